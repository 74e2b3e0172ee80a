"""Per-step view across ranks and what-if step times ("if rank r matched the median")."""

from __future__ import annotations

import numpy as np
import pandas as pd

from . import _intervals as iv
from ._model import TraceSet
from ._timeline import COMMUNICATION, COMPUTATION, Timeline, step_spans

__all__ = ["step_table", "counterfactuals"]


def step_table(traces: TraceSet, timelines: dict[int, Timeline]) -> pd.DataFrame:
    """One row per (rank, ProfilerStep): step_s, comm_s and exposed_comm_s inside it.

    Returns:
        rank, step, start_us, step_s, comm_s, exposed_comm_s (empty without ProfilerStep).
    """
    rows = []
    for rank, rt in traces.ranks.items():
        tl = timelines[rank]
        comm = (tl.start_us[tl.kind == COMMUNICATION], tl.end_us[tl.kind == COMMUNICATION])
        comp = (tl.start_us[tl.kind == COMPUTATION], tl.end_us[tl.kind == COMPUTATION])
        for st in step_spans(rt.events, traces.symbols).itertuples(index=False):
            c = iv.clip(*comm, st.start_us, st.end_us)
            p = iv.clip(*comp, st.start_us, st.end_us)
            comm_t = iv.total(*c)
            rows.append({"rank": rank, "step": st.step, "start_us": st.start_us,
                         "step_s": (st.end_us - st.start_us) / 1e6, "comm_s": comm_t / 1e6,
                         "exposed_comm_s": (comm_t - iv.overlap(c, p)) / 1e6})
    return pd.DataFrame(rows, columns=["rank", "step", "start_us", "step_s", "comm_s", "exposed_comm_s"])


def counterfactuals(steps: pd.DataFrame) -> dict[str, float | int | None]:
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
    for _, g in steps.groupby("step"):
        t = g["step_s"].to_numpy()
        worst = int(np.argmax(t))
        slowest.append(int(g["rank"].iloc[worst]))
        others = np.delete(t, worst)
        at_median = max(float(np.median(t)), float(others.max()) if others.size else 0.0)
        hidden = float((g["step_s"] - g["exposed_comm_s"]).max())
        per_step.append((float(t.max()), at_median, hidden))
    arr = np.asarray(per_step)
    return {"step_s": float(np.median(arr[:, 0])), "if_slowest_rank_at_median_s": float(np.median(arr[:, 1])),
            "if_comm_fully_overlapped_s": float(np.median(arr[:, 2])),
            "slowest_rank": int(pd.Series(slowest).mode().iloc[0])}
