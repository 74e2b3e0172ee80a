"""Per-step accounting on the training thread: phases, samples, loss, memory, communication.

The phase probes in `runtime` append their phase events to `phases` (the `on_*` methods do the
same for other callers); `end_step` closes a step, and the step's StepRecord line and its
CommRecord lines are written once they can be known:

- Host clock (CPU, or before the run is known to train on CUDA): at once, or one step
  later where DDP's builtin all-reduce is timed by the reducer's own timers (reported at
  the next forward).
- Device clock (training on CUDA): every phase boundary is a CUDA event on the current
  stream; a step is written when its last event has completed (`query()`, usually a step
  or two later), never by synchronizing. Its phases, communication and exposed
  communication are then device time; the host's launch times are kept beside them
  (`host_*_s`) and the record's `clock` says which is which.

Everything here runs on the hot path, so it keeps to float arithmetic and list appends.
Past the detailed steps (the warm-up, the first `DETAILED_STEPS` measured ones, trace windows)
host-clock steps are handed over in batches of `FINALIZE_EVERY` (or of what waited
`FINALIZE_AFTER_S`): on a 2-core VM the first touch of any code after a training step costs
5-15x its warm cost (getrusage 11 us, then 1.7 us), so one pass over 16 steps costs little
more than one. Only what cannot wait is done per step: the previous step's DDP timers, read
while they are still DDP's latest. A host-clock step's records are made from its times on the
writer's thread (`RecordWriter.finish_later`); a device-clock step's CUDA events are read
here, and its lines queued behind the others, so every file keeps the order of its steps.
"""

from __future__ import annotations

import bisect
import collections
from itertools import accumulate, repeat
from operator import add, ge, itemgetter, sub
import resource
from typing import Any, Callable

from ._clock import offset as _clock_offset
from ._device import DeviceEvents
from .writer import HOST_CALL_FIELDS, RecordWriter, host_call_values

__all__ = ["StepTracker"]

_OFFSET = _clock_offset()
# A host call's tuple (`writer.host_call_values`): perf_counter at its issue and at its return; an interval's ends.
_ISSUE, _RETURN = itemgetter(4), itemgetter(5)
_first, _second = itemgetter(0), itemgetter(1)

_PHASES = ("forward", "backward", "optimizer")
DETAILED_STEPS = 20  # measured steps whose DDP timers are always read (profiler.ddp_timers_every)
FINALIZE_EVERY = 16  # host-clock steps finalized and queued for the writer together, past the detailed steps
# ... or fewer, once the oldest waiting step ended this long ago: slow steps reach the files (the live
# dashboard, the pruner, the supervisor's no-progress timeout) as soon as unbatched ones would.
FINALIZE_AFTER_S = 0.5


