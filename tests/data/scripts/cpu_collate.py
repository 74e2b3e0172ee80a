"""A DDP script whose DataLoader collate is CPU-heavy, and whose ranks keep every core of the host busy.

The collate runs in the training process (num_workers 0) and multiplies matrices, as does the
model, on as many threads as the process has cores: with two ranks the host has no idle core
left in the data wait nor in the compute, so more DataLoader workers cannot make loading
faster. Used by tests/analysis/test_recommend.py.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, idx: int) -> int:
        return idx


def heavy_collate(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(indices[0])
    a = torch.randn(384, 384, generator=g)
    for _ in range(3):  # "augmentation": CPU work on every core this process may use
        a = torch.tanh(a @ a / 384.0)
    x = a[: len(indices) % 384, :16].contiguous()
    return x, torch.tensor([i % 4 for i in indices])


def main() -> None:
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    dist.init_process_group("gloo")
    model = DDP(nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(), batch_size=128, collate_fn=heavy_collate, num_workers=0)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step >= 200:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
