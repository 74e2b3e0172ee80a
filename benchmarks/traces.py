"""Time and peak RSS of trace parsing + analysis, optionally side by side with HTA.

    .venv/bin/python benchmarks/traces.py [TRACE_DIR ...] [--repeat 3] [--hta /tmp/htavenv/bin/python]

Each measurement runs in a fresh subprocess (so peak RSS is that run's alone, interpreter
and imports included) and reports the best wall time of `--repeat` runs for
load + temporal breakdown + overlap (the work HTA's numbers in the fixtures' README
cover) and, for torsh-tune, the full `analyze_traces`. With `--hta PYTHON` (a venv with
``holistictraceanalysis==0.5.0``, never a dependency of torsh-tune) the same is timed
for HTA and the metric deltas are printed. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DIRS = [REPO / "tests" / "data" / "traces" / d
                for d in ("hta-sampled-2rank", "hta-16rank-rank0", "hta-nccl-2rank-rank0")]

_OURS = r"""
import json, resource, sys, time
from torsh_tune.analysis.traces import analyze_traces, load_traces
t0 = time.perf_counter()
ts = load_traces(sys.argv[1])
t1 = time.perf_counter()
a = analyze_traces(ts, hta_rounding=sys.argv[2] == "1")
t2 = time.perf_counter()
print(json.dumps({"parse_s": t1 - t0, "analysis_s": t2 - t1, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  "events": int(sum(len(r.events) for r in ts.ranks.values())),
  "metrics": {str(int(r["rank"])): [r["idle_pct"], r["compute_pct"], r["non_compute_pct"]] for _, r in a.breakdown.iterrows()},
  "overlap": {str(int(r["rank"])): r["overlap_pct"] for _, r in a.overlap.iterrows()}}))
"""

_HTA = r"""
import json, logging, resource, sys, time
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
t0 = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
tb = ta.get_temporal_breakdown(visualize=False)
ov = ta.get_comm_comp_overlap(visualize=False)
t2 = time.perf_counter()
print(json.dumps({"parse_s": t1 - t0, "analysis_s": t2 - t1, "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
  "metrics": {str(int(r["rank"])): [r["idle_time_pctg"], r["compute_time_pctg"], r["non_compute_time_pctg"]] for _, r in tb.iterrows()},
  "overlap": {str(int(r["rank"])): r["comp_comm_overlap_pctg"] for _, r in ov.iterrows()}}))
"""


def _run(python: str, code: str, *args: str) -> dict:
    out = subprocess.run([python, "-c", code, *args], capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(python: str, code: str, repeat: int, *args: str) -> dict:
    runs = [_run(python, code, *args) for _ in range(repeat)]
    best = min(runs, key=lambda r: r["parse_s"] + r["analysis_s"])
    best["total_s"] = best["parse_s"] + best["analysis_s"]
    best["rss_mb"] = max(r["rss_mb"] for r in runs)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*", type=Path, default=DEFAULT_DIRS)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--hta", help="python of a venv with holistictraceanalysis==0.5.0")
    args = p.parse_args(argv)
    rows = []
    for d in args.dirs:
        ours = _best(sys.executable, _OURS, args.repeat, str(d), "1")
        row = {"trace": d.name, "events": ours["events"], "ours_s": round(ours["total_s"], 3),
               "ours_parse_s": round(ours["parse_s"], 3), "ours_rss_mb": round(ours["rss_mb"], 1)}
        if args.hta:
            hta = _best(args.hta, _HTA, args.repeat, str(d))
            deltas = [abs(a - b) for r in hta["metrics"] for a, b in zip(ours["metrics"][r], hta["metrics"][r])]
            deltas += [abs(ours["overlap"][r] - hta["overlap"][r]) for r in hta["overlap"]]
            row.update({"hta_s": round(hta["total_s"], 3), "hta_rss_mb": round(hta["rss_mb"], 1),
                        "speedup": round(hta["total_s"] / ours["total_s"], 2),
                        "rss_ratio": round(ours["rss_mb"] / hta["rss_mb"], 2),
                        "max_metric_delta_pp": round(max(deltas), 3)})
        rows.append(row)
    cols = list(rows[0])
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
    print(json.dumps({"benchmark": "traces", "repeat": args.repeat, "rows": rows}))


if __name__ == "__main__":
    main()
