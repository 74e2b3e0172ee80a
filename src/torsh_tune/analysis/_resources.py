"""Resources: data-loading wait, memory against capacity, CPU (and the cores left idle) and GPU
utilisation. The DataLoader workers these call for are sized in `_workers` (no pandas there)."""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import pandas as pd

from ..records import PLANNED_FIELDS
from ._types import MemoryStats, SystemStats

__all__ = ["GPU_UTIL_CAVEAT", "IdleCores", "checkpoint_saves", "data_wait_by_rank", "evaluation_passes", "idle_cores",
           "loader_restarts", "measured_windows", "memory_stats", "system_stats"]


def data_wait_by_rank(steps: pd.DataFrame) -> dict[int, float]:
    """rank -> median data_s as % of the rank's median step_s."""
    out: dict[int, float] = {}
    for rank, mine in steps.groupby("rank"):
        step_s = float(pd.to_numeric(mine["step_s"], errors="coerce").median())
        data_s = float(pd.to_numeric(mine["data_s"], errors="coerce").fillna(0.0).median())
        out[int(rank)] = 100.0 * data_s / step_s if step_s > 0 else 0.0
    return out


def checkpoint_saves(steps: pd.DataFrame) -> dict[str, Any] | None:
    """The measured steps' checkpoint saves (`StepRecord.checkpoint_s`), as a share of their time.

    A save is rare and long, so the median step never shows it: its cost is its total over the
    steps' total (per rank, the rank that lost most). Saves in warm-up are left out with the steps.

    Returns:
        None without a save; else checkpoint_pct (the worst rank's), checkpoint_pct_by_rank, saves (steps
        with a save on that rank), median_save_s, every_steps (median gap between them, None for one),
        checkpoint_s (that rank's total) and measured_s (its steps' total).

    Example:
        >>> steps = pd.DataFrame({"rank": [0] * 4, "step": [1, 2, 3, 4], "step_s": [0.1, 0.5, 0.1, 0.5],
        ...                       "checkpoint_s": [None, 0.4, None, 0.4]})
        >>> c = checkpoint_saves(steps)
        >>> round(c["checkpoint_pct"], 1), c["saves"], c["every_steps"]
        (66.7, 2, 2)
    """
    share = _rare_share(steps, "checkpoint_s")
    if share is None:
        return None
    return {"checkpoint_pct": share.pct, "checkpoint_pct_by_rank": share.pct_by_rank, "rank": share.rank,
            "saves": share.count, "median_save_s": share.median_s, "every_steps": share.every_steps,
            "checkpoint_s": share.total_s, "measured_s": share.measured_s}


