from __future__ import annotations

import pytest

from torsh_tune.analysis import load_run, measured, straggler_stats

from .conftest import DATA


def _measured(name):
    frames = load_run(DATA / name)
    steps, comm, _ = measured(frames.steps, frames.comm)
    return steps, comm


def test_straggler_is_the_rank_that_arrives_last():
    steps, comm = _measured("straggler")
    st = straggler_stats(steps, comm)
    assert st.basis == "comm"
    assert st.slowest_rank == 2
    assert st.last_share_pct == 100.0
    rows = {row["rank"]: row for row in st.per_rank}
    assert rows[2]["last_count"] == 8 and sum(r["last_count"] for r in rows.values()) == 8
    assert rows[2]["lateness_s"] == pytest.approx(0.05, abs=0.004)  # the fixture's 50 ms extra forward
    assert max(rows[r]["lateness_s"] for r in (0, 1, 3)) < 0.002
    assert rows[2]["median_compute_s"] > rows[0]["median_compute_s"] + 0.04
    step_s = steps.groupby("step")["step_s"].max().median()
    assert st.lateness_pct == pytest.approx(100 * 0.05 / step_s, abs=3)


def test_without_comm_records_compute_time_decides():
    steps, comm = _measured("straggler")
    st = straggler_stats(steps, comm.iloc[0:0])
    assert st.basis == "compute" and st.slowest_rank == 2 and st.last_share_pct == 100.0
    assert all(row["lateness_s"] is None for row in st.per_rank)


def test_healthy_run_has_no_consistent_large_lateness():
    steps, comm = _measured("healthy")
    st = straggler_stats(steps, comm)
    assert st.lateness_pct < 2.0


def test_single_rank_has_no_stragglers():
    steps, comm = _measured("healthy")
    assert straggler_stats(steps[steps["rank"] == 0], comm[comm["rank"] == 0]) is None
