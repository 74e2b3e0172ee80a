"""Strategy sections of RunConfig: TOML round trip, validation in one place, torchrun's environment."""

from __future__ import annotations

import pytest

from torsh_tune.config import (
    CollectivesConfig,
    DistEnv,
    FSDPConfig,
    PipelineConfig,
    RunConfig,
    StrategyConfig,
    TrainingConfig,
    dist_env,
    dump_toml,
    help_of,
)
from torsh_tune.errors import ConfigError
from torsh_tune.launch.command import build_run_env
from torsh_tune.rundir import RunDir

TOML = """
[strategy]
kind = "hsdp"

[distributed]
timeout_s = 120
omp_num_threads = 2

[ddp]
bucket_cap_mb_list = [1, 25.5]

[fsdp]
reshard_after_forward = 2
mixed_precision = "bf16"
reduce_dtype = "fp32"
wrap = ["blocks.*"]
replicate_degree = 2

[pipeline]
schedule = "interleaved1f1b"
n_microbatches = 8
split_points = ["blocks.2", "blocks.4", "blocks.6"]
stages_per_rank = 2

[collectives]
nccl_algo = "allreduce:tree;allgather:ring"
nccl_proto = "^LL128"
nccl_max_nchannels = 8

[training]
gradient_accumulation_steps = 4
max_grad_norm = 1.0
lr_scaling = "sqrt"
lr_warmup_steps = 100

[launch]
nproc_per_node = 4
"""


def test_every_section_loads_round_trips_and_has_help():
    cfg = RunConfig.from_toml(TOML).check_layout()
    st = cfg.strategy
    assert st.kind == "hsdp" and st.fsdp.reshard_after_forward == 2 and st.fsdp.wrap == ["blocks.*"]
    assert st.ddp.bucket_cap_mb_list == [1.0, 25.5] and st.pipeline.stages_per_rank == 2
    assert st.training.lr_scaling == "sqrt" and st.distributed.timeout_s == 120.0
    assert RunConfig.from_toml(dump_toml(cfg)) == cfg
    assert RunConfig.from_json(cfg.to_json()) == cfg
    for cls in (FSDPConfig, PipelineConfig, CollectivesConfig, TrainingConfig, StrategyConfig):
        for name in cls.__dataclass_fields__:
            assert help_of(cls, name), f"{cls.__name__}.{name} has no help"


def test_reshard_after_forward_takes_bools_and_ints():
    for value in (True, False, 2):
        cfg = RunConfig.from_dict({"strategy": {"kind": "fsdp", "fsdp": {"reshard_after_forward": value}},
                                   "launch": {"nproc_per_node": 2}}).check_layout()
        assert cfg.strategy.fsdp.reshard_after_forward is value or cfg.strategy.fsdp.reshard_after_forward == value
        assert type(cfg.strategy.fsdp.reshard_after_forward) is type(value)


def test_collective_env_goes_to_every_rank(tmp_path):
    cfg = RunConfig.from_toml(TOML)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    env = build_run_env(cfg, run, run_id="x", base={"PATH": "/bin"})
    assert env["NCCL_ALGO"] == "allreduce:tree;allgather:ring" and env["NCCL_PROTO"] == "^LL128"
    assert env["NCCL_MAX_NCHANNELS"] == "8" and env["OMP_NUM_THREADS"] == "2"
    assert "NCCL_MIN_NCHANNELS" not in build_run_env(RunConfig(), run, run_id="x", base={})


