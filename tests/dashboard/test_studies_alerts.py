"""Studies in the runs list and their tuning view; alerts and the bench figure on the overview (no browser)."""

from __future__ import annotations

import json
import shutil

import pytest

from torsh_tune.dashboard import RunNotFound, RunStore, is_study_dir, overview_info, tuning_view
from torsh_tune.fabric import CommModel, fit_alpha_beta, save_model
from torsh_tune.reports import get_tuning_info

from .conftest import DATA, add_planted_run, add_run, add_study, snapshot


def test_studies_are_listed_as_kind_study_with_their_verdict(runs_dir):
    add_run(runs_dir, "healthy")
    study = add_study(runs_dir)
    before = snapshot(runs_dir)
    store = RunStore(runs_dir)
    rows = {r.run_id: r for r in store.list_runs()}
    assert rows["healthy"].kind == "run" and rows["study_small"].kind == "study"
    row = rows["study_small"]
    expected = get_tuning_info(study)
    assert row.status == "finished" and row.headline == expected.verdict["title"]
    assert row.script == "train_tune.py" and row.world_size == 2 and row.started_at.startswith("20")
    assert store.is_study("study_small") and not store.is_study("healthy")
    assert snapshot(runs_dir) == before


def test_tuning_view_reuses_tuning_info_and_is_cached_until_the_study_changes(runs_dir):
    study = add_study(runs_dir)
    store = RunStore(runs_dir)
    view = tuning_view(store, "study_small")
    ref = get_tuning_info(study)
    assert view.info.trials == ref.trials and view.info.confirmations == ref.confirmations
    assert list(view.figures) == ["history", "importances", "parallel", "confirmation"]
    assert store.tuning("study_small") is view.info  # nothing changed: the cached TuningInfo
    result = study / "result.json"
    doc = json.loads(result.read_text())
    doc["trials"] = doc["trials"][:3]
    result.write_text(json.dumps(doc))  # the study moved on (here: rewritten): read again
    assert len(store.tuning("study_small").trials) == 3
    with pytest.raises(RunNotFound):
        store.tuning("../study_small")
    add_run(runs_dir, "healthy")
    with pytest.raises(RunNotFound):
        store.tuning("healthy")  # a run is not a study


def test_study_detection(tmp_path):
    assert is_study_dir(DATA / "study_small") and is_study_dir(DATA / "study_pareto")
    assert not is_study_dir(DATA / "healthy")
    starting = tmp_path / "tune-train"  # the main job before its first trial: profile/ only
    (starting / "profile").mkdir(parents=True)
    assert is_study_dir(starting)


def test_overview_shows_the_planted_alerts(runs_dir):
    add_planted_run(runs_dir)
    view = overview_info(RunStore(runs_dir), "planted")
    assert [a["kind"] for a in view.alerts] == ["low_gpu_utilization", "memory_pressure",
                                                "communication_overhead", "step_time_spike"]
    assert view.busbw_figure is None  # no bench reference


def test_overview_draws_busbw_against_the_bench_model(runs_dir, tmp_path):
    sizes = [1 << 16, 1 << 20, 1 << 24]
    fit = fit_alpha_beta("all_reduce", sizes, [1e-4 + s / 1e9 for s in sizes], group_size=2)
    save_model(CommModel(world_size=2, nnodes=1, nproc_per_node=2, fits=(fit,)), tmp_path / "bench")
    run = runs_dir / "comm"
    shutil.copytree(DATA / "recorded" / "comm_bound", run)
    info = json.loads((run / "run.json").read_text())
    info["reference_bench"] = str(tmp_path / "bench")
    (run / "run.json").write_text(json.dumps(info))
    fig = overview_info(RunStore(runs_dir), "comm").busbw_figure
    assert fig is not None
    assert [t.name for t in fig.data][:2] == ["measured (median over steps)", "model at the bucket size"]


def test_a_running_study_is_read_from_its_storage_without_writing_to_it(runs_dir):
    # A study the tuner is still writing: no result.json yet, only its Optuna storage (made here through
    # optuna's own API, as autotune.study stores trials: params in the "config_params" user attr).
    optuna = pytest.importorskip("optuna")
    study_dir = runs_dir / "tune-train"
    (study_dir / "ranks").mkdir(parents=True)
    storage = f"sqlite:///{study_dir / 'study.db'}"
    study = optuna.create_study(study_name="torsh-tune", storage=storage, direction="maximize")
    dist = {"ddp.bucket_cap_mb": optuna.distributions.CategoricalDistribution([5.0, 25.0])}
    for value in (100.0, 120.0):
        trial = study.ask(dist)
        trial.set_user_attr("config_params", dict(trial.params))
        study.tell(trial, value)
    before = snapshot(runs_dir)
    store = RunStore(runs_dir)
    row = store.row("tune-train")
    assert (row.kind, row.status, row.strategy) == ("study", "running", "2 trials")
    info = store.tuning("tune-train")
    assert info.study["source"] == "storage" and [t["samples_s"] for t in info.trials] == [100.0, 120.0]
    assert info.warnings == ()  # the read-only storage URL opened cleanly
    assert snapshot(runs_dir) == before
