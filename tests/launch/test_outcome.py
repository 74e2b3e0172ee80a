"""Outcome classification from run-directory evidence, step-file progress, run.json."""

from __future__ import annotations

import json
import signal
import threading
from importlib.util import find_spec
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
    # A rank coming up (its meta.json) restarts the no-progress clock once; a rewritten meta.json does not.
    rd.rank_file(1, "meta").write_text("{}")
    assert w.poll() and not w.poll()
    rd.rank_file(1, "meta").write_text('{"device": "cuda"}')
    assert not w.poll() and w.snapshot(3.0).steps_done == 2


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


# -- failure kinds: oom, collective_timeout, the abort after a completed run ---------------

def _summary(root_rank: int, root_exitcode: int, *, other: tuple[int, int] | None = None) -> str:
    """A torchrun 2.13 failure summary (as in SUMMARY_SIGKILL) with the given root cause."""

    def entry(i: int, rank: int, code: int) -> str:
        sig = f"  ({signal.Signals(-code).name})" if code < 0 else ""
        return (f"[{i}]:\n  time      : 2026-11-22_05:38:28\n  host      : localhost\n"
                f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {code} (pid: {5441 + rank}){sig}\n"
                "  error_file: <N/A>\n")

    others = entry(1, *other) if other else "  <NO_OTHER_FAILURES>\n"
    return ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 54
            + "\ntorsh_tune.runtime.bootstrap FAILED\n" + "-" * 54 + "\nFailures:\n" + others + "-" * 54
            + "\nRoot Cause (first observed failure):\n" + entry(0, root_rank, root_exitcode) + "=" * 54 + "\n")


def _write_error(rd: RunDir, rank: int, *, t_exit: float, etype: str, msg: str, tb: str = "") -> None:
    rec = {"rank": rank, "status": "error", "error_type": etype, "message": msg, "traceback": tb,
           "t_exit": t_exit, "steps_done": 3}
    rd.rank_file(rank, "exit").write_text(json.dumps(rec))


# The messages torch 2.13's gloo raised in the peer of a rank that died or skipped a collective
# (captured from tests/autotune/test_failures.py runs).
GLOO_PEER_CLOSED = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                    "peer [127.0.0.1]:5263. This is typically caused by a remote worker crashing. Check the logs of "
                    "the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "2000ms for recv operation to complete")
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
            "1.06 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory in use.")
# NCCL's watchdog logs this, then aborts the rank (SIGABRT) without an exit record.
NCCL_WATCHDOG_LOG = """\
[rank0]:[E1218 20:27:21.426415540 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=131072000, NumelOut=131072000, Timeout(ms)=600000) ran for 600081 milliseconds before timing out.
[rank0]:[E1218 20:27:21.427 ProcessGroupNCCL.cpp:2168] [PG ID 0 PG GUID 0(default_pg) Rank 0] First PG on this rank to signal dumping.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group watchdog thread terminated with exception: [Rank 0] Watchdog caught collective operation timeout
"""


def test_the_new_statuses_are_run_statuses() -> None:
    from torsh_tune.launch import RUN_STATUSES

    assert {"oom", "collective_timeout", "pruned"} <= set(RUN_STATUSES)
    out = RunOutcome(status="ok", returncode=1, warnings=("exit_abort: x",))
    assert json.loads(json.dumps(out.to_dict()))["warnings"] == ["exit_abort: x"] and out.ok


def test_oom_from_the_exit_record_beats_an_earlier_peer_lost_error(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(0, 1, other=(1, 1)))
    # the peer recorded its "Connection closed by peer" first: it is still only the symptom
    _write_error(rd, 0, t_exit=1.0, etype="RuntimeError", msg=GLOO_PEER_CLOSED)
    _write_error(rd, 1, t_exit=2.0, etype="OutOfMemoryError", msg=CUDA_OOM)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank) == ("oom", 1), out
    assert out.message == f"OutOfMemoryError: {CUDA_OOM}"

    for etype, msg in (
        ("MemoryError", ""),
        ("RuntimeError", "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 281474976710656 bytes. Error code 12 (Cannot allocate memory)"),
        ("RuntimeError", "CUDA error: out of memory\nCompile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."),
    ):
        _write_error(rd, 1, t_exit=2.0, etype=etype, msg=msg)
        assert classify_run(rd, world_size=2, returncode=1, duration_s=1.0).status == "oom", (etype, msg)


