"""Communication lab: collective sweeps beside the alpha-beta model, on loopback or an emulated cluster.

Loopback (default): all collectives 4 KiB -> 64 MiB on `--nproc-per-node` ranks of this host.

    .venv/bin/python benchmarks/commlab.py [--nproc-per-node 2] [--max-bytes 67108864] [--iters 10]

Emulated cluster (`--emulate SPEC`, root + iproute2; see docs/emulate.md), e.g. 2 nodes x 2 ranks
joined by a 1 Gbit/s tc-tbf veth link:

    sudo .venv/bin/python benchmarks/commlab.py --emulate nodes=2,procs_per_node=2,link=1gbit

1. bench: all_reduce and all_gather 64 KiB -> `--max-bytes` on the cluster (inter-node and
   intra-node levels), the fitted alpha-beta model;
2. flat vs hierarchical all-reduce (`strategies.collectives.hierarchical_all_reduce`) of large
   messages, interleaved, time = max over ranks, beside the model's ring and hierarchical
   predictions;
3. `examples/comm_bound.py` profiled under DDP without compression, with fp16, PowerSGD, Top-K
   and the hierarchical hook: median step time beside the model's prediction
   (compute = baseline step - its exposed communication; + the fitted collective time of the
   wire bytes each method's hooks sent per step; + the codec's own CPU time per step), and the
   bottlenecks the profiler labels the baseline with (against the bench's measured reference).

Every part runs on the same cluster. Prints tables and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from torsh_tune.bench import render_bench_table, run_bench, size_range

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "examples" / "comm_bound.py"
#: A smaller comm_bound model (3.4 M parameters, 13 MiB of fp32 gradients per step) keeps a 1 Gbit/s run short.
WORKLOAD_ARGS = ["--vocab-size", "8192", "--hidden", "1024", "--log-every", "1000"]
#: (label, config patch, how the model predicts its communication)
CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    ("ddp", {}, "ring"),
    ("fp16", {"compression": {"method": "fp16"}}, "ring"),
    ("powersgd r4", {"compression": {"method": "powersgd", "rank": 4, "start_iter": 2}}, "ring"),
    ("topk 1%", {"compression": {"method": "topk", "ratio": 0.01}}, "all_gather"),
    ("hierarchical", {"collectives": {"hierarchical": True}}, "hierarchical"),
]


# -- inside every rank (flat vs hierarchical all-reduce) ----------------------------------------
def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from torsh_tune.strategies.collectives import HierarchicalState, hierarchical_all_reduce

    dist.init_process_group()  # the bootstrap picks gloo on CPU
    state = HierarchicalState()
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        buf = torch.ones(size // 4)
        algos = {"flat": lambda: dist.all_reduce(buf), "hierarchical": lambda: hierarchical_all_reduce(buf, state).wait()}
        times: dict[str, list[float]] = {name: [] for name in algos}
        for it in range(args.warmup + args.iters):
            for name in (list(algos) if it % 2 == 0 else list(algos)[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                algos[name]()
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if it >= args.warmup:
                    times[name].append(float(took))
        rows.append({"size_bytes": size, **{f"{name}_s": statistics.median(ts) for name, ts in times.items()},
                     **{f"{name}_min_s": min(ts) for name, ts in times.items()},
                     **{f"{name}_max_s": max(ts) for name, ts in times.items()}})
    if dist.get_rank() == 0:
        Path(os.environ["TORSH_TUNE_RUN_DIR"], "allreduce.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


# -- the emulated cluster -----------------------------------------------------------------------
def _flat_vs_hierarchical(cluster: Any, model: Any, runs_dir: Path, sizes: list[int], iters: int) -> list[dict]:
    from torsh_tune.fabric import predict_allreduce_s
    from torsh_tune.config import BudgetConfig, ProfilerConfig, RunConfig
    from torsh_tune.launch import launch_run
    from torsh_tune.rundir import new_run_dir

    config = cluster.configure(RunConfig(budget=BudgetConfig(timeout_s=600), profiler=ProfilerConfig(enabled=False)))
    rd = new_run_dir(runs_dir, "allreduce")
    outcome = launch_run(config, rd, Path(__file__), ["--worker", "--sizes", ",".join(map(str, sizes)),
                                                      "--iters", str(iters), "--warmup", "1"], echo=lambda line: None)
    if outcome.status != "ok":
        raise SystemExit(f"flat vs hierarchical run failed: {outcome.status} {outcome.message} ({rd.logs})")
    rows = json.loads((rd.path / "allreduce.json").read_text())
    for row in rows:
        for algo, key in (("ring", "flat"), ("hierarchical", "hierarchical")):
            # One veth per emulated node: the hierarchical shard all-reduces share it.
            row[f"{key}_model_s"] = predict_allreduce_s(model, row["size_bytes"], algorithm=algo, node_links=1)
        row["speedup"] = row["flat_s"] / row["hierarchical_s"]
        row["model_speedup"] = row["flat_model_s"] / row["hierarchical_model_s"]
    return rows


def _codec_s_per_step(run_dir: Path) -> float:
    """The compression hook's own CPU time per step (compress + decompress), mean over ranks."""
    per_rank = []
    for meta_path in (run_dir / "ranks").glob("*.meta.json"):
        meta = json.loads(meta_path.read_text())
        stats = meta.get("compression")
        stats = stats[0] if isinstance(stats, list) and stats else stats
        if not isinstance(stats, dict) or not stats.get("calls") or not stats.get("num_buckets"):
            continue
        steps = stats["calls"] / stats["num_buckets"]
        per_rank.append((stats.get("compress_s", 0.0) + stats.get("decompress_s", 0.0)) / steps)
    return statistics.mean(per_rank) if per_rank else 0.0


