from __future__ import annotations

import statistics

import pandas as pd
import pytest

from torsh_tune.analysis import PHASES, breakdown, load_run, measured, step_stats, traced_left_out

from .conftest import DATA, read_jsonl


def _raw_steps(name):
    rows = []
    for p in sorted((DATA / name / "ranks").glob("*.steps.jsonl")):
        rows += read_jsonl(p)
    return rows


def test_global_step_time_is_the_slowest_rank_outside_warmup():
    rows = [r for r in _raw_steps("straggler") if not r["warmup"]]
    by_step: dict[int, list[float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r["step_s"])
    global_s = [max(v) for _, v in sorted(by_step.items())]
    frames = load_run(DATA / "straggler")
    steps, _, warnings = measured(frames.steps, frames.comm)
    st = step_stats(steps)
    assert warnings == []
    assert st.num_steps == len(global_s) == 8
    assert st.median_step_s == pytest.approx(statistics.median(global_s))
    assert st.mean_step_s == pytest.approx(statistics.fmean(global_s))
    assert st.samples_per_step == 4 * 32
    # A rate: samples over the steps' time (no step here is twice the median: no stall).
    assert st.stall_steps == 0 and st.throughput_samples_s == pytest.approx(128 * len(global_s) / sum(global_s))
    assert st.steps_per_s == pytest.approx(len(global_s) / sum(global_s))
    assert st.p90_step_s >= st.median_step_s


def test_all_warmup_steps_are_used_with_a_warning():
    frames = load_run(DATA / "crashed")
    steps, comm, warnings = measured(frames.steps, frames.comm)
    assert len(steps) == len(frames.steps) == 5
    assert any("warm-up" in w for w in warnings)
    # Collectives of the step rank 1 never finished (its record is torn) are left out.
    assert len(frames.comm) == 18 and len(comm) == 15
    assert set(zip(comm["rank"], comm["step"])) <= set(zip(steps["rank"], steps["step"]))


def test_warmup_collectives_are_dropped_with_their_steps():
    frames = load_run(DATA / "healthy")
    _, comm, _ = measured(frames.steps, frames.comm)
    assert set(comm["step"]) == set(range(2, 12))


def _traced_run(num_steps: int, traced: dict[int, str]) -> pd.DataFrame:
    """Two ranks; steps in `traced` ("warmup" or "recorded") take 1.5x the others' 10 ms, as a window's do."""
    return _frame([{"rank": r, "step": i, "step_s": 0.015 if i in traced else 0.010, "trace": traced.get(i)}
                   for i in range(num_steps) for r in (0, 1)])


def test_the_steps_of_trace_windows_are_left_out_where_enough_others_remain():
    steps = _traced_run(12, {4: "warmup", 5: "recorded", 6: "recorded"})
    kept, _, warnings = measured(steps, steps.iloc[0:0])
    assert warnings == [] and sorted(set(kept["step"])) == [0, 1, 2, 3, 7, 8, 9, 10, 11]
    st = step_stats(kept)
    assert st.median_step_s == st.p90_step_s == pytest.approx(0.010)
    assert traced_left_out(steps, kept) == 3
    # A window over most of the run: nothing better is known, so its steps stay in, and the report says so.
    steps = _traced_run(8, {i: "recorded" for i in range(1, 6)})
    kept, _, warnings = measured(steps, steps.iloc[0:0])
    assert len(set(kept["step"])) == 8 and traced_left_out(steps, kept) == 0
    assert len(warnings) == 1 and warnings[0].startswith("trace windows hold 5 of the 8 measured steps")


def _frame(rows):
    base = dict(rank=0, step=0, t_start=0.0, t_end=1.0, step_s=1.0, data_s=0.0, forward_s=0.0, backward_s=0.0,
                optimizer_s=0.0, comm_s=0.0, exposed_comm_s=0.0, samples=8, num_microbatches=1, loss=None,
                peak_mem_bytes=0, warmup=False)
    return pd.DataFrame([{**base, **r} for r in rows])


def test_breakdown_splits_backward_and_floors_at_zero():
    df = _frame([
        # backward 0.5 of which 0.2 exposed comm -> 0.3 compute; other = 1 - 0.1-0.2-0.3-0.2-0.1 = 0.1
        dict(rank=0, step=0, data_s=0.1, forward_s=0.2, backward_s=0.5, exposed_comm_s=0.2, optimizer_s=0.1),
        # exposed > backward (clock skew) and phases > step: both floors apply
        dict(rank=1, step=0, data_s=0.5, forward_s=0.4, backward_s=0.1, exposed_comm_s=0.3, optimizer_s=0.1),
    ])
    bd = breakdown(df)
    assert list(bd.phases_s) == list(PHASES) and list(bd.phases_pct) == list(PHASES)
    assert bd.phases_s["backward_compute"] == pytest.approx((0.3 + 0.0) / 2)
    assert bd.phases_s["other"] == pytest.approx((0.1 + 0.0) / 2)
    assert bd.phases_s["exposed_comm"] == pytest.approx(0.25)
    assert bd.step_s == 1.0 and bd.phases_pct["data"] == pytest.approx(30.0)


def test_breakdown_is_median_over_steps_of_the_rank_mean():
    df = _frame([dict(rank=r, step=s, data_s=0.1 * (s + 1) + 0.1 * r) for s in range(3) for r in range(2)])
    # per-step means: 0.15, 0.25, 0.35 -> median 0.25
    assert breakdown(df).phases_s["data"] == pytest.approx(0.25)


def test_empty_steps_give_none():
    assert step_stats(_frame([]).iloc[0:0]) is None
    assert breakdown(_frame([]).iloc[0:0]) is None


def test_steps_whose_ddp_all_reduce_went_untimed_are_left_out_of_the_comm_numbers():
    from torsh_tune.analysis._comm import comm_stats

    # PyTorch samples DDP's CUDA timers: 3 timed steps with 0.3 s of exposed comm, 4 untimed ones that
    # say 0 (not measured). Counted as 0 they would make the median exposure 0 and the backward compute.
    timed = [dict(step=s, backward_s=0.5, comm_s=0.4, exposed_comm_s=0.3) for s in range(3)]
    untimed = [dict(step=s, backward_s=0.5, comm_timed=False) for s in range(3, 7)]
    df = _frame(timed + untimed)
    bd = breakdown(df)
    assert bd.phases_s["exposed_comm"] == pytest.approx(0.3) and bd.phases_s["backward_compute"] == pytest.approx(0.2)
    stats = comm_stats(df, pd.DataFrame(), world_size=2)
    assert (stats.comm_s, stats.exposed_comm_s) == (pytest.approx(0.4), pytest.approx(0.3))
    # With none timed there is nothing better: all records, as before.
    assert breakdown(_frame(untimed)).phases_s["exposed_comm"] == 0.0
