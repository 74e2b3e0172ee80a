"""`python -m torsh_tune.launch._agent ARGS`: torchrun's agent, `python -m torch.distributed.run ARGS`,
ended without finalizing the interpreter.

A process that imported torch spends 0.3-0.5 s finalizing it at exit (module teardown and the
collections it triggers), after its workers have ended and the run's result is known. The agent
is torsh-tune's process, not the user's: once torchrun returns, its logs are flushed and it
exits with torchrun's code through `os._exit`, as a forked warm agent (`_zygote`) does. The
ranks are untouched and finalize as they always do (the user's objects, files and threads
are theirs).
"""

from __future__ import annotations

import os
import sys


def run_torchrun(argv: list[str]) -> int:
    """Run `torch.distributed.run` as `python -m` would with `argv` (argv[0] its name); its exit code.

    The interpreter's own ending of a `-m` run: SystemExit's code (a message is printed and
    is 1), an uncaught exception's traceback and 1. Logs and the standard streams are
    flushed, so the caller may `os._exit` with the code.
    """
    import logging
    import runpy
    import traceback

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


if __name__ == "__main__":
    code = 1
    try:
        code = run_torchrun(["torch.distributed.run", *sys.argv[1:]])
    finally:
        os._exit(code)
