"""Per-rank, append-only JSONL record files, flushed at least every `flush_interval_s`."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from ..rundir import RunDir
from ._clock import now

__all__ = ["RecordWriter"]

# One encoder for every record: json.dumps with non-default separators builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":")).encode


class _Stream:
    __slots__ = ("path", "file", "pending", "last_flush", "lock")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = None
        self.pending: list[str] = []
        self.last_flush = 0.0
        self.lock = threading.Lock()


class RecordWriter:
    """Buffers record lines per kind and appends them to `ranks/rankNNNNN.<kind>.jsonl`.

    Each kind is written by one thread (steps/comm: the training thread, system: the
    sampler), so a lock per stream only guards against the final `close()`.
    """

    def __init__(self, run_dir: RunDir, rank: int, *, flush_interval_s: float = 1.0) -> None:
        self._run_dir = run_dir
        self._rank = rank
        self._interval = flush_interval_s
        self._streams = {k: _Stream(run_dir.rank_file(rank, k)) for k in ("steps", "comm", "system")}
        run_dir.ranks.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, record: dict[str, Any], *, t: float | None = None) -> None:
        stream = self._streams[kind]
        stream.pending.append(_encode(record))
        t = now() if t is None else t
        if t - stream.last_flush >= self._interval:
            self._flush(stream, t)

    def flush(self) -> None:
        t = now()
        for stream in self._streams.values():
            self._flush(stream, t)

    def close(self) -> None:
        self.flush()
        for stream in self._streams.values():
            with stream.lock:
                if stream.file is not None:
                    stream.file.close()
                    stream.file = None

    @staticmethod
    def _flush(stream: _Stream, t: float) -> None:
        with stream.lock:
            stream.last_flush = t
            if not stream.pending:
                return
            lines, stream.pending = stream.pending, []
            if stream.file is None:
                stream.file = open(stream.path, "a", encoding="utf-8")
            stream.file.write("\n".join(lines) + "\n")
            stream.file.flush()

