"""The record schema shared by the in-rank writers (profiler) and the readers (analysis).

It lives below both layers so that `analysis` can know the columns without importing the
profiler (which imports torch). One JSON object per line; timestamps are Unix seconds
(`time.time()` base, `perf_counter` resolution), durations are seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

__all__ = [
    "CommRecord",
    "PHASE_ANNOTATION_PREFIX",
    "PLANNED_FIELDS",
    "RECORD_KINDS",
    "StepRecord",
    "SystemRecord",
    "WAIT_ANNOTATION",
    "columns_of",
    "ranges_text",
]

# Inside a trace window the phase probes annotate their phases as PREFIX + forward / backward /
# optimizer (`profiler.traces`); the trace analysis maps each to its kernels' device span.
PHASE_ANNOTATION_PREFIX = "torsh-tune::"
# ... and the capture annotates the training thread's Work.wait() on a collective it recorded (no
# profiler event records that wait): the trace analysis reads it as the thread blocked on communication.
WAIT_ANNOTATION = PHASE_ANNOTATION_PREFIX + "wait"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One optimizer step of one rank. A step runs from the previous step's end to this one's.

    `clock` says what the phase fields measure. "host": what the training thread spent
    (the truth on CPU, where the host does the work). "device": CUDA events on the current
    stream at the same boundaries, read once they completed: what the GPU spent; the host's
    times are then kept in the `host_*_s` fields (launch time and host waits).
    """

    rank: int
    step: int  # 0-based optimizer step index on this rank
    t_start: float  # Unix s (host): end of the previous step (or first activity for step 0)
    t_end: float  # Unix s (host): return of optimizer.step()
    step_s: float  # the step, in `clock`
    data_s: float  # host: blocked in DataLoader __next__; device: time before the first forward
    forward_s: float  # in the probed module's forward (DDP, FSDP root, compiled wrapper), summed over micro-batches
    backward_s: float  # inside backward() calls, including communication waited for there
    optimizer_s: float  # inside optimizer.step()
    comm_s: float  # union of the step's collective intervals
    exposed_comm_s: float  # communication the step waited for (not hidden behind compute)
    samples: int  # samples processed in the step (first dim of the model input or the DataLoader batch)
    tokens: int | None  # tokens the script counted in the step (torsh_tune.count_tokens), None if it counts none
    num_microbatches: int  # forward passes in the step (> 1 with gradient accumulation)
    loss: float | None  # read every `profiler.loss_every` steps, else None
    # torch.cuda.max_memory_allocated on GPU; process peak RSS on CPU, past the detailed steps read once per batch
    # of 16 records when they are written (an upper bound where RSS grew within the batch)
    peak_mem_bytes: int
    warmup: bool  # inside budget.warmup_steps
    clock: str | None = None  # "host" or "device" (None: records written before clocks were recorded)
    forward_exposed_comm_s: float | None = None  # exposed comm inside the forward (FSDP all-gathers)
    backward_exposed_comm_s: float | None = None  # ... inside the backward (DDP's last buckets, reduce-scatters)
    optimizer_exposed_comm_s: float | None = None  # ... inside optimizer.step()
    host_step_s: float | None = None  # device clock only: the host's view of the same fields
    host_data_s: float | None = None
    host_forward_s: float | None = None
    host_backward_s: float | None = None
    host_optimizer_s: float | None = None
    # False: DDP's builtin all-reduce of this step was not timed (PyTorch samples its CUDA timers at
    # iterations 1-10 and every 100th; on CPU `profiler.ddp_timers_every` picks the steps read; a
    # run's last step is reported at a forward that never comes):
    # comm_s and exposed_comm_s are unknown, not 0, and the analysis leaves the step out of them.
    comm_timed: bool = True
    # Host seconds the training thread spent saving checkpoints in this step (torch.save, distributed
    # checkpointing's save and async_save's blocking part; nested calls once): I/O that blocks the step,
    # on the host clock whatever `clock` says. Absent: no save in the step.
    checkpoint_s: float | None = None
    # An evaluation pass in this step: forwards of the trained module without gradients and in eval mode
    # (a validation loop between steps). Host seconds from the first batch fetched for it to the end of its
    # last forward, less the training phases in between, whatever `clock` says; those batches' fetches are
    # not in `data_s`, its forwards not in `forward_s`, `samples` or `num_microbatches`. Absent: none.
    eval_s: float | None = None
    eval_batches: int | None = None  # its forwards
    eval_samples: int | None = None  # their batches' first dimension, summed
    # Host seconds the training thread spent starting a DataLoader iterator's worker processes (`iter()` of a
    # loader with workers: every epoch unless it keeps them, `persistent_workers`) and shutting an exhausted
    # iterator's down, in this step, whatever `clock` says; not in `data_s` (the waits for batches, the new
    # workers' first one included). An evaluation loader's are its pass's. Absent: none.
    loader_restart_s: float | None = None
    loader_starts: int | None = None  # worker processes those starts launched; absent: none
    # The probed DDP model's forwards in this step whose backward all-reduced the gradients (outside
    # `no_sync`), when more than one: gradient accumulation that synchronizes every micro-batch. Each of
    # those all-reduces has its CommRecord (DDP's builtin all-reduce: read at the forward after it). Absent: 0 or 1.
    ddp_syncs: int | None = None
    # The step inside a deep-trace window: "recorded" (the profiler recorded it, which slows it) or "warmup"
    # (the step the window's profiler started in, before recording). Absent: no window. The analysis leaves
    # these steps out of the step statistics where enough others remain (`analysis.measured`).
    trace: str | None = None


