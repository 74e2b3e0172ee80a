"""API mode (`torsh_tune.parallelize` / `train_step`): alone, under bare torchrun, and under torsh-tune.

Real processes on gloo: the bare-torchrun checks run `tests/data/scripts/api_accumulate.py`;
the torsh-tune checks run the shipped `examples/api_strategies.py` through the real CLI with
every strategy kind that runs on 2 ranks, and the impossible combinations.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from torsh_tune.rundir import RunDir

from helpers import EXAMPLES, SCRIPTS, read_jsonl, run_cli, torchrun_bootstrap

ACCUMULATE = SCRIPTS / "api_accumulate.py"
EXAMPLE = EXAMPLES / "api_strategies.py"
_NO_LAUNCHER = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def test_alone_without_a_launcher_trains_in_one_process(tmp_path):
    out = tmp_path / "alone"
    proc = subprocess.run([sys.executable, str(ACCUMULATE), str(out)], capture_output=True, text=True, timeout=120,
                          env=_NO_LAUNCHER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "alone.rank0.json").read_text())
    assert res["world"] == 1 and res["kind"] == "Sequential" and res["same_optimizer"]
    assert _close(res["acc2"], res["big"])
    assert res["lrs"] == pytest.approx([0.05, 0.1, 0.1, 0.1])  # warm-up ramp, no scaling at world size 1


def test_bare_torchrun_ddp_accumulation_equals_the_doubled_batch_and_lr_scales(tmp_path):
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ACCUMULATE), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"ddp.rank{r}.json").read_text()) for r in (0, 1))
    assert r0["kind"] == "DistributedDataParallel" and r0["same_optimizer"]
    assert r0["acc2"] == r1["acc2"] and r0["big"] == r1["big"]  # replicas identical
    # no_sync over two micro-batches, gradients scaled by 1/2 == one step on both micro-batches at once
    assert _close(r0["acc2"], r0["big"])
    # linear scaling by the world size (2), ramped over 2 warm-up steps
    assert r0["lrs"] == pytest.approx([0.1, 0.2, 0.2, 0.2])


def _profile(tmp_path, name: str, toml: str, *script_args: str, steps: int = 6):
    cfg = tmp_path / f"{name}.toml"
    cfg.write_text(toml)
    return run_cli("profile", "--nproc-per-node", "2", "--steps", str(steps), "--warmup-steps", "2", "--quiet",
                   "--config", str(cfg), "--runs-dir", str(tmp_path / "runs"), "--run-name", name,
                   str(EXAMPLE), "--steps", "100", "--width", "64", "--depth", "4", *script_args, timeout=300)


def _meta(tmp_path, name: str, rank: int) -> dict:
    return json.loads(RunDir(tmp_path / "runs" / name).rank_file(rank, "meta").read_text())


@pytest.mark.slow
def test_profile_runs_fsdp_through_the_api_and_records_the_strategy(tmp_path):
    proc = _profile(tmp_path, "fsdp", '[strategy]\nkind = "fsdp"\n[fsdp]\nreshard_after_forward = false\n')
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        meta = _meta(tmp_path, "fsdp", rank)
        facts = meta["strategy"]
        assert facts["kind"] == "fsdp" and facts["api"] is True
        assert facts["fsdp"]["reshard_after_forward"] is False
        assert len(facts["fsdp"]["units"]) >= 4  # every block its own unit, plus the root
        steps = read_jsonl(RunDir(tmp_path / "runs" / "fsdp").rank_file(rank, "steps"))
        assert len(steps) == 8 and all(s["forward_s"] > 0 and s["samples"] == 64 for s in steps)
        assert not meta["notes"]


@pytest.mark.slow
def test_profile_runs_a_pipeline_and_reports_its_bubble(tmp_path):
    toml = '[strategy]\nkind = "pipeline"\n[pipeline]\nschedule = "gpipe"\nn_microbatches = 2\nsplit_points = ["blocks.2"]\n'
    proc = _profile(tmp_path, "pipe", toml)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        pipe = _meta(tmp_path, "pipe", rank)["pipeline"]
        assert pipe["stages"] == 2 and pipe["microbatches"] == 2
        assert 0.0 <= pipe["bubble_pct"] <= 100.0
        assert pipe["theoretical_bubble_pct"] == pytest.approx(100 / 3)
    report = json.loads((tmp_path / "runs" / "pipe" / "report" / "report.json").read_text())
    found = [b for b in report["bottlenecks"] if b["category"] == "pipeline_bubble"]
    assert found and set(found[0]["evidence"]["stage_bubble_pct"]) == {"0", "1"}


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('[strategy]\nkind = "pipeline"\n[pipeline]\nsplit_points = ["blocks.1", "blocks.2"]\n',
         "pipeline.split_points must be 1 names (2 ranks x 1 stages per rank = 2 stages)"),
        ('[strategy]\nkind = "hsdp"\n[fsdp]\nreplicate_degree = 3\n', "fsdp.replicate_degree must be a divisor of the world size 2"),
        ('[strategy]\nkind = "fsdp"\n[compression]\nmethod = "topk"\n', "compression.method must be 'none' with strategy kind 'fsdp'"),
        ('[strategy]\nkind = "pipeline"\n[pipeline]\nschedule = "interleaved1f1b"\n', "pipeline.stages_per_rank must be >= 2"),
        ('[collectives]\nhierarchical = true\n[compression]\nmethod = "fp16"\n', "collectives.hierarchical must be false"),
        ('[collectives]\nnccl_proto = "fast"\n', "collectives.nccl_proto must be"),
    ],
)
def test_impossible_combinations_are_one_line_errors_before_launch(tmp_path, toml, message):
    proc = _profile(tmp_path, "bad", toml)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "runs" / "bad").exists()


def test_pipeline_without_split_points_fails_in_the_ranks_with_one_line(tmp_path):
    proc = _profile(tmp_path, "nosplit", '[strategy]\nkind = "pipeline"\n')
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "pipeline.split_points must be at least one module name" in proc.stderr.strip().splitlines()[-1]


def test_cpu_offload_on_cpu_is_refused_in_the_ranks(tmp_path):
    proc = _profile(tmp_path, "offload", '[strategy]\nkind = "fsdp"\n[fsdp]\ncpu_offload = true\n')
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "fsdp.cpu_offload" in proc.stderr.strip().splitlines()[-1]


def _losses(stdout: str) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in stdout.splitlines() if " loss " in line]


@pytest.mark.slow
def test_fsdp_and_pipeline_under_bare_torchrun_follow_the_single_process_losses(tmp_path):
    """One script: alone, FSDP over 2 ranks (2 replicas), 2-stage 1F1B pipeline (1 replica).

    FSDP on 2 replicas matches DDP's losses; the pipeline (one replica fed rank 0's data)
    matches the single process fed the same data, to print precision.
    """
    args = ["--steps", "11", "--width", "64"]
    alone = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120,
                           env=_NO_LAUNCHER)
    assert alone.returncode == 0, alone.stderr[-2000:]
    runs = {}
    for name, toml in (("ddp", '[strategy]\nkind = "ddp"\n'), ("fsdp", '[strategy]\nkind = "fsdp"\n'),
                       ("pp", '[strategy]\nkind = "pipeline"\n[pipeline]\nschedule = "1f1b"\nn_microbatches = 4\n'
                              'split_points = ["blocks.2"]\n')):
        (tmp_path / f"{name}.toml").write_text(toml)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(EXAMPLE),
               *args, "--config", str(tmp_path / f"{name}.toml")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = _losses(proc.stdout)
    assert len(runs["pp"]) == 2 and runs["pp"] == pytest.approx(_losses(alone.stdout), abs=2e-4)
    assert runs["fsdp"] == pytest.approx(runs["ddp"], abs=2e-4)


def test_count_tokens_checks_its_argument_and_does_nothing_outside_torsh_tune():
    import torch

    import torsh_tune
    from torsh_tune.errors import ConfigError

    torsh_tune.count_tokens(128)  # the script run alone: no runtime, nothing to count into
    torsh_tune.count_tokens(torch.tensor(7))  # e.g. attention_mask.sum()
    for bad in (-1, 2.5, True, torch.tensor(1.5), "12"):
        with pytest.raises(ConfigError, match=r"count_tokens\(n\)"):
            torsh_tune.count_tokens(bad)


_RELEASE_SCRIPT = """
import gc, json, sys, weakref
import torch, torch.nn as nn, torch.distributed as dist
import torsh_tune as tt
from torsh_tune.config import RunConfig
from torsh_tune.errors import ConfigError

torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(4)))
opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                         {"params": [p for m in model[1:] for p in m.parameters()]}], lr=0.01, weight_decay=0.1)
originals = [weakref.ref(p) for p in model.parameters()]
res = {}
try:  # refused before sharding: the optimizer handed in must come back intact
    tt.parallelize(model, opt, config=RunConfig().apply_patch({"strategy": {"kind": "fsdp"}, "fsdp": {"cpu_offload": True}}).strategy)
except ConfigError:
    res["after_error"] = [len(g["params"]) for g in opt.param_groups]
model, new_opt = tt.parallelize(model, opt, config=RunConfig().apply_patch({"strategy": {"kind": "fsdp"}}).strategy)
gc.collect()
res["alive"] = sum(r() is not None for r in originals)
res["old_groups"] = [len(g["params"]) for g in opt.param_groups]
res["new_groups"] = [(len(g["params"]), g["lr"], g["weight_decay"]) for g in new_opt.param_groups]
res["type"] = type(new_opt).__name__
res["loss"] = float(tt.train_step(model, new_opt, (torch.randn(8, 32), torch.randn(8, 32)), nn.functional.mse_loss))
json.dump(res, open(sys.argv[1] + f".rank{dist.get_rank()}.json", "w"))
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp_lets_go_of_the_unsharded_parameters_and_keeps_the_param_groups(tmp_path):
    # FSDP2 frees each unit's unsharded parameters only if nothing else holds them; the
    # optimizer handed in held all of them, so the whole model stayed in memory (on the GPU).
    script = tmp_path / "release.py"
    script.write_text(_RELEASE_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
           str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        res = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert res["after_error"] == [2, 6]
        assert res["alive"] == 0 and res["old_groups"] == [0, 0]
        assert res["type"] == "AdamW" and res["new_groups"] == [[2, 0.1, 0.1], [6, 0.01, 0.1]]
        assert math.isfinite(res["loss"])


# -- CUDA: placement by strategy and the setup's memory peak (skipped without a GPU) ------------
_GPU_SCRIPT = '''
import json, sys
import torch, torch.nn as nn
import torsh_tune as tt
from torsh_tune.config import RunConfig

scenario, out = sys.argv[1], sys.argv[2]
torch.cuda.set_device(0)
torch.manual_seed(0)
model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8)))  # 8 FSDP units of 16 MiB
model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
if scenario == "offload":
    config = RunConfig().apply_patch({"strategy": {"kind": "fsdp"}, "fsdp": {"cpu_offload": True}}).strategy
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model, opt = tt.parallelize(model, opt, config=config)
    setup_peak = torch.cuda.max_memory_allocated() - base
else:  # under torsh-tune: 1 GiB freed before parallelize must not be the steps' peak
    junk = torch.empty(1 << 28, device="cuda")
    del junk
    model, opt = tt.parallelize(model, opt)
    setup_peak = None
places = sorted({(p.to_local() if hasattr(p, "to_local") else p).device.type for p in model.parameters()})
x, y = torch.randn(64, 2048), torch.randn(64, 2048)
losses = [float(tt.train_step(model, opt, (x, y), nn.functional.mse_loss)) for _ in range(3)]
json.dump({"model_bytes": model_bytes, "setup_peak": setup_peak, "places": places, "losses": losses}, open(out, "w"))
'''


def _gpu_script(tmp_path):
    script = tmp_path / "gpu_placement.py"
    script.write_text(_GPU_SCRIPT)
    return script


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA and NCCL")
def test_fsdp_cpu_offload_never_holds_the_whole_model_on_the_gpu(tmp_path):
    out = tmp_path / "offload.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(_gpu_script(tmp_path)),
           "offload", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["places"] == ["cpu"]  # the shards live on the CPU
    # Sharded one unit at a time (a unit and its padded shard at most), not moved whole first.
    assert res["setup_peak"] < res["model_bytes"] / 2, res
    assert all(math.isfinite(v) for v in res["losses"])


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA and NCCL")
def test_the_steps_peak_memory_is_the_training_peak_and_the_setup_peak_is_recorded(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun_bootstrap(run_dir, _gpu_script(tmp_path), "ddp", str(tmp_path / "ddp.json"), nproc=1, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(RunDir(run_dir).rank_file(0, "meta").read_text())
    assert meta["strategy"]["setup_peak_mem_bytes"] >= 1 << 30
    steps = read_jsonl(RunDir(run_dir).rank_file(0, "steps"))
    assert steps and all(0 < s["peak_mem_bytes"] < 1 << 30 for s in steps), [s["peak_mem_bytes"] for s in steps]
