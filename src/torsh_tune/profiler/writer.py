"""Per-rank, append-only JSONL record files, written by a thread of their own at least every `flush_interval_s`."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..rundir import RunDir
from ._clock import offset as _clock_offset

try:  # the records' lines, the same characters as `_line` writes, 6-8x cheaper (setup.py)
    from ._lines import record_lines as _c_record_lines
except ImportError:  # not built (no C compiler, another Python): `_line` writes them
    _c_record_lines = None

__all__ = ["RecordWriter", "SharedFields", "host_call_values"]

_OFFSET = _clock_offset()

# One encoder for every record: json.dumps with non-default separators builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


class SharedFields(dict):
    """Fields that many records share (a collective's op, group, issuer, dtype, clock...), encoded once.

    A record that carries one under the key `_s` holds only what changes per call; its line is
    the shared fields' JSON followed by the record's own. Readers in the process look the
    shared fields up here (`record["_s"]["issuer"]`). Encoding a whole 20-field record per
    collective was the largest part of the probes' per-collective cost.
    """

    __slots__ = ("json", "prefix")

    def __init__(self, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.json = _encode(fields)[1:-1]
        # What a line of a synchronous host-clock call kept as a tuple (`host_call_values`, the most common
        # collective record) starts with; `_line` appends the call's own fields.
        self.prefix = "{" + (self.json + "," if self.json else "")


# The per-call fields of a synchronous host-clock collective's record, in the order `host_call_values` gives them.
HOST_CALL_FIELDS = ("step", "seq", "bytes", "wire_bytes", "t_issue", "blocked_s", "duration_s", "t_complete")


def host_call_values(call: tuple) -> tuple:
    """The `HOST_CALL_FIELDS` values of a synchronous host-clock call the capture kept as a tuple.

    The tuple holds numbers only, so that the cyclic GC stops tracking it: (its call site's index
    in the tracker's `call_sites`, step, seq, bytes, perf_counter at issue, at return). The tracker
    accounts for it and the writer writes its line (`RecordWriter.write_calls`) from the tuple.
    """
    _, step, seq, nbytes, t0, t1 = call
    d = t1 - t0
    return step, seq, nbytes, nbytes, t0 + _OFFSET, d, d, t1 + _OFFSET


class _Stream:
    __slots__ = ("path", "file", "pending", "lock")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None
        self.pending: list[dict[str, Any] | tuple] = []  # records not yet encoded (list.append is atomic)
        self.lock = threading.Lock()  # one encoder and file writer at a time


def _line(record: dict[str, Any] | tuple, call_sites: list[tuple[SharedFields, str]]) -> str:
    if type(record) is tuple:  # a synchronous host-clock call (`host_call_values`)
        # Written by one f-string, times in fixed point: Unix seconds to 0.1 us (a float64 holds 0.24 us of
        # a Unix time between 2004 and 2038, so the line reads back as the same float), durations to 1 ns.
        # `repr` of those floats (the shortest round trip: 17 digits) was half the instructions of a
        # collective's probes, ~2 us of its ~2.3 us line (benchmarks/probe_instructions.py, BENCHMARKS.md).
        i, step, seq, nbytes, t0, t1 = record
        d = f"{t1 - t0:.9f}"
        return (f'{call_sites[i][0].prefix}"step":{step},"seq":{seq},"bytes":{nbytes},"wire_bytes":{nbytes},'
                f'"t_issue":{t0 + _OFFSET:.7f},"blocked_s":{d},"duration_s":{d},"t_complete":{t1 + _OFFSET:.7f}}}')
    shared = record.get("_s")
    line = _encode_record(record)
    if shared:  # no fields shared: the record's own line as it is
        line = "{" + shared.json + ("," + line[1:] if len(line) > 2 else "}")
    return line


# Float fields written in fixed point, by name: Unix times to 0.1 us (read back as the same float, as a host
# call's), durations (`*_s`, not rates `*_per_s`) to 1 ns. Any other float (a loss, a percentage, a rate)
# keeps json's shortest round trip.
_UNIX_TIMES = frozenset({"t", "t_since", "t_start", "t_end", "t_issue", "t_complete"})
_FIXED_POINT: dict[str, int] = {}  # field name -> 7 (Unix time), 9 (duration) or 0 (neither), learned per name


def _fixed_point(key: str) -> int:
    duration = key.endswith("_s") and not key.endswith("_per_s") and key.isidentifier()
    digits = 7 if key in _UNIX_TIMES else 9 if duration else 0
    _FIXED_POINT[key] = digits
    return digits


def _encode_record(record: dict[str, Any]) -> str:
    """A record's JSON object, its time and duration floats in fixed point (`_FIXED_POINT`) after the rest.

    A step record holds ~15 of them; their `repr` (17 digits) was ~60 % of what encoding it cost.
    """
    fixed: list[str] = []
    rest: dict[str, Any] = {}
    known = _FIXED_POINT
    for key, value in record.items():
        if key == "_s":  # the shared fields: the line's start (`_line`)
            continue
        # finite floats only: NaN and infinities keep json's spelling
        if type(value) is float and -1e15 < value < 1e15:
            digits = known.get(key)
            if digits is None:
                digits = _fixed_point(key)
            if digits == 7:
                fixed.append(f'"{key}":{value:.7f}')
                continue
            if digits == 9:
                fixed.append(f'"{key}":{value:.9f}')
                continue
        rest[key] = value
    line = _encode(rest)
    if not fixed:
        return line
    return (line[:-1] + "," if len(line) > 2 else "{") + ",".join(fixed) + "}"


class RecordWriter:
    """Queues records per kind and appends them to `ranks/rankNNNNN.<kind>.jsonl`.

    `write()` only appends the record to a list: encoding and file writes happen on the
    writer's own thread, every `flush_interval_s` and at `flush()`/`close()`, so the training
    thread pays neither (json encoding was most of the probes' cost per collective); so does
    making a step's records from its times (`finish_later`), before they are encoded. The
    thread gives the GIL back every few records, so a training thread that wants it waits
    tens of microseconds, not a switch interval. A record must not change once written.
    A failure to write is kept and raised by `close()`, never swallowed.
    """

    _YIELD_EVERY = 16  # records encoded between GIL hand-backs
    _C_RUN = 64  # records per call of the C writer (~0.2-1 us each) between GIL hand-backs

    def __init__(self, run_dir: RunDir, rank: int, *, flush_interval_s: float = 1.0) -> None:
        self._run_dir = run_dir
        self._rank = rank
        self._interval = flush_interval_s
        self._streams = {k: _Stream(run_dir.rank_file(rank, k)) for k in ("steps", "comm", "system")}
        run_dir.ranks.mkdir(parents=True, exist_ok=True)
        self.error: BaseException | None = None
        self._call_sites: list[tuple[SharedFields, str]] = []
        # Steps whose records are made here (`finish_later`): (finish, entry), appended by the training thread.
        self._entries: list[tuple[Callable[[Any], None], Any]] = []
        self._entries_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"torsh-writer-{rank}", daemon=True)
        self._thread.start()

    def write(self, kind: str, record: dict[str, Any]) -> None:
        """Queue one record (its `_s` shared fields are encoded with it); the writer thread writes it."""
        self._streams[kind].pending.append(record)

    def write_calls(self, calls: list[tuple], call_sites: list[tuple[SharedFields, str]]) -> None:
        """Queue the CommRecords of synchronous host-clock calls, as the capture kept them (`host_call_values`).

        `call_sites`: the table their first field indexes (the tracker's, always the same list).
        """
        self._call_sites = call_sites
        self._streams["comm"].pending.extend(calls)

    def finish_later(self, finish: Callable[[Any], None], entry: Any) -> None:
        """Have `finish(entry)` called on the writer's thread, before its next write of the queued records.

        The tracker hands over the steps whose records need nothing from the training thread any more
        (`StepTracker._write_ready`): `finish` makes their records and queues them here with `write`.
        """
        self._entries.append((finish, entry))

    def flush(self) -> None:
        """Write every queued record now, on the calling thread."""
        self._finish_entries(yield_gil=False)
        for stream in self._streams.values():
            self._flush(stream, yield_gil=False)

    def _finish_entries(self, *, yield_gil: bool) -> None:
        # One finisher at a time (the writer's thread, or flush() after a join that timed out), so that
        # the steps' lines keep their order. The training thread only appends: it never waits for this lock.
        with self._entries_lock:
            n = len(self._entries)
            jobs = self._entries[:n]
            del self._entries[:n]  # appended meanwhile: kept for the next pass
            for finish, entry in jobs:
                try:
                    finish(entry)
                except Exception as exc:  # noqa: BLE001 - kept for close(), which raises it; the other steps go on
                    self.error = self.error or exc
                if yield_gil:  # a step's record is tens of µs of Python: the GIL goes back after each
                    time.sleep(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=max(5.0, 2 * self._interval))
        try:
            self.flush()
        except OSError as exc:
            self.error = self.error or exc
        for stream in self._streams.values():
            with stream.lock:
                if stream.file is not None:
                    stream.file.close()
                    stream.file = None
        if self.error is not None:
            raise OSError(f"records of rank {self._rank} could not all be written: {self.error}") from self.error

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._finish_entries(yield_gil=True)
                for stream in self._streams.values():
                    self._flush(stream, yield_gil=True)
            except Exception as exc:  # noqa: BLE001 - kept for close(), which raises it
                self.error = self.error or exc

    def _lines(self, records: list[dict[str, Any] | tuple], *, yield_gil: bool) -> list[str]:
        """The records' lines, in order: through the C writer (`_lines.c`) where it is built, `_C_RUN` at a time, and
        what it turns down (a record it does not know how to write exactly as `_line` does) through `_line`."""
        sites = self._call_sites
        if _c_record_lines is None:
            lines: list[str] = []
            for i, record in enumerate(records, 1):
                line = self._python_line(record, sites)
                if line is not None:
                    lines.append(line)
                if yield_gil and i % self._YIELD_EVERY == 0:
                    time.sleep(0)
            return lines
        prefixes = [site[0].prefix for site in sites]
        lines = []
        for i in range(0, len(records), self._C_RUN):
            run = records[i:i + self._C_RUN]
            for record, line in zip(run, _c_record_lines(run, prefixes, _OFFSET, _FIXED_POINT)):
                if line is None:
                    line = self._python_line(record, sites)
                if line is not None:
                    lines.append(line)
            if yield_gil:
                time.sleep(0)
        return lines

    def _python_line(self, record: dict[str, Any] | tuple, sites: list[tuple[SharedFields, str]]) -> str | None:
        try:
            return _line(record, sites)
        except (TypeError, ValueError, IndexError) as exc:  # one record that is not JSON: the others are still written
            self.error = self.error or exc
            return None

    def _flush(self, stream: _Stream, *, yield_gil: bool) -> None:
        with stream.lock:
            if not stream.pending:
                return
            n = len(stream.pending)
            records = stream.pending[:n]
            del stream.pending[:n]  # appended meanwhile: kept for the next flush
            lines = self._lines(records, yield_gil=yield_gil)
            if not lines:
                return
            if stream.file is None:
                stream.file = open(stream.path, "a", encoding="utf-8")
            stream.file.write("\n".join(lines) + "\n")
            stream.file.flush()
