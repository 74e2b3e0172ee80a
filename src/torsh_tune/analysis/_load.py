"""Load a run directory into DataFrames, and compact its JSONL records to Parquet.

Readers never fail on what a crashed or killed run leaves behind: a torn last line, a
missing rank file or an unreadable JSON document becomes a warning in `RunFrames`.
"""

from __future__ import annotations

import functools
import json
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..records import RECORD_KINDS, columns_of
from ..rundir import RunDir, world_size_of
from ._clocks import on_one_clock

__all__ = ["RunFrames", "compact_run", "load_run"]

_RECORD_KINDS = tuple(RECORD_KINDS)  # steps, comm, system
_PARQUET_META_KEY = b"torsh_tune.source"


@dataclass(frozen=True, kw_only=True)
class RunFrames:
    """Everything a run directory holds, as DataFrames and dicts.

    `steps`, `comm` and `system` have the columns `records.columns_of(kind)` (and are empty,
    with those columns, when nothing was recorded). `meta` and `exits` map rank -> the
    rank's meta.json / exit.json document.
    """

    run_dir: str
    steps: pd.DataFrame
    comm: pd.DataFrame
    system: pd.DataFrame
    meta: dict[int, dict[str, Any]]
    exits: dict[int, dict[str, Any]]
    info: dict[str, Any]  # run.json, {} if absent
    config: dict[str, Any]  # config.json (RunConfig as a dict), {} if absent
    ranks: tuple[int, ...]  # ranks that wrote any file
    world_size: int
    warnings: tuple[str, ...] = field(default=())
    # Ranks on several hosts: each other host's clock against rank 0's host's, from the completions of the
    # collectives both hosts' ranks took part in (`_clocks.host_clock_offsets`); where `applied`, that host's
    # times in `steps`, `comm` and `system` are on rank 0's host's clock. Empty with one host.
    host_clocks: tuple[dict[str, Any], ...] = field(default=())

    def frame(self, kind: str) -> pd.DataFrame:
        """The DataFrame of record `kind` (steps, comm or system)."""
        return {"steps": self.steps, "comm": self.comm, "system": self.system}[kind]


def load_run(run_dir: str | os.PathLike[str]) -> RunFrames:
    """Read a run directory: records of every rank, meta, exit and run documents.

    Parquet files written by `compact_run` are read instead of the JSONL files when they
    are present and at least as new as every JSONL file of their kind.

    Args:
        run_dir: the run directory (created by the launcher, written by the ranks).

    Returns:
        The run's RunFrames; problems found while reading are in `warnings`.

    Example:
        >>> frames = load_run("runs/20250101-120000-train-ab12")  # doctest: +SKIP
        >>> frames.steps.groupby("rank")["step_s"].median()  # doctest: +SKIP
    """
    rd = RunDir(run_dir)
    warnings: list[str] = []
    if not rd.path.is_dir():
        warnings.append(f"run directory {str(rd.path)!r} does not exist")
    ranks = rd.rank_ids()
    frames = {kind: _load_kind(rd, kind, ranks, warnings) for kind in _RECORD_KINDS}
    meta = {r: d for r in ranks if (d := _read_json(rd.rank_file(r, "meta"), warnings, required=False)) is not None}
    exits = {r: d for r in ranks if (d := _read_json(rd.rank_file(r, "exit"), warnings, required=False)) is not None}
    info = _read_json(rd.run_json, warnings, required=False) or {}
    config = _read_json(rd.config_json, warnings, required=False) or {}
    if not info:
        warnings.append("run.json is missing: run status unknown")
    world_size = world_size_of(ranks, meta, info, config)
    seen = set(ranks) | set(int(r) for r in frames["steps"]["rank"].unique())
    missing = [r for r in range(world_size) if r not in seen]
    if missing:
        warnings.append(f"ranks {missing} wrote no files (world size {world_size})")
    for r in ranks:
        if not (frames["steps"]["rank"] == r).any():
            warnings.append(f"rank {r} wrote no step records")
    frames, clocks, note = on_one_clock(frames, meta)
    if note is not None:
        warnings.append(note)
    return RunFrames(
        run_dir=str(rd.path),
        steps=frames["steps"],
        comm=frames["comm"],
        system=frames["system"],
        meta=meta,
        exits=exits,
        info=info,
        config=config,
        ranks=tuple(sorted(seen)),
        world_size=world_size,
        warnings=tuple(warnings),
        host_clocks=tuple(clocks),
    )


