"""Communication lab: collective sweep 4 KiB -> 64 MiB on 2 ranks, measurements beside the alpha-beta model.

    .venv/bin/python benchmarks/commlab.py [--nproc-per-node 2] [--max-bytes 67108864] [--iters 10]

Prints the bench table, then one JSON line: per all-reduce size the measured time, the
fitted model's time and each algorithm's prediction, the fitted alpha/beta per
collective with their held-out errors, the memory-copy ceiling and the reference busbw.
"""

from __future__ import annotations

import argparse
import json
import tempfile

from rich.console import Console

from torsh_tune.bench import render_bench_table, run_bench, size_range


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=4 << 10)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs-dir", default=None, help="default: a temporary directory")
    args = p.parse_args()
    runs_dir = args.runs_dir or tempfile.mkdtemp(prefix="commlab-")
    result = run_bench(nproc_per_node=args.nproc_per_node, sizes=size_range(args.min_bytes, args.max_bytes, args.factor),
                       iters=args.iters, warmup=args.warmup, runs_dir=runs_dir, echo=lambda line: None)
    render_bench_table(result, Console(width=140))
    summary = {
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
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
