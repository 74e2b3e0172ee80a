"""Running one job under torchrun and supervising it to the end.

The supervisor starts torchrun in a new session (so a Ctrl-C in the terminal reaches only
the supervisor, which then stops the job in order), shows the ranks' output live, files
it per rank, watches progress through the step records, enforces the wall-clock and
no-progress timeouts, guarantees that no process of the run survives, and classifies
how the run ended. A caller may also have a running job stopped (the autotuner prunes
hopeless trials); that stop takes the same path as a timeout.

The terminal gets the classification, not torchrun's account of the same failure: once the
supervisor stops a job nothing more of it is shown, and torchrun's failure report (its
traceback and "Root Cause" banner, see `_logs`) is shown only when the outcome cannot
explain the failure by itself. Both stay in logs/.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..config import RunConfig
from ..errors import invalid
from ..rundir import STACKS_SIGNAL, RunDir
from ._logs import LogDemux
from ._procs import die_with_this_thread, find_run_processes, kill_run_processes, signal_group, terminate_run_processes
from .command import apply_launcher_template, build_run_env, build_torchrun_command, new_run_id, write_config_json
from .emulate import ENV_EMULATED, EmulateSpec
from .outcome import RunOutcome, classify_run, drop_empty_stacks
from .progress import Progress, StepsWatcher
from .runinfo import finish_run_info, start_run_info
from .warm import ForkedAgent, WarmAgents

__all__ = ["POLL_INTERVAL_S", "launch_run"]

#: How often the step files are polled and `on_progress` is called.
POLL_INTERVAL_S = 0.5


def _print_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _agent_command(cmd: list[str]) -> list[str]:
    """A local `python -m torch.distributed.run ARGS` as `python -m torsh_tune.launch._agent ARGS`: the same
    agent, ended without finalizing the interpreter (~0.4 s per run). run.json keeps the torchrun command."""
    if WarmAgents.eligible(cmd):
        return [cmd[0], "-m", "torsh_tune.launch._agent", *cmd[3:]]
    return cmd


def launch_run(
    config: RunConfig,
    run_dir: RunDir,
    script: str | Path,
    script_args: Sequence[str],
    *,
    argv: Sequence[str] | None = None,
    echo: Callable[[str], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    should_prune: Callable[[Progress], str | None] | None = None,
    agents: WarmAgents | None = None,
) -> RunOutcome:
    """Run `script` under torchrun with torsh-tune's runtime and supervise it to the end.

    Writes config.json and run.json (status "running", then the final status), captures
    the output into logs/rank{r:05d}.log and logs/launcher.log, and stops the whole job
    (SIGTERM, `budget.kill_grace_s`, SIGKILL, then any process still carrying the run's
    TORSH_TUNE_RUN_ID) on a wall-clock timeout, a no-progress timeout (only while the
    profiler writes step records), a pruning decision of `should_prune`, Ctrl-C, or
    SIGTERM/SIGHUP to the supervisor (when called from the main thread). It never
    raises for a failed job: failures are returned as the outcome's status.

    Args:
        config: The run configuration (validated here).
        run_dir: A fresh run directory (see `torsh_tune.rundir.new_run_dir`).
        script: The user's training script.
        script_args: The script's own arguments, passed through untouched.
        argv: torsh-tune's command line, recorded in run.json.
        echo: Receives each output line meant for the terminal, ranks' lines prefixed with
            `[rank<r>]:` (default: print to stdout). Called on the calling thread.
        on_progress: Called about every 0.5 s with a `Progress` snapshot, and once more
            after the run ended (unless it was interrupted).
        should_prune: Called after each poll while the job is alive (after `on_progress`);
            a non-empty string it returns stops the job as a timeout would, with status
            "pruned" and that string as the outcome's message (the autotuner's pruner).
        agents: Fork torchrun's agent from this warm server (a study's runs, `warm.WarmAgents`)
            when the command is a local torchrun launch; else it is started as a new process.

    Returns:
        The `RunOutcome`; its status is one of `RUN_STATUSES`.

    Raises:
        ConfigError: The configuration is invalid or the script does not exist.
        LaunchError: The launcher template is malformed.

    Example:
        >>> from torsh_tune.config import RunConfig, LaunchConfig
        >>> from torsh_tune.rundir import new_run_dir
        >>> cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2))
        >>> outcome = launch_run(cfg, new_run_dir("runs", "train.py"), "train.py", ["--epochs", "1"])
        >>> outcome.status  # doctest: +SKIP
        'ok'
    """
    config.validate()
    script_path = Path(script).resolve()
    if not script_path.is_file():
        raise invalid("script", "an existing file", str(script))
    echo = echo or _print_line

    run_id = new_run_id(run_dir)
    write_config_json(config, run_dir)
    cmd = build_torchrun_command(config, script_path, script_args, run_dir=run_dir)
    if config.launch.launcher is not None:
        cmd = apply_launcher_template(config.launch.launcher, cmd)
    env = build_run_env(config, run_dir, run_id=run_id)
    emulated = config.launch.env.get(ENV_EMULATED)
    start_run_info(
        run_dir, config=config, script=script_path, script_args=script_args, command=cmd, run_id=run_id, argv=argv,
        emulated=EmulateSpec.parse(str(emulated)).to_dict() if emulated else None,
    )

    t0 = time.monotonic()
    try:
        proc = agents.spawn(cmd, env) if agents is not None else None
        # A warm server that failed is said in run.json (agent_fallback), not only by a slower launch.
        fallback = agents.failed if agents is not None and proc is None and agents.eligible(cmd) else None
        proc = proc or subprocess.Popen(
            _agent_command(cmd),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_this_thread(),
        )
    except OSError as exc:
        outcome = classify_run(
            run_dir,
            world_size=config.world_size,
            returncode=None,
            duration_s=time.monotonic() - t0,
            launch_failure=f"{cmd[0]} could not be started: {exc.strerror or exc}",
        )
        finish_run_info(run_dir, outcome)
        return outcome
    return _Supervisor(config, run_dir, proc, run_id, t0, echo, on_progress, should_prune,
                       agent_fallback=fallback).run()


#: How a faulthandler dump of a rank's threads ends: the training thread's outermost frame (`python -m
#: torsh_tune.runtime.bootstrap`), or faulthandler's cut of a stack deeper than 100 frames.
_DUMP_ENDS = (b" in _run_module_as_main\n", b"\n  ...\n")
#: A dump that stopped growing this long is taken as complete (another way of starting the rank).
_DUMP_STILL_S = 0.25


def _dump_complete(path: Path, sizes: dict[Path, tuple[int, float]], now: float) -> bool:
    """Whether a rank's stacks file holds its whole dump (`_ask_for_stacks`); a file that cannot be read counts.

    `sizes`: path -> (its size, when it was first seen at that size), kept by the caller; `now`: monotonic seconds.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            f.seek(max(0, size - 64))
            tail = f.read()
    except OSError:
        return True
    if size and tail.endswith(_DUMP_ENDS):
        return True
    seen, since = sizes.get(path, (-1, now))
    if seen != size:
        sizes[path] = (size, now)
        return False
    return size > 0 and now - since >= _DUMP_STILL_S


