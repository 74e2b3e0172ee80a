"""Where arm B's probe cost goes: per-step time inside each probe function (perf_counter wrappers).

A companion of probe_cost.py: it runs one of its workloads with every probe installed as the
bootstrap installs them, but first wraps the probe functions of `torsh_tune` (and the torch
originals the probes wrap, so that a wrapper's own time is its inclusive time minus the
original's) in perf_counter accumulators, and prints microseconds per step per function.

    .venv/bin/python benchmarks/_probe_breakdown.py --workload allreduce --size 32 --steps 1000
    .venv/bin/python benchmarks/_probe_breakdown.py --all --steps 1000    # ddp-3, allreduce-2/32, fsdp2-10
    .venv/bin/python benchmarks/_probe_breakdown.py --micro               # single operations, in-process A/B

Each timer adds ~0.2-0.5 us to the functions that enclose it; numbers are inclusive unless
the name says `self`. Nothing in src/ is changed: functions are replaced on their classes and
modules before the runtime is built (the capture's wrappers call the originals they found).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# name -> [calls, seconds, per-call seconds]
_ACC: dict[str, list[Any]] = collections.defaultdict(lambda: [0, 0.0, []])

# The timer is compiled with module name "functools", one of the capture's `_PLUMBING` prefixes, so
# that the capture's caller walk skips it and finds the same issuer as without the timer.
_SRC = '''
def make(name, fn, acc, perf):
    cell = acc[name]
    calls = cell[2]
    def timed(*args, **kwargs):
        t0 = perf()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = perf() - t0
            cell[1] += dt
            cell[0] += 1
            calls.append(dt)
    return timed
'''
_NS: dict[str, Any] = {"__name__": "functools"}
exec(compile(_SRC, "<probe-timer>", "exec"), _NS)  # noqa: S102 - a fixed string


def timed(name: str, fn: Callable) -> Callable:
    wrapper = _NS["make"](name, fn, _ACC, time.perf_counter)
    functools.update_wrapper(wrapper, fn)  # keeps the signature the capture inspects (__wrapped__)
    return wrapper


def _outermost(name: str, fn: Callable, depth: list[int]) -> Callable:
    """Time only calls that are not nested in another timed call sharing `depth`."""
    inner = timed(name, fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        if depth[0]:
            return fn(*args, **kwargs)
        depth[0] += 1
        try:
            return inner(*args, **kwargs)
        finally:
            depth[0] -= 1

    functools.update_wrapper(call, fn)
    return call


def _patch_method(cls: Any, attr: str, name: str) -> None:
    raw = cls.__dict__[attr]
    if isinstance(raw, staticmethod):
        setattr(cls, attr, staticmethod(timed(name, raw.__func__)))
    else:
        setattr(cls, attr, timed(name, raw))


def instrument_before_install() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from torsh_tune.profiler import collectives, steps, system, writer
    from torsh_tune.runtime import context

    # torch originals the probes wrap: the probe's own time = its inclusive time - these.
    depth = [0]
    for name in collectives._SIZE_ARG:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        wrapper = _outermost("torch: c10d collective (original)", original, depth)
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)
    torch.autograd.backward = timed("torch: autograd.backward (original)", torch.autograd.backward)
    _BaseDataLoaderIter.__next__ = timed("torch: DataLoader __next__ (original)", _BaseDataLoaderIter.__next__)

    # torsh_tune's probe functions (the phase probes append to StepTracker.phases themselves: no call to time).
    for attr in ("end_step", "_collect_comm", "_write_ready", "_finalize", "on_collective", "next_comm",
                 "_finish_comm"):
        _patch_method(steps.StepTracker, attr, f"StepTracker.{attr}")
    steps._comm_times = timed("steps._comm_times", steps._comm_times)
    steps._peak_rss_bytes = timed("steps._peak_rss_bytes (getrusage)", steps._peak_rss_bytes)
    _patch_method(writer.RecordWriter, "write", "RecordWriter.write (append)")
    _patch_method(writer.RecordWriter, "write_calls", "RecordWriter.write_calls (extend)")
    _patch_method(writer.RecordWriter, "_flush", "RecordWriter._flush (file write, ~1/s)")
    for attr in ("_begin", "_end", "_group"):
        _patch_method(collectives.CollectiveCapture, attr, f"CollectiveCapture.{attr}")
    collectives._caller_site = timed("collectives._caller_site (frame walk)", collectives._caller_site)
    collectives._nbytes_dtype = timed("collectives._nbytes_dtype", collectives._nbytes_dtype)
    for attr in ("forward_pre_hook", "forward_post_hook", "ddp_step_comm"):
        _patch_method(context.RankRuntime, attr, f"RankRuntime.{attr}")
    _patch_method(system.SystemSampler, "sample", "SystemSampler.sample (sampler thread)")


def instrument_after_install() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.optim import optimizer as optim_mod
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from torsh_tune.profiler import collectives

    for name in collectives._SIZE_ARG:  # the capture's wrappers, inclusive
        wrapper = getattr(c10d, name, None)
        if wrapper is None or not getattr(wrapper, "_torsh_capture", False):
            continue
        t = timed("probe: capture wrapper, inclusive", wrapper)
        t._torsh_capture = True  # type: ignore[attr-defined]
        setattr(c10d, name, t)
        if getattr(dist, name, None) is wrapper:
            setattr(dist, name, t)
    torch.autograd.backward = timed("probe: backward wrapper, inclusive", torch.autograd.backward)
    _BaseDataLoaderIter.__next__ = timed("probe: DataLoader __next__ wrapper, inclusive", _BaseDataLoaderIter.__next__)
    for hooks, label in ((optim_mod._global_optimizer_pre_hooks, "pre"),
                         (optim_mod._global_optimizer_post_hooks, "post")):
        for key, fn in list(hooks.items()):
            hooks[key] = timed(f"probe: optimizer {label}-hook, inclusive", fn)


def run(workload: str, size: int, steps: int, warmup: int, *, probes: bool = True) -> dict[str, Any]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29591"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import probe_cost

    torch.set_num_threads(1)
    rt = None
    if probes:
        instrument_before_install()
        rt = probe_cost.install_probes(Path(tempfile.mkdtemp()) / "run", between=instrument_after_install)
    if workload == "fsdp2":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    else:
        dist.init_process_group("gloo")
    step, loader, _ = probe_cost._build(workload, size)
    batches = probe_cost._batches(loader)
    for _ in range(warmup):
        step(next(batches))
    gc_time = [0.0, 0.0, 0]  # seconds in the cyclic GC, start of the current collection, collections

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]
            gc_time[2] += 1

    gc.callbacks.append(on_gc)
    for cell in _ACC.values():  # in place: the timers hold their cells
        cell[0], cell[1] = 0, 0.0
        cell[2].clear()
    wall, t_cpu0, t_main0 = [], time.process_time(), time.thread_time()
    last = time.perf_counter()
    for _ in range(steps):
        step(next(batches))
        t = time.perf_counter()
        wall.append(t - last)
        last = t
    cpu_other = (time.process_time() - t_cpu0) - (time.thread_time() - t_main0)
    gc.callbacks.remove(on_gc)
    # (calls per step, mean-based us per step, median-based: median call x calls per step). The
    # median-based figure leaves out calls that were preempted (other processes on the cores).
    acc = {k: (v[0] / steps, v[1] / steps * 1e6, statistics.median(v[2]) * v[0] / steps * 1e6)
           for k, v in _ACC.items() if v[0]}
    if rt is not None:
        rt.finish("ok")

    def us(name: str) -> float:
        return acc.get(name, (0, 0.0, 0.0))[2]

    derived = {
        "probe: capture wrapper, self (incl - original c10d)":
            us("probe: capture wrapper, inclusive") - us("torch: c10d collective (original)"),
        "probe: capture wrapper, self minus timed parts":
            us("probe: capture wrapper, inclusive") - us("torch: c10d collective (original)")
            - sum(us(f"CollectiveCapture.{a}") for a in ("_begin", "_end"))
            - us("collectives._caller_site (frame walk)") - us("collectives._nbytes_dtype"),
        "probe: backward wrapper, self":
            us("probe: backward wrapper, inclusive") - us("torch: autograd.backward (original)"),
        "probe: DataLoader wrapper, self":
            us("probe: DataLoader __next__ wrapper, inclusive") - us("torch: DataLoader __next__ (original)"),
        "other threads' CPU (gloo, sampler), us/step": cpu_other / steps * 1e6,
        f"cyclic GC, us/step ({gc_time[2] / steps:.2f} collections/step)": gc_time[0] / steps * 1e6,
    }
    return {"workload": workload, "size": size, "steps": steps, "probes": probes,
            "median_step_us": statistics.median(wall) * 1e6,
            "per_step": {k: {"calls": c, "us_mean_based": u, "us": m}
                         for k, (c, u, m) in sorted(acc.items(), key=lambda kv: -kv[1][2])},
            "derived_us": derived}


def show(res: dict[str, Any]) -> None:
    arm = "arm B (timers included)" if res["probes"] else "bare"
    print(f"\n== {res['workload']}-{res['size']}: {arm}, {res['steps']} steps, "
          f"median step {res['median_step_us']:.1f} us")
    print(f"{'function':<62}{'calls/step':>11}{'us/step':>10}{'(mean-based)':>14}")
    for name, v in res["per_step"].items():
        print(f"{name:<62}{v['calls']:>11.2f}{v['us']:>10.1f}{v['us_mean_based']:>14.1f}")
    for name, u in res["derived_us"].items():
        print(f"{name:<62}{'':>11}{u:>10.1f}")
    print("us/step: median call x calls per step (preempted calls left out); derived rows use it")


def micro() -> None:
    """In-process A/B of single probe operations (no training loop): blocks alternate, median of (B - A)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29592"), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from torsh_tune.profiler import collectives as cap

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import probe_cost

    torch.set_num_threads(1)
    rt = probe_cost.install_probes(Path(tempfile.mkdtemp()) / "run")
    dist.init_process_group("gloo")

    def ab(name: str, fa: Callable, fb: Callable, n: int = 300, blocks: int = 20) -> None:
        deltas = []
        for j in range(blocks):
            med = {}
            for key, f in ((("a", fa), ("b", fb)) if j % 2 == 0 else (("b", fb), ("a", fa))):
                ts = []
                for _ in range(n):
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
                med[key] = statistics.median(ts)
            deltas.append((med["b"] - med["a"]) * 1e6)
        q = statistics.quantiles(deltas, n=4)
        print(f"{name:<72}{statistics.median(deltas):+8.2f} us  (IQR {q[0]:+.2f} .. {q[2]:+.2f})")

    def nop() -> None:
        return None

    layers: list[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 256)
    for _ in range(30):
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    t = torch.zeros(16)
    record = {"rank": 0, "step": 123, "seq": 4567, "bucket": -1, "collective": "all_reduce", "issuer": "user",
              "hook": None, "group": "world", "group_ranks": [0], "group_size": 1, "backend": "gloo", "bytes": 64,
              "wire_bytes": 64, "dtype": "float32", "grad_bytes": None, "num_tensors": None, "async_op": False,
              "t_issue": 1764000000.123456, "t_complete": 1764000000.123478, "duration_s": 2.2e-05,
              "blocked_s": 2.2e-05, "clock": "host"}
    values = tuple(record.values())
    print("in-process A/B, cost of B over A per call:")
    ab("dist.all_reduce(16 floats), capture wrapper vs original (gloo, sync)",
       lambda: dist.all_reduce.__wrapped__(t), lambda: dist.all_reduce(t), n=200)
    ab("json.dumps(CommRecord) as RecordWriter.write does", nop, lambda: json.dumps(record, separators=(",", ":")))
    ab("json.dumps(the same 23 values as a tuple)", nop, lambda: json.dumps(values, separators=(",", ":")))
    ab("collectives.issuer_of('__main__') (a user script: all 17 prefixes)", nop, lambda: cap.issuer_of("__main__"))
    ab("collectives._nbytes_dtype(tensor)", nop, lambda: cap._nbytes_dtype(t))
    ab("DDP._get_ddp_logging_data()", nop, model._get_ddp_logging_data)
    ab("RankRuntime.ddp_step_comm (timers unchanged: returns early)", nop, lambda: rt.ddp_step_comm(0, 0))
    ab("getattr(ddp, '_torsh_timed_hook', None) (nn.Module.__getattr__ miss)", nop,
       lambda: getattr(model, "_torsh_timed_hook", None))
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("ddp", "allreduce", "fsdp2"), default="allreduce")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--all", action="store_true", help="ddp-3, allreduce-2, allreduce-32, fsdp2-10 (fsdp2: steps/5)")
    p.add_argument("--bare", action="store_true", help="no probes: the GC and other threads' CPU to compare with")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line (used by --all)")
    p.add_argument("--micro", action="store_true", help="in-process A/B of single probe operations")
    args = p.parse_args()
    if args.micro:
        micro()
    if not args.all:
        res = run(args.workload, args.size, args.steps, args.warmup, probes=not args.bare)
        print(json.dumps(res)) if args.json else show(res)
        sys.stdout.flush()
        os._exit(0)  # gloo sometimes aborts while tearing down at exit; everything is printed by now
    results = []
    for workload, size in (("ddp", 3), ("allreduce", 2), ("allreduce", 32), ("fsdp2", 10)):
        steps = args.steps if workload != "fsdp2" else max(50, args.steps // 5)
        warmup = args.warmup if workload != "fsdp2" else max(20, args.warmup // 4)
        for bare in (True, False):
            out = subprocess.run([sys.executable, __file__, "--workload", workload, "--size", str(size), "--steps",
                                  str(steps), "--warmup", str(warmup), "--json", *(["--bare"] if bare else [])],
                                 capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
            show(results[-1])
    print(json.dumps({"benchmark": "probe_breakdown", "results": results}))


if __name__ == "__main__":
    main()
