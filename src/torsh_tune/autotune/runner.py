"""One measured launch of the user's script: the unit of every baseline, trial and confirmation run.

Each run is a fresh torchrun launch in its own run directory (NCCL reads its algorithm
variables once per process, and a fresh process group is the only honest measurement).
`launch_run` never raises for a failed run; its outcome decides the state:

- `ok` with measured steps -> "COMPLETE" with the throughput;
- `pruned` (the `should_prune` hook stopped it) -> "PRUNED" with the hook's reason;
- `ok` without measured steps, or any other status (script_error, signal, timeout, hang,
  config_error, launch_error) -> "FAIL" with the reason and the last stderr lines.
  A failed run is never scored as zero throughput: that would teach the sampler that
  the region is slow rather than broken.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..config import RunConfig
from ..errors import ConfigError
from ..launch import Progress, RunOutcome, launch_run
from ..launch.warm import WarmAgents
from ..rundir import RunDir, new_run_dir
from .objective import Measurement, measure_run

__all__ = ["MeasuredRun", "fresh_run_dir", "run_measured"]

_STDERR_LINES = 20


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    """A finished launch and what was measured from it.

    Attributes:
        state: "COMPLETE", "FAIL" or "PRUNED".
        run_dir: The run directory.
        status: The launch outcome's status (`RUN_STATUSES`), or "config_error" when the
            configuration was rejected before launch.
        failure_reason: One line, empty when COMPLETE (for PRUNED: why it was pruned).
        stderr_tail: Last lines of the failing rank's log.
        measurement: None when nothing could be read (or the config was rejected);
            for PRUNED, the steps recorded before the stop.
        duration_s: Wall time of the launch.
    """

    state: str
    run_dir: str
    status: str
    failure_reason: str = ""
    stderr_tail: tuple[str, ...] = ()
    measurement: Measurement | None = None
    duration_s: float = 0.0

    @property
    def samples_s(self) -> float | None:
        """The objective: the steady-state rate (`objective.steady_rate`), None unless COMPLETE."""
        if self.state != "COMPLETE" or self.measurement is None or self.measurement.throughput is None:
            return None
        return self.measurement.throughput.samples_s


def fresh_run_dir(root: str | os.PathLike[str], name: str) -> RunDir:
    """`new_run_dir(root, name=name)`, with a `-rN` suffix when `name` exists (a resumed study)."""
    for k in range(1000):
        candidate = name if k == 0 else f"{name}-r{k}"
        if not (Path(root) / candidate).exists():
            try:
                return new_run_dir(root, candidate, name=candidate)
            except ConfigError:
                continue  # another tuner took it between the check and mkdir
    raise AssertionError(f"no free run directory name for {name} under {root}")


def run_measured(
    config: RunConfig,
    run_dir: RunDir,
    script: str | os.PathLike[str],
    script_args: Sequence[str],
    *,
    echo: Callable[[str], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    should_prune: Callable[[Progress], str | None] | None = None,
    agents: WarmAgents | None = None,
) -> MeasuredRun:
    """Launch `script` with `config` into `run_dir`, classify the end, read the measurement.

    `on_progress`, `should_prune` and `agents` are handed to `launch_run` (a reason returned by
    `should_prune` stops the run: state "PRUNED"; `agents` forks torchrun's agent warm).

    Raises:
        ConfigError: Only for a missing script (a user mistake, not a trial failure).
    """
    outcome: RunOutcome = launch_run(
        config, run_dir, script, list(script_args), echo=echo or (lambda line: None), on_progress=on_progress,
        should_prune=should_prune, agents=agents,
    )
    if outcome.status == "pruned":
        return MeasuredRun(
            state="PRUNED",
            run_dir=str(run_dir.path),
            status=outcome.status,
            failure_reason=outcome.message,
            measurement=measure_run(run_dir.path),
            duration_s=outcome.duration_s,
        )
    if not outcome.ok:
        reason = f"{outcome.status}: {outcome.message}" if outcome.message else outcome.status
        if outcome.failing_rank is not None and f"rank {outcome.failing_rank}" not in reason:
            reason += f" (rank {outcome.failing_rank})"
        return MeasuredRun(
            state="FAIL",
            run_dir=str(run_dir.path),
            status=outcome.status,
            failure_reason=reason,
            stderr_tail=tuple(outcome.stderr_tail[-_STDERR_LINES:]),
            duration_s=outcome.duration_s,
        )
    measurement = measure_run(run_dir.path)
    if measurement.throughput is None:
        return MeasuredRun(
            state="FAIL",
            run_dir=str(run_dir.path),
            status=outcome.status,
            failure_reason="no_measurement: the run ended without a measured (post-warm-up) step",
            measurement=measurement,
            duration_s=outcome.duration_s,
        )
    return MeasuredRun(
        state="COMPLETE",
        run_dir=str(run_dir.path),
        status=outcome.status,
        measurement=measurement,
        duration_s=outcome.duration_s,
    )
