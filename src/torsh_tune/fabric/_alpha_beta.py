"""Alpha-beta (latency-bandwidth) model of collectives, fitted to a bench sweep. Pure Python.

Per collective and level the measured time is fitted as

    time_s = alpha_s + bus_factor(collective, n) * size_bytes * beta_s_per_byte

where `bus_factor` is nccl-tests' factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter,
all_to_all (n-1)/n; broadcast 1; see `_busbw`). With that choice
`bus_factor * size` is the number of bytes each rank's link carries in a bandwidth-optimal
(ring) algorithm, so `beta` is the inverse *link* bandwidth, the same for every collective
on a fabric (1 / beta is the asymptotic busbw), and `alpha` is the whole collective's
latency. The fit minimises squared *relative* error (times span orders of magnitude; an
unweighted fit would ignore the small messages), with alpha and beta kept >= 0.

The held-out error: fit on every other size (sizes 0, 2, 4, ...), predict the others, report
the median |prediction - measured| / measured. The stored alpha/beta are then refit on all.

All-reduce algorithm predictions (the ToRSh guide's `estimate_allreduce_time` family, with
measured alpha and beta; `n` ranks, `S` bytes, per-step latency a = alpha / (2(n-1)), the
ring's 2(n-1) steps being what the fitted all-reduce alpha is made of):

    ring          2(n-1) a + 2(n-1)/n S beta
    tree          2 ceil(log2 n) (a + S beta)          (reduce up + broadcast down, unpipelined)
    rs_ag         T_reduce_scatter(S) + T_all_gather(S)  (their own fits; ring formulas if absent)
    hierarchical  intra reduce-scatter + inter all-reduce of S/l + intra all-gather
                  over nnodes = m nodes of per_node ranks, each level with its own alpha/beta;
                  the per_node shard all-reduces run at once, and when they share a node's
                  links (node_links < per_node, e.g. one NIC per node) they share its bandwidth
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import invalid
from ..rundir import write_json_atomic
from ._busbw import bus_factor

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "AlphaBeta",
    "CommModel",
    "MODEL_FILE",
    "fit_alpha_beta",
    "fit_model",
    "load_model",
    "predict_allreduce_s",
    "reference_busbw_gbps",
    "save_model",
]

MODEL_FILE = "bench_model.json"
ALLREDUCE_ALGORITHMS = ("ring", "tree", "rs_ag", "hierarchical")
#: Default size at which the reference bus bandwidth is read: large enough to be bandwidth-bound.
REFERENCE_SIZE_BYTES = 256 << 20


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    """One fitted collective at one level.

    Attributes:
        collective: all_reduce, all_gather, reduce_scatter, broadcast or all_to_all.
        level: "intra" (within a node) or "inter" (across nodes).
        group_size: ranks taking part (the `n` of the bus factor).
        alpha_s: latency of the whole collective in seconds.
        beta_s_per_byte: inverse link bandwidth in seconds per bus byte.
        num_points: sizes used in the final fit.
        heldout_median_rel_err: median relative error on the held-out sizes (None if < 4 sizes).
        fit_median_rel_err: median relative error of the final fit on all sizes.
    """

    collective: str
    level: str
    group_size: int
    alpha_s: float
    beta_s_per_byte: float
    num_points: int
    heldout_median_rel_err: float | None = None
    fit_median_rel_err: float | None = None

    @property
    def factor(self) -> float:
        return bus_factor(self.collective, self.group_size)

    @property
    def busbw_gbps(self) -> float | None:
        """Asymptotic bus bandwidth 1 / beta in GB/s (None when beta is 0)."""
        return 1.0 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else None

    def predict_s(self, size_bytes: float) -> float:
        """Predicted time of one collective of `size_bytes` (nccl-tests sizing)."""
        return self.alpha_s + self.factor * float(size_bytes) * self.beta_s_per_byte


@dataclass(frozen=True, kw_only=True)
class CommModel:
    """Fitted alpha-beta parameters of a fabric.

    Attributes:
        world_size: ranks in the bench.
        nnodes: nodes in the bench.
        nproc_per_node: ranks per node.
        backend: process-group backend measured (gloo, nccl).
        fits: one `AlphaBeta` per (collective, level).
    """

    world_size: int
    nnodes: int
    nproc_per_node: int
    backend: str = "gloo"
    fits: tuple[AlphaBeta, ...] = field(default_factory=tuple)

    def get(self, collective: str, level: str | None = None) -> AlphaBeta | None:
        """The fit of `collective` at `level` (default: the widest level measured)."""
        candidates = [f for f in self.fits if f.collective == collective and (level is None or f.level == level)]
        if not candidates:
            return None
        return max(candidates, key=lambda f: f.group_size)

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": 1, **{k: v for k, v in asdict(self).items() if k != "fits"},
                "fits": [asdict(f) for f in self.fits]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CommModel:
        fits = tuple(AlphaBeta(**f) for f in data.get("fits", ()))
        return cls(world_size=int(data["world_size"]), nnodes=int(data["nnodes"]),
                   nproc_per_node=int(data["nproc_per_node"]), backend=str(data.get("backend", "gloo")), fits=fits)


def _weighted_fit(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Minimise sum(((a + b x) - t) / t)^2 with a, b >= 0; returns (a, b)."""
    ws = [1.0 / (t * t) for t in ts]
    sw = sum(ws)
    swx = sum(w * x for w, x in zip(ws, xs))
    swxx = sum(w * x * x for w, x in zip(ws, xs))
    swt = sum(w * t for w, t in zip(ws, ts))
    swxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * swxx - swx * swx
    if det > 0:
        a = (swt * swxx - swx * swxt) / det
        b = (sw * swxt - swx * swt) / det
        if a >= 0 and b >= 0:
            return a, b
    # The unconstrained optimum leaves the feasible set: the best feasible fit has one of
    # the parameters at zero, so take the better of the two one-parameter fits.
    b_only = swxt / swxx if swxx > 0 else 0.0
    a_only = swt / sw
    err_b = sum(w * (b_only * x - t) ** 2 for w, x, t in zip(ws, xs, ts))
    err_a = sum(w * (a_only - t) ** 2 for w, t in zip(ws, ts))
    return (0.0, max(b_only, 0.0)) if err_b <= err_a else (max(a_only, 0.0), 0.0)


