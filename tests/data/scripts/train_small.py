"""A small, unmodified-style torchrun DDP script with switches for the runtime tests."""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--backend", default="gloo")
p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (no_sync)")
p.add_argument("--sync-every-micro", action="store_true", help="accumulate without no_sync: every backward all-reduces")
p.add_argument("--custom-hook", action="store_true")
p.add_argument("--no-destroy", action="store_true")
p.add_argument("--exit-after", type=int, default=0, help="sys.exit(0) after this many steps")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--fail-step", type=int, default=3)
p.add_argument("--num-workers", type=int, default=0)
p.add_argument("--mark", default="", help="file prefix the custom hook appends to")
p.add_argument("--tokens-per-sample", type=int, default=0, help="count tokens (torsh_tune.count_tokens) when > 0")
p.add_argument("--buffer-mb", type=float, default=0.0, help="a constant buffer (a lookup table) DDP broadcasts")
args = p.parse_args()
if args.tokens_per_sample:
    import torsh_tune

dist.init_process_group(args.backend)
rank = dist.get_rank()
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
if args.buffer_mb:
    net.register_buffer("table", torch.randn(int(args.buffer_mb * 2**20) // 4))
model = nn.parallel.DistributedDataParallel(net)

if args.custom_hook:
    def counting_allreduce(state, bucket):
        with open(f"{args.mark}.{rank}", "a") as f:
            f.write("x\n")
        t = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(t, async_op=True).get_future().then(lambda fut: fut.value()[0])

    model.register_comm_hook(None, counting_allreduce)

ds = TensorDataset(torch.randn(2048, 32), torch.randint(0, 4, (2048,)))
loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds), num_workers=args.num_workers)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
step = 0
micro = 0
epoch = 0
while step < args.steps:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        last_micro = (micro + 1) % args.accum == 0
        if not last_micro and not args.sync_every_micro:
            with model.no_sync():
                (nn.functional.cross_entropy(model(x), y) / args.accum).backward()
        else:
            (nn.functional.cross_entropy(model(x), y) / args.accum).backward()
        if args.tokens_per_sample:
            torsh_tune.count_tokens(x.shape[0] * args.tokens_per_sample)
        micro += 1
        if not last_micro:
            continue
        opt.step()
        opt.zero_grad()
        step += 1
        if rank == args.fail_rank and step == args.fail_step:
            raise RuntimeError(f"planted failure on rank {rank}")
        if args.exit_after and step == args.exit_after:
            sys.exit(0)
        if step >= args.steps:
            break
    epoch += 1
if rank == 0:
    print(f"finished {step} steps")
if not args.no_destroy:
    dist.destroy_process_group()
