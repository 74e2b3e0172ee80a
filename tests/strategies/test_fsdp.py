"""FSDP2 and HSDP (`torsh_tune.strategies.fsdp`) on real gloo process groups, and their input checks.

One 2-rank torchrun launch trains the same small block model once per FSDP variant (full
shard, grad-op shard, reshard ints, mixed precision, explicit wrap patterns); one 4-rank
launch trains it on a 2x2 HSDP mesh (replicate degree given, and derived from the node
size) and with a partial reshard to groups of 2 (`tests/data/scripts/strategy_fsdp.py`).
Every variant is compared with a single-process reference trained on the global batch.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.config import FSDPConfig
from torsh_tune.errors import ConfigError
from torsh_tune.strategies.fsdp import FSDPInfo, apply_fsdp, select_units

from helpers import SCRIPTS, torchrun_results

SCRIPT = SCRIPTS / "strategy_fsdp.py"
LAUNCH_TIMEOUT_S = 120
FSDP_VARIANTS = ("full", "grad_op", "reshard_1", "reshard_2", "bf16", "fp16_bf16_reduce", "bf16_reduce_only", "wrap",
                 "root_only")
FP32_VARIANTS = ("full", "grad_op", "reshard_1", "reshard_2", "wrap", "root_only")
HSDP_VARIANTS = ("hsdp", "hsdp_nodes", "reshard_2")
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
NUM_PARAMS = (8 * 32 + 32) + 3 * (32 * 32 + 32) + (32 + 1)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(2, 4)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(4, 1)


def _launch(tmp_path_factory, name: str, nproc: int, *args: str) -> list[dict]:
    return torchrun_results(SCRIPT, str(tmp_path_factory.mktemp(name) / "out"), nproc, *args, timeout=LAUNCH_TIMEOUT_S)


def _one_line_error(exc: pytest.ExceptionInfo, what: str, value: str) -> None:
    message = str(exc.value)
    assert message.startswith(f"{what} must be ") and message.endswith(f"but got {value}") and "\n" not in message


# -- units and input checks (fast, no processes) ----------------------------------------------
def test_auto_units_are_the_children_of_the_outermost_containers():
    assert select_units(_Model()) == ["blocks.0", "blocks.1"]
    assert select_units(nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))) == ["0", "2"]
    assert select_units(nn.Linear(2, 2)) == []
    nested = nn.Module()
    nested.stages = nn.ModuleList(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)) for _ in range(2))
    assert select_units(nested) == ["stages.0", "stages.1"]


def test_wrap_patterns_select_modules_children_first():
    model = _Model()
    assert select_units(model, ["blocks.*"]) == ["blocks.0.lin", "blocks.0", "blocks.1.lin", "blocks.1"]
    assert select_units(model, ["head", "blocks.1"]) == ["blocks.1", "head"]
    assert select_units(model, ["*.lin"]) == ["blocks.0.lin", "blocks.1.lin"]


def test_wrap_pattern_matching_no_module_with_parameters_is_a_one_line_error():
    with pytest.raises(ConfigError) as exc:
        select_units(_Model(), ["blocks.*", "blokcs.*"])
    _one_line_error(exc, "fsdp.wrap", "'blokcs.*'")
    with pytest.raises(ConfigError) as exc:
        select_units(_Model(), ["blocks.0.act"])  # matches, but owns no parameters
    _one_line_error(exc, "fsdp.wrap", "'blocks.0.act'")


@pytest.mark.parametrize(
    ("cfg", "kind", "world", "per_node", "what", "value"),
    [
        (FSDPConfig(cpu_offload=True), "fsdp", 2, 2, "fsdp.cpu_offload", "True"),
        (FSDPConfig(replicate_degree=3), "hsdp", 4, 2, "fsdp.replicate_degree", "3"),
        (FSDPConfig(replicate_degree=8), "hsdp", 4, 2, "fsdp.replicate_degree", "8"),
        (FSDPConfig(), "hsdp", 4, 3, "ranks_per_node", "3"),
        (FSDPConfig(replicate_degree=2), "fsdp", 4, 2, "fsdp.replicate_degree", "2"),
        (FSDPConfig(reshard_after_forward=3), "fsdp", 4, 4, "fsdp.reshard_after_forward", "3"),
        (FSDPConfig(reshard_after_forward=4), "hsdp", 4, 2, "fsdp.reshard_after_forward", "4"),
        (FSDPConfig(reshard_after_forward=0), "fsdp", 2, 2, "fsdp.reshard_after_forward", "0"),
        (FSDPConfig(wrap=["nothing"]), "fsdp", 2, 2, "fsdp.wrap", "'nothing'"),
        (FSDPConfig(), "ddp", 2, 2, "strategy.kind", "'ddp'"),
    ],
)
def test_bad_mesh_reshard_wrap_and_offload_fail_before_any_collective(cfg, kind, world, per_node, what, value):
    # No process group exists here: each check must run before apply_fsdp communicates.
    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as exc:
        apply_fsdp(_Model(), cfg, kind=kind, world_size=world, ranks_per_node=per_node, device=torch.device("cpu"))
    _one_line_error(exc, what, value)


def test_info_to_dict_is_json():
    info = FSDPInfo(kind="hsdp", mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"), replicate_degree=2,
                    shard_degree=2, shard_ranks=[0, 1], reshard_after_forward=True, units=["blocks.0"],
                    param_dtype="bf16", reduce_dtype="fp32", cpu_offload=False, num_params=10, local_param_bytes=20,
                    notes=[])
    d = json.loads(json.dumps(info.to_dict()))
    assert d["mesh_shape"] == [2, 2] and d["mesh_dim_names"] == ["replicate", "shard"] and d["units"] == ["blocks.0"]


# -- FSDP: every variant in one 2-rank process group -------------------------------------------
@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory, "fsdp", 2, "--variants", ",".join(FSDP_VARIANTS), "--steps", "20")


@pytest.fixture(scope="module")
def hsdp4(tmp_path_factory) -> list[dict]:
    return _launch(tmp_path_factory, "hsdp", 4, "--variants", ",".join(HSDP_VARIANTS), "--steps", "20",
                   "--ranks-per-node", "2")


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("variant", FSDP_VARIANTS)
def test_fsdp_replicas_identical_and_loss_decreases(fsdp2, variant):
    r0, r1 = (r[variant] for r in fsdp2)
    assert r0["checksum"] == r1["checksum"]
    assert r0["losses"] == r1["losses"]
    losses = r0["losses"]
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:]))


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("variant", FP32_VARIANTS)
def test_fsdp_fp32_matches_single_process_reference(fsdp2, variant):
    for result in fsdp2:
        r = result[variant]
        assert max(r["grad_diff"].values()) < 1e-5 and max(r["param_diff"].values()) < 1e-5
        assert len(r["grad_diff"]) == (4 if variant == "root_only" else 10)  # every parameter: inp, blocks, head
        assert abs(r["losses"][0] - r["ref_losses"][0]) < 1e-6
        assert r["final_param_diff"] < 1e-4


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize(("variant", "param_dtype", "reduce_dtype"),
                         [("bf16", "bf16", "fp32"), ("fp16_bf16_reduce", "fp16", "bf16"),
                          ("bf16_reduce_only", None, "bf16")])
def test_mixed_precision_matches_reference_within_its_precision(fsdp2, variant, param_dtype, reduce_dtype):
    for result in fsdp2:
        r = result[variant]
        assert (r["info"]["param_dtype"], r["info"]["reduce_dtype"]) == (param_dtype, reduce_dtype)
        grad = max(r["grad_diff"].values())
        assert 0 < grad < 2e-2 and max(r["param_diff"].values()) < 2e-2
        assert abs(r["losses"][-1] - r["ref_losses"][-1]) < 2e-2 * r["ref_losses"][-1]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize(("variant", "reshard", "units", "post_forward_numel"),
                         [("full", True, BLOCKS, 512), ("grad_op", False, BLOCKS, 1024),
                          ("reshard_1", False, BLOCKS, 1024), ("reshard_2", True, BLOCKS, 512),
                          ("wrap", True, ["blocks.1", "head"], 1024)])
def test_fsdp_info_units_and_resharding(fsdp2, variant, reshard, units, post_forward_numel):
    # post_forward_numel: blocks.0's registered weight (32x32) between forward and backward;
    # with "wrap" blocks.0 belongs to the root, which keeps its parameters for backward.
    total = 0
    for result in fsdp2:
        r = result[variant]
        info = r["info"]
        assert (info["kind"], info["mesh_shape"], info["mesh_dim_names"]) == ("fsdp", [2], ["shard"])
        assert (info["replicate_degree"], info["shard_degree"], info["shard_ranks"]) == (1, 2, [0, 1])
        assert info["reshard_after_forward"] is reshard and info["units"] == units
        assert info["param_dtype"] is None and info["reduce_dtype"] is None and info["cpu_offload"] is False
        assert info["num_params"] == NUM_PARAMS
        assert abs(info["local_param_bytes"] - 4 * NUM_PARAMS / 2) <= 0.02 * 4 * NUM_PARAMS
        total += info["local_param_bytes"]
        assert r["post_forward_numel"] == post_forward_numel
        assert len(r["full_keys"]) == 10 and r["param_devices"] == ["cpu"]
    assert total == 4 * NUM_PARAMS


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize(("variant", "note"), [
    ("full", None),
    ("reshard_1", "fsdp.reshard_after_forward=1 is the same as false with a shard group of 2 ranks"),
    ("reshard_2", "fsdp.reshard_after_forward=2 is the same as true with a shard group of 2 ranks"),
    ("root_only", "fsdp.reshard_after_forward has no effect: the model has no nn.ModuleList/nn.Sequential blocks"),
])
def test_equivalent_or_ineffective_options_leave_a_note(fsdp2, variant, note):
    for result in fsdp2:
        info = result[variant]["info"]
        assert info["notes"] == [] if note is None else (len(info["notes"]) == 1 and info["notes"][0].startswith(note))
    root_only = fsdp2[0]["root_only"]["info"]
    assert root_only["units"] == [] and root_only["num_params"] == (8 * 32 + 32) + (32 + 1)


# -- HSDP and partial reshard: one 4-rank process group -------------------------------------------
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("variant", HSDP_VARIANTS)
def test_hsdp_replicas_identical_match_reference_and_loss_decreases(hsdp4, variant):
    runs = [r[variant] for r in hsdp4]
    assert len({r["checksum"] for r in runs}) == 1
    assert all(r["losses"] == runs[0]["losses"] for r in runs)
    for r in runs:
        assert max(r["grad_diff"].values()) < 1e-5 and max(r["param_diff"].values()) < 1e-5
        assert r["final_param_diff"] < 1e-4
    losses = runs[0]["losses"]
    assert abs(losses[0] - runs[0]["ref_losses"][0]) < 1e-6 and losses[-1] < 0.8 * losses[0]


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
@pytest.mark.parametrize("variant", ["hsdp", "hsdp_nodes"])
def test_hsdp_mesh_is_replicate_by_node_local_shard(hsdp4, variant):
    for rank, result in enumerate(hsdp4):
        r = result[variant]
        info = r["info"]
        assert (info["kind"], info["mesh_shape"], info["mesh_dim_names"]) == ("hsdp", [2, 2], ["replicate", "shard"])
        assert (info["replicate_degree"], info["shard_degree"]) == (2, 2)
        assert info["shard_ranks"] == ([0, 1] if rank < 2 else [2, 3])  # contiguous ranks: one node
        assert info["units"] == BLOCKS and info["reshard_after_forward"] is True
        assert abs(info["local_param_bytes"] - 4 * NUM_PARAMS / 2) <= 0.02 * 4 * NUM_PARAMS
        assert r["post_forward_numel"] == 1024 // 2
    for group in ((0, 1), (2, 3)):
        assert sum(hsdp4[rank][variant]["info"]["local_param_bytes"] for rank in group) == 4 * NUM_PARAMS


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_partial_reshard_keeps_groups_of_two_after_forward(hsdp4):
    for result in hsdp4:
        r = result["reshard_2"]
        assert r["info"]["reshard_after_forward"] == 2 and r["info"]["shard_degree"] == 4
        assert abs(r["info"]["local_param_bytes"] - 4 * NUM_PARAMS / 4) <= 0.03 * 4 * NUM_PARAMS
        # Sharded over 4 ranks at rest (256 values of blocks.0's weight), over 2 after forward.
        assert r["post_forward_numel"] == 1024 // 2
    assert sum(r["reshard_2"]["info"]["local_param_bytes"] for r in hsdp4) == 4 * NUM_PARAMS


# -- GPU: NCCL and CPU offload -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_cpu_offload_on_nccl_keeps_shards_on_host_and_matches_reference(tmp_path_factory):
    nproc = min(2, torch.cuda.device_count())
    results = _launch(tmp_path_factory, "fsdp_gpu", nproc, "--variants", "full,cpu_offload", "--device", "cuda")
    for result in results:
        r = result["cpu_offload"]
        assert r["info"]["cpu_offload"] is True and r["param_devices"] == ["cpu"]
        assert result["full"]["param_devices"] == ["cuda"]
        assert max(r["grad_diff"].values()) < 1e-4 and r["losses"][-1] < 0.7 * r["losses"][0]
    assert len({r["cpu_offload"]["checksum"] for r in results}) == 1
