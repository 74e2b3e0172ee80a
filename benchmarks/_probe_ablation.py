"""Which probe costs what, in one process: each probe group switched off in turn, interleaved.

A companion of probe_cost.py. Whole-process A/B pairs drift by +-30 us from one run to the next
on this 2-core VM even when their within-run IQR is +-10 us, which hides a 20-50 us part. Here
one process installs every probe as the bootstrap does, warms up, and then runs blocks of steps
of steps: for each group, one block with every probe on next to one with that group switched
off (its original restored, or its hooks taken out of torch's hook dicts), the order alternating
and the groups rotating. A group's cost is the median over rounds of (all on - that group off)
per-step medians, with the IQR; beside it the same for the training thread's CPU time per step
(`time.thread_time` over the block, a mean: the rare slow steps count, the host's other processes
and the VM's stolen time do not). Nothing in src/ is changed.

Groups (DDP workload, CPU): `ddp-rate` (DDP's runtime stats at the sample rate the profiler
sets, against PyTorch's default of 100: its own C++ work), `ddp-read` (reading those timers into the step's record),
`forward` (the forward pre/post hooks), `backward` (the autograd.backward wrapper), `data` (the
DataLoader __next__ wrapper), `end_step` (the step record: finalize, comm accounting, peak
memory; the optimizer hooks stay), `optimizer` (the optimizer pre/post hooks with end_step),
`peak` (the peak-memory read of each step record: getrusage on CPU, the allocator's stats on CUDA),
`all` (every group at once: the whole in-process cost, to set beside probe_cost.py's cross-process one).

    .venv/bin/python benchmarks/_probe_ablation.py --blocks 30 --steps 100
    python3 benchmarks/_probe_ablation.py --device cuda     # one NCCL rank, cuda_probe_cost.py's model

On CUDA the model is cuda_probe_cost.py's (a 2048-wide MLP, Adam, batch 256: a launch-bound
~2-4 ms step, where every microsecond of Python adds to the step), its batches come from a
DataLoader of CPU tensors copied to the GPU, and `ddp-rate` is left out (on CUDA PyTorch's own
sampling of its timers is kept). A CUDA-only group, `device-clock`, keeps every probe on and
puts the step tracker on the host clock, as on CPU: no timing event is recorded, queried or
read, and the steps are finalized in batches on the writer's thread with one peak-memory read
per batch, instead of each step on the training thread (the fourth lease found that no single
group holds the CUDA cost, while `all` does; this group asks whether what every group shares
on CUDA does). Step times there are host time per step with the GPU kept busy; the loop
synchronizes once per block.

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPS = ("ddp-rate", "ddp-read", "forward", "backward", "data", "end_step", "optimizer", "peak", "device-clock", "all")
# ddp-rate only on CPU (on CUDA PyTorch's own sampling of its timers is kept); device-clock only on CUDA.
ONLY_ON = {"ddp-rate": "cpu", "device-clock": "cuda"}


def _closure(fn: Callable, name: str) -> Any:
    """The value of free variable `name` of a closure (the original a patch wraps)."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", type=int, default=3)
    p.add_argument("--blocks", type=int, default=30, help="blocks per variant")
    p.add_argument("--steps", type=int, default=100, help="steps per block")
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--groups", help="comma-separated groups to switch off (default: every group of the device)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29591"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    from torch.optim import optimizer as optim_mod
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    import probe_cost

    torch.set_num_threads(1)
    rt = probe_cost.install_probes(Path(tempfile.mkdtemp()) / "run")
    if cuda:
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        step, loader, ddp = _build_cuda()
    else:
        dist.init_process_group("gloo")
        step, loader, ddp = probe_cost._build("ddp", args.buckets)
    batches = probe_cost._batches(loader)
    for _ in range(args.warmup):
        step(next(batches))

    tracker = rt.tracker
    probed = list(rt.probed_modules)
    patched_backward = torch.autograd.backward
    original_backward = _closure(patched_backward, "original")
    patched_next = _BaseDataLoaderIter.__next__
    original_next = _closure(patched_next, "original_next")
    step_comm, end_step, peak = tracker.step_comm, tracker.end_step, tracker._peak_memory
    device_events = tracker.device_events
    pre_hooks, post_hooks = dict(optim_mod._global_optimizer_pre_hooks), dict(optim_mod._global_optimizer_post_hooks)
    fwd_hooks = [(m, dict(m._forward_pre_hooks), dict(m._forward_hooks), dict(m._forward_pre_hooks_with_kwargs))
                 for m in probed]

    def minimal_end_step(t_end: float) -> int:
        tracker.step += 1
        tracker._t_start = t_end
        tracker._reset()
        return tracker.step

    def switch(group: str | None, on: bool) -> None:
        if group == "all":  # every probe group (the device clock goes with them: nothing records events)
            for g in GROUPS[:-1]:
                if ONLY_ON.get(g, args.device) == args.device and g != "device-clock":
                    switch(g, on)
        elif group == "device-clock":
            # Every probe on, the tracker on the host clock: no event recorded, queried or read, and steps
            # finalized in batches on the writer's thread (as on CPU). The steps held are written first
            # (they wait for their events), and the next step starts a new timeline.
            tracker.flush_pending()
            tracker.device_events = device_events if on else None
            tracker._start_event = None
        elif group == "ddp-rate":
            # on: the rate the profiler keeps (rt._ddp_rate: 1, or ddp_timers_every past the detailed steps)
            ddp._set_ddp_runtime_logging_sample_rate(rt._ddp_rate if on else 100)
        elif group == "ddp-read":
            tracker.step_comm = step_comm if on else (lambda step, seq, read=True: ([], 0.0, True))
        elif group == "forward":
            for m, pre, post, kw in fwd_hooks:
                for attr, saved in (("_forward_pre_hooks", pre), ("_forward_hooks", post),
                                    ("_forward_pre_hooks_with_kwargs", kw)):
                    getattr(m, attr).clear()
                    if on:
                        getattr(m, attr).update(saved)
        elif group == "backward":
            torch.autograd.backward = patched_backward if on else original_backward
        elif group == "data":
            _BaseDataLoaderIter.__next__ = patched_next if on else original_next
        elif group == "end_step":
            tracker.end_step = end_step if on else minimal_end_step
        elif group == "peak":
            tracker._peak_memory = peak if on else (lambda: 0)
        elif group == "optimizer":
            for live, saved in ((optim_mod._global_optimizer_pre_hooks, pre_hooks),
                                (optim_mod._global_optimizer_post_hooks, post_hooks)):
                live.clear()
                if on:
                    live.update(saved)

    groups = [g for g in GROUPS if ONLY_ON.get(g, args.device) == args.device]
    if args.groups:
        asked = args.groups.split(",")
        unknown = [g for g in asked if g not in groups]
        if unknown:
            sys.exit(f"--groups: {', '.join(unknown)} is not a group on {args.device} (groups: {', '.join(groups)})")
        groups = [g for g in groups if g in asked]
    perf = time.perf_counter

    cpu_clock = time.thread_time
    cpu_deltas: dict[str, list[float]] = {g: [] for g in groups}
    cpu_last: list[float] = [0.0]

    def block() -> float:
        """The block's median wall time per step; its training thread's mean CPU time per step goes to `cpu_last`."""
        times = []
        c0 = cpu_clock()
        for _ in range(args.steps):
            t0 = perf()
            step(next(batches))
            times.append(perf() - t0)
        if cuda:
            torch.cuda.synchronize()
        cpu_last[0] = (cpu_clock() - c0) / args.steps
        return statistics.median(times)

    # Each group's blocks are paired with an all-on block next to it (the order alternating), so a
    # delta spans ~2 blocks of the host's drift, not a whole round.
    deltas: dict[str, list[float]] = {g: [] for g in groups}
    on_blocks: list[float] = []
    for r in range(args.blocks):
        for g in groups[r % len(groups):] + groups[:r % len(groups)]:
            if r % 2:
                on_blocks.append(block())
                on_cpu = cpu_last[0]
                switch(g, False)
                off = block()
                off_cpu = cpu_last[0]
                switch(g, True)
            else:
                switch(g, False)
                off = block()
                off_cpu = cpu_last[0]
                switch(g, True)
                on_blocks.append(block())
                on_cpu = cpu_last[0]
            deltas[g].append(1e6 * (on_blocks[-1] - off))
            cpu_deltas[g].append(1e6 * (on_cpu - off_cpu))
    rows = []
    for g in groups:
        q = statistics.quantiles(deltas[g], n=4)
        qc = statistics.quantiles(cpu_deltas[g], n=4)
        rows.append({"group": g, "cost_us_median": statistics.median(deltas[g]), "q1": q[0], "q3": q[2],
                     "cpu_us_median": statistics.median(cpu_deltas[g]), "cpu_q1": qc[0], "cpu_q3": qc[2]})
    all_on = 1e6 * statistics.median(on_blocks)
    print(f"all probes on: median step {all_on:.1f} us ({args.blocks} blocks x {args.steps} steps per variant)")
    print(f"{'group switched off':<20}{'wall: median step, median (IQR)':>36}{'training thread CPU, mean (IQR)':>40}")
    for r in rows:
        print(f"{r['group']:<20}{r['cost_us_median']:>+12.1f} us  ({r['q1']:+7.1f} .. {r['q3']:+7.1f})"
              f"{r['cpu_us_median']:>+16.1f} us  ({r['cpu_q1']:+7.1f} .. {r['cpu_q3']:+7.1f})")
    workload = "ddp-mlp-2048-cuda" if cuda else f"ddp-{args.buckets}"
    print(json.dumps({"benchmark": "probe_ablation", "workload": workload, "blocks": args.blocks,
                      "steps": args.steps, "all_on_step_us": all_on, "rows": rows, "date": time.strftime("%Y-%m-%d")}))
    rt.finish("ok")
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown threads sometimes abort at exit; everything is printed


def _build_cuda() -> tuple[Any, Any, Any]:
    """cuda_probe_cost.py's model on one NCCL rank, fed by a DataLoader of CPU tensors."""
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    width = 2048
    model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                          nn.Linear(width, 1)).cuda()
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(torch.randn(8192, 256), torch.randn(8192, 1)), batch_size=256)

    def step(batch: Any) -> None:
        x, y = (t.cuda(non_blocking=True) for t in batch)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, loader, ddp


if __name__ == "__main__":
    main()
