"""StepTracker: a step's phases, samples and loss; closure optimizers; exposed communication by kind
of collective; the device clock's bookkeeping (held until its events completed, host fallback).

Times are chosen as exact binary fractions so that every expected value is exact. The device
clock's events come from `_ScriptedEvents`, a `DeviceEvents` whose events carry scripted device
times (CPU builds of torch have no timing events); the CUDA path itself runs in
tests/profiler/test_device_clock.py where a GPU is lent.
"""

from __future__ import annotations

import json

import pytest
import torch

from torsh_tune.profiler._device import DeviceEvents
from torsh_tune.profiler.steps import StepTracker, _comm_times
from torsh_tune.profiler.writer import RecordWriter, SharedFields
from torsh_tune.rundir import RunDir

from helpers import assert_record_schema

ZERO_EXPOSED = {"forward_exposed_comm_s": 0.0, "backward_exposed_comm_s": 0.0, "optimizer_exposed_comm_s": 0.0}


@pytest.fixture
def run(tmp_path):
    return RunDir(tmp_path / "run")


@pytest.fixture
def writer(run):
    w = RecordWriter(run, 3, flush_interval_s=60)  # written when the test flushes
    yield w
    w.close()


def _lines(run: RunDir, writer: RecordWriter, kind: str) -> list[dict]:
    writer.flush()
    path = run.rank_file(3, kind)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _tracker(writer, **kwargs) -> StepTracker:
    options = {"rank": 3, "writer": writer, "warmup_steps": 1, "loss_every": 2, "peak_memory": lambda: 4096}
    return StepTracker(**(options | kwargs))


def _comm(t_issue, t_complete, *, issuer="user", async_op=False, blocked_s=0.0, hook=None, clock="host",
          stream=None, step=0, seq=0, **extra) -> dict:
    """A CommRecord as the c10d capture hands it to the tracker."""
    shared = {"rank": 3, "bucket": -1, "collective": "all_reduce", "issuer": issuer, "async_op": async_op,
              "clock": clock}
    if hook is not None:
        shared["hook"] = hook
    if stream is not None:
        shared["stream"] = stream
    record = {"_s": SharedFields(shared), "step": step, "seq": seq, "bytes": 64, "wire_bytes": 64,
              "t_issue": t_issue, "blocked_s": blocked_s, **extra}
    if t_complete is not None:
        record["t_complete"], record["duration_s"] = t_complete, t_complete - t_issue
    return record


# -- host clock ---------------------------------------------------------------------------

class _Recording:
    """What the tracker reads of a TraceWindows: `recording`, here while its step is in `window` (no warm-up)."""

    warming = False

    def __init__(self, tracker, window):
        self._tracker, self._window = tracker, window

    @property
    def recording(self):
        return self._tracker.step in self._window


def test_a_step_runs_from_the_previous_end_and_sums_its_phases(run, writer):
    tracker = _tracker(writer)
    assert tracker.loss_due  # step 0 of loss_every=2
    tracker.on_data(10.0, 10.25, 8)
    tracker.on_forward(10.25, 10.75, 8)
    tracker.on_backward(10.75, 11.5, torch.tensor(0.5))
    tracker.on_optimizer(11.5, 11.75)
    tracker.on_optimizer(11.75, 12.0)  # a second optimizer in the same iteration: the same step
    assert tracker.end_step(12.0) == 1
    assert not tracker.loss_due
    # Gradient accumulation before the forward is probed: micro-batches are the backwards, samples the loader's.
    tracker.on_data(12.25, 12.5, 4)
    tracker.on_backward(12.5, 13.0, None)
    tracker.on_data(13.0, 13.25, 4)
    tracker.on_backward(13.25, 13.5, None)
    tracker.on_tokens(100)
    tracker.on_optimizer(13.5, 14.0)
    assert tracker.end_step(14.0) == 2
    tracker.restart_clock(20.0)  # e.g. a trace export between the steps: not the next step's time
    tracker.on_forward(20.5, 21.0, 2)
    tracker.on_backward(21.0, 21.5, torch.tensor(0.25))
    tracker.on_optimizer(21.5, 22.0)
    assert tracker.end_step(22.0) == 3

    steps = _lines(run, writer, "steps")
    base = {"rank": 3, "comm_s": 0.0, "exposed_comm_s": 0.0, "peak_mem_bytes": 4096, "clock": "host", **ZERO_EXPOSED}
    assert steps == [
        base | {"step": 0, "t_start": 10.0, "t_end": 12.0, "step_s": 2.0, "data_s": 0.25, "forward_s": 0.5,
                "backward_s": 0.75, "optimizer_s": 0.5, "samples": 8, "tokens": None, "num_microbatches": 1,
                "loss": 0.5, "warmup": True},
        base | {"step": 1, "t_start": 12.0, "t_end": 14.0, "step_s": 2.0, "data_s": 0.5, "forward_s": 0.0,
                "backward_s": 0.75, "optimizer_s": 0.5, "samples": 8, "tokens": 100, "num_microbatches": 2,
                "loss": None, "warmup": False},
        base | {"step": 2, "t_start": 20.0, "t_end": 22.0, "step_s": 2.0, "data_s": 0.0, "forward_s": 0.5,
                "backward_s": 0.5, "optimizer_s": 0.5, "samples": 2, "tokens": None, "num_microbatches": 1,
                "loss": 0.25, "warmup": False},
    ]
    for record in steps:
        assert_record_schema(record, "steps")


