"""The trace view's data: a run's deep-trace windows, analysed on request and cached in memory.

`torsh-tune profile --trace-window START:LEN` writes Kineto traces under
``RUN/traces/<window>/rank-<r>.json.gz``. The dashboard lists the windows of a run
(`list_trace_windows`), validates a window name from a URL exactly as run ids are
validated (`resolve_window`: a plain name, a direct child of ``RUN/traces`` once symlinks
are resolved), and turns `analysis.traces.analyze_traces` of one window into a `TraceView`:
findings, per-rank tables and the timeline figure of a typical step
(`reports.figures`, shared with the self-contained ``analysis.html``).

A window is analysed on request (tens of ms) and the view is cached in memory, keyed by
the window path, the size and mtime of each of its trace files and of ``RUN/config.json``
(whose ``[thresholds]`` the findings use): a window still being written is re-analysed
once its files change, a finished one never again. Nothing is written anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..analysis import run_thresholds
from ..errors import ConfigError
from ._security import RUN_ID_RE

if TYPE_CHECKING:
    import plotly.graph_objects as go

__all__ = ["TRACE_TABLES", "TraceCache", "TraceView", "TraceWindowNotFound", "build_trace_view",
           "list_trace_windows", "resolve_window", "trace_signature"]

_log = logging.getLogger(__name__)

#: Suffixes of the Kineto trace files of a window (as `analysis.traces.find_trace_files`).
_TRACE_SUFFIXES = (".json", ".json.gz")
#: Most timeline segments per rank sent to the browser (finer detail is merged into time bins).
TIMELINE_MAX_SEGMENTS = 1000
#: Rows of the top-kernels table per rank.
TOP_KERNELS_PER_RANK = 10
#: The page's tables: name -> (column header, source column) pairs.
TRACE_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "ranks": (("rank", "rank"), ("device", "device"), ("idle %", "idle_pct"), ("compute %", "compute_pct"),
              ("non-compute %", "non_compute_pct"), ("comm s", "comm_s"), ("exposed comm s", "exposed_comm_s"),
              ("overlap %", "overlap_pct")),
    "idle_causes": (("rank", "rank"), ("idle", "idle_s"), ("sync %", "sync_pct"), ("comm wait %", "comm_wait_pct"),
                    ("host wait %", "host_wait_pct"), ("other %", "other_pct"), ("peer wait", "peer_wait_s")),
    "stragglers": (("rank", "rank"), ("collectives", "collectives"), ("times last", "times_last"),
                   ("last %", "last_share_pct"), ("mean lateness", "mean_lateness_s"),
                   ("max lateness", "max_lateness_s")),
    "top_kernels": (("rank", "rank"), ("name", "name"), ("kind", "kind"), ("count", "count"),
                    ("total", "total_s"), ("mean", "mean_us"), ("max", "max_us"), ("share %", "share_pct")),
    # GPU: what is inside a step is the device span of the kernels it launched ("device step"); the step
    # time is its ProfilerStep# span on the host.
    "steps": (("rank", "rank"), ("step", "step"), ("step time (host)", "step_s"), ("device step", "device_step_s"),
              ("comm", "comm_s"), ("exposed comm", "exposed_comm_s")),
}


class TraceWindowNotFound(LookupError):
    """A window name that is malformed or names no trace window of the run."""

    def __init__(self, window: str) -> None:
        super().__init__(f"no trace window {window!r} in the run")
        self.window = window


@dataclass(frozen=True, kw_only=True)
class TraceView:
    """The trace page of one window, as plain data (plus the timeline figure).

    Attributes:
        window: the window's directory name (``step00020-00024``).
        key: what the view was computed from (trace files' and config.json's size and mtime).
        error: one line saying why the window could not be analysed (still being
            written, truncated gzip, no trace file); everything else is empty then.
        summary: `TraceAnalysis.summary` (JSON types).
        bottlenecks: `Bottleneck`s as dicts, most severe first.
        recommendations: `Recommendation`s as dicts (``expected_gain``: low_pct, high_pct,
            basis; % of the profiled window, which is whole steps), priority order.
        tables: `TRACE_TABLES` name -> rows (dicts of plain values). "ranks" joins the
            breakdown and overlap tables on rank.
        median_step_s: the median over profiled steps of the slowest rank's step time.
        step: the step the timeline shows (None: the whole window).
        figure: the per-rank timeline (`plot_trace_timeline`), None without events.
        warnings: the trace reader's and the thresholds' warnings.
    """

    window: str
    key: tuple = ()
    error: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    bottlenecks: tuple[dict[str, Any], ...] = ()
    recommendations: tuple[dict[str, Any], ...] = ()
    tables: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    median_step_s: float | None = None
    step: int | None = None
    figure: "go.Figure | None" = None
    warnings: tuple[str, ...] = ()


def _traces_root(run_path: Path) -> Path | None:
    """RUN/traces resolved, when it is a directory inside the run directory."""
    root = (run_path / "traces").resolve()
    if not root.is_dir() or not root.is_relative_to(run_path.resolve()):
        return None
    return root


def list_trace_windows(run_path: Path) -> list[str]:
    """Names of the run's trace windows (directories under RUN/traces), in step order."""
    root = _traces_root(run_path)
    if root is None:
        return []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    names = []
    for e in entries:
        if not RUN_ID_RE.match(e.name):
            continue
        try:
            resolve_window(run_path, e.name)
        except TraceWindowNotFound:
            continue
        names.append(e.name)
    return sorted(names)


