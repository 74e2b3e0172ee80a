"""The collective sweep, run on every rank: `torsh_tune.runtime.bootstrap _worker.py ARGS`.

It is launched like any user script (torchrun + bootstrap), so the process group is set up
with the run's configured backend. For every collective and message size: `warmup`
untimed iterations, one barrier so every rank starts together, then `iters` timed
iterations back to back and one wait at the end, as nccl-tests does: a barrier or a
synchronize inside the loop would add its own latency to every small message. On CUDA
the clock is CUDA events recorded on the stream between the iterations (device time, read
after the loop); on CPU (gloo, whose collectives return when done) it is the host's
perf_counter. Each rank's per-iteration times are gathered after the loop (not inside it,
so the exchange does not perturb what is measured) and the slowest rank's loop counts, as
in nccl-tests: `time_s` is its per-iteration mean (loop time / iters), `time_min_s` ..
`time_max_s` and the quartiles the spread of its iterations.

Message size follows nccl-tests: the size of the largest buffer a rank touches (the
all-reduce/broadcast buffer, the all-gather output, the reduce-scatter input, the
all-to-all send buffer). algbw = size / time and busbw = algbw * bus_factor.

Rank 0 writes `bench.json` (rows + memory-copy ceiling + layout) and `bench.csv` into the
run directory (TORSH_TUNE_RUN_DIR, or --out).
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import socket
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from torsh_tune.bench import COLLECTIVES
from torsh_tune.config import DistEnv, dist_env
from torsh_tune.fabric import Fact, bus_factor, detect_node, topology_from_hosts
from torsh_tune.launch.emulate import ENV_EMULATED, EmulateSpec
from torsh_tune.rundir import ENV_RUN_DIR, write_json_atomic, write_text_atomic

CSV_COLUMNS = (
    "collective", "level", "group_size", "size_bytes", "count", "dtype", "iters", "status",
    "time_s", "time_min_s", "time_max_s", "time_p25_s", "time_p75_s",
    "algbw_gbps", "busbw_gbps", "error",
)
# torch >= 2.12 renamed the flat-tensor forms (the old names warn on every call).
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_DTYPE = torch.float32
_ELEM_BYTES = 4


def _parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="torsh-tune collective sweep (runs on every rank)")
    p.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    p.add_argument("--collectives", default=",".join(COLLECTIVES))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--max-time-per-size-s", type=float, default=1.0,
                   help="fewer timed iterations (>= 3) when one size would take longer than this")
    p.add_argument("--copy-bytes", type=int, default=64 << 20, help="buffer size of the memory-copy ceiling")
    p.add_argument("--out", default=None, help="directory for bench.json/bench.csv (default: the run dir)")
    return p.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_loop(op, iters: int, device: torch.device) -> list[float]:
    """Seconds of each of `iters` back-to-back runs of `op`, with one wait at the end.

    CUDA: events recorded on the current stream between the runs (device time; a c10d
    collective makes the current stream wait for its NCCL stream, so an event after the
    call completes after the collective). CPU: perf_counter between the runs (the host
    time, which there is the work's time).
    """
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
        events[0].record()
        for i in range(iters):
            op()
            events[i + 1].record()
        events[-1].synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(iters)]
    stamps = [time.perf_counter()]
    for _ in range(iters):
        op()
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _clock(device: torch.device) -> str:
    return "device (CUDA events)" if device.type == "cuda" else "host (perf_counter)"


def _make_op(name: str, size_bytes: int, n: int, device: torch.device, group):
    """A zero-argument closure running one `name` collective of `size_bytes` (nccl-tests sizing)."""
    # Every rank-sliced collective needs a count divisible by the group size.
    count = max(size_bytes // _ELEM_BYTES // n, 1) * n
    if name == "all_reduce":
        buf = torch.ones(count, dtype=_DTYPE, device=device)
        return count, lambda: dist.all_reduce(buf, group=group)
    if name == "broadcast":
        buf = torch.ones(count, dtype=_DTYPE, device=device)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return count, lambda: dist.broadcast(buf, src=src, group=group)
    if name == "all_gather":
        out = torch.empty(count, dtype=_DTYPE, device=device)
        inp = torch.ones(count // n, dtype=_DTYPE, device=device)
        return count, lambda: _ALL_GATHER(out, inp, group=group)
    if name == "reduce_scatter":
        inp = torch.ones(count, dtype=_DTYPE, device=device)
        out = torch.empty(count // n, dtype=_DTYPE, device=device)
        return count, lambda: _REDUCE_SCATTER(out, inp, group=group)
    if name == "all_to_all":
        inp = torch.ones(count, dtype=_DTYPE, device=device)
        out = torch.empty(count, dtype=_DTYPE, device=device)
        return count, lambda: dist.all_to_all_single(out, inp, group=group)
    raise ValueError(f"collective must be one of {COLLECTIVES}, but got {name!r}")


def _quantile(sorted_values: list[float], q: float) -> float:
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def _measure(name: str, size_bytes: int, *, iters: int, warmup: int, max_time_s: float, device: torch.device,
             group, level: str) -> dict:
    n = dist.get_world_size(group)
    row = {"collective": name, "level": level, "group_size": n, "size_bytes": size_bytes, "count": None,
           "dtype": "float32", "iters": iters, "status": "ok", "error": None}
    failed = torch.zeros(1, dtype=torch.float64, device=device)
    try:
        count, op = _make_op(name, size_bytes, n, device, group)
        row["count"] = count
        t0 = time.perf_counter()
        for _ in range(max(warmup, 1)):
            op()
        _sync(device)
        # Large messages take long: cap the timed loop near max_time_s (at least 3 iterations).
        # Every rank must run the same count, so the estimate is agreed with a MAX first.
        estimate = torch.tensor([(time.perf_counter() - t0) / max(warmup, 1)], dtype=torch.float64, device=device)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)
        iters = max(min(iters, int(max_time_s / max(estimate.item(), 1e-9))), min(iters, 3))
        row["iters"] = iters
        _sync(device)  # nothing of the warm-up left on the stream
        dist.barrier(group=group)  # once: every rank starts the loop together
        times = torch.tensor(_timed_loop(op, iters, device), dtype=torch.float64, device=device)
    except (RuntimeError, NotImplementedError, ValueError) as exc:
        # A backend without this collective (or this size) fails on every rank alike; record
        # it instead of inventing a number. The MAX below keeps ranks in step either way.
        failed.fill_(1.0)
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failed.item() > 0:
        row["status"] = "unsupported"
        for key in ("time_s", "time_min_s", "time_max_s", "time_p25_s", "time_p75_s", "algbw_gbps", "busbw_gbps"):
            row[key] = None
        return row
    # Without a barrier per iteration the ranks' iterations do not line up one to one;
    # the slowest rank's whole loop is the collective's time (nccl-tests' max over ranks).
    per_rank = [torch.empty_like(times) for _ in range(n)]
    dist.all_gather(per_rank, times, group=group)
    loops = [t.cpu().tolist() for t in per_rank]
    slowest = sorted(max(loops, key=sum))
    mean_s = sum(slowest) / len(slowest)
    actual_bytes = row["count"] * _ELEM_BYTES
    row["size_bytes"] = actual_bytes
    algbw = actual_bytes / mean_s / 1e9 if mean_s > 0 else None
    row.update(
        time_s=mean_s, time_min_s=slowest[0], time_max_s=slowest[-1],
        time_p25_s=_quantile(slowest, 0.25), time_p75_s=_quantile(slowest, 0.75),
        algbw_gbps=algbw, busbw_gbps=None if algbw is None else algbw * bus_factor(name, n),
    )
    return row


def _copy_ceiling(nbytes: int, device: torch.device, iters: int = 10) -> dict:
    """GB/s of `dst.copy_(src)` on this rank's device: bytes copied / median time (read+write not doubled)."""
    count = max(nbytes // _ELEM_BYTES, 1)
    src = torch.ones(count, dtype=_DTYPE, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    median_s = statistics.median(_timed_loop(lambda: dst.copy_(src), iters, device))
    return {"bytes": count * _ELEM_BYTES, "time_s": median_s, "copy_gbps": count * _ELEM_BYTES / median_s / 1e9,
            "device": str(device), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    names = [c.strip() for c in args.collectives.split(",") if c.strip()]
    if not dist.is_initialized():
        dist.init_process_group()  # the bootstrap picks the run's backend
    rank, world = dist.get_rank(), dist.get_world_size()
    env = dist_env() or DistEnv.one_node(rank=rank, world_size=world)
    local_world, nnodes = env.local_world_size, env.nnodes
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        # With one GPU visible per rank (CUDA_VISIBLE_DEVICES) LOCAL_RANK can exceed the count.
        device = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(device)

    # Ranks measure the copy ceiling one after another: on a shared host, concurrent
    # copies would measure the memory bus split between them.
    copies = []
    for r in range(world):
        if r == rank:
            copies.append(_copy_ceiling(args.copy_bytes, device))
        dist.barrier()
    # One rank per node reads the hardware (nvidia-smi is slow); every rank reports its host.
    local_facts = [asdict(f) for f in detect_node()] if env.local_rank == 0 else None
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (socket.gethostname(), local_facts))
    hosts = [h for h, _ in gathered]
    node_facts = {h: [Fact(**f) for f in facts] for h, facts in gathered if facts is not None}
    emulated = os.environ.get(ENV_EMULATED)
    link = None if not emulated else f"{EmulateSpec.parse(emulated).link_gbps:g} Gbit/s"
    topology = topology_from_hosts(hosts, nodes=node_facts, emulated_link=link)

    # Levels: with one node everything is intra-node. With several, the world group is the
    # "inter" level (its ring crosses the network) and per-node subgroups measure "intra".
    plans = [("intra" if nnodes == 1 else "inter", None)]
    if nnodes > 1 and local_world > 1:
        node_group, _ = dist.new_subgroups(group_size=local_world)
        plans.append(("intra", node_group))
    rows = []
    for level, group in plans:
        for name in names:
            for size in sizes:
                row = _measure(name, size, iters=args.iters, warmup=args.warmup, max_time_s=args.max_time_per_size_s,
                               device=device, group=group, level=level)
                rows.append(row)
                if rank == 0 and row["status"] == "ok":
                    print(f"bench {level} {name} {row['size_bytes']} B: {row['time_s'] * 1e6:.1f} us "
                          f"busbw {row['busbw_gbps']:.3f} GB/s", flush=True)

    all_copies: list = [None] * world
    dist.all_gather_object(all_copies, copies[0])
    if rank == 0:
        out = Path(args.out or os.environ.get(ENV_RUN_DIR) or ".")
        doc = {
            "schema_version": 1,
            "backend": str(dist.get_backend()),
            "world_size": world,
            "nnodes": nnodes,
            "nproc_per_node": local_world,
            "hosts": hosts,
            "topology": topology.to_dict(),
            "iters": args.iters,
            "warmup": args.warmup,
            "timing": {"loop": "back-to-back iterations after one barrier; time_s = per-iteration mean "
                               "of the slowest rank's loop",
                       "clock": _clock(device)},
            "torch_version": torch.__version__,
            "memcopy": {"per_rank": all_copies,
                        "copy_gbps": statistics.median(c["copy_gbps"] for c in all_copies)},
            "rows": rows,
        }
        write_json_atomic(out / "bench.json", doc)
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_COLUMNS})
        write_text_atomic(out / "bench.csv", buf.getvalue())
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