def test_an_evaluation_pass_is_its_own_time_and_its_batches_are_not_data_wait_nor_samples(run, writer):
    tracker = _tracker(writer, warmup_steps=0)
    tracker.on_data(10.0, 10.125, 8)  # a training batch fetched in the step before (a loader prefetching)
    tracker.on_forward(10.125, 10.25, 8)
    tracker.on_optimizer(10.25, 10.5)
    assert tracker.end_step(10.5) == 1 and not tracker.last_unusual
    # Step 1: a validation pass of three batches between the steps, then a training step.
    tracker.on_data(10.5, 10.625, 16)
    tracker.on_eval(10.625, 11.0, 16)
    tracker.on_data(11.0, 11.125, 16)
    tracker.on_eval(11.125, 11.5, 16)
    tracker.on_data(11.5, 11.625, 4)  # the last batch is smaller
    tracker.on_eval(11.625, 12.0, 4)
    tracker.on_data(12.25, 12.5, 8)  # after the pass (its metrics, 12-12.25, are not in it): the training batch
    tracker.on_forward(12.5, 12.75, 8)
    tracker.on_backward(12.75, 13.0, None)
    tracker.on_optimizer(13.0, 13.25)
    assert tracker.unusual
    assert tracker.end_step(13.25) == 2 and tracker.last_unusual and not tracker.unusual
    # Step 2: an evaluation forward between the training forward and its backward (the pass's span holds
    # them; the training phases inside it are not the pass's).
    tracker.on_data(13.25, 13.5, 8)
    tracker.on_forward(13.5, 13.75, 8)
    tracker.on_data(13.75, 14.0, 2)
    tracker.on_eval(14.0, 14.25, 2)
    tracker.on_checkpoint(14.25, 14.5)
    tracker.on_eval(14.5, 14.75, 2)
    tracker.on_backward(14.75, 15.0, None)
    tracker.on_optimizer(15.0, 15.25)
    tracker.end_step(15.25)
    first, passed, inside = _lines(run, writer, "steps")
    assert "eval_s" not in first and (first["data_s"], first["samples"]) == (0.125, 8)
    assert (passed["eval_s"], passed["eval_batches"], passed["eval_samples"]) == (1.5, 3, 36)
    assert (passed["data_s"], passed["forward_s"], passed["samples"], passed["num_microbatches"]) == (0.25, 0.25, 8, 1)
    assert (inside["eval_s"], inside["eval_batches"], inside["eval_samples"]) == (0.75, 2, 4)  # 13.75-14.75 less the save
    assert (inside["data_s"], inside["checkpoint_s"], inside["samples"]) == (0.25, 0.25, 8)
    for record in (first, passed, inside):
        assert_record_schema(record, "steps")


def test_a_dataloaders_worker_restarts_are_their_own_time_and_an_evaluation_loaders_are_the_passs(run, writer):
    tracker = _tracker(writer, warmup_steps=0)
    tracker.on_data(10.0, 10.125, 8)
    tracker.on_forward(10.125, 10.25, 8)
    tracker.on_optimizer(10.25, 10.5)
    tracker.end_step(10.5)
    # Step 1: the epoch ends (the exhausted iterator shuts its workers down), the next epoch's iterator
    # starts 2 workers, and the first batch waits for them.
    tracker.on_loader(10.5, 10.625, 0)
    tracker.on_loader(10.75, 11.0, 2)
    assert tracker.unusual
    tracker.on_data(11.0, 11.5, 8)
    tracker.on_forward(11.5, 11.75, 8)
    tracker.on_optimizer(11.75, 12.0)
    assert tracker.end_step(12.0) == 2 and tracker.last_unusual
    # Step 2: a validation pass with a loader of its own (its iterator started, then shut down after the
    # last batch): the pass's time, not a restart of the training's loader.
    tracker.on_loader(12.0, 12.25, 3)
    tracker.on_data(12.25, 12.5, 16)
    tracker.on_eval(12.5, 12.75, 16)
    tracker.on_loader(12.75, 13.0, 0)
    tracker.on_data(13.0, 13.125, 8)
    tracker.on_forward(13.125, 13.25, 8)
    tracker.on_optimizer(13.25, 13.5)
    tracker.end_step(13.5)
    first, restarted, evaluated = _lines(run, writer, "steps")
    assert "loader_restart_s" not in first and "loader_starts" not in first
    # The start and the shut-down are the loader's (0.375 s); the wait for the first batch stays data wait.
    assert (restarted["loader_restart_s"], restarted["loader_starts"], restarted["data_s"]) == (0.375, 2, 0.5)
    assert restarted["samples"] == 8 and "eval_s" not in restarted
    assert "loader_restart_s" not in evaluated and "loader_starts" not in evaluated
    assert (evaluated["eval_s"], evaluated["data_s"], evaluated["samples"]) == (1.0, 0.125, 8)  # 12.0-13.0
    for record in (first, restarted, evaluated):
        assert_record_schema(record, "steps")


def test_an_evaluation_around_a_closure_optimizer_leaves_out_its_time_once(run, writer):
    tracker = _tracker(writer, warmup_steps=0)
    tracker.mark_activity(9.5)  # the run's first phase (a fetch, say): the tracker is no longer idle
    tracker.on_eval(10.0, 10.25, 2)
    tracker.on_forward(10.5, 10.75, 4)  # the closure's forward and backward, inside optimizer.step(closure)
    tracker.on_backward(10.75, 11.0, None)
    tracker.on_optimizer(10.25, 11.25)
    tracker.on_eval(11.25, 11.5, 2)
    tracker.end_step(11.5)
    (step,) = _lines(run, writer, "steps")
    assert (step["eval_s"], step["eval_batches"]) == (0.5, 2)  # 10-11.5 less the optimizer's 10.25-11.25, once


