"""Run analysis: load a run directory into DataFrames, diagnose it, recommend changes.

Pure: pandas, numpy and pyarrow only (never torch), so reports and the CLI can use it on
any machine.

Example:
    >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
    >>> a = analyze_run("runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> [(b.category, b.severity) for b in a.bottlenecks]  # doctest: +SKIP
"""

from ._advice import strategy_advice
from ._alerts import ALERT_KINDS, ALERT_SEVERITIES, Alert, find_alerts
from ._analyze import analyze_run, run_thresholds
from ._bottlenecks import diagnose
from ._comm import aligned_collectives, bus_factor, comm_stats
from ._load import RunFrames, compact_run, load_run
from ._recommend import choose_num_workers, recommend
from ._resources import data_wait_by_rank, memory_stats, system_stats
from ._steps import breakdown, measured, phase_frame, step_stats
from ._stragglers import straggler_stats
from ._types import (
    CATEGORIES,
    EFFORTS,
    PHASES,
    SEVERITIES,
    Bottleneck,
    Breakdown,
    CommStats,
    GainRange,
    MemoryStats,
    Recommendation,
    RunAnalysis,
    StepStats,
    StragglerStats,
    SystemStats,
)

__all__ = [
    "ALERT_KINDS",
    "ALERT_SEVERITIES",
    "CATEGORIES",
    "EFFORTS",
    "PHASES",
    "SEVERITIES",
    "Alert",
    "Bottleneck",
    "Breakdown",
    "CommStats",
    "GainRange",
    "MemoryStats",
    "Recommendation",
    "RunAnalysis",
    "RunFrames",
    "StepStats",
    "StragglerStats",
    "SystemStats",
    "aligned_collectives",
    "analyze_run",
    "breakdown",
    "bus_factor",
    "choose_num_workers",
    "comm_stats",
    "compact_run",
    "data_wait_by_rank",
    "diagnose",
    "find_alerts",
    "load_run",
    "measured",
    "memory_stats",
    "phase_frame",
    "recommend",
    "run_thresholds",
    "step_stats",
    "straggler_stats",
    "strategy_advice",
    "system_stats",
]
