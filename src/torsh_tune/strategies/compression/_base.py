"""Shared state and future plumbing of the gradient-compression DDP comm hooks.

Every hook is `hook(state, bucket) -> Future[Tensor]` and never blocks: collectives are
issued asynchronously and their results are consumed in `Future.then` callbacks. On gloo
those callbacks run on the process group's worker threads, so a callback must never wait
on another collective (torch's own `powerSGD_hook` does, and deadlocks on gloo as soon as
there are two buckets).

Hooks with two dependent collectives (int8: scale, then data; PowerSGD: P, then Q) issue
the second one from a callback. Collectives on one process group must be issued in the
same order on every rank, but callbacks of different buckets complete in any order. So the
second collectives go to a dedicated process group (`second_group`) and an
`_OrderedIssuer` issues them in the order the hooks were called (the same on every rank),
deferring an early one until its predecessors are issued. Deferring is not waiting: the
callback returns at once and whoever completes the missing predecessor issues the rest.

CUDA streams. `Future.then` runs every callback on a stream of its own from the pool, after
the stream waited for the future's collective, and records the future's value on it. Two
things are left to the hooks. A deferred second collective is issued from another bucket's
callback, whose stream knows nothing of the kernels that prepared its input: the issuing
stream first waits for an event recorded where `prepare` ran (`chain_second`), so the
collective, `finish` and the gradient DDP reads all come after them. And a tensor allocated
on one stream (a callback's, or the hook's) and read on another without passing through the
future's value must be marked with `record_stream` on the reader (`used_on_current_stream`),
or the caching allocator may hand its memory out again while the reader still reads it.
Neither blocks the host.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["CompressionState", "all_gather_flat", "reduce_scatter_flat", "used_on_current_stream"]


def used_on_current_stream(*tensors: torch.Tensor) -> None:
    """Tell the CUDA caching allocator that the current stream uses `tensors` too (no-op on CPU).

    For tensors allocated under another stream (an earlier callback's or the hook's) and
    read here: their memory is not reused until the work queued here so far has run.
    """
    for t in tensors:
        if t.is_cuda:
            t.record_stream(torch.cuda.current_stream(t.device))


def _stream_point(device: torch.device) -> Any:
    """An event at the current end of this thread's current stream on `device` (None on CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


