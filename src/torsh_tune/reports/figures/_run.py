"""Figures of one run (its `RunFrames`): step time, breakdown, communication, ranks, resources, loss.

Each figure is an info dataclass, the `get_*_info(frames, ...)` that fills it (aggregated
server-side to about `max_points` points per series) and the `plot_*(info)` that draws it,
side by side; `build_figures` draws them all, keyed by `FIGURE_TITLES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from ...analysis import PHASES, RunFrames, comm_timed, phase_frame
from ...records import PLANNED_FIELDS
from .._format import PHASE_LABELS
from ._common import DEFAULT_MAX_POINTS, FloatTuple, downsample, floats, new_figure, no_data, styled

if TYPE_CHECKING:  # plotly is loaded lazily, by the plot functions only
    import plotly.graph_objects as go

__all__ = [
    "FIGURE_TITLES",
    "PHASE_COLORS",
    "BreakdownInfo",
    "CommTimelineInfo",
    "LossInfo",
    "OverlapInfo",
    "RankHeatmapInfo",
    "RankResourceSeries",
    "ResourceInfo",
    "StepSeriesInfo",
    "build_figures",
    "get_breakdown_info",
    "get_comm_timeline_info",
    "get_loss_info",
    "get_overlap_info",
    "get_rank_heatmap_info",
    "get_resource_info",
    "get_step_series_info",
    "plot_breakdown",
    "plot_comm_timeline",
    "plot_loss",
    "plot_memory",
    "plot_overlap",
    "plot_rank_heatmap",
    "plot_step_series",
    "plot_utilization",
]

#: Keys of `build_figures`, in display order, with their titles.
FIGURE_TITLES = {
    "step_series": "Step time and throughput",
    "breakdown": "Step breakdown",
    "comm_timeline": "Communication timeline (buckets per rank)",
    "overlap": "Communication overlap",
    "rank_heatmap": "Per-rank step time and lateness",
    "memory": "Memory",
    "utilization": "CPU / GPU utilisation",
    "loss": "Loss",
}
#: Colours of the breakdown phases (colour-blind safe, Okabe-Ito).
PHASE_COLORS = {
    "data": "#E69F00",
    "forward": "#56B4E9",
    "backward_compute": "#0072B2",
    "exposed_comm": "#D55E00",
    "optimizer": "#009E73",
    "other": "#999999",
    "evaluation": "#CC79A7",
    "checkpoint": "#F0E442",
    "loader": "#000000",
}


# -- step time and throughput ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StepSeriesInfo:
    """Global step time (slowest rank per step) and throughput over steps."""

    step: FloatTuple  # first step of each bucket
    step_min_s: FloatTuple
    step_median_s: FloatTuple
    step_max_s: FloatTuple
    throughput_samples_s: FloatTuple  # median per bucket of samples (all ranks) / step time
    warmup: tuple[bool, ...]  # the bucket holds a warm-up step
    warmup_end_step: int | None  # last warm-up step, None without warm-up
    bucket_size: int
    num_steps: int

    @property
    def empty(self) -> bool:
        return not self.step


def get_step_series_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> StepSeriesInfo:
    """Global step time and throughput over all steps, warm-up included and marked.

    The global step time of a step is its slowest rank's step_s (what the job waits for);
    throughput is the step's samples summed over ranks divided by it.

    Example:
        >>> info = get_step_series_info(load_run(run_dir))  # doctest: +SKIP
        >>> info.warmup_end_step, info.bucket_size  # doctest: +SKIP
    """
    steps = frames.steps
    if steps.empty:
        return StepSeriesInfo(step=(), step_min_s=(), step_median_s=(), step_max_s=(), throughput_samples_s=(),
                              warmup=(), warmup_end_step=None, bucket_size=1, num_steps=0)
    g = steps.groupby("step", sort=True)
    per_step = pd.DataFrame({"step_s": g["step_s"].max(), "samples": g["samples"].sum(min_count=1),
                             "warmup": g["warmup"].any()})
    step_s = per_step["step_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tput = np.where(step_s > 0, per_step["samples"].to_numpy(dtype=float) / step_s, np.nan)
    x = per_step.index.to_numpy()
    d = downsample(x, step_s, max_points=max_points)
    t = downsample(x, tput, max_points=max_points)
    warm = per_step["warmup"].to_numpy(dtype=bool)
    warm_buckets = pd.Series(warm).groupby(np.arange(len(warm)) // d.bucket_size).any().to_numpy()
    return StepSeriesInfo(
        step=d.x, step_min_s=d.y_min, step_median_s=d.y_median, step_max_s=d.y_max,
        throughput_samples_s=t.y_median, warmup=tuple(bool(w) for w in warm_buckets),
        warmup_end_step=_warmup_end(steps), bucket_size=d.bucket_size, num_steps=len(per_step),
    )


def plot_step_series(info: StepSeriesInfo) -> "go.Figure":
    """Step time (median line inside a min-max band, ms) and throughput (right axis)."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["step_series"], secondary_y=True)
    if info.empty:
        return no_data(fig, "steps")
    x = list(info.step)
    if info.bucket_size > 1:
        fig.add_trace(go.Scatter(x=x, y=_ms(info.step_max_s), mode="lines", line=dict(width=0), name="max",
                                 showlegend=False, hoverinfo="skip"), secondary_y=False)
        fig.add_trace(go.Scatter(x=x, y=_ms(info.step_min_s), mode="lines", line=dict(width=0), fill="tonexty",
                                 fillcolor="rgba(0,114,178,0.2)", name=f"min-max per {info.bucket_size} steps"),
                      secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=_ms(info.step_median_s), mode="lines", line=dict(color="#0072B2"),
                             name="step time (slowest rank)"), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=list(info.throughput_samples_s), mode="lines",
                             line=dict(color="#009E73", dash="dot"), name="throughput"), secondary_y=True)
    _mark_warmup(fig, x[0], info.warmup_end_step)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="step time (ms)", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="samples/s", rangemode="tozero", showgrid=False, secondary_y=True)
    return fig


