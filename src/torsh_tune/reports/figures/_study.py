"""Figures of a study (a `TuningInfo`, from `get_tuning_info(study_dir)`), and what its tables share.

Each figure is an info dataclass, the `get_*_info(info)` that fills it and the
`plot_*(info)` that draws it, side by side; `build_tuning_figures` draws the search's
figures, keyed by `TUNING_FIGURE_TITLES`. `varying_params` and `params_text` say which
parameters a study varied and what a trial set them to (the report's and the dashboard's
trial tables).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from .._format import fmt_param
from .._tuning import TuningInfo
from ._common import FloatTuple, floats, new_figure, no_data

if TYPE_CHECKING:  # plotly is loaded lazily, by the plot functions only
    import plotly.graph_objects as go

__all__ = [
    "TUNING_FIGURE_TITLES",
    "ConfirmationInfo",
    "ImportanceInfo",
    "OptimizationHistoryInfo",
    "ParallelAxis",
    "ParallelCoordinatesInfo",
    "ParetoFrontInfo",
    "build_tuning_figures",
    "get_confirmation_info",
    "get_importance_info",
    "get_optimization_history_info",
    "get_parallel_coordinates_info",
    "get_pareto_front_info",
    "params_text",
    "plot_confirmation",
    "plot_importances",
    "plot_optimization_history",
    "plot_parallel_coordinates",
    "plot_pareto_front",
    "varying_params",
]

#: Keys of `build_tuning_figures`, in display order, with their titles.
TUNING_FIGURE_TITLES = {
    "history": "Optimisation history",
    "importances": "Parameter importances",
    "parallel": "Parameters of the completed trials",
    "pareto": "Pareto front: throughput vs loss deviation",
}


# -- optimisation history -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class OptimizationHistoryInfo:
    """Objective per trial, the best feasible one so far, and the baseline's noise band."""

    number: tuple[int, ...]  # every trial
    samples_s: FloatTuple  # NaN unless COMPLETE
    feasible: tuple[bool, ...]  # COMPLETE and within the constraints
    state: tuple[str, ...]
    best_samples_s: FloatTuple  # NaN before the first feasible trial
    baseline_samples_s: float | None  # median of the baseline runs
    band_low_samples_s: float | None  # slowest baseline run
    band_high_samples_s: float | None  # fastest baseline run
    beat_samples_s: float | None  # median x (1 + noise): what a confirmed speedup must exceed
    unit: str = "samples/s"  # the objective's unit (TuningInfo.study["unit"]: samples/s or tokens/s)

    @property
    def empty(self) -> bool:
        return not any(math.isfinite(v) for v in self.samples_s)


def get_optimization_history_info(info: TuningInfo) -> OptimizationHistoryInfo:
    """The objective of every trial in number order, the best feasible so far and the baseline band.

    Example:
        >>> from torsh_tune.reports import get_tuning_info
        >>> h = get_optimization_history_info(get_tuning_info("tests/data/study_small"))
        >>> h.number[:3], h.state[1]
        ((0, 1, 2), 'FAIL')
    """
    h, b = info.history, info.baseline or {}
    return OptimizationHistoryInfo(
        number=tuple(int(n) for n in h.get("number", ())),
        samples_s=floats([_nan(v) for v in h.get("samples_s", ())]),
        feasible=tuple(bool(v) for v in h.get("feasible", ())),
        state=tuple(str(s) for s in h.get("state", ())),
        best_samples_s=floats([_nan(v) for v in h.get("best_samples_s", ())]),
        baseline_samples_s=b.get("median_samples_s"),
        band_low_samples_s=b.get("low_samples_s"),
        band_high_samples_s=b.get("high_samples_s"),
        beat_samples_s=b.get("beat_samples_s"),
        unit=_unit(info),
    )


