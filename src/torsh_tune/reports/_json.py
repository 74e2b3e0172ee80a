"""report.json: the ReportInfo as one strict JSON document."""

from __future__ import annotations

import os
from pathlib import Path

from ..rundir import write_text_atomic as _write_atomic
from ._info import ReportInfo

__all__ = ["read_json", "write_json"]


def write_json(info: ReportInfo, path: str | os.PathLike[str]) -> Path:
    """Write `info` as JSON to `path` (atomically: readers never see half a file).

    Example:
        >>> write_json(info, "run/report/report.json")  # doctest: +SKIP
    """
    return _write_atomic(Path(path), info.to_json())


def read_json(path: str | os.PathLike[str]) -> ReportInfo:
    """Read a report.json written by `write_json` back into a ReportInfo."""
    return ReportInfo.from_json(Path(path).read_text())