def test_oom_as_the_cause_of_a_chained_exception_but_not_in_source_lines(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    chained = (
        "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    loss = step(batch)\n"
        f"torch.OutOfMemoryError: {CUDA_OOM}\n\nThe above exception was the direct cause of the following exception:\n\n"
        "Traceback (most recent call last):\n  File \"train.py\", line 11, in <module>\n"
        "    raise TrainingFailed('step 3') from exc\nTrainingFailed: step 3\n"
    )
    _write_error(rd, 1, t_exit=2.0, etype="TrainingFailed", msg="step 3", tb=chained)
    assert classify_run(rd, world_size=2, returncode=1, duration_s=1.0).status == "oom"
    # "MemoryError" in a frame's source line is code, not the exception
    source_only = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
                   "    except (MemoryError, torch.OutOfMemoryError):\nValueError: bad batch\n")
    _write_error(rd, 1, t_exit=2.0, etype="ValueError", msg="bad batch", tb=source_only)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.message) == ("script_error", "ValueError: bad batch")


def test_gloo_collective_timeout(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(0, 1, other=(1, -15)))
    _write_error(rd, 0, t_exit=1.0, etype="RuntimeError", msg=GLOO_TIMEOUT)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.message) == ("collective_timeout", 0, f"RuntimeError: {GLOO_TIMEOUT}")
    assert out.ranks == {0: "error", 1: "terminated"}
    # a peer that merely lost its connection is a script error (its peer's failure is unknown)
    _write_error(rd, 0, t_exit=1.0, etype="RuntimeError", msg=GLOO_PEER_CLOSED)
    assert classify_run(rd, world_size=2, returncode=1, duration_s=1.0).status == "script_error"


def test_nccl_watchdog_abort_is_a_collective_timeout_and_sigkill_stays_a_signal(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(0, -6, other=(1, -6)))
    rd.rank_log(0).write_text("step 1\n" + NCCL_WATCHDOG_LOG)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.signal) == ("collective_timeout", 0, "SIGABRT"), out
    assert out.message.startswith("rank 0 was killed by SIGABRT: [E1218")
    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE" in out.message
    # an abort after an uncaught CUDA OOM in a C++ thread
    rd.rank_log(0).write_text("terminate called after throwing an instance of 'c10::OutOfMemoryError'\n"
                              f"  what():  {CUDA_OOM}\n")
    assert classify_run(rd, world_size=2, returncode=1, duration_s=1.0).status == "oom"
    # SIGKILL (the kernel's OOM killer among others) leaves no evidence to trust: a signal
    (rd.logs / "launcher.log").write_text(_summary(0, -9, other=(1, -15)))
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.signal) == ("signal", "SIGKILL")


def test_root_log_with_rank_prefixed_traceback(tmp_path: Path) -> None:
    # No exit record (the exception came before the runtime could write one): the log tells.
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(1, 1, other=(0, -15)))
    rd.rank_log(1).write_text(
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 3, in <module>\n"
        "[rank1]:     x = torch.empty(n)\n[rank1]: MemoryError: no room\n"
    )
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.message) == ("oom", 1, "MemoryError: no room")


def test_abort_at_exit_after_every_rank_finished_is_ok_with_a_warning(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(1, -6))
    rd.rank_log(1).write_text("fail_modes: aborting at exit\n")
    _write_exit(rd, 0, "budget", t_exit=1.0)
    _write_exit(rd, 1, "budget", t_exit=1.0)
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert out.ok and out.status == "ok" and out.returncode == 1, out
    assert out.warnings == (out.message,) and out.message.startswith("exit_abort: ")
    assert "rank 1 was killed by SIGABRT at exit" in out.message and "measurement is valid" in out.message
    assert out.ranks == {0: "budget", 1: "budget"} and out.failing_rank is None
    assert out.stderr_tail == ("fail_modes: aborting at exit",)
    # without torchrun's summary the return code is all there is
    (rd.logs / "launcher.log").write_text("")
    assert classify_run(rd, world_size=2, returncode=1, duration_s=1.0).warnings[0].startswith(
        "exit_abort: every rank finished and wrote its exit record, then torchrun exited with status 1")
    # a rank without its record may not have finished: a failure, which says what is known
    rd.rank_file(0, "exit").unlink()
    (rd.logs / "launcher.log").write_text(_summary(1, -6, other=(0, -15)))
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.signal) == ("signal", 1, "SIGABRT")
    assert out.message == "rank 1 was killed by SIGABRT after recording a clean exit (budget), before every rank did"



def test_a_signalled_ranks_python_stacks_are_named_and_empty_stacks_files_are_dropped(tmp_path: Path) -> None:
    from torsh_tune.launch.outcome import drop_empty_stacks

    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(1, -6, other=(0, -15)))
    rd.rank_log(1).write_text("terminate called without an active exception\n")
    rd.rank_file(0, "stacks").write_text("")  # rank 0 was stopped by SIGTERM: faulthandler wrote nothing
    rd.rank_file(1, "stacks").write_text(
        'Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n'
        '  File "train.py", line 9 in <module>\n')
    drop_empty_stacks(rd)
    assert not rd.rank_file(0, "stacks").exists() and rd.rank_file(1, "stacks").exists()
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.signal, out.stacks) == ("signal", 1, "SIGABRT", (1,)), out
    assert out.message == "rank 1 was killed by SIGABRT (its Python stacks at the signal: ranks/rank00001.stacks.txt)"
    assert out.to_dict()["stacks"] == [1]
    # The abort at exit after every rank finished: the warning names the file too.
    _write_exit(rd, 0, "budget", t_exit=1.0)
    _write_exit(rd, 1, "budget", t_exit=1.0)
    (rd.logs / "launcher.log").write_text(_summary(1, -6))
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert out.ok and out.warnings[0].endswith("(its Python stacks at the signal: ranks/rank00001.stacks.txt)")
    # No file, no mention.
    rd.rank_file(1, "stacks").unlink()
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert out.stacks == () and "stacks" not in out.warnings[0]


