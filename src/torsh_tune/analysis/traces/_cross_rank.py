"""Cross-rank views of collectives: wait vs transfer, achieved bandwidth, stragglers."""

from __future__ import annotations

import numpy as np

from ...fabric import bus_factor
from ._table import Table

__all__ = ["collective_timing", "stragglers"]


def _groups(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense group index of each row's key, and the number of groups."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    return inverse.reshape(-1), uniq.size


def collective_timing(coll: Table) -> Table:
    """Split each collective's duration into waiting for peers and transferring.

    A collective cannot finish before its last rank arrives: each rank's ``wait_s`` =
    latest start across ranks − own start, and ``transfer_s`` = the minimum duration
    across ranks (the last arriver waits for no one). Collectives seen on one rank only
    keep their own duration as transfer (wait unknown, NaN). algbw = size / transfer;
    busbw = algbw × nccl-tests' bus factor for the kind and group size.

    Returns:
        `coll` plus ranks_seen, wait_s, transfer_s, algbw_gbps, busbw_gbps.
    """
    if coll.empty:
        empty = np.empty(0, dtype=np.float64)
        return coll.with_columns(ranks_seen=np.empty(0, dtype=np.int64), wait_s=empty, transfer_s=empty,
                                 algbw_gbps=empty, busbw_gbps=empty)
    key, n = _groups(coll["match_key"])
    start, dur = coll["start_us"].astype(np.float64), coll["dur_us"].astype(np.float64)
    pairs = np.unique(np.stack([key, coll["rank"].astype(np.int64)]), axis=1)
    ranks_seen = np.bincount(pairs[0], minlength=n)[key]
    latest = np.full(n, -np.inf)
    np.maximum.at(latest, key, start)
    shortest = np.full(n, np.inf)
    np.fmin.at(shortest, key, dur)
    shared = ranks_seen > 1
    wait_s = np.where(shared, (latest[key] - start) / 1e6, np.nan)
    transfer_s = np.where(shared, shortest[key], dur) / 1e6
    with np.errstate(divide="ignore", invalid="ignore"):
        algbw = coll["size_bytes"] / np.where(transfer_s > 0, transfer_s, np.nan) / 1e9
    factor = np.asarray([bus_factor(c, int(g) if g == g else 1)
                         for c, g in zip(coll["collective"].tolist(), coll["group_size"].tolist())], dtype=float)
    return coll.with_columns(ranks_seen=ranks_seen.astype(np.int64), wait_s=wait_s, transfer_s=transfer_s,
                             algbw_gbps=algbw, busbw_gbps=algbw * factor)


def stragglers(coll: Table) -> Table:
    """Which rank arrives last at collectives seen on two or more ranks, and by how much.

    Arrival is the CPU issue time when known (gloo, NCCL launch), else the start.

    Returns:
        One row per rank: rank, collectives, times_last, last_share_pct, mean_lateness_s
        (arrival − earliest arrival at the same collective), max_lateness_s.
    """
    cols = ["rank", "collectives", "times_last", "last_share_pct", "mean_lateness_s", "max_lateness_s"]
    if coll.empty:
        return Table(names=cols)
    keys, n = _groups(coll["match_key"])
    ranks = coll["rank"].astype(np.int64)
    issue = coll["issue_us"].astype(np.float64)
    arrive = np.where(np.isnan(issue), coll["start_us"], issue)
    pairs = np.unique(np.stack([keys, ranks]), axis=1)
    seen = np.bincount(pairs[0], minlength=n)
    shared = seen[keys] > 1
    if not shared.any():
        return Table(names=cols)
    keys, ranks, arrive = keys[shared], ranks[shared], arrive[shared]
    first = np.full(n, np.inf)
    last = np.full(n, -np.inf)
    np.minimum.at(first, keys, arrive)
    np.maximum.at(last, keys, arrive)
    lateness_s = (arrive - first[keys]) / 1e6
    is_last = arrive == last[keys]
    rows = []
    for rank in np.unique(ranks).tolist():
        m = ranks == rank
        n_coll = int(np.unique(keys[m]).size)
        times_last = int(is_last[m].sum())
        rows.append({"rank": rank, "collectives": n_coll, "times_last": times_last,
                     "last_share_pct": 100.0 * times_last / n_coll, "mean_lateness_s": float(lateness_s[m].mean()),
                     "max_lateness_s": float(lateness_s[m].max())})
    return Table.from_rows(rows, cols)