def compact_run(run_dir: str | os.PathLike[str]) -> dict[str, Path]:
    """Write steps/comm/system.parquet from the ranks' JSONL records.

    Each file is written to a temporary name and renamed, so a reader never sees a half
    written Parquet file. Kinds without any JSONL file are skipped.

    Args:
        run_dir: the run directory.

    Returns:
        kind -> path of the Parquet file written.

    Example:
        >>> compact_run("runs/20250101-120000-train-ab12")  # doctest: +SKIP
        {'steps': PosixPath('runs/.../steps.parquet'), ...}
    """
    rd = RunDir(run_dir)
    ranks = rd.rank_ids()
    written: dict[str, Path] = {}
    for kind in _RECORD_KINDS:
        paths = [p for r in ranks if (p := rd.rank_file(r, kind)).is_file()]
        if not paths:
            continue
        warnings: list[str] = []
        df = _concat([_read_jsonl(p, kind, warnings) for p in paths], kind)
        table = pa.Table.from_pandas(df, preserve_index=False)
        source = json.dumps({"files": len(paths), "rows": len(df), "warnings": warnings})
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), _PARQUET_META_KEY: source.encode()})
        target = rd.parquet(kind)
        tmp = target.with_name(f".{target.name}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, target)
        written[kind] = target
    return written


# -- internals ------------------------------------------------------------------------


def _load_kind(rd: RunDir, kind: str, ranks: list[int], warnings: list[str]) -> pd.DataFrame:
    jsonl = [p for r in ranks if (p := rd.rank_file(r, kind)).is_file()]
    parquet = rd.parquet(kind)
    if parquet.is_file():
        newest_jsonl = max((p.stat().st_mtime for p in jsonl), default=0.0)
        if parquet.stat().st_mtime >= newest_jsonl:
            try:
                df = pq.read_table(parquet).to_pandas()
                return _conform(df, kind, warnings, parquet.name)
            except (OSError, pa.ArrowException) as exc:
                warnings.append(f"{parquet.name} is unreadable ({exc}); reading the JSONL records")
        else:
            warnings.append(f"{parquet.name} is older than the JSONL records; reading the JSONL records")
    return _concat([_read_jsonl(p, kind, warnings) for p in jsonl], kind)


def _read_jsonl(path: Path, kind: str, warnings: list[str]) -> pd.DataFrame:
    rows: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        warnings.append(f"{path.name} is unreadable: {exc}")
        return _conform(pd.DataFrame(), kind)
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # The writer appends and flushes; only a crash mid-write tears the last line.
            where = "torn last line" if i == last else f"malformed line {i + 1}"
            warnings.append(f"{path.name}: {where} skipped")
            continue
        if not isinstance(row, dict):
            warnings.append(f"{path.name}: line {i + 1} is not a JSON object, skipped")
            continue
        rows.append(row)
    return _conform(pd.DataFrame.from_records(rows), kind, warnings, path.name)


def _conform(df: pd.DataFrame, kind: str, warnings: list[str] | None = None, source: str = "") -> pd.DataFrame:
    """Exactly the record's columns, in order, with the record's types.

    Missing columns are NA; values of the wrong type become NA; rows without a valid
    rank/step (/seq) cannot be placed and are dropped (with a warning).
    """
    cols = columns_of(kind)
    df = df.reindex(columns=cols)
    for col, kind_of in _column_kinds(kind).items():
        if kind_of == "number":
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        elif kind_of == "bool":
            df[col] = df[col].map(lambda v: v if isinstance(v, bool) else None).astype(object)
        elif kind_of == "list":
            df[col] = df[col].map(lambda v: [int(x) for x in v] if isinstance(v, (list, tuple, np.ndarray)) else None
                                  ).astype(object)
        else:
            df[col] = df[col].map(lambda v: v if isinstance(v, str) else None).astype(object)
    key = [c for c in ("rank", "step", "seq") if c in cols]
    valid = np.isfinite(df[key]).all(axis=1) & (df[key] >= 0).all(axis=1) & (df[key] < 2**62).all(axis=1)
    if not valid.all() and warnings is not None:
        warnings.append(f"{source}: {int((~valid).sum())} records without a valid {'/'.join(key)} skipped")
    df = df[valid].copy()
    for col in key:
        df[col] = df[col].astype("int64")
    if "warmup" in df.columns:
        df["warmup"] = df["warmup"].fillna(False).astype(bool)
    return df.reset_index(drop=True)


@functools.cache
def _column_kinds(kind: str) -> dict[str, str]:
    """column -> number | bool | str | list, from the record dataclass's annotations."""
    hints = typing.get_type_hints(RECORD_KINDS[kind])
    out = {}
    for col in columns_of(kind):
        args = set(typing.get_args(hints[col])) or {hints[col]}
        args.discard(type(None))
        out[col] = ("bool" if args == {bool} else "str" if args == {str}
                    else "list" if any(typing.get_origin(a) is list for a in args) else "number")
    return out


def _concat(frames: list[pd.DataFrame], kind: str) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return _conform(pd.DataFrame(), kind)
    df = pd.concat(frames, ignore_index=True)
    order = [c for c in ("rank", "step", "seq", "t") if c in df.columns]
    return df.sort_values(order, kind="stable").reset_index(drop=True)


def _read_json(path: Path, warnings: list[str], *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            warnings.append(f"{path.name} is missing")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        warnings.append(f"{path.name} is unreadable: {exc}")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{path.name} is not a JSON object")
        return None
    return data