def resolve_window(run_path: Path, window: Any) -> Path:
    """The directory of trace window `window` of the run at `run_path`, checked.

    The same rule as run ids (`_security.resolve_run`): a plain name (no separator, no
    '..', no percent-encoding), a direct child of RUN/traces once symlinks are followed.

    Raises:
        TraceWindowNotFound: malformed name, or no such window directory.
    """
    if not isinstance(window, str) or not RUN_ID_RE.match(window):
        raise TraceWindowNotFound(str(window)[:200])
    root = _traces_root(run_path)
    if root is None:
        raise TraceWindowNotFound(window)
    path = (root / window).resolve()
    if path.parent != root or not path.is_dir():
        raise TraceWindowNotFound(window)
    return path


def trace_signature(window_path: Path) -> tuple:
    """(name, size, mtime_ns) of every trace file of the window, by name."""
    out = []
    try:
        entries = sorted(os.scandir(window_path), key=lambda e: e.name)
    except OSError:
        return ()
    for e in entries:
        if not e.name.endswith(_TRACE_SUFFIXES):
            continue
        try:
            st = e.stat()
        except OSError:
            continue
        out.append((e.name, st.st_size, st.st_mtime_ns))
    return tuple(out)


def _one_line(exc: BaseException, run_path: Path) -> str:
    """The error as one line, with the run directory's absolute path left out."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    for prefix in {str(run_path) + os.sep, str(run_path.resolve()) + os.sep}:
        text = text.replace(prefix, "")
    return text[:400]


def _plain(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def _rows(table: Any, columns: tuple[tuple[str, str], ...]) -> list[dict[str, Any]]:
    keep = [c for _, c in columns]
    return [{c: _plain(r.get(c)) for c in keep} for r in table.rows()]


def build_trace_view(window_path: Path, *, window: str, config: dict[str, Any] | None = None,
                     run_path: Path | None = None, key: tuple = ()) -> TraceView:
    """Analyse one trace window into a `TraceView` (never raises for a bad window).

    Args:
        window_path: the window directory (checked by the caller: `resolve_window`).
        window: its name, for the page.
        config: the run's config.json (its ``[thresholds]`` drive the findings).
        run_path: the run directory, left out of error messages.
        key: the cache key the view is stored under.
    """
    from ..analysis.traces import analyze_traces

    warnings: list[str] = []
    thresholds = run_thresholds(config or {}, warnings)
    try:
        analysis = analyze_traces(window_path, thresholds=thresholds)
    except (ConfigError, OSError, EOFError) as exc:  # still being written, truncated, not a trace
        return TraceView(window=window, key=key, error=_one_line(exc, run_path or window_path.parent.parent))
    except Exception as exc:  # a trace the parser did not expect: say so on the page, not a 500
        _log.exception("trace analysis of %s failed", window_path)
        return TraceView(window=window, key=key,
                         error=f"analysis failed: {type(exc).__name__}: "
                               f"{_one_line(exc, run_path or window_path.parent.parent)}")
    t = analysis.tables
    overlap = {r["rank"]: r for r in t["overlap"].rows()}
    ranks = [{**o, **b} for b in t["breakdown"].rows() for o in [overlap.get(b["rank"], {})]]
    tables = {
        "ranks": [{c: _plain(r.get(c)) for _, c in TRACE_TABLES["ranks"]} for r in ranks],
        "idle_causes": _rows(t["idle_causes"], TRACE_TABLES["idle_causes"]),
        "stragglers": _rows(t["stragglers"], TRACE_TABLES["stragglers"]),
        "steps": _rows(t["steps"], TRACE_TABLES["steps"]),
    }
    top: list[dict[str, Any]] = []
    per_rank: dict[Any, int] = {}
    for r in sorted(_rows(t["top_kernels"], TRACE_TABLES["top_kernels"]),
                    key=lambda r: (r["rank"], -(r["total_s"] or 0.0))):
        per_rank[r["rank"]] = per_rank.get(r["rank"], 0) + 1
        if per_rank[r["rank"]] <= TOP_KERNELS_PER_RANK:
            top.append(r)
    tables["top_kernels"] = top
    figure, step = None, None
    if analysis.timelines:
        from ..reports.figures import get_trace_timeline_info, plot_trace_timeline

        try:
            info = get_trace_timeline_info(analysis, max_segments=TIMELINE_MAX_SEGMENTS)
            figure, step = plot_trace_timeline(info), info.step
        except (ValueError, KeyError, IndexError) as exc:
            warnings.append(f"no timeline: {_one_line(exc, run_path or window_path.parent.parent)}")
    summary = dict(analysis.summary)
    median = summary.get("what_if_step_s")
    return TraceView(
        window=window,
        key=key,
        summary=summary,
        bottlenecks=tuple(dataclasses.asdict(b) for b in analysis.bottlenecks),
        recommendations=tuple(dataclasses.asdict(r) for r in analysis.recommendations),
        tables=tables,
        median_step_s=float(median) if isinstance(median, (int, float)) else None,
        step=step,
        figure=figure,
        warnings=tuple(str(w) for w in summary.get("warnings") or []) + tuple(warnings),
    )


class TraceCache:
    """Views of trace windows, kept in memory (most recently used `max_windows`).

    One analysis runs at a time (each takes tens of ms and ~15 MB while it runs), so
    concurrent requests never multiply that memory; a request for a view already cached
    with the same files returns at once.
    """

    def __init__(self, max_windows: int = 8) -> None:
        self.max_windows = max_windows
        self._views: OrderedDict[str, TraceView] = OrderedDict()
        self._lock = threading.Lock()
        self._compute = threading.Lock()
        self.analyses = 0  # how many analyses ran (tests and the benchmark read it)

    def view(self, window_path: Path, *, window: str, config: dict[str, Any] | None, config_key: Any,
             run_path: Path | None = None) -> TraceView:
        """The window's view: cached while its trace files and config.json are unchanged."""
        key = (str(window_path), trace_signature(window_path), config_key)
        with self._lock:
            hit = self._views.get(key[0])
            if hit is not None and hit.key == key:
                self._views.move_to_end(key[0])
                return hit
        with self._compute:
            with self._lock:  # another request may have computed it meanwhile
                hit = self._views.get(key[0])
                if hit is not None and hit.key == key:
                    return hit
            view = build_trace_view(window_path, window=window, config=config, run_path=run_path, key=key)
            self.analyses += 1
            with self._lock:
                self._views[key[0]] = view
                self._views.move_to_end(key[0])
                while len(self._views) > self.max_windows:
                    self._views.popitem(last=False)
            return view
