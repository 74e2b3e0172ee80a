"""Idle-time causes: why each rank's device (GPU, or CPU main thread + gloo) sat idle.

Idle time is the temporal breakdown's: the parts of the profiled span where no kernel
(CPU: no main-thread operator and no gloo worker span) runs. Each idle stretch is cut
where its cause changes and labelled, first match wins:

1. ``sync``: a host thread is inside a call that blocks until the device is done
   (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``,
   synchronous ``cudaMemcpy``, ``aten::item``...; `CommPatterns.syncs`).
2. ``comm_wait``: a host thread is inside a wait on a collective (``c10d`` wait/barrier,
   ``wait_tensor``, torchrec awaitables; `CommPatterns.comm_waits`); on GPU, the kernel
   that ends the stretch is a collective launched before the stretch began (held back
   by its stream); on CPU, a collective issued by the main thread and not yet started
   by its gloo worker.
3. ``host_wait``: the device ran dry because the host had not issued the next work in
   time. GPU: the kernel that ends the idle stretch was launched after the stretch began
   (HTA's host-wait rule, applied to the device rather than to each stream). CPU: the
   main thread was between operators (Python, data loading).
4. ``other``: the next (non-communication) kernel was launched in time but started late
   (launch latency, a dependency the trace does not show).

Time that collectives spend waiting for late peers is busy (non-compute) time on the
timeline, not idle; `idle_causes` reports it beside the idle split as ``peer_wait_s``.

`idle_by_stream` is HTA's per-stream view instead (``get_idle_time_breakdown``, HTA 0.5),
reproduced so the numbers can be compared with it. Each CUDA stream is taken alone: the
gap before each of its kernels (memcpy/memset included) since the previous one on that
stream ended is ``host_wait`` when the kernel was launched after that end, else
``kernel_wait`` when shorter than 30 µs (HTA's ``consecutive_kernel_delay``), else
``other``. Gaps overlapped by other streams' work still count, so a stream's idle time is
not the device's.
"""

from __future__ import annotations

import numpy as np

from . import _intervals as iv
from ._model import TraceSet
from ._table import Table
from ._timeline import COMMUNICATION, COMPUTATION, CommPatterns, Timeline

__all__ = ["IDLE_CAUSES", "STREAM_IDLE_CAUSES", "idle_by_stream", "idle_causes", "idle_segments"]

IDLE_CAUSES = ("sync", "comm_wait", "host_wait", "other")
SEGMENT_COLUMNS = ["rank", "start_us", "end_us", "dur_us", "cause"]
STREAM_IDLE_CAUSES = ("host_wait", "kernel_wait", "other")
STREAM_COLUMNS = (["rank", "stream", "idle_s"] + [f"{c}_s" for c in STREAM_IDLE_CAUSES]
                  + [f"{c}_pct" for c in STREAM_IDLE_CAUSES])
# Event categories HTA 0.5 counts as a stream's kernels (not cuda_sync, not gpu_user_annotation).
_KERNEL_CATEGORIES = ("kernel", "Kernel", "gpu_memset", "Memset", "gpu_memcpy", "Memcpy", "mtia_ccp_events")
_SYNC, _COMM_WAIT, _HOST_WAIT, _OTHER = range(4)


def _host_spans(traces: TraceSet, rank: int, pattern: str) -> tuple[np.ndarray, np.ndarray]:
    ev = traces.ranks[rank].table
    ids = traces.symbols.ids_matching(pattern)
    rows = (ev["stream"] < 0) & np.isin(ev["name_id"], ids) & ~np.isnan(ev["dur_us"])
    s = ev["ts_us"][rows]
    return s, s + ev["dur_us"][rows]


