"""Self-check against ground truth: the always-on numbers beside a trace window's, same steps.

A deep-trace window (``RUN/traces/<window>/``, indexed by ``RUN/traces/windows.jsonl``)
holds whole steps annotated ``ProfilerStep#<step>`` with the step records' own indices, so
both tiers can be read over exactly the same steps. Per rank, and as the mean of ranks:

=====================  ==============================================  ==========================================
metric                 always-on (step records of the compared steps)  trace (`analyze_traces` of the window)
=====================  ==============================================  ==========================================
step time              median ``step_s``                               median ``ProfilerStep#`` span (host); GPU with
                                                                       device-clock records: median device span of
                                                                       the kernels each step launched; else span /
                                                                       steps
compute share          (forward + backward compute + optimizer) /      the phase annotations (GPU: the spans of
                       step time (`phase_frame`)                       their kernels) less the comm exposed in
                                                                       them (`phase_table`); busy time and the
                                                                       compute outside the phases beside it
communication share    ``comm_s`` / step time                          ``comm_s`` / span (`comm_overlap`; on a
                                                                       CPU the time collectives were in flight,
                                                                       queued for a gloo worker included)
exposed comm share     ``exposed_comm_s`` / step time                  ``exposed_comm_s`` / span (`comm_overlap`)
=====================  ==============================================  ==========================================

Shares are sums over the compared steps (the trace's are totals over its span); differences
are always-on minus trace, in percentage points (pp), and in % of the trace's step time for
the step time. A difference beyond ``[thresholds] selfcheck_pp`` is a finding.

Clocks: the always-on side is the step records' ``clock`` ("host" or "device") when they
carry one, else "host" (what the step probes time), marked as assumed. The trace's shares
are device time on a GPU (kernels) and host time on a CPU (main-thread operators, gloo
worker spans, and the main thread's waits for collectives, which no event records); its
step time is on the always-on side's clock where the trace has it: host time (``ProfilerStep#``
annotations), or on a GPU against device-clock records the device span of the kernels each step
launched (``trace_step_basis``). On a GPU the
trace analysis drops the kernels of the window's last step (cut off by the end of the
window, as HTA does), so that step is left out of both sides.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..config import ThresholdsConfig
from ..records import ranges_text
from ..rundir import RunDir
from ._steps import comm_timed, phase_frame
from ._types import SELF_CHECK_METRICS, SelfCheck

__all__ = ["run_self_checks", "self_check", "trace_windows"]

_WINDOW_RE = re.compile(r"^step(\d+)-(\d+)$")


def trace_windows(run_dir: str | Path, warnings: list[str]) -> list[tuple[str, Path, tuple[int, int]]]:
    """A run's trace windows that have trace files: (name, directory, (first step, last step)).

    ``traces/windows.jsonl`` names them (one line per window and rank; the steps are the
    ones actually traced, a truncated window's included); window directories missing from
    it (a copied or older run) are taken by their ``stepAAAAA-BBBBB`` names.
    """
    root = RunDir(run_dir).traces
    if not root.is_dir():
        return []
    steps: dict[str, tuple[int, int]] = {}
    index = root / "windows.jsonl"
    if index.is_file():
        for i, line in enumerate(index.read_text(errors="replace").splitlines(), 1):
            try:
                rec = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                warnings.append(f"traces/windows.jsonl: line {i} is not JSON, skipped")
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("window"), str):
                continue
            if rec.get("error"):
                warnings.append(f"trace window {rec['window']} rank {rec.get('rank')}: {rec['error']}")
            first, last = rec.get("start_step"), rec.get("end_step")
            if isinstance(first, int) and isinstance(last, int) and last >= first:
                lo, hi = steps.get(rec["window"], (first, last))
                steps[rec["window"]] = (min(lo, first), max(hi, last))
    out = []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if not any(f.name.endswith((".json", ".json.gz")) for f in d.iterdir() if f.is_file()):
            continue
        m = _WINDOW_RE.match(d.name)
        span = steps.get(d.name) or ((int(m.group(1)), int(m.group(2))) if m else None)
        if span is None:
            warnings.append(f"trace window {d.name}: its steps are unknown (not in traces/windows.jsonl), "
                            "not compared with the step records")
            continue
        out.append((d.name, d, span))
    return out


def run_self_checks(run_dir: str | Path, steps: pd.DataFrame, *, thresholds: ThresholdsConfig,
                    warnings: list[str], comm: pd.DataFrame | None = None) -> tuple[SelfCheck, ...]:
    """`self_check` of every trace window of a run (empty without windows); problems become warnings.

    Args:
        run_dir: the run directory.
        steps: every step record of the run, warm-up included (a window may lie in warm-up).
        thresholds: ``selfcheck_pp`` decides the findings; the trace analysis gets the rest.
        warnings: appended to.
        comm: the run's collective records, warm-up included: they say what the always-on
            communication of each compared step is made of (``always_on_comm_basis``).
    """
    from .traces import analyze_traces  # numpy only, loaded when a run has traces

    out = []
    for name, path, span in trace_windows(run_dir, warnings):
        try:
            trace = analyze_traces(path, thresholds=thresholds)
        except Exception as exc:  # noqa: BLE001 - a torn or odd trace costs the check, not the report
            warnings.append(f"self-check of trace window {name} skipped: {type(exc).__name__}: {exc}")
            continue
        check = self_check(steps, trace, window=name, window_steps=span, threshold_pp=thresholds.selfcheck_pp,
                           warnings=warnings, comm=comm)
        if check is not None:
            out.append(check)
    return tuple(out)


def self_check(steps: pd.DataFrame, trace: Any, *, window: str, window_steps: tuple[int, int],
               threshold_pp: float, warnings: list[str] | None = None,
               comm: pd.DataFrame | None = None) -> SelfCheck | None:
    """Compare the step records with a `TraceAnalysis` of one window over the same steps.

    Args:
        steps: step records (columns of `records.StepRecord`, plus ``clock`` when recorded).
        trace: `analysis.traces.analyze_traces` of the window.
        window: the window's name.
        window_steps: (first, last) step the window traced; used when the trace has no
            ``ProfilerStep#`` spans.
        threshold_pp: differences beyond it (pp; % for the step time) are findings.
        warnings: appended to when a rank cannot be compared.
        comm: collective records (`records.CommRecord` columns); when given, each row says
            what its always-on communication is made of (``always_on_comm_basis``, see
            `comm_basis`).

    Returns:
        The SelfCheck, or None when no rank has both a trace and step records.

    Example:
        >>> from torsh_tune.analysis.traces import analyze_traces  # doctest: +SKIP
        >>> sc = self_check(load_run(run).steps, analyze_traces(f"{run}/traces/step00008-00011"),
        ...                 window="step00008-00011", window_steps=(8, 11), threshold_pp=10.0)  # doctest: +SKIP
        >>> sc.overall["comm_diff_pp"]  # doctest: +SKIP
    """
    warnings = warnings if warnings is not None else []
    t = trace.tables
    breakdown = {int(r["rank"]): r for r in t["breakdown"].rows()}
    overlap = {int(r["rank"]): r for r in t["overlap"].rows()}
    phases = {int(r["rank"]): r for r in t["phases"].rows()} if "phases" in t else {}
    spans = t["steps"]
    rows = []
    covered: list[int] = []
    for rank in sorted(breakdown):
        b, o = breakdown[rank], overlap.get(rank, {})
        gpu = b["device"] == "gpu"
        mine = spans[spans["rank"] == rank] if len(spans) else spans
        prof = {int(s): float(v) for s, v in zip(mine["step"].tolist(), mine["step_s"].tolist())} if len(mine) else {}
        compared = sorted(prof) if prof else list(range(window_steps[0], window_steps[1] + 1))
        if gpu and len(prof) >= 2:
            compared = compared[:-1]  # the trace analysis drops the kernels of the last ProfilerStep
        records = steps[(steps["rank"] == rank) & steps["step"].isin(compared)]
        if records.empty:
            warnings.append(f"self-check of trace window {window}: rank {rank} has no step records for steps "
                            f"{compared[0]}-{compared[-1]}")
            continue
        missing = sorted(set(compared) - set(records["step"].tolist()))
        if missing:
            warnings.append(f"self-check of trace window {window}: rank {rank} has no step records for "
                            f"step(s) {ranges_text(missing)}: its always-on numbers leave them out, the trace's "
                            "shares do not")
            compared = [s for s in compared if s not in missing]
        timed = comm_timed(records)
        if len(timed) < len(records):
            untimed = sorted(set(records["step"].tolist()) - set(timed["step"].tolist()))
            warnings.append(f"self-check of trace window {window}: rank {rank}'s DDP all-reduce was not timed in "
                            f"step(s) {ranges_text(untimed)} (its timers are sampled): its always-on numbers leave "
                            "them out, the trace's shares do not")
            records, compared = timed, [s for s in compared if s not in untimed]
        elif "comm_timed" in records and records["comm_timed"].eq(False).any():
            warnings.append(f"self-check of trace window {window}: rank {rank}'s DDP all-reduce was not timed in "
                            "any of its steps (its timers are sampled): the always-on comm shares are not "
                            "measured there")
        covered += compared
        span_s = float(b["span_s"])
        if comm is not None:
            records = _with_evaluation_comm(records, comm)
        split = phase_frame(records)  # the records' phases (`phases` holds the trace's)
        ao = _always_on(records, split)
        # The trace's step time on the always-on side's clock: device-clock records against the device span
        # of each step's kernels (`traces.step_table`'s device_step_s), host-clock ones against its host span.
        device = _device_steps(mine) if gpu and ao["clock"] == "device" else {}
        if compared and all(s in device for s in compared):
            trace_step_s, step_clock, step_basis = float(np.median([device[s] for s in compared])), "device", \
                STEP_KERNEL_SPANS
        elif prof:
            trace_step_s, step_clock, step_basis = float(np.median([prof[s] for s in compared])), "host", \
                STEP_ANNOTATIONS
        else:
            trace_step_s = span_s / len(compared) if compared else float("nan")
            step_clock, step_basis = ("device" if gpu else "host"), STEP_SPAN_SHARE
        row: dict[str, Any] = {
            "rank": rank,
            "num_steps": len(compared),
            "always_on_clock": ao.pop("clock"),
            "always_on_clock_recorded": ao.pop("clock_recorded"),
            "trace_clock": "device" if gpu else "host",
            "trace_step_clock": step_clock,
            "trace_step_basis": step_basis,
            **ao,
            **({} if comm is None else {"always_on_comm_basis": comm_basis(comm, rank, compared)}),
            "trace_step_s": trace_step_s,
            **_trace_compute(b, phases.get(rank)),
            "trace_comm_pct": _share(o.get("comm_s"), span_s),
            "trace_exposed_comm_pct": _share(o.get("exposed_comm_s"), span_s),
        }
        per_step = _per_step(records, split, mine, span_s, gpu=gpu)
        if per_step is not None:
            row["per_step"] = per_step
        rows.append(_with_diffs(row))
    if not rows:
        return None
    overall = _overall(rows, num_steps=len(set(covered)))
    first, last = min(covered), max(covered)
    return SelfCheck(
        window=window,
        start_step=first,
        end_step=last,
        device=",".join(sorted({"gpu" if r["trace_clock"] == "device" else "cpu" for r in rows})),
        threshold_pp=float(threshold_pp),
        per_rank=tuple(rows),
        overall=overall,
        findings=_findings(rows, overall, threshold_pp, first, last),
    )


def _device_steps(trace_steps: Any) -> dict[int, float]:
    """{step: the device span of its kernels (s)} of one rank's trace steps, for the steps that launched any."""
    if not len(trace_steps) or "device_step_s" not in trace_steps.columns:
        return {}
    return {int(s): float(v) for s, v in zip(trace_steps["step"].tolist(), trace_steps["device_step_s"].tolist())
            if np.isfinite(v)}


#: ``trace_step_basis``: what the trace's step time is. The ``ProfilerStep#`` annotations (host clock); on a
#: GPU with device-clock records, the device span of the kernels each step launched (`traces.step_table`'s
#: ``device_step_s``); without step annotations, the analysed span over the number of steps.
STEP_ANNOTATIONS = "ProfilerStep# spans"
STEP_KERNEL_SPANS = "kernel spans per step"
STEP_SPAN_SHARE = "span / steps"

#: ``always_on_comm_basis``: what the always-on communication of the compared steps is made of.
REDUCER_WINDOW = "DDP reducer window"
COLLECTIVES = "collectives"


def comm_basis(comm: pd.DataFrame, rank: int, steps: list[int]) -> str:
    """What a rank's always-on communication over `steps` is made of, from its collective records.

    "collectives": one record per collective (the c10d capture; DDP buckets under a Python
    comm hook, `profiler.comm_hook_timing` included). "DDP reducer window": DDP's builtin
    all-reduce, one record per all-reduce (per step, unless a step's every micro-batch synchronizes:
    `StepRecord.ddp_syncs`) from the reducer's own timers, which open when its
    first bucket is issued and close at the end of its finalize: after the wait for the
    last bucket and the copies of every bucket back into the gradients. Both, joined by
    " + ", when a step has both; "none" without records.
    """
    if comm.empty or "rank" not in comm:
        return "none"
    mine = comm[(comm["rank"] == rank) & comm["step"].isin(steps)]
    if mine.empty:
        return "none"
    reducer = (mine["hook"].eq("builtin") & mine["bucket"].eq(-1)).to_numpy() if "hook" in mine else np.zeros(
        len(mine), dtype=bool)
    parts = ([COLLECTIVES] if not reducer.all() else []) + ([REDUCER_WINDOW] if reducer.any() else [])
    return " + ".join(parts)


def _trace_compute(breakdown: dict[str, Any], phases: dict[str, Any] | None) -> dict[str, Any]:
    """The trace's compute share, on the always-on tier's basis: the probed phases less exposed communication.

    The always-on tier's compute is its phases (forward, backward, optimizer step) less the
    communication exposed in them; work outside them is "other" there. The trace's counterpart
    is read inside the phase annotations the probes open in trace windows (`traces.phase_table`),
    less the communication the trace shows exposed in them. On a GPU the always-on phases are
    CUDA-event spans, idle gaps between kernels included: the trace's phase is the span of the
    kernels launched inside its annotation. On a CPU both tiers mark a phase with host times,
    so what the comparison tests there is the communication taken out of the phases (gloo
    worker spans and the main thread's waits on the trace's side). Beside it: the trace's
    busy time (kernels, or the main thread's operators: the gap to the phase share is the
    Python between operators) and its compute outside the phases
    (`trace_compute_outside_phases_pct`), which the always-on tier counts as other. A trace
    without phase annotations (recorded before they existed) compares the busy time.
    """
    busy = float(breakdown["compute_pct"])
    gpu = breakdown["device"] == "gpu"
    if phases is None:
        return {"trace_compute_pct": busy, "trace_compute_basis": "kernels" if gpu else "operators",
                "trace_kernel_compute_pct": busy, "trace_compute_outside_phases_pct": float("nan")}
    out = {"trace_compute_pct": float(phases["phase_compute_pct"]),
           "trace_compute_basis": "phase kernel spans" if gpu else "phase spans",
           "trace_kernel_compute_pct": busy, "trace_compute_outside_phases_pct": float(phases["busy_outside_pct"])}
    if gpu:  # the same phases as their CUDA events would read them (`traces.phase_spans`): idle edges included
        out["trace_event_compute_pct"] = float(phases.get("event_phase_compute_pct", float("nan")))
    return out


def _compute(phases: pd.DataFrame) -> pd.Series:
    """The always-on compute of each record (`phase_frame`): its phases less the communication exposed in them."""
    return phases["forward"] + phases["backward_compute"] + phases["optimizer"]


def _with_evaluation_comm(records: pd.DataFrame, comm: pd.DataFrame) -> pd.DataFrame:
    """The step records with their evaluation passes' collectives added back to comm_s and exposed_comm_s.

    A record leaves out the collectives an evaluation pass issued (CommRecord phase "evaluation"), which
    a trace of the step holds as communication like any other: the comparison takes both sides whole.
    Each such call counts its duration as communication and the time the training thread blocked in it
    as exposed.
    """
    if comm.empty or "phase" not in comm:
        return records
    theirs = comm[comm["phase"].eq("evaluation")]
    if theirs.empty:
        return records
    per_step = pd.DataFrame({
        "rank": theirs["rank"], "step": theirs["step"],
        "_comm": pd.to_numeric(theirs["duration_s"], errors="coerce").fillna(0.0),
        "_blocked": (pd.to_numeric(theirs["blocked_s"], errors="coerce").fillna(0.0) if "blocked_s" in theirs
                     else 0.0),
    }).groupby(["rank", "step"], as_index=False).sum()
    out = records.merge(per_step, on=["rank", "step"], how="left")
    out.index = records.index
    for column, extra in (("comm_s", "_comm"), ("exposed_comm_s", "_blocked")):
        out[column] = pd.to_numeric(out[column], errors="coerce").fillna(0.0) + out[extra].fillna(0.0)
    return out.drop(columns=["_comm", "_blocked"])


def _always_on(records: pd.DataFrame, phases: pd.DataFrame) -> dict[str, Any]:
    total = float(phases["step_s"].sum())
    comm = pd.to_numeric(records["comm_s"], errors="coerce").fillna(0.0).astype(float)
    clocks = sorted({str(c) for c in records["clock"].dropna()}) if "clock" in records.columns else []
    return {
        "clock": "+".join(clocks) if clocks else "host",
        "clock_recorded": bool(clocks),
        "always_on_step_s": float(phases["step_s"].median()),
        "always_on_compute_pct": _share(float(_compute(phases).sum()), total),
        "always_on_comm_pct": _share(float(comm.sum()), total),
        "always_on_exposed_comm_pct": _share(float(phases["exposed_comm"].sum()), total),
    }


def _per_step(records: pd.DataFrame, phases: pd.DataFrame, trace_steps: Any, span_s: float, *,
              gpu: bool = False) -> dict[str, dict[str, Any]] | None:
    """Where a rank's disagreement on compute or (exposed) communication lies: one step, or every step alike.

    Per compared step, the always-on record's ``comm_s`` (``exposed_comm_s``; its phases' compute) and
    the trace's inside the step (`traces.step_table`: on a CPU its ``ProfilerStep#`` span; on a GPU the
    device span of the kernels launched inside it, ``device_step_s``; compute: the phase annotations'
    spans less the communication exposed in them, as `phase_table` reads the window). A step's
    contribution to the pooled difference is 100 * (always-on / the compared steps' always-on time -
    trace / the window's span): the contributions add up to ``<metric>_diff_pp``, less what the trace
    holds outside every step. The median over steps of each step's own share difference (the trace's
    over the step's span on the trace's clock: host on a CPU, device on a GPU) is what a typical step reads.

    Returns:
        {"comm": ..., "exposed_comm": ..., "compute": ...} (compute with phase annotations only), each
        with ``median_step_diff_pp``, ``largest_step``, ``largest_step_pp`` (its contribution),
        ``largest_step_always_on_s`` and ``largest_step_trace_s``; None without per-step trace numbers.
    """
    if trace_steps is None or not len(trace_steps) or not span_s > 0:
        return None
    span_column = "device_step_s" if gpu else "step_s"
    columns = [c for c in ("step_s", "device_step_s", "comm_s", "exposed_comm_s", "phase_compute_s")
               if c in trace_steps.columns]
    if span_column not in columns:
        return None
    trace = {int(s): dict(zip(columns, (float(v) for v in values))) for s, *values in zip(
        trace_steps["step"].tolist(), *(trace_steps[c].tolist() for c in columns))}
    # Steps the trace has numbers for: on a GPU, those that launched kernels (not the dropped last one).
    known = [s for s, v in trace.items() if np.isfinite(v[span_column])]
    keep = phases["step"].astype(int).isin(known).to_numpy()
    total = float(phases["step_s"].sum())
    if not keep.any() or not total > 0:
        return None
    steps = phases["step"].astype(int).to_numpy()[keep]
    step_s = phases["step_s"].to_numpy(dtype=float)[keep]
    metrics = {
        "comm": (pd.to_numeric(records["comm_s"], errors="coerce").fillna(0.0).to_numpy(dtype=float), "comm_s"),
        "exposed_comm": (phases["exposed_comm"].to_numpy(dtype=float), "exposed_comm_s"),
        # The phases' compute, when the trace has their annotations (`phase_table`'s basis), step by step.
        "compute": (_compute(phases).to_numpy(dtype=float), "phase_compute_s"),
    }
    out: dict[str, dict[str, Any]] = {}
    for metric, (values, column) in metrics.items():
        traced = np.asarray([trace[int(s)].get(column, float("nan")) for s in steps], dtype=float)
        if not np.isfinite(traced).all():
            continue
        always_on = values[keep]
        traced_step = np.asarray([trace[int(s)][span_column] for s in steps], dtype=float)
        contribution = 100.0 * (always_on / total - traced / span_s)
        with np.errstate(divide="ignore", invalid="ignore"):
            own = 100.0 * (always_on / step_s - traced / traced_step)
        own = own[np.isfinite(own)]
        i = int(np.argmax(np.abs(contribution)))
        out[metric] = {
            "median_step_diff_pp": float(np.median(own)) if own.size else float("nan"),
            "largest_step": int(steps[i]),
            "largest_step_pp": float(contribution[i]),
            "largest_step_always_on_s": float(always_on[i]),
            "largest_step_trace_s": float(traced[i]),
        }
    return out or None


def _share(part: Any, total: float) -> float:
    if not isinstance(part, (int, float)) or not np.isfinite(part) or not total > 0:
        return float("nan")
    return 100.0 * float(part) / total


def _with_diffs(row: dict[str, Any]) -> dict[str, Any]:
    ao, tr = row["always_on_step_s"], row["trace_step_s"]
    row["step_diff_pct"] = 100.0 * (ao - tr) / tr if tr > 0 else float("nan")
    for metric in ("compute", "comm", "exposed_comm"):
        row[f"{metric}_diff_pp"] = row[f"always_on_{metric}_pct"] - row[f"trace_{metric}_pct"]
    return row


def _overall(rows: list[dict[str, Any]], *, num_steps: int) -> dict[str, Any]:
    """The mean of ranks of every number (differences recomputed from the means)."""
    def mean(key: str) -> float:
        v = np.asarray([r[key] for r in rows], dtype=float)
        v = v[np.isfinite(v)]
        return float(v.mean()) if v.size else float("nan")

    keys = [k for k in rows[0] if k.startswith(("always_on_", "trace_")) and not k.endswith(("clock", "recorded", "basis"))]
    out: dict[str, Any] = {
        "rank": None,
        "num_steps": num_steps,
        **{c: "+".join(sorted({str(r[c]) for r in rows})) for c in ("always_on_clock", "trace_clock",
                                                                     "trace_step_clock", "trace_step_basis",
                                                                     "trace_compute_basis")},
        **({"always_on_comm_basis": _joined_bases(r["always_on_comm_basis"] for r in rows)}
           if "always_on_comm_basis" in rows[0] else {}),
        "always_on_clock_recorded": all(r["always_on_clock_recorded"] for r in rows),
        **{k: mean(k) for k in keys},
    }
    return _with_diffs(out)


def _joined_bases(values: Any) -> str:
    """The ranks' `comm_basis` values as one ("collectives + DDP reducer window" when they differ)."""
    parts = {p for v in values for p in str(v).split(" + ") if p != "none"}
    return " + ".join(p for p in (COLLECTIVES, REDUCER_WINDOW) if p in parts) or "none"


def _findings(rows: list[dict[str, Any]], overall: dict[str, Any], threshold: float,
              first: int, last: int) -> tuple[dict[str, Any], ...]:
    out = []
    for metric, label, unit in SELF_CHECK_METRICS:
        diff_key = f"{metric}_diff_{unit}"
        over = [r for r in rows if abs(r[diff_key]) > threshold]
        if not over and not abs(overall[diff_key]) > threshold:
            continue
        worst = max(over or rows, key=lambda r: abs(r[diff_key]) if np.isfinite(r[diff_key]) else -1.0)
        shown = worst if abs(worst[diff_key]) >= abs(overall[diff_key]) else overall
        where = "mean of ranks" if shown is overall else f"rank {shown['rank']}"
        unit_text = " pp" if unit == "pp" else " %"
        ao_key, tr_key = (("always_on_step_s", "trace_step_s") if metric == "step"
                          else (f"always_on_{metric}_pct", f"trace_{metric}_pct"))
        ao, tr = shown[ao_key], shown[tr_key]
        fmt = _ms if metric == "step" else (lambda v: f"{v:.1f} %")
        message = (f"the always-on numbers disagree with the trace by {abs(shown[diff_key]):.1f}{unit_text} on "
                   f"{label} (steps {first}-{last}): {where} always-on {fmt(ao)} ({shown['always_on_clock']} clock) "
                   f"vs trace {fmt(tr)} ({shown['trace_step_clock' if metric == 'step' else 'trace_clock']} clock)")
        if shown is not overall:
            message += f"; mean of ranks {abs(overall[diff_key]):.1f}{unit_text}"
        steps = _where_in_steps(metric, shown if shown is not overall else worst, shown[diff_key],
                                name_rank=shown is overall)
        message += steps[0] + _why(metric, shown, tr)
        out.append({
            "metric": metric,
            "unit": unit,
            "diff": shown[diff_key],
            "overall_diff": overall[diff_key],
            "threshold": float(threshold),
            "ranks": [int(r["rank"]) for r in over],
            "start_step": first,
            "end_step": last,
            "message": message,
            **({"per_step": steps[1]} if steps[1] else {}),
        })
    return tuple(out)


def _where_in_steps(metric: str, row: dict[str, Any], diff: float, *, name_rank: bool) -> tuple[str, dict[str, Any]]:
    """The finding's words on where the disagreement lies (`_per_step`), and the numbers behind them."""
    found = (row.get("per_step") or {}).get(metric)
    if not found or not np.isfinite(diff):
        return "", {}
    detail = {"rank": int(row["rank"]), **found}
    largest, median = found["largest_step_pp"], found["median_step_diff_pp"]
    what = {"comm": "communication", "exposed_comm": "exposed communication"}.get(metric, metric)
    who = f"rank {row['rank']}'s " if name_rank else ""
    if largest * diff > 0 and abs(largest) >= 0.5 * abs(diff) and abs(median) < 0.5 * abs(diff):
        return (f"; {who}step {found['largest_step']} alone makes {largest:+.1f} pp of it (always-on "
                f"{_ms(found['largest_step_always_on_s'])} vs trace {_ms(found['largest_step_trace_s'])} of {what} "
                f"in that step) and the median step differs by {median:+.1f} pp: one step disagrees, not the "
                "measurement of every step (on a busy host, a thread that waited for a core inside it)"), detail
    if abs(median) >= 0.5 * abs(diff):
        return f"; the median step differs by {median:+.1f} pp: the steps disagree alike", detail
    return (f"; the median step differs by {median:+.1f} pp and the largest single step ({found['largest_step']}) "
            f"makes {largest:+.1f} pp: a few steps disagree"), detail


def _why(metric: str, row: dict[str, Any], trace_value: float) -> str:
    """The known reasons for a disagreement, when they apply: DDP's reducer window on a CPU, and what
    a GPU timeline shows (seen on an H100)."""
    if row["trace_clock"] != "device":
        if metric == "comm" and row["comm_diff_pp"] > 0 and REDUCER_WINDOW in str(row.get("always_on_comm_basis")):
            return ("; DDP's builtin all-reduce is timed by its reducer, one window per all-reduce from its first bucket's "
                    "issue to the end of its finalize: the copies of the buckets back into the gradients and, on a "
                    "busy host, gloo's wait for a core before it starts a bucket are inside it, and the trace counts "
                    "the gloo worker's spans; profiler.comm_hook_timing = true (--comm-hook-timing) times every bucket "
                    "(a Python comm hook per bucket)")
        return ""
    if metric == "compute" and row["compute_diff_pp"] > 0:
        return ("; on the device clock a phase spans the GPU's idle gaps between its kernels too, the trace counts "
                "kernel time only: the steps are launch-bound (the host enqueues slower than the GPU runs)")
    if metric in ("comm", "exposed_comm") and trace_value == 0:
        return ("; the GPU timeline holds no NCCL kernel: gloo runs its collectives on host threads, and one NCCL "
                "rank launches none")
    return ""


def _ms(seconds: float) -> str:
    """Milliseconds with 3 significant digits ("15.0 ms", "118 ms")."""
    ms = 1e3 * seconds
    return f"{ms:.0f} ms" if abs(ms) >= 99.95 else f"{ms:.1f} ms" if abs(ms) >= 9.995 else f"{ms:.2f} ms"
