"""An emulated multi-node cluster on one Linux host: network namespaces joined by shaped veth links.

Each "node" is a network namespace with its own loopback (intra-node traffic) and one
interface `tteth0` holding 198.18.0.<node+1>/24 (198.18.0.0/15 is reserved for
benchmarking). Two nodes are joined by one veth pair; more by veth pairs to a bridge in a
switch namespace. Every veth end is shaped on egress with `tc ... tbf` (netem, which could
add delay, is not assumed to exist), so every byte between nodes crosses a link of the
given rate in both directions.

A run on the cluster is a real multi-node torchrun launch: one agent per node, started in
its node's namespace (and its own UTS namespace, so `gethostname()` says which node a rank
is on), c10d rendezvous hosted by node 0 across the emulated link, gloo bound to `tteth0`
(`GLOO_SOCKET_IFNAME`). The launcher template the cluster puts into the run's config
starts `python -m torsh_tune.launch._agents ...`, which fans the torchrun command
out to the nodes and stands for all of them as one process: it exits with the first
failing agent's status, stops the others when one fails, and passes SIGTERM on, so the
supervisor's timeouts, pruning and Ctrl-C stop every node.

    from torsh_tune.launch.emulate import EmulateSpec, EmulatedCluster
    spec = EmulateSpec.parse("nodes=2,procs_per_node=2,link=1gbit")
    with EmulatedCluster(spec) as cluster:          # root and iproute2 needed
        config = cluster.configure(RunConfig())     # nnodes, rendezvous, launcher, env
        launch_run(config, run_dir, "train.py", [])

Everything the cluster creates is named `tt<owner pid>n<node>` (and `tt<owner pid>sw`) and
removed on exit, on error and on SIGTERM/SIGHUP/Ctrl-C; a cluster whose owner was killed
(SIGKILL) is removed by the next cluster that starts.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

from ..config import RunConfig
from ..errors import EmulationError, int_at_least, invalid

__all__ = [
    "AGENTS_MODULE",
    "ENV_EMULATED",
    "NODE_IFNAME",
    "EmulateSpec",
    "EmulatedCluster",
    "EmulationError",
    "check_can_emulate",
    "faketime_library",
    "node_address",
    "node_hostname",
    "owned_namespaces",
    "remove_stale_namespaces",
]

#: Set in every rank of a run on an emulated cluster: the spec, e.g. "nodes=2,procs_per_node=2,link=1gbit".
ENV_EMULATED = "TORSH_TUNE_EMULATED"
#: The inter-node interface inside every node namespace (the same name on every node, so one
#: GLOO_SOCKET_IFNAME fits all).
NODE_IFNAME = "tteth0"
#: The fan-out process the cluster's launcher template starts (one torchrun agent per node).
AGENTS_MODULE = "torsh_tune.launch._agents"
#: The rendezvous port on node 0 (the namespace is private, so a fixed port cannot collide).
RDZV_PORT = 29400
_SUBNET = "198.18.0"
#: `ip netns exec NS` bind-mounts /etc/netns/NS/hosts over /etc/hosts: the nodes resolve each other's names.
_ETC_NETNS = Path("/etc/netns")
_NAME_RE = re.compile(r"^tt(\d+)(?:n\d+|sw)$")
_CMD_TIMEOUT_S = 30.0


# -- the spec ----------------------------------------------------------------------------------
_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_SIZE_UNITS = {"b": 1, "kb": 1024, "k": 1024, "mb": 1 << 20, "m": 1 << 20}
_QUANTITY_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([a-z]*)\s*$")


def _quantity(key: str, text: str, units: dict[str, float], rule: str) -> float:
    m = _QUANTITY_RE.match(text.lower())
    if m is None or m.group(2) not in units or float(m.group(1)) <= 0:
        raise invalid(f"--emulate {key}", rule, text)
    return float(m.group(1)) * units[m.group(2)]


def _count(key: str, text: str, minimum: int) -> int:
    return int_at_least(f"--emulate {key}", text, minimum)


@dataclass(frozen=True, kw_only=True)
class EmulateSpec:
    """What to emulate: `nodes=N,procs_per_node=P,link=RATE[,latency=T][,burst=SIZE][,clock_skew=T][,clock_drift=PPM]`.

    Attributes:
        nodes: Emulated nodes (network namespaces), 2..254.
        procs_per_node: Ranks per node (torchrun --nproc-per-node).
        link_bps: Rate of every inter-node link in bits/s, each direction (tc units: 1gbit, 100mbit).
        latency_s: tbf's `latency`: the longest a packet may wait in the shaper before it is
            dropped (this sets the queue size; it is not a propagation delay: tbf adds none).
        burst_bytes: tbf's bucket size: bytes that may leave at line rate after an idle period.
        clock_skew_s: Node i's clocks run i x this ahead of node 0's, as hosts' clocks that NTP keeps only
            so close do (libfaketime, Debian's `faketime`, preloaded into the node's processes). 0: one
            clock, the host's.
        clock_drift_ppm: Node i's clocks run i x this many parts per million fast (libfaketime's rate, from
            each process's start), as a host's oscillator does that nothing disciplines. 0: none.
    """

    nodes: int
    procs_per_node: int
    link_bps: float
    latency_s: float = 0.05
    burst_bytes: int = 256 << 10
    clock_skew_s: float = 0.0
    clock_drift_ppm: float = 0.0

    @classmethod
    def parse(cls, text: str) -> EmulateSpec:
        """Parse `nodes=2,procs_per_node=2,link=1gbit,latency=50ms,burst=256kb,clock_skew=5ms,clock_drift=100`.

        Example:
            >>> EmulateSpec.parse("nodes=2,procs_per_node=2,link=1gbit").link_gbps
            1.0
        """
        fields: dict[str, str] = {}
        for item in (part.strip() for part in text.split(",")):
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip() or "=" in value:
                raise invalid("--emulate", "comma-separated KEY=VALUE items (nodes, procs_per_node, link, latency, "
                              "burst, clock_skew, clock_drift)", text)
            key = key.strip()
            if key not in ("nodes", "procs_per_node", "link", "latency", "burst", "clock_skew", "clock_drift"):
                raise invalid("--emulate key", "one of nodes, procs_per_node, link, latency, burst, clock_skew, "
                              "clock_drift", key)
            if key in fields:
                raise invalid(f"--emulate {key}", "given once", text)
            fields[key] = value.strip()
        missing = [k for k in ("nodes", "procs_per_node", "link") if k not in fields]
        if missing:
            raise invalid("--emulate", f"a spec with {', '.join(missing)} (e.g. nodes=2,procs_per_node=2,link=1gbit)",
                          text)
        nodes = _count("nodes", fields["nodes"], 2)
        if nodes > 254:
            raise invalid("--emulate nodes", "an integer <= 254 (one /24 of 198.18.0.0/15)", nodes)
        spec = cls(
            nodes=nodes,
            procs_per_node=_count("procs_per_node", fields["procs_per_node"], 1),
            link_bps=_quantity("link", fields["link"], _RATE_UNITS, "a rate > 0 such as 1gbit or 100mbit"),
        )
        if "latency" in fields:
            spec = replace(spec, latency_s=_quantity("latency", fields["latency"], _TIME_UNITS,
                                                      "a time > 0 such as 50ms or 500us"))
        if "burst" in fields:
            burst = int(_quantity("burst", fields["burst"], _SIZE_UNITS, "a size > 0 such as 256kb or 1mb"))
            if burst < 2048:
                raise invalid("--emulate burst", ">= 2kb (a full-size packet must fit the bucket)", fields["burst"])
            spec = replace(spec, burst_bytes=burst)
        if "clock_skew" in fields:
            skew = _quantity("clock_skew", fields["clock_skew"], _TIME_UNITS, "a time > 0 such as 5ms")
            if skew > 10.0:
                raise invalid("--emulate clock_skew", "at most 10s", fields["clock_skew"])
            spec = replace(spec, clock_skew_s=skew)
        if "clock_drift" in fields:
            raw = fields["clock_drift"].removesuffix("ppm")
            try:
                drift = float(raw)
            except ValueError:
                drift = float("nan")
            if not 0 < drift <= 10000:
                raise invalid("--emulate clock_drift", "parts per million > 0 and <= 10000, such as 100 or 100ppm",
                              fields["clock_drift"])
            spec = replace(spec, clock_drift_ppm=drift)
        return spec

    @property
    def fakes_clocks(self) -> bool:
        """Whether node i > 0 runs with libfaketime preloaded (a clock skew or drift)."""
        return bool(self.clock_skew_s or self.clock_drift_ppm)

    @property
    def link_gbps(self) -> float:
        """Link rate in Gbit/s."""
        return self.link_bps / 1e9

    @property
    def link_bytes_per_s(self) -> float:
        """Link rate in bytes/s (what a bus bandwidth in GB/s is compared with)."""
        return self.link_bps / 8

    def text(self) -> str:
        """The canonical spec string (what ENV_EMULATED carries)."""
        return (f"nodes={self.nodes},procs_per_node={self.procs_per_node},link={self.link_bps:.0f}bit,"
                f"latency={self.latency_s * 1e6:.0f}us,burst={self.burst_bytes}b"
                + (f",clock_skew={self.clock_skew_s * 1e6:.0f}us" if self.clock_skew_s else "")
                + (f",clock_drift={self.clock_drift_ppm:g}" if self.clock_drift_ppm else ""))

    def describe(self) -> str:
        """E.g. "2 nodes x 2 rank(s), 1 Gbit/s links (emulated: veth + tc tbf)"."""
        return (f"{self.nodes} nodes x {self.procs_per_node} rank(s), {self.link_gbps:g} Gbit/s links "
                f"(emulated: veth + tc tbf, queue {self.latency_s * 1e3:g} ms, burst {self.burst_bytes >> 10} KiB"
                + (f"; node i's clock i x {self.clock_skew_s * 1e3:g} ms ahead" if self.clock_skew_s else "")
                + (f"; node i's clock i x {self.clock_drift_ppm:g} ppm fast" if self.clock_drift_ppm else "") + ")")

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "procs_per_node": self.procs_per_node, "link_gbps": self.link_gbps,
                "latency_s": round(self.latency_s, 9), "burst_bytes": self.burst_bytes, "spec": self.text(),
                "shaping": "tc tbf on both ends of every veth"} | ({
                    "clock_skew_s": self.clock_skew_s, "clock_drift_ppm": self.clock_drift_ppm,
                    "clock": "libfaketime: node i's clocks i x clock_skew_s ahead, i x clock_drift_ppm fast",
                } if self.fakes_clocks else {})


def node_address(node: int) -> str:
    """The inter-node IPv4 address of emulated node `node` (198.18.0.<node + 1>)."""
    return f"{_SUBNET}.{node + 1}"


def node_hostname(node: int) -> str:
    """The hostname a rank on emulated node `node` sees (its own UTS namespace)."""
    return f"emulated-node{node}"


# -- namespaces ----------------------------------------------------------------------------------
def _run(args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EmulationError(f"`{shlex.join(args)}` must succeed to set up the emulated cluster, but got {exc}") from None
    if check and done.returncode != 0:
        raise EmulationError(f"`{shlex.join(args)}` must succeed to set up the emulated cluster, but it exited "
                             f"{done.returncode}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owned_namespaces() -> dict[str, int]:
    """Network namespaces named like an emulated cluster's (`tt<pid>n<i>`, `tt<pid>sw`) -> owner pid."""
    if shutil.which("ip") is None:
        return {}
    out = _run(["ip", "netns", "list"], check=False).stdout
    owned = {}
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME_RE.match(name)
        if m:
            owned[name] = int(m.group(1))
    return owned


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of clusters whose owner process is gone (it was SIGKILLed); returns their names."""
    stale = [name for name, pid in owned_namespaces().items() if not _pid_alive(pid)]
    for name in stale:
        _run(["ip", "netns", "delete", name], check=False)
    leftovers = [p for p in _ETC_NETNS.glob("tt*") if (m := _NAME_RE.match(p.name)) and not _pid_alive(int(m.group(1)))]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def faketime_library() -> str | None:
    """Debian's libfaketime (package `faketime`), which `clock_skew` preloads; None when it is not installed."""
    found = sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1")) + sorted(
        Path("/usr/lib/faketime").glob("libfaketime.so.1"))
    return str(found[0]) if found else None