def test_an_evaluation_passes_collectives_are_its_own_not_the_steps_communication(run, writer):
    """A pass's collectives (an FSDP2 all-gather in its forward, a metric's all-reduce after its last forward,
    before training resumes) keep their records, as phase "evaluation", and stay out of the step's comm."""
    from torsh_tune.profiler.steps import _OFFSET

    tracker = _tracker(writer, warmup_steps=0)
    tracker.call_sites.append((SharedFields({"rank": 3, "bucket": -1, "collective": "all_reduce",
                                             "issuer": "lightning", "async_op": False, "clock": "host"}), "lightning"))

    def call(t0, t1, seq):  # as the capture's fast path keeps a synchronous host call
        tracker.comm_done.append((0, tracker.step, seq, 8, t0 - _OFFSET, t1 - _OFFSET))

    tracker.on_forward(10.0, 10.25, 8)
    tracker.on_optimizer(10.25, 10.5)
    tracker.end_step(10.5)
    tracker.on_data(10.5, 10.625, 16)
    tracker.on_collective(_comm(10.75, 10.875, blocked_s=0.125, issuer="fsdp", step=1, seq=0))
    tracker.on_eval(10.625, 11.0, 16)
    call(11.125, 11.375, 1)  # the metric's all-reduce: after the pass's last forward
    tracker.on_training_mode(11.4375)  # the module back in train mode: the pass is over
    call(11.4375, 11.5, 3)  # Lightning's SIGTERM-flag broadcast before it fetches: training's
    tracker.on_data(11.5, 11.625, 8)  # training resumes
    tracker.on_forward(11.625, 11.75, 8)
    tracker.on_backward(11.75, 12.0, None)
    call(11.875, 11.9375, 2)  # the training's own (a hand-written all-reduce inside the backward)
    tracker.on_optimizer(12.0, 12.125)
    tracker.end_step(12.125)
    _, step = _lines(run, writer, "steps")
    assert step["eval_s"] == pytest.approx(11.375 - 10.5)  # to the end of its last collective
    assert (step["comm_s"], step["exposed_comm_s"]) == pytest.approx((0.125, 0.125))
    assert step["data_s"] == 0.125 and step["eval_batches"] == 1
    comm = {c["seq"]: c for c in _lines(run, writer, "comm")}
    assert (comm[0]["phase"], comm[0]["issuer"], comm[0]["blocked_s"]) == ("evaluation", "fsdp", 0.125)
    assert (comm[1]["phase"], comm[1]["issuer"]) == ("evaluation", "lightning")
    assert comm[1]["t_issue"] == pytest.approx(11.125) and comm[1]["duration_s"] == pytest.approx(0.25)
    assert "phase" not in comm[2] and "phase" not in comm[3]
    for record in comm.values():
        assert_record_schema(record, "comm")


def test_an_evaluation_pass_before_the_first_step_is_no_steps(run, writer):
    tracker = _tracker(writer, warmup_steps=0)
    tracker.on_eval(9.0, 9.5, 16)  # a sanity check before training: the tracker is idle
    assert not tracker.unusual and tracker.phases == []


def test_a_closure_optimizer_keeps_only_its_own_time(run, writer):
    # Lightning's optimizer.step(closure): forward and backward run inside the optimizer step.
    tracker = _tracker(writer)
    tracker.on_data(11.75, 12.0, 4)
    tracker.on_forward(12.25, 12.5, 4)
    tracker.on_backward(12.5, 13.0, None)
    tracker.on_forward(13.25, 13.5, 4)  # LBFGS evaluates the closure more than once
    tracker.on_backward(13.5, 13.75, None)
    tracker.on_optimizer(12.0, 14.0)
    tracker.end_step(14.0)
    (step,) = _lines(run, writer, "steps")
    assert (step["step_s"], step["forward_s"], step["backward_s"]) == (2.25, 0.5, 0.75)
    assert step["optimizer_s"] == 0.25 + 0.25 + 0.25  # 12-12.25, 13-13.25, 13.75-14


def test_collectives_are_written_with_their_step_and_late_ones_alone(run, writer):
    tracker = _tracker(writer, warmup_steps=0)
    tracker.on_forward(10.0, 10.75, 4)
    tracker.on_backward(10.75, 11.5, None)
    assert tracker.next_comm() == (0, 0)
    assert tracker.next_comm() == (0, 1)
    # A synchronous call from 11.25, blocking 0.5 s: half in the backward, half in the optimizer step.
    tracker.on_collective(_comm(11.25, 11.75, blocked_s=0.5, seq=0))
    tracker.on_optimizer(11.5, 11.75)
    # An async one completing after the step ended (its future's callback comes later).
    tracker.end_step(11.75)
    assert tracker.next_comm() == (1, 2)  # seq runs on across steps
    tracker.on_collective(_comm(11.5, 12.5, async_op=True, seq=1))
    tracker.on_forward(12.0, 12.5, 4)
    tracker.end_step(13.0)

    step0, step1 = _lines(run, writer, "steps")
    assert (step0["comm_s"], step0["exposed_comm_s"]) == (0.5, 0.5)
    assert (step0["forward_exposed_comm_s"], step0["backward_exposed_comm_s"], step0["optimizer_exposed_comm_s"]) \
        == (0.0, 0.25, 0.25)
    assert (step1["comm_s"], step1["exposed_comm_s"]) == (0.0, 0.0)  # the late one is step 0's, written alone
    comm = _lines(run, writer, "comm")
    assert [(c["step"], c["seq"], c["t_issue"], c["duration_s"]) for c in comm] == [(0, 0, 11.25, 0.5), (0, 1, 11.5, 1.0)]
    for record in comm:
        assert_record_schema(record, "comm")