# -- step breakdown -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class BreakdownInfo:
    """Per-step phase times (mean across ranks, then mean per bucket), stacking to step time."""

    step: FloatTuple
    # PHASES order; before "other", the parts of it the records name (`records.PLANNED_FIELDS`: evaluation
    # passes, checkpoint saves), only when the run has any
    phases_s: dict[str, FloatTuple]
    warmup_end_step: int | None
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


def get_breakdown_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> BreakdownInfo:
    """Phase times per step (mean across ranks), averaged per bucket so they still stack.

    The phases are `analysis.PHASES` as `analysis.phase_frame` splits them; they sum to
    the mean step time across ranks. A step's evaluation pass and checkpoint saves (rare, long:
    the median breakdown leaves them in "other") are shown as phases of their own, out of "other".
    """
    steps = frames.steps
    if steps.empty:
        return BreakdownInfo(step=(), phases_s={p: () for p in PHASES}, warmup_end_step=None, bucket_size=1)
    frame = phase_frame(steps)
    names = list(PHASES)
    for part, col in PLANNED_FIELDS.items():
        if col in steps:
            spent = pd.to_numeric(steps[col], errors="coerce").fillna(0.0).clip(lower=0.0)
            if (spent > 0).any():
                frame[part] = np.minimum(spent, frame["other"])  # host seconds, at most what "other" holds
                frame["other"] -= frame[part]
                names.insert(names.index("other"), part)
    per_step = frame.groupby("step", sort=True)[names].mean()
    n = len(per_step)
    size = max(1, math.ceil(n / max(1, max_points)))
    bucket = np.arange(n) // size
    means = per_step.groupby(bucket).mean()
    return BreakdownInfo(
        step=floats(per_step.index.to_numpy()[::size]),
        phases_s={p: floats(means[p].to_numpy()) for p in names},
        warmup_end_step=_warmup_end(steps),
        bucket_size=size,
    )


