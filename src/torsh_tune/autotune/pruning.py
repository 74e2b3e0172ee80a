"""Pruning: a running trial reports its intermediate throughput; a pruner stops hopeless ones.

While a trial runs, the supervisor polls its step records about twice a second and calls
`TrialPruning` (its `should_prune` hook). Each measured step that every rank has finished
is reported to Optuna as `trial.report(steady_rate_so_far, measured_step_index)`
(`objective.running_throughput`: the same index means the same in every trial of a study).
When the study's pruner (`make_pruner`) says so, the hook returns a one-line reason and the
supervisor stops the whole job the way it stops a timeout (SIGTERM, grace, SIGKILL, sweep of
the run's processes); the study then tells Optuna `TrialState.PRUNED`. A trial that ran to
the end has the steps the polls missed reported afterwards (`TrialPruning.finish`), so the
completed trials that later trials are compared with have a value at every index.

Optuna prunes single-objective studies only; baseline and confirmation runs are never pruned.

Example:
    >>> import optuna
    >>> study = optuna.create_study(direction="maximize", pruner=make_pruner(  # doctest: +SKIP
    ...     "median", percentile=None, warmup_steps=3, startup_trials=5))
    >>> watch = TrialPruning(study.ask(), "runs/tune/trials/0001", num_ranks=2)  # doctest: +SKIP
    >>> launch_run(config, run_dir, "train.py", [], should_prune=watch)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ..config import STUDY_PRUNERS
from ..errors import invalid
from .objective import running_throughput

if TYPE_CHECKING:
    import optuna

    from ..launch import Progress

__all__ = ["PRUNERS", "StepRecordReader", "TrialPruning", "make_pruner", "study_pruner"]

PRUNERS = STUDY_PRUNERS

_log = logging.getLogger(__name__)
_DEFAULT_PRUNER_PERCENTILE = 25.0
_DEFAULT_PRUNER_WARMUP_STEPS = 3
_DEFAULT_PRUNER_STARTUP_TRIALS = 5

_STEPS_RE = re.compile(r"^rank(\d+)\.steps\.jsonl$")
_COLUMNS = ("rank", "step", "step_s", "samples", "tokens", "warmup")


def make_pruner(name: str, *, percentile: float | None, warmup_steps: int, startup_trials: int):
    """The Optuna pruner called `name` (one of `PRUNERS`).

    Args:
        name: "none" (never prune), "median" or "percentile".
        percentile: For "percentile": Optuna's `PercentilePruner` percentile, the share (%)
            of trials kept: a trial is pruned when its best intermediate throughput is below
            the (100 - percentile)th percentile of the completed trials at the same step.
        warmup_steps: Intermediate values a trial reports before it may be pruned.
        startup_trials: Completed trials the study needs before any trial is pruned.

    Raises:
        ConfigError: Unknown name or an out-of-range option.
    """
    import optuna

    if name not in PRUNERS:
        raise invalid("pruner", f"one of {list(PRUNERS)}", name)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise invalid("pruner_warmup_steps", "an integer >= 0", warmup_steps)
    if isinstance(startup_trials, bool) or not isinstance(startup_trials, int) or startup_trials < 0:
        raise invalid("pruner_startup_trials", "an integer >= 0", startup_trials)
    if name == "none":
        return optuna.pruners.NopPruner()
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=startup_trials, n_warmup_steps=warmup_steps)
    if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile < 100:
        raise invalid("pruner_percentile", "a number between 0 and 100 (exclusive)", percentile)
    return optuna.pruners.PercentilePruner(float(percentile), n_startup_trials=startup_trials,
                                           n_warmup_steps=warmup_steps)


class StepRecordReader:
    """Incremental reader of every rank's step records in a live run directory.

    Only the bytes appended since the last `read` are parsed; a torn last line waits for
    the next call, and a malformed line is skipped (the analysis reports those).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self._ranks = Path(run_dir) / "ranks"
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        self._rows: list[dict[str, Any]] = []

    def read(self) -> pd.DataFrame:
        """Every complete step record so far (columns rank, step, step_s, samples, warmup)."""
        try:
            paths = sorted(p for p in self._ranks.iterdir() if _STEPS_RE.match(p.name))
        except FileNotFoundError:
            paths = []
        for path in paths:
            self._read_new(path)
        return pd.DataFrame(self._rows, columns=list(_COLUMNS))

    def _read_new(self, path: Path) -> None:
        offset = self._offsets.get(path, 0)
        try:
            size = path.stat().st_size
            if size <= offset:
                return
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read(size - offset)
        except FileNotFoundError:
            return
        self._offsets[path] = offset + len(data)
        complete, sep, self._partial[path] = (self._partial.get(path, b"") + data).rpartition(b"\n")
        if not sep:
            return
        for line in complete.split(b"\n"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self._rows.append({k: rec.get(k) for k in _COLUMNS})


class TrialPruning:
    """Reports a running trial's intermediate throughput and asks the study's pruner.

    An instance is the supervisor's `should_prune` hook for one trial run: it returns
    None to let the run go on, or the reason it must be stopped, e.g. "pruned at step 3:
    104.2 samples/s vs median 5210.7 (2 completed trials)".

    Args:
        trial: The running Optuna trial (single-objective study).
        run_dir: The trial's run directory.
        num_ranks: Ranks whose records make a step count (the run's world size on one
            node; on several nodes, the ranks whose records reach this run directory).
        percentile: The pruner's percentile (50 for the median pruner), for the reason.
        unit: The study's objective unit ("samples/s" or "tokens/s", the baseline's).
    """

    def __init__(self, trial: "optuna.trial.Trial", run_dir: str | os.PathLike[str], *, num_ranks: int,
                 percentile: float = 50.0, unit: str = "samples/s") -> None:
        self.trial = trial
        self.num_ranks = num_ranks
        self.percentile = percentile
        self.unit = unit
        self.reported: dict[int, float] = {}
        self.reason = ""
        self._reader = StepRecordReader(run_dir)
        self._steps_seen = -1

    def __call__(self, progress: "Progress") -> str | None:
        if progress.steps_done == self._steps_seen:
            return None  # nothing new on disk since the last poll
        self._steps_seen = progress.steps_done
        if not self._report_new() or not self.trial.should_prune():
            return None
        self.reason = self._describe(max(self.reported))
        return self.reason

    def finish(self) -> None:
        """Report the measured steps of a finished run that the polls did not see."""
        self._report_new()

    def _report_new(self) -> bool:
        running = running_throughput(self._reader.read(), num_ranks=self.num_ranks, unit=self.unit)
        new = False
        for step, value in running.items():
            if int(step) not in self.reported:
                self.trial.report(float(value), int(step))
                self.reported[int(step)] = float(value)
                new = True
        return new

    def _describe(self, step: int) -> str:
        from optuna.trial import TrialState

        best = max(self.reported.values())  # what the pruner compares: the best value so far
        others = [t.intermediate_values[step]
                  for t in self.trial.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                  if step in t.intermediate_values]
        if not others:
            return f"pruned at step {step}: {best:.1f} {self.unit}"
        # Optuna's PercentilePruner keeps the top `percentile` %: the cut is at 100 - percentile.
        cut = float(np.nanpercentile(np.asarray(others, dtype=float), 100.0 - self.percentile))
        label = "median" if self.percentile == 50 else f"{100 - self.percentile:g}th percentile"
        return (f"pruned at step {step}: {best:.1f} {self.unit} vs {label} {cut:.1f} "
                f"({len(others)} completed trial{'s' if len(others) != 1 else ''})")


def study_pruner(name: str, *, measured_steps: int, percentile: float | None, warmup_steps: int | None,
                 startup_trials: int | None):
    """The study's Optuna pruner and the percentile it keeps (for the pruning reason), defaults filled in.

    Options that have no effect with `name` are warned about; `pruner_warmup_steps` must leave a
    measured step to prune at.
    """
    # The name and its use with one objective are checked by StudyConfig.validate.
    if name == "none":
        unused = [k for k, v in (("pruner_percentile", percentile), ("pruner_warmup_steps", warmup_steps),
                                 ("pruner_startup_trials", startup_trials)) if v is not None]
        if unused:
            _log.warning("%s has no effect without a pruner (pruner='none')", ", ".join(unused))
    elif name == "median" and percentile is not None:
        _log.warning("pruner_percentile has no effect with the median pruner")
    if warmup_steps is None:
        warmup_steps = min(_DEFAULT_PRUNER_WARMUP_STEPS, max(measured_steps - 1, 0))
    elif name != "none" and isinstance(warmup_steps, int) and warmup_steps >= measured_steps:
        raise invalid("pruner_warmup_steps", f"< the measured steps per run ({measured_steps}) to ever prune",
                      warmup_steps)
    if percentile is None:
        percentile = _DEFAULT_PRUNER_PERCENTILE
    optuna_pruner = make_pruner(
        name, percentile=percentile, warmup_steps=warmup_steps,
        startup_trials=_DEFAULT_PRUNER_STARTUP_TRIALS if startup_trials is None else startup_trials)
    return optuna_pruner, (float(percentile) if name == "percentile" else 50.0)
