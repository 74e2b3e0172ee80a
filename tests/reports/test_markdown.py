"""report.md: readable Markdown with the evidence, ranked recommendations and patches."""

from __future__ import annotations

import re
import tomllib

from torsh_tune.config import RunConfig
from torsh_tune.reports import build_report_info, render_markdown, write_markdown

from .conftest import empty_analysis, make_analysis


def test_markdown_shows_summary_breakdown_bottlenecks_and_recommendations(tmp_path, analysis):
    path = write_markdown(build_report_info(analysis), tmp_path / "report.md")
    md = path.read_text()

    assert md.startswith("# torsh-tune report: demo-run\n")
    assert "PARTIAL" not in md
    # Summary table with the headline numbers.
    assert "| median step | **21.3 ms** |" in md
    assert "| p90 step | 25.1 ms |" in md
    assert "| throughput | **6,009 samples/s** |" in md
    # Breakdown: one row per phase with a '#' bar proportional to its share (50.2 % of 40 chars).
    row = next(line for line in md.splitlines() if line.startswith("| exposed communication |"))
    assert "10.7 ms" in row and "50.2 %" in row and "`" + "#" * 20 + "`" in row
    # Bottlenecks with their evidence, most severe first.
    assert md.index("CRITICAL: communication") < md.index("LOW: io")
    assert "50.2 % of the step is communication not hidden behind backward compute" in md
    assert "| `exposed_comm_pct` | 50.2 % |" in md
    assert "| `bytes_per_step` | 2.51 MiB |" in md
    # Recommendations in priority order with gain, effort and the patch as TOML.
    assert md.index("### 1. Raise DDP bucket_cap_mb to 100") < md.index("### 2. Compress gradients with PowerSGD")
    assert "5.0–20 % of the step (≈ 1.06 ms–4.26 ms)" in md
    assert "bounded by exposed communication 50.2 % of the step" in md
    assert "**effort:** low (< 1 h)" in md
    assert "**verified by trials:** 3, 7" in md
    assert "_No config knob covers this; it is a code change._" in md


def test_markdown_patch_snippet_is_valid_toml_accepted_by_run_config(analysis):
    md = render_markdown(build_report_info(analysis))
    snippets = re.findall(r"```toml\n(.*?)```", md, flags=re.S)
    assert len(snippets) == 1
    patch = tomllib.loads(snippets[0])
    assert patch == {"ddp": {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}}
    config = RunConfig().apply_patch(patch)
    assert config.strategy.ddp.bucket_cap_mb == 100


def test_markdown_partial_banner_and_warnings():
    analysis = make_analysis(partial=True, status="failed", warnings=("rank 1 left no exit.json",))
    md = render_markdown(build_report_info(analysis))
    banner = md.splitlines()[2]
    assert banner.startswith("> **⚠ PARTIAL RESULTS**") and "`failed`" in banner
    assert "> rank 1 was killed by SIGKILL" in md
    assert "## Warnings" in md and "- rank 1 left no exit.json" in md
    assert "| status | failed (partial) |" in md


def test_markdown_of_a_run_without_steps_says_what_is_missing():
    md = render_markdown(build_report_info(empty_analysis()))
    assert "PARTIAL RESULTS" in md
    assert "No measured steps were recorded." in md
    assert "No bottleneck found above the thresholds." in md
    assert "no step records" in md


def test_markdown_table_cells_escape_pipes():
    analysis = make_analysis(info={"script": "train.py", "script_args": ["--sep", "a|b"]})
    md = render_markdown(build_report_info(analysis))
    assert "a\\|b" in md


def _advice_rows(**config):
    import pandas as pd

    from torsh_tune.analysis import strategy_advice

    meta = {r: {"hostname": f"node{r // 2}", "device": "cuda:0", "ddp": {"num_params": 300_000_000}}
            for r in range(4)}
    system = pd.DataFrame({"rank": range(4), "gpu_mem_total_bytes": [80e9] * 4})
    return strategy_advice(meta, {"reference_busbw_gbps": 0.5}, system, 4,
                           config={"strategy": {"kind": "ddp", **config}})


def test_markdown_strategy_advice_section():
    from pathlib import Path

    from torsh_tune.analysis import analyze_run

    run = Path(__file__).resolve().parents[1] / "data" / "recorded" / "comm_bound"
    md = render_markdown(build_report_info(analyze_run(run)))
    section = md[md.index("## Strategy advice"):md.index("## Communication")]
    assert "You run ddp, the advisor's first choice for this model and cluster." in section
    assert "| parameters | 13.1 M | measured — rank 0 meta.json ddp.num_params" in section
    assert "| link | unknown | assumed — " in section
    assert "1. **ddp** (this run) — fits; 0.21 GB model state per rank; patch `strategy.kind = \"ddp\"`" in section
    assert '`fsdp.reshard_after_forward = false`' in section
    # The model-state arithmetic every candidate shares is said once, above the list.
    assert section.count("13.1 M params × 16 B = 0.21 GB of model state") == 1

    md = render_markdown(build_report_info(make_analysis(advice=_advice_rows())))
    assert "You run ddp; the advisor ranks ddp + powersgd compression first (yours is not among its candidates)." in md
    assert "| link | 4 Gbit/s | measured — " in md
    md = render_markdown(build_report_info(make_analysis(advice=_advice_rows(compression={"method": "powersgd"}))))
    assert "1. **ddp + powersgd compression** (this run)" in md
    assert "## Strategy advice" not in render_markdown(build_report_info(make_analysis()))


def test_a_sized_recommendation_shows_its_arithmetic_step_by_step():
    from torsh_tune.analysis import analyze_run

    from .test_html import DATA

    rec = next(r for r in analyze_run(DATA / "data_bound").recommendations if r.category == "io")
    steps = rec.expected_gain.basis.split("; ")
    assert len(steps) >= 4 and steps[0].startswith("idle cores per rank = ")
    md = render_markdown(build_report_info(analyze_run(DATA / "data_bound")))
    start = md.index(f"### 1. {rec.title}")
    section = md[start:md.index("\n### ", start + 1)]
    assert "- **derived from this run:**\n" + "".join(f"  {i}. {s}\n" for i, s in enumerate(steps, 1)) in section
    assert "bounded by" not in section  # the steps are the basis, not one line after the gain
