"""The always-on probes' cost in instructions, per step and per collective: a count that noise cannot move.

probe_cost.py times the probes (wall and CPU) in alternating blocks; on a shared 2-core VM its
per-collective slope moves by 2-3x between runs, more than the 5 us target, so it cannot say
whether a change to the capture's hot path helped. This benchmark counts instead. Each arm of
probe_cost.py's workloads (same models, same `install_probes`: every probe as the bootstrap
installs it) runs under valgrind's callgrind, which counts the instructions every thread of the
process executes (the training thread's wrappers and step accounting, the record writer's
encoding of every line). Two runs per arm differ only in their number of steps (N and 2N after
the same warm-up, the run finished and its records flushed in both): the difference is N steps'
instructions, start-up and teardown cancel. PYTHONHASHSEED is fixed; repeated counts agree to
a few hundred instructions per step.

The collectives run on torch's fake process group (two ranks in one process, every call goes
through torch.distributed's Python layer and the backend returns at once): a gloo worker
thread would add its own waits and polls to the count, and the capture's cost does not depend
on what the backend does after the call. The time-driven threads (the system sampler, the
writer's periodic flush) are set to run only at the run's end: under valgrind a step lasts ~50x
longer, so their per-second cost would land in the per-step count. Their cost is per second,
not per step.

Workloads (`--workload`): allreduce, a hand-written `dist.all_reduce(p.grad)` per parameter tensor
(`--sizes`: tensors per step), and fsdp2, `fully_shard` on `--sizes` blocks and the root (FSDP2's
all-gathers and reduce-scatters, asynchronous calls: the capture's general path). A straight line
through the torsh - bare difference against the CommRecords each step wrote (counted from the
N extra steps' records) splits it into instructions per step (intercept) and per collective
(slope).
Microseconds are estimates: the instructions times the bare loop's own native rate (its median
step time over its instructions per step, measured here without valgrind), so they assume the
probes' Python runs at the rate of the step it sits in.

    .venv/bin/python benchmarks/probe_instructions.py --steps 100 --sizes 4,32
    .venv/bin/python benchmarks/probe_instructions.py --workload fsdp2 --steps 20 --sizes 2,10

`--python-writer` has the torsh arm write its record lines in Python, as where the C writer
(`profiler/_lines.c`) is not built. Prints a table and one JSON line. Needs valgrind (Debian's package).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # probe_cost.py: the workloads and the probes

TARGET_STEP_US = 60.0
TARGET_COLLECTIVE_US = 5.0
WARMUP = 30
# Only at the end under valgrind: their cost is per second of the run, not per step.
QUIET_THREADS = {"system_interval_s": 1e6, "flush_interval_s": 1e6}
_PYTHON_WRITER = "PROBE_INSTRUCTIONS_PYTHON_WRITER"


def child(workload: str, arm: str, size: int, steps: int, out: Path, timed: bool) -> None:
    """One arm: fake group, WARMUP + `steps` steps of `workload`, the run finished; with `timed` the steps'
    perf_counter durations are written to `out`."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29599", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import probe_cost

    torch.set_num_threads(1)
    if os.environ.get(_PYTHON_WRITER):  # the record lines written by `writer._line`, as without the C writer
        import torsh_tune.profiler.writer as writer

        writer._c_record_lines = None
    rt = probe_cost.install_probes(out.parent / "run", profiler=dict(QUIET_THREADS)) if arm == "torsh" else None
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    step, loader, _ = probe_cost._build(workload, size)
    batches = probe_cost._batches(loader)
    for _ in range(WARMUP):
        step(next(batches))
    perf, durations = time.perf_counter, []
    for _ in range(steps):
        t0 = perf()
        step(next(batches))
        durations.append(perf() - t0)
    if rt is not None:
        rt.finish("ok")
    if timed:
        out.write_text(json.dumps(durations))
    sys.stdout.flush()
    os._exit(0)  # no destructors: the same exit for every arm


