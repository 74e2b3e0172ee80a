"""Recommendations: concrete actions per bottleneck, with gains bounded by this run's numbers.

Every expected gain is a range of % of the median step time computed from the bottleneck's
evidence (the time a change can remove is at most the time the bottleneck costs), never a
canned figure. `config_patch` is what `RunConfig().apply_patch` accepts; {} when no
torsh-tune knob can do it (e.g. repairing a slow host).

Quantities are sized from the run, and the arithmetic is in the gain's `basis`:

- DataLoader workers: from the data wait, the rest of the step and the CPU the ranks use
  and leave idle (`size_workers`); when the cores are saturated the recommendation says that
  workers will not help and what would.
- DDP bucket cap: the cap, among values a person would write, whose predicted exposed
  communication is least: the measured gradient bytes become ready uniformly over the measured
  backward compute, buckets are all-reduced one at a time, each taking alpha + bus bytes x beta
  (the alpha-beta model of the run's `--reference-bench`, else fitted to this run's own
  collectives: its per-step wire time and its last collective's).
- DDP's buffer broadcast (`broadcast_buffers=False`): at most its measured time per step (it
  blocks the forward), at least its transfer (the wait for the last rank may move to the next
  collective); the text says whether the buffers are running statistics the forward updates.
- Top-K compression ratio: the share of today's communication time that backward already
  hides, divided by the world size (Top-K all-gathers value + index, 8 bytes per kept entry:
  world x ratio of the dense all-reduce's bus bytes), so the compressed transfer fits there.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..fabric import bus_factor, load_model
from ._bottlenecks import LATENCY_BOUND_BYTES, theoretical_bubble_pct
from ._workers import WorkerSizing, host_idle_cores_per_rank, size_workers
from ._runinfo import cpu_count, dig, nproc_per_node
from ._types import SEVERITIES, Bottleneck, GainRange, Recommendation

__all__ = ["choose_num_workers", "recommend"]

_MiB = 1024 * 1024
#: Bucket caps (MiB) a recommendation chooses from: values a person would write.
_BUCKET_CAPS_MB = (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0)
#: Top-K ratios recommended: not below the config's default 0.01 (the model sees the wire, not
#: what a sparser gradient costs the loss), not above the search space's 0.1.
_TOPK_RATIO_MIN, _TOPK_RATIO_MAX = 0.01, 0.1
_TOPK_ENTRY_BYTES, _FP32_BYTES = 8, 4
#: A synchronous collective outside the gradients (DDP's buffer broadcast, a framework's per-step flag) is
#: recommended away from this share of the step (below it, noise and the kernel launch).
_SYNC_MIN_PCT = 1.0


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
    drafts: list[tuple[int, int, Recommendation]] = []
    # Redundant all-reduces (accumulation outside no_sync) are part of the exposed communication the
    # general finding grades, and their fix is lossless and changes what compression or bucket sizing
    # would gain: it comes first, at that finding's severity if higher.
    comm_level = min((SEVERITIES.index(b.severity) for b in bottlenecks if b.category == "communication"),
                     default=len(SEVERITIES))
    for b in bottlenecks:
        # Low GPU utilisation is a computation bottleneck with its own remedies.
        key = "gpu_util" if b.category == "computation" and "gpu_util_pct" in b.evidence else b.category
        key = "checkpoint" if b.category == "io" and "checkpoint_pct" in b.evidence else key
        key = "evaluation" if b.category == "computation" and "eval_pct" in b.evidence else key
        key = "loader_restart" if b.category == "io" and "restart_pct" in b.evidence else key
        key = "redundant_sync" if b.category == "communication" and "redundant_exposed_pct" in b.evidence else key
        make = _RULES.get(key)
        if make is None:
            continue
        level, first = SEVERITIES.index(b.severity), key == "redundant_sync"
        for rec in make(b, ctx):
            drafts.append((min(level, comm_level) if first else level, 0 if first else 1, rec))
    drafts.sort(key=lambda item: (item[0], item[1], -item[2].expected_gain.high_pct))
    out = []
    for i, (_, _, rec) in enumerate(drafts, start=1):
        out.append(Recommendation(priority=i, category=rec.category, title=rec.title, rationale=rec.rationale,
                                  config_patch=rec.config_patch, expected_gain=rec.expected_gain,
                                  effort=rec.effort, verified_by=rec.verified_by))
    return tuple(out)


def choose_num_workers(io: Bottleneck, *, cpu_count: int | None, ranks_per_node: int,
                       current: int = 0) -> WorkerSizing:
    """DataLoader workers per rank for an `io` finding, sized from its measured step, data wait and CPU.

    The idle cores per rank are the finding's (`idle_cores_per_rank`: the sampler's, over the
    cores the ranks may run on); a finding without them (a run recorded before the sampler
    kept them, or `diagnose` called without `host_cores_per_rank`) falls back to
    cpu_count / ranks per node x the host's idle share. `size_workers` has the arithmetic.

    Example:
        >>> io = diagnose(breakdown=analysis.breakdown, system=analysis.system)[0]  # doctest: +SKIP
        >>> choose_num_workers(io, cpu_count=2, ranks_per_node=2).workers  # doctest: +SKIP
        2
    """
    ev = io.evidence
    rank_pct, busy_pct = ev.get("rank_cpu_pct"), ev.get("host_cpu_busy_pct")
    idle, where = ev.get("idle_cores_per_rank"), ev.get("idle_cores_basis")
    if idle is None and cpu_count and busy_pct is not None:
        idle, where = host_idle_cores_per_rank(host_cores_per_rank=cpu_count / max(ranks_per_node, 1),
                                               host_busy_pct=float(busy_pct))
    sizing = size_workers(step_s=float(ev["step_s"]), data_s=float(ev["data_s"]), current=current,
                          rank_cpu_cores=None if rank_pct is None else float(rank_pct) / 100.0,
                          idle_cores_per_rank=None if idle is None else float(idle))
    if where:
        return dataclasses.replace(sizing, arithmetic=f"{where}; {sizing.arithmetic}")
    return sizing


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
        # The parameters the first stepping optimizer owns (meta.json `trained`).
        self.trained = first.get("trained") if isinstance(first.get("trained"), dict) else {}

    def hostname(self, rank: int) -> str | None:
        host = self.meta.get(rank, {}).get("hostname")
        return str(host) if host else None

    def num_workers(self) -> int:
        """The workers the run's (first) DataLoader ran with: meta.json, else config.json, else 0."""
        for m in (self.meta[r] for r in sorted(self.meta)):
            loaders = m.get("dataloaders")
            if isinstance(loaders, list) and loaders and isinstance(loaders[0].get("num_workers"), int):
                return int(loaders[0]["num_workers"])
        current = dig(self.config, "strategy", "dataloader", "num_workers")
        return current if isinstance(current, int) else 0


