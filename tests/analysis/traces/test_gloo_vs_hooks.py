"""A real 2-rank gloo run: the trace analyzer against the always-on tier's hook records.

`torsh-tune profile` runs examples/ddp_mlp.py (two DDP buckets per step) with per-bucket
hook timing and a trace window, so the same collectives are measured twice:

- hook (`profiler/comm.py`): issue = the comm hook's call, complete = its future's
  callback on gloo's worker thread; step records' exposed comm = last completion − last
  issue (the last bucket's issue taken as the end of backward compute: an upper bound).
- trace (`analysis/traces`): the main thread's ``c10d::allreduce_`` (issue) and the
  worker's ``gloo:all_reduce`` span (start, end); exposed = comm not under any
  main-thread operator (a blocking operator counts as compute: a lower bound).

Stated error: both sides can close late by a GIL wait. The hook stamps completion in a
Python callback on gloo's worker thread, which runs once the main thread lets go of the
GIL; the worker's span, or the main thread's ``c10d`` call, can also close late when the
host is busy (seen in 20 runs on 2 shared cores: 0.05-0.1 ms typically, a few ms now and
then, 38 ms once). So the median must agree within 1 ms and at least 3 in 4 collectives
within 5 ms; per-step comm and exposed comm (medians over the window) agree within those
bounds, exposed comm bracketed by the two estimators.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from torsh_tune.analysis._comm import aligned_collectives
from torsh_tune.analysis.traces import analyze_traces

from helpers import read_jsonl, run_cli

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ddp_mlp.py"
# Typical disagreement: the hook stamps issue just before the inner hook's own work (a
# division, then the c10d call) and completion just after the worker's span.
ISSUE_SKEW_S = 1e-3
# Disagreement allowed for most collectives: a late close or a late callback (module doc).
LATE_CLOSE_S = 5e-3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gloo-vs-hooks")
    cfg = tmp / "cfg.toml"
    cfg.write_text('[budget]\nsteps = 8\nwarmup_steps = 2\n[profiler]\ncomm_hook_timing = true\ntrace_window = "4:3"\n'
                   "[ddp]\nbucket_cap_mb = 1\n")
    proc = run_cli("profile", "--config", str(cfg), "--nproc-per-node", "2", "--runs-dir", str(tmp / "runs"),
                   "--run-name", "r", "--quiet", str(EXAMPLE), "--hidden", "512", "--layers", "2",
                   "--batch-size", "32", "--log-every", "1000", timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp / "runs" / "r"


def _matched(run_dir) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(trace collectives, hook records) of the window's steps, paired by (rank, step, issue order)."""
    a = analyze_traces(run_dir / "traces" / "step00004-00006", exclude_last_step=False)
    coll = a.collectives.copy()
    for rank, spans in a.steps.groupby("rank"):
        mine = coll["rank"] == rank
        at = np.searchsorted(spans["start_us"].to_numpy(), coll.loc[mine, "issue_us"].to_numpy(), side="right") - 1
        coll.loc[mine, "step"] = spans["step"].to_numpy()[at]
    coll["issue_to_end_s"] = (coll["end_us"] - coll["issue_us"]) / 1e6
    coll = coll.sort_values(["rank", "step", "issue_us"])
    coll["k"] = coll.groupby(["rank", "step"]).cumcount()
    comm = pd.DataFrame([r for p in sorted((run_dir / "ranks").glob("*.comm.jsonl")) for r in read_jsonl(p)])
    hook = aligned_collectives(comm)
    hook = hook[hook["step"].isin(a.steps["step"].unique())].sort_values(["rank", "step", "seq"])
    hook["k"] = hook.groupby(["rank", "step"]).cumcount()
    pairs = coll.merge(hook, on=["rank", "step", "k"], suffixes=("_trace", "_hook"))
    return pairs, a.steps


def test_trace_collectives_agree_with_hook_timing(run):
    pairs, steps = _matched(run)
    assert sorted(steps["step"].unique()) == [4, 5, 6]
    # Two buckets per step, three steps, two ranks: every hook record found its trace span.
    assert len(pairs) == 12 and (pairs["collective_trace"] == "all_reduce").all()
    hook_s = pairs["duration_s"].to_numpy()
    trace_s = pairs["issue_to_end_s"].to_numpy()
    start_s = ((pairs["start_us"] - pairs["issue_us"]) / 1e6).to_numpy()
    assert (start_s - ISSUE_SKEW_S <= hook_s).all(), "completion seen before the worker started"
    assert np.median(np.abs(hook_s - trace_s)) <= ISSUE_SKEW_S
    assert (np.abs(hook_s - trace_s) <= LATE_CLOSE_S).mean() >= 0.75
    # Transfer (the last arriver's time, min over ranks) per collective.
    per = pairs.groupby(["step", "k"]).agg(trace=("issue_to_end_s", "min"), hook=("transfer_s_hook", "first"))
    diff = np.abs(per["trace"] - per["hook"]).to_numpy()
    assert np.median(diff) <= ISSUE_SKEW_S and (diff <= LATE_CLOSE_S).mean() >= 0.75


def test_trace_overlap_agrees_with_step_records(run):
    _, steps = _matched(run)
    records = pd.DataFrame([r for p in sorted((run / "ranks").glob("*.steps.jsonl")) for r in read_jsonl(p)])
    records = records[records["step"].isin(steps["step"].unique())]
    for rank in (0, 1):
        # Medians over the window's steps: one late-closing span (see module doc) moves a sum.
        t = steps[steps["rank"] == rank][["comm_s", "exposed_comm_s"]].median()
        h = records[records["rank"] == rank][["comm_s", "exposed_comm_s"]].median()
        assert h["comm_s"] > 0 and t["comm_s"] > 0
        # Both cover the same intervals, either may close late (GIL, preemption).
        assert h["comm_s"] - LATE_CLOSE_S <= t["comm_s"] <= 2 * h["comm_s"] + LATE_CLOSE_S
        # Exposed: the trace's lower bound vs the hook's upper bound, widened by late closes.
        assert 0.5 * h["exposed_comm_s"] - ISSUE_SKEW_S <= t["exposed_comm_s"] <= 2 * h["exposed_comm_s"] + LATE_CLOSE_S