def test_ddp_timer_steps_wait_for_the_next_step_and_take_the_reducers_record(run, writer):
    calls = []

    def step_comm(step, seq, *, read=True):  # what RankRuntime.ddp_step_comm returns from DDP's timers
        if not read:  # the run's last step: its timers would come at a forward that never runs
            return [], 0.0, False
        calls.append((step, seq))
        builtin = _comm(10.75 + step, 11.75 + step, issuer="ddp", async_op=True, hook="builtin", step=step, seq=seq)
        return [builtin], 0.5, True

    tracker = _tracker(writer, warmup_steps=0)
    tracker.step_comm = step_comm
    for i in range(2):
        tracker.on_forward(10.0 + i, 10.5 + i, 2)
        tracker.on_backward(10.5 + i, 10.75 + i, None)  # 0.25 s: caps the exposure of 0.5
        tracker.next_comm()  # one collective of the step's own (seq 0, then seq 1)
        tracker.on_optimizer(10.75 + i, 11.0 + i)
        tracker.end_step(11.0 + i)
        if i == 0:
            assert _lines(run, writer, "steps") == [] and calls == []  # DDP reports at the next forward
    assert [s["step"] for s in _lines(run, writer, "steps")] == [0]
    assert calls == [(0, 2)]  # the builtin record takes the sequence number after the step's own
    tracker.flush_pending()  # the last step: no later timers to read, written without them
    step0, step1 = _lines(run, writer, "steps")
    assert (step0["comm_s"], step0["exposed_comm_s"], step0["backward_exposed_comm_s"]) == (1.0, 0.25, 0.25)
    assert (step1["comm_s"], step1["exposed_comm_s"]) == (0.0, 0.0) and calls == [(0, 2)]
    # Its 0 means "not measured": the record says so, the timed one carries nothing extra.
    assert step1["comm_timed"] is False and "comm_timed" not in step0
    assert [(c["step"], c["seq"], c["hook"]) for c in _lines(run, writer, "comm")] == [(0, 2, "builtin")]
    for record in (step0, step1):
        assert_record_schema(record, "steps")


# -- exposed communication by kind ---------------------------------------------------------
PHASES = [("forward", 10.0, 11.0), ("backward", 11.0, 12.0), ("optimizer", 12.25, 12.75)]


def _step(**fields) -> dict:
    return {"t_start": 10.0, "step_s": 3.0, "backward_s": 1.0, "clock": "host"} | fields


def test_ddp_buckets_expose_what_runs_after_the_last_bucket_is_issued():
    comm = [_comm(11.25, 11.75, issuer="ddp", async_op=True, hook="allreduce"),
            _comm(11.5, 12.0, issuer="ddp", async_op=True, hook="allreduce")]
    total, exposed, in_phase = _comm_times(comm, [], _step(), PHASES, 0.0)
    assert (total, exposed, in_phase) == (0.75, 0.5, {"forward": 0.0, "backward": 0.5, "optimizer": 0.0})
    # DDP's synchronous broadcast of its buffers before the forward is no bucket's: it blocks the forward.
    buffers = _comm(10.25, 10.5, issuer="ddp", blocked_s=0.25)
    total, exposed, in_phase = _comm_times([buffers, *comm], [], _step(), PHASES, 0.0)
    assert (total, exposed, in_phase) == (1.0, 0.75, {"forward": 0.25, "backward": 0.5, "optimizer": 0.0})
    # Never more than the backward it lies in.
    total, exposed, in_phase = _comm_times(comm, [], _step(backward_s=0.25), PHASES, 0.0)
    assert (exposed, in_phase["backward"]) == (0.25, 0.25)


def test_ddp_buckets_issuing_calls_are_exposed_and_none_completes_after_its_backward():
    # The first bucket's issuing call held the training thread 0.125 s; the last one's lies in the tail.
    first = _comm(11.25, 11.75, issuer="ddp", async_op=True, hook="allreduce", blocked_s=0.125, issue_s=0.125)
    # Its future's callback ran after the backward returned (the gloo worker woke the training thread
    # first): the reducer had waited for it, so it completed by the backward's end.
    last = _comm(11.5, 12.25, issuer="ddp", async_op=True, hook="allreduce", blocked_s=0.0625, issue_s=0.0625)
    total, exposed, in_phase = _comm_times([first, last], [], _step(), PHASES, 0.0)
    assert (total, exposed, in_phase) == (0.75, 0.625, {"forward": 0.0, "backward": 0.625, "optimizer": 0.0})
    assert (last["t_complete"], last["duration_s"]) == (12.0, 0.5) and first["t_complete"] == 11.75


def test_the_reducers_builtin_record_counts_its_timers_exposure_only():
    builtin = _comm(11.0, 12.5, issuer="ddp", async_op=True, hook="builtin")
    assert _comm_times([builtin], [], _step(), PHASES, 0.25) == (1.5, 0.25, {"forward": 0.0, "backward": 0.25,
                                                                          "optimizer": 0.0})


def test_host_clock_collectives_expose_the_time_the_thread_blocked():
    sync = _comm(10.75, 11.5, blocked_s=0.75)  # blocked from its issue: 0.25 forward, 0.5 backward
    waited = _comm(11.0, 12.5, async_op=True, blocked_s=0.25)  # Work.wait() until completion: 12.25-12.5
    never_waited = _comm(10.0, 12.0, async_op=True)  # a future chained by the script: overlapped
    total, exposed, in_phase = _comm_times([sync, waited, never_waited], [], _step(), PHASES, 0.0)
    assert (total, exposed) == (2.5, 1.0)
    assert in_phase == {"forward": 0.25, "backward": 0.5, "optimizer": 0.25}
    # What the step waited for is never more than the step.
    assert _comm_times([_comm(10.0, 15.0, blocked_s=5.0)], [], _step(), PHASES, 0.0)[1] == 3.0
    # A collective never seen complete counts for nothing.
    assert _comm_times([_comm(10.0, None)], [], _step(), PHASES, 0.0) == (0.0, 0.0, dict.fromkeys(("forward", "backward",
                                                                                                  "optimizer"), 0.0))