def plot_optimization_history(info: OptimizationHistoryInfo) -> "go.Figure":
    """Throughput per trial (feasible, outside a constraint), best so far, baseline median and noise band.

    The y axis is logarithmic when the trials span more than a factor 20 (a hopeless trial
    would flatten the others otherwise).
    """
    import plotly.graph_objects as go

    fig = new_figure(TUNING_FIGURE_TITLES["history"])
    fig.update_layout(hovermode="closest")
    if info.empty:
        return no_data(fig, "completed trials")
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


# -- parameter importances ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ImportanceInfo:
    """Parameter importances, most important first (see `TuningInfo.importances`)."""

    names: tuple[str, ...]
    importance: FloatTuple  # normalised, sums to 1 over the scored parameters
    eta_squared: FloatTuple
    num_groups: tuple[int, ...]
    method: str
    num_trials: int

    @property
    def empty(self) -> bool:
        return not self.names


def get_importance_info(info: TuningInfo) -> ImportanceInfo:
    """The scored parameters of `TuningInfo.importances`, most important first."""
    imp = info.importances
    rows = [r for r in imp.get("params", ()) if r.get("importance") is not None]
    return ImportanceInfo(
        names=tuple(r["name"] for r in rows),
        importance=floats([r["importance"] for r in rows]),
        eta_squared=floats([r["eta_squared"] for r in rows]),
        num_groups=tuple(int(r["num_groups"]) for r in rows),
        method=str(imp.get("method", "")),
        num_trials=int(imp.get("num_trials", 0)),
    )


def plot_importances(info: ImportanceInfo) -> "go.Figure":
    """Horizontal bars, the most important parameter on top."""
    import plotly.graph_objects as go

    fig = new_figure(TUNING_FIGURE_TITLES["importances"])
    fig.update_layout(hovermode="closest", height=max(260, 120 + 32 * len(info.names)))
    if info.empty:
        return no_data(fig, "parameter that varied over completed trials")
    fig.add_trace(go.Bar(
        x=list(info.importance), y=list(info.names), orientation="h", marker=dict(color="#0072B2"),
        name="importance", customdata=[[e, g] for e, g in zip(info.eta_squared, info.num_groups)],
        hovertemplate="%{y}: %{x:.2f} (eta² %{customdata[0]:.2f}, %{customdata[1]} groups)<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text=f"share of log-throughput variance explained ({info.num_trials} completed trials)",
                     range=[0, 1])
    return fig


# -- parallel coordinates -------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParallelAxis:
    """One axis of the parallel-coordinates figure: numbers, or categories coded 0..k-1."""

    name: str
    values: FloatTuple  # one per trial
    tickvals: FloatTuple  # categorical axes only
    ticktext: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class ParallelCoordinatesInfo:
    """The completed trials over the parameters that varied, coloured by throughput."""

    number: tuple[int, ...]
    axes: tuple[ParallelAxis, ...]  # the parameters that took more than one value
    samples_s: FloatTuple  # the last axis and the colour
    unit: str = "samples/s"

    @property
    def empty(self) -> bool:
        return not self.number


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
            axes.append(ParallelAxis(name=name, values=floats(values), tickvals=(), ticktext=()))
            continue
        order = sorted({repr(v): v for v in values}.values(), key=_category_key)
        code = {repr(v): float(i) for i, v in enumerate(order)}
        axes.append(ParallelAxis(name=name, values=tuple(code[repr(v)] for v in values),
                                 tickvals=tuple(code.values()), ticktext=tuple(_category_text(v) for v in order)))
    return ParallelCoordinatesInfo(number=tuple(int(t["number"]) for t in done), axes=tuple(axes),
                                   samples_s=floats([t["samples_s"] for t in done]), unit=_unit(info))


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


def plot_parallel_coordinates(info: ParallelCoordinatesInfo) -> "go.Figure":
    """One line per completed trial across its parameters and throughput, coloured by throughput."""
    import plotly.graph_objects as go

    fig = new_figure(TUNING_FIGURE_TITLES["parallel"])
    fig.update_layout(margin=dict(l=80, r=80, t=90, b=40))
    if info.empty:
        return no_data(fig, "completed trials")
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


# -- Pareto front ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ParetoFrontInfo:
    """Completed trials in throughput vs loss deviation, the Pareto front marked."""

    number: tuple[int, ...]
    samples_s: FloatTuple
    loss_deviation_pct: FloatTuple
    feasible: tuple[bool, ...]
    on_front: tuple[bool, ...]
    front_number: tuple[int, ...]  # the front, by increasing loss deviation (its drawing order)
    loss_tolerance_pct: float | None
    unit: str = "samples/s"

    @property
    def empty(self) -> bool:
        return not self.front_number


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
        samples_s=floats([t["samples_s"] for t in pts]),
        loss_deviation_pct=floats([100.0 * t["loss_deviation"] for t in pts]),
        feasible=tuple(t.get("constraint_status") != "violated" for t in pts),
        on_front=tuple(t["number"] in front for t in pts),
        front_number=tuple(int(p["number"]) for p in by_loss),
        loss_tolerance_pct=100.0 * tol if tol is not None else None,
        unit=_unit(info),
    )


