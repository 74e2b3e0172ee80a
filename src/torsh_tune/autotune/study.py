"""The Optuna study: baseline, search (ask/tell), confirmation, results.

    baseline x R  ->  noise = (max - min) / median of the R baseline throughputs
    trial 0 = PyTorch defaults (enqueued), then `initial_params` and the strategy advisor's
              zero-code candidates for the baseline run (enqueued), then the sampler's
              trials, each a fresh launch; a running trial reports its running median
              throughput per measured step and the pruner (`pruning.py`, opt-in) may stop it
              each completed trial passes the data guard (`dataguard.py`: it read the
              baseline's data, else FAIL and its knob leaves the space) and the loss guard
              (`objective.loss_check`: worse than the baseline beyond its repeats' spread
              violates the "loss_deviation" constraint)
    confirmation: top K feasible trials, each against the baseline interleaved A B A B ...
                  paired speedup = median of per-pair ratios, bootstrap 95 % CI
    ablation:     the best confirmed winner rounded (2 significant figures) and reduced to the
                  changes whose removal costs speed beyond noise, each with its share of
                  the speedup (`ablation.py`), re-checked against the baseline
    best.toml     that minimal configuration (or the baseline when nothing was confirmed)

Objectives: throughput alone (maximise), or throughput and loss (`objectives=("throughput",
"loss")`: maximise throughput, minimise the relative loss deviation from the baseline, the
number the loss constraint also uses). With two objectives the study's best is a Pareto front
(`TuneResult.pareto`), its fastest feasible members are confirmed, and there is no pruning
(Optuna cannot prune multi-objective studies).

A candidate is called better only when its CI lower bound is above 1 *and* its paired
speedup exceeds the baseline noise; no speedup is reported that the confirmation did not
support.

Example:
    >>> from torsh_tune.config import RunConfig, LaunchConfig
    >>> from torsh_tune.config import StudyConfig
    >>> result = tune("train.py", [], base_config=RunConfig(launch=LaunchConfig(nproc_per_node=2)),
    ...               study=StudyConfig(n_trials=8), study_dir="runs/tune-1")  # doctest: +SKIP
    >>> result.best_speedup, result.best_ci  # doctest: +SKIP
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..config import STUDY_DEFAULT_STEPS, STUDY_SAMPLERS, RunConfig, StudyConfig, dump_toml
from ..errors import ConfigError, TrialError, invalid
from ..fabric import CommModel, load_model
from ..launch.warm import WarmAgents
from ..rundir import RunDir, StudyDir, write_json_atomic, write_text_atomic
from .ablation import Ablation, PairedRuns, ablate, paired_stats
from .dataguard import DataCheck, check_data, run_fingerprints
from .objective import effective_settings, loss_check, loss_deviation, recorded_ddp, trial_constraints
from .pruning import TrialPruning, study_pruner
from .runner import MeasuredRun, fresh_run_dir, run_measured
from .seeding import asked_for, seed_study
from .space import SearchSpace, build_space
from .storage import open_storage

__all__ = [
    "OBJECTIVES",
    "SAMPLERS",
    "BaselineStats",
    "Confirmation",
    "ParetoTrial",
    "TrialResult",
    "TuneResult",
    "make_sampler",
    "tune",
]

SAMPLERS = STUDY_SAMPLERS

#: Objective name -> Optuna direction. "throughput": median steady-state samples/s (tokens/s
#: when the script counts tokens: `torsh_tune.count_tokens`);
#: "loss": relative deviation of the mean loss from the baseline's over their common steps.
OBJECTIVES = {"throughput": "maximize", "loss": "minimize"}


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """One optimisation trial as recorded in the study.

    Attributes:
        number: Optuna trial number (0 is PyTorch's defaults).
        params: Every dimension's value, fixed ones included.
        state: Optuna state name: COMPLETE, FAIL, PRUNED, RUNNING, ...
        samples_s: Steady-state throughput (the objective: `objective.steady_rate`), None unless COMPLETE.
        iqr_samples_s: Spread of the per-step throughput within the run.
        loss_deviation: Relative deviation of the mean loss from the baseline's (the
            second objective of a throughput+loss study).
        loss_check: The loss guard's test (`objective.LossCheck.to_dict()`: delta_rel,
            threshold_rel, margin_rel, noise_rel, ...), None when no loss was comparable.
        constraint_status: "feasible", "violated", or "" (not evaluated: failed or pruned trial).
        constraints: Constraint name -> value (<= 0 is feasible), as told to Optuna.
        failure_reason: One line for a FAIL, or why a PRUNED trial was pruned
            ("pruned at step N: X samples/s vs median Y (K completed trials)").
        stderr_tail: Last log lines of the failing rank.
        run_dir: The trial's run directory.
        role: Why the trial was enqueued: "pytorch-defaults", "initial", "advisor" (the
            strategy advisor's candidate), "model" (predicted fast by the bench's
            alpha-beta model), or "" for the sampler's.
        peak_mem_bytes: Largest peak memory of any rank (RSS on CPU), None unless measured.
        intermediate_samples_s: Measured-step index -> steady-state rate so far, as
            reported to the pruner (single-objective studies).
    """

    number: int
    params: dict[str, Any]
    state: str
    samples_s: float | None = None
    iqr_samples_s: float | None = None
    loss_deviation: float | None = None
    loss_check: dict[str, Any] | None = None
    constraint_status: str = ""
    constraints: dict[str, float] = field(default_factory=dict)
    failure_reason: str = ""
    stderr_tail: tuple[str, ...] = ()
    run_dir: str = ""
    role: str = ""
    peak_mem_bytes: int | None = None
    intermediate_samples_s: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ParetoTrial:
    """A trial on the Pareto front of a multi-objective study (feasible trials only).

    Attributes:
        number: Its trial number.
        params: Its parameters.
        values: Objective name -> value ("throughput": samples/s, "loss": relative deviation).
    """

    number: int
    params: dict[str, Any]
    values: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class BaselineStats:
    """The baseline (the user's config as it is) measured `baseline_repeats` times.

    Attributes:
        samples_s: Throughput of each successful repeat.
        median_samples_s: Their median.
        noise_rel: (max - min) / median: the run-to-run noise a trial must beat.
        run_dirs: Run directory of every repeat.
        max_microbatches: Largest micro-batches per step seen (static_graph is offered only at 1).
        unit: The throughput unit of the whole study: "tokens/s" when the script counts
            tokens (`torsh_tune.count_tokens`), else "samples/s" (`samples_s` fields hold it).
        loss_noise_rel: Run-to-run spread of the mean loss (sd of the repeats' means relative
            to their mean; `objective.LossCheck`), None with fewer than two repeats with a loss.
    """

    samples_s: tuple[float, ...]
    median_samples_s: float
    noise_rel: float
    run_dirs: tuple[str, ...]
    max_microbatches: int | None
    unit: str = "samples/s"
    loss_noise_rel: float | None = None


@dataclass(frozen=True, kw_only=True)
class Confirmation:
    """A candidate re-run against the baseline, interleaved A B A B ...

    Attributes:
        trial_number: The candidate's trial.
        params: Its parameters.
        ratios: Candidate / baseline throughput of each successful pair.
        speedup: Median of `ratios`, None without a successful pair.
        ci_low: Bootstrap 95 % CI of the median ratio, lower bound.
        ci_high: Upper bound.
        better: CI lower bound > 1 and speedup - 1 > baseline noise.
        run_dirs: (baseline, candidate) run directories per pair.
        failures: Why pairs were dropped.
    """

    trial_number: int
    params: dict[str, Any]
    ratios: tuple[float, ...]
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    better: bool
    run_dirs: tuple[tuple[str, str], ...] = ()
    failures: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What a study produced.

    Attributes:
        study_name: Optuna study name.
        storage: Optuna storage URL.
        study_dir: Where trials/, baseline/, confirm/ and the result files live.
        baseline: The baseline measurement and noise.
        trials: Every trial of the study (also those of earlier, resumed sessions).
        confirmations: One per confirmed candidate.
        best_trial: The confirmed best trial's number, None when nothing was confirmed.
        best_params: The parameters best.toml holds: the winner's minimal set after the ablation
            ({} for the baseline).
        best_speedup: Their confirmed paired speedup, None when nothing was confirmed.
        best_ci: Its 95 % CI, None when nothing was confirmed.
        best_config: The config written to best.toml (the base config when nothing won).
        interrupted: The study was stopped by Ctrl-C/SIGTERM during a run.
        files: Name -> path of best.toml, trials.csv, trials.parquet, result.json.
        objectives: The study's objectives, e.g. ("throughput",) or ("throughput", "loss").
        pareto: The Pareto front, fastest first (multi-objective studies; empty otherwise).
        confirmation_notes: Why top trials were passed over for the confirmation (e.g. a
            trial that ran with the baseline's own settings: its lead can only be noise).
        data_guard: Knob -> {"trial", "reason"}: the knobs that changed the data the ranks
            read (`dataguard.check_data`) and left the search space at that trial.
        ablation: The confirmed winner reduced to the changes that earn its speedup, each
            kept knob's share (`ablation.Ablation`); None when nothing was confirmed or the
            ablation is off. When its minimal configuration is confirmed (`better`), it is
            `best_params`/best.toml and its re-check gives `best_speedup`/`best_ci`.
    """

    study_name: str
    storage: str
    study_dir: str
    baseline: BaselineStats
    trials: tuple[TrialResult, ...]
    confirmations: tuple[Confirmation, ...]
    best_trial: int | None
    best_params: dict[str, Any]
    best_speedup: float | None
    best_ci: tuple[float, float] | None
    best_config: RunConfig
    interrupted: bool = False
    files: dict[str, str] = field(default_factory=dict)
    objectives: tuple[str, ...] = ("throughput",)
    pareto: tuple[ParetoTrial, ...] = ()
    confirmation_notes: tuple[str, ...] = ()
    data_guard: dict[str, dict[str, Any]] = field(default_factory=dict)
    ablation: Ablation | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["best_config"] = self.best_config.to_dict()
        return d


def make_sampler(name: str, *, seed: int | None, n_trials: int | None = None):
    """The Optuna sampler called `name` (one of `SAMPLERS`).

    TPE's random start-up is scaled to the budget (`n_trials // 5`, between 3 and Optuna's
    10): with the default 10, a 20-trial study is random search for half its trials.
    Measured on the 1 Gbit/s comm-bound grid (benchmarks/tuner_efficiency.py, 1000 seeds):
    95 % of the optimum within 9 trials for 78-80 % of seeds instead of 60 %.

    Raises:
        ConfigError: Unknown name, or its optional dependency (scipy for gp, cmaes for
            cmaes) is not installed: said before any run starts.
    """
    import optuna

    if name == "tpe":
        startup = 10 if n_trials is None else min(10, max(3, n_trials // 5))
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "gp":
        if importlib.util.find_spec("scipy") is None:
            raise invalid("--sampler gp", "used with scipy installed (pip install scipy)", name)
        return optuna.samplers.GPSampler(seed=seed)
    if name == "cmaes":
        if importlib.util.find_spec("cmaes") is None:
            raise invalid("--sampler cmaes", "used with the cmaes package installed (pip install cmaes)", name)
        return optuna.samplers.CmaEsSampler(seed=seed)
    raise invalid("--sampler", f"one of {list(SAMPLERS)}", name)


def tune(
    script: str | os.PathLike[str],
    script_args: Sequence[str] = (),
    *,
    base_config: RunConfig,
    study: StudyConfig | None = None,
    study_dir: str | os.PathLike[str],
    space_spec: Mapping[str, Any] | None = None,
    cuda: bool = False,
    cpu_count: int | None = None,
    initial_params: Sequence[Mapping[str, Any]] = (),
    echo: Callable[[str], None] | None = None,
    on_trial: Callable[[TrialResult], None] | None = None,
    on_run: Callable[[str, MeasuredRun], None] | None = None,
) -> TuneResult:
    """Tune `script` under torchrun: baseline, Optuna search, confirmation, ablation, best.toml.

    Re-opening the same `study.storage`/`study.study_name` resumes: the stored baseline is
    reused, trials left RUNNING by a killed tuner are marked FAIL, and trials continue until
    the study holds `study.n_trials` finished trials.

    Args:
        script: The user's training script.
        script_args: Its arguments, passed through untouched.
        base_config: The user's configuration (launch, profiler, strategy); the baseline.
        study: How to search, measure, guard and confirm (`config.StudyConfig`, validated here;
            default StudyConfig()).
        study_dir: Directory of the study (created): baseline/, trials/NNNN/, confirm/,
            ablation/, study.db, best.toml, trials.csv, result.json (`rundir.StudyDir`).
        space_spec: Dimension overrides (`space.parse_space` / `space.load_space_file`).
        cuda: The ranks use CUDA (offers pin_memory).
        cpu_count: Host cores (default os.cpu_count()).
        initial_params: Further parameter sets enqueued after trial 0. The strategy
            advisor's candidates for the baseline run that the space can express follow
            them (user attrs role "advisor" and advisor_rank; see `seeding.advisor_params`).
        echo: Receives the ranks' output lines (default: discarded).
        on_trial: Called with each finished optimisation trial.
        on_run: Called with ("baseline" | "confirm-A" | "confirm-B" | "ablation-A" |
            "ablation-B", run) for the other runs.

    Returns:
        The TuneResult (also written to STUDY_DIR/result.json).

    Raises:
        ConfigError: Invalid study options, space, sampler or pruner; objectives that differ
            from a resumed study's; the loss objective without a baseline loss.
        TrialError: No baseline run succeeded (the script fails under the base config).
    """
    study = (study or StudyConfig()).validate()
    if not Path(script).is_file():
        raise invalid("script", "an existing file", str(script))
    session = _open_session(script, script_args, base_config=base_config, study=study, study_dir=study_dir,
                            echo=echo, on_run=on_run)
    session.agents = WarmAgents() if study.warm_agent else None
    try:
        return _tune(session, base_config, study, space_spec=space_spec, cuda=cuda, cpu_count=cpu_count,
                     initial_params=initial_params, on_trial=on_trial)
    finally:
        if session.agents is not None:
            session.agents.close()


def _tune(session: "_Session", base_config: RunConfig, study: StudyConfig, *, space_spec: Mapping[str, Any] | None,
          cuda: bool, cpu_count: int | None, initial_params: Sequence[Mapping[str, Any]],
          on_trial: Callable[[TrialResult], None] | None) -> TuneResult:
    """`tune` past opening its session: baseline, search, confirmation, ablation, the result."""
    stored = _baseline(session)
    if "loss" in study.objectives and not stored["loss"]:
        raise invalid("objectives", "('throughput',) when the baseline records no loss "
                      "(its script must call backward on a scalar loss)", tuple(study.objectives))
    baseline = _baseline_stats(stored)
    session.unit = baseline.unit
    space = build_space(
        nproc_per_node=base_config.launch.nproc_per_node, cpu_count=cpu_count, cuda=cuda,
        baseline_num_microbatches=baseline.max_microbatches, include_compression=study.include_compression,
        spec=space_spec, base=base_config, api_mode=study.api_mode, allow_batch_changes=study.allow_batch_changes,
        baseline_buffers=recorded_ddp(stored["run_dirs"]))
    seed_study(session.optuna, space, stored["run_dirs"], initial_params, comm_model=session.comm_model,
               reference_bench=study.reference_bench)
    _search(session, space, stored, on_trial=on_trial)
    trials = tuple(_trial_result(t) for t in session.optuna.get_trials(deepcopy=False))
    pareto = _pareto(session.optuna, study.objectives) if session.multi else ()
    rng = np.random.default_rng(study.seed)
    confirmations, confirm_notes = _confirm(session, space, trials, pareto, baseline, rng)
    best, ablation = _ablate_winner(session, space, confirmations, baseline, rng)
    return _write_result(session, base_config, space, baseline, trials, pareto, confirmations, confirm_notes, best,
                         ablation)


@dataclass(kw_only=True)
class _Session:
    """One tuner's study in progress: what every phase needs, and whether it was interrupted."""

    opts: StudyConfig
    optuna: Any  # optuna.Study
    storage_url: str
    layout: StudyDir
    run_config: RunConfig
    script: str | os.PathLike[str]
    script_args: Sequence[str]
    comm_model: CommModel | None
    echo: Callable[[str], None] | None
    on_run: Callable[[str, MeasuredRun], None] | None
    num_ranks: int
    prune_percentile: float
    t_start: float
    unit: str = "samples/s"
    interrupted: bool = False
    agents: WarmAgents | None = None  # forks each run's torchrun agent with torch imported (study.warm_agent)

    @property
    def multi(self) -> bool:
        return len(self.opts.objectives) > 1

    def launch(self, config: RunConfig, where: str, name: str, *, trial: Any = None) -> MeasuredRun:
        """One run; an optimisation trial's (single objective) reports to the pruner."""
        run_dir = fresh_run_dir(self.layout.runs(where), name)
        watch = None
        if trial is not None and not self.multi:
            watch = TrialPruning(trial, run_dir.path, num_ranks=self.num_ranks, percentile=self.prune_percentile,
                                 unit=self.unit)
        run = run_measured(config, run_dir, self.script, self.script_args, echo=self.echo, should_prune=watch,
                           agents=self.agents)
        if watch is not None and run.state == "COMPLETE":
            watch.finish()  # every index, so later trials are compared at any step
        return run

    def _launch_pair(self, a_config: RunConfig, b_config: RunConfig, where: str, name: str, *,
                     b_first: bool) -> tuple[MeasuredRun, MeasuredRun]:
        """A and B of one pair, B first when `b_first`; after an interrupted first run, it stands for both."""
        order = (("B", b_config), ("A", a_config)) if b_first else (("A", a_config), ("B", b_config))
        runs: dict[str, MeasuredRun] = {}
        for label, config in order:
            prev = next(iter(runs.values()), None)
            if prev is not None and prev.status == "interrupted":
                runs[label] = prev
                continue
            runs[label] = self.launch(config, where, f"{name}-{label}")
            if self.on_run:
                self.on_run(f"{where}-{label}", runs[label])
        return runs["A"], runs["B"]

    def paired(self, a_config: RunConfig, b_config: RunConfig, where: str, name: str, pairs: int,
               stop: Callable[[Sequence[float], int], bool] | None = None) -> PairedRuns:
        """A and B interleaved (A B, B A, A B ...): B / A throughput per pair (A is the baseline side).

        `stop(ratios, pairs)` ends the pairs early once the measured ones decide the verdict.
        """
        ratios, dirs, failures = [], [], []
        for i in range(pairs):
            if stop is not None and stop(ratios, pairs):
                break
            # The order alternates (A then B, then B then A): a host that drifts within a pair (page
            # cache, clocks, a neighbour's load) would otherwise bias every ratio the same way, which
            # no CI over the pairs can see (an ablation once kept fp16 at 1.050, 1.059, 1.061).
            a, b = self._launch_pair(a_config, b_config, where, f"{name}-{i}", b_first=i % 2 == 1)
            dirs.append((a.run_dir, b.run_dir))
            if "interrupted" in (a.status, b.status):
                return PairedRuns(ratios=tuple(ratios), run_dirs=tuple(dirs), failures=tuple(failures),
                                  interrupted=True)
            if a.samples_s and b.samples_s and _unit_of(a) == _unit_of(b) == self.unit:
                ratios.append(b.samples_s / a.samples_s)
            elif a.samples_s and b.samples_s:
                failures.append(f"pair {i}: the runs measured {_unit_of(a)} and {_unit_of(b)}, the study {self.unit}")
            else:
                failures.append(f"pair {i}: " + "; ".join(
                    f"{role} {r.failure_reason}" for role, r in (("A", a), ("B", b)) if r.state != "COMPLETE"))
        return PairedRuns(ratios=tuple(ratios), run_dirs=tuple(dirs), failures=tuple(failures))


def _open_session(script: str | os.PathLike[str], script_args: Sequence[str], *, base_config: RunConfig,
                  study: StudyConfig, study_dir: str | os.PathLike[str], echo: Callable[[str], None] | None,
                  on_run: Callable[[str, MeasuredRun], None] | None) -> _Session:
    """The Optuna study created or resumed (its stale trials failed, their runs stopped), and the run budget."""
    import optuna

    objectives = tuple(study.objectives)
    optuna_sampler = make_sampler(study.sampler, seed=study.seed, n_trials=study.n_trials)
    comm_model = load_model(study.reference_bench) if study.reference_bench is not None else None
    run_config = _budgeted(base_config, steps=study.steps, warmup_steps=study.warmup_steps,
                           timeout_s=study.trial_timeout_s)
    optuna_pruner, prune_percentile = study_pruner(
        study.pruner, measured_steps=run_config.budget.steps, percentile=study.pruner_percentile,
        warmup_steps=study.pruner_warmup_steps, startup_trials=study.pruner_startup_trials)
    root = Path(study_dir)
    root.mkdir(parents=True, exist_ok=True)
    storage_url, storage_obj = open_storage(study.storage, root)
    t_start = time.monotonic()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ostudy = optuna.create_study(
        study_name=study.study_name,
        storage=storage_obj if storage_obj is not None else storage_url,
        sampler=optuna_sampler,
        pruner=optuna_pruner,
        directions=[OBJECTIVES[o] for o in objectives],
        load_if_exists=True,
    )
    # An existing study keeps its directions whatever was asked: refuse a mismatch.
    if [d.name.lower() for d in ostudy.directions] != [OBJECTIVES[o] for o in objectives]:
        stored_objectives = tuple(ostudy.user_attrs.get("objectives", ("throughput",)))
        raise invalid("objectives", f"the resumed study's {stored_objectives}", objectives)
    ostudy.set_user_attr("objectives", list(objectives))
    _fail_stale_trials(ostudy)
    _stop_stale_runs(root)
    # On several nodes only this node's ranks may write into the run directory.
    num_ranks = run_config.world_size if run_config.launch.nnodes == 1 else run_config.launch.nproc_per_node
    return _Session(opts=study, optuna=ostudy, storage_url=storage_url, layout=StudyDir(root), run_config=run_config,
                    script=script, script_args=script_args, comm_model=comm_model, echo=echo, on_run=on_run,
                    num_ranks=num_ranks, prune_percentile=prune_percentile, t_start=t_start)


def _baseline(s: _Session) -> dict[str, Any]:
    """The baseline repeats (or the resumed study's stored ones): throughputs, loss curves, run dirs."""
    stored = s.optuna.user_attrs.get("baseline")
    if stored is not None:
        return stored
    runs = []
    for i in range(s.opts.baseline_repeats):
        run = s.launch(s.run_config, "baseline", f"{i:02d}")
        runs.append(run)
        if s.on_run:
            s.on_run("baseline", run)
        if run.status == "interrupted":
            s.interrupted = True
            break
    good = [r for r in runs if r.state == "COMPLETE"]
    if s.interrupted and not good:
        raise KeyboardInterrupt  # Ctrl-C before anything was measured: nothing to tune against
    if not good:
        first = runs[0]
        raise TrialError(f"the baseline run must succeed, but got {first.failure_reason} (see {first.run_dir})")
    units = sorted({r.measurement.throughput.unit for r in good})
    if len(units) > 1:
        raise TrialError(f"the baseline runs must measure one throughput unit, but got {units} "
                         "(count tokens on every step of every run, or never)")
    loss = pd.concat([r.measurement.loss for r in good]).groupby(level=0).mean()
    micro = [r.measurement.max_microbatches for r in good if r.measurement.max_microbatches is not None]
    stored = {
        "unit": units[0],
        "samples_s": [r.samples_s for r in good],
        "run_dirs": [r.run_dir for r in runs],
        "loss": {str(int(k)): float(v) for k, v in loss.items()},
        # Each repeat's own curve: their spread calibrates the loss guard.
        "loss_runs": [{str(int(k)): float(v) for k, v in r.measurement.loss.items()} for r in good],
        "max_microbatches": max(micro) if micro else None,
    }
    s.optuna.set_user_attr("baseline", stored)
    return stored


def _search(s: _Session, space: SearchSpace, stored: Mapping[str, Any], *,
            on_trial: Callable[[TrialResult], None] | None) -> None:
    """Ask, launch, guard and tell trials until the study holds `n_trials` finished ones (or time or Ctrl-C)."""
    from optuna.trial import TrialState

    from ..launch import process_identity

    opts = s.opts
    baseline_loss = pd.Series({int(k): v for k, v in stored["loss"].items()}, dtype=float)
    # A study stored before the per-repeat curves were kept: the mean curve alone (no spread).
    baseline_losses = [pd.Series({int(k): v for k, v in run.items()}, dtype=float)
                       for run in stored.get("loss_runs", [stored["loss"]])]
    baseline_data = [run_fingerprints(d) for d in stored["run_dirs"] if Path(d).is_dir()]
    trial0 = space.baseline_params()

    def data_guard(run: MeasuredRun, params: Mapping[str, Any]) -> DataCheck:
        changed = {k: v for k, v in params.items() if k not in trial0 or trial0[k] != v}
        return check_data(run_fingerprints(run.run_dir), baseline_data, changed=changed,
                          allow_batch_changes=opts.allow_batch_changes)

    def finished() -> int:
        return len(s.optuna.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL,
                                                                TrialState.PRUNED)))

    tuner = process_identity()
    while not s.interrupted and finished() < opts.n_trials:
        if opts.timeout_s is not None and time.monotonic() - s.t_start > opts.timeout_s:
            break
        trial = s.optuna.ask()
        trial.set_user_attr("tuner", tuner)  # a resuming or peer tuner tells live trials from stale ones
        # Knobs that changed the data in an earlier trial (of any tuner) are searched no more.
        excluded = {k: f"trial {v['trial']} changed the data: {v['reason']}"
                    for k, v in (s.optuna.user_attrs.get("data_guard") or {}).items()}
        try:
            s.interrupted = _run_trial(s.optuna, trial, space.without(excluded), s.run_config, s.launch,
                                       baseline_loss, baseline_losses, objectives=tuple(opts.objectives),
                                       loss_tolerance=opts.loss_tolerance, max_peak_mem_bytes=opts.max_peak_mem_bytes,
                                       unit=s.unit, data_guard=data_guard)
        except KeyboardInterrupt:
            # Ctrl-C between runs (during a run the supervisor turns it into "interrupted"):
            # the asked trial must not stay RUNNING, and the results are still written.
            trial.set_user_attr("failure_reason", "interrupted: the tuner was stopped")
            s.optuna.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            s.interrupted = True
        _report(s.optuna, trial.number, on_trial)


def _confirm(s: _Session, space: SearchSpace, trials: Sequence[TrialResult], pareto: Sequence[ParetoTrial],
             baseline: BaselineStats, rng: np.random.Generator) -> tuple[list[Confirmation], list[str]]:
    """The fastest feasible trials (the Pareto front's, with two objectives), each paired against the baseline."""
    confirmations: list[Confirmation] = []
    notes: list[str] = []
    if s.interrupted or s.opts.confirm_top <= 0:
        return confirmations, notes
    run_config = s.run_config
    base_dict = run_config.to_dict()
    seen: set[str] = set()
    candidates = []
    base_settings = _baseline_settings(baseline.run_dirs)
    on_front = {p.number for p in pareto}
    for t in sorted((t for t in trials if t.state == "COMPLETE" and t.constraint_status == "feasible"
                     and (not s.multi or t.number in on_front)),
                    key=lambda t: -(t.samples_s or 0.0)):
        key = json.dumps(t.params, sort_keys=True)
        # The baseline against itself confirms nothing: neither the same config nor one
        # that only spells out the defaults the baseline ran with (its recorded settings).
        if key in seen or space.to_config(run_config, t.params).to_dict() == base_dict:
            continue
        if base_settings is not None and t.run_dir and _settings_of(t.run_dir) == base_settings:
            notes.append(f"trial {t.number} not confirmed: it ran with the baseline's own settings "
                         f"({t.samples_s:.4g} vs {baseline.median_samples_s:.4g} {s.unit} is noise)")
            continue
        seen.add(key)
        candidates.append(t)
        if len(candidates) == s.opts.confirm_top:
            break
    for cand in candidates:
        runs = s.paired(run_config, space.to_config(run_config, cand.params), "confirm", f"{cand.number:04d}",
                        s.opts.confirm_pairs)
        confirmations.append(_confirmation(cand, runs, baseline.noise_rel, rng))
        if runs.interrupted:
            s.interrupted = True
            break
    return confirmations, notes


def _ablate_winner(s: _Session, space: SearchSpace, confirmations: Sequence[Confirmation], baseline: BaselineStats,
                   rng: np.random.Generator) -> tuple[Confirmation | None, Ablation | None]:
    """The best confirmed winner, and its ablation to the changes that earn its speedup (None: none run)."""
    winners = [c for c in confirmations if c.better]
    best = max(winners, key=lambda c: c.speedup) if winners else None
    pairs = s.opts.confirm_pairs if s.opts.ablation_pairs is None else s.opts.ablation_pairs
    if best is None or s.interrupted or pairs <= 0:
        return best, None
    reverted = space.normalize(space.baseline_params())

    def config_of(params: Mapping[str, Any]) -> RunConfig:
        # Every change reverted is the user's configuration itself (not trial 0's spelled-out defaults).
        return s.run_config if dict(params) == reverted else space.to_config(s.run_config, params)

    def measure(a: Mapping[str, Any], b: Mapping[str, Any], name: str,
                stop: Callable[[Sequence[float], int], bool] | None) -> PairedRuns:
        return s.paired(config_of(a), config_of(b), "ablation", f"{best.trial_number:04d}-{name}", pairs, stop)

    ablation = ablate(best.params, space.baseline_params(), trial_number=best.trial_number, space=space,
                      measure=measure, noise_rel=baseline.noise_rel, rng=rng, suspects=asked_for(s.optuna, space))
    s.interrupted = ablation.interrupted
    return best, ablation


def _write_result(s: _Session, base_config: RunConfig, space: SearchSpace, baseline: BaselineStats,
                  trials: tuple[TrialResult, ...], pareto: tuple[ParetoTrial, ...],
                  confirmations: Sequence[Confirmation], confirm_notes: Sequence[str], best: Confirmation | None,
                  ablation: Ablation | None) -> TuneResult:
    """The TuneResult, written with best.toml (the ablated winner, else the confirmed one, else the base config)."""
    best_params = dict(best.params) if best else {}
    best_speedup, best_ci = (best.speedup, (best.ci_low, best.ci_high)) if best else (None, None)
    if ablation is not None and ablation.better:
        best_params = dict(ablation.params)
        best_speedup, best_ci = ablation.speedup, (ablation.ci_low, ablation.ci_high)
    best_config = space.to_config(base_config, best_params) if best else base_config
    layout = s.layout
    result = TuneResult(
        study_name=s.opts.study_name,
        storage=s.storage_url,
        study_dir=str(layout.path),
        baseline=baseline,
        trials=trials,
        confirmations=tuple(confirmations),
        best_trial=best.trial_number if best else None,
        best_params=best_params,
        best_speedup=best_speedup,
        best_ci=best_ci,
        best_config=best_config,
        interrupted=s.interrupted,
        files={name: str(layout.file(name)) for name in StudyDir.RESULT_FILES},
        objectives=tuple(s.opts.objectives),
        pareto=pareto,
        confirmation_notes=tuple(confirm_notes),
        data_guard=dict(s.optuna.user_attrs.get("data_guard") or {}),
        ablation=ablation,
    )
    write_text_atomic(layout.best_toml, dump_toml(best_config))
    _write_trials_csv(layout.trials_csv, trials)
    write_json_atomic(layout.result_json, result.to_dict())
    return result


def _run_trial(study, trial, space: SearchSpace, run_config: RunConfig, launch, baseline_loss: pd.Series,
               baseline_losses: Sequence[pd.Series], *, objectives: tuple[str, ...], loss_tolerance: float,
               max_peak_mem_bytes: int | None, unit: str = "samples/s",
               data_guard: Callable[[MeasuredRun, Mapping[str, Any]], DataCheck]) -> bool:
    """Suggest, launch, measure and tell one trial; True when the run was interrupted.

    A trial whose data differs from the baseline's (`dataguard.check_data`) is a FAIL, and the
    knob that caused it is recorded in the study's user attr "data_guard" (knob -> trial, reason).
    """
    from optuna.trial import TrialState

    params = space.suggest(trial)
    trial.set_user_attr("config_params", params)
    try:
        config = space.to_config(run_config, params)
    except ConfigError as exc:
        trial.set_user_attr("status", "config_error")
        trial.set_user_attr("failure_reason", f"config_error: {exc}")
        study.tell(trial, state=TrialState.FAIL)
        return False
    run = launch(config, "trials", f"{trial.number:04d}", trial=trial)
    trial.set_user_attr("run_dir", run.run_dir)
    trial.set_user_attr("status", run.status)
    if run.state == "PRUNED":
        trial.set_user_attr("failure_reason", run.failure_reason)
        study.tell(trial, state=TrialState.PRUNED)
        return False
    if run.state != "COMPLETE":
        trial.set_user_attr("failure_reason", run.failure_reason)
        trial.set_user_attr("stderr_tail", list(run.stderr_tail))
        study.tell(trial, state=TrialState.FAIL)
        return run.status == "interrupted"
    m = run.measurement
    if m.throughput.unit != unit:
        trial.set_user_attr("failure_reason", f"objective_unit: the baseline measured {unit}, this trial "
                            f"{m.throughput.unit} (count tokens on every step of every run, or never)")
        study.tell(trial, state=TrialState.FAIL)
        return False
    data = data_guard(run, params)
    trial.set_user_attr("data_check", {"ok": data.ok, "reason": data.reason, "knob": data.knob,
                                       "notes": list(data.notes)})
    if not data.ok:
        trial.set_user_attr("failure_reason", data.reason)
        if data.knob is not None:
            guard = dict(study.user_attrs.get("data_guard") or {})
            guard.setdefault(data.knob, {"trial": trial.number, "reason": data.reason})
            study.set_user_attr("data_guard", guard)
        study.tell(trial, state=TrialState.FAIL)
        return False
    trial.set_user_attr("iqr_samples_s", m.throughput.iqr_samples_s)
    trial.set_user_attr("peak_mem_bytes", m.peak_mem_bytes)
    dev = loss_deviation(m.loss, baseline_loss)
    trial.set_user_attr("loss_deviation", dev)
    if dev is None:
        trial.set_user_attr("loss_check", "unavailable")
        if "loss" in objectives:
            trial.set_user_attr("failure_reason", "no_loss: the trial read no loss at the baseline's loss steps")
            study.tell(trial, state=TrialState.FAIL)
            return False
    check = loss_check(m.loss, baseline_losses, tolerance=loss_tolerance)
    if check is not None:
        trial.set_user_attr("loss_check", check.to_dict())
    constraints = trial_constraints(
        loss=check, lossy=params.get("compression.method", "none") != "none",
        peak_mem_bytes=m.peak_mem_bytes, max_peak_mem_bytes=max_peak_mem_bytes)
    for name, value in constraints.items():
        trial.set_constraint(name, value)
    values = {"throughput": run.samples_s, "loss": dev}
    study.tell(trial, [values[o] for o in objectives])
    return False


def _budgeted(base: RunConfig, *, steps: int | None, warmup_steps: int | None,
              timeout_s: float | None) -> RunConfig:
    """The base config with the tuner's per-run budget; the profiler must be on to measure, and fingerprint the data."""
    budget = {
        "steps": steps if steps is not None else (base.budget.steps or STUDY_DEFAULT_STEPS),
        "warmup_steps": warmup_steps if warmup_steps is not None else base.budget.warmup_steps,
    }
    if timeout_s is not None:
        budget["timeout_s"] = timeout_s
    return base.apply_patch({"budget": budget, "profiler": {"enabled": True, "data_fingerprint": True}})


def _baseline_stats(stored: Mapping[str, Any]) -> BaselineStats:
    values = [float(v) for v in stored["samples_s"]]
    median = float(np.median(values))
    noise = (max(values) - min(values)) / median if median > 0 else 0.0
    runs = [pd.Series({int(k): v for k, v in run.items()}, dtype=float) for run in stored.get("loss_runs", ())]
    # The spread of the repeats' own mean losses: a trial identical to one repeat is checked against the others.
    spread = loss_check(runs[0], runs, tolerance=1.0) if len(runs) >= 2 else None
    return BaselineStats(
        samples_s=tuple(values),
        median_samples_s=median,
        noise_rel=noise,
        run_dirs=tuple(stored["run_dirs"]),
        max_microbatches=stored.get("max_microbatches"),
        unit=str(stored.get("unit", "samples/s")),
        loss_noise_rel=spread.noise_rel if spread is not None else None,
    )


def _unit_of(run: MeasuredRun) -> str | None:
    m = run.measurement
    return m.throughput.unit if m is not None and m.throughput is not None else None


def _settings_of(run_dir: str) -> dict[str, Any] | None:
    try:
        return effective_settings(run_dir)
    except (OSError, ValueError):
        return None


def _baseline_settings(run_dirs: Sequence[str]) -> dict[str, Any] | None:
    """The settings the baseline ran with (its first run that recorded them)."""
    return next((s for s in map(_settings_of, run_dirs) if s is not None), None)


def _stop_stale_runs(root: Path) -> None:
    """Runs a killed tuner left behind (run.json still "running"): end their processes and record the stop.

    A run whose supervisor (run.json `supervisor`) still runs belongs to a live peer tuner.
    """
    from ..launch import classify_run, finish_run_info, kill_run_processes, process_alive, read_run_info

    for run_json in sorted(root.glob("*/*/run.json")):
        run_dir = RunDir(run_json.parent)
        try:
            info = read_run_info(run_dir)
        except (OSError, ValueError):
            continue
        if info.get("status") != "running" or process_alive(info.get("supervisor")) is not False:
            continue  # finished, or supervised by a live tuner (a scale-out peer)
        if info.get("run_id"):
            kill_run_processes(str(info["run_id"]), grace_s=2.0)
        finish_run_info(run_dir, classify_run(
            run_dir, world_size=int(info.get("world_size") or 1), returncode=None, duration_s=0.0,
            stopped="interrupted", stop_message="the tuner stopped while supervising this run (found on resume)"))


def _fail_stale_trials(study) -> None:
    """Trials left RUNNING by a tuner that was killed become FAIL with a reason.

    Each trial records its tuner (`tuner` user attr: host, pid, start time); a trial whose
    tuner still runs on this host, or runs on another host, is left alone, so several tuners
    can work on one study (the trials of a tuner killed on another host stay RUNNING).
    """
    import optuna
    from optuna.trial import TrialState

    from ..launch import process_alive

    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if process_alive(t.user_attrs.get("tuner")) is not False:
            continue  # its tuner still runs (or runs on another host): a scale-out peer's trial
        optuna.trial.Trial(study, t._trial_id).set_user_attr(
            "failure_reason", "stale: the tuner stopped while this trial was running"
        )
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)


