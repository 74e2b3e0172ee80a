from __future__ import annotations

import pytest

from torsh_tune.analysis import (
    CATEGORIES,
    SEVERITIES,
    Bottleneck,
    Breakdown,
    CommStats,
    MemoryStats,
    StragglerStats,
    SystemStats,
    analyze_run,
    diagnose,
    recommend,
)
from torsh_tune.config import ThresholdsConfig

from .conftest import DATA, SCENARIOS


def _top(name, **kw):
    return analyze_run(DATA / name, **kw).bottlenecks[0]


def _severe(analysis):
    return [b for b in analysis.bottlenecks if b.severity in ("critical", "high")]


def _bd(**pct):
    phases = dict(data=0.0, forward=0.0, backward_compute=0.0, exposed_comm=0.0, optimizer=0.0, other=0.0)
    phases.update(pct)
    return Breakdown(phases_s={k: v / 100 for k, v in phases.items()}, phases_pct=phases, step_s=1.0)


def _comm(*, transfer_s=0.1, wait_s=0.0, busbw_gbps=10.0):
    return CommStats(num_collectives_per_step=3, bytes_per_step=3e6, comm_s=0.4, exposed_comm_s=0.3,
                     overlap_pct=25.0, transfer_s=transfer_s, wait_s=wait_s, busbw_gbps=busbw_gbps,
                     algbw_gbps=busbw_gbps, hooks=("allreduce",), ddp_logging=None, last_transfer_s=0.05)


def test_healthy_compute_bound_run_raises_nothing_severe():
    a = analyze_run(DATA / "healthy")
    assert _severe(a) == []
    assert [(b.category, b.severity) for b in a.bottlenecks] == [("computation", "low")]
    assert "compute-bound" in a.bottlenecks[0].message


def test_data_bound_run_is_io_critical():
    top = _top("data_bound")
    assert (top.category, top.severity) == ("io", "critical")
    assert top.evidence["data_wait_pct"] > 30 and top.ranks == (0, 1)


def test_comm_bound_run_is_communication_then_network():
    a = analyze_run(DATA / "comm_bound")
    assert (a.bottlenecks[0].category, a.bottlenecks[0].severity) == ("communication", "critical")
    net = next(b for b in a.bottlenecks if b.category == "network")
    assert net.evidence["transfer_share_pct"] > 95
    assert net.evidence["busbw_gbps"] < net.evidence["reference_busbw_gbps"]
    assert not any(b.category == "straggler" for b in a.bottlenecks)


def test_straggler_run_blames_the_straggler_not_communication():
    a = analyze_run(DATA / "straggler")
    top = a.bottlenecks[0]
    assert top.category == "straggler" and top.ranks == (2,)
    assert top.severity in ("high", "critical")
    assert top.evidence["skew_share_pct"] > 50 and top.evidence["last_share_pct"] == 100.0
    # The other ranks do spend a lot of the step in collectives ...
    assert a.breakdown.phases_pct["exposed_comm"] > 20
    # ... but that is waiting for rank 2, so neither communication nor network is severe.
    assert not [b for b in _severe(a) if b.category in ("communication", "network")]


def test_straggler_without_attribution_would_look_like_communication():
    # Same numbers as a straggler run, but no consistent last rank: skew stays communication.
    comm = _comm(transfer_s=0.01, wait_s=0.09)
    found = diagnose(breakdown=_bd(exposed_comm=40, forward=30, backward_compute=30), comm=comm, world_size=4)
    assert found[0].category == "communication" and "skew" in found[0].message
    strag = StragglerStats(per_rank=tuple({"rank": r, "median_step_s": 1.0, "median_compute_s": 0.6 if r == 2 else 0.3,
                                           "lateness_s": 0.3 if r == 2 else 0.0, "last_count": 10 if r == 2 else 0}
                                          for r in range(4)),
                           slowest_rank=2, last_share_pct=100.0, lateness_pct=30.0)
    found = diagnose(breakdown=_bd(exposed_comm=40, forward=30, backward_compute=30), comm=comm,
                     stragglers=strag, world_size=4)
    assert found[0].category == "straggler"
    assert "communication" not in [b.category for b in found if b.severity != "low"]