def evaluation_passes(steps: pd.DataFrame, comm: pd.DataFrame | None = None) -> dict[str, Any] | None:
    """The measured steps' evaluation passes (`StepRecord.eval_s`), as a share of their time.

    Like a checkpoint save, an evaluation between steps is rare and long: the median step never
    shows it, so its cost is its total over the steps' total, per rank (the rank that lost most).
    On the device clock the steps' total is the host's (`host_step_s`), the clock of `eval_s`.
    The collectives a pass issued (comm records with phase "evaluation": a metric's all-reduce,
    the gathers after the loop) are counted per pass on that rank.

    Returns:
        None without an evaluation; else eval_pct (the worst rank's), eval_pct_by_rank, rank, passes (steps
        with one on that rank), median_pass_s, every_steps (median gap, None for one), batches_per_pass and
        samples_per_pass (medians), eval_s (that rank's total), measured_s (its steps' total), and with comm
        records collectives_per_pass (median) and collective_kinds ("issuer op", most calls first).

    Example:
        >>> steps = pd.DataFrame({"rank": [0] * 4, "step": [1, 2, 3, 4], "step_s": [0.1, 0.3, 0.1, 0.3],
        ...                       "eval_s": [None, 0.2, None, 0.2], "eval_batches": [None, 4, None, 4],
        ...                       "eval_samples": [None, 64, None, 64]})
        >>> e = evaluation_passes(steps)
        >>> e["eval_pct"], e["passes"], e["every_steps"], e["batches_per_pass"]
        (50.0, 2, 2, 4)
    """
    share = _rare_share(steps, "eval_s")
    if share is None:
        return None
    mine = steps.loc[share.index]

    def per_pass(col: str) -> int | None:
        values = pd.to_numeric(mine[col], errors="coerce").dropna() if col in mine else pd.Series(dtype=float)
        return int(values.median()) if not values.empty else None

    out = {"eval_pct": share.pct, "eval_pct_by_rank": share.pct_by_rank, "rank": share.rank,
           "passes": share.count, "median_pass_s": share.median_s, "every_steps": share.every_steps,
           "batches_per_pass": per_pass("eval_batches"), "samples_per_pass": per_pass("eval_samples"),
           "eval_s": share.total_s, "measured_s": share.measured_s}
    if comm is not None and not comm.empty and "phase" in comm:
        theirs = comm[comm["phase"].eq("evaluation") & comm["rank"].eq(share.rank)
                      & comm["step"].isin(set(mine["step"]))]
        counts = theirs.groupby("step").size().reindex(sorted(set(mine["step"])), fill_value=0)
        kinds = (theirs["issuer"].fillna("unrecorded").astype(str) + " " + theirs["collective"].astype(str)
                 if not theirs.empty else pd.Series(dtype=str))
        out["collectives_per_pass"] = int(counts.median())
        out["collective_kinds"] = [str(k) for k in kinds.value_counts(sort=True).index]
    return out


