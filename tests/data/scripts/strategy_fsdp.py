"""Train one small block model per FSDP2/HSDP variant, in one process group.

Every variant starts from the same seed and trains on the same fixed global batch (each
rank takes its slice), beside a single-process reference: a copy of the unsharded model
trained on the whole global batch on this rank. Each rank writes OUT.rank{r}.json with,
per variant: the FSDPInfo, the first step's gradient and post-step parameter differences
from the reference, the global loss of every step, a checksum of the gathered full state
and the local size of blocks.0's registered weight between forward and backward.
"""

import argparse
import copy
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torsh_tune.config import FSDPConfig
from torsh_tune.strategies.fsdp import apply_fsdp, gather_full_state

VARIANTS = {
    "full": ("fsdp", {}),
    "grad_op": ("fsdp", {"reshard_after_forward": False}),
    "reshard_1": ("fsdp", {"reshard_after_forward": 1}),
    "reshard_2": ("fsdp", {"reshard_after_forward": 2}),
    "bf16": ("fsdp", {"mixed_precision": "bf16"}),
    "fp16_bf16_reduce": ("fsdp", {"mixed_precision": "fp16", "reduce_dtype": "bf16"}),
    "bf16_reduce_only": ("fsdp", {"reduce_dtype": "bf16"}),
    "wrap": ("fsdp", {"wrap": ["blocks.1", "head"]}),
    "cpu_offload": ("fsdp", {"cpu_offload": True}),
    "hsdp": ("hsdp", {"replicate_degree": 2}),
    "hsdp_nodes": ("hsdp", {}),  # replicate degree from --ranks-per-node
    "root_only": ("fsdp", {}),  # a model without blocks: the root is the only unit
}

p = argparse.ArgumentParser()
p.add_argument("--variants", default="full,grad_op,bf16")
p.add_argument("--steps", type=int, default=20)
p.add_argument("--lr", type=float, default=0.1)
p.add_argument("--ranks-per-node", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank")
p.add_argument("--out", required=True)
args = p.parse_args()

if args.device == "cuda":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
else:
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x):
        return self.act(self.lin(x))


class Model(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu(), b.detach().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != t.device_mesh.device_type:  # CPU-offloaded shards gather on the mesh's device
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


g = torch.Generator().manual_seed(1)
micro = 8
x_all = torch.randn(micro * world, 8, generator=g).to(device)
y_all = torch.sin(x_all.sum(dim=1, keepdim=True))
x_mine, y_mine = x_all[rank * micro:(rank + 1) * micro], y_all[rank * micro:(rank + 1) * micro]

results = {}
for name in args.variants.split(","):
    kind, options = VARIANTS[name]
    torch.manual_seed(0)
    model = Model(depth=0 if name == "root_only" else 3)
    ref = copy.deepcopy(model).to(device)
    info = apply_fsdp(model, FSDPConfig(**options), kind=kind, world_size=world, ranks_per_node=args.ranks_per_node,
                      device=device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    losses, ref_losses, grad_diff, param_diff, post_forward_numel = [], [], {}, {}, None
    for step in range(args.steps):
        loss = nn.functional.mse_loss(model(x_mine), y_mine)
        if step == 0 and len(model.blocks):
            w = model.blocks[0].lin.weight
            post_forward_numel = (w.to_local() if isinstance(w, DTensor) else w).numel()
        loss.backward()
        ref_loss = nn.functional.mse_loss(ref(x_all), y_all)
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        if step == 0:
            ref_params = dict(ref.named_parameters())
            for n, prm in model.named_parameters():
                grad_diff[n] = rel_diff(full_tensor(prm.grad), ref_params[n].grad)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        if step == 0:
            full = gather_full_state(model)
            param_diff = {n: rel_diff(full[n], prm.detach()) for n, prm in ref.named_parameters()}
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
    full = gather_full_state(model)
    digest = hashlib.sha256()
    for key in sorted(full):
        digest.update(full[key].cpu().contiguous().numpy().tobytes())
    final_diff = max(rel_diff(full[n], prm.detach()) for n, prm in ref.named_parameters())
    results[name] = {
        "info": json.loads(json.dumps(info.to_dict())),
        "grad_diff": grad_diff,
        "param_diff": param_diff,
        "final_param_diff": final_diff,
        "losses": losses,
        "ref_losses": ref_losses,
        "checksum": digest.hexdigest(),
        "full_keys": sorted(full),
        "post_forward_numel": post_forward_numel,
        "param_devices": sorted({prm.device.type for prm in model.parameters()}),
    }
    del model, opt

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
