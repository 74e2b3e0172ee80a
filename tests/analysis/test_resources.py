from __future__ import annotations

import pandas as pd
import pytest

from torsh_tune.analysis import data_wait_by_rank, load_run, memory_stats, system_stats
from torsh_tune.records import columns_of

from .conftest import DATA

GiB = 1024**3


def _system(rows):
    base = {c: None for c in columns_of("system")}
    return pd.DataFrame([{**base, "t": 0.0, "cpu_pct": 50.0, "sys_cpu_pct": 20.0, **r} for r in rows])


def _steps(peaks):
    return pd.DataFrame([{"rank": r, "step": 0, "peak_mem_bytes": p} for r, p in peaks.items()])


def test_gpu_memory_is_per_device_worst_rank():
    system = _system([
        dict(rank=0, rss_bytes=GiB, mem_total_bytes=64 * GiB, gpu_util_pct=90.0, gpu_mem_used_bytes=60 * GiB,
             gpu_mem_total_bytes=80 * GiB, gpu_power_w=300.0),
        dict(rank=1, rss_bytes=GiB, mem_total_bytes=64 * GiB, gpu_util_pct=70.0, gpu_mem_used_bytes=40 * GiB,
             gpu_mem_total_bytes=80 * GiB, gpu_power_w=200.0),
    ])
    mem = memory_stats(_steps({0: 50 * GiB, 1: 72 * GiB}), system, {})
    assert mem.device == "cuda" and mem.capacity_bytes == 80 * GiB
    assert mem.peak_bytes_by_rank == {0: 60 * GiB, 1: 72 * GiB}
    assert mem.peak_pct == pytest.approx(90.0)
    sy = system_stats(system)
    assert sy.gpu_util_pct_mean == pytest.approx(80.0) and sy.gpu_power_w_mean == pytest.approx(250.0)


def test_cpu_ranks_on_one_host_share_its_memory():
    system = _system([dict(rank=r, rss_bytes=GiB, mem_total_bytes=16 * GiB) for r in range(4)])
    meta = {0: {"hostname": "a"}, 1: {"hostname": "a"}, 2: {"hostname": "b"}, 3: {"hostname": "b"}}
    mem = memory_stats(_steps({0: 4 * GiB, 1: 4 * GiB, 2: 2 * GiB, 3: 1 * GiB}), system, meta)
    assert mem.device == "cpu" and mem.capacity_bytes == 16 * GiB
    assert mem.peak_pct == pytest.approx(100 * 8 / 16)  # host a: 4 + 4 GiB
    one_host = memory_stats(_steps({0: 4 * GiB, 1: 4 * GiB, 2: 2 * GiB, 3: 1 * GiB}), system, {})
    assert one_host.peak_pct == pytest.approx(100 * 11 / 16)
    assert system_stats(system).gpu_util_pct_mean is None


def test_memory_without_records_is_none():
    empty = pd.DataFrame(columns=columns_of("steps"))
    assert memory_stats(empty, pd.DataFrame(columns=columns_of("system")), {}) is None
    assert system_stats(pd.DataFrame(columns=columns_of("system"))) is None


def test_data_wait_share_per_rank():
    frames = load_run(DATA / "data_bound")
    by_rank = data_wait_by_rank(frames.steps[~frames.steps["warmup"]])
    assert set(by_rank) == {0, 1}
    assert all(28 < v < 34 for v in by_rank.values())  # 45 ms of ~145 ms


def test_idle_cores_are_shared_by_a_hosts_ranks_and_the_tightest_host_counts():
    # Host a: ranks 0, 1 restricted to 2 of its cores (taskset), 0.4 and 0.6 of them idle as each
    # saw it: one pool of 0.5, a quarter core each. Host b: ranks 2, 3 on all 8, 4 idle: 2 each.
    system = _system([dict(rank=0, cpu_cores=2, idle_cores=0.4), dict(rank=1, cpu_cores=2, idle_cores=0.6),
                      dict(rank=2, cpu_cores=8, idle_cores=3.0), dict(rank=3, cpu_cores=8, idle_cores=5.0)])
    meta = {0: {"hostname": "a"}, 1: {"hostname": "a"}, 2: {"hostname": "b"}, 3: {"hostname": "b"}}
    sy = system_stats(system, meta=meta)
    assert (sy.cpu_cores, sy.idle_cores_mean, sy.idle_cores_per_rank) == (2, 0.5, 0.25)
    assert sy.idle_cores_basis == ("idle cores per rank = 0.50 idle of the 2 cores that rank(s) 0, 1 on a may run on "
                                   "(their affinity mask, measured) / 2 ranks sharing them = 0.25 "
                                   "(the fewest of 2 hosts or core sets)")
    # Masks of different sizes on one host are not one mask: each rank keeps its own idle cores.
    apart = system_stats(system, meta={r: {"hostname": "a"} for r in range(4)})
    assert (apart.cpu_cores, apart.idle_cores_per_rank) == (2, 0.25)
    assert system_stats(system.assign(cpu_cores=[1, 2, 8, 8]), meta=meta).idle_cores_per_rank == 0.4


def test_runs_recorded_before_the_sampler_kept_idle_cores_have_none():
    sy = system_stats(_system([dict(rank=0), dict(rank=1)]))
    assert sy.cpu_pct_mean == 50.0 and sy.sys_cpu_pct_mean == 20.0
    assert (sy.cpu_cores, sy.idle_cores_mean, sy.idle_cores_per_rank, sy.idle_cores_basis) == (None,) * 4
    no_columns = _system([dict(rank=0)]).drop(columns=["cpu_cores", "idle_cores"])
    assert system_stats(no_columns).idle_cores_per_rank is None
    assert load_run(DATA / "data_bound").system["idle_cores"].isna().all()  # the recorded fixture is such a run
