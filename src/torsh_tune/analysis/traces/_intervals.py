"""Vectorised interval arithmetic on (start, end) arrays: union, length, overlap, gaps, labelling."""

from __future__ import annotations

import numpy as np

__all__ = ["clip", "covers", "gaps", "merge", "overlap", "paint", "subtract", "total"]


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals as sorted, disjoint (start, end); touching intervals join."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.size == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    heads = np.flatnonzero(new)
    return s[heads], np.maximum.reduceat(e, heads)


def total(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of the intervals."""
    s, e = merge(starts, ends)
    return float((e - s).sum())


def overlap(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Length of (union of `a`) ∩ (union of `b`), by inclusion-exclusion."""
    both = total(np.concatenate([a[0], b[0]]), np.concatenate([a[1], b[1]]))
    return total(*a) + total(*b) - both


def subtract(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(union of `a`) minus (union of `b`), as sorted, disjoint (start, end)."""
    a_s, a_e = merge(*a)
    b_s, b_e = merge(*b)
    if a_s.size == 0 or b_s.size == 0:
        return a_s, a_e
    out_s: list[float] = []
    out_e: list[float] = []
    j = 0
    for s, e in zip(a_s.tolist(), a_e.tolist()):
        while j < b_s.size and b_e[j] <= s:
            j += 1
        cur, k = s, j
        while k < b_s.size and b_s[k] < e:
            if b_s[k] > cur:
                out_s.append(cur)
                out_e.append(float(b_s[k]))
            cur = max(cur, float(b_e[k]))
            k += 1
        if cur < e:
            out_s.append(cur)
            out_e.append(e)
    return np.asarray(out_s, dtype=np.float64), np.asarray(out_e, dtype=np.float64)


def clip(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Intervals cut to [lo, hi] (empty ones dropped)."""
    s = np.clip(starts, lo, hi)
    e = np.clip(ends, lo, hi)
    keep = e > s
    return s[keep], e[keep]


def gaps(starts: np.ndarray, ends: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """The parts of [lo, hi] that no interval covers, as sorted (start, end)."""
    s, e = merge(*clip(np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64), lo, hi))
    gs = np.concatenate(([lo], e))
    ge = np.concatenate((s, [hi]))
    keep = ge > gs
    return gs[keep], ge[keep]


def covers(starts: np.ndarray, ends: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Whether each point lies inside the union of the intervals (half-open [start, end))."""
    s, e = merge(starts, ends)
    if s.size == 0:
        return np.zeros(np.shape(points), dtype=bool)
    at = np.searchsorted(s, points, side="right") - 1
    return (at >= 0) & (points < e[np.maximum(at, 0)])


def paint(lo: float, hi: float, layers: list[tuple[np.ndarray, np.ndarray]]
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut [lo, hi] into pieces labelled by the first layer covering them.

    Returns ``(starts, ends, label)``: sorted, disjoint pieces covering [lo, hi], where
    ``label`` is the index of the first layer whose union covers the piece (-1: none);
    neighbouring pieces with the same label are joined.
    """
    clipped = [clip(np.asarray(s, dtype=np.float64), np.asarray(e, dtype=np.float64), lo, hi) for s, e in layers]
    edges = np.unique(np.concatenate([[lo, hi], *(x for c in clipped for x in c)]))
    if edges.size < 2:
        return np.empty(0), np.empty(0), np.empty(0, dtype=np.int64)
    a, b = edges[:-1], edges[1:]
    mid = (a + b) / 2
    label = np.full(mid.size, -1, dtype=np.int64)
    for i in range(len(clipped) - 1, -1, -1):  # first layer wins: paint the last first
        label[covers(*clipped[i], mid)] = i
    heads = np.flatnonzero(np.r_[True, label[1:] != label[:-1]])
    tails = np.append(heads[1:], a.size) - 1
    return a[heads], b[tails], label[heads]
