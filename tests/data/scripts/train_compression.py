"""Train one small DDP regression model per compression method, in one process group.

Every method starts from the same seed and sees the same data, so the runs differ only by
the comm hook. Each rank writes OUT.rank{r}.json: per method the final eval loss, a
parameter checksum, the first step's averaged gradient and the hook's byte counters.
`--methods config` registers nothing: the torsh-tune bootstrap applies `[compression]`.
"adaptive" is built here with a small `--dense-below` (the model's buckets hold 1088, 2113
and 4160 values: the first stays dense) and is handed every loss, as the runtime does;
"adaptive-no-loss" is the same without the losses (it adapts on the gradient norm).
"""

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.strategies.compression import AdaptiveState, adaptive_hook, build_hook

p = argparse.ArgumentParser()
p.add_argument("--methods", default="none,fp16,bf16,topk,int8,powersgd")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--out", required=True)
p.add_argument("--ratio", type=float, default=0.1)
p.add_argument("--rank", type=int, default=2)
p.add_argument("--min-ratio", type=float, default=0.01)
p.add_argument("--max-ratio", type=float, default=0.25)
p.add_argument("--dense-below", type=int, default=1500, help="adaptive: buckets with fewer values go dense")
p.add_argument("--start-iter", type=int, default=10)
p.add_argument("--bucket-cap-mb", type=float, default=0.002)
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--no-error-feedback", action="store_true")
p.add_argument("--depth", type=int, default=1, help="hidden 64x64 layers (more layers, more buckets)")
p.add_argument("--script-hook-models", default="", help="comma-separated model indices that get our own plain hook")
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def data(seed, n):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=torch.Generator().manual_seed(99)) / 4
    # A smooth teacher plus noise: every method can reach the noise floor (0.01).
    y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


x_train, y_train = data(1000 + rank, 1024)  # each rank its own shard
x_eval, y_eval = data(7, 1024)  # the same on every rank


def plain_allreduce(state, bucket):
    t = bucket.buffer().div_(world)
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


results = {}
script_hook_models = {int(i) for i in args.script_hook_models.split(",") if i}
for i, method in enumerate(args.methods.split(",")):
    torch.manual_seed(0)
    hidden = [m for _ in range(args.depth) for m in (nn.Linear(64, 64), nn.Tanh())]
    module = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), *hidden, nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 1))
    model = nn.parallel.DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if method in ("adaptive", "adaptive-no-loss"):
        state, hook = AdaptiveState(model.process_group, ratio=args.ratio, min_ratio=args.min_ratio,
                                    max_ratio=args.max_ratio, dense_below=args.dense_below,
                                    error_feedback=not args.no_error_feedback), adaptive_hook
        model.register_comm_hook(state, hook)
    elif method == "config":
        state = getattr(model, "_torsh_compression", None)  # the runtime's configured state, for its stats
    elif method != "none":
        state, hook = build_hook(method, model.process_group, ratio=args.ratio, rank=args.rank, start_iter=args.start_iter,
                                 error_feedback=not args.no_error_feedback)
        model.register_comm_hook(state, hook)
    if i in script_hook_models:
        model.register_comm_hook(None, plain_allreduce)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(5 + rank)
    first_grad = None
    for step in range(args.steps):
        idx = torch.randint(0, x_train.shape[0], (64,), generator=g)
        loss = nn.functional.mse_loss(model(x_train[idx]), y_train[idx])
        if method == "adaptive":
            state.observe_loss(loss.detach())
        loss.backward()
        if first_grad is None:
            first_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).tolist()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        eval_loss = nn.functional.mse_loss(model.module(x_eval), y_eval).item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    results[method if method not in results else f"{method}.{i}"] = {
        "eval_loss": eval_loss,
        "checksum": hashlib.sha256(flat.numpy().tobytes()).hexdigest(),
        "first_grad": first_grad,
        "stats": None if state is None else {k: v for k, v in state.stats.items()},
    }
    del model, opt

with open(f"{args.out}.rank{rank}.json", "w") as f:
    json.dump(results, f)
dist.barrier()
dist.destroy_process_group()
