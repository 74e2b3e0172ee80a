"""Strategy advisor: which parallelism, compression and LR scaling fit a model on a cluster.

The ToRSh guide's rules, from the model size, device memory, world size, node count and
link speed alone (no measurement: `torsh-tune profile` and `tune` confirm or refute):

- DDP below 1 B parameters, when the model state (weights + gradients + Adam state,
  ~16 bytes per parameter) fits on every device; FSDP otherwise.
- FSDP (FSDP2 `fully_shard`) below 10 B parameters on up to 32 GPUs; HSDP (shard within a
  node, replicate across nodes) when there are several nodes and a node holds the shard.
- Beyond that, 3-D: HSDP across nodes, pipeline stages when a node cannot hold the model
  even sharded (stage boundaries send activations, not parameters, over the slow link).
- Gradient compression by link speed (DDP only): < 10 Gbit/s PowerSGD for large models
  (fp16 otherwise), 10-25 Gbit/s fp16, faster links none; the hierarchical all-reduce when
  several nodes share a link slower than the intra-node one.
- Learning-rate scaling with the global batch: linear up to 8x the batch the LR was tuned
  for, square root beyond, both with a warm-up.

Pure Python: importing this module imports neither torch nor optuna, dash or plotly.

Example:
    >>> cands = advise(num_params=1_300_000_000, device_memory_bytes=8 * 10**9, world_size=8,
    ...                nnodes=1, link_gbps=None, gpus=True)
    >>> cands[0].name, cands[0].config_patch["fsdp"]
    ('fsdp full shard', {'reshard_after_forward': True})
    >>> cands[0].reasons[1]
    '1.3 B params × 16 B = 20.8 GB > 8 GB per GPU → FSDP full shard: 20.8 GB / 8 = 2.6 GB per rank'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import invalid

__all__ = [
    "DDP_MAX_PARAMS",
    "FSDP_MAX_PARAMS",
    "FSDP_MAX_WORLD_SIZE",
    "GRADOP_MAX_MEMORY_FRACTION",
    "LINEAR_LR_MAX_GROWTH",
    "POWERSGD_MIN_PARAMS",
    "WARMUP_STEPS_PER_DOUBLING",
    "Candidate",
    "advice_table",
    "advise",
    "estimate_memory_bytes",
    "training_bytes_per_param",
]

DDP_MAX_PARAMS = 1_000_000_000
"""Below this many parameters the guide prefers DDP (when the model state fits)."""
FSDP_MAX_PARAMS = 10_000_000_000
"""Below this many parameters (and up to FSDP_MAX_WORLD_SIZE ranks) the guide prefers FSDP."""
FSDP_MAX_WORLD_SIZE = 32
"""Up to this many ranks plain FSDP; beyond it (or FSDP_MAX_PARAMS) the guide goes 3-D."""
POWERSGD_MIN_PARAMS = 100_000_000
"""On slow links, models from this size (400 MB of fp32 gradients a step) get PowerSGD rather than fp16."""
GRADOP_MAX_MEMORY_FRACTION = 0.6
"""FSDP grad-op shard ranks above full shard when its model state takes at most this share of the device."""
LINEAR_LR_MAX_GROWTH = 8
"""Linear LR scaling up to this growth of the global batch; square-root scaling beyond."""
WARMUP_STEPS_PER_DOUBLING = 100
"""LR warm-up steps per doubling of the global batch (Goyal et al. ramp over ~5 epochs; tune to yours)."""


def training_bytes_per_param(param_bytes_per_param: int = 4, optimizer_bytes_per_param: int = 8) -> int:
    """Bytes of model state per parameter during training.

    `param + gradient (same dtype) + optimizer state`, plus a 4-byte fp32 master copy when
    the parameters are kept in fewer than 4 bytes: fp32 with Adam is 4 + 4 + 8 = 16 B;
    bf16 with fp32 Adam and master weights is 2 + 2 + 8 + 4 = 16 B (the ZeRO paper's 16).

    >>> training_bytes_per_param(4), training_bytes_per_param(2), training_bytes_per_param(4, 0)
    (16, 16, 8)
    """
    master = 4 if param_bytes_per_param < 4 else 0
    return 2 * param_bytes_per_param + optimizer_bytes_per_param + master


def estimate_memory_bytes(
    num_params: int,
    kind: str,
    world_size: int,
    *,
    param_bytes_per_param: int = 4,
    optimizer_bytes_per_param: int = 8,
    reshard_after_forward: bool = True,
    shard_degree: int | None = None,
    pipeline_degree: int = 1,
) -> float:
    """Model-state bytes per rank (weights, gradients, optimizer state) for a strategy.

    With P parameters, S = `training_bytes_per_param(...)` bytes of state per parameter,
    p = `param_bytes_per_param`, N = `world_size`:

    - ``ddp``: P·S (every rank holds everything).
    - ``fsdp`` full shard (`reshard_after_forward=True`, ZeRO-3): P·S / N.
    - ``fsdp`` grad-op shard (`reshard_after_forward=False`, ZeRO-2): P·p + P·(S − p) / N
      (parameters stay gathered from forward to backward).
    - ``hsdp``: as fsdp over the shard group D = `shard_degree` (default N): P·S / D.
    - ``pipeline``: P·S / `pipeline_degree` (default N stages, one per rank).
    - fsdp/hsdp with `pipeline_degree` > 1 (3-D): the sharded figure / `pipeline_degree`.

    Activations, the all-gathered unit in flight and allocator overhead come on top.

    >>> estimate_memory_bytes(1_300_000_000, "fsdp", 8) / 1e9
    2.6
    """
    if kind not in ("ddp", "fsdp", "hsdp", "pipeline"):
        raise invalid("kind", "one of ['ddp', 'fsdp', 'hsdp', 'pipeline']", kind)
    if world_size < 1:
        raise invalid("world_size", "an integer >= 1", world_size)
    per_param = training_bytes_per_param(param_bytes_per_param, optimizer_bytes_per_param)
    state = float(num_params) * per_param
    if kind == "ddp":
        return state
    if kind == "pipeline":
        return state / (pipeline_degree if pipeline_degree > 1 else world_size)
    shard = shard_degree if kind == "hsdp" and shard_degree else world_size
    if reshard_after_forward:
        sharded = state / shard
    else:
        params = float(num_params) * param_bytes_per_param
        sharded = params + (state - params) / shard
    return sharded / max(1, pipeline_degree)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One advised strategy.

    Attributes:
        rank: 1 is the best.
        name: Short label, e.g. "fsdp full shard" or "ddp + hierarchical all-reduce".
        config_patch: Strategy sections for `RunConfig.apply_patch` (`{"strategy": {"kind": ...},
            "fsdp": {...}, "training": {...}}`); apply it to a config whose launch has this
            world size and node count.
        reasons: Why, with the numbers.
        score: 0-100, higher is better (the order of the list).
        memory_per_rank_bytes: Model state per rank from `estimate_memory_bytes`.
        fits: Whether that fits the device memory; None when the memory is unknown.
    """

    rank: int
    name: str
    config_patch: dict[str, Any]
    reasons: list[str]
    score: float
    memory_per_rank_bytes: float
    fits: bool | None


@dataclass
class _Draft:
    name: str
    kind: str
    score: float
    memory: float
    fits: bool | None
    reasons: list[str]
    patch: dict[str, Any] = field(default_factory=dict)


def _params(n: float) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.3g} B"
    if n >= 1e6:
        return f"{n / 1e6:.3g} M"
    return f"{n:,.0f}"


