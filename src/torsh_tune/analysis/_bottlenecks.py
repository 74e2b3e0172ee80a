"""Rules turning measured statistics into severity-ranked bottlenecks.

Thresholds come from `config.ThresholdsConfig` (the ToRSh guide's defaults). Every
bottleneck carries the numbers that triggered it, with units in the evidence keys.

Attribution matters more than detection: when one rank is late, the other ranks spend the
difference blocked in their collectives, which looks like exposed communication. The
cross-rank split of each collective (transfer = min duration across ranks, wait = the rest)
tells the two apart, so skew-dominated communication is charged to the straggler.
"""

from __future__ import annotations

from typing import Any, Callable

from ..config import ThresholdsConfig
from ._workers import host_idle_cores_per_rank, size_workers
from ..records import FRAMEWORK_ISSUERS, FRAMEWORK_SYNC_MAX_BYTES
from ._types import (SEVERITIES, Bottleneck, Breakdown, CommStats, MemoryStats, StragglerStats, SystemStats,
                     kinds_beyond_ddp)

__all__ = ["diagnose"]

# A rank must be the last to arrive in at least this share of steps to be a straggler
# (otherwise the skew moves between ranks: jitter, not one slow rank).
_LAST_SHARE_MIN_PCT = 50.0
# Communication is transfer-dominated when at least this share of it is transfer.
_TRANSFER_SHARE_MIN_PCT = 50.0
#: Without a bench model, collectives smaller than this on average are taken as latency-bound:
#: on Ethernet-class fabrics (alpha 50-500 us) their busbw is far below the link's even when the
#: link is healthy (PowerSGD's or Top-K's ~0.1 MiB messages), so no `network` finding.
LATENCY_BOUND_BYTES = 512 << 10


def diagnose(
    *,
    breakdown: Breakdown | None,
    comm: CommStats | None = None,
    stragglers: StragglerStats | None = None,
    memory: MemoryStats | None = None,
    system: SystemStats | None = None,
    data_wait_by_rank: dict[int, float] | None = None,
    pipeline: dict[str, Any] | None = None,
    world_size: int = 1,
    thresholds: ThresholdsConfig | None = None,
    reference_busbw_gbps: float | None = None,
    reference_busbw_at: Callable[[float], float | None] | None = None,
    host_cores_per_rank: float | None = None,
    checkpoint: dict[str, Any] | None = None,
    evaluation: dict[str, Any] | None = None,
    loader_restarts: dict[str, Any] | None = None,
    redundant_syncs: dict[str, Any] | None = None,
) -> tuple[Bottleneck, ...]:
    """Apply the bottleneck rules to a run's statistics.

    Args:
        breakdown: the step breakdown (phases as % of step time); None when no steps.
        comm: communication statistics.
        stragglers: straggler statistics.
        memory: memory statistics.
        system: system sampler statistics.
        data_wait_by_rank: rank -> data wait % of its step time.
        pipeline: a rank's meta.json "pipeline" document (stages, microbatches, the
            measured bubble_pct and the clock and device it was measured with), when the
            run is pipeline-parallel. A bubble is graded only on the device clock, or on the
            host clock of a CPU run (there the host runs the kernels); on CUDA the host clock
            measures kernel launches, so such a bubble (or one that does not say its clock
            and device) is reported at severity "low" as informational (`evidence["graded"]`
            False).
        world_size: number of ranks.
        thresholds: rule thresholds; ThresholdsConfig() by default.
        reference_busbw_gbps: bus bandwidth this fabric measurably delivers (run.json
            "reference_busbw_gbps", written from a `bench` measurement). Without one there is no
            `network` finding: a low bandwidth is only a claim against something measured.
        reference_busbw_at: message size (bytes) -> the bus bandwidth the fabric delivers at
            that size (the bench's alpha-beta model). Small messages are latency-bound: the run
            is compared with what the fabric does at its own message size. Without it,
            collectives under `LATENCY_BOUND_BYTES` on average get no `network` finding.
        host_cores_per_rank: the host's cores divided by its ranks (run.json cpu_count /
            nproc_per_node): with the host's busy %, the idle cores per rank of a run whose
            sampler did not record its own (`system.idle_cores_per_rank`, affinity-aware, is
            preferred). With idle cores known, the `io` finding says when the cores leave more
            DataLoader workers nothing to gain (`size_workers`).
        checkpoint: the measured steps' checkpoint saves (`checkpoint_saves`): an `io` finding when
            they take more than half of `io_high_pct` of the measured time.
        evaluation: the measured steps' evaluation passes (`evaluation_passes`): a `computation` finding
            (evidence `eval_pct`) when they take more than half of `eval_high_pct` of the measured time.
        loader_restarts: the measured steps' DataLoader worker restarts (`loader_restarts`): an `io` finding
            (evidence `restart_pct`) when the steps that make them take more than half of `io_high_pct` of the
            measured time beyond a usual step.
        redundant_syncs: DDP all-reducing after every micro-batch of a step (`redundant_syncs`): a
            `communication` finding (evidence `redundant_exposed_pct`), graded by the redundant all-reduces'
            exposure (medium from half of `comm_high_pct` of the median step, else low).

    Returns:
        Bottlenecks, most severe first (ties: larger share of the step first).

    Example:
        >>> diagnose(breakdown=analysis.breakdown, comm=analysis.comm)  # doctest: +SKIP
        (Bottleneck(category='communication', severity='high', ...),)
    """
    th = thresholds or ThresholdsConfig()
    all_ranks = tuple(range(world_size))
    found: list[tuple[Bottleneck, float]] = []  # (bottleneck, share of the step it costs, %)
    pct = breakdown.phases_pct if breakdown else {}

    straggler = _straggler(stragglers, comm, pct, th)
    if straggler:
        found.append(straggler)
    step_s = breakdown.step_s if breakdown else None
    found += _communication(comm, pct, th, all_ranks, step_s, straggler_found=straggler is not None)
    if reference_busbw_gbps:
        found += _network(comm, pct, th, all_ranks, reference_busbw_gbps, reference_busbw_at,
                          straggler_found=straggler is not None)
    found += _io(breakdown, data_wait_by_rank or {}, th, all_ranks, system, host_cores_per_rank)
    found += _checkpoint(checkpoint, th, all_ranks)
    found += _evaluation(evaluation, th, all_ranks)
    found += _loader_restarts(loader_restarts, th, all_ranks)
    found += _redundant_syncs(redundant_syncs, th, all_ranks)
    found += _memory(memory, th)
    found += _gpu_util(system, pct, th, all_ranks)
    found += _pipeline(pipeline, th, all_ranks)
    found += _computation(pct, all_ranks)
    found.sort(key=lambda item: (SEVERITIES.index(item[0].severity), -item[1]))
    return tuple(b for b, _ in found)


