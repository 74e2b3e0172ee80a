"""A plain DDP training script: an MLP on synthetic regression data.

This is the bundled demo. It knows nothing about torsh-tune and runs three ways:

    python examples/ddp_mlp.py --steps 50                                   # one process
    torchrun --standalone --nproc-per-node 2 examples/ddp_mlp.py --steps 50 # DDP on gloo
    torsh-tune profile --nproc-per-node 2 examples/ddp_mlp.py --hidden 512  # profiled

With `--hidden 512` and two CPU ranks a step takes a few tens of milliseconds.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024, help="width of the hidden layers")
    p.add_argument("--layers", type=int, default=3, help="number of hidden layers")
    p.add_argument("--in-features", type=int, default=256, help="input width")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--num-samples", type=int, default=16384, help="size of the synthetic data set")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every k steps")
    return p.parse_args()


def build_model(in_features: int, hidden: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    width = in_features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    blocks.append(nn.Linear(width, 1))
    return nn.Sequential(*blocks)


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
        device = torch.device("cuda", local_rank % torch.cuda.device_count())  # one GPU per rank, or ranks sharing one
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    master = rank == 0

    # Same seed everywhere: every rank builds the same data set and the same initial model.
    torch.manual_seed(args.seed)
    x = torch.randn(args.num_samples, args.in_features)
    w_true = torch.randn(args.in_features, 1) / args.in_features**0.5
    y = torch.sin(x @ w_true) + 0.1 * torch.randn(args.num_samples, 1)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None, drop_last=True
    )

    model = build_model(args.in_features, args.hidden, args.layers).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()
    if master:
        num_params = sum(p.numel() for p in model.parameters())
        print(f"ddp_mlp: world_size={world_size} device={device} params={num_params:,}", flush=True)

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
