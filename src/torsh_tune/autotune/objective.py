"""What a trial is worth: steady-state throughput, the loss-trajectory quality guard, the constraints.

Pure (pandas + numpy): works on the step records of any run directory, recorded or live.
`running_throughput` is what the pruner sees of a running trial: the median throughput
over the measured steps so far, indexed by measured step, the same index in every trial.

Example:
    >>> m = measure_run("tests/data/recorded/data_bound")  # doctest: +SKIP
    >>> m.throughput.median_samples_s  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..analysis import load_run
from ..rundir import RunDir

__all__ = [
    "Measurement",
    "Throughput",
    "effective_settings",
    "loss_by_step",
    "loss_deviation",
    "measure_run",
    "per_step_throughput",
    "running_throughput",
    "throughput_of",
    "throughput_unit",
    "trial_constraints",
]


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """Steady-state throughput of a run (warm-up excluded).

    Per step: global samples (sum over ranks) / global step time (the slowest rank's
    `step_s`, since every rank waits for it in the all-reduce). When the script counts its
    tokens (`torsh_tune.count_tokens`) on every measured step, tokens replace samples: the
    `*_samples_s` fields then hold tokens/s, and `unit` says which.

    Attributes:
        median_samples_s: Median of the per-step throughputs: the objective.
        q25_samples_s: 25th percentile.
        q75_samples_s: 75th percentile.
        iqr_samples_s: q75 - q25: the spread within the run.
        num_steps: Measured steps.
        unit: "samples/s", or "tokens/s" when the script counted tokens.
    """

    median_samples_s: float
    q25_samples_s: float
    q75_samples_s: float
    iqr_samples_s: float
    num_steps: int
    unit: str = "samples/s"


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What the tuner reads back from one run directory.

    Attributes:
        throughput: None when the run has no measured step.
        loss: Step -> mean loss across ranks (steps where the loss was read).
        peak_mem_bytes: Largest `peak_mem_bytes` of any rank, None without records.
        max_microbatches: Largest `num_microbatches` seen (> 1: gradient accumulation).
        warnings: Problems found while reading.
    """

    throughput: Throughput | None
    loss: pd.Series
    peak_mem_bytes: int | None
    max_microbatches: int | None
    warnings: tuple[str, ...] = ()


def throughput_unit(steps: pd.DataFrame) -> str:
    """"tokens/s" when every measured step record counted tokens (`torsh_tune.count_tokens`), "steps/s" when
    no record knows its samples (no batch tensor seen), else "samples/s"."""
    if steps.empty:
        return "samples/s"
    kept = steps[~steps["warmup"].fillna(False).astype(bool)]
    if "tokens" in steps.columns:
        tokens = pd.to_numeric(kept["tokens"], errors="coerce")
        if len(kept) and bool((tokens > 0).all()):
            return "tokens/s"
    samples = pd.to_numeric(kept["samples"], errors="coerce") if "samples" in kept else pd.Series(dtype=float)
    return "steps/s" if len(kept) and not bool((samples > 0).any()) else "samples/s"


def per_step_throughput(steps: pd.DataFrame, *, num_ranks: int | None = None, unit: str | None = None) -> pd.Series:
    """Measured step -> global samples/s (or tokens/s), in step order (warm-up steps left out).

    Per step: samples (tokens) summed over the ranks / the slowest rank's `step_s`.

    Args:
        steps: Step records (columns step, step_s, samples, tokens, warmup).
        num_ranks: When given, only steps recorded by this many ranks (a live run's
            steps that every rank has finished).
        unit: "samples/s" or "tokens/s"; default `throughput_unit(steps)`.
    """
    if steps.empty:
        return pd.Series(dtype=float)
    kept = steps[~steps["warmup"].fillna(False).astype(bool)]
    if kept.empty:
        return pd.Series(dtype=float)
    unit = unit or throughput_unit(steps)
    by_step = kept.groupby("step")
    step_s = by_step["step_s"].max().astype(float)
    if unit == "steps/s":
        samples = pd.Series(1.0, index=step_s.index)
    else:
        samples = by_step["tokens" if unit == "tokens/s" else "samples"].sum().astype(float)
    ok = step_s > 0
    if num_ranks is not None:
        ranks = by_step["rank"].nunique() if "rank" in kept.columns else by_step.size()
        ok &= ranks >= num_ranks
    return (samples[ok] / step_s[ok]).sort_index()


def running_throughput(steps: pd.DataFrame, *, num_ranks: int, unit: str | None = None) -> pd.Series:
    """Measured-step index (0, 1, ...) -> median throughput over the measured steps up to it.

    The intermediate values a trial reports to the pruner. Only steps every rank recorded
    count (ranks append in step order, so they form a prefix), hence the value at an index
    is the same whether computed while the run is alive or from its final records, and
    the index means the same in every trial of a study (same warm-up, same budget).
    `unit` as in `per_step_throughput` (a study passes its baseline's).
    """
    per_step = per_step_throughput(steps, num_ranks=num_ranks, unit=unit)
    running = per_step.reset_index(drop=True).expanding().median()
    return running.astype(float)


