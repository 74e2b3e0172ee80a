"""ReportInfo: built from a RunAnalysis, JSON round trip, schema version."""

from __future__ import annotations

import json

import pytest

from torsh_tune.analysis import PHASES
from torsh_tune.errors import ConfigError
from torsh_tune.reports import REPORT_SCHEMA_VERSION, ReportInfo, build_report_info, read_json, write_json

from .conftest import GENERATED_AT, empty_analysis, make_analysis


def test_json_round_trip_gives_an_equal_report(tmp_path, analysis):
    info = build_report_info(analysis, generated_at=GENERATED_AT)
    path = write_json(info, tmp_path / "report" / "report.json")

    doc = json.loads(path.read_text())
    assert doc["schema_version"] == REPORT_SCHEMA_VERSION == 1
    assert doc["generated_at"] == GENERATED_AT
    assert read_json(path) == info
    assert ReportInfo.from_json(info.to_json()) == info


def test_report_json_is_strict_json(tmp_path, analysis):
    # The NaN in the bottleneck evidence must not leak into the file as a bare NaN token.
    path = write_json(build_report_info(analysis), tmp_path / "report.json")
    doc = json.loads(path.read_text(), parse_constant=lambda name: pytest.fail(f"non-JSON constant {name}"))
    assert doc["bottlenecks"][0]["evidence"]["odd_ratio"] is None


def test_report_info_carries_the_analysis(analysis):
    info = build_report_info(analysis, generated_at=GENERATED_AT)

    assert info.run["name"] == "demo-run"
    assert info.run["world_size"] == 2
    assert info.run["backend"] == "gloo"  # from DDP's own logging, not the "auto" in the config
    assert info.run["device"] == "cpu"
    assert info.run["versions"]["torch"] == "2.13.0"
    assert info.run["hardware"]["cpu_count"] == 2
    assert info.run["rank_status"] == {"0": "ok", "1": "ok"}
    assert info.config["budget"]["steps"] == 40

    assert info.summary["median_step_s"] == pytest.approx(0.0213)
    assert info.summary["p90_step_s"] == pytest.approx(0.0251)
    assert info.summary["throughput_samples_s"] == pytest.approx(128 / 0.0213)
    assert info.summary["iqr_pct"] == pytest.approx(100 * 0.0012 / 0.0213)
    assert info.summary["rank_spread_pct"] == pytest.approx(100 * 0.0002 / 0.0213)

    assert [row["phase"] for row in info.breakdown] == list(PHASES)
    assert info.breakdown[3]["time_s"] == pytest.approx(0.0107)
    assert info.communication["wait_by_rank"] == [{"rank": 0, "wait_s": 0.006}, {"rank": 1, "wait_s": 0.004}]
    assert info.communication["hooks"] == ["allreduce"]
    assert info.memory["per_rank"][1] == {"rank": 1, "peak_bytes": 410 * 2**20}
    assert info.stragglers["slowest_rank"] == 1
    assert info.system["cpu_pct_mean"] == 97.5

    assert [b["severity"] for b in info.bottlenecks] == ["critical", "low"]
    assert info.bottlenecks[0]["ranks"] == [0, 1]
    assert [r["priority"] for r in info.recommendations] == [1, 2]
    assert info.recommendations[0]["expected_gain"] == {
        "low_pct": 5.0, "high_pct": 20.0, "basis": "exposed communication 50.2 % of the step", "of": "step"}
    assert info.recommendations[1]["verified_by"] == [3, 7]
    assert info.partial is False and info.warnings == ()


def test_partial_run_is_flagged_with_its_warnings():
    analysis = make_analysis(partial=True, status="failed", warnings=("rank 1 left no exit.json",))
    info = build_report_info(analysis)
    assert info.partial is True
    assert info.warnings == ("rank 1 left no exit.json",)
    assert info.run["status"] == "failed"
    assert info.run["message"] == "rank 1 was killed by SIGKILL"
    assert ReportInfo.from_json(info.to_json()) == info


def test_empty_analysis_gives_a_report_without_numbers():
    info = build_report_info(empty_analysis())
    assert info.summary is None and info.breakdown == () and info.communication is None
    assert info.memory is None and info.system is None and info.stragglers is None
    assert info.partial is True
    assert ReportInfo.from_json(info.to_json()) == info


def test_other_schema_versions_are_rejected(analysis):
    doc = build_report_info(analysis).to_dict()
    doc["schema_version"] = 99
    with pytest.raises(ConfigError, match="schema_version must be 1, but got 99"):
        ReportInfo.from_dict(doc)
    doc["schema_version"] = 1
    doc["surprise"] = True
    with pytest.raises(ConfigError, match="surprise"):
        ReportInfo.from_dict(doc)


def test_strategy_advice_round_trips_as_json_types():
    from pathlib import Path

    from torsh_tune.analysis import analyze_run

    run = Path(__file__).resolve().parents[1] / "data" / "recorded" / "comm_bound"
    info = build_report_info(analyze_run(run), generated_at=GENERATED_AT)
    assert info.strategy_advice and isinstance(info.strategy_advice, tuple)
    assert info.strategy_advice[0]["name"] == "ddp" and info.strategy_advice[0]["current"] is True
    assert ReportInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    assert ReportInfo.from_json(info.to_json()) == info
    assert build_report_info(make_analysis()).strategy_advice == ()
