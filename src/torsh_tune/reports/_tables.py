"""CSV and Parquet exports of a run's records (steps, comm), for pandas, spreadsheets, BI tools."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..analysis import RunFrames, load_run
from ..errors import invalid

__all__ = ["TABLE_FORMATS", "TABLE_KINDS", "write_tables"]

#: Formats `write_tables` writes.
TABLE_FORMATS = ("csv", "parquet")
#: Record kinds exported by default (the trials table joins these once the autotuner lands).
TABLE_KINDS = ("steps", "comm")


def write_tables(
    run_dir: str | os.PathLike[str] | RunFrames,
    out_dir: str | os.PathLike[str],
    formats: Sequence[str] = TABLE_FORMATS,
    *,
    kinds: Sequence[str] = TABLE_KINDS,
) -> dict[str, Path]:
    """Write `<kind>.<format>` files (e.g. steps.csv, comm.parquet) of every rank's records.

    Columns are `records.columns_of(kind)` (snake_case, units in names), one row per
    record, all ranks in one table sorted by rank and step; files are written to a
    temporary name and renamed.

    Args:
        run_dir: the run directory, or its RunFrames already loaded.
        out_dir: where to write (created if missing).
        formats: any of TABLE_FORMATS.
        kinds: record kinds: steps, comm, system.

    Returns:
        "<kind>.<format>" -> path written.

    Raises:
        ConfigError: an unknown format or kind.

    Example:
        >>> write_tables("torsh-runs/my-run", "out", ("csv",))  # doctest: +SKIP
        {'steps.csv': PosixPath('out/steps.csv'), 'comm.csv': PosixPath('out/comm.csv')}
    """
    for f in formats:
        if f not in TABLE_FORMATS:
            raise invalid("table format", f"one of {', '.join(TABLE_FORMATS)}", f)
    for k in kinds:
        if k not in ("steps", "comm", "system"):
            raise invalid("table kind", "one of steps, comm, system", k)
    frames = run_dir if isinstance(run_dir, RunFrames) else load_run(run_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for kind in kinds:
        df = frames.frame(kind)
        for fmt in formats:
            target = out / f"{kind}.{fmt}"
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            if fmt == "csv":
                df.to_csv(tmp, index=False)
            else:
                pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp)
            os.replace(tmp, target)
            written[f"{kind}.{fmt}"] = target
    return written