def test_straggler_needs_to_be_last_in_half_the_steps():
    rows = tuple({"rank": r, "median_step_s": 1.0, "median_compute_s": 0.5, "lateness_s": 0.2 if r == 1 else 0.0,
                  "last_count": 4 if r == 1 else 2} for r in range(4))
    jitter = StragglerStats(per_rank=rows, slowest_rank=1, last_share_pct=40.0, lateness_pct=20.0)
    assert not [b for b in diagnose(breakdown=_bd(forward=50), stragglers=jitter, world_size=4)
                if b.category == "straggler"]
    consistent = StragglerStats(per_rank=rows, slowest_rank=1, last_share_pct=60.0, lateness_pct=20.0)
    found = [b for b in diagnose(breakdown=_bd(forward=50), stragglers=consistent, world_size=4)
             if b.category == "straggler"]
    assert found[0].severity == "medium"  # 20 % late: not above 2x the 10 % threshold
    high = StragglerStats(per_rank=rows, slowest_rank=1, last_share_pct=60.0, lateness_pct=21.0)
    assert diagnose(breakdown=_bd(forward=50), stragglers=high, world_size=4)[0].severity == "high"
    critical = StragglerStats(per_rank=rows, slowest_rank=1, last_share_pct=60.0, lateness_pct=31.0)
    assert diagnose(breakdown=_bd(forward=50), stragglers=critical, world_size=4)[0].severity == "critical"


@pytest.mark.parametrize(("exposed", "severity"), [(10, None), (20, "medium"), (35, "high"), (55, "critical")])
def test_communication_levels(exposed, severity):
    found = diagnose(breakdown=_bd(exposed_comm=exposed, backward_compute=100 - exposed), comm=_comm(), world_size=2)
    got = [b.severity for b in found if b.category == "communication"]
    assert got == ([severity] if severity else [])


def test_thresholds_come_from_the_config():
    lenient = ThresholdsConfig(io_high_pct=40.0, io_critical_pct=60.0)
    a = analyze_run(DATA / "data_bound", thresholds=lenient)
    assert not [b for b in a.bottlenecks if b.category == "io"]


@pytest.mark.parametrize(("peak", "severity"), [(80.0, None), (90.0, "high"), (96.0, "critical")])
def test_memory_levels(peak, severity):
    mem = MemoryStats(device="cuda", peak_bytes_by_rank={0: int(peak), 1: 50}, capacity_bytes=100, peak_pct=peak)
    found = [b for b in diagnose(breakdown=_bd(forward=50), memory=mem, world_size=2) if b.category == "memory"]
    assert [b.severity for b in found] == ([severity] if severity else [])
    if found:
        assert found[0].ranks == (0,) and found[0].evidence["peak_pct"] == peak


def test_gpu_utilisation_only_with_gpu_data():
    cpu = SystemStats(cpu_pct_mean=90.0, sys_cpu_pct_mean=50.0, gpu_util_pct_mean=None, gpu_power_w_mean=None)
    assert all("gpu_util_pct" not in b.evidence for b in diagnose(breakdown=_bd(forward=90), system=cpu))
    gpu = SystemStats(cpu_pct_mean=90.0, sys_cpu_pct_mean=50.0, gpu_util_pct_mean=60.0, gpu_power_w_mean=200.0)
    found = [b for b in diagnose(breakdown=_bd(forward=90), system=gpu) if "gpu_util_pct" in b.evidence]
    assert found[0].severity == "medium" and found[0].evidence["gpu_util_pct"] == 60.0


def _bubble(**clock) -> Bottleneck:
    pipeline = {"stages": 4, "microbatches": 4, "bubble_pct": 50.0, **clock}
    found = [b for b in diagnose(breakdown=_bd(forward=90), pipeline=pipeline) if b.category == "pipeline_bubble"]
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize("clock", [{"clock": "host", "device": "cpu"}, {"clock": "device", "device": "cuda"}])
def test_pipeline_bubble_compares_with_theory(clock):
    assert not [b for b in diagnose(breakdown=_bd(forward=90)) if b.category == "pipeline_bubble"]
    found = _bubble(**clock)
    ev = found.evidence
    assert ev["theoretical_bubble_pct"] == pytest.approx(100 * 3 / 7, abs=0.01)
    assert ev["excess_bubble_pct"] == pytest.approx(50 - 100 * 3 / 7, abs=0.01)
    assert (ev["clock"], ev["device"], ev["graded"]) == (clock["clock"], clock["device"], True)
    assert found.severity == "high" and "informational" not in found.message


