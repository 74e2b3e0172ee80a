"""What the machines and links of a run are: nodes, ranks per node, GPUs and their links, NICs, InfiniBand.

Every fact carries where it came from:

- "measured": timed by torsh-tune (the bench's bandwidths);
- "detected": read from the system (sysfs, `nvidia-smi`, the rendezvous' hostnames);
- "assumed": nothing could be read, a default stands in.

Pure Python (no torch): the launcher, the bench worker, the in-rank runtime and the reports
can all call it.

    from torsh_tune.fabric import detect_node, topology_from_hosts
    node = detect_node()                       # this host
    topo = topology_from_hosts(["a", "a", "b", "b"], nodes=[node_a, node_b])
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["Fact", "Topology", "detect_node", "parse_nvidia_smi_topo", "topology_from_hosts"]

Source = Literal["measured", "detected", "assumed"]
_CMD_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Fact:
    """One statement about the hardware and how it is known.

    Attributes:
        name: what it is about, e.g. "nic.eth0.speed_mbps", "gpu.links", "nnodes".
        value: a JSON value.
        source: "measured", "detected" or "assumed".
        detail: where it was read from or why it is assumed.
    """

    name: str
    value: Any
    source: Source
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Topology:
    """The layout of a run.

    Attributes:
        nnodes: distinct hosts among the ranks.
        ranks_per_node: host -> number of ranks on it (rendezvous order of first appearance).
        nodes: per host, the facts `detect_node` found (host -> facts).
        facts: run-level facts (nnodes, ranks per node, link kinds).
    """

    nnodes: int
    ranks_per_node: dict[str, int]
    nodes: dict[str, tuple[Fact, ...]] = field(default_factory=dict)
    facts: tuple[Fact, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"nnodes": self.nnodes, "ranks_per_node": dict(self.ranks_per_node),
                "nodes": {h: [asdict(f) for f in facts] for h, facts in self.nodes.items()},
                "facts": [asdict(f) for f in self.facts]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Topology:
        return cls(nnodes=int(data["nnodes"]), ranks_per_node=dict(data["ranks_per_node"]),
                   nodes={h: tuple(Fact(**f) for f in facts) for h, facts in data.get("nodes", {}).items()},
                   facts=tuple(Fact(**f) for f in data.get("facts", ())))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # sysfs attributes of a down or virtual link raise EINVAL on read
        return None


def _nic_facts(sys_root: Path) -> list[Fact]:
    net = sys_root / "class" / "net"
    facts = []
    if not net.is_dir():
        return [Fact(name="nic", value=None, source="assumed", detail=f"{net} not readable")]
    for dev in sorted(net.iterdir()):
        if dev.name == "lo":
            continue
        physical = (dev / "device").exists()  # virtual links (veth, bridges, ifb) have no device
        speed = _read(dev / "speed")
        mbps = int(speed) if speed and speed.lstrip("-").isdigit() and int(speed) > 0 else None
        facts.append(Fact(
            name=f"nic.{dev.name}.speed_mbps", value=mbps, source="detected",
            detail=f"{dev / 'speed'}; operstate={_read(dev / 'operstate')}; "
                   f"{'physical' if physical else 'virtual'}" + ("" if mbps else "; speed not reported"),
        ))
    return facts


def _infiniband_facts(sys_root: Path) -> list[Fact]:
    ib = sys_root / "class" / "infiniband"
    if not ib.is_dir():
        return [Fact(name="infiniband", value=False, source="detected", detail=f"no {ib}")]
    facts = [Fact(name="infiniband", value=True, source="detected", detail=str(ib))]
    for dev in sorted(ib.iterdir()):
        ports = dev / "ports"
        for port in sorted(ports.iterdir()) if ports.is_dir() else ():
            facts.append(Fact(
                name=f"infiniband.{dev.name}.{port.name}",
                value={"state": _read(port / "state"), "rate": _read(port / "rate"),
                       "link_layer": _read(port / "link_layer")},
                source="detected", detail=str(port),
            ))
    return facts


_GPU_COLUMN = re.compile(r"GPU\d+")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # nvidia-smi underlines the header on some versions


def _topo_cells(line: str) -> list[str]:
    # nvidia-smi separates columns with tabs ("CPU Affinity" holds a space); a copy that
    # lost its tabs still splits right for the GPU columns, which come first.
    return [c.strip() for c in line.split("\t")] if "\t" in line else line.split()


def parse_nvidia_smi_topo(text: str) -> dict[str, Any]:
    """GPU-to-GPU link kinds from `nvidia-smi topo -m`.

    Only the `GPU<n>` columns are links between GPUs; the NIC columns and the trailing
    "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID" columns are not, nor are the NIC
    rows and the legend.

    Returns:
        {"gpus": [...], "pairs": {"GPU0-GPU1": "NV12", ...}, "links": "nvlink" | "pcie" | "mixed" | None}
        ("NV#" entries are NVLink; PIX, PXB, PHB, NODE and SYS go through PCIe / the host).

    Example:
        >>> parse_nvidia_smi_topo("\\tGPU0\\tGPU1\\nGPU0\\t X \\tNV12\\nGPU1\\tNV12\\t X \\n")["links"]
        'nvlink'
    """
    lines = [_ANSI.sub("", ln) for ln in text.splitlines() if ln.strip()]
    columns: dict[str, int] = {}  # GPU<n> -> its position among the cells after the row label
    for i, line in enumerate(lines):
        cells = _topo_cells(line)
        if cells and cells[0] == "":  # the header starts with a separator where rows have a label
            cells = cells[1:]
        found = {c: j for j, c in enumerate(cells) if _GPU_COLUMN.fullmatch(c)}
        if found and "X" not in cells:  # every GPU row has its "X" (self); the header has none
            columns, rows = found, lines[i + 1:]
            break
    else:
        return {"gpus": [], "pairs": {}, "links": None}
    pairs: dict[str, str] = {}
    for line in rows:
        cells = _topo_cells(line)
        if not cells or cells[0] not in columns:
            continue
        for other, j in columns.items():
            cell = cells[1 + j] if 1 + j < len(cells) else ""
            if other != cells[0] and cell and cell != "X":
                pairs["-".join(sorted((cells[0], other), key=lambda g: int(g[3:])))] = cell
    kinds = {"nvlink" if v.startswith("NV") else "pcie" for v in pairs.values()}
    links = None if not kinds else (kinds.pop() if len(kinds) == 1 else "mixed")
    return {"gpus": list(columns), "pairs": pairs, "links": links}


def _gpu_facts() -> list[Fact]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [Fact(name="gpu.count", value=0, source="assumed", detail="nvidia-smi not found")]
    facts = []
    try:
        names = subprocess.run([smi, "--query-gpu=name,pci.bus_id", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=_CMD_TIMEOUT_S, check=True).stdout.strip().splitlines()
        facts.append(Fact(name="gpu.count", value=len(names), source="detected", detail="nvidia-smi --query-gpu"))
        facts.append(Fact(name="gpu.names", value=[n.split(",")[0].strip() for n in names], source="detected",
                          detail="nvidia-smi --query-gpu"))
        topo = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S,
                              check=True).stdout
        parsed = parse_nvidia_smi_topo(topo)
        facts.append(Fact(name="gpu.links", value=parsed["links"], source="detected",
                          detail=f"nvidia-smi topo -m: {parsed['pairs']}"))
    except (OSError, subprocess.SubprocessError) as exc:
        facts.append(Fact(name="gpu.count", value=None, source="assumed", detail=f"nvidia-smi failed: {exc}"))
    return facts


def detect_node(*, sys_root: str | os.PathLike[str] = "/sys", gpus: bool = True) -> tuple[Fact, ...]:
    """Facts about this host: hostname, CPUs, NICs and their speed, InfiniBand, GPUs and their links.

    Args:
        sys_root: sysfs mount point (a directory tree of the same shape for tests).
        gpus: query `nvidia-smi` (skipped when False).
    """
    root = Path(sys_root)
    facts = [Fact(name="hostname", value=socket.gethostname(), source="detected", detail="gethostname()"),
             Fact(name="cpu.count", value=os.cpu_count(), source="detected", detail="os.cpu_count()")]
    facts += _nic_facts(root)
    facts += _infiniband_facts(root)
    if gpus:
        facts += _gpu_facts()
    return tuple(facts)


def topology_from_hosts(
    hosts: Sequence[str],
    *,
    nodes: Mapping[str, Sequence[Fact]] | None = None,
    emulated_link: str | None = None,
) -> Topology:
    """The run layout from the hostname of every rank (index = global rank), as the rendezvous saw it.

    Args:
        hosts: hostnames, one per rank.
        nodes: `detect_node` facts per host, when collected.
        emulated_link: the link of an emulated cluster (`torsh-tune ... --emulate`), e.g.
            "1 Gbit/s"; the nodes are network namespaces of one host, so their NICs say nothing.

    Example:
        >>> topology_from_hosts(["a", "a", "b", "b"]).ranks_per_node
        {'a': 2, 'b': 2}
    """
    counts = Counter(hosts)
    per_node = {h: counts[h] for h in dict.fromkeys(hosts)}
    facts = [
        Fact(name="nnodes", value=len(per_node), source="detected", detail="distinct hostnames of the ranks"),
        Fact(name="ranks_per_node", value=per_node, source="detected", detail="hostnames of the ranks"),
    ]
    node_facts = {h: tuple(f) for h, f in (nodes or {}).items()}
    if emulated_link is not None and len(per_node) > 1:
        facts.append(Fact(name="inter_node_link", value=f"emulated {emulated_link}", source="detected",
                          detail="network namespaces joined by veth pairs shaped with tc tbf (--emulate)"))
    elif len(per_node) == 1:
        facts.append(Fact(name="inter_node_link", value=None, source="detected", detail="single node"))
    else:
        speeds = [f.value for fs in node_facts.values() for f in fs
                  if f.name.startswith("nic.") and f.value and "physical" in f.detail]
        ib = any(f.name == "infiniband" and f.value for fs in node_facts.values() for f in fs)
        if ib:
            facts.append(Fact(name="inter_node_link", value="infiniband", source="detected",
                              detail="/sys/class/infiniband present"))
        elif speeds:
            facts.append(Fact(name="inter_node_link", value=f"ethernet {min(speeds)} Mbit/s", source="assumed",
                              detail="slowest physical NIC speed; which NIC carries the traffic is not known"))
        else:
            facts.append(Fact(name="inter_node_link", value=None, source="assumed", detail="no NIC speed readable"))
    return Topology(nnodes=len(per_node), ranks_per_node=per_node, nodes=node_facts, facts=tuple(facts))
