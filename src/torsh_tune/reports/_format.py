"""Number formatting shared by the Markdown and terminal reports (units come from key names)."""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "ADVICE_INPUT_LABELS",
    "PHASE_LABELS",
    "advice_common_reasons",
    "advice_headline",
    "advice_input_text",
    "comm_kinds",
    "kind_op",
    "fmt_origins",
    "fmt_gb",
    "fmt_bytes",
    "fmt_loss_deviation",
    "fmt_param",
    "fmt_pct",
    "fmt_s",
    "fmt_samples_s",
    "fmt_value",
    "gain_text",
    "migration_cell",
    "throughput_text",
]

#: Display names of the breakdown phases.
PHASE_LABELS = {
    "data": "data wait",
    "forward": "forward",
    "backward_compute": "backward (compute)",
    "exposed_comm": "exposed communication",
    "optimizer": "optimizer",
    "other": "other",
    "evaluation": "evaluation",  # the breakdown figure's parts of "other" (records.PLANNED_FIELDS)
    "checkpoint": "checkpoint saves",
    "loader": "DataLoader worker starts",
}


def fmt_s(seconds: float | None) -> str:
    """A duration in µs, ms or s with about 3 significant digits (never in e-notation)."""
    if seconds is None:
        return "–"
    a = abs(seconds)
    if a == 0:
        return "0 ms"
    # Thresholds just below the unit boundary so 0.9999 ms reads "1.00 ms", not "1000 µs".
    if a < 0.9995e-3:
        return f"{_sig3(seconds * 1e6)} µs"
    if a < 0.9995:
        return f"{_sig3(seconds * 1e3)} ms"
    return f"{_sig3(seconds)} s" if a < 1000 else f"{seconds:,.0f} s"


def _sig3(x: float) -> str:
    a = abs(x)
    return f"{x:.0f}" if a >= 99.95 else f"{x:.1f}" if a >= 9.995 else f"{x:.2f}"


def fmt_bytes(n: float | None) -> str:
    """Bytes in binary units (KiB, MiB, GiB)."""
    if n is None:
        return "–"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{_sig3(value)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_pct(pct: float | None) -> str:
    """A percentage with one decimal."""
    return "–" if pct is None else f"{pct:.1f} %"


def _fmt_number(x: float | int) -> str:
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, int):
        return f"{x:,}"
    if not math.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    return f"{x:.4g}"


def fmt_value(key: str, value: Any) -> str:
    """Format a measured value by the unit suffix of its key (_s, _bytes, _pct, _gbps, _w)."""
    if value is None:
        return "–"
    if isinstance(value, (list, tuple)):
        return ", ".join(fmt_value(key, v) for v in value) or "–"
    if isinstance(value, dict):
        # {rank: value} maps: the unit is the parent key's ("data_wait_pct_by_rank" -> pct).
        unit_key = key.split("_by_")[0]
        return ", ".join(f"{k}: {fmt_value(unit_key, v)}" for k, v in value.items()) or "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value).lower() if isinstance(value, bool) else str(value)
    parts = key.lower().split("_")
    # Statistics suffixes do not change the unit: cpu_pct_mean is a percentage.
    while len(parts) > 1 and parts[-1] in _STAT_SUFFIXES:
        parts.pop()
    unit = parts[-1]
    if "bytes" in parts:
        return fmt_bytes(value)
    if unit == "s" and parts != ["s"]:
        return fmt_s(float(value))
    if unit == "pct":
        return fmt_pct(float(value))
    if unit == "gbps":
        return f"{value:.3g} GB/s"
    if unit == "w" and parts != ["w"]:
        return f"{value:.3g} W"
    return _fmt_number(value)


_STAT_SUFFIXES = frozenset({"mean", "median", "max", "min", "p50", "p90", "p99", "std", "iqr"})


def gain_text(gain: dict[str, Any], median_step_s: float | None) -> str:
    """'5–12 % of the step (≈ 1.1–2.6 ms)' from an expected-gain dict; '5–12 % of the measured time' for a
    gain over rare, long steps (`GainRange.of`), which no median step holds."""
    low, high = gain.get("low_pct"), gain.get("high_pct")
    if low is None or high is None:
        return "–"
    same = _short_pct(low) == _short_pct(high)
    text = f"{_short_pct(low)} %" if same else f"{_short_pct(low)}–{_short_pct(high)} %"
    if gain.get("of") == "measured":
        return text + " of the measured time"
    text += " of the step"
    if median_step_s:
        lo_s, hi_s = low / 100 * median_step_s, high / 100 * median_step_s
        text += f" (≈ {fmt_s(lo_s)})" if same else f" (≈ {fmt_s(lo_s)}–{fmt_s(hi_s)})"
    return text


def _short_pct(x: float) -> str:
    if round(x, 1) == 0:
        return "0"
    return f"{x:.1f}" if abs(x) < 9.95 else f"{x:.0f}"


#: Display names of the strategy advisor's inputs (`ReportInfo.strategy_advice[*].inputs`).
ADVICE_INPUT_LABELS = {
    "num_params": "parameters",
    "param_bytes_per_param": "bytes per parameter",
    "optimizer_bytes_per_param": "optimizer state per parameter",
    "device_memory_bytes": "memory per rank",
    "gpus": "GPUs",
    "world_size": "ranks",
    "nnodes": "nodes",
    "link_gbps": "link",
    "reference_world_size": "LR tuned at (ranks)",
    "strategy": "this run's strategy",
}


