"""The autotuner: search space, objective, trial runner and the Optuna study (ask/tell).

Imports optuna lazily (only when a study or trial is made) and never torch.

Example:
    >>> from torsh_tune.autotune import tune  # doctest: +SKIP
    >>> from torsh_tune.config import StudyConfig  # doctest: +SKIP
    >>> result = tune("train.py", [], base_config=cfg, study=StudyConfig(n_trials=8), study_dir="runs/tune")  # doctest: +SKIP
    >>> result.best_speedup, result.best_ci  # doctest: +SKIP
"""

from .dataguard import DataCheck, check_data, run_fingerprints
from .objective import (
    LOSS_TEST_ALPHA,
    LossCheck,
    Measurement,
    Throughput,
    loss_by_step,
    loss_check,
    loss_deviation,
    measure_run,
    per_step_throughput,
    running_throughput,
    steady_rate,
    throughput_of,
    trial_constraints,
)
from .predict import (
    UNPREDICTABLE_METHODS,
    ModelCandidate,
    Prediction,
    StepInputs,
    model_candidates,
    predict_ddp_step,
    predict_params,
    step_inputs,
)
from .pruning import PRUNERS, StepRecordReader, TrialPruning, make_pruner
from .runner import MeasuredRun, fresh_run_dir, run_measured
from .seeding import advisor_params
from .space import BASELINE_PARAMS, Dimension, SearchSpace, build_space, load_space_file, parse_space
from .study import (
    OBJECTIVES,
    SAMPLERS,
    BaselineStats,
    Confirmation,
    ParetoTrial,
    TrialResult,
    TuneResult,
    make_sampler,
    tune,
)

__all__ = [
    "BASELINE_PARAMS",
    "LOSS_TEST_ALPHA",
    "OBJECTIVES",
    "PRUNERS",
    "SAMPLERS",
    "BaselineStats",
    "Confirmation",
    "DataCheck",
    "Dimension",
    "LossCheck",
    "MeasuredRun",
    "Measurement",
    "ModelCandidate",
    "ParetoTrial",
    "Prediction",
    "SearchSpace",
    "StepInputs",
    "StepRecordReader",
    "Throughput",
    "TrialPruning",
    "TrialResult",
    "TuneResult",
    "UNPREDICTABLE_METHODS",
    "advisor_params",
    "build_space",
    "check_data",
    "fresh_run_dir",
    "load_space_file",
    "loss_by_step",
    "loss_check",
    "loss_deviation",
    "make_pruner",
    "make_sampler",
    "measure_run",
    "model_candidates",
    "parse_space",
    "per_step_throughput",
    "predict_ddp_step",
    "predict_params",
    "run_fingerprints",
    "run_measured",
    "running_throughput",
    "steady_rate",
    "step_inputs",
    "throughput_of",
    "trial_constraints",
    "tune",
]
