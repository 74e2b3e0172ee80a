"""Per-rank timelines: which events are GPU kernels of which kind, and the CPU fallback.

Kernel kinds follow HTA's definitions (so the numbers agree with it): communication =
name matches a NCCL kernel pattern, memory = memcpy/memset, computation = the rest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from ...records import PHASE_ANNOTATION_PREFIX, WAIT_ANNOTATION
from . import _intervals as iv
from ._model import RankTrace
from ._symbols import SymbolTable
from ._table import Table

__all__ = ["CommPatterns", "Timeline", "gloo_span_ends", "rank_timeline", "step_spans"]

COMPUTATION, COMMUNICATION, MEMORY = 0, 1, 2
#: CPU timelines: the name of the main thread's waits for collectives (`_synchronous_waits`, `_scope_waits`).
MAIN_THREAD_WAIT = "collective wait (main thread)"
#: A main-thread gap after a synchronous collective's issue is its wait when the thread's next operator
#: starts within this long of a gloo worker span's end inside the gap: its wake-up, tens of µs on an
#: idle host and up to 9 ms seen with 2 ranks beside a test suite on 2 cores (the thread is runnable,
#: not run); longer stretches are taken for Python the thread ran after an asynchronous call.
SYNC_WAKE_US = 20_000.0
#: ... and a worker span may end up to this long after the gap: DDP's spans are bounded by the reducer's
#: copies of their results (`gloo_span_ends`), which start tens of µs after its wait for them returned.
SPAN_BOUND_SLACK_US = 200.0
KIND_NAMES = ("computation", "communication", "memory")
#: The profiler's annotation around a DataLoader's `__next__` (the batch's fetch and collate).
LOADER_ANNOTATION = r"^enumerate\(DataLoader\)"


@dataclass(frozen=True, kw_only=True)
class CommPatterns:
    """Regexes (``re.search``) recognising communication in traces.

    Attributes:
        nccl_kernels: GPU kernel names that are NCCL collectives. Both the pre-2.19
            ``ncclKernel_*`` and the newer ``ncclDevKernel_*`` spellings by default.
        gloo_worker: annotations the gloo ``pt_gloo_runloop`` worker threads record.
        c10d_ops: main-thread c10d operators that issue a collective.
        comm_waits: host operators that block until a collective finishes (idle-time causes).
        funcol_ops: a functional collective's own host operators around the c10d one it issues
            (its output's allocation and copy, the async result's wrapping): on CPU, the
            training thread's time issuing it.
        syncs: host calls that block until the device is done (idle-time causes).
        comm_scopes: host annotations a framework puts around its own collectives (FSDP's): on
            CPU, the main thread's time in them outside any leaf operator is a collective's wait.
        reducer_copies: DDP's reducer copying a reduced bucket into the gradients (CPU traces:
            every bucket's all-reduce has completed when the last of a backward's copies ends).
        backward_ops: the autograd engine's operators (a backward pass is running).
    """

    nccl_kernels: tuple[str, ...] = (r"ncclKernel", r"ncclDevKernel")
    gloo_worker: str = r"^gloo:"
    c10d_ops: str = r"^c10d::(?!wait|_wait|barrier_wait)"
    comm_waits: str = (r"^(?:wait|aten::wait|c10d::_?wait\w*|c10d::barrier\w*|_c10d_functional::wait_tensor)$"
                       r"|Awaitable wait\(\)|wait_tensors|^" + re.escape(WAIT_ANNOTATION) + "$")
    funcol_ops: str = r"^_c10d_functional::(?!wait_tensor$)"
    syncs: str = (r"^(?:cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy"
                  r"|hipStreamSynchronize|hipDeviceSynchronize|aten::item|aten::_local_scalar_dense)$")
    comm_scopes: str = r"^FSDP::(?:all_gather|post_backward_reduce|reduce_scatter)(?: \(\d+\))?$"
    reducer_copies: str = r"^torch\.distributed\.ddp\.reducer::copy_bucket_to_grad$"
    backward_ops: str = r"^autograd::engine::evaluate_function: "

    def nccl_regex(self) -> re.Pattern[str]:
        """One regex for all `nccl_kernels` patterns."""
        return re.compile("|".join(f"(?:{p})" for p in self.nccl_kernels))


@dataclass(frozen=True, kw_only=True)
class Timeline:
    """One rank's device timeline as arrays (µs).

    ``device`` is "gpu" when the trace has GPU kernels, else "cpu": then ``kind`` labels
    main-thread operators (computation) and communication comes from the main thread's c10d
    calls, gloo worker annotations and the main thread's waits for synchronous collectives
    (entries named `MAIN_THREAD_WAIT`, row -1: no event records them), so the same
    breakdown/overlap code serves CPU runs. ``launch_us`` (GPU only) is when the host
    launched each kernel (NaN when the launch is not in the trace). ``rows`` are the
    entries' row indices in the rank's event table (stream, category...).
    """

    device: str
    start_us: np.ndarray
    end_us: np.ndarray
    kind: np.ndarray
    name_id: np.ndarray
    window_us: tuple[float, float]
    launch_us: np.ndarray | None = None
    rows: np.ndarray | None = None
    # CPU only: the main thread's own c10d calls and its waits for collectives. They often run nested
    # inside an operator that counts as computation (DDP's all-reduce inside autograd's AccumulateGrad,
    # FSDP's waits inside its post-backward): that time is not compute.
    main_comm_us: tuple[np.ndarray, np.ndarray] | None = None
    # CPU only: each collective from its issuing call to the start of its worker's span (`with_queues`).
    queued_us: tuple[np.ndarray, np.ndarray] | None = None

    def compute_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Computation intervals; on CPU without the main thread's time inside c10d calls."""
        comp = (self.start_us[self.kind == COMPUTATION], self.end_us[self.kind == COMPUTATION])
        if self.main_comm_us is not None and self.main_comm_us[0].size:
            return iv.subtract(comp, self.main_comm_us)
        return comp

    def comm_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """Communication entries: NCCL kernels; on CPU c10d calls, gloo worker spans and the thread's waits."""
        comm = self.kind == COMMUNICATION
        return self.start_us[comm], self.end_us[comm]

    def in_flight_intervals(self) -> tuple[np.ndarray, np.ndarray]:
        """When a collective was in flight: `comm_intervals`, and on CPU the queued time before a worker
        ran each one (`queued_us`). The always-on tier's host-clock durations run from issue to completion."""
        comm = self.comm_intervals()
        if self.queued_us is None or not self.queued_us[0].size:
            return comm
        return np.concatenate([comm[0], self.queued_us[0]]), np.concatenate([comm[1], self.queued_us[1]])