def plot_breakdown(info: BreakdownInfo) -> "go.Figure":
    """Stacked phases per step (ms): data, forward, backward compute, exposed comm, optimizer, [evaluation,
    checkpoint,] other."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["breakdown"])
    if info.empty:
        return no_data(fig, "steps")
    x = list(info.step)
    for phase, values in info.phases_s.items():
        fig.add_trace(go.Scatter(x=x, y=_ms(values), mode="lines", stackgroup="phases",
                                 line=dict(width=0.5, color=PHASE_COLORS.get(phase)),
                                 name=PHASE_LABELS.get(phase, phase)))
    _mark_warmup(fig, x[0], info.warmup_end_step)
    fig.update_xaxes(title_text="step" + (f" (mean per {info.bucket_size} steps)" if info.bucket_size > 1 else ""))
    fig.update_yaxes(title_text="time per step (ms, mean across ranks)", rangemode="tozero")
    return fig


# -- communication timeline -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CommTimelineInfo:
    """Collectives of a few steps on every rank, times relative to the first step's start."""

    steps: tuple[int, ...]  # the steps shown
    rank: tuple[int, ...]  # one entry per collective
    step: tuple[int, ...]
    bucket: tuple[int, ...]
    collective: tuple[str, ...]
    start_s: FloatTuple  # t_issue - t0
    duration_s: FloatTuple
    bytes: FloatTuple
    step_bounds: tuple[tuple[int, int, float, float], ...]  # (rank, step, start_s, end_s)

    @property
    def empty(self) -> bool:
        return not self.rank


def get_comm_timeline_info(
    frames: RunFrames, *, steps: Sequence[int] | None = None, num_steps: int = 3
) -> CommTimelineInfo:
    """Every rank's collectives during a few steps (by default the last `num_steps` measured).

    Args:
        frames: the run.
        steps: the steps to show; default the last `num_steps` steps with comm records,
            measured (non-warm-up) ones preferred.
        num_steps: how many steps by default.
    """
    comm, st = frames.comm, frames.steps
    if steps is None:
        candidates = comm["step"] if not comm.empty else st["step"]
        measured = st.loc[~st["warmup"].astype(bool), "step"] if not st.empty else pd.Series(dtype="int64")
        steps = _newest_steps(candidates.to_numpy(np.int64), measured.to_numpy(np.int64), num_steps)
    chosen = tuple(int(s) for s in steps)
    c = comm[comm["step"].isin(chosen)] if not comm.empty else comm
    s = st[st["step"].isin(chosen)] if not st.empty else st
    starts = [v for v in (c["t_issue"].min() if not c.empty else np.nan,
                          s["t_start"].min() if not s.empty else np.nan) if np.isfinite(v)]
    t0 = min(starts) if starts else 0.0
    c = c.sort_values(["rank", "t_issue"], kind="stable")
    dur = c["duration_s"].astype(float)
    dur = dur.where(dur.notna(), c["t_complete"].astype(float) - c["t_issue"].astype(float))
    bounds = tuple(
        (int(r), int(k), float(a - t0), float(b - t0))
        for r, k, a, b in s[["rank", "step", "t_start", "t_end"]].itertuples(index=False)
        if np.isfinite(a) and np.isfinite(b)
    )
    return CommTimelineInfo(
        steps=chosen,
        rank=tuple(int(r) for r in c["rank"]),
        step=tuple(int(k) for k in c["step"]),
        bucket=tuple(int(b) if np.isfinite(b) else -1 for b in c["bucket"].astype(float)),
        collective=tuple(str(x) if x is not None else "?" for x in c["collective"]),
        start_s=floats(c["t_issue"].to_numpy(dtype=float) - t0),
        duration_s=floats(dur.to_numpy(dtype=float)),
        bytes=floats(c["bytes"].to_numpy(dtype=float)),
        step_bounds=bounds,
    )


