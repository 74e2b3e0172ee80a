"""Analysis of runs recorded from the real profiler (tests/data/recorded/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torsh_tune.analysis import analyze_run
from helpers import assert_record_schema

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


@pytest.mark.parametrize(
    "scenario, category, ranks",
    [("data_bound", "io", (0, 1)), ("comm_bound", "communication", (0, 1)), ("straggler", "straggler", (1,))],
)
def test_recorded_plant_is_the_top_diagnosis(scenario, category, ranks):
    a = analyze_run(RECORDED / scenario)
    top = a.bottlenecks[0]
    assert (top.category, top.ranks) == (category, ranks)
    assert top.severity in ("high", "critical")
    assert not a.partial and a.status == "ok"


def test_recorded_healthy_run_has_no_severe_bottleneck():
    a = analyze_run(RECORDED / "compute_bound")
    assert [b for b in a.bottlenecks if b.severity in ("high", "critical")] == []


def test_recorded_breakdown_accounts_for_the_step():
    for scenario in ("data_bound", "comm_bound", "straggler", "compute_bound"):
        a = analyze_run(RECORDED / scenario)
        assert a.steps.num_steps == 25
        # phases are medians over steps, so their sum is close to, not exactly, 100 %
        assert sum(a.breakdown.phases_pct.values()) == pytest.approx(100.0, abs=3.0)


def test_recorded_files_follow_the_record_schema():
    import json

    for path in RECORDED.glob("*/ranks/*.steps.jsonl"):
        first = json.loads(path.read_text().splitlines()[0])
        assert_record_schema(first, "steps")