def check_can_emulate() -> None:
    """Raise `EmulationError` (one line) unless this process is root and has `ip` and `tc`."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise EmulationError(f"--emulate needs iproute2 ({' and '.join(missing)} on PATH), but "
                             f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing")
    if not sys.platform.startswith("linux"):
        raise EmulationError(f"--emulate needs Linux network namespaces, but this is {sys.platform}")
    if os.geteuid() != 0:
        raise EmulationError(f"--emulate must run as root (it creates network namespaces), but the effective "
                             f"uid is {os.geteuid()}")


class _Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP while a cluster is up: unwind like Ctrl-C so the cluster is torn down."""


class EmulatedCluster:
    """Context manager: the namespaces, links and shaping of an `EmulateSpec`, torn down on exit.

    Args:
        spec: What to emulate.

    Raises:
        EmulationError: Not root, no iproute2, or an `ip`/`tc` command failed (nothing is left behind).

    Example:
        >>> with EmulatedCluster(EmulateSpec.parse("nodes=2,procs_per_node=2,link=1gbit")) as c:  # doctest: +SKIP
        ...     c.namespaces
        ['tt4242n0', 'tt4242n1']
    """

    def __init__(self, spec: EmulateSpec) -> None:
        self.spec = spec
        self.owner_pid = os.getpid()
        self.prefix = f"tt{self.owner_pid}"
        self.namespaces = [f"{self.prefix}n{i}" for i in range(spec.nodes)]
        self.switch = None if spec.nodes == 2 else f"{self.prefix}sw"
        self.stale_removed: list[str] = []
        self._created: list[str] = []
        self._previous_handlers: dict[int, Any] = {}

    def node_address(self, node: int) -> str:
        return node_address(node)

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.node_address(0)}:{RDZV_PORT}"

    def __enter__(self) -> EmulatedCluster:
        check_can_emulate()
        if self.spec.fakes_clocks and faketime_library() is None:
            raise EmulationError("--emulate clock_skew and clock_drift need libfaketime (Debian's package faketime), but "
                                 "libfaketime.so.1 is not installed")
        if any(pid == self.owner_pid for pid in owned_namespaces().values()):
            raise EmulationError(f"one emulated cluster per process, but {self.prefix}* namespaces already exist")
        self.stale_removed = remove_stale_namespaces()
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace this cluster created (their veth links go with them)."""
        try:
            for name in reversed(self._created):
                _run(["ip", "netns", "delete", name], check=False)
                shutil.rmtree(_ETC_NETNS / name, ignore_errors=True)
            self._created.clear()
        finally:
            self._restore_signal_handlers()

    # -- building ------------------------------------------------------------------------------------
    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])
        # c10d looks peer addresses up by name (IPv4-mapped on its dual-stack store); without entries it
        # asks DNS, which is unreachable from the namespace, and warns on every connection.
        hosts = ["127.0.0.1 localhost"]
        for i in range(self.spec.nodes):
            hosts += [f"{self.node_address(i)} {node_hostname(i)}", f"::ffff:{self.node_address(i)} {node_hostname(i)}"]
        try:
            (_ETC_NETNS / name).mkdir(parents=True, exist_ok=True)
            (_ETC_NETNS / name / "hosts").write_text("\n".join(hosts) + "\n")
        except OSError as exc:
            raise EmulationError(f"{_ETC_NETNS / name}/hosts must be writable to name the emulated nodes, but got {exc}") from None

    def _shape(self, namespace: str, dev: str) -> None:
        s = self.spec
        _run(["tc", "-n", namespace, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{s.link_bps:.0f}bit",
              "burst", f"{s.burst_bytes}b", "latency", f"{s.latency_s * 1e6:.0f}us"])

    def _create(self) -> None:
        for name in self.namespaces:
            self._add_namespace(name)
        if self.switch is None:
            a, b = self.namespaces
            _run(["ip", "link", "add", NODE_IFNAME, "netns", a, "type", "veth", "peer", "name", NODE_IFNAME, "netns", b])
        else:
            self._add_namespace(self.switch)
            _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for i, name in enumerate(self.namespaces):
                port = f"p{i}"
                _run(["ip", "link", "add", NODE_IFNAME, "netns", name, "type", "veth", "peer", "name", port,
                      "netns", self.switch])
                _run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
                self._shape(self.switch, port)
        for i, name in enumerate(self.namespaces):
            _run(["ip", "-n", name, "addr", "add", f"{self.node_address(i)}/24", "dev", NODE_IFNAME])
            _run(["ip", "-n", name, "link", "set", NODE_IFNAME, "up"])
            self._shape(name, NODE_IFNAME)

    # -- signals ---------------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # the caller owns signals; `with` still tears down on exceptions

        def handler(signum: int, frame: FrameType | None) -> None:
            raise _Terminated(signal.Signals(signum).name)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._previous_handlers[sig] = signal.signal(sig, handler)

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._previous_handlers.items():
            signal.signal(sig, old)
        self._previous_handlers.clear()

    # -- runs ---------------------------------------------------------------------------------------------
    def launcher_template(self) -> str:
        """The `launch.launcher` that fans a torchrun command out to the nodes."""
        skew = (["--clock-skew-s", repr(self.spec.clock_skew_s)] if self.spec.clock_skew_s else []) + (
            ["--clock-drift-ppm", repr(self.spec.clock_drift_ppm)] if self.spec.clock_drift_ppm else [])
        return shlex.join([sys.executable, "-m", AGENTS_MODULE, "--prefix", self.prefix,
                           "--nodes", str(self.spec.nodes), *skew, "--"]) + " {cmd}"

    def configure(self, config: RunConfig) -> RunConfig:
        """`config` launched on this cluster: nodes, ranks per node, c10d rendezvous on node 0, the fan-out
        launcher, GLOO_SOCKET_IFNAME and ENV_EMULATED for every rank."""
        return config.apply_patch({"launch": {
            "nnodes": self.spec.nodes, "nproc_per_node": self.spec.procs_per_node, "node_rank": None,
            "rdzv_backend": "c10d", "rdzv_endpoint": self.rdzv_endpoint, "launcher": self.launcher_template(),
            "env": {"GLOO_SOCKET_IFNAME": NODE_IFNAME, ENV_EMULATED: self.spec.text()},
        }})

    def info(self) -> dict[str, Any]:
        """What run.json records about the cluster."""
        return {**self.spec.to_dict(), "namespaces": list(self.namespaces), "switch": self.switch,
                "addresses": [self.node_address(i) for i in range(self.spec.nodes)], "interface": NODE_IFNAME,
                "rdzv_endpoint": self.rdzv_endpoint}
