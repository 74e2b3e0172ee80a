"""The strategy advisor's rules at their boundaries, its memory formulas, and its patches (pure)."""

from __future__ import annotations

import json

import pytest

from torsh_tune.config import RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.strategies.advisor import (
    Candidate,
    advice_table,
    advise,
    estimate_memory_bytes,
    training_bytes_per_param,
)

GB = 10**9
B = 10**9  # a billion parameters


def _kinds(cands: list[Candidate]) -> list[str]:
    return [c.config_patch["strategy"]["kind"] for c in cands]


def _names(cands: list[Candidate]) -> list[str]:
    return [c.name for c in cands]


def _launch(world_size: int, nnodes: int) -> RunConfig:
    launch = {"nnodes": nnodes, "nproc_per_node": world_size // nnodes}
    if nnodes > 1:
        launch["rdzv_endpoint"] = "node0:29500"
    return RunConfig.from_dict({"launch": launch})


def _assert_patches_apply(cands: list[Candidate], world_size: int, nnodes: int) -> None:
    base = _launch(world_size, nnodes)
    for c in cands:
        config = base.apply_patch(c.config_patch)
        assert config.strategy.kind == c.config_patch["strategy"]["kind"]


# -- memory formulas ----------------------------------------------------------------------

def test_training_bytes_per_param():
    assert training_bytes_per_param(4) == 16  # 4 weights + 4 grads + 8 Adam
    assert training_bytes_per_param(2) == 16  # 2 + 2 + 8 Adam + 4 fp32 master weights
    assert training_bytes_per_param(4, 4) == 12  # SGD with momentum


def test_estimate_memory_bytes_formulas():
    p = int(1.3 * B)
    assert estimate_memory_bytes(p, "ddp", 8) == pytest.approx(20.8 * GB)
    assert estimate_memory_bytes(p, "fsdp", 8) == pytest.approx(2.6 * GB)
    # grad-op: weights stay whole (5.2 GB), gradients + Adam (15.6 GB) are sharded
    assert estimate_memory_bytes(p, "fsdp", 8, reshard_after_forward=False) == pytest.approx(5.2 * GB + 15.6 * GB / 8)
    assert estimate_memory_bytes(p, "hsdp", 16, shard_degree=8) == pytest.approx(2.6 * GB)
    assert estimate_memory_bytes(p, "pipeline", 4) == pytest.approx(5.2 * GB)
    assert estimate_memory_bytes(p, "fsdp", 8, pipeline_degree=2) == pytest.approx(1.3 * GB)  # 3-D
    assert estimate_memory_bytes(p, "fsdp", 8, param_bytes_per_param=2) == pytest.approx(2.6 * GB)
    with pytest.raises(ConfigError, match="kind must be one of"):
        estimate_memory_bytes(p, "zero", 8)


# -- the parallelism rules ----------------------------------------------------------------

def test_ddp_below_one_billion_fsdp_above():
    small = advise(num_params=int(0.9 * B), device_memory_bytes=80 * GB, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    large = advise(num_params=int(1.1 * B), device_memory_bytes=80 * GB, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    assert _kinds(small)[0] == "ddp"
    assert _kinds(large)[0] == "fsdp"
    assert "ddp" in _kinds(large)  # it still fits, so it stays on the list, ranked lower
    assert _kinds(large).index("ddp") > _kinds(large).index("fsdp")


def test_small_model_that_does_not_fit_goes_fsdp_with_the_numbers():
    cands = advise(num_params=int(0.9 * B), device_memory_bytes=8 * GB, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    assert "ddp" not in _kinds(cands)  # 14.4 GB of model state > 8 GB
    assert cands[0].name == "fsdp full shard"
    assert "900 M params × 16 B = 14.4 GB > 8 GB per GPU → FSDP full shard: 14.4 GB / 8 = 1.8 GB per rank" in cands[0].reasons


def test_reason_quotes_the_guides_example():
    cands = advise(num_params=int(1.3 * B), device_memory_bytes=16 * GB, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    full = next(c for c in cands if c.name == "fsdp full shard")
    assert "1.3 B params × 16 B = 20.8 GB > 16 GB per GPU → FSDP full shard: 20.8 GB / 8 = 2.6 GB per rank" in full.reasons
    # grad-op's 7.15 GB per rank leaves > 40 % of 16 GB for activations: it is tried first
    assert cands[0].name == "fsdp grad-op shard" and cands[0].config_patch["fsdp"] == {"reshard_after_forward": False}


def test_grad_op_shard_ranks_below_full_shard_when_memory_is_tight_or_unknown():
    tight = advise(num_params=int(1.3 * B), device_memory_bytes=10 * GB, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    unknown = advise(num_params=int(1.3 * B), device_memory_bytes=None, world_size=8, nnodes=1, link_gbps=None, gpus=True)
    for cands in (tight, unknown):
        names = _names(cands)
        assert names[0] == "fsdp full shard" and names.index("fsdp grad-op shard") > 0


@pytest.mark.parametrize("params, first_kind, pipeline_before_fsdp", [(9 * B, "hsdp", False), (11 * B, "hsdp", True)])
def test_beyond_ten_billion_adds_pipeline_3d(params, first_kind, pipeline_before_fsdp):
    cands = advise(num_params=params, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=200.0, gpus=True)
    kinds = _kinds(cands)
    assert kinds[0] == first_kind
    assert (kinds.index("pipeline") < kinds.index("fsdp")) is pipeline_before_fsdp
    _assert_patches_apply(cands, 16, 2)


@pytest.mark.parametrize("world, nnodes, three_d", [(32, 4, False), (64, 8, True)])
def test_beyond_32_ranks_adds_pipeline_3d(world, nnodes, three_d):
    cands = advise(num_params=5 * B, device_memory_bytes=80 * GB, world_size=world, nnodes=nnodes, link_gbps=200.0, gpus=True)
    kinds = _kinds(cands)
    assert kinds[0] == "hsdp"
    pipe = next(c for c in cands if c.name == "pipeline")
    assert any(r.startswith("3-D") for r in pipe.reasons) is three_d
    assert (kinds.index("pipeline") == 1) is three_d


def test_several_nodes_shard_within_the_node_and_replicate_across():
    cands = advise(num_params=3 * B, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=100.0, gpus=True)
    top = cands[0]
    assert top.config_patch["strategy"]["kind"] == "hsdp" and top.config_patch["fsdp"]["replicate_degree"] == 2
    assert top.memory_per_rank_bytes == pytest.approx(3 * B * 16 / 8)  # sharded over the 8 ranks of a node
    config = _launch(16, 2).apply_patch(top.config_patch)
    assert config.strategy.kind == "hsdp" and config.strategy.fsdp.replicate_degree == 2


def test_a_node_that_cannot_hold_the_model_sharded_gets_pipeline_across_nodes():
    # 70 B x 16 B = 1,120 GB; a node of 8 x 80 GB holds 640 GB: HSDP does not fit, 64 ranks (17.5 GB each) do
    cands = advise(num_params=70 * B, device_memory_bytes=80 * GB, world_size=64, nnodes=8, link_gbps=100.0, gpus=True)
    assert _kinds(cands)[0] == "pipeline"
    assert "hsdp" not in _kinds(cands) and "ddp" not in _kinds(cands)
    assert cands[0].memory_per_rank_bytes == pytest.approx(17.5 * GB)
    _assert_patches_apply(cands, 64, 8)


def test_nothing_fits_on_gpus_gives_cpu_offload():
    cands = advise(num_params=200 * B, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=200.0, gpus=True)
    assert cands[0].name == "fsdp full shard + cpu offload"
    assert cands[0].config_patch["fsdp"]["cpu_offload"] is True
    assert any("≥ 40 devices" in r for r in cands[0].reasons)  # 3,200 GB / 80 GB


def test_nothing_fits_on_cpu_returns_the_smallest_layout_flagged():
    cands = advise(num_params=200 * B, device_memory_bytes=64 * GB, world_size=4, nnodes=1, link_gbps=None, gpus=False)
    assert len(cands) == 1 and cands[0].fits is False
    assert any("does not fit" in r for r in cands[0].reasons)


def test_one_rank_is_ddp():
    cands = advise(num_params=2 * B, device_memory_bytes=80 * GB, world_size=1, nnodes=1, link_gbps=None, gpus=True)
    assert cands[0].name == "ddp" and "training" not in cands[0].config_patch


# -- communication ------------------------------------------------------------------------

@pytest.mark.parametrize("link, params, method", [
    (5.0, 300_000_000, "powersgd"),
    (5.0, 50_000_000, "fp16"),
    (10.0, 300_000_000, "fp16"),
    (24.0, 300_000_000, "fp16"),
    (25.0, 300_000_000, None),
    (100.0, 300_000_000, None),
    (None, 300_000_000, None),
])
def test_compression_by_link_speed_on_one_node(link, params, method):
    cands = advise(num_params=params, device_memory_bytes=80 * GB, world_size=8, nnodes=1, link_gbps=link, gpus=True)
    top = cands[0]
    assert top.config_patch["strategy"]["kind"] == "ddp"
    assert top.config_patch.get("compression", {}).get("method") == method
    _assert_patches_apply(cands, 8, 1)


def test_ring_all_reduce_time_is_quoted():
    cands = advise(num_params=300_000_000, device_memory_bytes=80 * GB, world_size=8, nnodes=1, link_gbps=10.0, gpus=True)
    # 2 x 7/8 x 1.2 GB = 2.1 GB at 10 Gbit/s = 1.68 s
    assert any("2.1 GB per rank per step: 1.68 s at 10 Gbit/s" in r for r in cands[0].reasons)


def test_several_nodes_on_a_slower_link_get_the_hierarchical_all_reduce():
    cands = advise(num_params=300_000_000, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=15.0, gpus=True)
    assert cands[0].name == "ddp + hierarchical all-reduce"
    assert cands[0].config_patch["collectives"] == {"hierarchical": True}
    assert "compression" not in cands[0].config_patch  # both are the DDP comm hook
    assert "ddp + fp16 compression" in _names(cands)  # the lossy alternative, ranked lower
    _assert_patches_apply(cands, 16, 2)


def test_very_slow_link_prefers_powersgd_over_hierarchical():
    cands = advise(num_params=300_000_000, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=5.0, gpus=True)
    assert cands[0].name == "ddp + powersgd compression"
    assert _names(cands).index("ddp + hierarchical all-reduce") > 0


def test_no_hierarchical_when_the_inter_node_link_is_as_fast():
    cands = advise(num_params=300_000_000, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=400.0,
                   intra_node_gbps=400.0, gpus=True)
    assert all("collectives" not in c.config_patch for c in cands)
    faster = advise(num_params=300_000_000, device_memory_bytes=80 * GB, world_size=16, nnodes=2, link_gbps=100.0,
                    intra_node_gbps=2400.0, gpus=True)
    assert faster[0].config_patch["collectives"] == {"hierarchical": True}


def test_fsdp_on_a_slow_link_reduces_in_bf16():
    cands = advise(num_params=3 * B, device_memory_bytes=80 * GB, world_size=8, nnodes=1, link_gbps=10.0, gpus=True)
    assert cands[0].config_patch["strategy"]["kind"] == "fsdp"
    assert cands[0].config_patch["fsdp"]["reduce_dtype"] == "bf16"
    _assert_patches_apply(cands, 8, 1)


# -- learning-rate scaling ----------------------------------------------------------------

@pytest.mark.parametrize("world, reference, scaling, warmup", [
    (2, 1, "linear", 100),
    (8, 1, "linear", 300),
    (16, 1, "sqrt", 400),
    (64, 8, "linear", 300),
    (8, 8, None, None),
])
def test_lr_scaling_follows_the_growth_of_the_global_batch(world, reference, scaling, warmup):
    cands = advise(num_params=100_000_000, device_memory_bytes=80 * GB, world_size=world, nnodes=1, link_gbps=None,
                   gpus=True, reference_world_size=reference)
    training = cands[0].config_patch.get("training")
    if scaling is None:
        assert training is None
    else:
        assert training == {"lr_scaling": scaling, "lr_warmup_steps": warmup}
    pipe = [c for c in cands if c.name == "pipeline"]
    assert all("training" not in c.config_patch for c in pipe)  # one pipeline keeps the global batch


# -- output -------------------------------------------------------------------------------

def test_ranked_best_first_and_table_is_json():
    cands = advise(num_params=int(1.3 * B), device_memory_bytes=16 * GB, world_size=8, nnodes=1, link_gbps=25.0, gpus=True)
    assert [c.rank for c in cands] == list(range(1, len(cands) + 1))
    assert [c.score for c in cands] == sorted((c.score for c in cands), reverse=True)
    rows = json.loads(json.dumps(advice_table(cands)))
    assert rows[0]["rank"] == 1 and rows[0]["kind"] == "fsdp" and rows[0]["reasons"]
    assert {"name", "score", "memory_per_rank_gb", "fits", "config_patch"} <= set(rows[0])


@pytest.mark.parametrize("kwargs, message", [
    ({"num_params": 0}, "num_params must be an integer >= 1"),
    ({"world_size": 10, "nnodes": 3}, "world_size must be a multiple of nnodes (3), but got 10"),
    ({"device_memory_bytes": 0}, "device_memory_bytes must be a number > 0"),
    ({"link_gbps": -1.0}, "link_gbps must be a number > 0"),
])
def test_bad_inputs_are_one_line_errors(kwargs, message):
    args = {"num_params": B, "device_memory_bytes": 80 * GB, "world_size": 8, "nnodes": 1, "link_gbps": None,
            "gpus": True} | kwargs
    with pytest.raises(ConfigError) as exc:
        advise(**args)
    assert message in str(exc.value) and "\n" not in str(exc.value)
