"""Objective: throughput and the loss guard on recorded runs (tests/data/recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from torsh_tune.autotune import loss_by_step, loss_deviation, measure_run, running_throughput, throughput_of
from torsh_tune.autotune.objective import per_step_throughput, steady_rate, throughput_unit

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


def _steps(scenario: str) -> pd.DataFrame:
    rows = []
    for path in sorted((RECORDED / scenario / "ranks").glob("rank*.steps.jsonl")):
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("scenario", ["data_bound", "comm_bound", "compute_bound", "straggler"])
def test_throughput_is_global_samples_over_slowest_rank_after_warmup(scenario):
    steps = _steps(scenario)
    m = measure_run(RECORDED / scenario)
    measured = steps[~steps["warmup"]]
    # Computed independently, step by step, from the raw records.
    per_step = []
    for _, g in measured.groupby("step"):
        per_step.append(g["samples"].sum() / g["step_s"].max())
    assert m.throughput.num_steps == len(per_step) == 25
    # The objective: samples over time, a step beyond q3 + 3 IQR and twice the median left out (at most 2 of 25).
    samples = measured.groupby("step")["samples"].sum()
    step_s = measured.groupby("step")["step_s"].max()
    q1, med, q3 = np.quantile(step_s, [0.25, 0.5, 0.75])
    ok = step_s <= max(q3 + 3 * (q3 - q1), 2 * med)
    assert m.throughput.stalls == (~ok).sum() <= 2
    assert m.throughput.samples_s == pytest.approx(samples[ok].sum() / step_s[ok].sum())
    assert m.throughput.median_samples_s == pytest.approx(float(np.median(per_step)))
    q25, q75 = np.quantile(per_step, [0.25, 0.75])
    assert m.throughput.iqr_samples_s == pytest.approx(q75 - q25)
    assert m.throughput.q25_samples_s <= m.throughput.median_samples_s <= m.throughput.q75_samples_s
    assert m.max_microbatches == 1
    assert m.peak_mem_bytes == steps["peak_mem_bytes"].max()


def test_planted_scenarios_rank_as_expected():
    # comm_bound is the slow one by construction; the objective must see that.
    comm = measure_run(RECORDED / "comm_bound").throughput.samples_s
    compute = measure_run(RECORDED / "compute_bound").throughput.samples_s
    assert comm < compute / 5


def _series(step_ms, samples=8):
    return pd.DataFrame({"rank": 0, "step": range(len(step_ms)), "step_s": [t / 1000 for t in step_ms],
                         "samples": samples, "warmup": False})


def test_a_periodic_step_series_is_measured_at_its_rate_not_its_median():
    # Two DataLoader workers hand over batches in turn: short and long steps alternate. Their median
    # lands anywhere between the two (here the 8th and 9th of 16 sorted steps: 22 and 38 ms, or 22 and
    # 23 when the pattern shifts by one); the rate is one batch per 30 ms either way.
    even = [22, 38] * 8
    shifted = [22, 38] * 7 + [22, 23]
    tp_even, tp_shifted = throughput_of(_series(even)), throughput_of(_series(shifted))
    assert tp_even.samples_s == pytest.approx(8 / 0.030) and tp_even.stalls == 0
    assert tp_shifted.samples_s == pytest.approx(16 * 8 / (sum(shifted) / 1000))
    assert tp_shifted.samples_s / tp_even.samples_s < 1.07  # the rate moved with the time, 6 %
    assert tp_shifted.median_samples_s / tp_even.median_samples_s > 1.2  # the median jumped by 30 %
    # Every fourth step three times as long (four workers, a periodic evaluation): a pattern, kept.
    pattern = [10, 10, 10, 70] * 4
    tp = throughput_of(_series(pattern))
    assert tp.stalls == 0 and tp.samples_s == pytest.approx(8 / 0.025)


def test_a_rare_stall_is_left_out_of_the_rate():
    steps = [30.0] * 15 + [400.0]
    rate, stalls = steady_rate(np.full(16, 8.0), np.array(steps) / 1000)
    assert stalls == 1 and rate == pytest.approx(8 / 0.030)
    # Two stalls in 16 steps are more than one in ten: they count (the host is that slow).
    steps = [30.0] * 14 + [400.0, 400.0]
    rate, stalls = steady_rate(np.full(16, 8.0), np.array(steps) / 1000)
    assert stalls == 0 and rate == pytest.approx(16 * 8 / (sum(steps) / 1000))
    # A step a little longer than the others is not a stall (not twice the median).
    rate, stalls = steady_rate(np.full(16, 8.0), np.array([30.0] * 15 + [50.0]) / 1000)
    assert stalls == 0
    # The pruner's running value ends at the objective.
    frame = _series([30.0] * 15 + [400.0])
    assert running_throughput(frame, num_ranks=1).iloc[-1] == pytest.approx(throughput_of(frame).samples_s)


@pytest.mark.parametrize("column", ["eval_s", "checkpoint_s"])
def test_a_rare_evaluation_or_save_is_the_workloads_time_not_a_stall(column):
    # One step of 16 holds an evaluation pass (a save): as long as the stall above, and as rare; it is the job's.
    steps = [30.0] * 15 + [400.0]
    frame = _series(steps).assign(**{column: [None] * 15 + [0.37]})
    tp = throughput_of(frame)
    assert tp.stalls == 0 and tp.samples_s == pytest.approx(16 * 8 / (sum(steps) / 1000))
    assert running_throughput(frame, num_ranks=1).iloc[-1] == pytest.approx(tp.samples_s)
    # ... and the report's throughput says the same.
    from torsh_tune.analysis import step_stats

    st = step_stats(frame.assign(clock="host"))
    assert st.stall_steps == 0 and st.throughput_samples_s == pytest.approx(tp.samples_s)


def test_the_steps_a_trace_window_slowed_are_not_the_objective():
    # A window over steps 8-11 (its profiler warmed up in step 7): those steps 1.5x the others' 30 ms.
    frame = _series([30.0] * 7 + [45.0] * 5 + [30.0] * 8).assign(trace=[None] * 7 + ["warmup"] + ["recorded"] * 4
                                                                   + [None] * 8)
    assert throughput_of(frame).samples_s == pytest.approx(8 / 0.030) and throughput_of(frame).num_steps == 15


def test_warmup_only_or_empty_records_give_no_throughput():
    steps = _steps("data_bound")
    assert throughput_of(steps.assign(warmup=True)) is None
    assert throughput_of(steps.iloc[0:0]) is None
    assert measure_run(RECORDED / "does-not-exist").throughput is None


def test_loss_deviation_over_common_steps():
    steps = _steps("data_bound")
    base = loss_by_step(steps)
    assert len(base) >= 3 and base.index.is_unique
    assert loss_deviation(base, base) == 0.0
    assert loss_deviation(base * 1.02, base) == pytest.approx(0.02)
    assert loss_deviation(base * 0.995, base) == pytest.approx(0.005)
    # Only the common steps count: an extra, wild step in the trial changes nothing.
    extra = pd.concat([base, pd.Series({10_000: 1e6})])
    assert loss_deviation(extra, base) == 0.0
    assert loss_deviation(pd.Series({10_000: 1.0}), base) is None


def test_loss_differs_between_different_trainings():
    # Two different planted workloads have different losses; the guard must notice.
    a = loss_by_step(_steps("comm_bound"))
    b = loss_by_step(_steps("compute_bound"))
    assert loss_deviation(a, b) > 0.01


def test_counted_tokens_make_the_objective_tokens_per_second():
    steps = _steps("comm_bound")
    assert throughput_unit(steps) == "samples/s"
    counted = steps.assign(tokens=steps["samples"] * 128)
    tp = throughput_of(counted)
    assert tp.unit == "tokens/s"
    assert tp.samples_s == pytest.approx(128 * throughput_of(steps).samples_s)
    # One measured record without tokens: samples/s again (a partial count would mislead);
    # warm-up steps do not count.
    partial = counted.copy()
    partial.loc[partial.index[-1], "tokens"] = None
    assert throughput_unit(partial) == "samples/s"
    warm = counted.copy()
    warm.loc[warm["warmup"], "tokens"] = None
    assert throughput_unit(warm) == "tokens/s"
    assert per_step_throughput(counted, unit="samples/s").equals(per_step_throughput(steps))


def test_a_script_counting_tokens_is_measured_in_tokens_per_second(tmp_path):
    from torsh_tune.autotune.runner import run_measured
    from torsh_tune.config import RunConfig
    from torsh_tune.rundir import new_run_dir

    script = Path(__file__).resolve().parents[1] / "data" / "scripts" / "train_small.py"
    config = RunConfig.from_dict({"launch": {"nproc_per_node": 2}, "budget": {"steps": 4, "warmup_steps": 1}})
    run = run_measured(config, new_run_dir(tmp_path, "tokens"), script, ["--tokens-per-sample", "64", "--batch-size", "8"])
    assert run.state == "COMPLETE", run.failure_reason
    steps = pd.concat(pd.read_json(p, lines=True) for p in sorted(Path(run.run_dir, "ranks").glob("*.steps.jsonl")))
    assert (steps["tokens"] == 8 * 64).all() and (steps["samples"] == 8).all()
    tp = run.measurement.throughput
    assert tp.unit == "tokens/s" and tp.samples_s == pytest.approx(64 * throughput_of(
        steps.drop(columns="tokens")).samples_s)
    # Local rank 0 records its node's topology facts (sysfs: NICs, InfiniBand) in meta.json.
    import json

    metas = [json.loads(p.read_text()) for p in sorted(Path(run.run_dir, "ranks").glob("*.meta.json"))]
    facts = {f["name"]: f for f in metas[0]["node_facts"]}
    assert facts["cpu.count"]["value"] > 0 and "infiniband" in facts and facts["hostname"]["source"] == "detected"
    assert "node_facts" not in metas[1]