def loader_restarts(steps: pd.DataFrame) -> dict[str, Any] | None:
    """The measured steps in which a DataLoader started its worker processes again, and what they cost.

    A loader without persistent workers shuts its workers down at the end of every epoch and starts
    new ones with the next epoch's iterator (`StepRecord.loader_starts`). The step that does it is
    slow for more than the start itself (`loader_restart_s`): the new workers' first batch, and on a
    busy host their start-up competing with the step for cores. Its cost is what it takes beyond the
    rank's usual step (the median of its steps with nothing planned in them), its evaluation pass and
    checkpoint saves left out; per rank, the rank that lost most. The run's first iterator is no
    restart: it starts in the warm-up.

    Returns:
        None without a restart in the measured steps; else restart_pct (the worst rank's excess over its
        measured time), restart_pct_by_rank, rank, restarts (its steps with one), workers (worker processes
        per restart, median), every_steps (median gap between restarts, None for one), median_restart_step_s
        (those steps less their planned parts), usual_step_s, median_start_s (`loader_restart_s`),
        first_batch_s (the restart steps' median data wait), excess_s (total), first_batch_pct (their data
        wait over the measured time, at most the excess) and measured_s.

    Example:
        >>> steps = pd.DataFrame({"rank": [0] * 6, "step": range(1, 7), "step_s": [0.1, 0.1, 0.4, 0.1, 0.1, 0.4],
        ...                       "data_s": [0.0, 0.0, 0.1, 0.0, 0.0, 0.1],
        ...                       "loader_restart_s": [None, None, 0.05, None, None, 0.05],
        ...                       "loader_starts": [None, None, 2, None, None, 2]})
        >>> r = loader_restarts(steps)
        >>> round(r["restart_pct"], 1), r["restarts"], r["every_steps"], r["workers"], round(r["first_batch_pct"], 1)
        (50.0, 2, 3, 2, 16.7)
    """
    if steps.empty or "loader_starts" not in steps:
        return None
    starts = pd.to_numeric(steps["loader_starts"], errors="coerce").fillna(0.0)
    if not (starts > 0).any():
        return None
    step_s = _host_step_s(steps).fillna(0.0)
    aside = pd.Series(0.0, index=steps.index)  # an evaluation or a save in the same step: findings of their own
    planned = pd.Series(False, index=steps.index)
    for col in PLANNED_FIELDS.values():
        if col in steps:
            spent = pd.to_numeric(steps[col], errors="coerce").fillna(0.0)
            planned |= spent > 0
            if col != "loader_restart_s":
                aside += spent
    data_s = pd.to_numeric(steps["data_s"], errors="coerce").fillna(0.0) if "data_s" in steps else aside * 0.0
    by_rank: dict[int, dict[str, Any]] = {}
    for rank, idx in steps.groupby("rank").groups.items():
        usual = step_s[idx][~planned[idx]]
        at = idx[(starts[idx] > 0).to_numpy()]
        if usual.empty or at.empty:
            continue
        usual_s = float(usual.median())
        own = (step_s[at] - aside[at]).clip(lower=0.0)
        excess = (own - usual_s).clip(lower=0.0)
        measured_s = float(step_s[idx].sum())
        by_rank[int(rank)] = {"at": at, "own": own, "excess": excess, "usual_s": usual_s, "measured_s": measured_s,
                              "pct": 100.0 * float(excess.sum()) / measured_s if measured_s > 0 else 0.0}
    if not by_rank:
        return None
    worst = max(by_rank, key=lambda r: by_rank[r]["pct"])
    w = by_rank[worst]
    at = sorted(int(s) for s in steps.loc[w["at"], "step"])
    first = data_s[w["at"]].clip(upper=w["excess"])  # the new workers' first batch, within the excess
    return {
        "restart_pct": w["pct"], "restart_pct_by_rank": {r: round(v["pct"], 2) for r, v in sorted(by_rank.items())},
        "rank": worst, "restarts": len(at), "workers": int(starts[w["at"]].median()),
        "every_steps": _every(at),
        "median_restart_step_s": float(w["own"].median()), "usual_step_s": w["usual_s"],
        "median_start_s": float(pd.to_numeric(steps.loc[w["at"], "loader_restart_s"], errors="coerce").fillna(0.0)
                                .median()) if "loader_restart_s" in steps else 0.0,
        "first_batch_s": float(data_s[w["at"]].median()), "excess_s": float(w["excess"].sum()),
        "first_batch_pct": 100.0 * float(first.sum()) / w["measured_s"] if w["measured_s"] > 0 else 0.0,
        "measured_s": w["measured_s"],
    }


class _RareShare(NamedTuple):
    pct: float  # the worst rank's total over its measured time, %
    pct_by_rank: dict[int, float]
    rank: int
    count: int  # that rank's steps with some
    median_s: float  # their median
    every_steps: int | None  # median gap between them
    total_s: float
    measured_s: float
    index: pd.Index  # those steps' rows


def _rare_share(steps: pd.DataFrame, column: str) -> _RareShare | None:
    """Host seconds in `column` (a rare, long part of some steps) over the measured time, per rank."""
    if steps.empty or column not in steps:
        return None
    spent = pd.to_numeric(steps[column], errors="coerce").fillna(0.0)
    if not (spent > 0).any():
        return None
    step_s = _host_step_s(steps)
    by_rank: dict[int, tuple[float, float]] = {}
    for rank, mine in steps.assign(_spent=spent, _step=step_s.fillna(0.0)).groupby("rank"):
        by_rank[int(rank)] = (float(mine["_spent"].sum()), float(mine["_step"].sum()))
    pct = {r: 100.0 * s / t if t > 0 else 0.0 for r, (s, t) in by_rank.items()}
    worst = max(pct, key=lambda r: pct[r])
    mine = steps[(steps["rank"] == worst) & (spent > 0)]
    at = sorted(int(s) for s in mine["step"])
    return _RareShare(pct=pct[worst], pct_by_rank={r: round(v, 2) for r, v in sorted(pct.items())}, rank=worst,
                      count=len(at), median_s=float(spent[mine.index].median()), every_steps=_every(at),
                      total_s=by_rank[worst][0], measured_s=by_rank[worst][1], index=mine.index)


