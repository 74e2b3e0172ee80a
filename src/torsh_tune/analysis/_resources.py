"""Resources: data-loading wait, memory against capacity, CPU and GPU utilisation."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ._types import MemoryStats, SystemStats

__all__ = ["data_wait_by_rank", "memory_stats", "system_stats"]


def data_wait_by_rank(steps: pd.DataFrame) -> dict[int, float]:
    """rank -> median data_s as % of the rank's median step_s."""
    out: dict[int, float] = {}
    for rank, mine in steps.groupby("rank"):
        step_s = float(pd.to_numeric(mine["step_s"], errors="coerce").median())
        data_s = float(pd.to_numeric(mine["data_s"], errors="coerce").fillna(0.0).median())
        out[int(rank)] = 100.0 * data_s / step_s if step_s > 0 else 0.0
    return out


def memory_stats(steps: pd.DataFrame, system: pd.DataFrame, meta: dict[int, dict[str, Any]]) -> MemoryStats | None:
    """Peak memory per rank against the device's (or the shared host's) capacity.

    On GPU each rank has its own device, so the worst rank's peak / device total counts.
    On CPU `peak_mem_bytes` is RSS and ranks on one host share its memory, so the ranks'
    peaks are summed per host (hostname from meta.json) and the fullest host counts.

    Args:
        steps: all step records (warm-up included: peaks happen there too).
        system: system records.
        meta: rank -> meta.json.

    Returns:
        MemoryStats, or None with neither step nor system records.
    """
    peaks: dict[int, int] = {}
    if not steps.empty:
        for rank, v in pd.to_numeric(steps["peak_mem_bytes"], errors="coerce").groupby(steps["rank"]).max().items():
            if pd.notna(v):
                peaks[int(rank)] = int(v)
    gpu_total = _col_max_by_rank(system, "gpu_mem_total_bytes")
    device = "cuda" if gpu_total or any(str(m.get("device", "")).startswith("cuda") for m in meta.values()) else "cpu"
    if device == "cuda":
        for rank, used in _col_max_by_rank(system, "gpu_mem_used_bytes").items():
            peaks[rank] = max(peaks.get(rank, 0), used)
    else:
        for rank, rss in _col_max_by_rank(system, "rss_bytes").items():
            peaks.setdefault(rank, rss)
    if not peaks:
        return None
    if device == "cuda":
        capacity = min(gpu_total.values()) if gpu_total else None
        peak_pct = max(100.0 * peaks[r] / gpu_total.get(r, capacity) for r in peaks) if capacity else None
        return MemoryStats(device=device, peak_bytes_by_rank=dict(sorted(peaks.items())),
                           capacity_bytes=capacity, peak_pct=peak_pct)
    host_total = _col_max_by_rank(system, "mem_total_bytes")
    capacity = max(host_total.values()) if host_total else None
    peak_pct = None
    if capacity:
        by_host: dict[str, int] = {}
        for rank, peak in peaks.items():
            host = str(meta.get(rank, {}).get("hostname", "localhost"))
            by_host[host] = by_host.get(host, 0) + peak
        peak_pct = 100.0 * max(by_host.values()) / capacity
    return MemoryStats(device=device, peak_bytes_by_rank=dict(sorted(peaks.items())),
                       capacity_bytes=capacity, peak_pct=peak_pct)


def system_stats(system: pd.DataFrame) -> SystemStats | None:
    """Means of the system sampler's records (None for a quantity never sampled)."""
    if system.empty:
        return None

    def mean(col: str) -> float | None:
        v = pd.to_numeric(system[col], errors="coerce").dropna()
        return float(v.mean()) if len(v) else None

    return SystemStats(
        cpu_pct_mean=mean("cpu_pct"),
        sys_cpu_pct_mean=mean("sys_cpu_pct"),
        gpu_util_pct_mean=mean("gpu_util_pct"),
        gpu_power_w_mean=mean("gpu_power_w"),
    )


def _col_max_by_rank(df: pd.DataFrame, col: str) -> dict[int, int]:
    if df.empty:
        return {}
    v = pd.to_numeric(df[col], errors="coerce")
    out = v.groupby(df["rank"]).max().dropna()
    return {int(r): int(x) for r, x in out.items() if x > 0}
