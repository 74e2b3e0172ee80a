"""The study report: TuningInfo from recorded studies (and a live storage), its figures, Markdown, HTML, CLI.

`tests/data/study_small` and `study_pareto` are real `tune()` studies (2 ranks, gloo),
recorded by `tests/data/record_study.py`: no launch happens here.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest

from torsh_tune.errors import ConfigError
from torsh_tune.reports import (
    IMPORTANCE_METHOD,
    TuningInfo,
    get_tuning_info,
    render_tuning_html,
    render_tuning_markdown,
    write_tuning_reports,
)
from torsh_tune.reports import figures as F

from helpers import run_cli

DATA = Path(__file__).resolve().parents[1] / "data"
SMALL, PARETO = DATA / "study_small", DATA / "study_pareto"


@pytest.fixture(scope="module")
def small() -> TuningInfo:
    return get_tuning_info(SMALL)


@pytest.fixture(scope="module")
def pareto() -> TuningInfo:
    return get_tuning_info(PARETO)


def _result(**overrides) -> dict:
    """A result.json of a study with two parameters: "a" decides the throughput, "b" does not."""
    trials = []
    for i, (a, b, y) in enumerate([(1, "x", 100.0), (1, "y", 101.0), (2, "x", 400.0), (2, "y", 398.0),
                                   (1, "x", 99.0), (2, "y", 402.0)]):
        trials.append({"number": i, "params": {"a": a, "b": b}, "state": "COMPLETE", "samples_s": y,
                       "loss_deviation": 0.0, "constraint_status": "feasible", "constraints": {"loss_deviation": -0.02},
                       "failure_reason": "", "run_dir": f"/old/study/trials/{i:04d}", "role": ""})
    doc = {"study_name": "s", "storage": "sqlite:///x", "study_dir": "/old/study",
           "baseline": {"samples_s": [100.0, 104.0, 98.0], "run_dirs": ["/old/study/baseline/00"]},
           "trials": trials, "confirmations": [], "best_trial": None, "best_params": {}, "interrupted": False,
           "objectives": ["throughput"], "pareto": []}
    doc.update(overrides)
    return doc


# -- TuningInfo ------------------------------------------------------------------------------


def test_tuning_info_of_a_finished_study(small):
    result = json.loads((SMALL / "result.json").read_text())
    assert small.study["status"] == "finished" and small.study["source"] == "result.json"
    assert small.study["objectives"] == ["throughput"] and small.study["loss_tolerance"] == pytest.approx(0.05)
    assert small.study["counts"] == {"trials": 7, "finished": 7, "complete": 6, "feasible": 6, "violated": 0,
                                     "failed": 1, "pruned": 0, "running": 0}
    b = small.baseline
    assert b["samples_s"] == result["baseline"]["samples_s"] and b["runs"] == 2
    assert b["median_samples_s"] == pytest.approx(result["baseline"]["median_samples_s"])
    assert b["noise_rel"] == pytest.approx(result["baseline"]["noise_rel"])
    assert b["low_samples_s"] <= b["median_samples_s"] <= b["high_samples_s"]
    assert b["beat_samples_s"] == pytest.approx(b["median_samples_s"] * (1 + b["noise_rel"]))
    assert all(Path(d).is_dir() for d in b["run_dirs"])  # recorded relative, found in the fixture
    # Trials: number order, the planted failure with its reason and no objective.
    assert [t["number"] for t in small.trials] == list(range(7))
    failed = small.trials[1]
    assert failed["state"] == "FAIL" and failed["samples_s"] is None and failed["vs_baseline"] is None
    assert "planted failure" in failed["failure_reason"] and failed["role"] == "initial"
    assert [t["role"] for t in small.trials[:3]] == ["pytorch-defaults", "initial", "initial"]
    t0 = small.trials[0]
    assert t0["samples_s"] == pytest.approx(result["trials"][0]["samples_s"])
    assert t0["vs_baseline"] == pytest.approx(t0["samples_s"] / b["median_samples_s"])
    assert t0["constraint_status"] == "feasible" and t0["constraints"] == {"loss_deviation": pytest.approx(-0.05)}
    assert list(t0["intermediate_samples_s"]) == ["0", "1", "2", "3", "4"]
    assert Path(t0["run_dir"]) == SMALL / "trials" / "0000" and t0["confirmation"] == pytest.approx(44.332, abs=1e-3)
    assert set(small.params) >= {"ddp.bucket_cap_mb", "compression.method", "dataloader.prefetch_factor"}
    # Confirmation, best and verdict.
    (c,) = small.confirmations
    assert c["trial"] == 0 and c["pairs"] == 2 and len(c["ratios"]) == 2 and c["better"]
    assert c["ci_low"] <= c["speedup"] <= c["ci_high"] and c["verdict"] == "confirmed faster"
    assert all(Path(p).is_dir() for pair in c["run_dirs"] for p in pair)
    assert small.best["trial"] == 0 and small.best["speedup"] == c["speedup"]
    assert small.best["params"]["ddp.bucket_cap_mb"] == 25.0
    assert small.verdict["confirmed"] and small.verdict["title"] == f"Confirmed speedup {c['speedup']:.3f}x"
    assert small.summary is None and small.pareto == () and small.warnings == ()


def test_history_is_the_objective_and_the_best_feasible_so_far(small):
    h = small.history
    assert h["number"] == list(range(7)) and h["samples_s"][1] is None and h["feasible"][1] is False
    best, expected = None, []
    for y, ok in zip(h["samples_s"], h["feasible"]):
        if ok:
            best = y if best is None else max(best, y)
        expected.append(best)
    assert h["best_samples_s"] == expected


def test_tuning_info_is_strict_json_and_round_trips(small, pareto):
    for info in (small, pareto):
        text = info.to_json()
        assert "NaN" not in text and "Infinity" not in text
        assert TuningInfo.from_dict(json.loads(text)) == info
    with pytest.raises(ConfigError, match="study report schema_version must be 1"):
        TuningInfo.from_dict({**small.to_dict(), "schema_version": 99})


def test_importances_of_the_recorded_study(small):
    imp = small.importances
    assert imp["method"] == IMPORTANCE_METHOD and imp["objective"] == "log_throughput" and imp["num_trials"] == 6
    scored = [r for r in imp["params"] if r["importance"] is not None]
    assert sum(r["importance"] for r in scored) == pytest.approx(1.0)
    assert [r["importance"] for r in scored] == sorted((r["importance"] for r in scored), reverse=True)
    # The 75 MiB bucket (0.3 s a step in train_tune.py) is the one slow trial: bucket_cap_mb explains it
    # (so does the prefetch factor only that trial had: six trials cannot tell them apart).
    by_name = {r["name"]: r for r in imp["params"]}
    assert by_name["ddp.bucket_cap_mb"]["eta_squared"] > 0.9
    assert "ddp.bucket_cap_mb" in [r["name"] for r in scored[:2]]
    assert imp["constant"] == ["omp_num_threads"]


def test_importance_finds_the_parameter_that_decides_the_throughput(tmp_path):
    (tmp_path / "result.json").write_text(json.dumps(_result()))
    imp = get_tuning_info(tmp_path).importances
    a, b = imp["params"]
    assert a["name"] == "a" and a["importance"] > 0.99 and a["eta_squared"] > 0.99
    assert b["name"] == "b" and b["importance"] < 0.01
    # Six trials with six distinct values: a numeric parameter is binned in quartiles.
    doc = _result()
    for i, t in enumerate(doc["trials"]):
        t["params"]["c"] = float(i)
    (tmp_path / "result.json").write_text(json.dumps(doc))
    c = next(r for r in get_tuning_info(tmp_path).importances["params"] if r["name"] == "c")
    assert c["num_groups"] == 4


def test_pareto_study(pareto):
    result = json.loads((PARETO / "result.json").read_text())
    assert pareto.study["objectives"] == ["throughput", "loss"]
    assert [p["number"] for p in pareto.pareto] == [p["number"] for p in result["pareto"]]
    for p, r in zip(pareto.pareto, result["pareto"]):
        assert p["samples_s"] == r["values"]["throughput"] and p["loss_deviation"] == r["values"]["loss"]
    assert {t["number"] for t in pareto.trials if t["on_pareto"]} == {p["number"] for p in pareto.pareto}
    assert pareto.best["trial"] is None and not pareto.verdict["confirmed"]
    assert pareto.verdict["title"] == "No confirmed speedup" and "not measured" in pareto.verdict["text"]
    assert pareto.confirmations[0]["verdict"] == "not faster beyond noise"


def test_a_moved_study_finds_its_runs_and_an_interrupted_one_says_so(tmp_path):
    (tmp_path / "trials" / "0002").mkdir(parents=True)
    (tmp_path / "result.json").write_text(json.dumps(_result(interrupted=True)))
    info = get_tuning_info(tmp_path)
    assert info.trials[2]["run_dir"] == str(tmp_path / "trials" / "0002")  # /old/study/... -> here
    assert info.trials[0]["run_dir"] == str(tmp_path / "trials" / "0000")  # not there either: still relocated
    assert info.study["status"] == "interrupted" and "interrupted" in info.verdict["text"]
    assert info.baseline["median_samples_s"] == 100.0 and info.baseline["noise_pct"] == pytest.approx(6.0)


def test_a_running_study_is_read_from_its_storage(tmp_path):
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="torsh-tune", storage=f"sqlite:///{tmp_path / 'study.db'}",
                                direction="maximize")
    study.set_user_attr("objectives", ["throughput"])
    study.set_user_attr("baseline", {"samples_s": [100.0, 110.0], "run_dirs": ["baseline/00", "baseline/01"]})
    t = study.ask()
    t.set_user_attr("config_params", {"ddp.bucket_cap_mb": 25.0})
    t.set_user_attr("role", "pytorch-defaults")
    t.set_user_attr("loss_deviation", 0.0)
    t.set_constraint("loss_deviation", -0.01)
    t.report(120.0, 0)
    study.tell(t, 130.0)
    t = study.ask()
    t.set_user_attr("config_params", {"ddp.bucket_cap_mb": 150.0})
    t.set_user_attr("failure_reason", "script_error: boom")
    study.tell(t, state=TrialState.FAIL)
    study.ask().set_user_attr("config_params", {"ddp.bucket_cap_mb": 5.0})  # running

    info = get_tuning_info(tmp_path)
    assert info.study["status"] == "running" and info.study["source"] == "storage"
    assert info.study["counts"]["running"] == 1 and info.study["loss_tolerance"] == pytest.approx(0.01)
    assert [t["state"] for t in info.trials] == ["COMPLETE", "FAIL", "RUNNING"]
    t0 = info.trials[0]
    assert t0["samples_s"] == 130.0 and t0["constraint_status"] == "feasible" and t0["role"] == "pytorch-defaults"
    assert t0["intermediate_samples_s"] == {"0": 120.0} and t0["vs_baseline"] == pytest.approx(130.0 / 105.0)
    assert info.trials[1]["failure_reason"] == "script_error: boom"
    assert info.baseline["median_samples_s"] == 105.0 and info.confirmations == ()
    assert info.verdict["title"] == "Study in progress"
    assert "Study in progress" in render_tuning_markdown(info)
    # A result.json older than the storage (a resumed study) gives way to the storage, with a warning.
    result = tmp_path / "result.json"
    result.write_text(json.dumps(_result()))
    os.utime(result, (1_000_000, 1_000_000))
    resumed = get_tuning_info(tmp_path)
    assert resumed.study["source"] == "storage" and any("older than" in w for w in resumed.warnings)


def test_trials_table_fallback_and_not_a_study(tmp_path):
    shutil.copy(SMALL / "trials.csv", tmp_path / "trials.csv")
    info = get_tuning_info(tmp_path)
    assert info.study["source"] == "trials.csv" and info.study["status"] == "running"
    assert [t["state"] for t in info.trials] == [t["state"] for t in get_tuning_info(SMALL).trials]
    assert info.trials[1]["samples_s"] is None and "planted failure" in info.trials[1]["failure_reason"]
    assert any("trials.csv" in w for w in info.warnings)
    with pytest.raises(ConfigError, match="STUDY must be a study directory"):
        get_tuning_info(tmp_path / "nothing")


# -- figures ---------------------------------------------------------------------------------


def test_figure_infos_of_the_recorded_studies(small, pareto):
    h = F.get_optimization_history_info(small)
    assert h.number == tuple(range(7)) and math.isnan(h.samples_s[1]) and h.state[1] == "FAIL"
    assert h.baseline_samples_s == small.baseline["median_samples_s"]
    assert (h.band_low_samples_s, h.band_high_samples_s) == (small.baseline["low_samples_s"],
                                                            small.baseline["high_samples_s"])
    assert h.best_samples_s[-1] == max(v for v in h.samples_s if not math.isnan(v))

    imp = F.get_importance_info(small)
    scored = [r for r in small.importances["params"] if r["importance"] is not None]
    assert imp.names == tuple(r["name"] for r in scored) and sum(imp.importance) == pytest.approx(1.0)

    pc = F.get_parallel_coordinates_info(small)
    assert pc.number == (0, 2, 3, 4, 5, 6)  # completed trials only
    axes = {a.name: a for a in pc.axes}
    assert "omp_num_threads" not in axes  # one value: no axis
    assert axes["ddp.bucket_cap_mb"].values == (25.0, 5.0, 75.0, 25.0, 5.0, 25.0) and not axes["ddp.bucket_cap_mb"].ticktext
    prefetch = axes["dataloader.prefetch_factor"]  # conditional: absent without workers
    assert prefetch.ticktext[0] == "—" and len(prefetch.tickvals) == len(prefetch.ticktext)
    assert axes["compression.method"].ticktext == ("fp16", "none")

    assert F.get_pareto_front_info(small).empty  # one objective: no front
    pf = F.get_pareto_front_info(pareto)
    assert set(pf.front_number) == {p["number"] for p in pareto.pareto}
    front_loss = [pf.loss_deviation_pct[pf.number.index(n)] for n in pf.front_number]
    assert front_loss == sorted(front_loss)
    assert sum(pf.on_front) == len(pareto.pareto) and pf.loss_tolerance_pct == pytest.approx(5.0)


def test_plot_functions_draw_their_traces(small, pareto):
    h = F.plot_optimization_history(F.get_optimization_history_info(small))
    names = [t.name for t in h.data]
    assert names == ["baseline runs (noise band)", "baseline median", "trial", "best so far"]
    assert h.layout.yaxis.type == "log"  # the 40x-slow baseline and trial 3 against the rest
    bar = F.plot_importances(F.get_importance_info(small))
    assert [t.type for t in bar.data] == ["bar"] and list(bar.data[0].y) == list(F.get_importance_info(small).names)
    pc = F.plot_parallel_coordinates(F.get_parallel_coordinates_info(small))
    assert [t.type for t in pc.data] == ["parcoords"]
    assert len(pc.data[0].dimensions) == len(F.get_parallel_coordinates_info(small).axes) + 1
    pf = F.plot_pareto_front(F.get_pareto_front_info(pareto))
    assert [t.name for t in pf.data] == ["other trials", "Pareto front"]
    assert list(pf.data[1].customdata) == list(F.get_pareto_front_info(pareto).front_number)
    assert list(F.build_tuning_figures(small)) == ["history", "importances", "parallel"]
    assert list(F.build_tuning_figures(pareto)) == list(F.TUNING_FIGURE_TITLES)
    empty = F.plot_pareto_front(F.get_pareto_front_info(small))
    assert any(a.text.startswith("no ") for a in empty.layout.annotations)


# -- rendering -------------------------------------------------------------------------------


def _outside_scripts(text: str) -> str:
    return re.sub(r"<script\b[^>]*>.*?</script>", "<script></script>", text, flags=re.S | re.I)


@pytest.mark.parametrize("study", ["study_small", "study_pareto"])
def test_html_study_report_is_self_contained(study):
    info = get_tuning_info(DATA / study)
    html = render_tuning_html(info)
    tags = _outside_scripts(html)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", tags, flags=re.I)
    assert not re.search(r"<link\b|@import|url\(", tags, flags=re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", html, flags=re.I)
    figures = F.build_tuning_figures(info)
    assert html.count("plotly.js v") == 1 and html.count("Plotly.newPlot") == len(figures)
    for key in figures:
        assert f'id="fig-{key}"' in html
    assert info.verdict["title"] in html and 'id="importances"' in html and 'id="trials"' in html
    assert html.count('<tr class="trial"') == len(info.trials)
    assert ('id="pareto"' in html) == bool(info.pareto)


def test_html_escapes_and_draws_without_figures(tmp_path):
    doc = _result()
    doc["trials"][0]["failure_reason"] = "<script>alert(1)</script>"
    (tmp_path / "result.json").write_text(json.dumps(doc))
    html = render_tuning_html(get_tuning_info(tmp_path), figures=False)
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "plotly" not in html.lower()


def test_markdown_sections(small, pareto):
    md = render_tuning_markdown(small)
    for heading in ("# torsh-tune study: study_small", "## Baseline and best configuration",
                    "## Confirmation (candidate vs baseline", "## Search", "### Trials", "## Parameter importances",
                    "## Files"):
        assert heading in md
    assert f"**{small.verdict['title']}.**" in md and "planted failure" in md
    assert "| 0 ★ | COMPLETE | pytorch-defaults |" in md
    assert "## Pareto front" not in md and "## Pareto front" in render_tuning_markdown(pareto)
    assert "| 0 (Pareto) |" in render_tuning_markdown(pareto)
    short = render_tuning_markdown(small, full=False)
    assert "### Trials" not in short and "## Parameter importances" not in short
    assert "Fastest feasible trials" in short and "- trial 1: script_error" in short


def test_write_tuning_reports(tmp_path, small):
    paths = write_tuning_reports(small, tmp_path)
    assert sorted(paths) == ["html", "json", "md"]
    assert TuningInfo.from_dict(json.loads(paths["json"].read_text())) == small
    assert paths["md"].read_text() == render_tuning_markdown(small)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(ConfigError, match="study report format must be one of json, md, html, but got 'csv'"):
        write_tuning_reports(small, tmp_path, formats=("csv",))


def test_cli_report_on_a_study_directory(tmp_path):
    study = tmp_path / "study"
    shutil.copytree(SMALL, study)
    proc = run_cli("report", str(study), "--format", "md", env={"COLUMNS": "160"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    md = (study / "report.md").read_text()
    assert "## Parameter importances" in md and "Confirmed speedup 44.332x" in proc.stdout
    # The migration checks are measured again from the confirmation's runs (the tolerance the study used).
    assert "| mean loss |" in md and "within 5 % of baseline" in md and "| throughput |" in md
    assert not (study / "report.html").exists() and not (study / "summary.json").exists()
    proc = run_cli("report", str(study), "--format", "csv")
    assert proc.returncode == 2 and "--format of a study report must be one of json, md, html" in proc.stderr
