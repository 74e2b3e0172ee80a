"""Alerts: intervals where a metric stayed past a threshold for at least a duration.

The ToRSh guide's monitor fires an alert when a metric stays past its threshold for a
while (threshold + duration), not on a single sample. `find_alerts` replays that rule over
a run's records after the fact (or over what a live run has written so far):

| kind | metric | records | fires when |
|---|---|---|---|
| `low_gpu_utilization` | `gpu_util_pct` | system, per rank | below `alert_gpu_util_pct` |
| `low_cpu_utilization` | `cpu_pct` | system, per rank, runs without a GPU | below `alert_cpu_util_pct` |
| `memory_pressure` | `memory_pct` | system: GPU memory per rank, or the ranks' RSS summed per host | above `alert_memory_pct` |
| `communication_overhead` | `exposed_comm_pct` | steps: exposed comm / step time, mean across ranks | above `alert_comm_pct` |
| `step_time_spike` | `step_time_ratio` | steps: slowest rank's step, less the slowest rank's evaluation pass and checkpoint saves in it, / median step | above `alert_step_spike_factor` |

Each metric is a series of spans (a step from its start to its end; a system sample from
the previous sample to itself); consecutive spans past the threshold form an interval, and
an interval of at least `alert_duration_s` becomes an `Alert` (spikes fire at any length:
they are short by nature). Intervals of the same kind on different ranks that overlap in
time merge into one alert naming every rank. Warm-up steps are left out of the step-based
kinds (they are slow by design).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..config import ThresholdsConfig
from ..records import PLANNED_FIELDS
from ._load import RunFrames

__all__ = ["ALERT_KINDS", "ALERT_SEVERITIES", "Alert", "find_alerts"]

#: Alert kinds, in the order reports list them (see the module docstring).
ALERT_KINDS = ("memory_pressure", "low_gpu_utilization", "communication_overhead", "low_cpu_utilization",
               "step_time_spike")
#: Alert severities, most severe first.
ALERT_SEVERITIES = ("critical", "warning")


@dataclass(frozen=True, kw_only=True)
class Alert:
    """One fired alert: `metric` stayed past `threshold` from `start_s` to `end_s`.

    Times are seconds since the run's first record; steps are the steps running at the
    interval's start and end (None when no step record covers that time).
    """

    kind: str  # one of ALERT_KINDS
    severity: str  # one of ALERT_SEVERITIES
    metric: str  # the measured quantity, unit in its name
    comparison: str  # "below" or "above" the threshold
    threshold: float
    peak: float  # the worst value during the interval
    ranks: tuple[int, ...]
    start_s: float
    end_s: float
    duration_s: float
    start_step: int | None
    end_step: int | None
    num_samples: int  # samples (or steps) past the threshold
    message: str


@dataclass(frozen=True)
class _Rule:
    kind: str
    metric: str
    above: bool
    threshold: float
    critical: float
    min_duration_s: float
    what: str  # the message's subject
    unit: str = " %"


def find_alerts(frames: RunFrames, *, thresholds: ThresholdsConfig | None = None) -> tuple[Alert, ...]:
    """Every alert the run's records show, most severe first, then by start time.

    Args:
        frames: the run's records (`load_run`, or a live `RunStore.frames`).
        thresholds: the alert thresholds (`ThresholdsConfig.alert_*`); default ThresholdsConfig().

    Returns:
        The alerts; () for a run without records.

    Example:
        >>> alerts = find_alerts(load_run("torsh-runs/my-run"))  # doctest: +SKIP
        >>> [(a.kind, a.severity, round(a.duration_s)) for a in alerts]  # doctest: +SKIP
        [('communication_overhead', 'warning', 42)]
    """
    th = thresholds or ThresholdsConfig()
    t0 = _run_start(frames)
    if t0 is None:
        return ()
    per_step = _per_step(frames.steps)
    step_times = per_step[["t_start", "t_end"]]
    spans: list[tuple[_Rule, int, pd.DataFrame]] = []
    sysf = frames.system
    if not sysf.empty:
        has_gpu = bool(sysf["gpu_util_pct"].notna().any())
        gpu = _Rule("low_gpu_utilization", "gpu_util_pct", False, th.alert_gpu_util_pct, th.alert_gpu_util_pct / 2,
                    th.alert_duration_s, "GPU utilisation")
        cpu = _Rule("low_cpu_utilization", "cpu_pct", False, th.alert_cpu_util_pct, th.alert_cpu_util_pct / 2,
                    th.alert_duration_s, "process CPU utilisation (% of one core)")
        mem = _Rule("memory_pressure", "memory_pct", True, th.alert_memory_pct,
                    max(th.memory_critical_pct, th.alert_memory_pct), th.alert_duration_s,
                    "GPU memory used" if has_gpu else "host memory used by the ranks")
        for rank, df in sysf.groupby("rank", sort=True):
            df = df.sort_values("t", kind="stable")
            t = df["t"].to_numpy(dtype=float)
            start = _sample_starts(t)
            if has_gpu:
                spans.append((gpu, int(rank), _series(start, t, df["gpu_util_pct"])))
                used, total = df["gpu_mem_used_bytes"].astype(float), df["gpu_mem_total_bytes"].astype(float)
                spans.append((mem, int(rank), _series(start, t, 100.0 * used / total.where(total > 0))))
            else:
                spans.append((cpu, int(rank), _series(start, t, df["cpu_pct"])))
        if not has_gpu:
            spans += [(mem, rank, s) for rank, s in _host_memory(frames)]
    measured = per_step[~per_step["warmup"]]
    if not measured.empty:
        comm = _Rule("communication_overhead", "exposed_comm_pct", True, th.alert_comm_pct,
                     max(th.comm_critical_pct, th.alert_comm_pct), th.alert_duration_s,
                     "exposed communication (% of the step)")
        spans.append((comm, -1, _series(measured["t_start"], measured["t_end"], measured["exposed_pct"],
                                        measured.index)))
        median = float(measured["step_s"].median())
        if median > 0:
            spike = _Rule("step_time_spike", "step_time_ratio", True, th.alert_step_spike_factor,
                          2 * th.alert_step_spike_factor, 0.0, "step time / median step", "x")
            spans.append((spike, -1, _series(measured["t_start"], measured["t_end"], measured["step_s"] / median,
                                             measured.index)))
    ranks = tuple(int(r) for r in frames.ranks) or (0,)
    found: list[dict[str, Any]] = []
    for rule, rank, series in spans:
        for iv in _intervals(series, rule):
            found.append(dict(rule=rule, ranks={rank} if rank >= 0 else set(ranks), **iv))
    alerts = [_alert(iv, t0, step_times) for iv in _merge(found)]
    order = {kind: i for i, kind in enumerate(ALERT_KINDS)}
    return tuple(sorted(alerts, key=lambda a: (ALERT_SEVERITIES.index(a.severity), a.start_s, order[a.kind])))


# -- series ------------------------------------------------------------------------------


def _run_start(frames: RunFrames) -> float | None:
    starts = []
    if not frames.steps.empty:
        starts.append(float(frames.steps["t_start"].min()))
    if not frames.system.empty:
        starts.append(float(frames.system["t"].min()))
    starts = [s for s in starts if np.isfinite(s)]
    return min(starts) if starts else None


def _sample_starts(t: np.ndarray) -> np.ndarray:
    """A sample covers the time since the previous one (the first: one median interval)."""
    gaps = np.diff(t)
    first = float(np.median(gaps)) if len(gaps) else 0.0
    return np.concatenate([[t[0] - first], t[:-1]]) if len(t) else t


def _series(start: Any, end: Any, value: Any, step: Any = None) -> pd.DataFrame:
    """Spans (start, end] with a value; `step` names each span's step for step-based metrics."""
    df = pd.DataFrame({"start": np.asarray(start, dtype=float), "end": np.asarray(end, dtype=float),
                       "value": np.asarray(pd.to_numeric(pd.Series(np.asarray(value)), errors="coerce"),
                                           dtype=float)})
    if step is not None:
        df["step"] = np.asarray(step, dtype=np.int64)
    return df


