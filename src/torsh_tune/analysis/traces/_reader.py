"""Streaming byte-level reader of Kineto JSON: yields buffers of whole trace events.

A Kineto trace is one JSON object whose ``traceEvents`` array holds every event. Instead
of ``json.load`` (one Python dict per event, ~1 KB each), the file is decompressed in
blocks and a vectorised structural scan (numpy over the bytes) finds where each event
object starts and ends. Callers hand those byte spans to a columnar JSON reader. The
other top-level keys (``distributedInfo``, ``deviceProperties``...) are small and are
decoded with ``json`` at the end.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import invalid

__all__ = ["EventChunk", "TraceReader", "event_bounds"]

_READ_BYTES = 4 << 20
# Decompressed bytes gathered before a chunk is scanned and parsed; bounds peak memory.
CHUNK_BYTES = 8 << 20
# A JSON document whose traceEvents key is not found in this many bytes is not a trace.
_MAX_HEADER_BYTES = 256 << 20
_WS = b" \t\r\n"


class EventChunk:
    """`data[starts[i] : ends[i] + 1]` is the JSON text of event i (ends are the ``}``)."""

    __slots__ = ("data", "starts", "ends")

    def __init__(self, data: bytes, starts: np.ndarray, ends: np.ndarray) -> None:
        self.data = data
        self.starts = starts
        self.ends = ends


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
    ``(starts, ends, close)`` where ``close`` is the offset of the array's ``]`` or -1
    when the array continues past `data`; a trailing incomplete event is left out.
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


def _top_level_key(header: bytes, key: bytes) -> int:
    """Offset just past the ``[`` that opens top-level `key`'s array, or -1 if not seen yet."""
    at = header.find(key)
    while at != -1:
        prefix = header[:at]
        scan = prefix.replace(b"\\\\", b"__").replace(b'\\"', b"__") if b"\\" in prefix else prefix
        _, sign = _structure(prefix)
        if scan.count(b'"') % 2 == 0 and int(sign.sum()) == 1:
            rest = header[at + len(key):].lstrip(_WS)
            if rest[:1] == b":":
                rest2 = rest[1:].lstrip(_WS)
                if rest2[:1] == b"[":
                    return len(header) - len(rest2) + 1
                if rest2 == b"":
                    return -1  # the value has not arrived yet
        at = header.find(key, at + 1)
    return -1


class TraceReader:
    """Iterates a Kineto trace file (``.json`` or ``.json.gz``) as `EventChunk`s.

    After iteration, `metadata` holds every top-level key except ``traceEvents``.

    Raises:
        ConfigError: the file is not gzip/JSON, is truncated, or has no traceEvents array.
    """

    def __init__(self, path: Path, *, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self.chunk_bytes = chunk_bytes
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

    def __iter__(self) -> Iterator[EventChunk]:
        blocks = self._blocks()
        header = b""
        start = -1
        for block in blocks:
            header += block
            if not header.lstrip(_WS)[:1] in (b"{", b""):
                raise self._not_a_trace("it does not start with a JSON object")
            start = _top_level_key(header, b'"traceEvents"')
            if start != -1:
                break
            if len(header) > _MAX_HEADER_BYTES:
                break
        if start == -1:
            raise self._not_a_trace("no top-level traceEvents array")
        prefix, carry = header[: start - 1], header[start:]
        del header
        trailer = b""
        closed = False
        exhausted = False
        while not closed:
            if len(carry) < self.chunk_bytes and not exhausted:
                parts = [carry]
                size = len(carry)
                for block in blocks:
                    parts.append(block)
                    size += len(block)
                    if size >= self.chunk_bytes:
                        break
                else:
                    exhausted = True
                carry = b"".join(parts)
            starts, ends, close = event_bounds(carry)
            if ends.size:
                yield EventChunk(carry, starts, ends)
            if close != -1:
                closed = True
                trailer = carry[close + 1:]
            elif exhausted:
                raise invalid(f"trace file {self.path}", "complete JSON", "a file that ends inside traceEvents")
            else:
                carry = carry[int(ends[-1]) + 1:] if ends.size else carry
        trailer += b"".join(blocks)
        self.metadata = self._metadata(prefix, trailer)

    def _metadata(self, prefix: bytes, trailer: bytes) -> dict[str, Any]:
        """Decode the top-level object without its traceEvents value."""
        # prefix ends with `"traceEvents":` -> drop the key; trailer starts after `]`.
        head = prefix[: prefix.rfind(b'"traceEvents"')].rstrip(_WS)
        if head.endswith(b","):
            head = head[:-1]
        tail = trailer.lstrip(_WS)
        if tail.startswith(b","):
            tail = tail[1:].lstrip(_WS)
        sep = b"" if head.endswith(b"{") or tail.startswith(b"}") else b","
        try:
            meta = json.loads(head + sep + tail)
        except ValueError as exc:
            raise invalid(f"trace file {self.path}", "complete JSON", f"a broken top-level object ({exc})") from None
        if not isinstance(meta, dict):
            raise self._not_a_trace("the top level is not an object")
        return meta

    def _not_a_trace(self, why: str) -> Exception:
        return invalid(f"trace file {self.path}", "a Kineto/Chrome trace (JSON object with traceEvents)", why)
