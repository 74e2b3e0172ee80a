"""The torchrun command line and the environment every rank starts with.

torsh-tune never re-implements process launching: each run is one
`python -m torch.distributed.run ... -m torsh_tune.runtime.bootstrap SCRIPT ARGS...`
(optionally wrapped by a cluster launcher template such as `srun -N2 {cmd}`).
"""

from __future__ import annotations

import functools
import math
import os
import secrets
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..config import RunConfig
from ..errors import LaunchError
from ..rundir import ENV_CONFIG, ENV_RUN_DIR, RunDir

__all__ = [
    "BOOTSTRAP_MODULE",
    "ENV_RUN_ID",
    "LOG_LINE_PREFIX_TEMPLATE",
    "apply_launcher_template",
    "build_run_env",
    "build_torchrun_command",
    "local_cuda_available",
    "new_run_id",
    "torchrun_log_dir",
    "write_config_json",
]

BOOTSTRAP_MODULE = "torsh_tune.runtime.bootstrap"

#: Environment variable carrying a per-run marker; every process of the run inherits it,
#: which is how leftovers (workers in their own sessions, DataLoader workers, daemons a
#: script spawned) are found and killed after the run.
ENV_RUN_ID = "TORSH_TUNE_RUN_ID"

#: torchrun's `--tee` prefixes every worker line with this header. `${rank}` is the
#: *global* rank (the default header uses the local rank), so the supervisor can file
#: lines from every node of a multi-node run under logs/rank{r:05d}.log.
LOG_LINE_PREFIX_TEMPLATE = "[rank${rank}]:"
_ENV_LOG_LINE_PREFIX = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"


def torchrun_log_dir(run_dir: RunDir) -> Path:
    """Where torchrun keeps its raw per-worker stdout/stderr files (`--log-dir`)."""
    return run_dir.logs / "torchrun"


def _torch_source(relpath: str) -> str | None:
    """The text of a file of the installed torch package, found without importing torch (None if unreadable)."""
    import importlib.util

    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.origin:
        return None
    try:
        return (Path(spec.origin).parent / relpath).read_text(encoding="utf-8")
    except OSError:
        return None


@functools.cache
def torchrun_accepts(flag: str) -> bool:
    """Whether this torch's torchrun parser knows `flag` (flags come and go between releases).

    Read off the source of `torch/distributed/run.py`, which declares every flag as a string
    literal: importing it would import torch into the launching process (~2 s per CLI run,
    before anything starts). Without the source (a frozen install), asks the parser itself.
    """
    text = _torch_source("distributed/run.py")
    if text is not None:
        return f'"{flag}"' in text or f"'{flag}'" in text
    from torch.distributed.run import get_args_parser

    return any(flag in action.option_strings for action in get_args_parser()._actions)


@functools.cache
def local_cuda_available() -> bool:
    """`torch.cuda.is_available()` on this host, without importing torch where the answer is plainly no.

    A torch built without CUDA or ROCm (`torch/version.py` says `cuda = None` and `hip = None`)
    cannot use a GPU: said from that file, where importing torch would cost the launching process
    ~1.5-2 s before its first launch. A GPU build asks torch (no guess from driver files: WSL2,
    containers and Jetson boards each show their GPUs differently).
    """
    import re

    version = _torch_source("version.py")
    if version is not None:
        builds = {m.group(1): m.group(2).strip() for m in re.finditer(r"^(cuda|hip)\b[^=\n]*=(.*)$", version, re.M)}
        if builds.get("cuda") == "None" and builds.get("hip") == "None":
            return False
    import torch

    return bool(torch.cuda.is_available())