class StepTracker:
    """Accumulates one rank's step phases between optimizer steps."""

    def __init__(
        self,
        *,
        rank: int,
        writer: RecordWriter | None,
        warmup_steps: int,
        loss_every: int,
        peak_memory: Callable[[], int] | None = None,
    ) -> None:
        self.rank = rank
        self.step = 0
        self._writer = writer
        self._warmup = warmup_steps
        self._detailed_until = warmup_steps + DETAILED_STEPS
        self._loss_every = loss_every
        self._peak_memory = peak_memory or _peak_rss_bytes
        self._t_start: float | None = None
        self.idle = True  # no phase yet in this run: the first one calls `mark_activity`
        self.loss_due = True  # whether the current step reads its loss: step % loss_every == 0
        # The current step holds an evaluation pass or a checkpoint save: slow by design, no anomaly
        # (`last_unusual` keeps the verdict of the step just ended, for the trace windows' anomaly check).
        self.unusual = self.last_unusual = False
        self._comm_seq = 0
        # Completed collectives (or device-pending ones) arrive here, also from communication
        # threads; deque appends are atomic. A record dict, or a synchronous host-clock call's tuple,
        # which stays a tuple in its step (`writer.host_call_values`).
        self.comm_done: collections.deque[dict[str, Any] | tuple] = collections.deque()
        # (shared fields, issuer) of each call site the capture's fast path knows; a call's tuple holds
        # its site's index here (`writer.host_call_values`). Only ever appended to.
        self.call_sites: list[tuple[Any, str]] = []
        # (step, seq) -> (step-level CommRecords, exposed comm s, timed) of collectives no hook
        # timed (DDP's builtin all-reduce, from the reducer's timers); `read=False`: the step's
        # timers are not read (the run's last step, or a step `ddp_timers_every` skips).
        self.step_comm: Callable[..., tuple[list[dict[str, Any]], float, bool]] | None = None
        # Which steps' DDP timers are read (`profiler.ddp_timers_every`): every step of the warm-up,
        # the first DETAILED_STEPS measured ones and every step a trace window records (`traces`), then
        # every k-th.
        self.ddp_timers_every = 1
        self.traces: Any = None  # the rank's TraceWindows (its `recording`), when it has any
        # DDP's iteration (1-based sync forwards) minus the step (RankRuntime.ddp_step_comm learns it):
        # past the detailed steps DDP collects its timers at iterations that are multiples of k.
        self.ddp_offset = 1
        # DDP forwards of this step (and of the one before) whose backward all-reduces (outside `no_sync`):
        # more than one is gradient accumulation that synchronizes every micro-batch. DDP reports a
        # forward's timers at the model's next forward, so each of those all-reduces is read there
        # (`ddp_snapshots`: (step, the reducer's timers)), not once at the step's end (`ddp_sync_read`).
        self.ddp_syncs = self.prev_ddp_syncs = 0
        self.ddp_snapshots: list[tuple[int, dict[str, int]]] = []
        # Set once the run is known to train on CUDA: phases and NCCL collectives become device time.
        self.device_events: DeviceEvents | None = None
        # At each step's end, before its collectives are collected: hands on the asynchronous NCCL
        # collectives nobody waited on (`CollectiveCapture.release_unwaited`).
        self.release_comm: Callable[[], None] | None = None
        self._start_event: Any = None
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._late: list[dict[str, Any]] = []  # device-clock collectives of steps already written
        self.device_errors: list[str] = []  # steps whose events could not be read (kept on the host clock)
        self._reset()

    @property
    def warmup_steps(self) -> int:
        return self._warmup

    def extend_warmup(self, until: int) -> int:
        """Steps before `until` are warm-up too; returns how many steps that added."""
        added = max(0, until - self._warmup)
        self._warmup += added
        self._detailed_until = self._warmup + DETAILED_STEPS
        return added

    def use_device_clock(self, peak_memory: Callable[[], int] | None = None) -> None:
        """From the next step on, measure phases and NCCL collectives on the CUDA device."""
        if self.device_events is None:
            self.device_events = DeviceEvents()
            if peak_memory is not None:
                self._peak_memory = peak_memory

    def _reset(self) -> None:
        self.tokens = 0
        # The step's phase events, in order: (phase, host t0, host t1, value, (start event, end event) or
        # None on the host clock); value: the batch size (data, forward), the loss or None (backward).
        # Sums, samples and the record are made from them when the step is finalized. The probes
        # append to it themselves (one list append, no Python call, on the hot path), after calling
        # `mark_activity` while `idle`, as the `on_*` methods do.
        self.phases: list[tuple[str, float, float, Any, Any]] = []

    @property
    def microbatches(self) -> int:
        """Forwards probed in the current step so far."""
        return sum(1 for e in self.phases if e[0] == "forward")

    # -- phase events (training thread; the probes append to `phases` directly) -------
    def mark_activity(self, t: float) -> None:
        """The run's first phase began at `t`: the first step starts there (on CUDA, with an event)."""
        self.idle = False
        if self._t_start is None:
            self._t_start = t
            if self.device_events is not None and self._start_event is None:
                self._start_event = self.device_events.record()

    def restart_clock(self, t: float) -> None:
        """Start the current step at `t` (time spent between steps, e.g. exporting a trace, is not the step's)."""
        self._t_start = t
        if self.device_events is not None:
            # The old start event is the previous step's end event, which that step (maybe still
            # waiting to be written) owns and releases: it must not go back to the pool here.
            self._start_event = self.device_events.record()

    def on_data(self, t0: float, t1: float, batch_size: int) -> None:
        if self.idle:
            self.mark_activity(t0)
        self.phases.append(("data", t0, t1, batch_size, None))

    def on_forward(self, t0: float, t1: float, batch_size: int, events: tuple[Any, Any] | None = None) -> None:
        if self.idle:
            self.mark_activity(t0)
        self.phases.append(("forward", t0, t1, batch_size, events))

    def on_tokens(self, n: int) -> None:
        self.tokens += n

    def on_backward(self, t0: float, t1: float, loss: Any, events: tuple[Any, Any] | None = None) -> None:
        """`loss`: the step's loss (a detached scalar tensor) where `loss_due`, else None."""
        if self.idle:
            self.mark_activity(t0)
        self.phases.append(("backward", t0, t1, loss, events))

    def on_optimizer(self, t0: float, t1: float, events: tuple[Any, Any] | None = None) -> None:
        self.phases.append(("optimizer", t0, t1, None, events))

    def on_eval(self, t0: float, t1: float, batch_size: int, start_event: Any = None) -> None:
        """A forward of an evaluation pass (no gradients, eval mode); one before the first step is no step's."""
        if not self.idle:
            self.phases.append(("eval", t0, t1, batch_size, (start_event, None) if start_event is not None else None))
            self.unusual = True

    def on_training_mode(self, t: float) -> None:
        """The trained module went back to train mode: an evaluation pass of this step ended by then."""
        if self.unusual and self.phases and self.phases[-1][0] != "resume":
            self.phases.append(("resume", t, t, None, None))

    def on_checkpoint(self, t0: float, t1: float) -> None:
        """A checkpoint save on the training thread (host clock); one before the first step is no step's."""
        if not self.idle:
            self.phases.append(("checkpoint", t0, t1, None, None))
            self.unusual = True

    def on_loader(self, t0: float, t1: float, workers: int) -> None:
        """The training thread started a DataLoader iterator's `workers` processes (a new epoch's iterator of a
        loader without persistent workers) or, with `workers` 0, shut an exhausted iterator's down (host clock).

        Its step is slow for a known cause, a finding of its own (`StepRecord.loader_restart_s`): no anomaly.
        """
        if self.idle:
            self.mark_activity(t0)
        self.phases.append(("loader", t0, t1, workers, None))
        self.unusual = True

    def next_comm(self) -> tuple[int, int]:
        """(step, seq) for a collective issued now."""
        seq = self._comm_seq
        self._comm_seq = seq + 1
        return self.step, seq

    def on_collective(self, record: dict[str, Any]) -> None:
        """A collective completed (host clock) or was enqueued with its events (device clock); any thread."""
        self.comm_done.append(record)

    # -- step end --------------------------------------------------------------------
    def end_step(self, t_end: float) -> int:
        """Close the step; write what can be written; return the number of completed steps.

        Only the step's times and events are kept here; its record is made when it is finalized
        (at once for detailed and device-clock steps, else with its batch).
        """
        step, ev = self.step, self.phases
        t_start = self._t_start if self._t_start is not None else t_end
        if self.release_comm is not None and self.device_events is not None:
            self.release_comm()
        traces = self.traces
        detailed = step < self._detailed_until or (traces is not None and traces.recording)
        # comm: its CommRecords; calls: its synchronous host-clock calls, as the capture's tuples
        entry: dict[str, Any] = {"step": step, "t_start": t_start, "t_end": t_end, "ev": ev,
                                 "tokens": self.tokens, "comm": [], "calls": []}
        if traces is not None and (traces.recording or traces.warming):
            entry["trace"] = "recorded" if traces.recording else "warmup"
        if self.step_comm is not None:
            k = self.ddp_timers_every
            entry["read_timers"] = detailed or k == 1 or (step + self.ddp_offset) % k == 0
            if self.ddp_syncs > 1:
                entry["ddp_syncs"] = self.ddp_syncs
        # Detailed steps and device-clock ones are finalized at once; the others in batches, whose
        # one peak-memory read fills every record of the batch (`_write_ready`).
        events = self.device_events
        batched = events is None and not detailed
        if not batched:
            entry["peak"] = self._peak_memory()
        if events is not None:
            end_event = events.record()
            if self._start_event is not None:
                entry["events"] = (self._start_event, end_event)
            self._start_event = end_event  # the next step starts where this one ends
        queue = self._queue
        queue.append(entry)
        if len(queue) > 1 and self.step_comm is not None:
            self._read_ddp_timers(queue[-2], overwritten="ddp_syncs" in entry)
        if not batched or len(queue) > FINALIZE_EVERY or t_end - queue[0]["t_end"] >= FINALIZE_AFTER_S:
            self._collect_comm()
            self._write_ready()
        self.step = step = step + 1
        self.loss_due = step % self._loss_every == 0
        self.last_unusual, self.unusual = self.unusual, False
        self.prev_ddp_syncs, self.ddp_syncs = self.ddp_syncs, 0
        self._t_start = t_end
        self.tokens = 0
        self.phases = []
        return step

    def detailed(self, step: int) -> bool:
        """Whether `step` (the current one, or the next after a step boundary) has every DDP timer read."""
        return step < self._detailed_until or (self.traces is not None and self.traces.recording)

    def ddp_sync_read(self, step: int) -> bool:
        """Whether DDP collects its timers at every iteration in `step` (a detailed step, or `ddp_timers_every`
        1), so that the timers it just reported, of a step with more than one all-reduce, are worth reading
        (`RankRuntime._ddp_forward` asks); elsewhere such a step's communication is not timed."""
        return self.ddp_timers_every == 1 or self.detailed(step)

    def _read_ddp_timers(self, entry: dict[str, Any], *, overwritten: bool = False) -> None:
        """The DDP timers of `entry` (the step before the newest), read now: DDP's next report replaces them.

        A step whose DDP all-reduced after several micro-batches takes the timers read at the forwards
        that reported them (`ddp_snapshots`), one record per all-reduce. `overwritten`: the newest step
        did so, and its later forwards replaced this step's report (a step before the counting began).
        """
        if entry.get("read_timers") and "ddp" not in entry and self.step_comm is not None:
            step = entry["step"]
            syncs = entry.get("ddp_syncs")
            if syncs:
                snaps = [d for s, d in self.ddp_snapshots if s == step]
                self.ddp_snapshots = [(s, d) for s, d in self.ddp_snapshots if s > step]
                got = self.step_comm(step, self._comm_seq, read=True, snapshots=snaps, syncs=syncs)
            else:
                got = self.step_comm(step, self._comm_seq, read=not overwritten)
            entry["ddp"] = got
            self._comm_seq += len(got[0])

    def _collect_comm(self) -> None:
        """Hand the collectives that arrived to their steps' entries (late ones are written alone)."""
        done = self.comm_done
        if not done:
            return
        by_step = {e["step"]: e for e in self._queue}
        popleft = done.popleft
        step, calls = None, None  # the last host call's step and its entry's calls (a step's come together)
        while done:
            c = popleft()
            if type(c) is tuple:  # a synchronous host-clock call: it stays a tuple in its step
                if c[1] != step:
                    step = c[1]
                    entry = by_step.get(step)
                    calls = None if entry is None else entry["calls"]
                if calls is not None:
                    calls.append(c)
                elif self._writer is not None:  # after its step was written: its line alone
                    self._writer.finish_later(self._queue_late, c)
                continue
            entry = by_step.get(c["step"])
            if entry is not None:
                entry["comm"].append(c)
            else:
                self._write_late_comm(c)

    def _write_late_comm(self, c: dict[str, Any]) -> None:
        if "_start" in c and not self._comm_events_done(c):
            self._late.append(c)
            return
        self._finish_comm(c, None)
        if self._writer is not None:
            self._writer.finish_later(self._queue_late, c)

    def _queue_late(self, c: dict[str, Any] | tuple) -> None:
        """A collective whose step was written already: its line alone, behind its step's (writer's thread)."""
        if type(c) is tuple:
            self._writer.write_calls([c], self.call_sites)
        else:
            self._writer.write("comm", c)

    def _ready(self, entry: dict[str, Any], *, newest: bool) -> bool:
        if "read_timers" in entry and newest:
            return False  # DDP reports a step's timers at the next forward
        events = entry.get("events")
        if events is not None and not events[1].query():
            return False
        return all(self._comm_events_done(c) for c in entry["comm"] if "_start" in c)

    @staticmethod
    def _comm_events_done(c: dict[str, Any]) -> bool:
        end, wait, issued = c.get("_end"), c.get("_wait"), c.get("_issued")
        return (end is not None and end.query() and (wait is None or wait.query())
                and (issued is None or issued.query()))

    def _write_ready(self, *, wait: bool = False) -> None:
        peak: list[int] = []  # read once per batch, on its first record without one
        writer = self._writer
        while self._queue:
            entry = self._queue[0]
            if wait:
                _wait_for(entry)
            elif not self._ready(entry, newest=len(self._queue) == 1):
                break
            self._queue.popleft()
            if "peak" not in entry:  # a batched host-clock step
                if not peak:
                    peak.append(self._peak_memory())
                entry["peak"] = peak[0]
            if writer is None:
                self._finalize(entry)
            elif entry.get("events") is not None or any("_start" in c for c in entry["comm"]):
                self._finalize(entry)  # its CUDA events are read on this thread
                writer.finish_later(self._queue_records, entry)
            else:
                # Nothing of it is left to read on this thread (its DDP timers were read): its record is
                # made on the writer's thread. Every step goes through that one queue, so lines keep their order.
                writer.finish_later(self._finish, entry)

    def _finish(self, entry: dict[str, Any]) -> None:
        """Make a closed host-clock step's records and queue them (on the writer's thread)."""
        self._finalize(entry)
        self._queue_records(entry)

    def _queue_records(self, entry: dict[str, Any]) -> None:
        writer = self._writer
        for c in entry["comm"]:
            writer.write("comm", c)
        if entry["calls"]:
            writer.write_calls(entry["calls"], self.call_sites)
        writer.write("steps", entry["record"])

    def _record_of(self, entry: dict[str, Any]) -> dict[str, Any]:
        """The StepRecord of a closed step, from its times and phase events (host clock)."""
        sums = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0, "checkpoint": 0.0, "loader": 0.0}
        samples = loader_samples = forwards = backwards = started = 0
        loss = None
        marks = []
        # A batch is the next forward's: an evaluation forward's batches are the pass's, not data wait. So is a
        # DataLoader iterator's start (workers > 0) before them: the evaluation's loader, or the training's.
        # (t0, t1, samples, workers started or None for a batch)
        fetched: list[tuple[float, float, int, int | None]] = []
        after_eval = False  # the last phase was an evaluation forward: an iterator shut down now is the pass's
        passes: list[tuple[float, float, int, Any]] = []  # (t0, t1, samples or -1 for a fetch, start event)
        trained: list[tuple[float, float]] = []  # every other span: what ran between an evaluation's forwards
        resumed: list[float] = []  # the trained module back in train mode (`on_training_mode`)
        for phase, t0, t1, value, events in entry["ev"]:
            if phase == "data":
                fetched.append((t0, t1, value, None))
                continue
            if phase == "loader":
                if value:  # a start: like a batch, the next forward's (the evaluation's loader, or the training's)
                    fetched.append((t0, t1, 0, value))
                elif after_eval:  # the evaluation loader's workers, shut down after its last batch
                    passes.append((t0, t1, -1, None))
                else:  # the training loader's, at the end of its epoch (before an evaluation or the next epoch)
                    sums["loader"] += t1 - t0
                    trained.append((t0, t1))
                continue
            if phase == "resume":
                resumed.append(t0)
                continue
            after_eval = phase == "eval"
            if phase == "eval":
                passes += [(d0, d1, -1, None) for d0, d1, _, _ in fetched]
                passes.append((t0, t1, value, events[0] if events is not None else None))
                fetched = []
                continue
            if phase == "forward":
                n, workers = self._fetched_for_training(fetched, sums, trained)
                loader_samples += n
                started += workers
                fetched = []
                samples += value
                forwards += 1
            sums[phase] += t1 - t0
            trained.append((t0, t1))
            if phase == "checkpoint":  # host I/O between the phases, not one of them
                continue
            if phase == "backward":
                backwards += 1
                if value is not None:
                    loss = value
            marks.append((phase, t0, t1, *(events or (None, None))))
        # Fetched for a forward of the next step, or before the forward was probed.
        n, workers = self._fetched_for_training(fetched, sums, trained)
        loader_samples += n
        started += workers
        entry["marks"], entry["loss"] = marks, loss
        step, t_start, t_end = entry["step"], entry["t_start"], entry["t_end"]
        entry["record"] = record = {
            "rank": self.rank,
            "step": step,
            "t_start": t_start,
            "t_end": t_end,
            "step_s": t_end - t_start,
            "data_s": sums["data"],
            "forward_s": sums["forward"],
            "backward_s": sums["backward"],
            "optimizer_s": sums["optimizer"],
            "comm_s": 0.0,
            "exposed_comm_s": 0.0,
            "samples": samples or loader_samples,
            "tokens": entry["tokens"] or None,
            "num_microbatches": forwards or backwards,  # backwards, before the forward is probed
            "loss": None,
            "peak_mem_bytes": entry["peak"],
            "warmup": step < self._warmup,
            "clock": "host",
        }
        if sums["checkpoint"] > 0:
            record["checkpoint_s"] = sums["checkpoint"]
        if sums["loader"] > 0:
            record["loader_restart_s"] = sums["loader"]
        if started:
            record["loader_starts"] = started
        if entry.get("ddp_syncs"):
            record["ddp_syncs"] = entry["ddp_syncs"]
        if passes:
            record.update(_evaluation(passes, trained))
            entry["eval_events"] = [e[3] for e in passes if e[3] is not None]
            # The pass lasts until training resumes (a training phase, or the module back in train mode):
            # its collectives (a metric's all-reduce, the gathers after the loop) are the pass's, not the
            # step's communication (`_evaluation_comm`).
            hi = max(p[1] for p in passes)
            resume = min((t0 for t0, _ in trained if t0 >= hi), default=t_end)
            resume = min([resume, *(t for t in resumed if t >= hi)])
            entry["eval_window"] = (passes, trained, resume)
        if "trace" in entry:
            record["trace"] = entry["trace"]
        return record

    @staticmethod
    def _fetched_for_training(fetched: list[tuple[float, float, int, int | None]], sums: dict[str, float],
                              trained: list[tuple[float, float]]) -> tuple[int, int]:
        """Add training batches' fetches to the data wait, its iterators' starts and shut-downs to the loader's
        time; returns (their samples, the worker processes started)."""
        workers = 0
        for d0, d1, _, started in fetched:
            if started is None:
                sums["data"] += d1 - d0
            else:
                sums["loader"] += d1 - d0
                workers += started
            trained.append((d0, d1))
        return sum(n for _, _, n, _ in fetched), workers

    def _finalize(self, entry: dict[str, Any]) -> None:
        record, comm = self._record_of(entry), entry["comm"]
        if "read_timers" in entry and self.step_comm is not None:
            got = entry.get("ddp")
            if got is None:  # not read: a step `ddp_timers_every` skips, or the run's last (its timers never came)
                got = self.step_comm(record["step"], self._comm_seq, read=False)
            untimed, untimed_exposed, timed = got
            comm.extend(untimed)
            entry["ddp_exposed"] = untimed_exposed
            if not timed:  # its comm_s and exposed comm are unknown, not 0 (StepRecord.comm_timed)
                record["comm_timed"] = False
        loss = entry["loss"]
        if loss is not None:
            try:
                record["loss"] = float(loss)
            except Exception:  # a non-scalar or freed tensor: no loss for this step
                record["loss"] = None
        events = entry.get("events")
        if events is not None:
            try:
                self._to_device_clock(entry, *events)
            except RuntimeError as exc:  # an event that cannot be read (another stream, a CUDA error): host clock
                self.device_errors.append(f"step {record['step']}: {exc}")
                events = entry["events"] = None
                record["clock"] = "host"
                for name in ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s"):
                    if "host_" + name in record:
                        record[name] = record.pop("host_" + name)
                for c in comm:
                    for key in ("_start", "_issued", "_end", "_wait", "_rel_start", "_rel_end", "_rel_wait"):
                        c.pop(key, None)
        else:
            for c in comm:
                if "_start" in c:  # NCCL collectives of a step kept on the host clock
                    self._finish_comm(c, None)
        if events is not None:
            spans = [(p, record["t_start"] + s0, record["t_start"] + s1) for p, s0, s1 in entry["device_spans"]]
        else:
            spans = [(p, t0, t1) for p, t0, t1, _, _ in entry["marks"]]
        spans = _own_spans(spans)
        # A closure-style optimizer (Lightning's `optimizer.step(closure)`) runs forward and backward
        # inside the optimizer step: the optimizer phase is what is left of it.
        record["optimizer_s"] = sum(t1 - t0 for p, t0, t1 in spans if p == "optimizer")
        calls = entry["calls"]
        if "eval_window" in entry:
            comm, calls = self._evaluation_comm(entry, record)
        comm_s, exposed, in_phase = _comm_times(comm, calls, record, spans, entry.get("ddp_exposed", 0.0))
        record["comm_s"], record["exposed_comm_s"] = comm_s, exposed
        for phase in _PHASES:
            record[phase + "_exposed_comm_s"] = in_phase[phase]

    def _evaluation_comm(self, entry: dict[str, Any], record: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple]]:
        """Split off the collectives an evaluation pass issued: (the step's records, the step's host calls).

        A collective is the pass's when the host issued it between the pass's first fetch and the
        moment training resumed, outside any training phase. It keeps its CommRecord, with phase
        "evaluation" (a host call becomes a dict record for that), and is left out of the step's
        communication; the pass's host time (`eval_s`) runs to the last one's end on the host.
        """
        passes, trained, resume = entry.pop("eval_window")
        lo = min(p[0] for p in passes)
        inside = sorted((t0, t1) for t0, t1 in trained if t1 > lo and t0 < resume)

        def the_pass(t: float) -> bool:
            return lo <= t < resume and not any(t0 <= t < t1 for t0, t1 in inside)

        step_comm, step_calls, spans = [], [], []
        device = record["clock"] == "device"
        for c in entry["comm"]:
            if c.get("t_issue") is None or not the_pass(c["t_issue"]):
                step_comm.append(c)
                continue
            c["phase"] = "evaluation"
            if "_rel_start" in c:  # on the step's device timeline, as `_comm_times` writes the step's own
                c["t_start"] = record["t_start"] + c.pop("_rel_start")
                c["t_complete"] = record["t_start"] + c.pop("_rel_end")
                c.pop("_rel_wait", None)
            c.pop("_wait_end", None)
            host_end = c.get("t_complete") if c.get("_s", {}).get("clock") == "host" and not device else None
            spans.append((c["t_issue"], host_end or c["t_issue"] + (c.get("blocked_s") or 0.0), -1, None))
        for call in entry["calls"]:
            t_issue = call[4] + _OFFSET
            if not the_pass(t_issue):
                step_calls.append(call)
                continue
            shared = self.call_sites[call[0]][0]
            values = dict(zip(HOST_CALL_FIELDS, host_call_values(call)))
            entry["comm"].append({"_s": shared, **values, "phase": "evaluation"})
            spans.append((t_issue, call[5] + _OFFSET, -1, None))
        if spans:
            entry["calls"] = step_calls
            record.update(_evaluation(passes + spans, trained))
        return step_comm, step_calls

    def _to_device_clock(self, entry: dict[str, Any], start: Any, end: Any) -> None:
        """Phases and collectives of a completed step in device time, relative to its start event."""
        ev = self.device_events
        record = entry["record"]
        for name in ("step_s", "data_s", "forward_s", "backward_s", "optimizer_s"):
            record["host_" + name] = record[name]
        record["clock"] = "device"
        record["step_s"] = max(0.0, ev.seconds(start, end))
        sums = dict.fromkeys(_PHASES, 0.0)
        first_forward = None
        released = [start]
        spans = []
        for phase, _, _, e0, e1 in entry["marks"]:
            if e0 is None or e1 is None:
                continue
            s0, s1 = ev.seconds(start, e0), ev.seconds(start, e1)
            spans.append((phase, s0, s1))
            sums[phase] += max(0.0, s1 - s0)
            if phase == "forward" and first_forward is None:
                first_forward = s0
            released += (e0, e1)
        entry["device_spans"] = spans
        for phase in _PHASES:
            record[phase + "_s"] = sums[phase]
        # From the device's side, data is what it did (or idled for) before the first forward, an
        # evaluation pass's included (its forwards record their start, not their end: `eval_s` is host time).
        for e0 in entry.get("eval_events", ()):
            s0 = ev.seconds(start, e0)
            first_forward = s0 if first_forward is None else min(first_forward, s0)
            released.append(e0)
        record["data_s"] = max(0.0, first_forward) if first_forward is not None else 0.0
        for c in entry["comm"]:
            self._finish_comm(c, start)
        ev.release(*released)

    def _finish_comm(self, c: dict[str, Any], step_start: Any) -> None:
        """Device-clock collectives: duration and times on the step's device timeline (anchored at its host start)."""
        start, end, wait = c.pop("_start", None), c.pop("_end", None), c.pop("_wait", None)
        issued = c.pop("_issued", None)
        c.pop("_on_wait", None)
        c.pop("_wait_end", None)
        if start is None or end is None:
            for event in (wait, issued):
                if event is not None:
                    self.device_events.release(event)
            return
        ev = self.device_events
        # From where the collective was enqueued (`_issued`), not where the stream stood at its issue: on a
        # starved GPU the gap between them is the host's issuing, an idle device, not communication.
        begin = issued if issued is not None else start
        c["duration_s"] = max(0.0, ev.seconds(begin, end))
        if step_start is not None:
            c["_rel_start"] = ev.seconds(step_start, begin)
            c["_rel_end"] = ev.seconds(step_start, end)
            if wait is not None:
                c["_rel_wait"] = ev.seconds(step_start, wait)
        ev.release(start, end, wait, issued)

    def flush_pending(self) -> None:
        """Write every step still held (waits for device events; DDP's last step keeps hook-timed comm only)."""
        if self.release_comm is not None and self.device_events is not None:
            self.release_comm()
        self._collect_comm()
        self._write_ready(wait=True)

    def flush_comm(self) -> None:
        """Write what is still held at the end of the run (waits for device events)."""
        self.flush_pending()
        for c in list(self._late):
            _wait_comm(c)
            self._finish_comm(c, None)
            if self._writer is not None:
                self._writer.finish_later(self._queue_late, c)
        self._late.clear()