# torch >= 2.12 renamed the flat-tensor collectives (the old names warn on every call). Looked up
# at call time, so that the profiler's c10d capture (installed after these imports) sees the calls.
def all_gather_flat(*args: Any, **kwargs: Any) -> Any:
    """`all_gather_single` where torch has it, else `all_gather_into_tensor` (same arguments)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_flat(*args: Any, **kwargs: Any) -> Any:
    """`reduce_scatter_single` where torch has it, else `reduce_scatter_tensor` (same arguments)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class _OrderedIssuer:
    """Run submitted actions strictly in ticket order, without ever blocking a thread."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._next_ticket = 0
        self._next_to_run = 0
        self._pending: dict[int, Callable[[], None] | None] = {}

    def reserve(self) -> int:
        """A ticket; called on the thread that runs the hooks (DDP's, in bucket order)."""
        with self._lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            return ticket

    def submit(self, ticket: int, action: Callable[[], None] | None) -> None:
        """Run `action` once every earlier ticket has run; None only releases the ticket."""
        with self._lock:
            self._pending[ticket] = action
            # Issued under the lock so that two threads cannot interleave their issues.
            while self._next_to_run in self._pending:
                ready = self._pending.pop(self._next_to_run)
                self._next_to_run += 1
                if ready is not None:
                    ready()


class CompressionState:
    """Per-DDP-model state shared by the compression hooks.

    Args:
        process_group: the DDP model's process group (None: the default group).
        error_feedback: keep each bucket's compression residual and add it to the next
            gradient of that bucket (keeps lossy compression unbiased over steps).
        two_phase: the hook issues a second, dependent collective; creates `second_group`.

    Attributes:
        stats: running totals (fixed keys, updated in place): calls, bytes, wire_bytes,
            compress_s, decompress_s, and num_buckets (buckets seen in one iteration).
    """

    method = "none"

    def __init__(self, process_group: Any = None, *, error_feedback: bool = True, two_phase: bool = False) -> None:
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.error_feedback = error_feedback
        self.errors: dict[int, torch.Tensor] = {}
        self.iter = 0
        self.stats: dict[str, Any] = {"method": self.method, "calls": 0, "bytes": 0, "wire_bytes": 0,
                                      "compress_s": 0.0, "decompress_s": 0.0, "num_buckets": 0}
        self._stats_lock = threading.Lock()
        self.second_group: Any = None
        self._issuer = _OrderedIssuer()
        if two_phase:
            ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
            # Only the members create it (the DDP model may live on a subgroup).
            self.second_group = dist.new_group(
                ranks, backend=dist.get_backend(process_group), use_local_synchronization=True,
                group_desc=f"torsh_tune_{self.method}_second",
            )

    # -- bookkeeping --------------------------------------------------------------------
    def start_call(self, bucket: dist.GradBucket, wire_bytes: int) -> None:
        """Record one hook call (main thread); advance the iteration after the last bucket."""
        buf = bucket.buffer()
        with self._stats_lock:
            self.stats["calls"] += 1
            self.stats["bytes"] += buf.numel() * buf.element_size()
            self.stats["wire_bytes"] += int(wire_bytes)
            self.stats["num_buckets"] = max(self.stats["num_buckets"], bucket.index() + 1)
        if bucket.is_last():
            self.iter += 1

    def add_time(self, key: str, t0: float) -> None:
        """Add the time since `t0` (perf_counter) to stats[key] ('compress_s'/'decompress_s')."""
        dt = time.perf_counter() - t0
        with self._stats_lock:
            self.stats[key] += dt

    def error_of(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The bucket's residual (zeros at first); keyed by bucket index."""
        buf = bucket.buffer()
        err = self.errors.get(bucket.index())
        if err is None or err.shape != buf.shape:
            err = self.errors[bucket.index()] = torch.zeros_like(buf)
        return err

    # -- futures ------------------------------------------------------------------------
    def allreduce_future(self, tensor: torch.Tensor, *, group: Any = None, op: Any = dist.ReduceOp.SUM) -> torch.futures.Future:
        """Start an async all-reduce and return its future (value: [tensor])."""
        pg = self.process_group if group is None else group
        return dist.all_reduce(tensor, op=op, group=pg, async_op=True).get_future()

    def chain_second(self, first: torch.futures.Future, buf: torch.Tensor,
                     prepare: Callable[[Any], Callable[[], torch.futures.Future]],
                     finish: Callable[[Any], torch.Tensor]) -> torch.futures.Future:
        """first → prepare(value) → issue() on `second_group` in hook order → finish(value).

        `prepare` runs in `first`'s callback and returns `issue`, which starts the second
        collective (on `second_group`) and returns its future; `finish` turns that future's
        value into the bucket's averaged gradient. Errors anywhere land in the returned future.
        On CUDA, `issue` may run on another bucket's callback thread and stream: that stream
        waits (on the device, not the host) for the kernels `prepare` queued before issuing.
        """
        result = torch.futures.Future(devices=[buf.device]) if buf.is_cuda else torch.futures.Future()
        ticket = self._issuer.reserve()

        def after_second(fut: torch.futures.Future) -> None:
            try:
                result.set_result(finish(fut.value()))
            except BaseException as exc:  # noqa: BLE001 - handed to DDP through the future
                result.set_exception(exc)

        def after_first(fut: torch.futures.Future) -> None:
            try:
                issue = prepare(fut.value())
                prepared = _stream_point(buf.device)
            except BaseException as exc:  # noqa: BLE001
                self._issuer.submit(ticket, None)
                result.set_exception(exc)
                return

            def run_issue() -> None:
                try:
                    if prepared is not None:  # a deferred issue runs on another callback's stream
                        torch.cuda.current_stream(buf.device).wait_event(prepared)
                    issue().then(after_second)
                except BaseException as exc:  # noqa: BLE001
                    result.set_exception(exc)

            self._issuer.submit(ticket, run_issue)

        first.then(after_first)
        return result
