"""Pipeline parallelism applied by the script: `torch.distributed.pipelining` stages and a GPipe schedule.

Knows nothing about torsh-tune. Each rank builds its own slice of an MLP as a `PipelineStage`;
`ScheduleGPipe` runs every micro-batch's forward, then every backward, sending activations and
gradients between the stages with send/recv (`batch_isend_irecv`). The last stage computes the
loss; each rank steps an optimizer over its own stage's parameters.

    torchrun --standalone --nproc-per-node 2 stack_pipeline.py --steps 30
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=512)
p.add_argument("--blocks-per-stage", type=int, default=2)
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--batch-size", type=int, default=64)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)
stage_module = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU())
                               for _ in range(args.blocks_per_stage)])
stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
schedule = ScheduleGPipe(stage, n_microbatches=args.microbatches,
                         loss_fn=lambda out, target: nn.functional.mse_loss(out, target))
optimizer = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
generator = torch.Generator().manual_seed(0)  # every rank draws the same batches
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, generator=generator)
    y = torch.randn(args.batch_size, args.width, generator=generator)
    optimizer.zero_grad()
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        losses: list = []
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    optimizer.step()
if rank == 0:
    print("pipeline done", flush=True)
dist.destroy_process_group()