def test_an_asynchronous_collective_exposes_its_issuing_call_and_its_wait():
    # Issued in backward (the call held the thread 0.125 s), waited for 0.25 s until its completion.
    issued = _comm(11.25, 12.5, async_op=True, blocked_s=0.375, issue_s=0.125)
    total, exposed, in_phase = _comm_times([issued], [], _step(), PHASES, 0.0)
    assert (total, exposed) == (1.25, 0.375)
    assert in_phase == {"forward": 0.0, "backward": 0.125, "optimizer": 0.25}
    # Records made before the issuing call was kept apart: all of blocked_s is the wait.
    assert _comm_times([_comm(11.25, 12.5, async_op=True, blocked_s=0.25)], [], _step(), PHASES, 0.0)[2] == {
        "forward": 0.0, "backward": 0.0, "optimizer": 0.25}
    # Each asynchronous record says the phase its issue fell in (none between the backward and the
    # optimizer step); synchronous ones and DDP buckets do not.
    after = _comm(12.1, 12.2, async_op=True, blocked_s=0.1)
    sync, bucket = _comm(11.5, 11.6, blocked_s=0.1), _comm(11.5, 11.9, issuer="ddp", async_op=True, hook="allreduce")
    _comm_times([after, sync, bucket], [], _step(), PHASES, 0.0)
    assert issued["phase"] == "backward" and "phase" not in after and "phase" not in sync and "phase" not in bucket


def test_a_wait_that_returns_after_the_completion_is_placed_where_it_returned():
    # Issued in the forward, completed at 11.0 (the gloo worker's callback), but the training thread's
    # Work.wait() ran 12.25-12.5: a ZeroRedundancyOptimizer step on a busy host, whose thread took the core
    # back late. Placed to end at the completion, the 0.25 s would lie in the forward; it lies in the
    # optimizer step, and it is communication (the trace reads the wait so).
    late = _comm(10.5, 11.0, async_op=True, blocked_s=0.25, _wait_end=12.5)
    total, exposed, in_phase = _comm_times([late], [], _step(), PHASES, 0.0)
    assert (total, exposed) == (0.75, 0.25)
    assert in_phase == {"forward": 0.0, "backward": 0.0, "optimizer": 0.25}
    assert "_wait_end" not in late  # the probes' own field: never written
    # A wait that returned before the callback took its completion's timestamp ends where it returned too
    # (12.15-12.4), not at that timestamp.
    early = _comm(11.25, 12.5, async_op=True, blocked_s=0.25, _wait_end=12.4)
    assert _comm_times([early], [], _step(), PHASES, 0.0)[2]["optimizer"] == pytest.approx(0.15)


def test_a_synchronous_host_call_kept_as_a_tuple_counts_as_its_comm_record_would():
    from torsh_tune.profiler import SharedFields
    from helpers import host_call_record
    from torsh_tune.profiler.steps import _OFFSET

    sites = [(SharedFields({"rank": 3, "collective": "all_reduce", "issuer": issuer, "async_op": False,
                            "clock": "host"}), issuer) for issuer in ("user", "ddp")]

    def call(t0, t1, site=0):  # as the capture's fast path keeps it: its site's index, perf_counter times
        return (site, 0, 0, 64, t0 - _OFFSET, t1 - _OFFSET)

    calls = [call(10.75, 11.5), call(12.3, 12.4), call(11.25, 11.75, site=1), call(12.5, 12.5)]
    assert all(type(v) in (int, float) for c in calls for v in c)  # numbers only: the cyclic GC lets go of it
    records = [host_call_record(c, sites) for c in calls]
    for step in (_step(), _step(clock="device")):
        (total, exposed, in_phase), expected = (_comm_times([], calls, step, PHASES, 0.0),
                                                _comm_times(records, [], step, PHASES, 0.0))
        assert (total, exposed) == pytest.approx(expected[:2], abs=1e-6)
        assert in_phase == pytest.approx(expected[2], abs=1e-6)
    total, exposed, in_phase = _comm_times([], calls, _step(), PHASES, 0.0)
    # (the times went through perf_counter's offset: equal to a microsecond)
    assert (total, exposed) == pytest.approx((1.1, 0.75 + 0.1 + 0.5), abs=1e-6)  # DDP's own call blocks as any
    assert in_phase == pytest.approx({"forward": 0.25, "backward": 1.0, "optimizer": 0.1}, abs=1e-6)

def test_device_clock_collectives_block_only_synchronously_on_the_default_stream():
    def device(stream, async_op, rel):
        return _comm(10.5, None, async_op=async_op, clock="device", stream=stream, duration_s=rel[1] - rel[0],
                     _rel_start=rel[0], _rel_end=rel[1])

    sync_default = device("default", False, (1.5, 2.0))  # holds the compute stream: exposed
    side = device("side", False, (0.25, 1.0))  # FSDP2's side stream: overlapped
    async_default = device("default", True, (2.25, 2.5))
    comm = [sync_default, side, async_default]
    total, exposed, in_phase = _comm_times(comm, [], _step(clock="device"), PHASES, 0.0)
    assert (total, exposed, in_phase) == (1.5, 0.5, {"forward": 0.0, "backward": 0.5, "optimizer": 0.0})
    # Rewritten onto the step's device timeline, anchored at its host start.
    assert [(c["t_start"], c["t_complete"]) for c in comm] == [(11.5, 12.0), (10.25, 11.0), (12.25, 12.5)]
    assert not any("_rel_start" in c for c in comm)
    # An engine's asynchronous all-reduce, issued in backward and waited for before the optimizer step: the
    # compute stream reached the wait at 2.25 and idled until the collective ended at 2.5.
    waited = device("default", True, (0.75, 2.5))
    waited["_rel_wait"] = 2.25
    early = device("default", True, (0.75, 1.0))  # over before the stream reached its wait: nothing exposed
    early["_rel_wait"] = 1.75
    total, exposed, in_phase = _comm_times([waited, early], [], _step(clock="device"), PHASES, 0.0)
    assert (total, exposed, in_phase) == (1.75, 0.25, {"forward": 0.0, "backward": 0.0, "optimizer": 0.25})
    assert not any("_rel_wait" in c for c in (waited, early))


