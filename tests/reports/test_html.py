"""report.html is one offline file with the figures; CSV/Parquet tables; write_reports formats."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

from torsh_tune.analysis import analyze_run, load_run
from torsh_tune.errors import ConfigError
from torsh_tune.reports import build_report_info, write_html, write_reports, write_tables

from .conftest import make_analysis

DATA = Path(__file__).resolve().parents[1] / "data"


def _outside_scripts(text: str) -> str:
    # plotly.js carries URLs as string constants (docs links, map tiles it never fetches here);
    # what a browser loads is in tags: src/href attributes, <link>, @import and url(...) in CSS.
    return re.sub(r"<script\b[^>]*>.*?</script>", "<script></script>", text, flags=re.S | re.I)


@pytest.fixture(scope="module")
def straggler_html(tmp_path_factory) -> str:
    run = DATA / "straggler"
    path = write_html(analyze_run(run), load_run(run), tmp_path_factory.mktemp("html") / "report.html")
    return path.read_text(encoding="utf-8")


def test_html_is_self_contained(straggler_html):
    html = straggler_html
    tags = _outside_scripts(html)
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", tags, flags=re.I)
    assert not re.search(r"<link\b|@import|url\(", tags, flags=re.I)
    assert not re.search(r"<script\b[^>]*\bsrc\s*=", html, flags=re.I)  # plotly.js is inline
    assert "plotly.js v" in html and html.count("Plotly.newPlot") == 8  # the library once, 8 figures


def test_html_contains_the_sections_and_every_figure(straggler_html):
    html = straggler_html
    for key in ("step_series", "breakdown", "comm_timeline", "overlap", "rank_heatmap", "memory",
                "utilization", "loss"):
        assert f'id="fig-{key}"' in html and 'class="plotly-graph-div"' in html
    assert "Summary" in html and "Step breakdown" in html and "Recommendations" in html
    # the straggler card comes first (critical) and carries its evidence
    cards = re.findall(r'class="card bottleneck" data-severity="(\w+)"', html)
    assert cards[0] == "critical" and cards == sorted(cards, key=["critical", "high", "medium", "low"].index)
    assert "slowest_rank" in html and "Fix or replace the slow rank 2" in html


def test_html_without_frames_and_escaping(tmp_path):
    analysis = make_analysis(run_dir=str(tmp_path))
    info = build_report_info(analysis)
    info = info.__class__(**{**info.__dict__, "warnings": ("<script>alert(1)</script>",)})
    html = write_html(info, None, tmp_path / "r.html").read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;" in html
    assert "bucket_cap_mb = 100" in html  # config patch as TOML
    assert "Figures need the run" in html and "plotly" not in html.lower()


def test_write_tables_csv_and_parquet(tmp_path):
    paths = write_tables(DATA / "comm_bound", tmp_path, ("csv", "parquet"))
    assert sorted(paths) == ["comm.csv", "comm.parquet", "steps.csv", "steps.parquet"]
    frames = load_run(DATA / "comm_bound")
    csv = pd.read_csv(paths["steps.csv"])
    pq = pd.read_parquet(paths["comm.parquet"])
    assert list(csv.columns) == list(frames.steps.columns) and len(csv) == len(frames.steps)
    assert len(pq) == len(frames.comm) and pq["duration_s"].tolist() == frames.comm["duration_s"].tolist()
    with pytest.raises(ConfigError, match="table format must be one of csv, parquet, but got 'xlsx'"):
        write_tables(DATA / "comm_bound", tmp_path, ("xlsx",))


def test_write_reports_formats(tmp_path):
    run = DATA / "data_bound"
    paths = write_reports(analyze_run(run), run, formats=("json", "md", "html", "csv"), out_dir=tmp_path)
    assert sorted(paths) == ["comm.csv", "html", "json", "md", "steps.csv"]
    assert paths["html"] == tmp_path / "report.html" and "io" in paths["html"].read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with pytest.raises(ConfigError, match="report format"):
        write_reports(analyze_run(run), run, formats=("pdf",), out_dir=tmp_path)


def test_html_strategy_advice_section(tmp_path):
    run = DATA / "recorded" / "comm_bound"
    html = write_html(analyze_run(run), None, tmp_path / "r.html").read_text()
    section = html[html.index('id="strategy-advice"'):html.index("<h2>Figures</h2>")]
    assert "You run ddp, the advisor&#x27;s first choice" in section
    assert "<td>ddp <b>(this run)</b></td>" in section
    assert "<code>fsdp.reshard_after_forward = false</code>" in section
    assert "<b>measured</b> — rank 0 meta.json ddp.num_params" in section


def test_html_shows_a_sized_recommendations_arithmetic_step_by_step():
    from html import escape

    from torsh_tune.reports import render_html

    a = analyze_run(DATA / "data_bound")
    rec = next(r for r in a.recommendations if r.category == "io")
    html = render_html(a, None)
    steps = "".join(f"<li>{escape(s)}</li>" for s in rec.expected_gain.basis.split("; "))
    assert f"<li><b>derived from this run:</b><ol class=basis>{steps}</ol></li>" in html
    # A one-step basis stays on the gain's line ("bounded by ...").
    assert html.count("<ol class=basis>") == sum("; " in r.expected_gain.basis for r in a.recommendations)
