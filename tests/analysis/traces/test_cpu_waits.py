"""A CPU trace's communication as the training thread lives it: its waits on synchronous collectives.

`dist.all_reduce(t)` on gloo records its `c10d::allreduce_` while it issues the work, then blocks
in `Work.wait()`, which records nothing: the main thread shows a gap until it wakes up after the
gloo worker's span. That gap is the collective's (the always-on tier times the call, return
included); an asynchronous call followed by Python work is not a wait.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from torsh_tune.analysis import self_check
from torsh_tune.analysis.traces import analyze_traces
from torsh_tune.analysis.traces._timeline import MAIN_THREAD_WAIT, SYNC_WAKE_US

PID, MAIN, WORKER = 100, 100, 200
RESUME = 6000 + 25_000  # the first operator after the asynchronous call's Python
SPAN = RESUME + 9000


def _x(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = MAIN) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def _ann(name: str, ts: float, dur: float, *, tid: int = MAIN) -> dict:
    return _x(name, ts, dur, cat="user_annotation", tid=tid)


def _trace(tmp_path):
    """One step. The DataLoader collates its batch 20-80, then forward 100-1100 (one operator). The loss runs after it, outside any phase.
    Backward 1200-3000 holds a custom autograd function that all-reduces synchronously inside its
    operator: issued 1300-1350, run by the worker 1360-2000, the thread back at 2050. After backward
    a hand-written synchronous all-reduce: issued 3100-3150, run 3160-5000, the thread back at 5060
    (its `grad /= world`). Then an asynchronous one, issued 5200-5250 and run 5300-6000, while the
    thread runs Python for longer than a wake-up takes (`SYNC_WAKE_US`) before its next operator.
    Optimizer from there on."""
    ev = [_ann("ProfilerStep#5", 0, SPAN),
          _ann("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 10, 80), _x("aten::stack", 20, 60),
          _ann("torsh-tune::forward", 100, 1000), _x("aten::mm", 150, 900),
          _x("aten::cross_entropy_loss", 1110, 80),
          _ann("torsh-tune::backward", 1200, 1800), _x("AllReduceFunctionBackward", 1250, 1700),
          _x("aten::mm", 1260, 30), _x("c10d::allreduce_", 1300, 50), _ann("gloo:all_reduce", 1360, 640, tid=WORKER),
          _x("aten::mm", 2050, 850),
          _x("c10d::allreduce_", 3100, 50), _ann("gloo:all_reduce", 3160, 1840, tid=WORKER), _x("aten::div_", 5060, 100),
          _x("c10d::allreduce_", 5200, 50), _ann("gloo:all_reduce", 5300, 700, tid=WORKER),
          _x("aten::add", RESUME, 100),
          _ann("torsh-tune::optimizer", RESUME + 200, 800), _x("aten::add_", RESUME + 250, 700)]
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    (tmp_path / "rank-0.json").write_text(json.dumps({**meta, "traceEvents": ev}))
    return analyze_traces(tmp_path)


def test_a_synchronous_collectives_wait_is_communication_and_an_asynchronous_ones_python_is_not(tmp_path):
    a = _trace(tmp_path)
    tl = a.timelines[0]
    waits = sorted(zip(tl.start_us[tl.name_id == _wait_id(a)].tolist(), tl.end_us[tl.name_id == _wait_id(a)].tolist()))
    assert waits == [(1350.0, 2050.0), (3150.0, 5060.0)]
    assert RESUME - 6000 > SYNC_WAKE_US  # the asynchronous call's gap is no wait: the thread did not wake on it
    # The asynchronous one waited in gloo's queue from its issue to its worker's start: in flight, no one waiting.
    assert [tuple(x.tolist()) for x in tl.queued_us] == [(1300.0, 3100.0, 5200.0), (1360.0, 3160.0, 5300.0)]
    # comm (in flight): [1300, 2050] + [3100, 5060] + [5200, 6000]; exposed: all but the 50 µs queued
    overlap = a.tables["overlap"].rows()[0]
    assert overlap["comm_s"] * 1e6 == pytest.approx(750 + 1960 + 800)
    assert overlap["exposed_comm_s"] * 1e6 == pytest.approx(750 + 1960 + 50 + 700)
    assert overlap["overlapped_s"] * 1e6 == pytest.approx(50)
    # The main thread idle while it sat in the queue: that idle stretch's cause is the collective.
    assert [(r["start_us"], r["end_us"]) for r in a.tables["idle_segments"].rows() if r["cause"] == "comm_wait"] == [
        (5250.0, 5300.0)]
    (step,) = a.tables["steps"].rows()
    assert (step["comm_s"], step["exposed_comm_s"]) == pytest.approx((overlap["comm_s"], overlap["exposed_comm_s"]))
    # The wait inside the enclosing operator is not that operator's compute.
    compute = 60 + 900 + 80 + (1700 - 750) + 100 + 100 + 700
    assert a.breakdown.set_index("rank").loc[0, "compute_pct"] == pytest.approx(100 * compute / SPAN)
    top = a.top_kernels
    assert MAIN_THREAD_WAIT in set(top["name"]) and set(top.loc[top["name"] == MAIN_THREAD_WAIT, "kind"]) == {
        "communication"}


def test_the_phases_compute_and_the_compute_outside_them(tmp_path):
    row = _trace(tmp_path).phases.set_index("rank").loc[0]
    # forward 1000 + backward 1800 less its exposed comm 750 + optimizer 800
    assert row["phase_compute_pct"] == pytest.approx(100 * (1000 + 1050 + 800) / SPAN)
    # the loss, the gradient division and the add after the asynchronous call; not the collate (data)
    assert row["busy_outside_pct"] == pytest.approx(100 * (80 + 100 + 100) / SPAN)


def test_the_cpu_self_check_compares_the_phases_less_exposed_comm(tmp_path):
    a = _trace(tmp_path)
    # What the probes would record for this step: forward 1 ms, backward 1.8 ms with 0.75 ms waited
    # for, the hand-written calls 1.96 ms and 0.8 ms in flight (0.05 of it issuing), optimizer 0.8 ms.
    steps = pd.DataFrame([{"rank": 0, "step": 5, "warmup": False, "step_s": SPAN / 1e6, "data_s": 0.0,
                           "forward_s": 0.001, "backward_s": 0.0018, "optimizer_s": 0.0008,
                           "comm_s": 0.00351, "exposed_comm_s": 0.00276, "backward_exposed_comm_s": 0.00075,
                           "clock": "host"}])
    check = self_check(steps, a, window="step00005-00005", window_steps=(5, 5), threshold_pp=5.0)
    (row,) = check.per_rank
    assert row["trace_compute_basis"] == "phase spans"
    assert row["trace_compute_pct"] == pytest.approx(100 * 2850 / SPAN)
    assert row["trace_kernel_compute_pct"] == pytest.approx(a.breakdown.set_index("rank").loc[0, "compute_pct"])
    assert row["trace_compute_outside_phases_pct"] == pytest.approx(100 * 280 / SPAN)
    assert row["trace_comm_pct"] == pytest.approx(100 * 3510 / SPAN)
    assert row["comm_diff_pp"] == pytest.approx(0.0, abs=1e-9)


def _wait_id(a) -> int:
    """The waits' name id: the timeline entries that no trace event backs (row -1)."""
    tl = a.timelines[0]
    (wait_id,) = {int(i) for i in tl.name_id[tl.rows == -1]}
    return wait_id


