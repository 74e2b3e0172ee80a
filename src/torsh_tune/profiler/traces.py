"""Deep-trace windows: `torch.profiler` capture over a few steps, opened and closed at the
step boundaries the always-on tier already sees (the optimizer post-step hook).

A window is opened at the boundary *before* its first step and closed at the boundary after
its last, so it holds whole steps, annotated ``ProfilerStep#<step>`` with the same 0-based
step index as the step records. Every rank opens and closes the same windows:

- explicit (``trace_window = "START:LEN"``) and periodic (``trace_every``) windows are a
  function of the step count, which DDP keeps equal across ranks;
- anomaly windows (``trace_on_anomaly``) are decided on rank-local step times, so the ranks
  agree through one small collective every `ANOMALY_SYNC_EVERY_STEPS` steps: an all-reduce
  (SUM) of a ``world_size``-element float tensor (each rank's worst step / median ratio at
  its own index, 0 when it saw none) on a side gloo group, issued asynchronously at the
  boundary and waited for one step later; when any rank saw an anomaly, every rank opens the
  window at that later boundary. No sync happens while a window is open or after
  ``trace_max_windows`` anomaly windows.

Layout, per window (a directory holding nothing but Kineto traces, so that HTA, Perfetto and
`torsh_tune.analysis.traces.load_traces` read it as it is)::

    RUN/traces/step00020-00024/rank-0.json.gz
    RUN/traces/windows.jsonl        one line per (window, rank): steps, reason, capture cost

A window known ahead (explicit or periodic, from step 2 on) starts the profiler one step early in
torch's ``WARMUP`` state (`torch.profiler.schedule`'s warm-up: prepared, nothing recorded) and
records from its first step on, so a fresh process's one-time profiler start-up is not in the
compared steps (`benchmarks/trace_warmup.py`: the first recorded step 1.10x the others, once
25x, against 1.04x after a warm-up step; the first traced step of 25 stack runs in suites read
1.13x, one Trainer run stalled 7 ms inside its first collective there). The warm-up step
(``warmup_step``) is outside the window: not recorded, not in the reference of outside steps,
its time counted in the capture cost. An anomaly window (decided at its own first boundary),
one whose step before is still traced, and a window at step 0 or 1 start cold (``warmup_step``
null): step 0 is the script's setup, before which the profiler cannot know whether the run
will use CUDA.

The capture cost of a window on a rank is the time its steps (and its warm-up step) took
beyond the median step outside windows, starting the profiler included (``start_s``);
starting, stopping and exporting happen between two steps, are reported apart (``start_s``,
``stop_s``, ``export_s``) and kept out of the step records, so the first traced step record
spans what its ``ProfilerStep#`` spans.

Inside a window the always-on phase probes also annotate their phases (``torsh-tune::forward``,
``torsh-tune::backward``, ``torsh-tune::optimizer``, `PHASE_ANNOTATION`): the trace analysis
maps each to the device span of the kernels launched inside it, which is what the always-on
tier's CUDA events measure, so the self-check compares like with like on a GPU (principle 8).
Outside windows a probe pays one attribute test.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from typing import Any, Callable, Iterator

from ..config import ProfilerConfig
from ..records import PHASE_ANNOTATION_PREFIX
from ..rundir import RunDir
from ._clock import now

__all__ = ["ANOMALY_SYNC_EVERY_STEPS", "PHASE_ANNOTATION", "TraceWindows", "window_name"]

PHASE_ANNOTATION = PHASE_ANNOTATION_PREFIX + "{phase}"
"""Name of the trace annotation a phase probe opens inside a window (phase: forward, backward, optimizer)."""

ANOMALY_SYNC_EVERY_STEPS = 10
"""Steps between the anomaly agreements (one async 1 x world_size all-reduce each)."""

ALIGN_TIMEOUT_S = 120.0
"""Longest a rank waits at a window's boundary for the others (their stop and export, or a warm start)."""

