"""Figure of a run's Kineto traces: per-rank timeline of one profiled step (compute, communication, idle by cause).

`get_trace_timeline_info` turns a `TraceAnalysis` into plain segments, downsampled to at
most ``max_segments`` per rank; `plot_trace_timeline` draws them with plotly. Shown by
``analysis.html`` and the dashboard's trace view.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ...analysis.traces import IDLE_CAUSES
from ...analysis.traces._intervals import paint
from ...analysis.traces._timeline import COMMUNICATION, COMPUTATION, MEMORY

__all__ = ["SEGMENT_KINDS", "TraceTimelineInfo", "get_trace_timeline_info", "plot_trace_timeline"]

#: Segment labels in drawing priority: busy kinds, then idle by cause.
SEGMENT_KINDS = ("compute", "communication", "memory", *(f"idle: {c}" for c in IDLE_CAUSES))
_COLORS = {"compute": "#0072B2", "communication": "#E69F00", "memory": "#009E73", "idle: sync": "#CC79A7",
           "idle: comm_wait": "#D55E00", "idle: host_wait": "#999999", "idle: other": "#D9D9D9"}


class TraceTimelineInfo(NamedTuple):
    """What the timeline figure shows.

    Attributes:
        step: the ProfilerStep shown (None: the whole profiled window).
        origin_us: trace time of the figure's zero (earliest step start over ranks).
        segments: rank, kind (one of `SEGMENT_KINDS`), start_ms, end_ms (from origin).
        num_raw_segments: segments before downsampling, per rank.
    """

    step: int | None
    origin_us: float
    segments: pd.DataFrame
    num_raw_segments: dict[int, int]


def _pick_step(steps: pd.DataFrame) -> int | None:
    """The step whose slowest rank is the median over steps (a typical step)."""
    if steps.empty:
        return None
    worst = steps.groupby("step")["step_s"].max().sort_values(kind="stable")
    return int(worst.index[(len(worst) - 1) // 2])


def _downsample_segments(a: np.ndarray, b: np.ndarray, label: np.ndarray, lo: float, hi: float, bins: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """At most `bins` pieces: [lo, hi] in equal bins, each given the label covering most of it."""
    edges = np.linspace(lo, hi, bins + 1)
    share = np.zeros((len(SEGMENT_KINDS), bins))
    for k in np.unique(label):
        ka, kb = a[label == k], b[label == k]
        # Covered length of label k up to t is piecewise linear with knots at the piece
        # bounds (pieces are sorted and disjoint): interpolate it at the bin edges.
        before = np.concatenate([[0.0], np.cumsum(kb - ka)[:-1]])
        knots_t = np.column_stack([ka, kb]).ravel()
        knots_v = np.column_stack([before, before + (kb - ka)]).ravel()
        share[k] = np.diff(np.interp(edges, knots_t, knots_v))
    best = share.argmax(axis=0)
    heads = np.flatnonzero(np.r_[True, best[1:] != best[:-1]])
    tails = np.append(heads[1:], bins) - 1
    return edges[heads], edges[tails + 1], best[heads]


def get_trace_timeline_info(analysis: Any, *, step: int | None = None, max_segments: int = 1500) -> TraceTimelineInfo:
    """Segments of one step on every rank, ready to draw.

    Args:
        analysis: a `TraceAnalysis` (needs ``timelines``, ``steps``, ``idle_segments``).
        step: the ProfilerStep to show; default the step whose slowest rank is the median.
        max_segments: most segments per rank; more are merged into equal time bins, each
            drawn as the kind covering most of it.

    Returns:
        A `TraceTimelineInfo`.

    Raises:
        ValueError: `step` is not a profiled step, or `max_segments` < 1.
    """
    if max_segments < 1:
        raise ValueError(f"max_segments must be at least 1, but got {max_segments=}.")
    steps = analysis.steps
    if step is None:
        step = _pick_step(steps)
    elif step not in set(steps["step"]):
        raise ValueError(f"step must be one of the profiled steps {sorted(set(steps['step']))}, but got {step=}.")
    frames = []
    raw: dict[int, int] = {}
    spans = steps[steps["step"] == step] if step is not None else steps.iloc[0:0]
    origin = (float(spans["start_us"].min()) if len(spans)
              else min(tl.window_us[0] for tl in analysis.timelines.values()))
    for rank, tl in analysis.timelines.items():
        mine = spans[spans["rank"] == rank]
        if step is not None and mine.empty:
            continue
        lo, hi = ((float(mine["start_us"].iloc[0]), float(mine["start_us"].iloc[0] + mine["step_s"].iloc[0] * 1e6))
                  if step is not None else tl.window_us)
        idle = analysis.idle_segments[analysis.idle_segments["rank"] == rank]
        layers = [(tl.start_us[tl.kind == k], tl.end_us[tl.kind == k]) for k in (COMPUTATION, COMMUNICATION, MEMORY)]
        by_cause = {c: g for c, g in idle.groupby("cause")}
        layers += [(by_cause[c]["start_us"].to_numpy(), by_cause[c]["end_us"].to_numpy()) if c in by_cause
                   else (np.empty(0), np.empty(0)) for c in IDLE_CAUSES]
        a, b, label = paint(lo, hi, layers)
        keep = label >= 0
        a, b, label = a[keep], b[keep], label[keep]
        raw[rank] = int(a.size)
        if a.size > max_segments:
            a, b, label = _downsample_segments(a, b, label, lo, hi, max_segments)
        frames.append(pd.DataFrame({"rank": rank, "kind": np.asarray(SEGMENT_KINDS, dtype=object)[label],
                                    "start_ms": (a - origin) / 1e3, "end_ms": (b - origin) / 1e3}))
    segments = (pd.concat(frames, ignore_index=True) if frames
                else pd.DataFrame(columns=["rank", "kind", "start_ms", "end_ms"]))
    return TraceTimelineInfo(step=step, origin_us=origin, segments=segments, num_raw_segments=raw)


def plot_trace_timeline(info: TraceTimelineInfo) -> Any:
    """A plotly Figure: one row per rank, segments as horizontal bars coloured by kind."""
    import plotly.graph_objects as go

    fig = go.Figure()
    seg = info.segments
    for kind in SEGMENT_KINDS:
        part = seg[seg["kind"] == kind]
        if part.empty:
            continue
        fig.add_trace(go.Bar(
            name=kind, orientation="h", y=[f"rank {r}" for r in part["rank"]], base=part["start_ms"],
            x=part["end_ms"] - part["start_ms"], marker={"color": _COLORS[kind], "line": {"width": 0}},
            hovertemplate="%{y}: " + kind + " %{base:.3f} ms + %{x:.3f} ms<extra></extra>",
        ))
    title = f"Step {info.step}" if info.step is not None else "Profiled window"
    fig.update_layout(barmode="overlay", bargap=0.3, title=f"{title}: compute, communication and idle per rank",
                      xaxis_title="time since the step's earliest start (ms)", yaxis={"autorange": "reversed"},
                      legend={"orientation": "h", "y": -0.25}, height=160 + 40 * max(1, seg["rank"].nunique()),
                      margin={"l": 70, "r": 20, "t": 50, "b": 90})
    return fig
