"""Compare two runs (or a run and a baseline report.json): deltas with noise-aware verdicts.

Pure (pandas/numpy, never torch). `compare_runs` aligns the two reports metric by metric
and decides, for each, whether B improved on A, regressed, or stays within noise:

- **Noise.** With the per-step records of both runs (`frames_a`/`frames_b`, at most
  `BOOTSTRAP_MAX_STEPS` measured steps each) the 95 % interval of the change of the median
  is a percentile bootstrap (`BOOTSTRAP_RESAMPLES` resamples of each run's per-step values,
  seeded, so a comparison is reproducible). Otherwise (longer runs, or a report.json
  baseline without records) it is the normal approximation of the median's standard error
  from each run's IQR: `se = 1.2533 * (IQR / 1.349) / sqrt(n)`, interval
  `± 1.96 * sqrt(se_a² + se_b²)`. Values measured once per run (peak memory, bus
  bandwidth) have no spread: their noise is taken as 0 and only the threshold applies.
- **Verdict.** `regressed` / `improved` when the interval excludes no change *and* the
  change is at least `threshold_pct`; `within noise` otherwise; `n/a` when a side lacks
  the metric.
- **Percent base.** Step time, throughput, memory and bandwidth changes are % of A's own
  value; step phases and communication times are % of A's median step time, so a phase
  that grows from 0.1 ms to 0.2 ms reads as what it costs the step, not as +100 %.
- **Gate.** `regressed(comparison)` is true when a gating metric (median step time,
  throughput) regressed by more than the threshold: the CI exit code.

Example:
    >>> text, code = run_compare("runs/base", "runs/new", threshold_pct=5, fmt="md")  # doctest: +SKIP
    >>> code  # 0: no regression beyond 5 %, 1: regression  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ..analysis import PHASES, RunAnalysis, RunFrames, analyze_run, load_run, measured, phase_frame
from ..errors import ConfigError, invalid
from ._format import PHASE_LABELS, fmt_value
from ._info import ReportInfo, build_report_info
from ._json import read_json

__all__ = [
    "BOOTSTRAP_MAX_STEPS",
    "BOOTSTRAP_RESAMPLES",
    "COMPARE_FORMATS",
    "VERDICTS",
    "BottleneckChange",
    "Comparison",
    "MetricDelta",
    "compare_runs",
    "compare_to_dict",
    "regressed",
    "render_compare_markdown",
    "run_compare",
]

#: Verdicts of a metric, in the order they are reported.
VERDICTS = ("regressed", "improved", "within noise", "n/a")
#: Output formats of `run_compare`.
COMPARE_FORMATS = ("md", "json")
#: Bootstrap resamples per comparison.
BOOTSTRAP_RESAMPLES = 1000
#: Above this many measured steps per run, the IQR bound replaces the bootstrap (same answer, less time).
BOOTSTRAP_MAX_STEPS = 2000
_Z95 = 1.959964
_SE_MEDIAN_PER_IQR = 1.2533 / 1.349  # se(median) = this * IQR / sqrt(n) for normal-ish data


@dataclass(frozen=True, kw_only=True)
class MetricDelta:
    """One metric of runs A and B and the verdict on its change."""

    name: str  # key, unit in the name (median_step_s, phase_data_s, peak_memory_bytes, ...)
    label: str  # for people
    a: float | None
    b: float | None
    delta: float | None  # b - a, in the metric's unit
    delta_pct: float | None  # 100 * delta / base (see `pct_base`)
    pct_base: str  # "self" (A's value) or "step" (A's median step time)
    better: str  # "lower" or "higher"
    noise_pct: float | None  # half-width of the 95 % interval of delta_pct (None: unknown)
    method: str  # "bootstrap", "iqr" or "none"
    significant: bool  # the interval excludes 0
    verdict: str  # one of VERDICTS
    gating: bool  # counts for `regressed`


@dataclass(frozen=True, kw_only=True)
class BottleneckChange:
    """A bottleneck category present in A, B or both."""

    category: str
    change: str  # appeared, disappeared, worse, better, unchanged
    severity_a: str | None
    severity_b: str | None
    message_b: str | None  # B's message (A's when it disappeared)


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Run B against run A (the baseline)."""

    a_name: str
    b_name: str
    a_source: str  # run directory or report.json path
    b_source: str
    threshold_pct: float
    metrics: tuple[MetricDelta, ...]
    bottlenecks: tuple[BottleneckChange, ...]
    warnings: tuple[str, ...]


