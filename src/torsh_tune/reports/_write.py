"""`write_reports`: every report file of a run, in its run directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from ..analysis import RunAnalysis, RunFrames, load_run
from ..errors import invalid
from ..rundir import RunDir
from ._info import ReportInfo, build_report_info
from ._json import write_json
from ._markdown import write_markdown

__all__ = ["REPORT_FORMATS", "write_reports"]

#: Formats `write_reports` knows: json, md, html (report.*) and csv, parquet (steps.*, comm.*).
REPORT_FORMATS = ("json", "md", "html", "csv", "parquet")


def write_reports(
    analysis: RunAnalysis,
    run_dir: str | os.PathLike[str],
    *,
    info: ReportInfo | None = None,
    formats: Sequence[str] = ("json", "md"),
    frames: RunFrames | None = None,
    out_dir: str | os.PathLike[str] | None = None,
) -> dict[str, Path]:
    """Write the report files of a run into its `report/` folder (or `out_dir`).

    Args:
        analysis: the analysed run.
        run_dir: the run directory (its `report/` folder is created if missing).
        info: a ReportInfo already built from `analysis` (built here otherwise).
        formats: any of REPORT_FORMATS; json and md by default.
        frames: the run's records, for html figures and csv/parquet tables (loaded from
            `run_dir` when needed and not given).
        out_dir: write here instead of `run_dir/report`.

    Returns:
        "json", "md", "html" -> report.<ext>; "<kind>.csv", "<kind>.parquet" -> the tables.

    Raises:
        ConfigError: an unknown format.

    Example:
        >>> paths = write_reports(analyze_run(run), run)  # doctest: +SKIP
        >>> str(paths["md"].relative_to(run))  # doctest: +SKIP
        'report/report.md'
    """
    for f in formats:
        if f not in REPORT_FORMATS:
            raise invalid("report format", f"one of {', '.join(REPORT_FORMATS)}", f)
    info = info or build_report_info(analysis)
    report = Path(out_dir) if out_dir is not None else RunDir(run_dir).report
    paths: dict[str, Path] = {}
    if "json" in formats:
        paths["json"] = write_json(info, report / "report.json")
    if "md" in formats:
        paths["md"] = write_markdown(info, report / "report.md")
    needs_frames = any(f in formats for f in ("html", "csv", "parquet"))
    if needs_frames and frames is None:
        frames = load_run(run_dir)
    if "html" in formats:
        from ._html import write_html

        paths["html"] = write_html(info, frames, report / "report.html")
    tables = [f for f in ("csv", "parquet") if f in formats]
    if tables:
        from ._tables import write_tables

        assert frames is not None
        paths.update(write_tables(frames, report, tables))
    return paths
