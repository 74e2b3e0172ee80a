"""The record schema shared by the in-rank writers (profiler) and the readers (analysis).

It lives below both layers so that `analysis` can know the columns without importing the
profiler (which imports torch). One JSON object per line; timestamps are Unix seconds
(`time.time()` base, `perf_counter` resolution), durations are seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = [
    "CommRecord",
    "RECORD_KINDS",
    "StepRecord",
    "SystemRecord",
    "columns_of",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepRecord:
    """One optimizer step of one rank. A step runs from the previous step's end to this one's."""

    rank: int
    step: int  # 0-based optimizer step index on this rank
    t_start: float  # Unix s: end of the previous step (or first forward for step 0)
    t_end: float  # Unix s: return of optimizer.step()
    step_s: float  # t_end - t_start
    data_s: float  # time blocked in DataLoader __next__ during the step
    forward_s: float  # time inside the DDP (or root) module's forward, summed over micro-batches
    backward_s: float  # time inside backward() calls, including communication DDP waits for
    optimizer_s: float  # time inside optimizer.step()
    comm_s: float  # wall time covered by this step's collectives (union of bucket intervals)
    exposed_comm_s: float  # communication not hidden behind backward compute
    samples: int  # samples processed in the step (first dim of the model input)
    tokens: int | None  # tokens the script counted in the step (torsh_tune.count_tokens), None if it counts none
    num_microbatches: int  # forward passes in the step (> 1 with gradient accumulation)
    loss: float | None  # read every `profiler.loss_every` steps, else None
    peak_mem_bytes: int  # torch.cuda.max_memory_allocated on GPU, process RSS on CPU
    warmup: bool  # inside budget.warmup_steps


@dataclass(frozen=True, kw_only=True, slots=True)
class CommRecord:
    """One collective issued by a DDP comm hook (one bucket) or a traced collective."""

    rank: int
    step: int
    seq: int  # per-rank sequence number of collectives (aligns the same bucket across ranks)
    bucket: int  # DDP bucket index within the step (-1 when not a bucket)
    collective: str  # all_reduce, all_gather, ...
    hook: str  # name of the comm hook doing the work ("allreduce" for PyTorch's default)
    bytes: int  # payload of the bucket before compression
    wire_bytes: int  # bytes handed to the collective (after compression)
    num_tensors: int  # parameters/gradients in the bucket
    t_issue: float  # Unix s: hook called (gradients of the bucket ready)
    t_complete: float  # Unix s: future completed
    duration_s: float  # t_complete - t_issue (skew + contention + transfer)


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


RECORD_KINDS: dict[str, type] = {"steps": StepRecord, "comm": CommRecord, "system": SystemRecord}


def columns_of(kind: str) -> list[str]:
    """Column names of the DataFrame built from records of `kind` (steps, comm, system)."""
    return [f.name for f in fields(RECORD_KINDS[kind])]
