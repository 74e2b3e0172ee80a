"""Columnar parse of one Kineto trace file: numpy columns, no Python object per event.

`_reader.TraceReader` streams the ``traceEvents`` array to a scanner: the C extension
``_scan`` (built by ``pip install``) or, when it is not built, `_reader.PyScanner` (stdlib
``json``, several times slower). Strings come back once per distinct value and are interned
into the shared `SymbolTable`. Only the few communication events whose ``Input Dims`` give
message sizes (`_DETAIL_PREFIXES`) get a ``json.loads`` each.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ._reader import CHUNK_BYTES, SCAN_COLUMNS, PyScanner, TraceReader
from ._symbols import SymbolTable

try:
    from . import _scan
except ImportError:  # no C compiler at install time
    _scan = None

__all__ = ["CHUNK_BYTES", "DTYPE_BYTES", "EVENT_COLUMNS", "SCANNER", "dtype_bytes", "parse_trace_file",
           "rank_from_file_name"]

# The scanner `parse_trace_file` uses by default: "c" (the extension) or "python" (fallback).
SCANNER = "c" if _scan is not None else "python"

# args keys -> columns (the scanners hard-code the same mapping; "name" names threads).
_INT_ARGS = {
    "External id": "external_id",
    "correlation": "correlation",
    "stream": "stream",
    "device": "device",
    "In msg nelems": "in_nelems",
    "Out msg nelems": "out_nelems",
    "Group size": "group_size",
    "Seq": "coll_seq",
}
_STR_ARGS = {
    "Collective name": "coll_name_id",
    "dtype": "dtype_id",
    "Process Group Name": "pg_name_id",
    "Process Group Ranks": "pg_ranks_id",
    "name": "arg_name_id",
}
# Events whose Input Dims/Input type are decoded one by one (sizes of collectives).
_DETAIL_PREFIXES = ("c10d::", "gloo:", "record_param_comms", "nccl:")
_DETAIL_NAMES = "^(" + "|".join(re.escape(p) for p in _DETAIL_PREFIXES) + ")"

EVENT_COLUMNS = (
    "name_id", "cat_id", "ph", "ts_us", "dur_us", "pid", "tid", "stream", "correlation",
    "external_id", "device", "coll_name_id", "in_nelems", "out_nelems", "group_size", "coll_seq",
    "dtype_id", "pg_name_id", "pg_ranks_id", "input_numel", "input_bytes",
)
_STRING_COLUMNS = frozenset(("name_id", "cat_id", *_STR_ARGS.values()))
_DTYPES = {name: np.dtype(code) for name, code in SCAN_COLUMNS} | {
    "input_numel": np.dtype(np.int64), "input_bytes": np.dtype(np.int64)}

# Bytes per element of the dtype spellings in `Input type` (C++ names) and in
# record_param_comms' `dtype` (ScalarType names).
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::half": 2, "half": 2, "c10::bfloat16": 2, "bfloat16": 2,
    "long int": 8, "long": 8, "int64_t": 8, "int": 4, "short int": 2, "short": 2,
    "signed char": 1, "unsigned char": 1, "char": 1, "byte": 1, "bool": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16, "complexfloat": 8, "complexdouble": 16,
    "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}


def dtype_bytes(name: str | None) -> int:
    """Element size of a trace dtype spelling, or -1 when unknown."""
    if not name:
        return -1
    return DTYPE_BYTES.get(name.strip().lower(), -1)


def _input_sizes(ev: dict[str, Any]) -> tuple[int, int]:
    """(elements, bytes) of the tensor inputs of a c10d/gloo/record_param_comms event (-1: unknown)."""
    args = ev.get("args")
    if not isinstance(args, dict):
        return -1, -1
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    if not isinstance(dims, list) or not isinstance(types, list):
        return -1, -1
    numel = 0
    nbytes = 0
    known = True
    try:
        for i, d in enumerate(dims):
            t = types[i] if i < len(types) else ""
            if not isinstance(d, list) or not d:
                continue
            shapes = d if isinstance(d[0], list) else [d]  # TensorList: a list of shapes
            n = sum(math.prod(int(x) for x in s) for s in shapes if isinstance(s, list) and s)
            if n == 0 or t in ("Scalar", "ScalarList"):
                continue
            numel += n
            size = dtype_bytes(t) if isinstance(t, str) else -1
            if size < 0:
                known = False
            else:
                nbytes += n * size
    except (TypeError, ValueError, OverflowError):  # shapes that are not integers
        return -1, -1
    if not numel or not -(1 << 63) <= numel < 1 << 63:
        return -1, -1
    return numel, (nbytes if known and nbytes < 1 << 63 else -1)


def _new_scanner(kind: str | None) -> Any:
    kind = SCANNER if kind is None else kind
    if kind == "c":
        if _scan is None:
            raise RuntimeError("the C trace scanner (torsh_tune.analysis.traces._scan) is not built")
        return _scan.Scanner(_DETAIL_PREFIXES)
    if kind == "python":
        return PyScanner(_DETAIL_PREFIXES)
    raise ValueError(f"scanner must be None, 'c' or 'python', not {kind!r}")


def parse_trace_file(path: Path, symbols: SymbolTable, *, chunk_bytes: int = CHUNK_BYTES,
                     scanner: str | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[tuple[int, int], str]]:
    """Parse one trace file.

    Args:
        path: a ``.json`` or ``.json.gz`` Kineto/Chrome trace.
        symbols: where the event names, categories and string arguments are interned.
        chunk_bytes: decompressed bytes scanned per step (bounds peak memory).
        scanner: None for `SCANNER`; "c" or "python" to force one.

    Returns:
        ``(columns, metadata, thread_names)``: `EVENT_COLUMNS` as numpy arrays, one entry
        per complete (``ph`` X, code 0) or instant (i, code 1) event in file order
        (``*_id``: int32 symbol ids, -1 absent; ``ts_us``/``dur_us``: float64, NaN absent;
        the other integers -1 absent); the top-level keys other than traceEvents;
        ``(pid, tid) -> name`` from the ``thread_name`` metadata events.

    Raises:
        ConfigError: not a trace, truncated/corrupt gzip, malformed JSON (one line).
    """
    scan = _new_scanner(scanner)
    reader = TraceReader(path, chunk_bytes=chunk_bytes)
    details = reader.scan(scan)
    raw, strings, threads = scan.finish()
    lut = np.append(symbols.intern_many(strings), np.int32(-1))  # local id -1 -> -1
    columns: dict[str, np.ndarray] = {}
    for name in EVENT_COLUMNS:
        if name in raw:
            col = np.frombuffer(raw.pop(name), dtype=_DTYPES[name])
            columns[name] = lut[col] if name in _STRING_COLUMNS else col
    rows = len(columns["ph"])
    numel = np.full(rows, -1, dtype=np.int64)
    nbytes = np.full(rows, -1, dtype=np.int64)
    for row, ev in details:
        numel[row], nbytes[row] = _input_sizes(ev if isinstance(ev, dict) else json.loads(ev))
    columns["input_numel"] = numel
    columns["input_bytes"] = nbytes
    columns = {name: columns[name] for name in EVENT_COLUMNS}
    thread_names: dict[tuple[int, int], str] = {}
    for pid, tid, sid in threads:
        # Kineto may name one tid twice (e.g. "(pt_gloo_runloop)" then "(python)").
        key, name = (pid, tid), strings[sid]
        old = thread_names.get(key)
        thread_names[key] = name if old is None or name in old else f"{old} | {name}"
    return columns, reader.metadata, thread_names


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_from_file_name(path: Path) -> int | None:
    """Rank encoded in a trace file name such as ``rank-3.json.gz``, or None."""
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None
