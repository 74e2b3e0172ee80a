"""The always-on phases as the trace saw them: what `self_check` compares the phase probes with.

Inside a trace window the phase probes annotate forward, backward and the optimizer step
(``torsh-tune::<phase>``, `records.PHASE_ANNOTATION_PREFIX`). On a GPU the always-on tier times
a phase with CUDA events on the stream, so its span runs from where the stream reached the
phase to the end of the phase's last kernel, idle gaps between kernels included (a
launch-bound step is mostly such gaps). The trace's counterpart is the span of the kernels
the host launched inside the annotation, first start to last end: the kernels' busy time
(`temporal_breakdown`'s compute) answers another question. On a CPU trace the annotation is
the host span itself.

Phase compute, as the always-on tier counts it, is the phases' union less the exposed
communication inside it (communication no compute kernel hides).

Beside the kernel spans, `phase_spans(..., as_events=True)` reads each phase as its CUDA events
would: an event completes once the host has recorded it and its stream has finished everything
launched on it before, so the phase runs from max(annotation start, end of the stream's earlier
kernels) to max(annotation end, end of the kernels launched before it closed). On a starved GPU
the two differ by the idle edges (the device waiting for the host to launch a phase's first
kernel, and for the host to leave the phase after its last): the always-on tier counts those,
the kernel spans do not. Every lease so far read the always-on compute 6–9 pp above the kernel
spans on such steps; the event reading says whether that gap is the edges or a misplaced event.
"""

from __future__ import annotations

import re

import numpy as np

from ...records import PHASE_ANNOTATION_PREFIX
from . import _intervals as iv
from ._model import TraceSet
from ._table import Table
from ._timeline import COMPUTATION, LOADER_ANNOTATION, Timeline

__all__ = ["PHASE_COLUMNS", "phase_compute_intervals", "phase_spans", "phase_table"]

_NONE = (np.empty(0), np.empty(0))

PHASE_COLUMNS = ["rank", "device", "num_phases", "phase_s", "phase_compute_s", "phase_pct", "phase_compute_pct",
                 "busy_outside_pct", "event_phase_compute_pct"]
_PHASE_RE = "^" + re.escape(PHASE_ANNOTATION_PREFIX) + r"(?:forward|backward|optimizer)$"


