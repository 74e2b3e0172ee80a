"""fp16 / bf16 compression: cast the averaged bucket down, all-reduce, cast back."""

from __future__ import annotations

import time
from typing import Any

import torch

from ._base import CompressionState

__all__ = ["CastState", "cast_hook"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastState(CompressionState):
    """State of `cast_hook`: the wire dtype ("fp16" or "bf16") and the residuals.

    Unlike torch's `bf16_compress_hook`, bf16 is not restricted to NCCL: gloo sums bf16 on
    CPU (checked with torch 2.13), so the same hook runs on both backends.
    """

    def __init__(self, process_group: Any = None, *, dtype: str = "fp16", error_feedback: bool = True) -> None:
        self.method = dtype
        self.dtype = _DTYPES[dtype]
        super().__init__(process_group, error_feedback=error_feedback)


# No annotations on hooks: DDP's _check_comm_hook compares them by identity.
def cast_hook(state, bucket):  # noqa: ANN001, ANN201
    """Average a bucket in fp16/bf16 (DDP comm hook); returns Future[Tensor].

    Example:
        >>> state = CastState(dtype="bf16")  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, cast_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    t0 = time.perf_counter()
    # Divide first so that fp16 cannot overflow in the sum (as torch's fp16 hook does).
    src = buf.div(state.world_size)
    if state.error_feedback:
        err = state.error_of(bucket)
        src.add_(err)
    low = src.to(state.dtype)
    if state.error_feedback:
        torch.sub(src, low.to(src.dtype), out=err)
    state.add_time("compress_s", t0)
    state.start_call(bucket, low.numel() * low.element_size())
    fut = state.allreduce_future(low)

    def decompress(f):  # noqa: ANN001, ANN202
        t1 = time.perf_counter()
        buf.copy_(f.value()[0])
        state.add_time("decompress_s", t1)
        return buf

    return fut.then(decompress)