def _dump(*threads: list[tuple[str, int, str]], fatal: bool = False) -> str:
    """A faulthandler dump: one block per thread (frames most recent first), the last one current."""
    blocks = []
    for i, frames in enumerate(threads):
        head = "Current thread 0x00007f01" if i == len(threads) - 1 else f"Thread 0x00007f0{i + 2}"
        blocks.append(head + " (most recent call first):\n" + "".join(
            f'  File "{f}", line {n} in {fn}\n' for f, n, fn in frames))
    return ("Fatal Python error: Aborted\n\n" if fatal else "") + "\n".join(blocks)


# The frames' files as this installation has them (the bootstrap's is how the training thread is told apart).
BOOT = find_spec("torsh_tune.runtime.bootstrap").origin  # found, not imported: no torch in these tests
SAMPLER = [(threading.__file__, 331, "wait"), (find_spec("torsh_tune.profiler.system").origin, 182, "_run")]


def test_a_stopped_run_says_where_each_ranks_training_thread_was_in_the_script(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py")
    script, c10d = str(tmp_path / "train.py"), str(tmp_path / "torch" / "distributed" / "distributed_c10d.py")
    rd.run_json.write_text(json.dumps({"script": script}))
    in_all_reduce = [(c10d, 2950, "all_reduce"), (script, 57, "step"),
                     (script, 80, "<module>"), ("<frozen runpy>", 88, "_run_code"), (BOOT, 119, "main")]
    asleep = [(script, 93, "<module>"), ("<frozen runpy>", 88, "_run_code"), (BOOT, 119, "main")]
    for rank, frames in ((0, in_all_reduce), (1, asleep), (2, in_all_reduce), (3, in_all_reduce)):
        rd.rank_file(rank, "stacks").write_text(_dump(SAMPLER, frames))
    out = classify_run(rd, world_size=4, returncode=-15, duration_s=9.0, stopped="hang", stop_message="no step record")
    assert out.message == (
        "no step record; where the ranks were in the script: train.py:57 (ranks 0, 2-3), train.py:93 (rank 1); "
        "the ranks' Python stacks at the stop: ranks/rank00000.stacks.txt, ranks/rank00001.stacks.txt, "
        "ranks/rank00002.stacks.txt, ranks/rank00003.stacks.txt")
    # A crash's dump after the stop's: the last one counts. A stack cut at faulthandler's 100 frames before it
    # reached the bootstrap: the thread with a frame in the script. No frame in the script: no line.
    rd.rank_file(1, "stacks").write_text(_dump(SAMPLER, asleep) + "\n" + _dump(in_all_reduce, fatal=True))
    rd.rank_file(2, "stacks").write_text(_dump(SAMPLER, [(c10d, 1, "f"), (script, 12, "deep")]))
    rd.rank_file(3, "stacks").write_text(_dump(SAMPLER, [(c10d, 1, "f"), (BOOT, 119, "main")]))
    out = classify_run(rd, world_size=4, returncode=-15, duration_s=9.0, stopped="hang", stop_message="no step record")
    assert "where the ranks were in the script: train.py:57 (ranks 0-1), train.py:12 (rank 2); " in out.message
    # A rank killed by a signal: where it was, before what else is known.
    (rd.logs / "launcher.log").write_text(_summary(1, -6, other=(0, -15)))
    out = classify_run(rd, world_size=4, returncode=1, duration_s=1.0)
    assert out.message == "rank 1 was killed by SIGABRT at train.py:57 (its Python stacks at the signal: " \
                          "ranks/rank00001.stacks.txt)"


def test_a_root_that_recorded_its_own_error_died_of_it(tmp_path: Path) -> None:
    # The rank raised (exit record written), then aborted while exiting: the error is the cause.
    rd = new_run_dir(tmp_path, "t.py")
    (rd.logs / "launcher.log").write_text(_summary(1, -6, other=(0, -15)))
    _write_error(rd, 1, t_exit=1.0, etype="MemoryError", msg="no room")
    out = classify_run(rd, world_size=2, returncode=1, duration_s=1.0)
    assert (out.status, out.failing_rank, out.message) == ("oom", 1, "MemoryError: no room")