def _gb(n: float) -> str:
    gb = n / 1e9
    return f"{gb:,.0f} GB" if gb >= 100 else f"{gb:.3g} GB"


def _secs(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def advise(
    *,
    num_params: int,
    param_bytes_per_param: int = 4,
    device_memory_bytes: int | None = None,
    world_size: int,
    nnodes: int = 1,
    link_gbps: float | None = None,
    gpus: bool = True,
    optimizer_bytes_per_param: int = 8,
    intra_node_gbps: float | None = None,
    reference_world_size: int = 1,
) -> list[Candidate]:
    """Rank strategies for a model of `num_params` parameters on `world_size` ranks over `nnodes` nodes.

    Args:
        num_params: Trainable parameters.
        param_bytes_per_param: Bytes per parameter (4 fp32, 2 bf16/fp16).
        device_memory_bytes: Memory of one device (GPU, or host memory per rank on CPU); None: unknown.
        world_size: Ranks in all.
        nnodes: Nodes; `world_size` must divide by it.
        link_gbps: Inter-node (or, on one node, inter-rank) link speed in Gbit/s; None: unknown.
        gpus: Whether ranks are GPUs (CPU offload is advised only for GPUs).
        optimizer_bytes_per_param: Optimizer state per parameter (8: Adam's two fp32 moments).
        intra_node_gbps: Link speed inside a node; None: assumed faster than `link_gbps`.
        reference_world_size: World size the learning rate was tuned at (the global batch
            grows by world_size / reference_world_size).

    Returns:
        Candidates, best first (`rank` 1), each with a config patch and reasons quoting the
        numbers. Layouts that do not fit `device_memory_bytes` are left out, unless none
        fits: then the one needing the least memory is returned, flagged `fits=False`.

    Raises:
        ConfigError: a non-positive size, or `world_size` not divisible by `nnodes`.

    Example:
        >>> [c.name for c in advise(num_params=300_000_000, world_size=8, link_gbps=400.0)][:2]
        ['ddp', 'fsdp full shard']
    """
    _check_inputs(num_params, param_bytes_per_param, device_memory_bytes, world_size, nnodes, link_gbps,
                  optimizer_bytes_per_param, intra_node_gbps, reference_world_size)
    n, p = world_size, param_bytes_per_param
    per_param = training_bytes_per_param(p, optimizer_bytes_per_param)
    state = float(num_params) * per_param
    per_node = n // nnodes
    mem = device_memory_bytes
    unit = "GPU" if gpus else "device"
    mem_text = f"{_gb(mem)} per {unit}" if mem is not None else f"per {unit} (memory unknown: pass --device-memory-gb)"

    def fits(x: float) -> bool | None:
        return None if mem is None else x <= mem

    def est(kind: str, **kw: Any) -> float:
        return estimate_memory_bytes(num_params, kind, n, param_bytes_per_param=p,
                                     optimizer_bytes_per_param=optimizer_bytes_per_param, **kw)

    state_text = (f"{_params(num_params)} params × {per_param} B = {_gb(state)} of model state "
                  f"({p} B weights + {p} B gradients + {optimizer_bytes_per_param} B optimizer"
                  f"{' + 4 B fp32 master weights' if p < 4 else ''} per param; activations come on top)")
    small = num_params < DDP_MAX_PARAMS
    medium = not small and num_params < FSDP_MAX_PARAMS and n <= FSDP_MAX_WORLD_SIZE
    regime = ("< 1 B params: the guide's DDP range" if small else
              f"1-10 B params on ≤ {FSDP_MAX_WORLD_SIZE} ranks: the guide's FSDP range" if medium else
              f"{_params(num_params)} params on {n} ranks (beyond 10 B params or {FSDP_MAX_WORLD_SIZE} ranks): "
              "the guide's 3-D range (HSDP across nodes, pipeline stages when a node cannot hold the model)")
    drafts: list[_Draft] = []

    # DDP ---------------------------------------------------------------------------------
    ddp_fits = fits(state)
    if ddp_fits is False:
        ddp_why = f"{_params(num_params)} params × {per_param} B = {_gb(state)} > {mem_text} → DDP does not fit"
    elif ddp_fits:
        ddp_why = f"{_gb(state)} ≤ {mem_text}: every rank holds the whole model state"
    else:
        ddp_why = f"{_gb(state)} {mem_text}; DDP needs all of it on every rank"
    if n == 1:
        ddp_score, ddp_rule = 100.0, "one rank: there is nothing to shard or all-reduce"
    elif small:
        ddp_score = 100.0
        ddp_rule = (f"< 1 B params and {'it fits' if ddp_fits else 'assuming it fits'}: DDP (one gradient all-reduce "
                    "per step, no parameter traffic)")
    else:
        ddp_score, ddp_rule = 40.0, ("≥ 1 B params: the guide moves to FSDP (DDP keeps a full optimizer state on "
                                     "every rank and all-reduces every gradient)")
    drafts.append(_Draft("ddp", "ddp", ddp_score, state, ddp_fits, [state_text, ddp_why, ddp_rule],
                         {"strategy": {"kind": "ddp"}}))

    # FSDP full shard and grad-op shard ---------------------------------------------------
    full = est("fsdp")
    full_fits = fits(full)
    full_why = f"FSDP full shard: {_gb(state)} / {n} = {_gb(full)} per rank"
    if ddp_fits is False:
        full_why = f"{_params(num_params)} params × {per_param} B = {_gb(state)} > {mem_text} → {full_why}"
    if full_fits is False:
        full_why += f" > {_gb(mem)}: does not fit"
    if n == 1:
        full_score, full_rule = 5.0, "one rank: sharding saves nothing"
    elif small and ddp_fits is not False:
        full_score, full_rule = 55.0, "< 1 B params and DDP fits: sharding only adds parameter all-gathers"
    elif small or medium:
        full_score = 95.0 if nnodes == 1 else 88.0
        full_rule = ("the guide's FSDP range" if medium else "DDP does not fit: FSDP") + \
                    ("" if nnodes == 1 else "; across nodes every parameter all-gather crosses the inter-node link")
    else:
        full_score = 90.0 if nnodes == 1 else 75.0
        full_rule = ("one node: FSDP over all ranks" if nnodes == 1 else
                     "across nodes every parameter all-gather crosses the inter-node link (HSDP or pipeline avoid it)")
    drafts.append(_Draft("fsdp full shard", "fsdp", full_score, full, full_fits, [state_text, full_why, full_rule],
                         {"strategy": {"kind": "fsdp"}, "fsdp": {"reshard_after_forward": True}}))

    gradop = est("fsdp", reshard_after_forward=False)
    gradop_fits = fits(gradop)
    if n > 1:
        params_bytes = float(num_params) * p
        gradop_why = (f"grad-op shard keeps the {_gb(params_bytes)} of weights gathered from forward to backward "
                      f"(one parameter all-gather per step instead of two): {_gb(params_bytes)} + "
                      f"{_gb(state - params_bytes)} / {n} = {_gb(gradop)} per rank")
        if gradop_fits and gradop <= GRADOP_MAX_MEMORY_FRACTION * mem:
            gradop_why += (f" ≤ {100 * GRADOP_MAX_MEMORY_FRACTION:.0f} % of {_gb(mem)}, leaving room for activations: "
                           "faster than full shard")
            gradop_score = full_score + 3.0
        elif gradop_fits:
            gradop_why += (f" > {100 * GRADOP_MAX_MEMORY_FRACTION:.0f} % of {_gb(mem)}: little room left for "
                           "activations, so full shard is the safer first try")
            gradop_score = full_score - 5.0
        elif gradop_fits is None:
            gradop_why += "; device memory unknown, so full shard is the safer first try"
            gradop_score = full_score - 5.0
        else:
            gradop_why += f" > {_gb(mem)}: does not fit"
            gradop_score = 0.0
        drafts.append(_Draft("fsdp grad-op shard", "fsdp", gradop_score, gradop, gradop_fits,
                             [state_text, gradop_why, full_rule],
                             {"strategy": {"kind": "fsdp"}, "fsdp": {"reshard_after_forward": False}}))

    # HSDP ------------------------------------------------------------------------------------
    hsdp_fits: bool | None = None
    if nnodes > 1 and per_node > 1:
        hsdp = est("hsdp", shard_degree=per_node)
        hsdp_fits = fits(hsdp)
        hsdp_why = (f"HSDP: shard within each node of {per_node} ranks, replicate across {nnodes} nodes: "
                    f"{_gb(state)} / {per_node} = {_gb(hsdp)} per rank; parameter all-gathers stay inside the node, "
                    "only each shard's gradient all-reduce crosses nodes")
        if hsdp_fits is False:
            hsdp_why += f" — but {_gb(hsdp)} > {_gb(mem)}: a node cannot hold the model sharded"
        if small and ddp_fits is not False:
            hsdp_score = 60.0
        else:
            hsdp_score = 100.0
        drafts.append(_Draft("hsdp", "hsdp", hsdp_score, hsdp, hsdp_fits, [state_text, hsdp_why, regime],
                             {"strategy": {"kind": "hsdp"}, "fsdp": {"replicate_degree": nnodes}}))

    # Pipeline (3-D) --------------------------------------------------------------------------
    if n > 1:
        pipe = est("pipeline")
        microbatches = max(4, 4 * (n - 1))
        bubble = (n - 1) / (microbatches + n - 1)
        pipe_why = (f"pipeline: {n} stages, one per rank: {_gb(state)} / {n} = {_gb(pipe)} per rank; stage boundaries "
                    f"send activations point to point instead of all-gathering parameters; {microbatches} micro-batches "
                    f"keep the 1F1B bubble at (S − 1)/(M + S − 1) = {100 * bubble:.0f} % (set pipeline.split_points; "
                    "the batch must divide by the micro-batches)")
        three_d = not small and not medium
        if three_d and nnodes > 1 and hsdp_fits is False:
            pipe_score = 100.0
            pipe_rule = ("3-D: a node cannot hold the model even sharded, so split it into stages across nodes; "
                         "torsh-tune's kind 'pipeline' runs one stage per rank — for pipeline × FSDP apply "
                         "fully_shard inside each stage in API code")
        elif three_d:
            pipe_score = 85.0 if nnodes > 1 else 70.0
            pipe_rule = ("3-D: beyond 10 B params or 32 ranks the guide adds pipeline stages (pipeline × FSDP: "
                         "apply fully_shard inside each stage in API code; kind 'pipeline' alone is one stage per rank)")
        else:
            pipe_score = 20.0 if medium or ddp_fits is False else 5.0
            pipe_rule = "the model fits without stages: a pipeline only adds its bubble"
        drafts.append(_Draft("pipeline", "pipeline", pipe_score, pipe, fits(pipe), [state_text, pipe_why, pipe_rule],
                             {"strategy": {"kind": "pipeline"}, "pipeline": {"n_microbatches": microbatches}}))

    # CPU offload when nothing fits on the device ---------------------------------------------
    if gpus and full_fits is False:
        need = math.ceil(state / mem)
        drafts.append(_Draft(
            "fsdp full shard + cpu offload", "fsdp", 100.0, 0.0, True,
            [state_text,
             f"nothing fits: even fully sharded {_gb(state)} / {n} = {_gb(full)} per rank > {_gb(mem)} → "
             f"CPUOffloadPolicy keeps the sharded weights, gradients and optimizer state in host memory "
             f"({_gb(full)} of host memory per rank; steps become bound by host-device copies)",
             f"or use ≥ {need} devices of this size to hold the state on the devices"],
            {"strategy": {"kind": "fsdp"}, "fsdp": {"reshard_after_forward": True, "cpu_offload": True}}))

    _add_communication(drafts, num_params=num_params, p=p, n=n, nnodes=nnodes, per_node=per_node,
                       link_gbps=link_gbps, intra_node_gbps=intra_node_gbps, gpus=gpus)
    _add_lr_scaling(drafts, growth=n / reference_world_size, reference=reference_world_size)

    viable = [d for d in drafts if d.fits is not False]
    if not viable:
        least = min(drafts, key=lambda d: d.memory)
        least.score = 1.0
        least.reasons.append(f"does not fit: {_gb(least.memory)} per rank > {_gb(mem)}; needs ≥ "
                             f"{math.ceil(state / mem)} ranks of this memory")
        viable = [least]
    viable.sort(key=lambda d: -d.score)
    return [Candidate(rank=i + 1, name=d.name, config_patch=d.patch, reasons=d.reasons, score=d.score,
                      memory_per_rank_bytes=d.memory, fits=d.fits) for i, d in enumerate(viable)]


def _check_inputs(num_params: Any, p: Any, mem: Any, n: Any, nnodes: Any, link: Any, opt: Any, intra: Any,
                  reference: Any) -> None:
    def integer(what: str, v: Any, low: int) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise invalid(what, f"an integer >= {low}", v)

    def positive(what: str, v: Any) -> None:
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise invalid(what, "a number > 0 (or unset)", v)

    integer("num_params", num_params, 1)
    integer("param_bytes_per_param", p, 1)
    integer("optimizer_bytes_per_param", opt, 0)
    integer("world_size", n, 1)
    integer("nnodes", nnodes, 1)
    integer("reference_world_size", reference, 1)
    positive("device_memory_bytes", mem)
    positive("link_gbps", link)
    positive("intra_node_gbps", intra)
    if n % nnodes:
        raise invalid("world_size", f"a multiple of nnodes ({nnodes})", n)


def _compression_for(link_gbps: float, num_params: int) -> tuple[str, str]:
    """(method, reason) from the link speed alone."""
    if link_gbps < 10:
        if num_params >= POWERSGD_MIN_PARAMS:
            return "powersgd", (f"{link_gbps:g} Gbit/s < 10 and ≥ {_params(POWERSGD_MIN_PARAMS)} params: PowerSGD "
                                "(rank-4 low-rank gradients with error feedback) sends a small fraction of the bytes")
        return "fp16", f"{link_gbps:g} Gbit/s < 10 on a small model: fp16 compression halves the bytes"
    if link_gbps < 25:
        return "fp16", f"{link_gbps:g} Gbit/s in [10, 25): fp16 compression halves the bytes (bf16 if gradients overflow fp16)"
    if link_gbps < 100:
        return "none", (f"{link_gbps:g} Gbit/s in [25, 100): no compression by default; fp16 halves the bytes if "
                        "`torsh-tune profile` shows communication exposed")
    return "none", f"{link_gbps:g} Gbit/s ≥ 100: the link keeps up, compression would only cost accuracy and compute"


def _add_communication(drafts: list[_Draft], *, num_params: int, p: int, n: int, nnodes: int, per_node: int,
                       link_gbps: float | None, intra_node_gbps: float | None, gpus: bool) -> None:
    """Compression / hierarchical all-reduce for DDP (both are its comm hook), reduce dtype for FSDP."""
    if n == 1:
        return
    grad_bytes = float(num_params) * p
    ddp = next(d for d in drafts if d.kind == "ddp")
    if link_gbps is None:
        ddp.reasons.append("link speed unknown (pass --link-gbps): no gradient compression advised")
        method, why = "none", ""
    else:
        ring = 2 * (n - 1) / n * grad_bytes
        t = ring * 8 / (link_gbps * 1e9)
        ddp.reasons.append(f"ring all-reduce moves 2(N−1)/N × {_gb(grad_bytes)} = {_gb(ring)} per rank per step: "
                           f"{_secs(t)} at {link_gbps:g} Gbit/s")
        method, why = _compression_for(link_gbps, num_params)
    slower = (link_gbps is None or intra_node_gbps is None or link_gbps < intra_node_gbps)
    hier_ok = nnodes > 1 and per_node > 1 and slower
    hier_why = ""
    if hier_ok:
        known = "" if intra_node_gbps is not None and link_gbps is not None else " (assumed: intra-node links are faster)"
        speeds = (f" ({link_gbps:g} < {intra_node_gbps:g} Gbit/s)" if link_gbps is not None and intra_node_gbps
                  else "")
        hier_why = (f"{nnodes} nodes over a link slower than inside a node{speeds}{known}: the hierarchical all-reduce "
                    f"(intra-node reduce-scatter, inter-node all-reduce, intra-node all-gather) sends 1/{per_node} of "
                    "the gradient bytes over the slow link, losslessly")
    elif nnodes > 1 and per_node > 1:
        ddp.reasons.append(f"inter-node {link_gbps:g} Gbit/s ≥ intra-node {intra_node_gbps:g} Gbit/s: no hierarchical all-reduce")
    primary_is_compression = method == "powersgd" or not hier_ok
    if primary_is_compression and method != "none":
        ddp.patch["compression"] = {"method": method}
        ddp.name = f"ddp + {method} compression"
        ddp.reasons.append(why)
        if hier_ok:
            drafts.append(_Draft("ddp + hierarchical all-reduce", "ddp", ddp.score - 10, ddp.memory, ddp.fits,
                                 ddp.reasons[:-1] + [hier_why],
                                 {"strategy": {"kind": "ddp"}, "collectives": {"hierarchical": True}}))
    elif hier_ok:
        ddp.patch["collectives"] = {"hierarchical": True}
        ddp.name = "ddp + hierarchical all-reduce"
        ddp.reasons.append(hier_why)
        if method != "none":
            drafts.append(_Draft(f"ddp + {method} compression", "ddp", ddp.score - 5, ddp.memory, ddp.fits,
                                 ddp.reasons[:-1] + [why],
                                 {"strategy": {"kind": "ddp"}, "compression": {"method": method}}))
    elif why:
        ddp.reasons.append(why)
    if gpus and link_gbps is not None and link_gbps < 25:
        for d in drafts:
            if d.kind in ("fsdp", "hsdp"):
                d.patch.setdefault("fsdp", {})["reduce_dtype"] = "bf16"
                d.reasons.append(f"{link_gbps:g} Gbit/s < 25: gradients reduce-scattered in bf16 (fsdp.reduce_dtype) "
                                 "halve the bytes; fsdp.mixed_precision = 'bf16' halves the all-gathers too")


def _add_lr_scaling(drafts: list[_Draft], *, growth: float, reference: int) -> None:
    """training.lr_scaling / lr_warmup_steps for the data-parallel candidates."""
    for d in drafts:
        if d.kind == "pipeline":
            d.reasons.append("one pipeline keeps the global batch: no learning-rate scaling")
            continue
        if growth <= 1:
            continue
        warmup = int(math.ceil(WARMUP_STEPS_PER_DOUBLING * math.log2(growth)))
        if growth <= LINEAR_LR_MAX_GROWTH:
            how, rule = "linear", f"≤ {LINEAR_LR_MAX_GROWTH}×: linear LR scaling (Goyal et al.)"
        else:
            how, rule = "sqrt", f"> {LINEAR_LR_MAX_GROWTH}×: square-root LR scaling (linear overshoots at this size)"
        d.patch["training"] = {"lr_scaling": how, "lr_warmup_steps": warmup}
        d.reasons.append(f"global batch {growth:g}× the batch at {reference} rank(s) the LR was tuned for, {rule}, "
                         f"with {warmup} warm-up steps ({WARMUP_STEPS_PER_DOUBLING} per doubling)")


def advice_table(candidates: list[Candidate]) -> list[dict[str, Any]]:
    """The candidates as JSON-serialisable rows (for reports and `torsh-tune advise --json`)."""
    return [
        {
            "rank": c.rank,
            "name": c.name,
            "kind": c.config_patch.get("strategy", {}).get("kind"),
            "score": c.score,
            "memory_per_rank_bytes": c.memory_per_rank_bytes,
            "memory_per_rank_gb": round(c.memory_per_rank_bytes / 1e9, 3),
            "fits": c.fits,
            "config_patch": c.config_patch,
            "reasons": list(c.reasons),
        }
        for c in candidates
    ]