def skew_share_pct(comm: CommStats | None) -> float | None:
    """% of collective time that is waiting for other ranks (vs transfer)."""
    if comm is None or comm.transfer_s is None or comm.wait_s is None:
        return None
    total = comm.transfer_s + comm.wait_s
    return 100.0 * comm.wait_s / total if total > 0 else None


def _level(value: float, *, critical: float, high: float, medium: float | None = None) -> str | None:
    if value > critical:
        return "critical"
    if value > high:
        return "high"
    if medium is not None and value > medium:
        return "medium"
    return None


def _straggler(st: StragglerStats | None, comm: CommStats | None, pct: dict[str, float],
               th: ThresholdsConfig) -> tuple[Bottleneck, float] | None:
    if st is None or st.slowest_rank is None or st.lateness_pct is None:
        return None
    rows = {row["rank"]: row for row in st.per_rank}
    slow = st.slowest_rank
    others = sorted(row["median_compute_s"] for r, row in rows.items() if r != slow)
    step_s = median([row["median_step_s"] for row in rows.values()])
    compute_excess_pct = 0.0
    if others and step_s > 0:
        compute_excess_pct = 100.0 * (rows[slow]["median_compute_s"] - median(others)) / step_s
    excess_pct = max(st.lateness_pct, compute_excess_pct)
    last_share = st.last_share_pct or 0.0
    if excess_pct <= th.straggler_pct or last_share < _LAST_SHARE_MIN_PCT:
        return None
    # A rank a little behind is worth noting; it only becomes severe when the others lose a
    # large share of the step to it (on shared hosts ~10 % comes from contention alone).
    severity = _level(excess_pct, critical=3 * th.straggler_pct, high=2 * th.straggler_pct) or "medium"
    evidence: dict[str, Any] = {
        "slowest_rank": slow,
        "excess_pct": round(excess_pct, 2),
        "lateness_pct": round(st.lateness_pct, 2),
        "compute_excess_pct": round(compute_excess_pct, 2),
        "last_share_pct": round(last_share, 2),
        "median_compute_s": rows[slow]["median_compute_s"],
        "others_median_compute_s": median(others) if others else None,
        "threshold_pct": th.straggler_pct,
        "basis": st.basis,
    }
    if st.per_rank and rows[slow].get("lateness_s") is not None:
        evidence["lateness_s"] = rows[slow]["lateness_s"]
    skew = skew_share_pct(comm)
    if skew is not None:
        evidence["skew_share_pct"] = round(skew, 2)
        evidence["exposed_comm_pct"] = round(pct.get("exposed_comm", 0.0), 2)
        evidence["wait_s"] = comm.wait_s
    message = (
        f"rank {slow} is a straggler: {excess_pct:.1f} % of the step later/slower than the other ranks, "
        f"last in {last_share:.0f} % of steps"
    )
    if skew is not None and skew >= 50.0:
        message += f"; {skew:.0f} % of the others' collective time is waiting for it"
    return Bottleneck(category="straggler", severity=severity, ranks=(slow,), evidence=evidence, message=message), excess_pct


