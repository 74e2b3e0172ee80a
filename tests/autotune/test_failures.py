"""Failures are data, not crashes: each failure kind injected into real runs and trials.

Real torchrun launches (2 ranks, gloo) of `scripts/fail_modes.py`: a rank raises, runs out
of memory, SIGKILLs itself, hangs, skips a collective, aborts after finishing, or the
ranks refuse the strategy. Each run is classified, its reason and stderr tail recorded, no
process of it survives, and a study goes on past its failed trials. The tuner itself is
SIGKILLed (and resumed) and interrupted with Ctrl-C.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from torsh_tune.autotune import tune
from torsh_tune.autotune.runner import run_measured
from torsh_tune.config import RunConfig, StudyConfig
from torsh_tune.launch import kill_run_processes
from torsh_tune.rundir import new_run_dir

from helpers import run_survivors, sigint_as_ctrl_c

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fail_modes.py"


def _config(patch: dict | None = None) -> RunConfig:
    base = RunConfig.from_dict({
        "launch": {"nproc_per_node": 2},
        "profiler": {"loss_every": 1},
        "budget": {"steps": 5, "warmup_steps": 2, "kill_grace_s": 1.0},
    })
    return base.apply_patch(patch or {})


def _run_info(run_dir: str | Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


# -- one run per failure kind, through the launcher ----------------------------------------

# (script args, config patch, status, text in the reason, text in the stderr tail)
CASES = {
    # rank 1 sleeps before its first step while rank 0 waits in the all-reduce: no step
    # record comes (the no-progress timeout leaves room for start-up on a loaded 2-core machine)
    "hang": (["--mode", "hang", "--at-step", "0"], {"budget": {"no_progress_timeout_s": 8.0}}, "hang",
             "hang: no step record for budget.no_progress_timeout_s=8 s", "fail_modes: rank 0 mode=hang failing=False"),
    # rank 1 stops at step 2, with a collective timeout shorter than the no-progress timeout:
    # gloo gives up first (4 s: long enough for both ranks to meet in init_process_group under load)
    "collective_timeout": (["--mode", "hang"], {"strategy": {"distributed": {"timeout_s": 4.0}}},
                           "collective_timeout", "Timed out waiting 4000ms for recv operation to complete (rank 0)",
                           "Timed out waiting 4000ms for recv operation to complete"),
    # valid on its own, refused by the ranks: a hierarchical node size that does not divide 2 ranks
    "bad_strategy": (["--mode", "ok"], {"strategy": {"collectives": {"hierarchical": True, "ranks_per_node": 3}}},
                     "config_error",
                     "config_error: collectives.ranks_per_node must be a divisor of the world size 2, but got 3",
                     None),  # said once, in the outcome: a rank launched by torsh-tune does not print it too
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_failure_kind_is_classified_with_its_reason_and_leaves_no_process(tmp_path: Path, case: str) -> None:
    args, patch, status, reason, tail = CASES[case]
    run = run_measured(_config(patch), new_run_dir(tmp_path, SCRIPT), SCRIPT, args)
    info = _run_info(run.run_dir)
    assert (run.state, run.status) == ("FAIL", status), run
    assert run.failure_reason.startswith(f"{status}: ") and reason in run.failure_reason, run.failure_reason
    assert tail is None or any(tail in line for line in run.stderr_tail), run.stderr_tail
    assert run.samples_s is None  # never zero throughput
    assert info["status"] == status and info["outcome"]["status"] == status
    assert run_survivors(info["run_id"]) == []
    if status == "hang":  # where each rank was when it was stopped: rank 1 asleep before its first step,
        # rank 0 in the backward whose all-reduce waits for it
        assert info["outcome"]["stacks"] == [0, 1], info["outcome"]
        lines = SCRIPT.read_text().splitlines()
        sleep = 1 + next(i for i, line in enumerate(lines) if "time.sleep(3600)" in line)
        backward = 1 + next(i for i, line in enumerate(lines) if ".backward()" in line)
        assert (f"where the ranks were in the script: fail_modes.py:{backward} (rank 0), fail_modes.py:{sleep} "
                "(rank 1); ") in info["outcome"]["message"], info["outcome"]["message"]


# -- a study whose trials fail in different ways -------------------------------------------

@pytest.mark.slow
def test_study_goes_on_past_failed_trials_and_records_why(tmp_path: Path) -> None:
    # fail_modes.py maps these bucket caps to planted failures (MODES_BY_BUCKET_CAP_MB);
    # trial 0 (PyTorch's defaults) completes, then rank 1 aborts while exiting.
    planted = {101.0: ("script_error", "script_error: RuntimeError: injected failure: exception on rank 1 at step 2"),
               102.0: ("oom", "oom: MemoryError: injected failure: out of host memory on rank 1"),
               103.0: ("signal", "signal: rank 1 was killed by SIGKILL")}
    spec = {"ddp.bucket_cap_mb": {"choices": [25.0, *planted]}, "dataloader.num_workers": {"value": 0},
            "compression.method": {"value": "none"}}
    seen = []
    result = tune(
        SCRIPT, ["--trial-mode", "0=exit_abort"], base_config=_config(), study_dir=tmp_path,
        study=StudyConfig(n_trials=4, sampler="random", seed=0, baseline_repeats=1, confirm_top=0), space_spec=spec,
        cpu_count=2, initial_params=[{"ddp.bucket_cap_mb": cap} for cap in planted], on_trial=seen.append,
    )
    assert [t.number for t in seen] == [0, 1, 2, 3]  # the study went on after every failure
    # A recommendation the baseline enqueued (a noisy host can make one) waits once the budget is spent.
    assert all(t.role == "recommendation" for t in result.trials[4:] if t.state == "WAITING")
    assert [t.state for t in result.trials[:4]] == ["COMPLETE", "FAIL", "FAIL", "FAIL"]

    # The abort after a completed run is a warning: the measurement stands.
    first = result.trials[0]
    outcome = _run_info(first.run_dir)["outcome"]
    assert first.samples_s > 0 and first.constraint_status == "feasible"
    assert outcome["status"] == "ok" and outcome["returncode"] != 0
    assert outcome["ranks"] == {"0": "budget", "1": "budget"}
    assert [w.split(":")[0] for w in outcome["warnings"]] == ["exit_abort"]
    assert "rank 1 was killed by SIGABRT at exit" in outcome["warnings"][0]
    assert "fail_modes: aborting at exit" in outcome["stderr_tail"]

    study = optuna.load_study(study_name="torsh-tune", storage=f"sqlite:///{tmp_path / 'study.db'}")
    for t, (cap, (status, reason)) in zip(result.trials[1:], planted.items()):
        assert t.params["ddp.bucket_cap_mb"] == cap
        assert t.failure_reason.startswith(reason), t.failure_reason
        assert t.samples_s is None and t.constraint_status == ""
        frozen = study.trials[t.number]
        assert frozen.state == optuna.trial.TrialState.FAIL and frozen.value is None  # told as FAIL, no value
        assert frozen.user_attrs["status"] == status
    tails = {t.number: "\n".join(t.stderr_tail) for t in result.trials}
    assert "RuntimeError: injected failure: exception on rank 1" in tails[1]
    assert "MemoryError: injected failure" in tails[2]
    assert "fail_modes: rank 1 kills itself with SIGKILL" in tails[3]
    with open(tmp_path / "trials.csv") as f:
        rows = list(csv.DictReader(f))[:4]
    assert [r["state"] for r in rows] == ["COMPLETE", "FAIL", "FAIL", "FAIL"]
    assert [r["objective_samples_s"] for r in rows[1:]] == ["", "", ""]  # never 0
    assert [r["failure_reason"].split(":")[0] for r in rows[1:]] == ["script_error", "oom", "signal"]
    for t in result.trials[:4]:
        assert run_survivors(_run_info(t.run_dir)["run_id"]) == []


# -- the tuner killed, resumed, interrupted ------------------------------------------------

SPACE_TOML = """\
[space.ddp.bucket_cap_mb]
choices = [25.0, 5.0]
[space.dataloader.num_workers]
value = 0
"""


def _tune_cmd(root: Path, journal: Path, *extra: str, trials: int) -> list[str]:
    return [sys.executable, "-m", "torsh_tune.cli", "tune", "--nproc-per-node", "2", "--steps", "5",
            "--warmup-steps", "2", "--trials", str(trials), "--baseline-repeats", "1", "--confirm-top", "0",
            "--sampler", "random", "--seed", "0", "--storage", f"journal:{journal}",
            "--space", str(root / "space.toml"), "--no-compression", "--quiet", *extra,
            str(SCRIPT), "--trial-mode", "1=hang", "--trial-mode", "2=hang"]


def _wait_for_hang(proc: subprocess.Popen, trial_dir: Path, timeout_s: float = 90.0) -> str:
    """Wait until the trial's rank 1 hangs; returns the trial's run id."""
    deadline = time.monotonic() + timeout_s
    log = trial_dir / "logs" / "rank00001.log"
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the tuner exited early with {proc.returncode}"
        if log.exists() and "rank 1 hangs" in log.read_text():
            return _run_info(trial_dir)["run_id"]
        time.sleep(0.2)
    raise AssertionError(f"{trial_dir.name} did not start hanging in {timeout_s} s")


def _gone_within(run_id: str, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := run_survivors(run_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def killed_tuner(tmp_path_factory):
    """`torsh-tune tune` SIGKILLed while trial 1 hangs, after trial 0 completed."""
    root = tmp_path_factory.mktemp("killed")
    (root / "space.toml").write_text(SPACE_TOML)
    journal = root / "journal.log"
    log = (root / "tuner-1.log").open("w")
    proc = subprocess.Popen(_tune_cmd(root, journal, "--runs-dir", str(root), "--run-name", "study", trials=3),
                            stdout=log, stderr=subprocess.STDOUT)
    study_dir = root / "study"
    try:
        run_id = _wait_for_hang(proc, study_dir / "trials" / "0001")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    before = optuna.load_study(study_name="torsh-tune", storage=storage).trials
    # The kernel SIGTERMs the trial's torchrun when the tuner dies; torchrun stops its ranks
    # (SIGKILL after its own 30 s grace) and exits: ~0.5 s here when idle, ~2 s with the
    # cores busy, > 5 s once in a CI run. An orphan would sleep for an hour.
    survivors = _gone_within(run_id, 30.0)
    kill_run_processes(run_id, grace_s=1.0)
    return {"root": root, "study_dir": study_dir, "journal": journal, "run_id": run_id,
            "survivors": survivors, "before": before}


@pytest.mark.slow
def test_a_sigkilled_tuner_leaves_no_process_of_its_trial(killed_tuner) -> None:
    assert killed_tuner["survivors"] == []


@pytest.mark.slow
def test_resume_after_sigkill_loses_no_completed_trial_and_ctrl_c_stops_cleanly(killed_tuner) -> None:
    root, study_dir, journal = killed_tuner["root"], killed_tuner["study_dir"], killed_tuner["journal"]
    before = {t.number: t for t in killed_tuner["before"]}
    assert before[0].state.name == "COMPLETE" and before[1].state.name == "RUNNING"
    assert run_survivors(killed_tuner["run_id"]) == []  # the fixture's clean-up

    # --resume: trial 1 was left RUNNING (stale); trial 2 runs, hangs and gets Ctrl-C.
    log = (root / "tuner-2.log").open("w")
    proc = subprocess.Popen(_tune_cmd(root, journal, "--resume", str(study_dir), trials=3),
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=sigint_as_ctrl_c)
    try:
        run_id = _wait_for_hang(proc, study_dir / "trials" / "0002")
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = (root / "tuner-2.log").read_text()
    assert returncode == 130, output
    assert run_survivors(run_id) == []  # the interrupted trial's processes are gone
    assert _run_info(study_dir / "trials" / "0002")["status"] == "interrupted"

    # The report is written from what exists.
    result = json.loads((study_dir / "result.json").read_text())
    assert result["interrupted"] is True
    trials = {t["number"]: t for t in result["trials"]}
    assert [trials[n]["state"] for n in range(3)] == ["COMPLETE", "FAIL", "FAIL"], output
    # the completed trial is kept as it was: same value, same run
    assert trials[0]["samples_s"] == before[0].value and trials[0]["run_dir"] == before[0].user_attrs["run_dir"]
    assert trials[1]["failure_reason"] == "stale: the tuner stopped while this trial was running"
    assert trials[2]["failure_reason"].startswith("interrupted: ")
    assert len(list((study_dir / "baseline").iterdir())) == 1  # the baseline was not re-measured
    with open(study_dir / "trials.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["number"], r["state"]) for r in rows] == [("0", "COMPLETE"), ("1", "FAIL"), ("2", "FAIL")]
    assert rows[1]["objective_samples_s"] == rows[2]["objective_samples_s"] == ""
    assert (study_dir / "best.toml").is_file()


@pytest.mark.slow
def test_ctrl_c_during_the_baseline_exits_130(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text(SPACE_TOML)
    cmd = _tune_cmd(tmp_path, tmp_path / "journal.log", "--runs-dir", str(tmp_path), "--run-name", "study", trials=2)
    proc = subprocess.Popen([*cmd, "--mode", "hang"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=sigint_as_ctrl_c)
    try:
        run_id = _wait_for_hang(proc, tmp_path / "study" / "baseline" / "00")
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert run_survivors(run_id) == []  # holds today: the supervisor stops the run
    assert (proc.returncode, "error" in output) == (130, False), output
