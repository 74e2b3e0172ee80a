"""The main job's study report: the baseline against the confirmed best, with the ToRSh migration checks.

Rendered from the study's `result.json` and the step records of the runs it names, so it can
be rebuilt for any finished study. The numbers beside each other are those of the confirmation
phase (baseline and candidate run interleaved, A B A B ...), not the search's single runs; a
speedup is only reported when the confirmation supported it (`TuneResult.best_trial`).

ToRSh's migration checks of the best configuration against the baseline:

- throughput (samples/s) >= the baseline's;
- peak memory <= 110 % of the baseline's;
- mean loss within the loss tolerance (1 %) of the baseline's, over the steps both read;
- time per step (reported: an effective-batch change moves it without being worse).

Example:
    >>> summary = build_summary("torsh-runs/tune-train", script="train.py")  # doctest: +SKIP
    >>> write_summary("torsh-runs/tune-train", summary)  # doctest: +SKIP
    {'summary.json': '.../summary.json', 'summary.md': '.../summary.md'}
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..analysis import load_run
from ..errors import invalid
from ..rundir import write_json_atomic, write_text_atomic
from .objective import loss_by_step, loss_deviation, throughput_of

__all__ = ["SUMMARY_SCHEMA", "build_summary", "format_cell", "render_markdown", "write_summary"]

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
    """The study report as plain JSON types (see the module docstring).

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
    path = root / "result.json"
    if not path.is_file():
        raise invalid("STUDY", "a study directory holding result.json", str(study_dir))
    result = json.loads(path.read_text())
    best_trial = result.get("best_trial")
    confirmation = next((c for c in result.get("confirmations", []) if c["trial_number"] == best_trial), None)
    if best_trial is not None and confirmation is not None:
        pairs = [tuple(p) for p in confirmation.get("run_dirs", [])]
        baseline_side = _side([a for a, _ in pairs])
        best_side = _side([b for _, b in pairs])
    else:
        baseline_side = _side(result["baseline"]["run_dirs"])
        best_side = None
    best_toml = str(root / "best.toml")
    summary: dict[str, Any] = {
        "schema_version": SUMMARY_SCHEMA,
        "script": script,
        "script_args": list(script_args),
        "study_dir": str(root),
        "verdict": _verdict(result),
        "best_trial": best_trial,
        "best_params": result.get("best_params") or {},
        "speedup": result.get("best_speedup"),
        "speedup_ci": result.get("best_ci"),
        "baseline_noise_pct": 100.0 * float(result["baseline"]["noise_rel"]),
        "baseline": _public(baseline_side),
        "best": _public(best_side) if best_side else None,
        "migration": _migration(baseline_side, best_side, loss_tolerance, max_memory_ratio),
        "confirmations": [_confirmation_row(c) for c in result.get("confirmations", [])],
        "trials": _trials(result.get("trials", [])),
        "profile": _profile(profile_run),
        "recommendations_tested": _tested(recommendations_tried, result),
        "interrupted": bool(result.get("interrupted")),
        "commands": {
            "run": shlex.join(["torsh-tune", "run", "--config", best_toml, script, *script_args]),
            "apply": shlex.join(["torsh-tune", "apply", str(root)]),
        },
        "files": {name: str(root / name) for name in ("best.toml", "result.json", "trials.csv", "trials.parquet")},
    }
    if study_command:
        summary["commands"]["study"] = shlex.join(list(study_command))
    summary["migration_ok"] = (None if best_side is None
                               else all(m["ok"] is not False for m in summary["migration"]))
    return summary


def write_summary(study_dir: str | os.PathLike[str], summary: Mapping[str, Any]) -> dict[str, str]:
    """Write `summary.json` and `summary.md` into the study directory; name -> path."""
    root = Path(study_dir)
    out = {"summary.json": root / "summary.json", "summary.md": root / "summary.md"}
    write_json_atomic(out["summary.json"], dict(summary))
    write_text_atomic(out["summary.md"], render_markdown(summary))
    return {name: str(p) for name, p in out.items()}


