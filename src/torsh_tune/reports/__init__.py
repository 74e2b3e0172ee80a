"""Reports: one `ReportInfo` per run, drawn as JSON, Markdown and a terminal summary.

Data and drawing are apart (as in optuna's visualisation): `build_report_info` collects
what a report shows from a `RunAnalysis` into plain JSON-ready data; the writers only
format it. No torch and no plotly here.

Example:
    >>> from rich.console import Console  # doctest: +SKIP
    >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
    >>> analysis = analyze_run("torsh-runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> paths = write_reports(analysis, analysis.run_dir)  # doctest: +SKIP
    >>> render_summary(build_report_info(analysis), Console(), report_paths=paths)  # doctest: +SKIP
"""

from ._format import fmt_bytes, fmt_pct, fmt_s, fmt_value, gain_text
from ._info import REPORT_SCHEMA_VERSION, ReportInfo, build_report_info
from ._json import read_json, write_json
from ._markdown import render_markdown, write_markdown
from ._patch import patch_to_dotted, patch_to_toml
from ._terminal import SEVERITY_STYLES, render_summary
from ._write import write_reports

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "SEVERITY_STYLES",
    "ReportInfo",
    "build_report_info",
    "fmt_bytes",
    "fmt_pct",
    "fmt_s",
    "fmt_value",
    "gain_text",
    "patch_to_dotted",
    "patch_to_toml",
    "read_json",
    "render_markdown",
    "render_summary",
    "write_json",
    "write_markdown",
    "write_reports",
]