@pytest.mark.parametrize("clock", [{"clock": "host", "device": "cuda"}, {}])
def test_a_host_clock_bubble_off_cpu_is_informational(clock):
    # On CUDA the host clock of a schedule is kernel-launch time; a document that does not say
    # its clock and device (older runs) cannot be trusted either.
    found = _bubble(**clock)
    assert found.severity == "low" and found.evidence["graded"] is False and found.evidence["clock"] == "host"
    assert "informational" in found.message and "kernel-launch time" in found.message
    recs = [r for r in recommend([found]) if r.category == "pipeline_bubble"]
    # The gain comes from the theory only: 42.9 % at m=4 down to 27.3 % at m=8, not from the 50 % measured.
    assert recs and recs[0].expected_gain.low_pct == 0.0
    assert recs[0].expected_gain.high_pct == pytest.approx(100 * 3 / 7 - 100 * 3 / 11, abs=0.01)
    assert "host launch time" in recs[0].rationale


def test_a_graded_bubble_bounds_the_gain_by_the_measurement():
    recs = [r for r in recommend([_bubble(clock="device", device="cuda")]) if r.category == "pipeline_bubble"]
    assert recs[0].expected_gain.high_pct == pytest.approx(50 - 100 * 3 / 11, abs=0.01)


@pytest.mark.parametrize("name", SCENARIOS)
def test_bottlenecks_are_well_formed_and_severity_sorted(name):
    a = analyze_run(DATA / name)
    order = [SEVERITIES.index(b.severity) for b in a.bottlenecks]
    assert order == sorted(order)
    for b in a.bottlenecks:
        assert b.category in CATEGORIES and b.evidence and b.message
        assert all(r in range(a.world_size) for r in b.ranks)


def test_no_network_claim_without_a_measured_fabric_reference(tmp_path):
    import json
    import shutil

    run = tmp_path / "comm_bound"
    shutil.copytree(DATA / "comm_bound", run)
    info = json.loads((run / "run.json").read_text())
    del info["reference_busbw_gbps"]
    (run / "run.json").write_text(json.dumps(info))
    a = analyze_run(run)
    assert a.bottlenecks[0].category == "communication"
    assert not any(b.category == "network" for b in a.bottlenecks)


def test_small_collectives_are_judged_against_the_fabric_at_their_own_size():
    """PowerSGD-sized messages (0.1 MiB) are latency-bound: no network claim against the large-message
    reference; with the bench model's busbw at that size, the claim is made against that."""
    small = CommStats(num_collectives_per_step=2, bytes_per_step=13e6, wire_bytes_per_step=2e5, comm_s=0.08,
                      exposed_comm_s=0.075, overlap_pct=8.0, transfer_s=0.07, wait_s=0.01, busbw_gbps=0.0054,
                      algbw_gbps=0.0036, hooks=("powersgd",), ddp_logging=None, last_transfer_s=0.03)
    bd = _bd(exposed_comm=75, backward_compute=14, forward=6)
    found = diagnose(breakdown=bd, comm=small, world_size=4, reference_busbw_gbps=0.119)
    assert "network" not in {b.category for b in found} and found[0].category == "communication"
    # alpha 2 ms, 1/beta 0.12 GB/s: at 0.1 MB a collective can reach only ~0.02 GB/s.
    model_at = lambda size: 1.5 * size / (2e-3 + 1.5 * size / 0.12e9) / 1e9  # noqa: E731
    found = diagnose(breakdown=bd, comm=small, world_size=4, reference_busbw_gbps=0.119, reference_busbw_at=model_at)
    net = next(b for b in found if b.category == "network")
    assert net.evidence["reference_busbw_gbps"] == pytest.approx(model_at(1e5)) and model_at(1e5) < 0.119
    assert "bench model at 0.0954 MiB" in net.evidence["reference_basis"]
    # A fabric that delivers no more at that size than measured: nothing to claim.
    slow = lambda size: 0.005  # noqa: E731
    assert "network" not in {b.category for b in diagnose(breakdown=bd, comm=small, world_size=4,
                                                            reference_busbw_gbps=0.119, reference_busbw_at=slow)}