def render_markdown(summary: Mapping[str, Any]) -> str:
    """The study report as Markdown."""
    s = summary
    lines = [f"# torsh-tune study: {Path(s['script']).name}", ""]
    lines += [f"**{s['verdict']['title']}.** {s['verdict']['text']}", ""]
    best = s.get("best")
    lines += ["## Baseline and best configuration", ""]
    if best is None:
        lines += [f"No configuration was confirmed faster, so `best.toml` is the baseline: "
                  f"{_num(s['baseline']['samples_s'], ',.1f')} samples/s (median of "
                  f"{s['baseline']['runs']} baseline run(s)).", ""]
    else:
        lines += [f"Measured in the confirmation: {best['runs']} interleaved pair(s) of baseline and trial "
                  f"{s['best_trial']}.", ""]
    lines += ["| metric | baseline | best | change | ToRSh rule | check |", "|---|---|---|---|---|---|"]
    for m in s["migration"]:
        check = {True: "pass", False: "**fail**", None: "—"}[m["ok"]]
        cells = " | ".join(format_cell(m, key) for key in ("baseline", "best", "change"))
        lines.append(f"| {m['label']} | {cells} | {m['rule']} | {check} |")
    lines.append("")
    if best is not None and s.get("migration_ok") is False:
        failed = ", ".join(m["label"] for m in s["migration"] if m["ok"] is False)
        lines += [f"The best configuration is faster but fails the migration check on: {failed}. Review it "
                  "before adopting it.", ""]
    if s["best_params"]:
        lines += ["Parameters of the best configuration:", ""]
        lines += [f"- `{k} = {json.dumps(v)}`" for k, v in sorted(s["best_params"].items())] + [""]
    if s["confirmations"]:
        lines += ["## Confirmation (candidate vs baseline, interleaved A B A B ...)", "",
                  "| trial | pairs | paired speedup | 95 % CI | verdict |", "|---|---|---|---|---|"]
        for c in s["confirmations"]:
            if c["speedup"] is None:
                lines.append(f"| {c['trial']} | 0 | — | — | not measured: {'; '.join(c['failures']) or 'no pair'} |")
                continue
            verdict = "confirmed faster" if c["better"] else "not faster beyond noise"
            lines.append(f"| {c['trial']} | {c['pairs']} | {c['speedup']:.3f}x | "
                         f"{c['ci_low']:.3f}–{c['ci_high']:.3f} | {verdict} |")
        lines.append("")
    profile = s.get("profile")
    if profile:
        lines += ["## Baseline profile", "", f"Report: `{profile['report']}`", ""]
        for b in profile["bottlenecks"]:
            lines.append(f"- **{b['severity']}** {b['category']}: {b['message']}")
        if not profile["bottlenecks"]:
            lines.append("- no bottleneck found")
        for r in profile["recommendations"]:
            lines.append(f"- recommended: {r['title']} (expected gain {r['gain']})")
        lines.append("")
    if s.get("recommendations_tested"):
        lines += ["Each recommendation the search space can express ran as a trial:", "",
                  "| recommendation | trial | samples/s (single run) | verdict |", "|---|---|---|---|"]
        for r in s["recommendations_tested"]:
            lines.append(f"| {r['title']} | {r['trial']} | {_num(r['samples_s'], ',.1f')} | {r['verdict']} |")
        lines.append("")
    t = s["trials"]
    lines += ["## Search", "",
              f"{t['finished']} finished trial(s): {t['complete']} complete, {t['failed']} failed, "
              f"{t['violated']} outside a constraint (loss or memory). Single-run throughput of the best "
              "feasible trials (the search's ranking; only the confirmation above measures a speedup):", "",
              "| trial | samples/s | role | parameters |", "|---|---|---|---|"]
    for row in t["top"]:
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(row["params"].items()))
        lines.append(f"| {row['number']} | {_num(row['samples_s'], ',.1f')} | {row['role'] or 'sampler'} | {params} |")
    if t["failures"]:
        lines += ["", "Failed trials:", ""]
        lines += [f"- trial {f['number']}: {f['reason']}" for f in t["failures"]]
    lines += ["", "## Reproduce", "", "```sh",
              f"{s['commands']['run']}    # the full training with the tuned config, profiled",
              f"{s['commands']['apply']}    # print the tuned config"]
    if "study" in s["commands"]:
        lines.append(f"{s['commands']['study']}    # this study again (a new study directory)")
    lines += ["```", "", "## Files", ""]
    lines += [f"- {name}: `{p}`" for name, p in s["files"].items()]
    return "\n".join(lines) + "\n"


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
        tps.append(tp.median_samples_s)
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
    }


