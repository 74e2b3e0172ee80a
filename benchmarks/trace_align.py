"""The step after a deep-trace window: does the profiler's own stop and export show up in it?

Each run is a real `torsh-tune profile` (2 ranks, gloo) of `tests/data/scripts/stack_zero.py`
(DDP + ZeroRedundancyOptimizer, 24 measured steps) with one trace window (`--trace-window 10:5`).
Each rank stops and exports its trace at the boundary after the window, in its own time; a rank
that finishes first then waits for the others in the next step's first collective unless the
ranks leave the boundary together (`profiler/traces.py` aligns them on its side group).

The number per run is the step after the window over the median step outside the window (its
warm-up step, the run's warm-up and the step after excluded), the larger of the two ranks'. With
``--arm NAME=SRC`` twice, two code versions (their ``src`` directories, e.g. a `git worktree` of an
older commit) run alternately, the order reversed every other pair.

    .venv/bin/python benchmarks/trace_align.py --runs 6
    .venv/bin/python benchmarks/trace_align.py --runs 6 --arm before=/tmp/old/src --arm after=src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "data" / "scripts" / "stack_zero.py"
WARMUP, STEPS, WINDOW = 3, 24, (10, 5)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(src: Path, runs_dir: Path, name: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src.resolve())}
    cmd = [sys.executable, "-m", "torsh_tune.cli", "profile", "--nproc-per-node", "2", "--steps", str(STEPS),
           "--warmup-steps", str(WARMUP), "--trace-window", f"{WINDOW[0]}:{WINDOW[1]}", "--quiet",
           "--runs-dir", str(runs_dir), "--run-name", name, str(SCRIPT)]
    subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=300)
    run = runs_dir / name
    windows = _read_jsonl(run / "traces" / "windows.jsonl")
    start, end = WINDOW[0], WINDOW[0] + WINDOW[1] - 1
    after = end + 1
    ratios, waits = {}, {}
    for rank in (0, 1):
        steps = {s["step"]: s["step_s"] for s in _read_jsonl(run / "ranks" / f"rank{rank:05d}.steps.jsonl")}
        outside = [t for s, t in steps.items() if s >= WARMUP and not start - 1 <= s <= after]
        ratios[rank] = steps[after] / statistics.median(outside)
        w = next(w for w in windows if w["rank"] == rank)
        waits[rank] = w.get("end_align_s")
    return {"ratio": max(ratios.values()), "ratios": ratios, "end_align_s": waits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=6, help="runs per arm")
    parser.add_argument("--arm", action="append", default=[], metavar="NAME=SRC",
                        help="a code version: its src directory (default: this checkout's, as 'current')")
    args = parser.parse_args()
    arms = dict(a.split("=", 1) for a in args.arm) or {"current": str(ROOT / "src")}
    samples: dict[str, list[dict]] = {name: [] for name in arms}
    names = list(arms)
    with tempfile.TemporaryDirectory(prefix="trace-align-") as tmp:
        for i in range(args.runs):
            for name in (names if i % 2 == 0 else names[::-1]):
                samples[name].append(_run(Path(arms[name]), Path(tmp), f"{name}-{i}"))
    print(f"{'arm':10s} {'step after the window / median step: median':>44s} {'min':>6s} {'max':>6s}  n")
    summary = {}
    for name, got in samples.items():
        values = [g["ratio"] for g in got]
        summary[name] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                         "n": len(values), "samples": [round(v, 3) for v in values],
                         "end_align_s": [g["end_align_s"] for g in got]}
        print(f"{name:10s} {summary[name]['median']:44.3f} {min(values):6.3f} {max(values):6.3f}  {len(values)}")
    print(json.dumps({"benchmark": "trace_align", **summary}))


if __name__ == "__main__":
    main()
