"""`TuningInfo`: everything a study report or the dashboard's tuning view shows, as plain JSON data.

`get_tuning_info(study_dir)` reads a study directory written by `autotune.tune` once; the
Markdown and HTML writers and the figures (`figures.get_optimization_history_info`, ...)
only draw it. Where it reads from:

1. `result.json`: a finished (or interrupted) study: trials, baseline, confirmations, Pareto front.
2. The Optuna storage (`study.db` in the study directory, or `storage=`) when there is no
   result.json or the storage is newer than it (a study still running, resumed, or killed
   before it wrote its results): the trials as stored so far, the baseline once measured.
   optuna is imported only then, inside the function.
3. `trials.parquet` / `trials.csv` when neither of those is readable (fewer columns: no
   role, constraints or intermediate values).

The ToRSh migration checks (throughput >= baseline, peak memory <= 110 %, loss within
tolerance, time per step) measure the confirmation's run directories; the autotuner's
`autotune.summary.build_summary` computes them (the main job writes its `summary.json`),
and `TuningInfo.summary` carries that document as it is rather than measuring twice.

**Parameter importances** are not Optuna's fANOVA or PED-ANOVA evaluators: they are the
*adjusted correlation ratio* of each parameter with the objective over the completed
trials. Trials are grouped by the parameter's value (numbers with more than four distinct
values in quartile bins, a missing conditional value is a group of its own);
eta^2 = between-group / total sum of squares of log throughput (a knob's effect is a
factor, as the confirmation's speedups are, so one 40x-slow trial weighs as much as its
ratio says and not its absolute samples/s), adjusted for the number of
groups like an adjusted R^2, `1 - (1 - eta^2) (n - 1) / (n - k)` (n trials, k groups,
undefined when n <= k), clipped to [0, 1]; the importances are these scores normalised to
sum to 1. It is computed from the trials table alone, so it works for a recorded, copied,
running or remotely stored study, is deterministic, needs no optuna import and no minimum
number of trials; it is descriptive (one-parameter-at-a-time, no interactions), which is
all a study of tens of trials supports.

Example:
    >>> info = get_tuning_info("torsh-runs/tune-train")  # doctest: +SKIP
    >>> info.verdict["title"], info.importances["params"][0]["name"]  # doctest: +SKIP
    ('Confirmed speedup 1.180x', 'ddp.bucket_cap_mb')
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from ..errors import invalid
from ..rundir import StudyDir
from ._info import JsonDocument

__all__ = ["IMPORTANCE_METHOD", "TUNING_SCHEMA_VERSION", "TuningInfo", "get_tuning_info"]

#: Version of the TuningInfo / study report.json layout; bumped on incompatible changes.
TUNING_SCHEMA_VERSION = 1
#: `TuningInfo.importances["method"]`: see the module docstring.
IMPORTANCE_METHOD = "adjusted_eta_squared"

_FINISHED = ("COMPLETE", "FAIL", "PRUNED")
_MAX_BINS = 4
_TABLE_FILES = ("trials.parquet", "trials.csv")


@dataclass(frozen=True, kw_only=True)
class TuningInfo(JsonDocument):
    """The data of one study's report, JSON-serialisable and schema-versioned.

    Attributes:
        schema_version: `TUNING_SCHEMA_VERSION` of the writer.
        generated_at: ISO-8601 UTC time it was built.
        study: study_dir, study_name, storage, status ("finished", "interrupted" or
            "running"), source ("result.json", "storage", "trials.parquet", "trials.csv" or
            "none"), objectives, loss_tolerance (from the trials' loss_check or loss constraint,
            None when no trial shows it) and counts (trials, complete, feasible, violated,
            failed, pruned, running).
        baseline: the user's configuration measured `baseline_repeats` times: samples_s (each
            run), median_samples_s, noise_rel and noise_pct ((max - min) / median), low/high
            _samples_s (the noise band: slowest and fastest run), beat_samples_s (median x
            (1 + noise): what a confirmed speedup must exceed), runs, run_dirs; None before
            the baseline was measured.
        params: every parameter name the trials carry, sorted.
        trials: one row per trial in number order: number, state, role, params, samples_s
            (the objective; None unless COMPLETE), vs_baseline (samples_s / baseline median),
            iqr_samples_s, loss_deviation, loss_check (the noise-calibrated loss guard's test:
            delta_rel, threshold_rel, margin_rel, noise_rel, t_stat, ...; None when no loss
            was comparable), constraint_status ("feasible", "violated", ""),
            constraints, failure_reason, peak_mem_bytes, intermediate_samples_s (measured-step
            index -> running median throughput), run_dir, on_pareto, confirmation (the
            trial's paired speedup, None when it was not confirmed).
        history: the optimisation history over trial numbers: number, state, samples_s,
            feasible, best_samples_s (best feasible objective so far, None before the first).
        importances: method (`IMPORTANCE_METHOD`), objective ("log_throughput"), num_trials, params (rows:
            name, importance (sums to 1 over the scored parameters), eta_squared,
            adjusted_eta_squared, num_groups; most important first) and constant (parameters
            with one value in every completed trial).
        pareto: the Pareto front of a throughput+loss study, fastest first: number, params,
            samples_s, loss_deviation; [] for a single objective.
        confirmations: per confirmed candidate: trial, params, pairs, ratios, speedup,
            ci_low, ci_high, better, verdict, failures, run_dirs ([baseline, candidate] per pair).
        best: trial, params, speedup, ci_low, ci_high of the confirmed best (trial None when
            nothing was confirmed faster: best.toml is then the user's configuration); after
            an ablation whose minimal configuration was confirmed, its params and re-check.
        ablation: the confirmed winner reduced to the changes that earn its speedup
            (`autotune.ablation`): trial, rounded (name -> [found, rounded]), knobs (one per
            changed knob in test order: knob, value, reverted_to, kept, ratio, ci_low, ci_high,
            share, share_ci, verdict, pairs, run_dirs, tested_with: the knobs it was reverted with),
            params (the minimal set), speedup, ci_low, ci_high, better, pairs, run_dirs (its re-check),
            notes, together (the unasked-for changes reverted together first); None without one.
        verdict: confirmed (bool), title, text.
        summary: the main job's `summary.json` (the ToRSh migration checks in `migration`,
            the baseline profile, the recommendations it tested, the commands to reproduce),
            or None for a study without one.
        warnings: what was missing or odd while reading.
    """

    schema_version: int = TUNING_SCHEMA_VERSION
    generated_at: str
    study: dict[str, Any]
    baseline: dict[str, Any] | None = None
    params: tuple[str, ...] = ()
    trials: tuple[dict[str, Any], ...] = ()
    history: dict[str, Any] = field(default_factory=dict)
    importances: dict[str, Any] = field(default_factory=dict)
    pareto: tuple[dict[str, Any], ...] = ()
    confirmations: tuple[dict[str, Any], ...] = ()
    best: dict[str, Any] = field(default_factory=dict)
    ablation: dict[str, Any] | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TuningInfo":
        """Rebuild a TuningInfo from `to_dict()` output (e.g. a parsed study report.json).

        Raises:
            ConfigError: the document is not a study report of this schema version.
        """
        if not isinstance(data, Mapping):
            raise invalid("study report", "a JSON object", type(data).__name__)
        if data.get("schema_version") != TUNING_SCHEMA_VERSION:
            raise invalid("study report schema_version", f"{TUNING_SCHEMA_VERSION}", data.get("schema_version"))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise invalid("study report key", f"one of {sorted(names)}", unknown[0])
        kwargs = dict(data)
        for name in ("params", "trials", "pareto", "confirmations", "warnings"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)


def get_tuning_info(
    study_dir: str | os.PathLike[str],
    *,
    summary: Mapping[str, Any] | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    generated_at: str | None = None,
) -> TuningInfo:
    """Read a study directory into a `TuningInfo` (see the module docstring for the sources).

    Args:
        study_dir: A directory written by `autotune.tune` (`torsh-tune tune` or the main job).
        summary: The main job's summary (`autotune.summary.build_summary`); default: the
            study's `summary.json` when it is at least as new as its `result.json`; `{}`: none.
        storage: An Optuna storage URL to read a running study from (default: the study
            directory's `study.db`).
        study_name: Its study name (default: the only study in the storage, else "torsh-tune").
        generated_at: ISO-8601 time stamp to record (default: now, UTC).

    Raises:
        ConfigError: `study_dir` is not a study directory.

    Example:
        >>> info = get_tuning_info("tests/data/study_small")
        >>> info.study["status"], info.best["trial"], info.trials[1]["state"]
        ('finished', 0, 'FAIL')
    """
    root = Path(study_dir)
    warnings: list[str] = []
    study = StudyDir(root)
    result_path, db_path = study.result_json, study.study_db
    result = _read_json(result_path, warnings)
    live = storage is not None or (db_path.is_file() and (result is None or _newer(db_path, result_path)))
    stored: dict[str, Any] | None = None
    if live:
        stored = _read_storage(storage or study.sqlite_url(), study_name, warnings)
    if stored is not None:
        source, doc = "storage", stored
        if result is not None:
            warnings.append("result.json is older than the study's storage (the study was resumed or is running): "
                            "the trials are read from the storage, the confirmation of the last finished session is "
                            "left out")
    elif result is not None:
        source, doc = "result.json", result
    else:
        source, doc = _read_table(root, warnings)
        if doc is None and not any(study.runs(d).is_dir() for d in ("baseline", "trials")):
            raise invalid("STUDY", "a study directory (holding result.json, study.db or trials.csv)", str(study_dir))
    doc = doc or {"trials": []}
    locate = _Locator(root, doc.get("study_dir"))
    objectives = tuple(doc.get("objectives") or ("throughput",))
    trials = [_trial_row(t, locate) for t in sorted(doc.get("trials", []), key=lambda t: t["number"])]
    baseline = _baseline(doc.get("baseline"), locate)
    pareto = [_pareto_row(p) for p in doc.get("pareto") or []]
    confirmations = [_confirmation_row(c, locate) for c in doc.get("confirmations") or []] if source != "storage" else []
    warnings.extend(str(n) for n in doc.get("confirmation_notes") or ())
    on_front = {p["number"] for p in pareto}
    confirmed = {c["trial"]: c["speedup"] for c in confirmations}
    median = baseline["median_samples_s"] if baseline else None
    for t in trials:
        t["on_pareto"] = t["number"] in on_front
        t["confirmation"] = confirmed.get(t["number"])
        t["vs_baseline"] = t["samples_s"] / median if t["samples_s"] is not None and median else None
    status = ("running" if source != "result.json" else "interrupted" if doc.get("interrupted") else "finished")
    if summary is None:
        summary = _read_summary(root, result_path, warnings)
    best_trial = doc.get("best_trial") if source == "result.json" else None
    best_conf = next((c for c in confirmations if c["trial"] == best_trial), None)
    ablation = _ablation_row(doc.get("ablation"), locate) if source == "result.json" else None
    if best_conf is not None and ablation is not None and ablation["better"]:
        best_conf = {**best_conf, "params": ablation["params"], "pairs": ablation["pairs"],
                     **{k: ablation[k] for k in ("speedup", "ci_low", "ci_high")}}
    info = TuningInfo(
        generated_at=generated_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        study={
            "study_dir": str(root),
            "study_name": doc.get("study_name"),
            "storage": doc.get("storage"),
            "status": status,
            "source": source,
            "objectives": list(objectives),
            "unit": str((doc.get("baseline") or {}).get("unit") or "samples/s"),
            "loss_tolerance": _loss_tolerance(trials),
            "counts": _counts(trials),
        },
        baseline=baseline,
        params=tuple(sorted({name for t in trials for name in t["params"]})),
        trials=tuple(trials),
        history=_history(trials),
        importances=_importances(trials),
        pareto=tuple(pareto),
        confirmations=tuple(confirmations),
        best={"trial": best_trial, "params": dict(doc.get("best_params") or {}) if best_trial is not None else {},
              "speedup": best_conf["speedup"] if best_conf else None,
              "ci_low": best_conf["ci_low"] if best_conf else None,
              "ci_high": best_conf["ci_high"] if best_conf else None},
        ablation=ablation,
        verdict=_verdict(status, trials, baseline, confirmations, best_conf, ablation),
        summary=dict(summary) if summary is not None else None,
        warnings=tuple(warnings),
    )
    return TuningInfo.from_dict(json.loads(info.to_json()))  # plain JSON types throughout


# -- sources ---------------------------------------------------------------------------------


def _read_json(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # a torn file: fall back to the other sources, and say so
        warnings.append(f"{path.name} could not be read ({type(exc).__name__}: {exc})")
        return None


def _newer(a: Path, b: Path) -> bool:
    # The tuner writes result.json after its last storage write; a storage written later
    # belongs to a resumed (or still running) session.
    try:
        return a.stat().st_mtime > b.stat().st_mtime + 1.0
    except OSError:
        return False


def _read_summary(root: Path, result_path: Path, warnings: list[str]) -> dict[str, Any] | None:
    path = StudyDir(root).summary_json
    summary = _read_json(path, warnings)
    if summary is not None and result_path.is_file() and _newer(result_path, path):
        warnings.append("summary.json is older than result.json: its migration checks are left out "
                        "(`torsh-tune report STUDY` measures them again)")
        return None
    return summary


def _read_storage(url: str, study_name: str | None, warnings: list[str]) -> dict[str, Any] | None:
    """The study as stored so far, in result.json's layout (optuna is imported here only)."""
    try:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        names = optuna.get_all_study_names(storage=url)
        if study_name is None:
            study_name = names[0] if len(names) == 1 else "torsh-tune"
        study = optuna.load_study(study_name=study_name, storage=url)
        trials = [_frozen_trial(t) for t in study.get_trials(deepcopy=False)]
        objectives = tuple(study.user_attrs.get("objectives") or ("throughput",))
        pareto = []
        if len(objectives) > 1 and any(t["state"] == "COMPLETE" for t in trials):
            for t in sorted(study.best_trials, key=lambda t: (-t.values[0], t.number)):
                pareto.append({"number": t.number, "params": dict(t.user_attrs.get("config_params", t.params)),
                               "values": dict(zip(objectives, t.values))})
        return {"study_name": study_name, "storage": url, "objectives": list(objectives), "trials": trials,
                "baseline": study.user_attrs.get("baseline"), "pareto": pareto}
    except Exception as exc:  # noqa: BLE001 - a report must still come out of result.json or the tables
        warnings.append(f"the study's storage could not be read ({type(exc).__name__}: {exc})")
        return None


def _frozen_trial(t: Any) -> dict[str, Any]:
    """An Optuna FrozenTrial as result.json's trial (what `autotune.study` records in its user attrs)."""
    ua = t.user_attrs
    complete = t.state.name == "COMPLETE"
    constraints = {str(k): float(v) for k, v in dict(getattr(t, "constraints", None) or {}).items()} if complete else {}
    return {
        "number": t.number,
        "params": dict(ua.get("config_params", t.params)),
        "state": t.state.name,
        "samples_s": t.values[0] if complete and t.values else None,
        "iqr_samples_s": ua.get("iqr_samples_s"),
        "loss_deviation": ua.get("loss_deviation"),
        "loss_check": ua.get("loss_check"),
        "constraint_status": ("" if not complete else
                              "feasible" if all(v <= 0 for v in constraints.values()) else "violated"),
        "constraints": constraints,
        "failure_reason": ua.get("failure_reason", ""),
        "run_dir": ua.get("run_dir", ""),
        "role": str(ua.get("role", "")),
        "peak_mem_bytes": ua.get("peak_mem_bytes"),
        "intermediate_samples_s": {str(k): float(v) for k, v in sorted(t.intermediate_values.items())},
    }


def _read_table(root: Path, warnings: list[str]) -> tuple[str, dict[str, Any] | None]:
    for name in _TABLE_FILES:
        path = root / name
        if not path.is_file():
            continue
        try:
            frame = pd.read_parquet(path) if name.endswith(".parquet") else pd.read_csv(
                path, dtype={"params": str, "failure_reason": str, "constraint_status": str, "run_dir": str},
                keep_default_na=False, na_values={c: [""] for c in ("objective_samples_s", "iqr_samples_s",
                                                                      "loss_deviation")})
        except Exception as exc:  # noqa: BLE001 - try the next table
            warnings.append(f"{name} could not be read ({type(exc).__name__}: {exc})")
            continue
        warnings.append(f"no result.json or storage: trials from {name} (no roles, constraints or "
                        "intermediate values)")
        trials = [{
            "number": int(r["number"]), "state": str(r["state"]), "params": json.loads(r["params"] or "{}"),
            "samples_s": _num(r.get("objective_samples_s")), "iqr_samples_s": _num(r.get("iqr_samples_s")),
            "loss_deviation": _num(r.get("loss_deviation")), "constraint_status": str(r.get("constraint_status") or ""),
            "failure_reason": str(r.get("failure_reason") or ""), "run_dir": str(r.get("run_dir") or ""),
        } for r in frame.to_dict("records")]
        return name, {"trials": trials}
    return "none", None


class _Locator:
    """Run directories as recorded, found again after the study directory moved (or was recorded relative)."""

    def __init__(self, root: Path, recorded_root: str | None) -> None:
        self.root = root
        self.recorded = Path(recorded_root) if recorded_root else None

    def __call__(self, path: str | None) -> str:
        if not path:
            return ""
        p = Path(path)
        rel = None
        if self.recorded is not None and str(self.recorded) not in ("", "."):
            try:
                rel = p.relative_to(self.recorded)
            except ValueError:
                rel = None
        elif not p.is_absolute():
            rel = p
        for candidate in ([self.root / rel] if rel is not None else []) + [p]:
            if candidate.exists():
                return str(candidate)
        return str(self.root / rel) if rel is not None else str(p)


# -- rows ------------------------------------------------------------------------------------


def _trial_row(t: Mapping[str, Any], locate: _Locator) -> dict[str, Any]:
    complete = t.get("state") == "COMPLETE"
    return {
        "number": int(t["number"]),
        "state": str(t.get("state", "")),
        "role": str(t.get("role", "")),
        "params": dict(t.get("params") or {}),
        "samples_s": _num(t.get("samples_s")) if complete else None,
        "vs_baseline": None,
        "iqr_samples_s": _num(t.get("iqr_samples_s")),
        "loss_deviation": _num(t.get("loss_deviation")),
        "loss_check": dict(t["loss_check"]) if t.get("loss_check") else None,
        "constraint_status": str(t.get("constraint_status") or ""),
        "constraints": {str(k): float(v) for k, v in (t.get("constraints") or {}).items()},
        "failure_reason": str(t.get("failure_reason") or ""),
        "peak_mem_bytes": t.get("peak_mem_bytes"),
        "intermediate_samples_s": {str(k): float(v) for k, v in (t.get("intermediate_samples_s") or {}).items()},
        "run_dir": locate(t.get("run_dir")),
        "on_pareto": False,
        "confirmation": None,
    }


def _baseline(stored: Mapping[str, Any] | None, locate: _Locator) -> dict[str, Any] | None:
    if not stored or not stored.get("samples_s"):
        return None
    values = [float(v) for v in stored["samples_s"]]
    median = float(np.median(values))
    noise = (max(values) - min(values)) / median if median > 0 else 0.0
    return {
        "samples_s": values,
        "median_samples_s": median,
        "noise_rel": noise,
        "noise_pct": 100.0 * noise,
        "low_samples_s": min(values),
        "high_samples_s": max(values),
        "beat_samples_s": median * (1.0 + noise),
        "runs": len(values),
        "run_dirs": [locate(r) for r in stored.get("run_dirs") or []],
    }


def _pareto_row(p: Mapping[str, Any]) -> dict[str, Any]:
    values = p.get("values") or {}
    return {"number": int(p["number"]), "params": dict(p.get("params") or {}),
            "samples_s": _num(values.get("throughput")), "loss_deviation": _num(values.get("loss"))}


def _confirmation_row(c: Mapping[str, Any], locate: _Locator) -> dict[str, Any]:
    ratios = [float(r) for r in c.get("ratios") or []]
    speedup, better = _num(c.get("speedup")), bool(c.get("better"))
    if speedup is None:
        verdict = "not measured: " + ("; ".join(c.get("failures") or []) or "no successful pair")
    else:
        verdict = "confirmed faster" if better else "not faster beyond noise"
    return {
        "trial": int(c["trial_number"]),
        "params": dict(c.get("params") or {}),
        "pairs": len(ratios),
        "ratios": ratios,
        "speedup": speedup,
        "ci_low": _num(c.get("ci_low")),
        "ci_high": _num(c.get("ci_high")),
        "better": better,
        "verdict": verdict,
        "failures": [str(f) for f in c.get("failures") or []],
        "run_dirs": [[locate(a), locate(b)] for a, b in c.get("run_dirs") or []],
    }


def _ablation_row(a: Mapping[str, Any] | None, locate: _Locator) -> dict[str, Any] | None:
    if not a:
        return None
    knobs = [{
        "knob": str(e["knob"]), "value": e.get("value"), "reverted_to": e.get("reverted_to"), "kept": bool(e["kept"]),
        "ratio": _num(e.get("ratio")), "ci_low": _num(e.get("ci_low")), "ci_high": _num(e.get("ci_high")),
        "share": _num(e.get("share")), "share_ci": [float(x) for x in e["share_ci"]] if e.get("share_ci") else None,
        "verdict": str(e.get("verdict") or ""), "pairs": len(e.get("ratios") or []),
        "run_dirs": [[locate(x), locate(y)] for x, y in e.get("run_dirs") or []],
        "tested_with": [str(k) for k in e.get("tested_with") or []],
    } for e in a.get("effects") or []]
    return {
        "trial": int(a["trial_number"]), "rounded": {str(k): list(v) for k, v in (a.get("rounded") or {}).items()},
        "knobs": knobs, "params": dict(a.get("params") or {}), "speedup": _num(a.get("speedup")),
        "ci_low": _num(a.get("ci_low")), "ci_high": _num(a.get("ci_high")), "better": bool(a.get("better")),
        "pairs": len(a.get("run_dirs") or []), "run_dirs": [[locate(x), locate(y)] for x, y in a.get("run_dirs") or []],
        "notes": [str(n) for n in a.get("notes") or []],
        "together": [str(k) for k in a.get("together") or []],
    }


def _counts(trials: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    states = [t["state"] for t in trials]
    return {
        "trials": len(trials),
        "finished": sum(s in _FINISHED for s in states),
        "complete": states.count("COMPLETE"),
        "feasible": sum(t["state"] == "COMPLETE" and t["constraint_status"] != "violated" for t in trials),
        "violated": sum(t["constraint_status"] == "violated" for t in trials),
        "failed": states.count("FAIL"),
        "pruned": states.count("PRUNED"),
        "running": states.count("RUNNING") + states.count("WAITING"),
    }


def _loss_tolerance(trials: Sequence[Mapping[str, Any]]) -> float | None:
    for t in trials:
        if t.get("loss_check"):
            return float(t["loss_check"]["tolerance_rel"])
    # Studies recorded before the noise-calibrated guard: the constraint was `loss_deviation - loss_tolerance`.
    for t in trials:
        dev, c = t.get("loss_deviation"), t["constraints"].get("loss_deviation")
        if dev is not None and c is not None:
            return round(dev - c, 12)
    return None


def _history(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    best: float | None = None
    out: dict[str, list[Any]] = {"number": [], "state": [], "samples_s": [], "feasible": [], "best_samples_s": []}
    for t in trials:
        feasible = t["samples_s"] is not None and t["constraint_status"] != "violated"
        if feasible:
            best = t["samples_s"] if best is None else max(best, t["samples_s"])
        out["number"].append(t["number"])
        out["state"].append(t["state"])
        out["samples_s"].append(t["samples_s"])
        out["feasible"].append(feasible)
        out["best_samples_s"].append(best)
    return out


def _verdict(status: str, trials: Sequence[Mapping[str, Any]], baseline: Mapping[str, Any] | None,
             confirmations: Sequence[Mapping[str, Any]], best: Mapping[str, Any] | None,
             ablation: Mapping[str, Any] | None = None) -> dict[str, Any]:
    if best is not None:
        what = f"Trial {best['trial']}"
        if ablation is not None and ablation["better"]:
            kept = [k["knob"] for k in ablation["knobs"] if k["kept"]]
            what = (f"Trial {best['trial']} reduced to the {len(kept)} of its {len(ablation['knobs'])} change(s) that "
                    f"earn its speedup ({', '.join(kept) or 'none'})")
        return {"confirmed": True, "title": f"Confirmed speedup {best['speedup']:.3f}x",
                "text": f"{what} ran {best['speedup']:.3f}x the baseline's throughput (95 % CI "
                        f"{best['ci_low']:.3f}–{best['ci_high']:.3f}) over {best['pairs']} interleaved pair(s); "
                        f"{_noise(baseline)}. It is in `best.toml`."}
    if status == "running":
        done = sum(t["state"] in _FINISHED for t in trials)
        return {"confirmed": False, "title": "Study in progress",
                "text": f"{done} trial(s) finished so far; the best candidates are confirmed against the baseline "
                        "after the search (or the study was stopped before: `torsh-tune tune --resume STUDY`)."}
    if status == "interrupted":
        text = "The study was interrupted before a candidate was confirmed; `best.toml` is your configuration as it is."
    elif not confirmations:
        text = "No candidate was re-run against the baseline; `best.toml` is your configuration as it is."
    else:
        text = ("No candidate beat the baseline in the confirmation (a paired-speedup 95 % CI above 1 and a "
                f"speedup beyond the noise; {_noise(baseline)}); `best.toml` is your configuration as it is.")
    return {"confirmed": False, "title": "No confirmed speedup", "text": text}


def _noise(baseline: Mapping[str, Any] | None) -> str:
    if baseline is None or baseline["runs"] < 2:
        return "the baseline's run-to-run noise was not measured (one baseline run)"
    return f"the baseline's run-to-run noise is {baseline['noise_pct']:.1f} %"


# -- importances -----------------------------------------------------------------------------


def _importances(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Adjusted correlation ratio of each parameter with log throughput (module docstring)."""
    done = [t for t in trials if t["samples_s"] is not None and t["samples_s"] > 0]
    y = np.log(np.array([t["samples_s"] for t in done], dtype=float))
    names = sorted({n for t in done for n in t["params"]})
    rows, constant = [], []
    for name in names:
        groups = _groups([t["params"].get(name) for t in done])
        k = len(set(groups))
        if k < 2:
            constant.append(name)
            continue
        eta = _eta_squared(y, groups)
        n = len(y)
        adjusted = None if n <= k else min(1.0, max(0.0, 1.0 - (1.0 - eta) * (n - 1) / (n - k)))
        rows.append({"name": name, "importance": None, "eta_squared": eta, "adjusted_eta_squared": adjusted,
                     "num_groups": k})
    total = sum(r["adjusted_eta_squared"] or 0.0 for r in rows)
    for r in rows:
        if r["adjusted_eta_squared"] is not None:
            r["importance"] = r["adjusted_eta_squared"] / total if total > 0 else 0.0
    rows.sort(key=lambda r: (r["importance"] is None, -(r["importance"] or 0.0), -r["eta_squared"], r["name"]))
    return {"method": IMPORTANCE_METHOD, "objective": "log_throughput", "num_trials": len(done), "params": rows,
            "constant": constant}


def _groups(values: Sequence[Any]) -> list[str]:
    """Group labels: the value, or its quartile bin for numbers with more than `_MAX_BINS` values."""
    numeric = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    distinct = {json.dumps(v, sort_keys=True) for v in values}
    if len(numeric) == len(values) and len(distinct) > _MAX_BINS:
        bins = pd.qcut(pd.Series(numeric, dtype=float).rank(method="first"), _MAX_BINS, labels=False)
        return [f"q{int(b)}" for b in bins]
    return [json.dumps(v, sort_keys=True) for v in values]


def _eta_squared(y: np.ndarray, groups: Sequence[str]) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    if total <= 0:
        return 0.0
    frame = pd.DataFrame({"g": list(groups), "y": y})
    g = frame.groupby("g")["y"]
    between = float((g.size() * (g.mean() - y.mean()) ** 2).sum())
    return min(1.0, between / total)


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None

