"""torsh-tune: profile, diagnose and tune PyTorch distributed training.

`parallelize` and `train_step` (API mode) import torch on first use only, so that the
torch-free layers (analysis, reports, dashboard, autotune) stay torch-free.
"""

from typing import Any

from .config import RunConfig, StrategyConfig, StudyConfig
from .errors import ConfigError, LaunchError, TorshTuneError, TrialError

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "LaunchError",
    "RunConfig",
    "StrategyConfig",
    "StudyConfig",
    "TorshTuneError",
    "TrialError",
    "__version__",
    "count_tokens",
    "data_parallel_info",
    "parallelize",
    "train_step",
]


def __getattr__(name: str) -> Any:
    if name in ("parallelize", "train_step", "data_parallel_info", "count_tokens", "PipelineModule"):
        from .runtime import api

        return getattr(api, name)
    raise AttributeError(f"module 'torsh_tune' has no attribute {name!r}")
