"""Regenerate the gloo Kineto fixture in tests/data/traces/gloo-ddp-2rank/.

Run from the repository root (takes ~20 s on 2 CPU cores):

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/analysis/traces/make_gloo_trace.py tests/data/traces/gloo-ddp-2rank

Each rank trains a small DDP model on CPU with gloo under ``torch.profiler`` and exports
``rank-<r>.json.gz``. Besides DDP's bucketed all-reduces (issued from autograd hooks),
every step runs an all_gather on the default group and an all_reduce on a second process
group, so the fixture exercises pairing of main-thread ``c10d::*`` ops with the
``pt_gloo_runloop`` worker's ``gloo:*`` annotations per process group. Rank 1 sleeps a
little before the extra collectives so rank 0 waits there (a known straggler).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    out_dir = sys.argv[1]
    os.makedirs(out_dir, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    side_group = dist.new_group(ranks=[0, 1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    # Small buckets so one backward issues several all-reduces of known sizes.
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))
    gathered = [torch.empty(4096) for _ in range(dist.get_world_size())]
    side = torch.ones(8192)

    def export(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(os.path.join(out_dir, f"rank-{rank}.json.gz"))

    schedule = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=schedule,
        record_shapes=True,
        on_trace_ready=export,
    ) as prof:
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            if rank == 1:
                time.sleep(0.005)
            dist.all_gather(gathered, torch.full((4096,), float(rank)))
            dist.all_reduce(side, group=side_group)
            prof.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
