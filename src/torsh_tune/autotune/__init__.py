"""The autotuner: search space, objective, trial runner and the Optuna study (ask/tell).

Imports optuna lazily (only when a study or trial is made) and never torch.

Example:
    >>> from torsh_tune.autotune import tune  # doctest: +SKIP
    >>> result = tune("train.py", [], base_config=cfg, study_dir="runs/tune", n_trials=8)  # doctest: +SKIP
    >>> result.best_speedup, result.best_ci  # doctest: +SKIP
"""

from .objective import Measurement, Throughput, loss_by_step, loss_deviation, measure_run, throughput_of
from .runner import MeasuredRun, fresh_run_dir, run_measured
from .seeding import advisor_params
from .space import BASELINE_PARAMS, Dimension, SearchSpace, build_space, load_space_file, parse_space
from .study import SAMPLERS, BaselineStats, Confirmation, TrialResult, TuneResult, make_sampler, tune

__all__ = [
    "BASELINE_PARAMS",
    "SAMPLERS",
    "BaselineStats",
    "Confirmation",
    "Dimension",
    "MeasuredRun",
    "Measurement",
    "SearchSpace",
    "Throughput",
    "TrialResult",
    "TuneResult",
    "advisor_params",
    "build_space",
    "fresh_run_dir",
    "load_space_file",
    "loss_by_step",
    "loss_deviation",
    "make_sampler",
    "measure_run",
    "parse_space",
    "run_measured",
    "throughput_of",
    "tune",
]
