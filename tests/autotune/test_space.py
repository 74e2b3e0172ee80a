"""Search space: conditional dimensions, TOML narrowing, invalid spaces, configs built from trials."""

from __future__ import annotations

import optuna
import pytest

from torsh_tune.autotune import build_space, load_space_file, parse_space
from torsh_tune.config import RunConfig, dump_toml
from torsh_tune.errors import ConfigError

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _sample(space, n=40, seed=0):
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    out = []
    for _ in range(n):
        trial = study.ask()
        params = space.suggest(trial)
        study.tell(trial, 1.0)
        out.append((params, study.trials[-1].params))
    return out


def test_conditional_dimensions_follow_their_parents():
    space = build_space(nproc_per_node=2, cpu_count=16)
    samples = _sample(space)
    for params, asked in samples:
        assert asked == {k: v for k, v in params.items() if not space.dims[k].fixed}
        assert ("dataloader.prefetch_factor" in params) == (params["dataloader.num_workers"] > 0)
        assert ("dataloader.persistent_workers" in params) == (params["dataloader.num_workers"] > 0)
        assert ("compression.rank" in params) == (params["compression.method"] == "powersgd")
        assert ("compression.ratio" in params) == (params["compression.method"] in ("topk", "adaptive"))
        assert 1.0 <= params["ddp.bucket_cap_mb"] <= 200.0
        assert 0 <= params["dataloader.num_workers"] <= 8
        assert 1 <= params["omp_num_threads"] <= 8
        RunConfig().apply_patch(space.patch_of(params))  # every sample is a valid config
    # Both branches are actually reached.
    assert any(p["dataloader.num_workers"] > 0 for p, _ in samples)
    assert any(p["dataloader.num_workers"] == 0 for p, _ in samples)
    assert {p.get("dataloader.persistent_workers") for p, _ in samples} == {None, False, True}


def test_static_graph_only_without_gradient_accumulation_and_pin_memory_only_with_cuda():
    cpu = build_space(nproc_per_node=2, cpu_count=4, baseline_num_microbatches=1)
    assert "ddp.static_graph" in cpu.dims
    assert "dataloader.pin_memory" not in cpu.dims and "CUDA" in cpu.unavailable["dataloader.pin_memory"]
    accum = build_space(nproc_per_node=2, cpu_count=4, baseline_num_microbatches=4, cuda=True)
    assert "ddp.static_graph" not in accum.dims
    assert "187732" in accum.unavailable["ddp.static_graph"]
    assert "dataloader.pin_memory" in accum.dims
    for params, _ in _sample(accum, n=10):
        assert "ddp.static_graph" not in params
    with pytest.raises(ConfigError, match="space.ddp.static_graph must be omitted"):
        build_space(nproc_per_node=2, baseline_num_microbatches=2, spec={"ddp.static_graph": {"value": True}})


def test_broadcast_buffers_only_for_a_baseline_whose_buffers_are_not_running_statistics():
    table = {"buffer_bytes": 4096, "running_stats_bytes": 0}
    space = build_space(nproc_per_node=2, cpu_count=4, baseline_buffers=table)
    assert space.dims["ddp.broadcast_buffers"].choices == (True, False)
    assert space.baseline_params()["ddp.broadcast_buffers"] is True  # PyTorch's default, trial 0
    seen = {params["ddp.broadcast_buffers"] for params, _ in _sample(space)}
    assert seen == {True, False}
    base = RunConfig.from_dict({"launch": {"nproc_per_node": 2}})
    off = space.to_config(base, {**space.baseline_params(), "ddp.broadcast_buffers": False})
    assert off.strategy.ddp.broadcast_buffers is False
    for ddp, why in ((None, "unknown"), ({"buffer_bytes": 0, "running_stats_bytes": 0}, "broadcasts no buffers"),
                     ({"buffer_bytes": 4096, "running_stats_bytes": 24}, "running statistics")):
        space = build_space(nproc_per_node=2, cpu_count=4, baseline_buffers=ddp)
        assert "ddp.broadcast_buffers" not in space.dims and why in space.unavailable["ddp.broadcast_buffers"]
        assert all("ddp.broadcast_buffers" not in params for params, _ in _sample(space, n=5))


