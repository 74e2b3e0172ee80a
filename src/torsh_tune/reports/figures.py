"""Figures of a run, shared by the HTML report and the Dash dashboard.

Data and drawing are apart (as in optuna's visualisation): each `get_*_info(frames, ...)`
turns a run's `RunFrames` into a frozen dataclass of plain values (tuples of floats,
NaN where a value is missing), already aggregated on the server side so that a figure
never carries more than about `max_points` points per series, however long the run;
each `plot_*(info)` draws one into a `plotly.graph_objects.Figure`. Tests target the info
functions; the plot functions are thin.

plotly is imported inside the `plot_*` functions only, so importing this module (and
`torsh_tune.reports`) never loads it.

Public functions:

- `get_step_series_info(frames, *, max_points=2000) -> StepSeriesInfo`,
  `plot_step_series(info)`: global step time (slowest rank per step) as a min/median/max
  band per bucket of steps, throughput on a second axis, warm-up shaded.
- `get_breakdown_info(frames, *, max_points=2000) -> BreakdownInfo`,
  `plot_breakdown(info)`: stacked step breakdown (data, forward, backward compute,
  exposed comm, optimizer, other) over steps, mean across ranks.
- `get_comm_timeline_info(frames, *, steps=None, num_steps=3) -> CommTimelineInfo`,
  `plot_comm_timeline(info)`: each rank's collectives (bucket bars from issue to
  completion) over a few steps, with the step boundaries.
- `get_overlap_info(frames, *, max_points=2000) -> OverlapInfo`, `plot_overlap(info)`:
  communication per step split into hidden and exposed time, and the overlap %.
- `get_rank_heatmap_info(frames, *, max_columns=400) -> RankHeatmapInfo`,
  `plot_rank_heatmap(info)`: rank x step heatmaps of step time and of arrival lateness
  at each step's last collective (compute-time excess without comm records).
- `get_resource_info(frames, *, max_points=2000) -> ResourceInfo`, `plot_memory(info)`,
  `plot_utilization(info)`: memory (RSS, GPU memory) and CPU/GPU utilisation over time.
- `get_loss_info(frames, *, max_points=2000) -> LossInfo`, `plot_loss(info)`: the loss
  recorded every `profiler.loss_every` steps, mean across ranks, min/median/max band.
- `reference_model(info, *, warnings=None) -> CommModel | None`,
  `get_busbw_model_info(frames, model, *, reference_busbw_gbps=None) -> BusbwModelInfo`,
  `plot_busbw_model(info)`: each DDP
  bucket's measured bus bandwidth against the bench's alpha-beta prediction for its size
  (the run's `--reference-bench`); drawn only when a model or reference exists.
- `build_figures(frames, *, max_points=2000) -> dict[str, Figure]`: every figure above,
  keyed by `FIGURE_TITLES` order; empty-data figures say "no data" instead of failing.
- `downsample(x, y, *, max_points) -> Downsampled`: the bucket aggregation all of them
  use (first x, min, median, max of y per bucket of consecutive points).

Figures of a study (a `TuningInfo`, from `get_tuning_info(study_dir)`):

- `get_optimization_history_info(info) -> OptimizationHistoryInfo`,
  `plot_optimization_history(info)`: throughput per trial, the best feasible so far, the
  baseline's median and its noise band (slowest to fastest baseline run).
- `get_importance_info(info) -> ImportanceInfo`, `plot_importances(info)`: parameter
  importances as bars (`TuningInfo.importances`: adjusted eta^2 of log throughput).
- `get_parallel_coordinates_info(info) -> ParallelCoordinatesInfo`,
  `plot_parallel_coordinates(info)`: the completed trials over the parameters that varied.
- `get_pareto_front_info(info) -> ParetoFrontInfo`, `plot_pareto_front(info)`: throughput
  vs loss deviation with the Pareto front of a throughput+loss study.
- `build_tuning_figures(info) -> dict[str, Figure]`: those, keyed as `TUNING_FIGURE_TITLES`.
- `get_confirmation_info(info) -> ConfirmationInfo`, `plot_confirmation(info)`: each
  confirmed candidate's paired speedup over the baseline with its 95 % CI, against 1 and
  the baseline's noise (the dashboard's tuning view).

Example:
    >>> from torsh_tune.analysis import load_run  # doctest: +SKIP
    >>> frames = load_run("torsh-runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> info = get_step_series_info(frames)  # doctest: +SKIP
    >>> plot_step_series(info).write_html("steps.html")  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd

from ..analysis import PHASES, RunFrames, aligned_collectives, bus_factor, phase_frame
from ._format import PHASE_LABELS
from ._tuning import TuningInfo

if TYPE_CHECKING:  # plotly is loaded lazily, by the plot functions only
    import plotly.graph_objects as go

    from ..fabric import CommModel

__all__ = [
    "DEFAULT_MAX_POINTS",
    "FIGURE_TITLES",
    "PHASE_COLORS",
    "TUNING_FIGURE_TITLES",
    "BreakdownInfo",
    "BusbwModelInfo",
    "CommTimelineInfo",
    "ConfirmationInfo",
    "Downsampled",
    "ImportanceInfo",
    "LossInfo",
    "OptimizationHistoryInfo",
    "OverlapInfo",
    "ParallelAxis",
    "ParallelCoordinatesInfo",
    "ParetoFrontInfo",
    "RankHeatmapInfo",
    "RankResourceSeries",
    "ResourceInfo",
    "StepSeriesInfo",
    "build_figures",
    "build_tuning_figures",
    "downsample",
    "get_breakdown_info",
    "get_busbw_model_info",
    "get_comm_timeline_info",
    "get_confirmation_info",
    "get_importance_info",
    "get_loss_info",
    "get_optimization_history_info",
    "get_overlap_info",
    "get_parallel_coordinates_info",
    "get_pareto_front_info",
    "get_rank_heatmap_info",
    "get_resource_info",
    "get_step_series_info",
    "plot_breakdown",
    "plot_busbw_model",
    "plot_comm_timeline",
    "plot_confirmation",
    "plot_importances",
    "plot_loss",
    "plot_memory",
    "plot_optimization_history",
    "plot_overlap",
    "plot_parallel_coordinates",
    "plot_pareto_front",
    "plot_rank_heatmap",
    "plot_step_series",
    "plot_utilization",
    "reference_model",
]

#: Points per series a figure carries at most (per rank for per-rank series, split evenly).
DEFAULT_MAX_POINTS = 2000
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
}
_FloatTuple = tuple[float, ...]


# -- data -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Downsampled:
    """One series aggregated per bucket of `bucket_size` consecutive points."""

    x: _FloatTuple  # first x of each bucket
    y_min: _FloatTuple
    y_median: _FloatTuple
    y_max: _FloatTuple
    bucket_size: int  # points per bucket (1: not downsampled)


@dataclass(frozen=True, kw_only=True)
class StepSeriesInfo:
    """Global step time (slowest rank per step) and throughput over steps."""

    step: _FloatTuple  # first step of each bucket
    step_min_s: _FloatTuple
    step_median_s: _FloatTuple
    step_max_s: _FloatTuple
    throughput_samples_s: _FloatTuple  # median per bucket of samples (all ranks) / step time
    warmup: tuple[bool, ...]  # the bucket holds a warm-up step
    warmup_end_step: int | None  # last warm-up step, None without warm-up
    bucket_size: int
    num_steps: int

    @property
    def empty(self) -> bool:
        return not self.step


@dataclass(frozen=True, kw_only=True)
class BreakdownInfo:
    """Per-step phase times (mean across ranks, then mean per bucket), stacking to step time."""

    step: _FloatTuple
    phases_s: dict[str, _FloatTuple]  # PHASES order
    warmup_end_step: int | None
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


@dataclass(frozen=True, kw_only=True)
class CommTimelineInfo:
    """Collectives of a few steps on every rank, times relative to the first step's start."""

    steps: tuple[int, ...]  # the steps shown
    rank: tuple[int, ...]  # one entry per collective
    step: tuple[int, ...]
    bucket: tuple[int, ...]
    collective: tuple[str, ...]
    start_s: _FloatTuple  # t_issue - t0
    duration_s: _FloatTuple
    bytes: _FloatTuple
    step_bounds: tuple[tuple[int, int, float, float], ...]  # (rank, step, start_s, end_s)

    @property
    def empty(self) -> bool:
        return not self.rank


