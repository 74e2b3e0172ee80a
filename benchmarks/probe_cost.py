"""The always-on probes' own cost per step and per collective, in microseconds, measured precisely.

Whole-run A/B pairs on a shared 2-core machine vary by +-10 % run to run, far more than the
1 % the profiler may cost, so overhead.py can only bound it loosely. This benchmark isolates
the cost: one process per arm, tiny models whose steps are short, so the probes are a large,
measurable share of them. Arm A runs the loop bare; arm B installs every torsh-tune probe
exactly as the bootstrap does (the c10d collective capture, optimizer hooks, forward hooks,
backward and DataLoader wrappers, DDP's timers, the system sampler thread, the record writer).
Both arms time their steps with the same inline timers: wall (perf_counter) and CPU
(process_time, all threads; it barely moves when other processes take the cores).

A pair starts both arms side by side (fresh processes, warmed up by --skip steps) and then
alternates `--blocks` blocks of steps between them, one arm running at a time, the order
alternating, so that both arms see the same load on a shared machine. A pair's cost is the
median over its blocks of (B - A) block median step; a workload's probe cost is the median
over pairs, with the IQR over pairs.

Workloads (`--workload`, default all):
- ddp: a tiny DDP model (`--buckets` Linear layers, one bucket each), the default CPU path:
  PyTorch's C++ all-reduce stays, the reducer's timers give one step-level record per step.
- allreduce: a plain module whose gradients are averaged by a hand-written
  `dist.all_reduce(p.grad)` per parameter tensor (no DDP), at several sizes
  (`--allreduce-sizes`, parameter tensors = collectives per step). A straight line through
  each pair's costs splits the probe cost into a per-step part (intercept) and a
  per-collective part (slope).
- fsdp2: `fully_shard` on each of `--fsdp2-blocks` blocks and on the root, AdamW; every step
  all-gathers (forward, and again in backward) and reduce-scatters per FSDP group. FSDP2 skips
  its collectives at world size 1, so this one runs on torch's fake process group (2 ranks in
  one process: every call goes through torch.distributed's Python layer, where the capture
  sits, and the backend returns at once). Several comma-separated block counts give a fit as
  for allreduce; with one, its cost net of the allreduce fit's per-step part is shown.

Arm B's run directory is read back after each pair: every timed step must hold exactly the
collectives the bare arm counted (a counting wrapper, installed after its timed steps; DDP's
C++ all-reduces are one step-level record per step), else the run fails, since a probe that
records nothing costs nothing.

Where the cost goes: benchmarks/_probe_breakdown.py times each probe function in arm B.

    .venv/bin/python benchmarks/probe_cost.py --pairs 8 --steps 1000 --workload all

Prints a table and one JSON line; with --reference-step-ms (the median step of the workload
you care about, e.g. overhead.py's bare ddp_mlp step) it also gives the cost in % of it. The
issue's target: probe cost <= 60 us per step + 5 us per collective.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# From a checkout without `pip install -e .` (a lent GPU machine's own Python): the package in src/.
if importlib.util.find_spec("torsh_tune") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

TARGET_STEP_US = 60.0
TARGET_COLLECTIVE_US = 5.0
WORKLOADS = ("ddp", "allreduce", "fsdp2")
METRICS = ("wall", "cpu")  # per-step perf_counter and process_time

# torch.distributed's collectives and p2p calls, counted (outermost calls only) in the bare arm.
_COUNTED = ("all_reduce", "all_reduce_coalesced", "broadcast", "reduce", "all_gather", "all_gather_coalesced",
            "all_gather_into_tensor", "_all_gather_base", "all_gather_single", "reduce_scatter",
            "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single", "all_to_all",
            "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv",
            "barrier")
# Records show these under the name of the public call (profiler.collectives._OP_NAME).
_OP_NAME = {"_all_gather_base": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
            "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_tensor",
            "isend": "send", "irecv": "recv"}


# -- the child: one arm of one workload, in a fresh process ------------------------------
def _build(workload: str, size: int) -> tuple[Any, Any, Any]:
    """(step function taking a batch, the DataLoader, the DDP model or None)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    if workload == "ddp":
        layers = []
        for _ in range(size):  # one Linear per bucket with a 0.25 MiB cap
            layers += [nn.Linear(256, 256), nn.ReLU()]
        model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers), bucket_cap_mb=0.25)
        loader = DataLoader(TensorDataset(torch.randn(4096, 256)), batch_size=16)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(batch: Any) -> None:
            (x,) = batch
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        return step, loader, model

    if workload == "allreduce":
        width, layers = 32, []
        for i in range((size + 1) // 2):  # weight + bias: two parameter tensors per Linear
            layers += [nn.Linear(width, width, bias=2 * i + 1 < size), nn.ReLU()]
        model = nn.Sequential(*layers)
        params = [p for p in model.parameters() if p.requires_grad]
        assert len(params) == size, (len(params), size)
        world = dist.get_world_size()
        loader = DataLoader(TensorDataset(torch.randn(4096, width)), batch_size=16)
        opt = torch.optim.SGD(params, lr=1e-3)

        def step(batch: Any) -> None:
            (x,) = batch
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for p in params:  # hand-written gradient averaging, one collective per parameter
                dist.all_reduce(p.grad)
                p.grad.div_(world)
            opt.step()

        return step, loader, None

    if workload == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        width = 32

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.linear = nn.Linear(width, width)

            def forward(self, x: Any) -> Any:
                return torch.relu(self.linear(x))

        model = nn.Sequential(*[Block() for _ in range(size)], nn.Linear(width, 8))
        for block in model[:-1]:
            fully_shard(block)
        fully_shard(model)
        loader = DataLoader(TensorDataset(torch.randn(4096, width), torch.randint(0, 8, (4096,))), batch_size=16)
        # foreach: one DTensor dispatch per op for all parameters (the per-parameter loop costs ~20 ms a step here)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

        def step(batch: Any) -> None:
            x, y = batch
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()

        return step, loader, None

    raise ValueError(workload)


def _batches(loader: Any) -> Any:
    while True:
        yield from loader


def _count_collectives(step: Any, batches: Any, steps: int) -> tuple[float, dict[str, int]]:
    """Collectives per step (outermost torch.distributed calls) over a few extra, untimed steps."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    counts: collections.Counter[str] = collections.Counter()
    depth = [0]

    def wrap(name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not depth[0]:
                counts[_OP_NAME.get(name, name)] += 1
            depth[0] += 1
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name in _COUNTED:
        original = getattr(c10d, name, None)
        if original is not None:
            wrapper = wrap(name, original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
    for _ in range(steps):
        step(next(batches))
    return sum(counts.values()) / steps, {k: v // steps for k, v in counts.items()}


def install_probes(run: Path, *, between: Callable[[], None] | None = None, profiler: dict | None = None) -> Any:
    """Every torsh-tune probe, installed as the bootstrap installs them, on this world-size-1 rank
    (its RankRuntime, started; `between` runs after the patches and before the start; `profiler`:
    `[profiler]` settings other than the defaults)."""
    from torsh_tune.config import RunConfig, dist_env
    from torsh_tune.rundir import RunDir
    from torsh_tune.runtime import patches
    from torsh_tune.runtime.context import RankRuntime

    rt = RankRuntime(RunConfig.from_dict({"profiler": profiler or {}}), RunDir(run), env=dist_env())
    patches.install(rt)
    if between is not None:
        between()
    rt.start()
    return rt


def child(workload: str, size: int, arm: str, warmup: int, out: Path, profiler: dict | None = None) -> None:
    """Set up, run `warmup` steps, then serve blocks of timed steps: stdin `run K` -> one JSON line."""
    proto = os.fdopen(os.dup(1), "w")  # the protocol's own stdout; prints go to stderr
    os.dup2(2, 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29511"), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rt = install_probes(out.parent / "run", profiler=profiler) if arm == "torsh" else None
    if workload == "fsdp2":
        # FSDP2 skips its collectives at world size 1; a fake process group of 2 ranks in this one
        # process goes through all of torch.distributed's Python layer (where the capture sits)
        # and lets the backend return at once, so the step holds FSDP2's collectives but no peer.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    else:
        dist.init_process_group("gloo")
    step, loader, ddp = _build(workload, size)
    batches = _batches(loader)
    for _ in range(warmup):
        step(next(batches))
    proto.write("ready\n")
    proto.flush()
    perf, cpu_clock = time.perf_counter, time.process_time
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] != "run":
            break
        wall, cpu = [], []
        last, last_cpu = perf(), cpu_clock()
        for _ in range(int(cmd[1])):
            step(next(batches))
            t, c = perf(), cpu_clock()
            wall.append(t - last)
            cpu.append(c - last_cpu)
            last, last_cpu = t, c
        proto.write(json.dumps({"wall": wall, "cpu": cpu}) + "\n")
        proto.flush()
    result: dict[str, Any] = {}
    if arm == "bare":  # after the timed blocks: the counting wrapper costs the timed steps nothing
        if ddp is not None:  # the C++ all-reduce never reaches Python: DDP's buckets are its collectives
            data = ddp._get_ddp_logging_data()
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
            n = len([s for s in sizes.replace(",", " ").split() if s.isdigit()])
            result["collectives_per_step"], result["ops"] = float(n), {"all_reduce (C++, DDP buckets)": n}
        else:
            result["collectives_per_step"], result["ops"] = _count_collectives(step, batches, 20)
    if rt is not None:
        rt.finish("ok")
    out.write_text(json.dumps(result))
    # gloo sometimes aborts in its threads' teardown at exit ("terminate called without an active
    # exception"); everything is written by now, so leave without running destructors.
    sys.stderr.flush()
    os._exit(0)


# -- the parent: pairs of arms, verification, statistics ----------------------------------
def _read_records(run: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ranks = run / "ranks"

    def lines(kind: str) -> list[dict[str, Any]]:
        path = ranks / f"rank00000.{kind}.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

    return lines("steps"), lines("comm")


def _recorded(run: Path, steps: int, skip: int) -> dict[str, Any]:
    """What arm B's run directory holds for the timed steps (skip .. steps-2; the last may be held back)."""
    step_recs, comm = _read_records(run)
    per_step = collections.Counter(c["step"] for c in comm)
    # DDP's timers are read every profiler.ddp_timers_every-th step past the first ones: the others
    # say comm_timed: false and hold no builtin record.
    untimed = {s["step"] for s in step_recs if s.get("comm_timed") is False}
    timed = [s for s in range(skip, steps - 1) if s not in untimed]
    counts = [per_step.get(s, 0) for s in timed]
    timed_set = set(timed)
    ops = collections.Counter((c["collective"], c.get("issuer"), c.get("hook")) for c in comm if c["step"] in timed_set)
    return {
        "step_records": len(step_recs), "timed_steps": len(timed),
        "per_step_min": min(counts), "per_step_max": max(counts),
        "ops_per_step": {f"{op} ({issuer}{', ' + hook if hook else ''})": round(v / len(timed), 2)
                         for (op, issuer, hook), v in sorted(ops.items(), key=str)},
    }


def _expected_records(workload: str, collectives: float, profiler: dict | None) -> int:
    # DDP's C++ all-reduce is one step-level record per step (the reducer's timers), not one per bucket;
    # with profiler.comm_hook_timing a Python hook all-reduces every bucket, one record each.
    per_bucket = bool((profiler or {}).get("comm_hook_timing"))
    return 1 if workload == "ddp" and not per_bucket else int(round(collectives))


def _steps_of(workload: str, args: argparse.Namespace) -> tuple[int, int]:
    """(timed steps per arm, warm-up steps before them) of one pair of `workload`."""
    if workload == "fsdp2":  # ~15-50 ms steps here: fewer of them
        return args.fsdp2_steps, min(args.skip, max(20, args.fsdp2_steps // 4))
    return args.steps, args.skip


class _Arm:
    """One arm's child process, serving blocks of timed steps."""

    def __init__(self, arm: str, job: tuple[str, int], warmup: int, work: Path, port: int, profiler: str) -> None:
        self.arm = arm
        self.out = work / f"{job[0]}{job[1]}-{arm}" / "result.json"
        self.out.parent.mkdir(parents=True)
        self.stderr = open(self.out.parent / "stderr.txt", "w+")  # noqa: SIM115 - closed in close()
        env = dict(os.environ, PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--child", arm, "--child-workload", job[0], "--child-size", str(job[1]),
               "--skip", str(warmup), "--out", str(self.out), "--profiler", profiler]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                     text=True)
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def _line(self) -> str:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.proc.wait()
            self.stderr.seek(0)
            err = self.stderr.read()[-3000:]
            raise SystemExit(f"{self.out.parent.name} failed (rc {self.proc.returncode}):\n{err}")
        return line

    def ready(self) -> None:
        assert self._line().strip() == "ready"

    def run(self, steps: int) -> dict[str, list[float]]:
        self.proc.stdin.write(f"run {steps}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        block = json.loads(self._line())
        self.wall += block["wall"]
        self.cpu += block["cpu"]
        return block

    def close(self) -> dict[str, Any]:
        self.proc.stdin.write("stop\n")  # type: ignore[union-attr]
        self.proc.stdin.close()  # type: ignore[union-attr]
        rc = self.proc.wait(timeout=300)
        self.stderr.seek(0)
        err = self.stderr.read()
        self.stderr.close()
        if rc != 0 or not self.out.exists():
            raise SystemExit(f"{self.out.parent.name} failed at exit (rc {rc}):\n{err[-3000:]}")
        return json.loads(self.out.read_text())


def run_pair(job: tuple[str, int], args: argparse.Namespace, work: Path, i: int) -> dict[str, Any]:
    """Both arms of one job side by side, blocks of steps alternating between them (one runs at a time)."""
    steps, warmup = _steps_of(job[0], args)
    per_block = max(1, steps // args.blocks)
    run_pair.port = getattr(run_pair, "port", 0) + 2  # type: ignore[attr-defined]
    port = 29600 + run_pair.port % 400  # type: ignore[attr-defined]
    arms = {"bare": _Arm("bare", job, warmup, work / str(i), port, "{}"),
            "torsh": _Arm("torsh", job, warmup, work / str(i), port + 1, args.profiler)}
    for a in arms.values():
        a.ready()
    block_deltas: dict[str, list[float]] = {m: [] for m in METRICS}
    for j in range(args.blocks):
        order = ("bare", "torsh") if (i + j) % 2 == 0 else ("torsh", "bare")
        blocks = {arm: arms[arm].run(per_block) for arm in order}
        for m in METRICS:
            block_deltas[m].append(statistics.median(blocks["torsh"][m]) - statistics.median(blocks["bare"][m]))
    bare = arms["bare"].close()
    arms["torsh"].close()
    n = bare["collectives_per_step"]
    rec = _recorded(arms["torsh"].out.parent / "run", warmup + args.blocks * per_block, warmup)
    want = _expected_records(job[0], n, json.loads(args.profiler))
    total = warmup + args.blocks * per_block
    if not (rec["per_step_min"] == rec["per_step_max"] == want) or rec["step_records"] < total - 1:
        raise SystemExit(f"{job[0]}/{job[1]} pair {i}: arm B recorded {rec} but the bare arm counted "
                         f"{n} collectives per step ({bare['ops']}): the probes did not see them")
    shutil.rmtree(work / str(i))
    entry: dict[str, Any] = {"collectives": n, "ops": bare["ops"], "recorded": rec, "records_per_step": want}
    for m in METRICS:
        a, b = getattr(arms["bare"], m), getattr(arms["torsh"], m)
        entry[m] = {"bare_us": statistics.median(a) * 1e6, "torsh_us": statistics.median(b) * 1e6,
                    # the pair's cost: the median over its blocks of (B - A) block medians
                    "delta_us": statistics.median(block_deltas[m]) * 1e6,
                    # the mean-based cost keeps the rare slow steps medians leave out (flushes, sampler)
                    "delta_mean_us": (statistics.fmean(b) - statistics.fmean(a)) * 1e6,
                    "block_deltas_us": [d * 1e6 for d in block_deltas[m]]}
    return entry


def _q(values: list[float]) -> tuple[float, float, float]:
    """(median, q1, q3)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return statistics.median(values), q[0], q[2]


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _row(job: tuple[str, int], rs: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    n = rs[0]["collectives"]
    budget = TARGET_STEP_US + TARGET_COLLECTIVE_US * n
    row: dict[str, Any] = {"workload": job[0], "size": job[1], "steps": steps, "collectives_per_step": n,
                           "ops_per_step": rs[0]["ops"], "recorded_per_step": rs[0]["recorded"]["ops_per_step"],
                           "target_us": budget}
    for metric in METRICS:
        cost, q1, q3 = _q([r[metric]["delta_us"] for r in rs])
        row[metric] = {
            "median_bare_step_us": statistics.median(r[metric]["bare_us"] for r in rs),
            "probe_cost_us_median": cost, "probe_cost_us_q1": q1, "probe_cost_us_q3": q3,
            # the mean-based cost keeps the rare slow steps the median leaves out (flushes, sampler)
            "probe_cost_mean_based_us_median": statistics.median(r[metric]["delta_mean_us"] for r in rs),
            "probe_cost_per_collective_us": cost / n if n else None,  # all of it, per-step part included
            "meets_target": cost <= budget,
        }
    return row


def _fit(workload: str, sizes: list[int], runs: dict[tuple[str, int], list[dict[str, Any]]],
         pairs: int) -> dict[str, Any]:
    """Per-step part (intercept) and per-collective part (slope) of the cost, one line per pair."""
    fit: dict[str, Any] = {"workload": workload, "sizes": sizes,
                           "collectives": [runs[(workload, s)][0]["collectives"] for s in sizes]}
    for metric in METRICS:
        slopes, intercepts = [], []
        for i in range(pairs):
            xs = [runs[(workload, s)][i]["collectives"] for s in sizes]
            ys = [runs[(workload, s)][i][metric]["delta_us"] for s in sizes]
            line = statistics.linear_regression(xs, ys)
            slopes.append(line.slope)
            intercepts.append(line.intercept)
        s, s1, s3 = _q(slopes)
        c, c1, c3 = _q(intercepts)
        fit[metric] = {"per_collective_us_median": s, "per_collective_us_q1": s1, "per_collective_us_q3": s3,
                       "per_step_us_median": c, "per_step_us_q1": c1, "per_step_us_q3": c3,
                       "meets_target": s <= TARGET_COLLECTIVE_US and c <= TARGET_STEP_US}
    return fit


def _print_table(rows: list[dict[str, Any]], fits: list[dict[str, Any]]) -> None:
    print()
    print(f"{'':<16}{'coll.':>6}  {'bare step':>10}  {'probe cost per step, wall':>31}  {'per':>7}  "
          f"{'bare CPU':>10}  {'probe cost per step, CPU':>31}  {'per':>7}  {'target':>6}")
    print(f"{'workload':<16}{'/step':>6}  {'median':>10}  {'median (IQR)':>31}  {'coll.':>7}  "
          f"{'median':>10}  {'median (IQR)':>31}  {'coll.':>7}  {'/step':>6}")

    def cost(m: dict[str, Any], key: str) -> str:
        return f"{m[key + '_median']:+8.1f} ({m[key + '_q1']:+8.1f} .. {m[key + '_q3']:+8.1f})"

    for row in rows:
        cells = []
        for metric in METRICS:
            m = row[metric]
            per = m["probe_cost_per_collective_us"]
            cells.append(f"{m['median_bare_step_us']:>10.1f}  {cost(m, 'probe_cost_us') + ' us':>31}  "
                         f"{'-' if per is None else f'{per:+.1f}':>7}")
        verdict = "/".join("ok" if row[m]["meets_target"] else "MISS" for m in METRICS)
        print(f"{row['workload'] + '-' + str(row['size']):<16}{row['collectives_per_step']:>6g}  "
              f"{cells[0]}  {cells[1]}  {row['target_us']:>6.0f}  {verdict}")
    for fit in fits:
        cells = []
        for metric in METRICS:
            m = fit[metric]
            cells.append(f"{'':>10}  {cost(m, 'per_step_us') + ' us':>31}  {m['per_collective_us_median']:>+7.1f}")
        verdict = "/".join("ok" if fit[m]["meets_target"] else "MISS" for m in METRICS)
        print(f"{fit['workload'] + ' fit':<16}{'/'.join(f'{n:g}' for n in fit['collectives']):>6}  "
              f"{cells[0]}  {cells[1]}  {'60+5n':>6}  {verdict}")
        for metric in METRICS:
            m = fit[metric]
            print(f"  {fit['workload']} fit, {metric}: per collective {m['per_collective_us_median']:+.1f} us "
                  f"(IQR {m['per_collective_us_q1']:+.1f} .. {m['per_collective_us_q3']:+.1f}), per step "
                  f"{m['per_step_us_median']:+.1f} us (IQR {m['per_step_us_q1']:+.1f} .. {m['per_step_us_q3']:+.1f})")
    for row in rows:
        for metric in METRICS:
            net = row[metric].get("probe_cost_per_collective_net_us")
            if net is not None:
                print(f"  {row['workload']}-{row['size']}, {metric}: per collective net of the allreduce fit's "
                      f"per-step part: {net:+.1f} us")
    print(f"target: <= {TARGET_STEP_US:g} us per step + {TARGET_COLLECTIVE_US:g} us per collective (n). "
          "A row's 'per coll.' = its whole cost / its collectives (per-step part included); a fit row's = the slope. "
          "wall: perf_counter per step; CPU: process_time per step (all threads; robust to other load).")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--steps", type=int, default=2000, help="timed steps per arm and pair (ddp, allreduce)")
    p.add_argument("--skip", type=int, default=100, help="warm-up steps before the timed ones")
    p.add_argument("--blocks", type=int, default=20, help="blocks of steps the arms alternate in, per pair")
    p.add_argument("--workload", choices=(*WORKLOADS, "all"), default="all")
    p.add_argument("--buckets", type=int, default=3, help="ddp: DDP buckets per step (C++ all-reduces)")
    p.add_argument("--allreduce-sizes", default="2,32", help="allreduce: parameter tensors (= collectives) per step")
    p.add_argument("--fsdp2-blocks", default="10", help="fsdp2: blocks fully_shard-ed (plus the root); a list fits")
    p.add_argument("--fsdp2-steps", type=int, default=200, help="fsdp2: timed steps per arm and pair (longer steps)")
    p.add_argument("--reference-step-ms", type=float, default=None)
    p.add_argument("--child", choices=("bare", "torsh"))
    p.add_argument("--child-workload", choices=WORKLOADS, default="ddp")
    p.add_argument("--child-size", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--profiler", default="{}",
                   help='arm B\'s [profiler] settings as JSON, e.g. \'{"ddp_timers_every": 1}\' '
                        '(default: the defaults)')
    args = p.parse_args()
    if args.child:
        child(args.child_workload, args.child_size, args.child, args.skip, args.out, json.loads(args.profiler))
        return
    workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    for w in workloads:
        if _steps_of(w, args)[0] < args.blocks:
            p.error(f"{w}: fewer timed steps ({_steps_of(w, args)[0]}) than --blocks ({args.blocks})")
    sizes = {"ddp": [args.buckets], "allreduce": _sizes(args.allreduce_sizes), "fsdp2": _sizes(args.fsdp2_blocks)}
    jobs = [(w, s) for w in workloads for s in sizes[w]]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {job: [] for job in jobs}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.pairs):
            for job in jobs:
                entry = run_pair(job, args, Path(tmp), i)
                runs[job].append(entry)
                w, c = entry["wall"], entry["cpu"]
                print(f"pair {i} {job[0] + '/' + str(job[1]):>12}: bare {w['bare_us']:8.1f} us  torsh-tune "
                      f"{w['torsh_us']:8.1f} us  cost {w['delta_us']:+8.1f} us wall, {c['delta_us']:+8.1f} us CPU  "
                      f"({entry['collectives']:g} collectives/step, {entry['records_per_step']} records/step)",
                      flush=True)

    rows = [_row(job, runs[job], _steps_of(job[0], args)[0]) for job in jobs]
    fits = [_fit(w, sizes[w], runs, args.pairs) for w in workloads if len(sizes[w]) >= 2]
    ar_fit = next((f for f in fits if f["workload"] == "allreduce"), None)
    for row in rows:  # FSDP2 net of the per-step part the allreduce fit found (DDP's collectives are C++: not shown)
        if row["workload"] == "fsdp2" and ar_fit is not None and row["collectives_per_step"]:
            for metric in METRICS:
                row[metric]["probe_cost_per_collective_net_us"] = (
                    (row[metric]["probe_cost_us_median"] - ar_fit[metric]["per_step_us_median"])
                    / row["collectives_per_step"])
    _print_table(rows, fits)

    summary: dict[str, Any] = {
        "benchmark": "probe_cost",
        "profiler": json.loads(args.profiler),
        "pairs": args.pairs,
        "steps": args.steps,
        "fsdp2_steps": args.fsdp2_steps,
        "skip": args.skip,
        "blocks": args.blocks,
        "workload": args.workload,
        "rows": rows,
        "fits": fits,
        "target": {"per_step_us": TARGET_STEP_US, "per_collective_us": TARGET_COLLECTIVE_US},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "load_avg_1m_end": round(os.getloadavg()[0], 2),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    ddp_row = next((r for r in rows if r["workload"] == "ddp"), None)
    if ddp_row is not None:  # the earlier single-row keys (wall clock), for the ddp row
        m = ddp_row["wall"]
        summary.update(buckets=args.buckets, median_bare_step_us=m["median_bare_step_us"],
                       probe_cost_us_median=m["probe_cost_us_median"], probe_cost_us_q1=m["probe_cost_us_q1"],
                       probe_cost_us_q3=m["probe_cost_us_q3"])
    if args.reference_step_ms:
        summary["reference_step_ms"] = args.reference_step_ms
        for row in rows:
            row["cost_pct_of_reference"] = row["wall"]["probe_cost_us_median"] / (args.reference_step_ms * 1e3) * 100
            print(f"{row['workload']}-{row['size']}: {row['cost_pct_of_reference']:+.2f} % of a "
                  f"{args.reference_step_ms} ms step (wall)")
        if ddp_row is not None:
            summary["cost_pct_of_reference"] = ddp_row["cost_pct_of_reference"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
