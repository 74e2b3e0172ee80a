"""Layout of a run directory. The launcher creates it; ranks write into it; analysis reads it.

    RUN/
      run.json                      RunInfo: command, config, versions, hardware, status
      config.json                   the RunConfig handed to the ranks (TORSH_TUNE_CONFIG)
      ranks/rank00000.steps.jsonl   StepRecord lines (append-only, flushed >= 1/s)
      ranks/rank00000.comm.jsonl    CommRecord lines
      ranks/rank00000.system.jsonl  SystemRecord lines
      ranks/rank00000.meta.json     facts a rank learned (DDP buckets, backend, devices)
      ranks/rank00000.exit.json     how the script ended on that rank (ok, budget, error)
      logs/rank00000.log            the rank's stdout+stderr
      logs/launcher.log             torchrun's own output
      steps.parquet comm.parquet system.parquet   compacted at the end of the run
      report/report.json report/report.md
      traces/<window>/rank-<r>.json.gz              deep-trace windows
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from .errors import invalid

__all__ = ["ENV_CONFIG", "ENV_RUN_DIR", "RunDir", "new_run_dir", "write_json_atomic", "write_text_atomic"]

ENV_RUN_DIR = "TORSH_TUNE_RUN_DIR"
ENV_CONFIG = "TORSH_TUNE_CONFIG"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunDir:
    """Paths inside one run directory (creating nothing but what is asked for)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def config_json(self) -> Path:
        return self.path / "config.json"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def traces(self) -> Path:
        return self.path / "traces"

    def rank_file(self, rank: int, kind: str) -> Path:
        """`kind` is steps, comm, system (jsonl) or meta, exit (json)."""
        ext = "json" if kind in ("meta", "exit") else "jsonl"
        return self.ranks / f"rank{rank:05d}.{kind}.{ext}"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank:05d}.log"

    def parquet(self, kind: str) -> Path:
        return self.path / f"{kind}.parquet"

    def rank_ids(self) -> list[int]:
        """Ranks that wrote anything, sorted."""
        found = set()
        if self.ranks.is_dir():
            for p in self.ranks.iterdir():
                m = re.match(r"rank(\d+)\.", p.name)
                if m:
                    found.add(int(m.group(1)))
        return sorted(found)


def new_run_dir(runs_dir: str | os.PathLike[str], script: str, *, name: str | None = None) -> RunDir:
    """Create a fresh run directory; an existing one is never reused or overwritten."""
    root = Path(runs_dir)
    if name is not None and not _NAME_RE.match(name):
        raise invalid("--run-name", "letters, digits, '.', '_' or '-' (max 128)", name)
    root.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(script).stem)[:40] or "run"
    for _ in range(100):
        candidate = name or f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-{secrets.token_hex(2)}"
        path = root / candidate
        try:
            path.mkdir()
        except FileExistsError:
            if name is not None:
                raise invalid("--run-name", "the name of a run directory that does not exist yet", name) from None
            continue
        for sub in ("ranks", "logs", "report"):
            (path / sub).mkdir()
        return RunDir(path)
    raise AssertionError("could not find a free run directory name")


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` through a temporary file in the same directory: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """`write_text_atomic` of `data` as indented JSON (unknown types as strings)."""
    return write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")
