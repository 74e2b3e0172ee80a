"""A DDP script whose input pipeline is the bottleneck (planted: slow data loading).

Every sample is read from (emulated) remote storage — `--read-ms` of latency per sample, as
from a network file system or object store — then "decoded" and augmented on the CPU in
`__getitem__` (random image, crop, flip, colour jitter, blur, resize, normalise: about 2 ms per
sample at the default `--image-size 160`), and the DataLoader runs in the training process
(`--num-workers 0`), so the model waits for data for most of every step. The fix a profiler should find is more
DataLoader workers (and prefetching), not a different model.

    torchrun --standalone --nproc-per-node 2 examples/data_bound.py --steps 50
    python examples/data_bound.py --steps 50 --num-workers 2
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--read-ms", type=float, default=2.0, help="storage read latency per sample (ms)")
    p.add_argument("--image-size", type=int, default=160, help="side of the decoded image (cost per sample)")
    p.add_argument("--input-size", type=int, default=32, help="side of the image the model sees")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-samples", type=int, default=4096, help="size of the synthetic data set")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every k steps")
    return p.parse_args()


class SyntheticImages(Dataset):
    """Images generated and augmented on demand, deterministic per (seed, index)."""

    def __init__(self, *, num_samples: int, image_size: int, input_size: int, num_classes: int, seed: int,
                 read_s: float = 0.0) -> None:
        self.num_samples = num_samples
        self.read_s = read_s
        self.image_size = image_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.seed = seed
        k = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0])
        k = k[:, None] * k[None, :]
        self.blur = (k / k.sum()).expand(3, 1, 5, 5).contiguous()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, int]:
        if self.read_s:
            time.sleep(self.read_s)  # waiting for storage: no CPU used, so workers can overlap it
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        size = self.image_size
        # "Decode": a uint8 image, as a JPEG decoder would hand it over.
        img = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=g)
        x = img.float().div_(255.0)
        crop = size * 7 // 8
        i, j = torch.randint(0, size - crop + 1, (2,), generator=g).tolist()
        x = x[:, i : i + crop, j : j + crop]
        if torch.rand((), generator=g) < 0.5:
            x = x.flip(-1)
        x = x * (0.8 + 0.4 * torch.rand(3, 1, 1, generator=g)) + 0.1 * (torch.rand((), generator=g) - 0.5)
        x = F.conv2d(x.unsqueeze(0), self.blur, padding=2, groups=3)
        x = F.interpolate(x, size=(self.input_size, self.input_size), mode="bilinear", align_corners=False)
        x = x.squeeze(0)
        x = (x - x.mean(dim=(1, 2), keepdim=True)) / (x.std(dim=(1, 2), keepdim=True) + 1e-5)
        return x, idx % self.num_classes


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
    dataset = SyntheticImages(
        num_samples=args.num_samples,
        image_size=args.image_size,
        input_size=args.input_size,
        num_classes=args.num_classes,
        seed=args.seed,
        read_s=args.read_ms / 1000.0,
    )
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        sampler=sampler,
        shuffle=sampler is None,
        drop_last=True,
        num_workers=args.num_workers,
    )

    # A deliberately small model: the step has little compute to hide the input pipeline behind.
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, args.num_classes),
    ).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if master:
        print(
            f"data_bound: world_size={world_size} device={device} num_workers={args.num_workers} "
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
