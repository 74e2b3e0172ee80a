"""The Dash app: runs list, live run overview, bottleneck cards, trace view, compare view, study tuning view.

One page shell (`dcc.Location` + a routing callback) so moving between pages never
reloads the page; each page's content is filled by its own callbacks, and live pages
poll with `dcc.Interval`, skipping the work when the run's files did not change.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from typing import Any
from urllib.parse import parse_qs, quote

from ..analysis import RunAnalysis
from ..reports import (ALERT_COLUMNS, alert_cells, build_report_info, fmt_bytes, fmt_loss_deviation, fmt_s,
                       fmt_samples_s, fmt_value, gain_text, patch_to_toml)
from ..reports._info import self_check_clocks, self_check_dicts, self_check_table
from ..reports._tuning_markdown import ABLATION_COLUMNS, ablation_table
from ..reports.figures import FIGURE_TITLES, TUNING_FIGURE_TITLES, params_text, varying_params
from ._security import RunNotFound, check_token, install_guard, not_found_response
from ._store import RunRow, RunStore, status_class
from ._traces import TRACE_TABLES, TraceView, TraceWindowNotFound, resolve_window
from ._views import Kpis, TuningView, get_compare_info, overview_info, plot_compare_breakdown, tuning_view

__all__ = ["PAGE_PATHS", "create_app"]

#: The app's page paths; group "run" is a run id (validated before anything is read), group
#: "window" a trace window of that run (validated the same way, `_traces.resolve_window`).
PAGE_PATHS = (
    re.compile(r"/"),
    re.compile(r"/compare"),
    re.compile(r"/runs/(?P<run>[^/]+)"),
    re.compile(r"/runs/(?P<run>[^/]+)/bottlenecks"),
    re.compile(r"/studies/(?P<run>[^/]+)"),
    re.compile(r"/runs/(?P<run>[^/]+)/traces"),
    re.compile(r"/runs/(?P<run>[^/]+)/traces/(?P<window>[^/]+)"),
)
_RUN_PAGES = PAGE_PATHS[2:]
_SORT_KEYS = {
    "started": "started",
    "run": "run",
    "status": "status",
    "script": "script",
    "world size": "world",
    "strategy": "strategy",
    "median step": "median",
    "top bottleneck": "bottleneck",
    "kind": "kind",
}
_SEVERITY_ORDER = {"critical": 0, "high": 1, "medium": 2, "low": 3}

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#f6f7f9}
header{background:#1f2937;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:center}
header a{color:#e5e7eb;text-decoration:none;font-weight:500} header a.brand{font-weight:700;color:#fff}
main{padding:16px 24px;max-width:1400px}
table.runs{border-collapse:collapse;width:100%;background:#fff} .runs th,.runs td{padding:6px 10px;
border-bottom:1px solid #e5e7eb;text-align:left;font-size:14px} .runs th{background:#f3f4f6}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600;color:#fff}
.status-running{background:#2563eb}.status-finished{background:#059669}.status-failed{background:#dc2626}
.status-unknown{background:#6b7280}
.sev-critical{background:#7f1d1d}.sev-high{background:#dc2626}.sev-medium{background:#d97706}.sev-low{background:#6b7280}
.controls{display:flex;gap:12px;align-items:center;margin-bottom:12px} .controls input{padding:6px;width:320px}
.controls .sort{width:200px}
.tabs{display:flex;gap:16px;margin:8px 0 16px} .tabs a{text-decoration:none;color:#2563eb}
.tabs a.active{font-weight:700;color:#111}
.kpis{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:12px}
.kpi{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px 14px;min-width:120px}
.kpi .label{font-size:12px;color:#6b7280} .kpi .value{font-size:20px;font-weight:600}
.figs{display:grid;grid-template-columns:repeat(auto-fit,minmax(560px,1fr));gap:12px}
.card{background:#fff;border:1px solid #e5e7eb;border-left:6px solid #6b7280;border-radius:6px;padding:10px 16px;
margin-bottom:12px} .card.severity-critical{border-left-color:#7f1d1d}.card.severity-high{border-left-color:#dc2626}
.card.severity-medium{border-left-color:#d97706} .card h4{margin:4px 0}
.card table td{padding:2px 10px 2px 0;font-size:13px} pre{background:#f3f4f6;padding:8px;border-radius:4px}
.warnings{color:#92400e;font-size:13px} .not-found{padding:40px 0}
.compare-table td,.compare-table th{padding:4px 12px;text-align:right} .compare-table td:first-child{text-align:left}
.kind-study{background:#7c3aed}.kind-run{background:#9ca3af}
.alerts{margin-bottom:12px} .alert{background:#fff;border:1px solid #e5e7eb;border-left:6px solid #d97706;
border-radius:6px;padding:6px 12px;margin-bottom:6px;font-size:14px} .alert.severity-critical{border-left-color:#7f1d1d}
.alert .meta{color:#6b7280;font-size:12px} .sev-warning{background:#d97706}
.comm-model{margin-top:12px}
table.trials{border-collapse:collapse;width:100%;background:#fff;margin-top:8px} .trials th,.trials td{padding:4px 8px;
border-bottom:1px solid #e5e7eb;font-size:13px;text-align:left;vertical-align:top} .trials th{background:#f3f4f6}
.trials td.num{text-align:right;font-variant-numeric:tabular-nums} tr.trial.state-FAIL td{color:#991b1b}
tr.trial.state-PRUNED td{color:#6b7280} .verdict{border-left-color:#059669}
.verdict.unconfirmed{border-left-color:#d97706}
.windows{flex-wrap:wrap;gap:10px;font-size:14px} .trace-error{color:#991b1b;font-weight:600}
table.trace{border-collapse:collapse;background:#fff;margin:4px 0 12px} .trace th,.trace td{padding:3px 10px;
border-bottom:1px solid #e5e7eb;font-size:13px;text-align:left} .trace th{background:#f3f4f6}
.trace td.num{text-align:right;font-variant-numeric:tabular-nums}
"""


