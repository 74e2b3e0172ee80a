"""System statistics count only the samples covering the measured steps of each rank, by the time they cover."""

from __future__ import annotations

import doctest

import pandas as pd
import pytest

from torsh_tune.analysis import _resources, system_stats
from torsh_tune.analysis._resources import GPU_UTIL_CAVEAT, measured_windows
from torsh_tune.records import columns_of


def _system(rows):
    base = {c: None for c in columns_of("system")}
    return pd.DataFrame([{**base, "sys_cpu_pct": 10.0, "rss_bytes": 1, "mem_total_bytes": 2, **r} for r in rows])


def _steps(rank, spans, warmup_steps):
    """Step records of one rank: (t_start, t_end) per step, the first `warmup_steps` warm-up."""
    base = {c: None for c in columns_of("steps")}
    return pd.DataFrame([{**base, "rank": rank, "step": i, "t_start": a, "t_end": b, "step_s": b - a,
                          "warmup": i < warmup_steps} for i, (a, b) in enumerate(spans)])


def _run():
    """Two ranks: idle start-up (0-10 s) and teardown (> 20 s) around busy measured steps.

    Rank 0 warms up over 10-12 s and measures 12-20 s; rank 1 starts a second later.
    """
    steps = pd.concat([
        _steps(0, [(10.0, 12.0), (12.0, 16.0), (16.0, 20.0)], warmup_steps=1),
        _steps(1, [(11.0, 13.0), (13.0, 17.0), (17.0, 21.0)], warmup_steps=1),
    ], ignore_index=True)
    rows = []
    for rank in (0, 1):
        for t in range(0, 26):
            t0, t1 = (12.0, 20.0) if rank == 0 else (13.0, 21.0)
            busy = t0 <= t <= t1
            warm = (10.0 if rank == 0 else 11.0) <= t < t0
            util = 90.0 if busy else 50.0 if warm else 0.0
            rows.append(dict(rank=rank, t=float(t), cpu_pct=100.0 if busy else 5.0, gpu_util_pct=util,
                             gpu_power_w=400.0 if busy else 80.0))
    return _system(rows), steps


def test_only_samples_inside_the_measured_window_count():
    system, steps = _run()
    warnings: list[str] = []
    inside = system_stats(system, steps, warnings=warnings)
    assert inside.gpu_util_pct_mean == pytest.approx(90.0)
    assert inside.cpu_pct_mean == pytest.approx(100.0)
    assert inside.gpu_power_w_mean == pytest.approx(400.0)
    assert warnings == []
    # Over the whole run the idle start-up and teardown pull the mean far down.
    everything = system_stats(system)
    assert everything.gpu_util_pct_mean < 45.0


def test_windows_are_per_rank_and_skip_warmup():
    _, steps = _run()
    windows, only_warmup = measured_windows(steps)
    assert windows == {0: (12.0, 20.0), 1: (13.0, 21.0)} and not only_warmup
    # Rank 1's sample at t=21 is inside its window, rank 0's is not.
    system = _system([dict(rank=0, t=21.0, gpu_util_pct=0.0), dict(rank=1, t=21.0, gpu_util_pct=60.0)])
    assert system_stats(system, steps).gpu_util_pct_mean == pytest.approx(60.0)


def test_without_step_records_every_sample_counts_and_says_so():
    system, _ = _run()
    warnings: list[str] = []
    for steps in (None, pd.DataFrame(columns=columns_of("steps"))):
        stats = system_stats(system, steps, warnings=warnings)
        assert stats.gpu_util_pct_mean == pytest.approx(system["gpu_util_pct"].mean())
    assert len(warnings) == 2 and all("every system sample" in w for w in warnings)


def test_all_warmup_run_uses_the_warmup_steps_and_says_so():
    system, steps = _run()
    warnings: list[str] = []
    stats = system_stats(system, steps.assign(warmup=True), warnings=warnings)
    windows, only_warmup = measured_windows(steps.assign(warmup=True))
    assert only_warmup and windows == {0: (10.0, 20.0), 1: (11.0, 21.0)}
    assert 50.0 < stats.gpu_util_pct_mean < 90.0  # warm-up samples (50 %) join the busy ones
    assert any("warm-up" in w for w in warnings)


