"""The GPU check in one command (`make gpu-check`): what only a GPU can show, in one table.

On a lent single-GPU machine (H100/H200) it runs, within one 10-minute call:
  1. the `gpu`-marked tests;
  2. a 1-rank NCCL DDP run and an FSDP2 run (applied by the script) under the profiler with a
     trace window: the self-check table (always-on numbers vs the Kineto trace, same steps),
     the step's clock, NVML samples inside the measured window and the peak memory;
  3. what the probes cost on CUDA with all of them off, and with only their device clock off
     (benchmarks/_probe_ablation.py --groups device-clock,all, one process);
  4. the always-on overhead against bare runs, interleaved pairs (benchmarks/overhead.py), and
     the probes' cost per step in process (benchmarks/cuda_probe_cost.py);
  5. two ranks sharing the GPU over gloo with CUDA tensors (NCCL refuses two ranks on one GPU).
The order: the profiled runs, the tests, the probe groups, the overhead, the probe cost.
Without CUDA it runs what it can (the profiled runs on 2-rank gloo CPU) and says what it skipped.

    .venv/bin/python benchmarks/gpu_check.py            # or: make gpu-check
    python3 benchmarks/gpu_check.py --quick             # fewer steps and pairs

Prints a table and one JSON line; with --out DIR also writes gpu_check.json (after every check, so
a call cut off at its limit still leaves what it measured) and keeps the runs there. The whole
check holds to --budget-s (default 540 s): a check that no longer fits is skipped and said so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "data" / "scripts"


def _run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **(env or {})))
    except subprocess.TimeoutExpired as exc:
        # The exception carries what the child printed as bytes, even with text=True.
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return subprocess.CompletedProcess(cmd, 124, stdout=out, stderr=f"timed out after {timeout:.0f} s")


def _env() -> dict[str, Any]:
    import torch

    from torsh_tune.analysis.traces._parser import SCANNER
    from torsh_tune.profiler.writer import _c_record_lines

    out: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                           "cuda": torch.cuda.is_available(), "record_writer": "python" if _c_record_lines is None else "c",
                           "trace_scanner": SCANNER}
    if out["cuda"]:
        out.update(gpu=torch.cuda.get_device_name(0), cuda_runtime=torch.version.cuda, num_gpus=torch.cuda.device_count(),
                   nccl=".".join(map(str, torch.cuda.nccl.version())))
    return out


def gpu_tests(timeout: float) -> dict[str, Any]:
    """The gpu-marked tests; counts parsed from pytest's summary line."""
    t0 = time.time()
    # Only the files that hold gpu-marked tests: collecting the whole suite needs packages
    # (playwright, optuna, dash) a lent GPU machine may not have.
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text())
    # COLUMNS: the short summary cuts each failure's message to the terminal's width, 80 without one,
    # which left nothing of it after a long test name (the fifth lease).
    proc = _run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "--timeout", "200",
                 "--tb=short", *files], timeout=timeout, env={"COLUMNS": "400"})
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", tail[0])}
    # The short summary's lines keep each failure's message, and the tracebacks' "E" lines what the assertion
    # saw: a lease may end before a rerun.
    lines = proc.stdout.splitlines()
    failed = [line[:400] for line in lines if line.startswith(("FAILED", "ERROR"))]
    errors = [line[:400] for line in lines if line.startswith("E ")][:40]
    return {"status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}", "wall_s": round(time.time() - t0, 1),
            **counts, "failed_tests": failed, "errors": errors, "summary": tail[0]}


