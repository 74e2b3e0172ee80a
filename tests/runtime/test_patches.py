"""The zero-code patches without torchrun: their pure helpers here, `install` in one fresh process that
trains a one-rank gloo DDP model through every way a step can end (two optimizers per iteration, a
step GradScaler skips, a closure optimizer, the step budget)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from torsh_tune.errors import ConfigError
from torsh_tune.rundir import RunDir
from torsh_tune.runtime.patches import _batch_size, _outermost_owners, _resolve_backend

from helpers import read_jsonl


@pytest.mark.parametrize(
    ("requested", "configured", "cuda", "backend"),
    [
        (None, "auto", False, "gloo"),
        ("", "auto", True, "nccl"),
        ("auto", "auto", False, "gloo"),
        ("gloo", "auto", True, "gloo"),
        ("nccl", "gloo", False, "gloo"),  # the run's backend wins over the script's
        ("cpu:gloo,cuda:nccl", "auto", True, "cpu:gloo,cuda:nccl"),
    ],
)
def test_the_backend_is_the_runs_then_the_scripts_then_the_devices(requested, configured, cuda, backend):
    assert _resolve_backend(requested, configured, cuda) == backend


@pytest.mark.parametrize(("requested", "configured"), [("nccl", "auto"), ("NCCL", "auto"), (None, "nccl")])
def test_nccl_without_cuda_is_one_config_error(requested, configured):
    with pytest.raises(ConfigError) as exc:
        _resolve_backend(requested, configured, False)
    value = requested if configured == "auto" else configured
    assert str(exc.value) == (f"process-group backend must be gloo when CUDA is not available (nccl needs a GPU), "
                              f"but got {value!r}")


@pytest.mark.parametrize(
    ("batch", "size"),
    [
        (torch.zeros(5, 3), 5),
        (torch.tensor(2.0), 1),
        ([torch.zeros(7, 2), torch.zeros(7)], 7),
        ({"input_ids": torch.zeros(3, 16, dtype=torch.long), "labels": torch.zeros(3)}, 3),
        ((({"x": torch.zeros(6)},),), 6),
        ([[[[[torch.zeros(9)]]]]], 0),  # deeper than anything a loader yields: not searched
        ([], 0),
        ("text", 0),
    ],
)
def test_a_batchs_size_is_the_first_dimension_of_its_first_tensor(batch, size):
    assert _batch_size(batch) == size


def test_the_probed_forward_is_the_outermost_module_holding_the_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    # A wrapper holds the model as a submodule (DDP as `module`, torch.compile's as `_orig_mod`): it is outermost.
    wrapper = torch.nn.ModuleDict({"_orig_mod": model})
    head = torch.nn.ModuleList([model[1]])  # shares a layer, inside nothing else
    params = {id(p) for p in model.parameters()}
    assert {id(m) for m in _outermost_owners(params)} == {id(wrapper), id(head)}
    assert [id(m) for m in _outermost_owners({id(model[0].weight)})] == [id(wrapper)]


# -- install, in a process of its own ----------------------------------------------------------
CONFIG = {
    "budget": {"warmup_steps": 1, "steps": 5},
    "profiler": {"loss_every": 1, "flush_interval_s": 60},
    "strategy": {"ddp": {"bucket_cap_mb": 1}, "distributed": {"timeout_s": 30}, "dataloader": {"pin_memory": False}},
}
BATCH = 4

SCENARIO = """
import json, sys
import torch, torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torsh_tune.config import DistEnv, RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.rundir import RunDir
from torsh_tune.runtime import patches
from torsh_tune.runtime.budget import StepBudgetReached
from torsh_tune.runtime.context import RankRuntime

run_dir, config, batch = sys.argv[1], RunConfig.from_json(sys.argv[2]), int(sys.argv[3])
rt = RankRuntime(config, RunDir(run_dir), env=DistEnv.one_node(rank=0, world_size=1))
patches.install(rt)
out = {}
dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1)  # no backend named
out["timeout_s"] = c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
torch.manual_seed(0)
gen = DistributedDataParallel(torch.nn.Linear(8, 8), bucket_cap_mb=25)
disc = torch.nn.Linear(8, 1)
opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
dataset = TensorDataset(torch.randn(10 * batch, 8))
try:
    DataLoader(dataset, batch, False, None, None, 0)
except ConfigError as exc:
    out["positional_error"] = str(exc)
