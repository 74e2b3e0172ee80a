"""Progress of a running job, read from the ranks' append-only step records.

The supervisor polls `ranks/rank*.steps.jsonl` about twice a second. Only the bytes
appended since the last poll are read; completed lines are counted and only rank 0's
last complete line is parsed (for its latest step time). A torn last line is carried
over to the next poll.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..rundir import RunDir

__all__ = ["Progress", "StepsWatcher"]

_STEPS_RE = re.compile(r"^rank(\d+)\.steps\.jsonl$")
_META_RE = re.compile(r"^rank(\d+)\.meta\.json$")


@dataclass(frozen=True, kw_only=True)
class Progress:
    """A snapshot of a running job.

    Attributes:
        elapsed_s: Seconds since launch.
        steps_done: Complete step records of the slowest rank that reported any.
        ranks_reporting: Ranks whose step file has at least one complete record.
        last_step_s: Rank 0's latest `step_s`, None before its first record.
    """

    elapsed_s: float
    steps_done: int
    ranks_reporting: int
    last_step_s: float | None


class _RankFile:
    __slots__ = ("offset", "lines", "partial")

    def __init__(self) -> None:
        self.offset = 0
        self.lines = 0
        self.partial = b""


class StepsWatcher:
    """Incremental reader of every rank's steps file in a run directory."""

    def __init__(self, run_dir: RunDir) -> None:
        self._run_dir = run_dir
        self._files: dict[int, _RankFile] = {}
        self._up: set[int] = set()  # ranks whose meta.json appeared: the profiler in them started
        self.last_step_s: float | None = None

    def poll(self) -> bool:
        """Read what was appended since the last call; True when any steps file grew or a rank came up.

        A rank coming up (its meta.json, written before the script runs) is progress too: the start-up
        before it (imports, torchrun's rendezvous) is not the script hanging, and on a loaded host it
        can take most of a short no-progress timeout.
        """
        grew = False
        try:
            entries = list(self._run_dir.ranks.iterdir())
        except FileNotFoundError:
            return False
        for path in entries:
            m = _STEPS_RE.match(path.name)
            if m:
                grew |= self._read_new(int(m.group(1)), path)
                continue
            m = _META_RE.match(path.name)
            if m and int(m.group(1)) not in self._up:
                self._up.add(int(m.group(1)))
                grew = True
        return grew

    def _read_new(self, rank: int, path: Path) -> bool:
        state = self._files.setdefault(rank, _RankFile())
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False
        if size < state.offset:  # rewritten from scratch (a restart): start over
            state.offset, state.lines, state.partial = 0, 0, b""
        if size == state.offset:
            return False
        with path.open("rb") as f:
            f.seek(state.offset)
            data = f.read(size - state.offset)
        state.offset += len(data)
        data = state.partial + data
        complete, sep, state.partial = data.rpartition(b"\n")
        if sep:
            state.lines += complete.count(b"\n") + 1
            if rank == 0:
                self._note_rank0(complete.rsplit(b"\n", 1)[-1])
        return True

    def _note_rank0(self, line: bytes) -> None:
        try:
            value = json.loads(line).get("step_s")
        except (ValueError, AttributeError):
            return  # a malformed record is the analysis' business, not the supervisor's
        if isinstance(value, (int, float)):
            self.last_step_s = float(value)

    def snapshot(self, elapsed_s: float) -> Progress:
        counts = [s.lines for s in self._files.values() if s.lines > 0]
        return Progress(
            elapsed_s=elapsed_s,
            steps_done=min(counts) if counts else 0,
            ranks_reporting=len(counts),
            last_step_s=self.last_step_s,
        )
