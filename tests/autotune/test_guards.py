"""The study's guards on a real study (2 ranks, gloo): the noise-calibrated loss guard and the data guard.

`train_guard.py` does not seed its model, so the loss moves from run to run by itself; its
`--iterable` data set does not shard across DataLoader workers. One study holds every case:
trial 0 (the baseline's own settings) must never violate, a lossy Top-K at ratio 0.001
without error feedback must, and two workers over the unsharded stream must FAIL with the
cause named, after which the workers leave the search space.
"""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from torsh_tune.autotune import TuneResult, loss_check, tune
from torsh_tune.autotune.dataguard import check_data
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.reports import get_tuning_info, render_tuning_markdown
from torsh_tune.runtime.fingerprint import DataFingerprint

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_guard.py"
BASE = RunConfig.from_dict({"launch": {"nproc_per_node": 2}, "profiler": {"loss_every": 1},
                            "strategy": {"compression": {"error_feedback": False}}, "budget": {"kill_grace_s": 2.0}})
SPEC = {"ddp.bucket_cap_mb": {"value": 25.0}, "ddp.first_bucket_cap_mb": {"value": 1.0},
        "ddp.gradient_as_bucket_view": {"value": False}, "ddp.static_graph": {"value": False},
        "dataloader.num_workers": {"choices": [0, 2]}, "dataloader.prefetch_factor": {"value": 2},
        "dataloader.persistent_workers": {"value": False},
        "omp_num_threads": {"value": 1}, "compression.method": {"choices": ["none", "topk"]},
        "compression.ratio": {"value": 0.001}}
TOPK = {"compression.method": "topk", "dataloader.num_workers": 0}
WORKERS = {"compression.method": "none", "dataloader.num_workers": 2}


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, TuneResult]:
    study_dir = tmp_path_factory.mktemp("guards")
    result = tune(
        SCRIPT, ["--iterable"], base_config=BASE, study_dir=study_dir,
        study=StudyConfig(n_trials=4, baseline_repeats=4, confirm_top=0, sampler="random", seed=0, steps=12,
                          warmup_steps=2),
        space_spec=SPEC, cpu_count=2, initial_params=[TOPK, WORKERS],
    )
    return study_dir, result


def test_the_baseline_settings_never_violate_an_unseeded_loss(study):
    _, result = study
    # The unseeded model moves the mean loss from run to run: the guard measured that spread.
    assert result.baseline.loss_noise_rel is not None and result.baseline.loss_noise_rel > 0
    t0 = result.trials[0]
    assert t0.role == "pytorch-defaults" and t0.state == "COMPLETE"
    c = t0.loss_check
    assert c["repeats"] == 4 and c["num_steps"] == 14 and c["noise_rel"] == pytest.approx(result.baseline.loss_noise_rel)
    # The limit is the spread's one-sided t bound (3 df) or the tolerance, whichever is larger. With 3 repeats
    # (2 df, t 6.965) a baseline whose mean loss spread 9.7 % set the limit at +78 %, above Top-K's +73 %.
    assert c["threshold_rel"] == pytest.approx(max(0.01, 4.541 * c["noise_rel"] * (5 / 4) ** 0.5))
    assert not c["violated"] and t0.constraint_status == "feasible"
    assert t0.constraints["loss_deviation"] == pytest.approx(-c["margin_rel"]) and c["margin_rel"] > 0


def test_a_lossy_setting_that_hurts_violates_with_its_margin(study):
    study_dir, result = study
    t = result.trials[1]
    assert t.params["compression.method"] == "topk" and t.params["compression.ratio"] == 0.001
    c = t.loss_check
    assert c["violated"] and c["delta_rel"] > c["threshold_rel"] and c["margin_rel"] < 0
    assert t.constraint_status == "violated" and t.constraints["loss_deviation"] > 0
    info = get_tuning_info(study_dir)
    assert info.study["loss_tolerance"] == 0.01
    assert next(r for r in info.trials if r["number"] == 1)["loss_check"]["violated"] is True
    short, full = render_tuning_markdown(info, full=False), render_tuning_markdown(info, full=True)
    assert f"trial 1: loss {100 * c['delta_rel']:+.2f} % vs baseline, limit +{100 * c['threshold_rel']:.2f} %" in short
    assert "worse beyond noise" in short and "loss vs baseline (limit)" in full


def test_workers_over_an_unsharded_iterable_dataset_fail_and_leave_the_space(study):
    study_dir, result = study
    t = result.trials[2]
    assert t.params["dataloader.num_workers"] == 2 and t.state == "FAIL" and t.samples_s is None
    assert t.failure_reason.startswith("data_duplicated: the IterableDataset yields the same samples from every "
                                       "worker: shard it with get_worker_info()")
    assert "read each sample 2 times" in t.failure_reason
    # The knob that changed the data is searched no more: the next trial runs without it.
    assert result.data_guard == {"dataloader.num_workers": {"trial": 2, "reason": t.failure_reason}}
    assert "dataloader.num_workers" not in result.trials[3].params and result.trials[3].state == "COMPLETE"
    stored = optuna.load_study(study_name="torsh-tune", storage=result.storage)
    assert stored.trials[0].user_attrs["data_check"] == {"ok": True, "reason": "", "knob": None, "notes": []}