def with_queues(tl: Timeline, issue_us: np.ndarray, start_us: np.ndarray) -> Timeline:
    """A CPU timeline with its collectives' queued time: from each issuing ``c10d::`` call to the start of
    the worker span it was paired with (`rank_collectives`: a group's workers run its collectives in
    issue order).

    A gloo worker starts a collective once it is free and the OS has scheduled it: on a busy host the
    work waits a millisecond or more after its issue, no worker span covering it. It was in flight (the
    always-on tier's duration runs from the issue to the completion), but no thread waited in that time:
    it counts in the communication time (`comm_overlap`'s comm_s), not as exposed. GPU timelines are
    returned as they are (a kernel's queue on its stream is not read from traces).
    """
    if tl.device != "cpu":
        return tl
    issue_us, start_us = np.asarray(issue_us, dtype=np.float64), np.asarray(start_us, dtype=np.float64)
    keep = np.isfinite(issue_us) & (start_us > issue_us)
    return replace(tl, queued_us=(issue_us[keep], start_us[keep]))


def step_spans(events: Table, symbols: SymbolTable) -> Table:
    """``ProfilerStep#N`` spans: columns step, start_us, end_us (sorted by start)."""
    ids = symbols.ids_matching(r"^ProfilerStep#\d+$")
    dur = events["dur_us"]
    rows = np.flatnonzero(np.isin(events["name_id"], ids) & ~np.isnan(dur))
    steps = np.asarray([int(symbols[i].split("#")[1]) for i in events["name_id"][rows].tolist()], dtype=np.int64)
    ts = events["ts_us"][rows]
    return Table({"step": steps, "start_us": ts, "end_us": ts + dur[rows]}).sort("start_us")