class _Terminated(BaseException):
    """SIGTERM/SIGHUP reached the supervisor: stop the job as for Ctrl-C."""

    def __init__(self, signal_name: str) -> None:
        super().__init__(signal_name)
        self.signal_name = signal_name


@contextlib.contextmanager
def _signals_as_interrupts() -> Iterator[None]:
    # The job runs in its own session, so a supervisor killed by SIGTERM (a scheduler, a
    # closed terminal) would orphan it. Turn those signals into an orderly stop instead.
    # Handlers can only be installed from the main thread (the CLI); elsewhere (an
    # autotuner thread, say) the caller owns signal handling.
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise _Terminated(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _Supervisor:
    def __init__(
        self,
        config: RunConfig,
        run_dir: RunDir,
        proc: subprocess.Popen[bytes] | ForkedAgent,
        run_id: str,
        t0: float,
        echo: Callable[[str], None],
        on_progress: Callable[[Progress], None] | None,
        should_prune: Callable[[Progress], str | None] | None = None,
        *,
        agent_fallback: str | None = None,
    ) -> None:
        self.config = config
        self.agent_fallback = agent_fallback
        self.run_dir = run_dir
        self.proc = proc
        self.run_id = run_id
        self.t0 = t0
        self.echo = echo
        self.on_progress = on_progress
        self.should_prune = should_prune
        assert proc.stdout is not None
        self.demux = LogDemux(proc.stdout, run_dir).start()
        # Every rank has a log, also one that printed nothing (all of them run here: one node or emulated nodes).
        if config.launch.nnodes == 1 or config.launch.env.get(ENV_EMULATED):
            for rank in range(config.world_size):
                run_dir.rank_log(rank).touch()
        self.watcher = StepsWatcher(run_dir)

    def run(self) -> RunOutcome:
        stopped: str | None = None
        stop_message = ""
        # Kept through the stop as well: a second SIGTERM must not orphan a stopping job.
        with _signals_as_interrupts():
            try:
                stopped, stop_message = self._watch()
            except KeyboardInterrupt:
                stopped, stop_message = "interrupted", "interrupted by the user (KeyboardInterrupt)"
            except _Terminated as exc:
                stopped, stop_message = "interrupted", f"the supervisor received {exc.signal_name}"
            except BaseException as exc:
                # A failing callback must not leave the job running; record it, then re-raise.
                self._stop()
                self._finish("interrupted", f"supervisor failed: {type(exc).__name__}: {exc}")
                raise
            if stopped is not None:
                if stopped in ("hang", "timeout"):
                    self._ask_for_stacks()
                self._stop()
            return self._finish(stopped, stop_message)

    def _watch(self) -> tuple[str | None, str]:
        budget = self.config.budget
        last_growth = self.t0
        next_poll = self.t0
        while True:
            self._drain()
            if self.proc.poll() is not None:
                return None, ""
            now = time.monotonic()
            if now >= next_poll:
                if self.watcher.poll():
                    last_growth = now
                next_poll = now + POLL_INTERVAL_S
                snapshot = self.watcher.snapshot(now - self.t0)
                if self.on_progress is not None:
                    self.on_progress(snapshot)
                if self.should_prune is not None:
                    reason = self.should_prune(snapshot)
                    if reason:
                        return "pruned", reason
            if budget.timeout_s is not None and now - self.t0 >= budget.timeout_s:
                done = self.watcher.snapshot(now - self.t0).steps_done
                return "timeout", f"the run exceeded budget.timeout_s={budget.timeout_s:g} s after {done} steps"
            # Step records come from the profiler; without it silence proves nothing.
            if self.config.profiler.enabled and now - last_growth >= budget.no_progress_timeout_s:
                done = self.watcher.snapshot(now - self.t0).steps_done
                return "hang", (
                    f"no step record for budget.no_progress_timeout_s={budget.no_progress_timeout_s:g} s "
                    f"(after {done} steps)"
                )
            try:
                self.echo(self.demux.lines.get(timeout=0.1))
            except queue.Empty:
                pass

    def _drain(self) -> None:
        while True:
            try:
                line = self.demux.lines.get_nowait()
            except queue.Empty:
                return
            self.echo(line)

    def _ask_for_stacks(self, wait_s: float = 2.0) -> None:
        """Before a hung or timed-out run is stopped: where was each rank? Its Python stacks, in its stacks file.

        Only ranks of this host whose meta.json says they answer `STACKS_SIGNAL` (`runtime.bootstrap`), and only
        a pid that still carries this run's marker, are sent it; their faulthandler writes at once, from the
        signal handler, even while the thread is blocked in C++. The stop's SIGTERM would cut a dump short, and
        the training thread's stack comes last (the oldest thread), so each file is waited for until it ends in
        that stack's outermost frame (`_dump_complete`), up to `wait_s`.
        """
        live = {p.pid for p in find_run_processes(self.run_id)}
        host = socket.gethostname()
        asked = []
        for rank in self.run_dir.rank_ids():
            try:
                meta = json.loads(self.run_dir.rank_file(rank, "meta").read_text())
            except (OSError, ValueError):
                continue
            if not isinstance(meta, dict) or meta.get("stacks_signal") != STACKS_SIGNAL.name:
                continue
            if meta.get("hostname") != host or meta.get("pid") not in live:
                continue
            try:
                os.kill(int(meta["pid"]), STACKS_SIGNAL)
            except OSError:
                continue
            asked.append(self.run_dir.rank_file(rank, "stacks"))
        sizes: dict[Path, tuple[int, float]] = {}  # path -> (size, when it was first seen at that size)
        deadline = time.monotonic() + wait_s
        while asked and time.monotonic() < deadline:
            asked = [path for path in asked if not _dump_complete(path, sizes, time.monotonic())]
            time.sleep(0.02)

    def _stop(self) -> None:
        """SIGTERM everything, wait up to kill_grace_s, then SIGKILL whatever is left."""
        grace_s = self.config.budget.kill_grace_s
        # torchrun forwards SIGTERM to its workers, but they live in their own sessions and
        # a wedged torchrun would not, so they are signalled directly as well.
        signal_group(self.proc.pid, signal.SIGTERM)
        terminate_run_processes(self.run_id)
        deadline = time.monotonic() + grace_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not find_run_processes(self.run_id):
                    break
                time.sleep(0.1)
        except (KeyboardInterrupt, _Terminated):
            pass  # asked again: skip the grace period
        signal_group(self.proc.pid, signal.SIGKILL)
        kill_run_processes(self.run_id)
        self.proc.wait()

    def _finish(self, stopped: str | None, stop_message: str) -> RunOutcome:
        self.proc.wait()
        # Leftovers of a run that ended by itself (DataLoader workers, detached children).
        kill_run_processes(self.run_id, grace_s=min(self.config.budget.kill_grace_s, 2.0))
        self.demux.join(timeout_s=5.0)
        self.watcher.poll()
        drop_empty_stacks(self.run_dir)  # every rank process has ended
        outcome = classify_run(
            self.run_dir,
            world_size=self.config.world_size,
            returncode=self.proc.returncode,
            duration_s=time.monotonic() - self.t0,
            stopped=stopped,
            stop_message=stop_message,
            saw_rank_output=self.demux.saw_rank_output,
        )
        finish_run_info(self.run_dir, outcome,
                        agent_start="forked" if isinstance(self.proc, ForkedAgent) else "new_process",
                        agent_fallback=self.agent_fallback)
        # Callbacks last: if the terminal is gone, run.json already tells how the run ended.
        if stopped is None:  # a stopped job's last words are the stop's consequences
            self._drain()
        if _launcher_report_needed(outcome, stopped):
            for line in self.demux.held:
                self.echo(line)
        if self.on_progress is not None and stopped != "interrupted":
            # The final count, so a progress display ends on what the run really did.
            self.on_progress(self.watcher.snapshot(outcome.duration_s))
        return outcome


def _launcher_report_needed(outcome: RunOutcome, stopped: str | None) -> bool:
    """Whether torchrun's held-back lines must reach the terminal: nothing else says why the run failed.

    A job the supervisor stopped, a failing rank the outcome names and an abort at exit after
    every rank finished are explained without them; a successful run's are mere warnings.
    """
    if outcome.ok:
        return outcome.returncode == 0
    return stopped is None and outcome.failing_rank is None
