"""Search space: conditional dimensions, TOML narrowing, invalid spaces, configs built from trials."""

from __future__ import annotations

import subprocess
import sys

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
        assert ("compression.rank" in params) == (params["compression.method"] == "powersgd")
        assert ("compression.ratio" in params) == (params["compression.method"] in ("topk", "adaptive"))
        assert 1.0 <= params["ddp.bucket_cap_mb"] <= 200.0
        assert 0 <= params["dataloader.num_workers"] <= 8
        assert 1 <= params["omp_num_threads"] <= 8
        RunConfig().apply_patch(space.patch_of(params))  # every sample is a valid config
    # Both branches are actually reached.
    assert any(p["dataloader.num_workers"] > 0 for p, _ in samples)
    assert any(p["dataloader.num_workers"] == 0 for p, _ in samples)


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


def test_cpu_bounds_and_single_point_ranges_become_fixed():
    space = build_space(nproc_per_node=2, cpu_count=2)
    assert space.dims["omp_num_threads"].fixed and space.dims["omp_num_threads"].value == 1
    assert space.dims["dataloader.num_workers"].high == 1
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
        "ddp.bucket_cap_mb": 50.0, "ddp.gradient_as_bucket_view": True, "ddp.static_graph": False,
        "dataloader.num_workers": 2, "dataloader.prefetch_factor": 4, "omp_num_threads": 2,
        "compression.method": "powersgd", "compression.rank": 2, "compression.start_iter": 5,
    })
    params = space.suggest(trial)
    config = space.to_config(RunConfig(), params)
    assert config.strategy.ddp.bucket_cap_mb == 50.0
    assert config.strategy.dataloader.prefetch_factor == 4
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


def test_autotune_does_not_import_torch_or_optuna_at_load():
    code = "import sys, torsh_tune.autotune; print('torch' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
