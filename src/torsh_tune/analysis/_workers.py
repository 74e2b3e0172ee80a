"""DataLoader workers sized from one run's step, data wait and cores: pure arithmetic.

No pandas: `diagnose` and `recommend` use it, and so does the numpy-only trace analyzer
(`traces._findings` imports both), which must not load pandas (tests/test_import_contract.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["WORKERS_HELP_MIN_PCT", "WorkerSizing", "host_idle_cores_per_rank", "size_workers"]

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
    high = round(min(max(high, 0.0), 100.0 * data_s / step_s if step_s > 0 else 0.0), 2)  # one value, every text
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
        lines.append(f"saving <= (T - T') / T = {high:.1f} %, >= {low:.1f} % if loading is all CPU work on "
                     f"{loaders:.2f} cores (step {_ms(min(worst, step_s))})")
    else:
        low = 0.0
        if not saturated:
            lines.append(f"saving <= (T - T') / T = {high:.1f} %")
    return WorkerSizing(workers=workers, current=current, load_s=load_s, compute_s=compute_s,
                        cpu_bound_s=cpu_bound_s, step_s=step_s, low_pct=round(low, 2), high_pct=high,
                        saturated=saturated, arithmetic="; ".join(lines))


def host_idle_cores_per_rank(*, host_cores_per_rank: float, host_busy_pct: float) -> tuple[float, str]:
    """Idle cores per rank from the whole host's busy % (runs recorded before the sampler kept each
    rank's idle cores): the host's cores per rank x its idle share, and that arithmetic.

    It counts every core of the host, also those the ranks may not run on: the sampler's
    affinity-aware `SystemStats.idle_cores_per_rank` is preferred where recorded.

    Example:
        >>> host_idle_cores_per_rank(host_cores_per_rank=4.0, host_busy_pct=40.0)[0]
        2.4
    """
    idle = host_cores_per_rank * (1.0 - min(max(host_busy_pct, 0.0), 100.0) / 100.0)
    return idle, (f"idle cores per rank = {host_cores_per_rank:.3g} host cores per rank (run.json cpu_count / "
                  f"ranks per node) x {100.0 - host_busy_pct:.0f} % idle = {idle:.2f}")


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms"