def _public(side: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in side.items() if not k.startswith("_")}


def _migration(base: Mapping[str, Any], best: Mapping[str, Any] | None, loss_tolerance: float,
               max_memory_ratio: float) -> list[dict[str, Any]]:
    """ToRSh's migration checks; `ok` is None where a side lacks the number (or the row is a report)."""

    def row(metric: str, unit: str, rule: str, key: str, ok) -> dict[str, Any]:
        b, c = base.get(key), (best.get(key) if best else None)
        return {"metric": metric, "label": metric.replace("_", " "), "unit": unit, "rule": rule,
                "baseline": b, "best": c, "ok": None if b is None or c is None or ok is None else bool(ok(b, c))}

    dev = loss_deviation(best["_loss"], base["_loss"]) if best else None
    loss = row("mean_loss", "", f"within {100 * loss_tolerance:g} % of baseline", "mean_loss", None)
    loss["deviation_pct"] = None if dev is None else 100.0 * dev
    loss["ok"] = None if dev is None else dev <= loss_tolerance
    return [
        row("throughput", "samples/s", ">= baseline", "samples_s", lambda b, c: c >= b),
        row("peak_memory", "bytes", f"<= {100 * max_memory_ratio:.0f} % of baseline", "peak_mem_bytes",
            lambda b, c: c <= max_memory_ratio * b),
        loss,
        row("time_per_step", "s", "reported (a batch change moves it)", "step_s", None),
    ]


def _noise(result: Mapping[str, Any]) -> str:
    base = result["baseline"]
    if len(base.get("samples_s", [])) < 2:
        return "the baseline's run-to-run noise was not measured (one baseline run)"
    return f"the baseline's run-to-run noise is {100 * base['noise_rel']:.1f} %"


def _verdict(result: Mapping[str, Any]) -> dict[str, Any]:
    if result.get("best_trial") is not None:
        lo, hi = result["best_ci"]
        pairs = next((len(c["ratios"]) for c in result["confirmations"] if c["trial_number"] == result["best_trial"]), 0)
        return {"confirmed": True, "title": f"Confirmed speedup {result['best_speedup']:.3f}x",
                "text": f"Trial {result['best_trial']} ran {result['best_speedup']:.3f}x the baseline's throughput "
                        f"(95 % CI {lo:.3f}–{hi:.3f}) over {pairs} interleaved pair(s); {_noise(result)}. "
                        "It is in `best.toml`."}
    if result.get("interrupted"):
        text = "The study was interrupted before a candidate was confirmed; `best.toml` is your configuration as it is."
    elif not result.get("confirmations"):
        text = "No candidate was re-run against the baseline; `best.toml` is your configuration as it is."
    else:
        text = ("No candidate beat the baseline in the confirmation (a paired-speedup 95 % CI above 1 and a "
                f"speedup beyond the noise; {_noise(result)}); `best.toml` is your configuration as it is.")
    return {"confirmed": False, "title": "No confirmed speedup", "text": text}


