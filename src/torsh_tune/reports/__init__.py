"""Reports: one `ReportInfo` per run and one `TuningInfo` per study, drawn as JSON, Markdown and HTML.

Data and drawing are apart (as in optuna's visualisation): `build_report_info` collects
what a report shows from a `RunAnalysis` into plain JSON-ready data; the writers only
format it. `get_tuning_info(study_dir)` does the same for an autotuner study directory
(`write_tuning_reports`: STUDY/report.json, report.md, report.html). No torch here; plotly
only inside the figure-drawing functions of `figures` (loaded when an HTML report or a
dashboard draws), optuna only inside `get_tuning_info` when it reads a running study's
storage, never at import.

Example:
    >>> from rich.console import Console  # doctest: +SKIP
    >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
    >>> analysis = analyze_run("torsh-runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> paths = write_reports(analysis, analysis.run_dir)  # doctest: +SKIP
    >>> render_summary(build_report_info(analysis), Console(), report_paths=paths)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

# Attributes load their module on first use (PEP 562), as in `analysis`: the CLI's progress line
# (`_terminal`) must not pay for pandas, plotly and the HTML writers before a run is launched.
_LAZY = {
    "compare": None,  # submodules
    "figures": None,
    "fmt_bytes": "._format",
    "fmt_loss_deviation": "._format",
    "fmt_pct": "._format",
    "fmt_s": "._format",
    "fmt_samples_s": "._format",
    "fmt_value": "._format",
    "gain_text": "._format",
    "migration_cell": "._format",
    "ALERT_COLUMNS": "._info",
    "REPORT_SCHEMA_VERSION": "._info",
    "ReportInfo": "._info",
    "alert_cells": "._info",
    "build_report_info": "._info",
    "render_html": "._html",
    "write_html": "._html",
    "read_json": "._json",
    "write_json": "._json",
    "render_markdown": "._markdown",
    "write_markdown": "._markdown",
    "patch_to_dotted": "._patch",
    "patch_to_toml": "._patch",
    "REPORT_SCHEMA_PATH": "._schema",
    "report_schema": "._schema",
    "report_schema_errors": "._schema",
    "validate_report": "._schema",
    "TABLE_FORMATS": "._tables",
    "TABLE_KINDS": "._tables",
    "write_tables": "._tables",
    "SEVERITY_STYLES": "._terminal",
    "render_summary": "._terminal",
    "IMPORTANCE_METHOD": "._tuning",
    "TUNING_SCHEMA_VERSION": "._tuning",
    "TuningInfo": "._tuning",
    "get_tuning_info": "._tuning",
    "render_tuning_html": "._tuning_html",
    "write_tuning_html": "._tuning_html",
    "render_tuning_markdown": "._tuning_markdown",
    "write_tuning_markdown": "._tuning_markdown",
    "REPORT_FORMATS": "._write",
    "TUNING_REPORT_FORMATS": "._write",
    "write_reports": "._write",
    "write_tuning_reports": "._write",
    "Comparison": ".compare",
    "compare_runs": ".compare",
    "compare_to_dict": ".compare",
    "regressed": ".compare",
    "render_compare_markdown": ".compare",
    "run_compare": ".compare",
}


__all__ = [
    "ALERT_COLUMNS",
    "IMPORTANCE_METHOD",
    "REPORT_FORMATS",
    "REPORT_SCHEMA_PATH",
    "REPORT_SCHEMA_VERSION",
    "SEVERITY_STYLES",
    "TABLE_FORMATS",
    "TABLE_KINDS",
    "TUNING_REPORT_FORMATS",
    "TUNING_SCHEMA_VERSION",
    "Comparison",
    "ReportInfo",
    "TuningInfo",
    "alert_cells",
    "build_report_info",
    "compare",
    "compare_runs",
    "compare_to_dict",
    "figures",
    "fmt_bytes",
    "fmt_loss_deviation",
    "fmt_pct",
    "fmt_s",
    "fmt_samples_s",
    "fmt_value",
    "gain_text",
    "get_tuning_info",
    "migration_cell",
    "patch_to_dotted",
    "patch_to_toml",
    "read_json",
    "regressed",
    "render_compare_markdown",
    "render_html",
    "render_markdown",
    "render_summary",
    "render_tuning_html",
    "render_tuning_markdown",
    "report_schema",
    "report_schema_errors",
    "run_compare",
    "validate_report",
    "write_html",
    "write_json",
    "write_markdown",
    "write_reports",
    "write_tables",
    "write_tuning_html",
    "write_tuning_markdown",
    "write_tuning_reports",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = _LAZY[name]
    value = importlib.import_module(f".{name}" if module is None else module, __name__)
    if module is not None:
        value = getattr(value, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
