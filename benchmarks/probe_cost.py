"""The always-on probes' own cost per step, in microseconds, measured precisely.

Whole-run A/B pairs on a shared 2-core machine vary by +-10 % run to run, far more than the
1 % the profiler may cost, so overhead.py can only bound it loosely. This benchmark isolates
the cost: one process, world size 1 (gloo), a tiny DDP model whose step is short, so the
probes are a large, measurable share of it. Arm A runs the loop bare; arm B installs every
torsh-tune probe exactly as the bootstrap does (optimizer hooks, forward hooks, backward and
DataLoader wrappers, the timing comm hook, the system sampler thread, the record writer).
Both arms time their steps with the same inline timer. Pairs alternate A/B order; the probe
cost is the median over pairs of (B - A) median step time.

    .venv/bin/python benchmarks/probe_cost.py --pairs 10 --steps 2000 --reference-step-ms 15.7

Prints a table and one JSON line; with --reference-step-ms (the median step of the workload
you care about, e.g. overhead.py's bare ddp_mlp step) it also gives the cost in % of it.
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


def child(arm: str, steps: int, out: Path, buckets: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29511"), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    rt = None
    if arm == "torsh":
        from torsh_tune.config import RunConfig
        from torsh_tune.rundir import RunDir
        from torsh_tune.runtime import patches
        from torsh_tune.runtime.context import RankRuntime

        run = RunDir(out.parent / "run")
        rt = RankRuntime(RunConfig(), run)
        patches.install(rt)
        rt.start()
    torch.manual_seed(0)
    dist.init_process_group("gloo")
    layers = []
    for _ in range(buckets):  # one Linear per bucket with a 1 MiB cap
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=0.25)
    loader = DataLoader(TensorDataset(torch.randn(4096, 256)), batch_size=16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times, step, last = [], 0, time.perf_counter()
    while step < steps:
        for (x,) in loader:
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
            step += 1
            if step >= steps:
                break
    if rt is not None:
        rt.finish("ok")
    dist.destroy_process_group()
    out.write_text(json.dumps(times))


def run_arm(arm: str, args: argparse.Namespace, work: Path, i: int) -> float:
    out = work / f"{arm}{i}" / "steps.json"
    out.parent.mkdir()
    env = dict(os.environ, PORT=str(29600 + i % 50), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--child", arm, "--steps", str(args.steps), "--buckets", str(args.buckets), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{arm} {i} failed:\n{proc.stderr[-3000:]}")
    times = json.loads(out.read_text())[args.skip:]
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--skip", type=int, default=100)
    p.add_argument("--buckets", type=int, default=3, help="DDP buckets per step (comm hook calls)")
    p.add_argument("--reference-step-ms", type=float, default=None)
    p.add_argument("--child", choices=("bare", "torsh"))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.child:
        child(args.child, args.steps, args.out, args.buckets)
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            order = ("bare", "torsh") if i % 2 == 0 else ("torsh", "bare")
            res = {arm: run_arm(arm, args, Path(tmp), i) for arm in order}
            rows.append({"bare_us": res["bare"] * 1e6, "torsh_us": res["torsh"] * 1e6, "delta_us": (res["torsh"] - res["bare"]) * 1e6})
            print(f"pair {i}: bare {rows[-1]['bare_us']:8.1f} us   torsh-tune {rows[-1]['torsh_us']:8.1f} us   "
                  f"probe cost {rows[-1]['delta_us']:+7.1f} us", flush=True)
    deltas = sorted(r["delta_us"] for r in rows)
    q = statistics.quantiles(deltas, n=4)
    summary = {
        "benchmark": "probe_cost",
        "pairs": args.pairs,
        "steps": args.steps,
        "buckets": args.buckets,
        "median_bare_step_us": statistics.median(r["bare_us"] for r in rows),
        "probe_cost_us_median": statistics.median(deltas),
        "probe_cost_us_q1": q[0],
        "probe_cost_us_q3": q[2],
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    print()
    print(f"{'tiny-model step (bare)':<30}{summary['median_bare_step_us']:10.1f} us")
    print(f"{'probe cost per step, median':<30}{summary['probe_cost_us_median']:+10.1f} us  (IQR {q[0]:+.1f} .. {q[2]:+.1f})")
    if args.reference_step_ms:
        pct = summary["probe_cost_us_median"] / (args.reference_step_ms * 1e3) * 100
        summary["reference_step_ms"] = args.reference_step_ms
        summary["cost_pct_of_reference"] = pct
        print(f"{'share of a ' + str(args.reference_step_ms) + ' ms step':<30}{pct:+10.2f} %")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
