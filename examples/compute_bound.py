"""A healthy, compute-bound DDP script (the control: nothing is planted).

A small convolutional network (about 8 k parameters, so ≈ 30 KB of gradients) runs
on a large batch of in-memory images (64 per rank): almost all of each step is forward and backward
compute, the gradient all-reduce is tiny and data comes from memory. A profiler should
find no communication, data or straggler bottleneck here; a faster step needs a faster
device (or a smaller model), not different distributed settings.

    torchrun --standalone --nproc-per-node 2 examples/compute_bound.py --steps 50
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=16, help="width of the convolutions")
    p.add_argument("--image-size", type=int, default=32, help="side of the input images")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    p.add_argument("--num-samples", type=int, default=2048, help="size of the synthetic data set")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every k steps")
    return p.parse_args()


class ConvNet(nn.Module):
    """Three 3x3 convolutions at full resolution, then global pooling and a linear head."""

    def __init__(self, *, channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv3 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = nn.Linear(2 * channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.relu(self.conv3(x))
        return self.head(x.mean(dim=(2, 3)))


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
    images = torch.randn(args.num_samples, 3, args.image_size, args.image_size)
    labels = torch.randint(0, args.num_classes, (args.num_samples,))
    dataset = TensorDataset(images, labels)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None, drop_last=True
    )

    model = ConvNet(channels=args.channels, num_classes=args.num_classes).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if master:
        num_params = sum(p.numel() for p in model.parameters())
        print(
            f"compute_bound: world_size={world_size} device={device} params={num_params:,} "
            f"batch_size={args.batch_size}",
            flush=True,
        )

    step, epoch = 0, 0
    while step < args.steps:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            loss = F.cross_entropy(model(xb), yb)
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
