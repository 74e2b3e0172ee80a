"""The device clock on CUDA: phases and NCCL collectives in device time, no per-step synchronize.

Skipped without CUDA (run by `make gpu-check` where a GPU is lent). One GPU: NCCL runs one
rank; two ranks share the GPU over gloo with CUDA tensors.
"""

from __future__ import annotations

import json

import pytest
import torch

from torsh_tune.analysis import analyze_run
from torsh_tune.analysis.traces import analyze_traces
from torsh_tune.rundir import RunDir

from helpers import EXAMPLES, SCRIPTS, read_jsonl, run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS, WARMUP = 20, 3


def _profile(tmp_path, name: str, script, *args: str, nproc: int = 1, backend: str = "nccl",
             extra: tuple[str, ...] = ()) -> RunDir:
    proc = run_cli("profile", "--nproc-per-node", str(nproc), "--backend", backend, "--steps", str(STEPS),
                   "--warmup-steps", str(WARMUP), "--quiet", *extra, "--runs-dir", str(tmp_path / "runs"),
                   "--run-name", name, str(script), *args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return RunDir(tmp_path / "runs" / name)


def test_ddp_on_nccl_records_device_time_beside_the_host_time(tmp_path):
    run = _profile(tmp_path, "ddp", EXAMPLES / "ddp_mlp.py", "--hidden", "1024", "--steps", "100000",
                   "--log-every", "100000", extra=("--trace-window", "8:3"))
    steps = read_jsonl(run.rank_file(0, "steps"))
    assert len(steps) == STEPS + WARMUP
    measured = [s for s in steps if not s["warmup"]]
    assert {s["clock"] for s in measured} == {"device"}
    for s in measured:
        assert s["step_s"] > 0 and s["host_step_s"] > 0 and s["forward_s"] > 0 and s["backward_s"] > 0
        # Phases are device spans inside the step.
        assert s["forward_s"] + s["backward_s"] + s["optimizer_s"] <= s["step_s"] * 1.01
        # A trace window's export lies between steps: no step's device time holds it (it did once: the
        # previous step's end event went back to the pool and was recorded again after the export).
        assert s["step_s"] < 5 * s["host_step_s"] + 0.005, s
    # The loss is copied to pinned memory on the stream and read once the step completed.
    assert any(s["loss"] is not None for s in measured)
    comm = read_jsonl(run.rank_file(0, "comm"))
    # DDP's builtin all-reduce: PyTorch's own sampled CUDA timers (iterations 1-10, then every 100th).
    assert comm and {(c["issuer"], c["clock"], c["hook"]) for c in comm} == {("ddp", "device", "builtin")}
    # The steps it did not sample say so: their comm is unknown, and the analysis leaves them out of it.
    sampled = {c["step"] for c in comm}
    assert all(s.get("comm_timed", True) is (s["step"] in sampled) for s in steps)
    meta = json.loads(run.rank_file(0, "meta").read_text())
    assert meta["device"] == "cuda" and (meta["nvml"] == "ok" or meta["nvml"].startswith("matched by index"))
    _assert_device_steps(run)


def _assert_device_steps(run: RunDir) -> None:
    """The trace window's steps are the device spans of the kernels each step launched, and they tile the window:
    the self-check compares the device-clock records with them, step by step."""
    (window,) = [d for d in run.traces.iterdir() if d.is_dir()]
    trace = analyze_traces(window)
    steps, span = trace.steps, trace.breakdown["span_s"].iloc[0]
    device = steps["device_step_s"].dropna()
    assert len(device) == len(steps) - 1, steps  # the last step's kernels are dropped with it
    assert 0.9 * span <= device.sum() <= span * 1.0001, (device.tolist(), span)
    assert steps["comm_s"].sum() == pytest.approx(trace.overlap["comm_s"].iloc[0], rel=0.05, abs=1e-5)
    (check,) = analyze_run(run.path).self_check
    row = check.per_rank[0]
    assert (row["trace_step_clock"], row["trace_step_basis"]) == ("device", "kernel spans per step"), row
    assert "comm" in (row.get("per_step") or {}), row


def test_a_hand_written_nccl_all_reduce_is_timed_on_the_device(tmp_path):
    run = _profile(tmp_path, "allreduce", SCRIPTS / "stack_allreduce.py", "--width", "1024")
    comm = read_jsonl(run.rank_file(0, "comm"))
    assert comm and {(c["issuer"], c["clock"], c["backend"]) for c in comm} == {("user", "device", "nccl")}
    assert all(c["duration_s"] is not None and c["duration_s"] >= 0 and c["stream"] == "default" for c in comm)
    steps = [s for s in read_jsonl(run.rank_file(0, "steps")) if not s["warmup"]]
    assert {s["clock"] for s in steps} == {"device"}
    # A synchronous NCCL call runs on the current stream (torch >= 2.7), enqueued inside the call: its
    # device time can only start before the call, so on a starved GPU it holds the host's issuing too.


def _not_the_host_issue(comm: list[dict]) -> None:
    # One rank: NCCL launches no kernel, and a small model leaves the GPU waiting for the host. A
    # collective's device time starts where it was enqueued, not where the stream stood when the host
    # began issuing it: the issue's host time (c10d, NCCL) is the device idling, not communicating.
    duration = sum(c["duration_s"] for c in comm)
    blocked = sum(c["blocked_s"] for c in comm)
    assert duration < 0.5 * blocked, (duration, blocked, comm[:3])


def test_an_engines_async_all_reduces_are_device_time(tmp_path):
    # Each record waits for the engine's Work.wait(), where an event marks the stream reaching the wait:
    # what the stream idled from there to the collective's end is exposed (one rank: NCCL launches no
    # kernel, so it is ~0 here; the records must all arrive, none left holding an event).
    run = _profile(tmp_path, "engine", SCRIPTS / "stack_overlap_engine.py", "--width", "1024")
    comm = read_jsonl(run.rank_file(0, "comm"))
    assert comm and {(c["issuer"], c["clock"], c["async_op"]) for c in comm} == {("user", "device", True)}
    # Device times on the step's device timeline, no event left in the records.
    assert all(c["duration_s"] >= 0 and c["t_complete"] >= c["t_start"] for c in comm)
    assert not any(k.startswith("_") for c in comm for k in c)
    steps = [s for s in read_jsonl(run.rank_file(0, "steps")) if not s["warmup"]]
    assert {s["clock"] for s in steps} == {"device"}
    assert all(0 <= s["exposed_comm_s"] <= s["step_s"] for s in steps)
    _not_the_host_issue(comm)


def test_functional_collectives_are_device_time(tmp_path):
    # The traceable API (DTensor's, compiled code's) on one rank: a tensor-parallel model would issue none
    # here, since DTensor skips the collectives of a mesh dimension one rank wide.
    run = _profile(tmp_path, "funcol", SCRIPTS / "stack_allreduce.py", "--width", "1024", "--functional")
    comm = [c for c in read_jsonl(run.rank_file(0, "comm")) if c["step"] >= WARMUP]
    kinds = {(c["issuer"], c["collective"], c["clock"]) for c in comm}
    assert comm and kinds == {("user", "all_reduce", "device")}, (kinds, comm[:3])
    bad = [c for c in comm if not (c["duration_s"] >= 0 and c.get("t_complete", -1) >= c.get("t_start", 0))]
    assert not bad, (len(bad), len(comm), bad[:3])
    assert not any(k.startswith("_") for c in comm for k in c), comm[:3]
    # The stream reached each wait_tensor before its collective ended or after: never a negative exposure.
    steps = [s for s in read_jsonl(run.rank_file(0, "steps")) if not s["warmup"]]
    assert all(0 <= s["exposed_comm_s"] <= s["step_s"] for s in steps), steps[:3]
    _not_the_host_issue(comm)


def test_two_ranks_share_the_gpu_over_gloo_with_cuda_tensors(tmp_path):
    run = _profile(tmp_path, "gloo", EXAMPLES / "ddp_mlp.py", "--hidden", "512", "--steps", "100000",
                   "--log-every", "100000", nproc=2, backend="gloo")
    for rank in (0, 1):
        steps = [s for s in read_jsonl(run.rank_file(rank, "steps")) if not s["warmup"]]
        assert len(steps) == STEPS and {s["clock"] for s in steps} == {"device"}
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert comm and {c["backend"] for c in comm} == {"gloo"}


def test_an_evaluation_pass_on_the_device_clock_is_not_the_devices_data_time(tmp_path):
    # The Trainer evaluating every 4 steps (8 batches of 8): on the device clock a step's data is what the device
    # did before its first forward; an evaluation forward's start event ends it (else the pass read as data wait).
    pytest.importorskip("transformers")
    run = _profile(tmp_path, "hf_eval", SCRIPTS / "stack_hf_trainer.py", "--steps", "100000", "--eval-steps", "4",
                   "--eval-samples", "64")
    steps = [s for s in read_jsonl(run.rank_file(0, "steps")) if not s["warmup"]]
    evaluated = [s for s in steps if s.get("eval_s")]
    assert evaluated and {s["clock"] for s in steps} == {"device"}
    for s in evaluated:
        assert s["eval_batches"] == 8 and s["data_s"] < s["eval_s"], s
    assert {s["samples"] for s in steps} == {8}
    a = analyze_run(run.path)
    assert [b for b in a.bottlenecks if "eval_pct" in b.evidence]
