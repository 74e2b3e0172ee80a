"""What a trial is worth: steady-state throughput, the noise-calibrated loss guard, the constraints.

Pure (pandas + numpy): works on the step records of any run directory, recorded or live.
`running_throughput` is what the pruner sees of a running trial: the steady-state rate
over the measured steps so far, indexed by measured step, the same index in every trial.

The objective is a rate, not the median of per-step throughputs: a step series is often
periodic (N DataLoader workers hand over batches in turn, so short and long steps alternate;
gradient accumulation; a periodic evaluation), and the median of a two-valued series lands
anywhere between its two values (a no-op knob measured 1.05-1.26x on `examples/data_bound.py`
that way). `steady_rate` is samples over time of the measured steps with rare stalls (a step
beyond Tukey's far-out fence and at least twice the median, at most one in ten steps) left out.

The loss guard (`loss_check`) is calibrated on the baseline's own repeats: a trial violates
only when its mean loss is worse than the baseline's beyond what the baseline's run-to-run
spread explains (a one-sided t-test at `LOSS_TEST_ALPHA`) *and* beyond the tolerance.

Example:
    >>> m = measure_run("tests/data/recorded/data_bound")  # doctest: +SKIP
    >>> m.throughput.samples_s  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ..analysis import load_run, planned_steps, steady_rate, untraced
from ..rundir import RunDir

__all__ = [
    "LOSS_TEST_ALPHA",
    "LossCheck",
    "Measurement",
    "Throughput",
    "effective_settings",
    "loss_by_step",
    "loss_check",
    "loss_deviation",
    "measure_run",
    "per_step_throughput",
    "recorded_ddp",
    "running_throughput",
    "steady_rate",
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
        samples_s: The objective: `steady_rate` of the measured steps (samples over time, rare
            stalls left out).
        median_samples_s: Median of the per-step throughputs.
        q25_samples_s: 25th percentile of the per-step throughputs.
        q75_samples_s: 75th percentile.
        iqr_samples_s: q75 - q25: the spread within the run.
        num_steps: Measured steps.
        stalls: Measured steps left out of `samples_s` as stalls.
        unit: "samples/s", or "tokens/s" when the script counted tokens.
    """

    samples_s: float
    median_samples_s: float
    q25_samples_s: float
    q75_samples_s: float
    iqr_samples_s: float
    num_steps: int
    stalls: int = 0
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
    per_step = _per_step(steps, num_ranks=num_ranks, unit=unit)
    return per_step["samples"] / per_step["step_s"]


def _per_step(steps: pd.DataFrame, *, num_ranks: int | None = None, unit: str | None = None) -> pd.DataFrame:
    """Measured step -> (global samples or tokens, the slowest rank's step_s, whether it is `planned` slow: an
    evaluation pass or a checkpoint save), in step order."""
    empty = pd.DataFrame({"samples": pd.Series(dtype=float), "step_s": pd.Series(dtype=float),
                          "planned": pd.Series(dtype=bool)})
    if steps.empty:
        return empty
    kept, _ = untraced(steps[~steps["warmup"].fillna(False).astype(bool)])  # the report's steps
    if kept.empty:
        return empty
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
    planned = planned_steps(kept).reindex(step_s.index, fill_value=False)
    return pd.DataFrame({"samples": samples[ok], "step_s": step_s[ok], "planned": planned[ok]}).sort_index()


def running_throughput(steps: pd.DataFrame, *, num_ranks: int, unit: str | None = None) -> pd.Series:
    """Measured-step index (0, 1, ...) -> `steady_rate` of the measured steps up to it.

    The intermediate values a trial reports to the pruner. Only steps every rank recorded
    count (ranks append in step order, so they form a prefix), hence the value at an index
    is the same whether computed while the run is alive or from its final records, and
    the index means the same in every trial of a study (same warm-up, same budget).
    `unit` as in `per_step_throughput` (a study passes its baseline's).
    """
    per_step = _per_step(steps, num_ranks=num_ranks, unit=unit)
    samples, step_s, planned = (per_step[c].to_numpy() for c in ("samples", "step_s", "planned"))
    return pd.Series([steady_rate(samples[: i + 1], step_s[: i + 1], planned[: i + 1])[0] for i in range(len(step_s))],
                     dtype=float)


