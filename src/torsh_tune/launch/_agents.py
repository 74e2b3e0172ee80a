"""The fan-out process of an emulated cluster: one torchrun agent per node, one process to the supervisor.

    python -m torsh_tune.launch._agents --prefix ttPID --nodes N -- python -m torch.distributed.run ...

`EmulatedCluster.launcher_template()` puts this in front of the run's torchrun command. Each
node's agent runs inside the node's network namespace (`ip netns exec`) and its own UTS
namespace (hostname `emulated-node<i>`), advertises the node's 198.18 address, and node 0
hosts the c10d store. This process exits with the first failing agent's status, stops the
other agents when one fails (they would wait for it until their rendezvous or collective
timeouts), and passes SIGTERM/SIGINT/SIGHUP on; every agent gets SIGTERM if it dies.
A module of its own, not imported by `torsh_tune.launch`, so `-m` runs it cleanly.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

from ._procs import die_with_this_thread
from .emulate import EmulationError, faketime_library, node_address, node_hostname

_CLONE_NEWUTS = 0x04000000


def _agent_preexec(node: int):
    libc = ctypes.CDLL(None, use_errno=True)  # resolved before fork: the child only calls into it
    unshare, sethostname = libc.unshare, libc.sethostname
    name = node_hostname(node).encode()
    die_with_fan_out = die_with_this_thread()  # the fan-out died: stop this node

    def preexec() -> None:
        if die_with_fan_out is not None:
            die_with_fan_out()
        if unshare(_CLONE_NEWUTS) == 0:
            sethostname(name, len(name))

    return preexec


def _node_command(cmd: Sequence[str], *, namespace: str, address: str, host: bool) -> list[str]:
    """`cmd` (a torchrun command) for one node: inside its namespace, its own address, node 0 hosts the store."""
    cmd = list(cmd)
    try:
        at = cmd.index("torch.distributed.run") + 1
    except ValueError:
        raise EmulationError(f"the emulated cluster's launcher must wrap a torchrun command, but got {shlex.join(cmd)}") from None
    # --local-addr: torchrun would otherwise advertise the (shared, unreachable) hostname as MASTER_ADDR.
    # is_host: the endpoint is node 0's 198.18 address, which torch cannot match to the hostname.
    cmd[at:at] = ["--local-addr", address, "--rdzv-conf", f"is_host={'true' if host else 'false'}"]
    return ["ip", "netns", "exec", namespace, *cmd]


def _exit_status(code: int) -> int:
    return 128 - code if code < 0 else code


def _node_env(node: int, clock_skew_s: float, clock_drift_ppm: float = 0.0) -> dict[str, str] | None:
    """Node `node`'s environment: with a clock skew or drift, libfaketime preloaded to run its clocks node x
    clock_skew_s ahead and node x clock_drift_ppm fast (from each process's start). The monotonic clock moves
    with the realtime one (libfaketime's default): with it left alone (`FAKETIME_DONT_FAKE_MONOTONIC`)
    libfaketime 0.9.10 fails every `time.sleep` with EINVAL. Without a drift, intervals on it stay true and
    only what a node's clocks read against another node's changes; with one, they run long by its rate."""
    if not (clock_skew_s or clock_drift_ppm) or node == 0:
        return None
    library = faketime_library()
    if library is None:
        raise EmulationError("--emulate clock_skew and clock_drift need libfaketime (Debian's package faketime)")
    preload = " ".join(p for p in (library, os.environ.get("LD_PRELOAD", "")) if p)
    rate = f" x{1 + node * clock_drift_ppm * 1e-6:.9f}" if clock_drift_ppm else ""
    return {**os.environ, "LD_PRELOAD": preload, "FAKETIME": f"+{node * clock_skew_s:.6f}{rate}"}


def _run_agents(prefix: str, nodes: int, cmd: Sequence[str], *, grace_s: float = 10.0,
                clock_skew_s: float = 0.0, clock_drift_ppm: float = 0.0) -> int:
    procs: list[subprocess.Popen[bytes]] = []
    told: set[int] = set()  # agents already sent a stop: a second SIGTERM would cut torchrun's own shutdown short

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
                told.add(p.pid)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    for i in range(nodes):
        node_cmd = _node_command(cmd, namespace=f"{prefix}n{i}", address=node_address(i), host=i == 0)
        procs.append(subprocess.Popen(node_cmd, stdin=subprocess.DEVNULL, preexec_fn=_agent_preexec(i),
                                      env=_node_env(i, clock_skew_s, clock_drift_ppm)))
    status = 0
    stop_at: float | None = None
    while any(p.poll() is None for p in procs):
        for p in procs:
            code = p.poll()
            if code not in (None, 0) and status == 0:
                status = _exit_status(code)
                # A failed node: the others would wait for it (rendezvous, collectives) until their timeouts.
                for q in procs:
                    if q.poll() is None and q.pid not in told:
                        q.send_signal(signal.SIGTERM)
                        told.add(q.pid)
                stop_at = time.monotonic() + grace_s
        if stop_at is not None and time.monotonic() > stop_at:
            for q in procs:
                if q.poll() is None:
                    q.kill()
        time.sleep(0.05)
    if status == 0:
        status = next((_exit_status(p.returncode) for p in procs if p.returncode), 0)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m torsh_tune.launch._agents --prefix ttPID --nodes N -- TORCHRUN-COMMAND...`"""
    p = argparse.ArgumentParser(prog="python -m torsh_tune.launch._agents", description=__doc__.splitlines()[0])
    p.add_argument("--prefix", required=True, help="the cluster's namespace prefix (tt<owner pid>)")
    p.add_argument("--nodes", type=int, required=True, help="emulated nodes")
    p.add_argument("--clock-skew-s", type=float, default=0.0, help="node i's clocks i x this ahead (libfaketime)")
    p.add_argument("--clock-drift-ppm", type=float, default=0.0, help="node i's clocks i x this fast (libfaketime)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the torchrun command")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("a torchrun command after -- is required")
    return _run_agents(args.prefix, args.nodes, cmd, clock_skew_s=args.clock_skew_s,
                       clock_drift_ppm=args.clock_drift_ppm)


if __name__ == "__main__":
    sys.exit(main())
