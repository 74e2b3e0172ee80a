"""API mode under bare torchrun (or alone): accumulation, LR scaling and clipping, checked against plain training.

Writes OUT.rank{r}.json with the final parameter checksums of:
  acc2   - parallelize(config: gradient_accumulation_steps=2), 2 train_step calls of b samples per step
  big    - gradient_accumulation_steps=1, one call with the 2b samples of those two calls
  scaled - lr_scaling=linear, lr_warmup_steps=2, max_grad_norm=0.5 (learning rates seen each step)
"""

import gc
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

import torsh_tune as tt
from torsh_tune.config import RunConfig

out = sys.argv[1]
B = 8


def model_and_opt():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def data(step, micro, rank):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(B, 16, generator=g), torch.randn(B, 4, generator=g)


def checksum(model):
    inner = getattr(model, "module", model)
    return [float(p.detach().double().sum()) for p in inner.parameters()]


loss_fn = nn.MSELoss()
rank = 0
results = {}

m, opt = model_and_opt()
cfg = RunConfig().apply_patch({"training": {"gradient_accumulation_steps": 2}}).strategy
m, opt2 = tt.parallelize(m, opt, config=cfg)
rank = dist.get_rank() if dist.is_initialized() else 0
results["same_optimizer"] = opt2 is opt
results["kind"] = type(m).__name__
for step in range(3):
    for micro in range(2):
        tt.train_step(m, opt2, data(step, micro, rank), loss_fn)
results["acc2"] = checksum(m)

m, opt = model_and_opt()
m, opt = tt.parallelize(m, opt, config=RunConfig().strategy)
for step in range(3):
    (x0, y0), (x1, y1) = data(step, 0, rank), data(step, 1, rank)
    tt.train_step(m, opt, (torch.cat([x0, x1]), torch.cat([y0, y1])), loss_fn)
results["big"] = checksum(m)

m, opt = model_and_opt()
cfg = RunConfig().apply_patch({"training": {"lr_scaling": "linear", "lr_warmup_steps": 2, "max_grad_norm": 0.5}}).strategy
m, opt = tt.parallelize(m, opt, config=cfg)
lrs = []
for step in range(4):
    tt.train_step(m, opt, data(step, 0, rank), loss_fn)
    lrs.append(opt.param_groups[0]["lr"])
results["lrs"] = lrs
results["world"] = dist.get_world_size() if dist.is_initialized() else 1
with open(f"{out}.rank{rank}.json", "w") as f:
    json.dump(results, f)
if dist.is_initialized():
    # Free the three DDP models (their reducers hold the gloo group) while no collective is in
    # flight, as examples/api_strategies.py does: torch 2.13 otherwise aborts or hangs at exit
    # now and then ("terminate called without an active exception").
    dist.barrier()
    del m, opt, opt2
    gc.collect()
    dist.destroy_process_group()
