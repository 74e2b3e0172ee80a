"""`analyze_run`: load a run directory, run every analyzer, diagnose and recommend."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..config import RunConfig, ThresholdsConfig
from ..errors import ConfigError
from ..fabric import load_model
from ..records import ranges_text
from ._advice import strategy_advice
from ._alerts import find_alerts
from ._bottlenecks import diagnose
from ._comm import comm_stats, redundant_syncs
from ._load import load_run
from ._recommend import recommend
from ._resources import (checkpoint_saves, data_wait_by_rank, evaluation_passes, loader_restarts, memory_stats,
                         system_stats)
from ._runinfo import cpu_count, is_done, nproc_per_node, run_status
from ._selfcheck import run_self_checks
from ._steps import breakdown, measured, step_stats, traced_left_out
from ._stragglers import straggler_stats
from ._types import RunAnalysis

__all__ = ["analyze_run", "run_thresholds"]

T = TypeVar("T")


def analyze_run(run_dir: str | os.PathLike[str], *, thresholds: ThresholdsConfig | None = None) -> RunAnalysis:
    """Analyse one run directory: statistics, bottlenecks and recommendations.

    Never raises on a failed or empty run: whatever could be computed is returned, the
    rest is None, and `warnings` says what was missing. `partial` is True when a rank did
    not end with status ok/budget (or left no exit.json) or the run itself did not end ok.

    Args:
        run_dir: the run directory.
        thresholds: bottleneck thresholds; by default the run's own (config.json), else
            ThresholdsConfig().

    Returns:
        The RunAnalysis; `dataclasses.asdict` of it is JSON-serialisable.

    Example:
        >>> a = analyze_run("runs/20250101-120000-train-ab12")  # doctest: +SKIP
        >>> a.bottlenecks[0].category, a.recommendations[0].config_patch  # doctest: +SKIP
        ('io', {'dataloader': {'num_workers': 3, 'persistent_workers': True}})
    """
    frames = load_run(run_dir)
    warnings = list(frames.warnings) + rank_notes(frames.meta)
    th = thresholds or run_thresholds(frames.config, warnings)
    steps, comm, more = measured(frames.steps, frames.comm)
    warnings += more

    # A failed run can leave records no analyzer foresaw; one analyzer failing must not
    # cost the user the others, so each failure becomes a warning instead.
    def guarded(what: str, fn: Callable[[], T], fallback: T) -> T:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - recorded in warnings, never silent
            warnings.append(f"{what} failed: {type(exc).__name__}: {exc}")
            return fallback

    st = guarded("step statistics", lambda: step_stats(steps), None)
    if st is not None and (traced := traced_left_out(frames.steps, steps)):
        st = dataclasses.replace(st, traced_steps=traced)
    bd = guarded("breakdown", lambda: breakdown(steps), None)
    cm = guarded("communication analysis",
                 lambda: comm_stats(steps, comm, world_size=frames.world_size, meta=frames.meta), None)
    sg = guarded("straggler analysis",
                 lambda: straggler_stats(steps, comm, median_step_s=st.median_step_s if st else None), None)
    mem = guarded("memory analysis", lambda: memory_stats(frames.steps, frames.system, frames.meta), None)
    sysst = guarded("system analysis", lambda: system_stats(frames.system, frames.steps, meta=frames.meta,
                                                            warnings=warnings), None)
    waits = guarded("data-wait analysis", lambda: data_wait_by_rank(steps), {})
    # Rare, long events (a save, an evaluation pass) are counted over every measured step, the trace windows'
    # included: a window holding one would hide it and stretch the steps between the others.
    rare = frames.steps[~frames.steps["warmup"].fillna(False).astype(bool)] if not frames.steps.empty else steps
    rare = rare if not rare.empty else steps  # every step a warm-up step: `measured` kept them all
    saves = guarded("checkpoint analysis", lambda: checkpoint_saves(rare), None)
    passes = guarded("evaluation analysis", lambda: evaluation_passes(rare, frames.comm), None)
    restarts = guarded("DataLoader restart analysis", lambda: loader_restarts(rare), None)
    syncs = guarded("DDP all-reduces per step", lambda: redundant_syncs(steps), None)
    if st is None:
        warnings.append("no step records: step statistics, breakdown and bottlenecks are unavailable")

    pipeline = pipeline_summary(frames.meta)
    ref = frames.info.get("reference_busbw_gbps")
    bottlenecks = guarded("diagnosis", lambda: diagnose(
        breakdown=bd, comm=cm, stragglers=sg, memory=mem, system=sysst, data_wait_by_rank=waits,
        pipeline=pipeline, world_size=frames.world_size, thresholds=th, checkpoint=saves,
        evaluation=passes, loader_restarts=restarts, redundant_syncs=syncs,
        reference_busbw_gbps=float(ref) if isinstance(ref, (int, float)) and ref > 0 else None,
        reference_busbw_at=_bench_busbw_at(frames.info, warnings),
        host_cores_per_rank=_host_cores_per_rank(frames.info, frames.config, frames.world_size),
    ), ()) if bd is not None else ()
    recs = guarded("recommendations", lambda: recommend(
        bottlenecks, info=frames.info, config=frames.config, meta=frames.meta, world_size=frames.world_size,
    ), ())
    advice = guarded("strategy advice", lambda: strategy_advice(
        frames.meta, frames.info, frames.system, frames.world_size, config=frames.config, warnings=warnings,
    ), ())

    alerts = guarded("alerts", lambda: find_alerts(frames, thresholds=th), ())
    # Every step record, warm-up included: a trace window may lie in the warm-up.
    self_checks = guarded("self-check against the traces",
                          lambda: run_self_checks(frames.run_dir, frames.steps, thresholds=th, warnings=warnings,
                                                  comm=frames.comm), ())

    status = run_status(frames.info)
    partial = _partial(status, frames.exits, frames.world_size, warnings)
    return RunAnalysis(
        run_dir=frames.run_dir,
        name=str(frames.info.get("name") or Path(frames.run_dir).name),
        info=frames.info,
        world_size=frames.world_size,
        status=status,
        partial=partial,
        warnings=tuple(warnings),
        steps=st,
        breakdown=bd,
        comm=cm,
        stragglers=sg,
        memory=mem,
        system=sysst,
        bottlenecks=bottlenecks,
        recommendations=recs,
        advice=advice,
        alerts=alerts,
        self_check=self_checks,
        host_clocks=frames.host_clocks,
    )


def _host_cores_per_rank(info: dict[str, Any], config: dict[str, Any], world_size: int) -> float | None:
    """run.json cpu_count / the ranks per node: what `diagnose` counts idle cores from when the sampler
    did not record the ranks' own (runs before it did)."""
    cores = cpu_count(info)
    return cores / nproc_per_node(info, config, world_size) if cores else None


