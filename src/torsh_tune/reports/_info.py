"""`ReportInfo`: everything a report or dashboard page shows, as plain JSON-ready data.

`build_report_info` turns a `RunAnalysis` into it once; the JSON, Markdown and terminal
writers (and the dashboard) only draw it. Every value inside is a JSON type (dicts with
string keys, lists, str, int, float, bool, None), so `ReportInfo.from_dict(info.to_dict())`
after a trip through `json` gives back an equal object.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import PurePath
from typing import Any

from ..analysis import PHASES, SELF_CHECK_METRICS, RunAnalysis
from ..errors import invalid
from ._format import fmt_s

__all__ = ["ALERT_COLUMNS", "REPORT_SCHEMA_VERSION", "ReportInfo", "alert_cells", "build_report_info",
           "self_check_clocks", "self_check_dicts", "self_check_table"]

#: Version of the ReportInfo/report.json layout; bumped on incompatible changes.
REPORT_SCHEMA_VERSION = 1

# run.json keys copied into ReportInfo.run (what was run, where, with which versions).
_RUN_KEYS = (
    "run_id",
    "script",
    "script_args",
    "argv",
    "started_at",
    "finished_at",
    "duration_s",
    "nnodes",
    "nproc_per_node",
)
_HARDWARE_KEYS = ("hostname", "platform", "cpu_count", "mem_total_bytes", "python_executable")


class JsonDocument:
    """`to_dict` / `to_json` of the report dataclasses (run report, study report): plain JSON types, strict JSON."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists, NaN and infinities become None)."""
        return _plain(dataclasses.asdict(self))  # type: ignore[call-overload]  # subclasses are dataclasses

    def to_json(self, *, indent: int | None = 2) -> str:
        """The document as strict JSON (no NaN or Infinity)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False) + "\n"


@dataclass(frozen=True, kw_only=True)
class ReportInfo(JsonDocument):
    """The data of one run's report, JSON-serialisable and schema-versioned.

    Attributes:
        schema_version: `REPORT_SCHEMA_VERSION` of the writer.
        generated_at: ISO-8601 UTC time the report was built.
        run: name, run_dir, status, world_size, backend, device, script, script_args,
            started_at, finished_at, duration_s, message (how it ended), rank_status
            (rank -> status), versions, hardware (hostname, platform, cpu_count,
            mem_total_bytes, ...).
        config: the RunConfig of the run as a dict ({} when unknown).
        summary: num_steps, median/p90/mean/std/iqr_step_s, samples_per_step,
            throughput_samples_s, iqr_pct and cv_pct (spread over steps) and
            rank_spread_pct (slowest vs fastest rank's median step); None without steps.
        breakdown: one row per phase (PHASES order): phase, time_s, pct.
        communication: the CommStats fields (per-rank dicts as lists of rows); None
            without communication records.
        stragglers: slowest_rank, last_share_pct, lateness_pct, basis, per_rank rows; with ranks on
            several hosts, host_clocks rows (host, reference, offset_s, source, applied, exchange_offset_s,
            exchange_rtt_s, collectives_offset_s, spread_s, jitter_s, collectives, disagree: each host's clock
            against rank 0's host's, from the start-up exchange and the collectives' completions).
        memory: device, capacity_bytes, peak_pct, per_rank rows (rank, peak_bytes).
        system: cpu_pct_mean, sys_cpu_pct_mean, gpu_util_pct_mean, gpu_power_w_mean.
        bottlenecks: category, severity, ranks, evidence, message; most severe first.
        recommendations: priority, category, title, rationale, config_patch,
            expected_gain (low_pct, high_pct, basis), effort, verified_by; priority order.
        strategy_advice: the strategy advisor's candidates for this run's model and
            cluster, best first: rank, name, kind, score, memory_per_rank_bytes/_gb, fits,
            config_patch, reasons, current (the run's own strategy) and inputs (name,
            value, source measured/detected/assumed, detail; the same in every row).
        alerts: intervals where a metric stayed past an alert threshold for at least the
            alert duration (`analysis.find_alerts`): kind, severity, metric, comparison,
            threshold, peak, ranks, start_s, end_s, duration_s, start_step, end_step,
            num_samples, message; most severe first.
        self_check: per deep-trace window, the always-on numbers beside the trace's for the
            same steps (`analysis.run_self_checks`): window, start_step, end_step, device,
            threshold_pp, per_rank and overall rows (always_on_* / trace_* values, *_diff_pp
            and step_diff_pct, the clocks of both sides), findings (metric, unit, diff,
            overall_diff, threshold, ranks, start_step, end_step, message).
        partial: the run did not end cleanly on every rank; numbers cover what was recorded.
        warnings: what was missing or odd while analysing.

    Example:
        >>> info = build_report_info(analyze_run("torsh-runs/my-run"))  # doctest: +SKIP
        >>> info.summary["median_step_s"], info.bottlenecks[0]["category"]  # doctest: +SKIP
        (0.0213, 'communication')
    """

    schema_version: int = REPORT_SCHEMA_VERSION
    generated_at: str
    run: dict[str, Any]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    breakdown: tuple[dict[str, Any], ...] = ()
    communication: dict[str, Any] | None = None
    stragglers: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None
    system: dict[str, Any] | None = None
    bottlenecks: tuple[dict[str, Any], ...] = ()
    recommendations: tuple[dict[str, Any], ...] = ()
    strategy_advice: tuple[dict[str, Any], ...] = ()
    alerts: tuple[dict[str, Any], ...] = ()
    self_check: tuple[dict[str, Any], ...] = ()
    partial: bool = False
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ReportInfo":
        """Rebuild a ReportInfo from `to_dict()` output (e.g. a parsed report.json).

        Raises:
            ConfigError: the document is not a report of this schema version.
        """
        if not isinstance(data, dict):
            raise invalid("report", "a JSON object", type(data).__name__)
        version = data.get("schema_version")
        if version != REPORT_SCHEMA_VERSION:
            raise invalid("report schema_version", f"{REPORT_SCHEMA_VERSION}", version)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise invalid("report key", f"one of {sorted(names)}", unknown[0])
        kwargs = dict(data)
        for name in ("breakdown", "bottlenecks", "recommendations", "strategy_advice", "alerts", "self_check",
                     "warnings"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> "ReportInfo":
        """Parse a report.json document."""
        return cls.from_dict(json.loads(text))


def build_report_info(analysis: RunAnalysis, *, generated_at: str | None = None) -> ReportInfo:
    """Collect what the reports show from an analysed run.

    Args:
        analysis: the result of `torsh_tune.analysis.analyze_run`.
        generated_at: ISO-8601 time stamp to record (default: now, UTC).

    Returns:
        The ReportInfo; its values are plain JSON types.

    Example:
        >>> from torsh_tune.analysis import analyze_run  # doctest: +SKIP
        >>> info = build_report_info(analyze_run("torsh-runs/my-run"))  # doctest: +SKIP
        >>> write_markdown(info, "report.md")  # doctest: +SKIP
    """
    a = analysis
    stamp = generated_at or datetime.now(timezone.utc).isoformat(timespec="seconds")
    return ReportInfo(
        generated_at=stamp,
        run=_plain(_run_section(a)),
        config=_plain(a.info.get("config") or {}),
        summary=_plain(_summary(a)),
        breakdown=tuple(_plain(_breakdown_rows(a))),
        communication=_plain(_communication(a)),
        stragglers=_plain(_stragglers(a)),
        memory=_plain(_memory(a)),
        system=_plain(dataclasses.asdict(a.system)) if a.system is not None else None,
        bottlenecks=tuple(_plain([dataclasses.asdict(b) for b in a.bottlenecks])),
        recommendations=tuple(_plain([dataclasses.asdict(r) for r in a.recommendations])),
        strategy_advice=tuple(_plain(list(a.advice))),
        alerts=tuple(_plain([dataclasses.asdict(x) for x in a.alerts])),
        self_check=self_check_dicts(a),
        partial=bool(a.partial),
        warnings=tuple(str(w) for w in a.warnings),
    )


#: Columns of an alerts table (Markdown, HTML, dashboard), in order; see `alert_cells`.
ALERT_COLUMNS = ("severity", "alert", "ranks", "steps", "when", "duration", "worst", "threshold")


def alert_cells(alert: dict[str, Any]) -> dict[str, str]:
    """One `ReportInfo.alerts` row as the display strings of `ALERT_COLUMNS` (and "message").

    Example:
        >>> alert_cells({"severity": "warning", "kind": "communication_overhead", "ranks": [0, 1],
        ...              "start_step": 5, "end_step": 29, "start_s": 1.6, "end_s": 4.2, "duration_s": 2.7,
        ...              "metric": "exposed_comm_pct", "comparison": "above", "peak": 46.4,
        ...              "threshold": 30.0, "message": "m"})["worst"]
        '46.4 %'
    """
    ranks = alert.get("ranks") or []
    first, last = alert.get("start_step"), alert.get("end_step")
    steps = ("–" if first is None and last is None
             else str(first) if first == last else f"{_dash(first)}–{_dash(last)}")
    unit = "x" if str(alert.get("metric", "")).endswith("_ratio") else " %"

    def num(v: Any) -> str:
        return "–" if v is None else f"{v:.3g}{unit}"

    return {
        "severity": str(alert.get("severity", "")),
        "alert": str(alert.get("kind", "")).replace("_", " "),
        "ranks": ", ".join(map(str, ranks)) or "–",
        "steps": steps,
        "when": f"{alert.get('start_s', 0.0):,.1f}–{alert.get('end_s', 0.0):,.1f} s",
        "duration": f"{alert.get('duration_s', 0.0):,.1f} s",
        "worst": num(alert.get("peak")),
        "threshold": f"{alert.get('comparison', '')} {num(alert.get('threshold'))}".strip(),
        "message": str(alert.get("message", "")),
    }


def self_check_dicts(a: RunAnalysis) -> tuple[dict[str, Any], ...]:
    """The run's self-checks as report.json holds them (`ReportInfo.self_check`: plain JSON types)."""
    return tuple(_plain([dataclasses.asdict(c) for c in a.self_check]))


def self_check_clocks(check: dict[str, Any]) -> str:
    """The clocks of one `ReportInfo.self_check` window, in words.

    Example:
        >>> text = self_check_clocks({"overall": {"always_on_clock": "device", "always_on_clock_recorded": True,
        ...                                       "trace_clock": "device", "trace_step_clock": "host"}})
        >>> print(text.replace("; ", "\\n"))
        always-on: device clock (as recorded)
        trace: device clock (GPU kernels), step time host clock (ProfilerStep# spans)
        >>> print(self_check_clocks({"overall": {"always_on_clock": "device", "always_on_clock_recorded": True,
        ...                                      "trace_clock": "device", "trace_step_clock": "device",
        ...                                      "trace_step_basis": "kernel spans per step"}}).split("; ")[1])
        trace: device clock (GPU kernels), step time device clock (the device span of the kernels each step launched)
    """
    o = check.get("overall") or {}
    recorded = "as recorded" if o.get("always_on_clock_recorded") else "assumed: the step records carry no clock"
    trace = o.get("trace_clock")
    what = {"device": "GPU kernels", "host": "CPU operators and gloo worker spans"}.get(str(trace), "mixed")
    step = o.get("trace_step_clock")
    step_what = {"kernel spans per step": "the device span of the kernels each step launched"}.get(
        str(o.get("trace_step_basis")), "ProfilerStep# spans" if step == "host" else "span / steps")
    events = o.get("trace_event_compute_pct")
    events = (f"; as the phases' CUDA events would read them, the edges where the device waited for the host "
              f"included: {_pct(events)}" if isinstance(events, (int, float)) and events == events else "")
    basis = {"phase kernel spans": "; trace compute: the spans of the kernels launched in each probed phase, "
                                   "idle gaps between them included, less exposed communication (kernels busy "
                                   f"{_pct(o.get('trace_kernel_compute_pct'))}{events})",
             "phase spans": "; trace compute: the probed phases less the communication the trace shows exposed "
                            f"in them (operators busy {_pct(o.get('trace_kernel_compute_pct'))} of the span, the "
                            "Python between them left out)",
             "kernels": "; trace compute: kernel busy time (the trace has no phase annotations: idle gaps "
                        "inside phases count for the always-on side only)"}.get(str(o.get("trace_compute_basis")), "")
    outside = o.get("trace_compute_outside_phases_pct")
    if isinstance(outside, (int, float)) and outside == outside:
        basis += (f"; compute outside forward, backward and the optimizer step (the always-on side's other): "
                  f"{_pct(outside)} of the trace's span")
    comm = {"DDP reducer window": "; always-on communication: DDP's reducer window per step (its first bucket's "
                                  "issue to the end of its finalize, the copies back into the gradients included)",
            "collectives + DDP reducer window": "; always-on communication: the collectives, and DDP's reducer "
                                                "window per step for its builtin all-reduce"}.get(
        str(o.get("always_on_comm_basis")), "")
    return (f"always-on: {o.get('always_on_clock')} clock ({recorded}){comm}; trace: {trace} clock ({what}), "
            f"step time {step} clock ({step_what}){basis}")


def _pct(value: Any) -> str:
    return f"{value:.1f} %" if isinstance(value, (int, float)) and value == value else "n/a"


def self_check_table(check: dict[str, Any], *, max_ranks: int | None = None,
                     compact: bool = False) -> tuple[list[str], list[list[str]]]:
    """One `ReportInfo.self_check` window as a display table: header, then rows (mean of ranks first).

    Each metric's cell is "always-on / trace (difference)"; the header names the clocks
    (always-on / trace). `compact` (terminals): units in the header, differences (pp; step
    time: %) bare. At most
    `max_ranks` rank rows (the largest differences when some are left out).

    Example:
        >>> row = {"rank": 0, "always_on_clock": "host", "trace_clock": "host", "trace_step_clock": "host",
        ...        "always_on_step_s": 0.0146, "trace_step_s": 0.0144, "step_diff_pct": 1.1,
        ...        "always_on_compute_pct": 34.7, "trace_compute_pct": 32.5, "compute_diff_pp": 2.2,
        ...        "always_on_comm_pct": 55.5, "trace_comm_pct": 76.4, "comm_diff_pp": -20.9,
        ...        "always_on_exposed_comm_pct": 49.9, "trace_exposed_comm_pct": 58.5, "exposed_comm_diff_pp": -8.6}
        >>> header, rows = self_check_table({"overall": {**row, "rank": None}, "per_rank": [row]})
        >>> header[3], rows[1][3]
        ('communication share (host / host)', '55.5 % / 76.4 % (-20.9 pp)')
        >>> header, rows = self_check_table({"overall": {**row, "rank": None}, "per_rank": [row]}, compact=True)
        >>> rows[1][3]
        '55.5/76.4 (-20.9)'
    """
    overall = check.get("overall") or {}
    ranks = list(check.get("per_rank") or [])
    if max_ranks is not None and len(ranks) > max_ranks:
        def worst(r: dict[str, Any]) -> float:
            return max(abs(r.get(f"{m}_diff_{u}") or 0.0) for m, _, u in SELF_CHECK_METRICS)
        ranks = sorted(sorted(ranks, key=worst, reverse=True)[:max_ranks], key=lambda r: r.get("rank") or 0)
    header = ["rank"]
    for metric, label, unit in SELF_CHECK_METRICS:
        trace_clock = overall.get("trace_step_clock" if metric == "step" else "trace_clock")
        clocks = f"{overall.get('always_on_clock')} / {trace_clock}"
        if compact:
            short = _SHORT_LABELS.get(metric, metric)
            header.append(f"{short} {'ms' if metric == 'step' else '%'}\n{clocks.replace(' / ', '/')}")
        else:
            header.append(f"{label} ({clocks})")
    rows = []
    for row in [overall, *ranks]:
        cells = ["mean" if row.get("rank") is None else str(row["rank"])]
        for metric, _, unit in SELF_CHECK_METRICS:
            ao_v = row.get("always_on_step_s" if metric == "step" else f"always_on_{metric}_pct")
            tr_v = row.get("trace_step_s" if metric == "step" else f"trace_{metric}_pct")
            diff = row.get(f"{metric}_diff_{unit}")
            diff_text = "–" if diff is None else f"{diff:+.1f}"
            if compact:
                num = _ms if metric == "step" else _num1
                cells.append(f"{num(ao_v)}/{num(tr_v)} ({diff_text})")
            else:
                num = fmt_s if metric == "step" else _pct1
                cells.append(f"{num(ao_v)} / {num(tr_v)} ({diff_text} {'pp' if unit == 'pp' else '%'})")
        rows.append(cells)
    return header, rows


_SHORT_LABELS = {"step": "step", "compute": "compute", "comm": "comm", "exposed_comm": "exposed"}


def _ms(v: Any) -> str:
    return "–" if v is None else f"{1e3 * v:.1f}" if 1e3 * v < 99.95 else f"{1e3 * v:,.0f}"


def _num1(v: Any) -> str:
    return "–" if v is None else f"{v:.1f}"


def _pct1(v: Any) -> str:
    return "–" if v is None else f"{v:.1f} %"


def _dash(v: Any) -> str:
    return "…" if v is None else str(v)


def _run_section(a: RunAnalysis) -> dict[str, Any]:
    info = a.info
    outcome = info.get("outcome") if isinstance(info.get("outcome"), dict) else {}
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    ddp_logging = a.comm.ddp_logging if a.comm is not None and a.comm.ddp_logging else {}
    backend = ddp_logging.get("backend_name") or (config.get("launch") or {}).get("backend")
    run: dict[str, Any] = {
        "name": a.name,
        "run_dir": a.run_dir,
        "status": a.status,
        "world_size": a.world_size,
        "backend": backend,
        "device": a.memory.device if a.memory is not None else None,
    }
    for key in _RUN_KEYS:
        run[key] = info.get(key)
    run["message"] = outcome.get("message") or None
    ranks = outcome.get("ranks")
    run["rank_status"] = {str(k): v for k, v in ranks.items()} if isinstance(ranks, dict) else {}
    run["versions"] = info.get("versions") if isinstance(info.get("versions"), dict) else {}
    run["hardware"] = {key: info.get(key) for key in _HARDWARE_KEYS}
    return run


def _summary(a: RunAnalysis) -> dict[str, Any] | None:
    st = a.steps
    if st is None:
        return None
    out = dataclasses.asdict(st)
    out["iqr_pct"] = 100 * st.iqr_step_s / st.median_step_s if st.median_step_s > 0 else None
    out["cv_pct"] = 100 * st.std_step_s / st.mean_step_s if st.mean_step_s > 0 else None
    medians = [r.get("median_step_s") for r in (a.stragglers.per_rank if a.stragglers else ())]
    medians = [m for m in medians if isinstance(m, (int, float)) and math.isfinite(m)]
    out["rank_spread_pct"] = (
        100 * (max(medians) - min(medians)) / min(medians) if len(medians) > 1 and min(medians) > 0 else None
    )
    return out


def _breakdown_rows(a: RunAnalysis) -> list[dict[str, Any]]:
    bd = a.breakdown
    if bd is None:
        return []
    # PHASES order first, then anything an analyzer added after the contract was written.
    phases = [p for p in PHASES if p in bd.phases_s] + [p for p in bd.phases_s if p not in PHASES]
    return [{"phase": p, "time_s": bd.phases_s.get(p), "pct": bd.phases_pct.get(p)} for p in phases]


def _communication(a: RunAnalysis) -> dict[str, Any] | None:
    if a.comm is None:
        return None
    out = dataclasses.asdict(a.comm)
    out["wait_by_rank"] = [{"rank": int(r), "wait_s": s} for r, s in sorted(out.pop("wait_by_rank_s", {}).items())]
    return out


def _stragglers(a: RunAnalysis) -> dict[str, Any] | None:
    if a.stragglers is None:
        return None
    # Ranks on several hosts: the lateness is read on one clock, each host's offset (`analysis._clocks`) beside it.
    return dataclasses.asdict(a.stragglers) | ({"host_clocks": list(a.host_clocks)} if a.host_clocks else {})


def _memory(a: RunAnalysis) -> dict[str, Any] | None:
    m = a.memory
    if m is None:
        return None
    return {
        "device": m.device,
        "capacity_bytes": m.capacity_bytes,
        "peak_pct": m.peak_pct,
        "per_rank": [{"rank": int(r), "peak_bytes": b} for r, b in sorted(m.peak_bytes_by_rank.items())],
    }


def _plain(value: Any) -> Any:
    """A JSON-type copy: string dict keys, lists for sequences, None for NaN/inf, numpy scalars unwrapped."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    if isinstance(value, PurePath):
        return str(value)
    item = getattr(value, "item", None)  # numpy/pandas scalars, without importing numpy here
    if callable(item):
        try:
            return _plain(item())
        except (TypeError, ValueError):
            pass
    return str(value)
