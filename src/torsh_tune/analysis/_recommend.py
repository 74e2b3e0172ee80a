"""Recommendations: concrete actions per bottleneck, with gains bounded by this run's numbers.

Every expected gain is a range of % of the median step time computed from the bottleneck's
evidence (the time a change can remove is at most the time the bottleneck costs), never a
canned figure. `config_patch` is what `RunConfig().apply_patch` accepts; {} when no
torsh-tune knob can do it (e.g. repairing a slow host).
"""

from __future__ import annotations

import math
from typing import Any

from ._bottlenecks import theoretical_bubble_pct
from ._runinfo import cpu_count, dig, nproc_per_node
from ._types import SEVERITIES, Bottleneck, GainRange, Recommendation

__all__ = ["choose_num_workers", "recommend"]

_MiB = 1024 * 1024
_MAX_WORKERS = 8  # beyond this, workers rarely help one rank and cost memory


def recommend(
    bottlenecks: tuple[Bottleneck, ...] | list[Bottleneck],
    *,
    info: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    meta: dict[int, dict[str, Any]] | None = None,
    world_size: int = 1,
) -> tuple[Recommendation, ...]:
    """Actions for each bottleneck, most urgent and most rewarding first.

    Args:
        bottlenecks: output of `diagnose`.
        info: run.json (cpu_count, nproc_per_node).
        config: config.json, the RunConfig the run used (current DataLoader/DDP values).
        meta: rank -> meta.json (DDP buckets, device, hostname).
        world_size: number of ranks.

    Returns:
        Recommendations with priority 1..n (1 = do first).

    Example:
        >>> for rec in recommend(analysis.bottlenecks, info=frames.info):  # doctest: +SKIP
        ...     print(rec.priority, rec.title, rec.config_patch)
    """
    ctx = _Context(info or {}, config or {}, meta or {}, world_size)
    drafts: list[tuple[int, Recommendation]] = []
    for b in bottlenecks:
        # Low GPU utilisation is a computation bottleneck with its own remedies.
        key = "gpu_util" if b.category == "computation" and "gpu_util_pct" in b.evidence else b.category
        make = _RULES.get(key)
        if make is None:
            continue
        for rec in make(b, ctx):
            drafts.append((SEVERITIES.index(b.severity), rec))
    drafts.sort(key=lambda item: (item[0], -item[1].expected_gain.high_pct))
    out = []
    for i, (_, rec) in enumerate(drafts, start=1):
        out.append(Recommendation(priority=i, category=rec.category, title=rec.title, rationale=rec.rationale,
                                  config_patch=rec.config_patch, expected_gain=rec.expected_gain,
                                  effort=rec.effort, verified_by=rec.verified_by))
    return tuple(out)


def choose_num_workers(*, cpu_count: int | None, ranks_per_node: int, current: int = 0) -> int:
    """DataLoader workers per rank: the cores left per rank after the rank itself, at least current + 1."""
    if cpu_count is None:
        return max(current + 1, 2)
    free = math.floor(cpu_count / max(ranks_per_node, 1)) - 1
    return max(current + 1, min(_MAX_WORKERS, free))


class _Context:
    def __init__(self, info: dict[str, Any], config: dict[str, Any], meta: dict[int, dict[str, Any]],
                 world_size: int) -> None:
        self.info, self.config, self.meta, self.world_size = info, config, meta, world_size
        self.cpu_count = cpu_count(info)
        self.ranks_per_node = nproc_per_node(info, config, world_size)
        first = meta[min(meta)] if meta else {}
        self.device = str(first.get("device", "cpu"))
        self.ddp = first.get("ddp") if isinstance(first.get("ddp"), dict) else {}
        # Who issued the run's collectives (the c10d capture): {"ddp": {"count": n, "bytes": b}, ...}
        issuers = first.get("collectives") if isinstance(first.get("collectives"), dict) else {}
        self.main_issuer = max(issuers, key=lambda k: issuers[k].get("bytes", 0), default=None) if issuers else None

    def hostname(self, rank: int) -> str | None:
        host = self.meta.get(rank, {}).get("hostname")
        return str(host) if host else None


