"""Step statistics and the per-phase breakdown of a step."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ..records import PLANNED_FIELDS
from ._types import PHASES, Breakdown, StepStats

__all__ = ["MIN_UNTRACED_STEPS", "STALL_SHARE", "breakdown", "comm_timed", "measured", "phase_frame", "planned_steps",
           "steady_rate", "step_stats", "traced_left_out", "untraced"]


#: A stall is at most this share of the measured steps (more steps that long are the workload's pattern).
STALL_SHARE = 0.1
#: The steps of deep-trace windows are left out of the statistics only when at least this many measured
#: steps, and at least as many as the windows hold, remain.
MIN_UNTRACED_STEPS = 5


def steady_rate(samples: np.ndarray, step_s: np.ndarray, planned: np.ndarray | None = None) -> tuple[float, int]:
    """(samples per second over the steps, steps left out as stalls).

    A stall: a step longer than Tukey's far-out fence (q3 + 3 IQR of the step times) and twice
    their median, and only while such steps are at most `STALL_SHARE` of all (at least one may
    be): a host hiccup, not the workload. Steps that long more often are a pattern of the
    workload (every N-th batch of N DataLoader workers) and count. A step `planned` slow (it holds an
    evaluation pass or a checkpoint save: `planned_steps`) is the workload's however rare, never a stall:
    else one evaluation in a short window was left out of the rate and four were not.
    """
    samples = np.asarray(samples, dtype=float)
    step_s = np.asarray(step_s, dtype=float)
    if step_s.size == 0:
        return float("nan"), 0
    q1, med, q3 = np.quantile(step_s, [0.25, 0.5, 0.75])
    stall = step_s > max(q3 + 3.0 * (q3 - q1), 2.0 * med)
    if planned is not None:
        stall &= ~np.asarray(planned, dtype=bool)
    n = int(stall.sum())
    if n > max(1, int(STALL_SHARE * step_s.size)) or n == step_s.size:
        stall[:], n = False, 0
    return float(samples[~stall].sum() / step_s[~stall].sum()), n


def planned_steps(steps: pd.DataFrame) -> pd.Series:
    """Step -> whether a rank's record of it holds an evaluation pass or a checkpoint save (slow by design)."""
    planned = pd.Series(False, index=steps.index)
    for col in PLANNED_FIELDS.values():
        if col in steps:
            planned |= pd.to_numeric(steps[col], errors="coerce").fillna(0.0) > 0
    return planned.groupby(steps["step"]).any()


def comm_timed(steps: pd.DataFrame) -> pd.DataFrame:
    """The records whose communication was measured, where some were and some were not.

    DDP's builtin all-reduce is timed by the reducer's own timers, which PyTorch samples on
    CUDA (iterations 1-10, then every 100th), which the profiler reads on CPU in the steps
    `profiler.ddp_timers_every` picks, and which are reported at the next forward (a run's
    last step never): the other records say `comm_timed: false`, and their comm_s and
    exposed comm (0) mean "not measured", not "none". Records without the field (other
    stacks, older runs) were timed. When none was timed, all are returned: nothing better
    is known.
    """
    if steps.empty or "comm_timed" not in steps:
        return steps
    untimed = steps["comm_timed"].eq(False).to_numpy()
    if not untimed.any() or untimed.all():
        return steps
    return steps[~untimed]


def measured(steps: pd.DataFrame, comm: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, list[str]]:
    """The steps and collectives outside warm-up and deep-trace windows, and warnings about the choice.

    An evaluation pass's collectives (phase "evaluation") are not the training's communication: left
    out here, counted by `evaluation_passes`.

    When every step is a warm-up step (a short or crashed run) all of them are used, with
    a warning, so that a short run still gets numbers. The steps a trace window recorded or
    warmed its profiler up in (`StepRecord.trace`, on any rank) carry the profiler's own cost:
    they are left out where at least `MIN_UNTRACED_STEPS` measured steps, and at least as many
    as the windows hold, remain (the self-check compares exactly those steps, from the records);
    else they stay in, with a warning.
    """
    warnings: list[str] = []
    if steps.empty:
        return steps, comm, warnings
    warm = steps["warmup"].fillna(False).astype(bool)
    if warm.all():
        warnings.append(f"all {len(steps)} step records are warm-up steps; statistics include warm-up")
        kept = steps
    else:
        kept = steps[~warm]
    kept, warning = untraced(kept)
    if warning is not None:
        warnings.append(warning)
    keys = set(zip(kept["rank"], kept["step"]))
    if not comm.empty:
        mask = np.fromiter((k in keys for k in zip(comm["rank"], comm["step"])), bool, len(comm))
        if "phase" in comm:
            mask &= comm["phase"].ne("evaluation").to_numpy()
        comm = comm[mask]
    return kept.reset_index(drop=True), comm.reset_index(drop=True), warnings


def untraced(steps: pd.DataFrame) -> tuple[pd.DataFrame, str | None]:
    """`steps` without those of trace windows (`StepRecord.trace`, on any rank) where at least
    `MIN_UNTRACED_STEPS`, and as many as the windows hold, remain; else all, and why (see `measured`)."""
    if "trace" not in steps or not steps["trace"].notna().any():
        return steps, None
    traced = set(steps.loc[steps["trace"].notna(), "step"].tolist())
    total = steps["step"].nunique()
    if total - len(traced) >= max(MIN_UNTRACED_STEPS, len(traced)):
        return steps[~steps["step"].isin(traced)], None
    return steps, (f"trace windows hold {len(traced)} of the {total} measured steps: the step statistics include "
                   f"them and the profiler's cost in them (left out only when at least {MIN_UNTRACED_STEPS} and as "
                   "many other steps remain)")


