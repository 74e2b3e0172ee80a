"""Time and peak RSS of trace parsing + analysis, side by side with HTA.

    .venv/bin/python benchmarks/traces.py [TRACE_DIR ...] [--repeat 5] [--scale 6]
        [--hta ~/.cache/torsh-tune-bench/hta-venv/bin/python]

Each measurement runs in a fresh subprocess, so its peak RSS is that run's alone
(interpreter and imports included; the RSS right after the imports is reported too).
HTA parses in a forked process pool, so its own VmHWM misses the workers' memory: HTA's
peak is the larger of its VmHWM and the summed PSS of its process tree, sampled every
2 ms in `--memory-rounds` extra, untimed runs (PSS splits the pages that forked workers
share with the parent, so nothing is counted twice; sampling misses short peaks, so this
errs in HTA's favour). Ours is one process: its VmHWM, which is >= its PSS.
Rounds are interleaved (ours, HTA, next trace ..., the order flipped every round) and each
figure is the median over rounds with its min-max; the speedup is HTA's median / ours.
Timed work: for torsh-tune, `load_traces` + the full `analyze_traces`; for HTA,
`TraceAnalysis(trace_dir)` + temporal breakdown + comm/comp overlap + idle-time
breakdown (HTA computes less than we do). `--scale K` adds a trace built at run time from
hta-16rank-rank0 repeated K times with shifted timestamps, step numbers and ids (written
to a temporary directory, deleted afterwards), where the import floor no longer dominates.
Parity: ``max_metric_delta_pp`` is the largest gap (percentage points) between our and HTA's
temporal-breakdown and overlap figures; ``max_idle_stream_delta_pp`` the largest between
the per-CUDA-stream idle shares (host wait / kernel wait / other; ours: `idle_by_stream`,
HTA's from ``get_idle_time_breakdown``'s µs, not its 2-decimal ratios) over the streams both
report, which are also printed per stream.

HolisticTraceAnalysis is never a dependency of torsh-tune; for `--hta` make a separate venv:
``python3 -m venv ~/.cache/torsh-tune-bench/hta-venv &&
~/.cache/torsh-tune-bench/hta-venv/bin/pip install holistictraceanalysis==0.5.0``.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO / "tests" / "data" / "traces"
DEFAULT_DIRS = [TRACES / d for d in ("hta-sampled-2rank", "hta-16rank-rank0", "hta-nccl-2rank-rank0")]

_PRELUDE = r"""
import json, resource, sys, time
def rss_mb():  # VmHWM: unlike ru_maxrss, not inherited from the parent across exec
    with open("/proc/self/status") as fh:
        return next(int(l.split()[1]) for l in fh if l.startswith("VmHWM")) / 1024
def child_rss_mb(): return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
def cpu_s():  # this process and its finished children (HTA parses in a process pool)
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
"""

_OURS = _PRELUDE + r"""
from torsh_tune.analysis.traces import analyze_traces, load_traces
import_rss, c0 = rss_mb(), cpu_s()
t0 = time.perf_counter()
ts = load_traces(sys.argv[1])
t1 = time.perf_counter()
a = analyze_traces(ts, hta_rounding=sys.argv[2] == "1")
t2 = time.perf_counter()
peak, cpu = rss_mb(), cpu_s() - c0  # before anything below could allocate
print(json.dumps({"parse_s": t1 - t0, "analysis_s": t2 - t1, "cpu_s": cpu, "rss_mb": peak,
  "child_rss_mb": child_rss_mb(), "import_rss_mb": import_rss, "events": int(sum(len(r.table) for r in ts.ranks.values())),
  "scanner": __import__("torsh_tune.analysis.traces._parser", fromlist=["SCANNER"]).SCANNER,
  "metrics": {str(r["rank"]): [r["idle_pct"], r["compute_pct"], r["non_compute_pct"]] for r in a.tables["breakdown"].rows()},
  "overlap": {str(r["rank"]): r["overlap_pct"] for r in a.tables["overlap"].rows()},
  "idle_streams": {f"{r['rank']}:{r['stream']}": [r[c] * 1e6 for c in ("host_wait_s", "kernel_wait_s", "other_s")]
                   for r in a.tables["idle_streams"].rows()}}))
"""

_HTA = _PRELUDE + r"""
import logging
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
import_rss, c0 = rss_mb(), cpu_s()
t0 = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
t1 = time.perf_counter()
tb = ta.get_temporal_breakdown(visualize=False)
ov = ta.get_comm_comp_overlap(visualize=False)
ranks = sorted(ta.t.get_all_traces())
ib = ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
t2 = time.perf_counter()
print(json.dumps({"parse_s": t1 - t0, "analysis_s": t2 - t1, "cpu_s": cpu_s() - c0, "rss_mb": rss_mb(),
  "child_rss_mb": child_rss_mb(), "import_rss_mb": import_rss,
  "metrics": {str(int(r["rank"])): [r["idle_time_pctg"], r["compute_time_pctg"], r["non_compute_time_pctg"]] for _, r in tb.iterrows()},
  "overlap": {str(int(r["rank"])): r["comp_comm_overlap_pctg"] for _, r in ov.iterrows()},
  "idle_streams": {k: [float(g.loc[g.idle_category == c, "idle_time"].sum()) for c in ("host_wait", "kernel_wait", "other")]
                   for k, g in ib[0].groupby(ib[0]["rank"].astype(int).astype(str) + ":" + ib[0]["stream"].astype(int).astype(str))}}))
