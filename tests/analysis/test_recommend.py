from __future__ import annotations

import json

import pytest

from torsh_tune.analysis import (
    Bottleneck,
    MemoryStats,
    SystemStats,
    analyze_run,
    choose_num_workers,
    diagnose,
    recommend,
)
from torsh_tune.config import RunConfig

from .conftest import DATA, SCENARIOS, rewrite_jsonl
from .test_bottlenecks import _bd, _comm


def _all_category_bottlenecks():
    """Bottlenecks of every category and rule, from synthetic statistics."""
    mem = MemoryStats(device="cuda", peak_bytes_by_rank={0: 97, 1: 90}, capacity_bytes=100, peak_pct=97.0)
    gpu = SystemStats(cpu_pct_mean=90.0, sys_cpu_pct_mean=50.0, gpu_util_pct_mean=60.0, gpu_power_w_mean=200.0)
    found = diagnose(breakdown=_bd(data=20, exposed_comm=35, forward=20, backward_compute=25), comm=_comm(busbw_gbps=0.5),
                     memory=mem, system=gpu, pipeline={"stages": 4, "microbatches": 8, "bubble_pct": 40.0},
                     world_size=2, reference_busbw_gbps=1.0)
    return found + analyze_run(DATA / "straggler").bottlenecks + analyze_run(DATA / "healthy").bottlenecks


def test_every_patch_applies_to_a_run_config():
    bottlenecks = _all_category_bottlenecks()
    assert {b.category for b in bottlenecks} >= {"io", "communication", "network", "memory", "computation",
                                                 "pipeline_bubble", "straggler"}
    meta = {0: {"device": "cuda:0", "hostname": "h0",
                "ddp": {"bucket_cap_mb": 25.0, "num_buckets": 40, "param_bytes": 400 << 20,
                        "gradient_as_bucket_view": False}}}
    recs = recommend(bottlenecks, info={"cpu_count": 32, "nproc_per_node": 4}, meta=meta, world_size=2)
    assert {r.category for r in recs} >= {b.category for b in bottlenecks}
    for rec in recs:
        RunConfig().apply_patch(rec.config_patch)  # raises ConfigError if not accepted
        json.dumps(rec.config_patch)
        assert 0.0 <= rec.expected_gain.low_pct <= rec.expected_gain.high_pct <= 100.0
        assert rec.expected_gain.basis and rec.effort in ("low", "medium", "high")
    assert [r.priority for r in recs] == list(range(1, len(recs) + 1))
    bucket = next(r for r in recs if "bucket_cap_mb" in r.config_patch.get("ddp", {}))
    assert bucket.config_patch == {"ddp": {"bucket_cap_mb": 50.0}}  # 40 small buckets: make them larger
    assert next(r for r in recs if r.category == "io").config_patch["dataloader"]["pin_memory"] is True


@pytest.mark.parametrize("name", SCENARIOS)
def test_fixture_recommendations_apply(name):
    a = analyze_run(DATA / name)
    for rec in a.recommendations:
        RunConfig().apply_patch(rec.config_patch)


def test_recommendations_are_ordered_by_severity_then_gain():
    a = analyze_run(DATA / "data_bound")
    assert a.recommendations[0].category == "io" and a.recommendations[0].priority == 1
    assert a.recommendations[-1].category == "computation"


def test_num_workers_follow_cores_per_rank():
    assert choose_num_workers(cpu_count=8, ranks_per_node=2) == 3
    assert choose_num_workers(cpu_count=2, ranks_per_node=2) == 1
    assert choose_num_workers(cpu_count=64, ranks_per_node=1) == 8
    assert choose_num_workers(cpu_count=8, ranks_per_node=2, current=4) == 5


def _io_rec(run):
    return next(r for r in analyze_run(run).recommendations if r.category == "io")


def test_io_gain_comes_from_the_measured_data_wait(run_copy):
    base = _io_rec(DATA / "data_bound")
    d = analyze_run(DATA / "data_bound").breakdown.phases_pct["data"]
    assert base.expected_gain.high_pct == pytest.approx(d, abs=0.01)
    # 8 cores / 2 ranks = 3 free cores per rank -> 3 workers load 3x faster -> 2/3 of the wait goes.
    assert base.config_patch == {"dataloader": {"num_workers": 3, "persistent_workers": True}}
    assert base.expected_gain.low_pct == pytest.approx(d * 2 / 3, abs=0.01)

    run = run_copy("data_bound")
    for p in (run / "ranks").glob("*.steps.jsonl"):
        def slower_data(row):
            extra = 0.04
            return {**row, "data_s": row["data_s"] + extra, "step_s": row["step_s"] + extra}
        rewrite_jsonl(p, slower_data)
    slower = _io_rec(run)
    assert slower.expected_gain.high_pct > base.expected_gain.high_pct + 10

    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "cpu_count": 4}))
    fewer_cores = _io_rec(run)  # 1 free core per rank: one worker, no parallel speed-up promised
    assert fewer_cores.config_patch["dataloader"]["num_workers"] == 1
    assert fewer_cores.expected_gain.low_pct == 0.0
    assert fewer_cores.expected_gain.high_pct == slower.expected_gain.high_pct


def test_straggler_gain_is_bounded_by_its_lateness():
    a = analyze_run(DATA / "straggler")
    rec = a.recommendations[0]
    assert rec.category == "straggler" and rec.config_patch == {} and "rank 2" in rec.title
    assert rec.expected_gain.high_pct == pytest.approx(a.bottlenecks[0].evidence["excess_pct"], abs=0.01)
    assert rec.expected_gain.high_pct == pytest.approx(a.stragglers.lateness_pct, abs=1.0)


def test_comm_gain_is_bounded_by_exposed_comm_and_backward_compute():
    a = analyze_run(DATA / "comm_bound")
    pct = a.breakdown.phases_pct
    bucket = next(r for r in a.recommendations if r.category == "communication")
    assert bucket.expected_gain.high_pct == pytest.approx(min(pct["exposed_comm"], pct["backward_compute"]), abs=0.01)
    compress = next(r for r in a.recommendations if r.category == "network" and "Compress" in r.title)
    net = next(b for b in a.bottlenecks if b.category == "network")
    assert compress.expected_gain.high_pct == pytest.approx(net.evidence["transfer_exposed_pct"], abs=0.01)
    assert compress.expected_gain.low_pct == pytest.approx(net.evidence["transfer_exposed_pct"] / 2, abs=0.01)


def test_unknown_categories_get_no_recommendation():
    odd = Bottleneck(category="other", severity="high", ranks=(), evidence={"x_pct": 1.0}, message="?")
    assert recommend([odd]) == ()
