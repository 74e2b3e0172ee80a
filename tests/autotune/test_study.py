"""The study end to end with real torchrun launches (2 ranks, gloo), and its resume."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import optuna
import pandas as pd
import pytest

from torsh_tune.autotune import TuneResult, tune
from torsh_tune.autotune.objective import effective_settings
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.errors import ConfigError
from torsh_tune.importers import load_config_file
from torsh_tune.launch import find_run_processes

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_tune.py"

# rank 1 of train_tune.py raises when bucket_cap_mb > 100: the 150 MiB point is a planted failure.
# No DataLoader workers: the sampler's 3-4 per rank made a 5-step trial 8-9 s (their start-up and
# warm-up stock, on 2 cores) for nothing these tests look at.
SPEC = {
    "ddp.bucket_cap_mb": {"choices": [25.0, 150.0, 5.0]},
    "compression.method": {"value": "none"},
    "dataloader.num_workers": {"value": 0},
}
BASE = RunConfig.from_dict(
    {"launch": {"nproc_per_node": 2}, "profiler": {"loss_every": 1}, "budget": {"kill_grace_s": 2.0}}
)
COMMON = dict(base_config=BASE, space_spec=SPEC, cpu_count=2)
STUDY = StudyConfig(sampler="random", seed=0, steps=5, warmup_steps=2)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, TuneResult, list]:
    study_dir = tmp_path_factory.mktemp("study")
    seen = []
    result = tune(
        SCRIPT, [], study_dir=study_dir,
        # No ablation (tests/autotune/test_ablation.py has it): a winner confirmed by chance added ten runs.
        study=STUDY.replace(n_trials=3, baseline_repeats=2, confirm_top=1, confirm_pairs=1, ablation_pairs=0,
                            max_peak_mem_bytes=1 << 50),
        initial_params=[{"ddp.bucket_cap_mb": 150.0}, {"ddp.bucket_cap_mb": 5.0}], on_trial=seen.append, **COMMON,
    )
    return study_dir, result, seen


def test_trials_are_recorded_and_a_failed_trial_does_not_stop_the_study(study):
    study_dir, result, seen = study
    assert [t.number for t in seen] == [0, 1, 2]
    states = {t.number: t.state for t in result.trials}
    assert states[1] == "FAIL" and states[0] == states[2] == "COMPLETE"
    failed = result.trials[1]
    assert failed.params["ddp.bucket_cap_mb"] == 150.0
    assert failed.samples_s is None  # never zero throughput
    assert failed.failure_reason.startswith("script_error") and "planted failure" in failed.failure_reason
    assert any("planted failure" in line for line in failed.stderr_tail)
    # Trial 0 is PyTorch's defaults; completed trials pass the (lossless) quality guard.
    assert result.trials[0].params["ddp.bucket_cap_mb"] == 25.0
    for t in (result.trials[0], result.trials[2]):
        assert t.samples_s > 0 and t.constraint_status == "feasible" and t.loss_deviation is not None
        assert Path(t.run_dir).parent == study_dir / "trials"
        # The peak-memory limit is a constraint (far above this run's RSS: feasible).
        assert t.peak_mem_bytes > 0 and t.constraints["peak_mem"] == pytest.approx(t.peak_mem_bytes / (1 << 50) - 1)
        # Single objective: the running throughput is reported at every measured step (no pruner here).
        assert list(t.intermediate_samples_s) == list(range(5))
    with open(study_dir / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    # A recommendation the baseline's analysis enqueued (a noisy host can make one) stays WAITING once the
    # trial budget is spent: the study runs it on a resume. The trials that ran are the three.
    assert all(r["state"] == "WAITING" for r in rows[3:]), rows[3:]
    rows = rows[:3]
    assert [r["state"] for r in rows] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert "planted failure" in rows[1]["failure_reason"] and rows[1]["objective_samples_s"] == ""
    assert json.loads(rows[2]["params"])["ddp.bucket_cap_mb"] == 5.0
    frame = pd.read_parquet(study_dir / "trials.parquet")
    frame = frame[frame["state"] != "WAITING"]
    assert list(frame["number"]) == [0, 1, 2] and frame["objective_samples_s"].isna().tolist() == [False, True, False]


def test_baseline_confirmation_and_result_files(study):
    study_dir, result, _ = study
    assert len(result.baseline.samples_s) == 2 and result.baseline.noise_rel >= 0
    assert result.baseline.max_microbatches == 1
    assert len(result.confirmations) == 1
    c = result.confirmations[0]
    assert len(c.run_dirs) == 1 and len(c.ratios) == 1
    # Trial 0 spells out the defaults the baseline ran with (bucket cap 25, no workers, one
    # thread): the same job, so it is never confirmed against the baseline, however it ranked.
    base = effective_settings(result.baseline.run_dirs[0])
    assert base is not None and base["ddp"][0]["bucket_cap_mb"] == 25.0 and base["dataloaders"]
    assert effective_settings(result.trials[0].run_dir) == base != effective_settings(result.trials[2].run_dir)
    assert c.trial_number == 2
    if result.trials[0].samples_s > result.trials[2].samples_s:
        assert any(n.startswith("trial 0 not confirmed") for n in result.confirmation_notes)
    assert c.ci_low <= c.speedup <= c.ci_high
    # With one pair the CI is a point: a speedup is reported only if it clears the noise.
    assert c.better == (c.ci_low > 1 and c.speedup - 1 > result.baseline.noise_rel)
    best = load_config_file(study_dir / "best.toml")
    assert isinstance(best, RunConfig)
    assert best.budget.steps is None  # the tuning budget must not cut the real training short
    assert best == result.best_config
    if result.best_trial is None:
        assert best == BASE and result.best_speedup is None
    data = json.loads((study_dir / "result.json").read_text())
    assert data["baseline"]["samples_s"] == list(result.baseline.samples_s)
    assert result.objectives == ("throughput",) and result.pareto == () and data["pareto"] == []
    assert [t["number"] for t in data["trials"] if t["state"] != "WAITING"] == [0, 1, 2]
    for t in (t for t in result.trials if t.state != "WAITING"):  # a waiting trial never ran
        run = json.loads((Path(t.run_dir) / "run.json").read_text())
        assert find_run_processes(run["run_id"]) == []


def test_trials_carry_their_role_and_the_advisor_seeding_is_recorded(study):
    study_dir, result, _ = study
    assert [t.role for t in result.trials if t.state != "WAITING"] == ["pytorch-defaults", "initial", "initial"]
    assert all(t.role == "recommendation" for t in result.trials if t.state == "WAITING")
    attrs = optuna.load_study(study_name="torsh-tune", storage=f"sqlite:///{study_dir / 'study.db'}").user_attrs
    # A small CPU model without a bench link: the advisor's DDP is trial 0 itself (compression is
    # fixed to none here), and its FSDP/pipeline candidates need the API: nothing to enqueue.
    assert attrs["advisor"]["enqueued"] == []
    assert any("'fsdp' needs torsh_tune.parallelize" in line for line in attrs["advisor"]["skipped"])


def test_resume_continues_the_study_and_fails_stale_trials(study):
    study_dir, first, _ = study
    storage = f"sqlite:///{study_dir / 'study.db'}"
    # A tuner killed mid-trial leaves a RUNNING trial behind.
    stale = optuna.load_study(study_name="torsh-tune", storage=storage).ask()
    result = tune(
        SCRIPT, [], study_dir=study_dir, study=STUDY.replace(n_trials=5, baseline_repeats=2, confirm_top=0),
        **COMMON,
    )
    assert result.baseline == first.baseline  # not re-measured
    assert len(list((study_dir / "baseline").iterdir())) == 2
    by_number = {t.number: t for t in result.trials}
    assert [by_number[n].state for n in (0, 1, 2)] == [t.state for t in first.trials[:3]]
    assert by_number[stale.number].state == "FAIL" and "stale" in by_number[stale.number].failure_reason
    assert len(result.trials) == 5 and by_number[4].state in ("COMPLETE", "FAIL") and by_number[4].role == ""
    assert result.confirmations == () and result.best_trial is None


def test_bad_arguments_fail_before_any_launch(tmp_path):
    with pytest.raises(ConfigError, match=r"sampler must be one of \['tpe', 'random', 'gp', 'cmaes'\]"):
        tune(SCRIPT, [], base_config=BASE, study_dir=tmp_path / "s", study=STUDY.replace(sampler="annealing"))
    with pytest.raises(ConfigError, match="script must be an existing file"):
        tune(tmp_path / "missing.py", [], base_config=BASE, study_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match="n_trials must be an integer >= 1"):
        tune(SCRIPT, [], base_config=BASE, study_dir=tmp_path / "s", study=STUDY.replace(n_trials=0))
    assert not (tmp_path / "s").exists()


def test_samplers_with_missing_dependencies_fail_early(tmp_path):
    import importlib.util

    from torsh_tune.autotune import make_sampler

    assert make_sampler("tpe", seed=1) is not None and make_sampler("random", seed=1) is not None
    for name, module in (("gp", "scipy"), ("cmaes", "cmaes")):
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ConfigError, match=f"--sampler {name} must be used with .*{module}"):
                tune(SCRIPT, [], base_config=BASE, study_dir=tmp_path / "s", study=STUDY.replace(sampler=name))
        else:
            assert make_sampler(name, seed=1) is not None
    assert not (tmp_path / "s").exists()


def test_a_waiting_trial_shows_the_parameters_it_was_queued_with():
    from torsh_tune.autotune.study import _trial_result

    study = optuna.create_study()
    queued = {"ddp.bucket_cap_mb": 5.0, "compression.method": "none"}
    study.enqueue_trial(queued, user_attrs={"role": "recommendation"})
    (waiting,) = study.get_trials(deepcopy=False)
    assert waiting.state.name == "WAITING" and waiting.params == {}  # Optuna has none until it runs
    t = _trial_result(waiting)
    assert t.state == "WAITING" and t.role == "recommendation" and t.params == queued and t.samples_s is None
