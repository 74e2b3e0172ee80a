"""Columnar parse of one Kineto trace file into a per-rank event DataFrame.

Event spans found by `_reader` are rewritten in place into newline-delimited JSON and
parsed by Arrow's multi-threaded JSON reader against a fixed schema: no Python object is
built per event. Only the few communication events whose ``Input Dims`` (ragged nested
lists Arrow cannot type) are needed get a ``json.loads`` each.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pj

from ._reader import CHUNK_BYTES, EventChunk, TraceReader
from ._symbols import SymbolTable

__all__ = ["EVENT_COLUMNS", "DTYPE_BYTES", "parse_trace_file", "dtype_bytes"]

_INT_ARGS = {
    "External id": "external_id",
    "correlation": "correlation",
    "stream": "stream",
    "device": "device",
    "In msg nelems": "in_nelems",
    "Out msg nelems": "out_nelems",
    "Group size": "group_size",
    "Seq": "coll_seq",
    "sort_index": "sort_index",
}
_STR_ARGS = {
    "Collective name": "coll_name_id",
    "dtype": "dtype_id",
    "Process Group Name": "pg_name_id",
    "Process Group Ranks": "pg_ranks_id",
    "name": "arg_name_id",
}
_SCHEMA = pa.schema(
    [
        ("ph", pa.string()),
        ("cat", pa.string()),
        ("name", pa.string()),
        ("pid", pa.int64()),
        ("tid", pa.int64()),
        ("ts", pa.float64()),
        ("dur", pa.float64()),
        (
            "args",
            pa.struct([(k, pa.int64()) for k in _INT_ARGS] + [(k, pa.string()) for k in _STR_ARGS]),
        ),
    ]
)
_PARSE = pj.ParseOptions(explicit_schema=_SCHEMA, unexpected_field_behavior="ignore", newlines_in_values=False)
# Events whose Input Dims/Input type are decoded one by one (sizes of collectives).
_DETAIL_NAMES = r"^(c10d::|gloo:|record_param_comms|nccl:)"

EVENT_COLUMNS = (
    "name_id", "cat_id", "ph", "ts_us", "dur_us", "pid", "tid", "stream", "correlation",
    "external_id", "device", "coll_name_id", "in_nelems", "out_nelems", "group_size", "coll_seq",
    "dtype_id", "pg_name_id", "pg_ranks_id", "input_numel", "input_bytes",
)

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


# Arrow's default pool (mimalloc) keeps freed chunk tables mapped: ~50 MB more peak RSS
# on a 26 MB trace than the system allocator, for no measurable speed gain here.
_POOL = pa.system_memory_pool()
_STRING_ID_TAIL_BYTES = 1 << 16
_NEWLINES_TO_SPACES = bytes.maketrans(b"\n\r", b"  ")


def _to_ndjson(chunk: EventChunk) -> bytearray:
    """The chunk's events as one JSON object per line (positions inside events unchanged)."""
    starts, ends = chunk.starts, chunk.ends
    s0, e1 = int(starts[0]), int(ends[-1]) + 1
    # Raw newlines can only be whitespace in valid JSON; the separators become the lines.
    body = bytearray(memoryview(chunk.data)[s0:e1]).translate(_NEWLINES_TO_SPACES)
    a = np.frombuffer(body, dtype=np.uint8)
    gap = starts[1:] - ends[:-1] - 1
    if gap.size:
        if int(gap.min()) < 1:
            raise ValueError("events not separated by a comma")
        first = ends[:-1] + 1 - s0
        for k in range(1, int(gap.max())):
            sel = gap > k
            a[first[sel] + k] = 32
        a[first] = 10
    return body


def _rename_string_ids(text: bytearray) -> bytearray:
    """`text` with string-valued pid/tid keys renamed (``"pid": "Spans"`` -> ``"pid_s": ...``)."""
    for key in (b'"pid"', b'"tid"'):
        for sep in (b': "', b':"'):
            if key + sep in text:
                text = text.replace(key + sep, key[:-1] + b'_s"' + sep)
    return text


