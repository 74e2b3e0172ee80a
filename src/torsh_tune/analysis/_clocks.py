"""Hosts' clocks put on one: the offset of each host's clock, read from the collectives every host completed.

Every record's times are Unix seconds on its own host's clock (`profiler/_clock.py`). Ranks on one host
share that clock; ranks on different hosts compare times only as far as NTP or PTP keeps the hosts
together: milliseconds off are common, and an arrival lateness read across hosts (stragglers, the rank
heatmap) is then that offset. A synchronizing collective (an all-reduce, all-gather, reduce-scatter,
all-to-all or barrier) completes on every rank at nearly the same moment, whoever arrived last: it
cannot end anywhere before every rank has joined. So the median, over the collectives that ranks of two
hosts both completed, of the difference of their completion times is the offset of the two hosts'
clocks, and a late host does not move it (its issue is late, not its completion). Only host-clock
records count (a device-clock record's completion sits on its step's device timeline). DDP's reducer
windows count too (the records of a DDP run without a Python comm hook): each ends after its rank's copy
back into the gradients, the same work on every rank.

A multi-host run also measured each host's clock against rank 0's at start-up (`meta["clock_sync"]`,
`profiler._clock.exchange_with_rank0`: NTP's ping-pong, off by at most half its best round trip) and
again as the default group was destroyed (`meta["clock_sync_end"]`). That is the offset used where it
is known: a line through the two exchanges where they differ by more than their bounds (the clocks
drifted apart; each record is moved by the line's value at its time), else the one with the shorter
round trip. The collectives check it over the whole run (a clock stepped in between shows as a
disagreement, and the collectives' offset is used then) and stand alone where no exchange was made.
On NCCL, whose records are on the device clock, the exchanges are the only estimate.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

__all__ = ["SYNCHRONIZING", "clock_note", "host_clock_offsets", "on_one_clock", "onto_one_clock"]

#: Collectives that complete on no rank before every rank of the group has joined.
SYNCHRONIZING = frozenset({"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                           "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
                           "barrier", "monitored_barrier"})
#: An offset is applied when at least this many collectives measured it, it exceeds this many seconds, it
#: stands out of its own spread (three standard errors, from the median absolute deviation), and it exceeds
#: how far the same collective's completions lie apart on one clock (the median over pairs of ranks on one
#: host: a ring's last hop, a thread woken late, DDP's copy back; 3.5 ms with 4 ranks on 2 cores, where a
#: 20 ms offset read 16.6-22.3 ms). Below 0.25 ms an offset moves no straggler verdict.
MIN_COLLECTIVES = 5
MIN_OFFSET_S = 250e-6

_TIME_COLUMNS = {"steps": ("t_start", "t_end"), "comm": ("t_issue", "t_complete", "t_start"),
                 "system": ("t", "t_since")}


def host_clock_offsets(comm: pd.DataFrame, meta: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per host other than rank 0's (or the lowest rank's): how far its clock is ahead of that host's.

    Returns rows {host, reference, offset_s, t_offset, drift_ppm, source, applied, exchange_offset_s,
    exchange_rtt_s, exchange_end_offset_s, exchange_end_rtt_s, collectives_offset_s, spread_s, jitter_s,
    collectives, disagree}. From the collectives: `collectives_offset_s` is the median over collectives of
    (median completion on the host - median completion on the reference host), `spread_s` its standard
    error (1.4826 x MAD / sqrt(n)), `jitter_s` the median distance between two ranks' completions of one
    collective on one host (None with one rank per host). From the exchanges with rank 0 at start-up and
    at the end (`exchange_*`, None without them). `offset_s` is the one used (`source`: "exchange" or
    "collectives"; None: neither): with `drift_ppm` (the exchanges' line; None: none seen) the offset at
    the Unix time `t_offset`, moving by `drift_ppm` millionths of the time since. `disagree`: the exchanges
    and the collectives differ by more than their errors (the collectives' offset is used then). Empty
    with fewer than two hosts.
    """
    host_of = {int(r): str(m.get("hostname")) for r, m in meta.items() if m.get("hostname")}
    hosts = sorted(set(host_of.values()))
    if len(hosts) < 2:
        return []
    reference = host_of[min(host_of)]
    exchanged = _exchanged(meta, host_of) if host_of.get(0) == reference else {}
    by_host, jitter = _completions_by_host(comm, host_of)
    rows = []
    for host in hosts:
        if host == reference:
            continue
        both = by_host[[host, reference]].dropna() if {host, reference} <= set(by_host.columns) else by_host.iloc[0:0]
        diff = (both[host] - both[reference]).to_numpy(dtype=float) if len(both) else np.array([])
        n = len(diff)
        col = spread = None
        col_ok = False
        if n:
            col = float(np.median(diff))
            spread = float(1.4826 * np.median(np.abs(diff - col)) / np.sqrt(n))
            col_ok = (n >= MIN_COLLECTIVES and abs(col) >= MIN_OFFSET_S and abs(col) > 3 * spread
                      and abs(col) > (jitter or 0.0))
        row = {"host": host, "reference": reference, "offset_s": col, "t_offset": None, "drift_ppm": None,
               "source": "collectives" if n else None, "applied": bool(col_ok), "exchange_offset_s": None,
               "exchange_rtt_s": None, "exchange_end_offset_s": None, "exchange_end_rtt_s": None,
               "collectives_offset_s": col, "spread_s": spread, "jitter_s": jitter, "collectives": n,
               "disagree": False}
        ex = exchanged.get(host)
        if ex is not None:
            row.update(exchange_offset_s=ex["ahead_s"], exchange_rtt_s=ex["rtt_s"],
                       exchange_end_offset_s=ex.get("end_ahead_s"), exchange_end_rtt_s=ex.get("end_rtt_s"))
            offset, t_offset, drift, bound = _exchange_line(ex)
            if col_ok:
                # Both measure the same offset: apart by more than the exchanges' bound, three standard errors
                # and one clock's jitter, the clock moved between (a step) and the run's own completions are the
                # better estimate for the run. The line is read where the collectives were, mid-run.
                mid = float(np.median(both[reference])) if drift else t_offset
                at_mid = offset + (drift or 0.0) * (mid - t_offset)
                row["disagree"] = bool(abs(col - at_mid) > bound + 3 * spread + (jitter or 0.0))
            if not row["disagree"]:
                row.update(offset_s=offset, t_offset=t_offset, drift_ppm=None if drift is None else drift * 1e6,
                           source="exchange",
                           applied=bool(drift is not None or (abs(offset) >= MIN_OFFSET_S and abs(offset) > bound)))
        rows.append(row)
    return rows


