"""Adaptive sparsification: Top-K whose kept fraction follows the loss's stability and the bucket size.

Per bucket: buckets under `dense_below` values (biases, norms, small heads) are all-reduced
densely, compression does not pay there; larger ones keep k = ceil(ratio * n) entries as in
`topk_hook`, with error feedback.

The ratio is global and moves in [min_ratio, max_ratio]. Top-K's all-gather needs the same k
on every rank, so every decision is computed from values every rank holds bit for bit:
each bucket carries two float32 extras next to its payload (this rank's latest loss, handed
in through `observe_loss`, and the squared norm of its local gradient in that bucket), so
after the exchange every rank sees the same mean loss and mean gradient norms. The
decision runs on the hook thread when the first bucket of iteration t arrives and reads
the signals of iterations up to t - 2 (DDP waited for all of their callbacks, and on CUDA
their host copies are done without stalling the stream). Every `adapt_every` iterations,
over that window of per-iteration signals:

- unstable (coefficient of variation above `cv_threshold`, or the window's mean more than
  `rise_tolerance` and more than two standard errors above the previous window's, so that
  minibatch noise on a plateau does not count as a rise): ratio x 2, at most max_ratio;
- otherwise (stable or decreasing): ratio x 0.8, at least min_ratio.

The signal is the mean loss across ranks when every iteration of the window observed one
on every rank, else the total gradient norm (the root of the summed mean squared bucket
norms; the dense local gradients, so it does not depend on the ratio itself). Minibatch
gradient norms are noisier than losses (coefficient of variation 0.2-0.3 against about 0.1
on the plateau of the test task), so with the same thresholds the fallback keeps a higher
ratio.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from typing import Any

import torch

from ...errors import invalid
from ._base import CompressionState, all_gather_flat, used_on_current_stream
from ._topk import select_topk

__all__ = ["AdaptiveState", "adaptive_hook"]

_EXTRAS = 2  # float32 values carried by every bucket: (loss, squared local gradient norm)
_MAX_HISTORY = 1000  # ratio changes kept in stats (the count goes on)


class AdaptiveState(CompressionState):
    """State of `adaptive_hook`: the current ratio, its bounds and rule, residuals and signals.

    Args:
        process_group: the DDP model's process group.
        ratio: starting kept fraction, in [min_ratio, max_ratio].
        min_ratio: smallest ratio, in (0, ratio].
        max_ratio: largest ratio, in [ratio, 1].
        error_feedback: carry each sparsified bucket's residual to its next gradient.
        dense_below: buckets with fewer values are all-reduced densely.
        adapt_every: iterations per decision (the window of signals it looks at), >= 2.
        cv_threshold: coefficient of variation of the window above which it is unstable.
        rise_tolerance: relative increase of the window mean over the previous window's
            above which it is unstable.

    Attributes:
        ratio: the current kept fraction (identical on every rank).
        stats: CompressionState's totals plus ratio, min_ratio, max_ratio, dense_calls,
            loss_iters / grad_norm_iters (iterations whose signal was the loss / the gradient
            norm), num_ratio_changes and ratio_history (the latest changes: iter, ratio,
            signal, cv, rise).

    Example:
        >>> state = AdaptiveState(ratio=0.05, min_ratio=0.005, max_ratio=0.25)  # doctest: +SKIP
        >>> ddp_model.register_comm_hook(state, adaptive_hook)  # doctest: +SKIP
        >>> state.observe_loss(loss.detach()); loss.backward()  # doctest: +SKIP
    """

    method = "adaptive"

    def __init__(self, process_group: Any = None, *, ratio: float = 0.01, min_ratio: float = 0.001,
                 max_ratio: float = 0.25, error_feedback: bool = True, dense_below: int = 65536,
                 adapt_every: int = 10, cv_threshold: float = 0.25, rise_tolerance: float = 0.05) -> None:
        if not 0 < min_ratio <= ratio:
            raise invalid("min_ratio", f"in (0, ratio={ratio}]", min_ratio)
        if not ratio <= max_ratio <= 1:
            raise invalid("max_ratio", f"in [ratio={ratio}, 1]", max_ratio)
        if adapt_every < 2:
            raise invalid("adapt_every", "an integer >= 2", adapt_every)
        if dense_below < 0:
            raise invalid("dense_below", "an integer >= 0", dense_below)
        super().__init__(process_group, error_feedback=error_feedback)
        self.ratio, self.min_ratio, self.max_ratio = ratio, min_ratio, max_ratio
        self.dense_below = dense_below
        self.adapt_every, self.cv_threshold, self.rise_tolerance = adapt_every, cv_threshold, rise_tolerance
        self.stats.update({"ratio": ratio, "min_ratio": min_ratio, "max_ratio": max_ratio, "dense_calls": 0,
                           "loss_iters": 0, "grad_norm_iters": 0, "num_ratio_changes": 0, "ratio_history": []})
        self._loss: torch.Tensor | None = None  # the latest observed, not yet sent
        self._iter_loss: torch.Tensor | None = None  # the one the current iteration's buckets carry
        self._nan: dict[torch.device, torch.Tensor] = {}
        self._signal_lock = threading.Lock()
        # iteration -> bucket index -> (host tensor [mean loss, mean squared norm], CUDA event or None)
        self._pending: dict[int, dict[int, tuple[torch.Tensor, Any]]] = {}
        self._window: list[tuple[float, float]] = []  # (mean loss, gradient norm) per iteration
        self._next_iter = 0  # first iteration not read yet
        self._previous: dict[str, tuple[float, float]] = {}  # signal -> (mean, variance) of the previous window

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Hand in this rank's latest loss (a detached 0-d tensor); read by the next backward's buckets."""
        self._loss = loss

    # -- payload extras -----------------------------------------------------------------
    def _extras(self, buf: torch.Tensor) -> torch.Tensor:
        """[loss, squared norm of the local gradient] as float32 on the bucket's device (NaN: no loss)."""
        sq_norm = torch.linalg.vector_norm(buf, dtype=torch.float32).square().reshape(1)
        loss = self._iter_loss
        if loss is None:
            nan = self._nan.get(buf.device)
            if nan is None:
                nan = self._nan[buf.device] = torch.full((1,), math.nan, dtype=torch.float32, device=buf.device)
            return torch.cat([nan, sq_norm])
        return torch.cat([loss.detach().to(device=buf.device, dtype=torch.float32).reshape(1), sq_norm])

    def _record(self, iteration: int, index: int, extras: torch.Tensor) -> None:
        """Keep an exchanged bucket's mean extras (on a PG worker thread); read later on the hook thread."""
        if extras.is_cuda:
            host = torch.empty(_EXTRAS, dtype=torch.float32, pin_memory=True)
            host.copy_(extras, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = extras.clone(), None
        with self._signal_lock:
            self._pending.setdefault(iteration, {})[index] = (host, event)

    # -- the ratio ------------------------------------------------------------------------
    def _begin_iteration(self) -> None:
        """On the first bucket of an iteration: take the observed loss, fold in finished signals, adapt."""
        self._iter_loss, self._loss = self._loss, None
        # DDP waited for every bucket of the previous iteration; two back, CUDA is done with them too.
        last = self.iter - 2
        while self._next_iter <= last:
            with self._signal_lock:
                buckets = self._pending.pop(self._next_iter, {})
            self._next_iter += 1
            if not buckets:
                continue
            values = []
            for index in sorted(buckets):  # a fixed order: identical sums on every rank
                host, event = buckets[index]
                if event is not None:
                    event.synchronize()
                values.append(host.tolist())
            loss = values[0][0]  # every bucket carries the same loss; the first one's
            grad_norm = math.sqrt(math.fsum(v[1] for v in values))
            self._window.append((loss, grad_norm))
            if len(self._window) >= self.adapt_every:
                self._adapt(self._next_iter - 1)
                self._window = []

    def _adapt(self, iteration: int) -> None:
        if all(math.isfinite(loss) for loss, _ in self._window):
            signal, series = "loss", [loss for loss, _ in self._window]
        else:
            signal, series = "grad_norm", [norm for _, norm in self._window]
        with self._stats_lock:
            self.stats[f"{signal}_iters"] += len(series)
        mean = statistics.fmean(series)
        if not all(math.isfinite(v) for v in series) or mean == 0:
            return  # nothing to learn from inf/NaN gradients or an exactly zero loss
        var = statistics.pvariance(series)
        cv = math.sqrt(var) / abs(mean)
        prev_mean, prev_var = self._previous.get(signal, (mean, var))
        rise = 0.0 if prev_mean == 0 else (mean - prev_mean) / abs(prev_mean)
        rise_se = math.sqrt((var + prev_var) / len(series))  # standard error of the difference of the means
        self._previous = {signal: (mean, var)}
        if cv > self.cv_threshold or (rise > self.rise_tolerance and mean - prev_mean > 2 * rise_se):
            new_ratio = min(self.max_ratio, self.ratio * 2)
        else:
            new_ratio = max(self.min_ratio, self.ratio * 0.8)
        if new_ratio == self.ratio:
            return
        self.ratio = new_ratio
        change = {"iter": iteration, "ratio": new_ratio, "signal": signal, "cv": round(cv, 6), "rise": round(rise, 6)}
        with self._stats_lock:
            history = self.stats["ratio_history"]
            history.append(change)
            del history[:-_MAX_HISTORY]
            self.stats["num_ratio_changes"] += 1
            self.stats["ratio"] = new_ratio

    def k_of(self, numel: int, element_size: int) -> int | None:
        """Entries a bucket of `numel` values keeps at the current ratio; None: send it densely."""
        if numel < self.dense_below:
            return None
        k = max(1, min(numel, math.ceil(self.ratio * numel)))
        return None if k * (element_size + 4) >= numel * element_size else k


def adaptive_hook(state, bucket):  # noqa: ANN001, ANN201
    """Adaptive Top-K DDP comm hook; dense all-reduce for small buckets, never blocks.

    A sparsified bucket all-gathers (values, int32 indices, extras) packed byte-wise into one
    uint8 payload; a dense one all-reduces the bucket in float32 with the extras appended.
    Call `state.observe_loss(loss.detach())` before `loss.backward()` (the torsh-tune runtime
    does it for the configured hook) to adapt on the loss rather than the gradient norm.

    Example:
        >>> ddp_model.register_comm_hook(AdaptiveState(ratio=0.05), adaptive_hook)  # doctest: +SKIP
    """
    buf = bucket.buffer()
    index, iteration = bucket.index(), state.iter
    if index == 0:
        state._begin_iteration()
    n, ws, es = buf.numel(), state.world_size, buf.element_size()
    t0 = time.perf_counter()
    extras = state._extras(buf)  # the local gradient's norm, before any residual is added
    k = state.k_of(n, es)
    if k is None:
        if state.error_feedback:
            err = state.errors.pop(index, None)  # left over from sparse iterations: send it now
            if err is not None and err.shape == buf.shape:
                buf.add_(err)
        payload = torch.cat([buf.to(torch.float32), extras]).div_(ws)
        state.add_time("compress_s", t0)
        state.start_call(bucket, 4 * payload.numel())
        with state._stats_lock:
            state.stats["dense_calls"] += 1

        def unpack(f):  # noqa: ANN001, ANN202
            total = f.value()[0]
            t1 = time.perf_counter()
            buf.copy_(total[:n])
            state._record(iteration, index, total[n:])
            state.add_time("decompress_s", t1)
            return buf

        return state.allreduce_future(payload).then(unpack)

    vals, idx = select_topk(state, bucket, buf, k)
    payload = torch.cat([vals.view(torch.uint8), idx.to(torch.int32).view(torch.uint8), extras.view(torch.uint8)])
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
        all_idx = rows[:, k * es: k * (es + 4)].contiguous().view(torch.int32).long()
        all_extras = rows[:, k * (es + 4):].contiguous().view(torch.float32)
        buf.zero_()
        # One rank at a time in rank order: deterministic sums (identical replicas), as in topk_hook.
        for r in range(ws):
            buf.index_add_(0, all_idx[r], all_vals[r])
        buf.div_(ws)
        state._record(iteration, index, all_extras.mean(dim=0))
        state.add_time("decompress_s", t1)
        return buf

    return fut.then(decompress)
