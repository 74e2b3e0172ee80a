"""The minimal winning configuration: which of the confirmed winner's changes earn its speedup.

A study's winner usually changes several knobs, and only some of them make it faster (the
data-bound example wins by its DataLoader workers; the bucket size, static graph and lossy
gradient compression the sampler also picked are passengers). After the confirmation:

1. **Round** the winner's continuous values to what a person would write (two significant
   figures: `bucket_cap_mb = 60.91964802953841` -> 61), within their dimension's bounds.
2. **Drop the unasked-for changes together** (`suspects`: the knobs the baseline's analysis proposed
   changing, i.e. the dimensions its recommendations' and the strategy advisor's patches name and
   those the trials it seeded change, `seeding.asked_for`): when the winner changes at least two knobs outside them and at least
   one inside, the current configuration runs against the same configuration with all of those
   reverted at once. When that costs no speed beyond noise (the same keep rule as below) they are
   dropped in one test, each recorded with the group's ratio (`tested_with`); otherwise, or when no
   pair measured, each is tested alone as in step 3. A passenger tested alone costs 1.75 pairs on
   average; a data-bound study's winner with workers (asked for), fp16 and a bucket cap took 8
   ablation runs this way, 12-14 one knob at a time. A group can hide two changes whose effects
   cancel (one faster, one slower): neither is kept, and the re-check still measures what is kept.
3. **Ablate greedily**: for each changed knob in `ABLATION_ORDER` (lossy and risky knobs first),
   run the current configuration against the same
   configuration with that knob reverted to the baseline's value, interleaved A B A B
   (`pairs` pairs). The knob is kept only when removing it costs speed beyond noise: the
   bootstrap CI of the median ratio has its lower bound above 1 + the baseline's noise (stricter
   than the confirmation's "lower bound above 1, median beyond noise", which let a no-op measured
   at 1.19, 1.66 and 1.002 on a stalling host stay); otherwise it is dropped and the next knob is
   tested without it. A knob's
   pairs stop as soon as the ones measured decide that it is dropped whatever the rest would
   measure (`cannot_be_kept`: with 3 pairs, one pair that was not faster with it): a passenger
   costs 1.75 pairs on average instead of 3, and no verdict changes.
4. **Re-check** the minimal (rounded) configuration against the baseline with paired runs,
   unless the last test already compared exactly these two; that paired speedup is the
   study's result. If the minimal configuration is not confirmed faster, the winner as the
   confirmation measured it stays the result.

Each kept knob's **share** of the speedup is `ln(ratio_k) / ln(speedup)` (the knobs' effects
are factors, so their logs add up when they are independent), with a 95 % CI from
bootstrapping both medians; a dropped knob has "no measurable effect" (its ratio and CI are
kept to show how little). With one kept knob whose test is the re-check, its share is 1.

Example:
    >>> abl = ablate(winner, baseline_params, space=space, measure=measure, noise_rel=0.02, seed=0)  # doctest: +SKIP
    >>> [(e.knob, e.kept, e.share) for e in abl.effects]  # doctest: +SKIP
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np

from .space import SearchSpace

__all__ = ["ABLATION_ORDER", "Ablation", "KnobEffect", "PairedRuns", "ablate", "cannot_be_kept", "paired_stats",
           "round_params"]

#: The order knobs are tested in: lossy and risky first (a knob dropped early is not paid for
#: by later tests; the compression options go with their method, so they follow it), and
#: `persistent_workers` and `prefetch_factor` before the workers, so that when only the workers
#: earn the speedup the last test is the minimal configuration against the baseline itself (no
#: separate re-check).
ABLATION_ORDER = (
    "compression.method", "compression.ratio", "compression.rank", "compression.start_iter",
    "collectives.hierarchical", "ddp.static_graph", "ddp.broadcast_buffers", "ddp.gradient_as_bucket_view",
    "ddp.first_bucket_cap_mb",
    "ddp.bucket_cap_mb", "collectives.nccl_algo", "collectives.nccl_proto", "omp_num_threads",
    "dataloader.pin_memory", "dataloader.persistent_workers", "dataloader.prefetch_factor", "dataloader.num_workers",
    "fsdp.reshard_after_forward", "pipeline.schedule", "pipeline.n_microbatches", "strategy.kind",
    "training.gradient_accumulation_steps",
)
_BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True, kw_only=True)
class PairedRuns:
    """Interleaved runs of two configurations: ratios are B / A throughput per successful pair.

    Attributes:
        ratios: One per pair that measured both sides.
        run_dirs: (A, B) run directories per pair.
        failures: Why pairs were dropped.
        interrupted: The tuner was stopped during the runs.
    """

    ratios: tuple[float, ...] = ()
    run_dirs: tuple[tuple[str, str], ...] = ()
    failures: tuple[str, ...] = ()
    interrupted: bool = False


@dataclass(frozen=True, kw_only=True)
class KnobEffect:
    """What one of the winner's changes is worth.

    Attributes:
        knob: The dimension (e.g. "dataloader.num_workers").
        value: Its value in the (rounded) winner.
        reverted_to: The baseline's value it was tested against.
        kept: Removing it cost speed beyond noise.
        ratios: Speed with it / without it, per successful pair.
        ratio: Their median, None without a successful pair.
        ci_low: Bootstrap 95 % CI of `ratio`, lower bound.
        ci_high: Upper bound.
        share: Its share of the minimal configuration's speedup (kept knobs), None otherwise.
        share_ci: 95 % CI of `share`.
        verdict: "kept: ..." or "no measurable effect (...)".
        run_dirs: (without, with) run directories per pair.
        failures: Why pairs were dropped.
        tested_with: The other knobs it was reverted with in one test (step 2 of the module docstring);
            its ratios, CI and run directories are that test's. Empty: tested alone.
    """

    knob: str
    value: Any
    reverted_to: Any
    kept: bool
    ratios: tuple[float, ...]
    ratio: float | None
    ci_low: float | None
    ci_high: float | None
    share: float | None = None
    share_ci: tuple[float, float] | None = None
    verdict: str = ""
    run_dirs: tuple[tuple[str, str], ...] = ()
    failures: tuple[str, ...] = ()
    tested_with: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class Ablation:
    """The minimal configuration of a confirmed winner and each change's measured share.

    Attributes:
        trial_number: The confirmed winner it started from.
        winner_params: The winner's parameters as found.
        rounded: Name -> [found, rounded] for the values rounding changed.
        effects: One per changed knob, in the order tested.
        params: The minimal configuration's parameters (what best.toml holds when `better`).
        speedup: Its paired speedup against the baseline, None without a successful pair.
        ci_low: Bootstrap 95 % CI lower bound.
        ci_high: Upper bound.
        better: The minimal configuration is confirmed faster (the confirmation's rule).
        run_dirs: (baseline, minimal) run directories of the re-check (or of the last test, when
            that compared exactly these two).
        notes: What else happened (pairs that failed, a re-check that did not confirm).
        interrupted: The tuner was stopped during the ablation.
        together: The changes no finding asked for, reverted together in one test first (step 2 of the
            module docstring); empty when no such test ran.
    """

    trial_number: int
    winner_params: dict[str, Any]
    rounded: dict[str, list[Any]]
    effects: tuple[KnobEffect, ...]
    params: dict[str, Any]
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    better: bool
    run_dirs: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()
    interrupted: bool = False
    together: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def paired_stats(ratios: Sequence[float], *, noise_rel: float,
                 rng: np.random.Generator) -> tuple[float | None, float | None, float | None, bool]:
    """(median ratio, CI low, CI high, better): a percentile bootstrap of the median ratio.

    With few pairs it is coarse (and honest: with 3 pairs the CI spans the observed ratios).
    `better`: CI lower bound above 1 and the median's gain above the baseline's noise.
    """
    if not ratios:
        return None, None, None, False
    r = np.asarray(ratios, dtype=float)
    medians = _bootstrap_medians(r, rng)
    low, high = (float(x) for x in np.quantile(medians, [0.025, 0.975]))
    median = float(np.median(r))
    return median, low, high, low > 1.0 and median - 1.0 > noise_rel


def cannot_be_kept(ratios: Sequence[float], pairs: int) -> bool:
    """Whether the first `ratios` of `pairs` pairs already decide that the knob is dropped.

    A knob is kept only when the bootstrap CI's lower bound of the median ratio is above 1 + the
    baseline's noise (`ablate`), so never when it is at most 1. However fast the remaining pairs were, a resample's median is at most 1
    when more than half of its draws are pairs at or below 1; when such resamples are more than
    5 % of all (twice the 2.5 % the bound cuts: margin for the bootstrap's own noise), the lower
    bound is at most 1. With 3 pairs one pair at or below 1 decides it (26 % of resamples); with
    7 pairs it takes two.

    >>> cannot_be_kept([0.98], 3), cannot_be_kept([1.2, 1.1], 3), cannot_be_kept([0.9], 7)
    (True, False, False)
    """
    slower = sum(r <= 1.0 for r in ratios)
    if not slower or pairs <= 0:
        return False
    p = slower / pairs
    tail = sum(math.comb(pairs, k) * p**k * (1 - p) ** (pairs - k) for k in range(pairs // 2 + 1, pairs + 1))
    return tail > 0.05


def _bootstrap_medians(r: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    idx = rng.integers(0, r.size, size=(_BOOTSTRAP_RESAMPLES, r.size))
    return np.median(r[idx], axis=1)


def round_params(params: Mapping[str, Any], space: SearchSpace) -> dict[str, Any]:
    """Continuous values rounded to two significant figures, kept within their dimension's bounds."""
    out = dict(params)
    for name, value in params.items():
        dim = space.dims.get(name)
        if dim is None or dim.kind != "float" or dim.fixed or dim.choices or not isinstance(value, float):
            continue
        rounded = float(f"{value:.2g}")
        out[name] = min(max(rounded, float(dim.low)), float(dim.high))
    if "ddp.first_bucket_cap_mb" in out and "ddp.bucket_cap_mb" in out:
        out["ddp.first_bucket_cap_mb"] = min(out["ddp.first_bucket_cap_mb"], out["ddp.bucket_cap_mb"])
    return space.normalize(out)


def ablate(
    winner: Mapping[str, Any],
    baseline: Mapping[str, Any],
    *,
    trial_number: int,
    space: SearchSpace,
    measure: Callable[..., PairedRuns],
    noise_rel: float,
    rng: np.random.Generator,
    suspects: Collection[str] = (),
) -> Ablation:
    """Round, drop the unasked-for changes together, ablate greedily and re-check the winner (module docstring).

    Args:
        winner: The confirmed winner's parameters.
        baseline: Trial 0's parameters (the baseline's settings in the space's terms).
        trial_number: The winner's trial.
        space: The study's search space (bounds, conditions, defaults).
        measure: `measure(a_params, b_params, name, stop)` runs A and B interleaved and returns B / A
            ratios; `stop(ratios, pairs)` (None: run every pair) says after a pair that the rest
            cannot change the verdict.
        noise_rel: The baseline's run-to-run noise (a kept knob's gain must exceed it).
        rng: For the bootstraps.
        suspects: The dimensions the baseline's analysis proposed changing (empty: every change is tested alone).
    """
    base = space.normalize(dict(baseline))
    current = round_params(winner, space)
    rounded = {k: [winner[k], v] for k, v in current.items() if k in winner and winner[k] != v}
    order = sorted(current, key=lambda k: (ABLATION_ORDER.index(k) if k in ABLATION_ORDER else len(ABLATION_ORDER), k))
    effects: list[KnobEffect] = []
    notes: list[str] = []
    last: tuple[dict[str, Any], dict[str, Any], PairedRuns] | None = None
    interrupted = False

    def revert(knobs: Sequence[str]) -> dict[str, Any]:
        return space.normalize({**current, **{k: base.get(k, space.default(k)) for k in knobs}})

    def test(without: dict[str, Any], name: str) -> tuple[PairedRuns, float | None, float | None, float | None, bool]:
        runs = measure(without, current, name, cannot_be_kept)
        ratio, low, high, _ = paired_stats(runs.ratios, noise_rel=noise_rel, rng=rng)
        # Kept only when even the CI's lower bound of the slowdown without it is beyond the baseline's
        # noise: a no-op passenger measured (1.19, 1.66, 1.002) on a host with stalls passed "lower
        # bound above 1, median beyond noise" and would have stayed in best.toml.
        return runs, ratio, low, high, low is not None and low - 1.0 > noise_rel

    changed = [k for k in order if revert([k]) != current]
    unasked = [k for k in changed if k not in suspects]
    together = tuple(unasked) if len(unasked) >= 2 and len(unasked) < len(changed) else ()
    if together:
        without = revert(together)
        runs, ratio, low, high, kept = test(without, "unasked")
        notes += [f"{', '.join(together)} (together): {f}" for f in runs.failures]
        if ratio is not None and not kept:
            for knob in together:
                others = tuple(k for k in together if k != knob)
                effects.append(KnobEffect(
                    knob=knob, value=current[knob], reverted_to=base.get(knob, space.default(knob)), kept=False,
                    ratios=runs.ratios, ratio=ratio, ci_low=low, ci_high=high, run_dirs=runs.run_dirs,
                    failures=runs.failures, tested_with=others,
                    verdict=(f"no measurable effect, reverted with {', '.join(others)} ({ratio:.3f}x with them over "
                             f"{len(runs.ratios)} pair(s), 95 % CI {low:.3f}–{high:.3f})")))
            last = (without, dict(current), runs)
            current = without
        elif ratio is not None:
            notes.append(f"the {len(together)} changes no finding of the baseline asked for ({', '.join(together)}) "
                         f"were reverted together first: {ratio:.3f}x with them (95 % CI {low:.3f}–{high:.3f}), "
                         "so each was tested alone")
        interrupted = runs.interrupted
    decided = {e.knob for e in effects}
    for knob in order if not interrupted else ():
        if knob not in current or knob in decided:
            continue  # it went with a knob it depends on, or with the unasked-for changes
        reverted_to = base.get(knob, space.default(knob))
        without = revert([knob])
        if without == current:
            continue  # the baseline's value already, or the knob is fixed
        runs, ratio, low, high, kept = test(without, knob)
        last = (without, dict(current), runs)
        if ratio is None:
            verdict = "no measurable effect (no pair measured: " + ("; ".join(runs.failures) or "no run") + ")"
        elif kept:
            verdict = f"kept: {ratio:.3f}x faster with it (95 % CI {low:.3f}–{high:.3f})"
        else:
            verdict = (f"no measurable effect ({ratio:.3f}x with it over {len(runs.ratios)} pair(s), "
                       f"95 % CI {low:.3f}–{high:.3f})")
        effects.append(KnobEffect(knob=knob, value=current[knob], reverted_to=reverted_to, kept=kept,
                                  ratios=runs.ratios, ratio=ratio,
                                  ci_low=low, ci_high=high, verdict=verdict, run_dirs=runs.run_dirs,
                                  failures=runs.failures))
        notes += [f"{knob}: {f}" for f in runs.failures]
        if runs.interrupted:
            interrupted = True
            break
        if not kept:
            current = without
    minimal = current
    unchecked = dict(trial_number=trial_number, winner_params=dict(winner), rounded=rounded, params=minimal,
                     together=together, speedup=None, ci_low=None, ci_high=None, better=False)
    if interrupted:
        return Ablation(**unchecked, effects=tuple(effects), interrupted=True,
                        notes=tuple(notes + ["interrupted: the minimal configuration was not re-checked"]))
    if minimal == base:  # nothing kept: no configuration to re-check (the baseline against itself)
        return Ablation(**unchecked, effects=tuple(effects), notes=tuple(
            notes + [f"no change was kept: the winner (trial {trial_number}) stays the result as confirmed"]))
    if last is not None and last[0] == base and last[1] == minimal:
        final = last[2]  # the last test was this configuration against the baseline's settings
    else:
        final = measure(base, minimal, "final", None)
        notes += [f"re-check: {f}" for f in final.failures]
    speedup, low, high, better = paired_stats(final.ratios, noise_rel=noise_rel, rng=rng)
    effects = _with_shares(effects, final, speedup, rng)
    if not better:
        notes.append("the minimal configuration was not confirmed faster than the baseline in its re-check: the "
                     f"winner (trial {trial_number}) stays the result as confirmed")
    return Ablation(trial_number=trial_number, winner_params=dict(winner), rounded=rounded, effects=tuple(effects),
                    params=minimal, speedup=speedup, ci_low=low, ci_high=high, better=better,
                    run_dirs=final.run_dirs, notes=tuple(notes), interrupted=final.interrupted, together=together)


def _with_shares(effects: list[KnobEffect], final: PairedRuns, speedup: float | None,
                 rng: np.random.Generator) -> list[KnobEffect]:
    """Each kept knob's share of ln(speedup), with a CI from bootstrapping both medians."""
    if speedup is None or speedup <= 1.0:
        return effects
    total = np.log(_bootstrap_medians(np.asarray(final.ratios, dtype=float), rng))
    out = []
    for e in effects:
        if not e.kept or e.ratio is None:
            out.append(e)
            continue
        if e.run_dirs == final.run_dirs:
            share, ci = 1.0, (1.0, 1.0)  # the same measurement: all of it
        else:
            mine = np.log(_bootstrap_medians(np.asarray(e.ratios, dtype=float), rng))
            with np.errstate(divide="ignore", invalid="ignore"):
                shares = mine / np.where(total > 0, total, np.nan)
            shares = shares[np.isfinite(shares)]
            share = math.log(e.ratio) / math.log(speedup)
            ci = tuple(float(x) for x in np.quantile(shares, [0.025, 0.975])) if shares.size else (share, share)
        out.append(replace(e, share=share, share_ci=ci))
    return out


