from __future__ import annotations

import json
import math
import os
import subprocess
import sys

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
from torsh_tune.analysis._workers import WORKERS_HELP_MIN_PCT, size_workers
from torsh_tune.config import RunConfig
from torsh_tune.fabric import AlphaBeta, CommModel, save_model

from .conftest import DATA, SCENARIOS, rewrite_jsonl
from .test_bottlenecks import _bd, _comm

MiB = 1 << 20


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
    # No bench model and no recorded buckets to fit the fabric from: the cap is not guessed.
    bucket = next(r for r in recs if r.category == "communication" and "bucket" in r.title)
    assert bucket.config_patch == {} and "fewer than two DDP buckets" in bucket.rationale
    assert next(r for r in recs if r.category == "io").config_patch["dataloader"]["pin_memory"] is True


# Every scenario has at least these recommendations (a scenario without one would test nothing).
_EXPECTED = {"healthy": {"computation"}, "data_bound": {"io", "computation"},
             "comm_bound": {"communication", "network"}, "straggler": {"straggler", "computation"},
             "torn_line": {"computation"}, "crashed": {"computation"}}


@pytest.mark.parametrize("name", SCENARIOS)
def test_fixture_recommendations_apply(name):
    a = analyze_run(DATA / name)
    assert {r.category for r in a.recommendations} >= _EXPECTED[name]
    patches = [r.config_patch for r in a.recommendations]
    for patch in patches:
        RunConfig().apply_patch(patch)
    if name in ("data_bound", "comm_bound"):  # a sized knob to try, not only advice
        assert any(patches)


def test_recommendations_are_ordered_by_severity_then_gain():
    a = analyze_run(DATA / "data_bound")
    assert a.recommendations[0].category == "io" and a.recommendations[0].priority == 1
    assert a.recommendations[-1].category == "computation"


def test_workers_are_sized_from_load_time_compute_and_idle_cores():
    # The data-bound example on 2 cores: 52 ms of a 58 ms step waiting, each rank busy
    # 0.46 cores with 0.45 idle ones: the CPU allows a 29 ms step, so two workers, not one.
    s = size_workers(step_s=0.058, data_s=0.052, rank_cpu_cores=0.46, idle_cores_per_rank=0.45)
    cpu_bound = 0.058 * 0.46 / (0.46 + 0.45)
    assert s.cpu_bound_s == pytest.approx(cpu_bound)
    assert s.workers == math.ceil(0.052 / cpu_bound) == 2 and not s.saturated
    assert s.high_pct == pytest.approx(100 * (0.058 - cpu_bound) / 0.058, abs=0.01)
    assert s.low_pct == 0.0  # all-CPU loading on 0.45 idle cores would take longer than the step now
    assert f"workers = ceil(L / T') = ceil({0.052 / cpu_bound:.2f}) = 2" in s.arithmetic
    # Plenty of idle cores: the compute C bounds the step; one worker per C of loading.
    s = size_workers(step_s=0.145, data_s=0.045, rank_cpu_cores=0.95, idle_cores_per_rank=2.36)
    assert (s.workers, s.high_pct, s.low_pct) == (1, pytest.approx(100 * 0.045 / 0.145, abs=0.01),
                                                  pytest.approx(100 * 0.045 / 0.145, abs=0.01))
    # Workers already run: each takes current x step per batch.
    s = size_workers(step_s=0.100, data_s=0.060, current=2, rank_cpu_cores=1.0, idle_cores_per_rank=6.0)
    assert s.load_s == pytest.approx(0.200) and s.workers == math.ceil(0.200 / 0.040) == 5
    # No CPU numbers: no bound, said so; the workers are capped.
    s = size_workers(step_s=0.100, data_s=0.090)
    assert s.cpu_bound_s is None and s.workers == 8 and "unknown" in s.arithmetic


def test_saturated_cores_mean_workers_will_not_help():
    # The 2-core host: two ranks spend 88 % of each step in a CPU-heavy collate, no core idle.
    s = size_workers(step_s=0.100, data_s=0.088, rank_cpu_cores=0.98, idle_cores_per_rank=0.02)
    assert s.saturated and s.high_pct < WORKERS_HELP_MIN_PCT and s.workers == 0
    assert "whatever the workers" in s.arithmetic


def _io_rec(run):
    return next(r for r in analyze_run(run).recommendations if r.category == "io")


def test_io_recommendation_states_its_arithmetic(run_copy):
    a = analyze_run(DATA / "data_bound")
    io = next(b for b in a.bottlenecks if b.category == "io")
    rec = _io_rec(DATA / "data_bound")
    # 8 cores, host 40-41 % busy, 2 ranks: 2.36 idle cores each; C = step - wait >= the CPU bound.
    sizing = choose_num_workers(io, cpu_count=8, ranks_per_node=2)
    c = io.evidence["step_s"] - io.evidence["data_s"]
    assert sizing.workers == math.ceil(io.evidence["data_s"] / c) == 1
    assert rec.config_patch == {"dataloader": {"num_workers": 1, "persistent_workers": True}}
    # A run recorded before the sampler kept each rank's idle cores: run.json's 8 cores / 2 ranks stand in.
    assert io.evidence["idle_cores_basis"].startswith("idle cores per rank = 4 host cores per rank (run.json ")
    assert rec.expected_gain.basis.startswith(io.evidence["idle_cores_basis"] + "; ")
    assert rec.expected_gain.high_pct == pytest.approx(100 * io.evidence["data_s"] / io.evidence["step_s"], abs=0.01)

    # The same run on a saturated 2-core host: the recommendation says why workers cannot help.
    run = run_copy("data_bound")
    for p in (run / "ranks").glob("*.system.jsonl"):
        rewrite_jsonl(p, lambda row: {**row, "sys_cpu_pct": 99.5})
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "cpu_count": 2}))
    saturated = _io_rec(run)
    assert saturated.config_patch == {} and "will not help" in saturated.title
    assert "cheaper collate_fn" in saturated.rationale and "more cores per rank" in saturated.rationale
    assert saturated.expected_gain.high_pct == pytest.approx(io.evidence["data_wait_pct"], abs=0.01)


