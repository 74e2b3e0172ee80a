"""Always-on profiler overhead on examples/ddp_mlp.py: interleaved, paired A/B runs.

A = bare torchrun, B = `torsh-tune profile` (every probe on). Both arms run the same
script under the same step timer (_steptimer.py), so the only difference is torsh-tune.
Each pair runs A and B back to back (order alternating) and yields the ratio of their
median step times; the overhead is the median of those ratios, with its spread.

    .venv/bin/python benchmarks/overhead.py --pairs 8 --steps 300
    .venv/bin/python benchmarks/overhead.py --pairs 4 --steps 200 --trace-window 100:5
    .venv/bin/python benchmarks/overhead.py --script tests/data/scripts/stack_fsdp2.py --script-args "--blocks 10"

`--script` measures another script the same way (it must take `--steps N`; `--hidden` is ddp_mlp.py's).

With `--trace-window START:LEN` arm B also opens one deep-trace window: its overhead is
then computed outside the window (window steps and the step after it, which pays the
export, are left out of B's median), and the window's own cost is reported from the
step timer (median step inside / median outside) and from RUN/traces/windows.jsonl.

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


def _step_times(out: Path, nproc: int) -> list[float]:
    """Per step (index = the step's number), the slowest rank's time; step 0 has none."""
    per_rank = [json.loads((out / f"steps.rank{r}.json").read_text()) for r in range(nproc)]
    # A step is as slow as its slowest rank; entry k of a timer file is step k + 1.
    return [float("nan")] + [max(ts) for ts in zip(*per_rank)]


def _window(spec: str | None) -> range:
    if not spec:
        return range(0)
    start, length = (int(x) for x in spec.split(":"))
    return range(start, start + length)


def _median_step_s(out: Path, nproc: int, skip: int, exclude: range = range(0)) -> float:
    times = _step_times(out, nproc)
    # The step after a window pays the trace's stop and export.
    left_out = set(exclude) | ({exclude.stop} if len(exclude) else set())
    return statistics.median(t for k, t in enumerate(times) if k > skip and k not in left_out)


def _window_cost(out: Path, nproc: int, window: range, work: Path, i: int) -> dict:
    times = _step_times(out, nproc)
    inside = statistics.median(times[k] for k in window if k < len(times))
    records = [json.loads(line) for p in (work / "runs").glob(f"t{i}/traces/windows.jsonl")
               for line in p.read_text().splitlines() if line.strip()]
    return {"inside_ms": inside * 1e3, "export_step_ms": times[window.stop] * 1e3 if window.stop < len(times) else None,
            "recorded_overhead_pct": statistics.median(r["overhead_pct"] for r in records if r.get("overhead_pct") is not None)
            if records else None,
            "stop_s": statistics.median(r["stop_s"] for r in records) if records else None,
            "export_s": statistics.median(r["export_s"] for r in records) if records else None}


def run_arm(arm: str, args: argparse.Namespace, work: Path, i: int) -> float:
    out = work / f"{arm}{i}"
    out.mkdir()
    own = ["--hidden", str(args.hidden), "--log-every", "100000"] if args.script.resolve() == SCRIPT else []
    script_args = [str(out), str(args.script), "--steps", str(args.steps), *own, *args.script_args.split()]
    if arm == "bare":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}", str(TIMER), *script_args]
    else:
        window = ["--trace-window", args.trace_window] if args.trace_window else []
        cmd = [sys.executable, "-m", "torsh_tune.cli", "profile", "--nproc-per-node", str(args.nproc), "--quiet",
               "--runs-dir", str(work / "runs"), "--run-name", f"t{i}", *window, str(TIMER), *script_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} run {i} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return _median_step_s(out, args.nproc, args.skip, _window(args.trace_window))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="warm-up steps excluded from each run's median")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--script", type=Path, default=SCRIPT,
                   help="the training script (default examples/ddp_mlp.py; --hidden applies to it alone). It must take "
                        "--steps N, e.g. tests/data/scripts/stack_fsdp2.py (FSDP2 applied by the script)")
    p.add_argument("--script-args", default="", help="extra flags for the script, e.g. '--layers 1 --batch-size 8'")
    p.add_argument("--trace-window", metavar="START:LEN", help="arm B also captures this deep-trace window")
    args = p.parse_args()
    windows = []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for i in range(args.pairs):
            order = ("bare", "torsh") if i % 2 == 0 else ("torsh", "bare")
            res = {arm: run_arm(arm, args, work, i) for arm in order}
            ratio = res["torsh"] / res["bare"]
            if args.trace_window:
                cost = _window_cost(work / f"torsh{i}", args.nproc, _window(args.trace_window), work, i)
                cost["outside_ms"] = res["torsh"] * 1e3
                windows.append(cost)
                print(f"pair {i}: window steps {cost['inside_ms']:.3f} ms vs {cost['outside_ms']:.3f} ms outside, "
                      f"export step {cost['export_step_ms']:.1f} ms, recorded overhead {cost['recorded_overhead_pct']}",
                      flush=True)
            rows.append({"pair": i, "order": "/".join(order), "bare_ms": res["bare"] * 1e3, "torsh_ms": res["torsh"] * 1e3,
                         "overhead_pct": (ratio - 1) * 100, "delta_us": (res["torsh"] - res["bare"]) * 1e6})
            print(f"pair {i}: {rows[-1]['order']:<11} bare {rows[-1]['bare_ms']:8.3f} ms   torsh-tune {rows[-1]['torsh_ms']:8.3f} ms   "
                  f"overhead {rows[-1]['overhead_pct']:+6.2f} %", flush=True)
    ov = sorted(r["overhead_pct"] for r in rows)
    script = args.script.resolve()
    q1, q3 = (statistics.quantiles(ov, n=4)[0], statistics.quantiles(ov, n=4)[2]) if len(ov) >= 2 else (ov[0], ov[0])
    summary = {
        "benchmark": "overhead",
        "script": str(script.relative_to(REPO)) if script.is_relative_to(REPO) else str(script),
        "hidden": args.hidden if script == SCRIPT else None,
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
        "trace_window": args.trace_window,
        "window_inside_over_outside_pct": [round(100 * (w["inside_ms"] / w["outside_ms"] - 1), 2) for w in windows],
        "window_recorded_overhead_pct": [w["recorded_overhead_pct"] for w in windows],
        "window_export_step_ms": [w["export_step_ms"] for w in windows],
        "window_stop_s": [w["stop_s"] for w in windows],
        "window_export_s": [w["export_s"] for w in windows],
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
