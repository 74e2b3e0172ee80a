"""Warm start from the communication model: predicted vs measured step times on the tuner's grid.

Issue 4's warm start enqueues the configurations a `torsh-tune bench` alpha-beta model
predicts fastest (`torsh_tune.autotune.model_candidates`). This checks the predictions
against the exhaustive grid of `benchmarks/tuner_efficiency.py` (36 configurations of
`examples/comm_bound.py` measured on an emulated 1 Gbit/s link, cached in
`benchmarks/data/tuner_grid_comm_bound_1gbit.json`):

1. In a private network namespace whose loopback is rate-limited like the grid's
   (`tuner_efficiency.emulated_link`, tc tbf 1gbit; needs root): `torsh-tune bench` on 2 ranks
   (all_reduce and all_gather, 4 KiB -> 64 MiB) and one baseline profile of the workload
   (PyTorch defaults, the grid's steps, warm-up and script arguments).
2. Two models from the one sweep: fitted on every size (what `torsh-tune bench` writes), and
   on the sizes >= `--min-fit-bytes` (1 MiB: above the token bucket's 256 KB burst, which lets
   small messages through at memory speed).
3. Every grid point's step time predicted from the baseline's phases (`step_inputs`,
   `predict_params`), as samples/s beside the measured ones; Spearman rank correlation
   (ties averaged: the workers dimension does not change communication); the model's top 2
   picks (`model_candidates` over the grid's space) and how close their measured throughput
   is to the grid's optimum.

    sudo .venv/bin/python benchmarks/model_warm_start.py          # ~1 min
    .venv/bin/python benchmarks/model_warm_start.py --bench-run B --baseline-run R   # reuse runs

Run directories go to a temporary directory (`--runs-dir` keeps them). Prints tables and one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tuner_efficiency import DATA, FIXED, GRID, REPO, _space, emulated_link

GRID_FILE = DATA / "tuner_grid_comm_bound_1gbit.json"
TOLERANCES = (0.05, 0.10)


def _measure(runs_dir: Path, grid: dict[str, Any]) -> tuple[Path, Path, float]:
    """(bench run, baseline run, seconds) measured on the grid's emulated link."""
    exe = REPO / ".venv" / "bin" / "torsh-tune"
    t0 = time.monotonic()
    with emulated_link("1gbit") as launcher:
        inside = shlex.split(launcher.format(cmd=""))
        subprocess.run([*inside, str(exe), "bench", "--nproc-per-node", "2", "--backend", "gloo",
                        "--min-bytes", str(4 << 10), "--max-bytes", str(64 << 20), "--factor", "4",
                        "--collectives", "all_reduce,all_gather", "--iters", "10", "--warmup", "2",
                        "--runs-dir", str(runs_dir), "--run-name", "bench"], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        subprocess.run([*inside, str(exe), "profile", "--nproc-per-node", "2", "--steps", str(grid["steps"]),
                        "--warmup-steps", str(grid["warmup_steps"]), "--quiet", "--runs-dir", str(runs_dir),
                        "--run-name", "baseline", str(REPO / grid["script"]), *grid["script_args"]],
                       check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return runs_dir / "bench", runs_dir / "baseline", time.monotonic() - t0


def _ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties given their average rank."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (Pearson of the average ranks)."""
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _key(params: dict[str, Any]) -> str:
    return json.dumps({name: params[name] for name in GRID}, sort_keys=True)


def evaluate(model, baseline_run: Path, grid: dict[str, Any]) -> dict[str, Any]:
    """Predictions of every grid point, their rank correlation, and the model's top-2 picks."""
    from torsh_tune.autotune import model_candidates, predict_params, step_inputs

    space, _ = _space()
    inputs = step_inputs(baseline_run)
    points = [p for p in grid["points"] if p["samples_s"]]
    rows = []
    for p in points:
        pred = predict_params(model, inputs, space, {**FIXED, **p["params"]})
        rows.append({"params": p["params"], "measured_samples_s": p["samples_s"],
                     "predicted_samples_s": inputs.samples_per_step / pred.step_s,
                     "predicted_exposed_comm_s": pred.exposed_comm_s})
    measured = {_key(r["params"]): r["measured_samples_s"] for r in rows}
    best = max(measured.values())
    picks = []
    for c in model_candidates(model, baseline_run, space, top=2):
        got = measured.get(_key({**space.baseline_params(), **c.params}))
        picks.append({"params": {name: c.params.get(name) for name in GRID}, "predicted_speedup": c.predicted_speedup,
                      "measured_samples_s": got, "of_optimum": None if got is None else got / best, "why": c.why})
    reached = max((p["of_optimum"] or 0.0 for p in picks), default=0.0)
    base = space.baseline_params()
    base_pred = predict_params(model, inputs, space, {**FIXED, **{n: base[n] for n in GRID}})
    return {
        "rows": rows,
        "spearman": spearman([r["predicted_samples_s"] for r in rows], [r["measured_samples_s"] for r in rows]),
        "picks": picks,
        "optimum_samples_s": best,
        "top2_best_of_optimum": reached,
        **{f"top2_within_{round(t * 100)}pct": reached >= 1 - t for t in TOLERANCES},
        "baseline_measured_samples_s": inputs.samples_per_step / inputs.measured_step_s,
        "baseline_predicted_samples_s": inputs.samples_per_step / base_pred.step_s,
    }


def _fits(model) -> str:
    return ", ".join(f"{f.collective} alpha {f.alpha_s * 1e6:.0f} us 1/beta {f.busbw_gbps or 0:.3f} GB/s "
                     f"(held-out err {f.heldout_median_rel_err or 0:.0%})" for f in model.fits)


def _print(name: str, model, result: dict[str, Any]) -> None:
    print(f"\n== model: {name}: {_fits(model)}")
    print(f"baseline (PyTorch defaults): measured {result['baseline_measured_samples_s']:.2f} samples/s, "
          f"predicted {result['baseline_predicted_samples_s']:.2f}")
    print(f"{'workers':>7} {'method':>6} {'bucket':>6} {'measured':>9} {'predicted':>9} {'pred/meas':>9}")
    for r in sorted(result["rows"], key=lambda r: -r["measured_samples_s"]):
        p = r["params"]
        print(f"{p['dataloader.num_workers']:>7} {p['compression.method']:>6} {p['ddp.bucket_cap_mb']:>6g} "
              f"{r['measured_samples_s']:>9.2f} {r['predicted_samples_s']:>9.2f} "
              f"{r['predicted_samples_s'] / r['measured_samples_s']:>9.2f}")
    print(f"Spearman rank correlation (36 points): {result['spearman']:.3f}")
    for i, p in enumerate(result["picks"], 1):
        got = "not in the grid" if p["measured_samples_s"] is None else \
            f"measured {p['measured_samples_s']:.2f} samples/s = {p['of_optimum']:.1%} of the optimum"
        print(f"pick {i}: {p['params']} predicted x{p['predicted_speedup']:.2f}, {got}\n        {p['why']}")
    print(f"top 2 within 5 % of the optimum ({result['optimum_samples_s']:.2f}): {result['top2_within_5pct']}, "
          f"within 10 %: {result['top2_within_10pct']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-run", type=Path, help="an existing bench run on the emulated link (skips measuring)")
    ap.add_argument("--baseline-run", type=Path, help="an existing baseline profile (with --bench-run)")
    ap.add_argument("--runs-dir", type=Path, help="keep the measured runs here (default: a temporary directory)")
    ap.add_argument("--min-fit-bytes", type=int, default=1 << 20, help="smallest size of the restricted fit")
    args = ap.parse_args()
    from torsh_tune.fabric import fit_model, load_model

    grid = json.loads(GRID_FILE.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        measure_s = 0.0
        if args.bench_run and args.baseline_run:
            bench_run, baseline_run = args.bench_run, args.baseline_run
        else:
            runs_dir = args.runs_dir or Path(tmp)
            bench_run, baseline_run, measure_s = _measure(runs_dir, grid)
        bench = json.loads((bench_run / "bench.json").read_text())
        models = {
            "every size": load_model(bench_run),
            f">= {args.min_fit_bytes >> 10} KiB": fit_model(
                {**bench, "rows": [r for r in bench["rows"] if r["size_bytes"] >= args.min_fit_bytes]}),
        }
        results = {name: evaluate(model, baseline_run, grid) for name, model in models.items()}
    for name, model in models.items():
        _print(name, model, results[name])
    summary = {
        "benchmark": "model_warm_start",
        "grid": GRID_FILE.name,
        "measure_s": round(measure_s, 1),
        "models": {name: {
            "fits": [{"collective": f.collective, "alpha_s": f.alpha_s, "busbw_gbps": f.busbw_gbps,
                      "heldout_median_rel_err": f.heldout_median_rel_err} for f in models[name].fits],
            "spearman": round(r["spearman"], 4),
            "baseline_measured_samples_s": round(r["baseline_measured_samples_s"], 3),
            "baseline_predicted_samples_s": round(r["baseline_predicted_samples_s"], 3),
            "picks": [{**{k: v for k, v in p.items() if k != "why"}} for p in r["picks"]],
            "top2_best_of_optimum": round(r["top2_best_of_optimum"], 4),
            "top2_within_5pct": r["top2_within_5pct"],
            "top2_within_10pct": r["top2_within_10pct"],
        } for name, r in results.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