def test_the_reference_bench_model_sets_the_reference_at_the_run_s_message_size(tmp_path):
    import json
    import shutil

    from torsh_tune.fabric import AlphaBeta, CommModel, save_model

    run, bench = tmp_path / "comm_bound", tmp_path / "bench"
    shutil.copytree(DATA / "comm_bound", run)
    bench.mkdir()
    ref = json.loads((run / "run.json").read_text())["reference_busbw_gbps"]
    # A fabric with 20 ms of latency per all-reduce: at this run's bucket sizes it delivers far
    # less than its large-message bandwidth (the run.json reference).
    fit = AlphaBeta(collective="all_reduce", level="intra", group_size=2, alpha_s=0.02,
                    beta_s_per_byte=1 / (ref * 1e9), num_points=5)
    save_model(CommModel(world_size=2, nnodes=1, nproc_per_node=2, fits=(fit,)), bench)
    info = json.loads((run / "run.json").read_text())
    info["reference_bench"] = str(bench)
    (run / "run.json").write_text(json.dumps(info))
    net = next(b for b in analyze_run(run).bottlenecks if b.category == "network")
    size = net.evidence["wire_bytes_per_collective"]  # 4 MiB buckets
    assert net.evidence["reference_basis"] == f"the bench model at {size / 2**20:.3g} MiB per collective"
    assert net.evidence["reference_busbw_gbps"] == pytest.approx(size / (0.02 + size / (ref * 1e9)) / 1e9)
    assert net.evidence["busbw_gbps"] < net.evidence["reference_busbw_gbps"] < ref


def test_a_frameworks_small_per_step_collectives_are_its_syncs_and_its_gradient_traffic_is_not():
    import dataclasses

    flag = {"issuer": "lightning", "op": "broadcast", "count": 1.0, "bytes": 8.0, "time_s": 0.05,
            "transfer_s": 0.01, "origins": ["lightning.pytorch.loops.training_epoch_loop:L._broadcast_sigterm_tensor"]}
    grads = {"issuer": "deepspeed", "op": "all_reduce", "count": 4.0, "bytes": 4e6, "time_s": 0.3, "transfer_s": 0.2,
             "origins": ["deepspeed.comm.torch:TorchBackend.all_reduce"]}
    rare = {**flag, "op": "barrier", "count": 0.0, "bytes": 0.0, "time_s": 0.0, "transfer_s": 0.0}
    comm = dataclasses.replace(_comm(), by_kind=(grads, flag, rare))
    (b,) = [b for b in diagnose(breakdown=_bd(exposed_comm=35, backward_compute=65), comm=comm, world_size=2)
            if b.category == "communication"]
    assert b.evidence["framework_sync_pct_by_kind"] == {"lightning broadcast": 5.0}
    assert b.evidence["framework_sync_bytes_by_kind"] == {"lightning broadcast": 8.0}
    assert b.evidence["comm_origins_by_kind"]["deepspeed all_reduce"] == grads["origins"]


@pytest.mark.parametrize(("share", "severity"), [(4.0, None), (6.0, "medium"), (12.0, "high"), (35.0, "critical")])
def test_checkpoint_saves_are_graded_by_their_share_of_the_measured_time(share, severity):
    import pandas as pd

    from torsh_tune.analysis import checkpoint_saves

    # 40 steps of 0.1 s per rank; rank 1's saves (every 10 steps) take `share` % of its 4 s, rank 0's half that.
    rows = [{"rank": r, "step": s, "step_s": 0.1, "checkpoint_s": (share / 100 * 4.0 / 4 / (2 - r)) if s % 10 == 9
             else None} for r in (0, 1) for s in range(40)]
    saves = checkpoint_saves(pd.DataFrame(rows))
    assert saves["rank"] == 1 and saves["saves"] == 4 and saves["every_steps"] == 10
    assert saves["checkpoint_pct"] == pytest.approx(share, rel=0.05)
    found = [b for b in diagnose(breakdown=_bd(forward=50.0, other=50.0), checkpoint=saves, world_size=2)
             if "checkpoint_pct" in b.evidence]
    assert [b.severity for b in found] == ([severity] if severity else [])
    if severity:
        (b,) = found
        assert b.category == "io" and "spent saving checkpoints: 4 save(s)" in b.message
        (rec,) = recommend(found)
        assert "async_save" in rec.title and rec.expected_gain.high_pct == pytest.approx(b.evidence["checkpoint_pct"])
    assert checkpoint_saves(pd.DataFrame(rows).drop(columns="checkpoint_s")) is None


