"""Alerts (threshold + duration) on real recorded runs and on one planted run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from torsh_tune.analysis import ALERT_KINDS, analyze_run, find_alerts, load_run
from torsh_tune.config import RunConfig, ThresholdsConfig
from torsh_tune.errors import ConfigError

from .planted_alerts import COMM_STEPS, LOW_GPU, MEM_PRESSURE, SPIKE_STEP, write_planted_run

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"
SHORT = ThresholdsConfig(alert_duration_s=0.5)  # the recorded runs last 1-4 s


def exposed_pct_per_step(frames) -> "list[float]":
    steps = frames.steps[~frames.steps["warmup"]]
    pct = 100 * steps["exposed_comm_s"] / steps["step_s"]
    return pct.groupby(steps["step"]).mean().tolist()


def test_comm_bound_recording_fires_a_communication_overhead_alert():
    frames = load_run(RECORDED / "comm_bound")
    alerts = find_alerts(frames, thresholds=SHORT)
    comm = [a for a in alerts if a.kind == "communication_overhead"]
    assert len(comm) >= 1
    per_step = exposed_pct_per_step(frames)
    a = max(comm, key=lambda x: x.duration_s)
    assert a.comparison == "above" and a.threshold == 30.0 and a.ranks == (0, 1)
    assert a.peak == pytest.approx(max(per_step))  # the worst step of the run lies in the interval
    assert a.peak > 30.0 and a.severity == ("critical" if a.peak > 50.0 else "warning")
    assert 5 <= a.start_step <= a.end_step <= 29  # measured steps only: 5 warm-up + 25 measured
    assert a.duration_s >= 0.5 and a.end_s - a.start_s == pytest.approx(a.duration_s)


def test_compute_bound_recording_has_no_communication_alert():
    # A single step past 30 % (76 ms) is not sustained for 0.5 s: no alert.
    frames = load_run(RECORDED / "compute_bound")
    per_step = exposed_pct_per_step(frames)
    assert sorted(per_step)[-2] < 30.0 < max(per_step)
    assert not [a for a in find_alerts(frames, thresholds=SHORT) if a.kind == "communication_overhead"]


def test_the_duration_rule_keeps_short_runs_quiet():
    # Past the threshold, but for ~3 s: the default 10 s duration does not fire.
    frames = load_run(RECORDED / "comm_bound")
    assert [a for a in find_alerts(frames, thresholds=SHORT) if a.kind == "communication_overhead"]
    assert not [a for a in find_alerts(frames) if a.kind == "communication_overhead"]


def test_planted_run_fires_exactly_the_planted_alerts(tmp_path):
    run = write_planted_run(tmp_path / "planted")
    alerts = analyze_run(run).alerts  # the run's own thresholds: the defaults (10 s)
    by_kind = {a.kind: a for a in alerts}
    assert sorted(by_kind) == sorted(["low_gpu_utilization", "memory_pressure", "communication_overhead",
                                      "step_time_spike"])
    assert len(alerts) == 4  # rank 0's 5 s dip to 30 % is shorter than the duration: no alert

    gpu = by_kind["low_gpu_utilization"]
    rank, start, end = LOW_GPU
    assert gpu.ranks == (rank,) and gpu.severity == "critical" and gpu.peak == 15.0
    assert gpu.duration_s == pytest.approx(end - start) and gpu.num_samples == end - start

    mem = by_kind["memory_pressure"]
    rank, start, end = MEM_PRESSURE
    assert mem.ranks == (rank,) and mem.severity == "critical" and mem.peak == pytest.approx(97.0)
    assert mem.duration_s == pytest.approx(end - start)

    comm = by_kind["communication_overhead"]
    assert (comm.start_step, comm.end_step) == COMM_STEPS and comm.severity == "warning"
    assert comm.peak == pytest.approx(40.0) and comm.ranks == (0, 1)

    spike = by_kind["step_time_spike"]
    assert spike.start_step == spike.end_step == SPIKE_STEP and spike.peak == pytest.approx(4.0)
    assert spike.severity == "warning"  # critical only above 2 x alert_step_spike_factor
    # Most severe first, then by start time.
    assert [a.severity for a in alerts] == ["critical", "critical", "warning", "warning"]
    assert alerts[0].start_s < alerts[1].start_s


def test_thresholds_come_from_the_runs_config(tmp_path):
    run = write_planted_run(tmp_path / "planted")
    config = json.loads((run / "config.json").read_text())
    config["thresholds"] = {"alert_gpu_util_pct": 10.0, "alert_duration_s": 4.0}
    (run / "config.json").write_text(json.dumps(config))
    kinds = [a.kind for a in analyze_run(run).alerts]
    assert "low_gpu_utilization" not in kinds  # 15 % is no longer below the threshold
    frames = load_run(run)
    dip = find_alerts(frames, thresholds=ThresholdsConfig(alert_duration_s=4.0))
    assert [a.ranks for a in dip if a.kind == "low_gpu_utilization"] == [(1,), (0,)]  # the 5 s dip fires at 4 s


def test_overlapping_intervals_of_several_ranks_merge(tmp_path):
    run = write_planted_run(tmp_path / "planted")
    frames = load_run(run)
    frames = dataclasses.replace(frames, system=frames.system.assign(gpu_util_pct=10.0))  # every rank, all along
    gpu = [a for a in find_alerts(frames) if a.kind == "low_gpu_utilization"]
    assert len(gpu) == 1 and gpu[0].ranks == (0, 1)


def test_alert_kinds_and_an_empty_run():
    assert set(ALERT_KINDS) == {"memory_pressure", "low_gpu_utilization", "communication_overhead",
                                "low_cpu_utilization", "step_time_spike"}
    frames = load_run(RECORDED / "data_bound")
    empty = dataclasses.replace(frames, steps=frames.steps.iloc[:0], system=frames.system.iloc[:0])
    assert find_alerts(empty) == ()


@pytest.mark.parametrize("key,value,rule", [("alert_duration_s", -1.0, "a number of seconds >= 0"),
                                            ("alert_step_spike_factor", 1.0, "a number > 1"),
                                            ("alert_memory_pct", 120.0, "a percentage in [0, 100]")])
def test_alert_thresholds_are_validated(key, value, rule):
    with pytest.raises(ConfigError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        RunConfig.from_dict({"thresholds": {key: value}}).validate()
    RunConfig.from_dict({"thresholds": {"alert_duration_s": 600.0}}).validate()  # seconds, not a percentage


def test_a_step_slow_for_its_evaluation_or_its_checkpoint_is_no_spike(tmp_path):
    run = write_planted_run(tmp_path / "planted")
    frames = load_run(run)
    steps = frames.steps
    spike = steps["step"] == SPIKE_STEP
    # The planted spike (4x the median) was the step's evaluation pass: 3/4 of it; then its checkpoint save.
    for col in ("eval_s", "checkpoint_s"):
        held = dataclasses.replace(frames, steps=steps.assign(**{col: (0.75 * steps["step_s"]).where(spike)}))
        assert not [a for a in find_alerts(held) if a.kind == "step_time_spike"], col
    # Rank 0's own pass was short and it waited for rank 1's in the pass's last collective (Lightning's metric
    # sync): every rank waited out the slowest rank's pass.
    slow = float(steps.loc[spike, "step_s"].max())
    both = steps.assign(step_s=steps["step_s"].where(~spike, slow))  # both ranks' records hold the 4x step
    uneven = pd.Series(np.where(both["rank"] == 1, 0.75 * slow, 0.1 * slow), index=both.index)
    held = dataclasses.replace(frames, steps=both.assign(eval_s=uneven.where(spike)))
    assert not [a for a in find_alerts(held) if a.kind == "step_time_spike"]  # each rank's own remainder: 3.6x
    # An evaluation of a tenth of it leaves 3.6x the median to training: still past the 3x factor, still a spike.
    rest = dataclasses.replace(frames, steps=steps.assign(eval_s=(0.1 * steps["step_s"]).where(spike)))
    (a,) = [a for a in find_alerts(rest) if a.kind == "step_time_spike"]
    assert a.start_step == SPIKE_STEP and a.peak == pytest.approx(3.6)