def test_io_finding_says_so_when_given_the_cores_per_rank():
    a = analyze_run(DATA / "data_bound")
    busy = SystemStats(cpu_pct_mean=98.0, sys_cpu_pct_mean=99.0, gpu_util_pct_mean=None, gpu_power_w_mean=None)
    (io,) = [b for b in diagnose(breakdown=a.breakdown, system=busy, world_size=2, host_cores_per_rank=1.0)
             if b.category == "io"]
    assert "more DataLoader workers will not help" in io.message and "preprocessing offline" in io.message
    assert io.evidence["idle_cores_per_rank"] == 0.01
    idle = SystemStats(cpu_pct_mean=30.0, sys_cpu_pct_mean=30.0, gpu_util_pct_mean=None, gpu_power_w_mean=None)
    (io,) = [b for b in diagnose(breakdown=a.breakdown, system=idle, world_size=2, host_cores_per_rank=4.0)
             if b.category == "io"]
    assert "will not help" not in io.message and "30 % busy" in io.message


def test_a_run_restricted_to_some_cores_of_a_larger_host_counts_only_those(run_copy):
    """Two ranks restricted (taskset, cpuset) to 2 cores of a 32-core host keep both busy: the host
    is 41 % busy, so its idle share says 9.4 idle cores per rank; the ranks' own 2 cores have 0.02."""
    run = run_copy("data_bound")
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "cpu_count": 32}))
    host_wide = _io_rec(run)  # the records were written before the sampler kept each rank's idle cores
    assert host_wide.config_patch["dataloader"]["num_workers"] == 1
    assert host_wide.expected_gain.basis.startswith("idle cores per rank = 16 host cores per rank")
    for p in (run / "ranks").glob("*.system.jsonl"):
        rewrite_jsonl(p, lambda row: {**row, "cpu_cores": 2, "idle_cores": 0.04})
    a = analyze_run(run)
    assert (a.system.cpu_cores, a.system.idle_cores_mean, a.system.idle_cores_per_rank) == (2, 0.04, 0.02)
    io = next(b for b in a.bottlenecks if b.category == "io")
    assert io.evidence["idle_cores_per_rank"] == 0.02 and "more DataLoader workers will not help" in io.message
    rec = next(r for r in a.recommendations if r.category == "io")
    assert "will not help" in rec.title and rec.config_patch == {} and "0.02 idle cores per rank" in rec.rationale
    assert rec.expected_gain.basis.startswith(
        "idle cores per rank = 0.04 idle of the 2 cores that rank(s) 0, 1 on node0 may run on (their affinity mask, "
        "measured) / 2 ranks sharing them = 0.02; ")


@pytest.fixture(scope="module")
def saturated_run(tmp_path_factory):
    """A real 2-rank gloo profile of a CPU-heavy collate, the whole job restricted to one core of the
    host (as taskset or a cpuset would): the ranks saturate that core whatever the host's others do."""
    root = tmp_path_factory.mktemp("saturated")
    (root / "profiler.toml").write_text("[profiler]\nsystem_interval_s = 0.2\n")
    core = min(os.sched_getaffinity(0))
    # 24 measured steps of ~20 ms: a window of several sampler intervals (0.2 s), so both ranks have
    # samples inside it (with 6 steps, 0.12 s, a rank had one or none by chance).
    cmd = [sys.executable, "-m", "torsh_tune.cli", "profile", "--nproc-per-node", "2", "--steps", "24",
           "--warmup-steps", "1", "--config", str(root / "profiler.toml"), "--runs-dir", str(root),
           "--run-name", "cpu", str(DATA / "scripts" / "cpu_collate.py")]
    # A process spinning on the same core takes whatever moments the ranks leave it idle. Without it the core
    # read 0.06-0.07 idle per rank twice in a full suite (never alone): moments where both ranks waited on the
    # disk, which count as idle (iowait), and the verdict sized workers instead. The premise is a busy core.
    pin = lambda: os.sched_setaffinity(0, {core})  # noqa: E731
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, preexec_fn=pin)
    finally:
        hog.kill()
        hog.wait()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root / "cpu", proc.stdout


@pytest.mark.serial
def test_a_cpu_heavy_collate_on_busy_cores_is_told_workers_will_not_help(saturated_run):
    run, stdout = saturated_run
    a = analyze_run(run)
    # The sampler recorded the one core the ranks may run on, and how little of it was idle.
    assert a.system.cpu_cores == 1 and a.system.idle_cores_per_rank < 0.1
    io = next(b for b in a.bottlenecks if b.category == "io")
    assert io.evidence["idle_cores_per_rank"] == a.system.idle_cores_per_rank
    assert "more DataLoader workers will not help" in io.message
    rec = next(r for r in a.recommendations if r.category == "io")
    assert "will not help" in rec.title and rec.config_patch == {}
    assert rec.expected_gain.basis.startswith("idle cores per rank = ") and "of the 1 cores that rank(s) 0, 1 on " in \
        rec.expected_gain.basis and "whatever the workers" in rec.expected_gain.basis
    assert "More DataLoader workers will not help" in stdout  # what the user reads after the run
    system = (run / "ranks" / "rank00000.system.jsonl").read_text().splitlines()
    assert all(json.loads(line)["cpu_cores"] == 1 and "idle_cores" in json.loads(line) for line in system)


def test_straggler_gain_is_bounded_by_its_lateness():
    a = analyze_run(DATA / "straggler")
    rec = a.recommendations[0]
    assert rec.category == "straggler" and rec.config_patch == {} and "rank 2" in rec.title
    assert rec.expected_gain.high_pct == pytest.approx(a.bottlenecks[0].evidence["excess_pct"], abs=0.01)
    assert rec.expected_gain.high_pct == pytest.approx(a.stragglers.lateness_pct, abs=1.0)


