"""Trace findings: Bottleneck/Recommendation objects from the trace tables, and in the reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torsh_tune.analysis import SEVERITIES
from torsh_tune.analysis.traces import analyze_traces, load_traces, trace_findings
from torsh_tune.config import ThresholdsConfig
from torsh_tune.reports._traces import render_trace_html, render_trace_markdown, trace_report_dict

DATA = Path(__file__).resolve().parents[2] / "data" / "traces"
NAMES = ("hta-sampled-2rank", "hta-16rank-rank0", "hta-nccl-2rank-rank0", "gloo-ddp-2rank")
# Low enough for every rule to fire on the 16-rank trace (sync idle is 0.1 % of its window).
EVERYTHING = ThresholdsConfig(comm_high_pct=0.1, comm_critical_pct=0.2)
NO_STRAGGLER = ThresholdsConfig(straggler_pct=100.0)


@pytest.fixture(scope="module")
def analyses():
    return {name: analyze_traces(load_traces(DATA / name)) for name in NAMES}


def _span_pct(a, table, col):
    """Per rank, 100 * table[col] / the breakdown's span_s."""
    span = a.breakdown.set_index("rank")["span_s"]
    return (100.0 * getattr(a, table).set_index("rank")[col] / span).dropna()


def _only(bottlenecks, category, key):
    found = [b for b in bottlenecks if b.category == category and key in b.evidence]
    assert len(found) == 1, [b.message for b in bottlenecks]
    return found[0]


def test_host_wait_finding_on_the_hta_trace_hta_calls_host_wait(analyses):
    # HTA 0.5.0's idle breakdown of hta-nccl-2rank-rank0: host wait 99 % (test_idle_and_reports.py).
    a = analyses["hta-nccl-2rank-rank0"]
    b = _only(a.bottlenecks, "computation", "host_wait_pct")
    share = _span_pct(a, "idle_causes", "host_wait_s")
    assert b.evidence["host_wait_pct"] == pytest.approx(share.mean(), abs=0.005)
    assert b.evidence["host_wait_s_by_rank"] == a.idle_causes.set_index("rank")["host_wait_s"].to_dict()
    assert b.evidence["idle_host_wait_pct"] == pytest.approx(a.summary["idle_host_wait_pct"], abs=0.005)
    assert b.severity == "critical" and share.mean() > 50  # 77 % of the window
    assert b.message.startswith(f"the GPU idles {share.mean():.0f} % of the window waiting for the host")
    assert a.bottlenecks[0] is b
    titles = [r.title for r in a.recommendations]
    assert any("CUDA graphs" in t and "reduce-overhead" in t for t in titles)
    for r in a.recommendations:
        assert r.config_patch == {} and "host-wait idle" in r.expected_gain.basis
        assert r.expected_gain.high_pct == pytest.approx(b.evidence["host_wait_pct"])


def test_16rank_trace_idles_for_other_reasons_and_gets_no_host_wait_finding(analyses):
    # HTA calls 98 % of this trace's idle time "other" (launched in time, started late):
    # host wait is 1 % of its window, nothing the host-wait remedies would fix.
    a = analyses["hta-16rank-rank0"]
    assert a.summary["idle_other_pct"] > 90
    assert not [b for b in a.bottlenecks if "host_wait_pct" in b.evidence]


def test_every_rule_takes_its_evidence_from_the_tables(analyses):
    a = analyses["hta-16rank-rank0"]
    bottlenecks, recs = trace_findings(a, EVERYTHING)
    for cause in ("host_wait", "sync"):
        b = _only(bottlenecks, "computation", f"{cause}_pct")
        share = _span_pct(a, "idle_causes", f"{cause}_s")
        assert b.evidence[f"{cause}_pct_by_rank"] == {r: round(v, 2) for r, v in share.items()}
        assert b.evidence[f"{cause}_s_by_rank"] == a.idle_causes.set_index("rank")[f"{cause}_s"].to_dict()
    sync = _only(bottlenecks, "computation", "sync_pct")
    assert "host blocks in device syncs" in sync.message and "GPU" in sync.message
    comm = _only(bottlenecks, "communication", "exposed_comm_pct")
    assert comm.evidence["exposed_comm_pct"] == pytest.approx(a.overlap["exposed_comm_pct"].mean(), abs=0.005)
    assert comm.evidence["exposed_comm_s"] == a.summary["exposed_comm_s"]
    s = a.summary
    saving = 100 * (s["what_if_step_s"] - s["what_if_if_comm_fully_overlapped_s"]) / s["what_if_step_s"]
    assert comm.evidence["what_if_saving_pct"] == pytest.approx(saving, abs=0.005)
    # Ranked like diagnose: severity first, then the larger share.
    order = [(SEVERITIES.index(b.severity), -_share(b)) for b in bottlenecks]
    assert order == sorted(order)
    assert [r.priority for r in recs] == list(range(1, len(recs) + 1))


