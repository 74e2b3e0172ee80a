"""Entry point of every rank: `python -m torsh_tune.runtime.bootstrap SCRIPT ARGS...`.

(Minimal placeholder while the instrumentation is written: runs the script with runpy.)
"""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    script = argv[0]
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
