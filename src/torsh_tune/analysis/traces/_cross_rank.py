"""Cross-rank views of collectives: wait vs transfer, achieved bandwidth, stragglers."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .._comm import bus_factor

__all__ = ["collective_timing", "stragglers"]


def collective_timing(coll: pd.DataFrame) -> pd.DataFrame:
    """Split each collective's duration into waiting for peers and transferring.

    A collective cannot finish before its last rank arrives: each rank's ``wait_s`` =
    latest start across ranks − own start, and ``transfer_s`` = the minimum duration
    across ranks (the last arriver waits for no one). Collectives seen on one rank only
    keep their own duration as transfer (wait unknown, NaN). algbw = size / transfer;
    busbw = algbw × nccl-tests' bus factor for the kind and group size.

    Returns:
        `coll` plus ranks_seen, wait_s, transfer_s, algbw_gbps, busbw_gbps.
    """
    out = coll.copy()
    if out.empty:
        for c in ("ranks_seen", "wait_s", "transfer_s", "algbw_gbps", "busbw_gbps"):
            out[c] = pd.Series(dtype=float)
        return out
    g = out.groupby("match_key")
    out["ranks_seen"] = g["rank"].transform("nunique")
    latest = g["start_us"].transform("max")
    shared = out["ranks_seen"] > 1
    out["wait_s"] = np.where(shared, (latest - out["start_us"]) / 1e6, np.nan)
    out["transfer_s"] = np.where(shared, g["dur_us"].transform("min"), out["dur_us"]) / 1e6
    algbw = out["size_bytes"] / out["transfer_s"].where(out["transfer_s"] > 0) / 1e9
    factor = [bus_factor(c, int(n) if n == n else 1) for c, n in zip(out["collective"], out["group_size"])]
    out["algbw_gbps"] = algbw
    out["busbw_gbps"] = algbw * np.asarray(factor, dtype=float)
    return out


def stragglers(coll: pd.DataFrame) -> pd.DataFrame:
    """Which rank arrives last at collectives seen on two or more ranks, and by how much.

    Arrival is the CPU issue time when known (gloo, NCCL launch), else the start.

    Returns:
        One row per rank: rank, collectives, times_last, last_share_pct, mean_lateness_s
        (arrival − earliest arrival at the same collective), max_lateness_s.
    """
    cols = ["rank", "collectives", "times_last", "last_share_pct", "mean_lateness_s", "max_lateness_s"]
    if coll.empty:
        return pd.DataFrame(columns=cols)
    # numpy over factorized keys: a handful of pandas groupbys cost more than the rest of
    # the analysis on a small trace.
    keys, _ = pd.factorize(coll["match_key"])
    ranks = coll["rank"].to_numpy()
    arrive = coll["issue_us"].fillna(coll["start_us"]).to_numpy(dtype=float)
    seen = np.zeros(keys.max() + 1, dtype=np.int64)
    pairs = np.unique(np.stack([keys, ranks]), axis=1)
    np.add.at(seen, pairs[0], 1)
    shared = seen[keys] > 1
    if not shared.any():
        return pd.DataFrame(columns=cols)
    keys, ranks, arrive = keys[shared], ranks[shared], arrive[shared]
    first = np.full(seen.size, np.inf)
    last = np.full(seen.size, -np.inf)
    np.minimum.at(first, keys, arrive)
    np.maximum.at(last, keys, arrive)
    lateness_s = (arrive - first[keys]) / 1e6
    is_last = arrive == last[keys]
    rows = []
    for rank in np.unique(ranks).tolist():
        m = ranks == rank
        n = int(np.unique(keys[m]).size)
        times_last = int(is_last[m].sum())
        rows.append({"rank": rank, "collectives": n, "times_last": times_last,
                     "last_share_pct": 100.0 * times_last / n, "mean_lateness_s": float(lateness_s[m].mean()),
                     "max_lateness_s": float(lateness_s[m].max())})
    return pd.DataFrame(rows, columns=cols)