def _exchange_line(ex: dict[str, float]) -> tuple[float, float, float | None, float]:
    """(offset at `t_offset`, t_offset, drift per second or None, error bound) from a host's exchanges.

    Two exchanges apart by more than their bounds (half of each round trip) make a line; else the
    one with the shorter round trip is the offset, constant.
    """
    a0, r0, t0 = ex["ahead_s"], ex["rtt_s"], ex["t"]
    a1, r1, t1 = ex.get("end_ahead_s"), ex.get("end_rtt_s"), ex.get("end_t")
    if a1 is None or r1 is None or t1 is None or not t1 > t0:
        return a0, t0, None, r0 / 2
    if abs(a1 - a0) > (r0 + r1) / 2:
        return a0, t0, (a1 - a0) / (t1 - t0), max(r0, r1) / 2
    return (a0, t0, None, r0 / 2) if r0 <= r1 else (a1, t1, None, r1 / 2)


def _exchanged(meta: dict[int, dict[str, Any]], host_of: dict[int, str]) -> dict[str, dict[str, float]]:
    """host -> {ahead_s, rtt_s, t[, end_ahead_s, end_rtt_s, end_t]}: its ranks' exchanges with rank 0 at start-up
    and at the end (`meta["clock_sync"]`, `meta["clock_sync_end"]`)."""

    def numbers(sync: Any) -> tuple[float, float, float] | None:
        if not isinstance(sync, dict):
            return None
        values = (sync.get("ahead_s"), sync.get("rtt_s"), sync.get("t"))
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and np.isfinite(values).all():
            return float(values[0]), float(values[1]), float(values[2])
        return None

    out: dict[str, dict[str, float]] = {}
    for rank, m in sorted(meta.items()):
        start = numbers(m.get("clock_sync"))
        if start is None or int(rank) not in host_of or host_of[int(rank)] in out:
            continue
        row = dict(zip(("ahead_s", "rtt_s", "t"), start))
        end = numbers(m.get("clock_sync_end"))
        if end is not None:
            row.update(zip(("end_ahead_s", "end_rtt_s", "end_t"), end))
        out[host_of[int(rank)]] = row
    return out


def _completions_by_host(comm: pd.DataFrame, host_of: dict[int, str]) -> tuple[pd.DataFrame, float | None]:
    """(synchronizing collective x host: the median completion over the host's ranks, the one-clock jitter)."""
    if comm.empty:
        return pd.DataFrame(), None
    # Records from before the `clock` field were all host-clock ones.
    df = comm[comm["collective"].isin(SYNCHRONIZING) & (comm["clock"].fillna("host") == "host")]
    df = df[df["t_complete"].notna() & df["rank"].isin(host_of)]
    if df.empty:
        return pd.DataFrame(), None
    # collective (step, seq) x rank: its completion on that rank; per host, the median over the host's ranks
    done = df.pivot_table(index=["step", "seq"], columns="rank", values="t_complete")
    return done.T.groupby(lambda r: host_of[r]).median().T, _one_clock_jitter(done, host_of)


