"""Test helpers: real torchrun launches of small scripts on gloo, the CLI in a subprocess."""

from __future__ import annotations

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
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


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
