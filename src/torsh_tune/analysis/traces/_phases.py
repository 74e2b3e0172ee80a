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
"""

from __future__ import annotations

import re

import numpy as np

from ...records import PHASE_ANNOTATION_PREFIX
from . import _intervals as iv
from ._model import TraceSet
from ._table import Table
from ._timeline import COMMUNICATION, COMPUTATION, LOADER_ANNOTATION, Timeline

__all__ = ["PHASE_COLUMNS", "phase_spans", "phase_table"]

_NONE = (np.empty(0), np.empty(0))

PHASE_COLUMNS = ["rank", "device", "num_phases", "phase_s", "phase_compute_s", "phase_pct", "phase_compute_pct",
                 "busy_outside_pct"]
_PHASE_RE = "^" + re.escape(PHASE_ANNOTATION_PREFIX) + r"(?:forward|backward|optimizer)$"


def phase_spans(trace: TraceSet, rank: int, timeline: Timeline) -> tuple[np.ndarray, np.ndarray]:
    """Each phase annotation's span (µs) on `timeline`'s clock: its kernels' span on a GPU
    (annotations that launched none are left out), the annotation itself on a CPU."""
    ev = trace.ranks[rank].table
    ids = trace.symbols.ids_matching(_PHASE_RE)
    # The host's annotations (Kineto also writes a gpu_user_annotation of the same name on a GPU).
    host = ev["cat_id"] == trace.symbols.id_of("user_annotation")
    rows = np.flatnonzero(np.isin(ev["name_id"], ids) & host & ~np.isnan(ev["dur_us"]))
    a0 = ev["ts_us"][rows]
    a1 = a0 + ev["dur_us"][rows]
    if timeline.device != "gpu":
        return a0, a1
    if timeline.launch_us is None or a0.size == 0:
        return np.empty(0), np.empty(0)
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


def phase_table(trace: TraceSet, timelines: dict[int, Timeline]) -> Table:
    """Per rank: the phases' union inside the analysed span, and its compute share.

    Returns:
        One row per rank with phase annotations: rank, device, num_phases, phase_s,
        phase_compute_s, phase_pct, phase_compute_pct (of the span `temporal_breakdown` uses);
        busy_outside_pct: the compute kernels' (CPU: the main thread's operators') busy time
        outside the phases, e.g. a loss computed after the model's forward, gradient arithmetic
        after backward, copies of the batch to the device. On a CPU it counts operators only
        (not a framework's annotated Python, whose `Optimizer.step` annotation holds the
        profiler's own step end), and not those inside the DataLoader's annotation (the
        collate: the always-on data time).
    """
    rows = []
    for rank, tl in timelines.items():
        spans = phase_spans(trace, rank, tl)
        if spans[0].size == 0:
            continue
        lo, hi = tl.window_us
        union = iv.merge(*iv.clip(*spans, lo, hi))
        comm = (tl.start_us[tl.kind == COMMUNICATION], tl.end_us[tl.kind == COMMUNICATION])
        exposed = iv.subtract(comm, tl.compute_intervals())
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
        rows.append({"rank": rank, "device": tl.device, "num_phases": int(spans[0].size), "phase_s": phase / 1e6,
                     "phase_compute_s": compute / 1e6, "phase_pct": pct(phase), "phase_compute_pct": pct(compute),
                     "busy_outside_pct": pct(iv.total(*operators) - iv.overlap(operators, union))})
    return Table.from_rows(rows, PHASE_COLUMNS)