def test_cpu_bounds_and_single_point_ranges_become_fixed():
    space = build_space(nproc_per_node=2, cpu_count=2)
    assert space.dims["omp_num_threads"].fixed and space.dims["omp_num_threads"].value == 1
    # Workers are not bounded by the cores: a loader waiting on storage gains beyond them.
    assert space.dims["dataloader.num_workers"].high == 4
    assert build_space(nproc_per_node=1, cpu_count=64).dims["dataloader.num_workers"].high == 8
    params, asked = _sample(space, n=1)[0]
    assert params["omp_num_threads"] == 1 and "omp_num_threads" not in asked
    config = space.to_config(RunConfig(), params)
    assert config.launch.env["OMP_NUM_THREADS"] == "1"


def test_toml_space_narrows_widens_and_fixes(tmp_path):
    path = tmp_path / "space.toml"
    path.write_text(
        "[space.ddp.bucket_cap_mb]\nlow = 10\nhigh = 400\nlog = false\n"
        "[space.compression.method]\nchoices = ['none', 'fp16']\n"
        "[space.ddp.gradient_as_bucket_view]\nvalue = true\n"
        "[space.dataloader.num_workers]\nlow = 2\nhigh = 3\n"
    )
    spec = load_space_file(path)
    assert spec["ddp.bucket_cap_mb"] == {"low": 10, "high": 400, "log": False}
    space = build_space(nproc_per_node=1, cpu_count=8, spec=spec)
    b = space.dims["ddp.bucket_cap_mb"]
    assert (b.low, b.high, b.log) == (10, 400, False)
    for params, asked in _sample(space, n=30):
        assert 10 <= params["ddp.bucket_cap_mb"] <= 400
        assert params["compression.method"] in ("none", "fp16")
        assert params["ddp.gradient_as_bucket_view"] is True and "ddp.gradient_as_bucket_view" not in asked
        assert params["dataloader.num_workers"] in (2, 3) and "dataloader.prefetch_factor" in params
    # The defaults outside the narrowed range are not enqueued for trial 0.
    base = space.baseline_params()
    assert "ddp.bucket_cap_mb" in base and "dataloader.num_workers" not in base
    assert "ddp.gradient_as_bucket_view" not in base


def test_fixed_trial_builds_a_config_that_round_trips_through_toml():
    space = build_space(nproc_per_node=2, cpu_count=8)
    trial = optuna.trial.FixedTrial({
        "ddp.bucket_cap_mb": 50.0, "ddp.first_bucket_cap_mb": 2.0, "ddp.gradient_as_bucket_view": True,
        "ddp.static_graph": False, "dataloader.num_workers": 2, "dataloader.prefetch_factor": 4, "omp_num_threads": 2,
        "dataloader.persistent_workers": True,
        "compression.method": "powersgd", "compression.rank": 2, "compression.start_iter": 5,
    })
    params = space.suggest(trial)
    config = space.to_config(RunConfig(), params)
    assert config.strategy.ddp.bucket_cap_mb == 50.0 and config.strategy.ddp.first_bucket_cap_mb == 2.0
    assert config.strategy.dataloader.prefetch_factor == 4 and config.strategy.dataloader.persistent_workers is True
    assert config.strategy.compression.method == "powersgd" and config.strategy.compression.rank == 2
    assert config.launch.env == {"OMP_NUM_THREADS": "2"}
    assert RunConfig.from_toml(dump_toml(config)) == config


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"ddp.nope": {"value": 1}}, "space dimension must be one of"),
        ({"ddp.bucket_cap_mb": {"low": 50, "high": 10}}, "space.ddp.bucket_cap_mb.low must be <= high"),
        ({"ddp.bucket_cap_mb": {"low": 0}}, "space.ddp.bucket_cap_mb.low must be > 0"),
        ({"ddp.bucket_cap_mb": {"low": 1, "choices": [1, 2]}}, "must be one of: low/high/log, choices or value"),
        ({"ddp.bucket_cap_mb": {"lo": 1}}, "space.ddp.bucket_cap_mb.lo must be one of"),
        ({"dataloader.num_workers": {"high": 2.5}}, "num_workers.high must be an integer"),
        ({"dataloader.num_workers": {"low": -1}}, "num_workers.low must be >= 0"),
        ({"compression.method": {"choices": ["zip"]}}, "compression.method.choices must be one of"),
        ({"compression.method": {"choices": []}}, "must be a non-empty list"),
        ({"ddp.static_graph": {"low": 0}}, "choices = \\[...\\] or value"),
        ({"ddp.gradient_as_bucket_view": {"value": 1}}, "must be true or false"),
        ({"compression.ratio": {"high": 2.0}}, "compression.ratio.high must be <= 1.0"),
    ],
)
def test_invalid_spaces_are_one_line_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message) as info:
        build_space(nproc_per_node=2, cpu_count=8, spec=spec)
    assert "\n" not in str(info.value)


