"""Topology facts from sysfs-shaped trees, nvidia-smi output and rendezvous hostnames."""

from __future__ import annotations

from torsh_tune.fabric import Topology, detect_node, parse_nvidia_smi_topo, topology_from_hosts

TOPO_NVLINK = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\t0-63\t0
GPU1\tNV18\t X \tNV18\t0-63\t0
GPU2\tNV18\tNV18\t X \t0-63\t0

Legend:
  X    = Self
"""
# `nvidia-smi topo -m` on an 8x H100 SXM node (DGX H100 layout): NV18 between every GPU
# pair through NVSwitch, 12 NICs, and the trailing affinity columns (a header cell with a space).
TOPO_8XH100 = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tNIC1\tNIC2\tNIC3\tNIC4\tNIC5\tNIC6\tNIC7\tNIC8\tNIC9\tNIC10\tNIC11\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tNV18\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS\t0-55,112-167\t0\t\tN/A
GPU4\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
GPU5\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tNV18\tSYS\tSYS\tSYS\tSYS\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
GPU6\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tNV18\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
GPU7\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\tNV18\t X \tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tNODE\tNODE\t56-111,168-223\t1\t\tN/A
NIC0\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS
NIC1\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS
NIC2\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\t X \tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS
NIC3\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\t X \tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tSYS\tSYS
NIC4\tSYS\tSYS\tSYS\tSYS\tPIX\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tNODE\tNODE\tSYS\tSYS\tNODE\tNODE
NIC5\tSYS\tSYS\tSYS\tSYS\tNODE\tPIX\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tNODE\tNODE\tSYS\tSYS\tNODE\tNODE
NIC6\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tPIX\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\t X \tNODE\tSYS\tSYS\tNODE\tNODE
NIC7\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tPIX\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\t X \tSYS\tSYS\tNODE\tNODE
NIC8\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \tNODE\tSYS\tSYS
NIC9\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\t X \tSYS\tSYS
NIC10\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\t X \tNODE
NIC11\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tNODE\t X 

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
  NIC2: mlx5_2
  NIC3: mlx5_3
  NIC4: mlx5_4
  NIC5: mlx5_5
  NIC6: mlx5_6
  NIC7: mlx5_7
  NIC8: mlx5_8
  NIC9: mlx5_9
  NIC10: mlx5_10
  NIC11: mlx5_11
"""
TOPO_PCIE = "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n"