def _paused(tick: str) -> list[tuple[Any, bool, bool]]:
    """`running=` for a callback a `dcc.Interval` drives: the interval pauses while the callback runs.

    Dash's renderer drops the response of a callback whose input changed again before it
    answered (plotly/dash#1613): a view that takes longer to build than the refresh interval (a
    large run, a loaded host) would never show at all, every tick superseding the last. Paused,
    each tick's response lands before the next tick. The renderer turns the interval back on
    before it applies the callback's own outputs, so a view that stops its interval (a finished
    run) keeps it stopped.
    """
    from dash import Output

    return [(Output(tick, "disabled"), True, False)]


def create_app(runs_dir: str | os.PathLike[str], *, token: str | None = None, refresh_s: float = 2.0) -> Any:
    """Build the dashboard for the runs under `runs_dir` (read-only).

    Args:
        runs_dir: directory holding one sub-directory per run (`torsh-tune ... --runs-dir`).
        token: shared secret every request must carry (header `Authorization: Bearer T`,
            or `?token=T` once, then a cookie); None checks nothing (loopback use).
        refresh_s: how often live pages poll the run's files.

    Returns:
        The `dash.Dash` app; `app.server` is its Flask (WSGI) app.

    Raises:
        ConfigError: a malformed token or refresh interval.

    Example:
        >>> app = create_app("torsh-runs")  # doctest: +SKIP
        >>> app.run(host="127.0.0.1", port=8050, debug=False)  # doctest: +SKIP
    """
    import dash
    from dash import Input, Output, State, dcc, html, no_update
    from dash.exceptions import PreventUpdate

    from ..errors import invalid

    check_token(token)
    if not (isinstance(refresh_s, (int, float)) and 0.1 <= refresh_s <= 3600):
        raise invalid("refresh_s", "between 0.1 and 3600 seconds", refresh_s)
    store = RunStore(runs_dir)
    refresh_ms = int(refresh_s * 1000)
    app = dash.Dash(
        __name__,
        title="torsh-tune dashboard",
        update_title=None,
        suppress_callback_exceptions=True,
        serve_locally=True,  # no CDN: the dashboard works offline and leaks nothing
        include_assets_files=False,
        enable_mcp=False,
    )
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + _CSS + "</style>")
    install_guard(app.server, token=token, page_paths=PAGE_PATHS, runs_dir=runs_dir)
    _install_window_guard(app.server, store)
    app.torsh_store = store  # for tests and the benchmark: the app's own RunStore

    app.layout = html.Div([
        dcc.Location(id="url", refresh=False),
        html.Header([
            dcc.Link("torsh-tune", href="/", className="brand"),
            dcc.Link("Runs", href="/", id="nav-runs"),
            dcc.Link("Compare", href="/compare", id="nav-compare"),
        ]),
        html.Main(id="page"),
    ])

    # -- routing ------------------------------------------------------------------------

    @app.callback(Output("page", "children"), Input("url", "pathname"), Input("url", "search"))
    def route(pathname: str | None, search: str | None) -> Any:
        path = pathname or "/"
        if path == "/":
            return _runs_page(refresh_ms)
        if path == "/compare":
            q = parse_qs((search or "").lstrip("?"))
            return _compare_page(store, (q.get("a") or [None])[0], (q.get("b") or [None])[0])
        m = next((m for p in _RUN_PAGES if (m := p.fullmatch(path)) is not None), None)
        if m is None:
            return _not_found(f"No page at {path!r}.")
        run_id = m.group("run")
        try:
            if store.is_study(run_id):
                return _tuning_page(run_id, refresh_ms)
            if path.startswith("/studies/"):
                return _not_found(f"{run_id!r} is a run, not a study: see /runs/{run_id}.")
            status = status_class(store.info(run_id))
            windows = store.trace_windows(run_id)
        except RunNotFound:
            return _not_found(f"No run named {run_id!r} in the runs directory.")
        if m.re is PAGE_PATHS[5] or m.re is PAGE_PATHS[6]:
            window = m.groupdict().get("window") or (windows[0] if windows else None)
            if window is not None and window not in windows:
                return _not_found(f"No trace window named {window!r} in run {run_id!r}.")
            return _traces_page(run_id, status, windows, window, refresh_ms)
        if path.endswith("/bottlenecks"):
            return _bottlenecks_page(run_id, status, refresh_ms, traces=bool(windows))
        return _overview_page(run_id, status, refresh_ms, traces=bool(windows))

    # -- runs list ----------------------------------------------------------------------

    @app.callback(
        Output("runs-table", "children"),
        Input("runs-filter", "value"), Input("runs-sort", "value"), Input("runs-order", "value"),
        Input("runs-tick", "n_intervals"),
        running=_paused("runs-tick"),
    )
    def runs_table(text: str | None, sort: str | None, order: str | None, _n: int | None) -> Any:
        rows = _filter_rows(store.list_runs(), text or "")
        rows = _sort_rows(rows, sort or "started", descending=(order != "asc"))
        return _runs_table(rows)

    # -- overview -----------------------------------------------------------------------

    fig_ids = [f"fig-{k}" for k in FIGURE_TITLES]

    @app.callback(
        [Output("overview-kpis", "children"), Output("overview-warnings", "children"),
         Output("overview-alerts", "children")]
        + [Output(i, "figure") for i in fig_ids]
        + [Output("overview-comm-model", "children"), Output("overview-comm-model", "style"),
           Output("overview-sig", "data"), Output("overview-tick", "disabled")],
        Input("overview-tick", "n_intervals"),
        State("overview-run", "data"), State("overview-sig", "data"),
        running=_paused("overview-tick"),
    )
    def overview(_n: int | None, run_id: str, last_sig: str | None) -> Any:
        try:
            sig = _digest(store.signature(run_id))
            if sig == last_sig:
                raise PreventUpdate  # nothing was written since the last tick
            view = overview_info(store, run_id)
        except RunNotFound:
            return ([_not_found(f"No run named {run_id!r}."), None, None] + [no_update] * len(fig_ids)
                    + [None, {"display": "none"}, None, True])
        figs = [view.figures[k] for k in FIGURE_TITLES]
        comm_model = _comm_model(view.busbw_figure)
        return [_kpi_row(view.kpis), _warnings(view.warnings), _alert_cards(view.alerts), *figs,
                comm_model, None if comm_model else {"display": "none"}, sig, view.kpis.status != "running"]

    # -- tuning (a study) -----------------------------------------------------------------

    @app.callback(
        Output("tuning-content", "children"), Output("tuning-sig", "data"), Output("tuning-tick", "disabled"),
        Input("tuning-tick", "n_intervals"), State("tuning-run", "data"), State("tuning-sig", "data"),
        running=_paused("tuning-tick"),
    )
    def tuning(_n: int | None, run_id: str, last_sig: str | None) -> Any:
        try:
            info = store.tuning(run_id)  # cached until the study's files change
            sig = _digest((info.generated_at, repr(info.study.get("counts"))))
            if sig == last_sig:
                raise PreventUpdate
            view = tuning_view(store, run_id)
        except RunNotFound:
            return _not_found(f"No study named {run_id!r}."), None, True
        return _tuning_body(view), sig, view.info.study.get("status") != "running"

    # -- bottlenecks --------------------------------------------------------------------

    @app.callback(
        Output("bn-content", "children"), Output("bn-sig", "data"), Output("bn-tick", "disabled"),
        Input("bn-tick", "n_intervals"), State("bn-run", "data"), State("bn-sig", "data"),
        running=_paused("bn-tick"),
    )
    def bottlenecks(_n: int | None, run_id: str, last_sig: str | None) -> Any:
        try:
            sig = _digest(store.signature(run_id))
            if sig == last_sig:
                raise PreventUpdate
            analysis = store.analysis(run_id)
        except RunNotFound:
            return _not_found(f"No run named {run_id!r}."), None, True
        return _cards(analysis), sig, status_class(analysis.info) != "running"

    # -- trace view (one trace window) --------------------------------------------------

    @app.callback(
        Output("tr-content", "children"), Output("tr-sig", "data"), Output("tr-tick", "disabled"),
        Input("tr-tick", "n_intervals"), State("tr-run", "data"), State("tr-sig", "data"),
        running=_paused("tr-tick"),
    )
    def traces(_n: int | None, ref: Any, last_sig: str | None) -> Any:
        run_id, window = (ref.get("run"), ref.get("window")) if isinstance(ref, dict) else (None, None)
        try:
            view = store.trace_view(run_id, window)  # validates both names; cached until the files change
            running = status_class(store.info(run_id)) == "running"
        except RunNotFound:
            return _not_found(f"No run named {str(run_id)[:200]!r}."), None, True
        except TraceWindowNotFound:
            return _not_found(f"No trace window named {str(window)[:200]!r} in run {run_id!r}."), None, True
        check = _window_self_check(store, run_id, window) if view.error is None else None
        sig = _digest((view.key, check))  # the self-check changes while a live run's step records land
        if sig == last_sig:
            raise PreventUpdate
        return _trace_body(view, check), sig, not running  # a live run may still be writing this window

    # -- compare ------------------------------------------------------------------------

    @app.callback(Output("url", "search"), Input("cmp-a", "value"), Input("cmp-b", "value"),
                  prevent_initial_call=True)
    def compare_select(a: str | None, b: str | None) -> Any:
        parts = [f"{k}={quote(v)}" for k, v in (("a", a), ("b", b)) if v]
        return "?" + "&".join(parts) if parts else ""

    return app