# -- device clock ---------------------------------------------------------------------------
class _Event:
    """A timing event with a scripted device time. As on a CUDA stream, the device reaches events in the
    order they were recorded: completing one completes those before it; reading an unfinished one raises."""

    def __init__(self, pool: "_ScriptedEvents", t: float) -> None:
        self.pool, self.index, self.t = pool, len(pool.recorded), t
        self.done, self.unreadable = False, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        for e in self.pool.recorded[: self.index + 1]:
            e.done = True

    def elapsed_time(self, end: "_Event") -> float:
        if self.unreadable or end.unreadable:
            raise RuntimeError("event recorded on another device")
        if not (self.done and end.done):
            raise RuntimeError("device not ready")
        return (end.t - self.t) * 1000.0  # ms, as torch.cuda.Event


class _ScriptedEvents(DeviceEvents):
    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0  # device time of the events recorded next
        self.recorded: list[_Event] = []

    def record(self) -> _Event:
        self.recorded.append(_Event(self, self.t))
        return self.recorded[-1]

    def at(self, t: float) -> _Event:
        self.t = t
        return self.record()

    def complete(self) -> None:
        """The device caught up with everything recorded so far."""
        self.recorded[-1].synchronize()


def _device_step(tracker: StepTracker, ev: _ScriptedEvents, host0: float, dev0: float) -> dict:
    """One step: host launch times 1/8 s per phase; device times from `dev0` (the device lags)."""
    ev.t = dev0
    tracker.on_data(host0, host0 + 0.5, 4)  # the step's start event: device time dev0
    tracker.on_forward(host0 + 0.5, host0 + 0.625, 4, (ev.at(dev0 + 0.75), ev.at(dev0 + 1.0)))
    tracker.on_backward(host0 + 0.625, host0 + 0.75, torch.tensor(3.0), (ev.at(dev0 + 1.0), ev.at(dev0 + 2.5)))
    step, seq = tracker.next_comm()
    comm = _comm(host0 + 0.625, None, blocked_s=0.0625, clock="device", stream="default", step=step, seq=seq,
                 _start=ev.at(dev0 + 1.25), _end=ev.at(dev0 + 2.0))
    tracker.on_collective(comm)
    tracker.on_optimizer(host0 + 0.75, host0 + 0.875, (ev.at(dev0 + 2.5), ev.at(dev0 + 2.75)))
    ev.t = dev0 + 3.0
    tracker.end_step(host0 + 1.0)
    return comm


def test_device_clock_steps_are_written_once_their_events_completed(run, writer):
    tracker = _tracker(writer, warmup_steps=0, loss_every=1)
    ev = tracker.device_events = _ScriptedEvents()
    _device_step(tracker, ev, 10.0, 100.0)
    assert _lines(run, writer, "steps") == []  # nothing waited for: the step is held
    ev.complete()
    _device_step(tracker, ev, 11.0, 103.0)  # step 1 starts on the device where step 0 ended
    steps = _lines(run, writer, "steps")
    assert [s["step"] for s in steps] == [0]
    tracker.flush_pending()  # the end of the run waits for the events
    steps = _lines(run, writer, "steps")
    expected = {"clock": "device", "step_s": 3.0, "data_s": 0.75, "forward_s": 0.25, "backward_s": 1.5,
                "optimizer_s": 0.25, "host_step_s": 1.0, "host_data_s": 0.5, "host_forward_s": 0.125,
                "host_backward_s": 0.125, "host_optimizer_s": 0.125, "comm_s": 0.75, "exposed_comm_s": 0.75,
                "forward_exposed_comm_s": 0.0, "backward_exposed_comm_s": 0.75, "optimizer_exposed_comm_s": 0.0,
                "loss": 3.0}
    for step, host0 in zip(steps, (10.0, 11.0)):
        assert {k: step[k] for k in expected} == expected
        assert (step["t_start"], step["t_end"]) == (host0, host0 + 1.0)
        assert_record_schema(step, "steps")
    comm = _lines(run, writer, "comm")
    assert [(c["duration_s"], c["t_start"], c["t_complete"]) for c in comm] == [(0.75, 11.25, 12.0),
                                                                               (0.75, 12.25, 13.0)]
    assert tracker.device_errors == []


def test_on_the_device_clock_data_ends_at_the_first_forward_an_evaluations_included(run, writer):
    tracker = _tracker(writer, warmup_steps=0, loss_every=1)
    ev = tracker.device_events = _ScriptedEvents()
    ev.t = 100.0
    tracker.on_data(10.0, 10.125, 4)  # the step's start event: device time 100
    tracker.on_eval(10.125, 10.25, 4, ev.at(100.5))  # the device reached the evaluation at 100.5
    tracker.on_data(10.25, 10.375, 4)
    tracker.on_forward(10.375, 10.5, 4, (ev.at(101.5), ev.at(102.0)))
    tracker.on_backward(10.5, 10.625, torch.tensor(1.0), (ev.at(102.0), ev.at(103.0)))
    tracker.on_optimizer(10.625, 10.75, (ev.at(103.0), ev.at(103.5)))
    ev.t = 104.0
    tracker.end_step(10.75)
    ev.complete()
    tracker.flush_pending()
    (step,) = _lines(run, writer, "steps")
    assert step["clock"] == "device" and step["data_s"] == 0.5 and step["host_data_s"] == 0.125
    assert (step["eval_s"], step["eval_batches"]) == (0.25, 1)  # host seconds, whatever the clock
    assert len(tracker.device_events._free) == 8  # every event back in the pool, the evaluation's too