def _share(b):
    ev = b.evidence
    return next(ev[k] for k in ("host_wait_pct", "sync_pct", "attributable_comm_pct", "peer_wait_pct") if k in ev)


def test_gloo_straggler_is_the_sleeping_rank_with_truthful_cpu_wording(analyses):
    a = analyses["gloo-ddp-2rank"]
    b = _only(a.bottlenecks, "straggler", "straggler_rank")
    row = a.stragglers.set_index("rank").loc[1]
    # make_gloo_trace.py: rank 1 sleeps in Python every step; rank 0 waits for it.
    assert b.ranks == (1,) and b.evidence["straggler_rank"] == a.summary["straggler_rank"] == 1
    assert (b.evidence["times_last"], b.evidence["collectives"]) == (row["times_last"], row["collectives"])
    assert b.evidence["last_share_pct"] == pytest.approx(row["last_share_pct"])
    assert b.evidence["peer_wait_s_by_rank"] == {0: a.idle_causes.set_index("rank").loc[0, "peer_wait_s"]}
    assert b.evidence["peer_wait_pct"] == pytest.approx(_span_pct(a, "idle_causes", "peer_wait_s")[0], abs=0.005)
    host = _only(a.bottlenecks, "computation", "host_wait_pct")
    assert host.ranks == (1,) and host.evidence["device"] == "cpu"
    assert host.evidence["host_wait_pct"] == pytest.approx(_span_pct(a, "idle_causes", "host_wait_s").mean(), abs=0.005)
    for text in [x.message for x in a.bottlenecks] + [r.rationale for r in a.recommendations]:
        assert "GPU" not in text
    assert "main thread" in host.message and "main thread" in b.message
    # Rank 0's exposed comm is mostly waiting for rank 1: charged to the straggler, not communication.
    assert not [x for x in a.bottlenecks if x.category == "communication"]
    comm = _only(trace_findings(a, NO_STRAGGLER)[0], "communication", "exposed_comm_pct")
    assert comm.evidence["attributable_comm_pct"] == comm.evidence["exposed_comm_pct"]


@pytest.mark.parametrize("thresholds", [None, EVERYTHING, NO_STRAGGLER])
@pytest.mark.parametrize("name", NAMES)
def test_gains_never_exceed_the_share_that_bounds_them(analyses, name, thresholds):
    bottlenecks, recs = trace_findings(analyses[name], thresholds)
    assert recs or not bottlenecks
    for r in recs:
        mine = [b for b in bottlenecks if b.category == r.category]
        g = r.expected_gain
        assert 0.0 <= g.low_pct <= g.high_pct <= max(_share(b) for b in mine) + 1e-9
        what_if = [b.evidence.get("what_if_saving_pct") for b in mine if b.category == "communication"]
        if what_if and what_if[0] is not None:
            assert g.high_pct <= what_if[0] + 1e-9


def test_reports_carry_the_findings(analyses, tmp_path):
    a = analyses["gloo-ddp-2rank"]
    doc = json.loads(json.dumps(trace_report_dict(a), default=str))
    assert [b["message"] for b in doc["bottlenecks"]] == [b.message for b in a.bottlenecks]
    assert doc["bottlenecks"][0]["evidence"]["times_last"] == a.bottlenecks[0].evidence["times_last"]
    assert [r["expected_gain"]["high_pct"] for r in doc["recommendations"]] == [
        r.expected_gain.high_pct for r in a.recommendations]
    md = render_trace_markdown(a)
    assert md.index("## Bottlenecks") < md.index("## Recommendations") < md.index("## Temporal breakdown")
    for b in a.bottlenecks:
        assert b.message in md
    assert "CRITICAL: straggler" in md and "expected gain:" in md
    page = render_trace_html(a, max_segments=50)
    assert page.count('class="card bottleneck"') == len(a.bottlenecks)
    assert page.count('class="card recommendation"') == len(a.recommendations)
