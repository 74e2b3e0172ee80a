"""What each page shows, as data (computed server-side), apart from the Dash components.

`overview_info` is the live overview's whole server-side work (incremental read, KPIs,
alerts, every figure of `reports.figures`); the benchmark times it. `get_compare_info` /
`plot_compare_breakdown` are the compare view's data and drawing; `tuning_view` is a
study's page (its `TuningInfo` and figures).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..analysis import (PHASES, RunAnalysis, RunFrames, find_alerts, planned_steps, run_thresholds, steady_rate,
                        untraced)
from ..reports import TuningInfo
from ..reports.figures import (
    DEFAULT_MAX_POINTS,
    build_figures,
    build_tuning_figures,
    get_busbw_model_info,
    get_confirmation_info,
    plot_busbw_model,
    plot_confirmation,
    reference_model,
)
from ._store import RunStore, status_class

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["CompareInfo", "Kpis", "OverviewInfo", "TuningView", "get_compare_info", "get_kpis", "overview_info",
           "plot_compare_breakdown", "tuning_view"]

#: Measured steps the live busbw-vs-model figure reads (the newest): its cost stays flat as a run grows.
BUSBW_LIVE_STEPS = 200


@dataclass(frozen=True, kw_only=True)
class Kpis:
    """Headline numbers of a run, from its records as they stand."""

    status: str  # running | finished | failed | unknown
    num_steps: int  # distinct steps recorded (any rank)
    last_step: int | None
    median_step_s: float | None  # slowest rank per measured step, median
    throughput_samples_s: float | None  # global samples per measured step x their steady rate (`steady_rate`)
    world_size: int
    num_ranks_reporting: int
    last_record_age_s: float | None  # now - newest t_end (a stalled live run shows here)


@dataclass(frozen=True, kw_only=True)
class OverviewInfo:
    """The overview page of one run: KPIs and figures keyed as `reports.figures.FIGURE_TITLES`."""

    kpis: Kpis
    figures: dict[str, "go.Figure"]
    warnings: tuple[str, ...]
    alerts: tuple[dict[str, Any], ...] = ()  # `Alert`s as dicts (ReportInfo.alerts rows), most severe first
    busbw_figure: "go.Figure | None" = None  # measured vs bench busbw, only with a bench model or reference


def get_kpis(frames: RunFrames) -> Kpis:
    """KPIs from a run's records (warm-up steps, and trace windows' as the report leaves them out, excluded
    from the step-time numbers)."""
    steps = frames.steps
    status = status_class(frames.info)
    if steps.empty:
        return Kpis(status=status, num_steps=0, last_step=None, median_step_s=None, throughput_samples_s=None,
                    world_size=frames.world_size, num_ranks_reporting=0, last_record_age_s=None)
    measured, _ = untraced(steps[~steps["warmup"].astype(bool)])  # the report's steps: no trace window's
    base = measured if not measured.empty else steps
    g = base.groupby("step", sort=False)
    per_step = g["step_s"].max()
    median = float(per_step.median()) if len(per_step) else math.nan
    samples = float(g["samples"].sum(min_count=1).median())
    # The report's rate (`steady_rate`), in steps; samples per step as their median (a step some ranks
    # have not finished yet counts fewer samples).
    planned = planned_steps(base).reindex(per_step.index, fill_value=False).to_numpy()
    steps_s = (steady_rate(np.ones(len(per_step)), per_step.to_numpy(dtype=float), planned)[0] if len(per_step)
               else math.nan)
    t_end = float(steps["t_end"].max())
    return Kpis(
        status=status,
        num_steps=int(steps["step"].nunique()),
        last_step=int(steps["step"].max()),
        median_step_s=median if math.isfinite(median) else None,
        throughput_samples_s=samples * steps_s if median > 0 and math.isfinite(samples * steps_s) else None,
        world_size=frames.world_size,
        num_ranks_reporting=int(steps["rank"].nunique()),
        last_record_age_s=max(0.0, time.time() - t_end) if math.isfinite(t_end) else None,
    )


def overview_info(store: RunStore, run_id: str, *, max_points: int = DEFAULT_MAX_POINTS) -> OverviewInfo:
    """Everything the overview page draws, reading only what the run wrote since last time.

    Raises:
        RunNotFound: `run_id` is not a run of the store.
    """
    frames = store.frames(run_id)
    warnings = list(frames.warnings)
    alerts = find_alerts(frames, thresholds=run_thresholds(frames.config, warnings))
    busbw = _busbw_figure(frames, warnings)  # an unreadable bench model is a warning on the page
    return OverviewInfo(kpis=get_kpis(frames), figures=build_figures(frames, max_points=max_points),
                        warnings=tuple(warnings), alerts=tuple(dataclasses.asdict(a) for a in alerts),
                        busbw_figure=busbw)


def _busbw_figure(frames: RunFrames, warnings: list[str]) -> "go.Figure | None":
    ref = frames.info.get("reference_busbw_gbps")
    if frames.comm.empty or not (frames.info.get("reference_bench") or isinstance(ref, (int, float))):
        return None
    model = reference_model(frames.info, warnings=warnings)
    info = get_busbw_model_info(frames, model, last_steps=BUSBW_LIVE_STEPS)
    if info.empty or (model is None and info.reference_busbw_gbps is None):
        return None
    return plot_busbw_model(info)


# -- tuning ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TuningView:
    """A study's page: its TuningInfo and figures (`TUNING_FIGURE_TITLES` keys, plus "confirmation")."""

    info: TuningInfo
    figures: dict[str, "go.Figure"]


