"""Read-only, incremental access to the runs of a runs directory.

A live run's JSONL files only grow, so each file is read from where the last read
stopped (complete lines only: a line still being written waits for the next refresh),
and a run's `RunFrames` are rebuilt only when a file's size or mtime changed. Study
directories (`torsh-tune tune` and the main job write them into the same runs directory)
are listed too, as kind "study", and read as a `TuningInfo` that is rebuilt only when the
study's files change; a study's Optuna storage is opened read-only. A run's deep-trace
windows (RUN/traces/<window>/) are analysed on request and cached in memory until their
files change (`_traces.TraceCache`). Nothing here writes into a run or study directory.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import threading
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from ..analysis import RunAnalysis, RunFrames, analyze_run, on_one_clock
from ..records import RECORD_KINDS, columns_of
from ..reports import TuningInfo, get_tuning_info
from ..rundir import RunDir, StudyDir, is_study_dir, world_size_of
from ._security import RUN_ID_RE, RunNotFound, resolve_run
from ._traces import TraceCache, TraceView, list_trace_windows, resolve_window

__all__ = ["RunRow", "RunStore", "is_study_dir", "status_class"]

_RANK_FILE_RE = re.compile(r"^rank(\d+)\.(steps|comm|system)\.jsonl$")
_RANK_DOC_RE = re.compile(r"^rank(\d+)\.(meta|exit)\.json$")
_DONE = ("ok", "budget")
_KEYS = ("rank", "step", "seq")
_STUDY_STATUS = {"finished": "finished", "running": "running", "interrupted": "failed"}


def status_class(info: dict[str, Any]) -> str:
    """running, finished, failed or unknown, from run.json (outcome status first)."""
    outcome = info.get("outcome")
    status = outcome.get("status") if isinstance(outcome, dict) else outcome
    status = status if isinstance(status, str) and status else info.get("status")
    if not isinstance(status, str) or not status:
        return "unknown"
    if status == "running":
        return "running"
    return "finished" if status in _DONE else "failed"


@dataclass(frozen=True, kw_only=True)
class RunRow:
    """One line of the runs list."""

    run_id: str
    status: str  # running | finished | failed | unknown
    raw_status: str  # run.json's own word (ok, budget, error, timeout, ...)
    script: str
    world_size: int | None
    strategy: str
    median_step_s: float | None
    top_bottleneck: str  # "severity category", "" when none
    started_at: str
    started_at_unix: float | None
    kind: str = "run"  # "run", or "study" (a tuning study: its page is /studies/<id>)
    headline: str = ""  # a study's verdict ("Confirmed speedup 1.180x"), "" for a run


# -- incremental JSONL ------------------------------------------------------------------


@functools.cache
def _column_kinds(kind: str) -> dict[str, str]:
    """column -> key | number | bool | str | list, from the record dataclass's annotations."""
    hints = typing.get_type_hints(RECORD_KINDS[kind])
    out = {}
    for col in columns_of(kind):
        args = set(typing.get_args(hints[col])) or {hints[col]}
        args.discard(type(None))
        out[col] = ("key" if col in _KEYS else "bool" if args == {bool} else "str" if args == {str}
                    else "list" if any(typing.get_origin(a) is list for a in args) else "number")
    return out


@functools.cache
def _arrow_schema(kind: str) -> pa.Schema:
    types = {"key": pa.int64(), "number": pa.float64(), "bool": pa.bool_(), "str": pa.string(),
             "list": pa.list_(pa.int64())}
    return pa.schema([(c, types[k]) for c, k in _column_kinds(kind).items()])


