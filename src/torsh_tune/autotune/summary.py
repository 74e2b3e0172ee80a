"""The main job's study report: the baseline against the confirmed best, with the ToRSh migration checks.

Built on `reports.get_tuning_info` (the study's `result.json`: trials, confirmations, verdict)
plus the step records of the runs it names, so it can be rebuilt for any finished study, and
rendered by `reports` (`summary.md` is `render_tuning_markdown(..., full=False)`; the full
study report `report.md`/`report.html`/`report.json` carries the same checks). The numbers beside each other are those of the confirmation
phase (baseline and candidate run interleaved, A B A B ...), not the search's single runs, or,
when the ablation reduced the winner to a confirmed minimal configuration (best.toml), those of
its re-check; a speedup is only reported when the confirmation supported it (`TuneResult.best_trial`).

ToRSh's migration checks of the best configuration against the baseline:

- throughput (samples/s, or tokens/s when the script counts tokens) >= the baseline's;
- peak memory <= 110 % of the baseline's;
- mean loss not worse than the baseline's beyond its run-to-run noise and the loss tolerance
  (1 %), over the steps both read (`objective.loss_check` on the confirmation's runs);
- time per step (reported: an effective-batch change moves it without being worse).

Example:
    >>> summary = build_summary("torsh-runs/tune-train", script="train.py")  # doctest: +SKIP
    >>> sorted(write_summary("torsh-runs/tune-train", summary))  # doctest: +SKIP
    ['report.html', 'report.json', 'report.md', 'summary.json', 'summary.md']
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..analysis import load_run
from ..errors import invalid
from ..reports import TuningInfo, get_tuning_info, render_tuning_markdown, write_tuning_reports
from ..rundir import StudyDir, write_json_atomic, write_text_atomic
from .objective import loss_by_step, loss_check, loss_deviation, throughput_of

__all__ = ["SUMMARY_SCHEMA", "build_summary", "rebuild_summary", "render_markdown", "write_summary"]

SUMMARY_SCHEMA = 1
_TOP_TRIALS = 5


def build_summary(
    study_dir: str | os.PathLike[str],
    *,
    script: str,
    script_args: Sequence[str] = (),
    loss_tolerance: float = 0.01,
    max_memory_ratio: float = 1.10,
    profile_run: str | os.PathLike[str] | None = None,
    recommendations_tried: Sequence[str] = (),
    study_command: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The study summary as plain JSON types (see the module docstring).

    The study's trials, confirmations and verdict come from `reports.get_tuning_info`; this
    adds what needs the runs themselves: the ToRSh migration checks measured on the
    confirmation's paired runs, and the main job's profile and recommendations.

    Args:
        study_dir: A study directory holding `result.json`.
        script: The training script as the user names it (for the commands shown).
        script_args: Its arguments.
        loss_tolerance: Largest relative deviation of the mean loss (the study's `--loss-tolerance`).
        max_memory_ratio: Largest peak memory of the best run relative to the baseline's.
        profile_run: The baseline profile run of the main job (its bottlenecks are listed).
        recommendations_tried: Titles of the profile's recommendations enqueued as the study's
            "initial" trials, in order (each is matched with its trial and verdict).
        study_command: The command line that ran the study (shown to reproduce it).

    Raises:
        ConfigError: `study_dir` holds no result.json.
    """
    root = Path(study_dir)
    if not StudyDir(root).result_json.is_file():
        raise invalid("STUDY", "a study directory holding result.json", str(study_dir))
    info = get_tuning_info(root, summary={})
    best_trial = info.best["trial"]
    confirmation = next((c for c in info.confirmations if c["trial"] == best_trial), None)
    if info.ablation is not None and info.ablation["better"]:
        confirmation = info.ablation  # best.toml is the minimal configuration: measured in its re-check
    if best_trial is not None and confirmation is not None:
        baseline_side = _side([a for a, _ in confirmation["run_dirs"]])
        best_side = _side([b for _, b in confirmation["run_dirs"]])
    else:
        baseline_side = _side((info.baseline or {}).get("run_dirs", []))
        best_side = None
    best_toml = str(StudyDir(root).best_toml)
    unit = info.study.get("unit") or "samples/s"
    summary: dict[str, Any] = {
        "schema_version": SUMMARY_SCHEMA,
        "script": script,
        "script_args": list(script_args),
        "study_dir": str(root),
        "verdict": info.verdict,
        "best_trial": best_trial,
        "best_params": info.best["params"],
        "speedup": info.best["speedup"],
        "speedup_ci": [info.best["ci_low"], info.best["ci_high"]] if best_trial is not None else None,
        "baseline_noise_pct": (info.baseline or {}).get("noise_pct", 0.0),
        "loss_tolerance": loss_tolerance,
        "max_memory_ratio": max_memory_ratio,
        "baseline": _public(baseline_side),
        "best": _public(best_side) if best_side else None,
        "unit": unit,
        "migration": _migration(baseline_side, best_side, loss_tolerance, max_memory_ratio, unit),
        "confirmations": list(info.confirmations),
        "ablation": info.ablation,
        "trials": _trials(info),
        "profile": _profile(profile_run),
        "recommendations_tested": _tested(recommendations_tried, info),
        "interrupted": info.study["status"] == "interrupted",
        "commands": {
            "run": shlex.join(["torsh-tune", "run", "--config", best_toml, script, *script_args]),
            "apply": shlex.join(["torsh-tune", "apply", str(root)]),
        },
        "files": {name: str(root / name) for name in StudyDir.RESULT_FILES},
    }
    if study_command:
        summary["commands"]["study"] = shlex.join(list(study_command))
    summary["migration_ok"] = (None if best_side is None
                               else all(m["ok"] is not False for m in summary["migration"]))
    return summary