def _host_memory(frames: RunFrames) -> list[tuple[int, pd.DataFrame]]:
    """Per host: the ranks' summed RSS (each rank's latest sample) as % of the host's memory.

    Ranks on one host share its memory, as `memory_stats` counts it; the series carries
    the host's lowest rank (the merge puts every rank of the host on the alert).
    """
    sysf = frames.system
    host_of = {r: str(frames.meta.get(r, {}).get("hostname", "localhost")) for r in sysf["rank"].unique()}
    out = []
    for host in sorted(set(host_of.values())):
        mine = sysf[sysf["rank"].map(host_of) == host]
        rss = mine.pivot_table(index="t", columns="rank", values="rss_bytes", aggfunc="last").sort_index().ffill()
        total = float(mine["mem_total_bytes"].max())
        if not np.isfinite(total) or total <= 0 or rss.empty:
            continue
        t = rss.index.to_numpy(dtype=float)
        # Until every rank has reported once, the sum undercounts: start where all have.
        full = rss.notna().all(axis=1).to_numpy()
        pct = np.where(full, 100.0 * rss.sum(axis=1).to_numpy() / total, np.nan)
        lowest = int(min(mine["rank"].unique()))
        out.append((lowest, _series(_sample_starts(t), t, pct)))
    return out


def _intervals(series: pd.DataFrame, rule: _Rule) -> list[dict[str, Any]]:
    """Runs of consecutive spans past the rule's threshold that last at least its duration."""
    v = series["value"].to_numpy(dtype=float)
    past = np.isfinite(v) & ((v > rule.threshold) if rule.above else (v < rule.threshold))
    if not past.any():
        return []
    edges = np.diff(np.concatenate([[0], past.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # [start, end) index runs
    s, e = series["start"].to_numpy(dtype=float), series["end"].to_numpy(dtype=float)
    steps = series["step"].to_numpy() if "step" in series.columns else None
    out = []
    for i, j in zip(starts, ends):
        duration = float(e[j - 1] - s[i])
        if duration < rule.min_duration_s:
            continue
        seg = v[i:j]
        out.append(dict(start=float(s[i]), end=float(e[j - 1]), n=int(j - i),
                        peak=float(seg.max() if rule.above else seg.min()),
                        first_step=int(steps[i]) if steps is not None else None,
                        last_step=int(steps[j - 1]) if steps is not None else None))
    return out


def _merge(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Same-kind intervals that overlap in time become one (ranks united, worst peak kept)."""
    merged: list[dict[str, Any]] = []
    for iv in sorted(found, key=lambda x: (x["rule"].kind, x["start"])):
        last = merged[-1] if merged else None
        if last is not None and last["rule"].kind == iv["rule"].kind and iv["start"] <= last["end"]:
            worse = max if iv["rule"].above else min
            last.update(end=max(last["end"], iv["end"]), n=last["n"] + iv["n"], peak=worse(last["peak"], iv["peak"]),
                        ranks=last["ranks"] | iv["ranks"], last_step=_later(last["last_step"], iv["last_step"]))
        else:
            merged.append(dict(iv, ranks=set(iv["ranks"])))
    return merged


def _later(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


def _per_step(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per step (index: step, sorted): its span over the ranks, slowest step_s, warm-up, exposed comm %.

    One groupby for everything (a 100 000-step, 8-rank live run re-runs this every refresh).
    """
    if steps.empty:
        return pd.DataFrame({"t_start": [], "t_end": [], "step_s": [], "warmup": pd.Series([], dtype=bool),
                             "exposed_pct": []})
    step_s = steps["step_s"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        exposed = np.where(step_s > 0, 100.0 * steps["exposed_comm_s"].to_numpy(dtype=float) / step_s, np.nan)
    if "comm_timed" in steps:  # a step whose DDP all-reduce went untimed: its exposure is unknown, not 0
        exposed = np.where(steps["comm_timed"].eq(False).to_numpy(), np.nan, exposed)
    # A step is a spike for what it trains: an evaluation pass or a checkpoint save in it is slow by design and a
    # finding of its own (host seconds; on the device clock the host's view of the same time). The ranks meet
    # at the step's collectives, so the slowest rank's pass is what every rank waited out: the step less it.
    aside = np.zeros(len(steps))
    for col in PLANNED_FIELDS.values():
        if col in steps:
            aside = aside + pd.to_numeric(steps[col], errors="coerce").fillna(0.0).to_numpy(dtype=float)
    df = pd.DataFrame({"step": steps["step"].to_numpy(), "t_start": steps["t_start"].to_numpy(dtype=float),
                       "t_end": steps["t_end"].to_numpy(dtype=float), "step_s": step_s, "aside_s": aside,
                       "warmup": steps["warmup"].to_numpy(dtype=bool), "exposed_pct": exposed})
    out = df.groupby("step", sort=True).agg(t_start=("t_start", "min"), t_end=("t_end", "max"),
                                             step_s=("step_s", "max"), aside_s=("aside_s", "max"),
                                             warmup=("warmup", "max"), exposed_pct=("exposed_pct", "mean"))
    out["step_s"] = (out["step_s"] - out.pop("aside_s")).clip(lower=0.0)
    return out


def _step_at(step_times: pd.DataFrame, t: float, *, start: bool) -> int | None:
    """The step running at Unix time t (None before the first step or after the last).

    A step's span is (t_start, t_end]; an interval's start at a step boundary belongs to
    the step that begins there, its end to the step that ends there.
    """
    if step_times.empty:
        return None
    ends = step_times["t_end"].to_numpy(dtype=float)
    i = int(np.searchsorted(ends, t, side="right" if start else "left"))
    if i >= len(ends) or (i == 0 and t < float(step_times["t_start"].iloc[0])):
        return None
    return int(step_times.index[i])


def _alert(iv: dict[str, Any], t0: float, step_times: pd.DataFrame) -> Alert:
    rule: _Rule = iv["rule"]
    critical = iv["peak"] > rule.critical if rule.above else iv["peak"] < rule.critical
    duration = iv["end"] - iv["start"]
    ranks = tuple(sorted(iv["ranks"]))
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    word = "above" if rule.above else "below"
    worst = "peak" if rule.above else "lowest"
    message = (f"{rule.what} stayed {word} {rule.threshold:g}{rule.unit} for {duration:.1f} s on {who} "
               f"({worst} {iv['peak']:.3g}{rule.unit}, {iv['n']} sample{'s' if iv['n'] != 1 else ''})")
    return Alert(
        kind=rule.kind, severity="critical" if critical else "warning", metric=rule.metric, comparison=word,
        threshold=float(rule.threshold), peak=float(iv["peak"]), ranks=ranks,
        start_s=float(iv["start"] - t0), end_s=float(iv["end"] - t0), duration_s=float(duration),
        start_step=iv["first_step"] if iv["first_step"] is not None else _step_at(step_times, iv["start"], start=True),
        end_step=iv["last_step"] if iv["last_step"] is not None else _step_at(step_times, iv["end"], start=False),
        num_samples=int(iv["n"]), message=message,
    )