def test_space_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="--space must be an existing TOML file"):
        load_space_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[space\n")
    with pytest.raises(ConfigError, match="must be valid TOML"):
        load_space_file(bad)
    other = tmp_path / "other.toml"
    other.write_text("[ddp]\nbucket_cap_mb = 5\n")
    with pytest.raises(ConfigError, match=r"only a \[space\] table"):
        load_space_file(other)
    assert parse_space({"omp_num_threads": {"value": 2}}) == {"omp_num_threads": {"value": 2}}


# -- issue 4 dimensions: each conditional rule -------------------------------------------------

def _config(nproc=2, nnodes=1, **strategy):
    launch = {"nproc_per_node": nproc, "nnodes": nnodes}
    if nnodes > 1:
        launch["rdzv_endpoint"] = "head:29500"
    return RunConfig.from_dict({"launch": launch, "strategy": strategy}).check_layout()


def _fixed(space, **values):
    """A FixedTrial answering trial 0's values, with `values` (dotted names as `a__b`) on top."""
    return optuna.trial.FixedTrial({**space.baseline_params(), **{k.replace("__", "."): v for k, v in values.items()}})


def test_first_bucket_is_log_scaled_and_never_above_the_bucket_cap():
    space = build_space(nproc_per_node=2, cpu_count=8)
    dim = space.dims["ddp.first_bucket_cap_mb"]
    assert dim.log and dim.low > 0
    samples = _sample(space, n=60)
    for params, _ in samples:
        assert dim.low <= params["ddp.first_bucket_cap_mb"] <= params["ddp.bucket_cap_mb"]
        config = space.to_config(_config(), params)
        assert config.strategy.ddp.first_bucket_cap_mb <= config.strategy.ddp.bucket_cap_mb
    # Small bucket caps really bound it (the dynamic upper bound is used, not just the static one).
    small = [p for p, _ in samples if p["ddp.bucket_cap_mb"] < dim.high]
    assert small and all(p["ddp.first_bucket_cap_mb"] <= p["ddp.bucket_cap_mb"] for p in small)
    # A bucket cap below the first bucket's range: the first bucket is not asked at all.
    tiny = build_space(nproc_per_node=2, cpu_count=8, spec={"ddp.bucket_cap_mb": {"value": 0.1}})
    assert all("ddp.first_bucket_cap_mb" not in p for p, _ in _sample(tiny, n=5))
    # A fixed first bucket above the trial's cap is clipped to it.
    clipped = build_space(nproc_per_node=2, cpu_count=8, spec={"ddp.bucket_cap_mb": {"value": 4.0},
                                                               "ddp.first_bucket_cap_mb": {"value": 8.0}})
    assert clipped.suggest(_fixed(clipped))["ddp.first_bucket_cap_mb"] == 4.0
    # Trial 0 is PyTorch's 1 MiB first bucket under its 25 MiB cap.
    assert space.baseline_params()["ddp.first_bucket_cap_mb"] == 1.0


def test_first_bucket_and_bucket_cap_are_not_searched_over_a_bucket_cap_mb_list():
    base = _config(ddp={"bucket_cap_mb_list": [1.0, 10.0]})
    space = build_space(nproc_per_node=2, cpu_count=8, base=base)
    for name in ("ddp.first_bucket_cap_mb", "ddp.bucket_cap_mb"):
        assert name not in space.dims and "bucket_cap_mb_list" in space.unavailable[name]
    for params, _ in _sample(space, n=10):
        space.to_config(base, params)  # config forbids first_bucket_cap_mb with the list: never produced
    with pytest.raises(ConfigError, match="space.ddp.first_bucket_cap_mb must be omitted"):
        build_space(nproc_per_node=2, base=base, spec={"ddp.first_bucket_cap_mb": {"low": 0.5}})


def test_nccl_algorithm_and_protocol_only_with_cuda_and_auto_leaves_them_unset():
    cpu = build_space(nproc_per_node=2, cpu_count=8)
    for name in ("collectives.nccl_algo", "collectives.nccl_proto"):
        assert name not in cpu.dims and "CUDA" in cpu.unavailable[name]
    gpu = build_space(nproc_per_node=2, cpu_count=8, cuda=True)
    assert gpu.dims["collectives.nccl_algo"].choices == ("auto", "Ring", "Tree")
    assert gpu.dims["collectives.nccl_proto"].choices == ("auto", "Simple", "LL", "LL128")
    base = gpu.baseline_params()
    assert base["collectives.nccl_algo"] == base["collectives.nccl_proto"] == "auto"
    trial = optuna.trial.FixedTrial({**base, "collectives.nccl_algo": "Tree", "collectives.nccl_proto": "LL128"})
    config = gpu.to_config(_config(), gpu.suggest(trial))
    assert config.strategy.collective_env()["NCCL_ALGO"] == "Tree"
    assert config.strategy.collective_env()["NCCL_PROTO"] == "LL128"
    auto = gpu.to_config(_config(collectives={"nccl_algo": "Ring"}), gpu.suggest(optuna.trial.FixedTrial(base)))
    assert auto.strategy.collectives.nccl_algo is None and "NCCL_ALGO" not in auto.strategy.collective_env()
    assert {p["collectives.nccl_algo"] for p, _ in _sample(gpu, n=30)} == {"auto", "Ring", "Tree"}


def test_hierarchical_only_across_nodes_and_without_compression():
    one = build_space(nproc_per_node=2, cpu_count=8)
    assert "collectives.hierarchical" not in one.dims and "one node" in one.unavailable["collectives.hierarchical"]
    base = _config(nproc=2, nnodes=2)
    two = build_space(nproc_per_node=2, cpu_count=8, base=base)
    samples = _sample(two, n=60)
    for params, _ in samples:
        assert ("collectives.hierarchical" in params) == (params["compression.method"] == "none")
        two.to_config(base, params)
    assert any(p.get("collectives.hierarchical") for p, _ in samples)
    # A base that already uses the hierarchical hook: a compression trial replaces it (both are the comm hook).
    hier = _config(nproc=2, nnodes=2, collectives={"hierarchical": True})
    trial = optuna.trial.FixedTrial({**build_space(nproc_per_node=2, cpu_count=8, base=hier).baseline_params(),
                                     "compression.method": "fp16"})
    space = build_space(nproc_per_node=2, cpu_count=8, base=hier)
    config = space.to_config(hier, space.suggest(trial))
    assert config.strategy.compression.method == "fp16" and config.strategy.collectives.hierarchical is False
    # Compression not searched but on in the base: no hierarchical dimension.
    fp16 = _config(nproc=2, nnodes=2, compression={"method": "fp16"})
    off = build_space(nproc_per_node=2, cpu_count=8, base=fp16, include_compression=False)
    assert "compresses gradients" in off.unavailable["collectives.hierarchical"]


def test_zero_code_scripts_keep_their_strategy_kind():
    space = build_space(nproc_per_node=2, cpu_count=8)
    assert "strategy.kind" not in space.dims and "parallelize" in space.unavailable["strategy.kind"]
    for name in ("fsdp.reshard_after_forward", "pipeline.schedule", "training.gradient_accumulation_steps"):
        assert name in space.unavailable
    with pytest.raises(ConfigError, match="space.strategy.kind must be omitted"):
        build_space(nproc_per_node=2, spec={"strategy.kind": {"choices": ["ddp", "fsdp"]}})


def test_api_mode_kinds_on_two_ranks_are_ddp_and_fsdp_with_compression_only_for_ddp():
    base = _config()
    space = build_space(nproc_per_node=2, cpu_count=8, base=base, api_mode=True)
    assert space.dims["strategy.kind"].choices == ("ddp", "fsdp")
    assert "world size >= 4" in space.unavailable["strategy.kind=hsdp"]
    assert "split_points" in space.unavailable["strategy.kind=pipeline"]
    assert space.dims["fsdp.reshard_after_forward"].choices == (True, False)  # no partial reshard below 4 ranks
    samples = _sample(space, n=60)
    kinds = {p["strategy.kind"] for p, _ in samples}
    assert kinds == {"ddp", "fsdp"}
    for params, _ in samples:
        ddp = params["strategy.kind"] == "ddp"
        assert ("compression.method" in params) == ddp and ("ddp.bucket_cap_mb" in params) == ddp
        assert ("fsdp.reshard_after_forward" in params) == (not ddp)
        config = space.to_config(base, params)
        assert config.strategy.kind == params["strategy.kind"]
    assert space.baseline_params()["strategy.kind"] == "ddp"


def test_api_mode_hsdp_and_partial_reshard_from_four_ranks():
    base = _config(nproc=4)
    space = build_space(nproc_per_node=4, cpu_count=8, base=base, api_mode=True)
    assert space.dims["strategy.kind"].choices == ("ddp", "fsdp", "hsdp")
    assert space.dims["fsdp.reshard_after_forward"].choices == (True, False, 2)
    hsdp = space.to_config(base, space.suggest(_fixed(space, strategy__kind="hsdp", fsdp__reshard_after_forward=2)))
    assert hsdp.strategy.kind == "hsdp" and hsdp.strategy.fsdp.replicate_degree == 2  # a 2 x 2 mesh on one node
    assert hsdp.strategy.fsdp.reshard_after_forward == 2
    for params, _ in _sample(space, n=40):
        space.to_config(base, params)  # every kind/reshard combination passes check_layout
    # Several nodes: HSDP's replicas are the nodes (the config's default), partial reshard within a node.
    multi = _config(nproc=4, nnodes=2)
    spaced = build_space(nproc_per_node=4, cpu_count=8, base=multi, api_mode=True)
    assert "hsdp" in spaced.dims["strategy.kind"].choices
    assert spaced.dims["fsdp.reshard_after_forward"].choices == (True, False, 2, 4)
    config = spaced.to_config(multi, {"strategy.kind": "hsdp", "fsdp.reshard_after_forward": 4})
    assert config.strategy.fsdp.replicate_degree is None  # = nnodes
    # A 2 x 3 mesh on 6 ranks: partial reshard sizes must divide the shard group (3) too.
    six = build_space(nproc_per_node=6, cpu_count=12, base=_config(nproc=6), api_mode=True)
    assert six.dims["fsdp.reshard_after_forward"].choices == (True, False, 3)


def test_api_mode_pipeline_needs_split_points_and_they_decide_the_schedules():
    flat = _config(pipeline={"split_points": ["blocks.2"]})
    space = build_space(nproc_per_node=2, cpu_count=8, base=flat, api_mode=True)
    assert space.dims["strategy.kind"].choices == ("ddp", "fsdp", "pipeline")
    assert space.dims["pipeline.schedule"].choices == ("gpipe", "1f1b")
    assert space.dims["pipeline.n_microbatches"].choices == (2, 4, 8)
    samples = _sample(space, n=60)
    pipes = [p for p, _ in samples if p["strategy.kind"] == "pipeline"]
    assert pipes
    for params in pipes:
        assert {"pipeline.schedule", "pipeline.n_microbatches"} <= set(params)
        assert not any(k.startswith(("ddp.", "compression.", "fsdp.")) for k in params)
        config = space.to_config(flat, params)
        assert config.strategy.pipeline.stages_per_rank == 1
    # 2 x world stages: the interleaved schedule, two stages per rank.
    looped = _config(pipeline={"split_points": ["b.1", "b.2", "b.3"]})
    space = build_space(nproc_per_node=2, cpu_count=8, base=looped, api_mode=True)
    assert space.dims["pipeline.schedule"].choices == ("interleaved1f1b",)
    config = space.to_config(looped, {"strategy.kind": "pipeline", "pipeline.schedule": "interleaved1f1b",
                                      "pipeline.n_microbatches": 4})
    assert config.strategy.pipeline.stages_per_rank == 2
    with pytest.raises(ConfigError, match="space.pipeline.schedule.choices must be one of"):
        build_space(nproc_per_node=2, base=flat, api_mode=True, spec={"pipeline.schedule": {"choices": ["zbv"]}})
    # Split points that fit neither layout: no pipeline, with the reason.
    odd = _config(pipeline={"split_points": ["b.1", "b.2"]})
    space = build_space(nproc_per_node=2, cpu_count=8, base=odd, api_mode=True)
    assert "pipeline" not in space.dims["strategy.kind"].choices
    assert "make 3 stages" in space.unavailable["strategy.kind=pipeline"]


def test_gradient_accumulation_needs_allow_batch_changes_and_excludes_static_graph():
    base = _config()
    no = build_space(nproc_per_node=2, cpu_count=8, base=base, api_mode=True)
    assert "--allow-batch-changes" in no.unavailable["training.gradient_accumulation_steps"]
    space = build_space(nproc_per_node=2, cpu_count=8, base=base, api_mode=True, allow_batch_changes=True)
    assert space.dims["training.gradient_accumulation_steps"].choices == (1, 2, 4)
    samples = _sample(space, n=80)
    for params, _ in samples:
        accumulating = params.get("training.gradient_accumulation_steps", 1) > 1
        if params["strategy.kind"] == "ddp":
            assert ("ddp.static_graph" in params) == (not accumulating)  # pytorch#187732
        space.to_config(base, params)
    assert any(p.get("training.gradient_accumulation_steps", 1) > 1 for p, _ in samples)
    # A pipeline never accumulates (pipeline.n_microbatches does).
    piped = _config(pipeline={"split_points": ["blocks.2"]})
    space = build_space(nproc_per_node=2, cpu_count=8, base=piped, api_mode=True, allow_batch_changes=True)
    for params, _ in _sample(space, n=60):
        if params["strategy.kind"] == "pipeline":
            assert "training.gradient_accumulation_steps" not in params
        space.to_config(piped, params)


def test_api_mode_trial_zero_is_the_base_strategy_and_spaces_narrow_kinds():
    base = _config(nproc=4, kind="fsdp", fsdp={"reshard_after_forward": False})
    space = build_space(nproc_per_node=4, cpu_count=8, base=base, api_mode=True)
    trial0 = space.baseline_params()
    assert trial0["strategy.kind"] == "fsdp" and trial0["fsdp.reshard_after_forward"] is False
    config = space.to_config(base, trial0).strategy
    assert (config.kind, config.fsdp, config.compression) == (base.strategy.kind, base.strategy.fsdp, base.strategy.compression)
    narrowed = build_space(nproc_per_node=4, cpu_count=8, base=base, api_mode=True,
                           spec={"strategy.kind": {"choices": ["fsdp", "hsdp"]},
                                 "fsdp.reshard_after_forward": {"choices": [True, 2]}})
    for params, _ in _sample(narrowed, n=20):
        assert params["strategy.kind"] in ("fsdp", "hsdp") and params["fsdp.reshard_after_forward"] in (True, 2)
        assert params["fsdp.reshard_after_forward"] is not 1  # noqa: F632 - True is not the int 1
    widened = build_space(nproc_per_node=4, cpu_count=8, base=_config(nproc=4, pipeline={"split_points": ["a", "b", "c"]}),
                          api_mode=True, spec={"pipeline.n_microbatches": {"low": 2, "high": 16}})
    d = widened.dims["pipeline.n_microbatches"]
    assert (d.low, d.high, d.choices) == (2, 16, ())


@pytest.mark.parametrize(
    "kwargs, spec, message",
    [
        ({}, {"strategy.kind": {"choices": ["ddp", "hsdp"]}}, "space.strategy.kind.choices must be one of \\['ddp', 'fsdp'\\]"),
        ({"nproc": 4}, {"fsdp.reshard_after_forward": {"choices": [3]}}, "reshard_after_forward.choices must be one of"),
        ({"nproc": 4}, {"fsdp.reshard_after_forward": {"value": 1}}, "must be one of \\[True, False, 2\\]"),
        ({}, {"pipeline.n_microbatches": {"choices": [0]}}, "must be omitted"),
        ({"splits": 1}, {"pipeline.n_microbatches": {"choices": [0]}}, "n_microbatches.choices must be >= 1"),
        ({"batch": True}, {"training.gradient_accumulation_steps": {"low": 0}}, "gradient_accumulation_steps.low must be >= 1"),
        ({}, {"ddp.first_bucket_cap_mb": {"low": 0}}, "first_bucket_cap_mb.low must be > 0"),
        ({"cuda": True}, {"collectives.nccl_algo": {"choices": ["Fast"]}}, "nccl_algo.choices must be one of"),
        ({"nnodes": 2}, {"collectives.hierarchical": {"value": "yes"}}, "hierarchical.value must be true or false"),
    ],
)
def test_invalid_issue_4_spaces_are_one_line_config_errors(kwargs, spec, message):
    nproc = kwargs.get("nproc", 2)
    strategy = {"pipeline": {"split_points": ["blocks.1"]}} if kwargs.get("splits") else {}
    base = _config(nproc=nproc, nnodes=kwargs.get("nnodes", 1), **strategy)
    with pytest.raises(ConfigError, match=message) as info:
        build_space(nproc_per_node=nproc, cpu_count=8, base=base, api_mode=True, cuda=kwargs.get("cuda", False),
                    allow_batch_changes=kwargs.get("batch", False), spec=spec)
    assert "\n" not in str(info.value)