def _gap_causes(tl: Timeline, gs: np.ndarray, ge: np.ndarray) -> np.ndarray:
    """Per idle stretch, the cause given by the work that ends it (index into IDLE_CAUSES).

    GPU: launched after the stretch began -> host_wait; launched before and a
    collective -> comm_wait; else other. CPU: host_wait (the main thread issues all work).
    """
    if tl.device != "gpu" or tl.launch_us is None:
        return np.full(gs.size, _HOST_WAIT)
    order = np.argsort(tl.start_us, kind="stable")
    starts, launches, kinds = tl.start_us[order], tl.launch_us[order], tl.kind[order]
    nxt = np.minimum(np.searchsorted(starts, ge, side="left"), starts.size - 1)
    launch = launches[nxt]
    late = launch > gs  # an unknown launch (NaN) is not evidence of host wait
    held = (launch <= gs) & (kinds[nxt] == COMMUNICATION)
    return np.where(late, _HOST_WAIT, np.where(held, _COMM_WAIT, _OTHER))


def idle_segments(timelines: dict[int, Timeline], traces: TraceSet, patterns: CommPatterns) -> Table:
    """Every idle stretch of every rank, cut where its cause changes.

    Args:
        timelines: per-rank timelines (`rank_timeline`; on CPU with their queued collectives, `with_queues`).
        traces: the parsed traces (host events: syncs and comm waits).
        patterns: `CommPatterns` (``syncs``, ``comm_waits``).

    Returns:
        rank, start_us, end_us, dur_us, cause (one of `IDLE_CAUSES`), sorted by rank and start.
    """
    parts = []
    for rank, tl in timelines.items():
        lo, hi = tl.window_us
        gs, ge = iv.gaps(tl.start_us, tl.end_us, lo, hi)
        if gs.size == 0:
            continue
        sync = _host_spans(traces, rank, patterns.syncs)
        waits = _host_spans(traces, rank, patterns.comm_waits)
        comm = waits
        if tl.queued_us is not None:  # gloo: a collective issued by the main thread, not yet picked up by its worker
            comm = (np.concatenate([waits[0], tl.queued_us[0]]), np.concatenate([waits[1], tl.queued_us[1]]))
        gap_cause = _gap_causes(tl, gs, ge)
        busy = (tl.start_us, tl.end_us)
        by_gap = [(gs[gap_cause == c], ge[gap_cause == c]) for c in (_COMM_WAIT, _HOST_WAIT, _OTHER)]
        # Label order = priority: busy time is not idle; then sync, comm waits, the gap's own cause.
        a, b, label = iv.paint(lo, hi, [busy, sync, comm, *by_gap])
        keep = label > 0
        cause = np.asarray((None, "sync", "comm_wait", "comm_wait", "host_wait", "other"), dtype=object)[label[keep]]
        parts.append(Table({"rank": np.full(cause.size, rank, dtype=np.int64), "start_us": a[keep],
                            "end_us": b[keep], "dur_us": b[keep] - a[keep], "cause": cause}))
    return Table.concat(parts, SEGMENT_COLUMNS)


def idle_causes(segments: Table, timelines: dict[int, Timeline], collectives: Table) -> Table:
    """Per rank: idle time split by cause, and the time collectives waited for peers.

    Args:
        segments: `idle_segments` output.
        timelines: the same per-rank timelines.
        collectives: `collective_timing` output (needs ``wait_s``).

    Returns:
        One row per rank: rank, device, idle_s, sync_s, comm_wait_s, host_wait_s, other_s
        (these four sum to idle_s), sync_pct ... other_pct (of idle_s), and peer_wait_s:
        collective time spent waiting for the last peer to arrive while no compute ran
        (busy, non-compute time on the timeline: not part of idle_s).
    """
    rows = []
    for rank, tl in timelines.items():
        mine = segments["rank"] == rank
        dur = segments["dur_us"].astype(float)[mine]
        cause = segments["cause"][mine]
        idle = float(dur.sum())
        row: dict = {"rank": rank, "device": tl.device, "idle_s": idle / 1e6}
        for c in IDLE_CAUSES:
            row[f"{c}_s"] = float(dur[cause == c].sum()) / 1e6
        for c in IDLE_CAUSES:
            row[f"{c}_pct"] = 100.0 * row[f"{c}_s"] / row["idle_s"] if idle > 0 else float("nan")
        waited = collectives
        if len(waited):
            waited = waited[(waited["rank"] == rank) & (waited["wait_s"] > 0)]
        start = waited["start_us"].astype(float) if "start_us" in waited else np.empty(0)
        wait = waited["wait_s"].astype(float) if "wait_s" in waited else np.empty(0)
        waiting = (start, start + wait * 1e6)
        compute = (tl.start_us[tl.kind == COMPUTATION], tl.end_us[tl.kind == COMPUTATION])
        row["peer_wait_s"] = (iv.total(*waiting) - iv.overlap(waiting, compute)) / 1e6
        rows.append(row)
    cols = (["rank", "device", "idle_s"] + [f"{c}_s" for c in IDLE_CAUSES] + [f"{c}_pct" for c in IDLE_CAUSES]
            + ["peer_wait_s"])
    return Table.from_rows(rows, cols)