def _communication(comm: CommStats | None, pct: dict[str, float], th: ThresholdsConfig,
                   ranks: tuple[int, ...], step_s: float | None, *, straggler_found: bool) -> list[tuple[Bottleneck, float]]:
    if comm is None:
        return []
    exposed = pct.get("exposed_comm", 0.0)
    skew = skew_share_pct(comm)
    # Waiting for a straggler is the straggler's cost; only the transfer part is communication's.
    attributable = exposed * (1.0 - skew / 100.0) if straggler_found and skew is not None else exposed
    severity = _level(attributable, critical=th.comm_critical_pct, high=th.comm_high_pct, medium=th.comm_high_pct / 2)
    if severity is None:
        return []
    evidence: dict[str, Any] = {
        "exposed_comm_pct": round(exposed, 2),
        "attributable_comm_pct": round(attributable, 2),
        "exposed_comm_s": comm.exposed_comm_s,
        "comm_s": comm.comm_s,
        "overlap_pct": None if comm.overlap_pct is None else round(comm.overlap_pct, 2),
        "backward_compute_pct": round(pct.get("backward_compute", 0.0), 2),
        "threshold_high_pct": th.comm_high_pct,
        "threshold_critical_pct": th.comm_critical_pct,
        "num_collectives_per_step": comm.num_collectives_per_step,
        "bytes_per_step": comm.bytes_per_step,
    }
    if skew is not None:
        evidence["skew_share_pct"] = round(skew, 2)
        evidence["transfer_s"] = comm.transfer_s
        evidence["wait_s"] = comm.wait_s
    if comm.last_transfer_s is not None and step_s:
        evidence["last_transfer_pct"] = round(100.0 * comm.last_transfer_s / step_s, 2)
    # What `recommend` sizes buckets and compression from (the alpha-beta model of the fabric).
    if step_s:
        evidence["step_s"] = step_s
        evidence["backward_compute_s"] = step_s * pct.get("backward_compute", 0.0) / 100.0
    evidence["wire_s"] = comm.wire_s
    evidence["last_wire_s"] = comm.last_transfer_s
    # Who spends the communication time: "issuer op" -> time per step (most first), unless DDP's
    # all-reduce is all there is.
    kinds = [k for k in kinds_beyond_ddp(comm.by_kind) if k["time_s"] > 0]
    if kinds:
        evidence["comm_s_by_kind"] = {f"{k['issuer']} {k['op']}": k["time_s"] for k in kinds[:5]}
        origins = {f"{k['issuer']} {k['op']}": k["origins"] for k in kinds[:5] if k.get("origins")}
        if origins:  # the functions that called torch.distributed, most time first
            evidence["comm_origins_by_kind"] = origins
        # Whether the training thread waits in the call (synchronous) or issues and waits later (an engine
        # that overlaps its own collectives with backward, as DeepSpeed's and Megatron's do).
        waited = {f"{k['issuer']} {k['op']}": k["blocked_s"] for k in kinds[:5] if k.get("blocked_s") is not None}
        if waited:
            evidence["comm_blocked_s_by_kind"] = waited
        issued_async = {f"{k['issuer']} {k['op']}": k["async_share"] for k in kinds[:5] if k.get("async_share")}
        if issued_async:
            evidence["comm_async_share_by_kind"] = issued_async
        in_backward = {f"{k['issuer']} {k['op']}": k["backward_issue_share"] for k in kinds[:5]
                       if k.get("async_share") and k.get("backward_issue_share") is not None}
        if in_backward:  # of the asynchronous ones, issued during a backward (overlapping it) or after it
            evidence["comm_backward_issue_share_by_kind"] = in_backward
    # Collectives a training framework issues in most steps besides the gradients' (Lightning's SIGTERM
    # flag, a logged value synchronised at every step): synchronous, small, latency-bound. Small: a framework
    # that averages the gradients itself (DeepSpeed's engine) issues those too, and they are not flags.
    syncs = [k for k in comm.by_kind if k["issuer"] in FRAMEWORK_ISSUERS and k["count"] > 0 and k["time_s"] > 0
             and k["bytes"] / k["count"] <= FRAMEWORK_SYNC_MAX_BYTES]
    if syncs and step_s:
        for field, key in (("s", "time_s"), ("transfer_s", "transfer_s"), ("bytes", "bytes"), ("count", "count")):
            evidence[f"framework_sync_{field}_by_kind"] = {f"{k['issuer']} {k['op']}": k[key] for k in syncs}
        evidence["framework_sync_pct_by_kind"] = {f"{k['issuer']} {k['op']}": round(100.0 * k["time_s"] / step_s, 2)
                                                  for k in syncs}
    # DDP's broadcast of its buffers before each forward: synchronous, in the forward, never hidden.
    buffers = next((k for k in comm.by_kind if k["issuer"] == "ddp" and k["op"] == "broadcast"), None)
    if buffers is not None and buffers["time_s"] > 0 and step_s:
        evidence["buffer_broadcast_s"] = buffers["time_s"]
        evidence["buffer_broadcast_transfer_s"] = buffers["transfer_s"]
        evidence["buffer_broadcast_pct"] = round(100.0 * buffers["time_s"] / step_s, 2)
        evidence["buffer_broadcast_bytes"] = buffers["bytes"]
        evidence["buffer_broadcast_count"] = buffers["count"]
    # ZeroRedundancyOptimizer's broadcast of the updated parameters inside its step, after the backward: the
    # training thread's wait in it (`blocked_s`) is its exposed part; the step's own compute is what dropping
    # the sharding would multiply.
    zero = next((k for k in comm.by_kind if k["issuer"] == "zero" and k["op"] == "broadcast"), None)
    if zero is not None and zero["time_s"] > 0 and step_s:
        waited = zero.get("blocked_s")
        evidence["zero_broadcast_s"] = zero["time_s"]
        evidence["zero_broadcast_blocked_s"] = zero["time_s"] if waited is None else min(waited, zero["time_s"])
        evidence["zero_broadcast_transfer_s"] = zero["transfer_s"]
        evidence["zero_broadcast_pct"] = round(100.0 * evidence["zero_broadcast_blocked_s"] / step_s, 2)
        evidence["zero_broadcast_bytes"] = zero["bytes"]
        evidence["zero_broadcast_count"] = zero["count"]
        evidence["optimizer_s"] = step_s * pct.get("optimizer", 0.0) / 100.0
    message = f"{exposed:.1f} % of the step is communication not hidden behind backward compute"
    if comm.overlap_pct is not None:
        message += f" (overlap {comm.overlap_pct:.0f} %)"
    if skew is not None and skew >= 50.0 and not straggler_found:
        message += f"; {skew:.0f} % of it is waiting for other ranks (skew without one consistent straggler)"
    return [(Bottleneck(category="communication", severity=severity, ranks=ranks, evidence=evidence,
                        message=message), attributable)]


