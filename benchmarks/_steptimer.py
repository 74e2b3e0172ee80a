"""Run a training script unchanged and record when each optimizer step returns.

Used by overhead.py in BOTH arms (bare torchrun and torsh-tune), so the step times of the
two arms come from the same timer: `python _steptimer.py OUT_DIR SCRIPT ARGS...`.
"""

import atexit
import json
import os
import runpy
import sys
import time

from torch.optim.optimizer import register_optimizer_step_post_hook

out_dir, script, *script_args = sys.argv[1:]
stamps: list[float] = []
register_optimizer_step_post_hook(lambda *a: stamps.append(time.perf_counter()))


@atexit.register
def _dump() -> None:
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out_dir, f"steps.rank{rank}.json"), "w") as f:
        json.dump([b - a for a, b in zip(stamps, stamps[1:])], f)


sys.argv = [script, *script_args]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python SCRIPT` would: its own modules import
runpy.run_path(script, run_name="__main__")