_HISTORY_STEPS = 50  # outside-window steps the running median is taken over
_MIN_HISTORY_STEPS = 5  # no anomaly verdict before this many reference steps


def window_name(start_step: int, end_step: int) -> str:
    """Directory name of the window tracing steps `start_step`..`end_step` (inclusive)."""
    return f"step{start_step:05d}-{end_step:05d}"


class _Window:
    __slots__ = ("start", "end", "reason", "trigger", "prof", "step_s", "start_s", "last_step", "warmup_step",
                 "align_s")

    def __init__(self, start: int, length: int, reason: str, trigger: dict[str, Any] | None) -> None:
        self.start = start
        self.end = start + length - 1  # last traced step, inclusive
        self.reason = reason
        self.trigger = trigger
        self.prof: Any = None
        self.step_s: list[float] = []
        self.start_s = 0.0
        self.last_step = start - 1
        self.warmup_step: int | None = None  # the step the profiler warmed up in (not recorded)
        self.align_s: float | None = None  # the wait for the other ranks after a warm start

    @property
    def name(self) -> str:
        return window_name(self.start, self.end)


class TraceWindows:
    """Opens and closes `torch.profiler` windows at step boundaries for one rank.

    The runtime creates one per rank when `ProfilerConfig.traces_enabled`, calls
    `on_step_end` from the optimizer post-step hook and `close` when the rank finishes.

    Example:
        >>> tw = TraceWindows(config=ProfilerConfig(trace_window="4:2"), run_dir=RunDir("run"),
        ...                   rank=0, world_size=1)  # doctest: +SKIP
        >>> for step in range(8):
        ...     train_step(); tw.on_step_end(step + 1, now())  # doctest: +SKIP
        >>> tw.close()  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        config: ProfilerConfig,
        run_dir: RunDir,
        rank: int,
        world_size: int,
        cuda: bool | Callable[[], bool] = False,
        warmup_steps: int = 0,
        note: Callable[[str], None] | None = None,
        restart_step_clock: Callable[[float], None] | None = None,
    ) -> None:
        self._cfg = config
        self._run_dir = run_dir
        self._rank = rank
        self._world_size = world_size
        self._cuda = cuda
        self._warmup = warmup_steps
        self._note = note or (lambda message: None)
        self._restart_step_clock = restart_step_clock
        self._explicit = config.trace_window_steps
        self._every = config.trace_every
        self._anomaly = config.trace_on_anomaly
        self._open: _Window | None = None
        self._warming: _Window | None = None  # started one step early in WARMUP: records from its first step
        # A window is open: phase probes annotate their phases. An attribute, not a property: the
        # probes read it at every phase, and a property is one more Python call on the hot path.
        self.recording = False
        self.warming = False  # the step being run is a window's warm-up step (its profiler started, not recording)
        # A step boundary reached inside a compiled graph's op, acted on at the next probe outside one (`defer`).
        self.pending: Callable[[], None] | None = None
        self._last_t: float | None = None
        self._history: deque[float] = deque(maxlen=_HISTORY_STEPS)
        self._outside_s: list[float] = []  # every outside-window step after warm-up (the cost reference)
        self._anomaly_windows = 0
        self._local_anomaly: dict[str, Any] | None = None  # worst anomaly since the last agreement
        self._pending: tuple[Any, Any] | None = None  # (work, tensor) of the agreement in flight
        self._sent_anomaly: dict[str, Any] | None = None  # this rank's part of the agreement in flight
        self._group: Any = None
        self._side_failed = False  # the side group missed an alignment: no more agreements or alignments on it
        self._closing = False  # the rank is finishing: the other ranks may have destroyed their groups
        self.windows: list[dict[str, Any]] = []  # the records written, for the runtime's meta
        if self._explicit is not None and self._explicit[0] == 0:
            # Step 0 has no boundary before it: its window starts now, before the script runs.
            self._begin(_Window(0, self._explicit[1], "explicit", None), now())

    def annotate(self, phase: str) -> Any:
        """Open `phase`'s annotation in the window being recorded; None outside windows.

        Close it with `end_annotation` before the step boundary that may end the window. A phase probe
        reads its start before opening the annotation and its end after closing it: the annotation's own
        cost (3-4 µs each way idle, 10-30 µs on a busy 2-core host) lies inside both tiers' phase. Read
        inside it, the trace's phases were 12-62 µs longer than the probes' and the self-check's compute
        read ~2 pp low in every compiled-DDP step (2026-12-07; outside, 15-25 µs shorter: ~0.5 pp).
        """
        if self._open is None:
            return None
        from torch.autograd.profiler import record_function

        scope = record_function(PHASE_ANNOTATION.format(phase=phase))
        scope.__enter__()
        return scope

    def mark(self, name: str) -> bool:
        """A zero-length annotation PREFIX + `name` in the window being recorded (False outside windows).

        Where a phase cannot be one span: a compiled optimizer step's hooks run as ops of its graphs,
        and a span opened in one would outlive that op's own profiler event. The trace analysis pairs
        ``optimizer.begin`` with the next ``optimizer.end`` (`analysis.traces.phase_spans`).
        """
        scope = self.annotate(name)
        if scope is None:
            return False
        self.end_annotation(scope)
        return True

    @staticmethod
    def end_annotation(scope: Any) -> None:
        if scope is not None:
            scope.__exit__(None, None, None)

    # -- the hook -------------------------------------------------------------------------
    def on_step_end(self, steps_done: int, t_end: float, *, unusual: bool = False) -> None:
        """Called after step ``steps_done - 1`` ended at `t_end` (the tracker's clock); `unusual`: it held an
        evaluation pass or a checkpoint save, slow by design: neither an anomaly nor a reference step."""
        step = steps_done - 1
        if self._open is not None:
            self._open.last_step = step
            if self._last_t is not None:
                self._open.step_s.append(t_end - self._last_t)
        elif self._warming is not None:
            # The warm-up step: the profiler's, so not a reference step; its time is the window's cost.
            if self._last_t is not None:
                self._warming.step_s.append(t_end - self._last_t)
            self._last_t = t_end
            self._record_from_here()
            return
        elif self._last_t is not None:
            step_s = t_end - self._last_t
            if step >= max(1, self._warmup) and not unusual:  # step 0 holds the script's setup
                self._outside_s.append(step_s)
                if self._anomaly:
                    self._check_anomaly(step, step_s)
                self._history.append(step_s)
        self._last_t = t_end

        window = self._open
        if window is not None and steps_done > window.end:
            self._end(truncated=False)
            window = None
        start = self._start_at(steps_done)
        if start is not None:
            if window is not None:  # an explicit window pre-empts a periodic or anomaly one
                self._end(truncated=True)
            self._begin(start, t_end)
        elif window is not None:
            window.prof.step()
        elif self._open is None:
            ahead = self._known_ahead(steps_done + 1)
            if ahead is not None:
                self._begin(ahead, t_end, warm=True)

    def defer(self, action: Callable[[], None]) -> None:
        """Act on a step boundary (`action`: `on_step_end` and what follows it) at the next `run_pending`.

        A compiled optimizer step reaches its boundary inside an op of its graph
        (`runtime.patches._compiled_step_marker`); a profiler started there leaves that op's own
        event without a start (torch warns, naming the op, when it collects the trace). The phase
        probes outside compiled regions (the DataLoader's next batch, the probed module's forward,
        backward) run it first thing; two boundaries without such a probe between run the older now.
        """
        self.run_pending()
        self.pending = action

    def run_pending(self) -> None:
        action, self.pending = self.pending, None
        if action is not None:
            action()

    def close(self) -> None:
        """Stop and export a window still open when the rank finishes (marked truncated)."""
        # A boundary still pending (a compiled step's last) is acted on without aligning (`_closing`).
        self._closing = True
        self.run_pending()
        if self._open is not None:
            self._end(truncated=True)
        elif self._warming is not None:  # the run ended in the warm-up step: nothing was recorded
            window, self._warming, self.warming = self._warming, None, False
            with contextlib.suppress(Exception), _quiet_stderr():
                window.prof.stop()

    # -- scheduling -----------------------------------------------------------------------
    def _start_at(self, boundary: int) -> _Window | None:
        # An explicit window pre-empts an open one; a periodic or anomaly one waits for it to end.
        planned = self._planned(boundary, periodic=self._open is None)
        if planned is not None or self._open is not None:
            return planned
        if self._anomaly and self._anomaly_windows < self._cfg.trace_max_windows:
            trigger = self._agree_on_anomaly(boundary)
            if trigger is not None:
                self._anomaly_windows += 1
                return _Window(boundary, self._cfg.trace_len, "anomaly", trigger)
        return None

    def _known_ahead(self, boundary: int) -> _Window | None:
        """The window planned at `boundary` (explicit or periodic) when the step before it can warm it up."""
        return self._planned(boundary) if boundary > 1 else None

    def _planned(self, boundary: int, *, periodic: bool = True) -> _Window | None:
        """The explicit window, else (`periodic`) the periodic one, that starts at `boundary`: a function of the step count."""
        if self._explicit is not None and boundary == self._explicit[0] and boundary > 0:
            return _Window(boundary, self._explicit[1], "explicit", None)
        if periodic and self._every is not None and boundary % self._every == 0 and boundary > 0:
            return _Window(boundary, self._cfg.trace_len, "every", None)
        return None

    def _check_anomaly(self, step: int, step_s: float) -> None:
        if len(self._history) < _MIN_HISTORY_STEPS:
            return
        median_s = statistics.median(self._history)
        ratio = step_s / median_s if median_s > 0 else 0.0
        if ratio > self._cfg.trace_anomaly_factor and (
            self._local_anomaly is None or ratio > self._local_anomaly["ratio"]
        ):
            self._local_anomaly = {"step": step, "step_s": step_s, "median_step_s": median_s, "ratio": ratio}

    def _agree_on_anomaly(self, boundary: int) -> dict[str, Any] | None:
        """Every rank returns the same verdict at the same boundary (see the module doc)."""
        dist = _dist_if_initialized()
        if dist is None or self._world_size == 1 or self._side_failed:
            local, self._local_anomaly = self._local_anomaly, None
            return None if local is None else {"ratios": {str(self._rank): local["ratio"]}, "local": local}
        if self._pending is not None:
            work, tensor = self._pending
            self._pending = None
            work.wait()
            ratios = {str(r): float(v) for r, v in enumerate(tensor.tolist()) if v > 0}
            if ratios:
                return {"ratios": ratios, "local": self._sent_anomaly}
            return None
        if boundary % ANOMALY_SYNC_EVERY_STEPS == 0:
            import torch

            tensor = torch.zeros(self._world_size, dtype=torch.float64)
            self._sent_anomaly, self._local_anomaly = self._local_anomaly, None
            if self._sent_anomaly is not None:
                tensor[self._rank] = self._sent_anomaly["ratio"]
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._side_group(dist), async_op=True)
            self._pending = (work, tensor)
        return None

    def _side_group(self, dist: Any) -> Any:
        if self._group is None:
            # A side gloo group keeps the profiler's own agreements and alignments off the training
            # group's stream and sequence (NCCL on GPUs) and works on CPU tensors everywhere.
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _align(self) -> float | None:
        """Wait at this boundary until every rank reached it; the wait in seconds, None when not aligned.

        Stopping and exporting a window (and a warm start) take each rank its own time, hundreds of
        ms apart on a CPU host: without this the ranks that finished first wait out the others'
        export in their next step's first collective, and the profiler's own pause reads as a slow
        step, a step-time spike and a straggler in the script's records. Every rank passes the same
        boundaries (see `_planned`), so the barrier is on its side group; a rank that waited
        `ALIGN_TIMEOUT_S` in vain stops aligning (and agreeing) and says so in its notes.
        """
        dist = _dist_if_initialized()
        if dist is None or self._world_size == 1 or self._side_failed or self._closing:
            return None
        from datetime import timedelta

        t0 = time.perf_counter()
        try:
            dist.barrier(group=self._side_group(dist), async_op=True).wait(timeout=timedelta(seconds=ALIGN_TIMEOUT_S))
        except Exception as exc:
            self._side_failed = True
            self._note(f"trace windows: the ranks could not be aligned at a window boundary ({type(exc).__name__}: "
                       f"{exc}); later steps after a window may hold the other ranks' export time")
            return None
        return time.perf_counter() - t0

    # -- capture --------------------------------------------------------------------------
    def _begin(self, window: _Window, t: float, *, warm: bool = False) -> None:
        """Start the profiler at the boundary before `window.start` (recording), or one step earlier (`warm`)."""
        t0 = time.perf_counter()
        try:
            window.prof = _make_profiler(self._cfg, self._cuda() if callable(self._cuda) else self._cuda,
                                         record_from=window.start if warm else None)
            # The first recorded ProfilerStep# annotation carries the window's first step index.
            window.prof.step_num = window.start - 1 if warm else window.start
            with _quiet_stderr():
                window.prof.start()
        except Exception as exc:  # a failing profiler must not end the training run
            self._note(f"trace window {window.name} not started: {type(exc).__name__}: {exc}")
            if warm:  # the other ranks wait at this boundary all the same
                self._align()
            return
        window.start_s = time.perf_counter() - t0
        if warm:
            window.warmup_step = window.start - 1
            self._warming, self.warming = window, True
            # Nothing is recorded yet: the ranks leave the warm start together (a cold one records from here on).
            window.align_s = self._align()
        else:
            self._open, self.recording = window, True
        if window.start > 0 and self._restart_step_clock is not None:
            # Starting ran between two steps (CUPTI's start on a GPU: tens of ms): the next step
            # record starts after it, as its ProfilerStep# does; the window's capture cost (its own
            # step times, from the boundary) still counts it.
            self._restart_step_clock(now())

    def _record_from_here(self) -> None:
        """The boundary after the warm-up step: the profiler starts recording the window's first step."""
        window, self._warming, self.warming = self._warming, None, False
        assert window is not None
        t0 = time.perf_counter()
        try:
            with _quiet_stderr():
                window.prof.step()  # WARMUP -> RECORD: torch's start_trace
        except Exception as exc:  # a failing profiler must not end the training run
            self._note(f"trace window {window.name} not started: {type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception), _quiet_stderr():
                window.prof.stop()
            return
        window.start_s += time.perf_counter() - t0
        self._open, self.recording = window, True
        if self._restart_step_clock is not None:
            self._restart_step_clock(now())

    def _end(self, *, truncated: bool) -> None:
        window, self._open, self.recording = self._open, None, False
        assert window is not None
        record: dict[str, Any] = {
            "window": window.name,
            "rank": self._rank,
            "reason": window.reason,
            "start_step": window.start,
            "end_step": window.last_step,
            "planned_end_step": window.end,
            "truncated": truncated,
            "num_steps": window.last_step - window.start + 1,
            "warmup_step": window.warmup_step,
            "start_align_s": window.align_s,
            "trigger": window.trigger,
            "path": None,
            "trace_bytes": 0,
            "error": None,
        }
        t0 = time.perf_counter()
        try:
            with _quiet_stderr():
                window.prof.stop()
            t1 = time.perf_counter()
            out_dir = self._run_dir.traces / window.name
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"rank-{self._rank}.json.gz"
            with _quiet_stderr():
                window.prof.export_chrome_trace(str(path))
            t2 = time.perf_counter()
            record["path"] = str(path.relative_to(self._run_dir.path))
            record["trace_bytes"] = path.stat().st_size
        except Exception as exc:
            t1 = t2 = time.perf_counter()
            record["error"] = f"{type(exc).__name__}: {exc}"
            self._note(f"trace window {window.name} not exported: {record['error']}")
        record.update(self._cost(window, stop_s=t1 - t0, export_s=t2 - t1))
        # Stopping and exporting ran between two steps: every rank leaves this boundary together (a rank
        # finishing its run does not wait: `_closing`), and the next step's time starts after it.
        record["end_align_s"] = self._align()
        self._append(record)
        self.windows.append(record)
        t = now()
        self._last_t = t
        if self._restart_step_clock is not None:
            self._restart_step_clock(t)

    def _cost(self, window: _Window, *, stop_s: float, export_s: float) -> dict[str, Any]:
        reference = statistics.median(self._outside_s) if self._outside_s else None
        traced_s = sum(window.step_s)
        cost_s = None if reference is None else traced_s - reference * len(window.step_s)
        overhead_pct = (
            None if reference is None or not window.step_s or reference <= 0
            else 100.0 * (traced_s / len(window.step_s) / reference - 1.0)
        )
        return {
            "traced_step_s": traced_s,
            "median_step_s_outside": reference,
            "num_reference_steps": len(self._outside_s),
            "capture_cost_s": cost_s,
            "overhead_pct": overhead_pct,
            "start_s": window.start_s,
            "stop_s": stop_s,
            "export_s": export_s,
        }

    def _append(self, record: dict[str, Any]) -> None:
        self._run_dir.traces.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        # One O_APPEND write per line: ranks sharing the file never interleave inside a line.
        fd = os.open(self._run_dir.traces / "windows.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)


def _dist_if_initialized() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _make_profiler(cfg: ProfilerConfig, cuda: bool, *, record_from: int | None = None) -> Any:
    """A `torch.profiler.profile` that records every step, or warms up before step `record_from` and records from it."""
    import torch
    from torch.profiler import ProfilerAction, ProfilerActivity, profile

    class _WindowProfile(profile):
        def prepare_trace(self) -> None:
            # torch's prepare_trace probes `torch._inductor` only to read its cudagraphs flag;
            # the probe imports inductor (~1.5 s per rank) in a process that never compiled
            # anything, where the flag cannot be set. Hide the lazy import unless it happened.
            lazy = torch.__dict__.get("__getattr__")
            if "torch._inductor" in sys.modules or lazy is None:
                return super().prepare_trace()

            def no_inductor(name: str) -> Any:
                if name == "_inductor":
                    raise AttributeError(name)
                return lazy(name)

            torch.__getattr__ = no_inductor  # type: ignore[attr-defined]
            try:
                super().prepare_trace()
            finally:
                torch.__getattr__ = lazy  # type: ignore[attr-defined]

    activities = [ProfilerActivity.CPU]
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    return _WindowProfile(
        activities=activities,
        # A schedule makes the profiler annotate ProfilerStep#N (only the recorded steps reach the trace).
        schedule=(lambda step: ProfilerAction.RECORD) if record_from is None else
        (lambda step: ProfilerAction.WARMUP if step < record_from else ProfilerAction.RECORD),
        record_shapes=cfg.trace_shapes,
        with_stack=cfg.trace_stack,
        profile_memory=cfg.trace_memory,
    )


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Drop Kineto's `USDT: ... profiler_start/stop` lines; let anything else through.

    Kineto prints them from C++ straight to file descriptor 2 with no log level to turn
    them off, so fd 2 is pointed at a temporary file for the duration of the call and what
    landed there is written back without those lines.
    """
    try:
        sys.stderr.flush()
    except Exception:  # a closed or replaced stderr: nothing of ours is buffered there
        pass
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 at all: nothing to keep quiet
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [line for line in tmp.read().splitlines(keepends=True) if not line.startswith(b"USDT:")]
            if kept:
                os.write(2, b"".join(kept))
