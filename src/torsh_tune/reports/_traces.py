"""Render a deep-trace analysis (`analysis.traces.TraceAnalysis`) as JSON and Markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["trace_report_dict", "render_trace_markdown", "write_trace_reports"]

TRACE_REPORT_SCHEMA_VERSION = 1
_TABLES = ("breakdown", "overlap", "stragglers", "top_kernels", "steps")


def trace_report_dict(analysis: Any) -> dict[str, Any]:
    """Plain-JSON document of a TraceAnalysis: summary plus its per-rank tables."""
    doc: dict[str, Any] = {
        "schema_version": TRACE_REPORT_SCHEMA_VERSION,
        "path": str(analysis.path),
        "summary": analysis.summary,
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


def render_trace_markdown(analysis: Any) -> str:
    doc = trace_report_dict(analysis)
    s = doc["summary"]
    lines = [f"# Trace analysis: {doc['path']}", ""]
    lines += [f"backend **{s.get('backend')}**, device **{s.get('device')}**, ranks {s.get('ranks')}", ""]
    lines += ["## Temporal breakdown (% of the profiled span)", ""]
    lines += _table(doc["breakdown"], ["rank", "idle_pct", "compute_pct", "non_compute_pct"])
    lines += ["## Communication and overlap", ""]
    lines += _table(doc["overlap"], ["rank", "comm_s", "exposed_comm_s", "overlap_pct", "exposed_comm_pct"])
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


def write_trace_reports(analysis: Any, out_dir: Path) -> dict[str, Path]:
    """Write analysis.json and analysis.md into `out_dir` (created; must not exist yet)."""
    out_dir.mkdir(parents=True)
    paths = {"json": out_dir / "analysis.json", "md": out_dir / "analysis.md"}
    paths["json"].write_text(json.dumps(trace_report_dict(analysis), indent=1, default=str))
    paths["md"].write_text(render_trace_markdown(analysis))
    return paths