def test_comm_gain_is_bounded_by_exposed_comm_and_backward_compute():
    a = analyze_run(DATA / "comm_bound")
    pct = a.breakdown.phases_pct
    bucket = next(r for r in a.recommendations if r.category == "communication" and "bucket" in r.title)
    assert bucket.expected_gain.high_pct == pytest.approx(min(pct["exposed_comm"], pct["backward_compute"]), abs=0.01)
    compress = next(r for r in a.recommendations if r.category == "network" and "Compress" in r.title)
    net = next(b for b in a.bottlenecks if b.category == "network")
    assert compress.expected_gain.high_pct == pytest.approx(net.evidence["transfer_exposed_pct"], abs=0.01)
    assert compress.expected_gain.low_pct == pytest.approx(net.evidence["transfer_exposed_pct"] / 2, abs=0.01)


def test_unknown_categories_get_no_recommendation():
    odd = Bottleneck(category="other", severity="high", ranks=(), evidence={"x_pct": 1.0}, message="?")
    assert recommend([odd]) == ()


def _with_bench(run, alpha_s, busbw_gbps):
    bench = run.parent / f"bench-{alpha_s}"
    bench.mkdir()
    fit = AlphaBeta(collective="all_reduce", level="intra", group_size=2, alpha_s=alpha_s,
                    beta_s_per_byte=1e-9 / busbw_gbps, num_points=6)
    save_model(CommModel(world_size=2, nnodes=1, nproc_per_node=2, fits=(fit,)), bench)
    info = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**info, "reference_bench": str(bench)}))
    recs = analyze_run(run).recommendations
    return next((r for r in recs if r.category == "communication" and "bucket" in r.title), None)


def test_bucket_cap_is_sized_by_the_fabric_model(run_copy):
    """12 MiB of gradients over 24 ms of backward: a slow-latency fabric wants few buckets, a fast one many."""
    run = run_copy("comm_bound")
    slow_latency = _with_bench(run, alpha_s=0.020, busbw_gbps=10.0)
    fast_latency = _with_bench(run, alpha_s=20e-6, busbw_gbps=1.0)
    # 20 ms per collective: the 25 MiB cap now (one 11 MiB bucket after the 1 MiB first) is already
    # the least exposed, so no change. At 20 us, 2 MiB buckets (2.1 ms each on the wire, one ready
    # every 4 ms of backward) leave only the last exposed; 1 MiB ones would hide 1 ms more, under
    # 1 % of the ~100 ms step, so the fewer collectives win.
    assert slow_latency is None
    assert fast_latency.config_patch == {"ddp": {"bucket_cap_mb": 2.0}}
    basis = fast_latency.expected_gain.basis
    assert "alpha 20 us, bus bandwidth 1/beta 1 GB/s (bench " in basis and "1 MiB " in basis and "25 MiB " in basis
    assert 0.0 <= fast_latency.expected_gain.low_pct <= fast_latency.expected_gain.high_pct


def test_the_fabric_is_fitted_to_the_runs_own_buckets_without_a_bench():
    """Two unequal buckets (DDP's small first one): alpha and beta follow from the wire times."""
    alpha, f_beta = 0.002, 1e-9  # s, s per byte (bus factor 1 at 2 ranks)
    sizes = [1 * MiB, 11 * MiB]
    wire = sum(alpha + f_beta * b for b in sizes)
    comm = Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                      evidence={"exposed_comm_pct": 20.0, "attributable_comm_pct": 20.0, "backward_compute_pct": 30.0,
                                "step_s": 0.1, "backward_compute_s": 0.03, "wire_s": wire,
                                "last_wire_s": alpha + f_beta * sizes[-1], "overlap_pct": 20.0,
                                "comm_s": 0.025, "exposed_comm_s": 0.02, "bytes_per_step": 12 * MiB,
                                "num_collectives_per_step": 2})
    meta = {0: {"ddp": {"bucket_cap_mb": 25.0, "param_bytes": 12 * MiB, "bucket_sizes_bytes": sizes}}}
    (bucket,) = [r for r in recommend([comm], meta=meta, world_size=2) if "bucket" in r.title]
    assert "alpha 2e+03 us, bus bandwidth 1/beta 1 GB/s (fitted to this run: 2 buckets" in bucket.expected_gain.basis
    assert bucket.config_patch["ddp"]["bucket_cap_mb"] in (2.0, 5.0)


def test_topk_ratio_comes_from_the_hidden_share_of_communication():
    a = analyze_run(DATA / "comm_bound")
    comm = next(b for b in a.bottlenecks if b.category == "communication").evidence
    rec = next(r for r in a.recommendations if "Top-K" in r.title)
    hidden = (comm["comm_s"] - comm["exposed_comm_s"]) / comm["comm_s"]
    wanted = hidden / 2
    assert rec.config_patch["compression"]["ratio"] == float(f"{min(max(wanted, 0.01), 0.1):.2g}")
    assert f"{hidden:.3g} / 2 = {wanted:.3g}" in rec.expected_gain.basis
    assert rec.expected_gain.low_pct == 0.0  # the selection's compute is not modelled


