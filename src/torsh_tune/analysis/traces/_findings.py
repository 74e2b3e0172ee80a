"""Trace findings: `Bottleneck` and `Recommendation` objects from a `TraceAnalysis`.

The same types, severity scale and ordering as the always-on tier (`diagnose`,
`recommend`), with evidence taken from the trace tables. Shares are % of the profiled span
(the temporal breakdown's base), averaged over ranks like the summary's ``idle_pct``.
Idle causes have no thresholds of their own: like a pipeline bubble they are device time
that computes nothing, so they reuse the exposed-communication ones (medium above half of
``comm_high_pct``). Gains are bounded by the share the finding measured, and by the step
what-ifs where the trace has ProfilerSteps; the low end is 0 where the trace cannot tell
how much of that share a change recovers.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import ThresholdsConfig
from .._bottlenecks import _LAST_SHARE_MIN_PCT, _level
from .._recommend import _gain
from .._types import SEVERITIES, Bottleneck, GainRange, Recommendation
from ._table import Table

if TYPE_CHECKING:  # _analyze calls trace_findings
    from ._analyze import TraceAnalysis

__all__ = ["trace_findings"]

_Found = tuple[Bottleneck, float]  # (bottleneck, share of the span it costs, %)


def trace_findings(analysis: TraceAnalysis, thresholds: ThresholdsConfig | None = None
                   ) -> tuple[tuple[Bottleneck, ...], tuple[Recommendation, ...]]:
    """Bottlenecks and recommendations of a trace analysis.

    Args:
        analysis: `analyze_traces` output (its tables and summary; findings fields ignored).
        thresholds: rule thresholds; ThresholdsConfig() by default.

    Returns:
        (bottlenecks most severe first, ties by larger share; recommendations priority 1..n).

    Example:
        >>> a = analyze_traces("tests/data/traces/hta-nccl-2rank-rank0")  # doctest: +SKIP
        >>> trace_findings(a)[0][0].message  # doctest: +SKIP
        'the GPU idles 77 % of the window waiting for the host to launch kernels ...'
    """
    th = thresholds or ThresholdsConfig()
    per_rank = _per_rank(analysis)
    if per_rank.empty:
        return (), ()
    found: list[_Found] = []
    straggler = _straggler(analysis, per_rank, th)
    if straggler:
        found.append(straggler)
    found += _communication(analysis, per_rank, th, straggler_found=straggler is not None)
    found += _idle(analysis, per_rank, th, "host_wait")
    found += _idle(analysis, per_rank, th, "sync")
    found.sort(key=lambda item: (SEVERITIES.index(item[0].severity), -item[1]))
    bottlenecks = tuple(b for b, _ in found)
    return bottlenecks, _recommend(bottlenecks)


def _per_rank(a: TraceAnalysis) -> Table:
    """One row per rank (sorted): span_s, device, idle causes (s), exposed comm (s, %) and peer_wait_s."""
    bd, causes, ov = a.tables["breakdown"], a.tables["idle_causes"], a.tables["overlap"]
    ranks = np.intersect1d(np.intersect1d(bd["rank"], causes["rank"]), ov["rank"]).astype(np.int64)
    if ranks.size == 0:
        return Table()

    def at(t: Table) -> np.ndarray:  # rows of `t` in `ranks` order
        order = np.argsort(t["rank"], kind="stable")
        return order[np.searchsorted(t["rank"][order], ranks)]

    i, j, k = at(bd), at(causes), at(ov)
    cols = {"rank": ranks, "device": bd["device"][i], "span_s": bd["span_s"][i]}
    cols.update({c: causes[c][j] for c in causes.columns if c not in ("rank", "device")})
    cols.update({c: ov[c][k] for c in ("exposed_comm_s", "exposed_comm_pct")})
    df = Table(cols)
    return df[df["span_s"] > 0]


def _span_pct(df: Table, col: str) -> np.ndarray:
    return 100.0 * df[col] / df["span_s"]


def _by_rank(df: Table, values: np.ndarray, digits: int | None = 2) -> dict[int, float]:
    return {int(r): (round(float(v), digits) if digits is not None else float(v))
            for r, v in zip(df["rank"].tolist(), values.tolist())}


def _involved(df: Table, share_by_rank: np.ndarray, above: float) -> tuple[int, ...]:
    """Ranks whose own share passes `above`; all ranks when none does alone."""
    ranks = df["rank"].tolist()
    return tuple(int(r) for r, v in zip(ranks, share_by_rank.tolist()) if v > above) or tuple(int(r) for r in ranks)


def _saving_pct(summary: dict[str, Any], key: str) -> float | None:
    """% of the median step a what-if removes (None without ProfilerSteps)."""
    step, alt = summary.get("what_if_step_s"), summary.get(key)
    if step is None or alt is None or step <= 0:
        return None
    return 100.0 * (step - alt) / step


def _who(device: str | None) -> str:
    return "the GPU" if device == "gpu" else "the main thread" if device == "cpu" else "the device"


def _idle(a: TraceAnalysis, df: Table, th: ThresholdsConfig, cause: str) -> list[_Found]:
    by_rank = _span_pct(df, f"{cause}_s")
    share = float(by_rank.mean())
    medium = th.comm_high_pct / 2
    severity = _level(share, critical=th.comm_critical_pct, high=th.comm_high_pct, medium=medium)
    if severity is None:
        return []
    device = a.summary.get("device")
    of_idle = a.summary.get(f"idle_{cause}_pct")
    evidence: dict[str, Any] = {
        f"{cause}_pct": round(share, 2),
        f"{cause}_pct_by_rank": _by_rank(df, by_rank),
        f"{cause}_s_by_rank": _by_rank(df, df[f"{cause}_s"], None),
        "span_s_by_rank": _by_rank(df, df["span_s"], None),
        f"idle_{cause}_pct": None if of_idle is None else round(of_idle, 2),
        "idle_pct": None if a.summary.get("idle_pct") is None else round(a.summary["idle_pct"], 2),
        "device": device,
        "threshold_high_pct": th.comm_high_pct,
        "threshold_critical_pct": th.comm_critical_pct,
    }
    who = _who(device)
    if cause == "sync":
        what = (f"{who} idles {share:.0f} % of the window while the host blocks in device syncs "
                "(`.item()`, `torch.cuda.synchronize()`, printing a tensor)")
    elif device == "cpu":
        what = (f"{who} sits between operators {share:.0f} % of the window (Python, data loading): "
                "no operator and no gloo work runs")
    else:
        what = f"{who} idles {share:.0f} % of the window waiting for the host to launch kernels"
    message = what + (f" ({of_idle:.0f} % of all idle time)" if of_idle is not None else "")
    ranks = _involved(df, by_rank, medium)
    return [(Bottleneck(category="computation", severity=severity, ranks=ranks, evidence=evidence,
                        message=message), share)]


def _communication(a: TraceAnalysis, df: Table, th: ThresholdsConfig, *,
                   straggler_found: bool) -> list[_Found]:
    exposed = df["exposed_comm_pct"]
    # Collective time spent waiting for a late peer is the straggler's cost, not the network's.
    peer = 100.0 * np.fmin(df["peer_wait_s"], df["exposed_comm_s"]) / df["span_s"]
    attributable = np.clip(exposed - peer, 0.0, None) if straggler_found else exposed
    share = float(attributable.mean())
    severity = _level(share, critical=th.comm_critical_pct, high=th.comm_high_pct, medium=th.comm_high_pct / 2)
    if severity is None:
        return []
    s = a.summary
    evidence: dict[str, Any] = {
        "exposed_comm_pct": round(float(exposed.mean()), 2),
        "exposed_comm_pct_by_rank": _by_rank(df, exposed),
        "attributable_comm_pct": round(share, 2),
        "exposed_comm_s": s.get("exposed_comm_s"),
        "peer_wait_s": s.get("peer_wait_s"),
        "overlap_pct": None if s.get("overlap_pct") is None else round(s["overlap_pct"], 2),
        "compute_pct": None if s.get("compute_pct") is None else round(s["compute_pct"], 2),
        "what_if_step_s": s.get("what_if_step_s"),
        "what_if_if_comm_fully_overlapped_s": s.get("what_if_if_comm_fully_overlapped_s"),
        "what_if_saving_pct": _rounded(_saving_pct(s, "what_if_if_comm_fully_overlapped_s")),
        "threshold_high_pct": th.comm_high_pct,
        "threshold_critical_pct": th.comm_critical_pct,
    }
    message = f"{evidence['exposed_comm_pct']:.1f} % of the window is communication not hidden behind compute"
    if evidence["overlap_pct"] is not None:
        message += f" (overlap {evidence['overlap_pct']:.0f} %)"
    if straggler_found:
        message += f"; {share:.1f} % after the time spent waiting for the straggler"
    ranks = _involved(df, attributable, th.comm_high_pct / 2)
    return [(Bottleneck(category="communication", severity=severity, ranks=ranks, evidence=evidence,
                        message=message), share)]


def _straggler(a: TraceAnalysis, df: Table, th: ThresholdsConfig) -> _Found | None:
    s = a.summary
    slow, last_share = s.get("straggler_rank"), s.get("straggler_last_share_pct")
    others = df[df["rank"] != slow] if slow is not None else df[:0]
    if slow is None or last_share is None or last_share < _LAST_SHARE_MIN_PCT or others.empty:
        return None
    waiting = _span_pct(others, "peer_wait_s")
    share = float(waiting.mean())
    if share <= th.straggler_pct:
        return None
    severity = _level(share, critical=3 * th.straggler_pct, high=2 * th.straggler_pct) or "medium"
    strag = a.tables["stragglers"]
    (row,) = strag[strag["rank"] == slow].rows()
    evidence: dict[str, Any] = {
        "straggler_rank": int(slow),
        "last_share_pct": round(float(last_share), 2),
        "times_last": int(row["times_last"]),
        "collectives": int(row["collectives"]),
        "mean_lateness_s": float(row["mean_lateness_s"]),
        "max_lateness_s": float(row["max_lateness_s"]),
        "peer_wait_pct": round(share, 2),
        "peer_wait_pct_by_rank": _by_rank(others, waiting),
        "peer_wait_s_by_rank": _by_rank(others, others["peer_wait_s"], None),
        "threshold_pct": th.straggler_pct,
        "what_if_slowest_rank": s.get("slowest_rank"),
        "what_if_step_s": s.get("what_if_step_s"),
        "what_if_if_slowest_rank_at_median_s": s.get("what_if_if_slowest_rank_at_median_s"),
        "what_if_saving_pct": _rounded(_saving_pct(s, "what_if_if_slowest_rank_at_median_s")),
    }
    message = (f"rank {slow} is a straggler: last to arrive at {last_share:.0f} % of the collectives "
               f"({evidence['times_last']} of {evidence['collectives']}); the other ranks spend {share:.1f} % "
               "of the window waiting for late peers")
    mine = df[df["rank"] == slow]
    if len(mine):
        own = float(_span_pct(mine, "host_wait_s")[0])
        evidence["straggler_host_wait_pct"] = round(own, 2)
        if own > th.comm_high_pct / 2:
            message += (f"; rank {slow}'s main thread is between operators {own:.0f} % of the window"
                        if mine["device"][0] == "cpu" else
                        f"; rank {slow}'s GPU waits for its host {own:.0f} % of the window")
    return Bottleneck(category="straggler", severity=severity, ranks=(int(slow),), evidence=evidence,
                      message=message), share


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


def _recommend(bottlenecks: tuple[Bottleneck, ...]) -> tuple[Recommendation, ...]:
    drafts: list[tuple[int, Recommendation]] = []
    for b in bottlenecks:
        if b.category == "communication":
            recs = _overlap_recs(b)
        elif b.category == "straggler":
            recs = _straggler_recs(b)
        elif "sync_pct" in b.evidence:
            recs = _sync_recs(b)
        else:
            recs = _host_wait_recs(b)
        drafts += [(SEVERITIES.index(b.severity), r) for r in recs]
    drafts.sort(key=lambda item: (item[0], -item[1].expected_gain.high_pct))
    return tuple(replace(rec, priority=i) for i, (_, rec) in enumerate(drafts, start=1))


def _rec(category: str, title: str, rationale: str, gain: GainRange, effort: str) -> Recommendation:
    # No config_patch: these are code changes, and the trace does not record the knobs'
    # current values (e.g. bucket_cap_mb) to propose new ones from.
    return Recommendation(priority=0, category=category, title=title, rationale=rationale,
                          config_patch={}, expected_gain=gain, effort=effort)


def _host_wait_recs(b: Bottleneck) -> list[Recommendation]:
    h = float(b.evidence["host_wait_pct"])
    bound = (f"host-wait idle {h:.1f} % of the window bounds the saving (high); low 0: the trace does not "
             "show how far the host can run ahead")
    if b.evidence["device"] == "cpu":
        return [_rec(
            "computation",
            "Take Python work off the main thread's step: DataLoader workers, fewer small ops (torch.compile)",
            f"the main thread is between operators {h:.1f} % of the window; work it does there (Python, "
            "data loading, logging) delays the next operator and every collective",
            _gain(0.0, h, bound), "medium")]
    return [
        _rec("computation",
             'Replay the step with CUDA graphs: torch.compile(mode="reduce-overhead") or torch.cuda.CUDAGraph',
             f"the GPU idles {h:.1f} % of the window until the host launches the next kernel; a graph "
             "launches the whole step at once (needs static shapes)",
             _gain(0.0, h, bound), "medium"),
        _rec("computation",
             "Give each kernel more work: a larger per-rank batch, fused kernels, fewer small ops",
             f"kernels finish faster than the host launches them ({h:.1f} % of the window idle waiting); "
             "larger or fewer kernels cost the same launch time",
             _gain(0.0, h, bound), "medium"),
    ]


def _sync_recs(b: Bottleneck) -> list[Recommendation]:
    sync = float(b.evidence["sync_pct"])
    return [_rec(
        "computation",
        "Remove or defer host syncs in the step (.item(), print(tensor), torch.cuda.synchronize())",
        f"{_who(b.evidence['device'])} idles {sync:.1f} % of the window while the host waits for it; keep "
        "metrics on the device and read them every N steps",
        _gain(0.0, sync, f"sync idle {sync:.1f} % of the window bounds the saving (high); low 0: the host may "
                         "stall elsewhere once a sync is gone"),
        "low")]


def _overlap_recs(b: Bottleneck) -> list[Recommendation]:
    ev = b.evidence
    e = float(ev["attributable_comm_pct"])
    what_if = ev.get("what_if_saving_pct")
    high = min(e, what_if) if what_if is not None else e
    basis = f"exposed communication {e:.1f} % of the window bounds the saving"
    if what_if is not None:
        basis += (f"; the what-if with all communication hidden takes the step from {ev['what_if_step_s']:.4g} s "
                  f"to {ev['what_if_if_comm_fully_overlapped_s']:.4g} s ({what_if:.1f} %)")
    return [_rec(
        "communication",
        "Overlap communication with compute: smaller DDP buckets (ddp.bucket_cap_mb) or a comm hook",
        f"{e:.1f} % of the window is exposed communication (overlap {ev.get('overlap_pct')} %); smaller "
        "buckets start all-reduces earlier in backward, an fp16/bf16 hook (compression.method) shortens "
        "them. The trace does not record the current bucket size, so no value is proposed",
        _gain(0.0, high, basis + "; low 0: the last bucket never overlaps"), "low")]


def _straggler_recs(b: Bottleneck) -> list[Recommendation]:
    ev = b.evidence
    rank, w = ev["straggler_rank"], float(ev["peer_wait_pct"])
    what_if = ev.get("what_if_saving_pct")
    basis = f"the other ranks' wait for late peers, {w:.1f} % of the window (high)"
    if what_if is not None and ev.get("what_if_slowest_rank") == rank:
        low = min(max(what_if, 0.0), w)
        basis += f"; the what-if 'rank {rank} at the median step time' saves {what_if:.1f} % of the step (low)"
    else:
        # Every rank's step ends at the same collective, so the step what-if names the rank
        # whose step span is longest, not the late one; it says nothing about this rank.
        low = 0.0
        basis += (f"; low 0: the step what-if's slowest rank is {ev.get('what_if_slowest_rank')}, not rank {rank}"
                  if what_if is not None else "; low 0: no ProfilerSteps for a what-if")
    return [_rec(
        "straggler",
        f"Find why rank {rank} is late (its host work, data shard, load, throttling)",
        f"rank {rank} is last at {ev['last_share_pct']:.0f} % of the collectives and the others wait "
        f"{w:.1f} % of the window for it",
        _gain(low, w, basis), "medium")]
