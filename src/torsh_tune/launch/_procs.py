"""Finding and ending every process of a run.

torchrun starts each worker in its own session, so signalling torchrun's process group
does not reach the workers (torchrun forwards SIGTERM itself, but not when it is killed).
Every process of a run carries TORSH_TUNE_RUN_ID in its environment; scanning for it finds
workers, their DataLoader workers and anything a script detached.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Callable

import psutil

from .command import ENV_RUN_ID

__all__ = ["die_with_this_thread", "find_run_processes", "kill_run_processes", "signal_group", "terminate_run_processes"]


def find_run_processes(run_id: str) -> list[psutil.Process]:
    """Live processes of this user whose environment carries `run_id`."""
    uid = os.getuid()
    me = os.getpid()
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            uids = proc.info["uids"]
            if proc.pid == me or uids is None or uids.real != uid:
                continue
            if proc.environ().get(ENV_RUN_ID) == run_id and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def signal_group(pgid: int, sig: int) -> None:
    """Send `sig` to a process group that may already be gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_run_processes(run_id: str) -> list[psutil.Process]:
    """SIGTERM every process carrying `run_id`; returns those signalled."""
    done = []
    for p in find_run_processes(run_id):
        try:
            p.terminate()
            done.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return done


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> None:
    # Not psutil.wait_procs: these are mostly not our children, and an orphan zombie
    # (nobody reaping it) would hold it for the whole timeout although it is dead.
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)


def kill_run_processes(run_id: str, *, grace_s: float = 0.0, max_rounds: int = 5) -> list[int]:
    """End every process carrying `run_id`: SIGTERM, up to `grace_s`, then SIGKILL.

    Scans again after killing (a dying parent may have just forked) until none is left.

    Returns:
        Pids that had to be signalled.
    """
    signalled: list[int] = []
    if grace_s > 0:
        procs = terminate_run_processes(run_id)
        signalled += [p.pid for p in procs]
        _wait_gone(procs, grace_s)
    for _ in range(max_rounds):
        procs = find_run_processes(run_id)
        if not procs:
            break
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
                signalled.append(p.pid)
            except psutil.NoSuchProcess:
                pass
        _wait_gone(procs, 2.0)
    return sorted(set(signalled))


def die_with_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` that has the kernel SIGTERM the child when the thread that started it dies (Linux).

    The supervisor starts torchrun (and a study's warm agent server, `warm.py`) in its own session,
    so a supervisor killed without a chance to stop it (SIGKILL, the OOM killer, a crash) would
    leave torchrun and its ranks running: a hung trial forever. torchrun turns SIGTERM into an
    orderly stop of its workers. The signal follows the death of the thread that started the child.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec
