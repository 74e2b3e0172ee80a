"""The rich end-of-run summary, rendered to a recording Console."""

from __future__ import annotations

import io

from rich.console import Console

from torsh_tune.reports import build_report_info, render_summary, write_reports

from .conftest import empty_analysis, make_analysis


def _render(info, **kw) -> str:
    console = Console(record=True, width=140, file=io.StringIO(), force_terminal=False)
    render_summary(info, console, **kw)
    return console.export_text()


def test_summary_shows_headline_breakdown_bottlenecks_and_recommendations(analysis):
    text = _render(build_report_info(analysis))
    for expected in ("21.3 ms", "25.1 ms", "6,009 samples/s", "1.20 ms (5.6 %)", "exposed communication", "50.2 %",
                     "CRITICAL", "communication", "50.2 % of the step is communication not hidden",
                     "exposed_comm_pct=50.2 %", "Raise DDP bucket_cap_mb to 100", "5.0–20 % of the step",
                     "bucket_cap_mb = 100", "run dir: /runs/demo-run"):
        assert expected in text, expected
    assert "PARTIAL" not in text
    assert text.index("CRITICAL") < text.index("LOW")


def test_summary_lists_report_paths(tmp_path):
    analysis = make_analysis(run_dir=str(tmp_path))
    paths = write_reports(analysis, tmp_path)
    text = _render(build_report_info(analysis))  # found in the run dir
    assert f"report (json): {paths['json']}" in text
    assert f"report (md): {paths['md']}" in text
    text = _render(build_report_info(analysis), report_paths={"html": tmp_path / "x.html"})
    assert f"report (html): {tmp_path / 'x.html'}" in text and "report (md)" not in text


def test_summary_of_a_partial_run_shows_the_banner():
    analysis = make_analysis(partial=True, status="failed", warnings=("rank 1 left no exit.json",))
    text = _render(build_report_info(analysis))
    assert "PARTIAL RESULTS" in text and "rank 1 was killed by SIGKILL" in text
    assert "warning: rank 1 left no exit.json" in text
    assert "failed (partial)" in text


def test_summary_of_a_run_without_steps_renders():
    text = _render(build_report_info(empty_analysis()))
    assert "PARTIAL RESULTS" in text
    assert "No bottleneck found" in text
    assert "warning: no step records" in text


def test_summary_renders_on_a_narrow_colour_terminal(analysis):
    console = Console(record=True, width=60, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    render_summary(build_report_info(analysis), console)
    assert "CRITICAL" in console.export_text()
    assert "\x1b[" in console.file.getvalue()  # severity colours are emitted


def test_summary_names_the_strategy_advice_in_one_line():
    from pathlib import Path

    from torsh_tune.analysis import analyze_run

    run = Path(__file__).resolve().parents[1] / "data" / "recorded" / "comm_bound"
    with_advice = _render(build_report_info(analyze_run(run)))
    without = _render(build_report_info(analyze_run(run).__class__(**{**analyze_run(run).__dict__, "advice": ()})))
    lines = [line for line in with_advice.splitlines() if "strategy advice" in line]
    assert lines == ["strategy advice: You run ddp, the advisor's first choice for this model and cluster. "
                     "(report.md has the candidates)"]
    assert len(with_advice.splitlines()) == len(without.splitlines()) + 1