def traced_left_out(steps: pd.DataFrame, kept: pd.DataFrame) -> int:
    """How many steps of trace windows `measured` left out of `steps` to give `kept`."""
    if steps.empty or "trace" not in steps:
        return 0
    out = ~steps["step"].isin(set(kept["step"].tolist())) & steps["trace"].notna()
    return int(steps.loc[out, "step"].nunique())


def step_stats(steps: pd.DataFrame) -> StepStats | None:
    """Statistics of the global step time: the slowest rank's step_s at each step.

    Args:
        steps: measured step records (see `measured`).

    Returns:
        StepStats, or None without step records.

    Example:
        >>> step_stats(frames.steps).median_step_s  # doctest: +SKIP
    """
    if steps.empty:
        return None
    by_step = steps.groupby("step")
    global_s = by_step["step_s"].max().astype(float)
    samples = by_step["samples"].sum().astype(float)
    q25, q75, p90 = np.quantile(global_s, [0.25, 0.75, 0.9])
    median_s = float(global_s.median())
    samples_per_step = float(samples.median())
    # The rate, not samples / median step: the median of a periodic series (workers handing over
    # batches in turn) lands anywhere between its values (`steady_rate`).
    planned = planned_steps(steps).reindex(global_s.index, fill_value=False).to_numpy()
    samples_s, stalls = steady_rate(samples.to_numpy(), global_s.to_numpy(), planned)
    steps_s, _ = steady_rate(np.ones(len(global_s)), global_s.to_numpy(), planned)
    clocks = set(steps["clock"].dropna().astype(str)) if "clock" in steps else set()
    known = samples_per_step > 0
    note = None if known else (
        "samples per step are unknown: no forward of the trained module saw a batch tensor and no DataLoader "
        "was iterated (call torsh_tune.count_tokens, or iterate a DataLoader); throughput is in steps/s")
    return StepStats(
        num_steps=int(len(global_s)),
        median_step_s=median_s,
        p90_step_s=float(p90),
        mean_step_s=float(global_s.mean()),
        std_step_s=float(global_s.std(ddof=0)),
        iqr_step_s=float(q75 - q25),
        samples_per_step=samples_per_step,
        throughput_samples_s=(samples_s if np.isfinite(samples_s) else 0.0) if known else None,
        steps_per_s=steps_s if np.isfinite(steps_s) else 0.0,
        stall_steps=stalls,
        throughput_note=note,
        clock="device" if clocks == {"device"} else "host" if clocks <= {"host"} else "mixed",
    )


def phase_frame(steps: pd.DataFrame) -> pd.DataFrame:
    """Per record: rank, step, step_s and the PHASES columns (seconds), summing to step_s.

    Forward, backward and optimizer times include the communication the step waited for
    inside them (DDP's last buckets in the backward, FSDP's all-gathers in the forward);
    records say how much (`<phase>_exposed_comm_s`), and only the rest is compute. Older
    records without those fields put all exposed communication in the backward.
    """
    f = steps[["rank", "step"]].copy()

    def num(col: str) -> pd.Series:
        if col not in steps:
            return pd.Series(0.0, index=steps.index)
        return pd.to_numeric(steps[col], errors="coerce").fillna(0.0).astype(float)

    exposed = num("exposed_comm_s")
    if "backward_exposed_comm_s" in steps:
        in_fwd, in_bwd, in_opt = num("forward_exposed_comm_s"), num("backward_exposed_comm_s"), num("optimizer_exposed_comm_s")
        old = steps["backward_exposed_comm_s"].isna()
        in_bwd = in_bwd.where(~old, exposed)
    else:
        in_fwd, in_bwd, in_opt = 0.0 * exposed, exposed, 0.0 * exposed
    f["step_s"] = num("step_s")
    f["data"] = num("data_s")
    f["forward"] = (num("forward_s") - in_fwd).clip(lower=0.0)
    f["backward_compute"] = (num("backward_s") - in_bwd).clip(lower=0.0)
    f["exposed_comm"] = exposed
    f["optimizer"] = (num("optimizer_s") - in_opt).clip(lower=0.0)
    known = f[["data", "forward", "backward_compute", "exposed_comm", "optimizer"]].sum(axis=1)
    f["other"] = (f["step_s"] - known).clip(lower=0.0)
    return f


def breakdown(steps: pd.DataFrame) -> Breakdown | None:
    """Median over steps of the per-step mean across ranks of each phase.

    Steps whose communication was not timed (`comm_timed`) are left out where others were.
    Percentages are of the median (over steps) of the per-step mean step_s, the same
    aggregation as the phases, so they are comparable.

    Args:
        steps: measured step records.

    Returns:
        Breakdown with keys in PHASES order, or None without step records.
    """
    if steps.empty:
        return None
    # Steps whose DDP all-reduce went untimed would put their exposed comm in the backward's compute.
    per_step = phase_frame(comm_timed(steps)).groupby("step")[["step_s", *PHASES]].mean()
    medians = per_step.median()
    step_s = float(medians["step_s"])
    phases_s = {p: float(medians[p]) for p in PHASES}
    phases_pct = {p: (100.0 * v / step_s if step_s > 0 else 0.0) for p, v in phases_s.items()}
    return Breakdown(phases_s=phases_s, phases_pct=phases_pct, step_s=step_s)
