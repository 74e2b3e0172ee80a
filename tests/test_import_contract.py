"""The import contract of the design (design.md, "Layout" and "Imports flow one way"), in two tables.

- `MAY_IMPORT`: the torsh_tune packages each package may import. Every import statement of
  the source counts (module level, inside functions, under TYPE_CHECKING): a lazy import
  still makes a cycle, it only hides it until run time.
- `LIGHT`: what a fresh interpreter must not have loaded after importing (or running) a
  part of torsh-tune: torch stays out of the layers that run on any machine, optuna, dash
  and plotly stay out of the ranks, pandas out of the trace parser. `sys.modules` shows
  what third-party libraries pull in themselves, which no source scan can.
  `TORCH_FREE_AT_LOAD` adds a source scan for module-level `import torch` in modules the
  package loads lazily, which importing the package alone would not reach.

A new package needs a row in `MAY_IMPORT`; a new rule is a new row, not a new test.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
DATA = REPO / "tests" / "data"

# -- the layer order ---------------------------------------------------------------------------

_BELOW_FABRIC = {"errors", "records", "rundir", "config"}
_BASE = _BELOW_FABRIC | {"importers", "fabric"}
#: package -> the torsh_tune packages (or single modules, dotted) it may import besides itself.
MAY_IMPORT: dict[str, set[str]] = {
    # errors -> {records, rundir} -> config (-> importers, which builds on config) -> fabric
    "errors": set(),
    "records": {"errors"},
    "rundir": {"errors", "records"},
    "config": {"errors", "records", "rundir"},
    "importers": _BELOW_FABRIC,
    "fabric": _BELOW_FABRIC,
    # fabric -> {launch, analysis} -> {autotune, reports, dashboard, bench} -> cli
    "launch": _BASE,
    "analysis": _BASE | {"strategies.advisor"},  # the advisor is pure Python (its own LIGHT row)
    "reports": _BASE | {"launch", "analysis"},
    "autotune": _BASE | {"launch", "analysis", "reports"},
    "dashboard": _BASE | {"launch", "analysis", "reports"},
    "bench": _BASE | {"launch", "analysis"},
    # fabric -> {strategies, profiler} -> runtime: the code inside the ranks
    "strategies": _BASE,
    "profiler": _BASE,
    "runtime": _BASE | {"strategies", "profiler"},
    # the entry points: nothing imports them
    "cli": {"errors", "records", "rundir", "config", "importers", "fabric", "launch", "analysis", "reports",
            "autotune", "dashboard", "bench", "strategies", "profiler", "runtime", "torsh_tune"},
    "torsh_tune": {"errors", "config", "runtime"},  # the package's own __init__: the public API
}

#: Packages whose modules never import torch at module level (design.md; fabric and importers
#: say so in their docstrings, bench's __init__ is read by the CLI before any rank starts).
TORCH_FREE_AT_LOAD = ("errors", "records", "rundir", "config", "importers", "fabric", "launch", "analysis",
                      "reports", "dashboard", "autotune")
#: Packages that never import these at all: they run inside the ranks, next to the user's training.
#: (Checked on the source only: a fresh interpreter would spend seconds importing torch first.)
RANK_SIDE, NOT_IN_RANKS = ("strategies", "profiler", "runtime"), {"optuna", "dash", "plotly"}


@dataclass(frozen=True)
class Import:
    file: str  # relative to src/torsh_tune
    line: int
    importer: str  # the importing package (a MAY_IMPORT key)
    module: str  # the imported module, absolute and dotted
    module_level: bool  # executed when the module is imported (not inside a function or TYPE_CHECKING)

    @property
    def ours(self) -> str | None:
        """The imported torsh_tune module below the package ("fabric._busbw"; "torsh_tune" for the
        package itself), None for other libraries."""
        if self.module == "torsh_tune":
            return "torsh_tune"
        return self.module.removeprefix("torsh_tune.") if self.module.startswith("torsh_tune.") else None


def _package_of(rel: Path) -> str:
    return "torsh_tune" if rel.parts == ("__init__.py",) else rel.parts[0].removesuffix(".py")


def _walk(body: list[ast.stmt], module_level: bool):
    """(import node, runs at module load) for every import in `body` and the statements under it."""
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt, module_level
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk(stmt.body, False)
        elif isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test):
            yield from _walk(stmt.body, False)
            yield from _walk(stmt.orelse, module_level)
        else:
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                for sub in getattr(stmt, field, ()):
                    yield from _walk(sub.body if isinstance(sub, (ast.ExceptHandler, ast.match_case)) else [sub],
                                     module_level)


@functools.cache
def scan_imports(src: Path) -> list[Import]:
    """Every import statement of the `torsh_tune` package under `src`, resolved to absolute names."""
    root = src / "torsh_tune"
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        package = ["torsh_tune", *rel.parent.parts]
        for node, module_level in _walk(ast.parse(path.read_text(), str(path)).body, True):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif node.level == 0:
                names = [node.module or ""]
            else:
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
                # `from . import x`: x may be a module of its own or a name defined in the package
                names = list(dict.fromkeys(f"{base}.{a.name}" if _is_module(src, f"{base}.{a.name}") else base
                                           for a in node.names))
            out += [Import(str(rel), node.lineno, _package_of(rel), name, module_level) for name in names]
    return out


def _is_module(src: Path, dotted: str) -> bool:
    path = src.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def layer_violations(src: Path) -> list[str]:
    """One line per import of a torsh_tune package that `MAY_IMPORT` does not allow."""
    bad = []
    for imp in scan_imports(src):
        target = imp.ours
        if target is None or target.split(".")[0] == imp.importer:
            continue
        if not any(target == a or target.startswith(a + ".") for a in MAY_IMPORT.get(imp.importer, ())):
            bad.append(f"{imp.file}:{imp.line}: {imp.importer} imports {target}")
    return bad


def heavy_import_violations(src: Path) -> list[str]:
    """Module-level torch in the torch-free packages; optuna, dash or plotly anywhere in the ranks."""
    bad = []
    for imp in scan_imports(src):
        lib = imp.module.split(".")[0]
        if imp.importer in TORCH_FREE_AT_LOAD and lib == "torch" and imp.module_level:
            bad.append(f"{imp.file}:{imp.line}: {imp.importer} imports torch at module load")
        if imp.importer in RANK_SIDE and lib in NOT_IN_RANKS:
            bad.append(f"{imp.file}:{imp.line}: {imp.importer} imports {lib}")
    return bad


def test_every_package_has_a_row_and_the_table_has_no_cycle():
    packages = {p.name for p in (SRC / "torsh_tune").iterdir()
                if (p / "__init__.py").is_file() or (p.suffix == ".py" and p.name != "__init__.py")}
    assert {p.removesuffix(".py") for p in packages} | {"torsh_tune"} == set(MAY_IMPORT)
    graph = {pkg: {a.split(".")[0] for a in allowed} for pkg, allowed in MAY_IMPORT.items()}
    try:
        list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        pytest.fail(f"MAY_IMPORT has a cycle: {exc.args[1]}")
    assert not any("cli" in allowed for allowed in MAY_IMPORT.values())  # nothing imports cli


def test_imports_follow_the_layer_order():
    assert layer_violations(SRC) == []


def test_heavy_libraries_stay_out_of_light_layers_in_the_source():
    assert heavy_import_violations(SRC) == []


# -- what a fresh interpreter loads ----------------------------------------------------------


def _every_module(package: str) -> str:
    return (f"import importlib, pkgutil, {package} as p\n"
            "for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.'):\n"
            "    importlib.import_module(m.name)\n")


#: (name, code run in a fresh interpreter, top-level modules it must not have loaded)
LIGHT = [
    ("core", "import torsh_tune, torsh_tune.importers, torsh_tune.records, torsh_tune.rundir", {"torch"}),
    ("fabric", "import torsh_tune.fabric", {"torch", "numpy", "pandas"}),  # imported in every rank
    ("launch", _every_module("torsh_tune.launch"), {"torch"}),
    ("bench", "import torsh_tune.bench", {"torch"}),
    ("analysis", _every_module("torsh_tune.analysis"), {"torch"}),
    ("trace parser", "import torsh_tune.analysis.traces._parser, torsh_tune.analysis.traces._symbols",
     {"pandas", "pyarrow"}),
    ("trace analysis", "from torsh_tune.analysis.traces import analyze_traces\n"
                       f"analyze_traces({str(DATA / 'traces' / 'hta-sampled-2rank')!r})",
     {"torch", "pandas", "pyarrow", "plotly"}),
    ("reports", "import io, tempfile\n"
                "from rich.console import Console\n"
                "import torsh_tune.reports.figures\n"
                "from torsh_tune.reports import build_report_info, get_tuning_info, render_summary\n"
                "from torsh_tune.reports import render_tuning_markdown, write_reports\n"
                "from reports.conftest import make_analysis\n"
                "with tempfile.TemporaryDirectory() as out:\n"
                "    analysis = make_analysis(run_dir=out)\n"
                "    write_reports(analysis, out)\n"
                "    render_summary(build_report_info(analysis), Console(file=io.StringIO()))\n"
                f"render_tuning_markdown(get_tuning_info({str(DATA / 'study_small')!r}))",
     {"torch", "optuna", "plotly", "dash"}),  # plotly only when a figure is drawn
    ("dashboard", _every_module("torsh_tune.dashboard"), {"torch"}),
    # What a CLI run loads before torchrun starts: its progress line, the launcher, torchrun's flags.
    ("cli before a launch", "import torsh_tune.cli, torsh_tune.launch, torsh_tune.reports._terminal\n"
                            "torsh_tune.launch.command.torchrun_accepts('--tee')",
     {"torch", "pandas", "plotly", "optuna"}),
    ("autotune", "import torsh_tune.autotune", {"torch", "optuna"}),
    ("autotune modules", _every_module("torsh_tune.autotune"), {"torch"}),
    ("advisor", "import torsh_tune.strategies.advisor", {"torch", "optuna", "dash", "plotly"}),
]


def loaded(code: str, forbidden: set[str], *, src: Path = SRC) -> list[str]:
    """The `forbidden` top-level modules in `sys.modules` after running `code` in a fresh interpreter."""
    probe = (code + "\nimport json, sys\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({sorted(forbidden)!r}))))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(src), str(REPO / "tests")])}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("code", "forbidden"), [row[1:] for row in LIGHT], ids=[row[0] for row in LIGHT])
def test_light_layers_load_no_heavy_library(code, forbidden):
    assert loaded(code, forbidden) == []


# -- the checks above can fail ---------------------------------------------------------------


def test_planted_violations_are_caught(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(SRC / "torsh_tune", src / "torsh_tune", ignore=shutil.ignore_patterns("__pycache__"))
    pkg = src / "torsh_tune"
    # the old analysis <-> bench cycle, hidden in a function; a module-level torch in fabric;
    # plotly in the ranks; a pandas import that only sys.modules can see through fabric.
    with (pkg / "analysis" / "_steps.py").open("a") as f:
        f.write("\n\ndef _planted():\n    from ..bench import load_model\n")
    with (pkg / "fabric" / "_busbw.py").open("a") as f:
        f.write("\nif False:\n    import torch\nimport pandas\n")
    with (pkg / "profiler" / "steps.py").open("a") as f:
        f.write("\n\ndef _planted():\n    import plotly\n")
    assert [v.split(": ", 1)[1] for v in layer_violations(src)] == ["analysis imports bench"]
    assert [v.split(": ", 1)[1] for v in heavy_import_violations(src)] == [
        "fabric imports torch at module load", "profiler imports plotly"]
    assert loaded("import torsh_tune.fabric", {"torch", "numpy", "pandas"}, src=src) == ["numpy", "pandas"]