def _newest_steps(candidates: np.ndarray, measured: np.ndarray, num: int) -> list[int]:
    """The newest `num` steps among `candidates` that are measured too (all candidates when none is).

    Looks at a window of the newest steps first and widens it only when it holds too few: a
    live 100 000-step run must not sort every step to find the last three.
    """
    if num <= 0 or len(candidates) == 0:
        return []
    newest, oldest = int(candidates.max()), int(candidates.min())
    window = 4 * num
    while True:
        lo = newest - window
        pool = np.intersect1d(candidates[candidates > lo], measured[measured > lo])
        if len(pool) >= num or lo < oldest:
            break
        window *= 4
    if len(pool) == 0:  # nothing measured among them (a short or crashed run): the newest collectives
        pool = np.unique(candidates)
    return [int(x) for x in pool[-num:]]


def plot_comm_timeline(info: CommTimelineInfo) -> "go.Figure":
    """One row per rank: step spans (grey) and each collective from issue to completion."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["comm_timeline"])
    fig.update_layout(hovermode="closest", barmode="overlay")
    if info.empty and not info.step_bounds:
        return no_data(fig, "collectives")
    if info.step_bounds:
        r, k, a, b = zip(*info.step_bounds)
        fig.add_trace(go.Bar(y=[f"rank {v}" for v in r], x=[(e - s) * 1e3 for s, e in zip(a, b)],
                             base=[s * 1e3 for s in a], orientation="h", width=0.8, name="step",
                             marker=dict(color="rgba(150,150,150,0.25)", line=dict(color="#666", width=1)),
                             customdata=list(k), hovertemplate="step %{customdata}<extra></extra>"))
    buckets = sorted(set(info.bucket))
    palette = ("#D55E00", "#0072B2", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#F0E442")
    for i, bkt in enumerate(buckets):
        idx = [j for j, v in enumerate(info.bucket) if v == bkt]
        fig.add_trace(go.Bar(
            y=[f"rank {info.rank[j]}" for j in idx], x=[info.duration_s[j] * 1e3 for j in idx],
            base=[info.start_s[j] * 1e3 for j in idx], orientation="h", width=0.4,
            name=f"bucket {bkt}" if bkt >= 0 else "collective", marker=dict(color=palette[i % len(palette)]),
            customdata=[[info.step[j], info.collective[j], info.bytes[j] / 2**20] for j in idx],
            hovertemplate="step %{customdata[0]} %{customdata[1]}: %{x:.2f} ms, %{customdata[2]:.2f} MiB"
                          "<extra></extra>",
        ))
    fig.update_xaxes(title_text="time since the first shown step started (ms)")
    fig.update_yaxes(autorange="reversed")
    return fig


# -- communication overlap ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OverlapInfo:
    """Communication per step (mean across ranks): how much of it is hidden by compute."""

    step: FloatTuple
    comm_s: FloatTuple
    exposed_comm_s: FloatTuple
    overlap_pct: FloatTuple  # 100 * (1 - exposed / comm); NaN without communication
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


def get_overlap_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> OverlapInfo:
    """Per step (mean across ranks): communication time, its exposed part and the overlap %."""
    steps = frames.steps
    if steps.empty:
        return OverlapInfo(step=(), comm_s=(), exposed_comm_s=(), overlap_pct=(), bucket_size=1)
    # Steps whose DDP all-reduce went untimed (PyTorch samples its CUDA timers) are gaps, not zeros.
    per_step = comm_timed(steps).groupby("step", sort=True)[["comm_s", "exposed_comm_s"]].mean()
    n = len(per_step)
    size = max(1, math.ceil(n / max(1, max_points)))
    means = per_step.groupby(np.arange(n) // size).mean()
    comm = means["comm_s"].to_numpy(dtype=float)
    exposed = means["exposed_comm_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        overlap = np.where(comm > 0, 100.0 * (1.0 - exposed / comm), np.nan)
    return OverlapInfo(step=floats(per_step.index.to_numpy()[::size]), comm_s=floats(comm),
                       exposed_comm_s=floats(exposed), overlap_pct=floats(np.clip(overlap, 0.0, 100.0)),
                       bucket_size=size)


def plot_overlap(info: OverlapInfo) -> "go.Figure":
    """Hidden and exposed communication per step (stacked, ms) and the overlap % (right axis)."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["overlap"], secondary_y=True)
    if info.empty or not any(v > 0 for v in info.comm_s if math.isfinite(v)):
        return no_data(fig, "communication")
    x = list(info.step)
    hidden = [max(0.0, c - e) * 1e3 for c, e in zip(info.comm_s, info.exposed_comm_s)]
    fig.add_trace(go.Scatter(x=x, y=_ms(info.exposed_comm_s), stackgroup="comm", name="exposed",
                             line=dict(width=0.5, color="#D55E00")), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=hidden, stackgroup="comm", name="hidden behind compute",
                             line=dict(width=0.5, color="#56B4E9")), secondary_y=False)
    fig.add_trace(go.Scatter(x=x, y=list(info.overlap_pct), mode="lines", name="overlap %",
                             line=dict(color="#000", dash="dot")), secondary_y=True)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="communication per step (ms)", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="overlap (%)", range=[0, 100], tickmode="linear", dtick=20, showgrid=False,
                     secondary_y=True)
    return fig


