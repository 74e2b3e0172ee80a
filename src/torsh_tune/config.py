"""Run configuration: frozen dataclasses, TOML/JSON (de)serialisation and validation.

One `RunConfig` document describes a run. The CLI builds it from a TOML file overlaid with
flags; the launcher serialises it to JSON and hands it to every rank through a single
environment variable, where `RunConfig.from_json` parses it once.

Every field carries its help text in `metadata["help"]`; the CLI uses that text verbatim.
All cross-field validation lives in `RunConfig.validate` (one place, as in torchtitan's
`ParallelDims._validate`).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from .errors import ConfigError, int_at_least, invalid

__all__ = [
    "BACKENDS",
    "COMPRESSION_METHODS",
    "PIPELINE_SCHEDULES",
    "STRATEGY_KINDS",
    "BudgetConfig",
    "CollectivesConfig",
    "CompressionConfig",
    "DDPConfig",
    "DataLoaderConfig",
    "DistEnv",
    "DistributedConfig",
    "FSDPConfig",
    "LaunchConfig",
    "PipelineConfig",
    "ProfilerConfig",
    "RunConfig",
    "STUDY_DEFAULT_STEPS",
    "STUDY_OBJECTIVES",
    "STUDY_PRUNERS",
    "STUDY_SAMPLERS",
    "StrategyConfig",
    "StudyConfig",
    "ThresholdsConfig",
    "TrainingConfig",
    "dist_env",
    "dump_toml",
    "help_of",
    "parse_trace_window",
]

BACKENDS = ("auto", "gloo", "nccl")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How torchrun is started."""

    nproc_per_node: int = _f(1, "Worker processes per node (torchrun --nproc-per-node).")
    nnodes: int = _f(1, "Number of nodes; > 1 uses rendezvous instead of --standalone.")
    node_rank: int | None = _f(None, "This node's rank for static rendezvous (torchrun --node-rank).")
    rdzv_backend: str = _f("c10d", "Rendezvous backend for multi-node runs (c10d, etcd, static).")
    rdzv_endpoint: str | None = _f(None, "HOST:PORT of the rendezvous for multi-node runs.")
    rdzv_id: str | None = _f(None, "Rendezvous job id shared by all nodes (default: the run name).")
    backend: Literal["auto", "gloo", "nccl"] = _f(
        "auto", "Process-group backend: auto picks nccl when CUDA is available, else gloo."
    )
    launcher: str | None = _f(
        None, "Command template wrapping torchrun for clusters, e.g. 'srun -N2 {cmd}'."
    )
    max_restarts: int = _f(0, "torchrun elastic restarts after a worker failure.")
    env: dict = _f({}, "Extra environment variables for every rank.")


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """How long a run may go on."""

    steps: int | None = _f(
        None, "Measured optimizer steps after warm-up; the script is stopped cleanly on every rank after them."
    )
    warmup_steps: int = _f(5, "Steps excluded from statistics at the start of the run (more when a DataLoader's "
                                 "workers prefetched batches before the loop: those steps are warm-up too).")
    timeout_s: float | None = _f(None, "Wall-clock limit of the whole run in seconds (each rank's Python stacks at "
                                       "the stop go to ranks/rankNNNNN.stacks.txt).")
    no_progress_timeout_s: float = _f(
        300.0, "A run that writes no step record for this many seconds (counted from the launch, and again "
               "from each rank's start) is a hang and is stopped (each rank's Python stacks at the stop go to "
               "ranks/rankNNNNN.stacks.txt)."
    )
    kill_grace_s: float = _f(10.0, "Seconds between SIGTERM and SIGKILL when a run is stopped.")


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """The always-on profiler inside each rank."""

    enabled: bool = _f(True, "Record step, communication and system records.")
    loss_every: int = _f(10, "Read the loss every k steps (on GPU copied to pinned memory on the stream and read "
                             "once the step completed: no sync).")
    system_interval_s: float = _f(1.0, "Seconds between system samples (CPU, RSS, NVML).")
    flush_interval_s: float = _f(1.0, "Records are flushed to disk at least this often.")
    data_fingerprint: bool = _f(
        False,
        "Hash the samples each rank reads in the measured steps (meta.json data_fingerprint), for the tuner's "
        "data-integrity guard; the tuner turns it on for its own runs (a few numpy operations per batch).",
    )
    comm_hook_timing: bool = _f(
        False,
        "Route every DDP bucket through a Python all-reduce hook, so that each bucket's collective is captured "
        "(per-bucket records; a future hop per bucket: ~65 us per bucket on a 2-core gloo host, "
        "~1.3 ms per step measured on an H100). "
        "Off: PyTorch's C++ all-reduce stays and DDP's own timers give one record per step (on CUDA: at the "
        "iterations DDP samples, 1-10 then every 100th), the reducer's window from its first bucket's issue to "
        "the end of its finalize (on a 2-core gloo host 3-8 pp above the trace's comm share, within 2 pp per "
        "bucket); a Python hook (the script's or compression) is always captured per bucket.",
    )
    ddp_timers_every: int = _f(
        8,
        "On CPU, read DDP's all-reduce timers (one record per step from the reducer) in every step of the "
        "warm-up, the first 20 measured steps and every trace window, then every k-th step; a step not read "
        "says comm_timed: false and the analysis leaves it out of its communication numbers. DDP's own "
        "sample rate follows (its runtime stats cost ~25-50 us per iteration). A read costs ~50-110 us on "
        "a 2-core host (benchmarks/_probe_ablation.py); 8 against 4: ~-20 us per step; 1: every step (also "
        "with two DDP models, whose iterations differ). On CUDA PyTorch's own sampling of its timers applies.",
    )
    trace_window: str | None = _f(
        None, "Deep-trace steps START:LEN with torch.profiler, e.g. '20:5' traces steps 20-24 (0-based, as in step records)."
    )
    trace_every: int | None = _f(None, "Deep-trace trace_len steps every N steps (windows start at steps N, 2N, ...).")
    trace_len: int = _f(3, "Steps per deep-trace window for trace_every and trace_on_anomaly.")
    trace_on_anomaly: bool = _f(
        False, "Deep-trace trace_len steps when a step is slower than trace_anomaly_factor x the running median step."
    )
    trace_anomaly_factor: float = _f(2.0, "A step slower than this many times the running median step is an anomaly.")
    trace_max_windows: int = _f(3, "At most this many anomaly-triggered deep-trace windows per run.")
    trace_shapes: bool = _f(False, "Record operator input shapes in deep traces (torch.profiler record_shapes).")
    trace_stack: bool = _f(False, "Record Python stacks in deep traces (torch.profiler with_stack; costly).")
    trace_memory: bool = _f(False, "Record allocations in deep traces (torch.profiler profile_memory).")

    @property
    def trace_window_steps(self) -> tuple[int, int] | None:
        """`trace_window` as (first step, number of steps), or None when unset."""
        return None if self.trace_window is None else parse_trace_window(self.trace_window)

    @property
    def traces_enabled(self) -> bool:
        """Whether any deep-trace window can open in this run."""
        return self.trace_window is not None or self.trace_every is not None or self.trace_on_anomaly


