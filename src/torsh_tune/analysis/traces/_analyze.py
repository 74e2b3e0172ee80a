"""`analyze_traces`: every trace analyzer over a `TraceSet`, gathered in `TraceAnalysis`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import ThresholdsConfig
from .._types import Bottleneck, Recommendation
from ._breakdown import comm_overlap, temporal_breakdown, top_kernels
from ._collectives import COLLECTIVE_COLUMNS, rank_collectives
from ._counterfactuals import counterfactuals, step_table
from ._cross_rank import collective_timing, stragglers
from ._findings import trace_findings
from ._idle import IDLE_CAUSES, idle_by_stream, idle_causes, idle_segments
from ._model import TraceSet, load_traces
from ._phases import phase_table
from ._table import Table
from ._timeline import CommPatterns, Timeline, rank_timeline, with_queues

if TYPE_CHECKING:
    import pandas as pd

TABLES = ("breakdown", "overlap", "collectives", "stragglers", "top_kernels", "steps", "idle_causes",
          "idle_segments", "idle_streams", "phases")


class _Frame:
    """A `TraceAnalysis.tables` entry as a DataFrame, built on first access (imports pandas)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: TraceAnalysis | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        cache = obj.__dict__.setdefault("_frames", {})
        if self.name not in cache:
            cache[self.name] = obj.tables[self.name].to_pandas()
        return cache[self.name]

__all__ = ["TABLES", "TraceAnalysis", "analyze_traces"]


