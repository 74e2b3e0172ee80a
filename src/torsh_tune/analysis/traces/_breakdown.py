"""Temporal breakdown, communication/computation overlap, exposed comm, top kernels/ops."""

from __future__ import annotations

import numpy as np

from . import _intervals as iv
from ._symbols import SymbolTable
from ._table import Table, strings
from ._timeline import KIND_NAMES, Timeline

__all__ = ["comm_overlap", "temporal_breakdown", "top_kernels"]


def temporal_breakdown(timelines: dict[int, Timeline]) -> Table:
    """Idle / compute / non-compute share of each rank's device timeline.

    Over the span from the first kernel's start to the last kernel's end (HTA's
    definition): idle = time no kernel runs; compute = union of computation kernels;
    non-compute = the rest (communication and memcpy/memset not hidden under compute).
    On CPU timelines the "kernels" are main-thread operators and gloo worker spans, and
    the span is the profiled steps; the main thread's time inside c10d calls is not compute,
    even where the call runs nested in an operator (DDP's all-reduce inside AccumulateGrad).

    Returns:
        One row per rank: rank, device, span_s, idle_s, compute_s, non_compute_s,
        idle_pct, compute_pct, non_compute_pct.
    """
    rows = []
    for rank, tl in timelines.items():
        lo, hi = tl.window_us
        s, e = iv.clip(tl.start_us, tl.end_us, lo, hi)
        span = hi - lo
        busy = iv.total(s, e)
        compute = iv.total(*iv.clip(*tl.compute_intervals(), lo, hi))
        idle = span - busy
        non_compute = span - compute - idle
        pct = (lambda x: 100.0 * x / span) if span > 0 else (lambda x: float("nan"))
        rows.append({"rank": rank, "device": tl.device, "span_s": span / 1e6, "idle_s": idle / 1e6,
                     "compute_s": compute / 1e6, "non_compute_s": non_compute / 1e6,
                     "idle_pct": pct(idle), "compute_pct": pct(compute), "non_compute_pct": pct(non_compute)})
    return Table.from_rows(rows, ["rank", "device", "span_s", "idle_s", "compute_s", "non_compute_s",
                                   "idle_pct", "compute_pct", "non_compute_pct"])


def comm_overlap(timelines: dict[int, Timeline]) -> Table:
    """How much communication runs under computation, and how much is exposed.

    overlap_pct = |comm ∩ compute| / |comm| (HTA's comp/comm overlap); exposed_comm_s =
    |comm| − |comm ∩ compute|, the communication nothing hides: an upper bound on what
    faster or better-overlapped communication can save per profiled span. On a CPU, comm_s is
    the time a collective was in flight (`Timeline.in_flight_intervals`: from its issue, queued
    for a gloo worker included); the queued time is never exposed (no thread waited in it, a
    wait is its own entry) and counts as overlapped.

    Returns:
        One row per rank: rank, device, comm_s, compute_s, overlapped_s, exposed_comm_s,
        overlap_pct, exposed_comm_pct (of the span).
    """
    rows = []
    for rank, tl in timelines.items():
        lo, hi = tl.window_us
        comm, flight, comp = tl.comm_intervals(), tl.in_flight_intervals(), tl.compute_intervals()
        if tl.device == "cpu":
            comm, flight, comp = iv.clip(*comm, lo, hi), iv.clip(*flight, lo, hi), iv.clip(*comp, lo, hi)
        comp_t, comm_t = iv.total(*comp), iv.total(*flight)
        both = comm_t - (iv.total(*comm) - iv.overlap(comm, comp))
        span = hi - lo
        rows.append({"rank": rank, "device": tl.device, "comm_s": comm_t / 1e6, "compute_s": comp_t / 1e6,
                     "overlapped_s": both / 1e6, "exposed_comm_s": (comm_t - both) / 1e6,
                     "overlap_pct": 100.0 * both / comm_t if comm_t > 0 else float("nan"),
                     "exposed_comm_pct": 100.0 * (comm_t - both) / span if span > 0 else float("nan")})
    return Table.from_rows(rows, ["rank", "device", "comm_s", "compute_s", "overlapped_s",
                                   "exposed_comm_s", "overlap_pct", "exposed_comm_pct"])


def top_kernels(timelines: dict[int, Timeline], symbols: SymbolTable, *, limit: int = 15) -> Table:
    """The kernels (CPU: main-thread ops, inclusive) taking the most time on each rank.

    Returns:
        rank, name, kind, count, total_s, mean_us, max_us, share_pct (of the rank's
        summed kernel time), at most `limit` rows per rank, longest first.
    """
    cols = ["rank", "name", "kind", "count", "total_s", "mean_us", "max_us", "share_pct"]
    parts = []
    for rank, tl in timelines.items():
        if tl.start_us.size == 0:
            continue
        dur = tl.end_us - tl.start_us
        # One key per (name, kind): ids are < 2**31 and kinds < 4.
        key = tl.name_id.astype(np.int64) * 4 + tl.kind
        uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        total_us = np.bincount(inverse, weights=dur)
        count = np.bincount(inverse)
        longest = np.full(uniq.size, -np.inf)
        np.maximum.at(longest, inverse, dur)
        # Longest total first; ties keep first appearance, as a stable sort of pandas' groupby(sort=False).
        top = np.lexsort((first, -total_us))[:limit]
        names = tl.name_id[first[top]]
        parts.append(Table({
            "rank": np.full(top.size, rank, dtype=np.int64),
            "name": strings(symbols.decode(names.tolist())),
            "kind": strings(KIND_NAMES[k] for k in tl.kind[first[top]].tolist()),
            "count": count[top].astype(np.int64),
            "total_s": total_us[top] / 1e6,
            "mean_us": total_us[top] / count[top],
            "max_us": longest[top],
            "share_pct": 100.0 * total_us[top] / dur.sum(),
        }))
    return Table.concat(parts, cols)