def parse_trace_window(text: str) -> tuple[int, int]:
    """Parse "START:LEN" (e.g. "20:5": steps 20-24) into (start, length).

    Raises:
        ConfigError: not two integers START >= 0 and LEN >= 1 separated by a colon.
    """
    rule = "START:LEN with integers START >= 0 and LEN >= 1 (e.g. '20:5')"
    parts = text.split(":") if isinstance(text, str) else []
    try:
        start, length = (int(x) for x in parts)
    except ValueError:
        raise invalid("profiler.trace_window", rule, text) from None
    if start < 0 or length < 1:
        raise invalid("profiler.trace_window", rule, text)
    return start, length


@dataclass(frozen=True, kw_only=True)
class ThresholdsConfig:
    """Bottleneck and alert thresholds (the ToRSh guide's defaults)."""

    comm_high_pct: float = _f(30.0, "Exposed communication above this % of step time is high.")
    comm_critical_pct: float = _f(50.0, "Exposed communication above this % of step time is critical.")
    memory_high_pct: float = _f(85.0, "Peak memory above this % of capacity is high.")
    memory_critical_pct: float = _f(95.0, "Peak memory above this % of capacity is critical.")
    gpu_util_medium_pct: float = _f(80.0, "GPU utilisation below this % is a medium bottleneck.")
    io_high_pct: float = _f(10.0, "Data-loading wait above this % of step time is high.")
    io_critical_pct: float = _f(30.0, "Data-loading wait above this % of step time is critical.")
    eval_high_pct: float = _f(
        10.0, "Evaluation passes between steps above this % of the measured time are high (above half of it, medium)."
    )
    straggler_pct: float = _f(
        10.0, "A rank later than the others by this % of the step is a straggler (medium; high above 2x, critical above 3x)."
    )
    alert_duration_s: float = _f(
        10.0, "Seconds a metric must stay past its alert threshold before an alert fires (the ToRSh monitor's duration; "
        "step-time spikes fire at once)."
    )
    alert_gpu_util_pct: float = _f(50.0, "Alert when a rank's GPU utilisation stays below this % (critical below half of it).")
    alert_cpu_util_pct: float = _f(
        50.0, "Alert when a CPU-only rank's process stays below this % of one core (it waits; critical below half of it)."
    )
    alert_memory_pct: float = _f(
        90.0, "Alert when GPU memory (or the ranks' summed RSS on a host) stays above this % of capacity "
        "(critical above memory_critical_pct)."
    )
    alert_comm_pct: float = _f(
        30.0, "Alert when exposed communication stays above this % of step time (critical above comm_critical_pct)."
    )
    alert_step_spike_factor: float = _f(
        3.0, "Alert when a measured step takes longer than this many times the median step (critical above twice it)."
    )
    selfcheck_pp: float = _f(
        10.0, "Self-check: the always-on compute, communication or exposed-communication share disagreeing with a "
        "trace window's by more than these percentage points (step time: this many %) is a finding."
    )


@dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """Process-group and per-rank settings (the ToRSh guide's [distributed])."""

    timeout_s: float | None = _f(
        None, "Timeout of collectives in seconds (init_process_group timeout; PyTorch default 600 s on gloo)."
    )
    omp_num_threads: int | None = _f(
        None, "OMP_NUM_THREADS of every rank (torchrun sets 1 for multi-process jobs); on CPU often the largest win."
    )


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """DistributedDataParallel knobs; None keeps the script's (or PyTorch's) own value."""

    bucket_cap_mb: float | None = _f(None, "Gradient bucket size in MiB (PyTorch default 25).")
    first_bucket_cap_mb: float | None = _f(None, "Size of the first bucket in MiB (PyTorch default 1).")
    bucket_cap_mb_list: list[float] | None = _f(
        None, "Size of every bucket in MiB, in order (torch 2.13's bucket_cap_mb_list); the last entry repeats."
    )
    gradient_as_bucket_view: bool | None = _f(None, "Let gradients alias bucket memory (saves a copy).")
    static_graph: bool | None = _f(None, "Declare the graph static (enables DDP optimisations).")
    find_unused_parameters: bool | None = _f(None, "Search for parameters without gradients each step.")
    broadcast_buffers: bool | None = _f(None, "Broadcast buffers from rank 0 before each forward.")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """FSDP2 (`fully_shard`) options for strategy kinds fsdp and hsdp (API mode: `torsh_tune.parallelize`)."""

    reshard_after_forward: bool | int = _f(
        True,
        "true: full shard (parameters freed after forward); false: grad-op shard (kept until backward); "
        "an integer: reshard to groups of that many ranks after forward (partial reshard, divides the shard group).",
    )
    mixed_precision: Literal["none", "fp16", "bf16"] = _f(
        "none", "Compute dtype of parameters in forward/backward (MixedPrecisionPolicy param_dtype)."
    )
    reduce_dtype: Literal["fp32", "fp16", "bf16"] | None = _f(
        None, "Dtype of the gradient reduce-scatter (default: fp32 under mixed precision)."
    )
    cpu_offload: bool = _f(False, "Keep sharded parameters and optimizer state in host memory (CPUOffloadPolicy; GPU only).")
    wrap: list[str] = _f(
        [],
        "Module names (fnmatch patterns such as 'blocks.*') sharded as units of their own; empty: every child "
        "of the model's nn.ModuleList/nn.Sequential blocks.",
    )
    replicate_degree: int | None = _f(
        None, "HSDP: replicas of the 2-D mesh (replicate x shard); default: the number of nodes."
    )


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzb", "zbv")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline parallelism with torch.distributed.pipelining (API mode)."""

    schedule: Literal["gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "interleavedzb", "zbv"] = _f(
        "1f1b", "Pipeline schedule: gpipe, 1f1b, interleaved1f1b, loopedbfs, interleavedzb or zbv."
    )
    n_microbatches: int = _f(4, "Micro-batches per step; the batch's first dimension must divide by it.")
    split_points: list[str] = _f(
        [], "Module names where a new stage begins (split before each), e.g. ['blocks.4']; stages = splits + 1."
    )
    stages_per_rank: int = _f(
        1, "Virtual stages per rank: 1 for gpipe/1f1b, >= 2 for interleaved1f1b/loopedbfs/interleavedzb, 2 for zbv."
    )