#: StepRecord fields of host seconds a step spends slow by design, rare and long (phase name -> field): an
#: evaluation pass, a checkpoint save, a DataLoader starting its workers again (what a loader without
#: persistent workers does every epoch). The median step never shows them, they are findings of their own,
#: never a stall or a spike.
PLANNED_FIELDS = {"evaluation": "eval_s", "checkpoint": "checkpoint_s", "loader": "loader_restart_s"}


#: Issuers (`CommRecord.issuer`) that are training frameworks: besides the gradients' collectives they issue
#: their own (flags, counters, logged values), which the records name by where they are called from.
FRAMEWORK_ISSUERS = frozenset({"lightning", "accelerate", "transformers", "deepspeed"})
#: A framework's collective of at most this payload per call is a flag, a counter or a logged value, not
#: the gradients a framework like DeepSpeed averages itself.
FRAMEWORK_SYNC_MAX_BYTES = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class CommRecord:
    """One collective or p2p operation at the c10d layer (whoever issued it), or one DDP step's builtin all-reduce.

    `clock` says what `duration_s` measures: "device" (NCCL: CUDA events around the
    collective on the stream it was issued from, read later) or "host" (gloo: until the
    call returned or its future completed).
    """

    rank: int
    step: int
    seq: int  # per-rank sequence number of collectives (aligns the same collective across ranks)
    bucket: int  # DDP bucket index (-1 when not a bucket)
    collective: str  # all_reduce, all_gather_into_tensor, reduce_scatter_tensor, broadcast, send, ...
    hook: str | None = None  # the DDP comm hook that issued it ("allreduce", "builtin" for the reducer's own)
    bytes: int  # bytes of the collective (nccl-tests' size: the whole gathered/scattered buffer)
    wire_bytes: int  # bytes handed to the collective (after compression)
    num_tensors: int | None = None  # gradients in the DDP bucket
    t_issue: float  # Unix s (host): the call was made
    t_complete: float | None = None  # Unix s: completed (device clock: on the step's device timeline, anchored at its host start)
    duration_s: float | None = None  # in `clock`: skew + contention + transfer (None: never seen complete)
    issuer: str | None = None  # ddp, fsdp, pipeline, user, accelerate, transformers, lightning, dtensor, checkpoint
    # The function that called torch.distributed, "module:qualname" (a script's file name for its __main__):
    # the first frame outside c10d's plumbing, the one the issuer is read from. A framework's call adds
    # " via module:qualname", the first frame above it outside that framework and torch (the Trainer method
    # that called accelerate's gather, the script line that called fit). None: DDP's C++ reducer.
    origin: str | None = None
    group: str | None = None  # process group: "world" or its name
    group_ranks: list[int] | None = None  # global ranks of the group
    group_size: int | None = None
    backend: str | None = None  # nccl, gloo
    dtype: str | None = None
    grad_bytes: int | None = None  # DDP: gradient bytes of the bucket (before compression)
    async_op: bool | None = None
    blocked_s: float | None = None  # host: how long the training thread waited in the call or Work.wait()
    issue_s: float | None = None  # async_op: how long the issuing call itself took (host; part of blocked_s)
    clock: str | None = None  # "device" or "host"
    stream: str | None = None  # device clock: "default" (the compute stream) or "side"
    t_start: float | None = None  # device clock: started, on the step's device timeline
    # async_op (not a DDP bucket's): the probed phase its issue fell in ("forward", "backward", "optimizer"),
    # None outside them. An engine overlapping its gradients' all-reduces issues them in "backward".
    # Any call an evaluation pass issued (between its first fetch and the moment training resumed, e.g. a
    # metric's all-reduce): "evaluation", and it is not in the step's comm_s or exposed_comm_s.
    phase: str | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class SystemRecord:
    """A sample from the system sampler thread."""

    rank: int
    t: float  # Unix s
    cpu_pct: float  # this process (and its DataLoader workers), % of one core
    sys_cpu_pct: float  # whole machine, % of all cores
    rss_bytes: int  # this process plus its children
    mem_total_bytes: int  # physical memory of the host
    gpu_util_pct: float | None
    gpu_mem_used_bytes: int | None
    gpu_mem_total_bytes: int | None
    gpu_power_w: float | None
    pcie_tx_bytes_per_s: float | None
    pcie_rx_bytes_per_s: float | None
    nvlink_tx_bytes_per_s: float | None = None
    nvlink_rx_bytes_per_s: float | None = None
    cpu_cores: int | None = None  # cores this process may run on (its affinity mask)
    idle_cores: float | None = None  # how many of those were idle since the previous sample
    t_since: float | None = None  # Unix s: the CPU numbers are averages over (t_since, t], since the previous sample


RECORD_KINDS: dict[str, type] = {"steps": StepRecord, "comm": CommRecord, "system": SystemRecord}


def columns_of(kind: str) -> list[str]:
    """Column names of the DataFrame built from records of `kind` (steps, comm, system)."""
    return [f.name for f in fields(RECORD_KINDS[kind])]


def ranges_text(values: Iterable[int]) -> str:
    """Rank or step numbers as messages and reports name them: "3, 5-7" (sorted, runs of consecutive numbers
    joined)."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