def _network(comm: CommStats | None, pct: dict[str, float], th: ThresholdsConfig, ranks: tuple[int, ...],
             reference_gbps: float, reference_at: Callable[[float], float | None] | None, *,
             straggler_found: bool) -> list[tuple[Bottleneck, float]]:
    if comm is None or comm.busbw_gbps is None or comm.transfer_s is None:
        return []
    per_collective = _wire_bytes_per_collective(comm)
    basis = "large messages"
    at_size = reference_at(per_collective) if reference_at is not None and per_collective else None
    if at_size is not None and at_size < reference_gbps:
        reference_gbps, basis = at_size, f"the bench model at {per_collective / 2**20:.3g} MiB per collective"
    elif at_size is None and per_collective is not None and per_collective < LATENCY_BOUND_BYTES:
        return []  # latency-bound: a low busbw says nothing about the link at this size
    exposed = pct.get("exposed_comm", 0.0)
    skew = skew_share_pct(comm) or 0.0
    transfer_share = 100.0 - skew
    transfer_exposed = exposed * transfer_share / 100.0
    significant = exposed > th.comm_high_pct / 2
    if not (significant and transfer_share >= _TRANSFER_SHARE_MIN_PCT and comm.busbw_gbps < reference_gbps):
        return []
    severity = "high" if transfer_exposed > th.comm_high_pct and not straggler_found else "medium"
    evidence = {
        "busbw_gbps": round(comm.busbw_gbps, 4),
        "algbw_gbps": None if comm.algbw_gbps is None else round(comm.algbw_gbps, 4),
        "reference_busbw_gbps": reference_gbps,
        "transfer_share_pct": round(transfer_share, 2),
        "transfer_exposed_pct": round(transfer_exposed, 2),
        "exposed_comm_pct": round(exposed, 2),
        "transfer_s": comm.transfer_s,
        "wire_bytes_per_step": comm.wire_bytes_per_step,
        "wire_bytes_per_collective": per_collective,
        "reference_basis": basis,
    }
    message = (
        f"collectives are transfer-bound ({transfer_share:.0f} % transfer) at {comm.busbw_gbps:.3g} GB/s bus "
        f"bandwidth, below the {reference_gbps:.3g} GB/s reference ({basis})"
    )
    return [(Bottleneck(category="network", severity=severity, ranks=ranks, evidence=evidence, message=message),
             transfer_exposed)]