def _wait_for(entry: dict[str, Any]) -> None:
    events = entry.get("events")
    if events is not None:
        events[1].synchronize()
    for c in entry["comm"]:
        _wait_comm(c)


def _wait_comm(c: dict[str, Any]) -> None:
    for key in ("_end", "_wait", "_issued"):
        event = c.get(key)
        if event is not None:
            event.synchronize()


def _evaluation(passes: list[tuple[float, float, int, Any]], trained: list[tuple[float, float]]) -> dict[str, Any]:
    """A step's evaluation (host clock): from the first batch fetched for it to the end of its last forward,
    less the training spans (`trained`) that ran in between; its forwards and their samples."""
    lo, hi = min(p[0] for p in passes), max(p[1] for p in passes)
    # A union: an optimizer step holds the forward and backward of its closure (Lightning's).
    training = _union([(max(t0, lo), min(t1, hi)) for t0, t1 in trained if t1 > lo and t0 < hi])
    samples = [p[2] for p in passes if p[2] >= 0]
    return {"eval_s": max(0.0, hi - lo - training), "eval_batches": len(samples), "eval_samples": sum(samples)}


def _own_spans(spans: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Phase spans with the optimizer's cut around the forwards and backwards that ran inside it."""
    inner = sorted((t0, t1) for p, t0, t1 in spans if p != "optimizer")
    out = [s for s in spans if s[0] != "optimizer"]
    for p, t0, t1 in spans:
        if p != "optimizer":
            continue
        cur = t0
        for a, b in inner:
            if b <= cur or a >= t1:
                continue
            if a > cur:
                out.append((p, cur, a))
            cur = max(cur, b)
        if cur < t1:
            out.append((p, cur, t1))
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    if not spans:
        return 0.0
    spans = sorted(spans)
    starts, ends = list(map(_first, spans)), list(map(_second, spans))
    if _disjoint(starts, ends):  # a step's synchronous calls, one after another: the sum of their lengths
        return sum(map(sub, ends, starts))
    total, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    return total + cur_e - cur_s


def _comm_times(comm: list[dict[str, Any]], calls: list[tuple], record: dict[str, Any],
                phases: list[tuple[str, float, float]], ddp_exposed: float) -> tuple[float, float, dict[str, float]]:
    """(union of the step's collective intervals, exposed communication, exposed comm inside each phase).

    Exposed communication is what the step waited for:
    - DDP buckets (the records of a comm hook) are launched in index order once their
      gradients are ready, so the last issue is when backward compute ended; whatever runs
      after it is exposed (the reducer's timers say the same for the builtin all-reduce). It
      lies inside the backward. So does each earlier bucket's issuing call (`issue_s`): the
      training thread was in it, not computing.
    - Any other collective (FSDP, pipeline, a script's own call, DDP's broadcast of its
      buffers before a forward): on the host clock, the time the training thread blocked in
      it (a synchronous call, or `Work.wait()`); on the device clock, a synchronous
      collective on the default stream holds that stream for its whole duration, one issued
      on a side stream (FSDP2's) overlaps, and one whose wait was timed on the stream (a
      functional collective's `wait_tensor`, an asynchronous NCCL call's `Work.wait()`:
      `_rel_wait`) holds it from where it reached the wait to the collective's end.
    `calls` are synchronous host-clock calls as the capture's tuples (`host_call_values`): each
    blocks from its issue to its return, so on the host clock that whole span is exposed.
    Exposed intervals are split over the phases they fall in (`phases`: (name, t0, t1) on
    the record's timeline), so that phase compute = phase time - its exposed comm.
    Rewrites each device-clock record's t_start/t_complete onto the step's device timeline
    (anchored at the step's host start).
    """
    device = record["clock"] == "device"
    spans: list[tuple[float, float]] = []
    ddp: list[tuple[float, float]] = []
    ddp_issues: list[tuple[float, float]] = []
    blocked: list[tuple[float, float]] = []
    for c in comm:
        if c.get("duration_s") is None:
            continue
        shared = c["_s"]  # the fields every call of its kind has (`SharedFields`)
        waited = wait_end = None
        if device and "_rel_start" in c:
            s = record["t_start"] + c.pop("_rel_start")
            e = record["t_start"] + c.pop("_rel_end")
            c["t_start"], c["t_complete"] = s, e
            if "_rel_wait" in c:  # where the compute stream reached the collective's wait (wait_tensor, Work.wait)
                waited = record["t_start"] + c.pop("_rel_wait")
        else:
            s = c["t_issue"]
            e = c.get("t_complete") or s + c["duration_s"]
            wait_end = c.pop("_wait_end", None)  # where its Work.wait() returned
        hook = shared.get("hook")
        if hook is None and shared["async_op"]:
            # Where it was issued: in the backward (an engine overlapping its gradients' all-reduces) or
            # after it (issued, then waited for at once). The first phase that holds its start.
            for phase, p0, p1 in phases:
                if p0 <= s <= p1:
                    c["phase"] = phase
                    break
        if hook is not None and not device and hook != "builtin":
            e = _bounded_by_backward(c, s, e, phases)
        spans.append((s, e))
        if hook == "builtin":
            continue  # the reducer's one record per step: its exposure is `ddp_exposed` (comm end - compute end)
        if hook is not None:  # a DDP bucket's, from a comm hook
            ddp.append((s, e))
            if c.get("issue_s"):  # the training thread's time in the issuing call
                ddp_issues.append((s, s + c["issue_s"]))
        elif device:
            if shared["clock"] == "device" and shared.get("stream") == "default" and not shared["async_op"]:
                blocked.append((s, e))
            elif waited is not None and e > waited:
                # Waited for on the stream: it idled from the wait to the collective's end.
                blocked.append((waited, e))
        elif c["blocked_s"]:
            # A synchronous call blocks from its issue; an asynchronous one for its issuing call, then in
            # a wait() that ends where it returned: on a busy host that can be long after the completion
            # (the thread waits to take the GIL or a core back), and a wait placed to end at the
            # completion would reach back into the forward or the step before.
            b = c["blocked_s"]
            if not shared["async_op"]:
                blocked.append((s, s + b))
            else:
                issue = c.get("issue_s") or 0.0
                if issue > 0:
                    blocked.append((s, s + issue))
                if b - issue > 0:
                    w = wait_end or e
                    blocked.append((w - (b - issue), w))
    if blocked and not device:
        spans += blocked  # the training thread blocked on a collective: communication, as the trace reads it
    if calls:  # many per step (tens of hand-written all-reduces): C's map and zip, no Python per call
        n = len(calls)
        intervals = list(zip(map(add, map(_ISSUE, calls), repeat(_OFFSET, n)),
                             map(add, map(_RETURN, calls), repeat(_OFFSET, n))))
        spans += intervals
        # DDP's own synchronous calls (its buffers' broadcast before a forward, parameter checks) are
        # no bucket's: like any synchronous call, they block from their issue.
        if not device:
            blocked += intervals
    in_phase = dict.fromkeys(_PHASES, 0.0)
    ddp_s = ddp_exposed
    if ddp:
        last_issue = max(s for s, _ in ddp)
        ddp_s = max(ddp_s, max(e for _, e in ddp) - last_issue)
        # The earlier buckets' issuing calls held the thread before the last issue (the last one's lies in
        # the tail just counted).
        blocked += [(s, min(e, last_issue)) for s, e in ddp_issues if s < last_issue]
    if record["backward_s"]:
        ddp_s = min(ddp_s, record["backward_s"])
    in_phase["backward"] += ddp_s
    blocked.sort()
    starts, ends = list(map(_first, blocked)), list(map(_second, blocked))
    exposed = ddp_s + sum(map(sub, ends, starts))
    _split_over_phases(blocked, starts, ends, phases, in_phase)
    total = _union(spans)
    if record["step_s"] > 0:
        exposed = min(exposed, record["step_s"])
    return total, max(0.0, exposed), in_phase


def _bounded_by_backward(c: dict[str, Any], s: float, e: float, phases: list[tuple[str, float, float]]) -> float:
    """A DDP bucket's host-clock completion, at the latest when the backward that issued it returned.

    Its record completes in its future's callback, which the gloo worker runs after waking the
    training thread; on a busy host the woken thread often takes the core first and the callback
    runs milliseconds later, past the backward. But the reducer's finalize waited for every bucket
    and copied its result before `backward()` returned: the bucket had completed by then. The
    record is corrected in place (as the trace analysis bounds gloo's spans by the reducer's copies).
    """
    for phase, p0, p1 in phases:
        if phase == "backward" and p0 <= s <= p1:
            if e > p1:
                e = c["t_complete"] = p1
                c["duration_s"] = p1 - s
            break
    return e


def _split_over_phases(blocked: list[tuple[float, float]], starts: list[float], ends: list[float],
                       phases: list[tuple[str, float, float]], in_phase: dict[str, float]) -> None:
    """Add to `in_phase` the part of each blocked interval that lies in each phase (overlapping phases each count it).

    `blocked` is sorted; `starts` and `ends` are its intervals' ends. The common case, one thread's
    synchronous calls one after another (disjoint), takes two binary searches and a prefix sum per phase;
    anything else compares every pair.
    """
    if not blocked:
        return
    if not _disjoint(starts, ends):  # an interval inside another (an async wait around synchronous calls)
        _split_every_pair(blocked, phases, in_phase)
        return
    held = [0.0, *accumulate(map(sub, ends, starts))]  # held[k]: the length of the first k intervals
    for phase, p0, p1 in phases:
        if p1 <= p0:
            continue
        # the intervals that end after the phase starts, up to the first that starts when it ends or after
        k0, k1 = bisect.bisect_right(ends, p0), bisect.bisect_left(starts, p1)
        if k0 >= k1:
            continue
        inside = held[k1] - held[k0]
        if starts[k0] < p0:  # the first began before the phase
            inside -= p0 - starts[k0]
        if ends[k1 - 1] > p1:  # the last ends after it
            inside -= ends[k1 - 1] - p1
        in_phase[phase] += inside


def _disjoint(starts: list[float], ends: list[float]) -> bool:
    """Whether sorted intervals (their `starts` and `ends`) are disjoint, each after the one before (in C)."""
    return all(map(ge, starts[1:], ends)) and all(map(ge, ends, starts))


def _split_every_pair(blocked: list[tuple[float, float]], phases: list[tuple[str, float, float]],
                      in_phase: dict[str, float]) -> None:
    """`_split_over_phases` for any intervals (nested, overlapping): every interval against every phase."""
    for s, e in blocked:
        for phase, p0, p1 in phases:
            if p1 > s and p0 < e and p1 > p0:
                in_phase[phase] += (p1 if p1 < e else e) - (p0 if p0 > s else s)


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux; one syscall, no /proc parsing on the hot path.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
