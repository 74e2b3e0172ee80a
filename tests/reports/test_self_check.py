"""The self-check against trace windows in report.json, report.md, report.html and the terminal summary."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from torsh_tune.analysis import analyze_run
from torsh_tune.reports import (
    ReportInfo,
    build_report_info,
    render_html,
    render_markdown,
    render_summary,
    report_schema_errors,
    write_reports,
)
from torsh_tune.reports._info import self_check_table

from .conftest import make_analysis

RUN = Path(__file__).resolve().parents[1] / "data" / "trace_window"
# The renderings are checked against the analysis's own numbers (tests/analysis/test_selfcheck.py checks those).
(CHECK,) = analyze_run(RUN).self_check
EXPOSED = next(f["message"] for f in CHECK.findings if f["metric"] == "exposed_comm")
R0 = CHECK.per_rank[0]


def _cell(metric: str) -> str:
    return f"{R0[f'always_on_{metric}_pct']:.1f} % / {R0[f'trace_{metric}_pct']:.1f} % ({R0[f'{metric}_diff_pp']:+.1f} pp)"


def _info() -> ReportInfo:
    return build_report_info(analyze_run(RUN), generated_at="2025-01-01T00:00:00+00:00")


def test_report_json_carries_every_rank_and_the_findings(tmp_path):
    path = write_reports(analyze_run(RUN), RUN, out_dir=tmp_path)["json"]
    doc = json.loads(path.read_text())
    assert report_schema_errors(doc) == []
    (check,) = doc["self_check"]
    assert (check["window"], check["start_step"], check["end_step"], check["device"]) == ("step00008-00011", 8, 11,
                                                                                       "cpu")
    assert [r["rank"] for r in check["per_rank"]] == [0, 1] and check["overall"]["rank"] is None
    assert check["overall"]["always_on_clock"] == "host" and check["overall"]["trace_clock"] == "host"
    assert check["overall"]["always_on_comm_basis"] == "DDP reducer window"
    assert EXPOSED in [f["message"] for f in check["findings"]]
    assert ReportInfo.from_json(path.read_text()) == ReportInfo.from_dict(doc)


def test_reports_without_a_trace_window_have_no_self_check_and_old_reports_still_load():
    info = build_report_info(make_analysis())
    assert info.self_check == () and "Self-check" not in render_markdown(info)
    doc = info.to_dict()
    del doc["self_check"]  # report.json written before the self-check existed
    assert report_schema_errors(doc) == [] and ReportInfo.from_dict(doc).self_check == ()


def test_markdown_shows_both_sides_with_clocks_and_differences():
    md = render_markdown(_info())
    section = md[md.index("## Self-check against the traces"):md.index("## Recommendations")]
    assert "### Window `step00008-00011`: steps 8–11, 2 ranks, cpu" in section
    assert ("_Clocks: always-on: host clock (as recorded); always-on communication: DDP's reducer window per step "
            "(its first bucket's issue to the end of its finalize, the copies back into the gradients included); "
            "trace: host clock (CPU operators and gloo worker spans), step time host clock (ProfilerStep# spans)") in section
    assert f"- **⚠ {EXPOSED}**" in section
    assert ("| rank | step time (host / host) | compute share (host / host) | communication share (host / host) "
            "| exposed communication share (host / host) |") in section
    step = f"{1e3 * R0['always_on_step_s']:.1f} ms / {1e3 * R0['trace_step_s']:.1f} ms ({R0['step_diff_pct']:+.1f} %)"
    assert f"| 0 | {step} | {_cell('compute')} | {_cell('comm')} | {_cell('exposed_comm')} |" in section
    assert section.count("\n| mean |") == 1 and section.count("\n| 1 |") == 1


def test_html_shows_the_window_card():
    html = render_html(_info(), None)
    assert '<h2 id="self-check">Self-check against the traces</h2>' in html
    assert f'data-window="step00008-00011" data-findings="{len(CHECK.findings)}"' in html
    assert EXPOSED in html and _cell("exposed_comm") in html
    assert html.index('id="self-check"') < html.index("<h2>Recommendations</h2>")


def test_terminal_summary_shows_the_numbers_and_the_findings():
    console = Console(record=True, width=160, file=io.StringIO(), force_terminal=False)
    render_summary(_info(), console)
    text = console.export_text()
    assert "Self-check against trace window step00008-00011 (steps 8–11)" in text
    e0 = f"{R0['always_on_exposed_comm_pct']:.1f}/{R0['trace_exposed_comm_pct']:.1f} ({R0['exposed_comm_diff_pp']:+.1f})"
    assert e0 in text and "host/host" in text
    assert EXPOSED.split(" (steps")[0] in text
    assert "always-on: host clock (as recorded)" in text


def test_a_window_within_the_threshold_says_so(tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    config = json.loads((run / "config.json").read_text())
    config.setdefault("thresholds", {})["selfcheck_pp"] = 40.0
    (run / "config.json").write_text(json.dumps(config))
    info = build_report_info(analyze_run(run))
    assert info.self_check[0]["findings"] == []
    assert "- The two agree within 40 pp (step time: 40 %)." in render_markdown(info)
    console = Console(record=True, width=160, file=io.StringIO(), force_terminal=False)
    render_summary(info, console)
    assert "always-on and trace agree within 40 pp (step time: 40 %)" in console.export_text()


def test_large_runs_show_the_ranks_that_disagree_most():
    check = _info().self_check[0]
    zero = {k: 0.0 for k in ("step_diff_pct", "compute_diff_pp", "comm_diff_pp", "exposed_comm_diff_pp")}
    ranks = [{**check["per_rank"][0], **zero, "rank": r, "comm_diff_pp": -float(r % 7)} for r in range(40)]
    header, rows = self_check_table({**check, "per_rank": ranks}, max_ranks=3)
    assert len(header) == 5 and [r[0] for r in rows] == ["mean", "6", "13", "20"]
