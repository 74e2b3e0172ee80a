"""Communication: exposure, overlap, wait vs transfer, achieved bandwidth."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..fabric import bus_factor
from ._steps import comm_timed
from ._types import CommStats

__all__ = ["aligned_collectives", "bus_factor", "comm_stats", "redundant_syncs"]

def aligned_collectives(comm: pd.DataFrame) -> pd.DataFrame:
    """Comm records with the cross-rank split of each collective's duration.

    The same collective on every rank is identified by (step, seq). Its `transfer_s` is
    the minimum duration across ranks: the last rank to arrive waits for no one, so its
    duration is what the wire needs. Each rank's `wait_s` = own duration - transfer_s
    (skew + contention), and `lateness_s` = own t_issue - earliest t_issue; this is the
    split the PyTorch TensorBoard plugin and TraceLens make.

    A hook-timed collective also queues behind the rank's previous collective (the process
    group runs them in order), which the wire is busy with. `wire_s` = min across ranks of
    t_complete - max(t_issue, previous t_complete) drops that queueing, and is what the
    bandwidths are computed from. `service_s` is that time on the rank itself: what the
    rank's collectives of a step sum to without counting a queued one's wait twice (several
    asynchronous collectives in flight at once).

    Returns:
        A copy of `comm` with columns transfer_s, wait_s, lateness_s, wire_s, service_s, group_size.
    """
    df = comm.copy()
    if df.empty:
        for col in ("transfer_s", "wait_s", "lateness_s", "wire_s", "service_s", "group_size"):
            df[col] = pd.Series(dtype=float)
        return df
    for col in ("duration_s", "t_issue", "t_complete"):
        df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    df = df.sort_values(["rank", "seq"], kind="stable")
    prev_complete = df.groupby("rank")["t_complete"].shift(1)
    started = np.fmax(df["t_issue"], prev_complete.fillna(-np.inf))
    service = (df["t_complete"] - started).clip(lower=0.0)
    df["service_s"] = service.where(df["t_complete"].notna(), df["duration_s"])
    group = df.groupby(["step", "seq"])
    df["wire_s"] = group["service_s"].transform("min")
    df["transfer_s"] = group["duration_s"].transform("min")
    df["wait_s"] = (df["duration_s"] - df["transfer_s"]).clip(lower=0.0)
    df["lateness_s"] = df["t_issue"] - group["t_issue"].transform("min")
    df["group_size"] = group["rank"].transform("nunique")
    return df


def comm_stats(
    steps: pd.DataFrame,
    comm: pd.DataFrame,
    *,
    world_size: int,
    meta: dict[int, dict[str, Any]] | None = None,
) -> CommStats | None:
    """Communication per step from step records (exposure) and comm records (split).

    Per-step numbers are the mean across ranks, then the median over steps.

    Args:
        steps: measured step records.
        comm: measured comm records.
        world_size: number of ranks (for the bus-bandwidth factor).
        meta: rank -> meta.json; rank 0's (or the first) `ddp_logging` is passed through.

    Returns:
        CommStats, or None when the run has neither comm time nor comm records.
    """
    timed = comm_timed(steps)  # a step whose DDP all-reduce went untimed says 0 for "not measured"
    comm_s = _median_of_mean(timed, "comm_s")
    exposed_s = _median_of_mean(timed, "exposed_comm_s")
    if comm.empty and not comm_s:
        return None
    overlap = 100.0 * (1.0 - exposed_s / comm_s) if comm_s > 0 else None
    ddp_logging = _ddp_logging(meta or {})
    if comm.empty:
        return CommStats(
            num_collectives_per_step=0.0, bytes_per_step=0.0, comm_s=comm_s, exposed_comm_s=exposed_s,
            overlap_pct=overlap, transfer_s=None, wait_s=None, busbw_gbps=None, algbw_gbps=None,
            hooks=(), ddp_logging=ddp_logging,
        )
    df = aligned_collectives(comm)
    df["bytes"] = pd.to_numeric(df["bytes"], errors="coerce").fillna(0.0)
    df["wire_bytes"] = pd.to_numeric(df["wire_bytes"], errors="coerce").fillna(df["bytes"])
    per_rank_step = df.groupby(["rank", "step"]).agg(
        n=("seq", "size"), bytes=("bytes", "sum"), wire=("wire_bytes", "sum"), wait=("wait_s", "sum")
    )
    per_step = per_rank_step.groupby("step").mean()
    # One row per collective (not per rank) for the transfer part and bandwidths.
    coll = df.groupby(["step", "seq"]).agg(
        transfer_s=("transfer_s", "first"), wire_s=("wire_s", "first"),
        wire=("wire_bytes", "median"), collective=("collective", "first"),
    )
    coll["bus_bytes"] = [w * bus_factor(c, world_size) for w, c in zip(coll["wire"], coll["collective"])]
    transfer_per_step = coll.groupby("step")["transfer_s"].sum()
    wire_per_step = coll.groupby("step")["wire_s"].sum()
    last_wire = coll.reset_index().sort_values("seq").groupby("step")["wire_s"].last()
    total_wire = float(coll["wire_s"].sum())
    algbw = float(coll["wire"].sum()) / total_wire / 1e9 if total_wire > 0 else None
    busbw = float(coll["bus_bytes"].sum()) / total_wire / 1e9 if total_wire > 0 else None
    wait_by_rank = per_rank_step.groupby("rank")["wait"].median()
    return CommStats(
        num_collectives_per_step=float(per_step["n"].median()),
        bytes_per_step=float(per_step["bytes"].median()),
        comm_s=comm_s,
        exposed_comm_s=exposed_s,
        overlap_pct=overlap,
        transfer_s=float(transfer_per_step.median()),
        wait_s=float(per_step["wait"].median()),
        busbw_gbps=busbw,
        algbw_gbps=algbw,
        hooks=tuple(sorted(str(h) for h in df["hook"].dropna().unique())),
        ddp_logging=ddp_logging,
        wire_bytes_per_step=float(per_step["wire"].median()),
        wait_by_rank_s={int(r): float(v) for r, v in wait_by_rank.items()},
        last_transfer_s=float(last_wire.median()),
        wire_s=float(wire_per_step.median()),
        by_kind=_by_kind(df, steps),
    )


def _by_kind(df: pd.DataFrame, step_records: pd.DataFrame) -> tuple[dict[str, Any], ...]:
    """Each (issuer, op)'s count, bytes and time per step (see `CommStats.by_kind`): over the measured
    steps (a collective of every tenth step is 0 in the median step), per rank that recorded the step.
    DDP's builtin all-reduce (records of the reducer's timers, hook "builtin") over the steps whose timers
    were read (`comm_timed`): the others did all-reduce, unmeasured."""
    if "issuer" not in df.columns:
        return ()
    kinds = df.assign(issuer=df["issuer"].fillna("unrecorded").astype(str),
                      op=df["collective"].fillna("unrecorded").astype(str))
    out = []
    for (issuer, op), g in kinds.groupby(["issuer", "op"], sort=False):
        builtin = "hook" in g.columns and bool(g["hook"].eq("builtin").all())
        known = comm_timed(step_records) if builtin else step_records
        if not ({"step", "rank"} <= set(known.columns) and len(known)):
            known = kinds
        steps = pd.Index(sorted(set(known["step"].tolist()) | set(g["step"].tolist())), name="step")
        ranks = pd.concat([known[["step", "rank"]], g[["step", "rank"]]]).groupby("step")["rank"].nunique()
        ranks = ranks.reindex(steps)
        # Asynchronous collectives in flight together: each one's time counts from its issue or the
        # rank's previous completion, whichever is later (`service_s`), so queued ones are not summed twice.
        g = g.assign(time_s=g["service_s"].fillna(g["duration_s"]),
                     blocked_s=pd.to_numeric(g["blocked_s"], errors="coerce") if "blocked_s" in g else np.nan)
        per_rank = g.groupby(["step", "rank"]).agg(count=("seq", "size"), bytes=("bytes", "sum"),
                                                   time_s=("time_s", "sum"), blocked_s=("blocked_s", "sum"))
        # A rank without this kind in a step had none of it: 0, not a missing value.
        per_step = per_rank.groupby("step").sum().reindex(steps, fill_value=0.0).div(ranks, axis=0)
        # Each collective's fastest rank, its queueing behind the rank's previous one left out (`wire_s`).
        transfer = g.groupby(["step", "seq"])["wire_s"].first().groupby("step").sum().reindex(steps, fill_value=0.0)
        row = {"issuer": issuer, "op": op, "count": float(per_step["count"].median()),
               "bytes": float(per_step["bytes"].median()), "time_s": float(per_step["time_s"].median()),
               "transfer_s": float(transfer.median()), "origins": _origins(g)}
        if "async_op" in g and g["async_op"].notna().any():
            issued_async = g["async_op"].fillna(False).astype(bool)
            row["async_share"] = float(issued_async.mean())
            if "phase" in g and issued_async.any():  # recorded since 2026-11-28: older runs leave it out
                row["backward_issue_share"] = float(g.loc[issued_async, "phase"].eq("backward").mean())
        if g["blocked_s"].notna().any():  # the training thread's wait: in the call, or in Work.wait()
            row["blocked_s"] = float(per_step["blocked_s"].median())
        out.append(row)
    return tuple(sorted(out, key=lambda k: -k["time_s"]))


def _origins(g: pd.DataFrame, most: int = 3) -> list[str]:
    """The functions that called torch.distributed for these records, most time first (at most `most`)."""
    if "origin" not in g.columns:
        return []
    known = g.dropna(subset=["origin"])
    time = known["duration_s"].fillna(0.0).groupby(known["origin"].astype(str)).sum()
    return [str(o) for o in time.sort_values(ascending=False, kind="stable").index[:most]]


def _median_of_mean(steps: pd.DataFrame, col: str) -> float:
    if steps.empty:
        return 0.0
    values = pd.to_numeric(steps[col], errors="coerce").fillna(0.0)
    return float(values.groupby(steps["step"]).mean().median())


def _ddp_logging(meta: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    for rank in sorted(meta):
        data = meta[rank].get("ddp_logging")
        if isinstance(data, dict) and data:
            return dict(data)
    return None


def redundant_syncs(steps: pd.DataFrame) -> dict[str, Any] | None:
    """DDP all-reducing the gradients after every micro-batch of a step (accumulation outside `no_sync`).

    Accumulating over k micro-batches needs one all-reduce per step, of the summed gradients, after
    the last backward (DDP's `no_sync` around the others); every earlier one is the same bytes sent
    for nothing. Over the measured steps whose communication was timed: the median all-reduces per
    step (`StepRecord.ddp_syncs`, absent for at most one) and what their exposure (in the backward)
    takes of the median step; (syncs - 1) / syncs of it is the redundant ones'.

    Returns:
        None unless the median step all-reduced more than once; else syncs_per_step, microbatches_per_step
        (medians), backward_exposed_pct (the backward's exposed communication, % of the median step),
        redundant_exposed_pct, step_s (median) and steps (those counted).

    Example:
        >>> steps = pd.DataFrame({"rank": [0, 0], "step": [1, 2], "step_s": [0.2, 0.2], "num_microbatches": [4, 4],
        ...                       "ddp_syncs": [4, 4], "backward_exposed_comm_s": [0.08, 0.08]})
        >>> r = redundant_syncs(steps)
        >>> r["syncs_per_step"], round(r["redundant_exposed_pct"], 1)
        (4, 30.0)
    """
    if steps.empty or "ddp_syncs" not in steps:
        return None
    timed = comm_timed(steps)
    syncs = pd.to_numeric(timed["ddp_syncs"], errors="coerce").fillna(1.0)
    n = int(syncs.median())
    if n <= 1:
        return None
    step_s = float(pd.to_numeric(timed["step_s"], errors="coerce").median())
    exposed = (float(pd.to_numeric(timed["backward_exposed_comm_s"], errors="coerce").fillna(0.0).median())
               if "backward_exposed_comm_s" in timed else 0.0)
    pct = 100.0 * exposed / step_s if step_s > 0 else 0.0
    return {"syncs_per_step": n, "microbatches_per_step": int(pd.to_numeric(timed["num_microbatches"],
                                                                             errors="coerce").median()),
            "backward_exposed_pct": pct, "redundant_exposed_pct": pct * (n - 1) / n, "step_s": step_s,
            "steps": int(len(timed))}