def _host_step_s(steps: pd.DataFrame) -> pd.Series:
    """Each step's time on the host: device-clock records keep it in `host_step_s`, the clock of the planned fields."""
    step_s = pd.to_numeric(steps["step_s"], errors="coerce")
    if "host_step_s" in steps:
        step_s = pd.to_numeric(steps["host_step_s"], errors="coerce").fillna(step_s)
    return step_s


def _every(at: Sequence[int]) -> int | None:
    """The median gap between sorted steps (None for fewer than two)."""
    gaps = [b - a for a, b in zip(at, at[1:])]
    return int(pd.Series(gaps).median()) if gaps else None


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


# NVML's utilisation is "a kernel was resident during the sample period", and a kernel
# waiting inside a collective (NCCL spins on the GPU until its peers arrive) is resident.
GPU_UTIL_CAVEAT = (
    "gpu_util_pct is NVML's share of time a kernel was running; a kernel waiting in a collective "
    "(a spinning NCCL kernel) counts as busy, so it bounds useful GPU work from above"
)


def system_stats(
    system: pd.DataFrame,
    steps: pd.DataFrame | None = None,
    *,
    meta: dict[int, dict[str, Any]] | None = None,
    warnings: list[str] | None = None,
) -> SystemStats | None:
    """Means of the system sampler's records over the measured window, weighted by time.

    The window of a rank runs from the `t_start` of its first measured (non-warm-up) step
    to the `t_end` of its last step, so start-up (imports, NCCL init, compile) and teardown
    do not dilute the utilisation. Each sample weighs the seconds of the window its interval
    (`t_since`, `t`] covers (`_in_measured_window`). Only samples of ranks with step records count.

    `gpu_util_pct_mean` carries `GPU_UTIL_CAVEAT`: NVML counts a kernel waiting in a
    collective as busy, so a communication-bound run can look compute-busy.

    Args:
        system: system records.
        steps: all step records (warm-up included, `warmup` marks them); None or empty
            means no window is known and every sample counts.
        meta: rank -> meta.json (`hostname`: which ranks share a host's cores, see `idle_cores`).
        warnings: where to say when the window could not be used (appended to).

    Returns:
        SystemStats, or None without system records.

    Example:
        >>> import pandas as pd
        >>> system = pd.DataFrame({"rank": [0, 0, 0], "t": [0.0, 5.0, 9.0], "t_since": [-4.0, 0.0, 5.0],
        ...                        "cpu_pct": [0.0, 80.0, 20.0]})
        >>> steps = pd.DataFrame({"rank": [0, 0], "step": [0, 1], "t_start": [2.0, 4.0],
        ...                       "t_end": [4.0, 6.0], "warmup": [True, False]})
        >>> system_stats(system, steps).cpu_pct_mean  # (4, 5] at 80 %, (5, 6] at 20 %
        50.0
    """
    if system.empty:
        return None
    notes: list[str] = []
    inside = _in_measured_window(system, steps, notes)
    if warnings is not None:
        warnings.extend(notes)

    def mean(col: str) -> float | None:  # over the window's time: each sample weighs the seconds it covers
        if col not in inside.columns:
            return None
        v = pd.to_numeric(inside[col], errors="coerce")
        w = inside["weight"][v.notna()]
        return float((v[v.notna()] * w).sum() / w.sum()) if len(w) and w.sum() > 0 else None

    idle = idle_cores(inside, meta or {})
    return SystemStats(
        cpu_pct_mean=mean("cpu_pct"),
        sys_cpu_pct_mean=mean("sys_cpu_pct"),
        gpu_util_pct_mean=mean("gpu_util_pct"),
        gpu_power_w_mean=mean("gpu_power_w"),
        cpu_cores=idle.cores if idle else None,
        idle_cores_mean=idle.idle if idle else None,
        idle_cores_per_rank=idle.per_rank if idle else None,
        idle_cores_basis=idle.basis if idle else None,
    )