def _one_clock_jitter(done: pd.DataFrame, host_of: dict[int, str]) -> float | None:
    """The median |difference| of two ranks' completions of one collective on one host (one clock), from `done`
    (collective x rank); None when no host has two ranks that completed one."""
    on_host: dict[str, list[int]] = {}
    for rank in sorted(done.columns):
        on_host.setdefault(host_of[rank], []).append(rank)
    gaps = [(done[b] - done[a]).abs().dropna().to_numpy(dtype=float)
            for ranks in on_host.values() for a, b in zip(ranks, ranks[1:])]
    joined = np.concatenate(gaps) if gaps else np.array([])
    return float(np.median(joined)) if joined.size else None


def onto_one_clock(frames: dict[str, pd.DataFrame], meta: dict[int, dict[str, Any]],
                   offsets: list[dict[str, Any]]) -> dict[str, pd.DataFrame]:
    """`frames` (kind -> DataFrame) with the times of every rank on a host whose offset is applied moved onto the
    reference host's clock (copies; the others as they are). A drifting host's time moves by the offset at
    that time."""
    applied = {o["host"]: o for o in offsets if o["applied"]}
    if not applied:
        return frames
    of_rank = {int(r): applied[str(m.get("hostname"))] for r, m in meta.items() if str(m.get("hostname")) in applied}
    out = dict(frames)
    for kind, columns in _TIME_COLUMNS.items():
        df = frames.get(kind)
        if df is None or df.empty:
            continue
        rank = df["rank"]
        delta = rank.map({r: o["offset_s"] for r, o in of_rank.items()}).fillna(0.0).astype(float)
        drift = rank.map({r: o["drift_ppm"] * 1e-6 for r, o in of_rank.items() if o["drift_ppm"]})
        t_offset = rank.map({r: o["t_offset"] for r, o in of_rank.items() if o["drift_ppm"]})
        drifting = drift.notna().any()
        df = df.copy()
        for col in columns:
            if col in df.columns:
                moved = delta + (drift * (df[col] - t_offset)).fillna(0.0) if drifting else delta
                df[col] = df[col] - moved
        out[kind] = df
    return out


def clock_note(offsets: list[dict[str, Any]]) -> str | None:
    """One line on the hosts' clocks, for the run's notes; None with one host."""
    if not offsets:
        return None
    parts = []
    for o in offsets:
        if o["offset_s"] is None:
            parts.append(f"{o['host']}: no collective completed on both it and {o['reference']} and no start-up "
                         "exchange, its clock is taken as it is")
            continue
        ms = o["offset_s"] * 1e3
        evidence = []
        if o["exchange_offset_s"] is not None:
            evidence.append(f"start-up exchange with rank 0 {o['exchange_offset_s'] * 1e3:.3f} ms, within "
                            f"± {o['exchange_rtt_s'] * 1e3 / 2:.3f} ms")
        else:  # its leader made none (a run from before the exchanges) or it failed: the ranks' notes say why
            evidence.append("no exchange with rank 0 on record")
        if o["exchange_end_offset_s"] is not None:
            evidence.append(f"at the end {o['exchange_end_offset_s'] * 1e3:.3f} ms, within "
                            f"± {o['exchange_end_rtt_s'] * 1e3 / 2:.3f} ms")
        if o["drift_ppm"] is not None:
            evidence.append(f"drifting {o['drift_ppm']:+.1f} ppm, followed")
        if o["collectives_offset_s"] is not None:
            jitter = "" if o["jitter_s"] is None else f", completions on one clock {o['jitter_s'] * 1e3:.3f} ms apart"
            evidence.append(f"median over {o['collectives']} collectives' completions "
                            f"{o['collectives_offset_s'] * 1e3:.3f} ± {o['spread_s'] * 1e3:.3f} ms{jitter}")
        what = f"{o['host']} is {abs(ms):.3f} ms {'ahead of' if ms > 0 else 'behind'} {o['reference']}" \
               f"{' at start-up' if o['drift_ppm'] is not None else ''} " \
               f"({'; '.join(evidence)})"
        if o["disagree"]:
            what += ("; the exchanges and the collectives disagree (the clock was stepped during the run): the "
                     "collectives' offset is used")
        if o["applied"]:
            parts.append(f"{what}; its times were moved onto {o['reference']}'s clock")
        elif o["source"] == "collectives" and o["collectives"] < MIN_COLLECTIVES:
            parts.append(f"{what}; too few collectives to tell, not applied")
        else:
            parts.append(f"{what}; within the noise, not applied")
    return "hosts' clocks: " + "; ".join(parts)


def on_one_clock(frames: dict[str, pd.DataFrame], meta: dict[int, dict[str, Any]]
                 ) -> tuple[dict[str, pd.DataFrame], list[dict[str, Any]], str | None]:
    """(frames on rank 0's host's clock, the hosts' offsets, the note on them): what `load_run` and the dashboard's
    incremental frames both do with a run's records."""
    offsets = host_clock_offsets(frames["comm"], meta)
    return onto_one_clock(frames, meta, offsets), offsets, clock_note(offsets)