@dataclass(frozen=True, kw_only=True)
class OverlapInfo:
    """Communication per step (mean across ranks): how much of it is hidden by compute."""

    step: _FloatTuple
    comm_s: _FloatTuple
    exposed_comm_s: _FloatTuple
    overlap_pct: _FloatTuple  # 100 * (1 - exposed / comm); NaN without communication
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


@dataclass(frozen=True, kw_only=True)
class RankHeatmapInfo:
    """rank x step-bucket matrices (median per bucket); NaN where a rank has no record."""

    ranks: tuple[int, ...]
    step: _FloatTuple  # first step of each column
    step_s: tuple[_FloatTuple, ...]  # [rank][column]
    lateness_s: tuple[_FloatTuple, ...]  # [rank][column]
    lateness_basis: str  # "comm" (arrival at the last collective) or "compute" (excess compute)
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.ranks or not self.step


@dataclass(frozen=True, kw_only=True)
class RankResourceSeries:
    """One rank's system samples over time (s since the run's first record)."""

    rank: int
    t_s: _FloatTuple
    rss_bytes: _FloatTuple  # max per bucket
    cpu_pct: _FloatTuple  # mean per bucket, % of one core
    gpu_util_pct: _FloatTuple  # mean per bucket; NaN without a GPU
    gpu_mem_used_bytes: _FloatTuple  # max per bucket; NaN without a GPU


@dataclass(frozen=True, kw_only=True)
class ResourceInfo:
    """Memory and utilisation over time, per rank, and the machine's totals."""

    per_rank: tuple[RankResourceSeries, ...]
    sys_t_s: _FloatTuple  # whole-machine CPU, from the lowest rank's sampler
    sys_cpu_pct: _FloatTuple
    mem_total_bytes: float | None
    gpu_mem_total_bytes: float | None
    has_gpu: bool

    @property
    def empty(self) -> bool:
        return not any(s.t_s for s in self.per_rank)


@dataclass(frozen=True, kw_only=True)
class LossInfo:
    """Loss over steps (mean across ranks per step, then min/median/max per bucket)."""

    step: _FloatTuple
    loss_min: _FloatTuple
    loss_median: _FloatTuple
    loss_max: _FloatTuple
    warmup_end_step: int | None
    bucket_size: int

    @property
    def empty(self) -> bool:
        return not self.step


def downsample(x: Any, y: Any, *, max_points: int = DEFAULT_MAX_POINTS) -> Downsampled:
    """Aggregate a series into at most `max_points` buckets of consecutive points.

    Each bucket keeps its first x and the min, median and max of its y (NaN ignored), so
    spikes survive downsampling: the band of a plot spans every measured value.

    Args:
        x: sorted x values (steps or seconds).
        y: values, same length.
        max_points: buckets at most (>= 1).

    Returns:
        The Downsampled series; `bucket_size` 1 when no aggregation was needed.

    Example:
        >>> d = downsample(range(10), [1, 9, 2, 3, 4, 5, 6, 7, 8, 0], max_points=2)
        >>> d.x, d.y_min, d.y_max
        ((0.0, 5.0), (1.0, 0.0), (9.0, 8.0))
    """
    xs = np.asarray(x, dtype=float)
    ys = np.asarray(y, dtype=float)
    assert xs.shape == ys.shape, "x and y must have the same length"
    n = len(xs)
    if n == 0:
        return Downsampled(x=(), y_min=(), y_median=(), y_max=(), bucket_size=1)
    size = max(1, math.ceil(n / max(1, max_points)))
    if size == 1:
        t = _floats(ys)
        return Downsampled(x=_floats(xs), y_min=t, y_median=t, y_max=t, bucket_size=1)
    bucket = np.arange(n) // size
    g = pd.Series(ys).groupby(bucket)
    return Downsampled(
        x=_floats(xs[::size]),
        y_min=_floats(g.min().to_numpy()),
        y_median=_floats(g.median().to_numpy()),
        y_max=_floats(g.max().to_numpy()),
        bucket_size=size,
    )


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


