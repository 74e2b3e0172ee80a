"""Communication model: one row per collective per rank, for NCCL and gloo traces.

NCCL: every GPU kernel matching `CommPatterns.nccl_kernels` is a collective; its kind
comes from the kernel name (``ncclKernel_AllReduce_*``, ``ncclDevKernel_AllGather_*``) or
its ``Collective name`` argument; its size from the kernel's own ``In msg nelems`` ×
``dtype`` (PyTorch ≥ 2.1) or else from the ``record_param_comms`` op that launched it.

gloo: no GPU kernel and no record_param_comms exist. The main thread records a
``c10d::<op>`` when it issues a collective, and a ``pt_gloo_runloop`` worker records a
``gloo:<op>`` span while it runs it (with Input Dims and dtype). Each group's workers
run its collectives in issue order, so main-thread ops are paired with worker spans in
order, by kind and element count (reduce_scatter runs as ``gloo:all_reduce``).
"""

from __future__ import annotations

import re
from collections import defaultdict, deque, namedtuple
from typing import Any

import numpy as np

from ._model import RankTrace
from ._parser import dtype_bytes
from ._symbols import SymbolTable
from ._table import Table, strings
from ._timeline import CommPatterns, gloo_span_ends

__all__ = ["COLLECTIVE_COLUMNS", "rank_collectives", "normalize_collective"]

COLLECTIVE_COLUMNS = [
    "rank", "backend", "collective", "pg", "match_key", "issue_us", "start_us", "end_us", "dur_us",
    "size_bytes", "numel", "group_size", "stream", "name",
]

_ALIASES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
    "_allgather_base": "all_gather", "allgather_into_tensor": "all_gather", "all_gather_into_tensor": "all_gather",
    "reducescatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "sendrecv": "send_recv", "recv_": "recv", "recv_any_source": "recv", "allreduce_coalesced": "all_reduce",
}


def normalize_collective(raw: str) -> str:
    """Snake-case collective kind: ``AllReduce``/``allreduce_``/``gloo:all_reduce`` -> ``all_reduce``."""
    name = raw.split("::")[-1].split(":")[-1].strip()
    name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", name).lower().rstrip("_")
    key = name.replace("_", "") if name.replace("_", "") in _ALIASES else name
    return _ALIASES.get(key, _ALIASES.get(name, name))


_NCCL_KIND = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")


_STRING_COLUMNS = ("backend", "collective", "pg", "match_key", "name")
_INT_COLUMNS = ("rank", "stream")
_EVENT = namedtuple("_EVENT", "ts_us dur_us name_id tid stream correlation coll_name_id group_size in_nelems "
                              "out_nelems dtype_id pg_name_id input_numel input_bytes")


def _frame(rows: dict[str, list]) -> Table:
    cols: dict[str, Any] = {}
    for c in COLLECTIVE_COLUMNS:
        vals = rows.get(c, [])
        cols[c] = (strings(vals) if c in _STRING_COLUMNS
                   else np.asarray(vals, dtype=np.int64 if c in _INT_COLUMNS else np.float64))
    return Table(cols)


def _events(ev: Table, rows: np.ndarray) -> list[Any]:
    """Rows of `ev` as attribute tuples (for the per-collective Python loops)."""
    return [_EVENT._make(vals) for vals in zip(*(ev[f][rows].tolist() for f in _EVENT._fields))]


def _nccl(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns) -> Table:
    ev = trace.table
    ts, stream, corr = ev["ts_us"], ev["stream"], ev["correlation"]
    rows = np.flatnonzero(np.isin(ev["name_id"], symbols.ids_matching(patterns.nccl_regex())) & (stream >= 0)
                          & ~np.isnan(ev["dur_us"]))
    if rows.size == 0:
        return _frame({})
    rows = rows[np.argsort(ts[rows], kind="stable")]
    # The CPU side of each kernel: its launch (same correlation) and the enclosing
    # record_param_comms on the launching thread (sizes for traces without kernel args).
    cpu = stream < 0
    launch_rows = np.flatnonzero(cpu & (corr >= 0))
    launch_corr, first = np.unique(corr[launch_rows], return_index=True)
    launch_rows = launch_rows[first]
    at = np.minimum(np.searchsorted(launch_corr, corr[rows]), max(launch_corr.size - 1, 0))
    found = launch_corr[at] == corr[rows] if launch_corr.size else np.zeros(rows.size, dtype=bool)
    issue_at = np.where(found, ts[launch_rows[at]] if launch_corr.size else np.nan, np.nan)
    issue_tid = np.where(found, ev["tid"][launch_rows[at]] if launch_corr.size else -1, -1)
    rpc = np.flatnonzero(cpu & (ev["name_id"] == symbols.id_of("record_param_comms")))
    rpc = rpc[np.argsort(ts[rpc], kind="stable")]
    rpc_by_tid = {}
    for tid in np.unique(ev["tid"][rpc]).tolist():
        g = rpc[ev["tid"][rpc] == tid]
        rpc_by_tid[tid] = (ts[g], ts[g] + ev["dur_us"][g], ev["input_bytes"][g], ev["input_numel"][g])
    default_pg = (trace.process_groups[0].get("pg_name", "0") if trace.process_groups else "")
    rows_out: dict[str, list] = defaultdict(list)
    order: dict[str, int] = defaultdict(int)
    for k, issue, tid in zip(_events(ev, rows), issue_at.tolist(), issue_tid.tolist()):
        name = symbols[k.name_id]
        if k.coll_name_id >= 0:
            kind = normalize_collective(symbols[k.coll_name_id])
        elif (m := _NCCL_KIND.search(name)) is not None:
            kind = normalize_collective(m.group(1))
        else:
            kind = "unknown"
        size = -1
        numel = -1
        group = int(k.group_size) if k.group_size > 0 else 0
        if k.in_nelems >= 0 and k.dtype_id >= 0 and dtype_bytes(symbols[k.dtype_id]) > 0:
            numel = int(max(k.in_nelems, k.out_nelems))
            size = numel * dtype_bytes(symbols[k.dtype_id])
        if size < 0 and issue == issue and (cands := rpc_by_tid.get(tid)) is not None:
            i = int(np.searchsorted(cands[0], issue, side="right")) - 1
            if i >= 0 and cands[1][i] >= issue:
                size, numel = int(cands[2][i]), int(cands[3][i])
        pg = symbols[k.pg_name_id] if k.pg_name_id >= 0 else (default_pg or f"stream{k.stream}")
        rows_out["rank"].append(trace.rank)
        rows_out["backend"].append("nccl")
        rows_out["collective"].append(kind)
        rows_out["pg"].append(pg)
        rows_out["match_key"].append(f"{pg}#{order[pg]}")
        order[pg] += 1
        rows_out["issue_us"].append(issue)
        rows_out["start_us"].append(float(k.ts_us))
        rows_out["end_us"].append(float(k.ts_us + k.dur_us))
        rows_out["dur_us"].append(float(k.dur_us))
        rows_out["size_bytes"].append(size if size > 0 else np.nan)
        rows_out["numel"].append(numel if numel > 0 else np.nan)
        rows_out["group_size"].append(group or trace.world_size or np.nan)
        rows_out["stream"].append(int(k.stream))
        rows_out["name"].append(name)
    return _frame(rows_out)


