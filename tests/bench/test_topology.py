"""Topology facts from sysfs-shaped trees, nvidia-smi output and rendezvous hostnames."""

from __future__ import annotations

from torsh_tune.bench import Topology, detect_node, parse_nvidia_smi_topo, topology_from_hosts

TOPO_NVLINK = """\
\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV18\tNV18\t0-63\t0
GPU1\tNV18\t X \tNV18\t0-63\t0
GPU2\tNV18\tNV18\t X \t0-63\t0

Legend:
  X    = Self
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