def _trial_result(t) -> TrialResult:
    ua = t.user_attrs
    # A trial that ran has the parameters it was configured with; one still WAITING (enqueued, the
    # budget spent before it ran) has none yet, so it shows the parameters it was queued with.
    params = ua.get("config_params") or t.params or t.system_attrs.get("fixed_params") or {}
    complete = t.state.name == "COMPLETE"
    constraints = dict(t.constraints) if complete else {}
    if not complete:
        status = ""
    else:
        status = "feasible" if all(v <= 0 for v in constraints.values()) else "violated"
    return TrialResult(
        number=t.number,
        params=dict(params),
        state=t.state.name,
        samples_s=t.values[0] if complete else None,  # throughput is always the first objective
        iqr_samples_s=ua.get("iqr_samples_s"),
        loss_deviation=ua.get("loss_deviation"),
        loss_check=ua.get("loss_check"),
        constraint_status=status,
        constraints=constraints,
        failure_reason=ua.get("failure_reason", ""),
        stderr_tail=tuple(ua.get("stderr_tail", ())),
        run_dir=ua.get("run_dir", ""),
        role=str(ua.get("role", "")),
        peak_mem_bytes=ua.get("peak_mem_bytes"),
        intermediate_samples_s={int(k): float(v) for k, v in sorted(t.intermediate_values.items())},
    )


