"""A DDP script with one slow rank (planted: a straggler).

All ranks train the same MLP on the same kind of data, except that rank `--slow-rank`
(default 1) spends an extra `--delay-ms` (default 30) inside every forward pass, as a host
with a slower CPU, thermal throttling or a noisy neighbour would. The other ranks finish
their compute early and wait for it in the gradient all-reduce, so their step time and
communication time grow while their compute does not. A profiler should name the rank.

    torchrun --standalone --nproc-per-node 2 examples/straggler.py --steps 50
    torchrun --standalone --nproc-per-node 2 examples/straggler.py --delay-ms 0   # healthy twin
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slow-rank", type=int, default=1, help="the rank that is slowed down")
    p.add_argument("--delay-ms", type=float, default=30.0, help="extra time per forward on the slow rank")
    p.add_argument("--hidden", type=int, default=256, help="width of the hidden layers")
    p.add_argument("--layers", type=int, default=2, help="number of hidden layers")
    p.add_argument("--in-features", type=int, default=128, help="input width")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--num-samples", type=int, default=8192, help="size of the synthetic data set")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every k steps")
    return p.parse_args()


class SlowHostMLP(nn.Module):
    """An MLP whose forward takes `delay_s` longer (0 on healthy ranks)."""

    def __init__(self, *, in_features: int, hidden: int, layers: int, delay_s: float) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        width = in_features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        blocks.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*blocks)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay_s > 0:
            time.sleep(self.delay_s)  # the planted slow host
        return self.net(x)


def main() -> None:
    args = parse_args()
    ddp = int(os.environ.get("RANK", -1)) != -1
    if ddp:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    else:
        rank, world_size, local_rank = 0, 1, 0
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    master = rank == 0

    torch.manual_seed(args.seed)
    x = torch.randn(args.num_samples, args.in_features)
    y = x[:, :4].sum(dim=1, keepdim=True).tanh()
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None, drop_last=True
    )

    delay_s = args.delay_ms / 1000.0 if rank == args.slow_rank else 0.0
    model = SlowHostMLP(
        in_features=args.in_features, hidden=args.hidden, layers=args.layers, delay_s=delay_s
    ).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    if master:
        slow = args.slow_rank if 0 <= args.slow_rank < world_size else "none"
        print(
            f"straggler: world_size={world_size} device={device} slow_rank={slow} delay_ms={args.delay_ms}",
            flush=True,
        )

    step, epoch = 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if master and (step % args.log_every == 0 or step == args.steps):
                print(f"step {step:5d}  loss {loss.item():.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1

    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