def fmt_gb(n: float | None) -> str:
    """Bytes in decimal GB, as the advisor's reasons write them (0.21 GB, 12.6 GB, 80 GB)."""
    if n is None:
        return "–"
    gb = float(n) / 1e9
    return f"{gb:,.0f} GB" if gb >= 100 else f"{gb:.3g} GB"


def advice_input_text(item: dict[str, Any]) -> str:
    """The value of one advisor input for display ('13.1 M', '12.6 GB', 'unknown', ...)."""
    name, value = item.get("name"), item.get("value")
    if value is None:
        return "unknown"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if name == "num_params" and isinstance(value, (int, float)):
        return f"{value / 1e9:.3g} B" if value >= 1e9 else f"{value / 1e6:.3g} M" if value >= 1e6 else f"{value:,}"
    if name in ("param_bytes_per_param", "optimizer_bytes_per_param"):
        return f"{value} B"
    if name == "device_memory_bytes" and isinstance(value, (int, float)):
        return fmt_gb(value)
    if name == "link_gbps" and isinstance(value, (int, float)):
        return f"{value:.3g} Gbit/s"
    return _fmt_number(value) if isinstance(value, (int, float)) else str(value)


def advice_headline(rows: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str | None:
    """'You run X; the advisor ranks Y first (yours is #3).' from strategy_advice rows; None without rows."""
    if not rows:
        return None
    first = rows[0].get("name")
    inputs = rows[0].get("inputs") or []
    mine = next((i.get("value") for i in inputs if i.get("name") == "strategy"), None)
    current = next((r for r in rows if r.get("current")), None)
    if mine is None:
        return f"The advisor ranks {first} first."
    if current is not None and current.get("rank") == 1:
        return f"You run {mine}, the advisor's first choice for this model and cluster."
    where = f"yours is #{current.get('rank')}" if current is not None else "yours is not among its candidates"
    return f"You run {mine}; the advisor ranks {first} first ({where})."


def advice_common_reasons(rows: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> list[str]:
    """Reasons every candidate gives (the model-state arithmetic): shown once, above the candidates."""
    if len(rows) < 2:
        return []
    return [r for r in rows[0].get("reasons") or [] if all(r in (row.get("reasons") or []) for row in rows[1:])]


def fmt_samples_s(value: float | None, unit: str = "samples/s") -> str:
    """Throughput: '13,633 samples/s', '103.2 samples/s' (or another `unit`: 'tokens/s')."""
    if value is None:
        return "–"
    return f"{value:,.1f} {unit}" if abs(value) < 1000 else f"{value:,.0f} {unit}"


def throughput_text(summary: dict[str, Any]) -> str:
    """A run summary's throughput: samples/s, or steps/s when the samples per step are unknown."""
    t = summary.get("throughput_samples_s")
    if t is not None:
        return f"{t:,.1f} samples/s" if t < 100 else f"{t:,.0f} samples/s"
    steps = summary.get("steps_per_s")
    return "–" if not steps else f"{steps:,.2f} steps/s (samples unknown)"


def fmt_param(value: Any) -> str:
    """A search-space parameter value as the study's tables show it ('25', '3.13', 'fp16', 'true')."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def fmt_loss_deviation(deviation: float | None) -> str:
    """A relative loss deviation (0.000187) as a percentage with 3 significant digits ('0.0187 %')."""
    if deviation is None:
        return "–"
    return "0 %" if deviation == 0 else f"{100.0 * deviation:.3g} %"


def migration_cell(row: dict[str, Any], key: str) -> str:
    """A ToRSh migration check's "baseline", "best" or "change" cell, with its unit.

    `row` is one entry of the study summary's `migration` list (metric, unit, baseline, best,
    deviation_pct for the loss).
    """
    if key == "change":
        if row.get("deviation_pct") is not None:
            return f"{row['deviation_pct']:.2f} % off"
        b, c = row.get("baseline"), row.get("best")
        return "–" if b is None or c is None or b == 0 else f"{100.0 * (c / b - 1.0):+.1f} %"
    v = row.get(key)
    if v is None:
        return "–"
    unit = row.get("unit")
    if unit == "bytes":
        return f"{v / 2**20:,.1f} MiB"
    if unit == "s":
        return f"{v * 1e3:,.2f} ms"
    if unit in ("samples/s", "tokens/s"):
        return f"{v:,.1f} {unit}"
    return f"{v:.4g}"


def fmt_origins(kind: dict[str, Any]) -> str:
    """The functions that called torch.distributed for one `by_kind` row, or "–" (DDP's C++ reducer, old runs)."""
    return ", ".join(kind.get("origins") or []) or "–"


def kind_op(kind: dict[str, Any]) -> str:
    """A by-kind row's operation, "(async)" after it when most of its collectives were issued with async_op."""
    return f"{kind.get('op')} (async)" if (kind.get("async_share") or 0.0) > 0.5 else str(kind.get("op"))


def comm_kinds(communication: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's rows of communication by issuer and op (`analysis.kinds_beyond_ddp`)."""
    from ..analysis import kinds_beyond_ddp

    return kinds_beyond_ddp(communication.get("by_kind"))
