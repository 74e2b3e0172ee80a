"""Outcome classification from run-directory evidence, step-file progress, run.json."""

from __future__ import annotations

import json
from pathlib import Path

from torsh_tune.config import LaunchConfig, RunConfig
from torsh_tune.launch import (
    RunOutcome,
    StepsWatcher,
    classify_run,
    finish_run_info,
    parse_torchrun_failures,
    read_run_info,
    start_run_info,
)
from torsh_tune.rundir import RunDir, new_run_dir

# The summary torchrun 2.13 printed when rank 1 killed itself with SIGKILL (rank 0 was
# then stopped by torchrun with SIGTERM), as captured in a launcher.log.
SUMMARY_SIGKILL = """\
E1122 05:38:28.752000 5436 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 5442) of binary: /usr/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
======================================================
torsh_tune.runtime.bootstrap FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_05:38:28
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 5441)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 5441
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:38:28
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5442)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 5442
======================================================
"""


def _write_exit(rd: RunDir, rank: int, status: str, *, t_exit: float, etype: str = "", msg: str = "") -> None:
    rec = {"rank": rank, "status": status, "error_type": etype, "message": msg, "traceback": "",
           "t_exit": t_exit, "steps_done": 0}
    rd.rank_file(rank, "exit").write_text(json.dumps(rec))


def test_parse_torchrun_failures() -> None:
    failures = parse_torchrun_failures("noise\n" + SUMMARY_SIGKILL + "more noise\n")
    assert [(f.rank, f.exitcode, f.root_cause, f.signal) for f in failures] == [
        (0, -15, False, "SIGTERM"),
        (1, -9, True, "SIGKILL"),
    ]
    assert parse_torchrun_failures("rank : 3\nexitcode : 1\n") == []


def test_signal_at_root_cause_beats_secondary_errors(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(SUMMARY_SIGKILL)
    # rank 0's collective failed because its peer died: a secondary error record
    _write_exit(rd, 0, "error", t_exit=2.0, etype="RuntimeError", msg="Connection closed by peer")
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.signal) == ("signal", 1, "SIGKILL")
    assert "SIGKILL" in out.message
    assert out.ranks == {0: "error", 1: "signal"}


def test_config_error_first_then_earliest_error(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    _write_exit(rd, 0, "error", t_exit=1.0, etype="RuntimeError", msg="peer gone")
    _write_exit(rd, 2, "config_error", t_exit=5.0, etype="ConfigError", msg="backend must be gloo")
    _write_exit(rd, 1, "error", t_exit=0.5, etype="ValueError", msg="bad batch")
    out = classify_run(rd, world_size=3, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.message) == ("config_error", 2, "backend must be gloo")

    rd.rank_file(2, "exit").unlink()
    rd.rank_log(1).write_text("line\n" * 30 + "the end\n")
    out = classify_run(rd, world_size=3, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.message) == ("script_error", 1, "ValueError: bad batch")
    assert len(out.stderr_tail) == 20 and out.stderr_tail[-1] == "the end"
    assert out.ranks == {0: "error", 1: "error", 2: "unknown"}


def test_missing_exit_record_is_a_kill_and_ok_needs_status_zero(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    _write_exit(rd, 0, "budget", t_exit=1.0)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank) == ("signal", 1)
    _write_exit(rd, 1, "ok", t_exit=1.0)
    out = classify_run(rd, world_size=2, returncode=0, duration_s=1.0)
    assert out.status == "ok" and out.ranks == {0: "budget", 1: "ok"}


def test_stopped_and_launch_failures(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    out = classify_run(rd, world_size=2, returncode=-15, duration_s=3.0, stopped="hang", stop_message="no steps")
    assert (out.status, out.message, out.ranks) == ("hang", "no steps", {0: "stopped", 1: "stopped"})
    (rd.logs / "launcher.log").write_text("usage: run.py ...\nrun.py: error: unrecognized arguments\n")
    out = classify_run(rd, world_size=2, returncode=2, duration_s=0.1, saw_rank_output=False)
    assert out.status == "launch_error" and "unrecognized arguments" in out.message
    d = out.to_dict()
    assert json.loads(json.dumps(d))["ranks"] == {"0": "unknown", "1": "unknown"}


def test_steps_watcher_reads_only_new_complete_lines(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    w = StepsWatcher(rd)
    assert not w.poll() and w.snapshot(0.0).steps_done == 0
    f0, f1 = rd.rank_file(0, "steps"), rd.rank_file(1, "steps")
    f0.write_text(json.dumps({"step": 0, "step_s": 0.25}) + "\n" + '{"step": 1, "st')  # torn line
    assert w.poll()
    p = w.snapshot(1.0)
    assert (p.steps_done, p.ranks_reporting, p.last_step_s) == (1, 1, 0.25)
    with f0.open("a") as f:
        f.write('ep_s": 0.5}\n')
    f1.write_text("{}\n{}\n{}\n")
    assert w.poll()
    p = w.snapshot(2.0)
    assert (p.steps_done, p.ranks_reporting, p.last_step_s, p.elapsed_s) == (2, 2, 0.5, 2.0)
    assert not w.poll()  # nothing new


def test_run_json_start_and_finish(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py", name="r")
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=3))
    info = start_run_info(rd, config=cfg, script=Path("train.py"), script_args=["--x", "1"],
                          command=["python", "-m", "torch.distributed.run"], run_id="r-1", argv=["torsh-tune", "train.py"])
    assert read_run_info(rd) == info
    assert info["status"] == "running" and info["schema_version"] == 1
    assert info["world_size"] == 3 and info["nproc_per_node"] == 3 and info["nnodes"] == 1
    assert Path(info["script"]).is_absolute()
    assert info["versions"]["torch"].startswith("2.13")
    assert info["config"] == cfg.to_dict()
    out = RunOutcome(status="timeout", returncode=-15, duration_s=4.5, ranks={0: "stopped"})
    done = finish_run_info(rd, out)
    assert read_run_info(rd) == json.loads(json.dumps(done))
    assert done["status"] == "timeout" and done["duration_s"] == 4.5
    assert done["outcome"]["ranks"] == {"0": "stopped"} and done["started_at"] == info["started_at"]
    assert [p.name for p in rd.path.iterdir() if p.name.endswith(".tmp")] == []