@pytest.mark.parametrize(
    ("data", "what"),
    [
        ({"strategy": {"kind": "zero3"}}, "strategy.kind"),
        ({"strategy": {"fsdp": {"reshard_after_forward": 0}}}, "fsdp.reshard_after_forward"),
        ({"strategy": {"fsdp": {"mixed_precision": "fp8"}}}, "strategy.fsdp.mixed_precision"),
        ({"strategy": {"pipeline": {"schedule": "zbv", "stages_per_rank": 1}}}, "pipeline.stages_per_rank"),
        ({"strategy": {"pipeline": {"n_microbatches": 0}}}, "pipeline.n_microbatches"),
        ({"strategy": {"pipeline": {"split_points": ["a", "a"]}}}, "pipeline.split_points"),
        ({"strategy": {"ddp": {"bucket_cap_mb_list": []}}}, "ddp.bucket_cap_mb_list"),
        ({"strategy": {"ddp": {"bucket_cap_mb_list": [1], "first_bucket_cap_mb": 1}}}, "ddp.first_bucket_cap_mb"),
        ({"strategy": {"compression": {"method": "adaptive", "ratio": 0.01, "min_ratio": 0.1}}}, "compression.min_ratio"),
        ({"strategy": {"compression": {"method": "adaptive", "ratio": 0.5}}}, "compression.max_ratio"),
        ({"strategy": {"collectives": {"nccl_algo": "Ring,Warp"}}}, "collectives.nccl_algo"),
        ({"strategy": {"collectives": {"nccl_algo": "allsum:ring"}}}, "collectives.nccl_algo"),
        ({"strategy": {"collectives": {"nccl_min_nchannels": 8, "nccl_max_nchannels": 4}}}, "collectives.nccl_min_nchannels"),
        ({"strategy": {"training": {"gradient_accumulation_steps": 0}}}, "training.gradient_accumulation_steps"),
        ({"strategy": {"kind": "pipeline", "training": {"gradient_accumulation_steps": 2}}},
         "training.gradient_accumulation_steps"),
        ({"strategy": {"distributed": {"timeout_s": 0}}}, "distributed.timeout_s"),
        ({"strategy": {"kind": "ddp", "collectives": {"hierarchical": True}, "compression": {"method": "int8"}}},
         "collectives.hierarchical"),
        ({"strategy": {"kind": "pipeline", "collectives": {"hierarchical": True}}}, "collectives.hierarchical"),
        ({"strategy": {"training": {"bogus": 1}}}, "config key strategy.training.bogus"),
    ],
)
def test_invalid_strategies_are_one_line_errors(data, what):
    with pytest.raises(ConfigError) as exc:
        RunConfig.from_dict(data)
    message = str(exc.value)
    assert message.startswith(f"{what} must be ") and ", but got " in message and "\n" not in message


@pytest.mark.parametrize(
    ("data", "what"),
    [
        ({"strategy": {"kind": "hsdp", "fsdp": {"replicate_degree": 3}}, "launch": {"nproc_per_node": 4}},
         "fsdp.replicate_degree"),
        ({"strategy": {"kind": "hsdp", "fsdp": {"replicate_degree": 2, "reshard_after_forward": 3}},
          "launch": {"nproc_per_node": 4}}, "fsdp.reshard_after_forward"),
        ({"strategy": {"kind": "fsdp", "fsdp": {"replicate_degree": 2}}, "launch": {"nproc_per_node": 4}},
         "fsdp.replicate_degree"),
        ({"strategy": {"kind": "pipeline", "pipeline": {"split_points": ["a"]}}, "launch": {"nproc_per_node": 4}},
         "pipeline.split_points"),
        ({"strategy": {"collectives": {"hierarchical": True, "ranks_per_node": 3}}, "launch": {"nproc_per_node": 4}},
         "collectives.ranks_per_node"),
    ],
)
def test_layout_checks_need_the_world_size(data, what):
    cfg = RunConfig.from_dict(data)  # a file alone may still get other [launch] flags
    with pytest.raises(ConfigError) as exc:
        cfg.check_layout()
    assert str(exc.value).startswith(f"{what} must be ")


