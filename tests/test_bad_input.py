"""Bad input across every command: one line on stderr (what, rule, value), exit status 2, nothing lost.

Each case runs the real command line (`torsh_tune.cli.main`, in this process: no case may get
as far as a launch, and one interpreter keeps the table cheap) beside an existing run
directory, which must come out byte for byte as it was, with no new run or study directory
beside it.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest

from torsh_tune.cli import main

from helpers import REPO, SCRIPTS

SCRIPT = str(SCRIPTS / "train_small.py")

# (command line with placeholders, fragments the one line must hold: what and value, rule where short)
CASES = [
    # config files: values, sections, keys, syntax, unreadable
    ("profile --config {T}/bad.toml {SCRIPT}", ["bad.toml must be valid TOML"]),
    ("profile --config {T}/badval.toml {SCRIPT}", ["budget.steps must be an integer >= 1, but got -1"]),
    ("profile --config {T}/badsec.toml {SCRIPT}", ["config key nonsense must be one of", "but got 'nonsense'"]),
    ("profile --config {T}/badkey.toml {SCRIPT}", ["strategy.ddp.bucket_cap_mbb must be one of"]),
    ("profile --config {EMPTY} {SCRIPT}", ["--config must be an existing TOML or JSON file", "empty'"]),
    ("profile --config {T}/missing.toml {SCRIPT}", ["--config must be an existing TOML or JSON file", "missing.toml'"]),
    ("run --config {EMPTY} {SCRIPT}", ["--config must be a study directory holding best.toml, or a config file"]),
    # launch
    ("profile --nnodes 2 {SCRIPT}", ["launch.rdzv_endpoint must be set", "but got None"]),
    ("profile --nnodes 2 --node-rank 3 --rdzv-endpoint h:29500 {SCRIPT}", ["launch.node_rank must be in [0, 1], but got 3"]),
    ("profile --launcher srun {SCRIPT}", ["launch.launcher must be a template containing {cmd}, but got 'srun'"]),
    ("profile --steps 0 {SCRIPT}", ["--steps: must be an integer >= 1, but got 0"]),
    ("profile --trace-window 5:0 {SCRIPT}", ["profiler.trace_window must be START:LEN", "but got '5:0'"]),
    ("profile --dashboard 70000 {SCRIPT}", ["--dashboard: must be a TCP port 1-65535, but got 70000"]),
    ("profile --dashboard {BUSY} {SCRIPT}", ["the dashboard port must be free to bind on 127.0.0.1"]),
    ("profile {T}/notes.txt", ["SCRIPT must be a Python file ending in .py", "notes.txt'"]),
    ("profile --run-name existing {SCRIPT}", ["--run-name must be the name of a run directory that does not exist yet",
                                              "but got 'existing'"]),
    ("profile --runs-dir {RUN}/config.json {SCRIPT}", ["--runs-dir: must be a directory", "config.json'"]),
    # emulated clusters
    ("profile --emulate nodes=1,procs_per_node=2,link=1gbit {SCRIPT}", ["--emulate nodes must be an integer >= 2, but got 1"]),
    ("tune --emulate nodes=2,procs_per_node=2,link=1gbit --nproc-per-node 2 {SCRIPT}",
     ["--emulate must be used without --nproc-per-node"]),
    ("bench --emulate nodes=2,procs_per_node=2,link=0gbit", ["--emulate link must be a rate > 0", "but got '0gbit'"]),
    # search spaces and study options
    ("tune --space {T}/space_low.toml {SCRIPT}", ["space.ddp.bucket_cap_mb.low must be > 0", "but got 0"]),
    ("tune --space {T}/space_dim.toml {SCRIPT}", ["space dimension must be one of", "but got 'nosuch.knob'"]),
    ("tune --space {T}/space_syntax.toml {SCRIPT}", ["space_syntax.toml must be valid TOML"]),
    ("tune --objectives speed {SCRIPT}", ["objectives must be", "but got ('speed',)"]),
    ("tune --pruner median --objectives throughput,loss {SCRIPT}", ["pruner must be 'none' with several objectives",
                                                                    "but got 'median'"]),
    ("tune --sampler annealing {SCRIPT}", ["--sampler: invalid choice: 'annealing'"]),
    # study storage
    ("tune --storage nosuchdb://x {SCRIPT}", ["--storage must be an Optuna storage URL", "but got 'nosuchdb://x'"]),
    ("tune --storage journal:{MISSING}/study.log {SCRIPT}", ["--storage must be journal:PATH in an existing directory"]),
    ("tune --storage journal:{EMPTY} {SCRIPT}", ["--storage must be journal:PATH naming a file, not a directory"]),
    ("tune --storage sqlite:///{MISSING}/study.db {SCRIPT}", ["--storage must be sqlite:///FILE in an existing directory"]),
    ("tune --storage postgresql://tuner:secret@127.0.0.1:1/studies {SCRIPT}",
     ["--storage must be a", "postgresql://tuner:***@127.0.0.1:1/studies"]),
    # missing, empty or wrong study and run directories
    ("tune --resume {EMPTY} {SCRIPT}", ["--resume must be a study directory holding study.db", "empty'"]),
    ("tune --resume {RUN} {SCRIPT}", ["--resume must be a study directory holding study.db", "existing'"]),
    ("tune --run-name existing {SCRIPT}", ["--run-name must be the name of a run directory that does not exist yet"]),
    ("tune --reference-bench {EMPTY} {SCRIPT}", ["--reference-bench must be a finished `torsh-tune bench` run directory"]),
    ("apply {EMPTY}", ["STUDY must be a study directory holding best.toml", "empty'"]),
    ("apply {RUN}", ["STUDY must be a study directory holding best.toml", "existing'"]),
    ("report {MISSING}", ["RUN must be a torsh-tune run directory", "missing'"]),
    ("report {RUN} --format pdf", ["--format: invalid choice: 'pdf'"]),
    ("compare {RUN} {EMPTY}", ["run B must be a run directory or a report.json file", "empty'"]),
    # traces
    ("analyze {EMPTY}", ["must be a directory holding *.json or *.json.gz Kineto traces", "but got 'none found'"]),
    ("analyze {T}/not_json", ["rank-0.json must be a Kineto/Chrome trace"]),
    ("analyze {T}/bad_gzip", ["rank-0.json.gz must be a valid gzip file"]),
    ("analyze {T}/gzip_of_text", ["rank-0.json.gz must be a Kineto/Chrome trace"]),
    ("analyze {RUN} --out {RUN}", ["--out must be a directory that does not exist yet", "existing'"]),
    # import files
    ("import-config {T}/ds_stage5.json", ["deepspeed zero_optimization.stage must be 0, 1, 2 or 3, but got 5"]),
    ("import-config {T}/broken.json", ["broken.json must be valid JSON"]),
    ("import-config {T}/odd.json", ["(or pass --from)"]),
    ("import-config {T}/ds_ok.json --out {RUN}/config.json", ["--out must be a file that does not exist yet",
                                                              "config.json'"]),
    # advise and bench arguments
    ("advise --params 1e9 --world-size 8 --nnodes 3", ["world_size must be a multiple of nnodes (3), but got 8"]),
    ("advise --params lots --world-size 8", ["--params: must be a number of parameters >= 1", "but got 'lots'"]),
    ("bench --min-bytes 1024 --max-bytes 16", ["--min-bytes must be <= --max-bytes (16), but got 1024"]),
    ("bench --collectives all_reduce,all_shuffle", ["--collectives must be a comma-separated subset of",
                                                   "'all_reduce,all_shuffle'"]),
    ("bench --run-name existing", ["--run-name must be the name of a run directory that does not exist yet"]),
    ("bench --backend nccl", ["--backend must be gloo or auto when CUDA is not available", "but got 'nccl'"]),
    # the main job (torsh-tune [OPTIONS] SCRIPT): refused before its baseline profile
    ("--storage nosuchdb://x {SCRIPT}", ["--storage must be an Optuna storage URL", "but got 'nosuchdb://x'"]),
    ("--trials 0 {SCRIPT}", ["--trials: must be an integer >= 1, but got 0"]),
    # the dashboard
    ("dashboard --port 99999", ["--port: must be a TCP port 1-65535, but got 99999"]),
    ("dashboard --port {BUSY}", ["the dashboard port must be free to bind on 127.0.0.1", "Address already in use"]),
    ("dashboard --host 0.0.0.0", ["--host must be a loopback address unless --token", "but got '0.0.0.0'"]),
    ("dashboard --token short", ["--token must be at least 8 characters without whitespace"]),
    ("dashboard --runs-dir {RUN}/run.json", ["--runs-dir: must be a directory", "run.json'"]),
]
#: Commands that make a run or study directory (and the main job) get the test's runs directory.
_MAKES_RUNS = ("profile", "run", "tune", "bench")


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The files of the table, an existing run directory and a busy port."""
    t = tmp_path_factory.mktemp("bad-input")
    runs = t / "runs"
    shutil.copytree(REPO / "tests" / "data" / "healthy", runs / "existing")
    (t / "empty").mkdir()
    files = {
        "bad.toml": "[budget\nsteps = 3\n",
        "badval.toml": "[budget]\nsteps = -1\n",
        "badsec.toml": "[nonsense]\nx = 1\n",
        "badkey.toml": "[ddp]\nbucket_cap_mbb = 3\n",
        "notes.txt": "print('not a .py file')\n",
        "space_low.toml": "[space.ddp.bucket_cap_mb]\nlow = 0\n",
        "space_dim.toml": "[space.nosuch.knob]\nvalue = 1\n",
        "space_syntax.toml": "[space\n",
        "ds_stage5.json": json.dumps({"zero_optimization": {"stage": 5}}),
        "ds_ok.json": json.dumps({"zero_optimization": {"stage": 0}}),
        "broken.json": "{not json",
        "odd.json": json.dumps({"colour": "blue"}),
    }
    for name, text in files.items():
        (t / name).write_text(text)
    for name, data in (("not_json/rank-0.json", b"not json"), ("bad_gzip/rank-0.json.gz", b"\x1f\x8b garbage"),
                       ("gzip_of_text/rank-0.json.gz", gzip.compress(b"plain text, no trace"))):
        (t / name).parent.mkdir()
        (t / name).write_bytes(data)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    yield {"T": str(t), "RUNS": runs, "RUN": str(runs / "existing"), "EMPTY": str(t / "empty"),
           "MISSING": str(t / "missing"), "SCRIPT": SCRIPT, "BUSY": str(busy.getsockname()[1])}
    busy.close()