# -- per-rank heatmaps ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankHeatmapInfo:
    """rank x step-bucket matrices (median per bucket); NaN where a rank has no record."""

    ranks: tuple[int, ...]
    step: FloatTuple  # first step of each column
    step_s: tuple[FloatTuple, ...]  # [rank][column]
    lateness_s: tuple[FloatTuple, ...]  # [rank][column]
    lateness_basis: str  # "comm" (arrival at the last collective) or "compute" (excess compute)
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.ranks or not self.step


def get_rank_heatmap_info(frames: RunFrames, *, max_columns: int = 400) -> RankHeatmapInfo:
    """rank x step matrices of step time and lateness, medians per bucket of steps.

    Lateness at a step is how much later than the earliest rank a rank issued the step's
    last collective (the one that gates the optimizer step), as `analysis.straggler_stats`
    measures it; without comm records, how much more compute time (forward + backward
    compute) a rank spent than the fastest rank. A straggler is a bright row.
    """
    steps = frames.steps
    if steps.empty:
        return RankHeatmapInfo(ranks=(), step=(), step_s=(), lateness_s=(), lateness_basis="comm", bucket_size=1)
    step_s = _step_rank_matrix(steps["step"], steps["rank"], steps["step_s"], reduce=np.fmax)
    lateness = _lateness_by_step(frames.comm)
    basis = "comm"
    if lateness is None:
        ph = phase_frame(steps)
        ph["compute_s"] = ph["forward"] + ph["backward_compute"]
        comp = ph.pivot_table(index="step", columns="rank", values="compute_s", aggfunc="sum")
        lateness = comp.sub(comp.min(axis=1), axis=0)
        basis = "compute"
    lateness = lateness.reindex(index=step_s.index, columns=step_s.columns)
    n = len(step_s)
    size = max(1, math.ceil(n / max(1, max_columns)))
    bucket = np.arange(n) // size
    s_med = step_s.groupby(bucket).median()
    l_med = lateness.groupby(bucket).median()
    return RankHeatmapInfo(
        ranks=tuple(int(r) for r in step_s.columns),
        step=floats(step_s.index.to_numpy()[::size]),
        step_s=tuple(floats(s_med[r].to_numpy()) for r in step_s.columns),
        lateness_s=tuple(floats(l_med[r].to_numpy()) for r in step_s.columns),
        lateness_basis=basis,
        bucket_size=size,
    )


