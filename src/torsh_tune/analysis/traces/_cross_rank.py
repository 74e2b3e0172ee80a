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
    df = coll.assign(arrive_us=coll["issue_us"].fillna(coll["start_us"]))
    df = df[df.groupby("match_key")["rank"].transform("nunique") > 1]
    if df.empty:
        return pd.DataFrame(columns=cols)
    g = df.groupby("match_key")["arrive_us"]
    df = df.assign(lateness_s=(df["arrive_us"] - g.transform("min")) / 1e6,
                   is_last=df["arrive_us"] == g.transform("max"))
    per = df.groupby("rank").agg(collectives=("match_key", "nunique"), times_last=("is_last", "sum"),
                                 mean_lateness_s=("lateness_s", "mean"), max_lateness_s=("lateness_s", "max"))
    per["last_share_pct"] = 100.0 * per["times_last"] / per["collectives"]
    return per.reset_index()[cols]
