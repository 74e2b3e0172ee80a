from __future__ import annotations

import pandas as pd
import pytest

from torsh_tune.analysis import aligned_collectives, bus_factor, comm_stats, load_run, measured

from .conftest import DATA, read_jsonl


def _comm(rows):
    base = dict(bucket=0, collective="all_reduce", hook="allreduce", bytes=0, wire_bytes=0, num_tensors=1)
    out = []
    for r in rows:
        row = {**base, **r}
        row["t_complete"] = row["t_issue"] + row["duration_s"]
        out.append(row)
    return pd.DataFrame(out)


def test_transfer_is_the_min_duration_across_ranks_and_wait_the_rest():
    raw = [r for p in sorted((DATA / "straggler" / "ranks").glob("*.comm.jsonl")) for r in read_jsonl(p)]
    df = aligned_collectives(pd.DataFrame(raw))
    for (step, seq), group in df.groupby(["step", "seq"]):
        durations = [r["duration_s"] for r in raw if r["step"] == step and r["seq"] == seq]
        assert (group["transfer_s"] == min(durations)).all()
        assert group["wait_s"].tolist() == pytest.approx((group["duration_s"] - min(durations)).tolist())
        issues = [r["t_issue"] for r in raw if r["step"] == step and r["seq"] == seq]
        assert group["lateness_s"].tolist() == pytest.approx((group["t_issue"] - min(issues)).tolist())
    # The straggler (rank 2) arrives last, so it never waits; the others wait ~its 50 ms delay.
    assert df[df["rank"] == 2]["wait_s"].max() == 0.0
    assert df[(df["rank"] != 2) & (df["step"] >= 2)]["wait_s"].median() == pytest.approx(0.05, abs=0.005)


@pytest.mark.parametrize(("collective", "n", "factor"), [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 4, 0.75), ("reduce_scatter", 8, 0.875),
    ("all_to_all", 2, 0.5), ("broadcast", 4, 1.0), ("all_reduce", 1, 0.0),
])
def test_bus_factor_follows_nccl_tests(collective, n, factor):
    assert bus_factor(collective, n) == pytest.approx(factor)


def test_bandwidths_and_wait_from_a_hand_computed_collective():
    gb = 10**9
    # One 1 GB all-reduce on 4 ranks: rank 3 arrives 0.5 s late; the wire needs 1 s.
    df = _comm([dict(rank=r, step=0, seq=0, bytes=gb, wire_bytes=gb, t_issue=100.0 + (0.5 if r == 3 else 0.0),
                     duration_s=1.0 if r == 3 else 1.5) for r in range(4)])
    steps = pd.DataFrame({"rank": range(4), "step": 0, "comm_s": [1.5, 1.5, 1.5, 1.0],
                          "exposed_comm_s": [0.75, 0.75, 0.75, 0.5]})
    cs = comm_stats(steps, df, world_size=4, meta={1: {"ddp_logging": {"avg_backward_comm_time": 7}}})
    assert cs.transfer_s == pytest.approx(1.0)
    assert cs.wait_s == pytest.approx((0.5 * 3) / 4)
    assert cs.wait_by_rank_s == pytest.approx({0: 0.5, 1: 0.5, 2: 0.5, 3: 0.0})
    assert cs.algbw_gbps == pytest.approx(1.0)
    assert cs.busbw_gbps == pytest.approx(1.5)
    assert cs.comm_s == pytest.approx(1.375) and cs.exposed_comm_s == pytest.approx(0.6875)
    assert cs.overlap_pct == pytest.approx(100 * (1 - 0.6875 / 1.375))
    assert cs.num_collectives_per_step == 1 and cs.bytes_per_step == gb
    assert cs.hooks == ("allreduce",)
    assert cs.ddp_logging == {"avg_backward_comm_time": 7}


def test_queueing_behind_the_previous_collective_is_not_wire_time():
    gb = 10**9
    # Both ranks issue two buckets at t=0; the second waits for the first (1 s) then takes 1 s.
    df = _comm([dict(rank=r, step=0, seq=k, bytes=gb, wire_bytes=gb, t_issue=0.0, duration_s=1.0 + k)
                for r in range(2) for k in range(2)])
    steps = pd.DataFrame({"rank": [0, 1], "step": 0, "comm_s": 2.0, "exposed_comm_s": 1.0})
    cs = comm_stats(steps, df, world_size=2)
    assert cs.transfer_s == pytest.approx(3.0)  # min durations 1 + 2 (queue included)
    assert cs.wire_s == pytest.approx(2.0)  # the wire was busy 2 s
    assert cs.algbw_gbps == pytest.approx(1.0)
    assert cs.last_transfer_s == pytest.approx(1.0)
    assert cs.wait_s == pytest.approx(0.0)


