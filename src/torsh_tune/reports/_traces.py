"""Render a deep-trace analysis (`analysis.traces.TraceAnalysis`) as JSON, Markdown and HTML.

The HTML file is self-contained (plotly.js inline, no network) and shows the per-rank
timeline of a typical step (`figures`).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["render_trace_html", "render_trace_markdown", "trace_report_dict", "write_trace_reports"]

# 2: idle_causes table and idle_*_pct / peer_wait_s in the summary.
# 3: bottlenecks and recommendations (`trace_findings`), as in report.json.
# 4: idle_streams table (HTA's per-CUDA-stream idle breakdown, `idle_by_stream`).
TRACE_REPORT_SCHEMA_VERSION = 4
_TABLES = ("breakdown", "overlap", "idle_causes", "idle_streams", "stragglers", "top_kernels", "steps")
_WINDOW_NOTE = ("Shares are % of the profiled window (whole ProfilerSteps), averaged over ranks; "
                "idle findings use the exposed-communication thresholds.")
_IDLE_COLUMNS = ["rank", "idle_s", "sync_pct", "comm_wait_pct", "host_wait_pct", "other_pct", "peer_wait_s"]


def trace_report_dict(analysis: Any) -> dict[str, Any]:
    """Plain-JSON document of a TraceAnalysis: summary, findings and its per-rank tables."""
    doc: dict[str, Any] = {
        "schema_version": TRACE_REPORT_SCHEMA_VERSION,
        "path": str(analysis.path),
        "summary": analysis.summary,
        "bottlenecks": [asdict(b) for b in analysis.bottlenecks],
        "recommendations": [asdict(r) for r in analysis.recommendations],
    }
    for name in _TABLES:
        frame = getattr(analysis, name)
        doc[name] = json.loads(frame.to_json(orient="records"))
    return doc


def _table(rows: list[dict[str, Any]], columns: list[str]) -> list[str]:
    if not rows:
        return ["(none)", ""]
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for c in columns:
            v = row.get(c)
            cells.append(f"{v:.3f}" if isinstance(v, float) else ("" if v is None else str(v)))
        out.append("| " + " | ".join(cells) + " |")
    return out + [""]


def _findings(doc: dict[str, Any]) -> SimpleNamespace:
    # The run report's sections read these three fields; without a median step they print
    # gains as percentages only (of the profiled window here, whole steps).
    return SimpleNamespace(bottlenecks=doc["bottlenecks"], recommendations=doc["recommendations"], summary={})


def render_trace_markdown(analysis: Any) -> str:
    from ._markdown import _bottlenecks, _recommendations

    doc = trace_report_dict(analysis)
    s = doc["summary"]
    lines = [f"# Trace analysis: {doc['path']}", ""]
    lines += [f"backend **{s.get('backend')}**, device **{s.get('device')}**, ranks {s.get('ranks')}", ""]
    lines += [_WINDOW_NOTE, ""]
    lines += _bottlenecks(_findings(doc)) + _recommendations(_findings(doc))
    lines += ["## Temporal breakdown (% of the profiled span)", ""]
    lines += _table(doc["breakdown"], ["rank", "idle_pct", "compute_pct", "non_compute_pct"])
    lines += ["## Communication and overlap", ""]
    lines += _table(doc["overlap"], ["rank", "comm_s", "exposed_comm_s", "overlap_pct", "exposed_comm_pct"])
    lines += ["## Idle-time causes (% of each rank's idle time)", ""]
    lines += _table(doc["idle_causes"], _IDLE_COLUMNS)
    lines += ["sync: host blocked on the device; comm_wait: waiting on a collective; host_wait: the "
              "host issued the next work late; other: issued in time, started late. peer_wait_s: "
              "collective time spent waiting for late peers (busy, not idle).", ""]
    if doc["idle_streams"]:
        lines += ["## Idle per CUDA stream (HTA's definition, % of the stream's idle time)", ""]
        lines += _table(doc["idle_streams"], ["rank", "stream", "idle_s", "host_wait_pct", "kernel_wait_pct",
                                              "other_pct"])
    lines += ["## Stragglers (arrival at collectives)", ""]
    lines += _table(doc["stragglers"], [c for c in (doc["stragglers"][0] if doc["stragglers"] else {})])
    lines += ["## Headline", ""]
    for key in ("num_collectives", "mean_wait_s", "mean_transfer_s", "median_busbw_gbps", "straggler_rank",
                "what_if_step_s", "what_if_if_slowest_rank_at_median_s", "what_if_if_comm_fully_overlapped_s"):
        if s.get(key) is not None:
            lines.append(f"- `{key}`: {s[key]:.6g}" if isinstance(s[key], float) else f"- `{key}`: {s[key]}")
    for w in s.get("warnings") or []:
        lines.append(f"- warning: {w}")
    return "\n".join(lines) + "\n"


def render_trace_html(analysis: Any, *, max_segments: int = 1500) -> str:
    """One self-contained HTML page: headline, tables and the per-rank step timeline."""
    from ._html import _CSS, _bottlenecks, _e, _recommendations
    from .figures import get_trace_timeline_info, plot_trace_timeline

    doc = trace_report_dict(analysis)
    s = doc["summary"]

    def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
        if not rows:
            return "<p class=muted>(none)</p>"
        head = "".join(f"<th>{_e(c)}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(f"<td class=num>{v:.4g}</td>" if isinstance(v := r.get(c), float) else f"<td>{_e(v)}</td>"
                             for c in columns) + "</tr>" for r in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    if analysis.timelines:
        info = get_trace_timeline_info(analysis, max_segments=max_segments)
        fig = plot_trace_timeline(info).to_html(full_html=False, include_plotlyjs=True, div_id="fig-trace-timeline",
                                                config={"displaylogo": False, "responsive": True})
        figure = f'<div class="fig" id="figure-trace-timeline">{fig}</div>'
    else:
        figure = "<p class=muted>No timeline: the traces hold no events.</p>"
    parts = [
        "<!DOCTYPE html><html><head><meta charset=utf-8>",
        f"<title>Trace analysis: {_e(doc['path'])}</title><style>{_CSS}</style></head><body><main>",
        f"<h1>Trace analysis</h1><p class=muted>{_e(doc['path'])}: backend {_e(s.get('backend'))}, "
        f"device {_e(s.get('device'))}, ranks {_e(s.get('ranks'))}</p>",
        f"<p class=muted>{_e(_WINDOW_NOTE)}</p>",
        *_bottlenecks(_findings(doc)), *_recommendations(_findings(doc)),
        "<h2>Timeline of a typical step</h2>", figure,
        "<h2>Temporal breakdown (% of the profiled span)</h2>",
        table(doc["breakdown"], ["rank", "idle_pct", "compute_pct", "non_compute_pct"]),
        "<h2>Communication and overlap</h2>",
        table(doc["overlap"], ["rank", "comm_s", "exposed_comm_s", "overlap_pct", "exposed_comm_pct"]),
        "<h2>Idle-time causes (% of each rank's idle time)</h2>", table(doc["idle_causes"], _IDLE_COLUMNS),
        "<h2>Stragglers</h2>", table(doc["stragglers"], list(doc["stragglers"][0]) if doc["stragglers"] else []),
        "<h2>Top kernels</h2>", table(doc["top_kernels"], ["rank", "name", "kind", "count", "total_s", "share_pct"]),
    ]
    parts += [f"<p class=muted>warning: {_e(w)}</p>" for w in s.get("warnings") or []]
    parts.append("</main></body></html>")
    return "\n".join(parts)


def write_trace_reports(analysis: Any, out_dir: Path) -> dict[str, Path]:
    """Write analysis.json, analysis.md and analysis.html into `out_dir` (created; must not exist yet)."""
    out_dir.mkdir(parents=True)
    paths = {"json": out_dir / "analysis.json", "md": out_dir / "analysis.md", "html": out_dir / "analysis.html"}
    paths["json"].write_text(json.dumps(trace_report_dict(analysis), indent=1, default=str))
    paths["md"].write_text(render_trace_markdown(analysis))
    paths["html"].write_text(render_trace_html(analysis), encoding="utf-8")
    return paths