def _install_window_guard(server: Any, store: RunStore) -> None:
    """A trace-window path whose window does not resolve is a real 404 (after `install_guard`'s checks).

    `install_guard` (registered first, so the token is checked first) validates the run id;
    this validates the window name the same way, before Dash serves the page shell.
    """
    from flask import request

    @server.before_request
    def _window_guard() -> Any:
        m = PAGE_PATHS[6].fullmatch(request.path)
        if m is None:
            return None
        try:
            resolve_window(store.path(m.group("run")), m.group("window"))
        except (RunNotFound, TraceWindowNotFound):
            return not_found_response(f"No trace window named {m.group('window')!r} in run {m.group('run')!r}.")
        return None


# -- page builders (pure functions of data: no store access except where named) -----------


def _html() -> Any:
    from dash import dcc, html

    return dcc, html


def _not_found(message: str) -> Any:
    dcc, html = _html()
    return html.Div(className="not-found", id="not-found", children=[
        html.H2("404: not found"),
        html.P(message, id="not-found-message"),
        dcc.Link("Back to the runs list", href="/"),
    ])


def _runs_page(refresh_ms: int) -> Any:
    dcc, html = _html()
    return html.Div([
        html.H2("Runs"),
        html.Div(className="controls", children=[
            dcc.Input(id="runs-filter", type="text", placeholder="filter by run, script, status, strategy, bottleneck",
                      debounce=False, value=""),
            html.Label("sort by"),
            dcc.Dropdown(id="runs-sort", options=list(_SORT_KEYS), value="started", clearable=False,
                         className="sort"),
            dcc.RadioItems(id="runs-order", options=[{"label": " descending", "value": "desc"},
                                                     {"label": " ascending", "value": "asc"}],
                           value="desc", inline=True),
        ]),
        html.Div(id="runs-table"),
        dcc.Interval(id="runs-tick", interval=refresh_ms),
    ])