def _gain(low: float, high: float, basis: str) -> GainRange:
    high = min(max(high, 0.0), 100.0)
    low = min(max(low, 0.0), high)
    return GainRange(low_pct=round(low, 2), high_pct=round(high, 2), basis=basis)


def _rec(category: str, title: str, rationale: str, patch: dict[str, Any], gain: GainRange, effort: str) -> Recommendation:
    return Recommendation(priority=0, category=category, title=title, rationale=rationale,
                          config_patch=patch, expected_gain=gain, effort=effort)


def _io(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    d = float(b.evidence["data_wait_pct"])
    current = dig(ctx.config, "strategy", "dataloader", "num_workers")
    current = current if isinstance(current, int) else 0
    workers = choose_num_workers(cpu_count=ctx.cpu_count, ranks_per_node=ctx.ranks_per_node, current=current)
    if ctx.cpu_count is not None:
        free = max(ctx.cpu_count / max(ctx.ranks_per_node, 1) - 1.0, 0.0)
        # Loading parallelises over the workers that have a core of their own; the rank's
        # main process loads as one producer when num_workers is 0.
        now_eff = max(min(float(current), free), 1.0)
        new_eff = max(min(float(workers), free), 1.0)
        low = d * (1.0 - now_eff / new_eff)
        cores = (f"{ctx.cpu_count} cores / {ctx.ranks_per_node} ranks per node leave {free:.1f} free cores "
                 f"per rank, so {workers} workers load ~{new_eff / now_eff:.1f}x faster")
    else:
        low = 0.0
        cores = "cpu_count unknown, so no speed-up from parallel loading can be promised"
    patch: dict[str, Any] = {"dataloader": {"num_workers": workers, "persistent_workers": True}}
    if ctx.device.startswith("cuda"):
        patch["dataloader"]["pin_memory"] = True
    return [_rec(
        "io",
        f"Load data in {workers} DataLoader worker processes per rank (now {current})",
        f"ranks wait {d:.1f} % of each step for the next batch; workers prepare batches while the step computes",
        patch,
        _gain(low, d, f"data wait {d:.1f} % of the step bounds the saving; {cores}"),
        "low",
    )]


def _communication(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    e = float(ev.get("attributable_comm_pct", ev["exposed_comm_pct"]))
    bwd = float(ev.get("backward_compute_pct", 0.0))
    last = float(ev.get("last_transfer_pct", 0.0))
    # Overlap hides communication only behind backward compute, and never the last bucket.
    high = min(e, bwd)
    low = high - last
    if not ctx.ddp:
        return _communication_without_ddp(e, bwd, ev, ctx)
    cap = ctx.ddp.get("bucket_cap_mb") or 25.0
    num_buckets = ctx.ddp.get("num_buckets")
    if num_buckets is None and ev.get("num_collectives_per_step"):
        num_buckets = round(float(ev["num_collectives_per_step"]))
    param_mib = (ctx.ddp.get("param_bytes") or 0) / _MiB
    if num_buckets is not None and num_buckets > 16:
        new_cap, why = cap * 2, f"{num_buckets} buckets per step pay per-collective latency; fewer, larger ones"
    elif param_mib and (num_buckets is None or num_buckets <= 2):
        new_cap = max(1.0, round(param_mib / 4, 1))
        why = f"{param_mib:.1f} MiB of gradients in {num_buckets or 1} bucket(s) cannot overlap; ~4 buckets can"
    else:
        new_cap, why = max(1.0, cap / 2), "smaller buckets start communicating earlier in backward"
    if new_cap == cap:  # already at the smallest bucket DDP (and Dynamo's DDPOptimizer) accept
        return []
    return [_rec(
        "communication",
        f"Set DDP bucket_cap_mb to {new_cap:g} (now {cap:g})",
        f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); {why}",
        {"ddp": {"bucket_cap_mb": float(new_cap)}},
        _gain(low, high, f"exposed comm {e:.1f} % hidable only behind backward compute {bwd:.1f} %, "
                         f"minus the last bucket's transfer {last:.1f} %"),
        "low",
    )]


def _communication_without_ddp(e: float, bwd: float, ev: dict[str, Any], ctx: _Context) -> list[Recommendation]:
    """Exposed communication of a stack without DDP: DDP's knobs do not apply; say what does."""
    issuer = ctx.main_issuer or "user"
    if issuer == "fsdp":
        title = "Overlap FSDP's all-gathers and reduce-scatters with compute"
        why = ("FSDP's collectives are exposed: prefetch the next blocks' all-gathers "
               "(set_modules_to_forward_prefetch / set_modules_to_backward_prefetch), keep the root and last "
               "blocks unsharded after forward (reshard_after_forward=False), or shard over fewer ranks (HSDP)")
    else:
        title = "Average gradients with DDP instead of blocking all-reduces after backward"
        why = (f"the collectives come from {issuer!r} code and block the training thread; DDP's bucketed "
               "all-reduce starts during backward and overlaps with it (or register the all-reduce as a "
               "gradient hook with async_op=True and wait before the optimizer step)")
    return [_rec(
        "communication", title,
        f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); {why}",
        {}, _gain(0.0, min(e, bwd), f"exposed comm {e:.1f} % hidable at most behind backward compute {bwd:.1f} %"),
        "medium",
    )]