def _predicted_comm_s(model: Any, how: str, wire_bytes: float, num_collectives: float, world: int) -> float:
    from torsh_tune.fabric import predict_allreduce_s

    k = max(round(num_collectives), 1)
    if how == "all_gather":
        fit = model.get("all_gather", "inter")
        return k * fit.predict_s(wire_bytes * world / k)  # nccl-tests sizing: the gathered output
    return k * predict_allreduce_s(model, wire_bytes / k, algorithm=how, node_links=1)


def _profiled(cluster: Any, bench: Any, runs_dir: Path, label: str, patch: dict[str, Any], how: str, *,
              steps: int, warmup: int) -> dict[str, Any]:
    """One profiled run of the workload under `patch` on the cluster, analysed."""
    from torsh_tune.analysis import analyze_run, compact_run
    from torsh_tune.config import BudgetConfig, RunConfig
    from torsh_tune.launch import launch_run
    from torsh_tune.rundir import new_run_dir, write_json_atomic

    base = RunConfig(budget=BudgetConfig(steps=steps, warmup_steps=warmup, timeout_s=600))
    config = cluster.configure(base.apply_patch(patch) if patch else base)
    rd = new_run_dir(runs_dir, f"comm_bound-{label.split()[0]}")
    outcome = launch_run(config, rd, WORKLOAD, WORKLOAD_ARGS, echo=lambda line: None)
    # As `profile --reference-bench`: the `network` rule compares against the fabric's measured busbw.
    info = json.loads(rd.run_json.read_text())
    info["reference_busbw_gbps"] = bench.reference_busbw_gbps
    info["reference_bench"] = str(bench.run_dir)
    write_json_atomic(rd.run_json, info)
    compact_run(rd.path)
    a = analyze_run(rd.path)
    if outcome.status != "ok" or a.steps is None or a.comm is None:
        raise SystemExit(f"{label}: run failed: {outcome.status} {outcome.message} ({rd.logs})")
    wire = a.comm.wire_bytes_per_step or a.comm.bytes_per_step
    return {
        "config": label, "step_s": a.steps.median_step_s, "step_iqr_s": a.steps.iqr_step_s,
        "exposed_comm_s": a.comm.exposed_comm_s, "wire_bytes_per_step": wire,
        "payload_bytes_per_step": a.comm.bytes_per_step, "num_collectives": a.comm.num_collectives_per_step,
        "busbw_gbps": a.comm.busbw_gbps, "codec_s": _codec_s_per_step(rd.path), "how": how,
        "bottlenecks": [{"category": b.category, "severity": b.severity, "message": b.message,
                         "evidence": {k: v for k, v in b.evidence.items() if isinstance(v, (int, float, str))}}
                        for b in a.bottlenecks],
        "recommendations": [{"title": r.title, "expected_gain_pct": [r.expected_gain.low_pct, r.expected_gain.high_pct]}
                            for r in a.recommendations[:3]] if a.recommendations else [],
        "run_dir": str(rd.path),
    }


