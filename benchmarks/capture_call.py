"""What the collective capture adds to one `dist.all_reduce`, in place: bare, a pass-through wrapper, the capture.

probe_cost.py measures whole steps in two processes; on this 2-core VM its per-collective slope
moves by 3x between runs of the same code (the bare step itself by 1.5x), which hides a few
microseconds per call. Here one process runs a real training step (a small MLP's forward,
backward and SGD step on a one-rank gloo group) whose gradients are averaged by a hand-written
`dist.all_reduce(p.grad)` per parameter tensor, and swaps `torch.distributed.all_reduce` between
three functions block by block, the order rotating every round:

- bare: torch's own function;
- passthrough: `def f(*args, **kwargs): return original(*args, **kwargs)`, the floor of any
  Python wrapper (what a capture in C behind the Python function Dynamo must see still pays);
- capture: the capture's wrapper (`CollectiveCapture`), its common call (a known call site).

Only the gradient loop is timed (wall and the training thread's CPU time); each capture's records
are drained between steps, outside the timing, as the tracker does at the step's end. The cost per
call of an arm = its block's median loop time minus the round's bare block, divided by the calls;
the table gives the median over rounds and the IQR.

`--api funcol` times the functional collectives instead (what DTensor and tensor parallelism
call): per gradient `funcol.all_reduce(grad, "sum", group)`, whose asynchronous result is then
copied back into the gradient (its first use: `wait_tensor`, as in DTensor). The arms swap both
`funcol.all_reduce` and `funcol.wait_tensor`; a call's cost is the pair's.

    .venv/bin/python benchmarks/capture_call.py --rounds 30 --steps 200 --tensors 32
    .venv/bin/python benchmarks/capture_call.py --rounds 30 --steps 200 --backend fake --api funcol

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("torsh_tune") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.distributed_c10d as c10d  # noqa: E402

from torsh_tune.profiler import CollectiveCapture, StepTracker  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402

from torsh_tune.profiler.collectives import _BINDINGS, _FUNCTIONAL, _SIZE_ARG  # noqa: E402

ARMS = ("bare", "passthrough", "capture")
WRAPPED = ARMS[1:]


def _capture() -> tuple[dict[str, object], StepTracker]:
    """A capture installed: (its all_reduce, functional all_reduce and wait_tensor; its tracker). torch's
    functions are given back after: the arms swap them themselves."""
    names = [*_SIZE_ARG, *_BINDINGS, "destroy_process_group"]
    saved = {(m, n): getattr(m, n) for m in (c10d, dist) for n in names if hasattr(m, n)}
    saved |= {(funcol, n): getattr(funcol, n) for n in (*_FUNCTIONAL, "wait_tensor") if hasattr(funcol, n)}
    wait = torch._C._distributed_c10d.Work.wait
    tracker = StepTracker(rank=0, writer=None, warmup_steps=0, loss_every=1)
    CollectiveCapture(tracker, rank=0).install()
    wrappers = {"all_reduce": dist.all_reduce, "funcol.all_reduce": funcol.all_reduce,
                "funcol.wait_tensor": funcol.wait_tensor}
    for (m, n), original in saved.items():
        setattr(m, n, original)
    torch._C._distributed_c10d.Work.wait = wait
    return wrappers, tracker


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=200, help="steps per block")
    p.add_argument("--tensors", type=int, default=32, help="parameter tensors = all_reduce calls per step")
    p.add_argument("--backend", choices=("gloo", "fake"), default="gloo",
                   help="fake: torch's fake process group (world size 2, nothing sent, no worker thread): the "
                        "wrappers' own cost without gloo's hand-off and its noise")
    p.add_argument("--api", choices=("dist", "funcol"), default="dist",
                   help="funcol: the functional all_reduce and its wait_tensor (DTensor's path)")
    args = p.parse_args()
    if args.backend == "fake":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    else:
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    width, layers = 32, []
    for i in range((args.tensors + 1) // 2):
        layers += [torch.nn.Linear(width, width, bias=2 * i + 1 < args.tensors), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    x = torch.randn(16, width)

    # The functions each arm installs: (module, name) -> function.
    swapped = [(dist, "all_reduce")] if args.api == "dist" else [(funcol, "all_reduce"), (funcol, "wait_tensor")]
    originals = {key: getattr(*key) for key in swapped}

    def passthrough(original):
        def f(*a, **kw):
            return original(*a, **kw)
        return f

    captured, tracker_b = _capture()
    functions = {"bare": originals, "passthrough": {key: passthrough(f) for key, f in originals.items()},
                 "capture": {key: captured[("funcol." if key[0] is funcol else "") + key[1]] for key in swapped}}
    trackers = {"capture": tracker_b}
    group = dist.group.WORLD

    def block(arm: str, steps: int) -> tuple[float, float]:
        for (module, name), f in functions[arm].items():
            setattr(module, name, f)
        tracker = trackers.get(arm)
        walls, cpus = [], []
        for _ in range(steps):
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            w0, c0 = time.perf_counter(), time.thread_time()
            if args.api == "dist":
                for p_ in params:
                    dist.all_reduce(p_.grad)
            else:
                for p_ in params:  # the async result's first use waits for it (wait_tensor), as in DTensor
                    p_.grad.copy_(funcol.all_reduce(p_.grad, "sum", group))
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
            opt.step()
            if tracker is not None:  # what the step's end does with the calls: off the timed loop
                # every call was recorded (a probe that records nothing costs nothing)
                assert len(tracker.comm_done) == len(params), (len(tracker.comm_done), len(params))
                tracker.comm_done.clear()
                tracker.step += 1
        return statistics.median(walls), statistics.median(cpus)

    for arm in ARMS:  # warm-up: every capture learns its call sites
        block(arm, 20)
    costs: dict[str, dict[str, list[float]]] = {arm: {"wall": [], "cpu": []} for arm in WRAPPED}
    bare_us: list[float] = []
    for r in range(args.rounds):
        order = ARMS[r % 3:] + ARMS[:r % 3]
        got = {arm: block(arm, args.steps) for arm in order}
        bare_us.append(got["bare"][0] / args.tensors * 1e6)
        for arm in WRAPPED:
            for i, metric in enumerate(("wall", "cpu")):
                costs[arm][metric].append((got[arm][i] - got["bare"][i]) / args.tensors * 1e6)
    for key, f in originals.items():
        setattr(*key, f)
    dist.destroy_process_group()

    rows = []
    print(f"{'arm':<12} {'bare call':>10} {'cost per call, wall: median (IQR)':>36} {'CPU: median (IQR)':>30}")
    for arm in WRAPPED:
        w, c = _quantiles(costs[arm]["wall"]), _quantiles(costs[arm]["cpu"])
        print(f"{arm:<12} {statistics.median(bare_us):>8.2f}us {w[1]:>+10.2f} us ({w[0]:+.2f} .. {w[2]:+.2f})"
              f" {c[1]:>+10.2f} us ({c[0]:+.2f} .. {c[2]:+.2f})")
        rows.append({"arm": arm, "wall_us": {"median": w[1], "q1": w[0], "q3": w[2]},
                     "cpu_us": {"median": c[1], "q1": c[0], "q3": c[2]}})
    diff = [c_ - p_ for p_, c_ in zip(costs["passthrough"]["wall"], costs["capture"]["wall"])]
    d = _quantiles(diff)
    print(f"capture - passthrough, paired by round: {d[1]:+.2f} us per call (IQR {d[0]:+.2f} .. {d[2]:+.2f})")
    print(json.dumps({"benchmark": "capture_call", "api": args.api, "backend": args.backend, "rounds": args.rounds,
                      "steps": args.steps,
                      "tensors": args.tensors, "bare_call_us": statistics.median(bare_us), "rows": rows,
                      "capture_minus_passthrough_us": {"median": d[1], "q1": d[0], "q3": d[2]},
                      "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
                      "load_avg_1m_end": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
