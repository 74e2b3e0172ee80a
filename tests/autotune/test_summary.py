"""The main job's study summary (summary.json/md) and report (report.*) on the recorded studies.

`tests/data/study_small` (a confirmed speedup: the user's config was planted slow) and
`study_pareto` (nothing confirmed) are real `tune()` studies recorded by
`tests/data/record_study.py`; the summary measures their confirmation runs again.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from torsh_tune.autotune.summary import build_summary, rebuild_summary, write_summary
from torsh_tune.errors import ConfigError
from torsh_tune.reports import TuningInfo, get_tuning_info

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
def small(tmp_path) -> Path:
    return Path(shutil.copytree(DATA / "study_small", tmp_path / "study_small"))


def test_summary_measures_the_confirmation_pairs(small):
    s = build_summary(small, script="train.py", script_args=["--lr", "1"], loss_tolerance=0.05,
                      recommendations_tried=["Raise bucket_cap_mb", "Compress gradients"],
                      study_command=["torsh-tune", "train.py"])
    info = get_tuning_info(small)
    assert s["verdict"] == info.verdict and s["best_trial"] == 0 and s["speedup"] == info.best["speedup"]
    assert s["speedup_ci"] == [info.best["ci_low"], info.best["ci_high"]]
    assert s["confirmations"] == list(info.confirmations)
    # Baseline and best are the confirmation's interleaved runs (A and B of each pair), not the search's.
    pairs = info.confirmations[0]["run_dirs"]
    assert s["baseline"]["run_dirs"] == [a for a, _ in pairs] and s["best"]["run_dirs"] == [b for _, b in pairs]
    assert s["baseline"]["runs"] == s["best"]["runs"] == 2
    m = {row["metric"]: row for row in s["migration"]}
    assert list(m) == ["throughput", "peak_memory", "mean_loss", "time_per_step"]
    assert m["throughput"]["best"] > 10 * m["throughput"]["baseline"] and m["throughput"]["ok"] is True
    assert m["peak_memory"]["ok"] is True and m["peak_memory"]["baseline"] > 0
    assert m["mean_loss"]["deviation_pct"] == pytest.approx(0.0, abs=1e-6) and m["mean_loss"]["ok"] is True
    assert m["mean_loss"]["rule"] == "within 5 % of baseline or its run-to-run noise" and m["mean_loss"]["limit_pct"] >= 5
    assert m["time_per_step"]["ok"] is None
    assert m["time_per_step"]["best"] < m["time_per_step"]["baseline"]  # the planted 0.3 s per step is gone
    assert s["migration_ok"] is True
    # Trials, and what became of the recommendations enqueued as the "initial" trials 1 and 2.
    assert s["trials"]["finished"] == 7 and s["trials"]["failed"] == 1 and s["trials"]["top"][0]["number"] == 0
    assert s["trials"]["failures"][0]["number"] == 1
    tested = s["recommendations_tested"]
    assert [(r["title"], r["trial"]) for r in tested] == [("Raise bucket_cap_mb", 1), ("Compress gradients", 2)]
    assert tested[0]["verdict"].startswith("fail: script_error") and tested[1]["verdict"] == "not among the candidates confirmed"
    assert s["commands"]["run"] == f"torsh-tune run --config {small / 'best.toml'} train.py --lr 1"
    assert s["commands"]["study"] == "torsh-tune train.py" and s["loss_tolerance"] == 0.05
    json.dumps(s, allow_nan=False)


def test_write_summary_writes_the_summary_and_the_study_report(small):
    s = build_summary(small, script="train.py")
    files = write_summary(small, s)
    assert sorted(files) == ["report.html", "report.json", "report.md", "summary.json", "summary.md"]
    assert json.loads((small / "summary.json").read_text()) == json.loads(json.dumps(s))
    md = (small / "summary.md").read_text()
    assert s["verdict"]["title"] in md and f"torsh-tune run --config {small / 'best.toml'} train.py" in md
    assert "| throughput |" in md and "### Trials" not in md  # the short one
    report = TuningInfo.from_dict(json.loads((small / "report.json").read_text()))
    assert report.summary == json.loads(json.dumps(s))
    assert "| peak memory |" in (small / "report.md").read_text()
    assert 'class="migration"' in (small / "report.html").read_text()
    # summary.json is now as new as result.json: a later get_tuning_info picks it up by itself.
    assert get_tuning_info(small).summary == report.summary


def test_nothing_confirmed_has_no_best_side(tmp_path):
    study = Path(shutil.copytree(DATA / "study_pareto", tmp_path / "p"))
    s = build_summary(study, script="train.py")
    assert s["best"] is None and s["speedup"] is None and s["speedup_ci"] is None and s["migration_ok"] is None
    assert all(m["best"] is None and m["ok"] is None for m in s["migration"])
    assert s["baseline"]["runs"] == 1  # the baseline repeats of the study
    assert s["verdict"]["title"] == "No confirmed speedup"


def test_rebuild_summary_recovers_the_inputs(small):
    s = rebuild_summary(small)  # no summary.json: the baseline run's script, the constraint's tolerance
    assert s["script"] == "tests/autotune/scripts/train_tune.py" and s["loss_tolerance"] == pytest.approx(0.05)
    first = build_summary(small, script="mine.py", script_args=["-x"], recommendations_tried=["A", "B"],
                          loss_tolerance=0.02, study_command=["torsh-tune", "mine.py", "-x"])
    write_summary(small, first)
    again = rebuild_summary(small)
    assert (again["script"], again["script_args"], again["loss_tolerance"]) == ("mine.py", ["-x"], 0.02)
    assert [r["title"] for r in again["recommendations_tested"]] == ["A", "B"]
    assert again["commands"] == first["commands"]
    (small / "result.json").unlink()
    assert rebuild_summary(small) is None
    with pytest.raises(ConfigError, match="STUDY must be a study directory holding result.json"):
        build_summary(small, script="train.py")
