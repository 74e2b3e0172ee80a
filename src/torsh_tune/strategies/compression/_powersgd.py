"""PowerSGD (Vogels et al., 2019): rank-r power iteration, warm start, error feedback."""

from __future__ import annotations

import time
from typing import Any

import torch

from ...errors import invalid
from ._base import CompressionState, used_on_current_stream

__all__ = ["PowerSGDState", "powersgd_hook"]


class PowerSGDState(CompressionState):
    """State of `powersgd_hook`, per bucket index: Q (warm start), residual, generator.

    Args:
        process_group: the DDP model's process group.
        rank: rank r of the low-rank approximation.
        start_iter: plain all-reduce for this many DDP iterations first (PowerSGD
            converges better when the first, fast-changing gradients are exact).
        warm_start: reuse last iteration's Q instead of a fresh random one.
        error_feedback: carry each bucket's local approximation error to its next gradient.
        seed: seed of the random initial Q (identical on every rank).
    """

    method = "powersgd"

    def __init__(self, process_group: Any = None, *, rank: int = 4, start_iter: int = 10, warm_start: bool = True,
                 error_feedback: bool = True, seed: int = 0) -> None:
        if rank < 1:
            raise invalid("rank", "an integer >= 1", rank)
        if start_iter < 0:
            raise invalid("start_iter", "an integer >= 0", start_iter)
        super().__init__(process_group, error_feedback=error_feedback, two_phase=True)
        self.rank = rank
        self.start_iter = start_iter
        self.warm_start = warm_start
        self.seed = seed
        self.q_memory: dict[int, list[torch.Tensor]] = {}
        self._generators: dict[int, torch.Generator] = {}

    def _initial_q(self, index: int, shapes: list[tuple[int, int]], device: torch.device) -> list[torch.Tensor]:
        gen = self._generators.get(index)
        if gen is None:
            gen = self._generators[index] = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        # Drawn on the CPU generator so that every rank (and device) gets the same Q.
        return [torch.randn(m, r, generator=gen).to(device) for (_, m), r in zip(shapes, self._ranks(shapes))]

    def _ranks(self, shapes: list[tuple[int, int]]) -> list[int]:
        return [min(self.rank, n, m) for n, m in shapes]


def _layout(bucket, rank: int):  # noqa: ANN001, ANN202
    """Split the bucket buffer into (offset, view) of matrices worth compressing and of the rest."""
    buf = bucket.buffer()
    matrices, rest = [], []
    offset = 0
    for g in bucket.gradients():
        view = buf[offset: offset + g.numel()]
        if g.dim() > 1:
            n, m = g.shape[0], g.numel() // g.shape[0]
            r = min(rank, n, m)
            if (n + m) * r < n * m:
                matrices.append((offset, view.view(n, m)))
                offset += g.numel()
                continue
        rest.append((offset, view))
        offset += g.numel()
    assert offset == buf.numel(), "bucket buffer is not the concatenation of its gradients"
    return matrices, rest


def _orthogonalize(p: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(p, mode="reduced").Q


def powersgd_hook(state, bucket):  # noqa: ANN001, ANN201
    """PowerSGD DDP comm hook; multi-bucket safe and non-blocking on gloo and NCCL.

    Per bucket: matrices M (gradients with > 1 dim where rank r saves bytes) are replaced by
    P = M Q; P and the remaining tensors go out in one all-reduce; P is orthonormalised,
    Q = M^T P goes out in a second all-reduce (issued from the first's callback, in hook
    order, on `state.second_group`); M ≈ P Q^T / world_size. The residual M - P Q_local^T
    is kept per bucket when error feedback is on.

    Example:
        >>> state = PowerSGDState(rank=2, start_iter=10)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, powersgd_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    ws, index = state.world_size, bucket.index()
    if state.iter < state.start_iter:
        state.start_call(bucket, buf.numel() * buf.element_size())
        return state.allreduce_future(buf.div_(ws)).then(lambda f: f.value()[0])
    t0 = time.perf_counter()
    if state.error_feedback:
        buf.add_(state.error_of(bucket))
    matrices, rest = _layout(bucket, state.rank)
    shapes = [tuple(mat.shape) for _, mat in matrices]
    ranks = state._ranks(shapes)
    qs = state.q_memory.get(index) if state.warm_start else None
    if qs is None or [tuple(q.shape) for q in qs] != [(m, r) for (_, m), r in zip(shapes, ranks)]:
        qs = state._initial_q(index, shapes, buf.device)
    else:
        used_on_current_stream(*qs)  # the last iteration's, allocated on its finish callback's stream
    ps = [mat.float() @ q for (_, mat), q in zip(matrices, qs)]
    num_rest = sum(t.numel() for _, t in rest)
    # The uncompressed tensors travel with P: one collective instead of two.
    first_payload = torch.cat([t.float() for _, t in rest] + [p.reshape(-1) for p in ps])
    second_numel = sum(q.numel() for q in qs)
    state.add_time("compress_s", t0)
    state.start_call(bucket, 4 * (first_payload.numel() + second_numel))
    first = state.allreduce_future(first_payload)

    def unpack_rest(total: torch.Tensor) -> None:
        offset = 0
        for _, t in rest:
            t.copy_(total[offset: offset + t.numel()]).div_(ws)
            offset += t.numel()

    if not matrices:
        def finish_rest(f):  # noqa: ANN001, ANN202
            unpack_rest(f.value()[0])
            return buf

        return first.then(finish_rest)

    box: dict[str, Any] = {}

    def prepare(value):  # noqa: ANN001, ANN202
        t1 = time.perf_counter()
        total = value[0]
        unpack_rest(total)
        offset = num_rest
        new_ps, new_qs = [], []
        err = state.error_of(bucket) if state.error_feedback else None
        if err is not None:
            used_on_current_stream(err)  # allocated on the hook's stream, written on this callback's
        for (start, mat), p in zip(matrices, ps):
            p_sum = total[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
            p_hat = _orthogonalize(p_sum)
            q_local = mat.float().t() @ p_hat
            if err is not None:
                # The local approximation error (the paper's e = M - P Q_local^T).
                err[start: start + mat.numel()].view_as(mat).copy_(mat.float() - p_hat @ q_local.t())
            new_ps.append(p_hat)
            new_qs.append(q_local)
        if err is not None:
            for start, t in rest:  # sent exactly: no residual
                err[start: start + t.numel()].zero_()
        box["ps"], box["qs"] = new_ps, new_qs
        payload = torch.cat([q.reshape(-1) for q in new_qs])
        state.add_time("compress_s", t1)
        return lambda: state.allreduce_future(payload, group=state.second_group)

    def finish(value):  # noqa: ANN001, ANN202
        t2 = time.perf_counter()
        total = value[0]
        used_on_current_stream(*box["ps"])  # from prepare's callback stream (total is recorded by the future)
        offset = 0
        kept = []
        for (_, mat), p_hat, q in zip(matrices, box["ps"], box["qs"]):
            q_sum = total[offset: offset + q.numel()].view_as(q)
            offset += q.numel()
            mat.copy_(p_hat @ q_sum.t()).div_(ws)
            kept.append(q_sum.clone())
        state.q_memory[index] = kept
        state.add_time("decompress_s", t2)
        return buf

    return state.chain_second(first, buf, prepare, finish)