def test_comm_stats_from_fixture_runs():
    frames = load_run(DATA / "comm_bound")
    steps, comm, _ = measured(frames.steps, frames.comm)
    cs = comm_stats(steps, comm, world_size=2, meta=frames.meta)
    assert cs.num_collectives_per_step == 3 and cs.bytes_per_step == 12 * 1024 * 1024
    # Fixture: 4 MiB buckets taking 25 ms each on the wire (+-2 %).
    assert cs.algbw_gbps == pytest.approx(4 * 1024 * 1024 / 0.025 / 1e9, rel=0.03)
    assert cs.wait_s < 0.01 * cs.transfer_s  # symmetric ranks: no skew
    assert cs.overlap_pct < 30


def test_no_communication_gives_none():
    steps = pd.DataFrame({"rank": [0], "step": [0], "comm_s": [0.0], "exposed_comm_s": [0.0]})
    assert comm_stats(steps, _comm([]).iloc[0:0], world_size=1) is None


BROADCAST = "torch.nn.parallel.distributed:DistributedDataParallel._distributed_broadcast_coalesced"


def test_time_per_step_by_who_issued_which_op():
    # Two ranks, three steps: DDP broadcasts its buffers before every forward (rank 1 waits 2 ms on rank 0),
    # then all-reduces one bucket; the script all-gathers once, in step 1 only.
    rows = []
    for step in range(3):
        t = 10.0 * step
        for r in range(2):
            rows.append(dict(rank=r, step=step, seq=3 * step, collective="broadcast", issuer="ddp", bytes=4096,
                             t_issue=t, duration_s=0.003 if r else 0.001, origin=BROADCAST))
            rows.append(dict(rank=r, step=step, seq=3 * step + 1, issuer="ddp", bytes=1000, t_issue=t + 1,
                             duration_s=0.010))
            if step == 1:  # from two functions of the script: the one that took longer first
                rows.append(dict(rank=r, step=step, seq=3 * step + 2, collective="all_gather", issuer="user",
                                 bytes=64, t_issue=t + 2, duration_s=0.5, origin="train.py:sync"))
                rows.append(dict(rank=r, step=step, seq=3 * step + 3, collective="all_gather", issuer="user",
                                 bytes=64, t_issue=t + 3, duration_s=0.7, origin="train.py:<module>"))
    steps = pd.DataFrame({"rank": [0, 1] * 3, "step": [0, 0, 1, 1, 2, 2], "comm_s": 0.02, "exposed_comm_s": 0.01})
    kinds = comm_stats(steps, _comm(rows), world_size=2).by_kind
    assert [(k["issuer"], k["op"]) for k in kinds] == [("ddp", "all_reduce"), ("ddp", "broadcast"),
                                                       ("user", "all_gather")]  # most time first
    by = {(k["issuer"], k["op"]): k for k in kinds}
    # Where each kind was called from (records without an origin, DDP's C++ reducer's, name none).
    assert [k.pop("origins") for k in kinds] == [[], [BROADCAST], ["train.py:<module>", "train.py:sync"]]
    assert by[("ddp", "broadcast")] == pytest.approx({"issuer": "ddp", "op": "broadcast", "count": 1, "bytes": 4096,
                                                      "time_s": 0.002, "transfer_s": 0.001})
    assert by[("ddp", "all_reduce")]["time_s"] == pytest.approx(0.010)
    # In one step of three: the median step has none of it.
    assert by[("user", "all_gather")] == pytest.approx({"issuer": "user", "op": "all_gather", "count": 0, "bytes": 0,
                                                       "time_s": 0.0, "transfer_s": 0.0})


def test_ddps_builtin_all_reduce_counts_over_the_steps_its_timers_were_read():
    # DDP's C++ all-reduce is one step-level record per step whose reducer timers were read (every 8th step
    # past the detailed ones on CPU): the other steps did all-reduce too. Lightning's flag is captured in all.
    rows, timed = [], []
    for step in range(10):
        read = step % 8 == 0
        timed += [dict(rank=r, step=step, comm_s=0.02 if read else 0.0, exposed_comm_s=0.01 if read else 0.0,
                       comm_timed=read) for r in range(2)]
        for r in range(2):
            if read:
                rows.append(dict(rank=r, step=step, seq=2 * step, issuer="ddp", hook="builtin", bytes=1000,
                                 t_issue=10.0 * step, duration_s=0.010))
            rows.append(dict(rank=r, step=step, seq=2 * step + 1, collective="broadcast", hook=None, bytes=8,
                             issuer="lightning", t_issue=10.0 * step + 1, duration_s=0.001,
                             origin="lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor"))
    kinds = {(k["issuer"], k["op"]): k for k in comm_stats(pd.DataFrame(timed), _comm(rows), world_size=2).by_kind}
    assert (kinds[("ddp", "all_reduce")]["count"], kinds[("ddp", "all_reduce")]["time_s"]) == (1, pytest.approx(0.010))
    assert (kinds[("lightning", "broadcast")]["count"], kinds[("lightning", "broadcast")]["bytes"]) == (1, 8)