def compare_runs(
    a: RunAnalysis | ReportInfo,
    b: RunAnalysis | ReportInfo,
    *,
    threshold_pct: float = 5.0,
    frames_a: RunFrames | None = None,
    frames_b: RunFrames | None = None,
    seed: int = 0,
) -> Comparison:
    """Align run B with run A (the baseline) and judge every change against noise.

    Args:
        a: the baseline: an analysed run or a report (e.g. `read_json("base/report.json")`).
        b: the run to judge.
        threshold_pct: smallest change (in %) that counts as improved/regressed.
        frames_a: A's records (`load_run`), for a bootstrap over its per-step values.
        frames_b: B's records.
        seed: seed of the bootstrap.

    Returns:
        The Comparison.

    Raises:
        ConfigError: a negative or non-finite threshold.

    Example:
        >>> c = compare_runs(analyze_run(a), analyze_run(b), frames_a=load_run(a), frames_b=load_run(b))  # doctest: +SKIP
        >>> [(m.name, m.verdict) for m in c.metrics][:1]  # doctest: +SKIP
        [('median_step_s', 'within noise')]
    """
    if not (isinstance(threshold_pct, (int, float)) and math.isfinite(threshold_pct) and threshold_pct >= 0):
        raise invalid("threshold_pct", "a finite number >= 0", threshold_pct)
    ia, ib = _info(a), _info(b)
    warnings: list[str] = []
    sa, sb = _samples(frames_a), _samples(frames_b)
    if sa is None or sb is None:
        warnings.append("per-step records of both runs are needed for a bootstrap; noise is estimated from the IQR")
    rng = np.random.default_rng(seed)
    ctx = _Ctx(ia=ia, ib=ib, sa=sa, sb=sb, rng=rng, threshold_pct=float(threshold_pct))
    sum_a, sum_b = ia.summary or {}, ib.summary or {}
    step_a = sum_a.get("median_step_s")

    metrics = [
        ctx.metric("median_step_s", "median step time", sum_a.get("median_step_s"), sum_b.get("median_step_s"),
                   better="lower", gating=True, series="step_s", summary_iqr=True),
        ctx.metric("throughput_samples_s", "throughput", sum_a.get("throughput_samples_s"),
                   sum_b.get("throughput_samples_s"), better="higher", gating=True, series="throughput",
                   summary_iqr=True),
    ]
    phases_a = {r.get("phase"): r.get("time_s") for r in ia.breakdown}
    phases_b = {r.get("phase"): r.get("time_s") for r in ib.breakdown}
    for p in [*PHASES, *sorted((set(phases_a) | set(phases_b)) - set(PHASES))]:
        if p in phases_a or p in phases_b:
            metrics.append(ctx.metric(f"phase_{p}_s", f"phase: {PHASE_LABELS.get(p, p)}", phases_a.get(p),
                                      phases_b.get(p), better="lower", series=p, base=step_a))
    ca, cb = ia.communication or {}, ib.communication or {}
    if ca or cb:
        metrics.append(ctx.metric("comm_s", "communication per step", ca.get("comm_s"), cb.get("comm_s"),
                                  better="lower", series="comm_s", base=step_a))
        metrics.append(ctx.metric("exposed_comm_s", "exposed communication", ca.get("exposed_comm_s"),
                                  cb.get("exposed_comm_s"), better="lower", series="exposed_comm_s", base=step_a))
        metrics.append(ctx.metric("busbw_gbps", "bus bandwidth", ca.get("busbw_gbps"), cb.get("busbw_gbps"),
                                  better="higher"))
    ma, mb = _peak_memory(ia), _peak_memory(ib)
    if ma is not None or mb is not None:
        metrics.append(ctx.metric("peak_memory_bytes", "peak memory (worst rank)", ma, mb, better="lower"))
    if (ia.run.get("world_size") or 0) != (ib.run.get("world_size") or 0):
        warnings.append(f"world sizes differ: {ia.run.get('world_size')} vs {ib.run.get('world_size')}")
    if ia.partial or ib.partial:
        warnings.append("a run is partial: its numbers cover only what was recorded")
    return Comparison(
        a_name=str(ia.run.get("name") or "A"),
        b_name=str(ib.run.get("name") or "B"),
        a_source=str(ia.run.get("run_dir") or ""),
        b_source=str(ib.run.get("run_dir") or ""),
        threshold_pct=float(threshold_pct),
        metrics=tuple(metrics),
        bottlenecks=_bottleneck_changes(ia, ib),
        warnings=tuple(warnings),
    )


