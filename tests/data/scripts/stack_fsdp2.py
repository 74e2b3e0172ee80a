"""A script that applies FSDP2 itself: fully_shard on each block, then on the root; AdamW.

`--fsdp1` wraps the same model in FSDP1 instead (FullyShardedDataParallel, one unit per block,
FULL_SHARD; on CPU with `device_id=cpu`: without an accelerator FSDP1 refuses to guess).
Knows nothing about torsh-tune. Runs on CUDA/NCCL when a GPU is there, else CPU/gloo.
`--checkpoint-at K...` saves a distributed checkpoint (DCP) of the model and the optimizer after
these loop steps. `--compile` compiles each block before sharding it (`Module.compile`, `--backend`: default
aot_eager, which needs no C++ compiler); rank 0 then prints at exit the `DYNAMO {...}` line of
`_dynamo_report.py` (graphs, graph breaks, recompiles, warnings that mention torsh).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import _dynamo_report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=256)
p.add_argument("--blocks", type=int, default=4)
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--compile", action="store_true", help="torch.compile each block before sharding")
p.add_argument("--backend", choices=["eager", "aot_eager", "inductor"], default="aot_eager")
p.add_argument("--fsdp1", action="store_true", help="FullyShardedDataParallel instead of fully_shard")
p.add_argument("--checkpoint-at", type=int, nargs="*", default=(),
               help="save a distributed checkpoint (model and optimizer) after these steps of the loop")
args = p.parse_args()
if args.compile:
    _dynamo_report.watch()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.norm = nn.LayerNorm(w)
        self.up = nn.Linear(w, 4 * w)
        self.down = nn.Linear(4 * w, w)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


model = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)], nn.Linear(args.width, 8)).to(device)
if args.fsdp1:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=device,
                                     sharding_strategy=ShardingStrategy.FULL_SHARD)
else:
    for block in model[:-1]:
        if args.compile:
            block.compile(backend=args.backend)
        fully_shard(block)
    fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(rank)
try:
    for step in range(args.steps):
        x = torch.randn(args.batch_size, args.width, generator=g).to(device)
        y = torch.randint(0, 8, (args.batch_size,), generator=g).to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in args.checkpoint_at:
            import tempfile

            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            # One directory for both ranks: rank 0 makes it and tells the other.
            where = [tempfile.mkdtemp(prefix="stack-dcp-") if rank == 0 else None]
            dist.broadcast_object_list(where, src=0)
            model_state, optim_state = get_state_dict(model, opt)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=where[0])
            if rank == 0:  # the save ends once rank 0 has written the metadata of every rank's files
                import shutil

                shutil.rmtree(where[0])
finally:  # also when the run is stopped from outside (the profiler's step budget) by an exception
    if args.compile and rank == 0:
        print(_dynamo_report.line(backend=args.backend, world=world), flush=True)
if rank == 0:
    print(f"fsdp2 done, loss {loss.item():.4f}")
dist.destroy_process_group()
