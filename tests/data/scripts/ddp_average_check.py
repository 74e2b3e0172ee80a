"""DDP's averaged gradients against the ranks' own gradients averaged by hand, for whatever comm hook the
run put on DDP: two copies of one model, each rank its own batches; writes the largest difference of
each step to the JSON file named by argv[1] (rank 0)."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                          torch.nn.Linear(256, 4))
reference = copy.deepcopy(net)
model = DistributedDataParallel(net, bucket_cap_mb=0.1)  # several buckets
opt = torch.optim.SGD(model.parameters(), lr=0.01)
worst = []
for step in range(4):
    torch.manual_seed(100 + 10 * step + rank)
    x = torch.randn(8, 64)
    opt.zero_grad()
    model(x).square().sum().backward()
    reference.zero_grad()
    reference(x).square().sum().backward()
    diff = 0.0
    for p, q in zip(model.parameters(), reference.parameters()):
        mean = q.grad.clone()
        dist.all_reduce(mean)
        mean /= world
        diff = max(diff, (p.grad - mean).abs().max().item() / max(mean.abs().max().item(), 1e-12))
    worst.append(diff)
    opt.step()
    with torch.no_grad():
        for p, q in zip(model.parameters(), reference.parameters()):
            q.copy_(p)
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(worst, f)
dist.destroy_process_group()
