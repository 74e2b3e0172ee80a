"""The always-on probes' cost per step on one CUDA rank (NCCL, world size 1), in process.

Arm `bare` runs a small DDP step loop; arm `torsh` installs every probe as the bootstrap
does. Each arm is its own process (probes patch torch globally); run the arms alternately and
compare their µs per step (host + device: the loop's wall time over N steps, synchronized
once at the end). With `--profile`, prints cProfile's top functions of the torsh arm: where
the per-step cost goes on a GPU.

    python3 benchmarks/cuda_probe_cost.py --pairs 2          # alternating bare/torsh, a table and a JSON line
    python3 benchmarks/cuda_probe_cost.py --arm torsh --profile
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# From a checkout without `pip install -e .` (a lent GPU machine's own Python): the package in src/.
if importlib.util.find_spec("torsh_tune") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def arm(name: str, steps: int, profile: bool) -> float:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29533"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    rt = None
    if name == "torsh":
        from torsh_tune.config import RunConfig, dist_env
        from torsh_tune.rundir import RunDir
        from torsh_tune.runtime import patches
        from torsh_tune.runtime.context import RankRuntime

        rt = RankRuntime(RunConfig(), RunDir(Path(tempfile.mkdtemp()) / "run"), env=dist_env())
        patches.install(rt)
        rt.start()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    width = 2048
    model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 1)).cuda()
    model = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 256, device="cuda"), torch.randn(256, 1, device="cuda")

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(30):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile() if profile else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for _ in range(steps):
        step()
    if prof:
        prof.disable()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / steps
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    if rt is not None:
        rt.finish("ok")
    dist.destroy_process_group()
    return per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=("bare", "torsh"), help="run one arm in this process")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if args.arm:
        print(json.dumps({"arm": args.arm, "us_per_step": 1e6 * arm(args.arm, args.steps, args.profile)}), flush=True)
        return
    rows = []
    for i in range(args.pairs):
        res = {}
        for name in (("bare", "torsh") if i % 2 == 0 else ("torsh", "bare")):
            out = subprocess.run([sys.executable, __file__, "--arm", name, "--steps", str(args.steps)],
                                 capture_output=True, text=True, timeout=300)
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                raise SystemExit(f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            res[name] = json.loads(lines[-1])["us_per_step"]
        rows.append({"pair": i, **res, "delta_us": res["torsh"] - res["bare"]})
        print(f"pair {i}: bare {res['bare']:8.1f} us   torsh-tune {res['torsh']:8.1f} us   "
              f"delta {res['torsh'] - res['bare']:+8.1f} us", flush=True)
    summary = {"benchmark": "cuda_probe_cost", "pairs": args.pairs, "steps": args.steps,
               "median_bare_us": statistics.median(r["bare"] for r in rows),
               "median_torsh_us": statistics.median(r["torsh"] for r in rows),
               "delta_us_median": statistics.median(r["delta_us"] for r in rows),
               "delta_us_range": [min(r["delta_us"] for r in rows), max(r["delta_us"] for r in rows)],
               "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
