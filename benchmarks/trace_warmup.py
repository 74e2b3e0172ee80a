"""The first recorded step of a fresh process's profiler, with and without a warm-up step.

Each sample is a fresh Python process (the profiler's one-time start-up happens once per process)
that trains a small MLP (8 x Linear(256), AdamW, batch 64) for 5 steps, then starts a
`torch.profiler.profile` in one of two ways and times 6 more steps:

- ``cold``: the schedule records from the first step (what trace windows did before);
- ``warm``: one warm-up step first (``ProfilerAction.WARMUP``: prepared, nothing recorded), then
  recording (what `profiler.traces` does for windows known ahead).

The number per sample is the first recorded step's time over the median of the other five. The
arms alternate, the order reversed every other pair.

    .venv/bin/python benchmarks/trace_warmup.py --pairs 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_CHILD = r"""
import statistics, sys, time
import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(64, 256)


def step():
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()


for _ in range(5):
    step()
warm = sys.argv[1] == "warm"
schedule = (lambda s: ProfilerAction.WARMUP if s == 0 else ProfilerAction.RECORD) if warm else \
    (lambda s: ProfilerAction.RECORD)
prof = profile(activities=[ProfilerActivity.CPU], schedule=schedule)
prof.start()
if warm:
    step()
    prof.step()
times = []
for _ in range(6):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
    prof.step()
prof.stop()
print(times[0] / statistics.median(times[1:]))
"""


def _sample(arm: str) -> float:
    out = subprocess.run([sys.executable, "-c", _CHILD, arm], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=8, help="fresh processes per arm")
    args = parser.parse_args()
    samples: dict[str, list[float]] = {"cold": [], "warm": []}
    for i in range(args.pairs):
        for arm in (("cold", "warm") if i % 2 == 0 else ("warm", "cold")):
            samples[arm].append(_sample(arm))
    print(f"{'arm':6s} {'first recorded / median of the rest: median':>44s} {'min':>6s} {'max':>6s}  n")
    summary = {}
    for arm, values in samples.items():
        summary[arm] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                        "n": len(values), "samples": [round(v, 3) for v in values]}
        print(f"{arm:6s} {summary[arm]['median']:44.3f} {min(values):6.2f} {max(values):6.2f}  {len(values)}")
    print(json.dumps({"benchmark": "trace_warmup", **summary}))


if __name__ == "__main__":
    main()
