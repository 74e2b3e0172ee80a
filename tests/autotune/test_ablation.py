"""The ablation on a real study of the data-bound example (2 ranks, gloo): the winner is reduced to its workers.

Trial 1 is planted as a winner that changes three knobs: two DataLoader workers (what makes
`examples/data_bound.py` faster: it waits on storage for every sample), a bucket cap with
sixteen digits and fp16 gradient compression (passengers: lossy, for nothing). The ablation
must keep the workers, drop the passengers as "no measurable effect", round the bucket cap,
and write only the workers to best.toml. The baseline's io finding names the workers, so the two
passengers are reverted together and, unless that test measures them faster, dropped in one test (8
ablation runs where one test per knob took 12-14). 15-19 runs: with 2 pairs per test and 2 baseline runs a
no-op knob was kept on a loaded host (both of its pairs at 1.5x by chance, the baseline's noise
0.5 %); with 3 pairs every pair must favour it (a no-op: 1 in 8) and its gain must beat the noise
of 3 baseline runs. 16 measured steps (~0.5-1 s): with 6 (0.15-0.3 s) one stall of the host moved
a no-op's ratio to 1.66, and the keep rule now asks the CI's lower bound to clear the noise.
With two workers short and long steps alternate: the median of per-step throughputs, the
objective until then, made fp16 look 1.05-1.26x faster in all three pairs twice; the objective is
now the rate (samples over time, `objective.steady_rate`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optuna
import pytest

from torsh_tune.autotune import TuneResult, build_space, tune
from torsh_tune.autotune.ablation import PairedRuns, ablate, cannot_be_kept, paired_stats, round_params
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.importers import load_config_file
from torsh_tune.reports import get_tuning_info, render_tuning_markdown

# Which knobs are kept is measured speed: alone (`make test` runs the `serial` tests after the parallel part).
pytestmark = pytest.mark.serial

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data_bound.py"
ARGS = ["--read-ms", "6", "--image-size", "48", "--batch-size", "8", "--num-samples", "512", "--log-every", "1000"]
BASE = RunConfig.from_dict({"launch": {"nproc_per_node": 2}, "budget": {"kill_grace_s": 2.0}})
BUCKET = 60.91964802953841
SPEC = {"ddp.first_bucket_cap_mb": {"value": 1.0}, "ddp.gradient_as_bucket_view": {"value": False},
        "dataloader.num_workers": {"choices": [0, 2]}, "dataloader.prefetch_factor": {"value": 2},
        "dataloader.persistent_workers": {"value": False},
        "omp_num_threads": {"value": 1}, "compression.method": {"choices": ["none", "fp16"]}}
WINNER = {"ddp.bucket_cap_mb": BUCKET, "ddp.static_graph": False, "dataloader.num_workers": 2,
          "compression.method": "fp16"}


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, TuneResult]:
    study_dir = tmp_path_factory.mktemp("ablation")
    result = tune(
        EXAMPLE, ARGS, base_config=BASE, study_dir=study_dir,
        study=StudyConfig(n_trials=2, baseline_repeats=3, confirm_top=1, confirm_pairs=1, ablation_pairs=3,
                          sampler="random", seed=0, steps=16, warmup_steps=2),
        space_spec=SPEC, cpu_count=2, initial_params=[WINNER],
    )
    return study_dir, result


@pytest.mark.slow
def test_the_ablation_keeps_the_workers_and_drops_the_rest(study):
    study_dir, result = study
    assert result.trials[1].params["dataloader.num_workers"] == 2 and result.best_trial == 1
    a = result.ablation
    assert a is not None and a.trial_number == 1 and a.rounded == {"ddp.bucket_cap_mb": [BUCKET, 61.0]}
    effects = {e.knob: e for e in a.effects}
    # Lossy and risky knobs are tested first, the workers last (against the baseline's settings).
    assert list(effects) == ["compression.method", "ddp.bucket_cap_mb", "dataloader.num_workers"]
    workers = effects.pop("dataloader.num_workers")
    assert workers.kept and workers.ratio > 1.3 and workers.ci_low > 1 and len(workers.ratios) == 3
    for e in effects.values():
        assert not e.kept and e.verdict.startswith("no measurable effect") and e.share is None
    # The baseline's io finding asked for the workers (sized beyond this space's 0 and 2, no trial of it was
    # seeded, but the knob is named): the two changes nothing asked for were reverted together and dropped together.
    attrs = optuna.load_study(study_name="torsh-tune", storage=f"sqlite:///{study_dir / 'study.db'}").user_attrs
    assert "dataloader.num_workers" in attrs["recommendations"]["asked"], attrs
    assert not {"compression.method", "ddp.bucket_cap_mb"} & {*attrs["recommendations"]["asked"],
                                                              *attrs["advisor"]["asked"]}, attrs
    assert a.together == ("compression.method", "ddp.bucket_cap_mb")
    if _dropped_together(a):
        assert effects["compression.method"].tested_with == ("ddp.bucket_cap_mb",)
        assert effects["ddp.bucket_cap_mb"].tested_with == ("compression.method",)
        assert effects["compression.method"].run_dirs == effects["ddp.bucket_cap_mb"].run_dirs
    else:
        # Together they measured faster beyond the baseline's noise (CI once read 1.040-1.048: fp16's hook path
        # beside the builtin all-reduce on 2 cores crowded by 4 loader workers), so each was tested alone and
        # dropped alone; the unit tests above and below hold both branches on scripted ratios.
        assert all(e.tested_with == () and len(e.run_dirs) >= 1 for e in effects.values())
    assert workers.tested_with == ()
    # The last test compared the minimal configuration with the baseline: it is the re-check.
    assert a.better and a.run_dirs == workers.run_dirs and a.speedup == workers.ratio
    assert workers.share == 1.0 and workers.share_ci == (1.0, 1.0)
    assert result.best_params == a.params and a.params["dataloader.num_workers"] == 2
    # Only the workers differ from trial 0 (the baseline's settings); prefetch_factor and persistent_workers come with
    # them (each fixed by the space).
    changed = {k: v for k, v in a.params.items() if v != result.trials[0].params.get(k)}
    assert changed == {"dataloader.num_workers": 2, "dataloader.prefetch_factor": 2,
                       "dataloader.persistent_workers": False}
    assert result.best_speedup == a.speedup and result.best_ci == (a.ci_low, a.ci_high)
    best = load_config_file(study_dir / "best.toml")
    assert best.strategy.dataloader.num_workers == 2 and best.strategy.compression.method == "none"
    assert best.strategy.ddp.bucket_cap_mb in (None, 25.0)
    # Every ablation run is a normal run directory under ablation/.
    assert all(Path(d).parent == study_dir / "ablation" for pair in workers.run_dirs for d in pair)


@pytest.mark.slow
def test_the_report_shows_each_knobs_share(study):
    study_dir, result = study
    info = get_tuning_info(study_dir)
    assert info.ablation["better"] and info.best["speedup"] == result.best_speedup
    assert info.verdict["text"].startswith("Trial 1 reduced to the 1 of its 3 change(s) that earn its speedup "
                                           "(dataloader.num_workers)")
    md = render_tuning_markdown(info, full=False)
    assert "## Minimal configuration (ablation)" in md
    assert "| dataloader.num_workers | 2 | 0 |" in md and "| 100 % (100–100 %) | kept |" in md
    assert md.count("dropped: no measurable effect") == 2
    if _dropped_together(result.ablation):
        assert "| dropped: no measurable effect (reverted with ddp.bucket_cap_mb) |" in md
        assert "The changes no finding of the baseline asked for were first reverted together" in md
    else:
        assert "(compression.method, ddp.bucket_cap_mb) were reverted together first: " in md
    assert "`ddp.bucket_cap_mb` 60.9 → 61" in md
    json.dumps(info.to_dict(), allow_nan=False)


def _dropped_together(a) -> bool:
    """Whether the study's two unasked-for changes were dropped in the one test that reverted them together:
    a measurement (their 3 pairs against the baseline's noise), not a rule."""
    return not any("were reverted together first" in n for n in a.notes)


def test_rounding_and_the_greedy_order_on_the_space():
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base = space.baseline_params()
    winner = space.normalize({**base, "ddp.bucket_cap_mb": 60.91964802953841, "compression.method": "topk",
                              "compression.ratio": 0.0123456, "dataloader.num_workers": 3,
                              "dataloader.prefetch_factor": 4})
    rounded = round_params(winner, space)
    assert rounded["ddp.bucket_cap_mb"] == 61.0 and rounded["compression.ratio"] == 0.012
    tested, pairs = [], []

    def speed(params):  # a pure speed model: the workers make it 2x faster, nothing else counts
        return 2.0 if params.get("dataloader.num_workers") else 1.0

    def measure(a, b, name, stop):
        tested.append(name)
        ratios = []
        for _ in range(3):  # the study's loop: `stop` ends the pairs once the verdict is decided
            if stop is not None and stop(ratios, 3):
                break
            ratios.append(speed(b) / speed(a))
        pairs.append(len(ratios))
        return PairedRuns(ratios=tuple(ratios), run_dirs=((name, name),) * len(ratios))

    abl = ablate(winner, base, trial_number=7, space=space, measure=measure, noise_rel=0.05,
                 rng=np.random.default_rng(0))
    # The ratio went with the method it depends on; prefetch_factor is tested before the workers.
    assert tested == ["compression.method", "ddp.bucket_cap_mb", "dataloader.prefetch_factor",
                      "dataloader.num_workers"]
    assert [e.knob for e in abl.effects if e.kept] == ["dataloader.num_workers"]
    # A passenger's first pair (1.0x: not faster with it) decides its verdict; the workers get all 3.
    assert pairs == [1, 1, 1, 3]
    assert abl.params == space.normalize({**base, "dataloader.num_workers": 3})


def _modelled(speed, tested: list, pairs: list):
    """A `measure` of a pure speed model, with the study's loop: `stop` ends the pairs once the verdict is decided."""
    def measure(a, b, name, stop):
        tested.append(name)
        ratios = []
        for _ in range(3):
            if stop is not None and stop(ratios, 3):
                break
            ratios.append(speed(b) / speed(a))
        pairs.append(len(ratios))
        return PairedRuns(ratios=tuple(ratios), run_dirs=((name, name),) * len(ratios))
    return measure


def _winner_of_five_changes(space):
    base = space.baseline_params()
    return base, space.normalize({**base, "ddp.bucket_cap_mb": 61.0, "ddp.static_graph": True,
                                  "compression.method": "topk", "compression.ratio": 0.012,
                                  "dataloader.num_workers": 3, "dataloader.prefetch_factor": 4})


def test_the_changes_no_finding_asked_for_are_dropped_together_in_one_test():
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base, winner = _winner_of_five_changes(space)
    tested, pairs = [], []
    measure = _modelled(lambda p: 2.0 if p.get("dataloader.num_workers") else 1.0, tested, pairs)
    abl = ablate(winner, base, trial_number=7, space=space, measure=measure, noise_rel=0.05,
                 rng=np.random.default_rng(0), suspects={"dataloader.num_workers", "dataloader.prefetch_factor"})
    # One knob at a time: 5 tests (method, static graph, bucket cap, prefetch, workers; the ratio goes with the method).
    assert tested == ["unasked", "dataloader.prefetch_factor", "dataloader.num_workers"] and pairs == [1, 1, 3]
    effects = {e.knob: e for e in abl.effects}
    unasked = ["compression.method", "compression.ratio", "ddp.static_graph", "ddp.bucket_cap_mb"]
    assert list(effects) == [*unasked, "dataloader.prefetch_factor", "dataloader.num_workers"]
    for knob in unasked:
        e = effects[knob]
        assert not e.kept and e.tested_with == tuple(k for k in unasked if k != knob)
        assert e.ratios == (1.0,) and e.run_dirs == (("unasked", "unasked"),)
        assert e.verdict.startswith("no measurable effect, reverted with ")
    assert effects["dataloader.num_workers"].kept and effects["dataloader.num_workers"].tested_with == ()
    assert abl.params == space.normalize({**base, "dataloader.num_workers": 3}) and abl.better
    assert abl.speedup == 2.0 and abl.run_dirs == (("dataloader.num_workers",) * 2,) * 3
    assert abl.together == tuple(unasked)


def test_a_group_that_costs_speed_is_taken_apart_knob_by_knob():
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base, winner = _winner_of_five_changes(space)
    tested, pairs = [], []

    def speed(p):  # the workers 2x, and a bucket cap no finding asked for 1.5x
        return (2.0 if p.get("dataloader.num_workers") else 1.0) * (1.5 if p["ddp.bucket_cap_mb"] == 61.0 else 1.0)

    abl = ablate(winner, base, trial_number=7, space=space, measure=_modelled(speed, tested, pairs), noise_rel=0.05,
                 rng=np.random.default_rng(0), suspects={"dataloader.num_workers"})
    assert tested == ["unasked", "compression.method", "ddp.static_graph", "ddp.bucket_cap_mb",
                      "dataloader.prefetch_factor", "dataloader.num_workers", "final"]
    assert pairs == [3, 1, 1, 3, 1, 3, 3]
    assert [e.knob for e in abl.effects if e.kept] == ["ddp.bucket_cap_mb", "dataloader.num_workers"]
    assert all(e.tested_with == () for e in abl.effects) and len(abl.together) == 5
    assert any(n.startswith("the 5 changes no finding of the baseline asked for (compression.method, "
                            "compression.ratio, ddp.static_graph, ddp.bucket_cap_mb, dataloader.prefetch_factor) "
                            "were reverted together first: 1.500x") for n in abl.notes), abl.notes
    assert abl.speedup == pytest.approx(3.0) and abl.better


@pytest.mark.parametrize("suspects", [set(), {"compression.method", "compression.ratio", "ddp.static_graph",
                                             "ddp.bucket_cap_mb", "dataloader.prefetch_factor",
                                             "dataloader.num_workers"}, {"ddp.gradient_as_bucket_view"}])
def test_without_a_group_to_drop_every_change_is_tested_alone(suspects):
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base, winner = _winner_of_five_changes(space)
    tested = []
    abl = ablate(winner, base, trial_number=7, space=space, noise_rel=0.05, rng=np.random.default_rng(0),
                 measure=_modelled(lambda p: 2.0 if p.get("dataloader.num_workers") else 1.0, tested, []),
                 suspects=suspects)
    # None asked for (or only a knob the winner left alone): a group of every change would be the baseline.
    assert tested == ["compression.method", "ddp.static_graph", "ddp.bucket_cap_mb", "dataloader.prefetch_factor",
                      "dataloader.num_workers"]
    assert all(e.tested_with == () for e in abl.effects) and abl.together == ()


def test_nothing_kept_is_no_re_check_of_the_baseline_against_itself():
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base, winner = _winner_of_five_changes(space)
    tested = []
    abl = ablate(winner, base, trial_number=7, space=space, noise_rel=0.05, rng=np.random.default_rng(0),
                 measure=_modelled(lambda p: 1.0, tested, []))
    assert "final" not in tested and abl.params == space.normalize(base)
    assert not abl.better and abl.speedup is None
    assert abl.notes[-1] == "no change was kept: the winner (trial 7) stays the result as confirmed"


@pytest.mark.parametrize(("ratios", "pairs", "settled"), [
    ([], 3, False), ([1.3], 3, False), ([1.3, 1.2], 3, False), ([0.99], 3, True), ([1.3, 1.0], 3, True),
    ([0.9], 7, False), ([0.9, 1.5, 0.95], 7, True), ([0.9], 1, True),
])
def test_the_pairs_stop_once_the_knob_cannot_be_kept(ratios, pairs, settled):
    assert cannot_be_kept(ratios, pairs) is settled
    if settled:  # whatever the remaining pairs measure, the bootstrap's lower bound stays at or below 1
        full = list(ratios) + [1e6] * (pairs - len(ratios))
        assert not paired_stats(full, noise_rel=0.0, rng=np.random.default_rng(1))[3]


@pytest.mark.parametrize(("ratios", "noise_rel", "kept"), [
    ((1.194, 1.662, 1.002), 0.027, False),  # all above 1, median 1.19: a no-op seen on a stalling host
    ((1.05, 1.06, 1.045), 0.02, True),      # a small effect, every pair beyond the noise
    ((1.05, 1.06, 1.045), 0.05, False),     # the same effect inside a noisier baseline
])
def test_a_knob_is_kept_only_when_the_cis_lower_bound_clears_the_noise(ratios, noise_rel, kept):
    space = build_space(nproc_per_node=2, cpu_count=8, baseline_num_microbatches=1)
    base = space.baseline_params()
    winner = space.normalize({**base, "dataloader.num_workers": 3})

    def measure(a, b, name, stop):
        return PairedRuns(ratios=ratios, run_dirs=((name, name),) * len(ratios))

    abl = ablate(winner, base, trial_number=1, space=space, measure=measure, noise_rel=noise_rel,
                 rng=np.random.default_rng(0))
    (effect,) = [e for e in abl.effects if e.knob == "dataloader.num_workers"]
    assert effect.kept is kept, effect.verdict