def _median_rel_err(a: float, b: float, xs: Sequence[float], ts: Sequence[float]) -> float:
    return statistics.median(abs(a + b * x - t) / t for x, t in zip(xs, ts))


def fit_alpha_beta(
    collective: str,
    sizes_bytes: Sequence[float],
    times_s: Sequence[float],
    *,
    group_size: int,
    level: str = "intra",
) -> AlphaBeta:
    """Fit alpha and beta of one collective from (size, time) measurements.

    Args:
        collective: The collective's name (selects the bus factor).
        sizes_bytes: Message sizes (nccl-tests sizing), at least two distinct ones.
        times_s: Measured times (median over iterations, slowest rank), all > 0.
        group_size: Ranks taking part.
        level: "intra" or "inter".

    Returns:
        The fit, with the held-out median relative error when there are >= 4 sizes.

    Example:
        >>> fit = fit_alpha_beta("all_reduce", [1e3, 1e4, 1e5, 1e6], [1e-5 + 1e-9 * s for s in
        ...     [1e3, 1e4, 1e5, 1e6]], group_size=2)
        >>> round(fit.alpha_s * 1e6, 3), round(fit.beta_s_per_byte * 1e9, 3)
        (10.0, 1.0)
    """
    pts = sorted((float(s), float(t)) for s, t in zip(sizes_bytes, times_s) if t is not None)
    if len(pts) != len(sizes_bytes) or len(pts) < 2:
        raise invalid(f"measurements of {collective}", "at least two (size, time) pairs", len(pts))
    if any(t <= 0 or s < 0 for s, t in pts):
        raise invalid(f"measurements of {collective}", "positive times and non-negative sizes", pts)
    factor = bus_factor(collective, group_size)
    xs = [factor * s for s, _ in pts]
    ts = [t for _, t in pts]
    heldout = None
    if len(pts) >= 4:
        a_h, b_h = _weighted_fit(xs[0::2], ts[0::2])
        heldout = _median_rel_err(a_h, b_h, xs[1::2], ts[1::2])
    a, b = _weighted_fit(xs, ts)
    return AlphaBeta(collective=collective, level=level, group_size=int(group_size), alpha_s=a, beta_s_per_byte=b,
                     num_points=len(pts), heldout_median_rel_err=heldout,
                     fit_median_rel_err=_median_rel_err(a, b, xs, ts))


def fit_model(bench: Mapping[str, Any]) -> CommModel:
    """Fit every (collective, level) of a bench document (the content of bench.json).

    Collectives with fewer than two measured sizes (or marked unsupported) are left out.
    """
    groups: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for row in bench.get("rows", ()):
        if row.get("status") != "ok" or not row.get("time_s"):
            continue
        key = (row["collective"], row["level"], int(row["group_size"]))
        groups.setdefault(key, []).append((float(row["size_bytes"]), float(row["time_s"])))
    fits = []
    for (name, level, n), pts in sorted(groups.items()):
        if len({s for s, _ in pts}) < 2:
            continue
        fits.append(fit_alpha_beta(name, [s for s, _ in pts], [t for _, t in pts], group_size=n, level=level))
    return CommModel(world_size=int(bench.get("world_size", 1)), nnodes=int(bench.get("nnodes", 1)),
                     nproc_per_node=int(bench.get("nproc_per_node", bench.get("world_size", 1))),
                     backend=str(bench.get("backend", "gloo")), fits=tuple(fits))


def _ring_step(ab: AlphaBeta) -> tuple[float, float]:
    """(per-step latency, beta) of an all-reduce fit: its alpha is 2(n-1) ring steps."""
    steps = 2 * max(ab.group_size - 1, 1)
    return ab.alpha_s / steps, ab.beta_s_per_byte


