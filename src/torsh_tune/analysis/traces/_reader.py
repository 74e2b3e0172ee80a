"""Streaming reader of Kineto (Chrome trace) JSON: decompressed blocks into an event scanner.

A Kineto trace is one JSON object whose ``traceEvents`` array holds every event. Instead of
``json.load`` (one Python dict per event, ~1 KB each), the file is decompressed in blocks
and the bytes of the array are fed to a scanner in chunks of about `CHUNK_BYTES`: the C
extension ``_scan.Scanner`` or its pure-Python twin `PyScanner` (same interface, same
results). A scanner takes every complete event of a chunk into columns and says how many
bytes it consumed; the incomplete tail is carried over to the next chunk, so peak memory is
about one chunk plus the columns.

The other top-level keys (``distributedInfo``, ``deviceProperties``...) are small and are
decoded with ``json`` at the end.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from array import array
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ...errors import invalid

__all__ = ["CHUNK_BYTES", "PyScanner", "TraceReader", "event_bounds"]

# Largest decompressed block; a gzip file is read _READ_BYTES >> 3 compressed bytes at a time.
_READ_BYTES = 1 << 20
# Bytes handed to the scanner per call (plus at most one block); bounds peak memory.
CHUNK_BYTES = 1 << 20
# A JSON document whose traceEvents key is not found in this many bytes is not a trace.
_MAX_HEADER_BYTES = 256 << 20
_WS = b" \t\r\n"


class EventScanner(Protocol):
    """What `TraceReader.scan` drives (``_scan.Scanner`` and `PyScanner`)."""

    def feed(self, buf: bytes | bytearray, base: int = 0) -> tuple[int, int, list[tuple[int, Any]]]: ...

    def finish(self) -> tuple[dict[str, Any], list[str], list[tuple[int, int, int]]]: ...


def _structure(data: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Positions and depth deltas of ``{ [ } ]`` outside JSON strings in `data`.

    `data` must begin outside a string. Escapes are neutralised first on a same-length
    copy (``\\\\`` then ``\\"``, left to right, exactly how a JSON reader pairs them), so
    every remaining ``"`` delimits a string and a bracket is inside one iff an odd number
    of quotes precede it.
    """
    scan = data
    if b"\\" in data:
        scan = data.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    a = np.frombuffer(scan, dtype=np.uint8)
    quotes = np.flatnonzero(a == 34)
    # Clearing bit 5 maps { } onto [ ] (0x5B, 0x5D); then one compare against their
    # common bits finds candidates (few false hits such as 'Y' or '_'), checked exactly.
    folded = a & 0xDF
    folded |= 0x06
    pos = np.flatnonzero(folded == 0x5F)
    del folded
    kind = a[pos] & 0xDF
    exact = (kind == 0x5B) | (kind == 0x5D)
    pos, kind = pos[exact], kind[exact]
    if quotes.size:
        outside = (np.searchsorted(quotes, pos) & 1) == 0
        pos, kind = pos[outside], kind[outside]
    sign = np.where(kind == 0x5B, 1, -1).astype(np.int8)
    return pos, sign


def event_bounds(data: bytes) -> tuple[np.ndarray, np.ndarray, int]:
    """Start/end offsets of the complete events in `data` and where the array closes.

    `data` begins inside the ``traceEvents`` array, outside any event. Returns
    ``(starts, ends, close)`` where ``close`` is the offset of the first bracket that closes
    more than it opened (the array's ``]`` in valid JSON) or -1 when the array continues
    past `data`; a trailing incomplete event is left out. Only brackets are looked at: the
    text between them is not validated.
    """
    pos, sign = _structure(data)
    depth = np.cumsum(sign, dtype=np.int64)
    close = -1
    below = np.flatnonzero(depth < 0)
    if below.size:
        cut = below[0]
        close = int(pos[cut])
        pos, sign, depth = pos[:cut], sign[:cut], depth[:cut]
    starts = pos[(sign == 1) & (depth == 1)]
    ends = pos[(sign == -1) & (depth == 0)]
    return starts[: ends.size], ends, close


# --------------------------------------------------------------------------- Python scanner

