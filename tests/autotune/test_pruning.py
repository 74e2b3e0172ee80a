"""Pruning: intermediate throughput from a running trial's records, the pruner's stop, no survivors.

The study runs real torchrun launches (2 ranks, gloo): `train_tune.py` sleeps 0.3 s per
step when the bucket cap lies in (50, 100] MiB, a hopeless trial the median pruner stops.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import optuna
import pandas as pd
import pytest

from torsh_tune.autotune import (
    StepRecordReader,
    TrialPruning,
    TuneResult,
    make_pruner,
    running_throughput,
    tune,
)
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.errors import ConfigError
from torsh_tune.launch import Progress, find_run_processes

from helpers import run_survivors

SCRIPT = Path(__file__).resolve().parent / "scripts" / "train_tune.py"
# No DataLoader workers: what is pruned is the planted slow bucket cap, not the workers' start-up.
SPEC = {"ddp.bucket_cap_mb": {"choices": [25.0, 75.0]}, "compression.method": {"value": "none"},
        "dataloader.num_workers": {"value": 0}}
# Records reach the disk every step (flush 0.1 s) so the pruner sees the slow trial early.
BASE = RunConfig.from_dict({
    "launch": {"nproc_per_node": 2},
    "profiler": {"loss_every": 1, "flush_interval_s": 0.1},
    "budget": {"kill_grace_s": 2.0},
})
STEPS, WARMUP = 10, 2

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module")
def pruned(tmp_path_factory) -> tuple[Path, TuneResult, list]:
    study_dir = tmp_path_factory.mktemp("pruned")
    seen: list = []
    result = tune(
        SCRIPT, [], base_config=BASE, study_dir=study_dir,
        study=StudyConfig(n_trials=2, baseline_repeats=1, confirm_top=0, sampler="random", seed=0, steps=STEPS,
                          warmup_steps=WARMUP, pruner="median", pruner_warmup_steps=1, pruner_startup_trials=1),
        space_spec=SPEC, cpu_count=2, initial_params=[{"ddp.bucket_cap_mb": 75.0}], on_trial=seen.append,
    )
    return study_dir, result, seen


def test_a_hopeless_trial_is_pruned_and_nothing_of_it_survives(pruned):
    study_dir, result, seen = pruned
    assert [(t.number, t.state) for t in seen] == [(0, "COMPLETE"), (1, "PRUNED")]
    fast, slow = result.trials[:2]  # a recommendation the baseline enqueued may wait after them
    assert slow.params["ddp.bucket_cap_mb"] == 75.0 and slow.samples_s is None
    m = re.fullmatch(r"pruned at step (\d+): ([\d.]+) samples/s vs median ([\d.]+) \(1 completed trial\)",
                     slow.failure_reason)
    assert m, slow.failure_reason
    step, value, median = int(m.group(1)), float(m.group(2)), float(m.group(3))
    assert step >= 1  # pruner_warmup_steps=1: never on the first reported step
    assert value == pytest.approx(max(slow.intermediate_samples_s.values()), rel=1e-3)
    assert median == pytest.approx(fast.intermediate_samples_s[step], rel=1e-3) and value < median
    # Stopped before its budget, through the supervisor's stop (status "pruned").
    run = json.loads((Path(slow.run_dir) / "run.json").read_text())
    assert run["status"] == "pruned" and run["outcome"]["message"] == slow.failure_reason
    assert set(run["outcome"]["ranks"].values()) == {"stopped"}
    lines = (Path(slow.run_dir) / "ranks" / "rank00000.steps.jsonl").read_text().splitlines()
    # The budget: the warm-up (grown by the steps the DataLoader workers' start-up stock feeds) + STEPS.
    meta = json.loads((Path(slow.run_dir) / "ranks" / "rank00000.meta.json").read_text())
    assert len(lines) < meta.get("warmup_steps", WARMUP) + STEPS
    assert run_survivors(run["run_id"]) == [] and find_run_processes(run["run_id"]) == []
    with open(study_dir / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(r["state"] == "WAITING" for r in rows[2:]), rows[2:]  # a recommendation the baseline enqueued
    assert [r["state"] for r in rows[:2]] == ["COMPLETE", "PRUNED"]
    assert rows[1]["failure_reason"] == slow.failure_reason and rows[1]["objective_samples_s"] == ""
    stored = optuna.load_study(study_name="torsh-tune", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert stored.trials[1].state == optuna.trial.TrialState.PRUNED


def test_intermediate_values_are_the_running_rate_at_the_same_indices(pruned):
    _, result, _ = pruned
    fast, slow = result.trials[:2]  # a recommendation the baseline enqueued may wait after them
    # A completed trial has every measured step reported (those the polls missed afterwards).
    assert list(fast.intermediate_samples_s) == list(range(STEPS))
    steps = pd.concat([pd.read_json(p, lines=True) for p in sorted((Path(fast.run_dir) / "ranks").glob("*.steps.jsonl"))])
    expected = running_throughput(steps, num_ranks=2)
    assert list(fast.intermediate_samples_s.values()) == pytest.approx(expected.tolist())
    assert fast.intermediate_samples_s[STEPS - 1] == pytest.approx(fast.samples_s)
    assert list(slow.intermediate_samples_s) == list(range(len(slow.intermediate_samples_s)))


def test_baseline_runs_are_not_pruned(pruned):
    study_dir, result, _ = pruned
    for run_dir in result.baseline.run_dirs:
        assert json.loads((Path(run_dir) / "run.json").read_text())["status"] == "ok"


def test_running_throughput_counts_only_steps_every_rank_finished():
    rows = [{"rank": r, "step": s, "step_s": 0.1 * (1 + r), "samples": 8, "warmup": s < 2} for s in range(6) for r in (0, 1)]
    rows = [row for row in rows if not (row["rank"] == 1 and row["step"] == 5)]  # rank 1 has not finished step 5
    running = running_throughput(pd.DataFrame(rows), num_ranks=2)
    assert list(running.index) == [0, 1, 2]  # measured steps 2, 3, 4
    assert running.tolist() == pytest.approx([16 / 0.2] * 3)


def test_step_record_reader_waits_for_torn_lines(tmp_path):
    (tmp_path / "ranks").mkdir()
    path = tmp_path / "ranks" / "rank00000.steps.jsonl"
    line = json.dumps({"rank": 0, "step": 0, "step_s": 0.1, "samples": 4, "warmup": False})
    path.write_text(line + "\n" + line[:10])
    reader = StepRecordReader(tmp_path)
    assert len(reader.read()) == 1
    with path.open("a") as f:
        f.write(line[10:] + "\nnot json\n")
    frame = reader.read()
    assert len(frame) == 2 and list(frame["step"]) == [0, 0]


def _write_steps(run_dir: Path, step_s: float, steps: range) -> None:
    (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
    for r in (0, 1):
        with (run_dir / "ranks" / f"rank{r:05d}.steps.jsonl").open("a") as f:
            for s in steps:
                f.write(json.dumps({"rank": r, "step": s, "step_s": step_s, "samples": 10, "warmup": False}) + "\n")


def test_trial_pruning_reports_each_new_step_once_and_gives_its_reason(tmp_path):
    study = optuna.create_study(direction="maximize", pruner=make_pruner(
        "percentile", percentile=25.0, warmup_steps=1, startup_trials=1))
    done = study.ask()
    _write_steps(tmp_path / "a", 0.01, range(4))
    watch = TrialPruning(done, tmp_path / "a", num_ranks=2, percentile=25.0)
    assert watch(Progress(elapsed_s=1, steps_done=4, ranks_reporting=2, last_step_s=0.01)) is None  # no completed trial
    study.tell(done, 2000.0)
    slow = study.ask()
    watch = TrialPruning(slow, tmp_path / "b", num_ranks=2, percentile=25.0)
    _write_steps(tmp_path / "b", 0.1, range(1))
    assert watch(Progress(elapsed_s=1, steps_done=1, ranks_reporting=2, last_step_s=0.1)) is None  # warm-up step
    assert watch(Progress(elapsed_s=2, steps_done=1, ranks_reporting=2, last_step_s=0.1)) is None  # nothing new
    _write_steps(tmp_path / "b", 0.1, range(1, 2))
    reason = watch(Progress(elapsed_s=3, steps_done=2, ranks_reporting=2, last_step_s=0.1))
    assert reason == "pruned at step 1: 200.0 samples/s vs 75th percentile 2000.0 (1 completed trial)"
    assert watch.reported == {0: 200.0, 1: 200.0}


def test_pruner_arguments_are_checked_before_anything_runs(tmp_path):
    common = dict(base_config=BASE, study_dir=tmp_path / "s")
    cases = [
        (dict(pruner="hyperband"), r"pruner must be one of \['none', 'median', 'percentile'\], but got 'hyperband'"),
        (dict(pruner="percentile", pruner_percentile=100), "pruner_percentile must be a number between 0 and 100"),
        (dict(pruner="median", pruner_warmup_steps=-1), "pruner_warmup_steps must be an integer >= 0"),
        (dict(pruner="median", pruner_warmup_steps=5), r"pruner_warmup_steps must be < the measured steps per run \(5\)"),
        (dict(pruner="median", pruner_startup_trials=-2), "pruner_startup_trials must be an integer >= 0"),
        (dict(pruner="median", objectives=("throughput", "loss")), "pruner must be 'none' with several objectives"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            tune(SCRIPT, [], **common, study=StudyConfig(steps=5, **kwargs))
    assert not (tmp_path / "s").exists()