def get_breakdown_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> BreakdownInfo:
    """Phase times per step (mean across ranks), averaged per bucket so they still stack.

    The phases are `analysis.PHASES` as `analysis.phase_frame` splits them; they sum to
    the mean step time across ranks.
    """
    steps = frames.steps
    if steps.empty:
        return BreakdownInfo(step=(), phases_s={p: () for p in PHASES}, warmup_end_step=None, bucket_size=1)
    per_step = phase_frame(steps).groupby("step", sort=True)[list(PHASES)].mean()
    n = len(per_step)
    size = max(1, math.ceil(n / max(1, max_points)))
    bucket = np.arange(n) // size
    means = per_step.groupby(bucket).mean()
    return BreakdownInfo(
        step=_floats(per_step.index.to_numpy()[::size]),
        phases_s={p: _floats(means[p].to_numpy()) for p in PHASES},
        warmup_end_step=_warmup_end(steps),
        bucket_size=size,
    )


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
        start_s=_floats(c["t_issue"].to_numpy(dtype=float) - t0),
        duration_s=_floats(dur.to_numpy(dtype=float)),
        bytes=_floats(c["bytes"].to_numpy(dtype=float)),
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


def get_overlap_info(frames: RunFrames, *, max_points: int = DEFAULT_MAX_POINTS) -> OverlapInfo:
    """Per step (mean across ranks): communication time, its exposed part and the overlap %."""
    steps = frames.steps
    if steps.empty:
        return OverlapInfo(step=(), comm_s=(), exposed_comm_s=(), overlap_pct=(), bucket_size=1)
    per_step = steps.groupby("step", sort=True)[["comm_s", "exposed_comm_s"]].mean()
    n = len(per_step)
    size = max(1, math.ceil(n / max(1, max_points)))
    means = per_step.groupby(np.arange(n) // size).mean()
    comm = means["comm_s"].to_numpy(dtype=float)
    exposed = means["exposed_comm_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        overlap = np.where(comm > 0, 100.0 * (1.0 - exposed / comm), np.nan)
    return OverlapInfo(step=_floats(per_step.index.to_numpy()[::size]), comm_s=_floats(comm),
                       exposed_comm_s=_floats(exposed), overlap_pct=_floats(np.clip(overlap, 0.0, 100.0)),
                       bucket_size=size)


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
        step=_floats(step_s.index.to_numpy()[::size]),
        step_s=tuple(_floats(s_med[r].to_numpy()) for r in step_s.columns),
        lateness_s=tuple(_floats(l_med[r].to_numpy()) for r in step_s.columns),
        lateness_basis=basis,
        bucket_size=size,
    )


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
            t_s=_floats(df["t"].to_numpy(dtype=float)[::size] - t0),
            rss_bytes=_floats(g["rss_bytes"].max().to_numpy(dtype=float)),
            cpu_pct=_floats(g["cpu_pct"].mean().to_numpy(dtype=float)),
            gpu_util_pct=_floats(g["gpu_util_pct"].mean().to_numpy(dtype=float)),
            gpu_mem_used_bytes=_floats(g["gpu_mem_used_bytes"].max().to_numpy(dtype=float)),
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


def _warmup_end(steps: pd.DataFrame) -> int | None:
    warm = steps.loc[steps["warmup"].astype(bool), "step"] if not steps.empty else steps
    return int(warm.max()) if len(warm) else None


def _floats(values: Any) -> _FloatTuple:
    return tuple(float(v) for v in np.asarray(values, dtype=float).tolist())


# -- drawing ----------------------------------------------------------------------------

_LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=30, t=50, b=45), hovermode="x unified",
               legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1), height=360)


def _new_figure(title: str, *, secondary_y: bool = False) -> "go.Figure":
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]]) if secondary_y else go.Figure()
    fig.update_layout(title=dict(text=title, x=0.01), **_LAYOUT)
    return fig


def _no_data(fig: "go.Figure", what: str) -> "go.Figure":
    fig.add_annotation(text=f"no {what} recorded", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="#888"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _mark_warmup(fig: "go.Figure", first_step: float, warmup_end_step: int | None) -> None:
    if warmup_end_step is None:
        return
    fig.add_vrect(x0=first_step - 0.5, x1=warmup_end_step + 0.5, fillcolor="#bbbbbb", opacity=0.25, line_width=0,
                  annotation_text="warm-up", annotation_position="top left")


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1e3 for v in values]


def plot_step_series(info: StepSeriesInfo) -> "go.Figure":
    """Step time (median line inside a min-max band, ms) and throughput (right axis)."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["step_series"], secondary_y=True)
    if info.empty:
        return _no_data(fig, "steps")
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


def plot_breakdown(info: BreakdownInfo) -> "go.Figure":
    """Stacked phases per step (ms): data, forward, backward compute, exposed comm, optimizer, other."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["breakdown"])
    if info.empty:
        return _no_data(fig, "steps")
    x = list(info.step)
    for phase, values in info.phases_s.items():
        fig.add_trace(go.Scatter(x=x, y=_ms(values), mode="lines", stackgroup="phases",
                                 line=dict(width=0.5, color=PHASE_COLORS.get(phase)),
                                 name=PHASE_LABELS.get(phase, phase)))
    _mark_warmup(fig, x[0], info.warmup_end_step)
    fig.update_xaxes(title_text="step" + (f" (mean per {info.bucket_size} steps)" if info.bucket_size > 1 else ""))
    fig.update_yaxes(title_text="time per step (ms, mean across ranks)", rangemode="tozero")
    return fig


def plot_comm_timeline(info: CommTimelineInfo) -> "go.Figure":
    """One row per rank: step spans (grey) and each collective from issue to completion."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["comm_timeline"])
    fig.update_layout(hovermode="closest", barmode="overlay")
    if info.empty and not info.step_bounds:
        return _no_data(fig, "collectives")
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


def plot_overlap(info: OverlapInfo) -> "go.Figure":
    """Hidden and exposed communication per step (stacked, ms) and the overlap % (right axis)."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["overlap"], secondary_y=True)
    if info.empty or not any(v > 0 for v in info.comm_s if math.isfinite(v)):
        return _no_data(fig, "communication")
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