"""


def scaled_trace(src_dir: Path, copies: int, out_dir: Path) -> Path:
    """`src_dir`'s single rank trace repeated `copies` times back to back, as one gzip file.

    Copy k shifts ts by k x the trace's span, ProfilerStep numbers by k x (last step + 1),
    and correlation / External id by k x (largest id + 1), so launches still pair with
    their kernels and steps stay distinct. Events with a string pid (Kineto's "Spans" /
    "Traces" rows) are written once, last, as Kineto does.
    """
    (src,) = sorted(src_dir.glob("*.json.gz"))
    doc = json.loads(gzip.open(src).read())
    events = doc.pop("traceEvents")
    trailer = [e for e in events if not isinstance(e.get("pid", 0), int)]
    events = [e for e in events if isinstance(e.get("pid", 0), int)]
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    t_lo = min(e["ts"] for e in timed)
    span = max(e["ts"] + float(e.get("dur", 0) or 0) for e in timed) - t_lo + 1000
    ids = [int(v) for e in events for k, v in (e.get("args") or {}).items()
           if k in ("correlation", "External id") and isinstance(v, int)]
    id_step = max(ids, default=0) + 1
    steps = [int(e["name"].split("#")[1]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    step_step = max(steps, default=0) + 1
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "rank-0.json.gz"
    with gzip.open(out, "wt", compresslevel=1) as fh:
        head = json.dumps(doc)[:-1]
        fh.write(head + (', ' if doc else '') + '"traceEvents": [\n')
        first = True
        for k in range(copies):
            for e in events:
                if k:
                    e = dict(e)
                    if isinstance(e.get("ts"), (int, float)):
                        e["ts"] = e["ts"] + k * span
                    if str(e.get("name", "")).startswith("ProfilerStep#"):
                        e["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + k * step_step}"
                    if isinstance(e.get("args"), dict):
                        e["args"] = {a: (v + k * id_step if a in ("correlation", "External id") and isinstance(v, int)
                                         else v) for a, v in e["args"].items()}
                fh.write(("" if first else ",\n") + json.dumps(e))
                first = False
        for e in trailer:
            fh.write(",\n" + json.dumps(e))
        fh.write("\n]}\n")
    return out_dir


def _json_bytes(path: Path) -> int:
    if not path.name.endswith(".gz"):
        return path.stat().st_size
    with gzip.open(path) as fh:
        return sum(len(b) for b in iter(lambda: fh.read(1 << 22), b""))


def _tree_pss_mb(root: int) -> float:
    """Summed PSS of process `root` and its descendants (MB; 0 for those already gone)."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    kb = 0
    for proc in procs:
        try:
            with open(f"/proc/{proc.pid}/smaps_rollup") as fh:
                kb += next(int(line.split()[1]) for line in fh if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return kb / 1024


def _run(python: str, code: str, *args: str, sample_tree: bool = False) -> dict:
    """One fresh process; with `sample_tree`, also the peak summed PSS of it and its children."""
    proc = subprocess.Popen([python, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=REPO)
    peak = 0.0
    if sample_tree:
        while proc.poll() is None:
            peak = max(peak, _tree_pss_mb(proc.pid))
            time.sleep(0.002)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed on {args}:\n{err[-3000:]}")
    r = json.loads(out.strip().splitlines()[-1])
    r["total_s"] = r["parse_s"] + r["analysis_s"]
    r["tree_pss_mb"] = peak
    return r


def _spread(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def _fmt(s: dict) -> str:
    return f"{s['median']} ({s['min']}-{s['max']})"


def _shares(us: list[float]) -> list[float] | None:
    """host_wait / kernel_wait / other µs -> % of their sum (None for a stream that never idled)."""
    total = sum(us)
    return [round(100 * u / total, 3) for u in us] if total > 0 else None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="*", type=Path, default=DEFAULT_DIRS)
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds (fresh processes each)")
    p.add_argument("--scale", type=int, default=0,
                   help="also time hta-16rank-rank0 repeated K times (~26 MB of JSON per copy); 0: off")
    p.add_argument("--hta", help="python of a venv with holistictraceanalysis==0.5.0")
    p.add_argument("--memory-rounds", type=int, default=3,
                   help="extra HTA runs per trace sampling its process tree's PSS (HTA parses in a process "
                        "pool; not timed: sampling slows the sampled processes)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="torsh-bench-traces-") as tmp:
        dirs = list(args.dirs)
        if args.scale:
            dirs.append(scaled_trace(TRACES / "hta-16rank-rank0", args.scale, Path(tmp) / f"hta-16rank-x{args.scale}"))
        runs: dict[str, dict[str, list[dict]]] = {d.name: {"ours": [], "hta": []} for d in dirs}
        for i in range(args.repeat):
            for d in dirs:
                arms = [("ours", sys.executable, _OURS, (str(d), "1"))]
                if args.hta:
                    arms.append(("hta", args.hta, _HTA, (str(d),)))
                for name, python, code, a in (arms if i % 2 == 0 else arms[::-1]):
                    runs[d.name][name].append(_run(python, code, *a))
        tree: dict[str, list[float]] = {d.name: [] for d in dirs}
        for _ in range(args.memory_rounds if args.hta else 0):
            for d in dirs:
                tree[d.name].append(_run(args.hta, _HTA, str(d), sample_tree=True)["tree_pss_mb"])
        json_mb = {d.name: sum(_json_bytes(f) for f in sorted(d.glob("*.json*"))) / 1e6 for d in dirs}
    rows = []
    idle_streams: dict[str, dict[str, dict]] = {}
    for d in dirs:
        ours = runs[d.name]["ours"]
        # Per-stream idle split (% host_wait / kernel_wait / other), HTA's get_idle_time_breakdown.
        idle_streams[d.name] = {k: {"ours": _shares(v)} for k, v in ours[0]["idle_streams"].items()}
        row = {"trace": d.name, "events": ours[0]["events"], "json_mb": round(json_mb[d.name], 1),
               "ours_s": _spread([r["total_s"] for r in ours]), "ours_parse_s": _spread([r["parse_s"] for r in ours]),
               "ours_cpu_s": _spread([r["cpu_s"] for r in ours]),
               "ours_rss_mb": _spread([r["rss_mb"] for r in ours], 1),
               "ours_import_rss_mb": _spread([r["import_rss_mb"] for r in ours], 1)}
        hta = runs[d.name]["hta"]
        if hta:
            # HTA's peak: its own VmHWM, or its process tree's sampled PSS when larger (pool workers).
            tree_mb = statistics.median(tree[d.name]) if tree[d.name] else 0.0
            hta_peak = [max(h["rss_mb"], tree_mb) for h in hta]
            deltas = [abs(a - b) for r in hta[0]["metrics"] for a, b in zip(ours[0]["metrics"][r], hta[0]["metrics"][r])]
            deltas += [abs(ours[0]["overlap"][r] - hta[0]["overlap"][r]) for r in hta[0]["overlap"]]
            for k, v in hta[0]["idle_streams"].items():
                idle_streams[d.name].setdefault(k, {"ours": None})["hta"] = _shares(v)
            stream_deltas = [abs(a - b) for v in idle_streams[d.name].values() if v["ours"] and v.get("hta")
                             for a, b in zip(v["ours"], v["hta"])]
            row.update({
                "hta_s": _spread([r["total_s"] for r in hta]), "hta_cpu_s": _spread([r["cpu_s"] for r in hta]),
                "hta_rss_mb": _spread([r["rss_mb"] for r in hta], 1),
                "hta_import_rss_mb": _spread([r["import_rss_mb"] for r in hta], 1),
                "hta_child_rss_mb": _spread([r["child_rss_mb"] for r in hta], 1),
                "hta_tree_pss_mb": _spread(tree[d.name] or [0.0], 1),
                "hta_peak_mb": _spread(hta_peak, 1),
                "speedup": _spread([h["total_s"] / o["total_s"] for h, o in zip(hta, ours)], 2),
                "cpu_speedup": _spread([h["cpu_s"] / o["cpu_s"] for h, o in zip(hta, ours)], 2),
                "rss_ratio": _spread([o["rss_mb"] / h for h, o in zip(hta_peak, ours)], 2),
                "rss_above_import_ratio": _spread([(o["rss_mb"] - o["import_rss_mb"]) / (h["rss_mb"] - h["import_rss_mb"])
                                                   for h, o in zip(hta, ours)], 2),
                "max_metric_delta_pp": round(max(deltas), 3),
                "max_idle_stream_delta_pp": round(max(stream_deltas), 3) if stream_deltas else None,
            })
        rows.append(row)
    cols = list(rows[0]) if not args.hta else list(max(rows, key=len))
    table = [[str(_fmt(r[c]) if isinstance(r.get(c), dict) else r.get(c, "")) for c in cols] for r in rows]
    for c, *vals in zip(cols, *table):
        print(f"{c:24} " + "  ".join(f"{v:28}" for v in vals))
    print("\nidle by CUDA stream, % host_wait / kernel_wait / other (ours | HTA's get_idle_time_breakdown):")
    for trace, streams in idle_streams.items():
        for k, v in sorted(streams.items(), key=lambda kv: tuple(map(int, kv[0].split(":")))):
            cells = ["-" if v.get(arm) is None else " / ".join(f"{x:6.2f}" for x in v[arm])
                     for arm in ("ours", "hta") if arm == "ours" or args.hta]
            print(f"  {trace:24} rank:stream {k:8} " + "  |  ".join(cells))
    print(json.dumps({"benchmark": "traces", "repeat": args.repeat, "scale": args.scale, "rows": rows,
                      "idle_streams": idle_streams}))


if __name__ == "__main__":
    main()
