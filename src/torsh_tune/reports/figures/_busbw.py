"""Measured bus bandwidth per DDP bucket against the bench's alpha-beta model (`profile --reference-bench`).

Not part of `build_figures`: it needs a bench reference, read by `reference_model`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ...analysis import RunFrames, aligned_collectives, bus_factor
from ._common import FloatTuple, floats, new_figure, no_data

if TYPE_CHECKING:  # plotly is loaded lazily, by the plot function only
    import plotly.graph_objects as go

    from ...fabric import CommModel

__all__ = ["BUSBW_MODEL_TITLE", "BusbwModelInfo", "get_busbw_model_info", "plot_busbw_model", "reference_model"]

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
    size_bytes: FloatTuple  # median wire bytes of the bucket
    measured_busbw_gbps: FloatTuple  # median over steps
    measured_q25_gbps: FloatTuple
    measured_q75_gbps: FloatTuple
    model_busbw_gbps: FloatTuple
    curve_size_bytes: FloatTuple  # the model's prediction over the sizes shown, for the line
    curve_busbw_gbps: FloatTuple
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
    from ...fabric import MODEL_FILE, load_model

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
        size_bytes=floats(per["size"]), measured_busbw_gbps=floats(per["busbw"]),
        measured_q25_gbps=floats(per["q25"]), measured_q75_gbps=floats(per["q75"]),
        model_busbw_gbps=floats(predicted), curve_size_bytes=floats(curve_x), curve_busbw_gbps=floats(curve_y),
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

    fig = new_figure(BUSBW_MODEL_TITLE)
    fig.update_layout(hovermode="closest")
    if info.empty:
        return no_data(fig, "collectives with a measurable wire time")
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
