"""Warm agents: a study's torchrun agents forked from a process that imported torch once.

Every run of a study is a fresh `python -m torch.distributed.run` launch, and its agent
imports torch before it starts a worker: 1.3-1.5 s on one core while the others idle, in
every baseline, trial, confirmation and ablation run. `WarmAgents` starts one server per
study (`_zygote`, on first use) that imports torch and then forks each agent: the child
takes the run's environment, working directory and output pipe, starts its own session,
and runs `torch.distributed.run` as `-m` would, with the same arguments. The ranks are
untouched: torchrun starts them as fresh processes, as always, so what a run measures
does not change; only the launch gets shorter (`benchmarks/trial_cost.py`).

What a forked agent does not share with a fresh one: anything torch read from the
environment while it was imported (the tuner's environment, not the run's; the run's own
variables reach the ranks, which import torch themselves), and `/proc/PID/environ` and
`cmdline` show the server's (the run's processes are still found by TORSH_TUNE_RUN_ID:
the ranks carry it, the agent is the process group the supervisor signals).

Only a local launch whose command is exactly `sys.executable -m torch.distributed.run ...`
is forked (no launcher template, no emulated nodes), on Linux; anything else, or a server
that fails, falls back to `subprocess.Popen`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

import psutil

from ._procs import die_with_this_thread

__all__ = ["WarmAgents"]

_AGENT = ("-m", "torch.distributed.run")
_READY_TIMEOUT_S = 120.0
_REPLY_TIMEOUT_S = 30.0


class ForkedAgent:
    """The `subprocess.Popen` surface the supervisor uses, for an agent the server forked."""

    def __init__(self, pid: int, stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._done = threading.Event()
        self._orphaned = False  # the server died: nobody reports this agent's end, it is watched instead

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and not _alive(self.pid):
            # Its server's death sent it SIGTERM (PR_SET_PDEATHSIG); its own status went to whoever reaped it.
            self._exited(-int(signal.SIGTERM))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"agent {self.pid}", timeout or 0.0)
            self._done.wait(0.05 if self._orphaned else 0.5)
        assert self.returncode is not None
        return self.returncode


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class WarmAgents:
    """Forks the torchrun agents of one tuner; `close()` it when the study ends (or use it as a context manager).

    Example:
        >>> with WarmAgents() as agents:  # doctest: +SKIP
        ...     outcome = launch_run(config, run_dir, "train.py", [], agents=agents)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one request at a time; replies come in request order
        self._server: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._replies: list[dict] = []
        self._reply_ready = threading.Condition()
        self._agents: dict[int, ForkedAgent] = {}
        self._early: dict[int, int] = {}  # exit codes that came before the agent was registered
        self._reader: threading.Thread | None = None
        self._gone = False  # the server's socket closed: agents forked before are watched, not reported
        self.failed: str | None = None  # why agents are started the usual way from now on

    def __enter__(self) -> "WarmAgents":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def eligible(cmd: Sequence[str]) -> bool:
        """Whether `cmd` is a local torchrun launch with this Python (the only kind forked)."""
        return sys.platform.startswith("linux") and len(cmd) >= 3 and cmd[0] == sys.executable \
            and tuple(cmd[1:3]) == _AGENT

    def spawn(self, cmd: Sequence[str], env: Mapping[str, str]) -> ForkedAgent | None:
        """Fork the agent of `cmd` with `env`; None when it must be started the usual way (not eligible, no server)."""
        if not self.eligible(cmd):
            return None
        with self._lock:
            if self.failed is not None or (self._server is None and not self._start()):
                return None
            read_end, write_end = os.pipe()
            request = {"argv": ["torch.distributed.run", *cmd[3:]], "env": dict(env), "cwd": os.getcwd()}
            try:
                assert self._sock is not None
                socket.send_fds(self._sock, [json.dumps(request).encode()], [write_end])
                reply = self._reply()
            except (OSError, TimeoutError) as exc:
                os.close(read_end)
                self._fail(f"the warm agent server stopped answering ({exc})")
                return None
            finally:
                os.close(write_end)
            if "pid" not in reply:
                os.close(read_end)
                self._fail(str(reply.get("error", reply)))
                return None
            agent = ForkedAgent(reply["pid"], open(read_end, "rb"))
            with self._reply_ready:
                code = self._early.pop(agent.pid, None)
                if code is None and self._gone:
                    agent._orphaned = True
                elif code is None:
                    self._agents[agent.pid] = agent
            if code is not None:
                agent._exited(code)
            return agent

    def close(self) -> None:
        """Stop the server: it exits when its socket closes (an agent still running gets SIGTERM, as when the tuner dies)."""
        with self._lock:
            sock, server = self._sock, self._server
            with self._reply_ready:
                self._sock = None
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # wakes the reader; the server reads EOF
                except OSError:
                    pass
            if server is not None:
                try:
                    server.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            if self._reader is not None:
                self._reader.join(timeout=5.0)
            if sock is not None:
                sock.close()

    # -- the server -----------------------------------------------------------------------
    def _start(self) -> bool:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._server = subprocess.Popen(
                [sys.executable, "-m", f"{__package__}._zygote", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=die_with_this_thread(),
            )
        except OSError as exc:
            ours.close()
            self.failed = f"the warm agent server could not be started: {exc}"
            return False
        finally:
            theirs.close()
        self._sock = ours
        ours.settimeout(_READY_TIMEOUT_S)
        try:
            ready = json.loads(ours.recv(1 << 16) or b"{}")
        except (OSError, ValueError) as exc:
            ready = {"error": str(exc)}
        ours.settimeout(None)
        if "ready" not in ready:
            self._fail(f"the warm agent server did not start ({ready.get('error', 'it exited')})")
            return False
        self._reader = threading.Thread(target=self._read, name="torsh-tune-warm-agents", daemon=True)
        self._reader.start()
        return True

    def _reply(self) -> dict:
        with self._reply_ready:
            if not self._reply_ready.wait_for(lambda: self._replies or self._sock is None or self.failed,
                                              timeout=_REPLY_TIMEOUT_S):
                raise TimeoutError(f"no reply in {_REPLY_TIMEOUT_S:g} s")
            if not self._replies:
                raise OSError("the server is gone")
            return self._replies.pop(0)

    def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                data = sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message = json.loads(data)
            with self._reply_ready:
                if "exit" in message:
                    agent = self._agents.pop(message["exit"], None)
                    if agent is None:
                        self._early[message["exit"]] = message["code"]
                    else:
                        agent._exited(message["code"])
                else:
                    self._replies.append(message)
                self._reply_ready.notify_all()
        # The server is gone: its agents got SIGTERM (PR_SET_PDEATHSIG) and stop their ranks; nobody can report
        # their end, so each is watched until it is gone.
        with self._reply_ready:
            if self.failed is None and self._sock is not None:
                self.failed = "the warm agent server exited"
            self._gone = True
            for agent in self._agents.values():
                agent._orphaned = True
            self._agents.clear()
            self._reply_ready.notify_all()

    def _fail(self, why: str) -> None:
        self.failed = why
        if self._server is not None and self._server.poll() is None:
            self._server.kill()
