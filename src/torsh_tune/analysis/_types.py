"""The analysis result contract: what `analyze_run` returns and `reports`/`dashboard` draw.

Every type is a frozen, keyword-only dataclass of plain values (numbers, strings, tuples,
dicts), so `dataclasses.asdict(analysis)` is JSON-serialisable. Percentages are of the
median step time unless a field says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CATEGORIES",
    "EFFORTS",
    "PHASES",
    "SEVERITIES",
    "Bottleneck",
    "Breakdown",
    "CommStats",
    "GainRange",
    "MemoryStats",
    "Recommendation",
    "RunAnalysis",
    "SELF_CHECK_METRICS",
    "SelfCheck",
    "StepStats",
    "StragglerStats",
    "SystemStats",
    "kinds_beyond_ddp",
]

#: Bottleneck categories, in the order reports list them.
CATEGORIES = (
    "communication",
    "memory",
    "computation",
    "io",
    "network",
    "straggler",
    "pipeline_bubble",
)
#: Severities, most severe first (the sort order of `RunAnalysis.bottlenecks`).
SEVERITIES = ("critical", "high", "medium", "low")
#: Effort levels of a recommendation: low (< 1 h), medium (1-8 h), high (> 8 h).
EFFORTS = ("low", "medium", "high")
#: Step phases of `Breakdown`, in display order; they sum to the step time.
PHASES = ("data", "forward", "backward_compute", "exposed_comm", "optimizer", "other")
#: What `SelfCheck` compares: (metric, label, unit of its difference: "pct" of the trace's value or "pp").
SELF_CHECK_METRICS = (
    ("step", "step time", "pct"),
    ("compute", "compute share", "pp"),
    ("comm", "communication share", "pp"),
    ("exposed_comm", "exposed communication share", "pp"),
)


@dataclass(frozen=True, kw_only=True)
class GainRange:
    """Expected saving of a change, as % of the median step time or, for what the median step never shows
    (a checkpoint save, an evaluation pass, a DataLoader's restart), of the measured steps' total time."""

    low_pct: float
    high_pct: float
    basis: str  # the measured quantity that bounds it, in words
    of: str = "step"  # "step": % of the median step; "measured": % of the measured time


@dataclass(frozen=True, kw_only=True)
class Bottleneck:
    """One diagnosed problem with the measurements that show it."""

    category: str  # one of CATEGORIES
    severity: str  # one of SEVERITIES
    ranks: tuple[int, ...]  # ranks involved (all ranks when the problem is global)
    evidence: dict[str, Any]  # measured values, units in keys (e.g. "exposed_comm_pct")
    message: str


@dataclass(frozen=True, kw_only=True)
class Recommendation:
    """A concrete action for a bottleneck, with the gain this run's numbers allow."""

    priority: int  # 1 = do first
    category: str  # category of the bottleneck it addresses
    title: str
    rationale: str
    config_patch: dict[str, Any]  # accepted by RunConfig().apply_patch; {} when no knob fits
    expected_gain: GainRange
    effort: str  # one of EFFORTS
    verified_by: tuple[int, ...] = ()  # autotuner trial numbers that confirmed it


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Global step time (max over ranks per step) over the measured steps."""

    num_steps: int
    median_step_s: float
    p90_step_s: float
    mean_step_s: float
    std_step_s: float
    iqr_step_s: float
    samples_per_step: float  # global (all ranks)
    # Global samples over the measured steps' time, rare stalls left out (`steady_rate`); None when samples are unknown.
    throughput_samples_s: float | None
    steps_per_s: float = 0.0  # the same rate in steps: the throughput that is always known
    throughput_note: str | None = None  # why samples/s is unknown, when it is
    clock: str = "host"  # of step_s: "device" (CUDA events) or "host"
    stall_steps: int = 0  # measured steps left out of the throughput as stalls
    traced_steps: int = 0  # steps of deep-trace windows left out of these statistics (the profiler's cost in them)


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Where a step's time goes: median over steps of the per-step mean across ranks."""

    phases_s: dict[str, float]  # keys in PHASES order
    phases_pct: dict[str, float]  # % of step_s, same keys
    step_s: float = 0.0  # median over steps of the mean step_s across ranks (base of phases_pct)


@dataclass(frozen=True, kw_only=True)
class CommStats:
    """Communication per step, its overlap with compute and its wait/transfer split."""

    num_collectives_per_step: float  # per rank
    bytes_per_step: float  # per rank, payload before compression
    comm_s: float  # median per step, mean across ranks
    exposed_comm_s: float
    overlap_pct: float | None  # 100 * (1 - exposed / comm); None without communication
    transfer_s: float | None  # per step: sum over collectives of the min duration across ranks
    wait_s: float | None  # per step, mean across ranks: own duration - transfer (skew + contention)
    busbw_gbps: float | None  # nccl-tests bus bandwidth: algbw x collective factor
    algbw_gbps: float | None  # wire bytes / wire time (transfer without queueing)
    hooks: tuple[str, ...]  # comm hooks seen
    ddp_logging: dict[str, Any] | None  # DDP's own logging data (times in ns), rank 0
    wire_bytes_per_step: float | None = None  # per rank, after compression
    wait_by_rank_s: dict[int, float] = field(default_factory=dict)  # median per step
    last_transfer_s: float | None = None  # wire time of each step's last collective (never overlappable)
    wire_s: float | None = None  # per step: transfer without queueing behind the previous collective
    # Per (issuer, op), per step: {"issuer", "op", "count", "bytes", "time_s", "transfer_s", "origins"} and,
    # where the records say, "async_share" (of its collectives issued with async_op), "backward_issue_share"
    # (of those, issued during a backward: overlapping it, as an engine's gradient buckets) and "blocked_s" (the
    # training thread's wait in the call or in Work.wait()); count, bytes, time_s and blocked_s the mean
    # across ranks, time_s its records' durations with a queued collective's wait behind the rank's previous
    # one left out (`service_s`: asynchronous ones in flight together are not summed twice), transfer_s per
    # collective's min of that across ranks, each the median over steps (a kind missing from a step counts 0
    # there); origins: the functions that called torch.distributed ("module:qualname"), most time first, at
    # most 3; most time first.
    by_kind: tuple[dict[str, Any], ...] = ()


def kinds_beyond_ddp(by_kind: Any) -> list[dict[str, Any]]:
    """`CommStats.by_kind` rows worth showing apart: none when DDP's all-reduce (or an all-reduce
    of records made before the issuer was kept) is all there is, else every row."""
    kinds = list(by_kind or [])
    if len(kinds) == 1 and kinds[0].get("issuer") in ("ddp", "unrecorded") and kinds[0].get("op") == "all_reduce":
        return []
    return kinds


@dataclass(frozen=True, kw_only=True)
class StragglerStats:
    """Per-rank speed and lateness at the collectives."""

    per_rank: tuple[dict[str, Any], ...]  # rank, median_step_s, median_compute_s, lateness_s, last_count
    slowest_rank: int | None
    last_share_pct: float | None  # % of aligned collectives/steps where slowest_rank was last
    lateness_pct: float | None  # slowest rank's excess lateness (or compute) as % of median step
    basis: str = "comm"  # "comm" (arrival at collectives) or "compute" (no comm records)


@dataclass(frozen=True, kw_only=True)
class MemoryStats:
    """Peak memory per rank against what the device (or the shared host) holds."""

    device: str  # "cuda" or "cpu"
    peak_bytes_by_rank: dict[int, int]
    capacity_bytes: int | None
    peak_pct: float | None  # worst rank on GPU; summed ranks' RSS on a shared host


@dataclass(frozen=True, kw_only=True)
class SystemStats:
    """Means of the system sampler's records over the run.

    The `idle_cores*` fields come from the sampler's per-sample `cpu_cores` (the rank's affinity
    mask) and `idle_cores` (how many of those were idle), so a run restricted to some cores of a
    larger host counts only its own (`_resources.idle_cores`). They are None for runs recorded
    before the sampler kept them; there run.json `cpu_count` and `sys_cpu_pct_mean` stand in.
    """

    cpu_pct_mean: float | None  # per process, % of one core
    sys_cpu_pct_mean: float | None  # whole machine, % of all cores
    gpu_util_pct_mean: float | None
    gpu_power_w_mean: float | None
    cpu_cores: int | None = None  # cores the ranks may run on (one affinity mask; the tightest host's)
    idle_cores_mean: float | None = None  # how many of those were idle, mean over the measured window
    idle_cores_per_rank: float | None = None  # idle_cores_mean / the ranks sharing those cores
    idle_cores_basis: str | None = None  # that derivation with this run's numbers


@dataclass(frozen=True, kw_only=True)
class SelfCheck:
    """The always-on numbers beside one deep-trace window's numbers for the same steps.

    Rows (`per_rank`, and `overall`: the mean of ranks, rank None) hold, for the compared
    steps: ``num_steps``; ``always_on_step_s`` / ``trace_step_s`` (medians) and
    ``step_diff_pct`` (% of the trace's); ``always_on_<m>_pct`` / ``trace_<m>_pct`` (% of the
    step time, summed over the steps) and ``<m>_diff_pp`` (always-on minus trace, percentage
    points) for m in compute, comm, exposed_comm; the clocks: ``always_on_clock`` ("host" or
    "device", as the step records say; "host" when ``always_on_clock_recorded`` is False),
    ``trace_clock`` of the shares ("device": GPU kernels, "host": CPU operators) and
    ``trace_step_clock`` with ``trace_step_basis`` (host: ``ProfilerStep#`` spans; device: the
    device spans of the kernels each step launched, on a GPU against device-clock records).
    """

    window: str  # trace directory name under RUN/traces
    start_step: int  # first and last step compared (inclusive)
    end_step: int
    device: str  # "gpu" or "cpu": what the trace's timeline holds
    threshold_pp: float  # [thresholds] selfcheck_pp (the step time: %)
    per_rank: tuple[dict[str, Any], ...]
    overall: dict[str, Any]
    # Differences beyond the threshold, one per metric: metric, unit, diff (of the row shown in
    # the message), overall_diff, threshold, ranks beyond it, start_step, end_step, message.
    findings: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, kw_only=True)
class RunAnalysis:
    """Everything `analyze_run` learned about one run directory."""

    run_dir: str
    name: str
    info: dict[str, Any]  # run.json contents, {} if absent
    world_size: int
    status: str  # run.json outcome status, "unknown" if absent
    partial: bool  # a rank did not end ok/budget, or the run did not end ok
    warnings: tuple[str, ...]
    steps: StepStats | None
    breakdown: Breakdown | None
    comm: CommStats | None
    stragglers: StragglerStats | None
    memory: MemoryStats | None
    system: SystemStats | None
    bottlenecks: tuple[Bottleneck, ...]  # severity order
    recommendations: tuple[Recommendation, ...]  # priority order
    # The strategy advisor's candidates for this run's model and cluster, best first (see
    # `strategy_advice`): advice_table rows + `current` (this run's strategy) + `inputs`
    # (each advisor input with its source: measured, detected or assumed).
    advice: tuple[dict[str, Any], ...] = ()
    # Intervals where a metric stayed past an alert threshold (`find_alerts`), most severe first.
    alerts: tuple[Any, ...] = ()
    # Per deep-trace window, the always-on numbers checked against the trace's (`run_self_checks`).
    self_check: tuple[SelfCheck, ...] = ()
    # Ranks on several hosts: each other host's clock against rank 0's host's (`RunFrames.host_clocks`).
    host_clocks: tuple[dict[str, Any], ...] = ()
