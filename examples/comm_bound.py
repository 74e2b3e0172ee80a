"""A DDP script whose gradient all-reduce is the bottleneck (planted: communication bound).

The model is mostly parameters: a large embedding table with dense gradients plus a wide
linear layer, about 13 M parameters (≈ 50 MiB of fp32 gradients reduced every step), fed
a tiny batch (`--batch-size 4`) so there is almost no compute to hide the all-reduce behind.
Fixes a profiler should weigh: bigger batches / gradient accumulation (fewer all-reduces
per sample), sparse embedding gradients, gradient compression, bucket tuning.

    torchrun --standalone --nproc-per-node 2 examples/comm_bound.py --steps 50
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
    p.add_argument("--vocab-size", type=int, default=32768, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=256, help="embedding width")
    p.add_argument("--hidden", type=int, default=2048, help="width of the wide hidden layer")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sample")
    p.add_argument("--num-classes", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4, help="samples per rank per step")
    p.add_argument("--num-samples", type=int, default=8192, help="size of the synthetic data set")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps to run")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of data and model")
    p.add_argument("--log-every", type=int, default=20, help="print the loss every k steps")
    return p.parse_args()


class BagClassifier(nn.Module):
    """Mean of token embeddings -> wide MLP -> class logits."""

    def __init__(self, *, vocab_size: int, dim: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        # Dense (sparse=False) gradients: the whole table is all-reduced every step.
        self.embed = nn.Embedding(vocab_size, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens).mean(dim=1)
        h = F.relu(self.up(h))
        h = F.relu(self.down(h))
        return self.head(h)


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
    tokens = torch.randint(0, args.vocab_size, (args.num_samples, args.seq_len))
    labels = tokens[:, 0] % args.num_classes  # learnable: the class is a function of the first token
    dataset = TensorDataset(tokens, labels)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True) if ddp else None
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, shuffle=sampler is None, drop_last=True
    )

    model = BagClassifier(
        vocab_size=args.vocab_size, dim=args.dim, hidden=args.hidden, num_classes=args.num_classes
    ).to(device)
    if ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # Plain SGD keeps the optimizer's own cost small next to the all-reduce.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    if master:
        num_params = sum(p.numel() for p in model.parameters())
        print(
            f"comm_bound: world_size={world_size} device={device} params={num_params:,} "
            f"grad_bytes={num_params * 4 / 2**20:.1f} MiB batch_size={args.batch_size}",
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