def _fake_sys(root, *, ib: bool):
    eth = root / "class" / "net" / "eth0"
    eth.mkdir(parents=True)
    (eth / "speed").write_text("25000\n")
    (eth / "operstate").write_text("up\n")
    (eth / "device").mkdir()
    veth = root / "class" / "net" / "veth1"
    veth.mkdir()
    (veth / "speed").write_text("-1\n")
    (root / "class" / "net" / "lo").mkdir()
    if ib:
        port = root / "class" / "infiniband" / "mlx5_0" / "ports" / "1"
        port.mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n")
        (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
        (port / "link_layer").write_text("InfiniBand\n")
    return root


def test_nvidia_smi_topo_links():
    parsed = parse_nvidia_smi_topo(TOPO_NVLINK)
    assert parsed["gpus"] == ["GPU0", "GPU1", "GPU2"]
    assert parsed["pairs"] == {"GPU0-GPU1": "NV18", "GPU0-GPU2": "NV18", "GPU1-GPU2": "NV18"}
    assert parsed["links"] == "nvlink"
    assert parse_nvidia_smi_topo(TOPO_PCIE)["links"] == "pcie"
    assert parse_nvidia_smi_topo("")["links"] is None


def test_nvidia_smi_topo_8xh100_is_all_nvlink():
    parsed = parse_nvidia_smi_topo(TOPO_8XH100)
    assert parsed["gpus"] == [f"GPU{i}" for i in range(8)]
    assert len(parsed["pairs"]) == 8 * 7 // 2 and set(parsed["pairs"].values()) == {"NV18"}
    assert parsed["pairs"]["GPU6-GPU7"] == "NV18" and "GPU0-NIC0" not in parsed["pairs"]
    assert parsed["links"] == "nvlink"
    # The same table without its tabs (copied from a terminal) reads the same.
    assert parse_nvidia_smi_topo(TOPO_8XH100.expandtabs(8)) == parsed
    # nvidia-smi 580 underlines the header even into a pipe (seen on a lent H100).
    header, rest = TOPO_8XH100.split("\n", 1)
    underlined = f"\t\x1b[4m{header[1:]}\x1b[0m\n{rest}"
    assert parse_nvidia_smi_topo(underlined) == parsed


def test_nvidia_smi_topo_single_gpu_as_driver_580_prints_it():
    text = ("\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\nGPU0\t X \t0-15\t0\t\tN/A\n\n"
            "Legend:\n\n  X    = Self\n")
    assert parse_nvidia_smi_topo(text) == {"gpus": ["GPU0"], "pairs": {}, "links": None}


def test_nvidia_smi_topo_still_sees_a_mixed_node():
    # GPU0-GPU1 over NVLink, the other pairs over PCIe, with the affinity columns present.
    text = ("\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV4\tSYS\tPIX\t0-31\t0\t\tN/A\n"
            "GPU1\tNV4\t X \tSYS\tPIX\t0-31\t0\t\tN/A\n"
            "GPU2\tSYS\tSYS\t X \tSYS\t32-63\t1\t\tN/A\n"
            "NIC0\tPIX\tPIX\tSYS\t X \n")
    parsed = parse_nvidia_smi_topo(text)
    assert parsed["pairs"] == {"GPU0-GPU1": "NV4", "GPU0-GPU2": "SYS", "GPU1-GPU2": "SYS"}
    assert parsed["links"] == "mixed"


def test_detect_node_reads_nics_and_infiniband(tmp_path):
    facts = {f.name: f for f in detect_node(sys_root=_fake_sys(tmp_path, ib=True), gpus=False)}
    assert facts["nic.eth0.speed_mbps"].value == 25000 and "physical" in facts["nic.eth0.speed_mbps"].detail
    assert facts["nic.veth1.speed_mbps"].value is None and "virtual" in facts["nic.veth1.speed_mbps"].detail
    assert "nic.lo.speed_mbps" not in facts
    assert facts["infiniband"].value is True
    assert facts["infiniband.mlx5_0.1"].value["rate"].startswith("200 Gb/sec")
    assert all(f.source in ("measured", "detected", "assumed") for f in facts.values())


def test_this_host_without_gpu_tools_says_so():
    facts = {f.name: f for f in detect_node()}
    assert facts["hostname"].source == "detected"
    if "gpu.count" in facts and facts["gpu.count"].value == 0:
        assert facts["gpu.count"].source == "assumed"


def test_topology_from_hosts(tmp_path):
    single = topology_from_hosts(["h"] * 4)
    assert single.nnodes == 1 and single.ranks_per_node == {"h": 4}
    node = detect_node(sys_root=_fake_sys(tmp_path / "a", ib=False), gpus=False)
    multi = topology_from_hosts(["a", "a", "b", "b"], nodes={"a": node, "b": node})
    assert multi.nnodes == 2 and multi.ranks_per_node == {"a": 2, "b": 2}
    link = {f.name: f for f in multi.facts}["inter_node_link"]
    assert link.value == "ethernet 25000 Mbit/s" and link.source == "assumed"
    ib_node = detect_node(sys_root=_fake_sys(tmp_path / "b", ib=True), gpus=False)
    ib = topology_from_hosts(["a", "b"], nodes={"a": ib_node, "b": ib_node})
    assert {f.name: f for f in ib.facts}["inter_node_link"].value == "infiniband"
    assert Topology.from_dict(multi.to_dict()) == multi