def _gain(low: float, high: float, basis: str, *, of: str = "step") -> GainRange:
    high = min(max(high, 0.0), 100.0)
    low = min(max(low, 0.0), high)
    return GainRange(low_pct=round(low, 2), high_pct=round(high, 2), basis=basis, of=of)


def _rec(category: str, title: str, rationale: str, patch: dict[str, Any], gain: GainRange, effort: str) -> Recommendation:
    return Recommendation(priority=0, category=category, title=title, rationale=rationale,
                          config_patch=patch, expected_gain=gain, effort=effort)


def _io(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    d = float(b.evidence["data_wait_pct"])
    if "step_s" not in b.evidence:  # a finding recorded before the sizing inputs were kept
        return []
    current = ctx.num_workers()
    sizing = choose_num_workers(b, cpu_count=ctx.cpu_count, ranks_per_node=ctx.ranks_per_node, current=current)
    if sizing.saturated:
        return [_rec(
            "io",
            "More DataLoader workers will not help: the CPU cores are saturated; make each batch cheaper to load",
            f"ranks wait {d:.1f} % of each step for the next batch, and the cores a worker would need are busy "
            f"({_idle_text(b.evidence)}): workers could save at most "
            f"{sizing.high_pct:.1f} % of the step. What would help: a cheaper collate_fn or augmentation (vectorised over the batch, or moved to the "
            "GPU), preprocessing offline (store decoded, augmented tensors), or more cores per rank (fewer ranks "
            "per host, a larger CPU allocation)",
            {},
            _gain(0.0, d, f"{sizing.arithmetic}; a cheaper batch saves at most the data wait {d:.1f} %"),
            "medium",
        )]
    workers = sizing.workers
    patch: dict[str, Any] = {"dataloader": {"num_workers": workers, "persistent_workers": True}}
    if ctx.device.startswith("cuda"):
        patch["dataloader"]["pin_memory"] = True
    return [_rec(
        "io",
        f"Load data in {workers} DataLoader worker process{'es' if workers > 1 else ''} per rank (now {current})",
        f"ranks wait {d:.1f} % of each step for the next batch; {workers} workers have one ready every "
        f"{1e3 * sizing.load_s / workers:.3g} ms while the step computes",
        patch,
        _gain(sizing.low_pct, sizing.high_pct, sizing.arithmetic),
        "low",
    )]


def _checkpoint(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    """Checkpoint saves that block training: save asynchronously, or less often."""
    ev = b.evidence
    pct, save_s = float(ev["checkpoint_pct"]), float(ev["median_save_s"])
    every = ev.get("every_steps")
    often = f" every {every} steps" if every else ""
    return [_rec(
        "io",
        "Save checkpoints asynchronously (torch.distributed.checkpoint.async_save) or less often",
        f"saving blocks training for {1e3 * save_s:.0f} ms{often}, {pct:.1f} % of the measured time. "
        "torch.distributed.checkpoint.async_save stages the state in host memory and writes it on a thread "
        "while training goes on (only the staging blocks); saving half as often halves the cost "
        "(at the price of more work lost to a failure). Frameworks: Lightning's AsyncCheckpointIO, the "
        "Trainer's save_steps",
        {},
        _gain(0.0, pct, f"the saves' {pct:.1f} % of the measured time, at most (async_save still blocks for "
                        "the staging copy; not measured here)", of="measured"),
        "medium",
    )]


def _loader_restart(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    """A DataLoader that starts its workers again every epoch: keep them (persistent_workers)."""
    ev = b.evidence
    pct, first = float(ev["restart_pct"]), float(ev.get("first_batch_pct") or 0.0)
    every = f" every {ev['every_steps']} steps" if ev.get("every_steps") else ""
    built_by = str(ctx.ddp.get("built_by") or "user")
    if built_by == "transformers":
        where = "TrainingArguments(dataloader_persistent_workers=True)"
    elif built_by == "lightning":
        where = "persistent_workers=True in the DataLoader the LightningModule or DataModule returns"
    else:
        where = "DataLoader(..., persistent_workers=True)"
    return [_rec(
        "io",
        "Keep the DataLoader's workers between epochs (persistent_workers=True)",
        f"the loader shuts its {ev['workers']} worker process(es) down at the end of each epoch and starts new ones"
        f"{every}: those steps take {1e3 * float(ev['median_restart_step_s']):.0f} ms against "
        f"{1e3 * float(ev['usual_step_s']):.0f} ms, {pct:.1f} % of the measured time beyond a usual step. "
        "Persistent workers stay alive and only get the next epoch's indices (each keeps its copy of the dataset "
        "in memory between epochs). A loader that shuffles from the global RNG (shuffle=True, no generator and no "
        "DistributedSampler) then draws one seed fewer per epoch, so the epochs after the first come in other, "
        f"equally random orders. Where: {where}; zero-code, the patch applies it to every DataLoader of the "
        "script",
        {"dataloader": {"persistent_workers": True}},
        _gain(max(0.0, pct - first), pct,
              f"the restart steps' {pct:.1f} % beyond a usual step; at least that less their first batch's wait "
              f"({first:.1f} %), which the next epoch's first batch may still take", of="measured"),
        "low",
    )]


def _redundant_sync(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    """Gradient accumulation that all-reduces every micro-batch: DDP's no_sync around all but the last."""
    ev = b.evidence
    pct, n = float(ev["redundant_exposed_pct"]), int(ev["syncs_per_step"])
    return [_rec(
        "communication",
        f"All-reduce once per step, not after each of the {n} micro-batches (DDP's no_sync)",
        f"every backward of the step all-reduces the gradients so far; accumulation needs only the last one, of "
        f"their sum. Run the other {n - 1} backwards inside `with model.no_sync():` (Accelerate: "
        "`with accelerator.accumulate(model):`; the Hugging Face Trainer and Lightning do it themselves): the "
        f"step sends the gradients once instead of {n} times and the results are the same",
        {},
        _gain(pct, pct, f"the backward's exposed communication {float(ev['backward_exposed_pct']):.1f} % of the step, "
                        f"{n - 1} of its {n} all-reduces' share"),
        "low",
    )]


def _evaluation(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    """Evaluation passes between steps: evaluate less often or on fewer batches (in the framework's terms)."""
    ev = b.evidence
    pct, pass_s = float(ev["eval_pct"]), float(ev["median_pass_s"])
    every, batches = ev.get("every_steps"), ev.get("batches_per_pass")
    often = f" every {every} steps" if every else ""
    size = f" over {batches} batches" if batches else ""
    built_by = str(ctx.ddp.get("built_by") or "user")
    if built_by == "transformers":
        where = ("TrainingArguments: a larger eval_steps (or eval_strategy=\"epoch\"), a smaller eval_dataset, "
                 "a larger per_device_eval_batch_size")
    elif built_by == "lightning":
        where = "Trainer: a larger val_check_interval (or check_val_every_n_epoch), limit_val_batches"
    else:
        where = "the script's evaluation interval and the size of its held-out loader"
    return [_rec(
        "computation",
        "Evaluate less often, or on fewer batches",
        f"an evaluation pass{size} blocks training for {1e3 * pass_s:.0f} ms{often}, {pct:.1f} % of the measured "
        "time. Evaluating half as often halves that; so does a held-out set half the size (at the price of a "
        "noisier metric). Without gradients the forward keeps no activations for a backward: a larger "
        f"evaluation batch usually fits and runs faster per sample (not measured here). Where: {where}",
        {},
        _gain(pct / 2, pct, f"the evaluation's {pct:.1f} % of the measured time: half of it evaluating half as "
                            "often, all of it without evaluation", of="measured"),
        "low",
    )]


def _idle_text(ev: dict[str, Any]) -> str:
    idle, busy = ev.get("idle_cores_per_rank"), ev.get("host_cpu_busy_pct")
    parts = ([f"{float(idle):.2f} idle cores per rank"] if idle is not None else []) + (
        [f"host CPUs {busy} % busy"] if busy is not None else [])
    return ", ".join(parts) or "CPU use unknown"


def _communication(b: Bottleneck, ctx: _Context) -> list[Recommendation]:
    ev = b.evidence
    e = float(ev.get("attributable_comm_pct", ev["exposed_comm_pct"]))
    bwd = float(ev.get("backward_compute_pct", 0.0))
    if not ctx.ddp:
        return _communication_without_ddp(e, bwd, ev, ctx)
    grads, grad_e = _gradient_evidence(ev, e)
    recs = [_bucket_cap(grads, grad_e, bwd, ctx), _topk_ratio(grads, grad_e, ctx), _buffer_broadcast(ev, e, ctx),
            _zero_broadcast(ev, e, ctx), *_framework_syncs(ev, e)]
    return [r for r in recs if r is not None]


def _gradient_evidence(ev: dict[str, Any], e: float) -> tuple[dict[str, Any], float]:
    """The finding's evidence and exposed share without DDP's buffer broadcast, a framework's per-step
    collectives and ZeroRedundancyOptimizer's parameter broadcast: what bucket caps and gradient compression
    act on (those are outside the backward: the part the training thread waits for is exposed)."""
    apart = []  # (time s, exposed s, transfer s, bytes, count, % of the step) per step
    if ev.get("buffer_broadcast_s"):
        apart.append((ev["buffer_broadcast_s"], *(ev.get(f"buffer_broadcast{k}")
                                                  for k in ("_s", "_transfer_s", "_bytes", "_count", "_pct"))))
    if ev.get("zero_broadcast_s"):
        apart.append(tuple(ev.get(f"zero_broadcast{k}")
                           for k in ("_s", "_blocked_s", "_transfer_s", "_bytes", "_count", "_pct")))
    for kind, time_s in (ev.get("framework_sync_s_by_kind") or {}).items():
        apart.append((time_s, time_s, *((ev.get(f"framework_sync_{k}_by_kind") or {}).get(kind)
                                        for k in ("transfer_s", "bytes", "count", "pct"))))
    if not apart:
        return ev, e
    out = dict(ev)
    for time_s, exposed_s, transfer_s, nbytes, count, pct in apart:
        for key, less in (("comm_s", time_s), ("exposed_comm_s", exposed_s), ("wire_s", transfer_s),
                          ("bytes_per_step", nbytes), ("num_collectives_per_step", count)):
            if out.get(key) is not None and less:
                out[key] = max(float(out[key]) - float(less), 0.0)
        e = max(e - float(pct or 0.0), 0.0)
    return out, e


#: What a framework's per-step collective is and what to do about it, by a function of its origin
#: (`CommRecord.origin`: the function that called torch.distributed, and the one that called the framework).
#: Anything else a framework issues at most steps gets the generic advice.
_FRAMEWORK_SYNCS: dict[str, tuple[str, str, str]] = {
    "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor": (
        "Make Lightning's per-batch SIGTERM broadcast rarer",
        "Lightning broadcasts rank 0's SIGTERM flag before every training batch and reads it back with "
        "`.item()` (on CUDA that also makes the host wait for the device at every batch)",
        "no Trainer argument turns it off (Lightning-AI/pytorch-lightning#21487; #21640 proposes "
        "`Trainer(broadcast_sigterm_every_n_steps=N)`). Until then, in your script before `fit`: keep "
        "`orig = _TrainingEpochLoop._broadcast_sigterm_tensor` (lightning.pytorch.loops.training_epoch_loop) and "
        "replace it with one that calls `orig(self)` only when `self.total_batch_idx % 50 == 0` (every rank "
        "counts the same batches, so all of them still broadcast together); a SIGTERM is then acted on up to "
        "50 batches later. It is a private method: check it after upgrading Lightning",
    ),
    "transformers.trainer:Trainer._get_num_items_in_batch": (
        "Let each rank count its own tokens (average_tokens_across_devices=False), where the loss allows",
        "the Trainer all-gathers each batch's number of label tokens across ranks before every step "
        "(TrainingArguments.average_tokens_across_devices, on by default) to normalise the loss by the global count",
        "`TrainingArguments(average_tokens_across_devices=False)` removes it; each rank then normalises its loss "
        "by its own tokens, which changes the gradient's scale only where ranks see different numbers of label "
        "tokens (huggingface/transformers#34242): keep it for variable-length language-model batches, turn it off "
        "for fixed-size ones",
    ),
    "lightning.fabric.utilities.distributed:_sync_ddp": (
        "Synchronise Lightning's logged values once per epoch, not at every step",
        "`self.log(..., sync_dist=True)` all-reduces the logged value across ranks at every step it is logged",
        "log per step without sync_dist (each rank's own value) and with `on_epoch=True, sync_dist=True` for "
        "the value you compare across runs, or log less often (`Trainer(log_every_n_steps=...)`)",
    ),
}


def _framework_syncs(ev: dict[str, Any], e: float) -> list[Recommendation]:
    """A training framework's own collectives in most steps (besides the gradients'), each a visible share."""
    recs = []
    origins = ev.get("comm_origins_by_kind") or {}
    for kind, pct in (ev.get("framework_sync_pct_by_kind") or {}).items():
        if float(pct) < _SYNC_MIN_PCT or not ev.get("step_s"):
            continue
        time_s = float(ev["framework_sync_s_by_kind"][kind])
        transfer_s = float((ev.get("framework_sync_transfer_s_by_kind") or {}).get(kind) or 0.0)
        count = float((ev.get("framework_sync_count_by_kind") or {}).get(kind) or 0.0)
        nbytes = float((ev.get("framework_sync_bytes_by_kind") or {}).get(kind) or 0.0)
        called = list(origins.get(kind) or [])
        known = next((_FRAMEWORK_SYNCS[f] for o in called for f in o.split(" via ") if f in _FRAMEWORK_SYNCS), None)
        issuer, op = kind.split(" ", 1)
        where = f"called from {', '.join(called)}" if called else "where it is called from was not recorded"
        if known is not None:
            title, what, todo = known
        else:
            title = f"Issue {issuer}'s per-step {op} less often"
            what = f"{issuer} issues a {op} in most steps besides the gradients' ({where})"
            todo = ("find the option of that call (a metric synchronised at every step, a flag checked at every "
                    "batch) and make it run per epoch or every N steps")
        to_pct = 100.0 / float(ev["step_s"])
        basis = (f"{kind}: {count:.3g} per step, {_size(nbytes)}, {1e3 * time_s:.3g} ms per step (mean of ranks, "
                 f"median over steps), {1e3 * transfer_s:.3g} ms of it the transfer; synchronous and latency-bound: "
                 "removing it saves at least the transfer (a rank's wait for the others may move to its next "
                 "collective) and at most all of it")
        recs.append(_rec(
            "communication", title,
            f"{float(pct):.1f} % of the step is {kind} ({where}): {what}. What to do: {todo}",
            {}, _gain(transfer_s * to_pct, min(time_s * to_pct, e), basis), "medium",
        ))
    return recs


class _Fabric:
    """All-reduce time of one bucket: alpha + bus factor x bytes x beta, and where alpha and beta come from."""

    def __init__(self, alpha_s: float, beta_s_per_byte: float, world_size: int, source: str) -> None:
        self.alpha_s, self.beta, self.source = alpha_s, beta_s_per_byte, source
        self.factor = bus_factor("all_reduce", world_size)

    def allreduce_s(self, size_bytes: float) -> float:
        return self.alpha_s + self.factor * size_bytes * self.beta

    def describe(self) -> str:
        busbw = f"{1e-9 / self.beta:.3g} GB/s" if self.beta > 0 else "unbounded"
        return f"alpha {1e6 * self.alpha_s:.3g} us, bus bandwidth 1/beta {busbw} ({self.source})"


def _fabric(ev: dict[str, Any], ctx: _Context) -> tuple[_Fabric | None, str]:
    """The fabric's alpha-beta model: the run's reference bench, else fitted to this run's collectives; or why none."""
    bench = ctx.info.get("reference_bench")
    if isinstance(bench, str) and os.path.isfile(os.path.join(bench, "bench_model.json")):
        try:
            model = load_model(bench)
        except Exception as exc:  # noqa: BLE001 - said in the recommendation instead
            return None, f"the reference bench model is unreadable ({type(exc).__name__}: {exc})"
        fit = model.get("all_reduce", "inter" if model.nnodes > 1 else None) or model.get("all_reduce")
        if fit is not None:
            return _Fabric(fit.alpha_s, fit.beta_s_per_byte, ctx.world_size, f"bench {bench}"), ""
    # This run's own collectives: per step n of them carry G bytes in wire time X, the last one,
    # of b bytes, in t. X = n alpha + f G beta and t = alpha + f b beta give alpha and beta when
    # the last bucket is not the average one (DDP's first bucket is small, its last the rest).
    sizes = ctx.ddp.get("bucket_sizes_bytes")
    wire, last = ev.get("wire_s"), ev.get("last_wire_s")
    if not (isinstance(sizes, list) and len(sizes) >= 2 and wire and last):
        return None, ("no reference bench (profile with --reference-bench) and this run has fewer than two DDP "
                      "buckets to fit the fabric's latency and bandwidth apart")
    n, grad, b_last = len(sizes), float(sum(sizes)), float(sizes[-1])
    spread = n - grad / b_last
    alpha = (float(wire) - grad * float(last) / b_last) / spread if abs(spread) >= 0.25 else -1.0
    f_beta = (float(last) - alpha) / b_last
    if alpha < 0 or f_beta <= 0:
        return None, (f"no reference bench, and this run's collectives (wire {1e3 * float(wire):.3g} ms per step "
                      f"over {n} buckets, the last {b_last / _MiB:.3g} MiB in {1e3 * float(last):.3g} ms) do not "
                      "separate latency from bandwidth")
    fabric = _Fabric(alpha, f_beta / bus_factor("all_reduce", ctx.world_size), ctx.world_size,
                     f"fitted to this run: {n} buckets of {grad / _MiB:.3g} MiB in {1e3 * float(wire):.3g} ms of wire "
                     f"per step, the last ({b_last / _MiB:.3g} MiB) in {1e3 * float(last):.3g} ms")
    return fabric, ""


def predicted_exposed_s(fabric: _Fabric, *, grad_bytes: float, backward_s: float, cap_bytes: float,
                        first_cap_bytes: float) -> float:
    """Communication left after backward: gradients ready uniformly over backward, buckets all-reduced in turn."""
    done = finish = 0.0
    cap = min(first_cap_bytes, cap_bytes)
    while done < grad_bytes:
        size = min(cap, grad_bytes - done)
        done += size
        finish = max(backward_s * done / grad_bytes, finish) + fabric.allreduce_s(size)
        cap = cap_bytes
    return max(0.0, finish - backward_s)


def _bucket_cap(ev: dict[str, Any], e: float, bwd: float, ctx: _Context) -> Recommendation | None:
    cap = float(ctx.ddp.get("bucket_cap_mb") or 25.0)
    first = float(ctx.ddp.get("first_bucket_cap_mb") or 1.0)
    grad = float(ctx.ddp.get("param_bytes") or ev.get("bytes_per_step") or 0.0)
    step_s, backward_s = ev.get("step_s"), ev.get("backward_compute_s")
    fabric, why_not = _fabric(ev, ctx)
    if fabric is None or not (grad and step_s and backward_s is not None):
        why_not = why_not or "the step, backward or gradient size was not recorded"
        return _rec(
            "communication",
            "Measure the fabric to size DDP's buckets (torsh-tune bench, then profile --reference-bench)",
            f"{e:.1f} % of the step is exposed communication, and the bucket cap that hides most of it depends on "
            f"the fabric's latency and bandwidth: {why_not}",
            {},
            _gain(0.0, min(e, bwd), f"exposed comm {e:.1f} % hidable at most behind backward compute {bwd:.1f} %"),
            "low",
        )

    def exposed(cap_mb: float) -> float:
        return predicted_exposed_s(fabric, grad_bytes=grad, backward_s=float(backward_s), cap_bytes=cap_mb * _MiB,
                                   first_cap_bytes=first * _MiB)

    caps = sorted({c for c in _BUCKET_CAPS_MB if c <= max(2 * grad / _MiB, 1.0)} | {cap})
    predicted = {c: exposed(c) for c in caps}
    # The least exposure; among caps within 1 % of the step of it, the fewest collectives.
    least = min(predicted.values())
    best = max(c for c, x in predicted.items() if x <= least + 0.01 * float(step_s))
    now, new, measured = predicted[cap], predicted[best], e * float(step_s) / 100.0
    if best == cap or now - new < 0.01 * float(step_s):
        return None  # no cap a person would write hides more than 1 % of the step
    table = ", ".join(f"{c:g} MiB {1e3 * x:.3g} ms" for c, x in predicted.items())
    basis = (f"alpha-beta model: {fabric.describe()}; {grad / _MiB:.3g} MiB of gradients ready over "
             f"{1e3 * float(backward_s):.3g} ms of backward, all-reduced bucket by bucket; predicted exposed comm "
             f"per cap: {table}; cap {best:g} MiB saves {1e3 * (now - new):.3g} ms predicted "
             f"(measured exposed now {1e3 * measured:.3g} ms vs {1e3 * new:.3g} ms predicted at {best:g} MiB)")
    to_pct = 100.0 / float(step_s)
    return _rec(
        "communication",
        f"Set DDP bucket_cap_mb to {best:g} (now {cap:g})",
        f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); the fabric model "
        f"predicts {1e3 * new:.3g} ms exposed at {best:g} MiB buckets against {1e3 * now:.3g} ms at {cap:g} MiB. "
        + _in_your_code(ctx, "bucket_cap_mb", best),
        {"ddp": {"bucket_cap_mb": best}},
        _gain(min(now - new, measured - new) * to_pct, min(e, max(now - new, measured - new) * to_pct), basis),
        "low",
    )


def _topk_ratio(ev: dict[str, Any], e: float, ctx: _Context) -> Recommendation | None:
    """Top-K at the ratio whose transfer fits in the communication time backward already hides."""
    comm_s, exposed_s, step_s = ev.get("comm_s"), ev.get("exposed_comm_s"), ev.get("step_s")
    n = ctx.world_size
    if n < 2 or not (comm_s and exposed_s and step_s) or ctx.ddp.get("comm_hook") not in (None, "allreduce"):
        return None  # a script's own comm hook, or compression already on: not ours to replace
    per_collective = float(ev.get("bytes_per_step") or 0.0) / max(float(ev.get("num_collectives_per_step") or 1), 1.0)
    if per_collective < LATENCY_BOUND_BYTES:
        return None  # latency-bound: fewer bytes do not shorten the collectives
    hidden = max(float(comm_s) - float(exposed_s), 0.0)
    wanted = hidden / float(comm_s) / n
    ratio = float(f"{min(max(wanted, _TOPK_RATIO_MIN), _TOPK_RATIO_MAX):.2g}")
    after = max(n * ratio * float(comm_s) - hidden, 0.0)  # the compressed transfer beyond the hidden time
    saving = min(float(exposed_s) - after, e * float(step_s) / 100.0)
    if saving <= 0.01 * float(step_s):
        return None
    clamp = "" if ratio == float(f"{wanted:.2g}") else f", held within [{_TOPK_RATIO_MIN:g}, {_TOPK_RATIO_MAX:g}]"
    basis = (f"backward hides {1e3 * hidden:.3g} ms of the {1e3 * float(comm_s):.3g} ms of communication per step; "
             f"Top-K sends {_TOPK_ENTRY_BYTES} bytes per kept entry to all {n} ranks, {n} x ratio of the dense "
             f"all-reduce's bus bytes, so ratio = hidden / comm / world = {hidden / float(comm_s):.3g} / {n} = "
             f"{wanted:.3g}{clamp}; exposed {1e3 * float(exposed_s):.3g} ms -> {1e3 * after:.3g} ms if the wire "
             "time scales with the bytes (high); the top-k selection's compute is not modelled and on a CPU can "
             "cost what it saves (low)")
    return _rec(
        "communication",
        f"Compress gradients with Top-K at ratio {ratio:g} (error feedback on)",
        f"{e:.1f} % of the step is exposed communication; sending the largest {100 * ratio:g} % of each bucket's "
        "entries shrinks the transfer into the time backward hides (lossy: the study's loss guard checks it)",
        {"compression": {"method": "topk", "ratio": ratio, "error_feedback": True}},
        _gain(0.0, 100.0 * saving / float(step_s), basis),
        "low",
    )


def _buffer_broadcast(ev: dict[str, Any], e: float, ctx: _Context) -> Recommendation | None:
    """DDP's broadcast of its buffers before every forward, when it is a visible share of the step."""
    pct, step_s = ev.get("buffer_broadcast_pct"), ev.get("step_s")
    total = int(ctx.ddp.get("buffer_bytes") or 0)
    if not (pct and step_s and total) or float(pct) < _SYNC_MIN_PCT:
        return None
    if not ctx.ddp.get("broadcast_buffers", True):
        return None
    time_s, transfer_s = float(ev["buffer_broadcast_s"]), float(ev.get("buffer_broadcast_transfer_s") or 0.0)
    stats = ctx.ddp.get("running_stats_bytes")  # None: a run recorded before it was kept
    largest = ", ".join(f"{b['name']} {_size(b['bytes'])}" + (" (running statistics)" if b.get("running_stats") else "")
                        for b in ctx.ddp.get("largest_buffers") or [])
    what = f"its {_size(total)} of buffers" + (f" (largest: {largest})" if largest else "")
    if stats is None:
        caveat = ("check that the forward never writes them first (batch norm's running statistics it does: "
                  "without the broadcast each rank keeps its own)")
    elif stats == 0:
        caveat = ("none of them is a normalization layer's running statistics: if the forward never writes them "
                  "(position ids, masks, lookup tables) every rank already holds rank 0's values and the broadcast "
                  "is pure cost")
    else:
        share = "all of them are" if stats == total else f"{_size(stats)} of them are"
        caveat = (f"{share} normalization layers' running statistics: without the broadcast each rank keeps its "
                  "own (training-mode batch norm normalizes with the batch's statistics, so training is unchanged; "
                  "evaluate on rank 0, or all-reduce the statistics once before evaluating or saving)")
    to_pct = 100.0 / float(step_s)
    basis = (f"DDP broadcast {what} from rank 0 before each forward: {1e3 * time_s:.3g} ms per step (mean of "
             f"ranks, median over steps), {1e3 * transfer_s:.3g} ms of it the transfer (the slowest-arriving "
             "rank's); a synchronous call in the forward, hidden behind nothing: removing it saves at least the "
             "transfer (a rank's wait for the others may move to its next collective) and at most all of it")
    return _rec(
        "communication",
        "Turn off DDP's broadcast of its buffers before every forward (broadcast_buffers=False)",
        f"{float(pct):.1f} % of the step is DDP broadcasting {what} from rank 0 before every forward; {caveat}. "
        + _in_your_code(ctx, "broadcast_buffers", False),
        {"ddp": {"broadcast_buffers": False}},
        _gain(transfer_s * to_pct, min(time_s * to_pct, e), basis),
        "low" if stats == 0 else "medium",
    )


#: Optimizer state per parameter, in parameter sizes, of the optimizers ZeroRedundancyOptimizer commonly wraps.
_STATE_PER_PARAM = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "RMSprop": 1}


def _zero_broadcast(ev: dict[str, Any], e: float, ctx: _Context) -> Recommendation | None:
    """ZeroRedundancyOptimizer's broadcast of the updated parameters after every step, when the training
    thread's wait for it is a visible share of the step."""
    pct, step_s = ev.get("zero_broadcast_pct"), ev.get("step_s")
    if not (pct and step_s) or float(pct) < _SYNC_MIN_PCT:
        return None
    waited_s, time_s = float(ev["zero_broadcast_blocked_s"]), float(ev["zero_broadcast_s"])
    opt_s, world = float(ev.get("optimizer_s") or 0.0), ctx.world_size
    trained = ctx.trained
    inner = str(trained.get("wrapped_optimizer") or "")
    param_bytes = float(trained.get("param_bytes") or 0.0)
    factor = _STATE_PER_PARAM.get(inner)
    if factor is not None and param_bytes:
        saved = factor * param_bytes * (1.0 - 1.0 / world)
        memory = (f"it saves each rank {_size(saved)} of {inner}'s state ({factor} x the {_size(param_bytes)} of "
                  f"parameters, less its 1/{world} shard)")
    else:
        memory = f"it saves each rank (1 - 1/{world}) of the {inner or 'wrapped optimizer'}'s state"
    to_pct = 100.0 / float(step_s)
    more_s = (world - 1) * opt_s  # every rank updating every parameter instead of its shard
    count, nbytes = float(ev.get("zero_broadcast_count") or 0.0), float(ev.get("zero_broadcast_bytes") or 0.0)
    basis = (f"the training thread waited {1e3 * waited_s:.3g} ms per step for ZeroRedundancyOptimizer's {count:.3g} "
             f"broadcasts of {_size(nbytes)} ({1e3 * time_s:.3g} ms in flight, mean of ranks, median over steps); "
             f"without the sharding the wait goes and the optimizer step's {1e3 * opt_s:.3g} ms of compute grows "
             f"about {world}x (+{1e3 * more_s:.3g} ms, low); overlapped with DDP's backward at most the wait is "
             "saved (high)")
    return _rec(
        "communication",
        "Take ZeroRedundancyOptimizer's parameter broadcast off the critical path",
        f"{float(pct):.1f} % of the step is the training thread waiting for ZeroRedundancyOptimizer to broadcast "
        f"the parameters each rank updated to the others, after the optimizer step, where nothing overlaps it. "
        f"{memory[0].upper() + memory[1:]}: if the state fits without the sharding, step a plain "
        f"{inner or 'optimizer'} on every rank (no broadcast); otherwise overlap the broadcast with DDP's backward "
        "(ZeroRedundancyOptimizer(..., overlap_with_ddp=True) and ddp_model.register_comm_hook(None, "
        "hook_with_zero_step(allreduce_hook, ddp_model, zero)), both hooks from torch.distributed.algorithms."
        "ddp_comm_hooks (ddp_zero_hook, default_hooks): each bucket's shard is stepped and broadcast once the "
        "bucket is reduced), or shard with "
        "FSDP2 (fully_shard), whose reduce-scatter and all-gather replace DDP's all-reduce and this broadcast",
        {},
        _gain((waited_s - more_s) * to_pct, min(waited_s * to_pct, e), basis),
        "medium",
    )


#: TrainingArguments' fields for DDP's arguments (the rest only through the torsh-tune patch).
_HF_DDP_FIELDS = {"bucket_cap_mb": "ddp_bucket_cap_mb", "broadcast_buffers": "ddp_broadcast_buffers",
                  "static_graph": "ddp_static_graph", "find_unused_parameters": "ddp_find_unused_parameters"}


def _in_your_code(ctx: _Context, key: str, value: Any) -> str:
    """Where a user sets DDP's argument `key` to `value` in their own code, by who built the DDP model
    (meta.json `ddp.built_by`), and that the config patch does it without code changes."""
    arg = f"{key}={value!r}"
    built_by = str(ctx.ddp.get("built_by") or "user")
    if built_by == "transformers":
        field = _HF_DDP_FIELDS.get(key)
        where = (f"TrainingArguments({field}={value!r})" if field else
                 f"TrainingArguments has no field for {key}: only the patch below sets it")
    elif built_by == "accelerate":
        where = f"Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({arg})])"
    elif built_by == "lightning":
        where = f"Trainer(strategy=DDPStrategy({arg}))"
    elif built_by == "torsh-tune":
        where = "the config torsh_tune.parallelize reads (the patch below)"
    else:
        where = f"DistributedDataParallel(model, ..., {arg})"
    return f"In your code: {where}; without code changes the patch below does it"


def _size(nbytes: float) -> str:
    return f"{nbytes / _MiB:.3g} MiB" if nbytes >= _MiB / 10 else f"{nbytes / 1024:.3g} KiB"


def _communication_without_ddp(e: float, bwd: float, ev: dict[str, Any], ctx: _Context) -> list[Recommendation]:
    """Exposed communication of a stack without DDP: DDP's knobs do not apply; say what does."""
    issuer = ctx.main_issuer or "user"
    by_kind = ev.get("comm_s_by_kind") or {}
    spent = "; ".join(f"{k} {1e3 * float(v):.3g} ms" for k, v in by_kind.items())
    spent = f" (per step: {spent})" if spent else ""
    if issuer == "fsdp":
        title = "Overlap FSDP's all-gathers and reduce-scatters with compute"
        # all_gather_into_tensor / reduce_scatter_tensor (FSDP2), all_gather / reduce_scatter (FSDP1 paths)
        gathers = sum(float(v) for k, v in by_kind.items() if k.startswith("fsdp all_gather"))
        scatters = sum(float(v) for k, v in by_kind.items() if k.startswith("fsdp reduce_scatter"))
        # Which FSDP: the functions that issued its collectives (FSDP2's live in fsdp._fully_shard).
        origins = [o for k, found in (ev.get("comm_origins_by_kind") or {}).items() if k.startswith("fsdp ")
                   for o in found]
        fsdp1 = bool(origins) and not any("fsdp._fully_shard" in o for o in origins)
        if fsdp1:  # FullyShardedDataParallel's arguments
            bf16 = "MixedPrecision(reduce_dtype=torch.bfloat16)"
            prefetch = ("prefetch the next blocks' all-gathers (FullyShardedDataParallel(..., forward_prefetch=True, "
                        "backward_prefetch=BackwardPrefetch.BACKWARD_PRE))")
            keep = "keep parameters gathered from forward to backward (ShardingStrategy.SHARD_GRAD_OP)"
            fewer = "shard over fewer ranks (ShardingStrategy.HYBRID_SHARD)"
        else:
            bf16 = "MixedPrecisionPolicy reduce_dtype"
            prefetch = ("prefetch the next blocks' all-gathers "
                        "(set_modules_to_forward_prefetch / set_modules_to_backward_prefetch)")
            keep = "keep the root and last blocks unsharded after forward (reshard_after_forward=False)"
            fewer = "shard over fewer ranks (HSDP)"
        first = (f"the reduce-scatters take longest: they end the backward, so reduce them in bf16 ({bf16}) or "
                 f"{fewer}; the all-gathers: " if scatters > gathers else "")
        why = f"FSDP's collectives are exposed{spent}: {first}{prefetch}, {keep}, or {fewer}"
    elif issuer == "dtensor":
        return [_tensor_parallel(e, ev, spent), *_framework_syncs(ev, e)]
    elif issuer == "pipeline":
        return [_pipeline_p2p(e, ev, spent), *_framework_syncs(ev, e)]
    else:
        called = [o for k, origins in (ev.get("comm_origins_by_kind") or {}).items() if k.startswith(f"{issuer} ")
                  for o in origins]
        where = f" ({', '.join(dict.fromkeys(called))})" if called else ""
        issued_async = [k for k, share in (ev.get("comm_async_share_by_kind") or {}).items()
                        if k.startswith(f"{issuer} ") and share > 0.5]
        # Issued asynchronously but after the backward (a loop over the gradients, each waited for at its
        # first use): nothing overlaps them, as with blocking calls. Runs before the phase was recorded
        # have no share: taken as an engine's.
        in_backward = ev.get("comm_backward_issue_share_by_kind") or {}
        after = [k for k in issued_async if in_backward.get(k, 1.0) <= 0.5]
        if issued_async and len(after) < len(issued_async):
            return [_overlapped_engine(e, bwd, ev, issuer, where, issued_async), *_framework_syncs(ev, e)]
        title = "Average gradients with DDP instead of blocking all-reduces after backward"
        how = ("are issued asynchronously after backward, so nothing overlaps them" if after else
               "block the training thread")
        why = (f"the collectives come from {issuer!r} code{where} and {how}{spent}; DDP's bucketed "
               "all-reduce starts during backward and overlaps with it (or register the all-reduce as a "
               "gradient hook with async_op=True and wait before the optimizer step)")
    return [_rec(
        "communication", title,
        f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); {why}",
        {}, _gain(0.0, min(e, bwd), f"exposed comm {e:.1f} % hidable at most behind backward compute {bwd:.1f} %"),
        "medium",
    ), *_framework_syncs(ev, e)]


def _tensor_parallel(e: float, ev: dict[str, Any], spent: str) -> Recommendation:
    """Exposed communication of DTensor's redistributions (tensor parallelism): activations, not gradients,
    each needed by the next operation, so nothing overlaps them on its own."""
    why = (f"the collectives come from DTensor's redistributions (tensor parallelism{spent})"
           f"{_waited(ev, 'dtensor', 'for them')}: each block's "
           "partial output is reduced before the next one can use it, so they sit on the critical path. Give "
           "tensor parallelism fewer ranks and shard the rest with FSDP2 (a 2-D mesh: smaller all-reduces), keep "
           "its group on a node's fastest links, use SequenceParallel between blocks (a reduce-scatter and an "
           "all-gather of the activations' shards instead of an all-reduce), or compile with async tensor "
           "parallelism (torch._inductor.config._micro_pipeline_tp) to overlap them with the matmuls")
    return _activations_rec(e, ev, "Take tensor parallelism's collectives off the critical path", why)


def _pipeline_p2p(e: float, ev: dict[str, Any], spent: str) -> Recommendation:
    """Exposed communication of a pipeline schedule (`torch.distributed.pipelining`): its send/recv carry
    activations forward and their gradients backward between stages; a stage's exposed time is mostly its
    wait for the neighbouring stage's micro-batch (the bubble), not the transfer. Gradient compression
    does not apply: no gradient is averaged here."""
    why = (f"the collectives are the pipeline schedule's send/recv between stages{spent}"
           f"{_waited(ev, 'pipeline', 'in them')}: activations "
           "forward, their gradients backward. A stage waits there for its neighbour's micro-batch (the pipeline "
           "bubble, (p-1)/(m+p-1) of the step with p stages and m micro-batches) and for the transfer. Split the "
           "batch into more micro-batches, use an interleaved schedule (ScheduleInterleaved1F1B or "
           "ScheduleInterleavedZeroBubble with several stages per rank), balance the stages' compute (the slowest "
           "stage paces the others), and send the activations in bf16 (half the bytes)")
    return _activations_rec(e, ev, "Shrink the pipeline's waits between stages", why)


def _waited(ev: dict[str, Any], issuer: str, where: str) -> str:
    """"; the training thread waits X ms per step WHERE" for `issuer`'s collectives, or "" when it did not."""
    waited = sum(float(v) for k, v in (ev.get("comm_blocked_s_by_kind") or {}).items() if k.startswith(f"{issuer} "))
    return f"; the training thread waits {1e3 * waited:.3g} ms per step {where}" if waited else ""


def _activations_rec(e: float, ev: dict[str, Any], title: str, why: str) -> Recommendation:
    """Advice on collectives that carry activations (the next operation needs each): all of the exposed
    communication is at stake. No config patch: the script's own code sets them (a pipeline built by
    `torsh_tune.parallelize` gets its micro-batch knob from the pipeline-bubble finding)."""
    return _rec("communication", title,
                f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); {why}",
                {}, _gain(0.0, e, f"exposed comm {e:.1f} % of the step, at most all of it"), "medium")


def _overlapped_engine(e: float, bwd: float, ev: dict[str, Any], issuer: str, where: str,
                       kinds: list[str]) -> Recommendation:
    """Exposed communication of an engine that already issues its collectives asynchronously during backward
    (DeepSpeed's overlap_comm, Megatron's DDP, a hand-written bucketed hook): what is left to do depends on
    whether its collectives fit in the backward compute at all."""
    step_s = float(ev.get("step_s") or 0.0)
    comm_s = sum(float((ev.get("comm_s_by_kind") or {}).get(k, 0.0)) for k in kinds)
    waited_s = sum(float((ev.get("comm_blocked_s_by_kind") or {}).get(k, 0.0)) for k in kinds)
    bwd_s = float(ev.get("backward_compute_s") or 0.0)
    comm_pct = 100.0 * comm_s / step_s if step_s > 0 else 0.0
    what = (f"the collectives come from {issuer!r} code{where}, issued with async_op=True during backward "
            f"({', '.join(kinds)}: {1e3 * comm_s:.3g} ms per step), and the training thread waits "
            f"{1e3 * waited_s:.3g} ms per step for them (Work.wait(), wait_tensor)")
    if comm_s > bwd_s:
        title = "Put fewer bytes on the wire: the engine's collectives outlast the backward they overlap"
        why = (f"{what}; they take longer than the backward compute they can hide behind ({1e3 * bwd_s:.3g} ms), so "
               "no order or bucket size hides them all: reduce the gradients in bf16/fp16 (half the bytes) or "
               "compress them (Top-K, PowerSGD)")
        gain = _gain(0.0, min(e, comm_pct / 2),
                     f"half the bytes save at most half of the communication ({comm_pct:.1f} % of the step), "
                     f"and no more than is exposed ({e:.1f} %)")
    else:
        title = "Shorten the tail of the engine's overlapped collectives"
        why = (f"{what}; they fit in the backward compute ({1e3 * bwd_s:.3g} ms), so what stays exposed is the tail: "
               "the buckets issued when backward ends. Make the buckets smaller, the last one issued above all (it "
               "holds the first layers' gradients and nothing computes under it), and issue each as soon as its "
               "gradients are ready")
        gain = _gain(0.0, min(e, bwd), f"exposed comm {e:.1f} % hidable at most behind backward compute {bwd:.1f} %")
    return _rec("communication", title,
                f"{e:.1f} % of the step is exposed communication (overlap {ev.get('overlap_pct')} %); {why}",
                {}, gain, "medium")


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
    if ctx.main_issuer == "pipeline":
        # Pipeline stages do different work and end the step in turn: the first stage runs the last backward
        # micro-batch, so it finishes last by construction; beyond that, its stage is the heavier one.
        return [_rec(
            "straggler",
            f"Balance the pipeline's stages ({where} finishes last)",
            f"{where} ends the step {excess:.1f} % of the step after the others, last in {share:.0f} % of steps. "
            "In a pipeline schedule the stages do different work and finish in turn (the first stage runs the last "
            "backward micro-batch), so part of this is the schedule itself; the rest is a heavier stage: move "
            "layers from it to its neighbours, or give the pipeline more micro-batches so the others wait less "
            "for it (check the host too if the stages are balanced)",
            {},
            _gain(0.0, excess, f"its lateness {excess:.1f} % of the step, at most (part of it is the schedule's)"),
            "medium",
        )]
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
            f"peak memory is {peak:.1f} % of capacity; buckets and gradients then share storage. "
            + _in_your_code(ctx, "gradient_as_bucket_view", True),
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
    "checkpoint": _checkpoint,
    "evaluation": _evaluation,
    "loader_restart": _loader_restart,
    "redundant_sync": _redundant_sync,
    "communication": _communication,
    "network": _network,
    "straggler": _straggler,
    "memory": _memory,
    "gpu_util": _gpu_util,
    "computation": _computation,
    "pipeline_bubble": _pipeline,
}