def regressed(comparison: Comparison, threshold_pct: float | None = None) -> bool:
    """True when a gating metric (median step time, throughput) got significantly worse by more than the threshold.

    Args:
        comparison: from `compare_runs`.
        threshold_pct: the threshold (default: the comparison's own).

    Example:
        >>> sys.exit(1 if regressed(compare_runs(base, new, threshold_pct=5)) else 0)  # doctest: +SKIP
    """
    limit = comparison.threshold_pct if threshold_pct is None else float(threshold_pct)
    return any(m.gating and m.significant and _worse_pct(m) > limit for m in comparison.metrics)


def compare_to_dict(comparison: Comparison) -> dict[str, Any]:
    """The comparison as JSON-ready data, with `regressed` (at its threshold) added."""
    out = dataclasses.asdict(comparison)
    out["regressed"] = regressed(comparison)
    return _finite(out)


def render_compare_markdown(comparison: Comparison) -> str:
    """The comparison as Markdown: verdict line, metric table, bottleneck changes, warnings."""
    c = comparison
    out = [f"# torsh-tune compare: {c.a_name} → {c.b_name}", ""]
    gate = [m for m in c.metrics if m.gating and m.significant and _worse_pct(m) > c.threshold_pct]
    if gate:
        worst = max(gate, key=_worse_pct)
        out.append(f"**REGRESSION** beyond the {c.threshold_pct:g} % threshold: {worst.label} "
                   f"{_signed_pct(worst.delta_pct)} (noise ± {_pct(worst.noise_pct)}).")
    else:
        out.append(f"**No regression** beyond the {c.threshold_pct:g} % threshold.")
    out += ["", f"A (baseline): `{c.a_source or c.a_name}`  ", f"B: `{c.b_source or c.b_name}`", ""]
    out += ["| metric | A | B | change | noise (95 %) | verdict |", "|---|---:|---:|---:|---:|---|"]
    for m in c.metrics:
        base = " of step" if m.pct_base == "step" and m.delta_pct is not None else ""
        mark = {"regressed": "🔴 ", "improved": "🟢 "}.get(m.verdict, "")
        out.append(f"| {m.label} | {_fmt(m.name, m.a)} | {_fmt(m.name, m.b)} | {_signed_pct(m.delta_pct)}{base} "
                   f"| ± {_pct(m.noise_pct)} ({m.method}) | {mark}{m.verdict} |")
    out.append("")
    if c.bottlenecks:
        out += ["## Bottlenecks", "", "| category | A | B | change |", "|---|---|---|---|"]
        out += [f"| {x.category} | {x.severity_a or '–'} | {x.severity_b or '–'} | {x.change} |" for x in c.bottlenecks]
        out.append("")
    if c.warnings:
        out += ["## Warnings", ""] + [f"- {w}" for w in c.warnings] + [""]
    out.append("_Verdicts: a change counts when its 95 % interval excludes 0 and it is at least the threshold; "
               "phase and communication changes are % of A's median step._")
    return "\n".join(out) + "\n"


def run_compare(
    path_a: str | os.PathLike[str], path_b: str | os.PathLike[str], *, threshold_pct: float = 5.0, fmt: str = "md"
) -> tuple[str, int]:
    """What `torsh-tune compare A B` prints and its exit code.

    Each path is a run directory (analysed here, its records used for the bootstrap) or a
    report.json file (e.g. a committed baseline); a directory holding only
    `report/report.json` or `report.json` is read as that report.

    Args:
        path_a: the baseline.
        path_b: the run to judge.
        threshold_pct: regressions beyond this % of a gating metric exit 1.
        fmt: "md" (Markdown) or "json".

    Returns:
        (text to print, exit code: 0 no regression beyond the threshold, 1 regression).

    Raises:
        ConfigError: a path that is neither a run directory nor a report.json, an
            unreadable report, an unknown format or a bad threshold (one line each).

    Example:
        >>> text, code = run_compare("runs/base", "baseline/report.json", threshold_pct=5, fmt="json")  # doctest: +SKIP
    """
    if fmt not in COMPARE_FORMATS:
        raise invalid("compare format", f"one of {', '.join(COMPARE_FORMATS)}", fmt)
    ra, fa = _resolve(path_a, "run A")
    rb, fb = _resolve(path_b, "run B")
    comparison = compare_runs(ra, rb, threshold_pct=threshold_pct, frames_a=fa, frames_b=fb)
    if fmt == "json":
        text = json.dumps(compare_to_dict(comparison), indent=2, allow_nan=False) + "\n"
    else:
        text = render_compare_markdown(comparison)
    return text, 1 if regressed(comparison) else 0


