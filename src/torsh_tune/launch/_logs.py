"""Splitting torchrun's combined output into per-rank logs and the launcher log.

torchrun (with `--tee 3` and the `[rank${rank}]:` header template) echoes every worker
line with its global rank in front; everything else it prints is its own. One reader
thread files each line and hands it on, unchanged, for the terminal.

Except torchrun's failure report: from torchrun's first warning or error log line
("W1125 01:52:41.871000 7540 torch/distributed/elastic/...": closing signals sent to the
workers, a failed worker) or Python traceback on, its own lines (its `ChildFailedError`
or `SignalException` traceback and the "Root Cause" banner) are held back rather than
handed on. Filed in logs/launcher.log either way, they reach the terminal only when the
supervisor releases them: when the run's outcome cannot say what went wrong without them.
The ranks' lines are always handed on.
"""

from __future__ import annotations

import queue
import re
import threading
from typing import IO

from ..rundir import RunDir

__all__ = ["LogDemux"]

_RANK_PREFIX_RE = re.compile(rb"^\[rank(\d+)\]:")
# torchrun's logging ("W1125 01:52:41.871000 7540 torch/...] ...", glog style) at warning
# level or above, or an uncaught exception in torchrun: the start of its failure report.
_LAUNCHER_ALERT_RE = re.compile(rb"^(?:[WEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ |Traceback \(most recent call last\):)")
_MAX_OPEN_FILES = 128


class LogDemux:
    """Reads a byte stream line by line on a thread; files lines; queues them for display.

    Attributes:
        lines: Lines for the terminal, in order.
        held: torchrun's own lines from its failure report on, not in `lines` (complete
            once `join` returned True).
        saw_rank_output: Whether any rank printed anything.
    """

    def __init__(self, stream: IO[bytes], run_dir: RunDir) -> None:
        self._stream = stream
        self._run_dir = run_dir
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.held: list[str] = []
        self.saw_rank_output = False
        self._rank_files: dict[int, IO[bytes]] = {}
        run_dir.logs.mkdir(parents=True, exist_ok=True)
        self._launcher = open(run_dir.logs / "launcher.log", "ab")
        self._thread = threading.Thread(target=self._run, name="torsh-tune-log-demux", daemon=True)

    def start(self) -> "LogDemux":
        self._thread.start()
        return self

    def join(self, timeout_s: float) -> bool:
        """Wait for end of stream; True when the reader finished."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _rank_file(self, rank: int) -> IO[bytes]:
        f = self._rank_files.get(rank)
        if f is None:
            if len(self._rank_files) >= _MAX_OPEN_FILES:  # huge jobs: stay under fd limits
                self._close_ranks()
            f = self._rank_files[rank] = open(self._run_dir.rank_log(rank), "ab")
        return f

    def _close_ranks(self) -> None:
        for f in self._rank_files.values():
            f.close()
        self._rank_files.clear()

    def _run(self) -> None:
        try:
            for raw in iter(self._stream.readline, b""):
                line = raw.rstrip(b"\r\n")
                m = _RANK_PREFIX_RE.match(line)
                if m:
                    self.saw_rank_output = True
                    f = self._rank_file(int(m.group(1)))
                    f.write(line[m.end() :] + b"\n")
                    f.flush()
                else:
                    self._launcher.write(line + b"\n")
                    self._launcher.flush()
                    if self.held or _LAUNCHER_ALERT_RE.match(line):
                        self.held.append(line.decode("utf-8", errors="replace"))
                        continue
                self.lines.put(line.decode("utf-8", errors="replace"))
        finally:
            self._close_ranks()
            self._launcher.close()
