"""Stragglers: which rank the others wait for, how late it is and how often it is last."""

from __future__ import annotations

import pandas as pd

from ._comm import aligned_collectives
from ._steps import phase_frame
from ._types import StragglerStats

__all__ = ["straggler_stats"]


def straggler_stats(steps: pd.DataFrame, comm: pd.DataFrame, *, median_step_s: float | None = None) -> StragglerStats | None:
    """Per-rank speed and lateness; the slowest rank and how consistently it is last.

    With comm records, a rank's lateness at a step is how much later than the earliest
    rank it issued the step's last collective (the one that gates the optimizer step); the
    rank issuing it latest is "last" at that step. Without comm records the same is done
    with compute time (forward + backward compute) instead of arrival time.

    `lateness_pct` is the slowest rank's median lateness (or compute) minus the median of
    the other ranks', as % of the median step time.

    Args:
        steps: measured step records.
        comm: measured comm records.
        median_step_s: base of `lateness_pct`; the median global step time by default.

    Returns:
        StragglerStats, or None with fewer than two ranks of step records.
    """
    if steps.empty or steps["rank"].nunique() < 2:
        return None
    phases = phase_frame(steps)
    phases["compute_s"] = phases["forward"] + phases["backward_compute"]
    if median_step_s is None:
        median_step_s = float(phases.groupby("step")["step_s"].max().median())
    ranks = sorted(int(r) for r in phases["rank"].unique())

    score = _arrival_lateness(comm, len(ranks))
    basis = "comm"
    if score is None:
        # No aligned collectives: the slowest compute is what the others would wait for.
        score = phases.pivot_table(index="step", columns="rank", values="compute_s", aggfunc="sum")
        score = score.dropna()
        basis = "compute"
    if score.empty:
        return None
    last = score.idxmax(axis=1)
    last_count = last.value_counts()
    median_score = score.median()

    per_rank = []
    for r in ranks:
        mine = phases[phases["rank"] == r]
        per_rank.append({
            "rank": r,
            "median_step_s": float(mine["step_s"].median()),
            "median_compute_s": float(mine["compute_s"].median()),
            "lateness_s": float(median_score.get(r, 0.0)) if basis == "comm" else None,
            "last_count": int(last_count.get(r, 0)),
        })
    slowest = int(median_score.idxmax())
    others = median_score.drop(index=slowest)
    excess_s = float(median_score[slowest] - others.median()) if len(others) else 0.0
    return StragglerStats(
        per_rank=tuple(per_rank),
        slowest_rank=slowest,
        last_share_pct=100.0 * int(last_count.get(slowest, 0)) / len(score),
        lateness_pct=100.0 * excess_s / median_step_s if median_step_s > 0 else None,
        basis=basis,
    )


def _arrival_lateness(comm: pd.DataFrame, num_ranks: int) -> pd.DataFrame | None:
    """step x rank lateness at each step's last collective issued by every rank."""
    if comm.empty:
        return None
    df = aligned_collectives(comm)
    full = df[df["group_size"] == num_ranks]
    if full.empty:
        return None
    last_seq = full.groupby("step")["seq"].transform("max")
    gate = full[full["seq"] == last_seq]
    return gate.pivot_table(index="step", columns="rank", values="lateness_s", aggfunc="first").dropna()