def plot_rank_heatmap(info: RankHeatmapInfo) -> "go.Figure":
    """Two heatmaps, rank x step: step time and lateness (ms); a straggler is a bright row."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    late = "arrival lateness at the last collective" if info.lateness_basis == "comm" else "excess compute"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=("step time (ms)", f"{late} (ms)"))
    fig.update_layout(title=dict(text=FIGURE_TITLES["rank_heatmap"], x=0.01),
                      **{**_LAYOUT, "hovermode": "closest", "height": 260 + 40 * len(info.ranks)})
    if info.empty:
        return _no_data(fig, "steps")
    y = [f"rank {r}" for r in info.ranks]
    for row, matrix, scale, bar_y in ((1, info.step_s, "Viridis", 0.8), (2, info.lateness_s, "Inferno", 0.2)):
        z = [[v * 1e3 if math.isfinite(v) else None for v in vals] for vals in matrix]
        fig.add_trace(go.Heatmap(z=z, x=list(info.step), y=y, colorscale=scale,
                                 colorbar=dict(len=0.42, y=bar_y, title="ms"),
                                 hovertemplate="%{y}, step %{x}: %{z:.2f} ms<extra></extra>"), row=row, col=1)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="step", row=2, col=1)
    return fig


def plot_memory(info: ResourceInfo) -> "go.Figure":
    """Memory per rank over time (GiB): GPU memory used when there is a GPU, else process RSS."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["memory"])
    if info.empty:
        return _no_data(fig, "system samples")
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

    fig = _new_figure(FIGURE_TITLES["utilization"])
    if info.empty:
        return _no_data(fig, "system samples")
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


def plot_loss(info: LossInfo) -> "go.Figure":
    """Loss over steps (median, with a min-max band when downsampled)."""
    import plotly.graph_objects as go

    fig = _new_figure(FIGURE_TITLES["loss"])
    if info.empty:
        return _no_data(fig, "loss")
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


# -- measured bus bandwidth vs the bench's alpha-beta model -------------------------------

#: Title of `plot_busbw_model` (not part of `build_figures`: it needs a bench reference).
BUSBW_MODEL_TITLE = "Bus bandwidth per bucket: measured vs bench model"


@dataclass(frozen=True, kw_only=True)
class BusbwModelInfo:
    """Each (bucket, collective) of the measured steps: its size, measured and predicted busbw.

    Measured busbw is nccl-tests' bus bandwidth of each collective (wire bytes x bus factor
    / wire time, the fastest rank's time without queueing, as `analysis.comm_stats`
    computes it), median over steps, with its quartiles. The prediction is the bench's
    alpha-beta fit of the same collective at the bucket's size and this run's world size:
    busbw = factor x size / (alpha + factor x size x beta); NaN without a fit.
    """

    bucket: tuple[int, ...]
    collective: tuple[str, ...]
    size_bytes: _FloatTuple  # median wire bytes of the bucket
    measured_busbw_gbps: _FloatTuple  # median over steps
    measured_q25_gbps: _FloatTuple
    measured_q75_gbps: _FloatTuple
    model_busbw_gbps: _FloatTuple
    curve_size_bytes: _FloatTuple  # the model's prediction over the sizes shown, for the line
    curve_busbw_gbps: _FloatTuple
    reference_busbw_gbps: float | None  # run.json's reference (the bench's large-message busbw)
    model_label: str  # what the model is, in words ("" without one)
    num_steps: int

    @property
    def empty(self) -> bool:
        return not self.bucket


def reference_model(info: dict[str, Any], *, warnings: list[str] | None = None) -> "CommModel | None":
    """The alpha-beta model of the bench run a run was profiled against, or None.

    `profile --reference-bench BENCH_RUN` records the bench run's path in run.json
    (`reference_bench`); its `bench_model.json` is the model. Only that one file name is
    read. A missing model is None (the figure then shows the reference busbw alone, if
    run.json has one); so is an unreadable one, with the warning `analyze_run` gives for
    the same file appended to `warnings` (logged when no list is given).
    """
    from ..fabric import MODEL_FILE, load_model

    bench = info.get("reference_bench")
    if not isinstance(bench, str) or not bench or not (Path(bench) / MODEL_FILE).is_file():
        return None
    try:
        return load_model(Path(bench) / MODEL_FILE)
    except Exception as exc:  # noqa: BLE001 - the reference is optional; recorded below
        message = f"reference bench model unreadable: {type(exc).__name__}: {exc}"
        if warnings is None:
            logging.getLogger(__name__).warning(message)
        else:
            warnings.append(message)
        return None