@pytest.mark.parametrize(("share", "severity"), [(4.0, None), (6.0, "medium"), (12.0, "high"), (45.0, "high")])
def test_evaluation_passes_are_graded_by_their_share_of_the_measured_time(share, severity):
    import pandas as pd

    from torsh_tune.analysis import evaluation_passes

    # 40 steps of 0.1 s per rank; rank 0's evaluations (every 10 steps, 6 batches of 32) take `share` % of its 4 s.
    rows = [{"rank": r, "step": s, "step_s": 0.1, "eval_s": share / 100 * 4.0 / 4 * (1 - r / 2) if s % 10 == 9
             else None, "eval_batches": 6 if s % 10 == 9 else None, "eval_samples": 192 if s % 10 == 9 else None}
            for r in (0, 1) for s in range(40)]
    passes = evaluation_passes(pd.DataFrame(rows))
    assert (passes["rank"], passes["passes"], passes["every_steps"]) == (0, 4, 10)
    assert (passes["batches_per_pass"], passes["samples_per_pass"]) == (6, 192)
    assert passes["eval_pct"] == pytest.approx(share, rel=0.05)
    found = [b for b in diagnose(breakdown=_bd(forward=50.0, other=50.0), evaluation=passes, world_size=2)
             if "eval_pct" in b.evidence]
    assert [b.severity for b in found] == ([severity] if severity else [])
    if severity:
        (b,) = found
        assert b.category == "computation" and "is evaluation: 4 pass(es)" in b.message and "(6 batches)" in b.message
        (rec,) = recommend(found)
        assert rec.title == "Evaluate less often, or on fewer batches"
        assert (rec.expected_gain.low_pct, rec.expected_gain.high_pct) == pytest.approx((share / 2, share), rel=0.05)
    assert evaluation_passes(pd.DataFrame(rows).drop(columns="eval_s")) is None


def test_an_evaluations_collectives_are_counted_per_pass_and_left_out_of_the_trainings():
    import pandas as pd

    from torsh_tune.analysis import evaluation_passes
    from torsh_tune.analysis._steps import measured

    steps = pd.DataFrame([{"rank": r, "step": s, "step_s": 0.3 if s in (4, 8) else 0.1, "warmup": s == 0,
                           "eval_s": 0.2 if s in (4, 8) else None, "eval_batches": 4 if s in (4, 8) else None}
                          for r in (0, 1) for s in range(10)])
    # Each step: the training's all-reduce; each pass: a metric's all-reduce per batch, one gather after the loop.
    comm = pd.DataFrame([{"rank": r, "step": s, "seq": i, "collective": op, "issuer": issuer, "phase": phase}
                         for r in (0, 1) for s in range(10)
                         for i, (op, issuer, phase) in enumerate(
                             [("all_reduce", "user", None)]
                             + ([("all_reduce", "lightning", "evaluation")] * 4 + [("all_gather", "lightning", "evaluation")]
                                if s in (4, 8) else []))])
    passes = evaluation_passes(steps[~steps["warmup"]], comm)
    assert (passes["collectives_per_pass"], passes["collective_kinds"]) == (5, ["lightning all_reduce", "lightning all_gather"])
    (b,) = [b for b in diagnose(breakdown=_bd(forward=50.0, other=50.0), evaluation=passes, world_size=2)
            if "eval_pct" in b.evidence]
    assert "5 collective(s) per pass (lightning all_reduce, lightning all_gather)" in b.message
    _, training, _ = measured(steps, comm)
    assert set(training["issuer"]) == {"user"} and len(training) == 2 * 9


@pytest.mark.parametrize(("built_by", "where"), [("transformers", "per_device_eval_batch_size"),
                                                  ("lightning", "limit_val_batches"),
                                                  ("user", "the script's evaluation interval")])
def test_the_evaluation_advice_says_where_each_framework_sets_it(built_by, where):
    from torsh_tune.analysis import Bottleneck

    b = Bottleneck(category="computation", severity="high", ranks=(0, 1), message="",
                   evidence={"eval_pct": 20.0, "median_pass_s": 0.05, "every_steps": 4, "batches_per_pass": 8})
    (rec,) = recommend([b], meta={0: {"ddp": {"built_by": built_by}}})
    assert where in rec.rationale and "50 ms every 4 steps" in rec.rationale