def _arrow_table(text: bytearray) -> pa.Table:
    def read(buf: bytearray) -> pa.Table:
        return pj.read_json(pa.BufferReader(buf), parse_options=_PARSE,
                            read_options=pj.ReadOptions(block_size=4 << 20), memory_pool=_POOL)

    # String-valued pid/tid (Kineto's "Spans"/"Traces" rows) clash with the int columns.
    # Kineto writes them last; searching a whole chunk costs as much as parsing it, so
    # only the tail is searched up front and the rest only after a failed parse.
    tail = text[-_STRING_ID_TAIL_BYTES:]
    renamed = _rename_string_ids(tail)
    if renamed is not tail:
        text = text[:-_STRING_ID_TAIL_BYTES] + renamed
    try:
        return read(text)
    except pa.ArrowInvalid:
        renamed = _rename_string_ids(text)
        if renamed is text:
            raise
        return read(renamed)


def _python_table(chunk: EventChunk) -> pa.Table:
    """Slow path for traces whose field types vary (e.g. a string stream id)."""
    cols: dict[str, list[Any]] = {f.name: [] for f in _SCHEMA}

    def as_int(v: Any) -> int | None:
        try:
            return int(v)
        except (TypeError, ValueError):
            return None

    def as_float(v: Any) -> float | None:
        try:
            return float(v)
        except (TypeError, ValueError):
            return None

    for s, e in zip(chunk.starts.tolist(), chunk.ends.tolist()):
        ev = json.loads(chunk.data[s : e + 1])
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        cols["ph"].append(str(ev.get("ph")) if ev.get("ph") is not None else None)
        cols["cat"].append(str(ev["cat"]) if "cat" in ev else None)
        cols["name"].append(str(ev["name"]) if "name" in ev else None)
        cols["pid"].append(as_int(ev.get("pid")))
        cols["tid"].append(as_int(ev.get("tid")))
        cols["ts"].append(as_float(ev.get("ts")))
        cols["dur"].append(as_float(ev.get("dur")))
        arg_row = {k: as_int(args.get(k)) for k in _INT_ARGS}
        arg_row.update({k: (None if args.get(k) is None else str(args[k])) for k in _STR_ARGS})
        cols["args"].append(arg_row)
    return pa.Table.from_pydict(cols, schema=_SCHEMA)


def _input_sizes(ev: dict[str, Any]) -> tuple[int, int]:
    """(elements, bytes) of the tensor inputs of a c10d/gloo/record_param_comms event."""
    args = ev.get("args") or {}
    dims = args.get("Input Dims") or []
    types = args.get("Input type") or []
    numel = 0
    nbytes = 0
    known = True
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) else ""
        if not isinstance(d, list) or not d:
            continue
        shapes = d if isinstance(d[0], list) else [d]  # TensorList: a list of shapes
        n = sum(math.prod(int(x) for x in s) for s in shapes if isinstance(s, list) and s)
        if n == 0 or t in ("Scalar", "ScalarList"):
            continue
        numel += n
        size = dtype_bytes(t)
        if size < 0:
            known = False
        else:
            nbytes += n * size
    return (numel if numel else -1), (nbytes if numel and known else -1)


