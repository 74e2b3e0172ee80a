"""GPU traces step by step: the host's ProfilerStep# spans against the device spans of the kernels each launched.

    .venv/bin/python benchmarks/gpu_steps.py [TRACE_DIR ...]   # default: the recorded NCCL traces in tests/data

On a GPU the host only enqueues work: a step's ``ProfilerStep#`` span (host clock) holds whatever
kernels the device happened to run then, often the previous step's. `traces.step_table` reads a
step on the device clock instead (`device_step_spans`: from the first start among the kernels the
host launched inside the span to that of the next step's). For every rank and step this prints
both spans and the communication inside each, and checks what the self-check's per-step view
relies on: the device spans' communication adds up to the window's (`comm_overlap`), which the
host spans' need not. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

if importlib.util.find_spec("torsh_tune") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from torsh_tune.analysis.traces import CommPatterns, comm_overlap, load_traces, rank_timeline, step_spans, step_table
from torsh_tune.analysis.traces import _intervals as iv
from torsh_tune.analysis.traces._timeline import COMMUNICATION

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"
DEFAULT = ("hta-nccl-2rank-rank0", "hta-sampled-2rank", "hta-16rank-rank0")


def measure(path: Path) -> dict:
    traces = load_traces(path)
    timelines = {r: rank_timeline(rt, traces.symbols, CommPatterns()) for r, rt in traces.ranks.items()}
    table = step_table(traces, timelines)
    window = {int(r["rank"]): float(r["comm_s"]) for r in comm_overlap(timelines).rows()}
    rows, sums = [], {}
    for rank, tl in timelines.items():
        comm = (tl.start_us[tl.kind == COMMUNICATION], tl.end_us[tl.kind == COMMUNICATION])
        spans = step_spans(traces.ranks[rank].table, traces.symbols)
        host = {int(s): iv.total(*iv.clip(*comm, a, b)) / 1e6 for s, a, b in
                zip(spans["step"].tolist(), spans["start_us"].tolist(), spans["end_us"].tolist())}
        mine = [r for r in table.rows() if r["rank"] == rank]
        for r in mine:
            rows.append({"trace": path.name, "rank": rank, "step": int(r["step"]), "host_step_ms": 1e3 * r["step_s"],
                         "device_step_ms": 1e3 * r["device_step_s"], "comm_in_host_span_ms": 1e3 * host[int(r["step"])],
                         "comm_in_device_span_ms": 1e3 * r["comm_s"]})
        sums[rank] = {"window_comm_ms": 1e3 * window[rank],
                      "host_spans_comm_ms": 1e3 * sum(host.values()),
                      "device_spans_comm_ms": 1e3 * sum(r["comm_s"] for r in mine)}
    return {"trace": path.name, "device": tl.device, "steps": rows, "sums": sums}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, help="trace directories (default: the recorded NCCL traces)")
    args = parser.parse_args(argv)
    results = [measure(p) for p in (args.traces or [DATA / name for name in DEFAULT])]
    print(f"{'trace':<22}{'rank':>5}{'step':>6}{'host step':>11}{'device step':>13}{'comm in host':>14}"
          f"{'comm in device':>16}")
    for res in results:
        for r in res["steps"]:
            device = f"{r['device_step_ms']:>11.2f}ms" if r["device_step_ms"] == r["device_step_ms"] else f"{'-':>13}"
            print(f"{r['trace']:<22}{r['rank']:>5}{r['step']:>6}{r['host_step_ms']:>9.2f}ms{device}"
                  f"{r['comm_in_host_span_ms']:>12.3f}ms{r['comm_in_device_span_ms']:>14.3f}ms")
        for rank, s in res["sums"].items():
            print(f"{res['trace']:<22}{rank:>5}{'sum':>6}{'':>24}{s['host_spans_comm_ms']:>12.3f}ms"
                  f"{s['device_spans_comm_ms']:>14.3f}ms   window {s['window_comm_ms']:.3f} ms")
    ok = all(abs(s["device_spans_comm_ms"] - s["window_comm_ms"]) <= 1e-6 + 1e-9 * s["window_comm_ms"]
             for res in results for s in res["sums"].values())
    print(json.dumps({"benchmark": "gpu_steps", "device_spans_add_up": ok,
                      "traces": {res["trace"]: res["sums"] for res in results}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