@dataclass(frozen=True, kw_only=True)
class TraceAnalysis:
    """Results of `analyze_traces`: tables keyed by rank plus a JSON-able summary.

    Each table is in `tables` (numpy `Table`s, what the analyzers produce) and, as a
    pandas DataFrame built on first access, under its own name (``a.breakdown``...).

    Attributes:
        breakdown: idle/compute/non-compute per rank (`temporal_breakdown`).
        overlap: comm/compute overlap and exposed comm per rank (`comm_overlap`).
        collectives: one row per collective per rank with wait_s, transfer_s,
            algbw_gbps, busbw_gbps (`collective_timing`).
        stragglers: per rank, how often it arrives last at a collective.
        top_kernels: longest kernels (CPU: main-thread ops) per rank.
        steps: per (rank, ProfilerStep) step and exposed-comm time.
        idle_causes: per rank, idle time split into sync / comm_wait / host_wait / other,
            plus the time collectives waited for peers (`idle_causes`).
        idle_segments: every idle stretch with its cause (`idle_segments`).
        idle_streams: per (rank, CUDA stream), idle time split into host_wait /
            kernel_wait / other as HTA's ``get_idle_time_breakdown`` (`idle_by_stream`;
            no rows for CPU traces).
        phases: per rank, the always-on phases as the trace saw them (their annotations'
            kernel spans on a GPU: `phase_table`; no rows without annotations).
        timelines: the per-rank device timelines the tables were computed from.
        summary: headline numbers (plain JSON types) for reports and Bottleneck rules.
        bottlenecks: findings from the tables above, most severe first (`trace_findings`).
        recommendations: actions for them, priority order, gains bounded by their shares.
    """

    path: Path
    tables: dict[str, Table]
    timelines: dict[int, Timeline] = field(default_factory=dict, repr=False)
    summary: dict[str, Any] = field(default_factory=dict)
    bottlenecks: tuple[Bottleneck, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()

    breakdown = _Frame()
    overlap = _Frame()
    collectives = _Frame()
    stragglers = _Frame()
    top_kernels = _Frame()
    steps = _Frame()
    idle_causes = _Frame()
    idle_segments = _Frame()
    idle_streams = _Frame()
    phases = _Frame()


def _mean(t: Table, col: str) -> float | None:
    v = t[col].astype(float) if col in t else np.empty(0)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else None


def analyze_traces(source: str | Path | TraceSet, *, patterns: CommPatterns | None = None,
                   exclude_last_step: bool = True, hta_rounding: bool = False,
                   top_limit: int = 15, thresholds: ThresholdsConfig | None = None) -> TraceAnalysis:
    """Analyze a directory of Kineto traces (or a loaded `TraceSet`).

    Args:
        source: trace directory / file, or a `TraceSet` from `load_traces`.
        patterns: how communication is recognised (NCCL kernel names, gloo annotations).
        exclude_last_step: drop kernels launched in the last ProfilerStep, which the
            profiling window usually cuts off (HTA does the same).
        hta_rounding: round sub-µs kernel times to whole µs as HTA 0.5 does (for
            side-by-side comparisons only).
        top_limit: rows per rank in `top_kernels`.
        thresholds: thresholds of the bottleneck rules (`trace_findings`); ThresholdsConfig() when None.

    Returns:
        A `TraceAnalysis`.

    Raises:
        ConfigError: see `load_traces`.

    Example:
        >>> a = analyze_traces("tests/data/traces/hta-sampled-2rank")  # doctest: +SKIP
        >>> a.breakdown[["rank", "idle_pct"]].round(2).values.tolist()  # doctest: +SKIP
        [[0, 53.56], [1, 54.72]]
    """
    traces = source if isinstance(source, TraceSet) else load_traces(source)
    patterns = patterns or CommPatterns()
    timelines = {r: rank_timeline(rt, traces.symbols, patterns, exclude_last_step=exclude_last_step,
                                  hta_rounding=hta_rounding) for r, rt in traces.ranks.items()}
    per_rank = {r: rank_collectives(rt, traces.symbols, patterns) for r, rt in traces.ranks.items()}
    timelines = {r: with_queues(tl, per_rank[r]["issue_us"], per_rank[r]["start_us"]) for r, tl in timelines.items()}
    breakdown = temporal_breakdown(timelines)
    overlap = comm_overlap(timelines)
    coll = Table.concat(list(per_rank.values()), COLLECTIVE_COLUMNS)
    coll = collective_timing(coll)
    strag = stragglers(coll)
    steps = step_table(traces, timelines)
    segments = idle_segments(timelines, traces, patterns)
    causes = idle_causes(segments, timelines, coll)
    idle_total = float(causes["idle_s"].sum())
    what_if = counterfactuals(steps)
    backends = sorted({rt.backend for rt in traces.ranks.values() if rt.backend})
    worst = strag.rows()[int(np.argmax(strag["times_last"]))] if len(strag) else None
    summary: dict[str, Any] = {
        "num_ranks": len(traces.ranks),
        "ranks": list(traces.ranks),
        "backend": ",".join(backends) or None,
        "device": ",".join(sorted(set(breakdown["device"]))) or None,
        "idle_pct": _mean(breakdown, "idle_pct"),
        "compute_pct": _mean(breakdown, "compute_pct"),
        "non_compute_pct": _mean(breakdown, "non_compute_pct"),
        "overlap_pct": _mean(overlap, "overlap_pct"),
        "exposed_comm_s": float(overlap["exposed_comm_s"].sum()) if len(overlap) else None,
        "num_collectives": int(len(coll)),
        "mean_wait_s": _mean(coll, "wait_s"),
        "mean_transfer_s": _mean(coll, "transfer_s"),
        **{f"idle_{c}_pct": (100.0 * float(causes[f"{c}_s"].sum()) / idle_total if idle_total > 0 else None)
           for c in IDLE_CAUSES},
        "peer_wait_s": float(causes["peer_wait_s"].sum()) if len(causes) else None,
        "median_busbw_gbps": (float(np.nanmedian(coll["busbw_gbps"])) if (~np.isnan(coll["busbw_gbps"])).any()
                              else None),
        "straggler_rank": int(worst["rank"]) if worst is not None and worst["times_last"] > 0 else None,
        "straggler_last_share_pct": float(worst["last_share_pct"]) if worst is not None else None,
        **{f"what_if_{k}" if k != "slowest_rank" else k: v for k, v in what_if.items()},
        "hta_rounding": hta_rounding,
        "warnings": list(traces.warnings),
    }
    tables = {"breakdown": breakdown, "overlap": overlap, "collectives": coll, "stragglers": strag,
              "top_kernels": top_kernels(timelines, traces.symbols, limit=top_limit), "steps": steps,
              "idle_causes": causes, "idle_segments": segments,
              "idle_streams": idle_by_stream(traces, timelines, hta_rounding=hta_rounding),
              "phases": phase_table(traces, timelines)}
    analysis = TraceAnalysis(path=traces.path, tables=tables, timelines=timelines, summary=summary)
    bottlenecks, recommendations = trace_findings(analysis, thresholds)
    return replace(analysis, bottlenecks=bottlenecks, recommendations=recommendations)