@dataclass(frozen=True, kw_only=True)
class CollectivesConfig:
    """Collective algorithms: NCCL variables set through the launcher, and the hierarchical all-reduce."""

    nccl_algo: str | None = _f(
        None, "NCCL_ALGO of every rank, e.g. 'Ring', 'Tree' or per collective 'allreduce:tree;allgather:ring'."
    )
    nccl_proto: str | None = _f(None, "NCCL_PROTO of every rank: Simple, LL or LL128 (comma-separated, '^' excludes).")
    nccl_min_nchannels: int | None = _f(None, "NCCL_MIN_NCHANNELS of every rank.")
    nccl_max_nchannels: int | None = _f(None, "NCCL_MAX_NCHANNELS of every rank.")
    hierarchical: bool = _f(
        False,
        "DDP all-reduce as intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather "
        "(a comm hook; moves 1/ranks_per_node of the bytes over the slow link).",
    )
    ranks_per_node: int | None = _f(
        None, "Node size for the hierarchical all-reduce; default: torchrun's LOCAL_WORLD_SIZE."
    )


@dataclass(frozen=True, kw_only=True)
class DataLoaderConfig:
    """DataLoader overrides applied without code changes; None keeps the script's value."""

    num_workers: int | None = _f(None, "Worker processes per DataLoader.")
    prefetch_factor: int | None = _f(None, "Batches prefetched per worker (needs num_workers > 0).")
    pin_memory: bool | None = _f(None, "Pin host memory for faster host-to-GPU copies.")
    persistent_workers: bool | None = _f(None, "Keep workers alive between epochs.")


COMPRESSION_METHODS = ("none", "fp16", "bf16", "powersgd", "topk", "int8", "adaptive")


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Gradient compression as a DDP comm hook (strategies.compression)."""

    method: Literal["none", "fp16", "bf16", "powersgd", "topk", "int8", "adaptive"] = _f(
        "none", "Gradient compression: none, fp16, bf16, powersgd, topk, int8 or adaptive (a DDP comm hook)."
    )
    ratio: float = _f(0.01, "Top-K (and adaptive's starting) fraction of each bucket's entries sent, in (0, 1].")
    rank: int = _f(4, "PowerSGD: rank of the low-rank gradient approximation (>= 1).")
    start_iter: int = _f(10, "PowerSGD: plain all-reduce for this many iterations before compressing.")
    error_feedback: bool = _f(True, "Add each bucket's compression residual to its next gradient (lossy methods).")
    min_ratio: float = _f(0.001, "Adaptive: smallest ratio it may move to, in (0, ratio].")
    max_ratio: float = _f(0.25, "Adaptive: largest ratio it may move to, in [ratio, 1].")


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """What `torsh_tune.train_step` and `parallelize` do around the user's step (API mode)."""

    gradient_accumulation_steps: int = _f(
        1, "Micro-batches per optimizer step (no_sync on all but the last); multiplies the effective batch."
    )
    max_grad_norm: float | None = _f(None, "Clip the global gradient norm to this value before each step.")
    lr_scaling: Literal["none", "linear", "sqrt"] = _f(
        "none", "Scale the optimizer's learning rates by the world size (linear) or its square root (sqrt)."
    )
    lr_warmup_steps: int = _f(0, "Ramp the (scaled) learning rates linearly over this many steps.")


STRATEGY_KINDS = ("ddp", "fsdp", "hsdp", "pipeline")


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """What is applied to the user's training: parallelism, collectives, data-loading and training knobs."""

    kind: Literal["ddp", "fsdp", "hsdp", "pipeline"] = _f(
        "ddp", "Parallelism: ddp, fsdp (FSDP2), hsdp (FSDP2 on a 2-D mesh) or pipeline (API mode for all but ddp)."
    )
    distributed: DistributedConfig = _f(DistributedConfig(), "Process-group settings.")
    ddp: DDPConfig = _f(DDPConfig(), "DDP knobs.")
    fsdp: FSDPConfig = _f(FSDPConfig(), "FSDP2/HSDP options.")
    pipeline: PipelineConfig = _f(PipelineConfig(), "Pipeline options.")
    compression: CompressionConfig = _f(CompressionConfig(), "Gradient compression.")
    collectives: CollectivesConfig = _f(CollectivesConfig(), "Collective algorithms.")
    dataloader: DataLoaderConfig = _f(DataLoaderConfig(), "DataLoader overrides.")
    training: TrainingConfig = _f(TrainingConfig(), "Training-step options.")

    def validate(self, *, world_size: int | None = None, nnodes: int | None = None) -> "StrategyConfig":
        """Check the strategy's own values and combinations; raise ConfigError on the first violation.

        `world_size`/`nnodes` add the checks that need them (HSDP mesh, pipeline stages,
        hierarchical node size); the ranks call it again with torchrun's values.
        """
        _validate_strategy(self, world_size, nnodes)
        return self

    def collective_env(self) -> dict[str, str]:
        """Environment variables every rank needs for these collective and thread settings."""
        co, di = self.collectives, self.distributed
        pairs = {
            "NCCL_ALGO": co.nccl_algo,
            "NCCL_PROTO": co.nccl_proto,
            "NCCL_MIN_NCHANNELS": co.nccl_min_nchannels,
            "NCCL_MAX_NCHANNELS": co.nccl_max_nchannels,
            "OMP_NUM_THREADS": di.omp_num_threads,
        }
        return {k: str(v) for k, v in pairs.items() if v is not None}