def _compatible(issued: str, ran: str) -> bool:
    if issued == ran:
        return True
    # gloo implements these on top of all_reduce.
    return ran == "all_reduce" and issued in ("reduce_scatter", "barrier", "all_reduce")


def _gloo(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns) -> Table:
    ev = trace.table
    timed = ~np.isnan(ev["dur_us"])

    def sorted_rows(pattern: str) -> np.ndarray:
        rows = np.flatnonzero(timed & np.isin(ev["name_id"], symbols.ids_matching(pattern)))
        return rows[np.argsort(ev["ts_us"][rows], kind="stable")]

    work = sorted_rows(patterns.gloo_worker)
    if work.size == 0:
        return _frame({})
    pending: dict[str, deque] = defaultdict(deque)
    # A DDP bucket's span ends at the latest when the reducer used its result (`gloo_span_ends`).
    for w, end in zip(_events(ev, work), gloo_span_ends(trace, symbols, patterns, work).tolist()):
        pending[normalize_collective(symbols[w.name_id])].append(w._replace(dur_us=end - w.ts_us))
    pairs = []  # (issue op or None, worker span)
    for op in _events(ev, sorted_rows(patterns.c10d_ops)):
        kind = normalize_collective(symbols[op.name_id])
        match = None
        for ran, queue in pending.items():
            if not _compatible(kind, ran):
                continue
            for cand in queue:
                if cand.ts_us + cand.dur_us < op.ts_us:
                    continue  # finished before this op was issued: belongs to an earlier one
                same_size = op.input_numel < 0 or cand.input_numel < 0 or op.input_numel == cand.input_numel
                if same_size or kind != ran:
                    if match is None or cand.ts_us < match[1].ts_us:
                        match = (ran, cand)
                    break
        if match is not None:
            pending[match[0]].remove(match[1])
            pairs.append((op, kind, match[1]))
    for ran, queue in pending.items():  # worker spans without an issuing op in the window
        pairs.extend((None, ran, w) for w in queue)
    pairs.sort(key=lambda p: p[2].ts_us if p[0] is None else p[0].ts_us)
    pg = trace.process_groups[0].get("pg_name", "0") if len(trace.process_groups) == 1 else ""
    rows: dict[str, list] = defaultdict(list)
    order: dict[tuple, int] = defaultdict(int)
    for op, kind, w in pairs:
        numel = int(op.input_numel if op is not None and op.input_numel > 0 else w.input_numel)
        key = (kind, numel)
        rows["rank"].append(trace.rank)
        rows["backend"].append("gloo")
        rows["collective"].append(kind)
        rows["pg"].append(pg)
        rows["match_key"].append(f"{kind}:{numel}#{order[key]}")
        order[key] += 1
        rows["issue_us"].append(float(op.ts_us) if op is not None else np.nan)
        rows["start_us"].append(float(w.ts_us))
        rows["end_us"].append(float(w.ts_us + w.dur_us))
        rows["dur_us"].append(float(w.dur_us))
        rows["size_bytes"].append(float(w.input_bytes) if w.input_bytes > 0 else np.nan)
        rows["numel"].append(float(numel) if numel > 0 else np.nan)
        rows["group_size"].append(trace.world_size or np.nan)
        rows["stream"].append(int(w.tid))
        rows["name"].append(symbols[w.name_id])
    return _frame(rows)


def rank_collectives(trace: RankTrace, symbols: SymbolTable, patterns: CommPatterns) -> Table:
    """Every collective `trace` ran, one row each, ordered by start.

    Columns: rank, backend, collective (snake_case kind), pg, match_key (the same
    collective on every rank shares it), issue_us (CPU issue), start_us, end_us, dur_us
    (device / worker span), size_bytes (per-rank message), numel, group_size, stream
    (CUDA stream or gloo worker tid), name.
    """
    nccl = _nccl(trace, symbols, patterns)
    out = nccl if len(nccl) else _gloo(trace, symbols, patterns)
    return out.sort("start_us")