def test_a_step_whose_events_cannot_be_read_stays_on_the_host_clock(run, writer):
    tracker = _tracker(writer, warmup_steps=0, loss_every=1)
    ev = tracker.device_events = _ScriptedEvents()
    comm = _device_step(tracker, ev, 10.0, 100.0)
    ev.recorded[1].unreadable = True  # the forward's start event
    ev.complete()
    tracker.flush_pending()
    (step,) = _lines(run, writer, "steps")
    assert step["clock"] == "host" and not any(k.startswith("host_") for k in step)
    assert (step["step_s"], step["data_s"], step["forward_s"], step["backward_s"], step["optimizer_s"]) == \
        (1.0, 0.5, 0.125, 0.125, 0.125)
    assert (step["comm_s"], step["exposed_comm_s"], step["loss"]) == (0.0, 0.0, 3.0)
    assert tracker.device_errors == ["step 0: event recorded on another device"]
    (written,) = _lines(run, writer, "comm")
    assert written["seq"] == comm["seq"] and "duration_s" not in written and "_start" not in written


def test_ddp_timers_are_read_in_the_warmup_the_first_measured_steps_and_windows_then_every_kth(run, writer):
    from torsh_tune.profiler.steps import DETAILED_STEPS

    reads = []

    def step_comm(step, seq, *, read=True):
        if read:
            reads.append(step)
        return [], 0.0, read

    tracker = _tracker(writer, warmup_steps=2)
    tracker.step_comm, tracker.ddp_timers_every = step_comm, 4
    window = range(31, 34)  # a trace window over steps 31-33: the self-check compares every one of them
    tracker.traces = _Recording(tracker, window)
    n = 2 + DETAILED_STEPS + 20
    for i in range(n):
        tracker.on_forward(10.0 + i, 10.5 + i, 2)
        tracker.on_optimizer(10.5 + i, 11.0 + i)
        tracker.end_step(11.0 + i)
    tracker.flush_pending()
    detailed = list(range(2 + DETAILED_STEPS))
    # Past them, the steps whose DDP iteration (step + 1 here) is a multiple of 4: those DDP collects.
    assert reads == detailed + [23, 27, 31, 32, 33, 35, 39]  # the last step (41) is never read
    steps = _lines(run, writer, "steps")
    assert [s["step"] for s in steps if s.get("comm_timed", True)] == reads


def test_past_the_detailed_steps_host_records_are_finalized_in_batches_with_one_peak_read(run, writer):
    from torsh_tune.profiler.steps import DETAILED_STEPS, FINALIZE_EVERY

    peaks = []

    def peak():  # the RSS peak grows by 1 KiB per read: which read a record carries is visible
        peaks.append(len(peaks))
        return 4096 + 1024 * len(peaks)

    tracker = _tracker(writer, warmup_steps=2, peak_memory=peak)
    detailed = 2 + DETAILED_STEPS
    window = range(detailed + 20, detailed + 22)  # a trace window: every step of it is written at once
    tracker.traces = _Recording(tracker, window)
    written = []
    for i in range(detailed + 40):  # 10 ms steps: a batch is 16 steps, never what waited FINALIZE_AFTER_S
        t = 10.0 + 0.01 * i
        tracker.on_forward(t, t + 0.005, 2)
        tracker.on_optimizer(t + 0.005, t + 0.01)
        tracker.end_step(t + 0.01)
        written.append(len(tracker._queue))
    # Detailed steps are written at once (one read each); past them up to FINALIZE_EVERY + 1 wait, then go together.
    assert written[:detailed] == [0] * detailed
    assert max(written) == FINALIZE_EVERY
    assert written[detailed:detailed + FINALIZE_EVERY] == list(range(1, FINALIZE_EVERY + 1))
    assert written[detailed + FINALIZE_EVERY] == 0
    assert written[window[0]] == 0 and written[window[1]] == 0  # the window drains what waited and writes its steps
    tracker.flush_pending()
    steps = _lines(run, writer, "steps")
    assert [s["step"] for s in steps] == list(range(detailed + 40))
    by_peak: dict[int, list[int]] = {}
    for s in steps:
        by_peak.setdefault(s["peak_mem_bytes"], []).append(s["step"])
    # One read per detailed or window step, one per batch otherwise: every record of a batch has its read.
    # The batches: 17 steps, the 3 the window drained, 17, and the run's last step alone at the end.
    batches = [v for v in by_peak.values() if len(v) > 1]
    assert [len(v) for v in batches] == [FINALIZE_EVERY + 1, 20 - FINALIZE_EVERY - 1, FINALIZE_EVERY + 1]
    assert by_peak[max(by_peak)] == [detailed + 39]
    assert len(peaks) == detailed + 2 + len(batches) + 1
    for s in steps:
        assert_record_schema(s, "steps")


def test_slow_steps_are_not_held_back_by_the_batch(run, writer):
    from torsh_tune.profiler.steps import DETAILED_STEPS, FINALIZE_AFTER_S

    tracker = _tracker(writer, warmup_steps=0)
    waiting = []
    for i in range(DETAILED_STEPS + 6):  # 0.3 s steps: the one that ends 0.6 s after the oldest waiting flushes them
        t = 10.0 + i * 0.6 * FINALIZE_AFTER_S
        tracker.on_forward(t, t + 0.1, 2)
        tracker.end_step(t + 0.2)
        waiting.append(len(tracker._queue))
    assert waiting[DETAILED_STEPS:] == [1, 2, 0, 1, 2, 0]


