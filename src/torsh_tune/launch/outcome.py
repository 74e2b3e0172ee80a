"""How a run ended: `RunOutcome` and the classification of a finished torchrun.

Evidence, strongest first: the supervisor's own decision to stop the run (timeout, hang,
interrupt); the ranks' `exit.json` records (written by the runtime); torchrun's failure
summary ("Root Cause (first observed failure)") in logs/launcher.log, which names the
global rank and its exit code or signal; torchrun's return code; the rank logs.

A failing rank's exception (its exit record, else its log) refines a failure:

- `oom`: `MemoryError`, `torch.OutOfMemoryError` ("CUDA out of memory. Tried to allocate
  ..."), "CUDA error: out of memory", NCCL's "Cuda failure 'out of memory'", the CPU
  allocator's "DefaultCPUAllocator: can't allocate memory". A rank SIGKILLed by the
  kernel's OOM killer leaves no such trace: it is a `signal`.
- `collective_timeout`: gloo's "Timed out waiting 2000ms for recv operation to complete"
  (a peer never entered the collective within `strategy.distributed.timeout_s`) and
  NCCL's "Watchdog caught collective operation timeout" (the watchdog then aborts the
  rank with SIGABRT, so it is looked for in the log of a signalled rank too).

A peer's "Connection closed by peer" / "Connection reset by peer" (gloo) only says that
another rank went away: another rank's own error is preferred as the cause.

Every rank wrote a clean exit record (ok/budget) but torchrun still reports a failure:
that is the abort at interpreter exit seen on about one gloo run in eight, after the work
was done. The measurement is valid, so the run is `ok` with an `exit_abort` warning.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal as _signal
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..records import ranges_text
from ..rundir import RunDir

__all__ = ["RUN_STATUSES", "RunOutcome", "TorchrunFailure", "classify_run", "drop_empty_stacks",
           "parse_torchrun_failures"]

#: Every status a run can end with.
RUN_STATUSES = (
    "ok",
    "config_error",
    "script_error",
    "oom",
    "collective_timeout",
    "signal",
    "timeout",
    "hang",
    "pruned",
    "interrupted",
    "launch_error",
)

_TAIL_LINES = 20
#: How far back a signalled rank's log is searched for an OOM or watchdog message.
_SCAN_LINES = 200
_DONE = ("ok", "budget")

# Out of memory as PyTorch, the CUDA runtime, NCCL and the CPU allocator word it.
_OOM_TYPES = frozenset({"MemoryError", "OutOfMemoryError"})
_OOM_RE = re.compile(
    r"\b(?:CUDA|HIP|XPU|MPS backend) out of memory"
    r"|CUDA error: out of memory"
    r"|Cuda failure '?out of memory"
    r"|DefaultCPUAllocator: can't allocate memory"
    r"|(?:^|[\s.:'])(?:OutOfMemoryError|MemoryError)\b"
)
# A collective that did not complete in time: gloo (transport/tcp/unbound_buffer.cc) and
# NCCL's watchdog (ProcessGroupNCCL.cpp).
_COLLECTIVE_TIMEOUT_RE = re.compile(
    r"Timed out waiting \d+ ?ms for (?:recv|send) operation"
    r"|Watchdog caught collective operation timeout"
)
# A rank whose peer went away: the symptom of another rank's failure, not a cause.
_PEER_LOST_RE = re.compile(
    r"Connection closed by peer|Connection reset by peer|remote process exited or there was a network error"
)
# torch prefixes the lines of an uncaught exception in a distributed rank with "[rankN]: ".
_RANK_PREFIX_RE = re.compile(r"^\[rank\d+\]:\s?")


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """How one launched run ended.

    Attributes:
        status: One of `RUN_STATUSES`.
        returncode: torchrun's (or the launcher template's) exit status; None if it never started.
        failing_rank: Global rank that failed first, when one did.
        message: One line for the user, e.g. "ValueError: boom" or "rank 1 was killed by SIGKILL".
        stderr_tail: Last lines of the failing rank's log (or of launcher.log).
        duration_s: Wall time from launch to the end of supervision.
        signal: Name of the signal that killed the failing rank (e.g. "SIGKILL"), if any.
        ranks: Global rank -> how that rank ended: an exit.json status (ok, budget, error,
            config_error), or "signal", "terminated" (stopped by torchrun after another
            rank failed), "stopped" (stopped by the supervisor), "unknown".
        warnings: Problems that do not make the run a failure, each "kind: explanation"
            (e.g. "exit_abort: ..." for an abort after every rank finished).
        stacks: Ranks that left every Python thread's stack in ranks/rankNNNNN.stacks.txt
            (`runtime.bootstrap`): those that died of a fatal signal (SIGSEGV, SIGABRT, ...; a
            signalled root's message names its file), and on a hang or a timeout those the
            supervisor asked before the stop (the message names them).
    """

    status: str
    returncode: int | None
    failing_rank: int | None = None
    message: str = ""
    stderr_tail: tuple[str, ...] = ()
    duration_s: float = 0.0
    signal: str | None = None
    ranks: dict[int, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    stacks: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.status in RUN_STATUSES, self.status

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (rank keys become strings in JSON, as any JSON object key does)."""
        d = asdict(self)
        d["stderr_tail"] = list(self.stderr_tail)
        d["warnings"] = list(self.warnings)
        d["stacks"] = list(self.stacks)
        d["ranks"] = {str(k): v for k, v in sorted(self.ranks.items())}
        return d


@dataclass(frozen=True, kw_only=True)
class TorchrunFailure:
    """One entry of torchrun's ChildFailedError summary."""

    rank: int
    exitcode: int
    root_cause: bool
    time: str = ""

    @property
    def signal(self) -> str | None:
        return _signal_name(-self.exitcode) if self.exitcode < 0 else None


def _signal_name(num: int) -> str:
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_TIME_RE = re.compile(r"^\s*time\s*:\s*(\S+)")
_ENTRY_RE = re.compile(r"^\[\d+\]:\s*$")


def parse_torchrun_failures(text: str) -> list[TorchrunFailure]:
    """Parse the failure summaries torchrun prints when workers fail (one per node)."""
    failures: list[TorchrunFailure] = []
    section: str | None = None  # "failures" | "root"
    entry: dict[str, Any] | None = None

    def flush() -> None:
        nonlocal entry
        if entry is not None and "rank" in entry and "exitcode" in entry:
            failures.append(
                TorchrunFailure(
                    rank=entry["rank"],
                    exitcode=entry["exitcode"],
                    root_cause=section == "root",
                    time=entry.get("time", ""),
                )
            )
        entry = None

    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "Failures:":
            flush()
            section = "failures"
        elif stripped.startswith("Root Cause"):
            flush()
            section = "root"
        elif stripped.startswith("====="):
            flush()
            section = None
        elif section is None:
            continue
        elif _ENTRY_RE.match(stripped) or stripped.startswith("-----"):
            flush()
            entry = {} if _ENTRY_RE.match(stripped) else None
        elif entry is not None:
            for key, rx in (("rank", _RANK_RE), ("exitcode", _EXIT_RE), ("time", _TIME_RE)):
                m = rx.match(line)
                if m:
                    entry[key] = m.group(1) if key == "time" else int(m.group(1))
    flush()
    return failures


def read_exit_records(run_dir: RunDir) -> dict[int, dict[str, Any]]:
    """Every rank's exit.json that exists and parses (a killed rank writes none)."""
    out: dict[int, dict[str, Any]] = {}
    for rank in run_dir.rank_ids():
        path = run_dir.rank_file(rank, "exit")
        try:
            rec = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict):
            out[rank] = rec
    return out


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []


def _stacks_files(run_dir: RunDir) -> list[tuple[int, Path, int]]:
    """(rank, path, size) of the ranks' stacks files (`runtime.bootstrap`)."""
    found = []
    for path in run_dir.ranks.glob("rank*.stacks.txt") if run_dir.ranks.is_dir() else ():
        m = re.match(r"rank(\d+)\.", path.name)
        try:
            if m:
                found.append((int(m.group(1)), path, path.stat().st_size))
        except OSError:
            pass
    return found


def drop_empty_stacks(run_dir: RunDir) -> None:
    """Remove the ranks' stacks files that stayed empty (no fatal signal): call once every rank process ended."""
    for _, path, size in _stacks_files(run_dir):
        if size == 0:
            with contextlib.suppress(OSError):
                path.unlink()


def _stacks(run_dir: RunDir) -> dict[int, str]:
    """Rank -> its stacks file relative to the run directory, for the ranks that wrote one."""
    return {rank: str(path.relative_to(run_dir.path)) for rank, path, size in _stacks_files(run_dir) if size}


_FRAME_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in ')
_BOOTSTRAP = str(Path("torsh_tune", "runtime", "bootstrap.py"))


def _script_line(dump: str, script: str) -> str | None:
    """Where a faulthandler dump has the training thread in the script: "train.py:57", or None.

    The training thread is the one whose stack runs through torsh-tune's bootstrap (the last such in
    the file: a stop's dump may be followed by a crash's), else, when faulthandler cut a stack deeper
    than 100 frames before it reached the bootstrap, the last thread with a frame in the script. The
    line is that thread's innermost frame in `script` (a collective or a sleep called from there is
    below it, in torch or Python).
    """
    threads: list[list[tuple[str, int]]] = []
    frames: list[tuple[str, int]] | None = None
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")):
            frames = []
            threads.append(frames)
        elif frames is not None and (m := _FRAME_RE.match(line)):
            frames.append((m["file"], int(m["line"])))
        else:
            frames = None
    training = ([t for t in threads if any(f.endswith(_BOOTSTRAP) for f, _ in t)]
                or [t for t in threads if any(f == script for f, _ in t)])
    if not training:
        return None
    return next((f"{Path(f).name}:{n}" for f, n in training[-1] if f == script), None)


def _ranks_text(ranks: list[int]) -> str:
    """"rank 3", "ranks 0, 2-5"."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {ranges_text(ranks)}"


def _where_ranks_were(run_dir: RunDir, stacks: dict[int, str]) -> dict[int, str]:
    """Rank -> its training thread's line in the script ("train.py:57"), for the ranks whose stacks show it."""
    from .runinfo import read_run_info  # it imports this module

    try:
        script = read_run_info(run_dir).get("script")
    except (OSError, ValueError, AttributeError):
        return {}
    where = {}
    for rank, rel in stacks.items():
        try:
            at = _script_line((run_dir.path / rel).read_text(errors="replace"), str(script))
        except OSError:
            continue
        if at is not None:
            where[rank] = at
    return where


def _tail(path: Path, n: int = _TAIL_LINES) -> tuple[str, ...]:
    return tuple(_read_lines(path)[-n:])


def _last_exception_line(lines: list[str] | tuple[str, ...]) -> str:
    """The "Type: message" line closing the last Python traceback in a log, or ""."""
    lines = [_RANK_PREFIX_RE.sub("", line) for line in lines]
    start = None
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            start = i
    if start is None:
        return ""
    for line in lines[start + 1 :]:
        # Frames are indented; the first unindented line closes the (last) traceback.
        if line and not line.startswith((" ", "\t")):
            return line.strip()
    return ""


def _exception_lines(text: str) -> list[str]:
    """The unindented lines of a traceback or log (rank prefixes removed).

    In a traceback those are each chained exception's "Type: message"; the frames' source
    lines are indented, so `raise MemoryError(...)` in a frame does not count.
    """
    out = []
    for line in text.splitlines():
        line = _RANK_PREFIX_RE.sub("", line)
        if line and not line[0].isspace() and not line.startswith(
            ("Traceback (most recent call last)", "During handling of", "The above exception")
        ):
            out.append(line)
    return out


def _error_message(rec: dict[str, Any]) -> str:
    etype, msg = rec.get("error_type") or "", rec.get("message") or ""
    return f"{etype}: {msg}" if etype and msg else (etype or msg)


def _failure_kind(texts: list[str] | tuple[str, ...], error_type: str = "") -> str:
    """"oom", "collective_timeout" or "script_error" for a failing rank's exception text."""
    if error_type in _OOM_TYPES or any(_OOM_RE.search(t) for t in texts):
        return "oom"
    if any(_COLLECTIVE_TIMEOUT_RE.search(t) for t in texts):
        return "collective_timeout"
    return "script_error"


def _record_kind(rec: dict[str, Any]) -> str:
    texts = [_error_message(rec), *_exception_lines(str(rec.get("traceback") or ""))]
    return _failure_kind(texts, str(rec.get("error_type") or ""))


def _peer_lost(rec: dict[str, Any]) -> bool:
    return bool(_PEER_LOST_RE.search(_error_message(rec)))


def classify_run(
    run_dir: RunDir,
    *,
    world_size: int,
    returncode: int | None,
    duration_s: float,
    stopped: str | None = None,
    stop_message: str = "",
    launch_failure: str | None = None,
    saw_rank_output: bool = True,
) -> RunOutcome:
    """Classify a finished run from the evidence left in its run directory.

    Args:
        run_dir: The run directory (exit records, logs/launcher.log, logs/rank*.log).
        world_size: Expected number of ranks (all are listed in `ranks`).
        returncode: torchrun's exit status, None if it never started.
        duration_s: Wall time of the run.
        stopped: "timeout", "hang", "pruned" (the autotuner's pruner) or "interrupted" when
            the supervisor stopped the run.
        stop_message: Why it was stopped, for the user.
        launch_failure: Why the process could not be started (e.g. executable not found).
        saw_rank_output: Whether any rank printed anything (distinguishes a launcher that
            failed before starting workers from workers that failed silently).
    """
    launcher_log = run_dir.logs / "launcher.log"
    stacks = _stacks(run_dir)
    common = {"returncode": returncode, "duration_s": duration_s, "stacks": tuple(sorted(stacks))}
    if launch_failure is not None:
        return RunOutcome(status="launch_error", message=launch_failure, ranks={}, **common)

    exits = read_exit_records(run_dir)
    try:
        launcher_text = launcher_log.read_text(errors="replace")
    except FileNotFoundError:
        launcher_text = ""
    failures = parse_torchrun_failures(launcher_text)
    by_rank = {f.rank: f for f in failures}
    roots = [f for f in failures if f.root_cause]
    root = min(roots, key=lambda f: f.time) if roots else None

    ranks: dict[int, str] = {}
    for r in sorted(set(range(world_size)) | set(exits) | set(by_rank)):
        if r in exits and exits[r].get("status"):
            ranks[r] = str(exits[r]["status"])
        elif r in by_rank:
            f = by_rank[r]
            if f.exitcode < 0:
                ranks[r] = "signal" if f.root_cause or f.signal != "SIGTERM" else "terminated"
            else:
                ranks[r] = "error"
        elif stopped is not None:
            ranks[r] = "stopped"
        elif returncode == 0:
            ranks[r] = "ok"
        else:
            ranks[r] = "unknown"

    if stopped is not None:
        # Rank 0's last words usually show where a hung or slow job was; the ranks' stacks, where each one was
        # (a rank at another line than the rest is the one to look at: a collective the others never called).
        if stacks:
            places: dict[str, list[int]] = {}
            for rank, at in _where_ranks_were(run_dir, stacks).items():
                places.setdefault(at, []).append(rank)
            if places:
                stop_message += "; where the ranks were in the script: " + ", ".join(
                    f"{at} ({_ranks_text(rs)})" for at, rs in sorted(places.items(), key=lambda kv: min(kv[1])))
            stop_message += "; the ranks' Python stacks at the stop: " + ", ".join(stacks[r] for r in sorted(stacks))
        return RunOutcome(
            status=stopped, message=stop_message, stderr_tail=_tail(run_dir.rank_log(0)), ranks=ranks, **common
        )

    # Every rank finished its work and said so, yet torchrun reports a failure: an abort at
    # interpreter exit (about one gloo run in eight). The records were written after the
    # last step, so the measurement stands.
    if returncode != 0 and returncode is not None and all(
        str(exits.get(r, {}).get("status")) in _DONE for r in range(world_size)
    ):
        if root is not None:
            what = (f"rank {root.rank} was killed by {root.signal}" if root.signal
                    else f"rank {root.rank} exited with status {root.exitcode}")
        else:
            what = f"torchrun exited with status {returncode}"
        warning = (f"exit_abort: every rank finished and wrote its exit record, then {what} at exit; "
                   "the measurement is valid")
        if root is not None and root.rank in stacks:
            warning += f" (its Python stacks at the signal: {stacks[root.rank]})"
        tail_path = run_dir.rank_log(root.rank) if root is not None else launcher_log
        return RunOutcome(status="ok", message=warning, warnings=(warning,), stderr_tail=_tail(tail_path),
                          ranks=ranks, **common)

    # A rank that rejected the configuration explains everything that followed.
    config_errors = sorted(
        (r for r, rec in exits.items() if rec.get("status") == "config_error"),
        key=lambda r: (exits[r].get("t_exit") or 0.0, r),
    )
    if config_errors:
        r = config_errors[0]
        return RunOutcome(
            status="config_error",
            failing_rank=r,
            message=str(exits[r].get("message") or _error_message(exits[r])),
            stderr_tail=_tail(run_dir.rank_log(r)),
            ranks=ranks,
            **common,
        )

    # A signal at the root cause comes before "error" records: peers of a killed rank
    # typically fail in their next collective and record that secondary error. (A root
    # that recorded an error of its own died of it: that error is the cause, below.)
    root_status = exits.get(root.rank, {}).get("status") if root is not None else None
    if root is not None and root.exitcode < 0 and root_status != "error":
        log = _read_lines(run_dir.rank_log(root.rank))
        message = f"rank {root.rank} was killed by {root.signal}"
        stacks_note = ""
        if root.rank in stacks:
            at = _where_ranks_were(run_dir, {root.rank: stacks[root.rank]}).get(root.rank)
            message += f" at {at}" if at else ""
            stacks_note = f" (its Python stacks at the signal: {stacks[root.rank]})"
        if root_status in _DONE:
            message += f" after recording a clean exit ({root_status}), before every rank did"
        status = "signal"
        # SIGKILL comes from outside (the kernel's OOM killer, a scheduler, a user) and
        # leaves nothing to read; an abort may follow an OOM or NCCL's watchdog.
        if root.signal != "SIGKILL":
            scanned = _exception_lines("\n".join(log[-_SCAN_LINES:]))
            status = _failure_kind(scanned)
            if status == "script_error":
                status = "signal"
            else:
                pattern = _OOM_RE if status == "oom" else _COLLECTIVE_TIMEOUT_RE
                evidence = next(line.strip() for line in reversed(scanned) if pattern.search(line))
                message = f"{message}: {evidence}"
        return RunOutcome(
            status=status,
            failing_rank=root.rank,
            signal=root.signal,
            message=message + stacks_note,
            stderr_tail=tuple(log[-_TAIL_LINES:]),
            ranks=ranks,
            **common,
        )

    # The earliest error, but a rank that only lost its peer yields to one with its own error.
    errors = sorted(
        (r for r, rec in exits.items() if rec.get("status") == "error"),
        key=lambda r: (_peer_lost(exits[r]), exits[r].get("t_exit") or 0.0, r),
    )
    if errors:
        r = errors[0]
        return RunOutcome(
            status=_record_kind(exits[r]),
            failing_rank=r,
            message=_error_message(exits[r]) or f"rank {r} failed",
            stderr_tail=_tail(run_dir.rank_log(r)),
            ranks=ranks,
            **common,
        )

    if returncode == 0:
        return RunOutcome(status="ok", ranks=ranks, **common)

    if root is not None:
        log = _read_lines(run_dir.rank_log(root.rank))
        last = _last_exception_line(log)
        return RunOutcome(
            status=_failure_kind([last]) if last else "script_error",
            failing_rank=root.rank,
            message=last or f"rank {root.rank} exited with status {root.exitcode}",
            stderr_tail=tuple(log[-_TAIL_LINES:]),
            ranks=ranks,
            **common,
        )

    # Some ranks recorded a clean exit but others recorded nothing: those were killed
    # (a rank killed by a signal writes no exit record) without torchrun saying how.
    missing = [r for r in range(world_size) if r not in exits]
    if exits and missing:
        r = missing[0]
        return RunOutcome(
            status="signal",
            failing_rank=r,
            message=f"rank {r} ended without an exit record (killed?)",
            stderr_tail=_tail(run_dir.rank_log(r)),
            ranks=ranks,
            **common,
        )

    launcher_tail = _tail(launcher_log)
    if returncode is not None and returncode < 0:
        name = _signal_name(-returncode)
        return RunOutcome(
            status="signal",
            signal=name,
            message=f"the launcher was killed by {name}",
            stderr_tail=launcher_tail,
            ranks=ranks,
            **common,
        )
    if not saw_rank_output and not exits:
        last = next((line for line in reversed(launcher_tail) if line.strip()), "")
        return RunOutcome(
            status="launch_error",
            message=f"torchrun exited with status {returncode} before starting the script"
            + (f": {last.strip()}" if last else ""),
            stderr_tail=launcher_tail,
            ranks=ranks,
            **common,
        )
    return RunOutcome(
        status="script_error",
        message=f"torchrun exited with status {returncode}",
        stderr_tail=launcher_tail,
        ranks=ranks,
        **common,
    )
