"""Reports: one `ReportInfo` per run, drawn as JSON, Markdown and a terminal summary.

Data and drawing are apart (as in optuna's visualisation): `build_report_info` collects
what a report shows from a `RunAnalysis` into plain JSON-ready data; the writers only
format it. No torch here; plotly only inside the figure-drawing functions of `figures`
(loaded when an HTML report or a dashboard draws), never at import.

Example:
    >>> from rich.console import Console  # doctest: +SKIP
    >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
    >>> analysis = analyze_run("torsh-runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> paths = write_reports(analysis, analysis.run_dir)  # doctest: +SKIP
    >>> render_summary(build_report_info(analysis), Console(), report_paths=paths)  # doctest: +SKIP
"""

from . import compare, figures
from ._format import fmt_bytes, fmt_pct, fmt_s, fmt_value, gain_text
from ._info import REPORT_SCHEMA_VERSION, ReportInfo, build_report_info
from ._html import render_html, write_html
from ._json import read_json, write_json
from ._markdown import render_markdown, write_markdown
from ._patch import patch_to_dotted, patch_to_toml
from ._schema import REPORT_SCHEMA_PATH, report_schema, report_schema_errors, validate_report
from ._tables import TABLE_FORMATS, TABLE_KINDS, write_tables
from ._terminal import SEVERITY_STYLES, render_summary
from ._write import REPORT_FORMATS, write_reports
from .compare import Comparison, compare_runs, compare_to_dict, regressed, render_compare_markdown, run_compare

__all__ = [
    "REPORT_FORMATS",
    "REPORT_SCHEMA_PATH",
    "REPORT_SCHEMA_VERSION",
    "SEVERITY_STYLES",
    "TABLE_FORMATS",
    "TABLE_KINDS",
    "Comparison",
    "ReportInfo",
    "build_report_info",
    "compare",
    "compare_runs",
    "compare_to_dict",
    "figures",
    "fmt_bytes",
    "fmt_pct",
    "fmt_s",
    "fmt_value",
    "gain_text",
    "patch_to_dotted",
    "patch_to_toml",
    "read_json",
    "regressed",
    "render_compare_markdown",
    "render_html",
    "render_markdown",
    "render_summary",
    "report_schema",
    "report_schema_errors",
    "run_compare",
    "validate_report",
    "write_html",
    "write_json",
    "write_markdown",
    "write_reports",
    "write_tables",
]