def _io(breakdown: Breakdown | None, by_rank: dict[int, float], th: ThresholdsConfig, ranks: tuple[int, ...],
        system: SystemStats | None, host_cores_per_rank: float | None) -> list[tuple[Bottleneck, float]]:
    pct = breakdown.phases_pct if breakdown else {}
    data = pct.get("data", 0.0)
    severity = _level(data, critical=th.io_critical_pct, high=th.io_high_pct)
    if severity is None:
        return []
    involved = tuple(r for r, v in sorted(by_rank.items()) if v > th.io_high_pct) or ranks
    evidence: dict[str, Any] = {
        "data_wait_pct": round(data, 2),
        "data_wait_pct_by_rank": {r: round(v, 2) for r, v in sorted(by_rank.items())},
        "threshold_high_pct": th.io_high_pct,
        "threshold_critical_pct": th.io_critical_pct,
        # What `recommend` sizes the DataLoader workers from (`size_workers`).
        "step_s": breakdown.step_s,
        "data_s": breakdown.phases_s.get("data", 0.0),
    }
    message = f"{data:.1f} % of the step waits for the DataLoader"
    if system is None or system.cpu_pct_mean is None:
        return [(Bottleneck(category="io", severity=severity, ranks=involved, evidence=evidence, message=message), data)]
    evidence["rank_cpu_pct"] = round(system.cpu_pct_mean, 1)  # a rank's processes, % of one core
    seen = [f"each rank's processes keep {system.cpu_pct_mean / 100:.2f} cores busy"]
    if system.sys_cpu_pct_mean is not None:
        evidence["host_cpu_busy_pct"] = round(system.sys_cpu_pct_mean, 1)
        seen.append(f"the host's CPUs are {system.sys_cpu_pct_mean:.0f} % busy")
    idle, basis = _idle_cores_per_rank(system, host_cores_per_rank)
    if idle is not None:
        idle = round(idle, 3)  # what `recommend` reads back from the evidence
        evidence["idle_cores_per_rank"] = idle
        evidence["idle_cores_basis"] = basis
        seen.append(f"{idle:.2f} idle cores per rank")
    message += f" ({'; '.join(seen)})"
    if idle is not None:
        sizing = size_workers(step_s=evidence["step_s"], data_s=evidence["data_s"],
                              rank_cpu_cores=system.cpu_pct_mean / 100.0, idle_cores_per_rank=idle)
        if sizing.saturated:
            message += (f": more DataLoader workers will not help, the cores are saturated "
                        f"({basis}; {sizing.arithmetic}); a cheaper collate or augmentation, preprocessing offline, "
                        "or more cores per rank would")
    return [(Bottleneck(category="io", severity=severity, ranks=involved, evidence=evidence, message=message), data)]


def _rare_level(found: dict[str, Any] | None, key: str, ranks: tuple[int, ...], *, high: float,
                critical: float) -> tuple[float, str, tuple[int, ...]] | None:
    """(share, severity, ranks involved) of a rare, long part of the steps (a save, a pass, a DataLoader's
    restart) from its share of the measured time `found[key]` (and per rank, `key + "_by_rank"`): medium
    from half of `high`, the ranks above that (else all); None when there is none or it is below that."""
    if not found:
        return None
    pct = round(float(found[key]), 2)
    severity = _level(pct, critical=critical, high=high, medium=high / 2)
    if severity is None:
        return None
    return pct, severity, tuple(r for r, v in found[key + "_by_rank"].items() if v > high / 2) or ranks


