"""`python -m torsh_tune.launch._agent ARGS`: torchrun's agent, `python -m torch.distributed.run ARGS`,
ended without finalizing the interpreter.

A process that imported torch spends 0.3-0.5 s finalizing it at exit (module teardown and the
collections it triggers), after its workers have ended and the run's result is known. The agent
is torsh-tune's process, not the user's: once torchrun returns, its logs are flushed and it
exits with torchrun's code through `os._exit`, as a forked warm agent (`_zygote`) does. The
ranks are untouched and finalize as they always do (the user's objects, files and threads
are theirs).

`run_torchrun` (this module's and every forked agent's) also takes out what torchrun spends
waiting or reading source for nothing: its rendezvous' event names and a one-node launch's first
random sleep (`_lighter_rendezvous`), and its log tailers' one-after-the-other stop
(`_tails_stop_together`). About 0.35 s per run, all of it before the ranks start or after they end.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def run_torchrun(argv: list[str]) -> int:
    """Run `torch.distributed.run` as `python -m` would with `argv` (argv[0] its name); its exit code.

    The interpreter's own ending of a `-m` run: SystemExit's code (a message is printed and
    is 1), an uncaught exception's traceback and 1. Logs and the standard streams are
    flushed, so the caller may `os._exit` with the code.
    """
    import logging
    import runpy
    import traceback

    _lighter_rendezvous(argv[1:])
    _tails_stop_together()
    sys.argv = list(argv)  # argv[0] is replaced by the module's path, as with -m
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter would print and exit with
        traceback.print_exc()
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _lighter_rendezvous(args: list[str]) -> None:
    """Take two costs of torchrun's c10d rendezvous that buy nothing out of this process (0.2-0.3 s per run).

    - Each rendezvous event names its method with `inspect.stack()`, which reads the source of
      every frame: ~10-25 ms a call with torch imported, 9 calls a one-node run, for an event that
      is dropped (no handler is configured). The frame's own name is the same answer, read for free.
    - With one node, the first join's random 0-0.3 s sleep (it spreads many nodes' first calls to
      the store) spreads nothing.

    The agent is torsh-tune's process, not the user's: the rendezvous it reaches, its timeouts and
    every retry's delay are unchanged. A torch without these functions is left as it is, and nothing
    here fails the run: torchrun runs as it would have.
    """
    try:
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    except Exception:  # noqa: BLE001 - torchrun reports its own import errors
        return
    if callable(getattr(rdzv, "get_method_name", None)):
        rdzv.get_method_name = _method_name
    delay = getattr(rdzv, "_delay", None)
    if callable(delay) and _one_node(args):
        def first_join_undelayed(seconds: float | tuple[float, float]) -> None:
            if not isinstance(seconds, tuple):  # a range is only the first join's spread
                delay(seconds)

        rdzv._delay = first_join_undelayed


def _tails_stop_together() -> None:
    """Once torchrun's workers are gone, tell all its log tailers so at once (~0.1 s per run).

    torchrun tees the workers' stdout and stderr through two `TailLog`s, whose threads poll the
    log files every 0.1 s, and stops them one after the other: the second's threads only learn
    that the workers ended once the first's have finished their last sleep. Here every tailer is
    told when the workers are gone, before the first stop waits, so the sleeps end together. What
    is teed, and when, is unchanged: a tailer still reads its file to the end before it stops. A
    torch without these attributes is left as it is.
    """
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except Exception:  # noqa: BLE001 - torchrun reports its own import errors
        return
    close = getattr(PContext, "close", None)
    if not callable(close) or getattr(close, "_torsh_tune", False):
        return

    def close_with_tails_told(self: Any, *args: Any, **kwargs: Any) -> None:
        workers_closed = self._close

        def _close(*a: Any, **k: Any) -> None:
            workers_closed(*a, **k)
            for tail in getattr(self, "_tail_logs", ()):
                for finished in getattr(tail, "_finished_events", {}).values():
                    finished.set()

        self._close = _close  # this call's: the instance attribute shadows the method
        try:
            close(self, *args, **kwargs)
        finally:
            vars(self).pop("_close", None)  # a close inside this one (a signal's) may have taken it

    close_with_tails_told._torsh_tune = True  # type: ignore[attr-defined]
    PContext.close = close_with_tails_told


def _method_name(depth: int = 2) -> str:
    """`dynamic_rendezvous.get_method_name`: the name of the function `depth` frames up from here."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def _one_node(args: list[str]) -> bool:
    """Whether torchrun's arguments `args` are a one-node launch: `launch.command.build_torchrun_command` asks
    for those with `--standalone`, among torchrun's own options (before `-m` and the module it runs)."""
    own = args[: args.index("-m")] if "-m" in args else args
    return "--standalone" in own


if __name__ == "__main__":
    code = 1
    try:
        code = run_torchrun(["torch.distributed.run", *sys.argv[1:]])
    finally:
        os._exit(code)
