"""Objective: throughput and the loss guard on recorded runs (tests/data/recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from torsh_tune.autotune import loss_by_step, loss_deviation, measure_run, throughput_of
from torsh_tune.autotune.objective import per_step_throughput, throughput_unit

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
    assert m.throughput.median_samples_s == pytest.approx(float(np.median(per_step)))
    q25, q75 = np.quantile(per_step, [0.25, 0.75])
    assert m.throughput.iqr_samples_s == pytest.approx(q75 - q25)
    assert m.throughput.q25_samples_s <= m.throughput.median_samples_s <= m.throughput.q75_samples_s
    assert m.max_microbatches == 1
    assert m.peak_mem_bytes == steps["peak_mem_bytes"].max()


def test_planted_scenarios_rank_as_expected():
    # comm_bound is the slow one by construction; the objective must see that.
    comm = measure_run(RECORDED / "comm_bound").throughput.median_samples_s
    compute = measure_run(RECORDED / "compute_bound").throughput.median_samples_s
    assert comm < compute / 5


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
    assert tp.median_samples_s == pytest.approx(128 * throughput_of(steps).median_samples_s)
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
    assert tp.unit == "tokens/s" and tp.median_samples_s == pytest.approx(64 * throughput_of(
        steps.drop(columns="tokens")).median_samples_s)
    # Local rank 0 records its node's topology facts (sysfs: NICs, InfiniBand) in meta.json.
    import json

    metas = [json.loads(p.read_text()) for p in sorted(Path(run.run_dir, "ranks").glob("*.meta.json"))]
    facts = {f["name"]: f for f in metas[0]["node_facts"]}
    assert facts["cpu.count"]["value"] > 0 and "infiniband" in facts and facts["hostname"]["source"] == "detected"
    assert "node_facts" not in metas[1]
