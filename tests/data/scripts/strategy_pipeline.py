"""Train a small chain model with every requested pipeline schedule, in one process group.

Per schedule, every rank builds the same model (seed 0) and the same data; after the first
step it compares its stages' gradients with a single-process reference (the full model on
the full batch, same mean loss), then trains `--steps` SGD steps. `--bubble` adds runs of a
wider model (compute per microbatch well above gloo's send/recv time) for the bubble.
`--check-errors` feeds a batch that does not divide by n_microbatches. Each rank writes
OUT.rank{r}.json: {variant: {"max_grad_diff", "grads_compared", "losses", "ref_loss", "stats"}, "errors": {...}}.
"""

import argparse
import copy
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.config import PipelineConfig
from torsh_tune.errors import ConfigError
from torsh_tune.strategies.pipeline import build_pipeline

from _pipeline_model import DEPTH, Net

p = argparse.ArgumentParser()
p.add_argument("--schedules", default="gpipe,1f1b,interleaved1f1b,loopedbfs,interleavedzb,zbv")
p.add_argument("--microbatches", type=int, default=4)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--bubble", default="", help="comma-separated SCHEDULE:M runs of a wider model, e.g. gpipe:2,gpipe:8")
p.add_argument("--bubble-steps", type=int, default=6)
p.add_argument("--check-errors", action="store_true")
p.add_argument("--out", required=True)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def split_points(num_stages: int) -> list[str]:
    # The same number of blocks per stage: embed and head cost next to nothing.
    return [f"blocks.{s * DEPTH // num_stages}" for s in range(1, num_stages)]


def data(batch: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def run(schedule: str, m: int, *, width: int, batch: int, steps: int) -> dict:
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    cfg = PipelineConfig(schedule=schedule, n_microbatches=m, stages_per_rank=v)
    torch.manual_seed(0)
    model = Net(width)
    reference = copy.deepcopy(model)
    x, y = data(batch)
    ref_loss = nn.functional.mse_loss(reference(x), y)
    ref_loss.backward()
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}

    runner = build_pipeline(model, cfg, loss_fn=nn.functional.mse_loss, example_inputs=x, device="cpu", rank=rank,
                            world_size=world, split_points=split_points(world * v))
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    losses, max_diff, compared = [], None, []
    for step in range(steps):
        opt.zero_grad()
        loss = runner.step(x if runner.is_first else None, target=y if runner.is_last else None)
        if loss is not None:
            losses.append(loss.item())
        if step == 0:
            diffs = []
            for module in runner.stage_modules:
                for name, param in module.named_parameters():
                    diffs.append((param.grad - ref_grads[name]).abs().max().item())
                    compared.append(name)
            max_diff = max(diffs)
        opt.step()
    dist.barrier()
    return {"max_grad_diff": max_diff, "grads_compared": compared, "losses": losses, "ref_loss": ref_loss.item(),
            "stats": runner.stats()}


results: dict = {}
for schedule in args.schedules.split(","):
    if schedule:
        results[schedule] = run(schedule, args.microbatches, width=32, batch=32, steps=args.steps)
for spec in (s for s in args.bubble.split(",") if s):
    schedule, m = spec.split(":")
    results[f"bubble.{schedule}.m{m}"] = run(schedule, int(m), width=1024, batch=128, steps=args.bubble_steps)

if args.check_errors:
    # Only ranks that hold the batch or the target check it, and they raise before any
    # communication: a rank in the middle would wait for a microbatch that never comes.
    torch.manual_seed(0)
    model = Net(32)
    x, y = data(30)
    runner = build_pipeline(model, PipelineConfig(schedule="gpipe", n_microbatches=4), loss_fn=nn.functional.mse_loss,
                            example_inputs=x, device="cpu", rank=rank, world_size=world,
                            split_points=split_points(world))
    errors = {}
    if runner.is_first or runner.is_last:
        try:
            runner.step(x if runner.is_first else None, target=y if runner.is_last else None)
            errors["indivisible_batch"] = None
        except ConfigError as exc:
            errors["indivisible_batch"] = str(exc)
    results["errors"] = errors

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
