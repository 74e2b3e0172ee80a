"""Per-step view across ranks and what-if step times ("if rank r matched the median")."""

from __future__ import annotations

import numpy as np

from . import _intervals as iv
from ._model import TraceSet
from ._phases import phase_compute_intervals
from ._table import Table
from ._timeline import COMMUNICATION, Timeline, step_spans

__all__ = ["step_table", "counterfactuals"]


def step_table(traces: TraceSet, timelines: dict[int, Timeline]) -> Table:
    """One row per (rank, ProfilerStep): step_s, comm_s and exposed_comm_s inside it.

    On a CPU also phase_compute_s: the always-on phases' annotations inside the step less the
    communication exposed in them, `phase_table`'s compute step by step (NaN on a GPU, whose
    kernels are not inside the host's step spans, and without phase annotations).

    Returns:
        rank, step, start_us, step_s, comm_s, exposed_comm_s, phase_compute_s (empty without ProfilerStep).
    """
    rows = []
    for rank, rt in traces.ranks.items():
        tl = timelines[rank]
        comm = (tl.start_us[tl.kind == COMMUNICATION], tl.end_us[tl.kind == COMMUNICATION])
        # The compute `comm_overlap` counts (on CPU, not the main thread's waits for collectives inside an
        # enclosing operator): each step's exposed comm then sums to the window's.
        comp = tl.compute_intervals()
        spans = step_spans(rt.table, traces.symbols)
        phases = phase_compute_intervals(traces, rank, tl) if tl.device != "gpu" and len(spans["step"]) else None
        for step, start, end in zip(*(spans[c].tolist() for c in ("step", "start_us", "end_us"))):
            c = iv.clip(*comm, start, end)
            p = iv.clip(*comp, start, end)
            comm_t = iv.total(*c)
            phase_compute = float("nan")
            if phases is not None:
                _, union, exposed = phases
                u = iv.clip(*union, start, end)
                phase_compute = (iv.total(*u) - iv.overlap(u, iv.clip(*exposed, start, end))) / 1e6
            rows.append({"rank": rank, "step": step, "start_us": start, "step_s": (end - start) / 1e6,
                         "comm_s": comm_t / 1e6, "exposed_comm_s": (comm_t - iv.overlap(c, p)) / 1e6,
                         "phase_compute_s": phase_compute})
    return Table.from_rows(rows, ["rank", "step", "start_us", "step_s", "comm_s", "exposed_comm_s", "phase_compute_s"])


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
