"""The in-rank bootstrap on real 2-rank gloo runs of an unmodified DDP script."""

from __future__ import annotations

import json

import pytest

from torsh_tune.rundir import RunDir

from helpers import SCRIPTS, assert_record_schema, read_jsonl, torchrun_bootstrap

SCRIPT = SCRIPTS / "train_small.py"


def _exit(run: RunDir, rank: int) -> dict:
    return json.loads(run.rank_file(rank, "exit").read_text())


def test_budget_stops_every_rank_at_the_same_step_and_records_match_schema(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, config={"budget": {"steps": 8, "warmup_steps": 2}, "profiler": {"loss_every": 5}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        steps = read_jsonl(run.rank_file(rank, "steps"))
        assert [s["step"] for s in steps] == list(range(10))
        assert_record_schema(steps[0], "steps")
        assert steps[0]["clock"] == "host"  # CPU: the host does the work
        assert [s["warmup"] for s in steps] == [True, True] + [False] * 8
        assert all(s["samples"] == 16 and s["num_microbatches"] == 1 for s in steps)
        assert [s["step"] for s in steps if s["loss"] is not None] == [0, 5]
        assert all(s["step_s"] > 0 and s["backward_s"] > 0 for s in steps)
        # The forward is probed from the first optimizer step on (the module holding the parameters).
        assert all(s["forward_s"] > 0 for s in steps[1:]) and steps[0]["forward_s"] == 0
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert_record_schema(comm[0], "comm")
        assert comm[0]["issuer"] == "ddp" and comm[0]["clock"] == "host" and comm[0]["group_ranks"] == [0, 1]
        meta = json.loads(run.rank_file(rank, "meta").read_text())
        param_bytes = meta["ddp"]["param_bytes"]
        assert param_bytes == (32 * 64 + 64 + 64 * 4 + 4) * 4
        per_step = {}
        for c in comm:
            per_step[c["step"]] = per_step.get(c["step"], 0) + c["bytes"]
        # PyTorch's C++ all-reduce, timed by DDP's own timers: one record per step, in the step's
        # window; DDP reports a step's timers at the next forward, so the last step has none.
        assert set(per_step) == set(range(9)) and set(per_step.values()) == {param_bytes}
        assert {c["hook"] for c in comm} == {"builtin"}
        by_step = {s["step"]: s for s in steps}
        for c in comm:
            s = by_step[c["step"]]
            assert s["t_start"] <= c["t_issue"] <= c["t_complete"] <= s["t_end"]
            assert s["comm_s"] == pytest.approx(c["duration_s"])
        assert meta["backend"] == "gloo"
        assert "avg_backward_comm_time" in meta["ddp_logging"]
        ex = _exit(run, rank)
        assert ex["status"] == "budget" and ex["steps_done"] == 10
        # The sampler samples at the measured window's edges: one sample covers exactly its steps.
        system = read_jsonl(run.rank_file(rank, "system"))
        t0, t1 = steps[2]["t_start"], steps[-1]["t_end"]
        assert any(abs(r["t_since"] - t0) < 0.2 and abs(r["t"] - t1) < 0.2 for r in system), (t0, t1, system)


def test_custom_comm_hook_is_wrapped_and_still_runs(tmp_path):
    run = RunDir(tmp_path / "run")
    mark = tmp_path / "hook"
    proc = torchrun_bootstrap(run.path, SCRIPT, "--custom-hook", "--mark", str(mark), config={"budget": {"steps": 5, "warmup_steps": 0}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        calls = (tmp_path / f"hook.{rank}").read_text().count("x")
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert calls == len(comm) == 5
        assert {c["hook"] for c in comm} == {"counting_allreduce"}


def test_no_sync_accumulation_counts_micro_batches(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, "--accum", "3", config={"budget": {"steps": 4, "warmup_steps": 0}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run.rank_file(0, "steps"))
    assert len(steps) == 4
    assert all(s["num_microbatches"] == 3 and s["samples"] == 48 for s in steps)
    comm = read_jsonl(run.rank_file(0, "comm"))
    # one all-reduce per optimizer step (no_sync skipped the others); the last step's is never reported
    assert [c["step"] for c in comm] == [0, 1, 2]
    by_step = {s["step"]: s for s in steps}
    for c in comm:
        assert by_step[c["step"]]["t_start"] <= c["t_issue"] <= c["t_complete"] <= by_step[c["step"]]["t_end"]


def test_script_without_destroy_and_natural_end(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, "--steps", "6", "--no-destroy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished 6 steps" in proc.stdout + proc.stderr
    for rank in (0, 1):
        assert _exit(run, rank)["status"] == "ok"
        assert len(read_jsonl(run.rank_file(rank, "steps"))) == 6


def test_script_exiting_early_is_ok_with_fewer_steps(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, "--exit-after", "3", config={"budget": {"steps": 50}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        ex = _exit(run, rank)
        assert ex["status"] == "ok" and ex["steps_done"] == 3


def test_nccl_without_cuda_is_one_config_error(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, "--backend", "nccl")
    assert proc.returncode != 0
    # The first rank to fail writes its record before exiting; torchrun may stop the other first.
    exits = [_exit(run, r) for r in (0, 1) if run.rank_file(r, "exit").exists()]
    assert exits and all(ex["status"] == "config_error" for ex in exits)
    assert exits[0]["message"] == "process-group backend must be gloo when CUDA is not available (nccl needs a GPU), but got 'nccl'"
    assert "Traceback" not in "\n".join(l for l in proc.stderr.splitlines() if l.startswith("[rank0]"))


def test_failing_rank_writes_error_record(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, "--fail-rank", "1", "--fail-step", "2", config={"budget": {"steps": 20}})
    assert proc.returncode != 0
    ex = _exit(run, 1)
    assert ex["status"] == "error" and ex["error_type"] == "RuntimeError"
    assert "planted failure on rank 1" in ex["message"]
    assert len(read_jsonl(run.rank_file(1, "steps"))) == 2


def test_dataloader_and_ddp_overrides_apply_without_code_change(tmp_path):
    run = RunDir(tmp_path / "run")
    config = {"budget": {"steps": 3, "warmup_steps": 0},
              "strategy": {"ddp": {"bucket_cap_mb": 1.0, "gradient_as_bucket_view": True}, "dataloader": {"num_workers": 1}}}
    proc = torchrun_bootstrap(run.path, SCRIPT, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(run.rank_file(0, "meta").read_text())
    assert meta["ddp"]["bucket_cap_mb"] == pytest.approx(1.0)
    assert meta["ddp"]["gradient_as_bucket_view"] is True
    assert meta["dataloader_overrides"] == {"num_workers": 1}


_LEFT_OPEN = '''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
out_dir, rank = sys.argv[1], dist.get_rank()
log = open(os.path.join(out_dir, f"log{rank}.txt"), "w", buffering=1 << 16)
log.write("written, never flushed nor closed\\n")


class Node:  # a reference cycle whose finalizer has an effect
    def __init__(self):
        self.me = self

    def __del__(self):
        with open(os.path.join(out_dir, f"del{rank}.txt"), "w") as f:
            f.write("finalized\\n")


node = Node()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(100):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
'''


def test_a_rank_that_ends_at_its_budget_still_finalizes_the_scripts_objects(tmp_path):
    # The rank skips the interpreter's final collections over torch's objects (bootstrap's
    # _skip_the_final_collection), but the script's own namespace is garbage by then and is collected
    # first: a file it left open is flushed and closed, a cycle's finalizer runs.
    script = tmp_path / "left_open.py"
    script.write_text(_LEFT_OPEN)
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, script, str(tmp_path), config={"budget": {"steps": 3, "warmup_steps": 1}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        assert _exit(run, rank)["status"] == "budget"
        assert (tmp_path / f"log{rank}.txt").read_text() == "written, never flushed nor closed\n"
        assert (tmp_path / f"del{rank}.txt").read_text() == "finalized\n"


def test_ddps_gradients_are_the_ranks_average_under_the_profilers_per_bucket_hook(tmp_path):
    # With profiler.comm_hook_timing the profiler's hook divides and all-reduces each bucket itself (PyTorch's
    # default hook's arithmetic, on the process group): the gradients must be the ranks' average, as DDP's
    # C++ path gives them.
    run = RunDir(tmp_path / "run")
    out = tmp_path / "worst.json"
    proc = torchrun_bootstrap(run.path, SCRIPTS / "ddp_average_check.py", str(out),
                              config={"budget": {"warmup_steps": 0}, "profiler": {"comm_hook_timing": True}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = json.loads(out.read_text())
    assert len(worst) == 4 and max(worst) < 1e-5, worst
    for rank in (0, 1):
        comm = [c for c in read_jsonl(run.rank_file(rank, "comm")) if c["issuer"] == "ddp"]
        assert {c["hook"] for c in comm} == {"allreduce"}
        # One record per bucket, their bytes the parameters' in every step.
        param_bytes = json.loads(run.rank_file(rank, "meta").read_text())["ddp"]["param_bytes"]
        per_step = {}
        for c in comm:
            per_step.setdefault(c["step"], []).append(c)
        assert set(per_step) == set(range(4))
        assert all(len(per_step[step]) > 1 for step in (1, 2, 3))  # buckets rebuilt after the first iteration
        for records in per_step.values():
            assert sum(c["bytes"] for c in records) == sum(c["grad_bytes"] for c in records) == param_bytes
            assert all(c["t_issue"] <= c["t_complete"] and c["clock"] == "host" for c in records)


_FOREVER = '''
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], f"pid{dist.get_rank()}"), "w") as f:
    f.write(str(os.getpid()))
t = torch.ones(4)
while True:  # the two ranks keep each other going: only a signal ends them
    dist.all_reduce(t)
    time.sleep(0.05)
'''


def test_the_ranks_die_with_their_killed_torchrun_agent(tmp_path):
    """torchrun SIGKILLed (as a fan-out's grace period or the OOM killer does) leaves no rank running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "forever.py"
    script.write_text(_FOREVER)
    env = dict(os.environ, TORSH_TUNE_RUN_DIR=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                              "-m", "torsh_tune.runtime.bootstrap", str(script), str(tmp_path)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline and agent.poll() is None:
            pids = [int(p.read_text()) for p in tmp_path.glob("pid*") if p.read_text()]
            time.sleep(0.1)
        assert len(pids) == 2, "the ranks never started"
        agent.kill()
        agent.wait()

        def alive(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 30
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "ranks outlived their agent"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            agent.kill()


_ABORT_IN_A_WAIT = """
import os, sys, threading, time
from pathlib import Path
from torsh_tune.runtime.bootstrap import _stacks_on_a_fatal_signal

def background_sampler():
    time.sleep(30)

def wait_for_the_collective():
    time.sleep(0.2)  # the other thread is asleep by now
    os.abort()

threading.Thread(target=background_sampler, daemon=True).start()
_stacks_on_a_fatal_signal(Path(sys.argv[1]))
wait_for_the_collective()
"""


@pytest.mark.parametrize("users_own", [False, True])
def test_a_fatal_signal_leaves_every_python_threads_stack_unless_the_user_chose_faulthandler(tmp_path, users_own):
    import os
    import subprocess
    import sys

    stacks = tmp_path / "rank00001.stacks.txt"
    env = dict(os.environ, PYTHONFAULTHANDLER="1") if users_own else {k: v for k, v in os.environ.items()
                                                                      if k != "PYTHONFAULTHANDLER"}
    proc = subprocess.run([sys.executable, "-c", _ABORT_IN_A_WAIT, str(stacks)], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == -6, proc.stderr[-2000:]
    if users_own:  # theirs writes to stderr, and no file of ours is made
        assert not stacks.exists() and "in wait_for_the_collective" in proc.stderr
        return
    text = stacks.read_text()
    assert text.startswith("Fatal Python error: Aborted") and "Fatal Python error" not in proc.stderr
    # The aborting thread, and the other Python thread where it was (faulthandler's order of the two varies).
    blocks = {b.split(" ", 1)[0]: b for b in text.split("\n\n") if b.startswith(("Current thread", "Thread 0x"))}
    assert "in wait_for_the_collective" in blocks["Current"] and "in background_sampler" in blocks["Thread"], text


def test_the_stacks_signal_is_taken_only_while_nothing_handles_it(tmp_path):
    import subprocess
    import sys

    script = """
import signal, sys
from pathlib import Path
from torsh_tune.rundir import STACKS_SIGNAL
from torsh_tune.runtime.bootstrap import _stacks_on_a_fatal_signal
def theirs(signum, frame):
    print("their handler")
if sys.argv[2] == "theirs":
    signal.signal(STACKS_SIGNAL, theirs)
print(_stacks_on_a_fatal_signal(Path(sys.argv[1])))
signal.raise_signal(STACKS_SIGNAL)
print("alive")
"""
    for who, answers, printed in (("none", "True", ""), ("theirs", "False", "their handler\n")):
        stacks = tmp_path / f"{who}.stacks.txt"
        proc = subprocess.run([sys.executable, "-c", script, str(stacks), who], capture_output=True, text=True,
                              timeout=60)
        # The rank goes on after writing its stacks; a handler of the script's own stays in charge.
        assert proc.stdout == f"{answers}\n{printed}alive\n", proc.stderr[-2000:]
        assert ("Current thread" in stacks.read_text()) == (who == "none")