def test_sized_recommendations_enter_the_study_as_trials(tmp_path):
    """The recorded data-bound baseline: its sized workers become a trial of a real Optuna study."""
    import optuna

    from torsh_tune.autotune import build_space
    from torsh_tune.autotune.seeding import seed_study

    run = DATA / "recorded" / "data_bound"
    rec = _io_rec(run)
    space = build_space(nproc_per_node=2, cpu_count=8)
    study = optuna.create_study(direction="maximize")
    seed_study(study, space, [str(run)], [])
    (trial,) = [t for t in study.trials if t.user_attrs["role"] == "recommendation"
                and "dataloader.num_workers" in t.system_attrs["fixed_params"]]
    assert trial.system_attrs["fixed_params"]["dataloader.num_workers"] == rec.config_patch["dataloader"]["num_workers"]
    assert trial.user_attrs["recommendation"] == rec.title
    enqueued = study.user_attrs["recommendations"]["enqueued"]
    assert any(e["title"] == rec.title and e["basis"] == rec.expected_gain.basis for e in enqueued)
    # A recommendation without a config knob is kept as skipped, with why.
    assert all("no config knob" in line or "same trial" in line or "outside" in line
               for line in study.user_attrs["recommendations"]["skipped"])


def _buffer_finding(pct: float = 12.0) -> Bottleneck:
    step_s = 0.05
    return Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                      evidence={"exposed_comm_pct": 30.0, "attributable_comm_pct": 30.0, "backward_compute_pct": 20.0,
                                "step_s": step_s, "backward_compute_s": 0.01, "overlap_pct": 10.0, "comm_s": 0.02,
                                "exposed_comm_s": 0.015, "bytes_per_step": 9 * MiB, "num_collectives_per_step": 2,
                                "buffer_broadcast_s": step_s * pct / 100,
                                "buffer_broadcast_transfer_s": step_s * pct / 300,
                                "buffer_broadcast_pct": pct})


def _buffer_meta(**ddp):
    return {0: {"ddp": {"bucket_cap_mb": 25.0, "param_bytes": MiB, "broadcast_buffers": True,
                        "buffer_bytes": 8 * MiB, **ddp}}}


def test_ddps_buffer_broadcast_is_recommended_away_with_its_measured_share():
    constant = {"running_stats_bytes": 0,
                "largest_buffers": [{"name": "table", "bytes": 8 * MiB, "running_stats": False}]}
    (rec,) = [r for r in recommend([_buffer_finding()], meta=_buffer_meta(**constant), world_size=2)
              if "broadcast_buffers" in r.title]
    assert rec.config_patch == {"ddp": {"broadcast_buffers": False}}
    RunConfig().apply_patch(rec.config_patch)
    # At most the whole broadcast (it blocks the forward), at least its transfer.
    assert (rec.expected_gain.low_pct, rec.expected_gain.high_pct) == (4.0, 12.0)
    assert rec.effort == "low" and "table 8 MiB" in rec.rationale and "pure cost" in rec.rationale
    assert "In your code: DistributedDataParallel(model, ..., broadcast_buffers=False)" in rec.rationale
    # Where a framework's user sets it.
    hf = recommend([_buffer_finding()], meta=_buffer_meta(**constant, built_by="transformers"), world_size=2)
    assert any("In your code: TrainingArguments(ddp_broadcast_buffers=False)" in r.rationale for r in hf)
    # Batch norm's running statistics: the forward writes them, so the advice says what changes.
    stats = {"running_stats_bytes": 8 * MiB,
             "largest_buffers": [{"name": "bn.running_var", "bytes": 4 * MiB, "running_stats": True}]}
    (rec,) = [r for r in recommend([_buffer_finding()], meta=_buffer_meta(**stats), world_size=2)
              if "broadcast_buffers" in r.title]
    assert rec.effort == "medium" and "all of them are normalization layers' running statistics" in rec.rationale
    assert "(running statistics)" in rec.rationale
    # A run recorded before the kinds were kept: it says to check first.
    (rec,) = [r for r in recommend([_buffer_finding()], meta=_buffer_meta(), world_size=2)
              if "broadcast_buffers" in r.title]
    assert rec.effort == "medium" and "check that the forward never writes them" in rec.rationale
    # Under 1 % of the step, or already off: nothing.
    assert not [r for r in recommend([_buffer_finding(0.5)], meta=_buffer_meta(**constant), world_size=2)
                if "broadcast_buffers" in r.title]
    assert not [r for r in recommend([_buffer_finding()], meta=_buffer_meta(broadcast_buffers=False), world_size=2)
                if "broadcast_buffers" in r.title]


SIGTERM = "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor"


def _sync_finding(kind: str, origins: list[str], pct: float) -> Bottleneck:
    step_s = 0.005
    ev = {"exposed_comm_pct": 40.0, "attributable_comm_pct": 40.0, "backward_compute_pct": 10.0, "step_s": step_s,
          "backward_compute_s": 0.0005, "overlap_pct": 2.0, "comm_s": 0.0026, "exposed_comm_s": 0.002,
          "bytes_per_step": 300 * 1024 + 8, "num_collectives_per_step": 2,
          "comm_s_by_kind": {"ddp all_reduce": 0.0018, kind: step_s * pct / 100},
          "comm_origins_by_kind": {kind: origins}}
    for field, value in (("s", step_s * pct / 100), ("transfer_s", step_s * pct / 400), ("bytes", 8.0),
                         ("count", 1.0), ("pct", pct)):
        ev[f"framework_sync_{field}_by_kind"] = {kind: value}
    return Bottleneck(category="communication", severity="high", ranks=(0, 1), message="", evidence=ev)