def _pareto(study, objectives: tuple[str, ...]) -> tuple[ParetoTrial, ...]:
    """The study's Pareto front (Optuna keeps only feasible trials when constraints are set), fastest first."""
    front = sorted(study.best_trials, key=lambda t: (-t.values[0], t.number))
    return tuple(ParetoTrial(number=t.number, params=dict(t.user_attrs.get("config_params", t.params)),
                             values={o: float(v) for o, v in zip(objectives, t.values)}) for t in front)


def _report(study, number: int, on_trial: Callable[[TrialResult], None] | None) -> None:
    if on_trial is not None:
        on_trial(_trial_result(study.trials[number]))


def _confirmation(cand: TrialResult, runs: PairedRuns, noise_rel: float, rng: np.random.Generator) -> Confirmation:
    speedup, ci_low, ci_high, better = paired_stats(runs.ratios, noise_rel=noise_rel, rng=rng)
    return Confirmation(trial_number=cand.number, params=cand.params, ratios=runs.ratios, speedup=speedup,
                        ci_low=ci_low, ci_high=ci_high, better=better, run_dirs=runs.run_dirs,
                        failures=runs.failures)


_CSV_COLUMNS = ("number", "state", "params", "objective_samples_s", "iqr_samples_s", "loss_deviation",
                "constraint_status", "failure_reason", "run_dir")


def _write_trials_csv(path: Path, trials: Sequence[TrialResult]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_CSV_COLUMNS)
        for t in trials:
            w.writerow([t.number, t.state, json.dumps(t.params, sort_keys=True), _num(t.samples_s),
                        _num(t.iqr_samples_s), _num(t.loss_deviation), t.constraint_status, t.failure_reason,
                        t.run_dir])
    os.replace(tmp, path)
    # The same table, typed, for pandas/pyarrow readers (dashboard, reports).
    frame = pd.read_csv(path, dtype={"params": str, "failure_reason": str, "constraint_status": str, "run_dir": str},
                        keep_default_na=False, na_values={c: [""] for c in _CSV_COLUMNS[3:6]})
    tmp_parquet = path.with_name(f".trials.parquet.{os.getpid()}.tmp")
    frame.to_parquet(tmp_parquet, index=False)
    os.replace(tmp_parquet, path.with_suffix(".parquet"))


def _num(v: float | None) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else repr(float(v))
