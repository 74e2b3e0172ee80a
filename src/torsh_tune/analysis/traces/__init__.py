"""Deep-trace analysis: Kineto/Chrome traces (NCCL or gloo) into per-rank tables.

Parsing (`load_traces`: streaming, columnar, one event `Table` per rank + a symbol table)
is kept apart from the analyzers (pure functions over numpy `Table`s: breakdown, overlap,
collectives, stragglers, idle-time causes device-wide and per CUDA stream, steps and
what-ifs) behind one facade, `analyze_traces`, whose tables `trace_findings` turns into the
always-on tier's `Bottleneck` and `Recommendation` objects. Neither torch nor pandas is
imported: every table is also a pandas DataFrame on request (`TraceAnalysis.breakdown`,
`RankTrace.events`, `Table.to_pandas`).

Example:
    >>> from torsh_tune.analysis.traces import analyze_traces  # doctest: +SKIP
    >>> a = analyze_traces("tests/data/traces/gloo-ddp-2rank")  # doctest: +SKIP
    >>> a.overlap[["rank", "overlap_pct", "exposed_comm_s"]]  # doctest: +SKIP
"""

from ._analyze import TraceAnalysis, analyze_traces
from ._breakdown import comm_overlap, temporal_breakdown, top_kernels
from ._collectives import COLLECTIVE_COLUMNS, normalize_collective, rank_collectives
from ._counterfactuals import counterfactuals, step_table
from ._cross_rank import collective_timing, stragglers
from ._findings import trace_findings
from ._idle import IDLE_CAUSES, STREAM_IDLE_CAUSES, idle_by_stream, idle_causes, idle_segments
from ._model import RankTrace, TraceSet, find_trace_files, load_traces
from ._symbols import SymbolTable
from ._table import Table
from ._timeline import CommPatterns, Timeline, rank_timeline, step_spans

__all__ = [
    "COLLECTIVE_COLUMNS",
    "IDLE_CAUSES",
    "STREAM_IDLE_CAUSES",
    "CommPatterns",
    "RankTrace",
    "SymbolTable",
    "Table",
    "Timeline",
    "TraceAnalysis",
    "TraceSet",
    "analyze_traces",
    "collective_timing",
    "comm_overlap",
    "counterfactuals",
    "find_trace_files",
    "idle_by_stream",
    "idle_causes",
    "idle_segments",
    "load_traces",
    "normalize_collective",
    "rank_collectives",
    "rank_timeline",
    "step_spans",
    "step_table",
    "stragglers",
    "temporal_breakdown",
    "top_kernels",
    "trace_findings",
]