def _validate_strategy(st: StrategyConfig, world_size: int | None, nnodes: int | None) -> None:
    ddp, dl, co, fs, pp, cl, tr, di = (st.ddp, st.dataloader, st.compression, st.fsdp, st.pipeline,
                                       st.collectives, st.training, st.distributed)
    for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
        v = getattr(ddp, name)
        if v is not None and v <= 0:
            raise invalid(f"ddp.{name}", "a number of MiB > 0", v)
    if ddp.bucket_cap_mb_list is not None:
        if not ddp.bucket_cap_mb_list or any(v <= 0 for v in ddp.bucket_cap_mb_list):
            raise invalid("ddp.bucket_cap_mb_list", "a non-empty list of MiB > 0", ddp.bucket_cap_mb_list)
        if ddp.first_bucket_cap_mb is not None:
            raise invalid("ddp.first_bucket_cap_mb", "unset when ddp.bucket_cap_mb_list sizes every bucket",
                          ddp.first_bucket_cap_mb)
    if dl.num_workers is not None and dl.num_workers < 0:
        raise invalid("dataloader.num_workers", "an integer >= 0", dl.num_workers)
    if dl.prefetch_factor is not None:
        if dl.prefetch_factor < 1:
            raise invalid("dataloader.prefetch_factor", "an integer >= 1", dl.prefetch_factor)
        if dl.num_workers == 0:
            raise invalid("dataloader.prefetch_factor", "unset when num_workers is 0", dl.prefetch_factor)
    if dl.persistent_workers and dl.num_workers == 0:
        raise invalid("dataloader.persistent_workers", "false when num_workers is 0", True)
    if not 0 < co.ratio <= 1:
        raise invalid("compression.ratio", "a fraction in (0, 1]", co.ratio)
    if co.rank < 1:
        raise invalid("compression.rank", "an integer >= 1", co.rank)
    if co.start_iter < 0:
        raise invalid("compression.start_iter", "an integer >= 0", co.start_iter)
    if co.method == "adaptive":
        if not 0 < co.min_ratio <= co.ratio:
            raise invalid("compression.min_ratio", f"in (0, compression.ratio={co.ratio}]", co.min_ratio)
        if not co.ratio <= co.max_ratio <= 1:
            raise invalid("compression.max_ratio", f"in [compression.ratio={co.ratio}, 1]", co.max_ratio)
    if di.timeout_s is not None and di.timeout_s <= 0:
        raise invalid("distributed.timeout_s", "a number > 0", di.timeout_s)
    if di.omp_num_threads is not None and di.omp_num_threads < 1:
        raise invalid("distributed.omp_num_threads", "an integer >= 1", di.omp_num_threads)
    for name in ("nccl_min_nchannels", "nccl_max_nchannels"):
        v = getattr(cl, name)
        if v is not None and v < 1:
            raise invalid(f"collectives.{name}", "an integer >= 1", v)
    if cl.nccl_min_nchannels and cl.nccl_max_nchannels and cl.nccl_min_nchannels > cl.nccl_max_nchannels:
        raise invalid("collectives.nccl_min_nchannels", f"<= collectives.nccl_max_nchannels ({cl.nccl_max_nchannels})",
                      cl.nccl_min_nchannels)
    if cl.nccl_algo is not None:
        _check_nccl_algo(cl.nccl_algo)
    if cl.nccl_proto is not None:
        protos = [p for p in cl.nccl_proto.lstrip("^").split(",") if p]
        if not protos or any(p.lower() not in ("simple", "ll", "ll128") for p in protos):
            raise invalid("collectives.nccl_proto", "a comma-separated list of Simple, LL, LL128 (optionally after '^')",
                          cl.nccl_proto)
    if cl.ranks_per_node is not None and cl.ranks_per_node < 1:
        raise invalid("collectives.ranks_per_node", "an integer >= 1", cl.ranks_per_node)
    if tr.gradient_accumulation_steps < 1:
        raise invalid("training.gradient_accumulation_steps", "an integer >= 1", tr.gradient_accumulation_steps)
    if tr.max_grad_norm is not None and tr.max_grad_norm <= 0:
        raise invalid("training.max_grad_norm", "a number > 0", tr.max_grad_norm)
    if tr.lr_warmup_steps < 0:
        raise invalid("training.lr_warmup_steps", "an integer >= 0", tr.lr_warmup_steps)
    if isinstance(fs.reshard_after_forward, int) and not isinstance(fs.reshard_after_forward, bool):
        if fs.reshard_after_forward < 1:
            raise invalid("fsdp.reshard_after_forward", "true, false or an integer >= 1", fs.reshard_after_forward)
    if fs.replicate_degree is not None and fs.replicate_degree < 1:
        raise invalid("fsdp.replicate_degree", "an integer >= 1", fs.replicate_degree)
    if pp.n_microbatches < 1:
        raise invalid("pipeline.n_microbatches", "an integer >= 1", pp.n_microbatches)
    if pp.stages_per_rank < 1:
        raise invalid("pipeline.stages_per_rank", "an integer >= 1", pp.stages_per_rank)
    if len(set(pp.split_points)) != len(pp.split_points):
        raise invalid("pipeline.split_points", "distinct module names", pp.split_points)
    looped = pp.schedule in ("interleaved1f1b", "loopedbfs", "interleavedzb", "zbv")
    if pp.schedule == "zbv" and pp.stages_per_rank != 2:
        raise invalid("pipeline.stages_per_rank", "2 for the zbv schedule (a V of two stages per rank)", pp.stages_per_rank)
    if st.kind == "pipeline" and looped and pp.stages_per_rank < 2:
        raise invalid("pipeline.stages_per_rank", f">= 2 for the {pp.schedule} schedule (looped stages)", pp.stages_per_rank)
    if st.kind == "pipeline" and not looped and pp.stages_per_rank != 1:
        raise invalid("pipeline.stages_per_rank", f"1 for the {pp.schedule} schedule (one stage per rank)", pp.stages_per_rank)

    # Combinations: every "these cannot be combined" rule lives here.
    if st.kind != "ddp" and co.method != "none":
        raise invalid("compression.method", f"'none' with strategy kind {st.kind!r} (compression is a DDP comm hook)",
                      co.method)
    if st.kind != "ddp" and cl.hierarchical:
        raise invalid("collectives.hierarchical", f"false with strategy kind {st.kind!r} (it is a DDP comm hook)", True)
    if cl.hierarchical and co.method != "none":
        raise invalid("collectives.hierarchical", "false when gradient compression is on (both are the DDP comm hook)",
                      True)
    if st.kind == "pipeline" and tr.gradient_accumulation_steps > 1:
        raise invalid("training.gradient_accumulation_steps",
                      "1 with strategy kind 'pipeline' (raise pipeline.n_microbatches instead)",
                      tr.gradient_accumulation_steps)
    if world_size is None:
        return
    if st.kind == "hsdp":
        replicas = fs.replicate_degree if fs.replicate_degree is not None else (nnodes or 1)
        if replicas > world_size or world_size % replicas:
            raise invalid("fsdp.replicate_degree", f"a divisor of the world size {world_size} (HSDP mesh replicate x shard)",
                          replicas)
        shard = world_size // replicas
        if isinstance(fs.reshard_after_forward, int) and not isinstance(fs.reshard_after_forward, bool):
            if shard % fs.reshard_after_forward:
                raise invalid("fsdp.reshard_after_forward", f"a divisor of the shard group size {shard}",
                              fs.reshard_after_forward)
    if st.kind == "fsdp":
        if isinstance(fs.reshard_after_forward, int) and not isinstance(fs.reshard_after_forward, bool):
            if world_size % fs.reshard_after_forward:
                raise invalid("fsdp.reshard_after_forward", f"a divisor of the world size {world_size}",
                              fs.reshard_after_forward)
        if fs.replicate_degree is not None:
            raise invalid("fsdp.replicate_degree", "unset with strategy kind 'fsdp' (use kind 'hsdp' for a 2-D mesh)",
                          fs.replicate_degree)
    if st.kind == "pipeline" and pp.split_points:
        stages = len(pp.split_points) + 1
        if stages != world_size * pp.stages_per_rank:
            raise invalid("pipeline.split_points",
                          f"{world_size * pp.stages_per_rank - 1} names ({world_size} ranks x "
                          f"{pp.stages_per_rank} stages per rank = {world_size * pp.stages_per_rank} stages)",
                          pp.split_points)
    if cl.hierarchical:
        per_node = cl.ranks_per_node
        if per_node is not None and (per_node > world_size or world_size % per_node):
            raise invalid("collectives.ranks_per_node", f"a divisor of the world size {world_size}", per_node)