def plot_pareto_front(info: ParetoFrontInfo) -> "go.Figure":
    """Throughput vs loss deviation (%): every completed trial, the front joined, the tolerance dashed."""
    import plotly.graph_objects as go

    fig = new_figure(TUNING_FIGURE_TITLES["pareto"])
    fig.update_layout(hovermode="closest")
    if info.empty:
        return no_data(fig, "Pareto front (a throughput+loss study has one)")
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


# -- the search's figures -------------------------------------------------------------------


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


# -- confirmation ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ConfirmationInfo:
    """Each confirmed candidate's paired speedup over the baseline and its bootstrap 95 % CI."""

    trial: tuple[int, ...]
    speedup: FloatTuple
    ci_low: FloatTuple
    ci_high: FloatTuple
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
        speedup=floats([c["speedup"] for c in rows]),
        ci_low=floats([_nan(c.get("ci_low")) for c in rows]),
        ci_high=floats([_nan(c.get("ci_high")) for c in rows]),
        pairs=tuple(int(c.get("pairs") or 0) for c in rows),
        verdict=tuple(str(c.get("verdict") or "") for c in rows),
        best_trial=info.best.get("trial"),
        noise_rel=(info.baseline or {}).get("noise_rel"),
    )


def plot_confirmation(info: ConfirmationInfo) -> "go.Figure":
    """Paired speedup per candidate with its 95 % CI as error bars, 1x (the baseline) and 1 + noise dashed."""
    import plotly.graph_objects as go

    fig = new_figure("Confirmation: paired speedup over the baseline (95 % CI)")
    fig.update_layout(hovermode="closest")
    if info.empty:
        return no_data(fig, "confirmation pairs")
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


# -- the trial tables' parameters (the study report's and the dashboard's) ------------------


def varying_params(info: TuningInfo) -> set[str]:
    """The parameters that took more than one value over the study's trials (what a trial table shows).

    Example:
        >>> from torsh_tune.reports import get_tuning_info
        >>> sorted(varying_params(get_tuning_info("tests/data/study_small")))[:2]
        ['compression.method', 'dataloader.num_workers']
    """
    return {p for p in info.params if len({json.dumps(t["params"].get(p)) for t in info.trials}) > 1}


def params_text(params: Mapping[str, Any], names: set[str]) -> str:
    """A trial's values of the parameters `names`, as 'a=1, b=x' in name order ('–' when none).

    Example:
        >>> params_text({"ddp.bucket_cap_mb": 25, "compression.method": "none", "seed": 1},
        ...             {"ddp.bucket_cap_mb", "compression.method"})
        'compression.method=none, ddp.bucket_cap_mb=25'
    """
    return ", ".join(f"{k}={fmt_param(v)}" for k, v in sorted(params.items()) if k in names) or "–"


# -- helpers --------------------------------------------------------------------------------


def _unit(info: TuningInfo) -> str:
    return str(info.study.get("unit") or "samples/s")


def _nan(v: Any) -> float:
    return float("nan") if v is None else float(v)
