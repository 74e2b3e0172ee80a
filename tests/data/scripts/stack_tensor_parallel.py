"""Tensor parallelism applied by the script: DTensor's parallelize_module, column- then row-wise per MLP.

Knows nothing about torsh-tune. Each block's output is all-reduced across the mesh (RowwiseParallel's
Partial -> Replicate) through torch.distributed._functional_collectives, not the torch.distributed
functions: the collective completes at the tensor's first use (`wait_tensor`). Runs on CUDA/NCCL when a
GPU is there, else CPU/gloo.

    torchrun --standalone --nproc-per-node 2 stack_tensor_parallel.py --steps 30
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=256)
p.add_argument("--blocks", type=int, default=3)
p.add_argument("--batch-size", type=int, default=32)
args = p.parse_args()

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.up = nn.Linear(w, 4 * w)
        self.down = nn.Linear(4 * w, w)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


model = nn.Sequential(*[MLP(args.width) for _ in range(args.blocks)]).to(mesh.device_type)
for block in model:
    parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
g = torch.Generator().manual_seed(0)  # every rank sees the same batch: tensor parallelism splits the model
for step in range(args.steps):
    x = torch.randn(args.batch_size, args.width, generator=g).to(mesh.device_type)
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 0:
    print(f"tensor parallel done, loss {loss.item():.4f}")
dist.destroy_process_group()