def _confirmation_row(c: Mapping[str, Any]) -> dict[str, Any]:
    return {"trial": c["trial_number"], "pairs": len(c.get("ratios", [])), "speedup": c.get("speedup"),
            "ci_low": c.get("ci_low"), "ci_high": c.get("ci_high"), "better": bool(c.get("better")),
            "failures": list(c.get("failures", []))}


def _trials(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    finished = [t for t in trials if t["state"] in ("COMPLETE", "FAIL", "PRUNED")]
    feasible = [t for t in trials if t["state"] == "COMPLETE" and t.get("constraint_status") == "feasible"]
    top = sorted(feasible, key=lambda t: -(t.get("samples_s") or 0.0))[:_TOP_TRIALS]
    return {
        "finished": len(finished),
        "complete": sum(t["state"] == "COMPLETE" for t in trials),
        "failed": sum(t["state"] == "FAIL" for t in trials),
        "violated": sum(t.get("constraint_status") == "violated" for t in trials),
        "top": [{"number": t["number"], "samples_s": t.get("samples_s"), "role": t.get("role", ""),
                 "params": t.get("params", {})} for t in top],
        "failures": [{"number": t["number"], "reason": t.get("failure_reason", "")}
                     for t in trials if t["state"] == "FAIL"],
    }


def _tested(titles: Sequence[str], result: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recommendations enqueued as "initial" trials, with what the study made of each."""
    initial = sorted((t for t in result.get("trials", []) if t.get("role") == "initial"), key=lambda t: t["number"])
    confirmed = {c["trial_number"]: c for c in result.get("confirmations", [])}
    out = []
    for title, t in zip(titles, initial):
        c = confirmed.get(t["number"])
        if t["number"] == result.get("best_trial"):
            verdict = "confirmed faster: the best configuration"
        elif c is not None and c.get("better"):
            verdict = "confirmed faster"
        elif c is not None and c.get("speedup") is not None:
            verdict = f"not faster beyond noise (paired speedup {c['speedup']:.3f}x)"
        elif t["state"] != "COMPLETE":
            verdict = f"{t['state'].lower()}: {t.get('failure_reason', '')}"
        elif t.get("constraint_status") == "violated":
            verdict = "outside a constraint (loss or memory)"
        else:
            verdict = "not among the candidates confirmed"
        out.append({"title": title, "trial": t["number"], "state": t["state"], "samples_s": t.get("samples_s"),
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
                     "gain": _gain(g.get("low_pct", 0.0), g.get("high_pct", 0.0))})
    return {
        "run_dir": str(profile_run),
        "report": str(report.with_suffix(".md")),
        "bottlenecks": [{"severity": b.get("severity", ""), "category": b.get("category", ""),
                         "message": b.get("message", "")} for b in doc.get("bottlenecks", [])[:3]],
        "recommendations": recs,
    }


# -- formatting ----------------------------------------------------------------------------------

def _gain(low: float, high: float) -> str:
    return f"{high:.3g} % of the step" if low == high else f"{low:.3g}–{high:.3g} % of the step"


def _num(v: float | None, spec: str) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_cell(m: Mapping[str, Any], key: str) -> str:
    """A migration row's "baseline", "best" or "change" cell, with its unit."""
    if key == "change":
        if m.get("deviation_pct") is not None:
            return f"{m['deviation_pct']:.2f} % off"
        b, c = m.get("baseline"), m.get("best")
        return "—" if b is None or c is None or b == 0 else f"{100.0 * (c / b - 1.0):+.1f} %"
    v = m.get(key)
    if v is None:
        return "—"
    if m["unit"] == "bytes":
        return f"{v / 2**20:,.1f} MiB"
    if m["unit"] == "s":
        return f"{v * 1e3:,.2f} ms"
    if m["unit"] == "samples/s":
        return f"{v:,.1f} samples/s"
    return f"{v:.4g}"


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
