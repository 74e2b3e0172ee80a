"""A tiny torchrun DDP script for tuner tests; rank 1 fails when the trial's bucket cap is > 100 MiB.

The planted failure reads the trial's config document (TORSH_TUNE_CONFIG), so one point of
the search space crashes while the rest runs: a trial failure the study must survive. A
bucket cap in (50, 100] MiB makes every step 0.3 s slower: a hopeless trial to be pruned.
"""

import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
cfg = json.loads(open(os.environ["TORSH_TUNE_CONFIG"]).read())
bucket_cap_mb = cfg["strategy"]["ddp"]["bucket_cap_mb"]
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
ds = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, shuffle=False))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
epoch = 0
while True:  # the tuner's step budget ends the run
    for step, (x, y) in enumerate(loader):
        if rank == 1 and bucket_cap_mb is not None and bucket_cap_mb > 100 and step == 2:
            raise RuntimeError(f"planted failure: bucket_cap_mb={bucket_cap_mb}")
        if bucket_cap_mb is not None and 50 < bucket_cap_mb <= 100:
            time.sleep(0.3)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    epoch += 1
