"""Always-on profiler overhead on examples/ddp_mlp.py: interleaved, paired A/B runs.

A = bare torchrun, B = `torsh-tune profile` (every probe on). Both arms run the same
script under the same step timer (_steptimer.py), so the only difference is torsh-tune.
Each pair runs A and B back to back (order alternating) and yields the ratio of their
median step times; the overhead is the median of those ratios, with its spread.

    .venv/bin/python benchmarks/overhead.py --pairs 8 --steps 300

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMER = REPO / "benchmarks" / "_steptimer.py"
SCRIPT = REPO / "examples" / "ddp_mlp.py"


def _median_step_s(out: Path, nproc: int, skip: int) -> float:
    per_rank = [json.loads((out / f"steps.rank{r}.json").read_text())[skip:] for r in range(nproc)]
    # A step is as slow as its slowest rank.
    return statistics.median(max(ts) for ts in zip(*per_rank))


def run_arm(arm: str, args: argparse.Namespace, work: Path, i: int) -> float:
    out = work / f"{arm}{i}"
    out.mkdir()
    script_args = [str(out), str(SCRIPT), "--steps", str(args.steps), "--hidden", str(args.hidden), "--log-every", "100000",
                   *args.script_args.split()]
    if arm == "bare":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", str(TIMER), *script_args]
    else:
        cmd = [sys.executable, "-m", "torsh_tune.cli", "profile", "--nproc-per-node", str(args.nproc), "--quiet",
               "--runs-dir", str(work / "runs"), str(TIMER), *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} run {i} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return _median_step_s(out, args.nproc, args.skip)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="warm-up steps excluded from each run's median")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--script-args", default="", help="extra ddp_mlp.py flags, e.g. '--layers 1 --batch-size 8'")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.pairs):
            order = ("bare", "torsh") if i % 2 == 0 else ("torsh", "bare")
            res = {arm: run_arm(arm, args, work, i) for arm in order}
            ratio = res["torsh"] / res["bare"]
            rows.append({"pair": i, "order": "/".join(order), "bare_ms": res["bare"] * 1e3, "torsh_ms": res["torsh"] * 1e3,
                         "overhead_pct": (ratio - 1) * 100, "delta_us": (res["torsh"] - res["bare"]) * 1e6})
            print(f"pair {i}: {rows[-1]['order']:<11} bare {rows[-1]['bare_ms']:8.3f} ms   torsh-tune {rows[-1]['torsh_ms']:8.3f} ms   "
                  f"overhead {rows[-1]['overhead_pct']:+6.2f} %", flush=True)
    ov = sorted(r["overhead_pct"] for r in rows)
    q1, q3 = (statistics.quantiles(ov, n=4)[0], statistics.quantiles(ov, n=4)[2]) if len(ov) >= 2 else (ov[0], ov[0])
    summary = {
        "benchmark": "overhead",
        "script": "examples/ddp_mlp.py",
        "hidden": args.hidden,
        "nproc": args.nproc,
        "steps": args.steps,
        "pairs": args.pairs,
        "median_bare_ms": statistics.median(r["bare_ms"] for r in rows),
        "median_torsh_ms": statistics.median(r["torsh_ms"] for r in rows),
        "script_args": args.script_args,
        "delta_us_median": statistics.median(r["delta_us"] for r in rows),
        "overhead_pct_median": statistics.median(ov),
        "overhead_pct_q1": q1,
        "overhead_pct_q3": q3,
        "overhead_pct_min": ov[0],
        "overhead_pct_max": ov[-1],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print()
    print(f"{'median step (bare)':<28}{summary['median_bare_ms']:10.3f} ms")
    print(f"{'median step (torsh-tune)':<28}{summary['median_torsh_ms']:10.3f} ms")
    print(f"{'added per step, median':<28}{summary['delta_us_median']:10.1f} us")
    print(f"{'overhead, median of pairs':<28}{summary['overhead_pct_median']:+10.2f} %  (IQR {q1:+.2f} .. {q3:+.2f}, "
          f"range {ov[0]:+.2f} .. {ov[-1]:+.2f})")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