def _gpu_rows(events: Table, symbols: SymbolTable, exclude_last_step: bool) -> np.ndarray:
    """Indices of GPU events (stream >= 0 with a launch correlation), HTA's iteration filter applied.

    HTA drops kernels launched at or after the start of the last ProfilerStep (that step
    is usually cut off by the end of the profiling window) when a trace has two or more
    steps; ``exclude_last_step`` does the same so the numbers are comparable.
    """
    corr = events["correlation"]
    gpu_mask = (events["stream"] >= 0) & (corr >= 0)
    keep = gpu_mask & ~np.isnan(events["dur_us"])
    if exclude_last_step and keep.any():
        steps = step_spans(events, symbols)
        if np.unique(steps["step"]).size >= 2:
            launched = corr[~gpu_mask & (events["ts_us"] < steps["start_us"].max())]
            keep &= np.isin(corr, launched[launched >= 0])
    return np.flatnonzero(keep)


def _launch_times(events: Table, correlation: np.ndarray) -> np.ndarray:
    """Start of the host event (cudaLaunchKernel, cudaMemcpyAsync...) sharing each correlation id."""
    host = (events["stream"] < 0) & (events["correlation"] >= 0)
    if not host.any():
        return np.full(correlation.size, np.nan)
    corr = events["correlation"][host]
    order = np.argsort(corr, kind="stable")
    corr, ts = corr[order], events["ts_us"][host][order]
    at = np.minimum(np.searchsorted(corr, correlation), corr.size - 1)
    return np.where(corr[at] == correlation, ts[at], np.nan)


def rank_timeline(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns, *,
                  exclude_last_step: bool = True, hta_rounding: bool = False) -> Timeline:
    """Build `trace`'s timeline (GPU kernels if any, else the CPU main thread + gloo).

    ``hta_rounding`` reproduces HTA 0.5's handling of sub-µs timestamps (start rounded
    up, end rounded down to whole µs), which shortens every kernel by up to 1 µs; off by
    default because it biases short kernels (see docs in the package README).
    """
    ev = trace.table
    gpu = _gpu_rows(ev, symbols, exclude_last_step)
    if gpu.size:
        comm_ids = symbols.ids_matching(patterns.nccl_regex())
        mem_ids = symbols.ids_matching(r"Memcpy|Memset")
        names = ev["name_id"][gpu]
        kind = np.full(gpu.size, COMPUTATION, dtype=np.int8)
        kind[np.isin(names, mem_ids)] = MEMORY
        kind[np.isin(names, comm_ids)] = COMMUNICATION
        s = ev["ts_us"][gpu]
        e = s + ev["dur_us"][gpu]
        if hta_rounding and np.any(s != np.floor(s)):
            s, e = np.ceil(s), np.floor(e)
        return Timeline(device="gpu", start_us=s, end_us=e, kind=kind, name_id=names,
                        window_us=(float(s.min()), float(e.max())),
                        launch_us=_launch_times(ev, ev["correlation"][gpu]), rows=gpu)
    return _cpu_timeline(trace, symbols, patterns)


def _mode(values: np.ndarray) -> int:
    """Most frequent value (the smallest of ties, as pandas' mode)."""
    uniq, counts = np.unique(values, return_counts=True)
    return int(uniq[np.argmax(counts)])


