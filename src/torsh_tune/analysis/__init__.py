"""Run analysis: load a run directory into DataFrames, diagnose it, recommend changes.

Pure: pandas, numpy and pyarrow only (never torch), so reports and the CLI can use it on
any machine.

Example:
    >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
    >>> a = analyze_run("runs/20250101-120000-train-ab12")  # doctest: +SKIP
    >>> [(b.category, b.severity) for b in a.bottlenecks]  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import Any

# Attributes load their module on first use (PEP 562): `torsh_tune.analysis.traces` and
# other numpy-only users must not pay for the pandas-based run analyzers (~80 MB, ~0.3 s).
_LAZY = {
    "strategy_advice": "._advice",
    "ALERT_KINDS": "._alerts",
    "ALERT_SEVERITIES": "._alerts",
    "Alert": "._alerts",
    "find_alerts": "._alerts",
    "analyze_run": "._analyze",
    "run_thresholds": "._analyze",
    "diagnose": "._bottlenecks",
    "aligned_collectives": "._comm",
    "bus_factor": "._comm",
    "comm_stats": "._comm",
    "on_one_clock": "._clocks",
    "kinds_beyond_ddp": "._types",
    "RunFrames": "._load",
    "compact_run": "._load",
    "load_run": "._load",
    "choose_num_workers": "._recommend",
    "recommend": "._recommend",
    "run_self_checks": "._selfcheck",
    "self_check": "._selfcheck",
    "trace_windows": "._selfcheck",
    "checkpoint_saves": "._resources",
    "data_wait_by_rank": "._resources",
    "evaluation_passes": "._resources",
    "loader_restarts": "._resources",
    "redundant_syncs": "._comm",
    "memory_stats": "._resources",
    "system_stats": "._resources",
    "breakdown": "._steps",
    "measured": "._steps",
    "phase_frame": "._steps",
    "comm_timed": "._steps",
    "step_stats": "._steps",
    "traced_left_out": "._steps",
    "untraced": "._steps",
    "steady_rate": "._steps",
    "planned_steps": "._steps",
    "straggler_stats": "._stragglers",
    "Bottleneck": "._types",
    "Breakdown": "._types",
    "CATEGORIES": "._types",
    "CommStats": "._types",
    "EFFORTS": "._types",
    "GainRange": "._types",
    "MemoryStats": "._types",
    "PHASES": "._types",
    "Recommendation": "._types",
    "RunAnalysis": "._types",
    "SELF_CHECK_METRICS": "._types",
    "SEVERITIES": "._types",
    "SelfCheck": "._types",
    "StepStats": "._types",
    "StragglerStats": "._types",
    "SystemStats": "._types",
}

__all__ = [
    "ALERT_KINDS",
    "ALERT_SEVERITIES",
    "CATEGORIES",
    "EFFORTS",
    "PHASES",
    "SELF_CHECK_METRICS",
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
    "SelfCheck",
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
    "checkpoint_saves",
    "data_wait_by_rank",
    "diagnose",
    "evaluation_passes",
    "find_alerts",
    "loader_restarts",
    "redundant_syncs",
    "kinds_beyond_ddp",
    "load_run",
    "measured",
    "memory_stats",
    "on_one_clock",
    "phase_frame",
    "comm_timed",
    "recommend",
    "run_self_checks",
    "run_thresholds",
    "self_check",
    "planned_steps",
    "steady_rate",
    "step_stats",
    "traced_left_out",
    "untraced",
    "straggler_stats",
    "strategy_advice",
    "system_stats",
    "trace_windows",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
