"""DDP with torch's ZeroRedundancyOptimizer (ZeRO-1): each rank steps AdamW over its shard of the
parameters, then broadcasts the updated shard to the others inside `step()`.

Knows nothing about torsh-tune. Runs on CUDA/NCCL when a GPU is there, else CPU/gloo.

    torchrun --standalone --nproc-per-node 2 stack_zero.py --steps 30
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=256)
p.add_argument("--batch-size", type=int, default=32)
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                          nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 4)).to(device))
opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x, y = torch.randn(args.batch_size, 64, generator=g).to(device), torch.randint(0, 4, (args.batch_size,), generator=g).to(device)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
if rank == 0:
    print(f"zero done, loss {loss.item():.4f}")
dist.destroy_process_group()
