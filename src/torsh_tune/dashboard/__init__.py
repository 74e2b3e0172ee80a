"""The live Dash dashboard: runs list, run overview (alerts included), bottleneck cards, compare view, studies.

Read-only over a runs directory; binds 127.0.0.1 unless a token is given, and then checks
the token on every request. Figures come from `torsh_tune.reports.figures`, shared with
the HTML report.

Example:
    >>> from torsh_tune.dashboard import serve  # doctest: +SKIP
    >>> serve("torsh-runs", host="127.0.0.1", port=8050)  # doctest: +SKIP
"""

from ._app import PAGE_PATHS, create_app
from ._security import ENV_TOKEN, RunNotFound, check_bind, is_loopback, resolve_run
from ._serve import make_server, serve
from ._store import RunRow, RunStore, is_study_dir
from ._views import (
    CompareInfo,
    Kpis,
    OverviewInfo,
    TuningView,
    get_compare_info,
    get_kpis,
    overview_info,
    plot_compare_breakdown,
    tuning_view,
)

__all__ = [
    "ENV_TOKEN",
    "PAGE_PATHS",
    "CompareInfo",
    "Kpis",
    "OverviewInfo",
    "RunNotFound",
    "RunRow",
    "RunStore",
    "TuningView",
    "check_bind",
    "create_app",
    "get_compare_info",
    "get_kpis",
    "is_loopback",
    "is_study_dir",
    "make_server",
    "overview_info",
    "plot_compare_breakdown",
    "resolve_run",
    "serve",
    "tuning_view",
]
