"""A DeepSpeed/Megatron-style engine: gradients bucketed and all-reduced asynchronously during backward.

Knows nothing about torsh-tune and uses no DDP. Each parameter's post-accumulate-grad hook
copies its gradient into a flat bucket; a full bucket is all-reduced at once with
`async_op=True` (so the last layers' gradients travel while the first layers' are still being
computed, as ZeRO-1/2's `overlap_comm` and Megatron's DDP do); `engine.step()` waits for every
bucket, copies the averaged gradients back and steps the optimizer. Runs on CUDA/NCCL when a
GPU is there, else CPU/gloo.

    torchrun --standalone --nproc-per-node 2 stack_overlap_engine.py --steps 30
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--width", type=int, default=512)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--bucket-mb", type=float, default=2.0, help="bucket size in MiB of fp32 gradients")
args = p.parse_args()


class Engine:
    """Buckets in reverse parameter order (the order backward produces gradients), each reduced when full."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: int):
        self.model, self.optimizer = model, optimizer
        self.world = dist.get_world_size()
        params = [p for p in model.parameters() if p.requires_grad]
        self.buckets: list[list[nn.Parameter]] = [[]]
        for param in reversed(params):
            if self.buckets[-1] and sum(q.numel() * 4 for q in self.buckets[-1]) + param.numel() * 4 > bucket_bytes:
                self.buckets.append([])
            self.buckets[-1].append(param)
        self.flat = [torch.zeros(sum(q.numel() for q in b), device=params[0].device) for b in self.buckets]
        self.where = {}
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for param in bucket:
                self.where[param] = (i, offset)
                offset += param.numel()
                param.register_post_accumulate_grad_hook(self._ready)
        self.pending = [0] * len(self.buckets)
        self.works: list = []

    def _ready(self, param: nn.Parameter) -> None:
        i, offset = self.where[param]
        self.flat[i][offset:offset + param.numel()].copy_(param.grad.reshape(-1))
        self.pending[i] += 1
        if self.pending[i] == len(self.buckets[i]):
            self.works.append(dist.all_reduce(self.flat[i], async_op=True))

    def backward(self, loss: torch.Tensor) -> None:
        self.pending = [0] * len(self.buckets)
        loss.backward()

    def step(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        for i, bucket in enumerate(self.buckets):
            self.flat[i].div_(self.world)
            for param in bucket:
                _, offset = self.where[param]
                param.grad.copy_(self.flat[i][offset:offset + param.numel()].view_as(param.grad))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank = dist.get_rank()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)
layers = [nn.Linear(64, args.width), nn.GELU()]
for _ in range(args.layers):
    layers += [nn.Linear(args.width, args.width), nn.GELU()]
model = nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)
engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.01), int(args.bucket_mb * 2**20))
g = torch.Generator().manual_seed(rank)
for step in range(args.steps):
    x = torch.randn(args.batch_size, 64, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    engine.backward(nn.functional.cross_entropy(model(x), y))
    engine.step()
if rank == 0:
    print(f"overlap engine done, {len(engine.buckets)} buckets")
dist.destroy_process_group()