def _count(workload: str, arm: str, size: int, steps: int, work: Path, keep: Path | None = None) -> tuple[int, int]:
    """(instructions (callgrind's Ir, all threads), CommRecords written) of one child run; `keep`: a folder for
    its callgrind file."""
    tag = f"{workload}-{arm}-{size}-{steps}"
    d = work / tag
    d.mkdir()
    cg = d / "callgrind.out"
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={cg}", sys.executable, __file__,
           "--child", arm, "--workload", workload, "--size", str(size), "--steps", str(steps),
           "--out", str(d / "result.json")]
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    m = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
    if proc.returncode != 0 or m is None:
        raise SystemExit(f"{tag} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    records = _check_records(d / "run", steps) if arm == "torsh" else 0
    if keep is not None:  # for callgrind_annotate: which C functions (the GC, float repr, ...) the probes add
        keep.mkdir(parents=True, exist_ok=True)
        shutil.move(cg, keep / f"callgrind.{tag}.out")
    shutil.rmtree(d)
    return int(m.group(1)), records


def _check_records(run: Path, steps: int) -> int:
    """The torsh arm's CommRecords: at least one per step (a probe that records nothing costs nothing)."""
    comm = run / "ranks" / "rank00000.comm.jsonl"
    lines = comm.read_text().splitlines() if comm.exists() else []
    if len(lines) < WARMUP + steps:
        raise SystemExit(f"the torsh arm wrote {len(lines)} CommRecords for {WARMUP + steps} steps: "
                         "the capture did not see its collectives")
    return len(lines)


def _native_step_us(workload: str, size: int, steps: int, work: Path) -> float:
    """The bare arm's median step in microseconds, without valgrind."""
    out = work / f"native-{workload}-{size}" / "result.json"
    out.parent.mkdir()
    cmd = [sys.executable, __file__, "--child", "bare", "--workload", workload, "--size", str(size),
           "--steps", str(steps), "--out", str(out), "--timed"]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"native bare run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return statistics.median(json.loads(out.read_text())) * 1e6


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line."""
    if len(xs) == 1:
        return ys[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="N: the runs take N and 2N steps after the warm-up")
    p.add_argument("--workload", choices=("allreduce", "fsdp2"), default="allreduce",
                   help="probe_cost.py's: a hand-written all-reduce per parameter tensor, or FSDP2 blocks")
    p.add_argument("--sizes", default="4,32", help="allreduce: parameter tensors (= all-reduces) per step; fsdp2: "
                                                 "blocks fully_shard-ed; two or more fit a line")
    p.add_argument("--jobs", type=int, default=2, help="valgrind runs side by side (counts do not depend on it)")
    p.add_argument("--keep", type=Path, default=None, help="keep each run's callgrind output in this folder")
    p.add_argument("--python-writer", action="store_true",
                   help="the torsh arm writes its record lines in Python (profiler/_lines.c left out), to compare")
    p.add_argument("--child", choices=("bare", "torsh"))
    p.add_argument("--size", type=int, default=4)
    p.add_argument("--out", type=Path)
    p.add_argument("--timed", action="store_true")
    args = p.parse_args()
    if args.child:
        child(args.workload, args.child, args.size, args.steps, args.out, args.timed)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is required: apt-get install valgrind")
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    n = args.steps
    if args.python_writer:
        os.environ[_PYTHON_WRITER] = "1"  # the children inherit it
    from torsh_tune.profiler import writer

    writer_kind = "python" if args.python_writer or writer._c_record_lines is None else "c"
    work = Path(tempfile.mkdtemp(prefix="probe-instr-"))
    jobs = [(args.workload, arm, size, k) for size in sizes for arm in ("bare", "torsh") for k in (n, 2 * n)]
    t0 = time.time()
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        counts = dict(zip(jobs, pool.map(lambda j: _count(*j, work, args.keep), jobs)))
    native = {size: _native_step_us(args.workload, size, max(n, 300), work) for size in sizes}
    shutil.rmtree(work, ignore_errors=True)

    def per_step(arm: str, size: int, i: int) -> float:  # i: 0 instructions, 1 CommRecords; the N extra steps'
        return (counts[(args.workload, arm, size, 2 * n)][i] - counts[(args.workload, arm, size, n)][i]) / n

    rows = []
    for size in sizes:
        bare, torsh = per_step("bare", size, 0), per_step("torsh", size, 0)
        ns_per_instr = native[size] * 1e3 / bare
        rows.append({"size": size, "collectives": per_step("torsh", size, 1), "bare_instr": bare, "torsh_instr": torsh,
                     "delta_instr": torsh - bare, "bare_step_us": native[size], "ns_per_instr": ns_per_instr,
                     "delta_us": (torsh - bare) * ns_per_instr / 1e3})
    intercept, slope = _fit([r["collectives"] for r in rows], [r["delta_instr"] for r in rows])
    rate = statistics.fmean(r["ns_per_instr"] for r in rows)
    fit = {"per_step_instr": intercept, "per_collective_instr": slope,
           "per_step_us": intercept * rate / 1e3, "per_collective_us": slope * rate / 1e3, "ns_per_instr": rate}

    print(f"{args.workload + '-size':>14} {'collectives/step':>16} {'bare instr/step':>16} {'torsh instr/step':>17} "
          f"{'delta instr':>12} {'bare step':>10} {'delta (est.)':>13}")
    for r in rows:
        print(f"{r['size']:>14} {r['collectives']:>16.1f} {r['bare_instr']:>16,.0f} {r['torsh_instr']:>17,.0f} "
              f"{r['delta_instr']:>12,.0f} {r['bare_step_us']:>8.0f}us {r['delta_us']:>11.1f}us")
    print(f"fit: {fit['per_step_instr']:,.0f} instr per step + {fit['per_collective_instr']:,.0f} instr per collective"
          f" = ~{fit['per_step_us']:.1f} us per step + ~{fit['per_collective_us']:.2f} us per collective "
          f"at {rate:.3f} ns per instruction (targets {TARGET_STEP_US:.0f} us + {TARGET_COLLECTIVE_US:.0f} us)")
    print(f"record lines written in {'C (profiler/_lines.c)' if writer_kind == 'c' else 'Python'}")
    print(json.dumps({"benchmark": "probe_instructions", "workload": args.workload, "writer": writer_kind,
                      "steps": n, "warmup": WARMUP,
                      "sizes": sizes, "rows": rows, "fit": fit, "seconds": round(time.time() - t0, 1),
                      "python": platform.python_version(), "machine": platform.machine(),
                      "torch": __import__("torch").__version__}))


if __name__ == "__main__":
    main()