def _fingerprint(loader: DataLoader) -> dict:
    meta: dict = {}
    fp = DataFingerprint(meta, first_step=0, end_step=None)
    it = iter(loader)
    for step, batch in enumerate(it):
        fp.observe(batch, len(batch[0]), step, it)
    return meta["data_fingerprint"]


def _epochs_fingerprint(persistent: bool) -> dict:
    """Steps 4-5 (the second epoch's first half) of a shuffling loader with 2 workers, from seed 0."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 4, (32,), generator=g))
    loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=2, persistent_workers=persistent)
    meta: dict = {}
    fp = DataFingerprint(meta, first_step=4, end_step=6)
    step = 0
    for _ in range(2):
        it = iter(loader)
        for batch in it:
            fp.observe(batch, len(batch[0]), step, it)
            step += 1
    return meta["data_fingerprint"]


def test_persistent_workers_reorder_a_shuffled_epoch_and_the_guard_names_them():
    """PyTorch's own behaviour: a persistent iterator draws no new worker seed from the global RNG per epoch,
    so a sampler seeded from it (shuffle=True, no generator) orders the second epoch otherwise."""
    base = {0: _epochs_fingerprint(False)}
    assert _epochs_fingerprint(False)["digest"] == base[0]["digest"]  # the baseline repeats agree
    trial = {0: _epochs_fingerprint(True)}
    # Blamed on the persistence, not on the workers it needs (which would leave the study's space).
    both = {"dataloader.num_workers": 2, "dataloader.persistent_workers": True}
    check = check_data(trial, [base, base], changed=both)
    assert not check.ok and check.reason.startswith("data_changed") and check.knob == "dataloader.persistent_workers"
    assert check_data({0: _epochs_fingerprint(False)}, [base, base], changed={"dataloader.num_workers": 2}).ok


def test_check_data_tells_shuffling_augmentation_and_other_samples_apart():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    base = {0: _fingerprint(DataLoader(TensorDataset(x, y), batch_size=8))}
    repeats = [base, base]  # two baseline runs that read the same samples
    # Another order of the same samples is the same data.
    shuffled = _fingerprint(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    assert check_data({0: shuffled}, repeats, changed={}).ok
    # Other inputs with the same labels (augmentation drawn in workers): a note, not a failure.
    augmented = check_data({0: _fingerprint(DataLoader(TensorDataset(x + 1, y), batch_size=8))}, repeats,
                           changed={"dataloader.num_workers": 2})
    assert augmented.ok and "random augmentation" in augmented.notes[0]
    # Half the samples replaced (another sampler's choice): inputs and labels differ.
    mixed = TensorDataset(torch.cat([x[:32], x[:32] + 1]), torch.cat([y[:32], (y[:32] + 1) % 4]))
    other = check_data({0: _fingerprint(DataLoader(mixed, batch_size=8))}, repeats,
                       changed={"dataloader.num_workers": 2})
    assert not other.ok and other.reason.startswith("data_changed: rank 0 read other samples")
    assert "of the samples in common" in other.reason
    # One baseline run cannot show the data is deterministic; no data knob changed: a note, not a failure.
    assert check_data({0: _fingerprint(DataLoader(mixed, batch_size=8))}, [base], changed={"w": 1}).ok
    assert check_data({0: _fingerprint(DataLoader(mixed, batch_size=8))}, repeats, changed={"ddp.bucket_cap_mb": 5}).ok
    assert other.knob == "dataloader.num_workers"
    half = check_data({0: _fingerprint(DataLoader(TensorDataset(x, y), batch_size=4))}, repeats,
                      changed={"training.gradient_accumulation_steps": 2})
    assert not half.ok and "batches of 4 x float32[8] int64[], the baseline 8 x float32[8] int64[]" in half.reason
    assert half.knob == "training.gradient_accumulation_steps"
    assert check_data({0: _fingerprint(DataLoader(TensorDataset(x, y), batch_size=4))}, repeats,
                      changed={"training.gradient_accumulation_steps": 2}, allow_batch_changes=True).ok

    class Repeated(IterableDataset):
        def __iter__(self):
            yield from zip(x[:32].repeat(2, 1), y[:32].repeat(2))

    dup = check_data({0: _fingerprint(DataLoader(Repeated(), batch_size=8))}, repeats,
                     changed={"ddp.bucket_cap_mb": 5.0})
    assert not dup.ok and dup.reason.startswith("data_duplicated: rank 0 read each sample 2 times") and dup.knob is None


def test_loss_check_against_the_repeats_spread():
    base = pd.Series({s: 2.0 - 0.1 * s for s in range(10)})
    repeats = [base * (1 + e) for e in (0.0, 0.02, -0.02)]
    assert not loss_check(base * 1.03, repeats, tolerance=0.01).violated  # within the spread
    worse = loss_check(base * 1.5, repeats, tolerance=0.01)
    assert worse.violated and worse.t_stat > worse.t_crit
    # A deterministic baseline (no spread): the tolerance alone decides; one repeat: likewise.
    assert not loss_check(base * 1.005, [base, base], tolerance=0.01).violated
    assert loss_check(base * 1.02, [base], tolerance=0.01).violated
    assert loss_check(base * 0.5, repeats, tolerance=0.01).margin_rel > 0  # a lower loss is never a violation
    assert loss_check(pd.Series({99: 1.0}), repeats, tolerance=0.01) is None
    json.dumps(worse.to_dict())
