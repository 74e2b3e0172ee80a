from __future__ import annotations

import pytest

import json

import numpy as np
import pandas as pd

from torsh_tune.analysis import analyze_run, load_run, measured, straggler_stats
from torsh_tune.analysis._clocks import host_clock_offsets

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


def _on_two_hosts(run_copy, offset_s: float, exchanged: dict | None = None):
    """The straggler fixture's ranks 0-1 on one host and 2-3 on another whose clock is `offset_s` ahead;
    `exchanged`: rank 2's start-up exchange with rank 0 (`meta["clock_sync"]`), none without it."""
    from .conftest import rewrite_jsonl

    run = run_copy("straggler")
    for rank in range(4):
        path = run / "ranks" / f"rank{rank:05d}.meta.json"
        meta = {**json.loads(path.read_text()), "hostname": "node-a" if rank < 2 else "node-b"}
        if rank == 2 and exchanged is not None:
            meta["clock_sync"] = {"reference_rank": 0, "rounds": 16, **exchanged}
        path.write_text(json.dumps(meta))
        if rank < 2:
            continue
        for kind, fields in (("steps", ("t_start", "t_end")), ("comm", ("t_issue", "t_complete")), ("system", ("t",))):
            rewrite_jsonl(run / "ranks" / f"rank{rank:05d}.{kind}.jsonl",
                          lambda row, fields=fields: {**row, **{f: row[f] + offset_s for f in fields if f in row}})
    return run


@pytest.mark.parametrize("offset_s", [0.030, -0.060])
def test_a_host_whose_clock_is_off_is_put_on_rank_0s_hosts_clock_and_the_straggler_is_still_found(run_copy, offset_s):
    run = _on_two_hosts(run_copy, offset_s)
    frames = load_run(run)
    (clock,) = frames.host_clocks
    assert clock["host"] == "node-b" and clock["reference"] == "node-a" and clock["applied"]
    assert clock["offset_s"] == pytest.approx(offset_s, abs=0.001) and clock["collectives"] == 20
    assert any(w.startswith("hosts' clocks: node-b is ") and "no exchange with rank 0 on record" in w for w in frames.warnings)
    steps, comm, _ = measured(frames.steps, frames.comm)
    st = straggler_stats(steps, comm)
    rows = {row["rank"]: row for row in st.per_rank}
    # Read as recorded, node-b's arrivals would be `offset_s` late (or early): rank 2 at 80 ms, or ranks 0-1 last.
    assert st.slowest_rank == 2 and st.last_share_pct == 100.0
    assert rows[2]["lateness_s"] == pytest.approx(0.05, abs=0.004)
    assert max(rows[r]["lateness_s"] for r in (0, 1, 3)) < 0.002
    analysis = analyze_run(run)
    assert analysis.host_clocks == frames.host_clocks and analysis.stragglers.slowest_rank == 2


def test_one_host_and_hosts_whose_clocks_agree_are_left_as_they_are(run_copy):
    assert load_run(DATA / "straggler").host_clocks == ()  # one hostname: one clock
    frames = load_run(_on_two_hosts(run_copy, 0.0))
    (clock,) = frames.host_clocks
    # The fixture's ranks 1 and 3 complete 20 us after ranks 0 and 2 (an order, not a clock): not applied.
    assert not clock["applied"] and abs(clock["offset_s"]) < 100e-6 and clock["collectives"] == 20
    assert "within the noise, not applied" in " ".join(frames.warnings)
    raw = load_run(DATA / "straggler")
    assert frames.comm["t_issue"].tolist() == raw.comm["t_issue"].tolist()


def test_the_start_up_exchange_is_the_offset_used_and_the_collectives_check_it(run_copy):
    # Rank 2's exchange read 30.05 ms (within 0.1 ms); the collectives' completions read 30 ms: they agree.
    frames = load_run(_on_two_hosts(run_copy, 0.030, {"ahead_s": 0.03005, "rtt_s": 0.0002, "t": 1.7e9}))
    (clock,) = frames.host_clocks
    assert (clock["source"], clock["offset_s"], clock["applied"], clock["disagree"]) == ("exchange", 0.03005, True, False)
    assert clock["collectives_offset_s"] == pytest.approx(0.030, abs=0.001) and clock["exchange_rtt_s"] == 0.0002
    note = next(w for w in frames.warnings if w.startswith("hosts' clocks: "))
    assert "start-up exchange with rank 0 30.050 ms, within ± 0.100 ms" in note and "20 collectives'" in note
    raw = load_run(DATA / "straggler")
    node_b = frames.comm["rank"] >= 2
    # node-b's times moved by the exchange's 30.05 ms: 0.05 ms before where the fixture had them
    assert (frames.comm.loc[node_b, "t_complete"] - raw.comm.loc[node_b, "t_complete"]).to_numpy() == pytest.approx(-5e-5, abs=1e-6)


