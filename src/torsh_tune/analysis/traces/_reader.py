"""Streaming byte-level reader of Kineto JSON: yields buffers of whole trace events.

A Kineto trace is one JSON object whose ``traceEvents`` array holds every event. Instead
of ``json.load`` (one Python dict per event, ~1 KB each), the file is decompressed in
blocks and cut into chunks of whole events that a columnar JSON reader parses.

Two ways to find the events of a chunk:

- fast (`separator_candidates`): every ``}`` ws ``,`` ws ``{`` is taken for the comma
  between two events. One byte compare over the chunk plus work on the few ``{``
  positions. A false candidate (inside a string, or between objects nested in an event)
  always leaves the parser an unterminated string or unbalanced brackets, so the parse
  fails and the chunk is redone exactly: the guess never changes a result.
- exact (`event_bounds`): a structural scan that tracks strings and nesting depth.

The other top-level keys (``distributedInfo``, ``deviceProperties``...) are small and are
decoded with ``json`` at the end.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ...errors import invalid

__all__ = ["EventChunk", "TraceReader", "event_bounds", "separator_candidates"]

T = TypeVar("T")

_READ_BYTES = 4 << 20
# Decompressed bytes gathered before a chunk is scanned and parsed; bounds peak memory.
CHUNK_BYTES = 8 << 20
# A JSON document whose traceEvents key is not found in this many bytes is not a trace.
_MAX_HEADER_BYTES = 256 << 20
_WS = b" \t\r\n"


class EventChunk:
    """`data[starts[i] : ends[i] + 1]` is the JSON text of event i.

    ``exact`` chunks come from `event_bounds` (ends are the ``}``); the others from
    `separator_candidates`: an event's span may carry surrounding whitespace, and a
    parser must raise ValueError when a span is not one JSON object (see module doc).
    """

    __slots__ = ("data", "starts", "ends", "exact")

    def __init__(self, data: bytes, starts: np.ndarray, ends: np.ndarray, *, exact: bool = True) -> None:
        self.data = data
        self.starts = starts
        self.ends = ends
        self.exact = exact


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


_LEADING_WS = re.compile(rb"[ \t\r\n]*")
_COLON_VALUE = re.compile(rb"[ \t\r\n]*:[ \t\r\n]*(\[)?")
_IS_WS = np.zeros(256, dtype=bool)
_IS_WS[list(_WS)] = True
# Longest whitespace run skipped between two events; a longer one only costs the fast path.
_MAX_GAP = 64


def _skip_ws_back(a: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """For each position, the nearest position at or before it that is not whitespace (-1: none)."""
    pos = pos.copy()
    for _ in range(_MAX_GAP):
        ws = pos >= 0
        ws[ws] = _IS_WS[a[pos[ws]]]
        if not ws.any():
            break
        pos[ws] -= 1
    return pos


def separator_candidates(data: bytes) -> np.ndarray:
    """Offsets of each ``,`` that has ``}`` before and ``{`` after it, whitespace aside.

    Between two events of the traceEvents array there is always such a comma; inside
    strings or nested values there may be more (see module doc).
    """
    a = np.frombuffer(data, dtype=np.uint8)
    opens = np.flatnonzero(a == 123)
    comma = _skip_ws_back(a, opens - 1)
    comma = comma[comma >= 0]
    comma = comma[a[comma] == 44]
    close = _skip_ws_back(a, comma - 1)
    ok = close >= 0
    ok[ok] = a[close[ok]] == 125
    return comma[ok]


def _top_level_key(header: bytes, key: bytes) -> int:
    """Offset just past the ``[`` that opens top-level `key`'s array, or -1 if not seen yet."""
    at = header.find(key)
    while at != -1:
        prefix = header[:at]
        scan = prefix.replace(b"\\\\", b"__").replace(b'\\"', b"__") if b"\\" in prefix else prefix
        _, sign = _structure(prefix)
        if scan.count(b'"') % 2 == 0 and int(sign.sum()) == 1:
            # A match, not a slice: the header may be a whole 4 MB block.
            m = _COLON_VALUE.match(header, at + len(key))
            if m is not None and m.group(1):
                return m.end()
            if m is not None and m.end() == len(header):
                return -1  # the value has not arrived yet
        at = header.find(key, at + 1)
    return -1


def _fast_cut(carry: bytes, exhausted: bool) -> tuple[EventChunk, int, int] | None:
    """The leading events of `carry` cut at separator candidates, or None (cut exactly).

    Returns ``(chunk, rest, close)``: the next chunk starts at ``carry[rest:]``; ``close``
    is the offset of the array's ``]`` when the chunk holds the last event, else -1.
    """
    seps = separator_candidates(carry)
    close = -1
    if exhausted:
        # The last event and the array's end: an exact scan of the short tail.
        tail_at = int(seps[-1]) + 1 if seps.size else 0
        _, tail_ends, tail_close = event_bounds(carry[tail_at:])
        if tail_close == -1 or tail_ends.size != 1:
            return None
        last_end = tail_at + int(tail_ends[0])
        close = tail_at + tail_close
        inner = seps
        rest = last_end + 1
    else:
        if seps.size == 0:
            return None
        inner, last_end = seps[:-1], int(seps[-1]) - 1
        rest = int(seps[-1]) + 1
    starts = np.concatenate(([0], inner + 1))
    ends = np.concatenate((inner - 1, [last_end]))
    return EventChunk(carry, starts, ends, exact=False), rest, close


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
        """The file's events as exact chunks (`read` is the fast way)."""
        return self.read(lambda chunk: chunk, fast=False)

    def read(self, parse: Callable[[EventChunk], T], *, fast: bool = True) -> Iterator[T]:
        """``parse(chunk)`` for each chunk of whole events, in file order.

        With ``fast``, chunks are cut at `separator_candidates`; when `parse` raises
        ValueError on such a chunk, the same bytes are cut exactly and parsed again, and
        the rest of the file is read exactly. After iteration `metadata` is set.
        """
        blocks = self._blocks()
        header = b""
        start = -1
        for block in blocks:
            header += block
            lead = _LEADING_WS.match(header).end()
            if header[lead:lead + 1] not in (b"{", b""):
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
                del parts
            cut = _fast_cut(carry, exhausted) if fast else None
            if cut is not None:
                chunk, rest, close = cut
                try:
                    result = parse(chunk)
                except ValueError:
                    fast = False  # a false separator: this trace is read exactly from here on
                else:
                    yield result
                    if close != -1:
                        closed, trailer = True, carry[close + 1:]
                    else:
                        carry = carry[rest:]
                    continue
            starts, ends, close = event_bounds(carry)
            if ends.size:
                yield parse(EventChunk(carry, starts, ends))
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