def _network(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    t = float(ev["transfer_exposed_pct"])
    busbw, ref = float(ev["busbw_gbps"]), float(ev["reference_busbw_gbps"])
    return [
        _rec(
            "network",
            "Compress gradients (fp16/bf16 or PowerSGD DDP comm hook)",
            f"collectives are transfer-bound at {busbw:.3g} GB/s; fewer bytes on the wire shorten the transfer",
            {},
            _gain(t / 2, t, f"exposed transfer {t:.1f} % of the step; fp16 halves the bytes (low), "
                            "low-rank compression removes nearly all (high)"),
            "medium",
        ),
        _rec(
            "network",
            "Check the interconnect (link, NIC, NCCL_SOCKET_IFNAME / NCCL_IB_* settings)",
            f"achieved bus bandwidth {busbw:.3g} GB/s is below the {ref:g} GB/s reference",
            {},
            _gain(0.0, t * (1.0 - busbw / ref) if ref > 0 else 0.0,
                  f"exposed transfer {t:.1f} % shrunk by busbw {busbw:.3g} -> {ref:g} GB/s"),
            "medium",
        ),
    ]


def _straggler(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    rank = int(ev["slowest_rank"])
    excess = float(ev["excess_pct"])
    share = float(ev["last_share_pct"])
    host = ctx.hostname(rank)
    where = f"rank {rank}" + (f" on {host}" if host else "")
    return [_rec(
        "straggler",
        f"Fix or replace the slow {where}",
        f"the other ranks wait for {where} at every synchronisation: it is {excess:.1f} % of the step late "
        f"and last in {share:.0f} % of steps (check its load, thermal throttling, data shard size)",
        {},
        _gain(excess * share / 100.0, excess,
              f"its lateness {excess:.1f} % of the step (high), counted only in the {share:.0f} % of steps "
              "where it is last (low)"),
        "medium",
    )]


def _memory(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    peak = float(ev["peak_pct"])
    recs = []
    param_bytes = ctx.ddp.get("param_bytes") if ctx.ddp else None
    cap = ev.get("capacity_bytes")
    if ctx.ddp and not ctx.ddp.get("gradient_as_bucket_view") and param_bytes and cap:
        recs.append(_rec(
            "memory",
            "Enable DDP gradient_as_bucket_view to drop a gradient copy",
            f"peak memory is {peak:.1f} % of capacity; buckets and gradients then share storage",
            {"ddp": {"gradient_as_bucket_view": True}},
            _gain(0.0, 0.0, f"memory headroom, not step time: frees ~{param_bytes / _MiB:.0f} MiB "
                            f"({100.0 * param_bytes / cap:.1f} % of capacity) per rank"),
            "low",
        ))
    recs.append(_rec(
        "memory",
        "Reduce per-rank memory (smaller micro-batch with gradient accumulation, activation checkpointing, FSDP)",
        f"peak memory is {peak:.1f} % of capacity: the next larger batch or sequence will run out of memory",
        {},
        _gain(0.0, 0.0, f"avoids out-of-memory at {peak:.1f} % peak; step time unchanged or slightly worse"),
        "medium",
    ))
    return recs


def _gpu_util(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    idle = 100.0 - float(ev["gpu_util_pct"])
    known = float(ev.get("data_wait_pct", 0.0)) + float(ev.get("exposed_comm_pct", 0.0))
    return [_rec(
        "computation",
        "Keep the GPUs busy: larger per-rank batch, fewer host syncs, CUDA graphs/torch.compile",
        f"GPUs are idle {idle:.0f} % of the time; {known:.1f} % of the step is data wait or exposed communication",
        {},
        _gain(min(known, idle), idle, f"GPU idle time {idle:.1f} % (high); the idle time already explained by data "
                                      f"and communication {known:.1f} % (low)"),
        "medium",
    )]


def _computation(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    c = float(b.evidence["compute_pct"])
    overhead = float(b.evidence.get("exposed_comm_pct", 0.0)) + float(b.evidence.get("data_pct", 0.0))
    rest = ("the distributed overheads are small" if overhead < 15.0
            else f"data wait and exposed communication take another {overhead:.0f} % (see their findings)")
    return [_rec(
        "computation",
        "Compute-bound: scale compute (mixed precision, torch.compile, faster devices or more ranks)",
        f"{c:.0f} % of the step is forward/backward/optimizer compute; {rest}",
        {},
        _gain(0.0, c / 2, f"compute share {c:.1f} %; a 2x faster compute (e.g. bf16 on tensor cores) saves half"),
        "medium",
    )]


def _pipeline(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    p, m, measured = int(ev.get("ranks") or ev["stages"]), int(ev["microbatches"]), float(ev["bubble_pct"])
    after = theoretical_bubble_pct(p, 2 * m)
    if ev.get("graded") is False:  # a host-clock bubble on CUDA is launch time: only the theory bounds the gain
        now = theoretical_bubble_pct(p, m)
        return [_rec(
            "pipeline_bubble",
            f"Use {2 * m} microbatches per step (now {m})",
            f"(p-1)/(m+p-1) falls from {now:.1f} % to {after:.1f} % at m={2 * m} (the batch must divide by it); "
            f"the measured {measured:.1f} % is host launch time, not the device's bubble",
            {"pipeline": {"n_microbatches": 2 * m}},
            _gain(0.0, now - after, f"theoretical bubble {now:.1f} % down to {after:.1f} % at {2 * m} microbatches "
                  "(no device-clock measurement)"),
            "low",
        )]
    return [_rec(
        "pipeline_bubble",
        f"Use {2 * m} microbatches per step (now {m})",
        f"the bubble is {measured:.1f} % of the step; (p-1)/(m+p-1) falls to {after:.1f} % at m={2 * m} "
        "(the batch must divide by it)",
        {"pipeline": {"n_microbatches": 2 * m}},
        _gain(theoretical_bubble_pct(p, m) - after, measured - after,
              f"measured bubble {measured:.1f} % down to the theoretical {after:.1f} % at {2 * m} microbatches"),
        "low",
    )]


_RULES = {
    "io": _io,
    "communication": _communication,
    "network": _network,
    "straggler": _straggler,
    "memory": _memory,
    "gpu_util": _gpu_util,
    "computation": _computation,
    "pipeline_bubble": _pipeline,
}