@pytest.mark.parametrize("nnodes", [2, 3])
def test_hsdp_replicas_default_to_the_number_of_nodes(nnodes):
    # 6 ranks: nnodes replicas leave shard groups of 6 / nnodes ranks, which the
    # reshard_after_forward check (a divisor of the shard group size) reveals.
    def config(reshard: int) -> RunConfig:
        return RunConfig.from_dict({
            "strategy": {"kind": "hsdp", "fsdp": {"reshard_after_forward": reshard}},
            "launch": {"nproc_per_node": 6 // nnodes, "nnodes": nnodes, "rdzv_endpoint": "h:1"},
        })

    shard = 6 // nnodes
    config(shard).check_layout()
    with pytest.raises(ConfigError, match=f"a divisor of the shard group size {shard}, but got 6"):
        config(6).check_layout()


def test_dist_env_reads_torchrun_variables():
    assert dist_env({}) is None
    env = dist_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
                    "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.local_rank, env.world_size, env.nnodes, env.node_rank) == (5, 1, 8, 2, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    assert dist_env({"RANK": "0", "WORLD_SIZE": "1"}).local_world_size == 1


@pytest.mark.parametrize(
    ("env", "what"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "environment variable RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "environment variable RANK"),
        ({"RANK": "0"}, "environment variable WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "environment variable LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "environment variable MASTER_PORT"),
    ],
)
def test_dist_env_rejects_bad_values(env, what):
    with pytest.raises(ConfigError, match=f"^{what} must be "):
        dist_env(env)


def test_dist_env_takes_the_node_from_group_rank():
    # Nodes of 2 and 4 ranks: rank 2 is the second node's first, which rank // LOCAL_WORLD_SIZE cannot tell.
    uneven = {"RANK": "2", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    assert dist_env(uneven | {"GROUP_RANK": "1"}).node_rank == 1
    assert dist_env(uneven).node_rank == dist_env(uneven | {"GROUP_RANK": ""}).node_rank == 0
    env = dist_env({"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})
    assert (env.local_rank, env.node_rank, env.master_addr, env.master_port) == (2, 1, None, None)


@pytest.mark.parametrize(("world", "local_world", "nnodes"), [(8, 4, 2), (8, 8, 1), (8, 1, 8), (1, 1, 1), (12, 4, 3)])
def test_dist_env_nnodes_is_world_size_over_ranks_per_node(world, local_world, nnodes):
    env = dist_env({"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local_world)})
    assert env.nnodes == nnodes


def test_dist_env_of_a_group_started_without_a_launcher_is_one_node():
    env = DistEnv.one_node(rank=2, world_size=3)
    assert env == DistEnv(rank=2, local_rank=2, world_size=3, local_world_size=3, node_rank=0, master_addr=None,
                          master_port=None)
    assert env.nnodes == 1


def test_dist_env_with_ranks_per_node_regroups_consecutive_ranks():
    env = dist_env({"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})  # one node of 8
    assert env.nnodes == 1
    nodes = env.with_ranks_per_node(2)
    assert nodes == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=2, node_rank=2, master_addr="h",
                            master_port=29500)
    assert nodes.nnodes == 4
    assert env.with_ranks_per_node(None) is env and env.with_ranks_per_node(0) is env


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GROUP_RANK": "x"}, "environment variable GROUP_RANK must be an integer >= 0, but got 'x'"),
        ({"GROUP_RANK": "-1"}, "environment variable GROUP_RANK must be an integer >= 0, but got -1"),
        ({"GROUP_RANK": "1.5"}, "environment variable GROUP_RANK must be an integer >= 0, but got '1.5'"),
        ({"LOCAL_WORLD_SIZE": "0"}, "environment variable LOCAL_WORLD_SIZE must be an integer >= 1, but got 0"),
        ({"WORLD_SIZE": "0"}, "environment variable WORLD_SIZE must be an integer >= 1, but got 0"),
        ({"RANK": "-1"}, "environment variable RANK must be an integer >= 0, but got -1"),
        ({"LOCAL_RANK": "-1"}, "environment variable LOCAL_RANK must be an integer >= 0, but got -1"),
        ({"MASTER_PORT": "0"}, "environment variable MASTER_PORT must be an integer >= 1, but got 0"),
        ({"MASTER_PORT": "http"}, "environment variable MASTER_PORT must be an integer >= 1, but got 'http'"),
        ({"RANK": None}, "environment variable RANK must be set when RANK or WORLD_SIZE is, but got None"),
    ],
)
def test_dist_env_rejects_each_bad_variable_in_one_line(env, message):
    base = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    variables = {k: v for k, v in (base | env).items() if v is not None}
    with pytest.raises(ConfigError) as exc:
        dist_env(variables)
    assert str(exc.value) == message


def test_dist_env_rejects_more_ranks_per_node_than_in_the_job():
    with pytest.raises(ConfigError, match="^environment variable LOCAL_WORLD_SIZE must be "):
        dist_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "4"})


@pytest.mark.parametrize("value", [0, -1, 2.5, True, "4"])
def test_ddp_timers_every_is_a_positive_integer(value):
    with pytest.raises(ConfigError, match=r"^profiler.ddp_timers_every must be an integer"):
        RunConfig.from_dict({"profiler": {"ddp_timers_every": value}}).validate()
    assert RunConfig.from_dict({"profiler": {"ddp_timers_every": 1}}).validate().profiler.ddp_timers_every == 1