def get_busbw_model_info(frames: RunFrames, model: "CommModel | None", *, reference_busbw_gbps: float | None = None,
                         last_steps: int | None = None) -> BusbwModelInfo:
    """Measured busbw per bucket of the run's measured steps, and the model's prediction at its size.

    Args:
        frames: the run (its comm records; warm-up steps are left out).
        model: the bench's fitted model (`reference_model(frames.info)`), or None.
        reference_busbw_gbps: the reference line (default: run.json's `reference_busbw_gbps`).
        last_steps: only the newest this many steps with collectives (a live view); None: all.

    Example:
        >>> info = get_busbw_model_info(frames, reference_model(frames.info))  # doctest: +SKIP
        >>> info.size_bytes, info.measured_busbw_gbps, info.model_busbw_gbps  # doctest: +SKIP
    """
    if reference_busbw_gbps is None:
        ref = frames.info.get("reference_busbw_gbps")
        reference_busbw_gbps = float(ref) if isinstance(ref, (int, float)) and ref > 0 else None
    label = _model_label(model)
    empty = BusbwModelInfo(bucket=(), collective=(), size_bytes=(), measured_busbw_gbps=(), measured_q25_gbps=(),
                           measured_q75_gbps=(), model_busbw_gbps=(), curve_size_bytes=(), curve_busbw_gbps=(),
                           reference_busbw_gbps=reference_busbw_gbps, model_label=label, num_steps=0)
    comm, steps = frames.comm, frames.steps
    if comm.empty:
        return empty
    if not steps.empty:
        warm = set(steps.loc[steps["warmup"].astype(bool), "step"].unique())
        kept = comm[~comm["step"].isin(warm)]
        comm = kept if not kept.empty else comm
    if last_steps is not None:
        comm = comm[comm["step"] > int(comm["step"].max()) - last_steps]
    df = aligned_collectives(comm)
    df["wire"] = pd.to_numeric(df["wire_bytes"], errors="coerce").fillna(pd.to_numeric(df["bytes"], errors="coerce"))
    coll = df.groupby(["step", "seq"]).agg(bucket=("bucket", "first"), collective=("collective", "first"),
                                           wire=("wire", "median"), wire_s=("wire_s", "first"))
    coll = coll[(coll["wire_s"] > 0) & (coll["wire"] > 0)]
    if coll.empty:
        return empty
    world = frames.world_size
    factor = np.array([bus_factor(c, world) for c in coll["collective"]])
    coll["busbw_gbps"] = factor * coll["wire"].to_numpy(float) / coll["wire_s"].to_numpy(float) / 1e9
    coll["bucket"] = coll["bucket"].fillna(-1).astype(int)
    coll["collective"] = coll["collective"].fillna("?").astype(str)
    g = coll.groupby(["bucket", "collective"], sort=True)
    per = pd.DataFrame({"size": g["wire"].median(), "busbw": g["busbw_gbps"].median(),
                        "q25": g["busbw_gbps"].quantile(0.25), "q75": g["busbw_gbps"].quantile(0.75)})
    keys = list(per.index)
    predicted = [_predicted_busbw_gbps(model, c, size, world) for (_, c), size in zip(keys, per["size"])]
    curve_x: list[float] = []
    curve_y: list[float] = []
    main = keys[0][1] if keys else None
    if model is not None and main is not None:
        lo, hi = float(per["size"].min()) / 4, float(per["size"].max()) * 4
        curve_x = [float(x) for x in np.geomspace(max(lo, 1.0), max(hi, 2.0), 40)]
        curve_y = [_predicted_busbw_gbps(model, main, x, world) for x in curve_x]
    return BusbwModelInfo(
        bucket=tuple(int(b) for b, _ in keys), collective=tuple(str(c) for _, c in keys),
        size_bytes=_floats(per["size"]), measured_busbw_gbps=_floats(per["busbw"]),
        measured_q25_gbps=_floats(per["q25"]), measured_q75_gbps=_floats(per["q75"]),
        model_busbw_gbps=_floats(predicted), curve_size_bytes=_floats(curve_x), curve_busbw_gbps=_floats(curve_y),
        reference_busbw_gbps=reference_busbw_gbps, model_label=label,
        num_steps=int(coll.index.get_level_values("step").nunique()),
    )


def _predicted_busbw_gbps(model: "CommModel | None", collective: str, size_bytes: float, world_size: int) -> float:
    fit = model.get(collective) if model is not None else None
    if fit is None:
        return math.nan
    bus_bytes = bus_factor(collective, world_size) * float(size_bytes)
    t = fit.alpha_s + bus_bytes * fit.beta_s_per_byte
    return bus_bytes / t / 1e9 if t > 0 else math.nan


def _model_label(model: "CommModel | None") -> str:
    if model is None:
        return ""
    fit = model.get("all_reduce") or (model.fits[0] if model.fits else None)
    if fit is None:
        return f"bench model ({model.backend}, {model.world_size} ranks): no fit"
    bw = f"{fit.busbw_gbps:.3g} GB/s" if fit.busbw_gbps else "unbounded"
    return (f"bench {fit.collective} fit ({model.backend}, {fit.group_size} ranks): alpha {fit.alpha_s * 1e6:.0f} us, "
            f"1/beta {bw}")


def plot_busbw_model(info: BusbwModelInfo) -> "go.Figure":
    """Measured busbw per bucket (median, quartile bars) vs the model's curve and prediction, log size axis."""
    import plotly.graph_objects as go

    fig = _new_figure(BUSBW_MODEL_TITLE)
    fig.update_layout(hovermode="closest")
    if info.empty:
        return _no_data(fig, "collectives with a measurable wire time")
    x = list(info.size_bytes)
    labels = [f"bucket {b}" if b >= 0 else c for b, c in zip(info.bucket, info.collective)]
    fig.add_trace(go.Scatter(
        x=x, y=list(info.measured_busbw_gbps), mode="markers", name="measured (median over steps)",
        marker=dict(color="#0072B2", size=11),
        error_y=dict(type="data", symmetric=False,
                     array=[max(0.0, h - m) for h, m in zip(info.measured_q75_gbps, info.measured_busbw_gbps)],
                     arrayminus=[max(0.0, m - lo) for lo, m in zip(info.measured_q25_gbps, info.measured_busbw_gbps)]),
        customdata=labels, hovertemplate="%{customdata}: %{y:.3g} GB/s at %{x:.3s}B<extra></extra>"))
    if any(math.isfinite(v) for v in info.model_busbw_gbps):
        fig.add_trace(go.Scatter(x=x, y=list(info.model_busbw_gbps), mode="markers", name="model at the bucket size",
                                 marker=dict(color="#D55E00", size=10, symbol="diamond-open", line=dict(width=2)),
                                 customdata=labels, hovertemplate="%{customdata}: model %{y:.3g} GB/s<extra></extra>"))
    if info.curve_size_bytes:
        fig.add_trace(go.Scatter(x=list(info.curve_size_bytes), y=list(info.curve_busbw_gbps), mode="lines",
                                 name=info.model_label or "bench model", line=dict(color="#D55E00", dash="dot"),
                                 hoverinfo="skip"))
    if info.reference_busbw_gbps:
        fig.add_hline(y=info.reference_busbw_gbps, line_dash="dash", line_color="#555",
                      annotation_text=f"bench reference {info.reference_busbw_gbps:.3g} GB/s")
    fig.update_xaxes(title_text="bucket size (wire bytes)", type="log")
    fig.update_yaxes(title_text="bus bandwidth (GB/s)", rangemode="tozero")
    return fig


