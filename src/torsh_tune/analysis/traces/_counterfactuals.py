"""Per-step view across ranks and what-if step times ("if rank r matched the median")."""

from __future__ import annotations

import numpy as np

from . import _intervals as iv
from ._model import TraceSet
from ._phases import phase_compute_intervals
from ._table import Table
from ._timeline import Timeline, step_spans

__all__ = ["counterfactuals", "device_step_spans", "step_table"]


def step_table(traces: TraceSet, timelines: dict[int, Timeline]) -> Table:
    """One row per (rank, ProfilerStep): step_s, comm_s and exposed_comm_s inside it (as `comm_overlap`
    reads them: on a CPU, comm_s is the time collectives were in flight).

    ``step_s`` is the ``ProfilerStep#`` span (host clock). What is inside a step is read on the
    timeline's clock: on a CPU, the host span itself; on a GPU, the device time the step's kernels
    cover (`device_step_spans`: from the earliest start of the kernels the host launched inside the
    span to that of the next step's), since the host runs ahead of the device and its span holds
    another step's kernels. Those device spans tile the timeline, so the steps' communication adds up
    to the window's. ``device_step_s`` is that span (NaN on a CPU, and for a step that launched no
    kernel: the window's last, whose kernels the analysis drops). ``phase_compute_s``: the always-on
    phases' annotations (GPU: the spans of the kernels launched inside them) inside the step less the
    communication exposed in them, `phase_table`'s compute step by step (NaN without phase annotations).

    Returns:
        rank, step, start_us, step_s, device_step_s, comm_s, exposed_comm_s, phase_compute_s (empty
        without ProfilerStep).
    """
    rows = []
    for rank, rt in traces.ranks.items():
        tl = timelines[rank]
        comm, flight = tl.comm_intervals(), tl.in_flight_intervals()
        # The compute `comm_overlap` counts (on CPU, not the main thread's waits for collectives inside an
        # enclosing operator): each step's exposed comm then sums to the window's.
        comp = tl.compute_intervals()
        spans = step_spans(rt.table, traces.symbols)
        if not len(spans["step"]):
            continue
        phases = phase_compute_intervals(traces, rank, tl)
        host = (spans["start_us"], spans["end_us"])
        gpu = tl.device == "gpu"
        lo, hi = device_step_spans(tl, *host) if gpu else host
        for step, h0, h1, start, end in zip(*(a.tolist() for a in (spans["step"], *host, lo, hi))):
            device_s = (end - start) / 1e6 if gpu else float("nan")
            if not end >= start:  # a step that launched no kernel: nothing of it in the analysed timeline
                rows.append({"rank": rank, "step": step, "start_us": h0, "step_s": (h1 - h0) / 1e6,
                             "device_step_s": float("nan"), "comm_s": 0.0, "exposed_comm_s": 0.0,
                             "phase_compute_s": float("nan")})
                continue
            c = iv.clip(*comm, start, end)
            p = iv.clip(*comp, start, end)
            comm_t = iv.total(*iv.clip(*flight, start, end))
            phase_compute = float("nan")
            if phases is not None:
                _, union, exposed = phases
                u = iv.clip(*union, start, end)
                phase_compute = (iv.total(*u) - iv.overlap(u, iv.clip(*exposed, start, end))) / 1e6
            rows.append({"rank": rank, "step": step, "start_us": h0, "step_s": (h1 - h0) / 1e6,
                         "device_step_s": device_s, "comm_s": comm_t / 1e6,
                         "exposed_comm_s": (iv.total(*c) - iv.overlap(c, p)) / 1e6, "phase_compute_s": phase_compute})
    return Table.from_rows(rows, ["rank", "step", "start_us", "step_s", "device_step_s", "comm_s", "exposed_comm_s",
                                  "phase_compute_s"])


def device_step_spans(tl: Timeline, start_us: np.ndarray, end_us: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each host step span's device counterpart on a GPU timeline (µs; NaN for a step that launched no kernel).

    A step's kernels are the ones the host launched inside its span (their launch's correlation). Its
    device span runs from the earliest start among them to the earliest start among the next step's
    (the last step's: to the latest end among its own), so the spans tile the device timeline in step
    order: a kernel launched in one step that runs on after the next step's first kernel started is
    split between them, as the always-on tier's step events on the stream split it.
    """
    n = start_us.size
    lo, hi = np.full(n, np.nan), np.full(n, np.nan)
    if tl.launch_us is None or n == 0:
        return lo, hi
    launched = np.flatnonzero(~np.isnan(tl.launch_us))
    at = tl.launch_us[launched]
    step = np.searchsorted(start_us, at, side="right") - 1
    inside = (step >= 0) & (at < end_us[np.maximum(step, 0)])
    step, launched = step[inside], launched[inside]
    first, last = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(first, step, tl.start_us[launched])
    np.maximum.at(last, step, tl.end_us[launched])
    has = np.flatnonzero(np.isfinite(first))
    if has.size == 0:
        return lo, hi
    starts = np.maximum.accumulate(first[has])  # in step order, even where a side stream started earlier
    lo[has] = starts
    hi[has] = np.append(starts[1:], max(float(last[has[-1]]), float(starts[-1])))
    return lo, hi


def counterfactuals(steps: Table) -> dict[str, float | int | None]:
    """What-if step times over the profiled steps (medians over steps, seconds).

    Synchronous data parallelism makes a step as slow as its slowest rank, so:
    ``step_s`` = max over ranks; ``if_slowest_rank_at_median_s`` replaces the slowest
    rank's step time by the median rank's; ``if_comm_fully_overlapped_s`` removes each
    rank's exposed communication. ``slowest_rank`` is the rank most often slowest.
    """
    if steps.empty:
        return {"step_s": None, "if_slowest_rank_at_median_s": None, "if_comm_fully_overlapped_s": None,
                "slowest_rank": None}
    per_step = []
    slowest = []
    for step in np.unique(steps["step"]).tolist():
        g = steps[steps["step"] == step]
        t = g["step_s"]
        worst = int(np.argmax(t))
        slowest.append(int(g["rank"][worst]))
        others = np.delete(t, worst)
        at_median = max(float(np.median(t)), float(others.max()) if others.size else 0.0)
        hidden = float((g["step_s"] - g["exposed_comm_s"]).max())
        per_step.append((float(t.max()), at_median, hidden))
    arr = np.asarray(per_step)
    ranks, counts = np.unique(slowest, return_counts=True)
    return {"step_s": float(np.median(arr[:, 0])), "if_slowest_rank_at_median_s": float(np.median(arr[:, 1])),
            "if_comm_fully_overlapped_s": float(np.median(arr[:, 2])),
            "slowest_rank": int(ranks[np.argmax(counts)])}