class IdleCores(NamedTuple):
    """The idle cores of the tightest group of ranks sharing one affinity mask (`idle_cores`)."""

    cores: int  # cores in the mask
    idle: float  # of those, idle on average
    per_rank: float  # idle / ranks sharing the mask
    basis: str


def idle_cores(system: pd.DataFrame, meta: dict[int, dict[str, Any]]) -> IdleCores | None:
    """The idle cores each rank can draw on, from the sampler's `cpu_cores` and `idle_cores`.

    Each sample says how many cores the rank's affinity mask holds and how many of them were
    idle since the previous sample. torsh-tune's torchrun binds no rank to cores, so the ranks
    of one host inherit one mask (the launcher's: every core, or those of a `taskset`, a cgroup
    cpuset or a Slurm allocation) and share its idle cores: each rank's share is the mask's
    mean idle cores divided by the ranks of that host (hostname from meta.json) with a mask of
    that size; masks of different sizes cannot be one mask, so each size is a group of its own.
    Every rank gets the same `num_workers` and the slowest rank sets the step, so the group
    with the fewest idle cores per rank counts.

    Args:
        system: system records (those of the measured window; a `weight` column, the seconds each
            covers, weighs their mean).
        meta: rank -> meta.json.

    Returns:
        IdleCores, or None when no sample recorded them (runs before the sampler did).

    Example:
        >>> import pandas as pd
        >>> system = pd.DataFrame({"rank": [0, 0, 1], "cpu_cores": [4, 4, 4], "idle_cores": [1.0, 2.0, 1.5]})
        >>> idle_cores(system, {0: {"hostname": "a"}, 1: {"hostname": "a"}}).per_rank
        0.75
    """
    if system.empty or not {"cpu_cores", "idle_cores"} <= set(system.columns):
        return None
    weight = system["weight"] if "weight" in system.columns else 1.0  # seconds each sample covers
    df = pd.DataFrame({"rank": system["rank"],
                       "cores": pd.to_numeric(system["cpu_cores"], errors="coerce"),
                       "idle": pd.to_numeric(system["idle_cores"], errors="coerce"),
                       "weight": weight}).dropna()
    df = df[(df["cores"] > 0) & (df["weight"] > 0)]
    if df.empty:
        return None
    per_rank = df.assign(weighted=df["idle"] * df["weight"]).groupby("rank").agg(
        cores=("cores", "median"), weighted=("weighted", "sum"), weight=("weight", "sum"))
    per_rank["idle"] = per_rank["weighted"] / per_rank["weight"]
    groups: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for rank, row in per_rank.iterrows():
        host = str(meta.get(int(rank), {}).get("hostname", "localhost"))
        groups.setdefault((host, int(round(row["cores"]))), []).append((int(rank), float(row["idle"])))
    shares = {key: sum(idle for _, idle in ranks) / len(ranks) ** 2 for key, ranks in groups.items()}
    (host, cores), share = min(shares.items(), key=lambda item: item[1])
    ranks = groups[(host, cores)]
    idle = sum(v for _, v in ranks) / len(ranks)
    basis = (f"idle cores per rank = {idle:.2f} idle of the {cores} cores that rank(s) "
             f"{', '.join(str(r) for r, _ in ranks)} on {host} may run on (their affinity mask, measured) / "
             f"{len(ranks)} rank{'s' if len(ranks) > 1 else ''} sharing them = {share:.2f}")
    if len(groups) > 1:
        basis += f" (the fewest of {len(groups)} hosts or core sets)"
    return IdleCores(cores=cores, idle=round(idle, 3), per_rank=round(share, 3), basis=basis)