# -- study figures (a TuningInfo) -------------------------------------------------------------

#: Keys of `build_tuning_figures`, in display order, with their titles.
TUNING_FIGURE_TITLES = {
    "history": "Optimisation history",
    "importances": "Parameter importances",
    "parallel": "Parameters of the completed trials",
    "pareto": "Pareto front: throughput vs loss deviation",
}


@dataclass(frozen=True, kw_only=True)
class OptimizationHistoryInfo:
    """Objective per trial, the best feasible one so far, and the baseline's noise band."""

    number: tuple[int, ...]  # every trial
    samples_s: _FloatTuple  # NaN unless COMPLETE
    feasible: tuple[bool, ...]  # COMPLETE and within the constraints
    state: tuple[str, ...]
    best_samples_s: _FloatTuple  # NaN before the first feasible trial
    baseline_samples_s: float | None  # median of the baseline runs
    band_low_samples_s: float | None  # slowest baseline run
    band_high_samples_s: float | None  # fastest baseline run
    beat_samples_s: float | None  # median x (1 + noise): what a confirmed speedup must exceed
    unit: str = "samples/s"  # the objective's unit (TuningInfo.study["unit"]: samples/s or tokens/s)

    @property
    def empty(self) -> bool:
        return not any(math.isfinite(v) for v in self.samples_s)


@dataclass(frozen=True, kw_only=True)
class ImportanceInfo:
    """Parameter importances, most important first (see `TuningInfo.importances`)."""

    names: tuple[str, ...]
    importance: _FloatTuple  # normalised, sums to 1 over the scored parameters
    eta_squared: _FloatTuple
    num_groups: tuple[int, ...]
    method: str
    num_trials: int

    @property
    def empty(self) -> bool:
        return not self.names


@dataclass(frozen=True, kw_only=True)
class ParallelAxis:
    """One axis of the parallel-coordinates figure: numbers, or categories coded 0..k-1."""

    name: str
    values: _FloatTuple  # one per trial
    tickvals: _FloatTuple  # categorical axes only
    ticktext: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ParallelCoordinatesInfo:
    """The completed trials over the parameters that varied, coloured by throughput."""

    number: tuple[int, ...]
    axes: tuple[ParallelAxis, ...]  # the parameters that took more than one value
    samples_s: _FloatTuple  # the last axis and the colour
    unit: str = "samples/s"

    @property
    def empty(self) -> bool:
        return not self.number


@dataclass(frozen=True, kw_only=True)
class ParetoFrontInfo:
    """Completed trials in throughput vs loss deviation, the Pareto front marked."""

    number: tuple[int, ...]
    samples_s: _FloatTuple
    loss_deviation_pct: _FloatTuple
    feasible: tuple[bool, ...]
    on_front: tuple[bool, ...]
    front_number: tuple[int, ...]  # the front, by increasing loss deviation (its drawing order)
    loss_tolerance_pct: float | None
    unit: str = "samples/s"

    @property
    def empty(self) -> bool:
        return not self.front_number


def get_optimization_history_info(info: TuningInfo) -> OptimizationHistoryInfo:
    """The objective of every trial in number order, the best feasible so far and the baseline band.

    Example:
        >>> h = get_optimization_history_info(get_tuning_info("tests/data/study_small"))
        >>> h.number[:3], h.state[1]
        ((0, 1, 2), 'FAIL')
    """
    h, b = info.history, info.baseline or {}
    return OptimizationHistoryInfo(
        number=tuple(int(n) for n in h.get("number", ())),
        samples_s=_floats([_nan(v) for v in h.get("samples_s", ())]),
        feasible=tuple(bool(v) for v in h.get("feasible", ())),
        state=tuple(str(s) for s in h.get("state", ())),
        best_samples_s=_floats([_nan(v) for v in h.get("best_samples_s", ())]),
        baseline_samples_s=b.get("median_samples_s"),
        band_low_samples_s=b.get("low_samples_s"),
        band_high_samples_s=b.get("high_samples_s"),
        beat_samples_s=b.get("beat_samples_s"),
        unit=_unit(info),
    )


def get_importance_info(info: TuningInfo) -> ImportanceInfo:
    """The scored parameters of `TuningInfo.importances`, most important first."""
    imp = info.importances
    rows = [r for r in imp.get("params", ()) if r.get("importance") is not None]
    return ImportanceInfo(
        names=tuple(r["name"] for r in rows),
        importance=_floats([r["importance"] for r in rows]),
        eta_squared=_floats([r["eta_squared"] for r in rows]),
        num_groups=tuple(int(r["num_groups"]) for r in rows),
        method=str(imp.get("method", "")),
        num_trials=int(imp.get("num_trials", 0)),
    )


def get_parallel_coordinates_info(info: TuningInfo) -> ParallelCoordinatesInfo:
    """Completed trials on one axis per parameter that varied among them.

    Numeric parameters are plotted as numbers; booleans, strings and parameters that some
    trials lack (conditional ones, shown as "—") as categories in value order.
    """
    done = [t for t in info.trials if t.get("samples_s") is not None]
    axes = []
    for name in info.params:
        values = [t["params"].get(name) for t in done]
        if len({repr(v) for v in values}) < 2:
            continue
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            axes.append(ParallelAxis(name=name, values=_floats(values), tickvals=(), ticktext=()))
            continue
        order = sorted({repr(v): v for v in values}.values(), key=_category_key)
        code = {repr(v): float(i) for i, v in enumerate(order)}
        axes.append(ParallelAxis(name=name, values=tuple(code[repr(v)] for v in values),
                                 tickvals=tuple(code.values()), ticktext=tuple(_category_text(v) for v in order)))
    return ParallelCoordinatesInfo(number=tuple(int(t["number"]) for t in done), axes=tuple(axes),
                                   samples_s=_floats([t["samples_s"] for t in done]), unit=_unit(info))