@pytest.mark.parametrize(("line", "fragments"), CASES, ids=[c[0].split(" {")[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_is_touched(inputs, line, fragments, capfd, monkeypatch):
    if line == "bench --backend nccl":
        import torch

        if torch.cuda.is_available():
            pytest.skip("nccl is fine here: CUDA is available")
    monkeypatch.chdir(inputs["T"])  # a default ./torsh-runs would land here, and be seen below
    runs: Path = inputs["RUNS"]
    before = _snapshot(runs / "existing")
    argv = line.format(**inputs).split()
    if (argv[0] in _MAKES_RUNS or argv[0].startswith("-")) and "--runs-dir" not in argv:
        at = 0 if argv[0].startswith("-") else 1  # after the subcommand; the main job has none
        argv[at:at] = ["--runs-dir", str(runs)]
    capfd.readouterr()
    code = main(argv)
    err = capfd.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2, (code, err)
    assert len(lines) == 1 and lines[0].startswith("torsh-tune: error: "), err
    assert "Traceback" not in err
    assert " must " in lines[0] or "invalid choice" in lines[0], lines[0]  # the rule
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert _snapshot(runs / "existing") == before
    assert sorted(p.name for p in runs.iterdir()) == ["existing"]  # no half-made run or study directory
    assert not (Path(inputs["T"]) / "torsh-runs").exists()


def test_the_table_covers_every_command():
    from torsh_tune.cli import SUBCOMMANDS

    assert len(CASES) >= 30
    commands = {"main job" if c[0].startswith("-") else c[0].split()[0] for c in CASES}
    assert commands == {*SUBCOMMANDS, "main job"}