def phase_spans(trace: TraceSet, rank: int, timeline: Timeline, *,
                as_events: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each phase annotation's span (µs) on `timeline`'s clock: its kernels' span on a GPU
    (annotations that launched none are left out), the annotation itself on a CPU.

    `as_events` (GPU): the span its CUDA events on the compute stream would read (module
    docstring), every annotation included."""
    ev = trace.ranks[rank].table
    ids = trace.symbols.ids_matching(_PHASE_RE)
    # The host's annotations (Kineto also writes a gpu_user_annotation of the same name on a GPU).
    host = ev["cat_id"] == trace.symbols.id_of("user_annotation")
    rows = np.flatnonzero(np.isin(ev["name_id"], ids) & host & ~np.isnan(ev["dur_us"]))
    a0 = ev["ts_us"][rows]
    a1 = a0 + ev["dur_us"][rows]
    # A compiled optimizer step marks its begin and end (two zero-length annotations): one span each pair.
    b0, b1 = _paired_marks(trace, rank, host)
    if b0.size:
        a0, a1 = np.concatenate([a0, b0]), np.concatenate([a1, b1])
        order = np.argsort(a0, kind="stable")
        a0, a1 = a0[order], a1[order]
    if timeline.device != "gpu":
        return a0, a1
    if timeline.launch_us is None or a0.size == 0:
        return np.empty(0), np.empty(0)
    if as_events:
        return _event_spans(trace, rank, timeline, a0, a1)
    launched = ~np.isnan(timeline.launch_us)
    order = np.argsort(timeline.launch_us[launched], kind="stable")
    launch = timeline.launch_us[launched][order]
    start, end = timeline.start_us[launched][order], timeline.end_us[launched][order]
    lo = np.searchsorted(launch, a0, side="left")
    hi = np.searchsorted(launch, a1, side="right")
    has = hi > lo
    s = np.asarray([start[i:j].min() for i, j in zip(lo[has], hi[has])], dtype=np.float64)
    e = np.asarray([end[i:j].max() for i, j in zip(lo[has], hi[has])], dtype=np.float64)
    return s, e


def _paired_marks(trace: TraceSet, rank: int, host: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) µs of each ``optimizer.begin`` mark and the first ``optimizer.end`` after it."""
    ev = trace.ranks[rank].table
    prefix = re.escape(PHASE_ANNOTATION_PREFIX)
    marks = [np.sort(ev["ts_us"][np.isin(ev["name_id"], trace.symbols.ids_matching(f"^{prefix}optimizer\\.{which}$"))
                                 & host])
             for which in ("begin", "end")]
    begins, ends = marks
    if not (begins.size and ends.size):
        return np.empty(0), np.empty(0)
    k = np.searchsorted(ends, begins, side="left")
    has = k < ends.size
    # A begin whose end comes only after the next begin lost its end (the window closed): left out.
    nxt = np.append(begins[1:], np.inf)
    has &= ends[np.minimum(k, ends.size - 1)] <= nxt
    return begins[has], ends[k[has]]


def _event_spans(trace: TraceSet, rank: int, timeline: Timeline, a0: np.ndarray,
                 a1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the compute stream reached each annotation's start and end, as an event recorded there
    completes: the later of the host's time and the end of everything launched on the stream before."""
    if timeline.rows is None:
        return np.empty(0), np.empty(0)
    stream = trace.ranks[rank].table["stream"][np.maximum(timeline.rows, 0)]
    compute = (timeline.kind == COMPUTATION) & ~np.isnan(timeline.launch_us) & (timeline.rows >= 0)
    if not compute.any():
        return np.empty(0), np.empty(0)
    # The compute stream, where the phases' events are recorded: the one most of the kernels launched inside
    # the phases run on (a side stream's copies, FSDP2's all-gather copy-in, are fewer, if longer).
    order = np.argsort(timeline.launch_us[compute], kind="stable")
    launched, by_launch = timeline.launch_us[compute][order], stream[compute][order]
    # Each annotation's kernels are one run of the launch order: mark the runs with a difference array.
    edges = np.zeros(launched.size + 1, dtype=np.int64)
    np.add.at(edges, np.searchsorted(launched, a0, side="left"), 1)
    np.add.at(edges, np.searchsorted(launched, a1, side="right"), -1)
    inside = np.cumsum(edges[:-1]) > 0
    streams, counts = np.unique(by_launch[inside] if inside.any() else by_launch, return_counts=True)
    on = compute & (stream == streams[int(np.argmax(counts))])
    order = np.argsort(timeline.launch_us[on], kind="stable")
    launch = timeline.launch_us[on][order]
    done = np.maximum.accumulate(timeline.end_us[on][order])  # the stream's work finished by each launch's end
    return _reached(a0, launch, done), _reached(a1, launch, done)


def _reached(t: np.ndarray, launch: np.ndarray, done: np.ndarray) -> np.ndarray:
    """Where an event recorded at host times `t` completes: the later of `t` and the end of the stream's
    work launched by then (`done`, its running maximum of kernel ends in launch order)."""
    k = np.searchsorted(launch, t, side="right")
    prior = np.where(k > 0, done[np.maximum(k - 1, 0)], -np.inf)
    return np.maximum(t, prior)


def phase_compute_intervals(trace: TraceSet, rank: int, tl: Timeline) -> tuple[int, tuple, tuple] | None:
    """(number of phase spans, their union inside the analysed span, the exposed communication): phase
    compute is the union less its overlap with the exposed communication, over the window
    (`phase_table`) or a step (`step_table`). None without phase annotations."""
    spans = phase_spans(trace, rank, tl)
    if spans[0].size == 0:
        return None
    return int(spans[0].size), iv.merge(*iv.clip(*spans, *tl.window_us)), iv.subtract(tl.comm_intervals(),
                                                                               tl.compute_intervals())


def phase_table(trace: TraceSet, timelines: dict[int, Timeline]) -> Table:
    """Per rank: the phases' union inside the analysed span, and its compute share.

    Returns:
        One row per rank with phase annotations: rank, device, num_phases, phase_s,
        phase_compute_s, phase_pct, phase_compute_pct (of the span `temporal_breakdown` uses);
        event_phase_compute_pct (GPU, else NaN): phase_compute_pct with the spans the phases' CUDA
        events would read (`phase_spans(..., as_events=True)`);
        busy_outside_pct: the compute kernels' (CPU: the main thread's operators') busy time
        outside the phases, e.g. a loss computed after the model's forward, gradient arithmetic
        after backward, copies of the batch to the device. On a CPU it counts operators only
        (not a framework's annotated Python, whose `Optimizer.step` annotation holds the
        profiler's own step end), and not those inside the DataLoader's annotation (the
        collate: the always-on data time).
    """
    rows = []
    for rank, tl in timelines.items():
        intervals = phase_compute_intervals(trace, rank, tl)
        if intervals is None:
            continue
        num_phases, union, exposed = intervals
        lo, hi = tl.window_us
        phase = iv.total(*union)
        compute = phase - iv.overlap(union, exposed)
        span = hi - lo
        pct = (lambda x: 100.0 * x / span) if span > 0 else (lambda x: float("nan"))
        ops = tl.kind == COMPUTATION
        not_compute = tl.main_comm_us or _NONE
        if tl.device != "gpu" and tl.rows is not None:
            ev = trace.ranks[rank].table
            ops &= ev["cat_id"][np.maximum(tl.rows, 0)] == trace.symbols.id_of("cpu_op")
            # The batch's collate runs inside the DataLoader's annotation: the always-on side's data time.
            loader = np.flatnonzero(np.isin(ev["name_id"], trace.symbols.ids_matching(LOADER_ANNOTATION))
                                    & ~np.isnan(ev["dur_us"]))
            starts = ev["ts_us"][loader]
            not_compute = tuple(np.concatenate(x) for x in zip(not_compute, (starts, starts + ev["dur_us"][loader])))
        operators = iv.subtract(iv.clip(tl.start_us[ops], tl.end_us[ops], lo, hi), not_compute)
        event_pct = float("nan")
        if tl.device == "gpu":
            events = iv.merge(*iv.clip(*phase_spans(trace, rank, tl, as_events=True), lo, hi))
            if events[0].size:
                event_pct = pct(iv.total(*events) - iv.overlap(events, exposed))
        rows.append({"rank": rank, "device": tl.device, "num_phases": num_phases, "phase_s": phase / 1e6,
                     "phase_compute_s": compute / 1e6, "phase_pct": pct(phase), "phase_compute_pct": pct(compute),
                     "busy_outside_pct": pct(iv.total(*operators) - iv.overlap(operators, union)),
                     "event_phase_compute_pct": event_pct})
    return Table.from_rows(rows, PHASE_COLUMNS)