def test_a_frameworks_per_step_collective_is_named_by_where_it_is_called_and_sized():
    meta = {0: {"ddp": {"bucket_cap_mb": 25.0, "param_bytes": 300 * 1024, "broadcast_buffers": True,
                        "buffer_bytes": 0, "built_by": "lightning"}}}
    recs = recommend([_sync_finding("lightning broadcast", [f"{SIGTERM} via train.py:<module>"], 10.0)], meta=meta,
                     world_size=2)
    (rec,) = [r for r in recs if "SIGTERM" in r.title]
    # At least its transfer, at most all of it (synchronous, before the batch).
    assert (rec.expected_gain.low_pct, rec.expected_gain.high_pct) == (2.5, 10.0)
    assert f"10.0 % of the step is lightning broadcast (called from {SIGTERM} via train.py:<module>)" in rec.rationale
    assert "#21487" in rec.rationale and "total_batch_idx % 50 == 0" in rec.rationale and not rec.config_patch
    # Anything else a framework issues at most steps: named by where it is called, generic advice.
    other = "lightning.pytorch.callbacks.something:Flag.check"
    (rec,) = [r for r in recommend([_sync_finding("lightning all_reduce", [other], 5.0)], meta=meta, world_size=2)
              if "per-step all_reduce" in r.title]
    assert rec.title == "Issue lightning's per-step all_reduce less often" and f"called from {other}" in rec.rationale
    # Known by the framework's caller: the Trainer's gather of each batch's token count through accelerate.
    hf = ("accelerate.utils.operations:_gpu_gather.<locals>._gpu_gather_one"
          " via transformers.trainer:Trainer._get_num_items_in_batch")
    (rec,) = [r for r in recommend([_sync_finding("accelerate all_gather", [hf], 3.0)], meta=meta, world_size=2)
              if "tokens" in r.title]
    assert "average_tokens_across_devices=False" in rec.title and "#34242" in rec.rationale
    # Under 1 % of the step: nothing.
    assert not [r for r in recommend([_sync_finding("lightning broadcast", [SIGTERM], 0.5)], meta=meta, world_size=2)
                if "SIGTERM" in r.title]


def test_a_frameworks_per_step_collective_is_not_sized_as_gradient_communication():
    from torsh_tune.analysis._recommend import _gradient_evidence

    ev = _sync_finding("lightning broadcast", [SIGTERM], 10.0).evidence
    grads, e = _gradient_evidence(ev, 40.0)
    assert e == 30.0 and grads["num_collectives_per_step"] == 1 and grads["bytes_per_step"] == 300 * 1024
    assert grads["comm_s"] == pytest.approx(0.0026 - 0.0005) and ev["comm_s"] == 0.0026  # the finding's own kept


@pytest.mark.serial
def test_a_real_runs_buffer_broadcast_is_measured_and_recommended_away(tmp_path):
    """2 ranks, gloo: a model with an 8 MiB constant buffer (a lookup table) that DDP broadcasts
    from rank 0 before every forward, far longer than the tiny model's compute."""
    from helpers import run_cli

    proc = run_cli("profile", "--nproc-per-node", "2", "--steps", "8", "--warmup-steps", "2", "--runs-dir",
                   str(tmp_path), "--run-name", "buffers", str(DATA / "scripts" / "train_small.py"), "--buffer-mb", "8")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "buffers"
    meta = json.loads((run / "ranks" / "rank00000.meta.json").read_text())["ddp"]
    assert meta["buffer_bytes"] == 8 * MiB and meta["running_stats_bytes"] == 0
    assert meta["largest_buffers"] == [{"name": "table", "bytes": 8 * MiB, "running_stats": False}]
    report = json.loads((run / "report" / "report.json").read_text())
    kinds = {(k["issuer"], k["op"]): k for k in report["communication"]["by_kind"]}
    assert set(kinds) == {("ddp", "broadcast"), ("ddp", "all_reduce")}
    broadcast = kinds[("ddp", "broadcast")]
    assert broadcast["count"] == 1 and broadcast["bytes"] == 8 * MiB
    assert broadcast["time_s"] >= broadcast["transfer_s"] > 0
    comm = next(b for b in report["bottlenecks"] if b["category"] == "communication")
    step_s = comm["evidence"]["step_s"]
    assert comm["evidence"]["buffer_broadcast_pct"] == pytest.approx(100 * broadcast["time_s"] / step_s, abs=0.01)
    rec = next(r for r in report["recommendations"] if r["config_patch"] == {"ddp": {"broadcast_buffers": False}})
    gain = rec["expected_gain"]
    assert gain["low_pct"] == pytest.approx(100 * broadcast["transfer_s"] / step_s, abs=0.01)
    assert gain["high_pct"] == pytest.approx(min(100 * broadcast["time_s"] / step_s,
                                                 comm["evidence"]["attributable_comm_pct"]), abs=0.01)
    assert "table 8 MiB" in rec["rationale"] and "pure cost" in rec["rationale"] and meta["built_by"] == "user"
    md = (run / "report" / "report.md").read_text()
    assert "| ddp | broadcast | 1 | 8.00 MiB |" in md
    # The main job's seeding: the recommendation is a trial of the study's space, built from this baseline.
    from torsh_tune.autotune import advisor_params, build_space
    from torsh_tune.autotune.objective import recorded_ddp

    space = build_space(nproc_per_node=2, cpu_count=2, baseline_buffers=recorded_ddp([run]))
    rows = [{"rank": r["priority"], "name": r["title"], "config_patch": r["config_patch"]}
            for r in report["recommendations"] if r["config_patch"]]
    trials = dict(advisor_params(rows, space))
    assert trials[rec["priority"]] == {**space.baseline_params(), "ddp.broadcast_buffers": False}


def test_fsdps_recommendation_names_what_its_collectives_spend():
    def finding(by_kind):
        return Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                          evidence={"exposed_comm_pct": 30.0, "attributable_comm_pct": 30.0,
                                    "backward_compute_pct": 20.0, "step_s": 0.05, "comm_s_by_kind": by_kind})

    meta = {0: {"collectives": {"fsdp": {"count": 12, "bytes": 1 << 24}}}}
    # FSDP2's op names, as the capture records them.
    ag, rs = "fsdp all_gather_into_tensor", "fsdp reduce_scatter_tensor"
    (gathers,) = recommend([finding({ag: 0.006, rs: 0.002})], meta=meta, world_size=2)
    assert f"exposed (per step: {ag} 6 ms; {rs} 2 ms): prefetch" in gathers.rationale
    (scatters,) = recommend([finding({rs: 0.006, ag: 0.002})], meta=meta, world_size=2)
    assert "the reduce-scatters take longest" in scatters.rationale and not scatters.config_patch
    # FSDP1 (its collectives issued outside fsdp._fully_shard): FullyShardedDataParallel's own arguments.
    fsdp1 = finding({rs: 0.006, "fsdp all_gather": 0.002})
    fsdp1.evidence["comm_origins_by_kind"] = {rs: ["torch.distributed.fsdp._runtime_utils:_reduce_grad"]}
    (rec,) = recommend([fsdp1], meta=meta, world_size=2)
    assert "MixedPrecision(reduce_dtype=torch.bfloat16)" in rec.rationale and "SHARD_GRAD_OP" in rec.rationale
    assert "set_modules_to_forward_prefetch" not in rec.rationale