batches = iter(DataLoader(dataset, batch_size=batch))
losses = []
for _ in range(2):  # a GAN: two optimizers per iteration, the first to step ends the step
    (x,) = next(batches)
    loss = gen(x).pow(2).mean()
    loss.backward()
    opt_g.step()
    opt_g.zero_grad()
    disc(x).mean().backward()
    opt_d.step()
    opt_d.zero_grad()
    losses.append(loss.item())
scaler = torch.amp.GradScaler("cpu")  # inf gradients: the scaler skips opt_g.step()
(x,) = next(batches)
loss = gen(x).pow(2).mean()
scaler.scale(loss).backward()
gen.module.weight.grad[0, 0] = float("inf")
before = gen.module.weight.detach().clone()
scaler.step(opt_g)
scaler.update()
opt_g.zero_grad()
out["scaler_skipped"] = torch.equal(before, gen.module.weight.detach())
losses.append(loss.item())
(x,) = next(batches)
def closure():  # forward and backward inside the optimizer step
    opt_g.zero_grad()
    loss = gen(x).pow(2).mean()
    loss.backward()
    return loss
losses.append(opt_g.step(closure).item())
try:
    for (x,) in batches:
        loss = gen(x).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt_g.step()
        opt_g.zero_grad()
except StepBudgetReached as exc:
    out["budget"] = str(exc)
