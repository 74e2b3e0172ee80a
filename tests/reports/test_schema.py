"""report.json validates against the documented JSON Schema; the validator catches breakage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_tune.analysis import analyze_run
from torsh_tune.errors import ConfigError
from torsh_tune.reports import (
    REPORT_SCHEMA_PATH,
    build_report_info,
    report_schema,
    report_schema_errors,
    validate_report,
    write_reports,
)

from .conftest import empty_analysis, make_analysis

DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.mark.parametrize("scenario", ["healthy", "data_bound", "comm_bound", "straggler", "crashed", "torn_line",
                                      "trace_window"])  # trace_window: a self_check with findings and per_step
def test_every_fixture_report_validates(tmp_path, scenario):
    analysis = analyze_run(DATA / scenario)
    path = write_reports(analysis, DATA / scenario, out_dir=tmp_path)["json"]
    assert report_schema_errors(json.loads(path.read_text())) == []
    assert validate_report(path)["schema_version"] == 1


def test_synthetic_and_empty_reports_validate():
    for a in (make_analysis(), make_analysis(partial=True, status="failed"), empty_analysis()):
        assert report_schema_errors(build_report_info(a).to_dict()) == []


# Top-level keys added within schema version 1: optional, so earlier report.json files stay valid.
OPTIONAL_KEYS = {"strategy_advice", "alerts", "self_check"}


def test_schema_documents_every_top_level_key():
    schema = report_schema()
    keys = set(build_report_info(make_analysis()).to_dict())
    assert set(schema["properties"]) == keys
    assert set(schema["required"]) == keys - OPTIONAL_KEYS
    doc = (Path(__file__).resolve().parents[2] / "docs" / "report-schema.md").read_text()
    assert all(f"`{k}`" in doc for k in keys)
    assert REPORT_SCHEMA_PATH.name == "report.schema.json"


def test_validator_reports_what_is_wrong():
    doc = build_report_info(make_analysis()).to_dict()
    doc["summary"]["median_step_s"] = "fast"
    doc["bottlenecks"][0]["severity"] = "apocalyptic"
    doc["surprise"] = 1
    del doc["run"]["status"]
    errors = report_schema_errors(doc)
    assert "$.summary.median_step_s: must be of type number, got str 'fast'" in errors
    assert any(e.startswith("$.bottlenecks[0].severity: must be one of") for e in errors)
    assert "$: unknown key surprise" in errors and "$.run: missing required key status" in errors
    with pytest.raises(ConfigError, match=r"report.json must be valid against report.schema.json.*and 3 more"):
        validate_report(doc)


def test_recorded_run_report_with_strategy_advice_validates(tmp_path):
    run = DATA / "recorded" / "comm_bound"
    path = write_reports(analyze_run(run), run, out_dir=tmp_path)["json"]
    doc = json.loads(path.read_text())
    assert doc["strategy_advice"] and doc["strategy_advice"][0]["current"] is True
    assert report_schema_errors(doc) == []
    # The field is optional: a report.json written before it existed stays valid and readable.
    del doc["strategy_advice"]
    assert report_schema_errors(doc) == []
    from torsh_tune.reports import ReportInfo

    assert ReportInfo.from_dict(doc).strategy_advice == ()


def test_schema_checks_the_strategy_advice_rows():
    doc = build_report_info(analyze_run(DATA / "recorded" / "comm_bound")).to_dict()
    doc["strategy_advice"][0]["inputs"][0]["source"] = "guessed"
    del doc["strategy_advice"][1]["current"]
    errors = report_schema_errors(doc)
    assert any(e.startswith("$.strategy_advice[0].inputs[0].source: must be one of") for e in errors)
    assert "$.strategy_advice[1]: missing required key current" in errors