def _lateness_by_step(comm: pd.DataFrame) -> pd.DataFrame | None:
    """step x rank: t_issue of each rank's last collective of the step minus the earliest rank's.

    Only the last collective per (rank, step) is needed, which keeps this linear in the
    comm records (a 100 000-step run has millions of them).
    """
    if comm.empty:
        return None
    r, k, q = (comm[c].to_numpy(np.int64) for c in ("rank", "step", "seq"))
    key = (r * (int(k.max()) + 1) + k) * (int(q.max()) + 1) + q
    # load_run already sorts by rank, step, seq: skip the sort (the slow part) when it holds.
    order = np.arange(len(key)) if bool(np.all(key[1:] >= key[:-1])) else np.argsort(key, kind="stable")
    r, k = r[order], k[order]
    is_last = np.ones(len(order), dtype=bool)
    is_last[:-1] = (r[1:] != r[:-1]) | (k[1:] != k[:-1])
    issue = _step_rank_matrix(k[is_last], r[is_last], comm["t_issue"].to_numpy(float)[order][is_last])
    if issue.shape[1] < 2:
        return None
    return issue.sub(issue.min(axis=1), axis=0)


def _step_rank_matrix(step: Any, rank: Any, values: Any, *, reduce: Any = None) -> pd.DataFrame:
    """step x rank DataFrame (sorted both ways, NaN where missing); `reduce` merges duplicates (default: last)."""
    steps_u, si = np.unique(np.asarray(step, dtype=np.int64), return_inverse=True)
    ranks_u, ri = np.unique(np.asarray(rank, dtype=np.int64), return_inverse=True)
    out = np.full((len(steps_u), len(ranks_u)), np.nan)
    v = np.asarray(values, dtype=float)
    if reduce is None:
        out[si, ri] = v
    else:
        reduce.at(out, (si, ri), v)  # np.fmax ignores the NaN it starts from
    return pd.DataFrame(out, index=pd.Index(steps_u, name="step"), columns=pd.Index(ranks_u, name="rank"))


def plot_rank_heatmap(info: RankHeatmapInfo) -> "go.Figure":
    """Two heatmaps, rank x step: step time and lateness (ms); a straggler is a bright row."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    late = "arrival lateness at the last collective" if info.lateness_basis == "comm" else "excess compute"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("step time (ms)", f"{late} (ms)"))
    styled(fig, FIGURE_TITLES["rank_heatmap"], hovermode="closest", height=260 + 40 * len(info.ranks))
    if info.empty:
        return no_data(fig, "steps")
    y = [f"rank {r}" for r in info.ranks]
    for row, matrix, scale, bar_y in ((1, info.step_s, "Viridis", 0.8), (2, info.lateness_s, "Inferno", 0.2)):
        z = [[v * 1e3 if math.isfinite(v) else None for v in vals] for vals in matrix]
        fig.add_trace(go.Heatmap(z=z, x=list(info.step), y=y, colorscale=scale,
                                 colorbar=dict(len=0.42, y=bar_y, title="ms"),
                                 hovertemplate="%{y}, step %{x}: %{z:.2f} ms<extra></extra>"), row=row, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig


# -- memory and utilisation -----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankResourceSeries:
    """One rank's system samples over time (s since the run's first record)."""

    rank: int
    t_s: FloatTuple
    rss_bytes: FloatTuple  # max per bucket
    cpu_pct: FloatTuple  # mean per bucket, % of one core
    gpu_util_pct: FloatTuple  # mean per bucket; NaN without a GPU
    gpu_mem_used_bytes: FloatTuple  # max per bucket; NaN without a GPU


@dataclass(frozen=True, kw_only=True)
class ResourceInfo:
    """Memory and utilisation over time, per rank, and the machine's totals."""

    per_rank: tuple[RankResourceSeries, ...]
    sys_t_s: FloatTuple  # whole-machine CPU, from the lowest rank's sampler
    sys_cpu_pct: FloatTuple
    mem_total_bytes: float | None
    gpu_mem_total_bytes: float | None
    has_gpu: bool

    @property
    def empty(self) -> bool:
        return not any(s.t_s for s in self.per_rank)


