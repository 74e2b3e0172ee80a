"""compare: a run against itself / a resampled copy is within noise; a 1.3x slower copy regresses."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from torsh_tune.analysis import analyze_run, load_run
from torsh_tune.errors import ConfigError
from torsh_tune.reports import build_report_info, compare_runs, compare_to_dict, regressed, run_compare, write_reports

DATA = Path(__file__).resolve().parents[1] / "data"
_TIMES = ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s", "comm_s", "exposed_comm_s")


def _rewrite_steps(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    for path in sorted((dst / "ranks").glob("*.steps.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        path.write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))
    return dst


def _slower(factor: float):
    def edit(rows):
        for r in rows:
            for k in _TIMES:
                r[k] = r[k] * factor
        return rows
    return edit


def _resampled(seed: int):
    """The measured steps drawn with replacement (the same draw on every rank), renumbered."""
    def edit(rows):
        warm = [r for r in rows if r["warmup"]]
        meas = [r for r in rows if not r["warmup"]]
        picks = random.Random(seed).choices(range(len(meas)), k=len(meas))
        out = [dict(meas[i], step=len(warm) + j) for j, i in enumerate(picks)]
        return warm + out
    return edit


def test_run_against_itself_is_within_noise():
    run = DATA / "healthy"
    text, code = run_compare(run, run, threshold_pct=5, fmt="md")
    assert code == 0 and "No regression" in text
    c = compare_runs(analyze_run(run), analyze_run(run), frames_a=load_run(run), frames_b=load_run(run))
    assert {m.verdict for m in c.metrics} == {"within noise"}
    assert c.metrics[0].name == "median_step_s" and c.metrics[0].method == "bootstrap"
    assert all(b.change == "unchanged" for b in c.bottlenecks) and not regressed(c)


@pytest.mark.parametrize("seed", [1, 2])
def test_resampled_copy_is_within_noise(tmp_path, seed):
    copy = _rewrite_steps(DATA / "comm_bound", tmp_path / "copy", _resampled(seed))
    text, code = run_compare(DATA / "comm_bound", copy, threshold_pct=5, fmt="json")
    doc = json.loads(text)
    assert code == 0 and doc["regressed"] is False
    step = doc["metrics"][0]
    assert step["name"] == "median_step_s" and step["verdict"] == "within noise"


def test_slower_copy_regresses_and_exits_1(tmp_path):
    slow = _rewrite_steps(DATA / "healthy", tmp_path / "slow", _slower(1.3))
    text, code = run_compare(DATA / "healthy", slow, threshold_pct=5, fmt="md")
    assert code == 1 and "**REGRESSION** beyond the 5 % threshold: median step time +30.0 %" in text
    c = compare_runs(analyze_run(DATA / "healthy"), analyze_run(slow), threshold_pct=5,
                     frames_a=load_run(DATA / "healthy"), frames_b=load_run(slow))
    by_name = {m.name: m for m in c.metrics}
    assert by_name["median_step_s"].verdict == "regressed" and by_name["median_step_s"].delta_pct == pytest.approx(30)
    assert by_name["throughput_samples_s"].verdict == "regressed"
    assert by_name["throughput_samples_s"].delta_pct == pytest.approx(100 * (1 / 1.3 - 1))
    assert regressed(c) and not regressed(c, threshold_pct=40)  # a looser gate passes
    # The other direction is an improvement, never a failure.
    text, code = run_compare(slow, DATA / "healthy", threshold_pct=5, fmt="md")
    assert code == 0 and "improved" in text


def test_baseline_report_json_uses_the_iqr_bound(tmp_path):
    base = write_reports(analyze_run(DATA / "healthy"), DATA / "healthy", out_dir=tmp_path / "base")["json"]
    slow = _rewrite_steps(DATA / "healthy", tmp_path / "slow", _slower(1.3))
    text, code = run_compare(base, slow, threshold_pct=5, fmt="json")
    doc = json.loads(text)
    assert code == 1 and doc["metrics"][0]["method"] == "iqr" and doc["metrics"][0]["verdict"] == "regressed"
    _, code = run_compare(base, DATA / "healthy", threshold_pct=5, fmt="md")
    assert code == 0
    # a directory holding only report/report.json is read as that report
    (tmp_path / "only" / "report").mkdir(parents=True)
    shutil.copy(base, tmp_path / "only" / "report" / "report.json")
    assert run_compare(tmp_path / "only", base, threshold_pct=5, fmt="md")[1] == 0


def test_bottlenecks_appear_and_disappear():
    c = compare_runs(read_json_of("healthy"), read_json_of("data_bound"), threshold_pct=5)
    changes = {b.category: b.change for b in c.bottlenecks}
    assert changes["io"] == "appeared"
    assert compare_to_dict(c)["bottlenecks"][0]["change"] == "appeared"


def read_json_of(scenario: str):
    return build_report_info(analyze_run(DATA / scenario))


def test_bad_inputs_raise_one_line_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="run A must be a run directory or a report.json file, but got"):
        run_compare(tmp_path / "missing", DATA / "healthy", threshold_pct=5, fmt="md")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ConfigError, match="run B must be a readable torsh-tune report.json") as exc:
        run_compare(DATA / "healthy", tmp_path / "junk.json", threshold_pct=5, fmt="md")
    assert "\n" not in str(exc.value)
    (tmp_path / "other.json").write_text('{"schema_version": 99}')
    with pytest.raises(ConfigError, match="run B must be a torsh-tune report.json"):
        run_compare(DATA / "healthy", tmp_path / "other.json", threshold_pct=5, fmt="md")
    with pytest.raises(ConfigError, match="compare format"):
        run_compare(DATA / "healthy", DATA / "healthy", threshold_pct=5, fmt="xml")
    with pytest.raises(ConfigError, match="threshold_pct must be a finite number >= 0"):
        run_compare(DATA / "healthy", DATA / "healthy", threshold_pct=-1, fmt="md")