def _int_column(arr: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """An int64 Arrow array as numpy with -1 for nulls (from its buffers: no compute call)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    if arr.type != pa.int64() or arr.null_count == 0:
        return pc.fill_null(arr, -1).to_numpy()
    bitmap, data = arr.buffers()[:2]
    end = arr.offset + len(arr)
    values = np.frombuffer(data, dtype=np.int64, count=end)[arr.offset:]
    valid = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), count=end, bitorder="little")[arr.offset:]
    return np.where(valid.view(bool), values, -1)


def _chunk_columns(chunk: EventChunk, symbols: SymbolTable) -> dict[str, np.ndarray]:
    try:
        table = _arrow_table(_to_ndjson(chunk))
    except (pa.ArrowInvalid, ValueError):
        if not chunk.exact:
            raise  # TraceReader recuts the chunk exactly
        table = _python_table(chunk)
    if table.num_rows != chunk.ends.size:
        raise ValueError(f"{table.num_rows} rows for {chunk.ends.size} events")

    def interned(arr: pa.ChunkedArray) -> np.ndarray:
        enc = pc.dictionary_encode(arr)
        if isinstance(enc, pa.ChunkedArray):
            enc = enc.combine_chunks()
        lut = symbols.intern_many(enc.dictionary.to_pylist())
        idx = enc.indices.to_numpy(zero_copy_only=False)
        out = np.full(len(enc), -1, dtype=np.int32)
        valid = ~np.asarray(enc.is_null())
        if lut.size:
            out[valid] = lut[idx[valid].astype(np.int64)]
        return out

    def ints(arr: pa.ChunkedArray | pa.Array, dtype: Any = np.int64) -> np.ndarray:
        return _int_column(arr).astype(dtype, copy=False)

    cols: dict[str, np.ndarray] = {
        "name_id": interned(table["name"]),
        "cat_id": interned(table["cat"]),
        "ph": interned(table["ph"]),
        "ts_us": pc.fill_null(table["ts"], np.nan).to_numpy(),
        "dur_us": pc.fill_null(table["dur"], np.nan).to_numpy(),
        "pid": ints(table["pid"]),
        "tid": ints(table["tid"]),
    }
    args = table["args"].combine_chunks()
    for raw, col in _INT_ARGS.items():
        cols[col] = ints(pc.struct_field(args, raw), np.int32 if col in ("stream", "device", "group_size") else np.int64)
    for raw, col in _STR_ARGS.items():
        cols[col] = interned(pc.struct_field(args, raw))
    numel = np.full(table.num_rows, -1, dtype=np.int64)
    nbytes = np.full(table.num_rows, -1, dtype=np.int64)
    detail = np.isin(cols["name_id"], symbols.ids_matching(_DETAIL_NAMES))
    for i in np.flatnonzero(detail).tolist():
        ev = json.loads(chunk.data[int(chunk.starts[i]) : int(chunk.ends[i]) + 1])
        numel[i], nbytes[i] = _input_sizes(ev)
    cols["input_numel"] = numel
    cols["input_bytes"] = nbytes
    return cols


def parse_trace_file(path: Path, symbols: SymbolTable, *, chunk_bytes: int = CHUNK_BYTES
                     ) -> tuple[pd.DataFrame, dict[str, Any], dict[tuple[int, int], str]]:
    """Parse one trace file.

    Returns:
        ``(events, metadata, thread_names)``: complete/instant events (``ph`` X or i) with
        `EVENT_COLUMNS`; the top-level keys other than traceEvents; ``(pid, tid) -> name``
        from the ``thread_name`` metadata events.
    """
    reader = TraceReader(path, chunk_bytes=chunk_bytes)
    parts: list[dict[str, np.ndarray]] = []
    thread_names: dict[tuple[int, int], str] = {}
    ph_x, ph_i, ph_m = symbols.intern("X"), symbols.intern("i"), symbols.intern("M")
    thread_name = symbols.intern("thread_name")
    for cols in reader.read(lambda chunk: _chunk_columns(chunk, symbols)):
        meta_rows = np.flatnonzero((cols["ph"] == ph_m) & (cols["name_id"] == thread_name))
        for i in meta_rows.tolist():
            if cols["arg_name_id"][i] >= 0:
                # Kineto may name one tid twice (e.g. "(pt_gloo_runloop)" then "(python)").
                key = (int(cols["pid"][i]), int(cols["tid"][i]))
                name = symbols[int(cols["arg_name_id"][i])]
                old = thread_names.get(key)
                thread_names[key] = name if old is None or name in old else f"{old} | {name}"
        keep = (cols["ph"] == ph_x) | (cols["ph"] == ph_i)
        parts.append({k: v[keep] for k, v in cols.items() if k in EVENT_COLUMNS})
    data = {}
    for k in EVENT_COLUMNS:  # column by column, dropping the chunks' copies as we go
        data[k] = np.concatenate([p.pop(k) for p in parts]) if parts else np.empty(0)
    ph = data.pop("ph")
    # copy=False: one block per column instead of a consolidated copy of every column.
    events = pd.DataFrame(data, copy=False)
    events.insert(2, "ph", pd.Categorical.from_codes(np.where(ph == ph_x, 0, 1), categories=["X", "i"]))
    return events, reader.metadata, thread_names


_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)


def rank_from_file_name(path: Path) -> int | None:
    """Rank encoded in a trace file name such as ``rank-3.json.gz``, or None."""
    m = _RANK_IN_NAME.search(path.name)
    return int(m.group(1)) if m else None