def _filter_rows(rows: list[RunRow], text: str) -> list[RunRow]:
    words = text.lower().split()
    if not words:
        return rows

    def hay(r: RunRow) -> str:
        return " ".join([r.run_id, r.kind, r.status, r.raw_status, r.script, r.strategy, r.top_bottleneck, r.headline,
                         str(r.world_size or "")]).lower()

    return [r for r in rows if all(w in hay(r) for w in words)]


def _sort_rows(rows: list[RunRow], sort: str, *, descending: bool) -> list[RunRow]:
    key = _SORT_KEYS.get(sort, "started")

    def value(r: RunRow) -> tuple:
        v: Any = {
            "started": r.started_at_unix, "run": r.run_id, "status": r.status, "script": r.script,
            "world": r.world_size, "strategy": r.strategy, "median": r.median_step_s,
            "bottleneck": (_SEVERITY_ORDER.get(r.top_bottleneck.split(" ")[0], 9) if r.top_bottleneck else None),
            "kind": r.kind,
        }[key]
        return (v is None, v if v is not None else 0, r.run_id)

    present = sorted((r for r in rows if value(r)[0] is False), key=value, reverse=descending)
    return present + [r for r in rows if value(r)[0] is True]  # unknown values last either way


def _runs_table(rows: list[RunRow]) -> Any:
    dcc, html = _html()
    if not rows:
        return html.P("No runs match.", id="runs-empty")
    head = html.Tr([html.Th(h) for h in ("run", "kind", "status", "script", "world size", "strategy", "median step",
                                         "top bottleneck / verdict", "started")])
    body = []
    for r in rows:
        href = f"/studies/{r.run_id}" if r.kind == "study" else f"/runs/{r.run_id}"
        body.append(html.Tr(className=f"run-row row-{r.status}",
                            **{"data-run": r.run_id, "data-status": r.status, "data-kind": r.kind}, children=[
            html.Td(dcc.Link(r.run_id, href=href)),
            html.Td(html.Span(r.kind, className=f"badge kind-{r.kind}")),
            html.Td(html.Span(r.status, title=r.raw_status, className=f"badge status-{r.status}")),
            html.Td(r.script),
            html.Td("" if r.world_size is None else str(r.world_size)),
            html.Td(r.strategy),
            html.Td(fmt_s(r.median_step_s) if r.median_step_s is not None else ""),
            html.Td(r.headline if r.kind == "study" else r.top_bottleneck),
            html.Td(r.started_at[:19].replace("T", " ")),
        ]))
    return html.Table(className="runs", id="runs", children=[html.Thead(head), html.Tbody(body)])


def _tabs(run_id: str, active: str, *, traces: bool = False) -> Any:
    """The run's tabs; "Trace analysis" only when the run has trace windows."""
    dcc, html = _html()
    links = [("overview", "Overview", f"/runs/{run_id}"),
             ("bottlenecks", "Bottlenecks & recommendations", f"/runs/{run_id}/bottlenecks")]
    if traces:
        links.append(("traces", "Trace analysis", f"/runs/{run_id}/traces"))
    links.append(("compare", "Compare with…", f"/compare?a={quote(run_id)}"))
    return html.Div(className="tabs", children=[
        dcc.Link(label, href=href, className="active" if key == active else "", id=f"tab-{key}")
        for key, label, href in links])


def _title(run_id: str, status: str) -> Any:
    _, html = _html()
    return html.H2([run_id, " ", html.Span(status, id="run-status", className=f"badge status-{status}")])