def build_torchrun_command(
    config: RunConfig,
    script: Path,
    script_args: Sequence[str],
    *,
    run_dir: RunDir,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun command line of a run (without any launcher template).

    Single-node runs without a rendezvous endpoint use `--standalone`; otherwise the
    c10d (or configured) rendezvous flags are passed. Workers' output is tee'd: written
    to files under `logs/torchrun/` and echoed on torchrun's stdout/stderr with a
    `[rank<global rank>]:` header, which the supervisor demultiplexes.

    Args:
        config: The run's configuration (only `launch` and `budget.kill_grace_s` are read).
        script: The user's training script; made absolute.
        script_args: Arguments for the script, passed through untouched.
        run_dir: The run directory (torchrun's log directory lives under it).
        python: The interpreter that runs torchrun (and, through it, the workers).

    Returns:
        The argument vector, e.g.
        `[python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", ...,
        "-m", "torsh_tune.runtime.bootstrap", "/abs/train.py", "--lr", "0.1"]`.
    """
    la = config.launch
    cmd = [python, "-m", "torch.distributed.run"]
    if la.nnodes == 1 and la.rdzv_endpoint is None:
        cmd.append("--standalone")
    else:
        cmd += ["--nnodes", str(la.nnodes)]
        if la.node_rank is not None:
            cmd += ["--node-rank", str(la.node_rank)]
        cmd += ["--rdzv-backend", la.rdzv_backend]
        if la.rdzv_endpoint is not None:
            cmd += ["--rdzv-endpoint", la.rdzv_endpoint]
        cmd += ["--rdzv-id", la.rdzv_id or run_dir.name]
    cmd += ["--nproc-per-node", str(la.nproc_per_node), "--max-restarts", str(la.max_restarts)]
    # torchrun's own SIGTERM -> SIGKILL escalation of workers (after a worker failure or
    # our SIGTERM) uses the same grace as the supervisor; its default is 30 s. The flag is
    # new in torch 2.13: older torchruns refuse it and keep their 30 s.
    if torchrun_accepts("--shutdown-timeout"):
        cmd += ["--shutdown-timeout", str(math.ceil(config.budget.kill_grace_s))]
    cmd += ["--log-dir", str(torchrun_log_dir(run_dir)), "--tee", "3"]
    cmd += ["-m", BOOTSTRAP_MODULE, str(Path(script).resolve()), *script_args]
    return cmd


def apply_launcher_template(template: str, cmd: Sequence[str]) -> list[str]:
    """Wrap a command in a cluster launcher template such as `srun -N2 {cmd}`.

    `{cmd}` is replaced by the shell-quoted command and the result is split with
    `shlex` (no shell runs it, so `$VARS` in the template are not expanded).

    Example:
        >>> apply_launcher_template("srun -N2 {cmd}", ["python", "a b.py"])
        ['srun', '-N2', 'python', 'a b.py']
    """
    if "{cmd}" not in template:
        raise LaunchError(f"launch.launcher must be a template containing {{cmd}}, but got {template!r}")
    try:
        return shlex.split(template.replace("{cmd}", shlex.join(cmd)))
    except ValueError as exc:
        raise LaunchError(
            f"launch.launcher must be a valid shell-quoted template, but got {template!r}: {exc}"
        ) from None


def new_run_id(run_dir: RunDir) -> str:
    """A marker unique to one launch of one run directory."""
    return f"{run_dir.name}-{os.getpid()}-{secrets.token_hex(4)}"


def write_config_json(config: RunConfig, run_dir: RunDir) -> Path:
    """Write `config.json` (the document every rank parses once) and return its path."""
    path = run_dir.config_json
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(config.to_json())
    os.replace(tmp, path)
    return path


def build_run_env(
    config: RunConfig,
    run_dir: RunDir,
    *,
    run_id: str,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment torchrun (and so every rank) starts with.

    `base` (default `os.environ`) overlaid with `config.launch.env`, then the strategy's
    collective variables (NCCL_ALGO, NCCL_PROTO, NCCL_MIN/MAX_NCHANNELS, OMP_NUM_THREADS), then the variables
    torsh-tune owns: TORSH_TUNE_RUN_DIR, TORSH_TUNE_CONFIG (path of config.json, which
    must have been written with `write_config_json`), TORSH_TUNE_RUN_ID, PYTHONUNBUFFERED=1
    (live output through torchrun's tee) and torchrun's log-line prefix template.
    """
    env = dict(os.environ if base is None else base)
    env.update({str(k): str(v) for k, v in config.launch.env.items()})
    # [collectives] NCCL variables and [distributed] omp_num_threads: NCCL reads its variables
    # once per process, so they are set for the launch, never from inside a rank.
    env.update(config.strategy.collective_env())
    env[ENV_RUN_DIR] = str(run_dir.path.resolve())
    env[ENV_CONFIG] = str(run_dir.config_json.resolve())
    env[ENV_RUN_ID] = run_id
    env["PYTHONUNBUFFERED"] = "1"
    env[_ENV_LOG_LINE_PREFIX] = LOG_LINE_PREFIX_TEMPLATE
    return env