def test_host_clock_records_are_made_on_the_writers_thread_in_step_order(run):
    import threading
    import time

    from torsh_tune.profiler.steps import _OFFSET, DETAILED_STEPS

    writer = RecordWriter(run, 3, flush_interval_s=0.02)
    tracker = _tracker(writer, warmup_steps=0)
    tracker.call_sites.append((SharedFields({"rank": 3, "collective": "all_reduce", "issuer": "user"}), "user"))
    threads = []
    finalize = tracker._finalize
    tracker._finalize = lambda entry: (threads.append(threading.current_thread().name), finalize(entry))[1]
    n = DETAILED_STEPS + 40  # detailed steps, then batches
    for i in range(n):
        t = 10.0 + 0.01 * i
        tracker.on_forward(t, t + 0.005, 2)
        tracker.on_optimizer(t + 0.005, t + 0.01)
        tracker.end_step(t + 0.01)
        # the step before's call, arriving late: filed with its step, or its line alone once that one was handed over
        tracker.comm_done.append((0, max(0, i - 1), i, 8, t - _OFFSET, t + 0.001 - _OFFSET))
    tracker.flush_pending()
    deadline = time.monotonic() + 10
    while len(threads) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(threads) == n and set(threads) == {"torsh-writer-3"}, (len(threads), set(threads))
    writer.close()
    steps = [json.loads(line) for line in run.rank_file(3, "steps").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(n))
    comm = [json.loads(line) for line in run.rank_file(3, "comm").read_text().splitlines()]
    assert sorted(c["seq"] for c in comm) == list(range(n))


def test_a_record_that_cannot_be_made_is_kept_and_raised_by_close(run):
    writer = RecordWriter(run, 3, flush_interval_s=60)
    writer.finish_later(lambda entry: entry["missing"], {})
    with pytest.raises(OSError, match="could not all be written"):
        writer.close()


def test_a_host_call_that_arrives_after_its_step_was_written_gets_its_line_alone(run, writer):
    from torsh_tune.profiler.steps import _OFFSET

    tracker = _tracker(writer, warmup_steps=0)
    tracker.call_sites.append((SharedFields({"rank": 3, "collective": "all_reduce", "issuer": "user"}), "user"))
    tracker.on_forward(10.0, 10.5, 2)
    tracker.on_optimizer(10.5, 11.0)
    tracker.end_step(11.0)  # a detailed step: handed to the writer at once
    assert [s["step"] for s in _lines(run, writer, "steps")] == [0]
    tracker.comm_done.append((0, 0, 0, 64, 10.6 - _OFFSET, 10.7 - _OFFSET))  # step 0's call, handed over late
    tracker.on_forward(11.0, 11.5, 2)
    tracker.end_step(12.0)
    tracker.flush_comm()
    (c,) = _lines(run, writer, "comm")
    assert (c["step"], c["seq"], c["bytes"], c["issuer"]) == (0, 0, 64, "user")
    assert (c["t_issue"], c["duration_s"], c["blocked_s"]) == pytest.approx((10.6, 0.1, 0.1), abs=1e-6)


def test_blocked_time_is_split_over_phases_as_a_comparison_of_every_pair_would():
    import random

    from torsh_tune.profiler.steps import _split_over_phases

    def every_pair(blocked, phases):
        out = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
        for s, e in blocked:
            for phase, p0, p1 in phases:
                if p1 > s and p0 < e and p1 > p0:
                    out[phase] += min(p1, e) - max(p0, s)
        return out

    rng = random.Random(0)
    for trial in range(300):
        t, calls = 10.0, []
        for _ in range(rng.randrange(0, 40)):  # one thread's calls: one after another
            t += rng.choice((0.0, rng.random()))
            calls.append((t, t + rng.random()))
            t = calls[-1][1]
        if trial % 3 == 0 and calls:  # and, a third of the time, an async wait around some of them
            calls.append((calls[0][0] - 0.5, calls[-1][1]))
        rng.shuffle(calls)
        phases = [(rng.choice(("forward", "backward", "optimizer")), a, a + rng.random() * 5)
                  for a in (10.0 + rng.random() * t for _ in range(rng.randrange(1, 6)))]
        got = dict.fromkeys(("forward", "backward", "optimizer"), 0.0)
        blocked = sorted(calls)
        _split_over_phases(blocked, [s for s, _ in blocked], [e for _, e in blocked], phases, got)
        assert got == pytest.approx(every_pair(calls, phases), abs=1e-9)


def test_the_union_of_intervals_is_their_merged_length():
    import random

    from torsh_tune.profiler.steps import _union

    def merged(spans):
        total, end = 0.0, float("-inf")
        for s, e in sorted(spans):
            if e > end:
                total += e - max(s, end)
                end = e
        return total

    rng = random.Random(1)
    for trial in range(300):
        t, spans = 10.0, []
        for _ in range(rng.randrange(0, 40)):  # disjoint (one thread's calls), touching or apart
            t += rng.choice((0.0, rng.random()))
            spans.append((t, t + rng.random()))
            t = spans[-1][1]
        if trial % 2 and spans:  # and half of the time, spans that overlap them
            spans += [(a, a + rng.random() * 3) for a in (10.0 + rng.random() * t for _ in range(rng.randrange(1, 4)))]
        rng.shuffle(spans)
        assert _union(spans) == pytest.approx(merged(spans), abs=1e-9)