# -- internals ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Samples:
    """Per measured step: global step time, throughput, phases and comm (means across ranks)."""

    by_step: pd.DataFrame  # columns step_s, throughput, PHASES..., comm_s, exposed_comm_s


@dataclass(kw_only=True)
class _Ctx:
    ia: ReportInfo
    ib: ReportInfo
    sa: _Samples | None
    sb: _Samples | None
    rng: np.random.Generator
    threshold_pct: float

    def metric(self, name: str, label: str, a: Any, b: Any, *, better: str, gating: bool = False,
               series: str | None = None, base: float | None = None, summary_iqr: bool = False) -> MetricDelta:
        a, b = _num(a), _num(b)
        pct_base = "step" if base is not None else "self"
        denom = base if base is not None else a
        if a is None or b is None:
            return MetricDelta(name=name, label=label, a=a, b=b, delta=None, delta_pct=None, pct_base=pct_base,
                               better=better, noise_pct=None, method="none", significant=False, verdict="n/a",
                               gating=gating)
        delta = b - a
        delta_pct = 100.0 * delta / denom if denom else (0.0 if delta == 0 else math.copysign(math.inf, delta))
        noise, method = self._noise(series, denom, summary_iqr)
        if noise is None:
            significant = delta != 0
        else:
            significant = abs(delta_pct) > noise
        verdict = "within noise"
        if significant and abs(delta_pct) >= self.threshold_pct and delta != 0:
            worse = delta > 0 if better == "lower" else delta < 0
            verdict = "regressed" if worse else "improved"
        return MetricDelta(name=name, label=label, a=a, b=b, delta=delta, delta_pct=delta_pct, pct_base=pct_base,
                           better=better, noise_pct=noise, method=method, significant=bool(significant),
                           verdict=verdict, gating=gating)

    def _noise(self, series: str | None, denom: float | None, summary_iqr: bool) -> tuple[float | None, str]:
        if series is None or not denom:
            return None, "none"
        xa = self.sa.by_step[series].dropna().to_numpy(float) if self.sa is not None else None
        xb = self.sb.by_step[series].dropna().to_numpy(float) if self.sb is not None else None
        if xa is not None and xb is not None and len(xa) > 1 and len(xb) > 1:
            if max(len(xa), len(xb)) <= BOOTSTRAP_MAX_STEPS:
                return _bootstrap_halfwidth_pct(xa, xb, denom, self.rng), "bootstrap"
            return _iqr_halfwidth_pct(_iqr_n(xa), _iqr_n(xb), denom), "iqr"
        # Without both runs' records: the IQR each report states (step time; throughput shares its relative spread).
        if summary_iqr:
            qa = _iqr_n(xa) if xa is not None and len(xa) > 1 else _summary_iqr(self.ia, series)
            qb = _iqr_n(xb) if xb is not None and len(xb) > 1 else _summary_iqr(self.ib, series)
            if qa is not None and qb is not None:
                return _iqr_halfwidth_pct(qa, qb, denom), "iqr"
        return None, "none"


def _bootstrap_halfwidth_pct(xa: np.ndarray, xb: np.ndarray, denom: float, rng: np.random.Generator) -> float:
    """Half-width of the 95 % percentile-bootstrap interval of 100 * (median(b) - median(a)) / denom."""
    ma = np.median(xa[rng.integers(0, len(xa), size=(BOOTSTRAP_RESAMPLES, len(xa)))], axis=1)
    mb = np.median(xb[rng.integers(0, len(xb), size=(BOOTSTRAP_RESAMPLES, len(xb)))], axis=1)
    diff = 100.0 * (mb - ma) / denom
    lo, hi = np.percentile(diff, [2.5, 97.5])
    observed = 100.0 * (np.median(xb) - np.median(xa)) / denom
    # Distance from the observed change to the interval's far side: "significant" <=> 0 outside it.
    return float(max(observed - lo, hi - observed))


def _iqr_halfwidth_pct(qa: tuple[float, int], qb: tuple[float, int], denom: float) -> float:
    se_a = _SE_MEDIAN_PER_IQR * qa[0] / math.sqrt(max(1, qa[1]))
    se_b = _SE_MEDIAN_PER_IQR * qb[0] / math.sqrt(max(1, qb[1]))
    return 100.0 * _Z95 * math.sqrt(se_a**2 + se_b**2) / abs(denom)


def _iqr_n(x: np.ndarray) -> tuple[float, int]:
    q25, q75 = np.quantile(x, [0.25, 0.75])
    return float(q75 - q25), len(x)