def idle_by_stream(traces: TraceSet, timelines: dict[int, Timeline], *, hta_rounding: bool = False,
                   kernel_wait_us: float = 30.0) -> Table:
    """Per (rank, CUDA stream): idle time split as HTA 0.5's ``get_idle_time_breakdown``.

    On each stream, the kernels (and memcpy/memset) sorted by start; the gap before each
    one since the previous one ended is ``host_wait`` when it was launched (host runtime
    call) after that end, else ``kernel_wait`` when shorter than `kernel_wait_us`, else
    ``other``. Gaps are summed as they are (a negative one, from overlapping events on a
    stream, counts negatively, as in HTA); a kernel whose launch is not in the trace is
    never host wait. GPU ranks only.

    Args:
        traces: the parsed traces (stream and category of each event).
        timelines: per-rank timelines from `rank_timeline` (their kernel set: the last
            ProfilerStep filter, and with ``hta_rounding`` the rounded times); CPU
            timelines and ones without ``rows`` give no rows.
        hta_rounding: round launch times up to whole µs too, as HTA 0.5 does with
            sub-µs traces (pass the value the timelines were built with).
        kernel_wait_us: HTA's ``consecutive_kernel_delay`` (its default, 30; HTA's
            docstring says ns but its timestamps are µs).

    Returns:
        One row per (rank, stream), sorted: rank, stream, idle_s, host_wait_s,
        kernel_wait_s, other_s (these three sum to idle_s), host_wait_pct ...
        other_pct (of idle_s; NaN when the stream never idled). No rows for CPU ranks.
    """
    cat_ids = [i for i in map(traces.symbols.id_of, _KERNEL_CATEGORIES) if i >= 0]
    parts = []
    for rank, tl in timelines.items():
        if tl.device != "gpu" or tl.rows is None or tl.launch_us is None:
            continue
        ev = traces.ranks[rank].table
        keep = np.isin(ev["cat_id"][tl.rows], cat_ids)
        if not keep.any():
            continue
        stream = ev["stream"][tl.rows[keep]]
        order = np.lexsort((tl.start_us[keep], stream))
        stream = stream[order]
        start, end = tl.start_us[keep][order], tl.end_us[keep][order]
        launch = tl.launch_us[keep][order]
        if hta_rounding:
            launch = np.ceil(launch)
        prev_end = np.concatenate([[np.nan], end[:-1]])
        follows = np.concatenate([[False], stream[1:] == stream[:-1]])  # not its stream's first kernel
        gap = np.where(follows, start - prev_end, 0.0)
        host = follows & (launch > prev_end)  # NaN launch: False
        cause = np.where(host, 0, np.where(follows & (gap < kernel_wait_us), 1, 2))
        streams, idx = np.unique(stream, return_inverse=True)
        sums = np.bincount(idx * 3 + cause, weights=gap, minlength=3 * streams.size).reshape(-1, 3) / 1e6
        idle = sums.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            pct = np.where(idle[:, None] != 0, 100.0 * sums / idle[:, None], np.nan)
        cols = {"rank": np.full(streams.size, rank, dtype=np.int64), "stream": streams.astype(np.int64),
                "idle_s": idle}
        cols.update({f"{c}_s": sums[:, k] for k, c in enumerate(STREAM_IDLE_CAUSES)})
        cols.update({f"{c}_pct": pct[:, k] for k, c in enumerate(STREAM_IDLE_CAUSES)})
        parts.append(Table(cols))
    return Table.concat(parts, STREAM_COLUMNS)
