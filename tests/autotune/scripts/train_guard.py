"""A tiny torchrun DDP classifier for the tuner's guards: the data is seeded, the model is not.

Every run initialises its model differently (no `torch.manual_seed`), so the loss moves from
run to run by itself: the loss guard must measure that spread instead of crying wolf. The
data is the same in every run (its own seeded generator). With `--iterable` the samples come
from an `IterableDataset` that does not shard across DataLoader workers: with k workers every
sample is read k times (the data guard must refuse it).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--iterable", action="store_true")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
g = torch.Generator().manual_seed(0)
x = torch.randn(2048, 16, generator=g)
y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)


class Stream(IterableDataset):
    """This rank's share of the samples, in order; every worker yields all of it (no get_worker_info())."""

    def __iter__(self):
        for i in range(rank, len(x), world):
            yield x[i], y[i]


if args.iterable:
    loader = DataLoader(Stream(), batch_size=16)
else:
    ds = TensorDataset(x, y)
    loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, shuffle=True, seed=0))
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
opt = torch.optim.Adam(model.parameters(), lr=0.05)
epoch = 0
while True:  # the tuner's step budget ends the run
    if not args.iterable:
        loader.sampler.set_epoch(epoch)
    for xb, yb in loader:
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    epoch += 1