def _checkpoint(saves: dict[str, Any] | None, th: ThresholdsConfig,
                ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    """Checkpoint saves that block training: their share of the measured time, not of the median step."""
    graded = _rare_level(saves, "checkpoint_pct", ranks, high=th.io_high_pct, critical=th.io_critical_pct)
    if graded is None:
        return []
    pct, severity, involved = graded
    every = f", every {saves['every_steps']} steps" if saves.get("every_steps") else ""
    evidence = {
        "checkpoint_pct": pct,
        "checkpoint_pct_by_rank": saves["checkpoint_pct_by_rank"],
        "saves": saves["saves"],
        "median_save_s": saves["median_save_s"],
        "every_steps": saves.get("every_steps"),
        "checkpoint_s": saves["checkpoint_s"],
        "measured_s": saves["measured_s"],
        "threshold_high_pct": th.io_high_pct,
        "threshold_critical_pct": th.io_critical_pct,
    }
    message = (f"{pct:.1f} % of the measured time (rank {saves['rank']}) is spent saving checkpoints: "
               f"{saves['saves']} save(s) of {1e3 * saves['median_save_s']:.0f} ms{every}, blocking training "
               "(the median step does not show them)")
    return [(Bottleneck(category="io", severity=severity, ranks=involved, evidence=evidence, message=message), pct)]


def _loader_restarts(restarts: dict[str, Any] | None, th: ThresholdsConfig,
                     ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    """A DataLoader that starts its workers again every epoch: what those steps take beyond a usual one."""
    graded = _rare_level(restarts, "restart_pct", ranks, high=th.io_high_pct, critical=th.io_critical_pct)
    if graded is None:
        return []
    pct, severity, involved = graded
    every = f", every {restarts['every_steps']} steps" if restarts.get("every_steps") else ""
    workers = restarts["workers"]
    evidence = {key: restarts[key] for key in (
        "restart_pct_by_rank", "restarts", "workers", "every_steps", "median_restart_step_s", "usual_step_s",
        "median_start_s", "first_batch_s", "excess_s", "first_batch_pct", "measured_s")}
    evidence.update(restart_pct=pct, threshold_high_pct=th.io_high_pct, threshold_critical_pct=th.io_critical_pct)
    message = (f"{pct:.1f} % of the measured time (rank {restarts['rank']}) goes to starting the DataLoader's "
               f"{workers} worker process{'es' if workers != 1 else ''} again: {restarts['restarts']} restart(s)"
               f"{every} (a new epoch's iterator without persistent workers), each step "
               f"{1e3 * restarts['median_restart_step_s']:.0f} ms against {1e3 * restarts['usual_step_s']:.0f} ms "
               f"(the workers' start {1e3 * restarts['median_start_s']:.0f} ms, their first batch "
               f"{1e3 * restarts['first_batch_s']:.0f} ms; the median step does not show them)")
    return [(Bottleneck(category="io", severity=severity, ranks=involved, evidence=evidence, message=message), pct)]


def _redundant_syncs(syncs: dict[str, Any] | None, th: ThresholdsConfig,
                     ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    """Gradient accumulation whose every micro-batch all-reduces: all but the last all-reduce are redundant."""
    if not syncs:
        return []
    pct = round(float(syncs["redundant_exposed_pct"]), 2)
    # Sent for nothing, and removed without changing the results: a finding whatever its size.
    severity = _level(pct, critical=th.comm_critical_pct, high=th.comm_high_pct, medium=th.comm_high_pct / 2) or "low"
    n, k = syncs["syncs_per_step"], syncs["microbatches_per_step"]
    evidence = {"redundant_exposed_pct": pct, "syncs_per_step": n, "microbatches_per_step": k,
                "backward_exposed_pct": round(float(syncs["backward_exposed_pct"]), 2), "step_s": syncs["step_s"],
                "threshold_high_pct": th.comm_high_pct}
    message = (f"DDP all-reduces the gradients {n} times per step, after each of its {k} micro-batches (no "
               f"no_sync): {n - 1} of them are redundant, {pct:.1f} % of the step exposed")
    return [(Bottleneck(category="communication", severity=severity, ranks=ranks, evidence=evidence,
                        message=message), pct)]


def _evaluation(passes: dict[str, Any] | None, th: ThresholdsConfig,
                ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    """Evaluation passes between steps: compute that trains nothing, their share of the measured time."""
    graded = _rare_level(passes, "eval_pct", ranks, high=th.eval_high_pct, critical=100.0)
    if graded is None:
        return []
    pct, severity, involved = graded
    every = f", every {passes['every_steps']} steps" if passes.get("every_steps") else ""
    batches = passes.get("batches_per_pass")
    size = f" ({batches} batches)" if batches else ""
    evidence = {
        "eval_pct": pct,
        "eval_pct_by_rank": passes["eval_pct_by_rank"],
        "passes": passes["passes"],
        "median_pass_s": passes["median_pass_s"],
        "every_steps": passes.get("every_steps"),
        "batches_per_pass": batches,
        "samples_per_pass": passes.get("samples_per_pass"),
        "eval_s": passes["eval_s"],
        "measured_s": passes["measured_s"],
        "threshold_high_pct": th.eval_high_pct,
    }
    synced = ""
    if passes.get("collectives_per_pass"):  # a metric synced every batch makes a pass wait for the slowest rank
        evidence["collectives_per_pass"] = passes["collectives_per_pass"]
        evidence["collective_kinds"] = passes["collective_kinds"]
        synced = (f", {passes['collectives_per_pass']} collective(s) per pass "
                  f"({', '.join(passes['collective_kinds'][:3])})")
    message = (f"{pct:.1f} % of the measured time (rank {passes['rank']}) is evaluation: {passes['passes']} "
               f"pass(es) of {1e3 * passes['median_pass_s']:.0f} ms{size}{every}{synced}, training waits for them "
               "(the median step does not show them)")
    return [(Bottleneck(category="computation", severity=severity, ranks=involved, evidence=evidence,
                        message=message), pct)]


def _idle_cores_per_rank(system: SystemStats, host_cores_per_rank: float | None) -> tuple[float | None, str | None]:
    """The idle cores a rank can draw on, and how they were counted: the sampler's, over the cores the
    ranks may run on (`SystemStats.idle_cores_per_rank`), else the whole host's idle share of its
    cores per rank (runs recorded before the sampler kept them), else unknown."""
    if system.idle_cores_per_rank is not None:
        return system.idle_cores_per_rank, system.idle_cores_basis
    if host_cores_per_rank and system.sys_cpu_pct_mean is not None:
        return host_idle_cores_per_rank(host_cores_per_rank=host_cores_per_rank,
                                        host_busy_pct=system.sys_cpu_pct_mean)
    return None, None


def _memory(memory: MemoryStats | None, th: ThresholdsConfig) -> list[tuple[Bottleneck, float]]:
    if memory is None or memory.peak_pct is None:
        return []
    severity = _level(memory.peak_pct, critical=th.memory_critical_pct, high=th.memory_high_pct)
    if severity is None:
        return []
    if memory.device == "cuda" and memory.capacity_bytes:
        involved = tuple(r for r, b in memory.peak_bytes_by_rank.items()
                         if 100.0 * b / memory.capacity_bytes > th.memory_high_pct)
    else:
        involved = tuple(memory.peak_bytes_by_rank)
    evidence = {
        "peak_pct": round(memory.peak_pct, 2),
        "capacity_bytes": memory.capacity_bytes,
        "peak_bytes_by_rank": dict(memory.peak_bytes_by_rank),
        "device": memory.device,
        "threshold_high_pct": th.memory_high_pct,
        "threshold_critical_pct": th.memory_critical_pct,
    }
    where = "of GPU memory" if memory.device == "cuda" else "of host memory (ranks' RSS summed)"
    message = f"peak memory at {memory.peak_pct:.1f} % {where}: close to out-of-memory"
    return [(Bottleneck(category="memory", severity=severity, ranks=involved or tuple(memory.peak_bytes_by_rank),
                        evidence=evidence, message=message), 0.0)]


def _gpu_util(system: SystemStats | None, pct: dict[str, float], th: ThresholdsConfig,
              ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    if system is None or system.gpu_util_pct_mean is None or system.gpu_util_pct_mean >= th.gpu_util_medium_pct:
        return []
    util = system.gpu_util_pct_mean
    evidence = {
        "gpu_util_pct": round(util, 2),
        "threshold_pct": th.gpu_util_medium_pct,
        "data_wait_pct": round(pct.get("data", 0.0), 2),
        "exposed_comm_pct": round(pct.get("exposed_comm", 0.0), 2),
    }
    # NVML counts a kernel waiting in a collective as busy: the utilisation bounds useful work from above.
    message = (f"GPUs are busy {util:.0f} % of the time (below {th.gpu_util_medium_pct:g} %; NVML counts a "
               "kernel waiting in a collective as busy)")
    return [(Bottleneck(category="computation", severity="medium", ranks=ranks, evidence=evidence,
                        message=message), 100.0 - util)]


def theoretical_bubble_pct(stages: int, microbatches: int) -> float:
    """GPipe/1F1B bubble fraction (p - 1) / (m + p - 1), in %."""
    return 100.0 * (stages - 1) / (microbatches + stages - 1)


def _pipeline(pipeline: dict[str, Any] | None, th: ThresholdsConfig,
              ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    if not pipeline:
        return []
    stages, micro = pipeline.get("stages"), pipeline.get("microbatches")
    measured = pipeline.get("bubble_pct")
    if not (isinstance(stages, int) and isinstance(micro, int) and stages > 1 and micro > 0):
        return []
    # The schedule's own formula when the run recorded it (looped and zero-bubble schedules
    # differ from GPipe's), else GPipe/1F1B's over the pipeline's ranks.
    theory = pipeline.get("theoretical_bubble_pct")
    if not isinstance(theory, (int, float)):
        theory = theoretical_bubble_pct(int(pipeline.get("ranks") or stages), micro)
    if not isinstance(measured, (int, float)):
        measured = theory
    clock, device = pipeline.get("clock") or "host", pipeline.get("device")
    graded = clock == "device" or device == "cpu"
    if graded:
        severity = _level(measured, critical=th.comm_critical_pct, high=th.comm_high_pct,
                          medium=th.comm_high_pct / 2) or "low"
    else:
        severity = "low"
    evidence = {
        "stages": stages,
        "microbatches": micro,
        "bubble_pct": round(float(measured), 2),
        "theoretical_bubble_pct": round(theory, 2),
        "excess_bubble_pct": round(float(measured) - theory, 2),
        "clock": clock,
        "device": device,
        "graded": graded,
    }
    if isinstance(pipeline.get("stage_bubble_pct"), dict):
        evidence["stage_bubble_pct"] = pipeline["stage_bubble_pct"]
    if pipeline.get("schedule"):
        evidence["schedule"] = pipeline["schedule"]
    if isinstance(pipeline.get("ranks"), int):
        evidence["ranks"] = pipeline["ranks"]
    message = (f"pipeline bubble {measured:.1f} % of the step (theory for {stages} stages x {micro} "
               f"microbatches: {theory:.1f} %)")
    if not graded:
        where = "on CUDA" if device == "cuda" else f"on device {device or 'unknown'}"
        message += (f"; informational: measured on the host clock {where}, i.e. kernel-launch time, "
                    "not the device's bubble")
    return [(Bottleneck(category="pipeline_bubble", severity=severity, ranks=ranks, evidence=evidence,
                        message=message), float(measured) if graded else 0.0)]


def _computation(pct: dict[str, float], ranks: tuple[int, ...]) -> list[tuple[Bottleneck, float]]:
    if not pct:
        return []
    compute = pct.get("forward", 0.0) + pct.get("backward_compute", 0.0) + pct.get("optimizer", 0.0)
    rivals = {k: pct.get(k, 0.0) for k in ("data", "exposed_comm", "other")}
    if compute <= max(rivals.values()):
        return []
    evidence = {
        "compute_pct": round(compute, 2),
        "forward_pct": round(pct.get("forward", 0.0), 2),
        "backward_compute_pct": round(pct.get("backward_compute", 0.0), 2),
        "optimizer_pct": round(pct.get("optimizer", 0.0), 2),
        **{f"{k}_pct": round(v, 2) for k, v in rivals.items()},
    }
    message = f"compute-bound: {compute:.0f} % of the step is compute; scaling compute helps"
    return [(Bottleneck(category="computation", severity="low", ranks=ranks, evidence=evidence, message=message),
             compute)]


def median(values: list[float]) -> float:
    s = sorted(values)
    if not s:
        return 0.0
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2



def _wire_bytes_per_collective(comm: CommStats) -> float | None:
    """Average wire bytes of one collective (per rank), None when unknown."""
    wire = comm.wire_bytes_per_step if comm.wire_bytes_per_step is not None else comm.bytes_per_step
    if not wire or not comm.num_collectives_per_step:
        return None
    return float(wire) / float(comm.num_collectives_per_step)
