"""nccl-tests' bus-bandwidth factors (pure Python: the trace analyzers and the bench worker use them too)."""

from __future__ import annotations

__all__ = ["bus_factor"]

# nccl-tests' bus-bandwidth factors (PERFORMANCE.md): busbw = algbw * factor(n).
_RING_2 = {"all_reduce", "allreduce"}
_RING_1 = {"all_gather", "allgather", "reduce_scatter", "all_to_all", "alltoall",
           "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"}


def bus_factor(collective: str | None, world_size: int) -> float:
    """nccl-tests factor turning algorithm bandwidth into bus bandwidth for `collective`."""
    n = max(int(world_size), 1)
    name = str(collective or "").lower()
    if name in _RING_2:
        return 2.0 * (n - 1) / n
    if name in _RING_1:
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv: every byte crosses one link once