def profiled(name: str, script: Path, args: list[str], *, nproc: int, backend: str, runs: Path, steps: int,
             window: str, timeout: float) -> dict[str, Any]:
    """One profiled run: its self-check, clock, NVML samples and peak memory from the run directory."""
    t0 = time.time()
    proc = _run([sys.executable, "-m", "torsh_tune.cli", "profile", "--nproc-per-node", str(nproc), "--backend", backend,
                 "--steps", str(steps), "--warmup-steps", "5", "--trace-window", window, "--quiet",
                 "--runs-dir", str(runs), "--run-name", name, str(script), *args], timeout=timeout)
    run = runs / name
    out: dict[str, Any] = {"run": name, "status": "ok" if proc.returncode == 0 else f"exit {proc.returncode}",
                           "wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0:
        out["error"] = (proc.stdout + proc.stderr)[-1500:]
    report = run / "report" / "report.json"
    if not report.is_file():
        return out
    doc = json.loads(report.read_text())
    summary = doc.get("summary") or {}
    out.update(median_step_ms=_ms(summary.get("median_step_s")), clock=summary.get("clock"),
               throughput=summary.get("throughput_samples_s"))
    out["self_check"] = _self_check(doc)
    out.update(_records(run))
    return out


def _self_check(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The report's self-check: always-on vs trace for the window's steps (overall row)."""
    windows = doc.get("self_check")  # one entry per trace window (docs/report-schema.md)
    if not isinstance(windows, list) or not windows or not isinstance(windows[0], dict):
        return None
    row = windows[0]
    overall = row.get("overall") or {}
    # Where each rank's differences lie (per_step: the median step's own difference, the step weighing most).
    where = [f"r{r.get('rank')} {m}: median {w['median_step_diff_pp']:+.1f} pp, step {w['largest_step']} "
             f"{w['largest_step_pp']:+.1f} pp" for r in row.get("per_rank") or [] if isinstance(r, dict)
             for m, w in (r.get("per_step") or {}).items()
             if isinstance(w, dict) and all(isinstance(w.get(k), (int, float)) for k in
                                            ("median_step_diff_pp", "largest_step", "largest_step_pp"))]
    return {"window": row.get("window"), **{k: v for k, v in overall.items()
            if isinstance(v, (int, float, str)) or v is None}, "findings": len(row.get("findings") or []),
            **({"per_step": "; ".join(where)} if where else {})}


def _records(run: Path) -> dict[str, Any]:
    """Clock of the step records, collectives by issuer/clock, NVML samples and the peak memory."""
    out: dict[str, Any] = {}
    steps = [json.loads(line) for p in sorted((run / "ranks").glob("*.steps.jsonl"))
             for line in p.read_text().splitlines() if line.strip()]
    comm = [json.loads(line) for p in sorted((run / "ranks").glob("*.comm.jsonl"))
            for line in p.read_text().splitlines() if line.strip()]
    system = [json.loads(line) for p in sorted((run / "ranks").glob("*.system.jsonl"))
              for line in p.read_text().splitlines() if line.strip()]
    measured = [s for s in steps if not s.get("warmup")]
    out["step_clocks"] = sorted({str(s.get("clock")) for s in measured})
    if measured:
        out["device_vs_host_step"] = _median([s["step_s"] / s["host_step_s"] for s in measured
                                              if s.get("host_step_s")]) if any(s.get("host_step_s") for s in measured) else None
    out["collectives"] = {f"{c.get('issuer')}/{c.get('collective')}/{c.get('clock')}": 0 for c in comm}
    for c in comm:
        out["collectives"][f"{c.get('issuer')}/{c.get('collective')}/{c.get('clock')}"] += 1
    out["peak_mem_mib"] = round(max((s.get("peak_mem_bytes") or 0 for s in steps), default=0) / 2**20, 1)
    gpu = [r for r in system if r.get("gpu_util_pct") is not None]
    if measured and gpu:
        lo = min(s["t_start"] for s in measured)
        hi = max(s["t_end"] for s in measured)
        inside = [r["gpu_util_pct"] for r in gpu if lo <= r["t"] <= hi]
        out["nvml_samples"] = len(gpu)
        out["nvml_samples_in_window"] = len(inside)
        out["gpu_util_pct_in_window"] = round(sum(inside) / len(inside), 1) if inside else None
    meta = run / "ranks" / "rank00000.meta.json"
    if meta.is_file():
        m = json.loads(meta.read_text())
        out["device"] = m.get("device")
        out["nvml"] = m.get("nvml")
        out["notes"] = m.get("notes")
    return out


def _last_json(proc: subprocess.CompletedProcess) -> dict[str, Any] | None:
    """The JSON line a benchmark printed last, if it exited 0."""
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else None


def _failed(proc: subprocess.CompletedProcess) -> dict[str, Any]:
    return {"status": f"exit {proc.returncode}", "error": (proc.stdout + proc.stderr)[-1500:]}


# overhead.py's line per finished pair: "pair 0: bare/torsh  bare    3.153 ms   torsh-tune    5.985 ms   overhead ..."
_PAIR_LINE = re.compile(r"^pair \d+: \S+\s+bare\s+([\d.]+) ms\s+torsh-tune\s+([\d.]+) ms", re.M)


def overhead(pairs: int, steps: int, nproc: int, hidden: int, timeout: float) -> dict[str, Any]:
    proc = _run([sys.executable, str(REPO / "benchmarks" / "overhead.py"), "--pairs", str(pairs), "--steps", str(steps),
                 "--nproc", str(nproc), "--hidden", str(hidden), "--skip", "20",
                 "--script-args", "--batch-size 256"], timeout=timeout)
    doc = _last_json(proc)
    if doc is not None:
        return {"status": "ok", **{k: doc[k] for k in ("median_bare_ms", "median_torsh_ms", "delta_us_median",
                                                       "overhead_pct_median", "overhead_pct_q1", "overhead_pct_q3",
                                                       "pairs")}}
    # Cut off by its timeout (or failed late): the pairs it finished are still paired measurements.
    done = [(float(m[1]), float(m[2])) for m in _PAIR_LINE.finditer(proc.stdout)]
    if not done:
        return _failed(proc)
    pct = sorted(100 * (t / b - 1) for b, t in done)
    return {**_failed(proc), "status": f"partial: {len(done)} of {pairs} pairs (exit {proc.returncode})",
            "pairs": len(done), "median_bare_ms": _median([b for b, _ in done]),
            "median_torsh_ms": _median([t for _, t in done]), "delta_us_median": _median([1e3 * (t - b) for b, t in done]),
            "overhead_pct_median": _median(pct), "overhead_pct_each": [round(v, 2) for v in pct]}


def probe_cost(pairs: int, timeout: float) -> dict[str, Any]:
    """benchmarks/cuda_probe_cost.py: bare vs probed DDP step loop in process, alternating."""
    proc = _run([sys.executable, str(REPO / "benchmarks" / "cuda_probe_cost.py"), "--pairs", str(pairs)], timeout=timeout)
    doc = _last_json(proc)
    if doc is None:
        return _failed(proc)
    return {"status": "ok", **{k: doc[k] for k in ("median_bare_us", "median_torsh_us", "delta_us_median", "delta_us_range")}}


def probe_groups(groups: str, blocks: int, timeout: float) -> dict[str, Any]:
    """benchmarks/_probe_ablation.py on CUDA: what switching probe groups off saves, in one process."""
    proc = _run([sys.executable, str(REPO / "benchmarks" / "_probe_ablation.py"), "--device", "cuda", "--groups", groups,
                 "--blocks", str(blocks), "--warmup", "200"], timeout=timeout)
    doc = _last_json(proc)
    if doc is None:
        return _failed(proc)
    return {"status": "ok", "all_on_step_us": round(doc["all_on_step_us"], 1), "blocks": doc["blocks"],
            "saved_us": {r["group"]: [round(r[k], 1) for k in ("cost_us_median", "q1", "q3")] for r in doc["rows"]}}


def _ms(v: Any) -> float | None:
    return None if v is None else round(1e3 * float(v), 3)


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    return round(values[len(values) // 2], 3) if values else None


def _table(result: dict[str, Any]) -> str:
    # The first column as wide as the longest check's name (a name longer than a fixed width ran into its result).
    w = max([34, *(len(name) + 2 for name in result["checks"])])
    lines = [f"{'check':<{w}}{'result'}", "-" * 100]
    for name, value in result["checks"].items():
        if not isinstance(value, dict):
            lines.append(f"{name:<{w}}{value}")
            continue
        keys = ("status", "summary", "median_step_ms", "clock", "step_clocks", "device_vs_host_step", "peak_mem_mib",
                "nvml_samples_in_window", "gpu_util_pct_in_window", "overhead_pct_median", "delta_us_median",
                "median_bare_us", "median_torsh_us", "all_on_step_us", "saved_us")
        brief = ", ".join(f"{k}={value[k]}" for k in keys if k in value and value[k] is not None)
        lines.append(f"{name:<{w}}{brief}")
        for line in value.get("failed_tests") or []:
            lines.append(f"{'  failed':<{w}}{line}")
        for line in value.get("errors") or []:
            lines.append(f"{'  E':<{w}}{line[1:].strip()}")
        sc = value.get("self_check")
        if isinstance(sc, dict):
            lines.append(f"{'  self-check (always-on vs trace)':<{w}}" + ", ".join(f"{k}={v}" for k, v in sc.items()))
        if value.get("collectives"):
            lines.append(f"{'  collectives (issuer/op/clock)':<{w}}{value['collectives']}")
    lines.append("skipped: " + ("; ".join(result["skipped"]) or "nothing"))
    return "\n".join(lines)


class _Budget:
    """One deadline for the whole check (a lent machine's call ends at 10 minutes, and a killed
    call prints nothing): each check's timeout is capped by what is left, a check that cannot get
    `min_s` is skipped and said so, and with --out the JSON is rewritten after every check, so a
    call that is cut off still leaves what it measured."""

    def __init__(self, seconds: float, result: dict[str, Any], out: Path | None) -> None:
        self.deadline = time.monotonic() + seconds
        self.result, self.out = result, out

    def run(self, name: str, check: Any, *, timeout: float, min_s: float = 45.0) -> None:
        left = self.deadline - time.monotonic()
        if left < min_s:
            self.result["skipped"].append(f"{name} (out of time: {max(0.0, left):.0f} s of the budget left)")
        else:
            self.result["checks"][name] = check(min(timeout, left))
        self.save()

    def save(self) -> None:
        if self.out is not None:
            (self.out / "gpu_check.json").write_text(json.dumps(self.result, indent=2, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and overhead pairs")
    p.add_argument("--out", type=Path, help="keep the runs and write gpu_check.json here (after every check)")
    p.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="seconds for the whole check (default 540: inside a lent machine's 10-minute call)")
    args = p.parse_args()
    env = _env()
    cuda = env["cuda"]
    steps = 20 if args.quick else 40
    work = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"benchmark": "gpu_check", "env": env, "checks": {}, "skipped": [],
                              "date": time.strftime("%Y-%m-%d"), "work_dir": str(work)}
    budget = _Budget(args.budget_s, result, args.out)
    skipped = result["skipped"]

    def run(name: str, run_name: str, script: Path, script_args: list[str], *, nproc: int, backend: str,
            window: str) -> None:
        budget.run(name, lambda t: profiled(run_name, script, script_args, nproc=nproc, backend=backend, runs=runs,
                                            steps=steps, window=window, timeout=t), timeout=150)

    # The runs that answer the open questions first (the self-check on CUDA), the tests after them.
    if cuda:
        run("ddp, 1 rank, nccl", "ddp-nccl", REPO / "examples" / "ddp_mlp.py",
            ["--hidden", "2048", "--batch-size", "256", "--steps", "100000", "--log-every", "100000"],
            nproc=1, backend="nccl", window="20:5")
        run("fsdp2 by the script, 1 rank, nccl", "fsdp2-nccl",
            SCRIPTS / "stack_fsdp2.py", ["--width", "1024", "--batch-size", "128"],
            nproc=1, backend="nccl", window="20:5")
        # An engine's own async all-reduces waited for before the optimizer step, on the device clock.
        run("overlap engine, 1 rank, nccl", "engine-nccl", SCRIPTS / "stack_overlap_engine.py",
            ["--width", "2048", "--batch-size", "256"], nproc=1, backend="nccl", window="20:5")
        # Functional collectives (DTensor's and compiled code's API), issued after backward and waited for at
        # first use: their device path (a tensor-parallel model issues none on one rank).
        run("functional all-reduce, 1 rank, nccl", "funcol-nccl", SCRIPTS / "stack_allreduce.py",
            ["--width", "2048", "--batch-size", "256", "--functional"], nproc=1, backend="nccl", window="20:5")
        run("ddp, 2 ranks on 1 gpu, gloo", "ddp-gloo-cuda", REPO / "examples" / "ddp_mlp.py",
            ["--hidden", "1024", "--steps", "100000", "--log-every", "100000"], nproc=2, backend="gloo", window="15:9")
        if not args.no_tests:
            budget.run("gpu-marked tests", gpu_tests, timeout=240, min_s=90.0)
        # Where the probes' CUDA cost goes (the fourth lease: in no single group, in all of them together).
        budget.run("probe groups switched off, 1 rank, nccl",
                   lambda t: probe_groups("device-clock,all", blocks=6 if args.quick else 10, timeout=t), timeout=150)
        budget.run("overhead vs bare, 1 rank, nccl",
                   lambda t: overhead(pairs=2 if args.quick else 4, steps=200, nproc=1, hidden=2048, timeout=t),
                   timeout=240)
        budget.run("probe cost per step, in process", lambda t: probe_cost(pairs=2 if args.quick else 3, timeout=t),
                   timeout=200)
    else:
        skipped += ["gpu-marked tests (no CUDA)", "NCCL runs (no CUDA)", "2 ranks sharing a GPU over gloo (no CUDA)",
                    "overhead on NCCL (no CUDA)"]
        # 10 traced steps: with 4, one stalled step of a 2-core host moved the CPU self-check by up to 28 pp.
        run("ddp, 2 ranks, gloo cpu", "ddp-gloo", REPO / "examples" / "ddp_mlp.py",
            ["--hidden", "256", "--steps", "100000", "--log-every", "100000"], nproc=2, backend="gloo", window="15:10")
        run("fsdp2 by the script, 2 ranks, gloo cpu", "fsdp2-gloo", SCRIPTS / "stack_fsdp2.py", [], nproc=2, backend="gloo",
            window="15:10")
        run("overlap engine, 2 ranks, gloo cpu", "engine-gloo", SCRIPTS / "stack_overlap_engine.py", [], nproc=2,
            backend="gloo", window="15:10")
    print(_table(result))
    print(json.dumps(result, default=str))
    budget.save()
    bad = [k for k, v in result["checks"].items() if isinstance(v, dict) and v.get("status") != "ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
