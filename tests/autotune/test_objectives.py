"""Objectives and constraints: throughput + loss (Pareto front, its confirmation), peak memory.

The study runs real torchrun launches (2 ranks, gloo) over gradient compression
(none / fp16 / top-k), whose loss deviation from the baseline is the second objective.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import optuna
import pandas as pd
import pytest

from torsh_tune.autotune import TuneResult, loss_check, trial_constraints, tune
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.errors import ConfigError
from torsh_tune.importers import load_config_file

from helpers import run_cli

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_tune.py"
SPEC = {
    "ddp.bucket_cap_mb": {"value": 25.0},
    "compression.method": {"choices": ["none", "fp16", "topk"]},
    "compression.ratio": {"value": 0.1},
    # No DataLoader workers: the sampler gave fp16's trial 3 per rank, whose 12 prefetched batches
    # extended its warm-up by 10 steps (a 20 s trial of a 5-step study).
    "dataloader.num_workers": {"value": 0},
}
BASE = RunConfig.from_dict(
    {"launch": {"nproc_per_node": 2}, "profiler": {"loss_every": 1}, "budget": {"kill_grace_s": 2.0}}
)
OBJECTIVES = ("throughput", "loss")


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> tuple[Path, TuneResult]:
    study_dir = tmp_path_factory.mktemp("multi")
    result = tune(
        SCRIPT, [], base_config=BASE, study_dir=study_dir,
        # No ablation (test_ablation.py has its own): whether one ran depended on the confirmation's noise,
        # and it took 10 more launches when it did.
        study=StudyConfig(n_trials=3, baseline_repeats=1, confirm_top=1, confirm_pairs=1, ablation_pairs=0,
                          sampler="random", seed=0, steps=5, warmup_steps=2, objectives=OBJECTIVES,
                          loss_tolerance=0.05),
        space_spec=SPEC, cpu_count=2,
        initial_params=[{"compression.method": "fp16"}, {"compression.method": "topk"}],
    )
    return study_dir, result


def _dominates(a: dict[str, float], b: dict[str, float]) -> bool:
    no_worse = a["throughput"] >= b["throughput"] and a["loss"] <= b["loss"]
    return no_worse and (a["throughput"] > b["throughput"] or a["loss"] < b["loss"])


def test_throughput_and_loss_give_a_pareto_front(multi):
    study_dir, result = multi
    assert result.objectives == OBJECTIVES
    # A recommendation the baseline's analysis enqueued (a noisy host can make one) stays WAITING once
    # the trial budget is spent; it shows the parameters it was queued with. The trials that ran are three.
    waiting = [t for t in result.trials if t.state == "WAITING"]
    assert all(t.role == "recommendation" and "compression.method" in t.params for t in waiting), waiting
    ran = [t for t in result.trials if t.state != "WAITING"]
    assert [t.params["compression.method"] for t in ran] == ["none", "fp16", "topk"]
    complete = {t.number: t for t in result.trials if t.state == "COMPLETE"}
    assert complete, [t.failure_reason for t in result.trials]
    values = {n: {"throughput": t.samples_s, "loss": t.loss_deviation} for n, t in complete.items()}
    feasible = {n for n, t in complete.items() if t.constraint_status == "feasible"}
    front = {p.number: p for p in result.pareto}
    assert front and set(front) <= feasible
    for n, p in front.items():
        assert p.values == pytest.approx(values[n]) and p.params == complete[n].params
        assert not any(_dominates(values[m], values[n]) for m in feasible)
    for n in feasible - set(front):  # off the front only when something on it is at least as good
        assert any(_dominates(values[m], values[n]) for m in front)
    speeds = [p.values["throughput"] for p in result.pareto]
    assert speeds == sorted(speeds, reverse=True)
    # No pruning in a multi-objective study: nothing reported per step.
    assert all(t.intermediate_samples_s == {} for t in result.trials)
    data = json.loads((study_dir / "result.json").read_text())
    assert data["objectives"] == list(OBJECTIVES)
    assert data["pareto"] == [json.loads(json.dumps(asdict(p))) for p in result.pareto]
    stored = optuna.load_study(study_name="torsh-tune", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert [d.name for d in stored.directions] == ["MAXIMIZE", "MINIMIZE"]


def test_the_fastest_feasible_front_member_is_confirmed_and_best_toml_applies(multi):
    study_dir, result = multi
    assert len(result.confirmations) <= 1
    base = BASE.apply_patch({"budget": {"steps": 5, "warmup_steps": 2}, "profiler": {"enabled": True}}).to_dict()
    from torsh_tune.autotune import build_space

    space = build_space(nproc_per_node=2, cpu_count=2, spec=SPEC)
    from torsh_tune.autotune.objective import effective_settings

    # Trial 0 spells out the defaults the baseline ran with: never confirmed, said in the notes.
    ran = {t.number: effective_settings(t.run_dir) for t in result.trials if t.run_dir}
    same = effective_settings(result.baseline.run_dirs[0])
    eligible = [p for p in result.pareto if space.to_config(RunConfig.from_dict(base), p.params).to_dict() != base
                and ran.get(p.number) != same]
    for p in result.pareto:
        if ran.get(p.number) == same and eligible and p.values["throughput"] > eligible[0].values["throughput"]:
            assert any(n.startswith(f"trial {p.number} not confirmed") for n in result.confirmation_notes)
    if eligible:
        assert [c.trial_number for c in result.confirmations] == [eligible[0].number]
    best = load_config_file(study_dir / "best.toml")
    assert best == result.best_config
    applied = run_cli("apply", str(study_dir), timeout=60)
    assert applied.returncode == 0 and applied.stdout == (study_dir / "best.toml").read_text()


def test_a_resumed_study_keeps_its_objectives(multi):
    study_dir, _ = multi
    with pytest.raises(ConfigError, match=r"objectives must be the resumed study's \('throughput', 'loss'\)"):
        tune(
            SCRIPT, [], base_config=BASE, study_dir=study_dir, study=StudyConfig(n_trials=3), space_spec=SPEC,
            cpu_count=2,
        )


def test_objective_arguments_are_checked_before_anything_runs(tmp_path):
    common = dict(base_config=BASE, study_dir=tmp_path / "s")
    with pytest.raises(ConfigError, match=r"objectives must be \('throughput',\) or \('throughput', 'loss'\)"):
        tune(SCRIPT, [], study=StudyConfig(objectives=("loss",)), **common)
    with pytest.raises(ConfigError, match="pruner must be 'none' with several objectives"):
        tune(SCRIPT, [], study=StudyConfig(objectives=OBJECTIVES, pruner="median"), **common)
    with pytest.raises(ConfigError, match="max_peak_mem_bytes must be an integer > 0"):
        tune(SCRIPT, [], study=StudyConfig(max_peak_mem_bytes=0), **common)
    assert not (tmp_path / "s").exists()


def test_constraints_loss_guard_and_peak_memory():
    base = pd.Series({s: 2.0 - 0.1 * s for s in range(5)})
    check = loss_check(base * 1.002, [base], tolerance=0.01)
    c = trial_constraints(loss=check, lossy=True)
    assert c == {"loss_deviation": pytest.approx(-0.008)}  # -(tolerance - excess): the margin left
    # Without a comparable loss only a lossless choice passes.
    assert trial_constraints(loss=None, lossy=True) == {"loss_deviation": 1.0}
    assert trial_constraints(loss=None, lossy=False) == {"loss_deviation": 0.0}
    over = trial_constraints(loss=check, lossy=False, peak_mem_bytes=3 << 30, max_peak_mem_bytes=2 << 30)
    assert over["peak_mem"] == pytest.approx(0.5)  # > 0: violated
    under = trial_constraints(loss=check, lossy=False, peak_mem_bytes=1 << 30, max_peak_mem_bytes=2 << 30)
    assert under["peak_mem"] == pytest.approx(-0.5)
    assert "peak_mem" not in trial_constraints(loss=check, lossy=False, peak_mem_bytes=1 << 30)