def _conform(df: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Exactly the record's columns with the record's types; rows without a valid key dropped."""
    kinds = _column_kinds(kind)
    df = df.reindex(columns=list(kinds))
    for col, k in kinds.items():
        if k in ("key", "number"):
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        elif k == "bool":
            df[col] = df[col].map(lambda v: v if isinstance(v, (bool, np.bool_)) else None).astype(object)
        elif k == "list":
            df[col] = df[col].map(lambda v: [int(x) for x in v] if isinstance(v, (list, tuple, np.ndarray)) else None
                                  ).astype(object)
        else:
            df[col] = df[col].map(lambda v: v if isinstance(v, str) else None).astype(object)
    key = [c for c in _KEYS if c in kinds]
    valid = np.isfinite(df[key]).all(axis=1) & (df[key] >= 0).all(axis=1)
    df = df[valid].copy()
    for col in key:
        df[col] = df[col].astype("int64")
    if "warmup" in df.columns:
        df["warmup"] = df["warmup"].fillna(False).astype(bool)
    return df.reset_index(drop=True)


def _parse_block(block: bytes, kind: str, name: str, warnings: list[str]) -> pd.DataFrame:
    """Complete JSONL lines -> conformed DataFrame; pyarrow first, line by line on any fault."""
    try:
        table = pa_json.read_json(
            io.BytesIO(block),
            parse_options=pa_json.ParseOptions(explicit_schema=_arrow_schema(kind),
                                               unexpected_field_behavior="ignore"),
        )
        return _conform(table.to_pandas(), kind)
    except (pa.ArrowException, ValueError):
        pass  # a malformed or mistyped line: the slow path below finds and skips it
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in block.split(b"\n"):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if bad:
        warnings.append(f"{name}: {bad} malformed lines skipped")
    return _conform(pd.DataFrame.from_records(rows), kind)


class _Tail:
    """One append-only JSONL file, read incrementally."""

    def __init__(self, path: Path, kind: str) -> None:
        self.path, self.kind = path, kind
        self.offset = 0
        self.ino: int | None = None
        self.chunks: list[pd.DataFrame] = []
        self.warnings: list[str] = []

    def refresh(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._reset(None)
            return
        if st.st_ino != self.ino or st.st_size < self.offset:  # replaced or truncated
            self._reset(st.st_ino)
        if st.st_size == self.offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(st.st_size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return  # only a partial line so far: the writer has not finished it
        self.offset += end + 1
        df = _parse_block(data[: end + 1], self.kind, self.path.name, self.warnings)
        if len(df):
            self.chunks.append(df)
        if len(self.chunks) > 64:  # bound the list; the run's frame is one concat of all chunks anyway
            self.chunks = [pd.concat(self.chunks, ignore_index=True)]

    def _reset(self, ino: int | None) -> None:
        self.offset, self.ino, self.chunks, self.warnings = 0, ino, [], []


@dataclass
class _RunCache:
    path: Path
    signature: tuple = ()
    tails: dict[tuple[int, str], _Tail] = field(default_factory=dict)
    docs: dict[Path, tuple[tuple[int, int], dict[str, Any] | None]] = field(default_factory=dict)
    frames: RunFrames | None = None
    analysis: RunAnalysis | None = None
    analysis_signature: tuple = ()
    analysis_at: float = 0.0
    tuning: TuningInfo | None = None
    tuning_signature: tuple = ()
    lock: threading.Lock = field(default_factory=threading.Lock)


def _stat_key(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


class RunStore:
    """The runs under one directory: listing, incremental RunFrames, cached analyses.

    Thread-safe (Dash serves callbacks from several threads). Never writes.

    Args:
        runs_dir: the directory holding one sub-directory per run.
        analysis_every_s: how often a running run's analysis is recomputed at most.

    Example:
        >>> store = RunStore("torsh-runs")  # doctest: +SKIP
        >>> [r.run_id for r in store.list_runs()]  # doctest: +SKIP
        >>> store.frames("20250101-120000-train-ab12").steps.tail()  # doctest: +SKIP
    """

    def __init__(self, runs_dir: str | os.PathLike[str], *, analysis_every_s: float = 5.0) -> None:
        self.runs_dir = Path(runs_dir)
        self.analysis_every_s = analysis_every_s
        self._runs: dict[str, _RunCache] = {}
        self._lock = threading.Lock()
        self.traces = TraceCache()  # views of trace windows, in memory only

    # -- runs ---------------------------------------------------------------------------

    def run_ids(self) -> list[str]:
        """Names of the run and study directories (those with run.json or ranks/, or a study's files), newest first."""
        try:
            entries = list(os.scandir(self.runs_dir))
        except OSError:
            return []
        ids = []
        for e in entries:
            if not RUN_ID_RE.match(e.name) or not e.is_dir(follow_symlinks=False):
                continue
            run = RunDir(e.path)
            if run.run_json.is_file() or run.ranks.is_dir() or is_study_dir(run.path):
                ids.append(e.name)
        return sorted(ids, reverse=True)

    def path(self, run_id: str) -> Path:
        """The validated run directory (raises RunNotFound)."""
        return resolve_run(self.runs_dir, run_id)

    def info(self, run_id: str) -> dict[str, Any]:
        """run.json of a run ({} when absent or unreadable)."""
        cache = self._cache(run_id)
        with cache.lock:
            return self._doc(cache, cache.path / "run.json") or {}

    def list_runs(self) -> list[RunRow]:
        """One RunRow per run (summary numbers from report.json when fresh, else an analysis)."""
        rows = []
        for run_id in self.run_ids():
            try:
                rows.append(self.row(run_id))
            except RunNotFound:
                continue  # removed between listing and reading
        return rows

    def is_study(self, run_id: str) -> bool:
        """Whether `run_id` names a study directory (raises RunNotFound for no such directory)."""
        return is_study_dir(self.path(run_id))

    def tuning(self, run_id: str) -> TuningInfo:
        """The study's TuningInfo, rebuilt only when one of its files changed.

        Raises:
            RunNotFound: no such directory, or not a study.
        """
        cache = self._cache(run_id)
        with cache.lock:
            if not is_study_dir(cache.path):
                raise RunNotFound(run_id)
            study = StudyDir(cache.path)
            # A change to any file the TuningInfo is read from rebuilds it.
            sig = tuple((n, _stat_key(study.file(n))) for n in StudyDir.INFO_FILES)
            if cache.tuning is None or sig != cache.tuning_signature:
                db = study.study_db
                # Read-only: opening the storage for writing could change the study under its tuner.
                storage = f"sqlite:///file:{db.resolve()}?mode=ro&uri=true" if db.is_file() else None
                cache.tuning = get_tuning_info(cache.path, storage=storage if _storage_is_newer(cache.path) else None)
                cache.tuning_signature = sig
            return cache.tuning

    def row(self, run_id: str) -> RunRow:
        """The runs-list row of one run or study."""
        if self.is_study(run_id):
            return self._study_row(run_id)
        info = self.info(run_id)
        status = status_class(info)
        median, top = self._summary(run_id, info, status)
        config = info.get("config") if isinstance(info.get("config"), dict) else {}
        strategy = config.get("strategy") if isinstance(config.get("strategy"), dict) else {}
        kind = str(strategy.get("kind") or "")
        comp = strategy.get("compression") if isinstance(strategy.get("compression"), dict) else {}
        if comp.get("kind") not in (None, "none", ""):
            kind = f"{kind} + {comp['kind']}"
        raw = info.get("outcome", {}).get("status") if isinstance(info.get("outcome"), dict) else None
        world = info.get("world_size")
        started = info.get("started_at_unix")
        return RunRow(
            run_id=run_id,
            status=status,
            raw_status=str(raw or info.get("status") or "unknown"),
            script=Path(str(info.get("script") or "")).name,
            world_size=world if isinstance(world, int) else None,
            strategy=kind,
            median_step_s=median,
            top_bottleneck=top,
            started_at=str(info.get("started_at") or ""),
            started_at_unix=float(started) if isinstance(started, (int, float)) else None,
        )

    # -- records ------------------------------------------------------------------------

    def frames(self, run_id: str) -> RunFrames:
        """The run's records as RunFrames, re-reading only what grew since the last call."""
        cache = self._cache(run_id)
        with cache.lock:
            self._refresh(cache)
            assert cache.frames is not None
            return cache.frames

    def signature(self, run_id: str) -> tuple:
        """Sizes and mtimes of every file the frames come from (changes when the run writes)."""
        cache = self._cache(run_id)
        with cache.lock:
            return self._signature(cache.path)

    def analysis(self, run_id: str) -> RunAnalysis:
        """`analyze_run` of the run, cached until its files change.

        A running run is re-analysed at most every `analysis_every_s` seconds (the last
        analysis is returned in between).
        """
        cache = self._cache(run_id)
        with cache.lock:
            sig = self._signature(cache.path)
            fresh = cache.analysis is not None and (
                sig == cache.analysis_signature
                or time.monotonic() - cache.analysis_at < self.analysis_every_s
            )
            if not fresh:
                cache.analysis = analyze_run(cache.path)
                cache.analysis_signature, cache.analysis_at = sig, time.monotonic()
            assert cache.analysis is not None
            return cache.analysis

    # -- deep traces --------------------------------------------------------------------

    def trace_windows(self, run_id: str) -> list[str]:
        """Names of the run's trace windows (RUN/traces/<window>/), in step order; [] for none.

        Raises:
            RunNotFound: no such run directory.
        """
        return list_trace_windows(self.path(run_id))

    def trace_view(self, run_id: str, window: str) -> TraceView:
        """The analysed trace window (findings, tables, timeline), cached until its files change.

        A window that cannot be analysed (still being written, truncated) is a view with
        `error` set, not an exception. The run's `[thresholds]` (config.json) apply.

        Raises:
            RunNotFound: no such run directory.
            TraceWindowNotFound: malformed window name, or no such window.
        """
        cache = self._cache(run_id)
        path = resolve_window(cache.path, window)
        config_path = cache.path / "config.json"
        with cache.lock:
            config = self._doc(cache, config_path) or {}
        return self.traces.view(path, window=window, config=config, config_key=_stat_key(config_path),
                                run_path=cache.path)

    # -- internals ----------------------------------------------------------------------

    def _study_row(self, run_id: str) -> RunRow:
        t = self.tuning(run_id)
        first = next(iter((t.baseline or {}).get("run_dirs") or []), None)
        base: dict[str, Any] = {}
        root = self.path(run_id)
        path = (root / first).resolve() if first else None
        if path is not None and path.is_relative_to(root):  # never read outside the study directory
            cache = self._cache(run_id)  # the baseline run's run.json says what ran (the study has none)
            with cache.lock:
                base = self._doc(cache, path / "run.json") or {}
        started = base.get("started_at_unix")
        world = base.get("world_size")
        raw = str(t.study.get("status") or "unknown")
        counts = t.study.get("counts") or {}
        return RunRow(
            run_id=run_id,
            status=_STUDY_STATUS.get(raw, "unknown"),
            raw_status=raw,
            script=Path(str((t.summary or {}).get("script") or base.get("script") or "")).name,
            world_size=world if isinstance(world, int) else None,
            strategy=f"{counts.get('trials', 0)} trials",
            median_step_s=None,
            top_bottleneck="",
            started_at=str(base.get("started_at") or ""),
            started_at_unix=float(started) if isinstance(started, (int, float)) else None,
            kind="study",
            headline=str(t.verdict.get("title") or ""),
        )

    def _cache(self, run_id: str) -> _RunCache:
        path = self.path(run_id)
        with self._lock:
            cache = self._runs.get(run_id)
            if cache is None or cache.path != path:
                cache = self._runs[run_id] = _RunCache(path=path)
            return cache

    def _summary(self, run_id: str, info: dict[str, Any], status: str) -> tuple[float | None, str]:
        report = self._fresh_report(run_id)
        if report is not None:
            summary = report.get("summary") or {}
            bns = report.get("bottlenecks") or []
            median = summary.get("median_step_s")
            top = f"{bns[0].get('severity')} {bns[0].get('category')}" if bns else ""
            return (float(median) if isinstance(median, (int, float)) else None), top
        a = self.analysis(run_id)
        top = f"{a.bottlenecks[0].severity} {a.bottlenecks[0].category}" if a.bottlenecks else ""
        return (a.steps.median_step_s if a.steps is not None else None), top

    def _fresh_report(self, run_id: str) -> dict[str, Any] | None:
        """report/report.json when it was written after the run's last record."""
        cache = self._cache(run_id)
        report = cache.path / "report" / "report.json"
        with cache.lock:
            key = _stat_key(report)
            if key is None:
                return None
            # run.json is rewritten at the very end, after the report: compare records only.
            newest = max((s[1] for n, s in self._signature(cache.path)
                          if s is not None and _RANK_FILE_RE.match(n)), default=0)
            if key[1] < newest:
                return None
            return self._doc(cache, report)

    def _doc(self, cache: _RunCache, path: Path) -> dict[str, Any] | None:
        key = _stat_key(path)
        if key is None:
            return None
        hit = cache.docs.get(path)
        if hit is not None and hit[0] == key:
            return hit[1]
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = None
        data = data if isinstance(data, dict) else None
        cache.docs[path] = (key, data)
        return data

    @staticmethod
    def _signature(path: Path) -> tuple:
        files = [path / "run.json", path / "config.json"]
        ranks = path / "ranks"
        try:
            files += sorted(ranks / n for n in os.listdir(ranks) if _RANK_FILE_RE.match(n) or _RANK_DOC_RE.match(n))
        except OSError:
            pass
        files += [path / f"{k}.parquet" for k in RECORD_KINDS]
        return tuple((f.name, _stat_key(f)) for f in files)

    def _refresh(self, cache: _RunCache) -> None:
        sig = self._signature(cache.path)
        if cache.frames is not None and sig == cache.signature:
            return
        rd = RunDir(cache.path)
        ranks_seen: set[int] = set()
        meta: dict[int, dict[str, Any]] = {}
        exits: dict[int, dict[str, Any]] = {}
        try:
            names = sorted(os.listdir(rd.ranks))
        except OSError:
            names = []
        for name in names:
            if m := _RANK_FILE_RE.match(name):
                rank, kind = int(m.group(1)), m.group(2)
                ranks_seen.add(rank)
                cache.tails.setdefault((rank, kind), _Tail(rd.ranks / name, kind)).refresh()
            elif m := _RANK_DOC_RE.match(name):
                rank = int(m.group(1))
                ranks_seen.add(rank)
                doc = self._doc(cache, rd.ranks / name)
                if doc is not None:
                    (meta if m.group(2) == "meta" else exits)[rank] = doc
        warnings: list[str] = []
        kinds = {kind: self._kind_frame(cache, rd, kind, warnings) for kind in RECORD_KINDS}
        info = self._doc(cache, rd.run_json) or {}
        config = self._doc(cache, rd.config_json) or {}
        seen = ranks_seen | set(int(r) for r in kinds["steps"]["rank"].unique())
        kinds, clocks, note = on_one_clock(kinds, meta)  # ranks on several hosts: rank 0's host's clock, as load_run
        cache.frames = RunFrames(
            run_dir=str(cache.path),
            steps=kinds["steps"],
            comm=kinds["comm"],
            system=kinds["system"],
            meta=meta,
            exits=exits,
            info=info,
            config=config,
            ranks=tuple(sorted(seen)),
            world_size=world_size_of(seen, meta, info, config),
            warnings=tuple(warnings + [w for t in cache.tails.values() for w in t.warnings] + ([note] if note else [])),
            host_clocks=tuple(clocks),
        )
        cache.signature = sig

    @staticmethod
    def _kind_frame(cache: _RunCache, rd: RunDir, kind: str, warnings: list[str]) -> pd.DataFrame:
        tails = [t for (_, k), t in sorted(cache.tails.items()) if k == kind and t.path.exists()]
        parts = [c for t in tails for c in t.chunks]
        if not tails and (pq_path := rd.parquet(kind)).is_file():
            # JSONL gone but compacted records kept: read those.
            try:
                parts = [_conform(pq.read_table(pq_path).to_pandas(), kind)]
            except (OSError, pa.ArrowException) as exc:
                warnings.append(f"{pq_path.name} is unreadable: {exc}")
        if not parts:
            return _conform(pd.DataFrame(), kind)
        df = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
        order = [c for c in ("rank", "step", "seq", "t") if c in df.columns]
        if _is_sorted(df, order[:2]):  # the usual case (rank files in order, each appended in order)
            return df.reset_index(drop=True) if len(parts) == 1 else df
        return df.sort_values(order, kind="stable", ignore_index=True)


def _is_sorted(df: pd.DataFrame, cols: list[str]) -> bool:
    """Whether df is ordered by cols lexicographically (linear time, no sort)."""
    if len(df) < 2:
        return True
    a = df[cols[0]].to_numpy()
    da = np.diff(a)
    if (da < 0).any():
        return False
    b = df[cols[1]].to_numpy()
    if np.issubdtype(b.dtype, np.floating) and np.isnan(b).any():
        return False
    return bool(((da > 0) | (np.diff(b) >= 0)).all())


def _storage_is_newer(path: Path) -> bool:
    """Whether get_tuning_info would read study.db (no result.json, or a storage written after it)."""
    study = StudyDir(path)
    db, result = study.study_db, study.result_json
    if not db.is_file():
        return False
    try:
        return not result.is_file() or db.stat().st_mtime > result.stat().st_mtime + 1.0
    except OSError:
        return False