@pytest.mark.parametrize(("comm_s", "title", "gain_high"), [
    (0.030, "Put fewer bytes on the wire: the engine's collectives outlast the backward they overlap", 30.0),
    (0.008, "Shorten the tail of the engine's overlapped collectives", 20.0),
])
def test_an_engine_that_already_overlaps_its_collectives_is_told_what_is_left(comm_s, title, gain_high):
    kind = "user all_reduce"
    evidence = {"exposed_comm_pct": 30.0, "attributable_comm_pct": 30.0, "overlap_pct": 50.0,
                "backward_compute_pct": 20.0, "step_s": 0.05, "backward_compute_s": 0.01,
                "comm_s_by_kind": {kind: comm_s}, "comm_blocked_s_by_kind": {kind: 0.015},
                "comm_async_share_by_kind": {kind: 1.0}, "comm_origins_by_kind": {kind: ["train.py:Engine._ready"]}}
    meta = {0: {"collectives": {"user": {"count": 6, "bytes": 1 << 24}}}}
    finding = Bottleneck(category="communication", severity="high", ranks=(0, 1), message="", evidence=evidence)
    (rec,) = recommend([finding], meta=meta, world_size=2)
    assert rec.title == title and "DDP instead" not in rec.title and not rec.config_patch
    assert (f"come from 'user' code (train.py:Engine._ready), issued with async_op=True during backward "
            f"({kind}: {1e3 * comm_s:.3g} ms per step), and the training thread waits 15 ms per step") in rec.rationale
    # Longer than the backward: at most half of them (half the bytes); else what the backward can hide; never
    # more than is exposed.
    assert rec.expected_gain.high_pct == pytest.approx(gain_high)
    # The same collectives issued synchronously: DDP's overlap is the advice.
    sync = {**evidence, "comm_async_share_by_kind": {kind: 0.0}}
    (rec,) = recommend([Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                                   evidence=sync)], meta=meta, world_size=2)
    assert rec.title == "Average gradients with DDP instead of blocking all-reduces after backward"
    assert "block the training thread" in rec.rationale
    # Issued asynchronously but none during a backward (a loop over the gradients after it, each result
    # waited for at its first use: functional collectives): nothing overlaps them either.
    after = {**evidence, "comm_backward_issue_share_by_kind": {kind: 0.0}}
    (rec,) = recommend([Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                                   evidence=after)], meta=meta, world_size=2)
    assert rec.title == "Average gradients with DDP instead of blocking all-reduces after backward"
    assert "are issued asynchronously after backward, so nothing overlaps them" in rec.rationale
    assert "during backward (" not in rec.rationale
    # Issued during the backward: the engine's advice, as without the share (runs recorded before it).
    during = {**evidence, "comm_backward_issue_share_by_kind": {kind: 1.0}}
    (rec,) = recommend([Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                                   evidence=during)], meta=meta, world_size=2)
    assert rec.title == title


def test_tensor_parallelisms_collectives_are_advised_as_activations_not_gradients():
    kind = "dtensor all_reduce"
    evidence = {"exposed_comm_pct": 35.0, "attributable_comm_pct": 35.0, "overlap_pct": 10.0,
                "backward_compute_pct": 20.0, "step_s": 0.026, "backward_compute_s": 0.005,
                "comm_s_by_kind": {kind: 0.0105}, "comm_blocked_s_by_kind": {kind: 0.0094},
                "comm_async_share_by_kind": {kind: 1.0}}
    meta = {0: {"collectives": {"dtensor": {"count": 5, "bytes": 1 << 20}}}}
    (rec,) = recommend([Bottleneck(category="communication", severity="high", ranks=(0, 1), message="",
                                   evidence=evidence)], meta=meta, world_size=2)
    assert rec.title == "Take tensor parallelism's collectives off the critical path"
    assert "waits 9.4 ms per step" in rec.rationale and "SequenceParallel" in rec.rationale
    assert "gradients in bf16" not in rec.rationale and rec.expected_gain.high_pct == pytest.approx(35.0)


def test_a_pipeline_schedules_send_recv_and_its_last_stage_are_advised_as_a_pipeline():
    send, recv = "pipeline send", "pipeline recv"
    evidence = {"exposed_comm_pct": 19.0, "attributable_comm_pct": 19.0, "overlap_pct": 31.4,
                "backward_compute_pct": 30.0, "step_s": 0.024, "backward_compute_s": 0.007,
                "comm_s_by_kind": {send: 0.0074, recv: 0.0064}, "comm_blocked_s_by_kind": {send: 0.002, recv: 0.0075},
                "comm_async_share_by_kind": {send: 1.0, recv: 1.0}}
    meta = {0: {"collectives": {"pipeline": {"count": 8, "bytes": 1 << 18}}}}
    comm = Bottleneck(category="communication", severity="high", ranks=(0, 1), message="", evidence=evidence)
    late = Bottleneck(category="straggler", severity="medium", ranks=(0,), message="",
                      evidence={"slowest_rank": 0, "excess_pct": 12.6, "last_share_pct": 80.0})
    rec, straggler = recommend([comm, late], meta=meta, world_size=2)
    # Activations and their gradients between stages: no gradient to compress, no DDP to switch to.
    assert rec.title == "Shrink the pipeline's waits between stages" and not rec.config_patch
    assert "waits 9.5 ms per step" in rec.rationale and "ScheduleInterleaved1F1B" in rec.rationale
    assert "PowerSGD" not in rec.rationale and "DDP" not in rec.rationale
    # The first stage finishes last by construction: balance the stages, not "replace the slow rank".
    assert straggler.title == "Balance the pipeline's stages (rank 0 finishes last)"
    assert "move layers" in straggler.rationale and straggler.expected_gain.high_pct == pytest.approx(12.6)
    # The same lateness without a pipeline is a slow rank.
    (plain,) = recommend([late], meta={0: {"collectives": {"ddp": {"count": 3, "bytes": 1 << 20}}}}, world_size=2)
    assert plain.title == "Fix or replace the slow rank 0"


