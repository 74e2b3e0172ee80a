"""Launching runs under torchrun: command and environment, supervision, outcome, run.json.

    from torsh_tune.launch import launch_run
    outcome = launch_run(config, run_dir, "train.py", ["--epochs", "1"])
    print(outcome.status, outcome.message)
"""

from ._procs import find_run_processes, kill_run_processes
from .command import (
    BOOTSTRAP_MODULE,
    ENV_RUN_ID,
    apply_launcher_template,
    build_run_env,
    build_torchrun_command,
    new_run_id,
    write_config_json,
)
from .emulate import EmulatedCluster, EmulateSpec, EmulationError
from .outcome import RUN_STATUSES, RunOutcome, TorchrunFailure, classify_run, parse_torchrun_failures
from .progress import Progress, StepsWatcher
from .runinfo import (
    RUN_INFO_SCHEMA_VERSION,
    finish_run_info,
    process_alive,
    process_identity,
    read_run_info,
    start_run_info,
)
from .supervisor import launch_run

__all__ = [
    "BOOTSTRAP_MODULE",
    "ENV_RUN_ID",
    "EmulateSpec",
    "EmulatedCluster",
    "EmulationError",
    "Progress",
    "RUN_INFO_SCHEMA_VERSION",
    "RUN_STATUSES",
    "RunOutcome",
    "StepsWatcher",
    "TorchrunFailure",
    "apply_launcher_template",
    "build_run_env",
    "build_torchrun_command",
    "classify_run",
    "find_run_processes",
    "finish_run_info",
    "kill_run_processes",
    "launch_run",
    "new_run_id",
    "parse_torchrun_failures",
    "process_alive",
    "process_identity",
    "read_run_info",
    "start_run_info",
    "write_config_json",
]