def main_thread(trace: RankTrace, symbols: SymbolTable) -> int:
    """Tid of the training loop: the one with ProfilerStep spans, else tid == pid, else busiest."""
    ev = trace.table
    steps = np.isin(ev["name_id"], symbols.ids_matching(r"^ProfilerStep#\d+$"))
    if steps.any():
        return _mode(ev["tid"][steps])
    cpu = (ev["stream"] < 0) & ~np.isnan(ev["dur_us"])
    same = cpu & (ev["tid"] == ev["pid"])
    if same.any():
        return _mode(ev["tid"][same])
    if not cpu.any():
        return -1
    tids, inverse = np.unique(ev["tid"][cpu], return_inverse=True)
    return int(tids[np.argmax(np.bincount(inverse, weights=ev["dur_us"][cpu]))])


def _scope_waits(ev: Table, symbols: SymbolTable, patterns: CommPatterns, tid: int, s: np.ndarray,
                 e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The main thread's waits inside the collectives a framework annotates, on a CPU trace.

    FSDP's `FSDP::all_gather (i)`, `FSDP::post_backward_reduce (i)`: a collective's `wait()` is
    no operator, so the time the thread blocks in it shows only as the self time of whatever
    encloses it (an autograd operator such as `RegisterPostBackwardFunctionBackward`). Inside
    such a scope, the time outside any leaf operator is the wait; leaf operators there (FSDP's
    copy-in/copy-out) are compute.
    """
    scope_rows = np.flatnonzero(~np.isnan(ev["dur_us"]) & (ev["tid"] == tid)
                                & np.isin(ev["name_id"], symbols.ids_matching(patterns.comm_scopes)))
    if scope_rows.size == 0 or s.size == 0:
        return np.empty(0), np.empty(0)
    scopes = (ev["ts_us"][scope_rows], ev["ts_us"][scope_rows] + ev["dur_us"][scope_rows])
    leaf = _leaves(s, e)
    return iv.subtract(scopes, (s[leaf], e[leaf]))


def _leaves(s: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Which of one thread's events contain no other (operators nest: a parent's next event starts inside it)."""
    order = np.lexsort((-e, s))  # by start, the enclosing event first
    leaf = np.ones(s.size, dtype=bool)
    leaf[order[:-1]] = s[order[1:]] >= e[order[:-1]]
    return leaf


def _synchronous_waits(s: np.ndarray, e: np.ndarray, is_comm_issue: np.ndarray, worker_end: np.ndarray,
                       marks: np.ndarray, step_marks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The main thread's waits for collectives it called synchronously (CPU trace, µs).

    A synchronous collective (``dist.all_reduce(t)``) records its ``c10d::`` operator while it
    issues the work, then blocks in ``Work.wait()``, which records nothing: the thread shows a
    gap that ends when it wakes up after the gloo worker's span. That gap is the collective's
    as the training step sees it (the always-on tier times the call, return included). A gap
    on the main thread counts as such a wait when the last thing before it was a collective's
    issue and the thread's next event (`marks`: the starts of its operators and annotations)
    began within `SYNC_WAKE_US` of a worker span's end inside the gap: a thread that went on
    with Python work after an asynchronous call does not resume on a worker's completion. A gap
    that ends where a ``ProfilerStep#`` begins (`step_marks`) held the profiler's own step,
    milliseconds of Python: it is left out.
    """
    if s.size == 0 or worker_end.size == 0 or not is_comm_issue.any():
        return np.empty(0), np.empty(0)
    # The thread is busy in its leaf operators and in its c10d calls (whatever those contain).
    keep = _leaves(s, e) | is_comm_issue
    bs, be = iv.merge(s[keep], e[keep])
    gs = be[:-1]
    marks = np.sort(marks)
    ge = marks[np.minimum(np.searchsorted(marks, gs, side="right"), marks.size - 1)]  # the thread's next event
    ge = np.minimum(ge, bs[1:])
    after_issue = np.isin(gs, e[is_comm_issue])
    ends = np.sort(worker_end)
    # the last worker end at or before the gap's end (or just after it: a span bounded by the copy that follows)
    last = np.searchsorted(ends, ge + SPAN_BOUND_SLACK_US, side="right") - 1
    last_end = ends[np.maximum(last, 0)]
    waited = (after_issue & (last >= 0) & (last_end > gs) & (ge - last_end <= SYNC_WAKE_US)
              & ~np.isin(ge, step_marks))
    return gs[waited], ge[waited]


def gloo_span_ends(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns, rows: np.ndarray, *,
                   tid: int | None = None, steps: Table | None = None) -> np.ndarray:
    """The ends (µs) of the gloo worker spans at `rows`, DDP buckets' bounded by the reducer's use of them.

    Both readers of gloo spans take their ends from here: the CPU timeline (`rank_timeline`) and the
    per-collective table (`_collectives.rank_collectives`). `tid` (the main thread) and `steps`
    (`step_spans`) are found when not given.

    A gloo worker thread closes its span in a callback that runs after it completed the work and woke
    the waiting thread. On a busy host the woken training thread often takes the core first, and the
    span then ends milliseconds late: traces from 2 ranks on 2 cores showed 1.3-3.5 ms, past the
    optimizer and into the next step, while the reducer had copied the results right after
    its wait. A collective cannot end after its result was used. So a span started during a step's
    backward, before the reducer's last `copy_bucket_to_grad` of that step, ends at the latest when
    that copy ends: by then the reducer has waited for every bucket (its finalize waits for a bucket,
    then copies it). A worker may start a bucket after the first copy: queued behind the others, or
    not yet scheduled on a busy host (compiled DDP's last bucket, 1 ms after its issue). The step's
    first-issued span (bucket 0, the first the reducer waits for)
    ends at the latest when its first copy starts. Without such copies (`gradient_as_bucket_view`, no DDP) the
    spans are kept as they are.
    """
    ev = trace.table
    ws = ev["ts_us"][rows]
    out = ws + ev["dur_us"][rows]
    steps = step_spans(ev, symbols) if steps is None else steps
    if ws.size == 0 or len(steps) == 0:
        return out
    tid = main_thread(trace, symbols) if tid is None else tid
    on_main = ~np.isnan(ev["dur_us"]) & (ev["tid"] == tid)
    copies = np.flatnonzero(on_main & np.isin(ev["name_id"], symbols.ids_matching(patterns.reducer_copies)))
    if copies.size == 0:
        return out
    backward = np.flatnonzero(on_main & np.isin(ev["name_id"], symbols.ids_matching(patterns.backward_ops)))
    st, en = steps["start_us"].astype(float), steps["end_us"].astype(float)
    cs, ce = ev["ts_us"][copies], ev["ts_us"][copies] + ev["dur_us"][copies]
    bs = np.sort(ev["ts_us"][backward])
    n = st.size
    first_copy, last_copy, last_copy_end, first_bwd = (np.full(n, np.nan) for _ in range(4))
    k_copy = np.searchsorted(st, cs, side="right") - 1
    in_step = (k_copy >= 0) & (cs < en[np.maximum(k_copy, 0)])
    for k in np.unique(k_copy[in_step]):
        mine = in_step & (k_copy == k)
        first_copy[k], last_copy[k], last_copy_end[k] = cs[mine].min(), cs[mine].max(), ce[mine].max()
        i = np.searchsorted(bs, st[k])
        if i < bs.size and bs[i] < first_copy[k]:
            first_bwd[k] = bs[i]
    k_span = np.searchsorted(st, ws, side="right") - 1
    k = np.maximum(k_span, 0)
    bounded = (k_span >= 0) & (ws < en[k]) & (ws >= first_bwd[k]) & (ws < last_copy[k])  # NaN compares False
    out[bounded] = np.minimum(out[bounded], last_copy_end[k[bounded]])
    # The first bucket launched is the first the reducer waits for, before its first copy: its span ends by
    # then (a single-bucket model's all-reduce, which the training thread waits for from its last launch on).
    rows_b = np.flatnonzero(bounded)
    if rows_b.size:
        first = rows_b[np.lexsort((ws[rows_b], k[rows_b]))]
        first = first[np.r_[True, k[first][1:] != k[first][:-1]]]  # the earliest-issued span of each step
        out[first] = np.minimum(out[first], first_copy[k[first]])
    return out


def _cpu_timeline(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns) -> Timeline:
    ev = trace.table
    timed = ~np.isnan(ev["dur_us"])
    tid = main_thread(trace, symbols)
    names_all = ev["name_id"]
    # The main thread's operators, and its annotated Python work (a framework's hooks, the optimizer
    # step): the host's compute on CPU. Not the step markers, data loading or communication scopes.
    on_main = timed & (ev["tid"] == tid)
    # torsh-tune's own phase annotations span communication waits too (phase_table reads them).
    annotated = (on_main & (ev["cat_id"] == symbols.id_of("user_annotation"))
                 & ~np.isin(names_all, symbols.ids_matching(
                     rf"^ProfilerStep#|{LOADER_ANNOTATION}|{patterns.gloo_worker}|{patterns.comm_scopes}"
                     rf"|^{re.escape(PHASE_ANNOTATION_PREFIX)}")))
    # A Work.wait() torsh-tune annotated in its window (`WAIT_ANNOTATION`) is the thread blocked on a collective.
    waited = on_main & np.isin(names_all, symbols.ids_matching(f"^{re.escape(WAIT_ANNOTATION)}$"))
    main = np.flatnonzero((on_main & (ev["cat_id"] == symbols.id_of("cpu_op"))) | annotated | waited)
    worker = np.flatnonzero(timed & np.isin(names_all, symbols.ids_matching(patterns.gloo_worker)))
    is_comm_issue = np.isin(names_all[main], symbols.ids_matching(patterns.c10d_ops))
    # An operator that blocks until a collective finishes (a functional collective's `wait_tensor`, at a
    # DTensor's first use) is the step waiting for communication, not compute; so is the time a
    # functional collective's own operators take to issue it (the always-on side times the call).
    is_comm = is_comm_issue | np.isin(names_all[main], symbols.ids_matching(f"{patterns.comm_waits}|{patterns.funcol_ops}"))
    rows = np.concatenate([main, worker])
    s = ev["ts_us"][rows]
    e = s + ev["dur_us"][rows]
    steps = step_spans(ev, symbols)
    e[main.size:] = gloo_span_ends(trace, symbols, patterns, worker, tid=tid, steps=steps)
    kind = np.concatenate([np.where(is_comm, COMMUNICATION, COMPUTATION).astype(np.int8),
                           np.full(worker.size, COMMUNICATION, dtype=np.int8)])
    if len(steps):
        window = (float(steps["start_us"].min()), float(steps["end_us"].max()))
    elif s.size:
        window = (float(s.min()), float(e.max()))
    else:
        window = (0.0, 0.0)
    # Its waits for synchronous collectives (no event records them) are communication. Neither those
    # nor the time in FSDP's scopes outside its operators is the compute of an operator enclosing them;
    # the scopes are not communication as a whole: they hold the Python of FSDP's hooks too.
    ms, me = s[:main.size], e[:main.size]
    scoped = _scope_waits(ev, symbols, patterns, tid, ms, me)
    marks = ev["ts_us"][on_main]
    waits = _synchronous_waits(ms, me, is_comm_issue, e[main.size:], marks, steps["start_us"])
    main_comm = tuple(np.concatenate([x[is_comm], y, z]) for x, y, z in zip((ms, me), scoped, waits))
    n = waits[0].size
    names = np.concatenate([names_all[rows], np.full(n, symbols.intern(MAIN_THREAD_WAIT), dtype=names_all.dtype)])
    rows = np.concatenate([rows, np.full(n, -1, dtype=rows.dtype)])
    kind = np.concatenate([kind, np.full(n, COMMUNICATION, dtype=np.int8)])
    return Timeline(device="cpu", start_us=np.concatenate([s, waits[0]]), end_us=np.concatenate([e, waits[1]]),
                    kind=kind, name_id=names, window_us=window, rows=rows, main_comm_us=main_comm)