def get_pareto_front_info(info: TuningInfo) -> ParetoFrontInfo:
    """Every completed trial with a loss deviation, and the Pareto front of a throughput+loss study.

    Empty (`front_number == ()`) for a single-objective study, which has no front.
    """
    front = {p["number"] for p in info.pareto}
    pts = [t for t in info.trials if t.get("samples_s") is not None and t.get("loss_deviation") is not None]
    by_loss = sorted((p for p in info.pareto if p.get("loss_deviation") is not None),
                     key=lambda p: (p["loss_deviation"], -(p["samples_s"] or 0.0)))
    tol = info.study.get("loss_tolerance")
    return ParetoFrontInfo(
        number=tuple(int(t["number"]) for t in pts),
        samples_s=_floats([t["samples_s"] for t in pts]),
        loss_deviation_pct=_floats([100.0 * t["loss_deviation"] for t in pts]),
        feasible=tuple(t.get("constraint_status") != "violated" for t in pts),
        on_front=tuple(t["number"] in front for t in pts),
        front_number=tuple(int(p["number"]) for p in by_loss),
        loss_tolerance_pct=100.0 * tol if tol is not None else None,
        unit=_unit(info),
    )


def _unit(info: TuningInfo) -> str:
    return str(info.study.get("unit") or "samples/s")


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)


def _category_key(v: Any) -> tuple[int, Any]:
    if v is None:
        return (0, 0)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return (1, v)
    return (2, str(v))


