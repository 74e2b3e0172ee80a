"""Test helpers: real torchrun launches of small scripts on gloo, the CLI in a subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil

from torsh_tune.launch import ENV_RUN_ID

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "data" / "scripts"
EXAMPLES = REPO / "examples"


def torchrun_bootstrap(run_dir: Path, script: Path, *args: str, nproc: int = 2, config: dict | None = None,
                       timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `torchrun -m torsh_tune.runtime.bootstrap SCRIPT ARGS` directly (no supervisor)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = run_dir / "config.json"
    cfg.write_text(json.dumps(config or {}))
    full_env = dict(os.environ, TORSH_TUNE_RUN_DIR=str(run_dir), TORSH_TUNE_CONFIG=str(cfg), **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "torsh_tune.runtime.bootstrap", str(script), *args]
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:  # where a rank that died of a signal was: at the end, where assertions show stderr
        proc.stderr += rank_stacks(run_dir)
    return proc


# torch 2.13 on gloo now and then aborts a rank at interpreter exit, after its script called destroy_process_group
# (about 1 run in 8 without that call; seen with it too): SIGABRT and this line on stderr.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun_results(script: Path, out: str, nproc: int, *args: str, timeout: float) -> list[dict]:
    """Each rank's results of a bare `torchrun --standalone script ... --out OUT` (no torsh-tune), which every rank
    writes to OUT.rank<r>.json before its final barrier. A launch that failed only by gloo's abort at exit, every
    rank's results written, is the script's whole work; any other failure fails the test."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
           *args, "--out", out]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1"))  # an aborting rank says where
    files = [Path(f"{out}.rank{r}.json") for r in range(nproc)]
    aborted_at_exit = GLOO_EXIT_ABORT in proc.stderr and all(f.is_file() for f in files)
    assert proc.returncode == 0 or aborted_at_exit, proc.stderr[-3000:]
    return [json.loads(f.read_text()) for f in files]


def rank_stacks(run_dir: Path) -> str:
    """The Python stacks the ranks of a run left at a fatal signal or a stop (ranks/*.stacks.txt), or ""."""
    found = [p for p in sorted((Path(run_dir) / "ranks").glob("rank*.stacks.txt")) if p.stat().st_size]
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')}" for p in found)


def assert_record_schema(record: dict, kind: str) -> None:
    """The record has every required field of its type and no field the type does not know (optional
    fields such as clocks, issuers and values not known are left out: older records lack them too)."""
    from torsh_tune.records import RECORD_KINDS

    fields = dataclasses.fields(RECORD_KINDS[kind])
    required = {f.name for f in fields if f.default is dataclasses.MISSING}
    assert required <= set(record), required - set(record)
    assert set(record) <= {f.name for f in fields}, set(record) - {f.name for f in fields}


def sigint_as_ctrl_c() -> None:
    """`preexec_fn` for a child a test sends SIGINT to: the default disposition, as in a terminal.

    A suite started as a background job (`make test &`, `nohup`) inherits SIGINT ignored, and a
    Python child that starts with it ignored installs no KeyboardInterrupt handler: the Ctrl-C
    would never arrive and the test would time out instead of testing the tuner's handling.
    """
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real `torsh-tune` CLI in a subprocess."""
    cmd = [sys.executable, "-m", "torsh_tune.cli", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))


def run_survivors(run_id: str) -> list[int]:
    """Live processes carrying the run's marker (checked independently of the launcher)."""
    pids = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get(ENV_RUN_ID) == run_id:
                pids.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return pids


def host_call_record(call: tuple, call_sites: list) -> dict:
    """The CommRecord a synchronous host-clock call's tuple stands for (its line, as the writer writes it).

    `call_sites`: the tracker's table the tuple's first field indexes (`writer.host_call_values`).
    """
    from torsh_tune.profiler.writer import HOST_CALL_FIELDS, host_call_values

    return {"_s": call_sites[call[0]][0], **dict(zip(HOST_CALL_FIELDS, host_call_values(call)))}