# Columns a scanner returns, with their `array`/numpy type codes (the C module's COLUMNS).
SCAN_COLUMNS = (
    ("name_id", "i"), ("cat_id", "i"), ("ph", "b"), ("ts_us", "d"), ("dur_us", "d"), ("pid", "q"),
    ("tid", "q"), ("stream", "i"), ("correlation", "q"), ("external_id", "q"), ("device", "i"),
    ("coll_name_id", "i"), ("in_nelems", "q"), ("out_nelems", "q"), ("group_size", "i"),
    ("coll_seq", "q"), ("dtype_id", "i"), ("pg_name_id", "i"), ("pg_ranks_id", "i"),
)
# args key -> (column, is int32); the string args; args "name" only names threads.
_INT_ARG_COLUMNS = (
    ("External id", "external_id", False), ("correlation", "correlation", False),
    ("stream", "stream", True), ("device", "device", True), ("In msg nelems", "in_nelems", False),
    ("Out msg nelems", "out_nelems", False), ("Group size", "group_size", True), ("Seq", "coll_seq", False),
)
_STR_ARG_COLUMNS = (
    ("Collective name", "coll_name_id"), ("dtype", "dtype_id"), ("Process Group Name", "pg_name_id"),
    ("Process Group Ranks", "pg_ranks_id"),
)
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_I64 = (-(1 << 63), 1 << 63)
_I32 = (-(1 << 31), 1 << 31)


def _number(v: Any) -> Any:
    """A JSON number given as a string, as json would decode it; other values unchanged."""
    if type(v) is str:
        m = _NUMBER.fullmatch(v)
        if m is None:
            return None
        return float(v) if m.group(1) or m.group(2) else int(v)
    return v


def _as_int(v: Any, bounds: tuple[int, int] = _I64) -> int:
    """Integer field: ints, truncated finite floats, numeric strings; -1 otherwise or out of range."""
    v = _number(v)
    if type(v) is float:
        if not math.isfinite(v):
            return -1
        v = int(v)
    elif type(v) is not int:  # bool, None, containers
        return -1
    return v if bounds[0] <= v < bounds[1] else -1


def _as_float(v: Any) -> float:
    """Float field: numbers and numeric strings (correctly rounded), NaN otherwise."""
    v = _number(v)
    if type(v) is float:
        return v
    if type(v) is int:
        try:
            return float(v)
        except OverflowError:
            return math.inf if v > 0 else -math.inf
    return math.nan


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODE = json.JSONDecoder(parse_constant=_reject_constant).decode


