"""Figures shared by the HTML reports and the Dash dashboard, one module per family.

Data and drawing are apart (as in optuna's visualisation): each `get_*_info(...)` turns
its input into a frozen dataclass of plain values (tuples of floats, NaN where a value is
missing), already aggregated on the server side so that a figure never carries more than
about `max_points` points per series, however long the run; each `plot_*(info)` draws one
into a `plotly.graph_objects.Figure`. Tests target the info functions; the plot functions
are thin. Each figure's info and drawing sit side by side in its family's module:

- `_common`: `downsample(x, y, *, max_points) -> Downsampled`, the bucket aggregation every
  series uses (first x, min, median, max of y per bucket of consecutive points), and the
  plotly frame ("no data" figures instead of failures).
- `_run`, a run's `RunFrames`:
  `get_step_series_info` / `plot_step_series` (global step time, slowest rank per step, as
  a min/median/max band per bucket of steps; throughput on a second axis; warm-up shaded),
  `get_breakdown_info` / `plot_breakdown` (stacked phases over steps, mean across ranks),
  `get_comm_timeline_info` / `plot_comm_timeline` (each rank's collectives over a few
  steps, with the step boundaries), `get_overlap_info` / `plot_overlap` (communication per
  step, hidden and exposed, and the overlap %), `get_rank_heatmap_info` /
  `plot_rank_heatmap` (rank x step step time and arrival lateness), `get_resource_info` /
  `plot_memory` / `plot_utilization` (RSS, GPU memory, CPU/GPU utilisation over time),
  `get_loss_info` / `plot_loss` (the recorded loss, min/median/max band);
  `build_figures(frames, *, max_points=2000)`: all of them, keyed as `FIGURE_TITLES`.
- `_busbw`, a run against the bench it was profiled with (`--reference-bench`):
  `reference_model(info, *, warnings=None) -> CommModel | None` (an unreadable model goes
  into `warnings`, as `analyze_run` reports it), `get_busbw_model_info` /
  `plot_busbw_model` (each DDP bucket's measured bus bandwidth against the alpha-beta
  prediction for its size).
- `_study`, a study's `TuningInfo` (`get_tuning_info(study_dir)`):
  `get_optimization_history_info` / `plot_optimization_history` (throughput per trial,
  best so far, the baseline's median and noise band), `get_importance_info` /
  `plot_importances`, `get_parallel_coordinates_info` / `plot_parallel_coordinates`,
  `get_pareto_front_info` / `plot_pareto_front` (throughput vs loss deviation);
  `build_tuning_figures(info)`: those, keyed as `TUNING_FIGURE_TITLES`;
  `get_confirmation_info` / `plot_confirmation` (each confirmed candidate's paired speedup
  with its 95 % CI); `varying_params` / `params_text` (the trial tables' parameters).
- `_trace`, a run's Kineto traces (`TraceAnalysis`): `get_trace_timeline_info` /
  `plot_trace_timeline` (compute, communication and idle by cause per rank over one step).

plotly is imported inside the `plot_*` functions only, so importing this package (and
`torsh_tune.reports`) never loads it.

Example:
    >>> from torsh_tune.analysis import load_run  # doctest: +SKIP
    >>> frames = load_run("torsh-runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> info = get_step_series_info(frames)  # doctest: +SKIP
    >>> plot_step_series(info).write_html("steps.html")  # doctest: +SKIP
"""

from typing import Any

from ._busbw import BUSBW_MODEL_TITLE, BusbwModelInfo, get_busbw_model_info, plot_busbw_model, reference_model
from ._common import DEFAULT_MAX_POINTS, Downsampled, downsample
from ._run import (
    FIGURE_TITLES,
    PHASE_COLORS,
    BreakdownInfo,
    CommTimelineInfo,
    LossInfo,
    OverlapInfo,
    RankHeatmapInfo,
    RankResourceSeries,
    ResourceInfo,
    StepSeriesInfo,
    build_figures,
    get_breakdown_info,
    get_comm_timeline_info,
    get_loss_info,
    get_overlap_info,
    get_rank_heatmap_info,
    get_resource_info,
    get_step_series_info,
    plot_breakdown,
    plot_comm_timeline,
    plot_loss,
    plot_memory,
    plot_overlap,
    plot_rank_heatmap,
    plot_step_series,
    plot_utilization,
)
from ._study import (
    TUNING_FIGURE_TITLES,
    ConfirmationInfo,
    ImportanceInfo,
    OptimizationHistoryInfo,
    ParallelAxis,
    ParallelCoordinatesInfo,
    ParetoFrontInfo,
    build_tuning_figures,
    get_confirmation_info,
    get_importance_info,
    get_optimization_history_info,
    get_parallel_coordinates_info,
    get_pareto_front_info,
    params_text,
    plot_confirmation,
    plot_importances,
    plot_optimization_history,
    plot_parallel_coordinates,
    plot_pareto_front,
    varying_params,
)

# The trace family loads `analysis.traces` (~0.13 s): on first use (PEP 562), not with every report.
_TRACE_NAMES = ("SEGMENT_KINDS", "TraceTimelineInfo", "get_trace_timeline_info", "plot_trace_timeline")

__all__ = [
    "BUSBW_MODEL_TITLE",
    "DEFAULT_MAX_POINTS",
    "FIGURE_TITLES",
    "PHASE_COLORS",
    "SEGMENT_KINDS",
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
    "TraceTimelineInfo",
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
    "get_trace_timeline_info",
    "params_text",
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
    "plot_trace_timeline",
    "plot_utilization",
    "reference_model",
    "varying_params",
]


def __getattr__(name: str) -> Any:
    if name not in _TRACE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import _trace

    return getattr(_trace, name)