def measured_windows(steps: pd.DataFrame | None) -> tuple[dict[int, tuple[float, float]], bool]:
    """rank -> (t_start of its first measured step, t_end of its last step), and whether
    warm-up steps had to stand in (every step of the run is a warm-up step)."""
    if steps is None or steps.empty or not {"rank", "t_start", "t_end"} <= set(steps.columns):
        return {}, False
    df = steps.assign(t_start=pd.to_numeric(steps["t_start"], errors="coerce"),
                      t_end=pd.to_numeric(steps["t_end"], errors="coerce"))
    df = df[df["t_start"].notna() & df["t_end"].notna()]
    if df.empty:
        return {}, False
    warm = df["warmup"].fillna(False).astype(bool) if "warmup" in df.columns else pd.Series(False, index=df.index)
    only_warmup = bool(warm.all())
    out: dict[int, tuple[float, float]] = {}
    for rank, mine in df.groupby("rank"):
        mine_warm = warm.loc[mine.index]
        first = mine[~mine_warm] if not only_warmup else mine
        if first.empty:  # this rank never left warm-up while others did: no measured window
            continue
        t0 = float(first["t_start"].min())
        t1 = float(mine["t_end"].max())
        if t1 > t0:
            out[int(rank)] = (t0, t1)
    return out, only_warmup


def _in_measured_window(system: pd.DataFrame, steps: pd.DataFrame | None, notes: list[str]) -> pd.DataFrame:
    """The samples covering each rank's measured window, with a `weight` column: the seconds of
    the window each covers.

    A sample's CPU numbers are averages over (`t_since`, `t`]; its weight is that interval's
    overlap with the window, so a sample mostly over start-up (one taken as the window opens)
    weighs almost nothing, and a window shorter than the sampling interval still has the sample
    that covers it. Records without `t_since` (older runs) cover the time since the rank's previous
    sample, the first one a median spacing.
    """
    windows, only_warmup = measured_windows(steps)
    if not windows:
        notes.append("system statistics use every system sample (start-up and teardown included): "
                     "no step records give a measured window")
        return system.assign(weight=1.0)
    if not system.index.is_unique:  # the weights are placed by label
        system = system.reset_index(drop=True)
    t = pd.to_numeric(system["t"], errors="coerce")
    since = (pd.to_numeric(system["t_since"], errors="coerce") if "t_since" in system.columns
             else pd.Series(float("nan"), index=system.index))
    weight = pd.Series(0.0, index=system.index)
    for rank, (t0, t1) in windows.items():
        mine = (system["rank"] == rank) & t.notna()
        if not mine.any():
            continue
        ts = t[mine].sort_values()
        spacing = float(ts.diff().median()) if len(ts) > 1 else 0.0
        start = since[ts.index].fillna(ts.shift(1)).fillna(ts - spacing)
        overlap = (ts.clip(upper=t1) - start.clip(lower=t0)).clip(lower=0.0)
        # A lone sample of unknown span (an older record) inside the window: taken to cover the window.
        point = (start >= ts) & (ts >= t0) & (ts <= t1)
        weight[ts.index] = overlap.where(~point, t1 - t0)
    keep = weight > 0
    if not keep.any():
        notes.append(f"system statistics use every system sample (start-up and teardown included): "
                     f"none of the {len(system)} samples covers the measured steps "
                     f"(a run shorter than profiler.system_interval_s?)")
        return system.assign(weight=1.0)
    if only_warmup:
        notes.append("system statistics cover the warm-up steps: every step record is a warm-up step")
    outside = sorted(set(system["rank"].dropna().astype(int)) - set(windows))
    if outside:
        notes.append(f"system samples of rank(s) {outside} left out of system statistics: "
                     "no measured step records on them")
    return system[keep].assign(weight=weight[keep])


def _col_max_by_rank(df: pd.DataFrame, col: str) -> dict[int, int]:
    if df.empty:
        return {}
    v = pd.to_numeric(df[col], errors="coerce")
    out = v.groupby(df["rank"]).max().dropna()
    return {int(r): int(x) for r, x in out.items() if x > 0}
