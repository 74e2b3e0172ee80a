"""Entry point of every rank: `python -m torsh_tune.runtime.bootstrap SCRIPT ARGS...`.

torchrun starts this module in each worker. It reads the run's config (the only two
variables that carry it are TORSH_TUNE_RUN_DIR and TORSH_TUNE_CONFIG), installs the probes
and patches, runs the unmodified script with `runpy` as `__main__`, and ends the rank
cleanly: at the step budget every rank meets at a barrier and the process group is
destroyed; on an exception the rank's exit record says what happened. A rank dies with its
torchrun agent: no orphan keeps running after a killed launcher.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import RunConfig, dist_env
from ..errors import ConfigError
from ..rundir import ENV_CONFIG, ENV_RUN_DIR, STACKS_SIGNAL, RunDir

if TYPE_CHECKING:
    from .context import RankRuntime


def _load_config() -> RunConfig:
    raw = os.environ.get(ENV_CONFIG)
    if not raw:
        return RunConfig()
    text = raw if raw.lstrip().startswith("{") else Path(raw).read_text()
    return RunConfig.from_json(text)


def _teardown_process_group(*, barrier: bool) -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


def _config_error(rt: "RankRuntime", exc: ConfigError, *, launched: bool) -> int:
    """Record a config error; say it here only under a bare launcher (torsh-tune's CLI says it once, from the record)."""
    rt.finish("config_error", error=exc)
    if not launched:
        print(f"torsh-tune: error: {exc}", file=sys.stderr)
    return 2


def _die_with_the_agent() -> None:
    """Under torchrun, have the kernel SIGKILL this rank when its agent dies (Linux, PR_SET_PDEATHSIG).

    torchrun stops its workers itself on SIGTERM, but an agent killed before it has (SIGKILL, the
    OOM killer, a fan-out's grace period running out while it waits for a slow rank) leaves its
    ranks orphaned in their collectives: they ran on for minutes after a killed bench. SIGKILL, not
    SIGTERM: nobody is left to escalate, and a script's own SIGTERM handler (Lightning has one)
    must not keep it alive. torchrun starts its workers from its main thread, the thread the
    signal follows. (The launcher's children get theirs from `launch._procs.die_with_this_thread`,
    set before exec; the runtime does not import `launch`.)
    """
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the agent died before prctl took effect: this rank is already an orphan
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    _die_with_the_agent()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("torsh-tune bootstrap: usage: python -m torsh_tune.runtime.bootstrap SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = argv[0]
    try:
        config = _load_config()
    except ConfigError as exc:
        print(f"torsh-tune: error: {exc}", file=sys.stderr)
        return 2
    run_dir_env = os.environ.get(ENV_RUN_DIR)
    run_dir = RunDir(run_dir_env) if run_dir_env else None

    from . import patches
    from .budget import StepBudgetReached
    from .context import RankRuntime

    try:
        env = dist_env()  # the rank's place in the job, parsed here only: the runtime hands it on
    except ConfigError as exc:
        print(f"torsh-tune: error: {exc}", file=sys.stderr)
        return 2
    rt = RankRuntime(config, run_dir, env=env)
    try:
        if env is not None:  # the checks that need the launcher's world size (HSDP mesh, pipeline stages, ...)
            nodes = env.with_ranks_per_node(config.strategy.collectives.ranks_per_node)
            config.strategy.validate(world_size=env.world_size, nnodes=nodes.nnodes)
    except ConfigError as exc:
        return _config_error(rt, exc, launched=run_dir is not None)
    patches.install(rt)
    if run_dir is not None and _stacks_on_a_fatal_signal(run_dir.rank_file(rt.rank, "stacks")):
        rt.meta["stacks_signal"] = STACKS_SIGNAL.name  # the supervisor may ask for them (meta.json, `pid`)
    rt.start()

    sys.argv = argv
    script_dir = str(Path(script).resolve().parent)
    if sys.path and sys.path[0] != script_dir:
        sys.path.insert(0, script_dir)
    try:
        runpy.run_path(script, run_name="__main__")
    except StepBudgetReached:
        _teardown_process_group(barrier=True)
        rt.finish("budget")
        return 0
    except SystemExit as exc:
        code = exc.code
        if code in (None, 0):
            _teardown_process_group(barrier=False)
            rt.finish("ok")
            return 0
        rt.finish("error", error=exc, tb=f"SystemExit({code!r})")
        raise
    except ConfigError as exc:
        return _config_error(rt, exc, launched=run_dir is not None)
    except BaseException as exc:
        rt.finish("error", error=exc, tb=traceback.format_exc())
        raise
    # The script returned on its own (it may never have called destroy_process_group;
    # leaving the group alive makes about one exit in eight abort on gloo).
    _teardown_process_group(barrier=False)
    rt.finish("ok")
    return 0


#: The stacks file, open for the life of the process: faulthandler writes to its descriptor from a signal handler.
_STACKS: list[Any] = []


def _stacks_on_a_fatal_signal(path: Path) -> bool:
    """Have Python write every thread's stack to `path` if the rank dies of a fatal signal, or on `STACKS_SIGNAL`.

    SIGSEGV, SIGABRT (gloo's "terminate called without an active exception", NCCL's watchdog after a
    collective timed out, a C++ assertion), SIGBUS, SIGFPE, SIGILL: the rank writes no exit record and
    its log ends in C++'s last words, if any. With `faulthandler` the file says where the training
    thread was (which collective, which line of the script) and what every other Python thread did.
    The supervisor sends `STACKS_SIGNAL` before it stops a hung or timed-out run: the dump runs in the
    signal handler, so a thread blocked in C++ (a collective whose peer never came) is shown where it
    waits. Costs nothing until a signal. Left alone when the script's environment enabled faulthandler
    already (PYTHONFAULTHANDLER, -X faulthandler): the user's choice of file stands, as does a later
    `faulthandler.enable()` of the script's own. `STACKS_SIGNAL` is taken only while nothing handles it.
    The launcher removes the file when it stayed empty (`launch.outcome.drop_empty_stacks`).

    Returns:
        Whether the rank answers `STACKS_SIGNAL` (meta.json says so: no other process is sent it).
    """
    import faulthandler
    import signal

    if faulthandler.is_enabled():
        return False
    try:
        file = open(path, "w")  # noqa: SIM115 - open until the process ends
    except OSError:
        return False
    _STACKS.append(file)
    faulthandler.enable(file=file, all_threads=True)
    if signal.getsignal(STACKS_SIGNAL) is not signal.SIG_DFL:
        return False
    faulthandler.register(STACKS_SIGNAL, file=file, all_threads=True, chain=False)
    return True


def _skip_the_final_collection() -> None:
    """Leave the objects alive now out of the interpreter's collections at exit: 0.4-0.6 s less per rank.

    With torch (and the Dynamo modules DDP imports) loaded, the cyclic collections of the
    interpreter's shutdown walk about a million objects: 0.6-0.8 s per rank on this kind of host,
    after the rank's work is done, in every run. The script's namespace became cyclic garbage
    when it ended (its functions reference it), so it is collected here first, as it would have
    been: its objects' finalizers run (an open file is flushed and closed). Then everything still
    alive is frozen (`gc.freeze`): atexit handlers run and modules are cleared as always (objects
    freed by reference counting are finalized); only reference cycles still alive at exit are not
    collected, whose finalizers Python does not promise to run either (`object.__del__`).
    """
    import gc

    gc.collect()
    gc.freeze()


if __name__ == "__main__":
    code = main()
    if code == 0:
        _skip_the_final_collection()
    sys.exit(code)