def throughput_of(steps: pd.DataFrame) -> Throughput | None:
    """Throughput statistics of step records (the `warmup` column marks steps left out).

    Returns:
        None without any measured step (all-warm-up runs are not used: a tuner must not
        rank configurations by their warm-up).
    """
    unit = throughput_unit(steps)
    per_step = per_step_throughput(steps, unit=unit).to_numpy()
    if per_step.size == 0:
        return None
    q25, med, q75 = np.quantile(per_step, [0.25, 0.5, 0.75])
    return Throughput(
        median_samples_s=float(med),
        q25_samples_s=float(q25),
        q75_samples_s=float(q75),
        iqr_samples_s=float(q75 - q25),
        num_steps=int(per_step.size),
        unit=unit,
    )


def loss_by_step(steps: pd.DataFrame) -> pd.Series:
    """Step -> mean loss across the ranks that read it (warm-up included: same data order)."""
    if steps.empty:
        return pd.Series(dtype=float)
    loss = pd.to_numeric(steps["loss"], errors="coerce")
    frame = pd.DataFrame({"step": steps["step"], "loss": loss}).dropna()
    return frame.groupby("step")["loss"].mean().astype(float)


def loss_deviation(trial_loss: pd.Series, baseline_loss: pd.Series) -> float | None:
    """Relative deviation of the trial's mean loss from the baseline's over their common steps.

    |mean(trial) - mean(baseline)| / |mean(baseline)|, both over the steps where both read
    the loss (the same data order makes the step index comparable).

    Returns:
        None when the two share no step with a loss or the baseline's mean loss is 0.
    """
    common = trial_loss.index.intersection(baseline_loss.index)
    if len(common) == 0:
        return None
    base = float(baseline_loss.loc[common].mean())
    if base == 0 or not np.isfinite(base):
        return None
    return abs(float(trial_loss.loc[common].mean()) - base) / abs(base)


def trial_constraints(
    *,
    loss_deviation: float | None,
    lossy: bool,
    loss_tolerance: float,
    peak_mem_bytes: int | None = None,
    max_peak_mem_bytes: int | None = None,
) -> dict[str, float]:
    """Constraint name -> value as told to Optuna (`trial.set_constraint`): <= 0 is feasible.

    - "loss_deviation": `loss_deviation - loss_tolerance`. Without a comparable loss a
      lossy choice (compression) cannot be shown to be harmless: 1.0 (violated); a
      lossless one: 0.0.
    - "peak_mem": `peak_mem_bytes / max_peak_mem_bytes - 1`, only with a limit and a
      recorded peak.
    """
    out: dict[str, float] = {}
    if loss_deviation is None:
        out["loss_deviation"] = 1.0 if lossy else 0.0
    else:
        out["loss_deviation"] = loss_deviation - loss_tolerance
    if max_peak_mem_bytes is not None and peak_mem_bytes is not None:
        out["peak_mem"] = peak_mem_bytes / max_peak_mem_bytes - 1.0
    return out


def measure_run(run_dir: str | os.PathLike[str]) -> Measurement:
    """Read a run directory's step records into a `Measurement`."""
    frames = load_run(run_dir)
    steps = frames.steps
    if steps.empty:
        return Measurement(throughput=None, loss=pd.Series(dtype=float), peak_mem_bytes=None,
                           max_microbatches=None, warnings=frames.warnings)
    peak = pd.to_numeric(steps["peak_mem_bytes"], errors="coerce").max()
    micro = pd.to_numeric(steps["num_microbatches"], errors="coerce").max()
    return Measurement(
        throughput=throughput_of(steps),
        loss=loss_by_step(steps),
        peak_mem_bytes=None if pd.isna(peak) else int(peak),
        max_microbatches=None if pd.isna(micro) else int(micro),
        warnings=frames.warnings,
    )



# What identifies a DDP model's setup in meta.json `ddp_models` (the rest are sizes and timings).
_DDP_SETTINGS = ("bucket_cap_mb", "first_bucket_cap_mb", "gradient_as_bucket_view", "static_graph",
                 "find_unused_parameters", "broadcast_buffers", "comm_hook")


def effective_settings(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The settings a run really ran with: what the ranks recorded, else what was configured.

    A trial that spells out PyTorch's defaults (`bucket_cap_mb = 25`, 0 workers, ...) and a
    baseline that leaves them unset run the same job; their configs differ, this does not.
    DDP from meta.json `ddp_models` (bucket caps, gradient views, static graph, comm hook),
    DataLoaders from `dataloaders` (workers, prefetch, pin_memory as run), threads from
    `omp_num_threads`/`num_threads`; the strategy's other sections and the launch
    environment (less OMP_NUM_THREADS) from config.json.

    Returns:
        A JSON-comparable dict, or None when rank 0 left no meta.json (nothing to compare).
    """
    run = RunDir(run_dir)  # two small JSON files, not the run's records
    meta_path = run.rank_file(0, "meta")
    if not meta_path.is_file():
        return None
    meta = json.loads(meta_path.read_text())
    config = json.loads(run.config_json.read_text()) if run.config_json.is_file() else {}
    strategy = {k: v for k, v in (config.get("strategy") or {}).items() if k not in ("ddp", "dataloader")}
    env = dict((config.get("launch") or {}).get("env") or {})
    env.pop("OMP_NUM_THREADS", None)
    return {
        "strategy": strategy,
        "env": env,
        "ddp": [{k: m.get(k) for k in _DDP_SETTINGS} for m in meta.get("ddp_models", ())],
        "dataloaders": meta.get("dataloaders"),
        "threads": (meta.get("omp_num_threads"), meta.get("num_threads")),
    }