_NCCL_ALGOS = ("ring", "tree", "collnet", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
_NCCL_COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce", "sendrecv", "alltoall")


def _check_nccl_algo(text: str) -> None:
    """NCCL_ALGO: 'Ring,Tree', '^Tree' or per collective 'allreduce:tree,ring;allgather:ring'."""
    rule = (f"a comma-separated list of {', '.join(_NCCL_ALGOS)} (optionally after '^'), or "
            "'collective:algos;...' per collective")
    for part in text.split(";"):
        coll, _, algos = part.rpartition(":")
        if coll and coll.strip().lower() not in _NCCL_COLLECTIVES:
            raise invalid("collectives.nccl_algo", rule, text)
        names = [a.strip().lower() for a in algos.strip().lstrip("^").split(",")]
        if not names or any(a not in _NCCL_ALGOS for a in names):
            raise invalid("collectives.nccl_algo", rule, text)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; the single document handed to every rank."""

    launch: LaunchConfig = _f(LaunchConfig(), "Launch options.")
    budget: BudgetConfig = _f(BudgetConfig(), "Step and time budget.")
    profiler: ProfilerConfig = _f(ProfilerConfig(), "Always-on profiler options.")
    thresholds: ThresholdsConfig = _f(ThresholdsConfig(), "Bottleneck and alert thresholds.")
    strategy: StrategyConfig = _f(StrategyConfig(), "Strategy applied to the script.")

    # -- validation -------------------------------------------------------------------
    def validate(self) -> "RunConfig":
        """Check every field and cross-field rule; raise ConfigError on the first violation."""
        _check_types(self, "")
        la, bu, pr, th = self.launch, self.budget, self.profiler, self.thresholds
        if la.nproc_per_node < 1:
            raise invalid("launch.nproc_per_node", "an integer >= 1", la.nproc_per_node)
        if la.nnodes < 1:
            raise invalid("launch.nnodes", "an integer >= 1", la.nnodes)
        if la.node_rank is not None and not 0 <= la.node_rank < la.nnodes:
            raise invalid("launch.node_rank", f"in [0, {la.nnodes - 1}]", la.node_rank)
        if la.nnodes > 1 and la.rdzv_endpoint is None and la.launcher is None:
            raise invalid("launch.rdzv_endpoint", "set (HOST:PORT) when nnodes > 1", None)
        if la.rdzv_endpoint is not None and ":" not in la.rdzv_endpoint:
            raise invalid("launch.rdzv_endpoint", "of the form HOST:PORT", la.rdzv_endpoint)
        if la.launcher is not None and "{cmd}" not in la.launcher:
            raise invalid("launch.launcher", "a template containing {cmd}", la.launcher)
        if la.max_restarts < 0:
            raise invalid("launch.max_restarts", "an integer >= 0", la.max_restarts)
        if bu.steps is not None and bu.steps < 1:
            raise invalid("budget.steps", "an integer >= 1", bu.steps)
        if bu.warmup_steps < 0:
            raise invalid("budget.warmup_steps", "an integer >= 0", bu.warmup_steps)
        for name in ("timeout_s",):
            v = getattr(bu, name)
            if v is not None and v <= 0:
                raise invalid(f"budget.{name}", "a number > 0", v)
        if bu.no_progress_timeout_s <= 0:
            raise invalid("budget.no_progress_timeout_s", "a number > 0", bu.no_progress_timeout_s)
        if bu.kill_grace_s < 0:
            raise invalid("budget.kill_grace_s", "a number >= 0", bu.kill_grace_s)
        if pr.loss_every < 1:
            raise invalid("profiler.loss_every", "an integer >= 1", pr.loss_every)
        if isinstance(pr.ddp_timers_every, bool) or not isinstance(pr.ddp_timers_every, int) \
                or pr.ddp_timers_every < 1:
            raise invalid("profiler.ddp_timers_every", "an integer >= 1", pr.ddp_timers_every)
        for name in ("system_interval_s", "flush_interval_s"):
            if getattr(pr, name) <= 0:
                raise invalid(f"profiler.{name}", "a number > 0", getattr(pr, name))
        if pr.trace_window is not None:
            first, _ = parse_trace_window(pr.trace_window)
            if bu.steps is not None and first >= bu.warmup_steps + bu.steps:
                last = bu.warmup_steps + bu.steps - 1
                raise invalid("profiler.trace_window", f"a window starting by step {last} (the budget's last step)",
                              pr.trace_window)
        if pr.trace_len < 1:
            raise invalid("profiler.trace_len", "an integer >= 1", pr.trace_len)
        if pr.trace_every is not None and pr.trace_every <= pr.trace_len:
            raise invalid("profiler.trace_every", f"an integer > profiler.trace_len ({pr.trace_len})", pr.trace_every)
        if not pr.trace_anomaly_factor > 1.0:
            raise invalid("profiler.trace_anomaly_factor", "a number > 1", pr.trace_anomaly_factor)
        if pr.trace_max_windows < 1:
            raise invalid("profiler.trace_max_windows", "an integer >= 1", pr.trace_max_windows)
        for f in dataclasses.fields(th):
            v = getattr(th, f.name)
            if f.name.endswith("_pct") and not 0 <= v <= 100:
                raise invalid(f"thresholds.{f.name}", "a percentage in [0, 100]", v)
        if not th.alert_duration_s >= 0:
            raise invalid("thresholds.alert_duration_s", "a number of seconds >= 0", th.alert_duration_s)
        if not th.alert_step_spike_factor > 1.0:
            raise invalid("thresholds.alert_step_spike_factor", "a number > 1", th.alert_step_spike_factor)
        if th.comm_high_pct > th.comm_critical_pct:
            raise invalid("thresholds.comm_high_pct", "<= thresholds.comm_critical_pct", th.comm_high_pct)
        if th.io_high_pct > th.io_critical_pct:
            raise invalid("thresholds.io_high_pct", "<= thresholds.io_critical_pct", th.io_high_pct)
        if th.memory_high_pct > th.memory_critical_pct:
            raise invalid("thresholds.memory_high_pct", "<= thresholds.memory_critical_pct", th.memory_high_pct)
        self.strategy.validate()
        return self

    def check_layout(self) -> "RunConfig":
        """`validate` plus the strategy checks that need the launch's world size (HSDP mesh,
        pipeline stages, hierarchical node size). Called on the final document (file < flags),
        not on a file alone, whose [launch] flags may still change."""
        self.strategy.validate(world_size=self.world_size, nnodes=self.launch.nnodes)
        return self

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        """Build and validate a config. Strategy sections ({"ddp": ...}) may stand at top level."""
        return _build(cls, _hoist_strategy_sections(data) if isinstance(data, dict) else data, "").validate()

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_toml(cls, text: str, *, source: str = "config") -> "RunConfig":
        """Parse a TOML document. Strategy sections ([ddp], [dataloader]) may stand at top level."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source} must be valid TOML, but got: {exc}") from None
        return cls.from_dict(data)

    def replace(self, **sections: Any) -> "RunConfig":
        """A copy with whole sections or `section.field` overrides applied (validated)."""
        data = self.to_dict()
        for key, value in sections.items():
            data[key] = value
        return RunConfig.from_dict(data)

    def with_overrides(self, overrides: dict[str, Any]) -> "RunConfig":
        """Apply dotted overrides like {"budget.steps": 50, "strategy.ddp.bucket_cap_mb": 50}."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            node = data
            parts = dotted.split(".")
            for part in parts[:-1]:
                if part not in node or not isinstance(node[part], dict):
                    raise invalid("config key", "a known option", dotted)
                node = node[part]
            if parts[-1] not in node:
                raise invalid("config key", "a known option", dotted)
            node[parts[-1]] = value
        return RunConfig.from_dict(data)

    def apply_patch(self, patch: dict[str, Any]) -> "RunConfig":
        """Apply a recommendation's `config_patch` (strategy sections such as {"ddp": {...}})."""
        data = self.to_dict()
        for section, values in _hoist_strategy_sections(patch).items():
            if not isinstance(values, dict):
                raise invalid("config patch section", "a table", section)
            for key, sub in values.items():
                target = data.setdefault(section, {})
                if isinstance(sub, dict) and isinstance(target.get(key), dict):
                    target[key].update(sub)
                else:
                    target[key] = sub
        return RunConfig.from_dict(data)


