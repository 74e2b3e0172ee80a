"""Strategy advice from a run's own facts: recorded 2-rank CPU runs and synthetic GPU clusters."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from torsh_tune.analysis import analyze_run, load_run, strategy_advice

from .conftest import DATA

RECORDED = DATA / "recorded"


def _inputs(rows) -> dict[str, dict]:
    return {i["name"]: i for i in rows[0]["inputs"]}


@pytest.mark.parametrize("scenario", ["comm_bound", "data_bound", "straggler", "compute_bound"])
def test_recorded_run_advice_reads_the_model_and_host(scenario):
    frames = load_run(RECORDED / scenario)
    rows = strategy_advice(frames.meta, frames.info, frames.system, frames.world_size, config=frames.config)
    meta0 = json.loads((RECORDED / scenario / "ranks" / "rank00000.meta.json").read_text())
    inputs = _inputs(rows)

    assert inputs["num_params"]["value"] == meta0["ddp"]["num_params"] > 0
    assert inputs["num_params"]["source"] == "measured"
    assert (inputs["param_bytes_per_param"]["value"], inputs["param_bytes_per_param"]["source"]) == (4, "measured")
    optimizer = inputs["optimizer_bytes_per_param"]
    assert (optimizer["value"], optimizer["source"]) == (8, "assumed")
    # CPU: ranks share the host, so each holds its share of the host's memory.
    assert inputs["gpus"] == {**inputs["gpus"], "value": False, "source": "detected"}
    host_mem = int(frames.system["mem_total_bytes"].max())
    assert inputs["device_memory_bytes"]["value"] == host_mem // frames.world_size
    assert inputs["device_memory_bytes"]["source"] == "detected"
    assert (inputs["nnodes"]["value"], inputs["nnodes"]["source"]) == (1, "detected")
    assert inputs["world_size"]["value"] == frames.world_size == 2
    # No bench reference in these runs: the link is unknown, so no compression is advised.
    assert inputs["link_gbps"]["value"] is None and inputs["link_gbps"]["source"] == "assumed"
    assert {i["source"] for i in rows[0]["inputs"]} <= {"measured", "detected", "assumed"}

    # A 13 M-parameter model on 2 ranks: plain DDP first, and that is what the run used.
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0]["name"] == "ddp" and rows[0]["fits"] is True and rows[0]["current"] is True
    assert [r["name"] for r in rows if r["current"]] == ["ddp"]
    assert inputs["strategy"]["value"] == "ddp"
    assert all(r["inputs"] == rows[0]["inputs"] for r in rows)
    json.dumps(rows)  # JSON types only


def test_analyze_run_carries_the_advice():
    a = analyze_run(RECORDED / "comm_bound")
    frames = load_run(RECORDED / "comm_bound")
    assert a.advice == strategy_advice(frames.meta, frames.info, frames.system, frames.world_size,
                                       config=frames.config)
    assert a.advice and not any("strategy advice" in w for w in a.warnings)


def _cluster(*, hosts=("node0", "node0", "node1", "node1"), gpu_mem=(80e9, 80e9, 80e9, 40e9), **ddp):
    meta = {r: {"rank": r, "hostname": h, "device": f"cuda:{r % 2}",
                "ddp": {"num_params": 300_000_000, "param_bytes": 1_200_000_000, **ddp}}
            for r, h in enumerate(hosts)}
    system = pd.DataFrame({"rank": list(range(len(hosts))), "gpu_mem_total_bytes": list(gpu_mem),
                           "mem_total_bytes": [512e9] * len(hosts)})
    return meta, system


def test_gpu_multi_node_advice_uses_the_gpus_hosts_and_bench_link():
    meta, system = _cluster()
    info = {"reference_busbw_gbps": 0.5, "reference_bench": "runs/bench-1"}
    rows = strategy_advice(meta, info, system, 4, config={"strategy": {"kind": "ddp"}})
    inputs = _inputs(rows)

    assert (inputs["gpus"]["value"], inputs["nnodes"]["value"]) == (True, 2)
    assert inputs["device_memory_bytes"]["value"] == 40e9  # the smallest GPU bounds what fits
    assert inputs["link_gbps"] == {**inputs["link_gbps"], "value": 4.0, "source": "measured"}
    assert "runs/bench-1" in inputs["link_gbps"]["detail"]
    # 0.5 GB/s = 4 Gbit/s < 10 and 300 M params: PowerSGD first, the hierarchical all-reduce next.
    assert rows[0]["name"] == "ddp + powersgd compression"
    assert rows[0]["config_patch"]["compression"] == {"method": "powersgd"}
    assert "ddp + hierarchical all-reduce" in [r["name"] for r in rows]
    # The run used DDP without a comm hook: not among the candidates.
    assert inputs["strategy"]["value"] == "ddp" and not any(r["current"] for r in rows)

    compressed = strategy_advice(meta, info, system, 4,
                                 config={"strategy": {"kind": "ddp", "compression": {"method": "powersgd"}}})
    assert [r["current"] for r in compressed][0] is True


def test_gpu_without_a_link_or_nvml_records_says_unknown():
    meta, _ = _cluster()
    rows = strategy_advice(meta, {}, pd.DataFrame(), 4)
    inputs = _inputs(rows)
    assert inputs["gpus"]["value"] is True
    assert inputs["device_memory_bytes"]["value"] is None and inputs["device_memory_bytes"]["source"] == "assumed"
    assert inputs["link_gbps"]["value"] is None
    assert {r["fits"] for r in rows} == {None}


def test_fsdp_run_through_the_api_is_matched_to_its_candidate():
    meta = {r: {"hostname": "node0", "device": f"cuda:{r}",
                "strategy": {"kind": "fsdp", "api": True, "num_params": 2_000_000_000, "param_bytes": 8_000_000_000,
                             "fsdp": {"num_params": 2_000_000_000, "reshard_after_forward": True}}}
            for r in range(8)}
    system = pd.DataFrame({"rank": range(8), "gpu_mem_total_bytes": [80e9] * 8})
    rows = strategy_advice(meta, {}, system, 8, config={"strategy": {"kind": "fsdp"}})
    inputs = _inputs(rows)
    assert inputs["num_params"]["value"] == 2_000_000_000
    assert "strategy.num_params" in inputs["num_params"]["detail"]
    assert inputs["strategy"]["value"] == "fsdp full shard"
    current = [r for r in rows if r["current"]]
    assert [r["name"] for r in current] == ["fsdp full shard"]
    assert rows[0]["name"] == "fsdp grad-op shard"  # 2 B params fit gathered on 80 GB: one all-gather fewer


def test_pipeline_run_and_fsdp_only_count():
    meta = {r: {"hostname": "node0", "strategy": {"kind": "pipeline", "num_params": 50_000_000}} for r in range(2)}
    rows = strategy_advice(meta, {"mem_total_bytes": 64 * 10**9}, pd.DataFrame(), 2)
    assert [r["name"] for r in rows if r["current"]] == ["pipeline"]
    inputs = _inputs(rows)
    assert inputs["device_memory_bytes"]["value"] == 32 * 10**9  # run.json host memory / 2 ranks
    assert inputs["param_bytes_per_param"]["source"] == "assumed"

    fsdp_only = {0: {"strategy": {"kind": "fsdp", "fsdp": {"num_params": 7}}}}
    assert _inputs(strategy_advice(fsdp_only, {}, pd.DataFrame(), 1))["num_params"]["value"] == 7


def test_a_script_without_ddp_or_parallelize_is_advised_from_what_its_optimizer_steps():
    # FSDP2 applied by the script: its sharded parameters (counted whole) and FSDP's collectives.
    fsdp2 = {r: {"hostname": "node0", "trained": {"num_params": 2_106_376, "param_bytes": 8_425_504, "sharded": True},
                 "collectives": {"fsdp": {"count": 210, "bytes": 1}}} for r in range(2)}
    rows = strategy_advice(fsdp2, {"mem_total_bytes": 64 * 10**9}, pd.DataFrame(), 2,
                           config={"strategy": {"kind": "ddp"}})  # the config's default kind: nothing applied
    inputs = _inputs(rows)
    assert inputs["num_params"]["value"] == 2_106_376 and inputs["num_params"]["source"] == "measured"
    assert "trained.num_params" in inputs["num_params"]["detail"] and "counted whole" in inputs["num_params"]["detail"]
    assert inputs["param_bytes_per_param"]["value"] == 4
    assert inputs["strategy"]["value"] == "fsdp full shard"
    assert [r["name"] for r in rows if r["current"]] == ["fsdp full shard"]
    # A hand-written all-reduce: no DDP, nothing sharded. The config's default "ddp" is not what it runs.
    plain = {0: {"hostname": "node0", "trained": {"num_params": 1000, "param_bytes": 4000, "sharded": False},
                 "collectives": {"user": {"count": 4, "bytes": 16000}}}}
    rows = strategy_advice(plain, {"mem_total_bytes": 64 * 10**9}, pd.DataFrame(), 1,
                           config={"strategy": {"kind": "ddp"}})
    assert _inputs(rows)["num_params"]["value"] == 1000 and _inputs(rows)["strategy"]["value"] is None
    assert not any(r["current"] for r in rows)


def test_no_parameter_count_means_no_advice_and_a_warning():
    warnings: list[str] = []
    assert strategy_advice({0: {"hostname": "a"}}, {}, pd.DataFrame(), 1, warnings=warnings) == ()
    assert len(warnings) == 1 and "parameter count is unknown" in warnings[0]


def test_ranks_spread_unevenly_over_hosts_give_no_advice():
    meta, system = _cluster(hosts=("a", "a", "b"), gpu_mem=(80e9,) * 3)
    warnings: list[str] = []
    assert strategy_advice(meta, {}, system, 3, warnings=warnings) == ()
    assert "do not divide evenly over 2 hosts" in warnings[0]


def test_analysis_without_parameter_count_warns(run_copy):
    run = run_copy("healthy")
    for path in (run / "ranks").glob("*.meta.json"):
        doc = json.loads(path.read_text())
        doc.pop("ddp", None)
        path.write_text(json.dumps(doc))
    a = analyze_run(run)
    assert a.advice == () and any("strategy advice unavailable" in w for w in a.warnings)


def test_a_failing_advisor_becomes_a_warning(monkeypatch):
    import torsh_tune.analysis._analyze as analyze_module

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(analyze_module, "strategy_advice", broken)
    a = analyze_run(DATA / "healthy")
    assert a.advice == () and "strategy advice failed: RuntimeError: boom" in a.warnings
    assert a.bottlenecks is not None and a.steps is not None


def test_synthetic_fixtures_get_advice_without_warnings():
    a = analyze_run(DATA / "healthy")
    assert a.advice and a.warnings == ()
    assert Path(a.run_dir).name == "healthy"


def test_without_a_bench_the_nodes_nic_line_rate_is_the_detected_link():
    meta, system = _cluster()

    def nic(name, mbps, *, physical=True, up=True):
        kind = "physical" if physical else "virtual"
        return {"name": f"nic.{name}.speed_mbps", "value": mbps, "source": "detected",
                "detail": f"/sys/class/net/{name}/speed; operstate={'up' if up else 'down'}; {kind}"}

    # One meta per node carries the facts (local rank 0): the slower node's fastest up NIC wins.
    meta[0]["node_facts"] = [nic("eth0", 25000), nic("eth1", 100000, up=False), nic("veth0", 10000, physical=False)]
    meta[2]["node_facts"] = [nic("eth0", 10000), nic("eth1", 1000)]
    link = _inputs(strategy_advice(meta, {}, system, 4))["link_gbps"]
    assert (link["value"], link["source"]) == (10.0, "detected")
    assert "NIC eth0 on node1" in link["detail"] and "not a measurement" in link["detail"]
    # InfiniBand's active port rate beats the Ethernet NIC on a node.
    meta[2]["node_facts"].append({"name": "infiniband.mlx5_0.1", "source": "detected", "detail": "/sys/class/...",
                                  "value": {"state": "4: ACTIVE", "rate": "200 Gb/sec (4X HDR)", "link_layer": "IB"}})
    assert _inputs(strategy_advice(meta, {}, system, 4))["link_gbps"]["value"] == 25.0
    # A node without facts could be the slow one: nothing claimed.
    del meta[2]["node_facts"]
    assert _inputs(strategy_advice(meta, {}, system, 4))["link_gbps"]["value"] is None
    # A bench reference (measured) always comes first.
    meta[2]["node_facts"] = [nic("eth0", 10000)]
    assert _inputs(strategy_advice(meta, {"reference_busbw_gbps": 0.5}, system, 4))["link_gbps"]["value"] == 4.0
