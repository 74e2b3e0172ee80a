"""torchrun's agent with and without `launch._agent._lighter_rendezvous`, paired.

torchrun's c10d rendezvous names the method of each of its events with `inspect.stack()` (the
source of every frame is read; the event is then dropped) and, on its first join, sleeps a random
0-0.3 s to spread many nodes' calls to the store. The agent torsh-tune starts (`launch/_agent.py`)
takes both out on a one-node launch. This benchmark runs torchrun's module in a fresh process per
arm, as the agent does (`runpy`, torch imported before the clock starts), on a 1-process script
that does nothing, so what is timed is the agent's own work: parse, rendezvous, start and reap the
worker, shut down. Arms alternate, the order reversing every pair.

    .venv/bin/python benchmarks/agent_rendezvous.py --pairs 6

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_ARM = r'''
import sys, time, runpy
sys.path.insert(0, {src!r})
import torch.distributed.run  # imported before the clock, then run afresh as `python -m` would
del sys.modules["torch.distributed.run"]
args = ["--standalone", "--nproc-per-node", "1", {script!r}]
if sys.argv[1] == "agent":
    from torsh_tune.launch._agent import _lighter_rendezvous
    _lighter_rendezvous(args)
sys.argv = ["torch.distributed.run", *args]
t0 = time.perf_counter()
try:
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
except SystemExit:
    pass
print(time.perf_counter() - t0)
'''


def _stats(values: list[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "q1": q[0], "q3": q[2], "min": min(values), "max": max(values)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "empty.py"
        script.write_text("pass\n")
        code = _ARM.format(src=str(REPO / "src"), script=str(script))
        walls: dict[str, list[float]] = {"torchrun": [], "agent": []}
        for i in range(args.pairs):
            for arm in ("torchrun", "agent") if i % 2 == 0 else ("agent", "torchrun"):
                out = subprocess.run([sys.executable, "-c", code, arm], capture_output=True, text=True, check=True)
                walls[arm].append(float(out.stdout.split()[-1]))
    saved = [a - b for a, b in zip(walls["torchrun"], walls["agent"], strict=True)]
    result = {"benchmark": "agent_rendezvous", "pairs": args.pairs,
              "wall_s": {k: _stats(v) for k, v in walls.items()}, "saved_s": _stats(saved),
              "machine": f"{platform.machine()}, {platform.node()}, Python {platform.python_version()}"}
    print(f"{'arm':10s} {'median':>8s} {'min':>8s} {'max':>8s}")
    for arm, s in result["wall_s"].items():
        print(f"{arm:10s} {s['median']:8.3f} {s['min']:8.3f} {s['max']:8.3f}")
    s = result["saved_s"]
    print(f"{'saved':10s} {s['median']:8.3f} {s['min']:8.3f} {s['max']:8.3f}   (torchrun - agent, per pair, s)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
