"""A script that averages gradients by hand: dist.all_reduce on each grad after backward, no DDP.

With `--functional`, through `torch.distributed._functional_collectives` instead (the traceable API
that DTensor and compiled code use), each result waited for at its first use.
Knows nothing about torsh-tune. Runs on CUDA/NCCL when a GPU is there, else CPU/gloo.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--functional", action="store_true", help="average with functional collectives")
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                      nn.Linear(args.width, 4)).to(device)
ds = TensorDataset(torch.randn(4096, 64), torch.randint(0, 4, (4096,)))
loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step, epoch = 0, 0
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        for prm in model.parameters():
            if args.functional:
                prm.grad.copy_(funcol.all_reduce(prm.grad, "sum", dist.group.WORLD))
            else:
                dist.all_reduce(prm.grad)
            prm.grad /= world
        opt.step()
        opt.zero_grad()
        step += 1
        if step >= args.steps:
            break
    epoch += 1
if rank == 0:
    print(f"allreduce done, loss {loss.item():.4f}")
dist.destroy_process_group()