class PyScanner:
    """Pure-Python fallback of ``_scan.Scanner`` (stdlib ``json``; several times slower).

    Same interface and results as the C scanner: see ``_scan.c`` for the field rules.
    `event_bounds` finds the complete events of a chunk, ``json`` decodes them all at once.
    """

    def __init__(self, detail_prefixes: Iterable[str] = ()) -> None:
        self._prefixes = tuple(detail_prefixes)
        self._cols = {name: array(code) for name, code in SCAN_COLUMNS}
        self._ids: dict[str, int] = {}
        self._detail: list[bool] = []
        self._threads: list[tuple[int, int, int]] = []
        self._after = False  # an event was taken: the next one needs a comma first
        self._closed = False
        self._rows = 0

    @property
    def rows(self) -> int:
        return self._rows

    def _sid(self, v: Any) -> int:
        if type(v) is not str:
            return -1
        sid = self._ids.get(v)
        if sid is None:
            sid = self._ids[v] = len(self._ids)
            self._detail.append(v.startswith(self._prefixes))
        return sid

    def feed(self, buf: bytes | bytearray, base: int = 0) -> tuple[int, int, list[tuple[int, Any]]]:
        """See ``_scan.Scanner.feed``; details come back as decoded dicts."""
        if self._closed:
            raise RuntimeError("the traceEvents array is already closed")
        data = bytes(buf)
        starts, ends, close = event_bounds(data)
        if close >= 0:
            if data[close] != 0x5D:  # a '}' that closes nothing
                raise ValueError(f"malformed JSON at byte {base + close}: expected ',' or ']'")
            stop = close
        elif ends.size:
            stop = int(ends[-1]) + 1
        else:
            return 0, -1, []
        lo = 0
        if self._after:
            lo = len(data[:stop]) - len(data[:stop].lstrip(_WS))
            if lo < stop:
                if data[lo] != 0x2C:
                    raise ValueError(f"malformed JSON at byte {base + lo}: expected ',' or ']' after an event")
                lo += 1
                if not data[lo:stop].strip(_WS):  # "[..., ]"
                    raise ValueError(f"malformed JSON at byte {base + stop}: expected an event object")
        events = self._decode(data, lo, stop, base)
        details = self._take(events, base + lo)
        if events:
            self._after = True
        if close >= 0:
            self._closed = True
            return close + 1, close, details
        return stop, -1, details

    @staticmethod
    def _decode(data: bytes, lo: int, hi: int, base: int) -> list[Any]:
        try:
            text = data[lo:hi].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            raise ValueError(f"malformed JSON at byte {base + lo + exc.start}: invalid UTF-8") from None
        try:
            return _DECODE("[" + text + "]")
        except json.JSONDecodeError as exc:
            at = len(text[: min(max(exc.pos - 1, 0), len(text))].encode("utf-8", "surrogatepass"))
            raise ValueError(f"malformed JSON at byte {base + lo + at}: {exc.msg}") from None
        except RecursionError:
            raise ValueError(f"malformed JSON after byte {base + lo}: nesting too deep") from None
        except ValueError as exc:  # NaN/Infinity
            raise ValueError(f"malformed JSON after byte {base + lo}: {exc}") from None

    def _take(self, events: list[Any], at: int) -> list[tuple[int, Any]]:
        cols = self._cols
        details: list[tuple[int, Any]] = []
        sid = self._sid
        for ev in events:
            if type(ev) is not dict:
                raise ValueError(f"malformed JSON after byte {at}: expected an event object")
            ph = ev.get("ph")
            args = ev.get("args")
            if type(args) is not dict:
                args = {}
            if ph == "M":
                if ev.get("name") == "thread_name" and type(args.get("name")) is str:
                    self._threads.append((_as_int(ev.get("pid")), _as_int(ev.get("tid")), sid(args["name"])))
                continue
            if ph != "X" and ph != "i":
                continue
            name = sid(ev.get("name"))
            cols["name_id"].append(name)
            cols["cat_id"].append(sid(ev.get("cat")))
            cols["ph"].append(0 if ph == "X" else 1)
            cols["ts_us"].append(_as_float(ev.get("ts")))
            cols["dur_us"].append(_as_float(ev.get("dur")))
            cols["pid"].append(_as_int(ev.get("pid")))
            cols["tid"].append(_as_int(ev.get("tid")))
            for key, col, small in _INT_ARG_COLUMNS:
                cols[col].append(_as_int(args.get(key), _I32 if small else _I64))
            for key, col in _STR_ARG_COLUMNS:
                cols[col].append(sid(args.get(key)))
            if name >= 0 and self._detail[name]:
                details.append((self._rows, ev))
            self._rows += 1
        return details

    def finish(self) -> tuple[dict[str, array], list[str], list[tuple[int, int, int]]]:
        """See ``_scan.Scanner.finish``."""
        return self._cols, list(self._ids), self._threads


# --------------------------------------------------------------------------- reader

_LEADING_WS = re.compile(rb"[ \t\r\n]*")
_COLON_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\[)?")


def _top_level_key(header: bytes, key: bytes) -> int:
    """Offset just past the ``[`` that opens top-level `key`'s array, or -1 if not seen yet."""
    at = header.find(key)
    while at != -1:
        prefix = header[:at]
        scan = prefix.replace(b"\\\\", b"__").replace(b'\\"', b"__") if b"\\" in prefix else prefix
        _, sign = _structure(prefix)
        if scan.count(b'"') % 2 == 0 and int(sign.sum()) == 1:
            # A match, not a slice: the header may be a whole block.
            m = _COLON_VALUE.match(header, at + len(key))
            if m is not None and m.group(1):
                return m.end()
            if m is not None and m.end() == len(header):
                return -1  # the value has not arrived yet
        at = header.find(key, at + 1)
    return -1


