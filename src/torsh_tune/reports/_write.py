"""`write_reports`: every report file of a run, in its run directory; `write_tuning_reports`: a study's."""

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
from ._tuning import TuningInfo

__all__ = ["REPORT_FORMATS", "TUNING_REPORT_FORMATS", "write_reports", "write_tuning_reports"]

#: Formats `write_reports` knows: json, md, html (report.*) and csv, parquet (steps.*, comm.*).
REPORT_FORMATS = ("json", "md", "html", "csv", "parquet")
#: Formats `write_tuning_reports` knows: STUDY/report.json, report.md, report.html.
TUNING_REPORT_FORMATS = ("json", "md", "html")


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


def write_tuning_reports(
    info: TuningInfo,
    out_dir: str | os.PathLike[str],
    *,
    formats: Sequence[str] = TUNING_REPORT_FORMATS,
) -> dict[str, Path]:
    """Write a study's report files, `report.json`, `report.md` and `report.html`, into `out_dir`.

    Args:
        info: The study's TuningInfo (`get_tuning_info`).
        out_dir: Where to write them (the study directory for the main job; created if missing).
        formats: Any of TUNING_REPORT_FORMATS; all three by default.

    Returns:
        "json", "md", "html" -> the paths written.

    Raises:
        ConfigError: an unknown format.

    Example:
        >>> paths = write_tuning_reports(get_tuning_info(study), study)  # doctest: +SKIP
        >>> paths["html"].name  # doctest: +SKIP
        'report.html'
    """
    for f in formats:
        if f not in TUNING_REPORT_FORMATS:
            raise invalid("study report format", f"one of {', '.join(TUNING_REPORT_FORMATS)}", f)
    out = Path(out_dir)
    paths: dict[str, Path] = {}
    if "json" in formats:
        from ._json import _write_atomic

        paths["json"] = _write_atomic(out / "report.json", info.to_json())
    if "md" in formats:
        from ._tuning_markdown import write_tuning_markdown

        paths["md"] = write_tuning_markdown(info, out / "report.md")
    if "html" in formats:
        from ._tuning_html import write_tuning_html

        paths["html"] = write_tuning_html(info, out / "report.html")
    return paths