def test_a_functional_collectives_own_operators_and_its_wait_tensor_are_communication(tmp_path):
    """DTensor's all-reduce through `_functional_collectives`: the functional op allocates and copies the
    output around the c10d op it issues, then wraps the async result; `wait_tensor` at the result's
    first use blocks until the gloo worker is done. All of it is the training thread's communication
    (the always-on side times the functional call and its wait); the matmuls around it are compute."""
    ev = [_ann("ProfilerStep#5", 0, 5000),
          _ann("torsh-tune::forward", 100, 4000), _x("aten::addmm", 150, 1000),
          _x("_c10d_functional::all_reduce", 1200, 130), _x("aten::clone", 1210, 20),
          _x("c10d::allreduce_", 1270, 40), _ann("gloo:all_reduce", 1320, 1500, tid=WORKER),
          _x("_c10d_functional::_wrap_tensor_autograd", 1340, 120),
          _x("aten::addmm", 1500, 500),  # compute that does not need the result
          _x("_c10d_functional::wait_tensor", 2100, 800),
          _x("aten::relu", 2950, 100)]
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    (tmp_path / "rank-0.json").write_text(json.dumps({**meta, "traceEvents": ev}))
    overlap = analyze_traces(tmp_path).tables["overlap"].rows()[0]
    # comm: [1200, 1460] (issue and wrap) + the worker's [1320, 2820] + the wait [2100, 2900] = [1200, 2900]
    assert overlap["comm_s"] * 1e6 == pytest.approx(1700)
    # exposed: all of it but the 500 us of compute the worker's span hides
    assert overlap["exposed_comm_s"] * 1e6 == pytest.approx(1700 - 500)