class TraceReader:
    """Feeds the events of a Kineto trace file (``.json`` or ``.json.gz``) to a scanner.

    After `scan`, `metadata` holds every top-level key except ``traceEvents``.

    Raises:
        ConfigError: the file is not gzip/JSON, is truncated or corrupt, has no
            traceEvents array or malformed JSON in it (one line, with the byte offset).
    """

    def __init__(self, path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.chunk_bytes = max(int(chunk_bytes), 1)
        self.metadata: dict[str, Any] = {}

    def _blocks(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            magic = fh.read(2)
            fh.seek(0)
            if magic != b"\x1f\x8b":
                while raw := fh.read(_READ_BYTES):
                    yield raw
                return
            dec = zlib.decompressobj(wbits=31)
            while True:
                raw = dec.unused_data or fh.read(_READ_BYTES >> 3)
                if not raw:
                    break
                if dec.eof:  # a concatenated gzip member follows
                    dec = zlib.decompressobj(wbits=31)
                # max_length bounds each block, whatever the compression ratio.
                while raw:
                    try:
                        out = dec.decompress(raw, _READ_BYTES)
                    except zlib.error as exc:
                        raise invalid(f"trace file {self.path}", "a valid gzip file",
                                      f"corrupt data ({exc})") from None
                    if out:
                        yield out
                    raw = dec.unconsumed_tail
            if not dec.eof:
                raise invalid(f"trace file {self.path}", "a complete gzip file", "a truncated one")

    def _header(self, blocks: Iterator[bytes]) -> tuple[bytes, bytes]:
        """(text before the traceEvents ``[``, the bytes read after it)."""
        header = b""
        start = -1
        for block in blocks:
            header += block
            lead = _LEADING_WS.match(header).end()
            if header[lead:lead + 1] not in (b"{", b""):
                raise self._not_a_trace("it does not start with a JSON object")
            start = _top_level_key(header, b'"traceEvents"')
            if start != -1 or len(header) > _MAX_HEADER_BYTES:
                break
        if start == -1:
            raise self._not_a_trace("no top-level traceEvents array")
        return header[: start - 1], header[start:]

    def scan(self, scanner: EventScanner) -> list[tuple[int, Any]]:
        """Feed the traceEvents array to `scanner`, set `metadata`.

        Returns:
            The ``(row, event)`` details the scanner reported, in file order.
        """
        blocks = self._blocks()
        prefix, rest = self._header(blocks)
        buf = bytearray(rest)
        del rest
        base = len(prefix) + 1  # offset of buf[0] in the (decompressed) file
        details: list[tuple[int, Any]] = []
        want = self.chunk_bytes
        exhausted = False
        while True:
            while len(buf) < want and not exhausted:
                block = next(blocks, None)
                if block is None:
                    exhausted = True
                else:
                    buf += block
            try:
                consumed, close, found = scanner.feed(buf, base)
            except ValueError as exc:
                raise invalid(f"trace file {self.path}", "valid JSON", str(exc)) from None
            details += found
            if close >= 0:
                trailer = bytes(buf[close + 1:])
                break
            if exhausted:
                raise invalid(f"trace file {self.path}", "complete JSON", "a file that ends inside traceEvents")
            if consumed:
                del buf[:consumed]
                base += consumed
                want = self.chunk_bytes
            else:  # an event longer than the chunk: read on, doubling, until it is whole
                want = max(want, 2 * len(buf))
        del buf
        trailer += b"".join(blocks)
        self.metadata = self._metadata(prefix, trailer)
        return details

    def _metadata(self, prefix: bytes, trailer: bytes) -> dict[str, Any]:
        """Decode the top-level object without its traceEvents value."""
        # prefix ends with `"traceEvents":` -> drop the key; trailer starts after `]`.
        head = prefix[: prefix.rfind(b'"traceEvents"')].rstrip(_WS)
        tail = trailer.lstrip(_WS)
        comma_before, comma_after = head.endswith(b","), tail.startswith(b",")
        if comma_before:
            head = head[:-1].rstrip(_WS)
        if comma_after:
            tail = tail[1:].lstrip(_WS)
        first, last = head.endswith(b"{"), tail.startswith(b"}")  # traceEvents is the first/last key
        if comma_before == first or comma_after == last:
            why = "a comma before traceEvents" if comma_before == first else "a comma after traceEvents' array"
            raise invalid(f"trace file {self.path}", "complete JSON", f"a broken top-level object ({why})")
        try:
            meta = json.loads(head + (b"" if first or last else b",") + tail)
        except ValueError as exc:
            raise invalid(f"trace file {self.path}", "complete JSON", f"a broken top-level object ({exc})") from None
        if not isinstance(meta, dict):
            raise self._not_a_trace("the top level is not an object")
        return meta

    def _not_a_trace(self, why: str) -> Exception:
        return invalid(f"trace file {self.path}", "a Kineto/Chrome trace (JSON object with traceEvents)", why)
