"""torch.compile(DDP(model)) on a tiny MLP: Dynamo's DDPOptimizer splits the graph at DDP's buckets.

Knows nothing about torsh-tune. Runs on CUDA/NCCL when a GPU is there, else CPU/gloo.
`--backend` picks the torch.compile backend (eager | aot_eager | inductor; default
aot_eager, which needs no C++ compiler); `--compile-step` compiles the optimizer step too
(a function calling `opt.step()`, PyTorch's recipe for a compiled optimizer). `--bucket-cap-mb`
is 1 MB by default (the smallest the DDPOptimizer accepts) so that this small model has
several DDP buckets, hence several Dynamo subgraphs.

At exit (also when the run is stopped from outside by an exception unwinding the script),
rank 0 prints one `DYNAMO {...}` line (`_dynamo_report.py`), with ddp_optimizer_buckets = the
bucket (= subgraph) count of each graph DDPOptimizer split.

    torchrun --standalone --nproc-per-node 2 stack_compile_ddp.py --steps 30 --backend aot_eager
"""

import argparse
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import _dynamo_report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--backend", choices=["eager", "aot_eager", "inductor"], default="aot_eager")
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch-size", type=int, default=32)
# Dynamo's DDPOptimizer asserts bucket_cap >= DDP's 1 MB first bucket, so 1 MB is the
# smallest usable value; with width 512 (~2.3 MB of fp32 gradients) that is 3 buckets.
p.add_argument("--bucket-cap-mb", type=float, default=1.0)
p.add_argument("--compile-step", action="store_true",
               help="also compile the optimizer step (a function calling opt.step(), as PyTorch's recipe does)")
args = p.parse_args()
_dynamo_report.watch()
# DDPOptimizer says at INFO how many buckets (= compiled subgraphs) it split the graph into.
_ddp_buckets: list[int] = []


class _Buckets(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "DDPOptimizer used bucket cap" in str(record.msg) and len(record.args or ()) >= 2:
            _ddp_buckets.append(int(record.args[1]))


_ddp_log = logging.getLogger("torch._dynamo.backends.distributed")
_ddp_log.addHandler(_Buckets(level=logging.INFO))
_ddp_log.setLevel(logging.INFO)

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)



# A user-defined module on purpose: Dynamo skips frames that live in torch/ itself, so
# compiling DDP around a bare nn.Sequential captures no graph at all (unique_graphs 0).
class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = nn.functional.gelu(self.inp(x))
        for layer in self.hidden:
            x = nn.functional.gelu(layer(x))
        return self.out(x)


model = MLP(args.width).to(device)
n_params = sum(p.numel() for p in model.parameters())
ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_cap_mb)
compiled = torch.compile(ddp, backend=args.backend)
opt = torch.optim.SGD(compiled.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(rank)


def optimizer_step():
    opt.step()


if args.compile_step:
    optimizer_step = torch.compile(optimizer_step, backend=args.backend)


step, loss = 0, None
try:
    while step < args.steps:
        x = torch.randn(args.batch_size, 64, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        optimizer_step()
        opt.zero_grad()
        step += 1
finally:
    if rank == 0:
        print(_dynamo_report.line(backend=args.backend, world=world, params=n_params, ddp_optimizer_buckets=_ddp_buckets),
              flush=True)
        sys.stdout.flush()
if rank == 0:
    print(f"compile_ddp done, {step} steps, loss {loss.item():.4f}, backend {args.backend}")
dist.destroy_process_group()
