"""Alerts in report.json/Markdown/HTML; the busbw-vs-bench-model and confirmation figures (no browser)."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

from torsh_tune.analysis import analyze_run, load_run
from torsh_tune.fabric import CommModel, fit_alpha_beta, save_model
from torsh_tune.reports import ReportInfo, build_report_info, get_tuning_info, render_html, render_markdown
from torsh_tune.reports import figures as F
from torsh_tune.reports import report_schema_errors

from analysis.planted_alerts import write_planted_run

DATA = Path(__file__).resolve().parents[1] / "data"
ALPHA_S, BETA = 200e-6, 1 / 0.8e9  # a 0.8 GB/s link with 200 us latency


def synthetic_model() -> CommModel:
    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
    fit = fit_alpha_beta("all_reduce", sizes, [ALPHA_S + s * BETA for s in sizes], group_size=2)
    return CommModel(world_size=2, nnodes=1, nproc_per_node=2, backend="gloo", fits=(fit,))


def test_alerts_go_into_every_report_format(tmp_path):
    info = build_report_info(analyze_run(write_planted_run(tmp_path / "planted")))
    doc = json.loads(info.to_json())
    assert report_schema_errors(doc) == []
    assert [a["kind"] for a in doc["alerts"]] == ["low_gpu_utilization", "memory_pressure",
                                                  "communication_overhead", "step_time_spike"]
    assert ReportInfo.from_json(info.to_json()) == info
    md = render_markdown(info)
    assert "## Alerts" in md and "| critical | low gpu utilization | 1 |" in md and "below 50 %" in md
    html = render_html(info, None)
    assert html.count('<tr class="alert"') == 4 and 'data-kind="memory_pressure"' in html


def test_a_report_without_alerts_still_reads_and_renders(tmp_path):
    doc = json.loads(build_report_info(analyze_run(DATA / "healthy")).to_json())
    doc.pop("alerts")  # written before alerts existed: optional within schema 1
    assert report_schema_errors(doc) == []
    info = ReportInfo.from_dict(doc)
    assert info.alerts == () and "## Alerts" not in render_markdown(info)
    broken = dict(doc, alerts=[{"kind": "gremlins"}])
    assert any("alerts[0]" in e for e in report_schema_errors(broken))


def independent_busbw_by_bucket(frames) -> dict[int, float]:
    """Median over measured steps of bytes / wire time (factor 1 at 2 ranks), computed without the library."""
    comm = frames.comm.sort_values(["rank", "seq"])
    warm = set(frames.steps.loc[frames.steps["warmup"], "step"])
    service: dict[tuple[int, int], list[float]] = {}
    size: dict[tuple[int, int], tuple[int, float]] = {}
    for _, rows in comm.groupby("rank"):
        prev = -math.inf
        for r in rows.itertuples():
            service.setdefault((r.step, r.seq), []).append(r.t_complete - max(r.t_issue, prev))
            size[(r.step, r.seq)] = (int(r.bucket), float(r.wire_bytes))
            prev = r.t_complete
    per_bucket: dict[int, list[float]] = {}
    for key, times in service.items():
        if key[0] in warm:
            continue
        bucket, nbytes = size[key]
        per_bucket.setdefault(bucket, []).append(nbytes / min(times) / 1e9)
    return {b: statistics.median(v) for b, v in per_bucket.items()}


def test_busbw_info_measures_each_bucket_and_predicts_it_from_the_model():
    frames = load_run(DATA / "recorded" / "comm_bound")
    info = F.get_busbw_model_info(frames, synthetic_model())
    expected = independent_busbw_by_bucket(frames)
    assert info.bucket == tuple(sorted(expected)) and info.collective == ("all_reduce",) * len(expected)
    assert info.measured_busbw_gbps == pytest.approx([expected[b] for b in info.bucket], rel=1e-9)
    assert all(lo <= m <= hi for lo, m, hi in zip(info.measured_q25_gbps, info.measured_busbw_gbps,
                                                   info.measured_q75_gbps))
    for s, predicted in zip(info.size_bytes, info.model_busbw_gbps):
        assert predicted == pytest.approx(s / (ALPHA_S + s * BETA) / 1e9, rel=1e-6)  # factor 1 at 2 ranks
    assert info.num_steps == 25 and info.reference_busbw_gbps is None
    assert len(info.curve_size_bytes) == 40 and max(info.curve_busbw_gbps) < 0.8  # below 1/beta
    assert "alpha 200 us" in info.model_label
    fig = F.plot_busbw_model(info)
    assert [t.name for t in fig.data][:2] == ["measured (median over steps)", "model at the bucket size"]
    last = F.get_busbw_model_info(frames, None, reference_busbw_gbps=1.5, last_steps=3)
    assert last.num_steps == 3 and all(math.isnan(v) for v in last.model_busbw_gbps)
    assert any(s.y0 == 1.5 for s in F.plot_busbw_model(last).layout.shapes)  # the reference line


def test_the_model_comes_from_the_runs_reference_bench_and_reaches_the_html_report(tmp_path):
    bench = tmp_path / "bench-run"
    save_model(synthetic_model(), bench)
    run = tmp_path / "run"
    shutil.copytree(DATA / "recorded" / "comm_bound", run)
    assert F.reference_model(json.loads((run / "run.json").read_text())) is None
    frames = load_run(run)
    assert "fig-busbw_model" not in render_html(analyze_run(run), frames)
    info = json.loads((run / "run.json").read_text())
    info.update(reference_bench=str(bench), reference_busbw_gbps=0.7)
    (run / "run.json").write_text(json.dumps(info))
    assert F.reference_model(info) == synthetic_model()
    assert F.reference_model({"reference_bench": str(tmp_path / "nowhere")}) is None
    html = render_html(analyze_run(run), load_run(run))
    comm_section = html[html.index("<h2>Communication</h2>"):]
    assert 'id="figure-busbw_model"' in comm_section.split("<h2>", 2)[1]  # inside the communication section


def test_confirmation_info_carries_each_candidates_ci():
    tuning = get_tuning_info(DATA / "study_small")
    info = F.get_confirmation_info(tuning)
    result = json.loads((DATA / "study_small" / "result.json").read_text())
    done = [c for c in result["confirmations"] if c.get("speedup") is not None]
    assert info.trial == tuple(c["trial_number"] for c in done) and info.best_trial == result["best_trial"]
    assert info.speedup == pytest.approx([c["speedup"] for c in done])
    assert all(lo <= s <= hi for lo, s, hi in zip(info.ci_low, info.speedup, info.ci_high))
    fig = F.plot_confirmation(info)
    bar = fig.data[0].error_y
    assert bar.array[0] == pytest.approx(info.ci_high[0] - info.speedup[0])
    assert any(s.y0 == 1.0 for s in fig.layout.shapes)
    assert F.get_confirmation_info(get_tuning_info(DATA / "study_pareto")).trial  # a second real study
