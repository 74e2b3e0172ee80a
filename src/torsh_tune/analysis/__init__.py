"""Run analysis: load a run directory into DataFrames, diagnose it, recommend changes.

Pure: pandas, numpy and pyarrow only (never torch), so reports and the CLI can use it on
any machine.
"""

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
    "CATEGORIES",
    "EFFORTS",
    "PHASES",
    "SEVERITIES",
    "Bottleneck",
    "Breakdown",
    "CommStats",
    "GainRange",
    "MemoryStats",
    "Recommendation",
    "RunAnalysis",
    "StepStats",
    "StragglerStats",
    "SystemStats",
]
