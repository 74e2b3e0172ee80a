"""torchrun command line, launcher templates and the ranks' environment."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from torsh_tune.config import BudgetConfig, LaunchConfig, RunConfig
from torsh_tune.errors import LaunchError
from torsh_tune.launch import (
    BOOTSTRAP_MODULE,
    ENV_RUN_ID,
    apply_launcher_template,
    build_run_env,
    build_torchrun_command,
    new_run_id,
    write_config_json,
)
from torsh_tune.rundir import ENV_CONFIG, ENV_RUN_DIR, new_run_dir


def _opt(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_standalone_command(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py", name="r1")
    script = tmp_path / "train.py"
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=4, max_restarts=2), budget=BudgetConfig(kill_grace_s=2.5))
    cmd = build_torchrun_command(cfg, script, [], run_dir=rd, python="/usr/bin/python3")

    assert cmd[:3] == ["/usr/bin/python3", "-m", "torch.distributed.run"]
    assert "--standalone" in cmd
    for flag in ("--nnodes", "--rdzv-endpoint", "--rdzv-id", "--node-rank"):
        assert flag not in cmd
    assert _opt(cmd, "--nproc-per-node") == "4"
    assert _opt(cmd, "--max-restarts") == "2"
    assert _opt(cmd, "--shutdown-timeout") == "3"  # ceil of the kill grace
    assert _opt(cmd, "--tee") == "3"
    assert Path(_opt(cmd, "--log-dir")).is_relative_to(rd.logs)
    assert cmd[-3:] == ["-m", BOOTSTRAP_MODULE, str(script.resolve())]


def test_multi_node_command(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py", name="job-7")
    cfg = RunConfig(
        launch=LaunchConfig(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29400")
    )
    cmd = build_torchrun_command(cfg, Path("train.py"), [], run_dir=rd)

    assert "--standalone" not in cmd
    assert _opt(cmd, "--nnodes") == "2"
    assert _opt(cmd, "--node-rank") == "1"
    assert _opt(cmd, "--rdzv-backend") == "c10d"
    assert _opt(cmd, "--rdzv-endpoint") == "node0:29400"
    assert _opt(cmd, "--rdzv-id") == "job-7"  # defaults to the run name, shared by all nodes
    assert cmd[0] == sys.executable

    explicit = cfg.replace(launch={**cfg.to_dict()["launch"], "rdzv_id": "abc", "node_rank": None})
    cmd2 = build_torchrun_command(explicit, Path("train.py"), [], run_dir=rd)
    assert _opt(cmd2, "--rdzv-id") == "abc"
    assert "--node-rank" not in cmd2


def test_script_args_pass_through_untouched(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py")
    args = ["--hidden", "5", "--steps", "x", "--nproc-per-node", "7", "-m", "a b", "--standalone"]
    cmd = build_torchrun_command(RunConfig(), tmp_path / "train.py", args, run_dir=rd)
    i = cmd.index(BOOTSTRAP_MODULE)
    assert cmd[i + 2 :] == args
    # the launcher's own options all precede the script
    assert cmd.index("--nproc-per-node") < i and cmd.count("--standalone") == 2

    # torchrun's parser really leaves them to the script (REMAINDER after the script)
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.training_script == BOOTSTRAP_MODULE
    assert parsed.training_script_args == [str((tmp_path / "train.py").resolve()), *args]
    assert parsed.nproc_per_node == "1"


def test_launcher_template(tmp_path: Path) -> None:
    cmd = ["python", "-m", "torch.distributed.run", "/my dir/train.py", "--name", "it's"]
    wrapped = apply_launcher_template("srun -N2 --ntasks-per-node=1 {cmd}", cmd)
    assert wrapped == ["srun", "-N2", "--ntasks-per-node=1", *cmd]

    # a real wrapper runs the command with every argument intact (no shell involved)
    code = "import os, sys; print(sys.argv[1:], os.environ['TT_X'])"
    out = subprocess.run(
        apply_launcher_template("env TT_X=1 {cmd}", [sys.executable, "-c", code, "a b", "it's", "$HOME"]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str(["a b", "it's", "$HOME"]) + " 1"

    with pytest.raises(LaunchError, match=r"\{cmd\}"):
        apply_launcher_template("srun -N2", cmd)
    with pytest.raises(LaunchError, match="shell-quoted"):
        apply_launcher_template("srun 'unclosed {cmd}", cmd)


def test_env_and_config_json(tmp_path: Path) -> None:
    rd = new_run_dir(tmp_path, "train.py")
    cfg = RunConfig(launch=LaunchConfig(nproc_per_node=2, env={"NCCL_ALGO": "Ring", "PYTHONUNBUFFERED": "0"}))
    path = write_config_json(cfg, rd)
    run_id = new_run_id(rd)
    env = build_run_env(cfg, rd, run_id=run_id, base={"PATH": "/bin", "NCCL_ALGO": "Tree"})

    assert path == rd.config_json
    assert RunConfig.from_json(path.read_text()) == cfg
    assert json.loads(path.read_text())["launch"]["nproc_per_node"] == 2
    assert env["PATH"] == "/bin"
    assert env["NCCL_ALGO"] == "Ring"  # config beats the inherited environment
    assert env["PYTHONUNBUFFERED"] == "1"  # live output is not negotiable
    assert env[ENV_RUN_DIR] == str(rd.path.resolve())
    assert env[ENV_CONFIG] == str(rd.config_json.resolve())
    assert env[ENV_RUN_ID] == run_id
    assert run_id != new_run_id(rd)
    assert env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank${rank}]:"
    assert all(isinstance(v, str) for v in env.values())


def test_shlex_join_is_what_templates_receive() -> None:
    cmd = ["a", "b c"]
    assert apply_launcher_template("x {cmd} y", cmd) == ["x", *shlex.split(shlex.join(cmd)), "y"]


def test_torchrun_flags_are_read_off_its_source_as_its_parser_knows_them():
    from torch.distributed.run import get_args_parser

    from torsh_tune.launch.command import torchrun_accepts

    known = {opt for action in get_args_parser()._actions for opt in action.option_strings}
    for flag in ("--shutdown-timeout", "--standalone", "--nproc-per-node", "--tee", "--log-dir", "--no-such-flag",
                 "--local-ranks-filter"):
        assert torchrun_accepts(flag) == (flag in known), flag
    # The launching process never imports torch for it (it cost ~2 s per CLI run).
    probe = ("import sys; from torsh_tune.launch.command import torchrun_accepts; "
             "torchrun_accepts('--shutdown-timeout'); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_cuda_availability_is_torchs_answer_and_needs_no_torch_import_on_a_cpu_host(monkeypatch):
    import torch

    from torsh_tune.launch import command

    probe = ("import sys; from torsh_tune.launch.command import local_cuda_available; "
             "print(local_cuda_available(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(torch.cuda.is_available())
    if torch.version.cuda is None and torch.version.hip is None:  # this CPU wheel: said from torch/version.py
        assert out[1] == "False"
    # What each torch/version.py says: only a build with neither CUDA nor ROCm is answered without torch.
    asked = []
    fake = type("T", (), {"cuda": type("C", (), {"is_available": staticmethod(lambda: asked.append(1) or True)})})
    monkeypatch.setitem(sys.modules, "torch", fake)
    for text, expected, asks in (("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False, 0),
                                 ("cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", True, 1),
                                 ("cuda = None\nhip = '6.2'\n", True, 1),
                                 ("something else entirely\n", True, 1)):
        monkeypatch.setattr(command, "_torch_source", lambda relpath, text=text: text)
        command.local_cuda_available.cache_clear()
        asked.clear()
        assert command.local_cuda_available() is expected and len(asked) == asks, text
    command.local_cuda_available.cache_clear()


def test_the_agent_takes_the_rendezvous_costs_that_buy_nothing_and_keeps_its_retries(tmp_path, monkeypatch):
    import types

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as rdzv
    from torch.distributed.elastic.rendezvous import utils as rdzv_utils

    from torsh_tune.launch import _agent

    monkeypatch.setattr(rdzv, "get_method_name", rdzv.get_method_name)  # restored after the test
    monkeypatch.setattr(rdzv, "_delay", rdzv._delay)
    original_name, original_delay = rdzv.get_method_name, rdzv._delay
    one = build_torchrun_command(RunConfig(), tmp_path / "train.py", ["--standalone", "--nnodes", "2"],
                                 run_dir=new_run_dir(tmp_path, "train.py", name="one"))
    two = build_torchrun_command(RunConfig(launch=LaunchConfig(nnodes=2, rdzv_endpoint="node0:29400")),
                                 tmp_path / "train.py", ["-m", "--standalone"],
                                 run_dir=new_run_dir(tmp_path, "train.py", name="two"))
    # Only torchrun's own options count: the script's arguments (here a `--standalone` of its own) do not.
    assert _agent._one_node(one[3:]) and not _agent._one_node(two[3:])

    _agent._lighter_rendezvous(two[3:])  # several nodes: every delay is kept
    assert rdzv._delay is original_delay and rdzv.get_method_name is not original_name

    def _record():  # the rendezvous' own pattern: the name of the method that records the event
        return rdzv.get_method_name(), original_name()

    def next_rendezvous():
        return _record()

    new, old = next_rendezvous()
    assert new == old == "next_rendezvous"
    assert rdzv.get_method_name(10_000) == original_name(10_000) == "no_method_name"

    _agent._lighter_rendezvous(one[3:])  # one node: the first join's random spread is gone, a retry's wait is not
    slept: list[float] = []
    monkeypatch.setattr(rdzv_utils, "time", types.SimpleNamespace(sleep=slept.append))  # what `_delay` sleeps
    rdzv._delay((0.25, 0.3))
    assert slept == []
    rdzv._delay(1)
    assert slept == [1]
    original_delay((0.25, 0.3))  # the check above can fail: torch's own delay sleeps on such a range
    assert len(slept) == 2 and 0.25 <= slept[1] <= 0.3


def test_the_agent_tells_every_log_tailer_once_the_workers_are_gone_and_each_still_reads_to_the_end(
        tmp_path, monkeypatch):
    import io

    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.tail_log import TailLog

    from torsh_tune.launch import _agent

    monkeypatch.setattr(api.PContext, "close", api.PContext.close)  # restored after the test
    _agent._tails_stop_together()
    _agent._tails_stop_together()  # once only
    assert getattr(api.PContext, "close")._torsh_tune

    told_at_first_stop: list[bool] = []
    outs = [io.StringIO(), io.StringIO()]
    files = []
    for i in range(2):
        f = tmp_path / f"worker{i}.log"
        f.write_text(f"line of {i}\n")
        files.append(f)

    class Tail(TailLog):
        def stop(self) -> None:
            told_at_first_stop.append(all(e.is_set() for t in ctx._tail_logs for e in t._finished_events.values()))
            super().stop()

    class Context(api.PContext):  # torchrun's own close(), on workers already gone
        def _start(self): ...
        def _poll(self): ...
        def pids(self): return {}
        def _close(self, death_sig, timeout=30):
            for i, f in enumerate(files):  # a worker's last words, written as it ends
                with f.open("a") as out:
                    out.write(f"last of {i}\n")

    ctx = object.__new__(Context)
    ctx._tail_logs = [Tail("w", {0: str(f)}, out).start() for f, out in zip(files, outs)]
    ctx.filtered_stdout = ctx.filtered_stderr = None
    ctx.close()
    assert told_at_first_stop[:1] == [True] and "_close" not in vars(ctx)
    assert [o.getvalue() for o in outs] == [f"[w0]:line of {i}\n[w0]:last of {i}\n" for i in range(2)]