def throughput_of(steps: pd.DataFrame) -> Throughput | None:
    """Throughput statistics of step records (the `warmup` column marks steps left out).

    Returns:
        None without any measured step (all-warm-up runs are not used: a tuner must not
        rank configurations by their warm-up).
    """
    unit = throughput_unit(steps)
    frame = _per_step(steps, unit=unit)
    if frame.empty:
        return None
    per_step = (frame["samples"] / frame["step_s"]).to_numpy()
    q25, med, q75 = np.quantile(per_step, [0.25, 0.5, 0.75])
    rate, stalls = steady_rate(frame["samples"].to_numpy(), frame["step_s"].to_numpy(), frame["planned"].to_numpy())
    return Throughput(
        samples_s=rate,
        stalls=stalls,
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


#: Significance level of the loss guard's one-sided test (1 %: a trial that trains exactly as the
#: baseline does is called worse in one study of a hundred trials at most).
LOSS_TEST_ALPHA = 0.01
# One-sided Student t quantiles t(1 - LOSS_TEST_ALPHA, df) for df = 1..30; beyond, the normal's.
_T_99 = (31.821, 6.965, 4.541, 3.747, 3.365, 3.143, 2.998, 2.896, 2.821, 2.764, 2.718, 2.681, 2.650, 2.624,
         2.602, 2.583, 2.567, 2.552, 2.539, 2.528, 2.518, 2.508, 2.500, 2.492, 2.485, 2.479, 2.473, 2.467,
         2.462, 2.457)
_Z_99 = 2.326


@dataclass(frozen=True, kw_only=True)
class LossCheck:
    """The loss guard's verdict on one trial (all values relative to the baseline's mean loss).

    The unit of noise is a whole run: a run's loss curve moves as one (another model
    initialisation shifts every step), so per-step differences are not independent and a
    per-step test would claim far more certainty than the runs support. Over the logged steps
    common to the trial and every baseline repeat:

        delta   = mean(trial) / mean(baseline) - 1          (> 0: the trial's loss is worse)
        m_r     = mean(repeat r) / mean(baseline) - 1       for the R baseline repeats
        noise   = sd(m_1 .. m_R)                            (one run's spread, R - 1 df)
        se      = noise * sqrt(1 + 1/R)                     (one trial run vs the mean of R runs)
        t       = delta / se
        threshold = max(tolerance, t(1 - alpha, R - 1) * se)

    The trial violates when `delta > threshold`: its loss is worse than the baseline's beyond
    the baseline's own run-to-run spread (one-sided t-test, alpha `LOSS_TEST_ALPHA`) and beyond
    the tolerance (which keeps a bit-for-bit deterministic baseline, whose spread is 0, from
    calling a reordered floating-point sum a regression). With one baseline repeat there is
    no spread to measure: the threshold is the tolerance alone.

    Attributes:
        delta_rel: The trial's mean loss relative to the baseline's, minus 1.
        threshold_rel: The largest `delta_rel` that is feasible.
        margin_rel: `threshold_rel - delta_rel` (< 0: violated by that much).
        noise_rel: One run's relative spread (sd of the repeats' means), None with one repeat.
        t_stat: `delta_rel / se`, None without a spread (or a spread of 0).
        t_crit: The one-sided critical value used, None with one repeat.
        tolerance_rel: The study's loss tolerance.
        repeats: Baseline repeats with a loss at the common steps.
        num_steps: Logged steps compared.
        violated: `delta_rel > threshold_rel`.
    """

    delta_rel: float
    threshold_rel: float
    margin_rel: float
    noise_rel: float | None
    t_stat: float | None
    t_crit: float | None
    tolerance_rel: float
    repeats: int
    num_steps: int
    violated: bool

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _t_crit(df: int) -> float:
    return _T_99[df - 1] if df <= len(_T_99) else _Z_99


def loss_check(trial_loss: pd.Series, baseline_runs: Sequence[pd.Series], *, tolerance: float) -> LossCheck | None:
    """Test whether the trial's loss is worse than the baseline's beyond its run-to-run noise (see `LossCheck`).

    Args:
        trial_loss: Step -> mean loss of the trial (`loss_by_step`).
        baseline_runs: The same for each baseline repeat.
        tolerance: The study's loss tolerance (relative): the smallest worsening ever called a violation.

    Returns:
        None when no logged step is common to the trial and every baseline repeat, or the
        baseline's mean loss there is 0.
    """
    runs = [r.dropna() for r in baseline_runs if len(r.dropna())]
    if not runs:
        return None
    common = trial_loss.dropna().index
    for r in runs:
        common = common.intersection(r.index)
    if len(common) == 0:
        return None
    means = np.array([float(r.loc[common].mean()) for r in runs])
    base = float(means.mean())
    if base == 0 or not np.isfinite(base):
        return None
    delta = float(trial_loss.loc[common].mean()) / base - 1.0
    repeats = len(runs)
    noise = t_stat = t_crit = None
    threshold = tolerance
    if repeats >= 2:
        noise = float(np.std(means / base - 1.0, ddof=1))
        se = noise * math.sqrt(1.0 + 1.0 / repeats)
        t_crit = _t_crit(repeats - 1)
        threshold = max(tolerance, t_crit * se)
        t_stat = delta / se if se > 0 else None
    return LossCheck(delta_rel=delta, threshold_rel=threshold, margin_rel=threshold - delta, noise_rel=noise,
                     t_stat=t_stat, t_crit=t_crit, tolerance_rel=tolerance, repeats=repeats,
                     num_steps=len(common), violated=delta > threshold)


def trial_constraints(
    *,
    loss: LossCheck | None,
    lossy: bool,
    peak_mem_bytes: int | None = None,
    max_peak_mem_bytes: int | None = None,
) -> dict[str, float]:
    """Constraint name -> value as told to Optuna (`trial.set_constraint`): <= 0 is feasible.

    - "loss_deviation": `-loss.margin_rel` (`loss_check`: the trial's relative loss excess
      over the noise-calibrated threshold). Without a comparable loss a lossy choice
      (compression) cannot be shown to be harmless: 1.0 (violated); a lossless one: 0.0.
    - "peak_mem": `peak_mem_bytes / max_peak_mem_bytes - 1`, only with a limit and a
      recorded peak.
    """
    out: dict[str, float] = {}
    if loss is None:
        out["loss_deviation"] = 1.0 if lossy else 0.0
    else:
        out["loss_deviation"] = -loss.margin_rel
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


def _rank0_meta(run: RunDir) -> dict[str, Any] | None:
    """Rank 0's meta.json, None when it left none (ValueError when it is not JSON)."""
    path = run.rank_file(0, "meta")
    return json.loads(path.read_text()) if path.is_file() else None


def recorded_ddp(run_dirs: Sequence[str | os.PathLike[str]]) -> dict[str, Any] | None:
    """Rank 0's DDP model as the first of `run_dirs` that recorded one (meta.json `ddp`), else None."""
    for run_dir in run_dirs:
        try:
            ddp = (_rank0_meta(RunDir(run_dir)) or {}).get("ddp")
        except (OSError, ValueError):
            continue
        if isinstance(ddp, dict):
            return ddp
    return None


def effective_settings(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The settings a run really ran with: what the ranks recorded, else what was configured.

    A trial that spells out PyTorch's defaults (`bucket_cap_mb = 25`, 0 workers, ...) and a
    baseline that leaves them unset run the same job; their configs differ, this does not.
    DDP from meta.json `ddp_models` (bucket caps, gradient views, static graph, comm hook),
    DataLoaders from `dataloaders` (workers, prefetch, pin_memory, persistent workers as run),
    threads from `omp_num_threads`/`num_threads`; the strategy's other sections and the launch
    environment (less OMP_NUM_THREADS) from config.json.

    Returns:
        A JSON-comparable dict, or None when rank 0 left no meta.json (nothing to compare).
    """
    run = RunDir(run_dir)  # two small JSON files, not the run's records
    meta = _rank0_meta(run)
    if meta is None:
        return None
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