@pytest.mark.parametrize(("built_by", "key", "value", "where"), [
    ("user", "bucket_cap_mb", 5.0, "DistributedDataParallel(model, ..., bucket_cap_mb=5.0)"),
    ("transformers", "bucket_cap_mb", 5.0, "TrainingArguments(ddp_bucket_cap_mb=5.0)"),
    ("transformers", "gradient_as_bucket_view", True, "TrainingArguments has no field for gradient_as_bucket_view"),
    ("accelerate", "gradient_as_bucket_view", True,
     "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])"),
    ("lightning", "broadcast_buffers", False, "Trainer(strategy=DDPStrategy(broadcast_buffers=False))"),
])
def test_ddp_advice_says_where_the_users_own_code_sets_it(built_by, key, value, where):
    from torsh_tune.analysis._recommend import _Context, _in_your_code

    ctx = _Context({}, {}, {0: {"ddp": {"built_by": built_by}}}, 2)
    text = _in_your_code(ctx, key, value)
    assert text.startswith(f"In your code: {where}") and text.endswith("the patch below does it")


@pytest.mark.serial
def test_a_loader_that_starts_its_workers_every_epoch_is_found_and_its_patch_keeps_them(tmp_path):
    """2 ranks, gloo: the data-bound example with 2 DataLoader workers and epochs of 4 steps (64 samples,
    batches of 8 per rank). Without persistent workers every epoch's iterator starts two processes and
    waits for their first batch: the median step never shows it, the finding and its patch do."""
    from helpers import run_cli

    from torsh_tune.autotune import advisor_params, build_space
    from torsh_tune.autotune.objective import effective_settings
    from torsh_tune.autotune.seeding import script_values
    from torsh_tune.reports import patch_to_toml

    example = DATA.parents[1] / "examples" / "data_bound.py"
    args = [str(example), "--num-workers", "2", "--num-samples", "64", "--batch-size", "8", "--read-ms", "1",
            "--image-size", "32", "--log-every", "1000"]
    budget = ["--nproc-per-node", "2", "--steps", "12", "--warmup-steps", "2", "--runs-dir", str(tmp_path)]
    proc = run_cli("profile", *budget, "--run-name", "restarts", *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "restarts"
    for rank in (0, 1):
        steps = [json.loads(line) for line in (run / "ranks" / f"rank{rank:05d}.steps.jsonl").read_text().splitlines()]
        # The first iterator starts in the warm-up (which its 2 x 2 ready batches extend to step 4); then one
        # restart every 4 steps, at each epoch's first step, and never the data wait's.
        measured = [s for s in steps if not s["warmup"]]
        assert [s["step"] for s in measured if s.get("loader_starts")] == [4, 8, 12], measured
        assert all(s["loader_starts"] == 2 and s["loader_restart_s"] > 0 for s in measured if s.get("loader_starts"))
    report = json.loads((run / "report" / "report.json").read_text())
    found = next(b for b in report["bottlenecks"] if "restart_pct" in b["evidence"])
    ev = found["evidence"]
    assert found["category"] == "io" and found["severity"] in ("medium", "high", "critical")
    assert (ev["restarts"], ev["workers"], ev["every_steps"]) == (3, 2, 4)
    assert ev["median_restart_step_s"] > ev["usual_step_s"] and ev["excess_s"] > 0
    assert ev["restart_pct"] == pytest.approx(100 * ev["excess_s"] / ev["measured_s"], abs=0.01)
    rec = next(r for r in report["recommendations"] if r["config_patch"] == {"dataloader": {"persistent_workers": True}})
    gain = rec["expected_gain"]
    assert gain["of"] == "measured" and gain["high_pct"] == pytest.approx(ev["restart_pct"], abs=0.01)
    assert gain["low_pct"] == pytest.approx(max(0.0, ev["restart_pct"] - ev["first_batch_pct"]), abs=0.01)
    assert "% of the measured time" in (run / "report" / "report.md").read_text()
    # The tuner's trial of it keeps the script's 2 workers (PyTorch's default 0 would make it trial 0).
    space = build_space(nproc_per_node=2, cpu_count=2)
    assert script_values([str(run)]) == {"dataloader.num_workers": 2}
    [(_, params)] = advisor_params([{"rank": 1, "name": rec["title"], "config_patch": rec["config_patch"]}], space,
                                   script=script_values([str(run)]))
    assert (params["dataloader.num_workers"], params["dataloader.persistent_workers"]) == (2, True)
    # The patch, as the user would apply it: the workers start once, in the warm-up, and no finding is left.
    config = tmp_path / "persistent.toml"
    config.write_text(patch_to_toml(rec["config_patch"]))
    proc = run_cli("profile", *budget, "--run-name", "persistent", "--config", str(config), *args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "persistent"
    steps = [json.loads(line) for line in (run / "ranks" / "rank00000.steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if s.get("loader_starts")] == [0]
    report = json.loads((run / "report" / "report.json").read_text())
    assert not [b for b in report["bottlenecks"] if "restart_pct" in b["evidence"]]
    # What ran, as the tuner compares runs: the same workers, now persistent.
    assert effective_settings(run)["dataloaders"] == [
        {"num_workers": 2, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}]
    assert effective_settings(tmp_path / "restarts")["dataloaders"][0]["persistent_workers"] is False


def test_a_loader_restarts_cost_leaves_out_the_evaluation_in_its_step_and_is_advised_in_the_frameworks_terms():
    import pandas as pd

    from torsh_tune.analysis import loader_restarts

    # Rank 0: epochs of 4 steps of 0.1 s; each restart step 0.5 s, of which the epoch's validation takes 0.2 s
    # (a finding of its own) and the first batch 0.1 s. Rank 1 restarts alike at 0.3 s.
    rows = []
    for rank, restart_s in ((0, 0.5), (1, 0.3)):
        for step in range(1, 13):
            start = step % 4 == 0
            rows.append({"rank": rank, "step": step, "step_s": restart_s if start else 0.1,
                         "data_s": 0.1 if start else 0.0, "eval_s": 0.2 if start and rank == 0 else None,
                         "loader_restart_s": 0.05 if start else None, "loader_starts": 2 if start else None})
    r = loader_restarts(pd.DataFrame(rows))
    # Rank 0: 3 x (0.5 - 0.2 - 0.1) = 0.6 s beyond a usual step over 2.4 s; rank 1: 3 x 0.2 = 0.6 s over 1.8 s.
    assert r["rank"] == 1 and r["restart_pct_by_rank"] == {0: 25.0, 1: 33.33}
    assert (r["restarts"], r["every_steps"], r["workers"]) == (3, 4, 2)
    assert r["median_restart_step_s"] == pytest.approx(0.3) and r["usual_step_s"] == pytest.approx(0.1)
    assert r["first_batch_pct"] == pytest.approx(100 * 0.3 / 1.8)
    (b,) = diagnose(breakdown=None, loader_restarts=r, world_size=2)
    assert b.category == "io" and b.severity == "critical" and b.ranks == (0, 1)  # both over io_high_pct / 2
    assert "2 worker processes again: 3 restart(s), every 4 steps" in b.message
    for built_by, where in (("user", "DataLoader(..., persistent_workers=True)"),
                            ("transformers", "TrainingArguments(dataloader_persistent_workers=True)"),
                            ("lightning", "persistent_workers=True in the DataLoader the LightningModule")):
        (rec,) = recommend([b], meta={0: {"ddp": {"built_by": built_by}}}, world_size=2)
        assert rec.config_patch == {"dataloader": {"persistent_workers": True}} and where in rec.rationale
        assert rec.expected_gain.of == "measured"
        assert (rec.expected_gain.low_pct, rec.expected_gain.high_pct) == (pytest.approx(16.67, abs=0.02), 33.33)


@pytest.mark.serial
def test_accumulation_that_all_reduces_every_micro_batch_is_measured_per_all_reduce_and_told_to_use_no_sync(tmp_path):
    """2 ranks, gloo: 3 micro-batches per step, each backward outside `no_sync`. DDP reports a forward's timers at
    its next synchronizing forward: read once per step, 2 of the 3 all-reduces were missing and the third came from
    the next step (the self-check read comm -53, exposed -40 pp against a trace on a 4-micro-batch script)."""
    from helpers import run_cli

    proc = run_cli("profile", "--nproc-per-node", "2", "--steps", "6", "--warmup-steps", "1", "--runs-dir",
                   str(tmp_path), "--run-name", "syncs", str(DATA / "scripts" / "train_small.py"), "--accum", "3",
                   "--sync-every-micro")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    run = tmp_path / "syncs"
    meta = json.loads((run / "ranks" / "rank00000.meta.json").read_text())["ddp"]
    for rank in (0, 1):
        steps = {s["step"]: s for s in (json.loads(line) for line in
                                        (run / "ranks" / f"rank{rank:05d}.steps.jsonl").read_text().splitlines())}
        comm = [json.loads(line) for line in (run / "ranks" / f"rank{rank:05d}.comm.jsonl").read_text().splitlines()]
        # Probed from step 1 on (the first optimizer step finds the model); the last step's last all-reduce is
        # never reported, and step 0's report was replaced by step 1's: neither is timed.
        counted = [n for n in steps if steps[n].get("ddp_syncs")]
        assert counted == list(range(1, 7)) and all(steps[n]["ddp_syncs"] == 3 for n in counted)
        assert steps[0].get("comm_timed") is False and steps[6].get("comm_timed") is False
        for n in range(1, 6):
            mine = [c for c in comm if c["step"] == n and c["issuer"] == "ddp" and c["collective"] == "all_reduce"]
            assert len(mine) == 3 and all(c["bytes"] == meta["param_bytes"] for c in mine), mine
            assert all(steps[n]["t_start"] <= c["t_issue"] <= c["t_complete"] <= steps[n]["t_end"] for c in mine)
            # The three durations and comm_s are each written to 1 ns (rounded half to even): their sums may differ
            # by 2 ns, which rel=1e-6 alone refused for a 0.98 ms step's comm (0.000984907 against 0.000984908).
            assert steps[n]["comm_s"] == pytest.approx(sum(c["duration_s"] for c in mine), rel=1e-6, abs=2.5e-9)
    report = json.loads((run / "report" / "report.json").read_text())
    found = next(b for b in report["bottlenecks"] if "redundant_exposed_pct" in b["evidence"])
    ev = found["evidence"]
    assert found["category"] == "communication" and (ev["syncs_per_step"], ev["microbatches_per_step"]) == (3, 3)
    assert ev["redundant_exposed_pct"] == pytest.approx(ev["backward_exposed_pct"] * 2 / 3, abs=0.01)
    first = report["recommendations"][0]
    assert "no_sync" in first["title"] and first["config_patch"] == {}
    assert first["expected_gain"]["low_pct"] == first["expected_gain"]["high_pct"] == ev["redundant_exposed_pct"]