def predict_allreduce_s(
    model: CommModel,
    size_bytes: float,
    *,
    algorithm: str = "ring",
    world_size: int | None = None,
    nnodes: int | None = None,
    node_links: int | None = None,
) -> float:
    """Predicted all-reduce time of `size_bytes` under `algorithm` with measured alpha/beta.

    Args:
        model: A fitted model with an all_reduce fit.
        size_bytes: The all-reduce buffer size.
        algorithm: One of `ALLREDUCE_ALGORITHMS`.
        world_size: Ranks (default: the bench's world size).
        nnodes: Nodes for "hierarchical" (default: the bench's); ranks per node = world_size / nnodes.
        node_links: Inter-node links per node for "hierarchical" (default: one per rank, as on
            rail-optimised GPU nodes); 1 when a node has one NIC (an emulated cluster: one veth),
            so its ranks' concurrent shard all-reduces share it.

    Returns:
        Seconds.

    Example:
        >>> predict_allreduce_s(model, 64 << 20, algorithm="tree")  # doctest: +SKIP
        0.081
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise invalid("algorithm", f"one of {', '.join(ALLREDUCE_ALGORITHMS)}", algorithm)
    n = int(world_size or model.world_size)
    m = int(nnodes or model.nnodes)
    s = float(size_bytes)
    if n <= 1:
        return 0.0
    flat = model.get("all_reduce", "inter" if m > 1 else None) or model.get("all_reduce")
    if flat is None:
        raise invalid("model", "a fit of all_reduce", [f"{f.collective}/{f.level}" for f in model.fits])
    a, beta = _ring_step(flat)
    if algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * s * beta
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (a + s * beta)
    if algorithm == "rs_ag":
        rs, ag = model.get("reduce_scatter"), model.get("all_gather")
        if rs is not None and ag is not None and rs.group_size == n and ag.group_size == n:
            return rs.predict_s(s) + ag.predict_s(s)
        return 2 * ((n - 1) * a + (n - 1) / n * s * beta)
    # hierarchical: m nodes of per_node ranks; intra level from its own fit when measured.
    per_node = max(n // max(m, 1), 1)
    intra = model.get("all_reduce", "intra")
    a_in, b_in = _ring_step(intra) if intra is not None else (a, beta)
    inter = model.get("all_reduce", "inter")
    a_out, b_out = _ring_step(inter) if inter is not None else (a, beta)
    t_intra = 2 * ((per_node - 1) * a_in + (per_node - 1) / per_node * s * b_in)  # reduce-scatter + all-gather in the node
    sharing = math.ceil(per_node / max(1, min(node_links or per_node, per_node)))  # shards per link
    t_inter = 2 * (m - 1) * a_out + 2 * (m - 1) / m * (s / per_node) * sharing * b_out if m > 1 else 0.0
    return t_intra + t_inter


def reference_busbw_gbps(source: CommModel | Mapping[str, Any], size_bytes: float | None = None) -> float | None:
    """The fabric's measured all-reduce bus bandwidth at large messages (run.json's reference).

    Args:
        source: A fitted `CommModel`, or a bench document (bench.json content) / `BenchResult`
            rows under "rows".
        size_bytes: With a model: the size at which to predict (default 256 MiB). With bench
            rows: the largest measured all-reduce size <= `size_bytes` (default: the largest).

    Returns:
        GB/s, or None when nothing was measured. From rows: the highest all-reduce busbw of
        the widest level among the sizes within 16x of the chosen largest size, i.e. what
        the network between the ranks delivered at bandwidth-bound sizes.
    """
    if isinstance(source, CommModel):
        fit = source.get("all_reduce")
        if fit is None:
            return None
        s = float(size_bytes or REFERENCE_SIZE_BYTES)
        t = fit.predict_s(s)
        return fit.factor * s / t / 1e9 if t > 0 else None
    rows = [r for r in source.get("rows", ()) if r.get("collective") == "all_reduce" and r.get("status") == "ok"
            and r.get("busbw_gbps")]
    if not rows:
        return None
    widest = max(int(r["group_size"]) for r in rows)
    rows = [r for r in rows if int(r["group_size"]) == widest]
    if size_bytes is not None:
        rows = [r for r in rows if r["size_bytes"] <= size_bytes] or rows
    # The best of the large sizes (within 16x of the largest, i.e. the top three x4 steps):
    # one scheduler hiccup on a shared host must not set what the fabric "delivers".
    largest = max(r["size_bytes"] for r in rows)
    return float(max(r["busbw_gbps"] for r in rows if r["size_bytes"] * 16 >= largest))


def save_model(model: CommModel, run_dir: str | os.PathLike[str]) -> Path:
    """Write the model as `bench_model.json` in `run_dir` (or to `run_dir` if it ends in .json)."""
    path = Path(run_dir)
    if path.suffix != ".json":
        path = path / MODEL_FILE
    return write_json_atomic(path, model.to_dict())


def load_model(path: str | os.PathLike[str]) -> CommModel:
    """Read a model saved by `save_model` (a run directory or the JSON file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / MODEL_FILE
    if not p.is_file():
        raise invalid("bench model", f"an existing {MODEL_FILE} (a bench run directory)", str(path))
    return CommModel.from_dict(json.loads(p.read_text()))

