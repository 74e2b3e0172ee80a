"""`write_reports`: every report file of a run, in its run directory."""

from __future__ import annotations

import os
from pathlib import Path

from ..analysis import RunAnalysis
from ..rundir import RunDir
from ._info import ReportInfo, build_report_info
from ._json import write_json
from ._markdown import write_markdown

__all__ = ["write_reports"]


def write_reports(
    analysis: RunAnalysis, run_dir: str | os.PathLike[str], *, info: ReportInfo | None = None
) -> dict[str, Path]:
    """Write report/report.json and report/report.md into `run_dir`.

    Args:
        analysis: the analysed run.
        run_dir: the run directory (its `report/` folder is created if missing).
        info: a ReportInfo already built from `analysis` (built here otherwise).

    Returns:
        Format name ("json", "md") -> path written.

    Example:
        >>> paths = write_reports(analyze_run(run), run)  # doctest: +SKIP
        >>> str(paths["md"].relative_to(run))  # doctest: +SKIP
        'report/report.md'
    """
    info = info or build_report_info(analysis)
    report = RunDir(run_dir).report
    return {
        "json": write_json(info, report / "report.json"),
        "md": write_markdown(info, report / "report.md"),
    }
