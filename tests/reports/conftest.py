"""RunAnalysis objects built directly from the analysis dataclasses (no analyzers involved)."""

from __future__ import annotations

from typing import Any

import pytest

from torsh_tune.analysis import (
    Bottleneck,
    Breakdown,
    CommStats,
    GainRange,
    MemoryStats,
    Recommendation,
    RunAnalysis,
    StepStats,
    StragglerStats,
    SystemStats,
)

GENERATED_AT = "2025-01-01T12:00:00+00:00"


def make_analysis(*, run_dir: str = "/runs/demo-run", partial: bool = False, status: str = "ok",
                  warnings: tuple[str, ...] = (), **overrides: Any) -> RunAnalysis:
    """A comm-bound 2-rank run: median step 21.3 ms, 6,009 samples/s, one critical bottleneck."""
    phases_s = {"data": 0.0004, "forward": 0.002, "backward_compute": 0.006, "exposed_comm": 0.0107,
                "optimizer": 0.0018, "other": 0.0004}
    fields: dict[str, Any] = dict(
        run_dir=run_dir,
        name="demo-run",
        info={
            "name": "demo-run",
            "script": "/home/user/project/examples/ddp_mlp.py",
            "script_args": ["--hidden", "512"],
            "versions": {"torsh_tune": "0.1.0", "torch": "2.13.0", "python": "3.11.9"},
            "hostname": "node0",
            "platform": "Linux-6.1-x86_64",
            "cpu_count": 2,
            "mem_total_bytes": 8 * 2**30,
            "started_at": "2025-01-01T11:59:00+00:00",
            "duration_s": 14.2,
            "nnodes": 1,
            "nproc_per_node": 2,
            "config": {"launch": {"nproc_per_node": 2, "backend": "auto"}, "budget": {"steps": 40}},
            "outcome": {"status": status, "message": "rank 1 was killed by SIGKILL" if partial else "",
                        "ranks": {0: "ok", 1: "signal" if partial else "ok"}},
        },
        world_size=2,
        status=status,
        partial=partial,
        warnings=warnings,
        steps=StepStats(num_steps=40, median_step_s=0.0213, p90_step_s=0.0251, mean_step_s=0.0220,
                        std_step_s=0.0015, iqr_step_s=0.0012, samples_per_step=128.0,
                        throughput_samples_s=128.0 / 0.0213),
        breakdown=Breakdown(phases_s=phases_s,
                            phases_pct={k: 100 * v / 0.0213 for k, v in phases_s.items()}, step_s=0.0213),
        comm=CommStats(num_collectives_per_step=2.0, bytes_per_step=2_629_636.0, comm_s=0.014,
                       exposed_comm_s=0.0107, overlap_pct=23.6, transfer_s=0.009, wait_s=0.005,
                       busbw_gbps=0.29, algbw_gbps=0.29, hooks=("allreduce",),
                       ddp_logging={"backend_name": "gloo", "avg_backward_comm_time": 11_000_000},
                       wire_bytes_per_step=2_629_636.0, wait_by_rank_s={0: 0.006, 1: 0.004}),
        stragglers=StragglerStats(
            per_rank=({"rank": 0, "median_step_s": 0.0213, "median_compute_s": 0.0082, "lateness_s": 0.0001,
                       "last_count": 18},
                      {"rank": 1, "median_step_s": 0.0215, "median_compute_s": 0.0083, "lateness_s": 0.0003,
                       "last_count": 22}),
            slowest_rank=1, last_share_pct=55.0, lateness_pct=1.4),
        memory=MemoryStats(device="cpu", peak_bytes_by_rank={0: 400 * 2**20, 1: 410 * 2**20},
                           capacity_bytes=8 * 2**30, peak_pct=9.9),
        system=SystemStats(cpu_pct_mean=97.5, sys_cpu_pct_mean=88.0, gpu_util_pct_mean=None,
                           gpu_power_w_mean=None),
        bottlenecks=(
            Bottleneck(category="communication", severity="critical", ranks=(0, 1),
                       evidence={"exposed_comm_pct": 50.2, "exposed_comm_s": 0.0107, "overlap_pct": 23.6,
                                 "bytes_per_step": 2_629_636, "odd_ratio": float("nan")},
                       message="50.2 % of the step is communication not hidden behind backward compute"),
            Bottleneck(category="io", severity="low", ranks=(1,),
                       evidence={"data_pct": 1.9, "data_s": 0.0004},
                       message="rank 1 waits 1.9 % of the step for data"),
        ),
        recommendations=(
            Recommendation(priority=1, category="communication", title="Raise DDP bucket_cap_mb to 100",
                           rationale="fewer, larger all-reduces amortise the per-collective latency",
                           config_patch={"ddp": {"bucket_cap_mb": 100, "gradient_as_bucket_view": True}},
                           expected_gain=GainRange(low_pct=5.0, high_pct=20.0,
                                                   basis="exposed communication 50.2 % of the step"),
                           effort="low"),
            Recommendation(priority=2, category="communication", title="Compress gradients with PowerSGD",
                           rationale="the all-reduce is transfer-bound", config_patch={},
                           expected_gain=GainRange(low_pct=10.0, high_pct=40.0, basis="transfer 42 % of the step"),
                           effort="medium", verified_by=(3, 7)),
        ),
    )
    fields.update(overrides)
    return RunAnalysis(**fields)


def empty_analysis(**overrides: Any) -> RunAnalysis:
    """A run that crashed before its first measured step: nothing but warnings."""
    fields: dict[str, Any] = dict(
        run_dir="/runs/crashed", name="crashed", info={}, world_size=2, status="failed", partial=True,
        warnings=("no step records: step statistics, breakdown and bottlenecks are unavailable",),
        steps=None, breakdown=None, comm=None, stragglers=None, memory=None, system=None,
        bottlenecks=(), recommendations=(),
    )
    fields.update(overrides)
    return RunAnalysis(**fields)


@pytest.fixture
def analysis() -> RunAnalysis:
    return make_analysis()