def _overview_page(run_id: str, status: str, refresh_ms: int, *, traces: bool = False) -> Any:
    dcc, html = _html()
    graphs = [dcc.Graph(id=f"fig-{k}", config={"displaylogo": False}) for k in FIGURE_TITLES]
    return html.Div([
        _title(run_id, status),
        _tabs(run_id, "overview", traces=traces),
        html.Div(id="overview-kpis", className="kpis"),
        html.Div(id="overview-alerts", className="alerts"),
        html.Div(id="overview-warnings", className="warnings"),
        html.Div(graphs, className="figs"),
        html.Div(id="overview-comm-model", className="comm-model", style={"display": "none"}),
        dcc.Store(id="overview-run", data=run_id),
        dcc.Store(id="overview-sig"),
        dcc.Interval(id="overview-tick", interval=refresh_ms, disabled=False),
    ])


def _kpi_row(k: Kpis) -> Any:
    _, html = _html()
    age = k.last_record_age_s
    items = [
        ("status", k.status, "kpi-status"),
        ("steps recorded", str(k.num_steps), "kpi-steps"),
        ("last step", "" if k.last_step is None else str(k.last_step), "kpi-last-step"),
        ("median step (measured)", fmt_s(k.median_step_s) if k.median_step_s is not None else "–", "kpi-median"),
        ("throughput", f"{k.throughput_samples_s:,.1f} samples/s" if k.throughput_samples_s else "–",
         "kpi-throughput"),
        ("ranks reporting", f"{k.num_ranks_reporting} / {k.world_size}", "kpi-ranks"),
    ]
    if k.status == "running" and age is not None:
        items.append(("last record", f"{age:,.0f} s ago", "kpi-age"))
    return [html.Div(className="kpi", children=[html.Div(label, className="label"),
                                                html.Div(value, className="value", id=i)]) for label, value, i in items]


def _warnings(warnings: tuple[str, ...]) -> Any:
    _, html = _html()
    if not warnings:
        return None
    return html.Details([html.Summary(f"{len(warnings)} warning(s) while reading the run"),
                         html.Ul([html.Li(w) for w in warnings[:50]])])


def _alert_cards(alerts: tuple[dict[str, Any], ...]) -> Any:
    """One card per alert (most severe first), or a one-line all-clear."""
    _, html = _html()
    if not alerts:
        return html.P("No alert: no metric stayed past its alert threshold.", id="no-alerts", className="warnings")
    cards = [html.H3(f"Alerts ({len(alerts)})", id="alerts-title")]
    for a in alerts:
        c = alert_cells(a)
        sev = c["severity"]
        cards.append(html.Div(className=f"alert severity-{sev}", **{"data-kind": str(a.get("kind")),
                                                                    "data-severity": sev}, children=[
            html.Span(sev, className=f"badge sev-{sev}"), " ", html.B(c["alert"]), " ",
            html.Span(c["message"]),
            html.Div(" · ".join(f"{k}: {c[k]}" for k in ALERT_COLUMNS[2:]), className="meta"),
        ]))
    return cards


def _comm_model(figure: Any) -> Any:
    """The overview's communication-vs-bench section, or None without a bench model or reference."""
    dcc, html = _html()
    if figure is None:
        return None
    return [html.H3("Communication vs the bench model"),
            dcc.Graph(id="fig-busbw_model", figure=figure, config={"displaylogo": False})]


def _tuning_page(run_id: str, refresh_ms: int) -> Any:
    _, html = _html()
    return html.Div([html.H2([run_id, " ", html.Span("study", className="badge kind-study")]),
                     *_live_panel("tuning", run_id, "reading the study…", refresh_ms)])


def _live_panel(prefix: str, run_id: str, placeholder: str, refresh_ms: int) -> list[Any]:
    """A panel its callback refills: `{prefix}-content`, the run id and last signature, a slow tick."""
    dcc, html = _html()
    return [html.Div(id=f"{prefix}-content", children=html.P(placeholder)),
            dcc.Store(id=f"{prefix}-run", data=run_id),
            dcc.Store(id=f"{prefix}-sig"),
            dcc.Interval(id=f"{prefix}-tick", interval=max(refresh_ms, 5000), disabled=False)]


