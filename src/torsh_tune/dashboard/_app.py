"""The Dash app: runs list, live run overview, bottleneck cards, compare view.

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
from ..reports import build_report_info, fmt_s, fmt_value, gain_text, patch_to_toml
from ..reports.figures import FIGURE_TITLES
from ._security import RunNotFound, check_token, install_guard
from ._store import RunRow, RunStore, status_class
from ._views import Kpis, get_compare_info, overview_info, plot_compare_breakdown

__all__ = ["PAGE_PATHS", "create_app"]

#: The app's page paths; group "run" is a run id (validated before anything is read).
PAGE_PATHS = (
    re.compile(r"/"),
    re.compile(r"/compare"),
    re.compile(r"/runs/(?P<run>[^/]+)"),
    re.compile(r"/runs/(?P<run>[^/]+)/bottlenecks"),
)
_SORT_KEYS = {
    "started": "started",
    "run": "run",
    "status": "status",
    "script": "script",
    "world size": "world",
    "strategy": "strategy",
    "median step": "median",
    "top bottleneck": "bottleneck",
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
"""


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
        m = PAGE_PATHS[2].fullmatch(path) or PAGE_PATHS[3].fullmatch(path)
        if m is None:
            return _not_found(f"No page at {path!r}.")
        run_id = m.group("run")
        try:
            status = status_class(store.info(run_id))
        except RunNotFound:
            return _not_found(f"No run named {run_id!r} in the runs directory.")
        if path.endswith("/bottlenecks"):
            return _bottlenecks_page(run_id, status, refresh_ms)
        return _overview_page(run_id, status, refresh_ms)

    # -- runs list ----------------------------------------------------------------------

    @app.callback(
        Output("runs-table", "children"),
        Input("runs-filter", "value"), Input("runs-sort", "value"), Input("runs-order", "value"),
        Input("runs-tick", "n_intervals"),
    )
    def runs_table(text: str | None, sort: str | None, order: str | None, _n: int | None) -> Any:
        rows = _filter_rows(store.list_runs(), text or "")
        rows = _sort_rows(rows, sort or "started", descending=(order != "asc"))
        return _runs_table(rows)

    # -- overview -----------------------------------------------------------------------

    fig_ids = [f"fig-{k}" for k in FIGURE_TITLES]

    @app.callback(
        [Output("overview-kpis", "children"), Output("overview-warnings", "children")]
        + [Output(i, "figure") for i in fig_ids]
        + [Output("overview-sig", "data"), Output("overview-tick", "disabled")],
        Input("overview-tick", "n_intervals"),
        State("overview-run", "data"), State("overview-sig", "data"),
    )
    def overview(_n: int | None, run_id: str, last_sig: str | None) -> Any:
        try:
            sig = _digest(store.signature(run_id))
            if sig == last_sig:
                raise PreventUpdate  # nothing was written since the last tick
            view = overview_info(store, run_id)
        except RunNotFound:
            return [_not_found(f"No run named {run_id!r}."), None] + [no_update] * len(fig_ids) + [None, True]
        figs = [view.figures[k] for k in FIGURE_TITLES]
        return [_kpi_row(view.kpis), _warnings(view.warnings), *figs, sig, view.kpis.status != "running"]

    # -- bottlenecks --------------------------------------------------------------------

    @app.callback(
        Output("bn-content", "children"), Output("bn-sig", "data"), Output("bn-tick", "disabled"),
        Input("bn-tick", "n_intervals"), State("bn-run", "data"), State("bn-sig", "data"),
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

    # -- compare ------------------------------------------------------------------------

    @app.callback(Output("url", "search"), Input("cmp-a", "value"), Input("cmp-b", "value"),
                  prevent_initial_call=True)
    def compare_select(a: str | None, b: str | None) -> Any:
        parts = [f"{k}={quote(v)}" for k, v in (("a", a), ("b", b)) if v]
        return "?" + "&".join(parts) if parts else ""

    return app


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
        return " ".join([r.run_id, r.status, r.raw_status, r.script, r.strategy, r.top_bottleneck,
                         str(r.world_size or "")]).lower()

    return [r for r in rows if all(w in hay(r) for w in words)]


def _sort_rows(rows: list[RunRow], sort: str, *, descending: bool) -> list[RunRow]:
    key = _SORT_KEYS.get(sort, "started")

    def value(r: RunRow) -> tuple:
        v: Any = {
            "started": r.started_at_unix, "run": r.run_id, "status": r.status, "script": r.script,
            "world": r.world_size, "strategy": r.strategy, "median": r.median_step_s,
            "bottleneck": (_SEVERITY_ORDER.get(r.top_bottleneck.split(" ")[0], 9) if r.top_bottleneck else None),
        }[key]
        return (v is None, v if v is not None else 0, r.run_id)

    present = sorted((r for r in rows if value(r)[0] is False), key=value, reverse=descending)
    return present + [r for r in rows if value(r)[0] is True]  # unknown values last either way


def _runs_table(rows: list[RunRow]) -> Any:
    dcc, html = _html()
    if not rows:
        return html.P("No runs match.", id="runs-empty")
    head = html.Tr([html.Th(h) for h in ("run", "status", "script", "world size", "strategy", "median step",
                                         "top bottleneck", "started")])
    body = []
    for r in rows:
        body.append(html.Tr(className=f"run-row row-{r.status}", **{"data-run": r.run_id, "data-status": r.status},
                            children=[
            html.Td(dcc.Link(r.run_id, href=f"/runs/{r.run_id}")),
            html.Td(html.Span(r.status, title=r.raw_status, className=f"badge status-{r.status}")),
            html.Td(r.script),
            html.Td("" if r.world_size is None else str(r.world_size)),
            html.Td(r.strategy),
            html.Td(fmt_s(r.median_step_s) if r.median_step_s is not None else ""),
            html.Td(r.top_bottleneck),
            html.Td(r.started_at[:19].replace("T", " ")),
        ]))
    return html.Table(className="runs", id="runs", children=[html.Thead(head), html.Tbody(body)])


def _tabs(run_id: str, active: str) -> Any:
    dcc, html = _html()
    links = [("overview", "Overview", f"/runs/{run_id}"),
             ("bottlenecks", "Bottlenecks & recommendations", f"/runs/{run_id}/bottlenecks"),
             ("compare", "Compare with…", f"/compare?a={quote(run_id)}")]
    return html.Div(className="tabs", children=[
        dcc.Link(label, href=href, className="active" if key == active else "", id=f"tab-{key}")
        for key, label, href in links])


def _title(run_id: str, status: str) -> Any:
    _, html = _html()
    return html.H2([run_id, " ", html.Span(status, id="run-status", className=f"badge status-{status}")])


def _overview_page(run_id: str, status: str, refresh_ms: int) -> Any:
    dcc, html = _html()
    graphs = [dcc.Graph(id=f"fig-{k}", config={"displaylogo": False}) for k in FIGURE_TITLES]
    return html.Div([
        _title(run_id, status),
        _tabs(run_id, "overview"),
        html.Div(id="overview-kpis", className="kpis"),
        html.Div(id="overview-warnings", className="warnings"),
        html.Div(graphs, className="figs"),
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


def _bottlenecks_page(run_id: str, status: str, refresh_ms: int) -> Any:
    dcc, html = _html()
    return html.Div([
        _title(run_id, status),
        _tabs(run_id, "bottlenecks"),
        html.Div(id="bn-content", children=html.P("analysing…")),
        dcc.Store(id="bn-run", data=run_id),
        dcc.Store(id="bn-sig"),
        dcc.Interval(id="bn-tick", interval=max(refresh_ms, 5000), disabled=False),
    ])


def _cards(analysis: RunAnalysis) -> Any:
    _, html = _html()
    info = build_report_info(analysis)
    median = (info.summary or {}).get("median_step_s")
    bns = sorted(info.bottlenecks, key=lambda b: _SEVERITY_ORDER.get(b.get("severity"), 9))
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
    recs = sorted(info.recommendations, key=lambda r: r.get("priority") or 99)
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
    if info.warnings:
        out.append(_warnings(info.warnings))
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