def get_resource_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> ResourceInfo:
    """System samples per rank over time, downsampled to `max_points` split over the ranks."""
    sysf = frames.system
    if sysf.empty:
        return ResourceInfo(per_rank=(), sys_t_s=(), sys_cpu_pct=(), mem_total_bytes=None,
                            gpu_mem_total_bytes=None, has_gpu=False)
    starts = [sysf["t"].min()]
    if not frames.steps.empty:
        starts.append(frames.steps["t_start"].min())
    t0 = float(np.nanmin(np.asarray(starts, dtype=float)))
    ranks = sorted(int(r) for r in sysf["rank"].unique())
    per_series = max(50, max_points // max(1, len(ranks)))
    series = []
    for r in ranks:
        df = sysf[sysf["rank"] == r].sort_values("t", kind="stable")
        n = len(df)
        size = max(1, math.ceil(n / per_series))
        g = df.groupby(np.arange(n) // size)
        series.append(RankResourceSeries(
            rank=r,
            t_s=floats(df["t"].to_numpy(dtype=float)[::size] - t0),
            rss_bytes=floats(g["rss_bytes"].max().to_numpy(dtype=float)),
            cpu_pct=floats(g["cpu_pct"].mean().to_numpy(dtype=float)),
            gpu_util_pct=floats(g["gpu_util_pct"].mean().to_numpy(dtype=float)),
            gpu_mem_used_bytes=floats(g["gpu_mem_used_bytes"].max().to_numpy(dtype=float)),
        ))
    first = sysf[sysf["rank"] == ranks[0]].sort_values("t", kind="stable")
    machine = downsample(first["t"].to_numpy(dtype=float) - t0, first["sys_cpu_pct"].to_numpy(dtype=float),
                         max_points=per_series)
    mem_total = sysf["mem_total_bytes"].max()
    gpu_total = sysf["gpu_mem_total_bytes"].max()
    return ResourceInfo(
        per_rank=tuple(series),
        sys_t_s=machine.x,
        sys_cpu_pct=tuple(float(v) for v in pd.Series(machine.y_median).to_numpy()),
        mem_total_bytes=float(mem_total) if np.isfinite(mem_total) else None,
        gpu_mem_total_bytes=float(gpu_total) if np.isfinite(gpu_total) else None,
        has_gpu=bool(sysf["gpu_util_pct"].notna().any() or sysf["gpu_mem_used_bytes"].notna().any()),
    )


def plot_memory(info: ResourceInfo) -> "go.Figure":
    """Memory per rank over time (GiB): GPU memory used when there is a GPU, else process RSS."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["memory"])
    if info.empty:
        return no_data(fig, "system samples")
    for s in info.per_rank:
        values = s.gpu_mem_used_bytes if info.has_gpu else s.rss_bytes
        fig.add_trace(go.Scatter(x=list(s.t_s), y=[v / 2**30 for v in values], mode="lines",
                                 name=f"rank {s.rank} {'GPU memory' if info.has_gpu else 'RSS'}"))
    total = info.gpu_mem_total_bytes if info.has_gpu else None
    if total:
        fig.add_hline(y=total / 2**30, line_dash="dash", line_color="#D55E00", annotation_text="GPU capacity")
    fig.update_xaxes(title_text="time (s)")
    fig.update_yaxes(title_text="GiB", rangemode="tozero")
    return fig


def plot_utilization(info: ResourceInfo) -> "go.Figure":
    """CPU % per rank (of one core), the machine's CPU % and, with a GPU, GPU utilisation."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["utilization"])
    if info.empty:
        return no_data(fig, "system samples")
    for s in info.per_rank:
        fig.add_trace(go.Scatter(x=list(s.t_s), y=list(s.cpu_pct), mode="lines", name=f"rank {s.rank} CPU"))
        if info.has_gpu:
            fig.add_trace(go.Scatter(x=list(s.t_s), y=list(s.gpu_util_pct), mode="lines",
                                     line=dict(dash="dot"), name=f"rank {s.rank} GPU"))
    if info.sys_t_s:
        fig.add_trace(go.Scatter(x=list(info.sys_t_s), y=list(info.sys_cpu_pct), mode="lines",
                                 line=dict(color="#000", dash="dash"), name="machine CPU (% of all cores)"))
    fig.update_xaxes(title_text="time (s)")
    fig.update_yaxes(title_text="utilisation (%)", rangemode="tozero")
    return fig


# -- loss -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LossInfo:
    """Loss over steps (mean across ranks per step, then min/median/max per bucket)."""

    step: FloatTuple
    loss_min: FloatTuple
    loss_median: FloatTuple
    loss_max: FloatTuple
    warmup_end_step: int | None
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


def get_loss_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> LossInfo:
    """The recorded loss per step (mean across ranks), min/median/max per bucket."""
    steps = frames.steps
    rec = steps[steps["loss"].notna()] if not steps.empty else steps
    if rec.empty:
        return LossInfo(step=(), loss_min=(), loss_median=(), loss_max=(), warmup_end_step=None, bucket_size=1)
    per_step = rec.groupby("step", sort=True)["loss"].mean()
    d = downsample(per_step.index.to_numpy(), per_step.to_numpy(dtype=float), max_points=max_points)
    return LossInfo(step=d.x, loss_min=d.y_min, loss_median=d.y_median, loss_max=d.y_max,
                    warmup_end_step=_warmup_end(steps), bucket_size=d.bucket_size)


def plot_loss(info: LossInfo) -> "go.Figure":
    """Loss over steps (median, with a min-max band when downsampled)."""
    import plotly.graph_objects as go

    fig = new_figure(FIGURE_TITLES["loss"])
    if info.empty:
        return no_data(fig, "loss")
    x = list(info.step)
    if info.bucket_size > 1:
        fig.add_trace(go.Scatter(x=x, y=list(info.loss_max), mode="lines", line=dict(width=0), showlegend=False,
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=x, y=list(info.loss_min), mode="lines", line=dict(width=0), fill="tonexty",
                                 fillcolor="rgba(204,121,167,0.2)", name="min-max"))
    fig.add_trace(go.Scatter(x=x, y=list(info.loss_median), mode="lines+markers" if len(x) < 100 else "lines",
                             line=dict(color="#CC79A7"), name="loss"))
    _mark_warmup(fig, x[0], info.warmup_end_step)
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="loss")
    return fig


# -- all of them, and what they share -------------------------------------------------------


def build_figures(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> dict[str, "go.Figure"]:
    """Every figure of a run, keyed and ordered as `FIGURE_TITLES`.

    Example:
        >>> figs = build_figures(load_run(run_dir))  # doctest: +SKIP
        >>> list(figs)[:2]  # doctest: +SKIP
        ['step_series', 'breakdown']
    """
    resources = get_resource_info(frames, max_points=max_points)
    return {
        "step_series": plot_step_series(get_step_series_info(frames, max_points=max_points)),
        "breakdown": plot_breakdown(get_breakdown_info(frames, max_points=max_points)),
        "comm_timeline": plot_comm_timeline(get_comm_timeline_info(frames)),
        "overlap": plot_overlap(get_overlap_info(frames, max_points=max_points)),
        "rank_heatmap": plot_rank_heatmap(get_rank_heatmap_info(frames, max_columns=min(400, max_points))),
        "memory": plot_memory(resources),
        "utilization": plot_utilization(resources),
        "loss": plot_loss(get_loss_info(frames, max_points=max_points)),
    }


def _warmup_end(steps: pd.DataFrame) -> int | None:
    warm = steps.loc[steps["warmup"].astype(bool), "step"] if not steps.empty else steps
    return int(warm.max()) if len(warm) else None


def _mark_warmup(fig: "go.Figure", first_step: float, warmup_end_step: int | None) -> None:
    if warmup_end_step is None:
        return
    fig.add_vrect(x0=first_step - 0.5, x1=warmup_end_step + 0.5, fillcolor="#bbbbbb", opacity=0.25, line_width=0,
                  annotation_text="warm-up", annotation_position="top left")


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values]
