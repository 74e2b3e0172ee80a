"""Predict DDP step times from a fitted communication model, and warm-start a study with them.

A `torsh-tune bench` run fits an alpha-beta model of the fabric (`torsh_tune.fabric`).
With one baseline profile of the workload (its step phases and gradient buckets), the model
predicts the step time of other DDP settings without running them:

- Buckets: DDP's rule over the gradient tensors in the order they become ready (a bucket
  closes once it holds >= its cap; the first cap is `first_bucket_cap_mb`, then
  `bucket_cap_mb`; MiB). The tensors come from the baseline's recorded buckets (`step_inputs`)
  or, when unknown, are `num_tensors` equal parts of the gradient.
- Readiness: backward produces gradient bytes uniformly over its compute time, so a bucket is
  ready when the backward has covered the bytes up to its end.
- Collectives run one at a time (one stream): finish_i = max(ready_i, finish_{i-1}) + t_i;
  exposed = max(0, last finish - backward); step = other + backward + exposed.
- Per bucket of b bytes (fp32 gradients) on the wire, as the hooks of
  `torsh_tune.strategies.compression` send it: none, one all-reduce of b (ring, or
  hierarchical across nodes); fp16/bf16, one all-reduce of b/2; int8, an all-reduce of 4 bytes
  (the shared scale) then one of b/4; topk at ratio r, k = ceil(r * b/4) values and int32
  indices (8k bytes per rank) all-gathered (bench sizing: the gathered output, world x 8k),
  or a dense all-reduce of b when 8k >= b.

What it does not know, and says in `Prediction.notes`: the compute cost of compressing and
decompressing (casts, top-k selection, scatter-adds; on a CPU it can cost as much as the
transfer it saves), and what a lossy method does to the loss. PowerSGD (its wire size needs
every gradient's matrix shape, which a run does not record) and adaptive (its ratio follows
the loss at run time) are not predicted (`UNPREDICTABLE_METHODS`). Fit the bench on the
sizes the buckets have: on a token-bucket link (tc tbf) messages under its burst pass at memory
speed, and one line through both regimes got 1/beta wrong by up to 1.8x (BENCHMARKS.md).

Example:
    >>> from torsh_tune.fabric import AlphaBeta, CommModel
    >>> link = AlphaBeta(collective="all_reduce", level="intra", group_size=2, alpha_s=0.0,
    ...                  beta_s_per_byte=1e-8, num_points=4)
    >>> model = CommModel(world_size=2, nnodes=1, nproc_per_node=2, fits=(link,))
    >>> p = predict_ddp_step(model, grad_bytes=100 << 20, num_tensors=1, backward_s=0.5, other_s=0.1,
    ...                      world_size=2, nnodes=1, params={"compression.method": "fp16"})
    >>> round(p.exposed_comm_s, 3), round(p.step_s, 3)
    (0.524, 1.124)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import invalid
from ..fabric import CommModel, predict_allreduce_s
from .seeding import _complete, _key
from .space import BASELINE_PARAMS, SearchSpace

__all__ = [
    "ModelCandidate",
    "Prediction",
    "StepInputs",
    "UNPREDICTABLE_METHODS",
    "model_candidates",
    "predict_ddp_step",
    "predict_params",
    "step_inputs",
]

_MIB = 1 << 20
_FP32_BYTES = 4
_TOPK_ENTRY_BYTES = 8  # a float32 value and its int32 index
#: Compression methods the model cannot predict -> why.
UNPREDICTABLE_METHODS: dict[str, str] = {
    "powersgd": "its wire size needs every gradient's matrix shape, which a run does not record",
    "adaptive": "its kept fraction follows the loss at run time",
}
_COMPUTE_NOTE = "compression compute (compress/decompress) is not modelled: the predicted step is a lower bound"
# Candidate values tried by `model_candidates` (clipped to each dimension).
_BUCKET_CAPS_MB = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0)
_FIRST_BUCKET_CAPS_MB = (0.25, 1.0, 5.0, 25.0)
# Top-K ratios: not below the default (0.01): the model sees only wire time, not what a
# sparser gradient costs the loss, so it would always pick the sparsest.
_TOPK_RATIOS = (0.01, 0.05)
_TIE_REL = 1e-3  # predictions this close count as equal: the one changing fewer knobs wins


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """The model's step time of one DDP configuration.

    Attributes:
        step_s: other_s + backward_s + exposed_comm_s.
        backward_s: backward compute (without waiting for communication), as given.
        other_s: everything else in a step (data, forward, optimizer), as given.
        comm_s: the sum of the collectives' predicted times.
        exposed_comm_s: communication left after backward compute ended.
        bucket_bytes: gradient bytes of each bucket, in the order they become ready.
        wire_bytes: bytes this rank hands to collectives per step (after compression).
        num_collectives: collectives per step.
        method: compression method.
        algorithm: all-reduce algorithm ("ring", or "hierarchical" across nodes).
        notes: what the model leaves out for this configuration.
    """

    step_s: float
    backward_s: float
    other_s: float
    comm_s: float
    exposed_comm_s: float
    bucket_bytes: tuple[int, ...]
    wire_bytes: int
    num_collectives: int
    method: str
    algorithm: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """What the model needs from a baseline run (see `step_inputs`).

    Attributes:
        grad_bytes: gradient bytes all-reduced per step (the first DDP model's parameters).
        num_tensors: gradient tensors.
        tensor_bytes: estimated tensor sizes in the order they become ready, from the recorded
            buckets (None: unknown, `predict_ddp_step` splits `grad_bytes` evenly).
        backward_s: median backward compute (backward minus its exposed communication).
        other_s: median rest of a step (step minus backward).
        measured_step_s: median measured step (the slowest rank of each step).
        samples_per_step: median samples per step, summed over the ranks.
        world_size: ranks.
        nnodes: nodes.
        settings: the baseline's own values of the dimensions the model reads
            (`ddp.bucket_cap_mb`, `ddp.first_bucket_cap_mb`, `compression.method`, ...).
    """

    grad_bytes: int
    num_tensors: int
    tensor_bytes: tuple[int, ...] | None
    backward_s: float
    other_s: float
    measured_step_s: float
    samples_per_step: float
    world_size: int
    nnodes: int
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ModelCandidate:
    """A configuration the model predicts faster than the baseline's.

    Attributes:
        params: trial parameters of the space (for `study.enqueue_trial`).
        predicted_step_s: the model's step time of `params`.
        baseline_predicted_step_s: the model's step time of the baseline params (trial 0).
        predicted_speedup: baseline_predicted_step_s / predicted_step_s.
        why: one line: what changes and what the model expects of it.
        prediction: the full prediction of `params`.
    """

    params: dict[str, Any]
    predicted_step_s: float
    baseline_predicted_step_s: float
    predicted_speedup: float
    why: str
    prediction: Prediction


# -- one configuration ------------------------------------------------------------------------
def predict_ddp_step(
    model: CommModel,
    *,
    grad_bytes: int,
    num_tensors: int,
    backward_s: float,
    other_s: float,
    world_size: int,
    nnodes: int = 1,
    params: Mapping[str, Any],
    tensor_bytes: Sequence[int] | None = None,
) -> Prediction:
    """Predict the step time of DDP under `params` from the fitted model.

    Args:
        model: A fitted model with an all_reduce fit (and all_gather for topk; without it
            the all-gather is taken as half a ring all-reduce of its output).
        grad_bytes: fp32 gradient bytes all-reduced per step.
        num_tensors: gradient tensors (used when `tensor_bytes` is None).
        backward_s: backward compute, without waiting for communication.
        other_s: the rest of a step (data, forward, optimizer).
        world_size: ranks.
        nnodes: nodes; > 1 with `collectives.hierarchical` uses the hierarchical all-reduce.
        params: trial parameters; read: `ddp.bucket_cap_mb` (default 25),
            `ddp.first_bucket_cap_mb` (1), `compression.method` ("none"), `compression.ratio`
            (0.01), `collectives.hierarchical` (False).
        tensor_bytes: tensor sizes in ready order (summing to about `grad_bytes`).

    Returns:
        The prediction.

    Raises:
        ConfigError: an unpredictable compression method (`UNPREDICTABLE_METHODS`) or a model
            without an all_reduce fit.
    """
    method = str(params.get("compression.method", "none"))
    if method in UNPREDICTABLE_METHODS:
        raise invalid("compression.method", f"a method the model predicts (not {method}: "
                      f"{UNPREDICTABLE_METHODS[method]})", method)
    cap_mb = float(params.get("ddp.bucket_cap_mb", BASELINE_PARAMS["ddp.bucket_cap_mb"]))
    first_mb = float(params.get("ddp.first_bucket_cap_mb", BASELINE_PARAMS["ddp.first_bucket_cap_mb"]))
    algorithm = "hierarchical" if nnodes > 1 and params.get("collectives.hierarchical") else "ring"
    if tensor_bytes is None:
        n = max(int(num_tensors), 1)
        tensor_bytes = [grad_bytes / n] * n
    buckets = _buckets(tensor_bytes, first_cap_bytes=first_mb * _MIB, cap_bytes=cap_mb * _MIB)
    total = sum(buckets) or 1.0
    done, finish = 0.0, 0.0
    comm_s, wire, calls = 0.0, 0, 0
    for b in buckets:
        done += b
        ready_s = backward_s * done / total
        t, w, c = _bucket_comm(model, b, method=method, ratio=float(params.get("compression.ratio", 0.01)),
                               algorithm=algorithm, world_size=world_size, nnodes=nnodes)
        finish = max(ready_s, finish) + t
        comm_s, wire, calls = comm_s + t, wire + w, calls + c
    exposed = max(0.0, finish - backward_s) if buckets else 0.0
    notes = []
    if method != "none":
        notes.append(_COMPUTE_NOTE)
    if (world_size, nnodes) != (model.world_size, model.nnodes):
        notes.append(f"bench measured {model.world_size} ranks on {model.nnodes} node(s), predicted for "
                     f"{world_size} on {nnodes}: alpha/beta are assumed to carry over")
    return Prediction(step_s=other_s + backward_s + exposed, backward_s=backward_s, other_s=other_s, comm_s=comm_s,
                      exposed_comm_s=exposed, bucket_bytes=tuple(int(round(b)) for b in buckets), wire_bytes=int(wire),
                      num_collectives=calls, method=method, algorithm=algorithm, notes=tuple(notes))


def _buckets(tensor_bytes: Sequence[float], *, first_cap_bytes: float, cap_bytes: float) -> list[float]:
    """DDP's bucket assignment by size: a bucket closes once it holds >= its cap."""
    out, cur, limit = [], 0.0, first_cap_bytes
    for t in tensor_bytes:
        cur += float(t)
        if cur >= limit:
            out.append(cur)
            cur, limit = 0.0, cap_bytes
    if cur > 0:
        out.append(cur)
    return out


def _bucket_comm(model: CommModel, b: float, *, method: str, ratio: float, algorithm: str, world_size: int,
                 nnodes: int) -> tuple[float, float, int]:
    """(seconds, wire bytes, collectives) of one bucket of `b` fp32 gradient bytes."""

    def allreduce(size: float) -> float:
        return predict_allreduce_s(model, size, algorithm=algorithm, world_size=world_size, nnodes=nnodes)

    if method in ("fp16", "bf16"):
        return allreduce(b / 2), b / 2, 1
    if method == "int8":
        return allreduce(4) + allreduce(b / 4), 4 + b / 4, 2
    if method == "topk":
        numel = max(int(b // _FP32_BYTES), 1)
        k = max(1, min(numel, math.ceil(ratio * numel)))
        payload = k * _TOPK_ENTRY_BYTES
        if payload >= b:
            return allreduce(b), b, 1
        return _allgather_s(model, world_size * payload, world_size), payload, 1
    if method != "none":
        raise invalid("compression.method", "none, fp16, bf16, int8 or topk", method)
    return allreduce(b), b, 1


def _allgather_s(model: CommModel, out_bytes: float, world_size: int) -> float:
    """An all-gather with `out_bytes` of output (bench sizing) on `world_size` ranks."""
    fit = model.get("all_gather")
    if fit is not None:
        return replace(fit, group_size=world_size).predict_s(out_bytes)
    ring = model.get("all_reduce")
    if ring is None:
        raise invalid("model", "a fit of all_reduce", [f"{f.collective}/{f.level}" for f in model.fits])
    # Half of a ring all-reduce: (n-1) steps, (n-1)/n of the output on each link.
    return predict_allreduce_s(model, out_bytes, world_size=world_size) / 2


# -- the baseline run ---------------------------------------------------------------------------
def step_inputs(run_dir: str | os.PathLike[str]) -> StepInputs:
    """Read what `predict_ddp_step` needs from a profiled baseline run.

    Medians over the measured (non-warm-up) steps of every rank; backward compute is
    `backward_s - exposed_comm_s` (DDP's backward waits for its last bucket). Tensor sizes
    are estimated from the recorded buckets (DDP's logging of its rebuilt buckets, else the
    per-bucket comm records): DDP closed each bucket that reached its cap on the tensor that
    took it there, so that tensor is taken to hold all but half a cap and the others to share
    the rest; the tensors of a bucket below its cap are taken as equal.

    Raises:
        ConfigError: the run recorded no measured step or no DDP model.
    """
    from ..analysis import comm_timed, load_run  # pandas: only when a run is read

    run = load_run(run_dir)
    steps = run.steps
    if not steps.empty:
        steps = steps[~steps["warmup"].fillna(False).astype(bool)]
    if steps.empty:
        raise invalid("baseline run", "a run with measured steps", str(run_dir))
    meta = next((m for _, m in sorted(run.meta.items()) if m.get("ddp_models")), None)
    if meta is None:
        raise invalid("baseline run", "a DDP run (a recorded DDP model)", str(run_dir))
    timed = comm_timed(steps)  # steps whose DDP all-reduce went untimed would hide their exposure in the backward
    exposed = timed["exposed_comm_s"].fillna(0.0)
    backward = float((timed["backward_s"] - exposed).clip(lower=0.0).median())
    other = float((steps["step_s"] - steps["backward_s"]).clip(lower=0.0).median())
    by_step = steps.groupby("step")
    measured = float(by_step["step_s"].max().median())
    samples = float(by_step["samples"].sum().median())
    ddp = meta["ddp_models"][0]
    cap, first = float(ddp.get("bucket_cap_mb") or 25.0), float(ddp.get("first_bucket_cap_mb") or 1.0)
    launch = run.config.get("launch") or {}
    strategy = run.config.get("strategy") or {}
    compression = strategy.get("compression") or run.config.get("compression") or {}
    collectives = strategy.get("collectives") or run.config.get("collectives") or {}
    buckets = _recorded_buckets(meta, run.comm)
    settings = {"ddp.bucket_cap_mb": cap, "ddp.first_bucket_cap_mb": first,
                "compression.method": compression.get("method") or "none",
                "compression.ratio": compression.get("ratio") or BASELINE_PARAMS["compression.ratio"],
                "collectives.hierarchical": bool(collectives.get("hierarchical", False))}
    return StepInputs(
        grad_bytes=int(ddp["param_bytes"]), num_tensors=int(ddp.get("num_param_tensors") or 1),
        tensor_bytes=None if buckets is None else _tensor_estimate(buckets, first_cap_bytes=first * _MIB,
                                                                   cap_bytes=cap * _MIB),
        backward_s=backward, other_s=other, measured_step_s=measured, samples_per_step=samples,
        world_size=int(run.world_size), nnodes=int(launch.get("nnodes") or 1), settings=settings)


def _recorded_buckets(meta: Mapping[str, Any], comm: Any) -> list[tuple[float, int]] | None:
    """(bytes, tensors) of each DDP bucket in ready order: DDP's own logging (rebuilt buckets)
    when the rank recorded it, else the per-bucket comm records of the last step."""
    log = meta.get("ddp_logging") or {}
    sizes, indices = log.get("rebuilt_bucket_sizes"), log.get("rebuilt_per_bucket_param_indices")
    if sizes and indices:
        byte_counts = [float(x) for x in str(sizes).split(",") if x.strip()]
        tensor_counts = [len(group.split()) for group in str(indices).split(",")]
        if len(byte_counts) == len(tensor_counts):
            return list(zip(byte_counts, tensor_counts))
    if comm.empty or "bucket" not in comm.columns:
        return None
    rows = comm[(comm["bucket"] >= 0) & comm["bytes"].notna()]  # -1: one record for DDP's untimed all-reduce
    if rows.empty:
        return None
    rows = rows[rows["rank"] == rows["rank"].min()]
    rows = rows[rows["step"] == rows["step"].max()].drop_duplicates("bucket").sort_values("bucket")
    return list(zip(rows["bytes"].astype(float), rows["num_tensors"].fillna(1).astype(int)))


def _tensor_estimate(buckets: Sequence[tuple[float, int]], *, first_cap_bytes: float,
                     cap_bytes: float) -> tuple[int, ...]:
    """Tensor sizes in ready order from (bytes, tensors) buckets built with these caps."""
    out: list[float] = []
    for i, (b, t) in enumerate(buckets):
        cap = first_cap_bytes if i == 0 else cap_bytes
        t = max(int(t), 1)
        if t > 1 and b >= cap:
            small = min(cap / 2, b * (t - 1) / t)  # the t-1 tensors before the closing one held < cap
            out += [small / (t - 1)] * (t - 1) + [b - small]
        else:
            out += [b / t] * t
    return tuple(int(round(x)) for x in out)


# -- warm start ---------------------------------------------------------------------------------
def model_candidates(
    model: CommModel,
    baseline_run_dir: str | os.PathLike[str],
    space: SearchSpace,
    *,
    top: int = 2,
    min_gain: float = 0.05,
    exclude: Sequence[Mapping[str, Any]] = (),
    skipped: list[str] | None = None,
) -> list[ModelCandidate]:
    """The configurations the communication model predicts fastest, as trial parameters of `space`.

    For the tuner's warm start (`seeding.seed_study`, role "model"): enqueue each returned
    candidate's `params` with `study.enqueue_trial(c.params, user_attrs={"role": "model",
    "predicted_speedup": c.predicted_speedup, "why": c.why})` after trial 0 and the advisor's.
    Call it inside a try/except that only warns (like the advisor): a missing fit or a
    baseline without DDP raises.

    Inputs come from the baseline run (`step_inputs`: median step phases, gradient bytes and
    buckets). Candidates: a small grid over the dimensions the model speaks to, each inside
    its (narrowed or fixed) `Dimension`: `ddp.bucket_cap_mb` (1-200 MiB ladder, or the
    dimension's choices), `ddp.first_bucket_cap_mb` (0.25-25 MiB, never above the cap),
    `compression.method` (the space's methods but `UNPREDICTABLE_METHODS`), Top-K's
    `compression.ratio` (0.01 and 0.05: never sparser than the default), and
    `collectives.hierarchical` when the run spans nodes. Every other dimension keeps
    `space.baseline_params()`. Each candidate is completed as `space.suggest` would ask it
    (only active, non-fixed dimensions), so it can be enqueued as is.

    Args:
        model: The fabric's fitted model (`torsh_tune.fabric.load_model(bench_run)`).
        baseline_run_dir: The study's baseline run (profiled DDP, trial 0's settings).
        space: The study's search space.
        top: At most this many candidates.
        min_gain: Only candidates predicted faster than the baseline params by more than this
            fraction (predicted_speedup > 1 + min_gain).
        exclude: Parameter sets already enqueued (trial 0 is always excluded).
        skipped: Receives one line per method (or strategy kind) left out, with the reason.

    Returns:
        Up to `top` candidates, fastest first, distinct from each other, from trial 0 and
        from `exclude`, each with a predicted step of its own: of candidates predicted equal
        (within 0.1 %) only the one changing fewest dimensions, and none predicted equal to
        an excluded set. Empty when nothing beats the baseline by `min_gain`, or when the
        study's strategy kind is not DDP.

    Raises:
        ConfigError: the model has no all_reduce fit, or the run has no measured DDP steps.

    Example:
        >>> from torsh_tune.fabric import load_model
        >>> found = model_candidates(load_model("runs/bench"), "runs/baseline", space)  # doctest: +SKIP
        >>> [(c.params["compression.method"], round(c.predicted_speedup, 2)) for c in found]  # doctest: +SKIP
        [('topk', 3.1), ('int8', 2.4)]
    """
    if top < 0:
        raise invalid("top", "an integer >= 0", top)
    if min_gain < 0:
        raise invalid("min_gain", ">= 0", min_gain)
    notes = skipped if skipped is not None else []
    if space.base_kind != "ddp" or top == 0:
        if space.base_kind != "ddp":
            notes.append(f"strategy kind {space.base_kind}: the model predicts DDP only")
        return []
    inputs = step_inputs(baseline_run_dir)
    baseline = _complete(space, space.baseline_params())
    base_pred = predict_params(model, inputs, space, baseline)
    excluded = [_complete(space, {**space.baseline_params(), **dict(p)}) for p in exclude]
    seen = {_key(baseline)} | {_key(p) for p in excluded}
    # Step times already on the queue: a candidate predicted the same adds nothing the model knows.
    taken = [predict_params(model, inputs, space, p).step_s for p in excluded if _valid(space, p)]
    scored: list[tuple[float, int, dict[str, Any], Prediction]] = []
    for changes in _grid(space, inputs, notes):
        params = _complete(space, {**space.baseline_params(), **changes})
        if not _valid(space, params) or _key(params) in seen:
            continue
        seen.add(_key(params))
        pred = predict_params(model, inputs, space, params)
        changed = sum(1 for k, v in params.items() if baseline.get(k) != v)
        scored.append((pred.step_s, changed, params, pred))
    scored.sort(key=lambda s: (s[0], s[1]))
    out: list[ModelCandidate] = []
    for step_s, _, params, pred in scored:
        if len(out) >= top or base_pred.step_s / step_s <= 1 + min_gain:
            break
        if any(abs(step_s - t) <= _TIE_REL * step_s for t in taken):
            continue  # the same prediction as a kept or excluded one, with more changes than the kept
        taken.append(step_s)
        out.append(ModelCandidate(params=params, predicted_step_s=step_s, baseline_predicted_step_s=base_pred.step_s,
                                  predicted_speedup=base_pred.step_s / step_s,
                                  why=_why(model, params, baseline, pred, base_pred, inputs), prediction=pred))
    return out


def predict_params(model: CommModel, inputs: StepInputs, space: SearchSpace, params: Mapping[str, Any]) -> Prediction:
    """`predict_ddp_step` for trial parameters of `space`; a dimension they do not set takes its
    fixed value in the space, else the baseline run's own setting."""
    fixed = {name: dim.value for name, dim in space.dims.items() if dim.fixed}
    effective = {**inputs.settings, **fixed, **dict(params)}
    return predict_ddp_step(model, grad_bytes=inputs.grad_bytes, num_tensors=inputs.num_tensors,
                            backward_s=inputs.backward_s, other_s=inputs.other_s, world_size=inputs.world_size,
                            nnodes=inputs.nnodes, params=effective, tensor_bytes=inputs.tensor_bytes)


def _values(dim: Any, ladder: Sequence[float], *extra: Any) -> list[Any]:
    """The ladder's values (and `extra`) that lie in `dim`, or its choices / fixed value."""
    if dim is None:
        return []
    if dim.fixed:
        return [dim.value]
    if dim.choices:
        return list(dim.choices)
    vals = [v for v in (*ladder, *extra) if v is not None and dim.contains(v)]
    return sorted(set(vals)) or [dim.low]


def _grid(space: SearchSpace, inputs: StepInputs, notes: list[str]) -> list[dict[str, Any]]:
    """Changes to the baseline params: buckets x compression (x hierarchical)."""
    dims = space.dims
    caps = _values(dims.get("ddp.bucket_cap_mb"), _BUCKET_CAPS_MB, inputs.settings.get("ddp.bucket_cap_mb")) or [None]
    firsts = _values(dims.get("ddp.first_bucket_cap_mb"), _FIRST_BUCKET_CAPS_MB) or [None]
    methods: list[Any] = [None]
    if "compression.method" in dims:
        methods = []
        for m in _values(dims["compression.method"], ()):
            if m in UNPREDICTABLE_METHODS:
                notes.append(f"compression.method={m}: not predicted: {UNPREDICTABLE_METHODS[m]}")
            else:
                methods.append(m)
    ratios = _values(dims.get("compression.ratio"), _TOPK_RATIOS) or [None]
    hier = [False, True] if inputs.nnodes > 1 and "collectives.hierarchical" in dims else [None]
    out: list[dict[str, Any]] = []
    for cap in caps:
        for first in firsts:
            if first is not None and cap is not None and first > cap:
                continue
            for method in methods:
                for ratio in (ratios if method == "topk" else [None]):
                    for h in (hier if method in (None, "none") else [None]):
                        changes = {"ddp.bucket_cap_mb": cap, "ddp.first_bucket_cap_mb": first,
                                   "compression.method": method, "compression.ratio": ratio,
                                   "collectives.hierarchical": h}
                        out.append({k: v for k, v in changes.items() if v is not None})
    return out


def _valid(space: SearchSpace, params: Mapping[str, Any]) -> bool:
    """Every value inside its dimension, and the first bucket not above the bucket cap."""
    if not all(space.dims[k].contains(v) for k, v in params.items()):
        return False
    cap = params.get("ddp.bucket_cap_mb", space.base_bucket_cap_mb)
    return params.get("ddp.first_bucket_cap_mb", 0.0) <= cap


def _why(model: CommModel, params: Mapping[str, Any], baseline: Mapping[str, Any], pred: Prediction,
         base: Prediction, inputs: StepInputs) -> str:
    """One line: what the candidate changes and what the model expects of it."""
    mib = inputs.grad_bytes / _MIB
    fit = model.get("all_reduce")
    link = f"a {fit.busbw_gbps:.3g} GB/s link" if fit is not None and fit.busbw_gbps else "this link"
    parts = []
    method = pred.method
    if method in ("fp16", "bf16"):
        parts.append(f"{method} halves {mib:.0f} MiB")
    elif method == "int8":
        parts.append(f"int8 quarters {mib:.0f} MiB")
    elif method == "topk":
        parts.append(f"topk {params.get('compression.ratio', BASELINE_PARAMS['compression.ratio']):g} sends "
                     f"{pred.wire_bytes / _MIB:.2f} of {mib:.0f} MiB")
    if pred.algorithm == "hierarchical":
        parts.append(f"hierarchical all-reduce over {inputs.nnodes} nodes")
    if pred.bucket_bytes != base.bucket_bytes:
        parts.append(f"buckets of {_mib_list(pred.bucket_bytes)} MiB instead of {_mib_list(base.bucket_bytes)}")
    if not parts:
        changed = [k for k, v in params.items() if baseline.get(k) != v]
        parts.append(", ".join(changed) or "the same communication")
    tail = "; compression compute not modelled" if method != "none" else ""
    return (f"{' and '.join(parts)} on {link}: exposed comm {base.exposed_comm_s:.2f} s → "
            f"{pred.exposed_comm_s:.2f} s, step {base.step_s:.2f} s → {pred.step_s:.2f} s{tail}")


def _mib_list(sizes: Sequence[int]) -> str:
    shown = "/".join(f"{b / _MIB:.3g}" for b in sizes[:4])
    return shown + ("/…" if len(sizes) > 4 else "")
