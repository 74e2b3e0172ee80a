"""launch_run with real torchrun, 2 ranks on this machine: output, failures, stops, leftovers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from torsh_tune.config import BudgetConfig, LaunchConfig, RunConfig
from torsh_tune.launch import Progress, RunOutcome, launch_run
from torsh_tune.launch.warm import WarmAgents
from torsh_tune.rundir import RunDir, new_run_dir

from helpers import run_survivors

pytestmark = pytest.mark.timeout(60)


def _config(**budget: float) -> RunConfig:
    budget.setdefault("kill_grace_s", 1.0)
    return RunConfig(launch=LaunchConfig(nproc_per_node=2), budget=BudgetConfig(**budget))


class Launched:
    def __init__(self, outcome: RunOutcome, run_dir: RunDir, lines: list[str], progress: list[Progress]) -> None:
        self.outcome, self.run_dir, self.lines, self.progress = outcome, run_dir, lines, progress
        self.info = json.loads(run_dir.run_json.read_text())

    def log(self, rank: int) -> str:
        return self.run_dir.rank_log(rank).read_text()

    @property
    def launcher_log(self) -> str:
        return (self.run_dir.logs / "launcher.log").read_text()

    @property
    def shown(self) -> str:
        """What reached the terminal."""
        return "\n".join(self.lines)


def _launch(tmp_path: Path, body: str, config: RunConfig, args: tuple[str, ...] = (), on_progress=None,
            agents: WarmAgents | None = None) -> Launched:
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "script.py"
    header = "import os, sys, time, signal, json, subprocess\nRANK = int(os.environ['RANK'])\n"
    script.write_text(header + textwrap.dedent(body))
    rd = new_run_dir(tmp_path / "runs", script)
    lines: list[str] = []
    progress: list[Progress] = []

    def record(p: Progress) -> None:
        progress.append(p)
        if on_progress is not None:
            on_progress(p)

    outcome = launch_run(config, rd, script, list(args), argv=["torsh-tune", "script.py"], echo=lines.append,
                         on_progress=record, agents=agents)
    launched = Launched(outcome, rd, lines, progress)
    # whatever happened, nothing of the run survives and run.json tells how it ended
    assert run_survivors(launched.info["run_id"]) == []
    assert launched.info["status"] == outcome.status
    assert launched.info["outcome"] == json.loads(json.dumps(outcome.to_dict()))
    assert launched.info["finished_at"] is not None
    return launched


def test_output_is_prefixed_live_and_filed_per_rank(tmp_path: Path) -> None:
    run = _launch(
        tmp_path,
        """
        print(f"hello from {RANK} args={sys.argv[1:]}")
        print(f"warning on {RANK}", file=sys.stderr)
        """,
        _config(),
        args=("--hidden", "5", "--steps", "x"),
    )
    assert run.outcome.status == "ok", run.outcome
    assert run.outcome.returncode == 0 and run.outcome.ranks == {0: "ok", 1: "ok"}
    for r in (0, 1):
        expected = f"hello from {r} args=['--hidden', '5', '--steps', 'x']"
        assert f"[rank{r}]:{expected}" in run.lines
        assert f"[rank{r}]:warning on {r}" in run.lines
        log = run.log(r).splitlines()
        assert expected in log and f"warning on {r}" in log
        assert not any(line.startswith("[rank") for line in log)
    launcher = (run.run_dir.logs / "launcher.log").read_text()
    assert "hello from" not in launcher
    assert all(line in run.lines for line in launcher.splitlines())  # torchrun's own lines are shown too
    assert run.info["script_args"] == ["--hidden", "5", "--steps", "x"]
    assert run.info["argv"] == ["torsh-tune", "script.py"]
    script = str((tmp_path / "script.py").resolve())
    assert run.info["command"][-5:] == [script, "--hidden", "5", "--steps", "x"] == [run.info["script"], *run.info["script_args"]]
    assert json.loads(run.run_dir.config_json.read_text())["launch"]["nproc_per_node"] == 2
    assert run.info["agent_start"] == "new_process"


def test_progress_from_step_files_keeps_a_slow_run_alive(tmp_path: Path) -> None:
    # 14 records 0.6 s apart span longer than the no-progress timeout: only the growth
    # of the step files keeps the run from being declared hung.
    run = _launch(
        tmp_path,
        """
        path = os.path.join(os.environ["TORSH_TUNE_RUN_DIR"], "ranks", f"rank{RANK:05d}.steps.jsonl")
        for step in range(14):
            with open(path, "a") as f:
                f.write(json.dumps({"rank": RANK, "step": step, "step_s": 0.5 + step / 100}) + "\\n")
            time.sleep(0.6)
        """,
        _config(no_progress_timeout_s=8.0),  # well above torchrun + torch start-up
    )
    assert run.outcome.status == "ok", run.outcome
    final = run.progress[-1]
    assert (final.steps_done, final.ranks_reporting, final.last_step_s) == (14, 2, pytest.approx(0.63))
    assert any(0 < p.steps_done < 14 for p in run.progress)  # seen while running, not only at the end
    assert [p.elapsed_s for p in run.progress] == sorted(p.elapsed_s for p in run.progress)


def test_exception_on_one_rank(tmp_path: Path) -> None:
    run = _launch(
        tmp_path,
        """
        if RANK == 1:
            raise ValueError("bad shape on rank one")
        time.sleep(30)
        """,
        _config(),
    )
    out = run.outcome
    assert (out.status, out.failing_rank) == ("script_error", 1), out
    assert out.message == "ValueError: bad shape on rank one"
    assert any("ValueError: bad shape on rank one" in line for line in out.stderr_tail)
    assert out.ranks[1] == "error" and out.returncode != 0
    # The rank's own traceback is its output and shown; torchrun's account of it only filed.
    assert [line for line in run.lines if "Traceback" in line] == ["[rank1]:Traceback (most recent call last):"]
    assert "ChildFailedError" in run.launcher_log and "Root Cause" in run.launcher_log
    assert "ChildFailedError" not in run.shown and "Root Cause" not in run.shown


def test_rank_killed_by_a_signal(tmp_path: Path) -> None:
    run = _launch(
        tmp_path,
        """
        if RANK == 1:
            print("about to die", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(30)
        """,
        _config(),
    )
    out = run.outcome
    assert (out.status, out.failing_rank, out.signal) == ("signal", 1, "SIGKILL"), out
    assert "SIGKILL" in out.message and "about to die" in out.stderr_tail
    assert out.ranks[1] == "signal"
    assert "[rank1]:about to die" in run.lines
    assert "ChildFailedError" in run.launcher_log and "Traceback" not in run.shown


def test_abort_at_exit_after_the_work_is_ok_with_a_warning(tmp_path: Path) -> None:
    # The abort seen on about one gloo exit in eight, made certain: rank 1 aborts at exit, after
    # the runtime wrote its exit record and once rank 0 wrote its own. The run is explained, so
    # torchrun's report of it is only filed.
    run = _launch(
        tmp_path,
        """
        import atexit

        def abort_after_rank_0():
            while not os.path.exists(os.path.join(os.environ["TORSH_TUNE_RUN_DIR"], "ranks", "rank00000.exit.json")):
                time.sleep(0.05)
            os.abort()

        if RANK == 1:
            atexit.register(abort_after_rank_0)
        """,
        _config(),
    )
    out = run.outcome
    assert (out.status, out.ranks) == ("ok", {0: "ok", 1: "ok"}), out
    assert out.returncode != 0 and out.warnings[0].startswith("exit_abort: ") and "SIGABRT" in out.warnings[0]
    assert "ChildFailedError" in run.launcher_log and "Traceback" not in run.shown
    # Where the aborting rank was: faulthandler's stacks of every Python thread, named by the warning; the
    # other rank's file stayed empty and is gone.
    rd = run.run_dir
    assert out.stacks == (1,) and "ranks/rank00001.stacks.txt" in out.warnings[0]
    stacks = rd.rank_file(1, "stacks").read_text()
    assert stacks.startswith("Fatal Python error: Aborted") and "in abort_after_rank_0" in stacks, stacks
    assert not rd.rank_file(0, "stacks").exists()


def test_wall_clock_timeout_kills_everything(tmp_path: Path) -> None:
    # rank 1 ignores SIGTERM and leaves a detached grandchild in its own session: both
    # must still be gone after the stop.
    run = _launch(
        tmp_path,
        """
        if RANK == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
            print(f"grandchild {child.pid}", flush=True)
        time.sleep(120)
        """,
        _config(timeout_s=8.0, kill_grace_s=1.0),
    )
    out = run.outcome
    assert out.status == "timeout", out
    assert "budget.timeout_s=8" in out.message
    assert out.ranks == {0: "stopped", 1: "stopped"}
    # Before the stop each rank wrote where it was: every Python thread's stack (faulthandler, on the stacks
    # signal), the script's sleep in the training thread.
    assert out.stacks == (0, 1), out
    assert out.message.endswith("; the ranks' Python stacks at the stop: ranks/rank00000.stacks.txt, "
                                "ranks/rank00001.stacks.txt")
    script = (tmp_path / "script.py").read_text().splitlines()
    sleep = 1 + script.index("time.sleep(120)")
    assert f"; where the ranks were in the script: script.py:{sleep} (ranks 0-1); " in out.message
    for rank in (0, 1):
        stacks = run.run_dir.rank_file(rank, "stacks").read_text()
        assert f'script.py", line {sleep} in <module>' in stacks and "Thread 0x" in stacks, stacks
    grandchild = [int(line.split()[-1]) for line in run.log(1).splitlines() if line.startswith("grandchild")]
    assert len(grandchild) == 1
    # torchrun (up: rank 1 ran) logs the stop's SIGTERM at once, then its traceback; only filed.
    assert "death signal" in run.launcher_log, run.launcher_log
    assert "death signal" not in run.shown and "Traceback" not in run.shown
    try:
        assert psutil.Process(grandchild[0]).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass


def test_no_progress_is_a_hang(tmp_path: Path) -> None:
    run = _launch(tmp_path, "time.sleep(120)\n", _config(no_progress_timeout_s=3.0))
    assert run.outcome.status == "hang", run.outcome
    assert "no_progress_timeout_s=3" in run.outcome.message
    assert run.outcome.returncode is not None
    # (On a loaded machine torchrun may not be up after 3 s: what it logs is not asserted here.)
    assert "death signal" not in run.shown and "Traceback" not in run.shown


def test_keyboard_interrupt_stops_the_run(tmp_path: Path) -> None:
    calls = []

    def interrupt(p: Progress) -> None:
        calls.append(p)
        if len(calls) == 3:
            raise KeyboardInterrupt

    run = _launch(tmp_path, "time.sleep(120)\n", _config(), on_progress=interrupt)
    assert run.outcome.status == "interrupted", run.outcome
    assert len(calls) == 3  # no further callbacks after the interrupt


def test_config_error_on_a_rank(tmp_path: Path) -> None:
    run = _launch(
        tmp_path,
        """
        from torsh_tune.errors import invalid
        if RANK == 1:
            raise invalid("launch.backend", "gloo without CUDA", "nccl")
        time.sleep(30)
        """,
        _config(),
    )
    out = run.outcome
    assert (out.status, out.failing_rank) == ("config_error", 1), out
    assert out.message == "launch.backend must be gloo without CUDA, but got 'nccl'"


def test_launch_errors(tmp_path: Path) -> None:
    # the launcher template's program fails before any rank starts
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2, launcher="false {cmd}"))
    run = _launch(tmp_path, "print('never')\n", cfg)
    assert run.outcome.status == "launch_error", run.outcome
    assert run.outcome.returncode == 1 and "before starting the script" in run.outcome.message
    # the program cannot be started at all
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2, launcher="/nonexistent/launcher {cmd}"))
    run = _launch(tmp_path, "print('never')\n", cfg)
    assert run.outcome.status == "launch_error" and run.outcome.returncode is None
    assert "/nonexistent/launcher" in run.outcome.message
    # a launcher failing with a traceback of its own: nothing else explains it, so it is shown
    fail = "echo 'Traceback (most recent call last):'; echo 'RuntimeError: no rendezvous'; exit 1"
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2, launcher=f"sh -c \"{fail}\" {{cmd}}"))
    run = _launch(tmp_path, "print('never')\n", cfg)
    assert run.outcome.status == "launch_error" and run.outcome.message.endswith("RuntimeError: no rendezvous")
    assert run.lines == ["Traceback (most recent call last):", "RuntimeError: no rendezvous"]


def test_missing_script_is_a_config_error(tmp_path: Path) -> None:
    from torsh_tune.errors import ConfigError

    with pytest.raises(ConfigError, match="script must be an existing file"):
        launch_run(_config(), new_run_dir(tmp_path, "x.py"), tmp_path / "missing.py", [])



def test_sigterm_to_the_supervisor_stops_the_job(tmp_path: Path) -> None:
    # A scheduler or closed terminal signals the supervisor; the job (in its own session)
    # must not be orphaned.
    script = tmp_path / "sleep.py"
    script.write_text("import os, time\nprint('rank up', os.environ['RANK'], flush=True)\ntime.sleep(120)\n")
    driver = textwrap.dedent(
        f"""
        import sys
        from torsh_tune.config import BudgetConfig, LaunchConfig, RunConfig
        from torsh_tune.launch import launch_run
        from torsh_tune.rundir import RunDir
        cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2), budget=BudgetConfig(kill_grace_s=1.0))
        out = launch_run(cfg, RunDir({str(tmp_path / "run")!r}), {str(script)!r}, [])
        print("STATUS", out.status, out.message, flush=True)
        """
    )
    (tmp_path / "run").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "rank up" in line:
            proc.send_signal(signal.SIGTERM)
            break
    rest = proc.communicate(timeout=30)[0]
    info = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "STATUS interrupted the supervisor received SIGTERM" in rest, seen + [rest]
    assert info["status"] == "interrupted"
    assert run_survivors(info["run_id"]) == []


# -- warm agents (a study's runs: torchrun's agent forked from a server that imported torch) ----------


@pytest.fixture(scope="module")
def warm():
    with WarmAgents() as agents:
        yield agents


def test_a_forked_agent_runs_the_job_as_a_new_process_would(tmp_path: Path, warm: WarmAgents) -> None:
    body = """
        print(f"hello from {RANK} args={sys.argv[1:]} cwd={os.getcwd()} marker={os.environ.get('MARKER')}")
        print(f"warning on {RANK}", file=sys.stderr)
        """
    config = RunConfig(launch=LaunchConfig(nproc_per_node=2, env={"MARKER": "run-env"}),
                       budget=BudgetConfig(kill_grace_s=1.0))
    run = _launch(tmp_path, body, config, args=("--hidden", "5"), agents=warm)
    assert warm.failed is None and run.info["agent_start"] == "forked" and "agent_fallback" not in run.info
    assert run.outcome.status == "ok" and run.outcome.returncode == 0, run.outcome
    assert run.outcome.ranks == {0: "ok", 1: "ok"}
    for r in (0, 1):
        expected = f"hello from {r} args=['--hidden', '5'] cwd={Path.cwd()} marker=run-env"
        assert f"[rank{r}]:{expected}" in run.lines and expected in run.log(r).splitlines()
        assert f"[rank{r}]:warning on {r}" in run.lines
    launcher = run.launcher_log
    assert "hello from" not in launcher and all(line in run.lines for line in launcher.splitlines())


def test_a_forked_agent_fails_and_is_stopped_as_a_new_process_would(tmp_path: Path, warm: WarmAgents) -> None:
    crash = _launch(tmp_path / "crash", """
        if RANK == 1:
            raise ValueError("bad shape on rank one")
        time.sleep(30)
        """, _config(), agents=warm)
    out = crash.outcome
    assert (out.status, out.failing_rank, out.message) == ("script_error", 1, "ValueError: bad shape on rank one"), out
    assert out.returncode not in (0, None) and crash.info["agent_start"] == "forked"
    assert "ChildFailedError" in crash.launcher_log and "ChildFailedError" not in crash.shown
    # A stop (here the wall clock) signals the agent's session and every process of the run: none survives
    # (`_launch` checks), not even a rank that ignores SIGTERM.
    stopped = _launch(tmp_path / "stop", """
        if RANK == 1:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(120)
        """, _config(timeout_s=6.0), agents=warm)
    assert stopped.outcome.status == "timeout" and stopped.outcome.ranks == {0: "stopped", 1: "stopped"}
    assert "death signal" in stopped.launcher_log and stopped.info["agent_start"] == "forked"


class _Watched(WarmAgents):
    """Keeps the agents it forked, to check they are gone."""

    def __init__(self) -> None:
        super().__init__()
        self.forked: list = []

    def spawn(self, cmd, env):
        agent = super().spawn(cmd, env)
        if agent is not None:
            self.forked.append(agent)
        return agent


def test_a_dead_server_ends_its_agents_and_later_runs_start_as_new_processes(tmp_path: Path) -> None:
    with _Watched() as agents:
        def kill_server(p: Progress) -> None:
            if p.elapsed_s > 3.0 and agents._server.poll() is None:
                agents._server.kill()

        run = _launch(tmp_path / "a", "time.sleep(60)\n", _config(), on_progress=kill_server, agents=agents)
        assert run.outcome.status != "ok" and agents.failed == "the warm agent server exited", run.outcome
        # Nobody reports the orphaned agent's end: the supervisor waited until it was gone.
        (agent,) = agents.forked
        assert agent.returncode == -signal.SIGTERM
        assert not psutil.pid_exists(agent.pid) or psutil.Process(agent.pid).status() == psutil.STATUS_ZOMBIE
        later = _launch(tmp_path / "b", "print('fine')\n", _config(), agents=agents)
        assert later.outcome.status == "ok" and later.info["agent_start"] == "new_process"
        assert later.info["agent_fallback"] == "the warm agent server exited"


def test_a_ranks_dump_is_complete_at_its_outermost_frame_or_once_it_stopped_growing(tmp_path: Path) -> None:
    from torsh_tune.launch.supervisor import _dump_complete

    path, sizes = tmp_path / "rank00000.stacks.txt", {}
    path.write_text("")
    assert not _dump_complete(path, sizes, 100.0)  # nothing yet
    path.write_text('Thread 0x7f02 (most recent call first):\n  File "threading.py", line 331 in wait\n\n'
                    'Current thread 0x7f01 (most recent call first):\n  File "train.py", line 8 in <module>\n')
    assert not _dump_complete(path, sizes, 100.1)  # the training thread's stack is still being written
    with path.open("a") as f:
        f.write('  File "<frozen runpy>", line 198 in _run_module_as_main\n')
    assert _dump_complete(path, sizes, 100.2)
    # Another ending (a rank not started by the bootstrap module): complete once it stopped growing.
    other, sizes = tmp_path / "rank00001.stacks.txt", {}
    other.write_text('Current thread 0x7f01 (most recent call first):\n  File "train.py", line 8 in <module>\n')
    assert not _dump_complete(other, sizes, 100.0) and not _dump_complete(other, sizes, 100.1)
    assert _dump_complete(other, sizes, 100.4)
    assert _dump_complete(tmp_path / "missing.stacks.txt", {}, 100.0)  # cannot be read: not waited for