_STRATEGY_SECTIONS = {f.name for f in dataclasses.fields(StrategyConfig)} - {"kind"}


def _hoist_strategy_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Accept ToRSh-style top-level [ddp]/[dataloader] tables as strategy sub-sections."""
    out = dict(data)
    strategy = dict(out.pop("strategy", {}) or {})
    for name in list(out):
        if name in _STRATEGY_SECTIONS:
            strategy[name] = out.pop(name)
    if strategy:
        out["strategy"] = strategy
    return out


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise invalid(path or "config", "a table", data)
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{path}." if path else ""
        raise invalid(f"config key {where}{unknown[0]}", f"one of {sorted(names)}", unknown[0])
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        sub = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, sub)
        else:
            kwargs[name] = _coerce(hint, value, sub)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise invalid(path, f"one of {list(args)}", value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise invalid(path, "true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(path, "a number", value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise invalid(path, "a string", value)
        return value
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise invalid(path, "a list", value)
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not isinstance(value, (list, tuple)):
            raise invalid(path, "a list", value)
        return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise invalid(path, "a table", value)
        return {str(k): str(v) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {hint!r} at {path}")


def _check_types(obj: Any, path: str) -> None:
    """Re-check field types of an instance built directly (not through from_dict)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            _check_types(value, sub)
        else:
            _coerce(hints[f.name], value, sub)