def test_a_clock_that_moved_after_the_exchange_is_read_from_the_collectives(run_copy):
    # The exchange found the hosts together at start-up; the run's completions say node-b is 30 ms ahead.
    frames = load_run(_on_two_hosts(run_copy, 0.030, {"ahead_s": 0.0, "rtt_s": 0.0002, "t": 1.7e9}))
    (clock,) = frames.host_clocks
    assert (clock["source"], clock["applied"], clock["disagree"], clock["exchange_offset_s"]) == ("collectives", True, True, 0.0)
    assert clock["offset_s"] == pytest.approx(0.030, abs=0.001)
    assert "the exchanges and the collectives disagree (the clock was stepped during the run)" in " ".join(frames.warnings)
    steps, comm, _ = measured(frames.steps, frames.comm)
    assert straggler_stats(steps, comm).slowest_rank == 2


def test_without_host_clock_collectives_the_exchange_alone_puts_the_hosts_on_one_clock():
    # NCCL across hosts: every record on the device clock, no completion to compare; the exchange remains.
    meta = {0: {"hostname": "a"}, 1: {"hostname": "a"},
            2: {"hostname": "b", "clock_sync": {"ahead_s": -0.004, "rtt_s": 5e-5, "t": 1.7e9}},
            3: {"hostname": "b"}}
    comm = pd.DataFrame({"rank": [0, 2], "step": [0, 0], "seq": [0, 0], "collective": ["all_reduce"] * 2,
                         "clock": ["device"] * 2, "t_complete": [1.0, 1.004]})
    (row,) = host_clock_offsets(comm, meta)
    assert (row["source"], row["offset_s"], row["applied"], row["collectives"]) == ("exchange", -0.004, True, 0)
    # An exchange within its own round trip's bound says nothing about the sign: not applied.
    meta[2]["clock_sync"] = {"ahead_s": 0.0003, "rtt_s": 0.001, "t": 1.7e9}
    (row,) = host_clock_offsets(comm, meta)
    assert (row["source"], row["applied"]) == ("exchange", False)
    # Rank 0 unknown (its meta lost): the exchange's reference is not the lowest rank's host, so it is not used.
    del meta[0], meta[1]
    meta[4] = {"hostname": "c"}
    assert all(r["source"] is None and r["offset_s"] is None for r in host_clock_offsets(comm, meta))


def test_a_clock_that_drifts_between_the_two_exchanges_is_followed_record_by_record(run_copy):
    from .conftest import rewrite_jsonl

    # node-b's clock gains 1 ms per second (1000 ppm): 30 ms ahead at the fixture's first record, more later.
    run = _on_two_hosts(run_copy, 0.0)
    raw = load_run(run)
    t0, t1 = raw.steps["t_start"].min(), raw.steps["t_end"].max()
    ahead = lambda t: 0.030 + 1e-3 * (t - t0)  # noqa: E731
    for rank in (2, 3):
        for kind, fields in (("steps", ("t_start", "t_end")), ("comm", ("t_issue", "t_complete")), ("system", ("t",))):
            rewrite_jsonl(run / "ranks" / f"rank{rank:05d}.{kind}.jsonl",
                          lambda row, fields=fields: {**row, **{f: row[f] + ahead(row[f]) for f in fields if f in row}})
    path = run / "ranks" / "rank00002.meta.json"
    meta = json.loads(path.read_text())
    meta["clock_sync"] = {"reference_rank": 0, "ahead_s": ahead(t0 - 1), "rtt_s": 1e-4, "t": t0 - 1 + ahead(t0 - 1), "rounds": 16}
    meta["clock_sync_end"] = {"reference_rank": 0, "ahead_s": ahead(t1 + 1), "rtt_s": 1e-4, "t": t1 + 1 + ahead(t1 + 1), "rounds": 16}
    path.write_text(json.dumps(meta))
    frames = load_run(run)
    (clock,) = frames.host_clocks
    assert (clock["source"], clock["applied"], clock["disagree"]) == ("exchange", True, False), clock
    assert clock["drift_ppm"] == pytest.approx(1000, rel=0.01) and clock["offset_s"] == pytest.approx(0.029, abs=1e-5)
    assert f"drifting {clock['drift_ppm']:+.1f} ppm, followed" in " ".join(frames.warnings)
    # Every record of node-b back where the fixture had it, early and late in the run alike (to 1 us: the line's
    # slope is taken on node-b's own clock).
    for kind, col in (("steps", "t_end"), ("comm", "t_complete")):
        moved, was = frames.__dict__[kind], raw.__dict__[kind]
        node_b = moved["rank"] >= 2
        assert np.abs(moved.loc[node_b, col].to_numpy() - was.loc[node_b, col].to_numpy()).max() < 1e-6
    steps, comm, _ = measured(frames.steps, frames.comm)
    rows = {row["rank"]: row for row in straggler_stats(steps, comm).per_rank}
    assert rows[2]["lateness_s"] == pytest.approx(0.05, abs=0.004) and rows[3]["lateness_s"] < 0.002
