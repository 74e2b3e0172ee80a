"""Resources: data-loading wait and the DataLoader workers it calls for, memory against capacity,
CPU and GPU utilisation."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd

from ._types import MemoryStats, SystemStats

__all__ = ["GPU_UTIL_CAVEAT", "WorkerSizing", "data_wait_by_rank", "measured_windows", "memory_stats",
           "size_workers", "system_stats"]

#: Below this saving (% of the step) the host's cores leave DataLoader workers nothing to gain.
WORKERS_HELP_MIN_PCT = 10.0
_MAX_WORKERS = 8  # beyond this, workers rarely help one rank and cost memory


@dataclass(frozen=True, kw_only=True)
class WorkerSizing:
    """DataLoader workers per rank sized from one run's step, data wait and CPU (`size_workers`).

    Attributes:
        workers: num_workers per rank that loads a batch within the shortest step the cores allow.
        current: num_workers the run used.
        load_s: one worker's time to load one batch (L).
        compute_s: the rest of the step (C: forward, backward, optimizer, communication).
        cpu_bound_s: the shortest step the CPU allows (None when the CPU is unknown).
        step_s: the measured step (T).
        low_pct, high_pct: expected saving, % of the step.
        saturated: the cores allow less than `WORKERS_HELP_MIN_PCT` % of the step to be saved:
            more workers will not help.
        arithmetic: the derivation with this run's numbers, for the evidence.
    """

    workers: int
    current: int
    load_s: float
    compute_s: float
    cpu_bound_s: float | None
    step_s: float
    low_pct: float
    high_pct: float
    saturated: bool
    arithmetic: str


def size_workers(*, step_s: float, data_s: float, current: int = 0, rank_cpu_cores: float | None = None,
                 idle_cores_per_rank: float | None = None) -> WorkerSizing:
    """How many DataLoader workers per rank hide this run's data wait, and what the cores allow.

    One batch takes a worker L to load: L = data wait when the rank loads it itself
    (num_workers 0), else current x step (the workers are the bottleneck, each delivering one
    batch per L). The rest of the step, C = step - data wait, is the least a step can take.
    The rank's CPU work per step (its processes' cores x step) cannot run faster than on the
    cores it uses plus its share of the idle ones, so the step is at least
    T' = max(C, cores used x step / (cores used + idle cores)), and
    workers = ceil(L / T'): enough that a batch is ready every T'. The saving is at most
    (step - T') / step (high: the loading's sleeps, e.g. storage reads, overlap freely); at least
    what remains when the loading is all CPU work that only the idle cores can take on (low).

    Args:
        step_s: median step time.
        data_s: median data wait per step.
        current: num_workers the run used.
        rank_cpu_cores: mean CPU of one rank's processes (its workers included), in cores.
        idle_cores_per_rank: the host's idle cores divided among its ranks.

    Returns:
        The sizing; without CPU numbers the CPU bound is left out (and said so).

    Example:
        >>> s = size_workers(step_s=0.060, data_s=0.050, rank_cpu_cores=0.5, idle_cores_per_rank=0.5)
        >>> s.workers, round(s.cpu_bound_s, 3), round(s.high_pct, 1), s.saturated
        (2, 0.03, 50.0, False)
        >>> size_workers(step_s=0.060, data_s=0.050, rank_cpu_cores=1.0, idle_cores_per_rank=0.02).saturated
        True
    """
    data_s = min(max(data_s, 0.0), step_s)
    compute_s = step_s - data_s
    load_s = data_s if current == 0 else current * step_s
    who = "the data wait: the rank loads it itself" if current == 0 else f"{current} workers x the step"
    lines = [f"per step {_ms(step_s)}: data wait {_ms(data_s)}, the rest C = {_ms(compute_s)}; "
             f"one batch takes a worker L = {_ms(load_s)} ({who})"]
    cpu_bound_s = None
    if rank_cpu_cores is not None and idle_cores_per_rank is not None and rank_cpu_cores > 0:
        idle = max(idle_cores_per_rank, 0.0)
        cpu_bound_s = step_s * rank_cpu_cores / (rank_cpu_cores + idle)
        lines.append(f"each rank's processes keep {rank_cpu_cores:.2f} cores busy and {idle:.2f} idle cores are "
                     f"its share, so its CPU work per step ({rank_cpu_cores:.2f} x {_ms(step_s)}) needs at least "
                     f"{_ms(cpu_bound_s)} on {rank_cpu_cores + idle:.2f} cores")
    else:
        lines.append("the ranks' CPU use or the host's idle cores are unknown: no CPU bound")
    shortest = max(compute_s, cpu_bound_s or 0.0)
    high = 100.0 * (step_s - shortest) / step_s if step_s > 0 else 0.0
    high = min(max(high, 0.0), 100.0 * data_s / step_s if step_s > 0 else 0.0)
    saturated = cpu_bound_s is not None and high < WORKERS_HELP_MIN_PCT
    workers = current if saturated else max(current + 1, min(_MAX_WORKERS, math.ceil(load_s / shortest - 1e-9)))
    if saturated:
        lines.append(f"step >= max(C, CPU bound) = {_ms(shortest)}: the cores leave "
                     f"{high:.1f} % of the step to save (< {WORKERS_HELP_MIN_PCT:g} %), whatever the workers")
    else:
        lines.append(f"step >= T' = max(C, CPU bound) = {_ms(shortest)}; workers = ceil(L / T') = "
                     f"ceil({load_s / shortest:.2f}) = {workers}" + (f" (at most {_MAX_WORKERS})"
                                                                     if workers == _MAX_WORKERS else ""))
    if cpu_bound_s is not None and not saturated:
        loaders = min(float(workers), current + max(idle_cores_per_rank or 0.0, 0.0))
        worst = max(shortest, compute_s, load_s / loaders) if loaders > 0 else step_s
        low = min(max(100.0 * (step_s - worst) / step_s, 0.0), high)
        lines.append(f"saving <= (T - T') / T = {high:.1f} %; >= {low:.1f} % if loading is all CPU work on "
                     f"{loaders:.2f} cores (step {_ms(min(worst, step_s))})")
    else:
        low = 0.0
        if not saturated:
            lines.append(f"saving <= (T - T') / T = {high:.1f} %")
    return WorkerSizing(workers=workers, current=current, load_s=load_s, compute_s=compute_s,
                        cpu_bound_s=cpu_bound_s, step_s=step_s, low_pct=round(low, 2), high_pct=round(high, 2),
                        saturated=saturated, arithmetic="; ".join(lines))


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms"


def data_wait_by_rank(steps: pd.DataFrame) -> dict[int, float]:
    """rank -> median data_s as % of the rank's median step_s."""
    out: dict[int, float] = {}
    for rank, mine in steps.groupby("rank"):
        step_s = float(pd.to_numeric(mine["step_s"], errors="coerce").median())
        data_s = float(pd.to_numeric(mine["data_s"], errors="coerce").fillna(0.0).median())
        out[int(rank)] = 100.0 * data_s / step_s if step_s > 0 else 0.0
    return out


def memory_stats(steps: pd.DataFrame, system: pd.DataFrame, meta: dict[int, dict[str, Any]]) -> MemoryStats | None:
    """Peak memory per rank against the device's (or the shared host's) capacity.

    On GPU each rank has its own device, so the worst rank's peak / device total counts.
    On CPU `peak_mem_bytes` is RSS and ranks on one host share its memory, so the ranks'
    peaks are summed per host (hostname from meta.json) and the fullest host counts.

    Args:
        steps: all step records (warm-up included: peaks happen there too).
        system: system records.
        meta: rank -> meta.json.

    Returns:
        MemoryStats, or None with neither step nor system records.
    """
    peaks: dict[int, int] = {}
    if not steps.empty:
        for rank, v in pd.to_numeric(steps["peak_mem_bytes"], errors="coerce").groupby(steps["rank"]).max().items():
            if pd.notna(v):
                peaks[int(rank)] = int(v)
    gpu_total = _col_max_by_rank(system, "gpu_mem_total_bytes")
    device = "cuda" if gpu_total or any(str(m.get("device", "")).startswith("cuda") for m in meta.values()) else "cpu"
    if device == "cuda":
        for rank, used in _col_max_by_rank(system, "gpu_mem_used_bytes").items():
            peaks[rank] = max(peaks.get(rank, 0), used)
    else:
        for rank, rss in _col_max_by_rank(system, "rss_bytes").items():
            peaks.setdefault(rank, rss)
    if not peaks:
        return None
    if device == "cuda":
        capacity = min(gpu_total.values()) if gpu_total else None
        peak_pct = max(100.0 * peaks[r] / gpu_total.get(r, capacity) for r in peaks) if capacity else None
        return MemoryStats(device=device, peak_bytes_by_rank=dict(sorted(peaks.items())),
                           capacity_bytes=capacity, peak_pct=peak_pct)
    host_total = _col_max_by_rank(system, "mem_total_bytes")
    capacity = max(host_total.values()) if host_total else None
    peak_pct = None
    if capacity:
        by_host: dict[str, int] = {}
        for rank, peak in peaks.items():
            host = str(meta.get(rank, {}).get("hostname", "localhost"))
            by_host[host] = by_host.get(host, 0) + peak
        peak_pct = 100.0 * max(by_host.values()) / capacity
    return MemoryStats(device=device, peak_bytes_by_rank=dict(sorted(peaks.items())),
                       capacity_bytes=capacity, peak_pct=peak_pct)


# NVML's utilisation is "a kernel was resident during the sample period", and a kernel
# waiting inside a collective (NCCL spins on the GPU until its peers arrive) is resident.
GPU_UTIL_CAVEAT = (
    "gpu_util_pct is NVML's share of time a kernel was running; a kernel waiting in a collective "
    "(a spinning NCCL kernel) counts as busy, so it bounds useful GPU work from above"
)


def system_stats(
    system: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    warnings: list[str] | None = None,
) -> SystemStats | None:
    """Means of the system sampler's records inside the measured window.

    The window of a rank runs from the `t_start` of its first measured (non-warm-up) step
    to the `t_end` of its last step, so start-up (imports, NCCL init, compile) and teardown
    do not dilute the utilisation. Only samples of ranks with step records count.

    `gpu_util_pct_mean` carries `GPU_UTIL_CAVEAT`: NVML counts a kernel waiting in a
    collective as busy, so a communication-bound run can look compute-busy.

    Args:
        system: system records.
        steps: all step records (warm-up included, `warmup` marks them); None or empty
            means no window is known and every sample counts.
        warnings: where to say when the window could not be used (appended to).

    Returns:
        SystemStats, or None without system records.

    Example:
        >>> import pandas as pd
        >>> system = pd.DataFrame({"rank": [0, 0, 0], "t": [0.0, 5.0, 9.0], "cpu_pct": [0.0, 80.0, 0.0]})
        >>> steps = pd.DataFrame({"rank": [0, 0], "step": [0, 1], "t_start": [2.0, 4.0],
        ...                       "t_end": [4.0, 6.0], "warmup": [True, False]})
        >>> system_stats(system, steps).cpu_pct_mean
        80.0
    """
    if system.empty:
        return None
    notes: list[str] = []
    inside = _in_measured_window(system, steps, notes)
    if warnings is not None:
        warnings.extend(notes)

    def mean(col: str) -> float | None:
        if col not in inside.columns:
            return None
        v = pd.to_numeric(inside[col], errors="coerce").dropna()
        return float(v.mean()) if len(v) else None

    return SystemStats(
        cpu_pct_mean=mean("cpu_pct"),
        sys_cpu_pct_mean=mean("sys_cpu_pct"),
        gpu_util_pct_mean=mean("gpu_util_pct"),
        gpu_power_w_mean=mean("gpu_power_w"),
    )


def measured_windows(steps: pd.DataFrame | None) -> tuple[dict[int, tuple[float, float]], bool]:
    """rank -> (t_start of its first measured step, t_end of its last step), and whether
    warm-up steps had to stand in (every step of the run is a warm-up step)."""
    if steps is None or steps.empty or not {"rank", "t_start", "t_end"} <= set(steps.columns):
        return {}, False
    df = steps.assign(t_start=pd.to_numeric(steps["t_start"], errors="coerce"),
                      t_end=pd.to_numeric(steps["t_end"], errors="coerce"))
    df = df[df["t_start"].notna() & df["t_end"].notna()]
    if df.empty:
        return {}, False
    warm = df["warmup"].fillna(False).astype(bool) if "warmup" in df.columns else pd.Series(False, index=df.index)
    only_warmup = bool(warm.all())
    out: dict[int, tuple[float, float]] = {}
    for rank, mine in df.groupby("rank"):
        mine_warm = warm.loc[mine.index]
        first = mine[~mine_warm] if not only_warmup else mine
        if first.empty:  # this rank never left warm-up while others did: no measured window
            continue
        t0 = float(first["t_start"].min())
        t1 = float(mine["t_end"].max())
        if t1 > t0:
            out[int(rank)] = (t0, t1)
    return out, only_warmup


def _in_measured_window(system: pd.DataFrame, steps: pd.DataFrame | None, notes: list[str]) -> pd.DataFrame:
    windows, only_warmup = measured_windows(steps)
    if not windows:
        notes.append("system statistics use every system sample (start-up and teardown included): "
                     "no step records give a measured window")
        return system
    t = pd.to_numeric(system["t"], errors="coerce")
    keep = pd.Series(False, index=system.index)
    for rank, (t0, t1) in windows.items():
        keep |= (system["rank"] == rank) & (t >= t0) & (t <= t1)
    if not keep.any():
        notes.append(f"system statistics use every system sample (start-up and teardown included): "
                     f"none of the {len(system)} samples fall inside the measured steps "
                     f"(a run shorter than profiler.system_interval_s?)")
        return system
    if only_warmup:
        notes.append("system statistics cover the warm-up steps: every step record is a warm-up step")
    outside = sorted(set(system["rank"].dropna().astype(int)) - set(windows))
    if outside:
        notes.append(f"system samples of rank(s) {outside} left out of system statistics: "
                     "no measured step records on them")
    return system[keep]


def _col_max_by_rank(df: pd.DataFrame, col: str) -> dict[int, int]:
    if df.empty:
        return {}
    v = pd.to_numeric(df[col], errors="coerce")
    out = v.groupby(df["rank"]).max().dropna()
    return {int(r): int(x) for r, x in out.items() if x > 0}
