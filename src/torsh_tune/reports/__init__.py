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

from . import compare, figures
from ._format import (fmt_bytes, fmt_loss_deviation, fmt_pct, fmt_s, fmt_samples_s, fmt_value, gain_text,
                      migration_cell)
from ._info import ALERT_COLUMNS, REPORT_SCHEMA_VERSION, ReportInfo, alert_cells, build_report_info
from ._html import render_html, write_html
from ._json import read_json, write_json
from ._markdown import render_markdown, write_markdown
from ._patch import patch_to_dotted, patch_to_toml
from ._schema import REPORT_SCHEMA_PATH, report_schema, report_schema_errors, validate_report
from ._tables import TABLE_FORMATS, TABLE_KINDS, write_tables
from ._terminal import SEVERITY_STYLES, render_summary
from ._tuning import IMPORTANCE_METHOD, TUNING_SCHEMA_VERSION, TuningInfo, get_tuning_info
from ._tuning_html import render_tuning_html, write_tuning_html
from ._tuning_markdown import render_tuning_markdown, write_tuning_markdown
from ._write import REPORT_FORMATS, TUNING_REPORT_FORMATS, write_reports, write_tuning_reports
from .compare import Comparison, compare_runs, compare_to_dict, regressed, render_compare_markdown, run_compare

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