def _summary_iqr(info: ReportInfo, series: str) -> tuple[float, int] | None:
    s = info.summary or {}
    iqr, n, med = _num(s.get("iqr_step_s")), s.get("num_steps"), _num(s.get("median_step_s"))
    if iqr is None or not isinstance(n, int) or n < 1:
        return None
    if series == "throughput":
        tput = _num(s.get("throughput_samples_s"))
        if tput is None or not med:
            return None
        return iqr / med * tput, n  # same relative spread as the step time
    return iqr, n


def _samples(frames: RunFrames | None) -> _Samples | None:
    if frames is None or frames.steps.empty:
        return None
    steps, _, _ = measured(frames.steps, frames.comm.iloc[0:0])
    g = steps.groupby("step")
    by_step = pd.DataFrame({"step_s": g["step_s"].max().astype(float)})
    samples = g["samples"].sum(min_count=1).astype(float)
    by_step["throughput"] = (samples / by_step["step_s"]).where(by_step["step_s"] > 0)
    phases = phase_frame(steps).groupby("step")[list(PHASES)].mean()
    by_step = by_step.join(phases)
    by_step = by_step.join(g[["comm_s", "exposed_comm_s"]].mean())
    return _Samples(by_step=by_step)


def _peak_memory(info: ReportInfo) -> float | None:
    rows = (info.memory or {}).get("per_rank") or []
    peaks = [v for r in rows if (v := _num(r.get("peak_bytes"))) is not None]
    return max(peaks) if peaks else None


_SEV_RANK = {"critical": 0, "high": 1, "medium": 2, "low": 3}


def _bottleneck_changes(ia: ReportInfo, ib: ReportInfo) -> tuple[BottleneckChange, ...]:
    def worst(info: ReportInfo) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for bn in info.bottlenecks:  # severity order: the first of a category is its worst
            out.setdefault(str(bn.get("category")), bn)
        return out

    wa, wb = worst(ia), worst(ib)
    changes = []
    for cat in [*wa, *(c for c in wb if c not in wa)]:
        x, y = wa.get(cat), wb.get(cat)
        sa, sb = (x or {}).get("severity"), (y or {}).get("severity")
        if x is None:
            change = "appeared"
        elif y is None:
            change = "disappeared"
        else:
            ra, rb = _SEV_RANK.get(str(sa), 9), _SEV_RANK.get(str(sb), 9)
            change = "worse" if rb < ra else "better" if rb > ra else "unchanged"
        changes.append(BottleneckChange(category=cat, change=change, severity_a=sa, severity_b=sb,
                                        message_b=(y or x or {}).get("message")))
    order = {"appeared": 0, "worse": 1, "disappeared": 2, "better": 3, "unchanged": 4}
    return tuple(sorted(changes, key=lambda c: order[c.change]))


def _resolve(path: str | os.PathLike[str], what: str) -> tuple[ReportInfo | RunAnalysis, RunFrames | None]:
    p = Path(path)
    if p.is_file():
        return _read_report(p, what), None
    if p.is_dir():
        if (p / "ranks").is_dir() or (p / "run.json").is_file():
            return analyze_run(p), load_run(p)
        for candidate in (p / "report" / "report.json", p / "report.json"):
            if candidate.is_file():
                return _read_report(candidate, what), None
    raise invalid(what, "a run directory or a report.json file", str(path))


def _read_report(path: Path, what: str) -> ReportInfo:
    try:
        return read_json(path)
    except ConfigError as exc:
        raise invalid(what, "a torsh-tune report.json", f"{path} ({exc})") from None
    except (OSError, UnicodeDecodeError, ValueError, TypeError) as exc:
        raise invalid(what, "a readable torsh-tune report.json", f"{path} ({type(exc).__name__}: {exc})") from None


def _info(x: RunAnalysis | ReportInfo) -> ReportInfo:
    if isinstance(x, ReportInfo):
        return x
    if isinstance(x, RunAnalysis):
        return build_report_info(x)
    raise invalid("compared run", "a RunAnalysis or ReportInfo", type(x).__name__)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _worse_pct(m: MetricDelta) -> float:
    if m.delta_pct is None:
        return 0.0
    return m.delta_pct if m.better == "lower" else -m.delta_pct


def _fmt(name: str, v: float | None) -> str:
    if v is None:
        return "–"
    if name == "throughput_samples_s":
        return f"{v:,.1f} samples/s" if v < 100 else f"{v:,.0f} samples/s"
    return fmt_value(name, v)


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.1f} %"


def _signed_pct(v: float | None) -> str:
    return "–" if v is None else f"{v:+.1f} %"


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
