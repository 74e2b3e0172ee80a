"""int8 quantization with a per-bucket scale agreed across ranks."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from ...errors import invalid
from ._base import CompressionState, used_on_current_stream

__all__ = ["Int8State", "int8_hook"]


class Int8State(CompressionState):
    """State of `int8_hook`: quantization levels and residuals.

    The int8 values are summed by the all-reduce itself, so each rank quantizes to
    `127 // world_size` levels and the sum cannot overflow; this needs world size <= 127.
    """

    method = "int8"

    def __init__(self, process_group: Any = None, *, error_feedback: bool = True) -> None:
        super().__init__(process_group, error_feedback=error_feedback, two_phase=True)
        self.levels = 127 // self.world_size
        if self.levels < 1:
            raise invalid("the world size of int8 compression", "<= 127", self.world_size)


def int8_hook(state, bucket):  # noqa: ANN001, ANN201
    """int8 DDP comm hook: all-reduce MAX of |g| (the shared scale), then the int8 sum.

    The second all-reduce is issued from the first one's callback, in hook order, on
    `state.second_group` (see `CompressionState.chain_second`); nothing ever waits.

    Example:
        >>> ddp_model.register_comm_hook(Int8State(), int8_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    t0 = time.perf_counter()
    if state.error_feedback:
        buf.add_(state.error_of(bucket))
    amax = buf.abs().max().reshape(1).float()
    state.add_time("compress_s", t0)
    state.start_call(bucket, buf.numel() + amax.numel() * amax.element_size())
    first = state.allreduce_future(amax, op=dist.ReduceOp.MAX)
    box: dict[str, Any] = {}

    def prepare(value):  # noqa: ANN001, ANN202
        t1 = time.perf_counter()
        top = value[0]
        # Kept on the device: a float() here would sync the stream on CUDA.
        scale = torch.where(top > 0, top / state.levels, torch.ones_like(top)).to(buf.dtype)
        q = torch.round(buf / scale).clamp_(-state.levels, state.levels).to(torch.int8)
        if state.error_feedback:
            err = state.error_of(bucket)  # allocated on the hook's stream, written on this callback's
            used_on_current_stream(err)
            torch.sub(buf, q.to(buf.dtype) * scale, out=err)
        box["scale"] = scale
        state.add_time("compress_s", t1)
        return lambda: state.allreduce_future(q, group=state.second_group)

    def finish(value):  # noqa: ANN001, ANN202
        t2 = time.perf_counter()
        # `scale` comes from prepare's callback stream; q (value[0]) is recorded by the future.
        used_on_current_stream(box["scale"])
        buf.copy_(value[0]).mul_(box["scale"] / state.world_size)
        state.add_time("decompress_s", t2)
        return buf

    return state.chain_second(first, buf, prepare, finish)
