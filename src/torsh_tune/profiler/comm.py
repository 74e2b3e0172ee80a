"""A DDP comm hook wrapper that times every bucket's collective without blocking.

The wrapper is registered once per DDP model; whatever hook the script (or a strategy)
registers later becomes its `inner` hook. Completion is observed with `Future.then`, whose
callback runs on the backend's worker thread: it only timestamps and appends (never waits).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ._clock import now
from .steps import StepTracker

__all__ = ["TimedCommHook", "default_allreduce"]


def default_allreduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """PyTorch's default DDP behaviour (average by all-reduce) as a Python hook."""
    return default_hooks.allreduce_hook(process_group, bucket)


class TimedCommHook:
    """Callable DDP comm hook `(state, bucket) -> Future` that wraps an inner hook."""

    def __init__(self, tracker: StepTracker, *, inner: Callable, inner_state: Any, name: str, cuda: bool) -> None:
        self.tracker = tracker
        self.inner = inner
        self.inner_state = inner_state
        self.name = name
        self.cuda = cuda
        self.wire_bytes_of: Callable[[Any, int], int] | None = None  # set by compression hooks
        self._num_tensors: dict[int, int] = {}
        # Comm hooks are looked up by qualname in DDP's logger; keep a stable one.
        self.__qualname__ = self.__name__ = "torsh_tune_timed_hook"

    def set_inner(self, inner: Callable, inner_state: Any, name: str) -> None:
        self.inner, self.inner_state, self.name = inner, inner_state, name

    # No annotations on purpose: DDP's _check_comm_hook compares them by identity and
    # `from __future__ import annotations` turns them into strings.
    def __call__(self, state, bucket):  # noqa: ANN001
        tracker = self.tracker
        step, seq, index = tracker.next_comm()
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        idx = bucket.index()
        ntensors = self._num_tensors.get(idx)
        if ntensors is None:
            ntensors = self._num_tensors[idx] = len(bucket.gradients())
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t_issue = now()
        fut = self.inner(self.inner_state, bucket)
        wire = nbytes if self.wire_bytes_of is None else self.wire_bytes_of(self.inner_state, nbytes)
        rank, name, done = tracker.rank, self.name, tracker.comm_done

        def _complete(f: torch.futures.Future) -> Any:
            t_complete = now()
            record = {
                    "rank": rank,
                    "step": step,
                    "seq": seq,
                    "bucket": index,
                    "collective": "all_reduce",
                    "hook": name,
                    "bytes": nbytes,
                    "wire_bytes": wire,
                    "num_tensors": ntensors,
                    "t_issue": t_issue,
                    "t_complete": t_complete,
                    "duration_s": t_complete - t_issue,
                }
            if self.cuda:
                # The callback runs once the work is enqueued, not finished: time it on the
                # device and let the tracker resolve the events when they have completed.
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                record["_events"] = (start, end)
            done.append(record)
            return f.value()

        return fut.then(_complete)