def tuning_view(store: RunStore, run_id: str) -> TuningView:
    """The study's data and figures, as the study report draws them, plus the confirmation's CIs.

    Raises:
        RunNotFound: `run_id` is not a study of the store.
    """
    info = store.tuning(run_id)
    figures = build_tuning_figures(info)
    confirmation = get_confirmation_info(info)
    if not confirmation.empty:
        figures["confirmation"] = plot_confirmation(confirmation)
    return TuningView(info=info, figures=figures)


# -- compare ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class CompareInfo:
    """Two runs' headline numbers side by side; deltas are (b - a) / a in %."""

    names: tuple[str, str]
    rows: tuple[dict[str, Any], ...]  # metric, unit, a, b, delta_pct (None when undefined)
    phases: tuple[str, ...]
    phases_s: tuple[tuple[float, ...], tuple[float, ...]]  # per run, PHASES order (NaN when unknown)
    bottlenecks: tuple[tuple[str, ...], tuple[str, ...]]  # "severity category" per run


def _metrics(a: RunAnalysis) -> dict[str, tuple[str, float | None]]:
    st, cm = a.steps, a.comm
    return {
        "median step time": ("s", st.median_step_s if st else None),
        "p90 step time": ("s", st.p90_step_s if st else None),
        "throughput": ("samples/s", st.throughput_samples_s if st else None),
        "measured steps": ("", float(st.num_steps) if st else None),
        "communication per step": ("s", cm.comm_s if cm else None),
        "exposed communication per step": ("s", cm.exposed_comm_s if cm else None),
        "overlap": ("%", cm.overlap_pct if cm else None),
        "peak memory (worst rank)": ("bytes", float(max(a.memory.peak_bytes_by_rank.values()))
                                     if a.memory and a.memory.peak_bytes_by_rank else None),
    }


def get_compare_info(a: RunAnalysis, b: RunAnalysis) -> CompareInfo:
    """Side-by-side numbers of two analysed runs.

    Example:
        >>> info = get_compare_info(store.analysis("run-a"), store.analysis("run-b"))  # doctest: +SKIP
        >>> info.rows[0]["metric"], info.rows[0]["delta_pct"]  # doctest: +SKIP
        ('median step time', -12.5)
    """
    ma, mb = _metrics(a), _metrics(b)
    rows = []
    for metric, (unit, va) in ma.items():
        vb = mb[metric][1]
        delta = 100 * (vb - va) / va if va not in (None, 0) and vb is not None else None
        rows.append({"metric": metric, "unit": unit, "a": va, "b": vb, "delta_pct": delta})

    def phases(x: RunAnalysis) -> tuple[float, ...]:
        return tuple(float(x.breakdown.phases_s.get(p, np.nan)) if x.breakdown else np.nan for p in PHASES)

    return CompareInfo(
        names=(a.name, b.name),
        rows=tuple(rows),
        phases=PHASES,
        phases_s=(phases(a), phases(b)),
        bottlenecks=tuple(tuple(f"{bn.severity} {bn.category}" for bn in x.bottlenecks) for x in (a, b)),
    )


def plot_compare_breakdown(info: CompareInfo) -> "go.Figure":
    """One stacked bar per run: the median step's phases (ms)."""
    import plotly.graph_objects as go

    from ..reports.figures import PHASE_COLORS

    fig = go.Figure()
    for i, phase in enumerate(info.phases):
        fig.add_trace(go.Bar(x=list(info.names), y=[info.phases_s[0][i] * 1e3, info.phases_s[1][i] * 1e3],
                             name=phase.replace("_", " "), marker_color=PHASE_COLORS.get(phase)))
    fig.update_layout(barmode="stack", template="plotly_white", height=360, title=dict(text="Step breakdown", x=0.01),
                      yaxis_title="time per step (ms)", margin=dict(l=60, r=30, t=50, b=45))
    return fig
