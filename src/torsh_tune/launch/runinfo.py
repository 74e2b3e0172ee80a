"""run.json: what was run, where, with which versions, and how it ended.

Written when the run starts (status "running") and rewritten when it ends, always
atomically (temporary file + os.replace) so readers never see half a document.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from ..config import RunConfig
from ..rundir import RunDir, write_json_atomic
from .outcome import RunOutcome

__all__ = ["RUN_INFO_SCHEMA_VERSION", "finish_run_info", "process_alive", "process_identity", "read_run_info",
           "record_reference", "start_run_info"]

RUN_INFO_SCHEMA_VERSION = 1


def process_identity(pid: int | None = None) -> dict[str, Any]:
    """host, pid and start time of a process (this one by default): names it even after pid reuse."""
    proc = psutil.Process(pid)
    return {"host": socket.gethostname(), "pid": proc.pid, "create_time": proc.create_time()}


def process_alive(identity: Any) -> bool | None:
    """Whether the process `process_identity` described still runs; None when it lives on another host."""
    if not isinstance(identity, dict) or "pid" not in identity:
        return False
    if identity.get("host") != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(int(identity["pid"])).create_time() - float(identity.get("create_time", 0))) < 1.0
    except (psutil.Error, ValueError, TypeError):
        return False


def read_run_info(run_dir: RunDir) -> dict[str, Any]:
    """The contents of run.json, or {} when it does not exist."""
    try:
        return json.loads(run_dir.run_json.read_text())
    except FileNotFoundError:
        return {}


def _version(dist: str) -> str | None:
    # importlib.metadata, not `import torch`: launch must not import torch (seconds, GBs).
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def start_run_info(
    run_dir: RunDir,
    *,
    config: RunConfig,
    script: Path,
    script_args: Sequence[str],
    command: Sequence[str],
    run_id: str,
    argv: Sequence[str] | None = None,
    started_at: float | None = None,
    emulated: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write run.json for a run that is starting and return its contents.

    Args:
        run_dir: The run directory.
        config: The run's configuration (stored whole under "config").
        script: The user's script (stored as an absolute path).
        script_args: The script's own arguments.
        command: The exact command the supervisor starts.
        run_id: The TORSH_TUNE_RUN_ID marker of this launch.
        argv: torsh-tune's own command line, when launched from the CLI.
        started_at: Unix time of the start (default: now).
        emulated: the emulated cluster's spec (`EmulateSpec.to_dict`) when every node is a
            network namespace of this host; stored under "emulated".
    """
    t = time.time() if started_at is None else started_at
    info: dict[str, Any] = {
        "schema_version": RUN_INFO_SCHEMA_VERSION,
        "name": run_dir.name,
        "run_id": run_id,
        "script": str(Path(script).resolve()),
        "script_args": list(script_args),
        "argv": None if argv is None else list(argv),
        "command": list(command),
        "versions": {
            "torsh_tune": _version("torsh-tune"),
            "torch": _version("torch"),
            "python": platform.python_version(),
        },
        "hostname": socket.gethostname(),
        # Who supervises the run (a tuner resuming a study leaves a live supervisor's runs alone).
        "supervisor": process_identity(),
        "platform": platform.platform(),
        "python_executable": sys.executable,
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": psutil.virtual_memory().total,
        "started_at": _iso(t),
        "started_at_unix": t,
        "finished_at": None,
        "finished_at_unix": None,
        "duration_s": None,
        "status": "running",
        "world_size": config.world_size,
        "nnodes": config.launch.nnodes,
        "nproc_per_node": config.launch.nproc_per_node,
        "config": config.to_dict(),
        "outcome": None,
    }
    if emulated is not None:
        info["emulated"] = emulated
    write_json_atomic(run_dir.run_json, info)
    return info


def finish_run_info(run_dir: RunDir, outcome: RunOutcome, *, finished_at: float | None = None,
                    agent_start: str | None = None, agent_fallback: str | None = None) -> dict[str, Any]:
    """Record how the run ended in run.json (keeping what the start wrote) and return it.

    `agent_start`: how torchrun's agent was started, "new_process" or "forked" (a study's warm
    agent server, `launch.warm`), stored as "agent_start" when given; `agent_fallback`: why a
    study's agent was started as a new process after all (its warm server failed).
    """
    t = time.time() if finished_at is None else finished_at
    info = read_run_info(run_dir)
    if agent_start is not None:
        info["agent_start"] = agent_start
    if agent_fallback is not None:
        info["agent_fallback"] = agent_fallback
    info.update(
        {
            "finished_at": _iso(t),
            "finished_at_unix": t,
            "duration_s": outcome.duration_s,
            "status": outcome.status,
            "outcome": outcome.to_dict(),
        }
    )
    write_json_atomic(run_dir.run_json, info)
    return info


def record_reference(run_dir: RunDir, busbw_gbps: float, *, bench_run: str | os.PathLike[str] | None) -> dict[str, Any]:
    """Record in run.json the bus bandwidth `network` findings compare against, and return run.json.

    Args:
        run_dir: The finished run.
        busbw_gbps: The reference bus bandwidth in GB/s.
        bench_run: The `torsh-tune bench` run that measured it; None when it is an emulated
            cluster's configured link rate (not a measurement).
    """
    info = read_run_info(run_dir)
    info["reference_busbw_gbps"] = busbw_gbps
    if bench_run is not None:
        info["reference_bench"] = str(Path(bench_run).resolve())
    else:
        info["reference_source"] = "emulated"  # the link's configured rate, not a measurement
    write_json_atomic(run_dir.run_json, info)
    return info
