"""The DDP comm hook wrapper: it gives each bucket's collectives their bucket, hook and gradient bytes.

The wrapper is registered once per DDP model; whatever hook the script (or a strategy)
registers later becomes its `inner` hook. The collectives the inner hook issues are
recorded by the c10d capture (`collectives.py`) like any other, inside a bucket scope
that labels them, so compression and hierarchical hooks show what really went over
which process group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

if TYPE_CHECKING:
    from .collectives import CollectiveCapture

__all__ = ["TimedCommHook", "default_allreduce"]


def default_allreduce(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future:
    """PyTorch's default DDP behaviour (average by all-reduce) as a Python hook."""
    return default_hooks.allreduce_hook(process_group, bucket)


class TimedCommHook:
    """Callable DDP comm hook `(state, bucket) -> Future` that wraps an inner hook."""

    def __init__(self, capture: "CollectiveCapture | None", *, inner: Callable, inner_state: Any, name: str) -> None:
        self.capture = capture
        self.inner = inner
        self.inner_state = inner_state
        self.name = name
        self._num_tensors: dict[tuple[int, int], int] = {}  # (bucket index, its bytes) -> gradients in it
        # Comm hooks are looked up by qualname in DDP's logger; keep a stable one.
        self.__qualname__ = self.__name__ = "torsh_tune_timed_hook"

    def set_inner(self, inner: Callable, inner_state: Any, name: str) -> None:
        self.inner, self.inner_state, self.name = inner, inner_state, name

    # No annotations on purpose: DDP's _check_comm_hook compares them by identity and
    # `from __future__ import annotations` turns them into strings.
    def __call__(self, state, bucket):  # noqa: ANN001
        if self.capture is None:
            return self.inner(self.inner_state, bucket)
        buf = bucket.buffer()
        idx, nbytes = bucket.index(), buf.numel() * buf.element_size()
        ntensors = self._num_tensors.get((idx, nbytes))  # DDP rebuilds its buckets after the first iteration
        if ntensors is None:
            ntensors = self._num_tensors[(idx, nbytes)] = len(bucket.gradients())
        # PyTorch's default all-reduce on a host-clock group: the capture's one-hop path (`averaged_bucket`).
        if (self.inner is default_allreduce or self.inner is default_hooks.allreduce_hook) and \
                self.capture.averages_on_host(self.inner_state):
            return self.capture.averaged_bucket(self.inner_state, buf, idx, self.name, ntensors)
        with self.capture.bucket(idx, self.name, nbytes, ntensors):
            return self.inner(self.inner_state, bucket)
