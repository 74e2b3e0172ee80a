"""Collective micro-benchmarks that measure the fabric (they launch ranks).

    from torsh_tune.bench import run_bench, render_bench_table
    result = run_bench(nproc_per_node=2, runs_dir="runs")
    render_bench_table(result, rich.console.Console())
    result.reference_busbw_gbps   # what run.json "reference_busbw_gbps" should carry

The sweep itself runs on every rank as an ordinary torsh-tune run (torchrun + the
runtime bootstrap, with the profiler off: a bench has no optimizer steps to record, and
with the profiler off the supervisor's no-progress timeout does not apply; the wall-clock
`timeout_s` still does). Rank 0 writes bench.json and bench.csv; `load_bench` reads them,
fits the alpha-beta model (bench_model.json) and records the reference bus bandwidth in
the bench run's run.json.

What the measurements mean (the alpha-beta model, bus-bandwidth factors, topology) is
`torsh_tune.fabric`, re-exported here as it always was.
"""

from __future__ import annotations

from ..errors import BenchError
from ..fabric import (
    ALLREDUCE_ALGORITHMS,
    MODEL_FILE,
    AlphaBeta,
    CommModel,
    Fact,
    Topology,
    detect_node,
    fit_alpha_beta,
    fit_model,
    load_model,
    parse_nvidia_smi_topo,
    predict_allreduce_s,
    reference_busbw_gbps,
    save_model,
    topology_from_hosts,
)
from ._run import COLLECTIVES, DEFAULT_SIZES_BYTES, WORKER_SCRIPT, BenchResult, load_bench, run_bench, size_range
from ._table import render_bench_table

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "AlphaBeta",
    "BenchError",
    "BenchResult",
    "COLLECTIVES",
    "CommModel",
    "DEFAULT_SIZES_BYTES",
    "Fact",
    "MODEL_FILE",
    "Topology",
    "WORKER_SCRIPT",
    "detect_node",
    "fit_alpha_beta",
    "fit_model",
    "load_bench",
    "load_model",
    "parse_nvidia_smi_topo",
    "predict_allreduce_s",
    "reference_busbw_gbps",
    "render_bench_table",
    "run_bench",
    "save_model",
    "size_range",
    "topology_from_hosts",
]
