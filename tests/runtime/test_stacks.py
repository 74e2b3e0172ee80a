"""The stacks users really run, profiled through the real CLI on 2-rank gloo: nothing is invisible.

Each script knows nothing about torsh-tune (tests/data/scripts/stack_*.py). For each: steps
on both ranks, a throughput, a forward, communication records at the c10d layer whose bytes
match the gradients and whose issuer is right, and a diagnosis that follows from them.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from torsh_tune.analysis import analyze_run, phase_frame
from torsh_tune.config import ThresholdsConfig
from torsh_tune.rundir import RunDir

from helpers import SCRIPTS, rank_stacks, read_jsonl, run_cli

# Every stack's self-check must agree with its trace within 5 pp, so each run is measured alone (`make test`
# runs the `serial` tests after the parallel part), not beside another test's ranks on the same cores.
pytestmark = pytest.mark.serial

STEPS, WARMUP = 12, 3


def _profile(tmp_path, name: str, script: str, *script_args: str, extra: tuple[str, ...] = (), timeout: float = 300,
             steps: int = STEPS):
    runs = tmp_path / "runs"
    proc = run_cli("profile", "--nproc-per-node", "2", "--steps", str(steps), "--warmup-steps", str(WARMUP),
                   "--quiet", *extra, "--runs-dir", str(runs), "--run-name", name, str(SCRIPTS / script),
                   *script_args, timeout=timeout, env={"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + rank_stacks(runs / name)[-6000:]
    return RunDir(runs / name)


LIGHTNING_SIGTERM = "lightning.pytorch.loops.training_epoch_loop:_TrainingEpochLoop._broadcast_sigterm_tensor"


def _per_step_bytes(comm: list[dict], *, collective: str | None = None, issuer: str | None = None) -> dict[int, int]:
    out: dict[int, int] = {}
    for c in comm:
        if (collective is None or c["collective"] == collective) and (issuer is None or c.get("issuer") == issuer):
            out[c["step"]] = out.get(c["step"], 0) + c["bytes"]
    return out


def _assert_steps_and_forward(run: RunDir, num_steps: int = STEPS) -> list[list[dict]]:
    per_rank = []
    for rank in (0, 1):
        steps = read_jsonl(run.rank_file(rank, "steps"))
        assert [s["step"] for s in steps] == list(range(num_steps + WARMUP))
        measured = [s for s in steps if not s["warmup"]]
        assert all(s["forward_s"] > 0 and s["samples"] > 0 and s["clock"] == "host" for s in measured)
        per_rank.append(steps)
    a = analyze_run(run.path)
    assert a.steps is not None and a.steps.throughput_samples_s and a.steps.throughput_samples_s > 0
    assert a.breakdown is not None and a.breakdown.phases_s["forward"] > 0
    return per_rank


# The self-check (always-on vs the Kineto trace of the same steps), in pp: the 5 pp.
# Measured 2026-11-27 with 2 ranks beside a running test suite on 2 cores, 3 runs each: the
# hand-written all-reduce (width 1024) compute -0.6 to -2.2, comm and exposed +0.2 to +0.6; FSDP2
# compute -0.5 to 0, comm and exposed +0.3 to +0.6. Before the trace counted the main thread's
# waits for synchronous collectives (it wakes up after the gloo worker's span: ms on a loaded host)
# and compared compute on the phases (the trace's operators outside them, e.g. the gradient
# division, are the always-on side's other), comm reached +7.7 and compute -5.3.
SELF_CHECK_PP = 5.0
WINDOW = ("--trace-window", f"{WARMUP + 2}:6")
# Twelve traced steps for the stacks whose training thread shares the 2 cores with gloo's workers
# mid-step (compiled DDP's buckets, tensor parallelism's all-reduces inside forward): one lost core
# for a few ms moves a 6-step window's shares by 2-3 pp one way or the other.
LONG_STEPS = 20
LONG_WINDOW = ("--trace-window", f"{WARMUP + 2}:12")


# A mean of ranks past the limit still passes when the self-check's own per-step view puts it on one step per
# rank (a thread that lost one of the 2 shared cores inside it) while every rank's median step agrees within
# this many pp: a moment the two tiers saw differently, not a measurement that is wrong in every step.
# Above the steady part some stacks read in every step: the Trainer's compute -1.8 ... -2.6 pp per median step
# (2026-11-29, six quiet ranks: its two small synchronous collectives per step each read 0.1-0.2 ms longer
# than gloo's span in the trace, the call's own work around the wait, which the trace leaves in the forward's
# compute). At 2.0 one suite run failed on medians of -2.11 and -2.14 with one stalled step (+3.2 and +3.5 pp
# of comm, the window's first step, on both ranks).
ONE_STEP_MEDIAN_PP = 3.0


def _assert_self_check(run: RunDir, limit_pp: float = SELF_CHECK_PP) -> None:
    (check,) = analyze_run(run.path).self_check
    diffs = {m: check.overall[f"{m}_diff_pp"] for m in ("compute", "comm", "exposed_comm")}
    where = {m: {r["rank"]: (r[f"{m}_diff_pp"], (r.get("per_step") or {}).get(m)) for r in check.per_rank}
             for m in diffs}
    for metric, diff in diffs.items():
        if abs(diff) <= limit_pp:
            continue
        steps = where[metric].values()
        one_step = all(w is not None and abs(w["median_step_diff_pp"]) <= ONE_STEP_MEDIAN_PP for _, w in steps) and \
            abs(sum(d - w["largest_step_pp"] for d, w in steps) / len(steps)) <= limit_pp
        assert one_step, (metric, diffs, where[metric])


def test_fsdp2_applied_by_the_script_has_its_all_gathers_and_reduce_scatters(tmp_path):
    # A distributed checkpoint saved after the loop's first step (warm-up step 1): its collectives are
    # the checkpoint's, not the script's.
    run = _profile(tmp_path, "fsdp2", "stack_fsdp2.py", "--checkpoint-at", "0", extra=WINDOW)
    _assert_fsdp2(run)
    for rank in (0, 1):
        comm = [c for c in read_jsonl(run.rank_file(rank, "comm")) if c["step"] < WARMUP]
        saved = [c for c in comm if c["issuer"] == "checkpoint"]
        assert saved and {c["step"] for c in saved} == {1}, {(c["step"], c["issuer"]) for c in comm}
        assert all(c["origin"].startswith("torch.distributed.checkpoint.") for c in saved), saved
        # The script's own broadcast of the directory stays the user's.
        assert {c["collective"] for c in comm if c["issuer"] == "user"} == {"broadcast_object_list"}


def test_checkpoint_saves_in_the_measured_steps_are_timed_and_called_out(tmp_path):
    # Saves after loop steps 4, 8 and 12 (measured steps 5, 9, 13): rare, long, and the median step never shows them.
    run = _profile(tmp_path, "saves", "stack_fsdp2.py", "--checkpoint-at", "4", "8", "12")
    for rank in (0, 1):
        steps = read_jsonl(run.rank_file(rank, "steps"))
        saved = {s["step"]: s["checkpoint_s"] for s in steps if s.get("checkpoint_s")}
        assert set(saved) == {5, 9, 13}, saved
        # One save is timed once (DCP's writer calls torch.save inside it), inside its step.
        assert all(0 < saved[s] < steps[s]["step_s"] for s in saved)
    a = analyze_run(run.path)
    (io,) = [b for b in a.bottlenecks if b.category == "io" and "checkpoint_pct" in b.evidence]
    ev = io.evidence
    assert ev["saves"] == 3 and ev["every_steps"] == 4 and ev["checkpoint_pct"] > 5
    assert "spent saving checkpoints: 3 save(s)" in io.message
    (rec,) = [r for r in a.recommendations if "async_save" in r.title]
    assert rec.category == "io" and rec.config_patch == {} and rec.expected_gain.high_pct == pytest.approx(
        ev["checkpoint_pct"], abs=0.01)
    # The saves' collectives are the checkpoint's; the step breakdown's median is untouched by them.
    assert {k["issuer"] for k in a.comm.by_kind} >= {"fsdp", "checkpoint"}


def _assert_fsdp2(run: RunDir, width: int = 256, blocks: int = 4) -> None:
    _assert_steps_and_forward(run)
    num_params = blocks * (2 * width + width * 4 * width + 4 * width + 4 * width * width + width) + width * 8 + 8
    for rank in (0, 1):
        comm = [c for c in read_jsonl(run.rank_file(rank, "comm")) if c["step"] >= WARMUP]
        assert {c["issuer"] for c in comm} == {"fsdp"}
        # Called from FSDP2's own collectives module (not the script): where FSDP's advice applies.
        assert all(c["origin"].startswith("torch.distributed.fsdp._fully_shard.") for c in comm), \
            {c["origin"] for c in comm}
        assert all(c["clock"] == "host" and c["backend"] == "gloo" and c["group_ranks"] == [0, 1] for c in comm)
        measured = range(WARMUP, WARMUP + STEPS)
        rs = _per_step_bytes(comm, collective="reduce_scatter_tensor")
        ag = _per_step_bytes(comm, collective="all_gather_into_tensor")
        # Every gradient is reduce-scattered once per step (fp32, no padding at these widths); parameters
        # are gathered in forward and again (resharded blocks) in backward.
        assert all(rs[s] == 4 * num_params for s in measured), rs
        assert all(4 * num_params <= ag[s] <= 2 * 4 * num_params for s in measured), ag
        # What the optimizer steps: the sharded parameters, counted whole (the strategy advice's model size).
        trained = json.loads(run.rank_file(rank, "meta").read_text())["trained"]
        assert trained == {"num_params": num_params, "param_bytes": 4 * num_params, "sharded": True,
                           "optimizer": "AdamW"}
    a = analyze_run(run.path)
    assert a.comm is not None and a.comm.num_collectives_per_step >= 10
    assert a.breakdown.phases_s["exposed_comm"] > 0
    # The communication split by who issued which op: the reduce-scatters carry every gradient once.
    kinds = {(k["issuer"], k["op"]): k for k in a.comm.by_kind}
    assert set(kinds) == {("fsdp", "all_gather_into_tensor"), ("fsdp", "reduce_scatter_tensor")}
    assert kinds[("fsdp", "reduce_scatter_tensor")]["bytes"] == 4 * num_params
    assert sum(k["count"] for k in kinds.values()) == a.comm.num_collectives_per_step
    # The strategy advice knows the model and that the script shards it (no DDP, no parallelize call).
    assert [r["name"] for r in a.advice if r["current"]] == ["fsdp full shard"]
    _assert_self_check(run)


def test_fsdp1_wrapped_by_the_script_is_measured_and_advised_in_its_own_terms(tmp_path):
    width, blocks = 256, 4
    run = _profile(tmp_path, "fsdp1", "stack_fsdp2.py", "--fsdp1", extra=WINDOW)
    _assert_steps_and_forward(run)
    num_params = blocks * (2 * width + width * 4 * width + 4 * width + 4 * width * width + width) + width * 8 + 8
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert {c["issuer"] for c in comm} == {"fsdp"}
        assert all(c["origin"].startswith("torch.distributed.fsdp._") for c in comm)
        # Every gradient reduce-scattered once per step (a flat parameter per unit, padded to the world size).
        rs = _per_step_bytes(comm, collective="reduce_scatter_tensor")
        assert all(4 * num_params <= rs[s] <= 4 * num_params + 4 * 2 * (blocks + 1) for s in range(WARMUP + STEPS)), rs
        # The optimizer steps this rank's shards of the flat parameters: counted whole, as sharded.
        trained = json.loads(run.rank_file(rank, "meta").read_text())["trained"]
        assert (trained["num_params"], trained["sharded"]) == (num_params, True)
    a = analyze_run(run.path)
    assert [r["name"] for r in a.advice if r["current"]] == ["fsdp full shard"]
    # FSDP1's own arguments, not FSDP2's API.
    recs = [r for r in a.recommendations if r.category == "communication"]
    assert recs and "backward_prefetch=BackwardPrefetch.BACKWARD_PRE" in recs[0].rationale
    assert "set_modules_to_forward_prefetch" not in recs[0].rationale
    _assert_self_check(run)


def test_tensor_parallel_collectives_through_functional_collectives_are_seen_and_waited_for(tmp_path):
    # DTensor's redistributions call torch.distributed._functional_collectives (c10d's ops, not the
    # torch.distributed functions): before they were wrapped the always-on side saw no communication and
    # the self-check read -38 pp; the trace had counted their wait_tensor as compute.
    width, blocks, batch = 256, 3, 32
    run = _profile(tmp_path, "tp", "stack_tensor_parallel.py", extra=LONG_WINDOW, steps=LONG_STEPS)
    _assert_steps_and_forward(run, LONG_STEPS)
    for rank in (0, 1):
        # (the parameters' scatter and broadcast when parallelize_module distributes them come first: set-up)
        comm = [c for c in read_jsonl(run.rank_file(rank, "comm")) if c["step"] >= WARMUP]
        assert {(c["issuer"], c["collective"], c["async_op"]) for c in comm} == {("dtensor", "all_reduce", True)}
        assert all(c["origin"].startswith("torch.distributed.tensor.") for c in comm)
        assert all(0 < c["issue_s"] <= c["blocked_s"] for c in comm) and any(c["blocked_s"] > c["issue_s"] for c in comm)
        # Each block's row-wise output (batch x width, fp32) is all-reduced in forward.
        forward = _per_step_bytes(comm)
        assert all(forward[s] >= blocks * batch * width * 4 for s in range(WARMUP, WARMUP + LONG_STEPS)), forward
    a = analyze_run(run.path)
    assert a.breakdown.phases_s["exposed_comm"] > 0
    recs = [r for r in a.recommendations if r.category == "communication"]
    assert recs and recs[0].title == "Take tensor parallelism's collectives off the critical path"
    # Measured 2026-11-28 with 6 traced steps: compute -3.7 to -4.3, comm and exposed comm +3.1 to +3.9 alone,
    # compute -5.1 once inside the full suite. Most of it was the functional collectives' own operators
    # around c10d's (their output's clone, the async result's wrapping: ~0.25 ms per call), which the
    # always-on side times as the issuing call and the trace had counted as compute; with those counted as
    # communication and 12 traced steps, six runs read compute -0.8 to -1.2, comm +1.6 to +2.1, exposed
    # comm +0.4 to +1.0 pp.
    _assert_self_check(run)


def test_compiled_fsdp2_blocks_trace_the_same_graphs_with_and_without_the_profiler(tmp_path):
    import subprocess
    import sys

    # Each block compiled before it is sharded (`Module.compile`: FSDP2's hooks run inside Dynamo's
    # frame), the probes on the root outside it.
    args = ["--compile", "--steps", str(STEPS + WARMUP)]
    bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "stack_fsdp2.py"), *args], capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0 or "fsdp2 done" in bare.stdout, bare.stdout[-2000:] + bare.stderr[-3000:]
    without = _dynamo_line(bare.stdout)
    run = _profile(tmp_path, "compiled-fsdp2", "stack_fsdp2.py", *args, extra=WINDOW)
    with_profiler = _dynamo_line(run.logs.joinpath("rank00000.log").read_text())
    assert without["unique_graphs"] > 0 and without["frames_ok"] > 0  # Dynamo did capture the blocks
    for key in ("unique_graphs", "graph_breaks", "recompiles", "calls_captured", "frames_ok", "frames_total"):
        assert with_profiler[key] == without[key], (key, with_profiler, without)
    assert with_profiler["torsh_warnings"] == [] and with_profiler["graph_break_reasons"] == without["graph_break_reasons"]
    assert json.loads(run.rank_file(0, "meta").read_text())["probed_modules"] == ["FSDPSequential"]
    _assert_fsdp2(run)


def test_hand_written_all_reduce_is_seen_and_diagnosed_as_communication(tmp_path):
    width = 1024
    run = _profile(tmp_path, "allreduce", "stack_allreduce.py", "--width", str(width), extra=WINDOW)
    _assert_steps_and_forward(run)
    grad_bytes = 4 * (64 * width + width + width * width + width + width * 4 + 4)
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert {c["issuer"] for c in comm} == {"user"} and {c["collective"] for c in comm} == {"all_reduce"}
        assert {c["origin"] for c in comm} == {"stack_allreduce.py:<module>"}  # the script's own top level
        per_step = _per_step_bytes(comm)
        assert all(per_step[s] == grad_bytes for s in range(WARMUP + STEPS)), per_step
        # Synchronous gloo calls: the training thread waits for all of each one.
        assert all(c["blocked_s"] == pytest.approx(c["duration_s"]) for c in comm)
        trained = json.loads(run.rank_file(rank, "meta").read_text())["trained"]
        assert (trained["num_params"], trained["param_bytes"], trained["sharded"]) == (grad_bytes // 4, grad_bytes, False)
    a = analyze_run(run.path)
    categories = [b.category for b in a.bottlenecks]
    assert categories and categories[0] == "communication", categories
    assert a.breakdown.phases_pct["exposed_comm"] > 30
    # DDP's knobs do not apply to a script without DDP: the recommendation says what does.
    recs = [r for r in a.recommendations if r.category == "communication"]
    assert recs and "DDP instead" in recs[0].title and not recs[0].config_patch
    comm = next(b for b in a.bottlenecks if b.category == "communication")
    assert list(comm.evidence["comm_s_by_kind"]) == ["user all_reduce"]
    assert "from 'user' code (stack_allreduce.py:<module>) and block the training thread (per step: user all_reduce " \
        in recs[0].rationale
    _assert_self_check(run)


def test_ddp_with_zero_redundancy_optimizer_is_one_step_and_its_broadcast_is_seen_and_advised(tmp_path):
    # torch's ZeRO-1: ZeroRedundancyOptimizer.step() steps its own AdamW over this rank's shard (a second,
    # nested optimizer step) and then broadcasts each updated parameter from its owner, waiting inside step().
    width = 256
    run = _profile(tmp_path, "zero", "stack_zero.py", "--width", str(width), extra=WINDOW)
    per_rank = _assert_steps_and_forward(run)
    param_bytes = 4 * (64 * width + width + 2 * (width * width + width) + width * 4 + 4)
    for rank, steps in zip((0, 1), per_rank):
        # The outer step is the phase and the step boundary; the nested AdamW step is part of it.
        assert all(0 < s["optimizer_s"] < s["step_s"] for s in steps if not s["warmup"])
        comm = read_jsonl(run.rank_file(rank, "comm"))
        broadcasts = [c for c in comm if c["collective"] == "broadcast"]
        assert {c["issuer"] for c in broadcasts} == {"zero"} and all(c["async_op"] for c in broadcasts)
        assert all(c["origin"].startswith("torch.distributed.optim.zero_redundancy_optimizer:") for c in broadcasts)
        # Every parameter once per step, from its owner: each rank takes part in all of them.
        per_step = _per_step_bytes(broadcasts)
        assert all(per_step[s] == param_bytes for s in range(WARMUP + STEPS)), per_step
        assert all(c["issuer"] == "ddp" and c["bytes"] == param_bytes for c in comm if c["collective"] == "all_reduce")
        trained = json.loads(run.rank_file(rank, "meta").read_text())["trained"]
        assert (trained["optimizer"], trained["wrapped_optimizer"], trained["param_bytes"]) == \
            ("ZeroRedundancyOptimizer", "AdamW", param_bytes)
    a = analyze_run(run.path)
    comm = next(b for b in a.bottlenecks if b.category == "communication")
    assert comm.evidence["zero_broadcast_bytes"] == param_bytes and comm.evidence["zero_broadcast_blocked_s"] > 0
    (rec,) = [r for r in a.recommendations if "ZeroRedundancyOptimizer" in r.title]
    assert "step a plain AdamW on every rank" in rec.rationale and "overlap_with_ddp=True" in rec.rationale
    assert rec.expected_gain.high_pct > 0 and not rec.config_patch
    # The gradient advice acts on DDP's all-reduce alone: its share leaves the broadcast's wait out.
    topk = [r for r in a.recommendations if r.title.startswith("Compress gradients")]
    assert all(r.expected_gain.high_pct <= comm.evidence["exposed_comm_pct"] - comm.evidence["zero_broadcast_pct"]
               + 0.01 for r in topk)
    # The trace sees the training thread blocked in the broadcasts' Work.wait() (annotated in the window), not
    # the enclosing optimizer step's compute: before that the shares differed by ~30 pp.
    _assert_self_check(run)


def _dynamo_line(text: str) -> dict:
    lines = [line for line in text.splitlines() if "DYNAMO {" in line]
    assert lines, text[-2000:]
    return json.loads(lines[-1].split("DYNAMO ", 1)[1])


def test_an_engine_overlapping_its_own_async_all_reduces_is_measured_and_advised_as_one(tmp_path):
    # DeepSpeed/Megatron style: gradient buckets all-reduced with async_op=True from post-accumulate-grad
    # hooks during backward, waited for before the optimizer step; no DDP.
    width, layers = 512, 6
    run = _profile(tmp_path, "engine", "stack_overlap_engine.py", extra=WINDOW)
    _assert_steps_and_forward(run)
    grad_bytes = 4 * (64 * width + width + layers * (width * width + width) + 10 * width + 10)
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert {c["issuer"] for c in comm} == {"user"} and all(c["async_op"] for c in comm)
        assert {c["origin"] for c in comm} == {"stack_overlap_engine.py:Engine._ready"}
        # Issued from post-accumulate-grad hooks: in the backward. A record that completed after its step was
        # accounted (a gloo callback running late on a busy host) has no phase.
        phases = [c.get("phase") for c in comm]
        assert set(phases) <= {"backward", None} and phases.count("backward") >= 0.9 * len(phases), phases
        per_step = _per_step_bytes(comm)
        assert all(per_step[s] == grad_bytes for s in range(WARMUP + STEPS)), per_step
        # The issuing call held the thread too; the wait before the optimizer step comes on top.
        assert all(0 < c["issue_s"] <= c["blocked_s"] for c in comm)
        assert any(c["blocked_s"] > c["issue_s"] for c in comm)
    a = analyze_run(run.path)
    (kind,) = a.comm.by_kind
    assert kind["async_share"] == 1.0 and 0 < kind["blocked_s"] < kind["time_s"]
    # Buckets in flight together are not summed twice: the kind's time is the communication's (both medians
    # over steps, of different sums: one run read 1.06x), not the 5.5x that summing their durations read.
    assert kind["time_s"] <= 1.25 * a.comm.comm_s and a.comm.overlap_pct > 0
    # Already asynchronous: not told to "average with DDP instead of blocking all-reduces".
    recs = [r for r in a.recommendations if r.category == "communication"]
    assert recs and recs[0].title in ("Put fewer bytes on the wire: the engine's collectives outlast the backward "
                                      "they overlap", "Shorten the tail of the engine's overlapped collectives")
    assert "issued with async_op=True during backward" in recs[0].rationale
    _assert_self_check(run)


def test_a_pipeline_schedule_applied_by_the_script_is_measured_and_advised_as_a_pipeline(tmp_path):
    # torch.distributed.pipelining's GPipe over two stages, one per rank: every micro-batch's activations
    # go forward and their gradients back through batch_isend_irecv (send/recv), no gradient is averaged.
    width, batch = 512, 64
    run = _profile(tmp_path, "pipeline", "stack_pipeline.py", "--width", str(width), "--batch-size", str(batch),
                   extra=LONG_WINDOW, steps=LONG_STEPS)
    _assert_steps_and_forward(run, LONG_STEPS)
    for rank, (sent, received) in ((0, ("send", "recv")), (1, ("recv", "send"))):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        # The first step's shape inference sends the stage outputs' metadata as objects; then only tensors.
        shapes = [c for c in comm if c["collective"].endswith("_object_list")]
        assert shapes and {(c["issuer"], c["step"]) for c in shapes} == {("pipeline", 0)}
        assert {(c["issuer"], c["collective"]) for c in comm if c not in shapes} == {("pipeline", "send"),
                                                                                     ("pipeline", "recv")}
        # Each step moves the whole batch's activations forward and its gradients back: batch x width fp32
        # (the first step also a few bytes of its shape inference).
        for op in (sent, received):
            per_step = _per_step_bytes(comm, collective=op)  # (the object lists are not counted here)
            assert all(per_step[s] == batch * width * 4 for s in range(1, LONG_STEPS + WARMUP)), (rank, op, per_step)
    # The advice is the subject here, not the grade: this pipeline's exposed communication is near the
    # default medium line (15 %) and one loaded full suite read it under (no finding, so no advice). A
    # lower line makes the finding certain whenever the stages wait on each other at all.
    a = analyze_run(run.path, thresholds=ThresholdsConfig(comm_high_pct=4.0))
    found = {b.category: b for b in a.bottlenecks}
    assert found["communication"].evidence["exposed_comm_pct"] > 2.0
    recs = {r.category: r for r in a.recommendations}
    # Not the gradient engine's "fewer bytes" (bf16 gradients, PowerSGD), nor a slow machine to replace.
    assert recs["communication"].title == "Shrink the pipeline's waits between stages"
    assert "ScheduleInterleaved1F1B" in recs["communication"].rationale
    assert "gradients in bf16" not in recs["communication"].rationale
    if "straggler" in recs:
        assert recs["straggler"].title.startswith("Balance the pipeline's stages")
    # Measured 2026-11-28, five runs: compute -0.9 to -1.5, comm -1.1 to -1.5, exposed comm -2.9 to -3.8 pp.
    # The exposed gap: a send in flight while the schedule's Python runs between micro-batches is exposed
    # for the trace (no operator overlaps it); the always-on side counts what the training thread waited.
    _assert_self_check(run)


@pytest.mark.timeout(600)
def test_torch_compile_of_ddp_traces_the_same_graphs_with_and_without_the_profiler(tmp_path):
    import subprocess
    import sys

    script = SCRIPTS / "stack_compile_ddp.py"
    bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), "--steps", str(STEPS + WARMUP)], capture_output=True, text=True, timeout=300)
    # torch 2.13 on gloo now and then aborts a rank at interpreter exit ("terminate called without an active
    # exception"; CI saw it once in this bare run): rank 0's counters, printed before it ended, are the run's.
    assert bare.returncode == 0 or "compile_ddp done" in bare.stdout, bare.stdout[-2000:] + bare.stderr[-3000:]
    without = _dynamo_line(bare.stdout)
    # DDP's buckets timed one by one (`--comm-hook-timing`: the reducer's window counts the gaps
    # between buckets and their copy back as communication; one default run read comm +7.3 pp against
    # the trace) and a trace window: neither changes Dynamo's graphs.
    run = _profile(tmp_path, "compiled", "stack_compile_ddp.py", "--steps", "1000",
                   extra=("--comm-hook-timing", *LONG_WINDOW), steps=LONG_STEPS)
    with_profiler = _dynamo_line(run.logs.joinpath("rank00000.log").read_text())
    assert without["unique_graphs"] > 0  # Dynamo did capture the model: the comparison means something
    for key in ("unique_graphs", "graph_breaks", "recompiles", "calls_captured"):
        assert with_profiler[key] == without[key], (key, with_profiler, without)
    assert with_profiler["torsh_warnings"] == [] and with_profiler["graph_break_reasons"] == without["graph_break_reasons"]
    # The compiled module is probed from outside the graph: forwards and samples are still measured.
    _assert_steps_and_forward(run, LONG_STEPS)
    meta = json.loads(run.rank_file(0, "meta").read_text())
    assert meta["probed_modules"] == ["OptimizedModule"]
    # Every optimizer step all-reduces the model's gradients, bucket by bucket (the DDPOptimizer's subgraphs).
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        ddp = _per_step_bytes(comm, collective="all_reduce", issuer="ddp")
        assert set(ddp) == set(range(LONG_STEPS + WARMUP)) and set(ddp.values()) == {meta["ddp"]["param_bytes"]}, ddp
        assert len({c["bucket"] for c in comm}) >= 3
        # Each bucket's issuing call held the training thread: it counts as exposed where it was issued
        # (the bound on a bucket's completion by its backward's end is tests/profiler/test_steps.py's).
        assert all(c["issue_s"] > 0 and c["blocked_s"] == c["issue_s"] for c in comm
                   if c["issuer"] == "ddp" and c["collective"] == "all_reduce")
    # Measured 2026-11-28, 2 ranks on 2 cores, largest |difference| of compute, comm and exposed comm with 6
    # traced steps in eleven runs: 4.0, 4.0, 5.2, 2.4, 1.9, 2.0, 1.2, 2.2, 2.9, 4.0, 4.8 pp (exposed comm
    # below the trace's). The issuing calls of the buckets (one took 4.4 ms on a busy host) counted as
    # compute, and a bucket's completion, recorded in its future's callback after gloo had woken the
    # training thread, landed past the backward. With both mended and 12 traced steps, ten runs: at most
    # 2.0, 1.9, 3.7, 0.7, 3.8, 3.0, 1.6, 2.1, 1.6, 2.8 pp (compute -0.5 to -3.7, exposed comm -0.4 to +3.0).
    # What is left is a core lost mid-step: a reducer copy of 20 us that takes 4.5 ms while the last
    # bucket runs (the trace counts it as compute, the always-on side as the tail's wait). CI then failed on
    # compute -5.3 (2026-12-07): every step read ~2 pp low (the probes' annotations in the trace's phases
    # only), and comm +0.5 to +4.2 (a bucket queued ~1 ms for its gloo worker: in flight for the records, not
    # for the trace). Both mended, and a bucket's issue stamped at the process group's call (docs/architecture.md),
    # eight runs: compute -1.0 to +1.4, comm -1.8 to +0.2, exposed comm -0.6 to +2.2 pp.
    _assert_self_check(run)


def test_a_compiled_optimizer_step_is_still_one_step_and_adds_no_graph_break(tmp_path):
    import subprocess
    import sys

    # PyTorch's recipe for a compiled optimizer: torch.compile of a function that calls opt.step(). Dynamo traces
    # the global step hooks into the step's graphs, so before the marker op no boundary came: no step record.
    script = SCRIPTS / "stack_compile_ddp.py"
    bare = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), "--steps", str(STEPS + WARMUP), "--compile-step"],
                          capture_output=True, text=True, timeout=300)
    assert bare.returncode == 0 or "compile_ddp done" in bare.stdout, bare.stdout[-2000:] + bare.stderr[-3000:]
    without = _dynamo_line(bare.stdout)
    # As for compiled DDP alone: its buckets timed one by one and 12 traced steps (a 6-step window with the
    # reducer's window read comm +5.9 pp once).
    run = _profile(tmp_path, "compiled-step", "stack_compile_ddp.py", "--steps", "1000", "--compile-step",
                   extra=("--comm-hook-timing", *LONG_WINDOW), steps=LONG_STEPS)
    with_profiler = _dynamo_line(run.logs.joinpath("rank00000.log").read_text())
    # torch's own optimizer step breaks the graph before and after its body (`_use_grad`): the hooks' marker
    # ops make those two fragments a graph each; nothing else changes.
    for key in ("graph_breaks", "recompiles", "frames_ok"):
        assert with_profiler[key] == without[key], (key, with_profiler, without)
    assert with_profiler["graph_break_reasons"] == without["graph_break_reasons"]
    assert with_profiler["unique_graphs"] == without["unique_graphs"] + 2
    assert with_profiler["calls_captured"] == without["calls_captured"] + 2
    assert with_profiler["torsh_warnings"] == []
    # The window started and stopped outside the marker ops: torch's profiler did not warn about them.
    assert all("torsh_tune::" not in run.logs.joinpath(f"rank0000{r}.log").read_text() for r in (0, 1))
    per_rank = _assert_steps_and_forward(run, LONG_STEPS)
    assert all(s["optimizer_s"] > 0 for steps in per_rank for s in steps if not s["warmup"])
    _assert_self_check(run)


def test_the_trainers_evaluation_passes_are_their_own_time_not_training_nor_a_spike(tmp_path):
    # The Trainer evaluates every 4 steps on 128 held-out samples (8 batches of 8 per rank), after the optimizer
    # step: in the step that follows. Its evaluation loop runs the unwrapped model (DDP's `module`), under
    # no_grad and in eval mode. Before evaluations were seen they were "other" of those steps and raised a
    # step-time spike each; the DDP wrapper's probe never saw the forwards. A trace window holds step 8's pass:
    # it is still counted (the window's steps are left out of the step statistics), and the trace agrees.
    pytest.importorskip("transformers")
    run = _profile(tmp_path, "hf_eval", "stack_hf_trainer.py", "--steps", "1000", "--eval-steps", "4",
                   "--eval-samples", "128", extra=("--trace-window", "7:4"), steps=16)
    per_rank = _assert_steps_and_forward(run, 16)
    expected = {s for s in range(16 + WARMUP) if s and s % 4 == 0}
    for steps in per_rank:
        evaluated = {s["step"]: s for s in steps if s.get("eval_s")}
        assert set(evaluated) == expected, sorted(evaluated)
        for s in evaluated.values():
            assert (s["eval_batches"], s["eval_samples"]) == (8, 64) and s["eval_s"] < s["step_s"]
            assert s["data_s"] + s["forward_s"] + s["eval_s"] <= s["step_s"]
        # The evaluation's batches are neither the step's samples nor its micro-batches.
        assert {(s["samples"], s["num_microbatches"]) for s in steps if not s["warmup"]} == {(8, 1)}
    a = analyze_run(run.path)
    (finding,) = [b for b in a.bottlenecks if "eval_pct" in b.evidence]
    ev = finding.evidence
    assert finding.category == "computation" and ev["eval_pct"] > 5
    assert (ev["passes"], ev["every_steps"], ev["batches_per_pass"], ev["samples_per_pass"]) == (
        len([s for s in expected if s >= WARMUP]), 4, 8, 64)
    (rec,) = [r for r in a.recommendations if r.title == "Evaluate less often, or on fewer batches"]
    assert "per_device_eval_batch_size" in rec.rationale and rec.expected_gain.high_pct == pytest.approx(ev["eval_pct"])
    assert not [al for al in a.alerts if al.kind == "step_time_spike" and al.start_step in expected], a.alerts
    assert a.steps.traced_steps == 5  # the window's four and its warm-up step
    _assert_self_check(run)


@pytest.mark.parametrize("script", ["stack_hf_trainer.py", "stack_accelerate.py", "stack_lightning.py"])
def test_trainer_loops_measure_steps_forward_and_their_ddp_all_reduce(tmp_path, script):
    pytest.importorskip({"stack_hf_trainer.py": "transformers", "stack_accelerate.py": "accelerate",
                         "stack_lightning.py": "lightning"}[script])
    run = _profile(tmp_path, script.removesuffix(".py"), script, "--steps", "1000", extra=LONG_WINDOW,
                   steps=LONG_STEPS)
    _assert_steps_and_forward(run, LONG_STEPS)
    meta = json.loads(run.rank_file(0, "meta").read_text())
    grad_bytes, buffer_bytes = meta["ddp"]["param_bytes"], meta["ddp"]["buffer_bytes"]
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        ddp = _per_step_bytes(comm, collective="all_reduce", issuer="ddp")
        # One gradient all-reduce per optimizer step (accelerate accumulates 2 micro-batches under no_sync);
        # DDP reports a step's timers at the next forward, so the last step has none.
        assert set(ddp) == set(range(LONG_STEPS + WARMUP - 1)) and set(ddp.values()) == {grad_bytes}, ddp
        # DDP's broadcast of its buffers before every forward (a C++ binding, not a c10d function): the
        # BERT model's position and token type ids (the other two models have no buffers).
        broadcasts = _per_step_bytes(comm, collective="broadcast", issuer="ddp")
        expected = {s: buffer_bytes for s in range(LONG_STEPS + WARMUP)} if buffer_bytes else {}
        assert broadcasts == expected, broadcasts
        if script == "stack_hf_trainer.py":
            # The Trainer's own collective before every step: accelerate's gather of the batch's token count,
            # named by accelerate's function and by the Trainer method that called it.
            gathers = [c for c in comm if c.get("issuer") == "accelerate" and c["collective"] == "all_gather"]
            callers = {c["origin"].split(" via ")[-1] for c in gathers}
            assert callers == {"transformers.trainer:Trainer._get_num_items_in_batch"}, callers
            assert {c["step"] for c in gathers} == set(range(LONG_STEPS + WARMUP))
        if script == "stack_lightning.py":
            # Lightning's own collective before every batch, named by the function that calls it: its SIGTERM flag.
            flags = [c for c in comm if c.get("issuer") == "lightning" and c["collective"] == "broadcast"]
            assert {(c["origin"], c["bytes"]) for c in flags} == {
                (f"{LIGHTNING_SIGTERM} via stack_lightning.py:<module>", 8)}
            assert {c["step"] for c in flags} == set(range(LONG_STEPS + WARMUP))
    assert (buffer_bytes > 0) == (script == "stack_hf_trainer.py"), buffer_bytes
    # Whose settings reach DDP's arguments (the recommendations say where to change them).
    assert meta["ddp"]["built_by"] == {"stack_hf_trainer.py": "transformers", "stack_accelerate.py": "accelerate",
                                       "stack_lightning.py": "lightning"}[script]
    if buffer_bytes:  # ids the forward only reads: no normalization layer's running statistics among them
        assert meta["ddp"]["running_stats_bytes"] == 0 and \
            {b["name"].rsplit(".", 1)[-1] for b in meta["ddp"]["largest_buffers"]} <= {"position_ids", "token_type_ids"}
    # Phases are disjoint (Lightning runs forward and backward inside optimizer.step(closure)): in every step
    # record the phases fit inside the step, nothing is counted twice. (Medians over steps of each phase
    # need not add up to 100 %: CI once saw 107 % from disjoint phases, so the check is per record.)
    phases = phase_frame(pd.read_parquet(run.path / "steps.parquet"))
    inside = phases[["data", "forward", "backward_compute", "exposed_comm", "optimizer"]].sum(axis=1)
    excess = inside - phases["step_s"]
    assert (excess <= 1e-6 + 1e-3 * phases["step_s"]).all(), phases[excess > 0]
    a = analyze_run(run.path)
    assert a.breakdown.phases_pct["forward"] > 0
    if script == "stack_lightning.py":
        kinds = {(k["issuer"], k["op"]): k for k in a.comm.by_kind}
        assert kinds[("lightning", "broadcast")]["count"] == 1 and kinds[("ddp", "all_reduce")]["count"] == 1
        assert kinds[("lightning", "broadcast")]["origins"] == [f"{LIGHTNING_SIGTERM} via stack_lightning.py:<module>"]
        if any(b.category == "communication" for b in a.bottlenecks):  # the finding its advice belongs to
            assert any(r.title == "Make Lightning's per-batch SIGTERM broadcast rarer" for r in a.recommendations)
    # DDP's builtin all-reduce, one bucket in these models: its reducer window agrees with the trace. Before
    # DDP's broadcast of BERT's buffers was captured, the Trainer read compute +7.5, comm -6.6 pp. Lightning
    # read compute +4.5 ... +20 and exposed comm -3.9 ... -19 pp until its single bucket's launch, stalled for
    # ms on 2 cores, stopped counting as compute (DDP's timers) and the trace found the training thread's
    # wait for it in the reducer's finalize (a span bounded by the first copy); then three runs read at most
    # 1.9 pp. Twelve traced steps: with 6, one CI run of the whole suite read Lightning's comm at +5.4 pp (its
    # comm is 35-75 % of a 5-8 ms step, so a few ms of one lost core move the share); alone it reads +0.8 ... +2.0.
    _assert_self_check(run)
