"""A tiny torchrun DDP training loop that fails on purpose, one way per trial.

The failure is chosen, first match wins, by:

- `--trial-mode NUMBER=MODE` (repeatable): MODE in the tuner's trial NUMBER (its run
  directory is trials/NNNN), whatever the sampler chose;
- `--mode MODE`;
- the trial's DDP bucket cap, read from the run's config document (TORSH_TUNE_CONFIG)
  through `MODES_BY_BUCKET_CAP_MB`, so that a study can plant failures in its space.

`--rank` picks the failing rank (default 1) and `--at-step` the step where it fails (default 2).

Modes:
    ok               train until the tuner's step budget stops the run
    exception        raise RuntimeError on the failing rank
    memory_error     raise MemoryError on the failing rank (what an allocation failure raises)
    sigkill          the failing rank SIGKILLs itself (as the kernel's OOM killer would)
    hang             the failing rank stops making progress: sleeps, without entering
                     the next collective (the peer waits in its all-reduce)
    exit_abort       the run completes, then the failing rank aborts (SIGABRT) at interpreter
                     exit, after every rank wrote its exit record
"""

import argparse
import atexit
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

#: Planted failures of a study: the trial's `ddp.bucket_cap_mb` -> mode.
MODES_BY_BUCKET_CAP_MB = {101.0: "exception", 102.0: "memory_error", 103.0: "sigkill"}

parser = argparse.ArgumentParser()
parser.add_argument("--mode")
parser.add_argument("--trial-mode", action="append", default=[], metavar="NUMBER=MODE")
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--at-step", type=int, default=2)
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
run_dir = Path(os.environ["TORSH_TUNE_RUN_DIR"])
by_trial = {f"{int(n):04d}": m for n, m in (item.split("=") for item in args.trial_mode)}
mode = by_trial.get(run_dir.name) if run_dir.parent.name == "trials" else None
mode = mode or args.mode
if mode is None:
    raw = os.environ["TORSH_TUNE_CONFIG"]  # a path or the JSON document itself
    cfg = json.loads(raw if raw.lstrip().startswith("{") else Path(raw).read_text())
    mode = MODES_BY_BUCKET_CAP_MB.get(cfg["strategy"]["ddp"]["bucket_cap_mb"], "ok")
failing = rank == args.rank
print(f"fail_modes: rank {rank} mode={mode} failing={failing}", flush=True)


def abort_at_exit() -> None:
    # Wait for every exit record, so that the run is complete on every rank before the abort.
    ranks_dir = run_dir / "ranks"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if len(list(ranks_dir.glob("rank*.exit.json"))) == world_size:
            break
        time.sleep(0.05)
    print("fail_modes: aborting at exit", flush=True)
    os.abort()


if mode == "exit_abort" and failing:
    atexit.register(abort_at_exit)

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
ds = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, shuffle=False))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
while True:  # the tuner's step budget ends the run
    for step, (x, y) in enumerate(loader):
        if failing and step == args.at_step:
            if mode == "exception":
                raise RuntimeError(f"injected failure: exception on rank {rank} at step {step}")
            if mode == "memory_error":
                raise MemoryError(f"injected failure: out of host memory on rank {rank}")
            if mode == "sigkill":
                print(f"fail_modes: rank {rank} kills itself with SIGKILL", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "hang":
                print(f"fail_modes: rank {rank} hangs", flush=True)
                time.sleep(3600)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