def rank_notes(meta: dict[int, dict[str, Any]]) -> list[str]:
    """What the ranks noted while they ran (`RankRuntime.note`, meta.json's ``notes``), one line per note:
    "ranks 0-3: ..." for a note every one of those ranks made, in the order they made them.

    They say how to read the numbers (a setting that had no effect, a step kept on the host clock,
    DDP's sampled timers, a failed clock exchange), so every report shows them with the run's warnings,
    after what reading the run directory found.

    Example:
        >>> rank_notes({0: {"notes": ["a", "b"]}, 1: {"notes": ["a"]}})
        ['ranks 0-1: a', 'rank 0: b']
    """
    by_note: dict[str, list[int]] = {}
    for rank in sorted(meta):
        notes = meta[rank].get("notes") if isinstance(meta[rank], dict) else None
        for note in notes if isinstance(notes, list) else ():
            ranks = by_note.setdefault(str(note), [])
            if rank not in ranks:
                ranks.append(rank)
    return [f"rank{'s' if len(ranks) > 1 else ''} {ranges_text(ranks)}: {note}" for note, ranks in by_note.items()]


def _partial(status: str, exits: dict[int, dict[str, Any]], world_size: int, warnings: list[str]) -> bool:
    partial = status != "unknown" and not is_done(status)
    if partial:
        warnings.append(f"run status is {status!r}: results cover only what was recorded")
    for rank in range(world_size):
        doc = exits.get(rank)
        if doc is None:
            warnings.append(f"rank {rank} left no exit.json (killed or still running)")
            partial = True
        elif not is_done(str(doc.get("status"))):
            detail = doc.get("error_type") or doc.get("message") or ""
            warnings.append(f"rank {rank} ended with status {doc.get('status')!r} {detail}".rstrip())
            partial = True
    return partial


def run_thresholds(config: dict[str, Any], warnings: list[str]) -> ThresholdsConfig:
    """The `[thresholds]` of a run's config.json (defaults when absent; a bad table is a warning)."""
    data = config.get("thresholds")
    if not isinstance(data, dict):
        return ThresholdsConfig()
    try:
        return RunConfig.from_dict({"thresholds": data}).thresholds
    except ConfigError as exc:
        warnings.append(f"config.json thresholds ignored: {exc}")
        return ThresholdsConfig()


def pipeline_summary(meta: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """One pipeline document from every rank's: each rank measured the bubble of its own stage(s).

    The run's bubble is the mean over ranks (each rank idles its own share of the step);
    `stage_bubble_pct` keeps every rank's value for the evidence.
    """
    docs = {r: m["pipeline"] for r, m in sorted(meta.items()) if isinstance(m.get("pipeline"), dict)}
    if not docs:
        return None
    first = dict(next(iter(docs.values())))
    measured = {r: d["bubble_pct"] for r, d in docs.items() if isinstance(d.get("bubble_pct"), (int, float))}
    if measured:
        first["bubble_pct"] = sum(measured.values()) / len(measured)
        first["stage_bubble_pct"] = {str(r): round(float(v), 2) for r, v in measured.items()}
    return first


def _bench_busbw_at(info: dict[str, Any], warnings: list[str]) -> Callable[[float], float | None] | None:
    """Message size -> the all-reduce busbw the run's reference bench model predicts (None without one).

    The model is the `bench_model.json` of run.json's `reference_bench` (a `torsh-tune bench`
    run); across nodes its inter-node fit, else the only one.
    """
    bench = info.get("reference_bench")
    if not isinstance(bench, str) or not os.path.isfile(os.path.join(bench, "bench_model.json")):
        return None
    try:
        model = load_model(bench)
    except Exception as exc:  # noqa: BLE001 - the reference is optional
        warnings.append(f"reference bench model unreadable: {type(exc).__name__}: {exc}")
        return None
    fit = model.get("all_reduce", "inter" if model.nnodes > 1 else None) or model.get("all_reduce")
    if fit is None:
        return None

    def busbw_at(size: float) -> float | None:
        t = fit.predict_s(size)
        return fit.factor * size / t / 1e9 if t > 0 else None

    return busbw_at