out["losses"] = losses
rt.finish("budget")
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(what the script saw, the rank's steps, comm, meta and exit records)."""
    run = RunDir(tmp_path_factory.mktemp("patches") / "run")
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(run.path), json.dumps(CONFIG), str(BATCH)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    meta = json.loads(run.rank_file(0, "meta").read_text())
    exit_record = json.loads(run.rank_file(0, "exit").read_text())
    return out, read_jsonl(run.rank_file(0, "steps")), read_jsonl(run.rank_file(0, "comm")), meta, exit_record


STEPS = CONFIG["budget"]["warmup_steps"] + CONFIG["budget"]["steps"]
SCALER_STEP = 2  # the step whose optimizer.step() the GradScaler skipped


def test_every_iteration_is_one_step_however_it_ends(installed):
    out, steps, _, _, exit_record = installed
    assert out["scaler_skipped"] is True
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert [s["warmup"] for s in steps] == [True] + [False] * (STEPS - 1)
    assert len(out["losses"]) == STEPS
    # Each step's loss is its iteration's: the second optimizer, the skipped step and the closure did not shift them.
    assert [s["loss"] for i, s in enumerate(steps) if i != SCALER_STEP] == \
        [loss for i, loss in enumerate(out["losses"]) if i != SCALER_STEP]
    assert [(s["samples"], s["num_microbatches"]) for s in steps] == [(BATCH, 1)] * STEPS
    # The budget ended the script at its last step, every rank the same way.
    assert (exit_record["status"], exit_record["steps_done"]) == ("budget", STEPS)
    assert out["budget"] == f"step budget reached after {STEPS} steps"


def test_a_loss_scaled_by_gradscaler_is_recorded_unscaled(installed):
    out, steps, _, _, _ = installed
    assert steps[SCALER_STEP]["loss"] == out["losses"][SCALER_STEP]


def test_the_forward_is_probed_from_the_first_optimizer_step_on(installed):
    _, steps, _, meta, _ = installed
    assert meta["probed_modules"] == ["DistributedDataParallel"]  # the generator's: the first optimizer's parameters
    assert steps[0]["forward_s"] == 0.0 and all(s["forward_s"] > 0 for s in steps[1:])
    closure_step = steps[SCALER_STEP + 1]  # forward and backward ran inside optimizer.step(closure)
    assert closure_step["forward_s"] > 0 and closure_step["backward_s"] > 0


SKIPPED_FIRST = """
import json, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torsh_tune.config import DistEnv, RunConfig
from torsh_tune.rundir import RunDir
from torsh_tune.runtime import patches
from torsh_tune.runtime.context import RankRuntime

run_dir, config = sys.argv[1], RunConfig.from_json(sys.argv[2])
rt = RankRuntime(config, RunDir(run_dir), env=DistEnv.one_node(rank=0, world_size=1))
patches.install(rt)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu")
for i in range(4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    if i == 2:  # the inner module's evaluation hooks are gone after the training forward that followed its pass
        print(json.dumps({"hooks": len(model.module._forward_pre_hooks) + len(model.module._forward_hooks)}))
    scaler.scale(loss).backward()
    if i == 0:  # the scale is still calibrating: the first step's gradients overflow and it is skipped
        model.module.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    if i >= 1:  # an evaluation pass between steps (in steps 2 and 3): not a training forward
        model.eval()
        with torch.no_grad():
            model(torch.randn(16, 8))
        if i == 1:  # Lightning's way back to training: each module's mode assigned, no train() call
            for m in model.modules():
                m.training = True
        else:
            model.train()
rt.finish("ok")
dist.destroy_process_group()
"""


def test_a_first_step_gradscaler_skips_still_finds_the_forward_to_probe_and_evaluation_is_not_training(tmp_path):
    run = RunDir(tmp_path / "run")
    config = {"budget": {"warmup_steps": 0, "steps": 10}, "profiler": {"flush_interval_s": 60}}
    proc = subprocess.run([sys.executable, "-c", SKIPPED_FIRST, str(run.path), json.dumps(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run.rank_file(0, "steps"))
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and steps[0]["optimizer_s"] == 0.0  # skipped: no step()
    # The first optimizer.step() (step 1) found the module: the forwards after it are probed, with their batch;
    # the evaluation forwards of steps 2 and 3 (no grad, 16 samples) are neither their forward nor their samples.
    assert [(s["samples"], s["num_microbatches"], s["forward_s"] > 0) for s in steps[2:]] == [(4, 1, True)] * 2
    # ... it is the step's evaluation pass (the DDP model in eval mode, under no_grad).
    assert [(s.get("eval_batches"), s.get("eval_samples"), s.get("eval_s", 0) > 0) for s in steps] == [
        (None, None, False)] * 2 + [(1, 16, True)] * 2
    # A mode restored by assignment (Lightning's) left the hooks on every later training forward (~3 us each).
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"hooks": 0}
    assert json.loads(run.rank_file(0, "meta").read_text())["probed_modules"] == ["DistributedDataParallel"]


def test_init_process_group_gets_the_resolved_backend_and_the_runs_timeout(installed):
    out, _, _, meta, _ = installed
    assert (meta["backend"], meta["backend_requested"]) == ("gloo", None)
    assert meta["record_writer"] == "c"  # profiler/_lines.c, built by `make venv`
    assert out["timeout_s"] == CONFIG["strategy"]["distributed"]["timeout_s"]


def test_the_runs_ddp_knobs_replace_the_scripts_and_say_so(installed):
    _, _, _, meta, _ = installed
    (model,) = meta["ddp_models"]
    assert (model["bucket_cap_mb"], model["applied_from_config"]) == (1.0, {"bucket_cap_mb": 1.0})
    assert (model["param_bytes"], model["num_param_tensors"], model["comm_hook"]) == ((8 * 8 + 8) * 4, 2, "allreduce")
    assert "ddp.bucket_cap_mb: the script's 25 replaced by the run's 1.0" in meta["notes"]


def test_ddps_builtin_allreduce_is_one_record_per_step_from_its_timers(installed):
    _, steps, comm, meta, _ = installed
    param_bytes = meta["ddp_models"][0]["param_bytes"]
    # The last step's timers are never reported (DDP reports them at the next forward).
    assert [(c["step"], c["seq"]) for c in comm] == [(i, i) for i in range(STEPS - 1)]
    for c in comm:
        assert (c["collective"], c["hook"], c["issuer"], c["bytes"], c["grad_bytes"], c["num_tensors"], c["group"],
                c["backend"], c["clock"]) == ("all_reduce", "builtin", "ddp", param_bytes, param_bytes, 2, "world",
                                              "gloo", "host")
        assert steps[c["step"]]["comm_s"] == c["duration_s"]
    # ... and its record says its comm was not measured (0 there is unknown, not none); the others say nothing.
    assert [s.get("comm_timed", True) for s in steps] == [True] * (STEPS - 1) + [False]


def test_dataloaders_run_with_the_runs_overrides(installed):
    out, _, _, meta, _ = installed
    assert meta["dataloader_overrides"] == {"pin_memory": False}
    assert meta["dataloaders"] == [{"num_workers": 0, "prefetch_factor": None, "pin_memory": False,
                                   "persistent_workers": False}]
    assert out["positional_error"] == ("DataLoader arguments must be passed by keyword after batch_sampler when "
                                       "overrides apply, but got 'positional'")


LOADER_SCENARIO = """
import json, sys
import torch
from torch.utils.data import DataLoader, TensorDataset
from torsh_tune.config import DistEnv, RunConfig
from torsh_tune.rundir import RunDir
from torsh_tune.runtime import patches
from torsh_tune.runtime.budget import StepBudgetReached
from torsh_tune.runtime.context import RankRuntime

run_dir, config, workers, prefetch = sys.argv[1], RunConfig.from_json(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rt = RankRuntime(config, RunDir(run_dir), env=DistEnv.one_node(rank=0, world_size=1))
patches.install(rt)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
kwargs = {"num_workers": workers, "prefetch_factor": prefetch} if workers else {}
loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=4, **kwargs)
steps = 0
try:
    for (x,) in loader:
        model(x).mean().backward()
        opt.step()
        opt.zero_grad()
        steps += 1
except StepBudgetReached:
    pass
rt.finish("budget")
print(json.dumps({"steps": steps}))
"""


@pytest.mark.parametrize(("workers", "prefetch", "warmup"), [(2, 3, 6), (1, 1, 2), (0, 0, 2)])
def test_the_dataloaders_startup_stock_is_warm_up(tmp_path, workers, prefetch, warmup):
    """Steps that eat the batches workers filled before the loop never wait for data: they are warm-up."""
    run = RunDir(tmp_path / "run")
    config = {"budget": {"warmup_steps": 2, "steps": 3}, "profiler": {"flush_interval_s": 60}}
    proc = subprocess.run([sys.executable, "-c", LOADER_SCENARIO, str(run.path), json.dumps(config), str(workers),
                           str(prefetch)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_jsonl(run.rank_file(0, "steps"))
    meta = json.loads(run.rank_file(0, "meta").read_text())
    # The measured window keeps its 3 steps; the warm-up covers the stock when it is longer than the configured 2.
    assert [s["warmup"] for s in steps] == [True] * warmup + [False] * 3
    # The budget ended the last step inside its optimizer.step(): the script counted one fewer.
    assert json.loads(proc.stdout.splitlines()[-1]) == {"steps": warmup + 3 - 1}
    notes = [n for n in meta["notes"] if n.startswith("warm-up extended")]
    if warmup > 2:
        assert meta["warmup_steps"] == warmup and notes == [
            f"warm-up extended by {warmup - 2} step(s) to {warmup}: the DataLoader's {workers} worker(s) x "
            f"prefetch_factor {prefetch} = {workers * prefetch} batches were ready before the loop, so those steps "
            f"never waited for data"]
    else:
        assert "warmup_steps" not in meta and notes == []


TWO_MODELS = r"""
import json, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torsh_tune.config import DistEnv, RunConfig
from torsh_tune.rundir import RunDir
from torsh_tune.runtime import patches
from torsh_tune.runtime.budget import StepBudgetReached
from torsh_tune.runtime.context import RankRuntime

rt = RankRuntime(RunConfig.from_json(sys.argv[2]), RunDir(sys.argv[1]), env=DistEnv.one_node(rank=0, world_size=1))
patches.install(rt)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
torch.manual_seed(0)
gen = DistributedDataParallel(torch.nn.Linear(8, 8))
disc = DistributedDataParallel(torch.nn.Linear(8, 1))
opt_g = torch.optim.SGD(gen.parameters(), lr=0.01)
opt_d = torch.optim.SGD(disc.parameters(), lr=0.01)
try:
    while True:  # a GAN: the discriminator runs two forwards per iteration, the generator one
        x = torch.randn(4, 8)
        fake = gen(x)
        (disc(x).mean() - disc(fake.detach()).mean()).backward()
        opt_d.step()
        opt_d.zero_grad()
        disc.zero_grad()
        gen(x).pow(2).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
except StepBudgetReached:
    pass
rt.finish("budget")
dist.destroy_process_group()
"""


def test_two_ddp_models_have_their_timers_read_at_every_step(tmp_path):
    from torsh_tune.profiler.steps import DETAILED_STEPS

    run = RunDir(tmp_path / "run")
    steps = 2 + DETAILED_STEPS + 12  # past the detailed steps, where one model reads every k-th step
    config = {"budget": {"warmup_steps": 2, "steps": DETAILED_STEPS + 12}, "profiler": {"flush_interval_s": 60}}
    proc = subprocess.run([sys.executable, "-c", TWO_MODELS, str(run.path), json.dumps(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run.rank_file(0, "steps"))
    comm = read_jsonl(run.rank_file(0, "comm"))
    meta = json.loads(run.rank_file(0, "meta").read_text())
    assert [s["step"] for s in records] == list(range(steps))
    # Each model counts its own iterations (the discriminator two per step): a rate k > 1 would collect
    # them at different steps, and the second model's reads would find stale timers. Every step but the
    # last (its timers come at a forward that never runs) is timed, with one record per model.
    assert [s["step"] for s in records if s.get("comm_timed", True) is False] == [steps - 1]
    per_step = {}
    for c in comm:
        per_step[c["step"]] = per_step.get(c["step"], 0) + 1
    assert all(per_step.get(i) == 2 for i in range(1, steps - 1)), per_step
    assert any("two DDP models" in n for n in meta["notes"])


@pytest.mark.parametrize(("modules", "expected"), [
    (["__main__"], "user"),
    (["__main__", "transformers.trainer", "accelerate.accelerator"], "transformers"),
    (["__main__", "accelerate.accelerator"], "accelerate"),
    (["__main__", "lightning.pytorch.trainer.trainer", "lightning.pytorch.strategies.ddp"], "lightning"),
    (["__main__", "torsh_tune.runtime.api"], "torsh-tune"),
])
def test_who_builds_a_ddp_model_is_the_outermost_framework_on_the_stack(modules, expected):
    from torsh_tune.runtime.patches import _built_by

    # A chain of calls, outermost first, each function in its own module's globals; the innermost asks.
    fn = None
    for name in reversed(modules):
        scope = {"__name__": name, "_built_by": _built_by, "sys": sys, "inner": fn}
        exec("def f():\n    return inner() if inner is not None else _built_by(sys._getframe())", scope)  # noqa: S102
        fn = scope["f"]
    assert fn() == expected


def test_a_one_bucket_steps_all_reduce_is_all_exposed_on_the_host_clock():
    from torsh_tune.runtime.context import _ddp_exposed

    # DDP's timers (ns): the launch at 1.000 s stalled until 1.005 s, the compute end recorded after it (1.0051 s),
    # the all-reduce done at 1.006 s.
    data = {"backward_comm_time_start": 1_000_000_000, "backward_comm_time_end": 1_006_000_000,
            "backward_compute_time_end": 1_005_100_000}
    one = {**data, "num_buckets_reduced": 1}
    assert _ddp_exposed(one, 1.0, 1.006, 0.0, on_cuda=False) == pytest.approx(0.006)  # nothing computes under one bucket
    assert _ddp_exposed({**data, "num_buckets_reduced": 3}, 1.0, 1.006, 0.0, on_cuda=False) == pytest.approx(0.0009)
    assert _ddp_exposed(one, 1.0, 1.006, 0.0, on_cuda=True) == pytest.approx(0.0009)  # CUDA events: no host launch in them
    assert _ddp_exposed({"num_buckets_reduced": 2}, 1.0, 1.006, 0.0, on_cuda=False) == 0.0  # no compute end: unknown
    # The realtime clock 2 s ahead of ours: the record's times are on our clock, the compute end is moved onto it.
    many = {**data, "num_buckets_reduced": 3}
    assert _ddp_exposed(many, -1.0, -0.994, 2.0, on_cuda=False) == pytest.approx(0.0009)


# The checkpoint probes in a fresh process (they wrap torch.save process-wide): real torch.save, distributed
# checkpointing imported after the probes (its names bound by `from ... import`), safetensors, and a save on
# another thread; the rank's StepTracker is stood in for by one that keeps the save times.
_CHECKPOINT_SNIPPET = r"""
import io, json, tempfile, threading, types
import torch
from torsh_tune.runtime import patches

class Tracker:
    idle = False
    saves = []
    def on_checkpoint(self, t0, t1):
        self.saves.append(t1 - t0)

tracker = Tracker()
rt = types.SimpleNamespace(config=types.SimpleNamespace(profiler=types.SimpleNamespace(enabled=True)), tracker=tracker)
patches._patch_checkpoint_saves(rt)
seen = []
torch.save({"w": torch.ones(4)}, io.BytesIO())
seen.append(len(tracker.saves))
from torch.distributed.checkpoint import save
# Its writer calls torch.save once per tensor (3 here): one save all the same.
save({"a": torch.ones(64), "b": torch.ones(8), "c": torch.ones(3)}, checkpoint_id=tempfile.mkdtemp())
seen.append(len(tracker.saves))
from safetensors.torch import save_file
save_file({"w": torch.ones(4)}, tempfile.mkdtemp() + "/w.safetensors")
seen.append(len(tracker.saves))
t = threading.Thread(target=torch.save, args=({"w": torch.ones(4)}, io.BytesIO()))
t.start(); t.join()  # async_save's writer thread is not the step's
seen.append(len(tracker.saves))
print(json.dumps({"seen": seen, "positive": all(s > 0 for s in tracker.saves)}))
"""


def test_checkpoint_saves_are_timed_once_on_the_training_thread():
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHECKPOINT_SNIPPET], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"seen": [1, 2, 3, 3], "positive": True}
