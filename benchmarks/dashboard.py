"""Dashboard overview render time for a large synthetic run (issue 5: <= 1.5 s for 100 000 steps x 8 ranks).

Synthesises a run directory (JSONL records as the profiler writes them: steps, comm with
`--buckets` buckets per step, system samples once per second), then measures, server side:

- cold load: the first incremental read of every JSONL file into RunFrames;
- overview render: the overview callback's work on the loaded run (KPIs + every figure of
  `reports.figures`, downsampled) plus serialising the figures to JSON as Dash sends them;
- live tick: the run appends 100 steps per rank, then refresh (tail read) + render;
- idle tick: nothing changed (signature check only).

Usage:
    .venv/bin/python benchmarks/dashboard.py [--steps 100000] [--ranks 8] [--buckets 2] [--repeat 3]

Prints a table and one JSON line (the last line) with every timing in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from torsh_tune.dashboard import RunStore, overview_info
from torsh_tune.records import columns_of

TARGET_S = 1.5


def synthesise(run: Path, *, num_steps: int, num_ranks: int, num_buckets: int, first_step: int = 0,
               seed: int = 0) -> None:
    """Append `num_steps` steps of every rank to run/ranks/*.jsonl (creating the run if needed)."""
    rng = np.random.default_rng(seed + first_step)
    (run / "ranks").mkdir(parents=True, exist_ok=True)
    if not (run / "run.json").exists():
        (run / "run.json").write_text(json.dumps({
            "name": run.name, "status": "running", "outcome": None, "world_size": num_ranks,
            "nproc_per_node": num_ranks, "nnodes": 1, "script": "/bench/train.py", "started_at_unix": 1.76e9,
            "config": {"strategy": {"kind": "ddp"}, "launch": {"nproc_per_node": num_ranks, "nnodes": 1}},
        }))
    step = np.arange(first_step, first_step + num_steps)
    for rank in range(num_ranks):
        step_s = 0.05 + 0.002 * rng.standard_normal(num_steps).clip(-3, 3) + (0.01 if rank == num_ranks - 1 else 0)
        t_end = 1.76e9 + np.cumsum(np.full(num_steps, 0.06)) + first_step * 0.06
        data_s, fwd, opt = 0.1 * step_s, 0.25 * step_s, 0.05 * step_s
        bwd = 0.5 * step_s
        comm_s, exposed = 0.3 * step_s, 0.08 * step_s
        steps = pd.DataFrame({
            "rank": rank, "step": step, "t_start": t_end - step_s, "t_end": t_end, "step_s": step_s, "data_s": data_s,
            "forward_s": fwd, "backward_s": bwd, "optimizer_s": opt, "comm_s": comm_s, "exposed_comm_s": exposed,
            "samples": 32, "num_microbatches": 1, "loss": np.where(step % 10 == 0, 2.0 / (1 + step / 1e4), np.nan),
            "peak_mem_bytes": 6e8 + rank, "warmup": step < 5,
        }).reindex(columns=columns_of("steps"))  # columns the scenario does not set are null
        with open(run / "ranks" / f"rank{rank:05d}.steps.jsonl", "a") as f:
            f.write(steps.to_json(orient="records", lines=True))
        n = num_steps * num_buckets
        b = np.tile(np.arange(num_buckets), num_steps)
        s = np.repeat(step, num_buckets)
        issue = np.repeat(t_end - 0.4 * step_s, num_buckets) + b * 0.005 + (rank * 1e-4)
        dur = np.full(n, 0.006)
        comm = pd.DataFrame({
            "rank": rank, "step": s, "seq": s * num_buckets + b, "bucket": b, "collective": "all_reduce",
            "hook": "allreduce", "bytes": 25 * 2**20, "wire_bytes": 25 * 2**20, "num_tensors": 10,
            "t_issue": issue, "t_complete": issue + dur, "duration_s": dur, "issuer": "ddp", "backend": "gloo",
            "dtype": "float32", "clock": "host",
        }).reindex(columns=columns_of("comm"))  # columns the scenario does not set are null
        with open(run / "ranks" / f"rank{rank:05d}.comm.jsonl", "a") as f:
            f.write(comm.to_json(orient="records", lines=True))
        t = np.arange(1.76e9 + first_step * 0.06, 1.76e9 + (first_step + num_steps) * 0.06, 1.0)
        system = pd.DataFrame({
            "rank": rank, "t": t, "cpu_pct": 95.0, "sys_cpu_pct": 60.0, "rss_bytes": 6e8, "mem_total_bytes": 6.4e10,
            "gpu_util_pct": None, "gpu_mem_used_bytes": None, "gpu_mem_total_bytes": None, "gpu_power_w": None,
            "pcie_tx_bytes_per_s": None, "pcie_rx_bytes_per_s": None,
        }).reindex(columns=columns_of("system"))
        with open(run / "ranks" / f"rank{rank:05d}.system.jsonl", "a") as f:
            f.write(system.to_json(orient="records", lines=True))


def _render(store: RunStore, run_id: str) -> float:
    import plotly.io as pio

    t0 = time.perf_counter()
    view = overview_info(store, run_id)
    for fig in view.figures.values():  # what Dash does to send them
        pio.to_json(fig, validate=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--buckets", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="torsh-bench-dash-") as tmp:
        runs = Path(tmp)
        run = runs / "big-run"
        t0 = time.perf_counter()
        synthesise(run, num_steps=args.steps, num_ranks=args.ranks, num_buckets=args.buckets)
        synth_s = time.perf_counter() - t0
        size_bytes = sum(f.stat().st_size for f in (run / "ranks").iterdir())

        store = RunStore(runs)
        t0 = time.perf_counter()
        store.frames(run.name)
        cold_s = time.perf_counter() - t0
        render = [_render(store, run.name) for _ in range(args.repeat)]  # unchanged files: cached frames
        ticks = []
        for i in range(args.repeat):
            synthesise(run, num_steps=100, num_ranks=args.ranks, num_buckets=args.buckets,
                       first_step=args.steps + 100 * i)
            ticks.append(_render(store, run.name))
        t0 = time.perf_counter()
        store.signature(run.name)
        idle_s = time.perf_counter() - t0

    result = {
        "benchmark": "dashboard_overview", "steps": args.steps, "ranks": args.ranks, "buckets": args.buckets,
        "jsonl_bytes": size_bytes, "synthesise_s": round(synth_s, 3), "cold_load_s": round(cold_s, 3),
        "render_s_median": round(statistics.median(render), 3), "live_tick_s_median": round(statistics.median(ticks), 3),
        "idle_tick_s": round(idle_s, 4), "target_s": TARGET_S,
        "meets_target": max(statistics.median(render), statistics.median(ticks)) <= TARGET_S,
    }
    rows = [("JSONL written", f"{size_bytes / 2**20:,.0f} MiB in {synth_s:.1f} s"),
            ("cold load (first read of every record)", f"{cold_s:.2f} s"),
            ("overview render (KPIs + 8 figures + JSON)", f"{result['render_s_median']:.3f} s (median of {args.repeat})"),
            ("live tick (+100 steps/rank, tail read + render)", f"{result['live_tick_s_median']:.3f} s"),
            ("idle tick (nothing changed)", f"{idle_s * 1e3:.1f} ms"),
            (f"target <= {TARGET_S} s (render and live tick)", "met" if result["meets_target"] else "NOT met")]
    width = max(len(r[0]) for r in rows)
    print(f"dashboard overview, {args.steps:,} steps x {args.ranks} ranks x {args.buckets} buckets")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