def _tuning_body(view: TuningView) -> Any:
    """The study page: verdict, baseline vs best with its CI, figures, trials table."""
    dcc, html = _html()
    info = view.info
    status = str(info.study.get("status") or "unknown")
    counts = info.study.get("counts") or {}
    b, best = info.baseline or {}, info.best or {}
    unit = str(info.study.get("unit") or "samples/s")
    kpis = [("status", status, "tuning-status"),
            ("trials", f"{counts.get('complete', 0)} complete / {counts.get('trials', 0)}", "tuning-trials"),
            ("baseline (median)", fmt_samples_s(b.get("median_samples_s"), unit), "tuning-baseline"),
            ("baseline noise", f"{b['noise_pct']:.1f} %" if b.get("noise_pct") is not None else "–", "tuning-noise")]
    if best.get("speedup") is not None:
        kpis += [("confirmed speedup", f"{best['speedup']:.3f}x (trial {best.get('trial')})", "tuning-speedup"),
                 ("95 % CI", f"{best['ci_low']:.3f}–{best['ci_high']:.3f}", "tuning-ci")]

    def graph(key: str) -> Any:
        fig = view.figures.get(key)
        return dcc.Graph(id=f"fig-tuning-{key}", figure=fig, config={"displaylogo": False}) if fig else None

    out: list[Any] = [
        html.Div(className="card verdict" + ("" if info.verdict.get("confirmed") else " unconfirmed"),
                 id="tuning-verdict", children=[html.H4(str(info.verdict.get("title") or "")),
                                                html.P(str(info.verdict.get("text") or ""))]),
        html.Div(className="kpis", children=[
            html.Div(className="kpi", children=[html.Div(label, className="label"), html.Div(value, className="value",
                                                                                          id=i)])
            for label, value, i in kpis]),
    ]
    if info.confirmations:
        out += [html.H3("Baseline vs best: confirmation"), graph("confirmation"), _confirmation_table(info)]
    if info.ablation:  # the winner's changes that earn its speedup, each with its share
        out += [html.H3("Minimal configuration (ablation)"), html.Table(
            className="trials", id="ablation-table",
            children=[html.Thead(html.Tr([html.Th(c) for c in ABLATION_COLUMNS])),
                      html.Tbody([html.Tr([html.Td(c) for c in row]) for row in ablation_table(info)])])]
    out += [html.H3("Search"),
            html.Div([graph(k) for k in TUNING_FIGURE_TITLES if k in view.figures], className="figs"),
            html.H3(f"Trials ({len(info.trials)})"), _trials_table(info)]
    if info.warnings:
        out.append(_warnings(info.warnings))
    return out


def _confirmation_table(info: Any) -> Any:
    _, html = _html()
    head = html.Tr([html.Th(h) for h in ("trial", "pairs", "paired speedup", "95 % CI", "verdict")])
    rows = [html.Tr([html.Td(str(c["trial"])), html.Td(str(c.get("pairs") or 0)),
                     html.Td("–" if c["speedup"] is None else f"{c['speedup']:.3f}x"),
                     html.Td("–" if c.get("ci_low") is None else f"{c['ci_low']:.3f}–{c['ci_high']:.3f}"),
                     html.Td(str(c.get("verdict") or ""))]) for c in info.confirmations]
    return html.Table(className="trials", id="confirmation-table", children=[html.Thead(head), html.Tbody(rows)])


def _trials_table(info: Any) -> Any:
    """Every trial: state, role, objective, constraint status, the parameters that varied, why it failed."""
    _, html = _html()
    if not info.trials:
        return html.P("No trial has been recorded yet.", id="no-trials")
    varying = varying_params(info)
    unit = str(info.study.get("unit") or "samples/s")
    head = html.Tr([html.Th(h) for h in ("trial", "state", "role", unit, "vs baseline", "loss deviation",
                                         "constraints", "peak memory", "parameters", "failure reason")])
    body = []
    for t in info.trials:
        mark = "★ " if t["number"] == info.best.get("trial") else ""
        body.append(html.Tr(className=f"trial state-{t['state']}",
                            **{"data-number": str(t["number"]), "data-state": str(t["state"])}, children=[
            html.Td(f"{mark}{t['number']}", className="num"),
            html.Td(str(t["state"])),
            html.Td(t.get("role") or "sampler"),
            html.Td(fmt_samples_s(t.get("samples_s"), unit), className="num"),
            html.Td(f"{t['vs_baseline']:.2f}x" if t.get("vs_baseline") is not None else "–", className="num"),
            html.Td(fmt_loss_deviation(t.get("loss_deviation")), className="num"),
            html.Td(t.get("constraint_status") or "–", className="constraint"),
            html.Td(fmt_bytes(t["peak_mem_bytes"]) if t.get("peak_mem_bytes") is not None else "–", className="num"),
            html.Td(params_text(t.get("params") or {}, varying)),
            html.Td(t.get("failure_reason") or "", className="reason"),
        ]))
    return html.Table(className="trials", id="trials-table", children=[html.Thead(head), html.Tbody(body)])


def _bottlenecks_page(run_id: str, status: str, refresh_ms: int, *, traces: bool = False) -> Any:
    _, html = _html()
    return html.Div([_title(run_id, status), _tabs(run_id, "bottlenecks", traces=traces),
                     *_live_panel("bn", run_id, "analysing…", refresh_ms)])


def _cards(analysis: RunAnalysis) -> Any:
    _, html = _html()
    info = build_report_info(analysis)
    out = _finding_cards(info.bottlenecks, info.recommendations, (info.summary or {}).get("median_step_s"))
    if info.warnings:
        out.append(_warnings(info.warnings))
    return out