def test_no_sample_covering_the_window_falls_back_and_says_so():
    _, steps = _run()
    # Both samples cover time before rank 0's window (12-20 s) only.
    system = _system([dict(rank=0, t=1.0, gpu_util_pct=10.0), dict(rank=0, t=5.0, gpu_util_pct=30.0)])
    warnings: list[str] = []
    assert system_stats(system, steps, warnings=warnings).gpu_util_pct_mean == pytest.approx(20.0)
    assert len(warnings) == 1 and "none of the 2 samples" in warnings[0]


def test_a_sample_spanning_the_whole_window_is_its_measurement():
    """Without `t_since` a sample covers the time since the rank's previous one: the one at 30 s
    covers 1-30 s, the whole window, and is its measurement (not a fallback to every sample)."""
    _, steps = _run()
    system = _system([dict(rank=0, t=1.0, gpu_util_pct=10.0), dict(rank=0, t=30.0, gpu_util_pct=30.0)])
    warnings: list[str] = []
    assert system_stats(system, steps, warnings=warnings).gpu_util_pct_mean == pytest.approx(30.0)
    assert warnings == []


def _steps_of(window: tuple[float, float]) -> pd.DataFrame:
    return _steps(0, [(window[0] - 0.1, window[0]), window], warmup_steps=1)


def test_a_window_shorter_than_the_interval_uses_the_sample_that_covers_it_not_start_up():
    """A 6-step run of ~50 ms steps: 0.3 s of window, samples every second. Before, no sample fell
    inside, every sample counted, and start-up's 100 % CPU said the cores were saturated."""
    steps = _steps_of((12.0, 12.3))
    system = _system([dict(rank=0, t=11.5, t_since=10.5, cpu_pct=100.0, idle_cores=0.0, cpu_cores=2),
                      dict(rank=0, t=12.5, t_since=11.5, cpu_pct=40.0, idle_cores=1.2, cpu_cores=2)])
    warnings: list[str] = []
    stats = system_stats(system, steps, meta={0: {"hostname": "a"}}, warnings=warnings)
    assert stats.cpu_pct_mean == pytest.approx(40.0) and stats.idle_cores_per_rank == pytest.approx(1.2)
    assert warnings == []


def test_each_sample_weighs_the_seconds_of_the_window_it_covers():
    """The runtime samples as the window opens: that sample covers start-up, and weighs 0.01 s."""
    steps = _steps_of((12.0, 20.0))
    system = _system([dict(rank=0, t=12.01, t_since=0.0, cpu_pct=100.0, idle_cores=0.0, cpu_cores=2),
                      dict(rank=0, t=20.02, t_since=12.01, cpu_pct=40.0, idle_cores=1.0, cpu_cores=2),
                      dict(rank=0, t=21.0, t_since=20.02, cpu_pct=5.0, idle_cores=2.0, cpu_cores=2)])
    stats = system_stats(system, steps, meta={0: {"hostname": "a"}})
    assert stats.cpu_pct_mean == pytest.approx((100.0 * 0.01 + 40.0 * 7.99) / 8.0)
    assert stats.idle_cores_per_rank == pytest.approx(1.0 * 7.99 / 8.0, abs=1e-3)


def test_rank_without_steps_is_left_out_and_named():
    system, steps = _run()
    extra = _system([dict(rank=2, t=15.0, gpu_util_pct=0.0, cpu_pct=0.0)])
    warnings: list[str] = []
    stats = system_stats(pd.concat([system, extra], ignore_index=True), steps, warnings=warnings)
    assert stats.gpu_util_pct_mean == pytest.approx(90.0)
    assert len(warnings) == 1 and "[2]" in warnings[0]


def test_gpu_util_caveat_names_collective_waits():
    assert "collective" in GPU_UTIL_CAVEAT and "busy" in GPU_UTIL_CAVEAT
    assert "collective" in system_stats.__doc__


def test_docstring_example_runs():
    assert doctest.testmod(_resources, raise_on_error=False).failed == 0