def _compression(cluster: Any, bench: Any, runs_dir: Path, *, steps: int, warmup: int, rounds: int) -> list[dict]:
    """Every config once per round (reversed order on odd rounds); per config the round with the median step."""
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in CONFIGS}
    for rnd in range(rounds):
        for label, patch, how in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
            runs[label].append(_profiled(cluster, bench, runs_dir, label, patch, how, steps=steps, warmup=warmup))
    rows = []
    for label, rs in runs.items():
        rs = sorted(rs, key=lambda r: r["step_s"])
        row = dict(rs[(len(rs) - 1) // 2])
        row["round_steps_s"] = [r["step_s"] for r in runs[label]]
        rows.append(row)
    base = rows[0]
    world = cluster.spec.nodes * cluster.spec.procs_per_node
    compute_s = base["step_s"] - base["exposed_comm_s"]
    for row in rows:
        # The hierarchical hook counts only its inter-node bytes as wire bytes; its model takes the buffer.
        size = row["payload_bytes_per_step"] if row["how"] == "hierarchical" else row["wire_bytes_per_step"]
        row["predicted_comm_s"] = _predicted_comm_s(bench.model, row["how"], size, row["num_collectives"], world)
        row["predicted_step_s"] = compute_s + row["predicted_comm_s"] + row["codec_s"]
        row["error_pct"] = 100.0 * (row["step_s"] - row["predicted_step_s"]) / row["predicted_step_s"]
        row["speedup_vs_ddp"] = base["step_s"] / row["step_s"]
        row["predicted_speedup_vs_ddp"] = base["predicted_step_s"] / row["predicted_step_s"]
    return rows


def _emulated(args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    from torsh_tune.launch.emulate import EmulatedCluster, EmulateSpec

    console = Console(width=140)
    spec = EmulateSpec.parse(args.emulate)
    with EmulatedCluster(spec) as cluster:
        console.print(f"emulated cluster: {spec.describe()}", markup=False)
        bench = run_bench(sizes=size_range(64 << 10, args.max_bytes, 4), collectives=("all_reduce", "all_gather"),
                          iters=args.iters, warmup=1, runs_dir=runs_dir, echo=lambda line: None, cluster=cluster)
        render_bench_table(bench, console)
        big = [s for s in (4 << 20, 16 << 20, 64 << 20) if s <= args.max_bytes]
        hier = _flat_vs_hierarchical(cluster, bench.model, runs_dir, big, iters=args.iters)
        comp = _compression(cluster, bench, runs_dir, steps=args.steps, warmup=args.warmup_steps, rounds=args.rounds)
    print("\nflat vs hierarchical all-reduce (median of max-over-ranks time; model: ring vs hierarchical)")
    print(f"{'size':>8} {'flat ms':>9} {'hier ms':>9} {'speedup':>8} | {'model flat':>10} {'model hier':>10} {'model x':>8}")
    for r in hier:
        print(f"{r['size_bytes'] >> 20:>5} MiB {r['flat_s'] * 1e3:9.1f} {r['hierarchical_s'] * 1e3:9.1f} {r['speedup']:8.2f} | "
              f"{r['flat_model_s'] * 1e3:10.1f} {r['hierarchical_model_s'] * 1e3:10.1f} {r['model_speedup']:8.2f}")
    print(f"\n{WORKLOAD.name} {' '.join(WORKLOAD_ARGS)}: {args.steps} measured steps after {args.warmup_steps}, "
          f"median of {args.rounds} interleaved round(s)")
    print(f"{'config':<14} {'step ms':>8} {'predicted':>9} {'err %':>6} {'x ddp':>6} {'pred x':>6} "
          f"{'wire MiB':>9} {'codec ms':>8} {'busbw GB/s':>10}")
    for r in comp:
        busbw = "-" if r["busbw_gbps"] is None else f"{r['busbw_gbps']:.3f}"
        print(f"{r['config']:<14} {r['step_s'] * 1e3:8.1f} {r['predicted_step_s'] * 1e3:9.1f} {r['error_pct']:6.1f} "
              f"{r['speedup_vs_ddp']:6.2f} {r['predicted_speedup_vs_ddp']:6.2f} {r['wire_bytes_per_step'] / 2**20:9.2f} "
              f"{r['codec_s'] * 1e3:8.1f} {busbw:>10}")
    print("\nprofiler's bottlenecks of the ddp baseline:")
    for b in comp[0]["bottlenecks"]:
        print(f"  {b['severity']:<8} {b['category']:<14} {b['message']}")
    for r in comp[0]["recommendations"]:
        print(f"  recommendation: {r['title']} (expected gain {r['expected_gain_pct'][0]:.0f}-{r['expected_gain_pct'][1]:.0f} % of the step)")
    return {
        "benchmark": "commlab_emulated", "spec": spec.to_dict(),
        "reference_busbw_gbps": bench.reference_busbw_gbps,
        "fits": [{"collective": f.collective, "level": f.level, "group_size": f.group_size, "alpha_us": f.alpha_s * 1e6,
                  "busbw_gbps": f.busbw_gbps, "heldout_median_rel_err": f.heldout_median_rel_err} for f in bench.model.fits],
        "all_reduce": bench.predictions(), "flat_vs_hierarchical": hier, "compression": comp,
        "baseline_bottlenecks": [b["category"] for b in comp[0]["bottlenecks"]],
        "machine": f"{platform.machine()} {os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d"),
        "run_dir": str(runs_dir),
    }


# -- loopback ---------------------------------------------------------------------------------------
def _loopback(args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    result = run_bench(nproc_per_node=args.nproc_per_node, sizes=size_range(args.min_bytes, args.max_bytes, args.factor),
                       iters=args.iters, warmup=args.warmup, runs_dir=runs_dir, echo=lambda line: None)
    render_bench_table(result, Console(width=140))
    return {
        "benchmark": "commlab",
        "world_size": result.meta.get("world_size"),
        "backend": result.meta.get("backend"),
        "memcopy_gbps": result.memcopy_gbps,
        "reference_busbw_gbps": result.reference_busbw_gbps,
        "fits": [{"collective": f.collective, "level": f.level, "group_size": f.group_size,
                  "alpha_us": f.alpha_s * 1e6, "busbw_gbps": f.busbw_gbps,
                  "heldout_median_rel_err": f.heldout_median_rel_err} for f in result.model.fits],
        "all_reduce": result.predictions(),
        "run_dir": str(result.run_dir),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--emulate", metavar="SPEC", help="e.g. nodes=2,procs_per_node=2,link=1gbit (root, iproute2)")
    p.add_argument("--steps", type=int, default=10, help="--emulate: measured steps per profiled run")
    p.add_argument("--warmup-steps", type=int, default=3, help="--emulate: warm-up steps per profiled run")
    p.add_argument("--rounds", type=int, default=2, help="--emulate: profiled runs per configuration (interleaved)")
    p.add_argument("--runs-dir", default=None, help="default: a temporary directory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sizes", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    runs_dir = Path(args.runs_dir or tempfile.mkdtemp(prefix="commlab-"))
    summary = _emulated(args, runs_dir) if args.emulate else _loopback(args, runs_dir)
    print(json.dumps(summary))


if __name__ == "__main__":
    sys.exit(main())
