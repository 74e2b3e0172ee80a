"""The hierarchical all-reduce against gloo's own, for several node layouts, in one process group.

For each ranks_per_node in --layouts: the hierarchical sum of random tensors of --sizes
(issued back to back, waited for at the end) against `dist.all_reduce`, and a small DDP
model (odd-sized buckets) trained with `hierarchical_hook` against the same model with a
plain all-reduce hook (same seed and data). One more DDP model registers no hook: under the
torsh-tune bootstrap with `collectives.hierarchical` it gets the configured hook (zero code).
Each rank writes OUT.rank{r}.json.
"""

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.strategies.collectives import HierarchicalState, hierarchical_all_reduce, hierarchical_hook

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--layouts", default="2,4,1", help="ranks_per_node values")
p.add_argument("--sizes", default="1,2,3,7,64,1001,65537")
p.add_argument("--steps", type=int, default=5)
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sizes = [int(s) for s in args.sizes.split(",")]


def plain_allreduce(state, bucket):
    t = bucket.buffer().div_(world)
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


def train(hook=None, state=None):
    """(per-step flat gradients, parameter checksum) of a DDP model with 3 buckets (596, 2112, 1071 values)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 63), nn.Tanh(), nn.Linear(63, 33), nn.Tanh(), nn.Linear(33, 17), nn.Tanh(),
                           nn.Linear(17, 1))
    model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=0.002)
    if hook is not None:
        model.register_comm_hook(state, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(100 + rank)
    grads = []
    for _ in range(args.steps):
        x = torch.randn(32, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), x[:, :1].sin())
        loss.backward()
        grads.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]))
        opt.step()
        opt.zero_grad()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    return grads, hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


ref_grads, _ = train(plain_allreduce)
results = {}
for per_node in (int(s) for s in args.layouts.split(",")):
    state = HierarchicalState(ranks_per_node=per_node)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n)) for n in sizes]
    xs.append(torch.randn(3, 5, generator=torch.Generator().manual_seed(rank)))  # 2-D, 15 values
    refs = [x.clone() for x in xs]
    for ref in refs:
        dist.all_reduce(ref)
    futures = [hierarchical_all_reduce(x, state) for x in xs]  # all in flight at once
    for fut, x in zip(futures, xs):
        assert fut.wait() is x
    rel_err = {str(x.numel()): ((x - ref).abs() / ref.abs().clamp(min=1)).max().item() for x, ref in zip(xs, refs)}
    allreduce_stats = dict(state.stats)
    grads, checksum = train(hierarchical_hook, state)
    # The same with 1000-value chunks: 1001 and 65537 values, and DDP's 2112-value bucket, pipeline.
    chunked = HierarchicalState(ranks_per_node=per_node, chunk_bytes=4000)
    ys = [x.clone() for x in refs]  # already summed: sum again, compare with gloo's
    yrefs = [y.clone() for y in ys]
    for ref in yrefs:
        dist.all_reduce(ref)
    for fut, y in zip([hierarchical_all_reduce(y, chunked) for y in ys], ys):
        assert fut.wait() is y
    chunked_err = max(((y - ref).abs() / ref.abs().clamp(min=1)).max().item() for y, ref in zip(ys, yrefs))
    chunked_calls = chunked.stats["calls"]
    chunked_grads, chunked_checksum = train(hierarchical_hook, chunked)
    results[str(per_node)] = {
        "chunked_rel_err": chunked_err,
        "chunked_calls": chunked_calls,
        "chunked_grad_max_diff": max_diff(chunked_grads, ref_grads),
        "chunked_checksum": chunked_checksum,
        "num_nodes": state.num_nodes,
        "allreduce_rel_err": rel_err,
        "allreduce_stats": allreduce_stats,
        "grad_max_diff": max_diff(grads, ref_grads),
        "checksum": checksum,
        "stats": dict(state.stats),
    }
grads, checksum = train()  # no hook of its own: the run's configured one, if any
results["config"] = {"grad_max_diff": max_diff(grads, ref_grads), "checksum": checksum}

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
