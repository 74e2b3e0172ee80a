"""API mode: one script, every strategy kind (DDP, FSDP2, HSDP, pipeline).

The strategy comes from the torsh-tune run's config (`[strategy] kind = "fsdp"` ...), or from
`--config FILE` under bare torchrun, or is plain DDP; alone (no launcher) it trains in one
process. The model is a stack of residual MLP blocks, so the pipeline can split it at
`blocks.N` and FSDP shards each block as its own unit.

    torsh-tune profile --nproc-per-node 2 --config strat.toml examples/api_strategies.py
    torchrun --standalone --nproc-per-node 2 examples/api_strategies.py --config strat.toml
    python examples/api_strategies.py                       # one process, no distribution
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn

import torsh_tune as tt


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim_in: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim_in, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--split", nargs="*", default=None, help="pipeline split points (default: from the config)")
    parser.add_argument("--config", default=None, help="strategy TOML for runs outside torsh-tune")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial model on every rank
    model = Net(32, args.width, args.depth, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    teacher = torch.nn.Linear(32, 10)  # a learnable task: labels from a fixed random linear map

    replica = 0  # which data-parallel replica this rank feeds (a pipeline is one replica)

    def batch_for(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * step + replica)
        x = torch.randn(args.batch, 32, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(dim=1)
        return x, y

    model, optimizer = tt.parallelize(model, optimizer, example_batch=batch_for(0), loss_fn=loss_fn,
                                      split_points=args.split, config=args.config)
    replica, _ = tt.data_parallel_info(model)
    for step in range(args.steps):
        loss = tt.train_step(model, optimizer, batch_for(step), loss_fn)
        if step % 10 == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if dist.is_initialized():
        # Free the model (DDP's reducer holds the gloo process group) while no collective is in
        # flight: a reducer freed at interpreter exit joins gloo's worker with the GIL held and,
        # torch 2.13, deadlocks in about 1 run in 8 when that worker still needs the GIL.
        dist.barrier()
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
