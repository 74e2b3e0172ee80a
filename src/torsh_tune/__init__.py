"""torsh-tune: profile, diagnose and tune PyTorch distributed training."""

from .config import RunConfig, StrategyConfig
from .errors import ConfigError, LaunchError, TorshTuneError, TrialError

__version__ = "0.1.0"

__all__ = ["ConfigError", "LaunchError", "RunConfig", "StrategyConfig", "TorshTuneError", "TrialError", "__version__"]
