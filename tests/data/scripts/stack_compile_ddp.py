"""torch.compile(DDP(model)) on a tiny MLP: Dynamo's DDPOptimizer splits the graph at DDP's buckets.

Knows nothing about torsh-tune. Runs on CUDA/NCCL when a GPU is there, else CPU/gloo.
`--backend` picks the torch.compile backend (eager | aot_eager | inductor; default
aot_eager, which needs no C++ compiler). `--bucket-cap-mb` is 1 MB by default (the
smallest the DDPOptimizer accepts) so that this small model has several DDP buckets,
hence several Dynamo subgraphs.

At exit (also when the run is stopped from outside by an exception unwinding the script),
rank 0 prints one line

    DYNAMO {"unique_graphs": N, "graph_breaks": N, "graph_break_reasons": {...},
            "recompiles": N, "frames_ok": N, "dynamo_warnings": N, "torsh_warnings": [...], ...}

from torch._dynamo.utils.counters: unique_graphs = counters["stats"]["unique_graphs"],
graph_breaks = sum(counters["graph_break"].values()), recompiles = compilations whose
recompile_reason is set (torch._dynamo.utils.get_compilation_metrics()),
ddp_optimizer_buckets = the bucket (= subgraph) count of each graph DDPOptimizer split, and every
warning or WARNING+ log record emitted while the script ran that mentions "torsh".

    torchrun --standalone --nproc-per-node 2 stack_compile_ddp.py --steps 30 --backend aot_eager
"""

import argparse
import json
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--backend", choices=["eager", "aot_eager", "inductor"], default="aot_eager")
p.add_argument("--width", type=int, default=512)
p.add_argument("--batch-size", type=int, default=32)
# Dynamo's DDPOptimizer asserts bucket_cap >= DDP's 1 MB first bucket, so 1 MB is the
# smallest usable value; with width 512 (~2.3 MB of fp32 gradients) that is 3 buckets.
p.add_argument("--bucket-cap-mb", type=float, default=1.0)
args = p.parse_args()

# --- capture warnings and log records (Dynamo reports most of its problems through `logging`)
_records: list[dict] = []


class _Capture(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # a malformed record must not break training
            msg = str(record.msg)
        _records.append({"kind": "log", "logger": record.name, "level": record.levelname, "msg": msg})


_capture = _Capture(level=logging.WARNING)
# torch._logging gives its registered loggers ("torch", "torch._dynamo", "torch._inductor",
# "torch.distributed", ...) their own handlers and propagate=False, so a handler on
# "torch" alone misses Dynamo's records: attach it to every registered one.
try:
    from torch._logging._internal import log_registry

    _qnames = set(log_registry.get_log_qnames())
except Exception:  # private API; fall back to the usual suspects
    _qnames = set()
_qnames |= {"torch", "torch._dynamo", "torch._inductor", "torch._functorch", "torch.distributed", "torch.fx"}
for _name in sorted(_qnames):
    logging.getLogger(_name).addHandler(_capture)
# DDPOptimizer says at INFO how many buckets (= compiled subgraphs) it split the graph into.
_ddp_buckets: list[int] = []


class _Buckets(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "DDPOptimizer used bucket cap" in str(record.msg) and len(record.args or ()) >= 2:
            _ddp_buckets.append(int(record.args[1]))


_ddp_log = logging.getLogger("torch._dynamo.backends.distributed")
_ddp_log.addHandler(_Buckets(level=logging.INFO))
_ddp_log.setLevel(logging.INFO)
_show_warning = warnings.showwarning


def _showwarning(message, category, filename, lineno, file=None, line=None):
    _records.append({"kind": "warning", "category": category.__name__, "msg": str(message),
                     "where": f"{filename}:{lineno}"})
    _show_warning(message, category, filename, lineno, file, line)


warnings.showwarning = _showwarning

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % max(1, torch.cuda.device_count())) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
torch.manual_seed(0)



# A user-defined module on purpose: Dynamo skips frames that live in torch/ itself, so
# compiling DDP around a bare nn.Sequential captures no graph at all (unique_graphs 0).
class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Linear(64, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.out = nn.Linear(width, 10)

    def forward(self, x):
        x = nn.functional.gelu(self.inp(x))
        for layer in self.hidden:
            x = nn.functional.gelu(layer(x))
        return self.out(x)


model = MLP(args.width).to(device)
n_params = sum(p.numel() for p in model.parameters())
ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_cap_mb)
compiled = torch.compile(ddp, backend=args.backend)
opt = torch.optim.SGD(compiled.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(rank)


def _summary() -> dict:
    from torch._dynamo.utils import counters

    try:
        from torch._dynamo.utils import get_compilation_metrics

        metrics = get_compilation_metrics()
        recompiles = sum(1 for m in metrics if getattr(m, "recompile_reason", None))
    except Exception:  # the metrics API moved between releases
        recompiles = None
    graph_breaks = counters.get("graph_break", {})
    torsh = [r for r in _records if "torsh" in json.dumps(r).lower()]
    torsh += [{"kind": "graph_break", "msg": k, "count": v} for k, v in graph_breaks.items() if "torsh" in k.lower()]
    return {
        "backend": args.backend,
        "world": world,
        "params": n_params,
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "calls_captured": counters["stats"].get("calls_captured", 0),
        "graph_breaks": sum(graph_breaks.values()),
        "graph_break_reasons": {k[:300]: v for k, v in graph_breaks.items()},
        "recompiles": recompiles,
        "ddp_optimizer_buckets": _ddp_buckets,
        "frames_ok": counters["frames"].get("ok", 0),
        "frames_total": counters["frames"].get("total", 0),
        "dynamo_warnings": sum(1 for r in _records if r.get("logger", "").startswith("torch._dynamo")),
        "torch_warning_msgs": sorted({r["msg"][:200] for r in _records if r.get("logger", "").startswith("torch")}),
        "torsh_warnings": [{k: (v[:500] if isinstance(v, str) else v) for k, v in r.items()} for r in torsh],
    }


step, loss = 0, None
try:
    while step < args.steps:
        x = torch.randn(args.batch_size, 64, generator=g).to(device)
        y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
finally:
    if rank == 0:
        print("DYNAMO " + json.dumps(_summary(), sort_keys=True), flush=True)
        sys.stdout.flush()
if rank == 0:
    print(f"compile_ddp done, {step} steps, loss {loss.item():.4f}, backend {args.backend}")
dist.destroy_process_group()