def _category_text(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def plot_optimization_history(info: OptimizationHistoryInfo) -> "go.Figure":
    """Throughput per trial (feasible, outside a constraint), best so far, baseline median and noise band.

    The y axis is logarithmic when the trials span more than a factor 20 (a hopeless trial
    would flatten the others otherwise).
    """
    import plotly.graph_objects as go

    fig = _new_figure(TUNING_FIGURE_TITLES["history"])
    fig.update_layout(hovermode="closest")
    if info.empty:
        return _no_data(fig, "completed trials")
    x, y = list(info.number), list(info.samples_s)
    ok = [i for i, v in enumerate(y) if math.isfinite(v) and info.feasible[i]]
    bad = [i for i, v in enumerate(y) if math.isfinite(v) and not info.feasible[i]]
    if info.band_low_samples_s is not None and info.band_high_samples_s is not None:
        lo, hi = info.band_low_samples_s, info.band_high_samples_s
        fig.add_trace(go.Scatter(x=[x[0] - 0.5, x[-1] + 0.5, x[-1] + 0.5, x[0] - 0.5, x[0] - 0.5],
                                 y=[lo, lo, hi, hi, lo], fill="toself", mode="lines", line=dict(width=0),
                                 fillcolor="rgba(153,153,153,0.3)", hoverinfo="skip",
                                 name="baseline runs (noise band)"))
    if info.baseline_samples_s is not None:
        fig.add_trace(go.Scatter(x=[x[0] - 0.5, x[-1] + 0.5], y=[info.baseline_samples_s] * 2, mode="lines",
                                 line=dict(color="#555", dash="dash"), name="baseline median"))
    fig.add_trace(go.Scatter(x=[x[i] for i in ok], y=[y[i] for i in ok], mode="markers", name="trial",
                             marker=dict(color="#0072B2", size=9),
                             hovertemplate=f"trial %{{x}}: %{{y:,.1f}} {info.unit}<extra></extra>"))
    if bad:
        fig.add_trace(go.Scatter(x=[x[i] for i in bad], y=[y[i] for i in bad], mode="markers",
                                 name="outside a constraint", marker=dict(color="#999", size=9, symbol="x"),
                                 hovertemplate=f"trial %{{x}}: %{{y:,.1f}} {info.unit} (constraint)<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=list(info.best_samples_s), mode="lines", line=dict(color="#D55E00", shape="hv"),
                             name="best so far"))
    finite = [v for v in y if math.isfinite(v) and v > 0]
    log = bool(finite) and max(finite) / min(finite) > 20
    fig.update_xaxes(title_text="trial", dtick=1 if len(x) <= 30 else None)
    fig.update_yaxes(title_text=info.unit + (" (log)" if log else ""), type="log" if log else "linear",
                     rangemode="normal" if log else "tozero")
    return fig


def plot_importances(info: ImportanceInfo) -> "go.Figure":
    """Horizontal bars, the most important parameter on top."""
    import plotly.graph_objects as go

    fig = _new_figure(TUNING_FIGURE_TITLES["importances"])
    fig.update_layout(hovermode="closest", height=max(260, 120 + 32 * len(info.names)))
    if info.empty:
        return _no_data(fig, "parameter that varied over completed trials")
    fig.add_trace(go.Bar(
        x=list(info.importance), y=list(info.names), orientation="h", marker=dict(color="#0072B2"),
        name="importance", customdata=[[e, g] for e, g in zip(info.eta_squared, info.num_groups)],
        hovertemplate="%{y}: %{x:.2f} (eta² %{customdata[0]:.2f}, %{customdata[1]} groups)<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text=f"share of log-throughput variance explained ({info.num_trials} completed trials)",
                     range=[0, 1])
    return fig


def plot_parallel_coordinates(info: ParallelCoordinatesInfo) -> "go.Figure":
    """One line per completed trial across its parameters and throughput, coloured by throughput."""
    import plotly.graph_objects as go

    fig = _new_figure(TUNING_FIGURE_TITLES["parallel"])
    fig.update_layout(margin=dict(l=80, r=80, t=90, b=40))
    if info.empty:
        return _no_data(fig, "completed trials")
    dims = []
    for a in info.axes:
        d: dict[str, Any] = dict(label=a.name, values=list(a.values))
        if a.ticktext:
            d.update(tickvals=list(a.tickvals), ticktext=list(a.ticktext))
        dims.append(d)
    dims.append(dict(label=info.unit, values=list(info.samples_s)))
    fig.add_trace(go.Parcoords(line=dict(color=list(info.samples_s), colorscale="Viridis", showscale=True,
                                         colorbar=dict(title=info.unit)), dimensions=dims))
    return fig


def plot_pareto_front(info: ParetoFrontInfo) -> "go.Figure":
    """Throughput vs loss deviation (%): every completed trial, the front joined, the tolerance dashed."""
    import plotly.graph_objects as go

    fig = _new_figure(TUNING_FIGURE_TITLES["pareto"])
    fig.update_layout(hovermode="closest")
    if info.empty:
        return _no_data(fig, "Pareto front (a throughput+loss study has one)")
    idx = {n: i for i, n in enumerate(info.number)}
    off = [i for i in range(len(info.number)) if not info.on_front[i]]
    fig.add_trace(go.Scatter(
        x=[info.loss_deviation_pct[i] for i in off], y=[info.samples_s[i] for i in off], mode="markers",
        name="other trials", marker=dict(color=["#999" if not info.feasible[i] else "#56B4E9" for i in off], size=9),
        customdata=[info.number[i] for i in off],
        hovertemplate=f"trial %{{customdata}}: %{{y:,.1f}} {info.unit}, loss %{{x:.3g}} % off<extra></extra>"))
    front = [idx[n] for n in info.front_number if n in idx]
    fig.add_trace(go.Scatter(
        x=[info.loss_deviation_pct[i] for i in front], y=[info.samples_s[i] for i in front], mode="lines+markers",
        name="Pareto front", line=dict(color="#D55E00", shape="hv"), marker=dict(size=11),
        customdata=[info.number[i] for i in front],
        hovertemplate=f"trial %{{customdata}}: %{{y:,.1f}} {info.unit}, loss %{{x:.3g}} % off<extra></extra>"))
    xlabel = "loss deviation from the baseline (%)"
    tol = info.loss_tolerance_pct
    if tol is not None and max(info.loss_deviation_pct, default=0.0) >= tol / 4:
        fig.add_vline(x=tol, line_dash="dash", line_color="#555", annotation_text="loss tolerance")
    elif tol is not None:  # drawn, the line would squeeze every point against the axis
        xlabel += f"; tolerance {tol:.3g} %, far right of the chart"
    fig.update_xaxes(title_text=xlabel, rangemode="tozero")
    fig.update_yaxes(title_text=info.unit, rangemode="tozero")
    return fig


def build_tuning_figures(info: TuningInfo) -> dict[str, "go.Figure"]:
    """The study's figures, keyed and ordered as `TUNING_FIGURE_TITLES`; "pareto" only with a front.

    Example:
        >>> figs = build_tuning_figures(get_tuning_info("tests/data/study_small"))  # doctest: +SKIP
        >>> list(figs)  # doctest: +SKIP
        ['history', 'importances', 'parallel']
    """
    figs = {
        "history": plot_optimization_history(get_optimization_history_info(info)),
        "importances": plot_importances(get_importance_info(info)),
        "parallel": plot_parallel_coordinates(get_parallel_coordinates_info(info)),
    }
    pareto = get_pareto_front_info(info)
    if not pareto.empty:
        figs["pareto"] = plot_pareto_front(pareto)
    return figs


@dataclass(frozen=True, kw_only=True)
class ConfirmationInfo:
    """Each confirmed candidate's paired speedup over the baseline and its bootstrap 95 % CI."""

    trial: tuple[int, ...]
    speedup: _FloatTuple
    ci_low: _FloatTuple
    ci_high: _FloatTuple
    pairs: tuple[int, ...]
    verdict: tuple[str, ...]
    best_trial: int | None  # the confirmed best (None when nothing was confirmed faster)
    noise_rel: float | None  # the baseline's (max - min) / median: what a speedup must exceed

    @property
    def empty(self) -> bool:
        return not self.trial


def get_confirmation_info(info: TuningInfo) -> ConfirmationInfo:
    """The confirmation's candidates that ran at least one pair, in the study's order."""
    rows = [c for c in info.confirmations if c.get("speedup") is not None]
    return ConfirmationInfo(
        trial=tuple(int(c["trial"]) for c in rows),
        speedup=_floats([c["speedup"] for c in rows]),
        ci_low=_floats([_nan(c.get("ci_low")) for c in rows]),
        ci_high=_floats([_nan(c.get("ci_high")) for c in rows]),
        pairs=tuple(int(c.get("pairs") or 0) for c in rows),
        verdict=tuple(str(c.get("verdict") or "") for c in rows),
        best_trial=info.best.get("trial"),
        noise_rel=(info.baseline or {}).get("noise_rel"),
    )


def plot_confirmation(info: ConfirmationInfo) -> "go.Figure":
    """Paired speedup per candidate with its 95 % CI as error bars, 1x (the baseline) and 1 + noise dashed."""
    import plotly.graph_objects as go

    fig = _new_figure("Confirmation: paired speedup over the baseline (95 % CI)")
    fig.update_layout(hovermode="closest")
    if info.empty:
        return _no_data(fig, "confirmation pairs")
    x = [f"trial {t}" + (" (best)" if t == info.best_trial else "") for t in info.trial]
    fig.add_trace(go.Scatter(
        x=x, y=list(info.speedup), mode="markers", name="paired speedup",
        marker=dict(size=12, color=["#009E73" if t == info.best_trial else "#0072B2" for t in info.trial]),
        error_y=dict(type="data", symmetric=False,
                     array=[h - s if math.isfinite(h) else 0.0 for h, s in zip(info.ci_high, info.speedup)],
                     arrayminus=[s - lo if math.isfinite(lo) else 0.0 for lo, s in zip(info.ci_low, info.speedup)]),
        customdata=[[lo, hi, n, v] for lo, hi, n, v in zip(info.ci_low, info.ci_high, info.pairs, info.verdict)],
        hovertemplate="%{x}: %{y:.3f}x (CI %{customdata[0]:.3f}-%{customdata[1]:.3f}, %{customdata[2]} pairs): "
                      "%{customdata[3]}<extra></extra>"))
    fig.add_hline(y=1.0, line_color="#555", annotation_text="baseline")
    if info.noise_rel:
        fig.add_hline(y=1.0 + info.noise_rel, line_dash="dash", line_color="#999",
                      annotation_text="baseline noise", annotation_position="bottom right")
    fig.update_yaxes(title_text="speedup (candidate / baseline)")
    return fig
