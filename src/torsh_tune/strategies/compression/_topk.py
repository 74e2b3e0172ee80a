"""Top-K sparsification: exchange the k largest-magnitude entries of every bucket."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from ...errors import invalid
from ._base import CompressionState, all_gather_flat, used_on_current_stream

__all__ = ["TopKState", "topk_hook"]


class TopKState(CompressionState):
    """State of `topk_hook`: the kept fraction `ratio` in (0, 1] and the residuals."""

    method = "topk"

    def __init__(self, process_group: Any = None, *, ratio: float = 0.01, error_feedback: bool = True) -> None:
        if not 0 < ratio <= 1:
            raise invalid("ratio", "in (0, 1]", ratio)
        self.ratio = ratio
        super().__init__(process_group, error_feedback=error_feedback)


def select_topk(state: CompressionState, bucket: dist.GradBucket, buf: torch.Tensor,
                k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest |entries| of `buf` plus the bucket's residual.

    With error feedback the residual is added first and what is not sent becomes the new
    residual.
    """
    if state.error_feedback:
        err = state.error_of(bucket)
        buf.add_(err)
    _, idx = buf.abs().topk(k, sorted=False)
    vals = buf[idx]
    if state.error_feedback:
        err.copy_(buf)
        err[idx] = 0
    return vals, idx


def topk_hook(state, bucket):  # noqa: ANN001, ANN201
    """Top-K DDP comm hook: all-gather (values, indices), scatter-add, average.

    Every rank keeps k = ceil(ratio * n) entries per bucket; values and int32 indices are
    packed byte-wise into one uint8 payload so that a single all-gather moves both. When
    the sparse payload would not be smaller than the dense bucket (k >= n / 2 with 4-byte
    values), the bucket is all-reduced densely instead (exact and cheaper).

    Example:
        >>> ddp_model.register_comm_hook(TopKState(ratio=0.05), topk_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    n, ws = buf.numel(), state.world_size
    k = max(1, min(n, math.ceil(state.ratio * n)))
    es = buf.element_size()
    if k * (es + 4) >= n * es:
        state.start_call(bucket, n * es)
        return state.allreduce_future(buf.div_(ws)).then(lambda f: f.value()[0])
    t0 = time.perf_counter()
    vals, idx = select_topk(state, bucket, buf, k)
    payload = torch.cat([vals.view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])
    out = torch.empty(ws * payload.numel(), dtype=torch.uint8, device=buf.device)
    state.add_time("compress_s", t0)
    state.start_call(bucket, payload.numel())
    fut = all_gather_flat(out, payload, group=state.process_group, async_op=True).get_future()

    def decompress(f):  # noqa: ANN001, ANN202
        f.value()  # re-raises a failed collective
        t1 = time.perf_counter()
        used_on_current_stream(out)  # allocated on the hook's stream, read on this callback's
        rows = out.view(ws, -1)
        all_vals = rows[:, : k * es].contiguous().view(buf.dtype)
        all_idx = rows[:, k * es:].contiguous().view(torch.int32).long()
        buf.zero_()
        # One rank at a time in rank order: indices are unique within a rank, so the sum is
        # deterministic (identical replicas) even where index_add_ uses atomics (CUDA).
        for r in range(ws):
            buf.index_add_(0, all_idx[r], all_vals[r])
        buf.div_(ws)
        state.add_time("decompress_s", t1)
        return buf

    return fut.then(decompress)