STUDY_SAMPLERS = ("tpe", "random", "gp", "cmaes")
STUDY_OBJECTIVES = (("throughput",), ("throughput", "loss"))
STUDY_PRUNERS = ("none", "median", "percentile")
STUDY_DEFAULT_STEPS = 20
"""Measured steps per study run when neither the study nor the base config's budget says."""


@dataclass(frozen=True, kw_only=True)
class StudyConfig:
    """Every option of one study (`torsh-tune tune`, the main job, `autotune.tune`).

    What each run does is the study's base `RunConfig`; this is how the study searches,
    measures, guards and confirms. Each field's help is the CLI's help text; all checks are
    in `validate`.

    Example:
        >>> StudyConfig(n_trials=8, sampler="random", seed=0).validate().confirm_pairs
        3
    """

    n_trials: int = _f(20, "Finished trials the study should hold (trial 0 runs the PyTorch defaults).")
    sampler: str = _f("tpe", "Optuna sampler: tpe, random, gp (needs scipy) or cmaes (needs cmaes).")
    seed: int | None = _f(None, "Sampler and bootstrap seed.")
    storage: str | None = _f(
        None, "Where the study lives (default sqlite in the study dir). Shared by tuners on several machines: "
        "journal:PATH on a file system they all mount, or a database server they all reach, "
        "postgresql://USER@HOST:PORT/DB (pip install torsh-tune[postgres]; the password in ~/.pgpass "
        "or PGPASSWORD). Checked before anything runs.")
    study_name: str = _f("torsh-tune", "Optuna study name.")
    baseline_repeats: int = _f(3, "Baseline launches before the search; their spread is the noise.")
    confirm_top: int = _f(2, "Best feasible trials re-run against the baseline (0: none).")
    confirm_pairs: int = _f(3, "Interleaved baseline/candidate pairs per confirmed candidate.")
    ablation_pairs: int | None = _f(
        None, "Pairs per test of the ablation that keeps only the winner's changes whose removal costs speed "
        "beyond noise (default: as many as the confirmation's pairs; 0: best.toml is the winner as found).")
    steps: int | None = _f(None, f"Measured steps per run (default: the base config's, else {STUDY_DEFAULT_STEPS}).")
    warmup_steps: int | None = _f(None, "Warm-up steps per run (default: the base config's).")
    trial_timeout_s: float | None = _f(None, "Wall-clock limit of one run (default: the base config's).")
    timeout_s: float | None = _f(None, "No new run starts after this many seconds of the study.")
    loss_tolerance: float = _f(
        0.01, "A trial violates the loss guard when its mean loss is worse than the baseline's by more than this "
        "(relative) and beyond the baseline repeats' run-to-run spread (one-sided t-test at 1 %).")
    max_peak_mem_bytes: int | None = _f(
        None, "A trial whose peak memory (any rank; RSS on CPU) exceeds this violates a constraint.")
    objectives: tuple[str, ...] = _f(
        ("throughput",), "Objectives: throughput, or throughput and loss (also minimise the loss deviation from "
        "the baseline; the result is a Pareto front, whose fastest feasible members are confirmed).")
    pruner: str = _f(
        "none", "Stop trials whose running throughput falls behind the completed trials' at the same step: "
        "none, median or percentile (single objective only).")
    pruner_percentile: float | None = _f(None, "With the percentile pruner: the share (%) of trials kept (default 25).")
    pruner_warmup_steps: int | None = _f(None, "Measured steps before a trial may be pruned (default 3).")
    pruner_startup_trials: int | None = _f(None, "Completed trials before any pruning (default 5).")
    include_compression: bool = _f(True, "Search gradient compression.")
    api_mode: bool = _f(
        False, "Search the strategy kind (DDP, FSDP, HSDP, pipeline) and its options: the script calls "
        "torsh_tune.parallelize.")
    allow_batch_changes: bool = _f(
        False, "Also search knobs that change the effective batch (gradient accumulation; API mode only); the data "
        "guard then accepts their change of the batch.")
    warm_agent: bool = _f(
        True, "Fork each run's torchrun agent from one process that imported torch once (saves ~1.2 s per run; "
        "the ranks still start fresh; Linux, local launches only).")
    reference_bench: str | None = _f(
        None, "A `torsh-tune bench` run of this fabric (its bench_model.json): the configurations its alpha-beta "
        "model predicts fastest for the baseline run are tried early.")

    def validate(self) -> "StudyConfig":
        """Check every field and cross-field rule; raise ConfigError on the first violation."""
        _check_types(self, "")
        for name, low in (("n_trials", 1), ("baseline_repeats", 1), ("confirm_top", 0), ("confirm_pairs", 1),
                          ("ablation_pairs", 0), ("steps", 1), ("warmup_steps", 0), ("pruner_warmup_steps", 0),
                          ("pruner_startup_trials", 0), ("seed", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or value < low):
                raise invalid(name, f"an integer >= {low}", value)
        if self.max_peak_mem_bytes is not None and (isinstance(self.max_peak_mem_bytes, bool)
                                                    or self.max_peak_mem_bytes <= 0):
            raise invalid("max_peak_mem_bytes", "an integer > 0", self.max_peak_mem_bytes)
        for name in ("loss_tolerance", "trial_timeout_s", "timeout_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise invalid(name, "a number > 0", value)
        if self.sampler not in STUDY_SAMPLERS:
            raise invalid("sampler", f"one of {list(STUDY_SAMPLERS)}", self.sampler)
        if tuple(self.objectives) not in STUDY_OBJECTIVES:
            raise invalid("objectives", "('throughput',) or ('throughput', 'loss')", self.objectives)
        if self.pruner not in STUDY_PRUNERS:
            raise invalid("pruner", f"one of {list(STUDY_PRUNERS)}", self.pruner)
        if self.pruner != "none" and len(self.objectives) > 1:
            raise invalid("pruner", "'none' with several objectives (Optuna cannot prune a multi-objective study)",
                          self.pruner)
        if self.pruner_percentile is not None and not 0 < self.pruner_percentile < 100:
            raise invalid("pruner_percentile", "a number between 0 and 100, exclusive", self.pruner_percentile)
        if self.allow_batch_changes and not self.api_mode:
            raise invalid("allow_batch_changes", "used with a script that calls torsh_tune.parallelize (API mode)",
                          self.allow_batch_changes)
        return self

    def replace(self, **changes: Any) -> "StudyConfig":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """A rank's place in the job, as torchrun (or any launcher setting its variables) describes it.

    Parsed once per rank by `dist_env()` (the rank runtime does it at start-up) and handed to
    what needs it: the API, the strategies, the bench worker.

    Example:
        >>> env = dist_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
        >>> env.local_rank, env.nnodes, env.node_rank
        (1, 2, 1)
        >>> env.with_ranks_per_node(2).nnodes
        4
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # ranks on this rank's node
    node_rank: int  # torchrun's GROUP_RANK; rank // local_world_size without it
    master_addr: str | None
    master_port: int | None

    @property
    def nnodes(self) -> int:
        """Number of nodes, assuming the same number of ranks on each (torchrun's layout)."""
        return max(1, self.world_size // max(1, self.local_world_size))

    @classmethod
    def one_node(cls, *, rank: int, world_size: int) -> "DistEnv":
        """A process group started without a launcher's variables: all its ranks on one node."""
        return cls(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size, node_rank=0,
                   master_addr=None, master_port=None)

    def with_ranks_per_node(self, ranks_per_node: int | None) -> "DistEnv":
        """This rank in nodes of `ranks_per_node` consecutive ranks; itself when None.

        `collectives.ranks_per_node` declares the node size the strategies work with (the
        hierarchical all-reduce, the HSDP mesh), e.g. to emulate nodes on one host; the
        launcher's own layout stays what this rank's device is chosen from.
        """
        if not ranks_per_node:
            return self
        return dataclasses.replace(self, local_world_size=ranks_per_node, local_rank=self.rank % ranks_per_node,
                                   node_rank=self.rank // ranks_per_node)


def dist_env(environ: dict[str, str] | None = None) -> DistEnv | None:
    """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT the torchrun way.

    Returns None when the process was not started by a distributed launcher (no RANK and no
    WORLD_SIZE), so the same script runs alone, as in nanoGPT's
    `ddp = int(os.environ.get("RANK", -1)) != -1`.

    Raises:
        ConfigError: a variable is present but not a valid integer, or out of range.
    """
    import os

    env = os.environ if environ is None else environ
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None

    def integer(name: str, default: int | None, low: int) -> int | None:
        raw = env.get(name)
        if raw is None or raw == "":
            if default is None:
                raise invalid(f"environment variable {name}", "set when RANK or WORLD_SIZE is", None)
            return default
        return int_at_least(f"environment variable {name}", raw, low)

    world = integer("WORLD_SIZE", None, 1)
    rank = integer("RANK", None, 0)
    if rank >= world:
        raise invalid("environment variable RANK", f"< WORLD_SIZE ({world})", env.get("RANK"))
    local_world = integer("LOCAL_WORLD_SIZE", world, 1)
    if local_world > world:
        raise invalid("environment variable LOCAL_WORLD_SIZE", f"<= WORLD_SIZE ({world})", env.get("LOCAL_WORLD_SIZE"))
    local_rank = integer("LOCAL_RANK", rank % local_world, 0)
    if local_rank >= local_world:
        raise invalid("environment variable LOCAL_RANK", f"< LOCAL_WORLD_SIZE ({local_world})", env.get("LOCAL_RANK"))
    port = env.get("MASTER_PORT")
    master_port = None if not port else integer("MASTER_PORT", None, 1)
    if master_port is not None and master_port > 65535:
        raise invalid("environment variable MASTER_PORT", "a port in [1, 65535]", port)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
                   node_rank=integer("GROUP_RANK", rank // local_world, 0),
                   master_addr=env.get("MASTER_ADDR") or None, master_port=master_port)


def help_of(cls: type, name: str) -> str:
    """The help text of field `name` of config dataclass `cls`."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(name)


def dump_toml(config: RunConfig) -> str:
    """Serialise a RunConfig to TOML (unset values are omitted)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or k == "env"}
        tables = {k: v for k, v in table.items() if isinstance(v, dict) and k != "env"}
        body = [f"{k} = {_toml_value(v)}" for k, v in scalars.items() if v is not None]
        if body and prefix:
            lines.append(f"[{prefix}]")
        lines.extend(body)
        if body:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(config.to_dict(), "")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {json.dumps(str(x))}" for k, x in v.items()) + " }"
    return json.dumps(str(v))
