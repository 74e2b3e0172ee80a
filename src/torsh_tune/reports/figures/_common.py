"""What every figure family shares: the bucket downsampling, float tuples, and the plotly frame.

plotly is imported inside the drawing helpers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:  # plotly is loaded lazily, by the drawing functions only
    import plotly.graph_objects as go

__all__ = ["DEFAULT_MAX_POINTS", "LAYOUT", "Downsampled", "FloatTuple", "downsample", "floats", "new_figure", "styled",
           "no_data"]

#: Points per series a figure carries at most (per rank for per-rank series, split evenly).
DEFAULT_MAX_POINTS = 2000
FloatTuple = tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class Downsampled:
    """One series aggregated per bucket of `bucket_size` consecutive points."""

    x: FloatTuple  # first x of each bucket
    y_min: FloatTuple
    y_median: FloatTuple
    y_max: FloatTuple
    bucket_size: int  # points per bucket (1: not downsampled)


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
        t = floats(ys)
        return Downsampled(x=floats(xs), y_min=t, y_median=t, y_max=t, bucket_size=1)
    bucket = np.arange(n) // size
    g = pd.Series(ys).groupby(bucket)
    return Downsampled(
        x=floats(xs[::size]),
        y_min=floats(g.min().to_numpy()),
        y_median=floats(g.median().to_numpy()),
        y_max=floats(g.max().to_numpy()),
        bucket_size=size,
    )


def floats(values: Any) -> FloatTuple:
    return tuple(float(v) for v in np.asarray(values, dtype=float).tolist())


# -- drawing ----------------------------------------------------------------------------

LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=30, t=50, b=45), hovermode="x unified",
              legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1), height=360)


def new_figure(title: str, *, secondary_y: bool = False) -> "go.Figure":
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(specs=[[{"secondary_y": True}]]) if secondary_y else go.Figure()
    return styled(fig, title)


def styled(fig: "go.Figure", title: str, **layout: Any) -> "go.Figure":
    """`fig` with the figures' common look (`LAYOUT`, its template set by `set_template`), `layout` overriding it."""
    import plotly.io as pio

    set_template(fig, pio.templates[LAYOUT["template"]])
    fig.update_layout(title=dict(text=title, x=0.01), **{**{k: v for k, v in LAYOUT.items() if k != "template"},
                                                         **layout})
    return fig


def set_template(fig: "go.Figure", template: Any) -> None:
    """Give `fig` a template of plotly's registry as plotly gives a figure its default one: unvalidated.

    Assigning a template validates and copies every one of its properties: 10-30 ms a figure, more
    than drawing most of them (8 per report and per dashboard refresh). The registry's templates
    were validated when they were registered, so plotly itself assigns its default template with the
    layout's validation off (`BaseFigure._initialize_layout_template`); this does the same. A plotly
    without that switch ignores the flag and validates, as before.
    """
    layout = fig.layout
    validate = getattr(layout, "_validate", True)
    layout._validate = False
    try:
        layout.template = template
    finally:
        layout._validate = validate


def no_data(fig: "go.Figure", what: str) -> "go.Figure":
    fig.add_annotation(text=f"no {what} recorded", showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                       font=dict(size=14, color="#888"))
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig
