"""The warm agent's server: a process that imported torch once and forks a torchrun agent per request.

Started by `warm.WarmAgents` with one end of a SOCK_SEQPACKET socket pair (its file descriptor
is the only argument). Messages, one JSON object each:

- to it: `{"argv": [...], "env": {...}, "cwd": "..."}` with one file descriptor attached
  (SCM_RIGHTS), the write end of the pipe the agent's stdout and stderr go to;
- from it: `{"ready": pid}` once torch is imported; `{"pid": pid}` or `{"error": "..."}`
  for each request, in order; `{"exit": pid, "code": c}` when an agent ends (c as
  `subprocess.Popen.returncode`: negative for a signal).

The server is single-threaded (it forks), exits when the socket closes, and dies with the
thread that started it (PR_SET_PDEATHSIG, set by its starter); each agent dies with the
server the same way, so a killed tuner still leaves no agent behind.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
from typing import Callable

from ._procs import die_with_this_thread

_MAX_MESSAGE = 1 << 20


def main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    import torch  # noqa: F401 - the point: every agent forked from here has it imported
    import torch.distributed  # noqa: F401

    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    _send(sock, {"ready": os.getpid()})
    while True:
        for key, _ in sel.select():
            if key.fileobj is sock:
                try:
                    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 1)
                except ConnectionError:
                    data, fds = b"", []
                if not data:
                    return  # the launcher closed its end (or died): nothing more will come
                own = (sock.fileno(), wake_r, wake_w, sel.fileno())  # not the agent's: closed in it
                _send(sock, _fork(json.loads(data), fds, own))
            else:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                _reap(sock)


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict, fds: list[int], own: tuple[int, ...]) -> dict:
    if len(fds) != 1:
        for f in fds:
            os.close(f)
        return {"error": f"expected one file descriptor, got {len(fds)}"}
    out = fds[0]
    die_with_server = die_with_this_thread()  # made before the fork: the child only calls it
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(out)
        return {"error": f"fork failed: {exc}"}
    if pid:
        os.close(out)
        return {"pid": pid}
    code = 1
    try:
        code = _agent(request, out, own, die_with_server)
    finally:
        os._exit(code)


def _agent(request: dict, out: int, own: tuple[int, ...], die_with_server: Callable[[], None] | None) -> int:
    """In the forked child: become `python -m torch.distributed.run ARGS` in its own session; its exit code."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for f in own:
        os.close(f)
    os.setsid()  # as subprocess.Popen(start_new_session=True): signals to the group reach the agent
    if die_with_server is not None:  # SIGTERM when the server dies: torchrun stops its workers in order
        die_with_server()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    for f in (null, out):
        if f > 2:
            os.close(f)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.environ.get("PYTHONUNBUFFERED"):  # read at interpreter start, which this process did not have
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    sys.path[0] = os.getcwd()  # what `python -m` puts first
    from ._agent import run_torchrun

    return run_torchrun(list(request["argv"]))


if __name__ == "__main__":
    main(int(sys.argv[1]))