def _finding_cards(bottlenecks: Any, recommendations: Any, median: float | None) -> list[Any]:
    """Bottleneck cards (most severe first) and recommendation cards (priority order), from their dicts."""
    _, html = _html()
    bns = sorted(bottlenecks, key=lambda b: _SEVERITY_ORDER.get(b.get("severity"), 9))
    out: list[Any] = [html.H3(f"Bottlenecks ({len(bns)})")]
    if not bns:
        out.append(html.P("No bottleneck found in the measured steps.", id="no-bottlenecks"))
    for b in bns:
        sev, cat = str(b.get("severity")), str(b.get("category"))
        evidence = b.get("evidence") or {}
        out.append(html.Div(className=f"card bottleneck severity-{sev}", **{"data-category": cat,
                                                                             "data-severity": sev}, children=[
            html.H4([html.Span(sev, className=f"badge sev-{sev}"), " ", html.Span(cat, className="category")]),
            html.P(str(b.get("message") or "")),
            html.Div(f"ranks: {', '.join(str(r) for r in b.get('ranks') or [])}"),
            html.Table([html.Tr([html.Td(k), html.Td(fmt_value(k, v))]) for k, v in evidence.items()])
            if evidence else None,
        ]))
    recs = sorted(recommendations, key=lambda r: r.get("priority") or 99)
    out.append(html.H3(f"Recommendations ({len(recs)})"))
    for r in recs:
        gain = r.get("expected_gain") or {}
        patch = r.get("config_patch") or {}
        out.append(html.Div(className="card recommendation", **{"data-category": str(r.get("category"))},
                            children=[
            html.H4(f"{r.get('priority')}. {r.get('title')}"),
            html.Div([html.B("expected gain: "), gain_text(gain, median),
                      f" ({gain.get('basis')})" if gain.get("basis") else ""]),
            html.Div([html.B("effort: "), str(r.get("effort"))]),
            html.P(str(r.get("rationale") or "")),
            html.Pre(patch_to_toml(patch), className="patch") if patch else html.I("no config knob: a code change"),
        ]))
    return out


def _traces_page(run_id: str, status: str, windows: list[str], window: str | None, refresh_ms: int) -> Any:
    """The trace view: one link per window, the selected window's analysis (filled by its callback)."""
    dcc, html = _html()
    head = [_title(run_id, status), _tabs(run_id, "traces", traces=True)]
    if window is None:
        return html.Div([*head, html.P(["This run has no trace window: profile with ",
                                        html.Code("torsh-tune profile --trace-window START:LEN"),
                                        " to capture Kineto traces of a few steps."], id="no-trace-windows")])
    links = html.Div(className="tabs windows", id="trace-windows", children=[
        html.Span("trace windows:")] + [
        html.Span(dcc.Link(w, href=f"/runs/{run_id}/traces/{w}", className="active" if w == window else ""),
                  className="window", **{"data-window": w}) for w in windows])
    return html.Div([
        *head, links,
        html.H3(["Trace window ", html.Span(window, id="trace-window")]),
        html.Div(id="tr-content", children=html.P("analysing the traces…")),
        dcc.Store(id="tr-run", data={"run": run_id, "window": window}),
        dcc.Store(id="tr-sig"),
        dcc.Interval(id="tr-tick", interval=max(refresh_ms, 5000), disabled=False),
    ])


def _cell(col: str, v: Any) -> tuple[str, str]:
    """(text, class) of one table cell: units from the column name (_s, _us, _pct)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–", "num"
    if isinstance(v, str):
        return v, ""
    if col.endswith("_us"):
        return fmt_s(float(v) / 1e6), "num"
    if col.endswith("_pct"):
        return f"{v:.1f}", "num"
    return fmt_value(col, v), "num"


def _trace_table(name: str, rows: list[dict[str, Any]]) -> Any:
    _, html = _html()
    columns = TRACE_TABLES[name]
    if not rows:
        return html.P("(none)", id=f"trace-{name}")
    body = []
    for r in rows:
        cells = []
        for _, col in columns:
            text, cls = _cell(col, r.get(col))
            cells.append(html.Td(text, className=cls, title=text if col == "name" else None))
        body.append(html.Tr(cells, **{"data-rank": str(r.get("rank"))}))
    return html.Table(className="trace", id=f"trace-{name}", children=[
        html.Thead(html.Tr([html.Th(label) for label, _ in columns])), html.Tbody(body)])


def _window_self_check(store: RunStore, run_id: str, window: str) -> dict[str, Any] | None:
    """The run's self-check of this window (`RunAnalysis.self_check`, as report.json has it), or None."""
    try:
        checks = self_check_dicts(store.analysis(run_id))
    except Exception:  # noqa: BLE001 - the trace view stands without it; the overview shows what failed
        return None
    return next((c for c in checks if c.get("window") == window), None)


def _self_check_section(check: dict[str, Any] | None) -> list[Any]:
    """The always-on numbers beside this window's, same steps (design principle 8), and what disagrees."""
    _, html = _html()
    if check is None:
        return []
    header, rows = self_check_table(check)
    out: list[Any] = [
        html.H3("Self-check: the always-on numbers against this trace, same steps"),
        html.P(f"Steps {check['start_step']}-{check['end_step']}. Each cell: always-on / trace (always-on minus "
               f"trace). Clocks: {self_check_clocks(check)}.", className="warnings"),
        html.Table(className="trace", id="trace-self-check", children=[
            html.Thead(html.Tr([html.Th(h) for h in header])),
            html.Tbody([html.Tr([html.Td(c, className="" if i == 0 else "num") for i, c in enumerate(row)],
                                **{"data-rank": row[0]}) for row in rows])]),
    ]
    findings = check.get("findings") or []
    if findings:
        out.append(html.Ul(id="trace-self-check-findings", children=[
            html.Li(f["message"], **{"data-metric": str(f["metric"])}) for f in findings]))
    else:
        out.append(html.P(f"The two agree within {check['threshold_pp']:g} pp ([thresholds] selfcheck_pp; the step "
                          "time within as many %).", id="trace-self-check-agrees", className="warnings"))
    return out


def _trace_body(view: TraceView, check: dict[str, Any] | None = None) -> Any:
    """One analysed window: headline, findings, the self-check, timeline, per-rank tables, warnings."""
    dcc, html = _html()
    if view.error is not None:
        return [html.P(view.error, id="trace-error", className="trace-error")]
    s = view.summary

    def pct(key: str) -> str:
        v = s.get(key)
        return "–" if v is None else f"{v:.1f} %"

    kpis = [("backend / device", f"{s.get('backend') or '–'} / {s.get('device') or '–'}", "trace-kpi-backend"),
            ("ranks", str(s.get("num_ranks", "–")), "trace-kpi-ranks"),
            ("median step (slowest rank)", fmt_s(view.median_step_s) if view.median_step_s else "–",
             "trace-kpi-step"),
            ("idle", pct("idle_pct"), "trace-kpi-idle"),
            ("comm/compute overlap", pct("overlap_pct"), "trace-kpi-overlap"),
            ("collectives", str(s.get("num_collectives", "–")), "trace-kpi-collectives"),
            ("straggler", "–" if s.get("straggler_rank") is None
             else f"rank {s['straggler_rank']} ({s.get('straggler_last_share_pct') or 0:.0f} % last)",
             "trace-kpi-straggler")]
    out: list[Any] = [
        html.Div(className="kpis", children=[
            html.Div(className="kpi", children=[html.Div(label, className="label"),
                                                html.Div(value, className="value", id=i)])
            for label, value, i in kpis]),
        html.P("Shares are % of the profiled window (whole ProfilerSteps), averaged over ranks; expected gains "
               "are % of the window, so of an average profiled step.", className="warnings"),
        *_finding_cards(view.bottlenecks, view.recommendations, view.median_step_s),
        *_self_check_section(check),
        html.H3("Timeline of a typical step" + (f" (step {view.step})" if view.step is not None else "")),
    ]
    if view.figure is not None:
        out.append(dcc.Graph(id="fig-trace-timeline", figure=view.figure, config={"displaylogo": False}))
    else:
        out.append(html.P("No timeline: the traces hold no events.", id="no-trace-timeline"))
    out += [
        html.H3("Per-rank breakdown and overlap (% of the profiled window)"),
        _trace_table("ranks", view.tables["ranks"]),
        html.H3("Idle-time causes (% of each rank's idle time)"),
        _trace_table("idle_causes", view.tables["idle_causes"]),
        html.P("sync: host blocked on the device; comm wait: waiting on a collective; host wait: the host issued the "
               "next work late; other: issued in time, started late. Peer wait: collective time spent waiting for "
               "late peers (busy, not idle).", className="warnings"),
        html.H3("Stragglers (arrival at collectives)"), _trace_table("stragglers", view.tables["stragglers"]),
        html.H3("Top kernels / operators"), _trace_table("top_kernels", view.tables["top_kernels"]),
        html.H3("Profiled steps"), _trace_table("steps", view.tables["steps"]),
    ]
    if view.warnings:
        out.append(_warnings(view.warnings))
    return out


def _compare_page(store: RunStore, a: str | None, b: str | None) -> Any:
    dcc, html = _html()
    ids = store.run_ids()
    body: Any
    if a and b:
        try:
            ia = get_compare_info(store.analysis(a), store.analysis(b))
        except RunNotFound as exc:
            body = _not_found(f"No run named {exc.run_id!r} in the runs directory.")
        else:
            body = _compare_body(ia)
    else:
        body = html.P("Pick two runs.")
    return html.Div([
        html.H2("Compare two runs"),
        html.Div(className="controls", children=[
            dcc.Dropdown(id="cmp-a", options=ids, value=a if a in ids else None, placeholder="run A",
                         style={"width": "420px"}),
            dcc.Dropdown(id="cmp-b", options=ids, value=b if b in ids else None, placeholder="run B",
                         style={"width": "420px"}),
        ]),
        html.Div(body, id="compare-body"),
    ])


def _compare_body(info: Any) -> Any:
    dcc, html = _html()
    from ..reports import fmt_bytes

    def fmt(unit: str, v: float | None) -> str:
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "–"
        return {"s": fmt_s, "bytes": fmt_bytes}.get(unit, lambda x: f"{x:,.1f} {unit}".strip())(v)

    rows = [html.Tr([html.Td(r["metric"]), html.Td(fmt(r["unit"], r["a"])), html.Td(fmt(r["unit"], r["b"])),
                     html.Td("" if r["delta_pct"] is None else f"{r['delta_pct']:+.1f} %")]) for r in info.rows]
    rows.append(html.Tr([html.Td("bottlenecks"), html.Td(", ".join(info.bottlenecks[0]) or "none"),
                         html.Td(", ".join(info.bottlenecks[1]) or "none"), html.Td("")]))
    return html.Div([
        html.Table(className="compare-table", id="compare-table", children=[
            html.Thead(html.Tr([html.Th(""), html.Th(info.names[0]), html.Th(info.names[1]), html.Th("B vs A")])),
            html.Tbody(rows)]),
        dcc.Graph(id="compare-breakdown", figure=plot_compare_breakdown(info), config={"displaylogo": False}),
    ])


def _digest(sig: tuple) -> str:
    return hashlib.sha1(repr(sig).encode()).hexdigest()

