"""Per-step accounting on the training thread: phases, samples, loss, memory, communication.

The patches in `runtime` call the `on_*` methods; `end_step` turns what accumulated into one
StepRecord line and the step's CommRecord lines. Everything here runs on the hot path, so it
keeps to float arithmetic and list appends (the record is serialised once per step).
"""

from __future__ import annotations

import collections
import resource
from typing import Any, Callable

from .writer import RecordWriter

__all__ = ["StepTracker"]


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
        self._loss_every = loss_every
        self._peak_memory = peak_memory or _peak_rss_bytes
        self._t_start: float | None = None
        self._pending: tuple[dict[str, Any], list[dict[str, Any]]] | None = None
        self._comm_seq = 0
        # Completed collectives arrive from communication threads; deque appends are atomic.
        self.comm_done: collections.deque[tuple] = collections.deque()
        # (step, seq) -> (step-level CommRecords, exposed comm s) of collectives no hook timed.
        self.step_comm: Callable[[int, int], tuple[list[dict[str, Any]], float]] | None = None
        self._reset()

    def _reset(self) -> None:
        self.data_s = 0.0
        self.forward_s = 0.0
        self.backward_s = 0.0
        self.optimizer_s = 0.0
        self.samples = 0
        self.loader_samples = 0
        self.tokens = 0
        self.microbatches = 0
        self._loss: Any = None
        self._bucket_in_step = 0

    # -- phase hooks (training thread) ----------------------------------------------
    def mark_activity(self, t: float) -> None:
        if self._t_start is None:
            self._t_start = t

    def restart_clock(self, t: float) -> None:
        """Start the current step at `t` (time spent between steps, e.g. exporting a trace, is not the step's)."""
        self._t_start = t

    def on_data(self, t0: float, t1: float, batch_size: int) -> None:
        self.mark_activity(t0)
        self.data_s += t1 - t0
        self.loader_samples += batch_size

    def on_forward(self, t0: float, t1: float, batch_size: int) -> None:
        self.mark_activity(t0)
        self.forward_s += t1 - t0
        self.samples += batch_size
        self.microbatches += 1

    def on_tokens(self, n: int) -> None:
        self.tokens += n

    def wants_loss(self) -> bool:
        return self.step % self._loss_every == 0

    def on_backward(self, t0: float, t1: float, loss: Any) -> None:
        self.mark_activity(t0)
        self.backward_s += t1 - t0
        if loss is not None:
            self._loss = loss

    def on_optimizer(self, t0: float, t1: float) -> None:
        self.optimizer_s += t1 - t0

    def next_comm(self) -> tuple[int, int, int]:
        """(step, seq, bucket index within the step) for a collective issued now."""
        seq, bucket = self._comm_seq, self._bucket_in_step
        self._comm_seq += 1
        self._bucket_in_step += 1
        return self.step, seq, bucket

    # -- step end --------------------------------------------------------------------
    def end_step(self, t_end: float) -> int:
        """Write the step's records; return the number of completed steps."""
        t_start = self._t_start if self._t_start is not None else t_end
        comm = self._drain_comm()
        comm_s, exposed_s = _comm_times(comm)
        if self.step_comm is not None and self._pending is not None:
            # DDP's timers of a step are collected at the next forward: what they report now
            # belongs to the previous step, which is why that step's record is still pending.
            prev, prev_comm = self._pending
            untimed, untimed_exposed = self.step_comm(prev["step"], self._comm_seq)
            if untimed:
                self._comm_seq += len(untimed)
                prev["comm_s"] += sum(c["duration_s"] for c in untimed)
                exposed = max(prev["exposed_comm_s"], untimed_exposed)
                prev["exposed_comm_s"] = min(exposed, prev["backward_s"]) if prev["backward_s"] else exposed
                prev_comm.extend(untimed)
        loss = None
        if self._loss is not None:
            try:
                loss = float(self._loss)
            except Exception:  # a non-scalar or freed tensor: no loss for this step
                loss = None
        record = {
            "rank": self.rank,
            "step": self.step,
            "t_start": t_start,
            "t_end": t_end,
            "step_s": t_end - t_start,
            "data_s": self.data_s,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "optimizer_s": self.optimizer_s,
            "comm_s": comm_s,
            "exposed_comm_s": min(exposed_s, self.backward_s) if self.backward_s else exposed_s,
            "samples": self.samples or self.loader_samples,
            "tokens": self.tokens or None,
            "num_microbatches": self.microbatches,
            "loss": loss,
            "peak_mem_bytes": self._peak_memory(),
            "warmup": self.step < self._warmup,
        }
        self.flush_pending(t_end)
        self._pending = (record, comm)
        self.step += 1
        self._t_start = t_end
        self._reset()
        return self.step

    def _drain_comm(self, *, wait: bool = False) -> list[dict[str, Any]]:
        out, later = [], []
        while self.comm_done:
            c = self.comm_done.popleft()
            events = c.get("_events")
            if events is not None:
                start, end = events
                if not wait and not end.query():  # still running on the device: next step
                    later.append(c)
                    continue
                if wait:
                    end.synchronize()
                del c["_events"]
                c["duration_s"] = start.elapsed_time(end) / 1000.0
                c["t_complete"] = c["t_issue"] + c["duration_s"]
            out.append(c)
        self.comm_done.extendleft(reversed(later))
        return out

    def flush_pending(self, t: float | None = None) -> None:
        """Write the step record held back for DDP's lagging timers (all of it at the end of a run:
        the last step's untimed all-reduce is never reported by DDP, its comm fields count hooks only)."""
        if self._pending is None:
            return
        record, comm = self._pending
        self._pending = None
        if self._writer is not None:
            for c in comm:
                self._writer.write("comm", c, t=t)
            self._writer.write("steps", record, t=t)

    def flush_comm(self) -> None:
        """Write what is still held at the end of the run (waits for device events)."""
        self.flush_pending()
        if self._writer is not None:
            for c in self._drain_comm(wait=True):
                self._writer.write("comm", c)


def _comm_times(comm: list[dict[str, Any]]) -> tuple[float, float]:
    """(union of collective intervals, time after the last issue until the last completion).

    DDP launches buckets in index order once their gradients are ready, so the last issue is
    when backward compute ended; whatever communication is still running after it is exposed.
    """
    if not comm:
        return 0.0, 0.0
    spans = sorted((c["t_issue"], c["t_complete"]) for c in comm)
    total, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            total += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    total += cur_e - cur_s
    last_issue = max(c["t_issue"] for c in comm)
    last_complete = max(c["t_complete"] for c in comm)
    return total, max(0.0, last_complete - last_issue)


def _peak_rss_bytes() -> int:
    # ru_maxrss is in KiB on Linux; one syscall, no /proc parsing on the hot path.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