def write_summary(study_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> dict[str, str]:
    """Write the study report into the study directory; file name -> path.

    `summary.json` (the summary itself), `summary.md` (its short Markdown) and the full
    study report `report.json`, `report.md` and `report.html` (`reports.write_tuning_reports`:
    every trial, the figures, importances, Pareto front, and these migration checks).
    """
    root = Path(study_dir)
    info = get_tuning_info(root, summary=summary)
    out = {name: StudyDir(root).file(name) for name in ("summary.json", "summary.md")}
    write_json_atomic(out["summary.json"], dict(summary))
    write_text_atomic(out["summary.md"], render_tuning_markdown(info, full=False))
    out.update({f"report.{fmt}": p for fmt, p in write_tuning_reports(info, root).items()})
    return {name: str(p) for name, p in out.items()}


def rebuild_summary(study_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The summary of an existing study, measured again (`torsh-tune report STUDY`).

    The inputs only the main job knew come from the study's previous `summary.json` when it
    has one (script and arguments, loss tolerance, the recommendations tried, the study's
    command); otherwise the script is the baseline run's (its run.json) and the loss
    tolerance the one the trials' loss constraint was built with.

    Returns:
        None for a study without result.json (still running: nothing confirmed to measure).
    """
    root = Path(study_dir)
    study_files = StudyDir(root)
    if not study_files.result_json.is_file():
        return None
    try:
        old = json.loads(study_files.summary_json.read_text())
    except (OSError, ValueError):
        old = {}
    info = get_tuning_info(root, summary={})
    script, script_args = old.get("script"), old.get("script_args")
    if script is None:
        script, script_args = _baseline_script(info)
    profile = study_files.profile
    study = (old.get("commands") or {}).get("study")
    return build_summary(
        root, script=script, script_args=script_args or (),
        loss_tolerance=old.get("loss_tolerance") or info.study.get("loss_tolerance") or 0.01,
        max_memory_ratio=old.get("max_memory_ratio") or 1.10,
        profile_run=profile if profile.is_dir() else None,
        recommendations_tried=[r["title"] for r in old.get("recommendations_tested") or []],
        study_command=shlex.split(study) if study else None,
    )


def _baseline_script(info: TuningInfo) -> tuple[str, list[str]]:
    for run_dir in (info.baseline or {}).get("run_dirs", []):
        try:
            run = json.loads((Path(run_dir) / "run.json").read_text())
        except (OSError, ValueError):
            continue
        if run.get("script"):
            return str(run["script"]), [str(a) for a in run.get("script_args") or []]
    return "SCRIPT", []


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The summary as Markdown (summary.md): `reports.render_tuning_markdown(..., full=False)`."""
    return render_tuning_markdown(get_tuning_info(summary["study_dir"], summary=summary), full=False)


# -- measurements ----------------------------------------------------------------------------

def _side(run_dirs: Sequence[str]) -> dict[str, Any]:
    """Throughput, step time, peak memory and loss of a set of runs of one configuration."""
    tps, step_s, peaks, losses = [], [], [], []
    for rd in run_dirs:
        if not rd or not Path(rd).is_dir():
            continue
        steps = load_run(rd).steps
        if steps.empty:
            continue
        tp = throughput_of(steps)
        if tp is None:
            continue
        tps.append(tp.samples_s)  # the study's unit: a script counts tokens in every run or never
        kept = steps[~steps["warmup"].fillna(False).astype(bool)]
        step_s.append(float(kept.groupby("step")["step_s"].max().median()))
        peak = pd.to_numeric(steps["peak_mem_bytes"], errors="coerce").max()
        if not pd.isna(peak):
            peaks.append(int(peak))
        losses.append(loss_by_step(steps))
    loss = pd.concat(losses).groupby(level=0).mean() if losses else pd.Series(dtype=float)
    return {
        "runs": len(tps),
        "run_dirs": [str(r) for r in run_dirs],
        "samples_s": float(np.median(tps)) if tps else None,
        "step_s": float(np.median(step_s)) if step_s else None,
        "peak_mem_bytes": max(peaks) if peaks else None,
        "mean_loss": float(loss.mean()) if len(loss) else None,
        "_loss": loss,
        "_losses": losses,
    }


def _public(side: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in side.items() if not k.startswith("_")}


def _migration(base: Mapping[str, Any], best: Mapping[str, Any] | None, loss_tolerance: float,
               max_memory_ratio: float, unit: str = "samples/s") -> list[dict[str, Any]]:
    """ToRSh's migration checks; `ok` is None where a side lacks the number (or the row is a report)."""

    def row(metric: str, unit: str, rule: str, key: str, ok) -> dict[str, Any]:
        b, c = base.get(key), (best.get(key) if best else None)
        return {"metric": metric, "label": metric.replace("_", " "), "unit": unit, "rule": rule,
                "baseline": b, "best": c, "ok": None if b is None or c is None or ok is None else bool(ok(b, c))}

    dev = loss_deviation(best["_loss"], base["_loss"]) if best else None
    check = loss_check(best["_loss"], base["_losses"], tolerance=loss_tolerance) if best else None
    loss = row("mean_loss", "", f"within {100 * loss_tolerance:g} % of baseline or its run-to-run noise",
               "mean_loss", None)
    loss["deviation_pct"] = None if dev is None else 100.0 * dev
    loss["limit_pct"] = None if check is None else 100.0 * check.threshold_rel
    loss["ok"] = None if check is None else not check.violated
    return [
        row("throughput", unit, ">= baseline", "samples_s", lambda b, c: c >= b),
        row("peak_memory", "bytes", f"<= {100 * max_memory_ratio:.0f} % of baseline", "peak_mem_bytes",
            lambda b, c: c <= max_memory_ratio * b),
        loss,
        row("time_per_step", "s", "reported (a batch change moves it)", "step_s", None),
    ]


def _trials(info: TuningInfo) -> dict[str, Any]:
    counts = info.study["counts"]
    feasible = [t for t in info.trials if t["samples_s"] is not None and t["constraint_status"] == "feasible"]
    top = sorted(feasible, key=lambda t: -t["samples_s"])[:_TOP_TRIALS]
    return {
        "finished": counts["finished"],
        "complete": counts["complete"],
        "failed": counts["failed"],
        "violated": counts["violated"],
        "top": [{"number": t["number"], "samples_s": t["samples_s"], "role": t["role"], "params": t["params"]}
                for t in top],
        "failures": [{"number": t["number"], "reason": t["failure_reason"]} for t in info.trials if t["state"] == "FAIL"],
    }


def _tested(titles: Sequence[str], info: TuningInfo) -> list[dict[str, Any]]:
    """The recommendations enqueued as "initial" trials, with what the study made of each."""
    initial = [t for t in info.trials if t["role"] == "initial"]
    confirmed = {c["trial"]: c for c in info.confirmations}
    out = []
    for title, t in zip(titles, initial):
        c = confirmed.get(t["number"])
        if t["number"] == info.best["trial"]:
            verdict = "confirmed faster: the best configuration"
        elif c is not None and c["better"]:
            verdict = "confirmed faster"
        elif c is not None and c["speedup"] is not None:
            verdict = f"not faster beyond noise (paired speedup {c['speedup']:.3f}x)"
        elif t["state"] != "COMPLETE":
            verdict = f"{t['state'].lower()}: {t['failure_reason']}"
        elif t["constraint_status"] == "violated":
            verdict = "outside a constraint (loss or memory)"
        else:
            verdict = "not among the candidates confirmed"
        out.append({"title": title, "trial": t["number"], "state": t["state"], "samples_s": t["samples_s"],
                    "verdict": verdict})
    return out


def _profile(profile_run: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    if profile_run is None:
        return None
    report = Path(profile_run) / "report" / "report.json"
    if not report.is_file():
        return None
    doc = json.loads(report.read_text())
    recs = []
    for r in doc.get("recommendations", [])[:3]:
        g = r.get("expected_gain") or {}
        recs.append({"title": r.get("title", ""), "config_patch": r.get("config_patch", {}),
                     "gain": _gain(g.get("low_pct", 0.0), g.get("high_pct", 0.0), g.get("of", "step"))})
    return {
        "run_dir": str(profile_run),
        "report": str(report.with_suffix(".md")),
        "bottlenecks": [{"severity": b.get("severity", ""), "category": b.get("category", ""),
                         "message": b.get("message", "")} for b in doc.get("bottlenecks", [])[:3]],
        "recommendations": recs,
    }


# -- formatting ----------------------------------------------------------------------------------

def _gain(low: float, high: float, of: str = "step") -> str:
    whole = "the measured time" if of == "measured" else "the step"  # `GainRange.of`
    return f"{high:.3g} % of {whole}" if low == high else f"{low:.3g}–{high:.3g} % of {whole}"
