"""Gradient compression as DDP comm hooks that run on gloo and NCCL and never block.

Each method is a state class plus a hook `(state, bucket) -> Future[Tensor]`:

| method   | state           | hook            | on the wire (per rank, per bucket of n values) |
|----------|-----------------|-----------------|-----------------------------------------------|
| fp16     | CastState       | cast_hook       | 2n bytes, one all-reduce                      |
| bf16     | CastState       | cast_hook       | 2n bytes, one all-reduce (gloo too)           |
| topk     | TopKState       | topk_hook       | 8k bytes (values + int32 indices), all-gather |
| int8     | Int8State       | int8_hook       | 4 + n bytes, all-reduce MAX then int8 sum     |
| powersgd | PowerSGDState   | powersgd_hook   | 4 (sum r(n_i + m_i) + rest), two all-reduces  |
| adaptive | AdaptiveState   | adaptive_hook   | 8k + 8, all-gather, ratio k/n from the loss;  |
|          |                 |                 | 4(n + 2), all-reduce, under 64 Ki values      |

Example:
    >>> from torsh_tune.strategies.compression import build_hook
    >>> state, hook = build_hook("powersgd", ddp_model.process_group, rank=2)  # doctest: +SKIP
    >>> ddp_model.register_comm_hook(state, hook)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Callable

from ...errors import invalid
from ._adaptive import AdaptiveState, adaptive_hook
from ._base import CompressionState
from ._cast import CastState, cast_hook
from ._int8 import Int8State, int8_hook
from ._powersgd import PowerSGDState, powersgd_hook
from ._topk import TopKState, topk_hook

__all__ = [
    "AdaptiveState",
    "CastState",
    "CompressionState",
    "Int8State",
    "PowerSGDState",
    "TopKState",
    "adaptive_hook",
    "build_hook",
    "cast_hook",
    "hook_from_config",
    "int8_hook",
    "powersgd_hook",
    "topk_hook",
]


def build_hook(method: str, process_group: Any = None, *, ratio: float = 0.01, rank: int = 4, start_iter: int = 10,
               error_feedback: bool = True, min_ratio: float = 0.001,
               max_ratio: float = 0.25) -> tuple[CompressionState, Callable] | None:
    """The (state, hook) pair of a compression method; None for "none".

    Must be called on every rank of `process_group` in the same order (int8 and powersgd
    create a second process group for their dependent collective).

    Args:
        method: "none", "fp16", "bf16", "topk", "int8", "powersgd" or "adaptive".
        process_group: the DDP model's process group (None: the default group).
        ratio: Top-K kept fraction in (0, 1]; adaptive's starting one.
        rank: PowerSGD approximation rank.
        start_iter: PowerSGD iterations with plain all-reduce first.
        error_feedback: keep and re-inject each bucket's compression residual.
        min_ratio: adaptive's smallest ratio, in (0, ratio].
        max_ratio: adaptive's largest ratio, in [ratio, 1].

    Raises:
        ConfigError: an unknown method or an out-of-range option.
    """
    if method == "none":
        return None
    if method in ("fp16", "bf16"):
        return CastState(process_group, dtype=method, error_feedback=error_feedback), cast_hook
    if method == "topk":
        return TopKState(process_group, ratio=ratio, error_feedback=error_feedback), topk_hook
    if method == "int8":
        return Int8State(process_group, error_feedback=error_feedback), int8_hook
    if method == "powersgd":
        state = PowerSGDState(process_group, rank=rank, start_iter=start_iter, error_feedback=error_feedback)
        return state, powersgd_hook
    if method == "adaptive":
        state = AdaptiveState(process_group, ratio=ratio, min_ratio=min_ratio, max_ratio=max_ratio,
                              error_feedback=error_feedback)
        return state, adaptive_hook
    raise invalid("compression method", "one of none, fp16, bf16, topk, int8, powersgd, adaptive", method)


def hook_from_config(config: Any, process_group: Any = None) -> tuple[CompressionState, Callable] | None:
    """`build_hook` from a `CompressionConfig`."""
    return build_hook(config.method, process_group, ratio=config.ratio, rank=config.rank,
                      start_iter=config.start_iter, error_feedback=config.error_feedback,
                      min_ratio=config.min_ratio, max_ratio=config.max_ratio)
