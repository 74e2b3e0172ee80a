"""DeepSpeed, Horovod and FSDP1 settings imported as torsh-tune strategies (pure, no processes)."""

from __future__ import annotations

import json

import pytest

from torsh_tune.config import RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.importers import (
    ImportResult,
    from_deepspeed,
    from_fsdp1_kwargs,
    from_horovod,
    import_file,
    load_config_file,
    looks_like_deepspeed,
)


def _unsupported(result: ImportResult) -> dict[str, str]:
    """{dotted key: reason} of the keys an importer did not map."""
    pairs = [line.split(": ", 1) for line in result.unsupported]
    assert all(len(p) == 2 and p[1] for p in pairs), result.unsupported  # every key comes with a reason
    return dict(pairs)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and " must be " in text and ", but got " in text, text
    return text


# -- DeepSpeed ----------------------------------------------------------------------------

@pytest.mark.parametrize("stage, kind, reshard", [(0, "ddp", None), (1, "fsdp", False), (2, "fsdp", False),
                                                   (3, "fsdp", True)])
def test_deepspeed_zero_stage_picks_ddp_or_fsdp_sharding(stage, kind, reshard):
    result = from_deepspeed({"zero_optimization": {"stage": stage}})
    config = result.to_run_config()
    assert config.strategy.kind == kind
    if reshard is not None:
        assert config.strategy.fsdp.reshard_after_forward is reshard
    assert result.unsupported == []
    if stage == 1:
        assert any("optimizer state" in n for n in result.notes)


def test_deepspeed_without_zero_section_is_ddp():
    assert from_deepspeed({"train_batch_size": 32}).to_run_config().strategy.kind == "ddp"


@pytest.mark.parametrize("key", ["offload_param", "offload_optimizer"])
def test_deepspeed_cpu_offload(key):
    result = from_deepspeed({"zero_optimization": {"stage": 3, key: {"device": "cpu", "pin_memory": True}}})
    assert result.to_run_config().strategy.fsdp.cpu_offload is True
    assert f"zero_optimization.{key}.pin_memory" in _unsupported(result)


def test_deepspeed_nvme_offload_and_offload_without_zero_are_listed():
    nvme = from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    assert nvme.to_run_config().strategy.fsdp.cpu_offload is False
    assert {"zero_optimization.offload_param.device", "zero_optimization.offload_param.nvme_path"} <= set(_unsupported(nvme))
    ddp = from_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    assert ddp.to_run_config().strategy.kind == "ddp"
    assert "sharding" in _unsupported(ddp)["zero_optimization.offload_optimizer.device"]


@pytest.mark.parametrize("section, dtype", [("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")])
def test_deepspeed_half_precision_becomes_fsdp_mixed_precision(section, dtype):
    result = from_deepspeed({"zero_optimization": {"stage": 3}, section: {"enabled": True, "loss_scale": 0}})
    assert result.to_run_config().strategy.fsdp.mixed_precision == dtype
    assert f"{section}.loss_scale" in _unsupported(result)


def test_deepspeed_half_precision_on_ddp_is_listed_with_reason():
    result = from_deepspeed({"fp16": {"enabled": True}})
    config = result.to_run_config()
    assert config.strategy.kind == "ddp" and config.strategy.compression.method == "none"
    assert "DDP has no mixed-precision policy" in _unsupported(result)["fp16.enabled"]


@pytest.mark.parametrize("bf16", ["bf16", "bfloat16"])
def test_deepspeed_fp16_and_bf16_together_is_one_line_error(bf16):
    with pytest.raises(ConfigError) as exc:
        from_deepspeed({"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}, bf16: {"enabled": True}})
    assert f"deepspeed fp16.enabled must be false when {bf16}.enabled is true" in _one_line(exc)


@pytest.mark.parametrize("stage, dtype, section, key, value", [
    (0, "fp16", "compression", "method", "fp16"),
    (0, "bf16", "compression", "method", "bf16"),
    (3, "bf16", "fsdp", "reduce_dtype", "bf16"),
    (3, "fp32", "fsdp", "reduce_dtype", "fp32"),
])
def test_deepspeed_communication_data_type(stage, dtype, section, key, value):
    result = from_deepspeed({"zero_optimization": {"stage": stage}, "communication_data_type": dtype})
    assert getattr(getattr(result.to_run_config().strategy, section), key) == value


def test_deepspeed_fp32_communication_on_ddp_keeps_plain_all_reduce():
    result = from_deepspeed({"communication_data_type": "fp32"})
    assert result.to_run_config().strategy.compression.method == "none" and result.unsupported == []


def test_deepspeed_reduce_bucket_size_is_ddp_bucket_in_mib():
    result = from_deepspeed({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e8}})
    # 5e7 elements x 4 bytes (fp32) = 200,000,000 bytes = 190.735 MiB
    assert result.to_run_config().strategy.ddp.bucket_cap_mb == pytest.approx(190.735)
    assert "never all-gathers" in _unsupported(result)["zero_optimization.allgather_bucket_size"]


def test_deepspeed_bucket_sizes_under_fsdp_are_listed():
    result = from_deepspeed({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}})
    skipped = _unsupported(result)
    assert "FSDP2 has no bucket knob" in skipped["zero_optimization.reduce_bucket_size"]
    assert "FSDP2 has no bucket knob" in skipped["zero_optimization.allgather_bucket_size"]
    assert result.to_run_config().strategy.ddp.bucket_cap_mb is None


def test_deepspeed_training_keys():
    config = from_deepspeed({"gradient_accumulation_steps": 4, "gradient_clipping": 1.0}).to_run_config()
    assert config.strategy.training.gradient_accumulation_steps == 4
    assert config.strategy.training.max_grad_norm == 1.0
    off = from_deepspeed({"gradient_clipping": 0.0})
    assert off.to_run_config().strategy.training.max_grad_norm is None
    assert any("no clipping" in n for n in off.notes)


def test_deepspeed_script_own_keys_are_listed_with_reasons():
    doc = {
        "train_batch_size": 256, "train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW"},
        "scheduler": {"type": "WarmupLR"}, "steps_per_print": 10, "wall_clock_breakdown": False,
        "activation_checkpointing": {}, "some_future_key": 1,
        "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                              "zero_hpz_partition_size": 8},
    }
    skipped = _unsupported(from_deepspeed(doc))
    assert "the script's own" in skipped["train_batch_size"]
    assert "the script's own" in skipped["optimizer"]
    assert "the script's own" in skipped["scheduler"]
    assert "profiler" in skipped["steps_per_print"]
    assert "overlap" in skipped["zero_optimization.overlap_comm"]
    assert "hsdp" in skipped["zero_optimization.zero_hpz_partition_size"]
    # nothing is dropped silently: every key of the input is either mapped or listed
    mapped = {"zero_optimization.stage"}
    listed = set(skipped)
    every = {k for k in doc if k != "zero_optimization"} | {f"zero_optimization.{k}" for k in doc["zero_optimization"]}
    assert every == mapped | listed


def test_deepspeed_hf_trainer_auto_values_are_listed_and_noted():
    doc = {  # the Hugging Face Trainer's ds_config template
        "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
    }
    result = from_deepspeed(doc)
    config = result.to_run_config()
    assert config.strategy.kind == "fsdp" and config.strategy.fsdp.mixed_precision == "none"
    assert config.strategy.training.gradient_accumulation_steps == 1
    skipped = _unsupported(result)
    for key in ("fp16.enabled", "bf16.enabled", "gradient_accumulation_steps", "gradient_clipping",
                "zero_optimization.reduce_bucket_size"):
        assert "'auto'" in skipped[key], key
    assert any("Hugging Face Trainer" in n for n in result.notes)


@pytest.mark.parametrize("doc, message", [
    ({"zero_optimization": {"stage": 4}}, "deepspeed zero_optimization.stage must be 0, 1, 2 or 3, but got 4"),
    ({"zero_optimization": {"stage": "three"}}, "deepspeed zero_optimization.stage must be an integer >= 0"),
    ({"zero_optimization": []}, "deepspeed zero_optimization must be a table of settings"),
    ({"communication_data_type": "int8"}, "deepspeed communication_data_type must be one of 'fp16', 'bf16' or 'fp32'"),
    ({"fp16": {"enabled": "maybe"}}, "deepspeed fp16.enabled must be true or false"),
    ({"zero_optimization": {"stage": 0, "reduce_bucket_size": -1}}, "deepspeed zero_optimization.reduce_bucket_size must be a number > 0"),
    ({"gradient_accumulation_steps": 0}, "deepspeed gradient_accumulation_steps must be an integer >= 1, but got 0"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "offload_param.device must be one of"),
])
def test_deepspeed_bad_values_are_one_line_errors(doc, message):
    with pytest.raises(ConfigError) as exc:
        from_deepspeed(doc)
    assert message in _one_line(exc)


def test_looks_like_deepspeed():
    assert looks_like_deepspeed({"zero_optimization": {"stage": 2}})
    assert looks_like_deepspeed({"train_micro_batch_size_per_gpu": 4})
    assert not looks_like_deepspeed({"strategy": {"kind": "ddp"}, "budget": {"steps": 3}})
    assert not looks_like_deepspeed([1, 2])


# -- Horovod ------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, mib", [
    ({"HOROVOD_FUSION_THRESHOLD": "67108864"}, 64.0),
    ({"HOROVOD_FUSION_THRESHOLD": 33554432}, 32.0),
    ({"fusion_threshold_mb": 16}, 16.0),
    ({"--fusion-threshold-mb": "8"}, 8.0),
])
def test_horovod_fusion_threshold_is_ddp_bucket(settings, mib):
    config = from_horovod(settings).to_run_config()
    assert config.strategy.kind == "ddp" and config.strategy.ddp.bucket_cap_mb == mib


def test_horovod_zero_fusion_threshold_is_listed():
    result = from_horovod({"HOROVOD_FUSION_THRESHOLD": "0"})
    assert result.to_run_config().strategy.ddp.bucket_cap_mb is None
    assert "always buckets" in _unsupported(result)["HOROVOD_FUSION_THRESHOLD"]


def test_horovod_cycle_time_and_unknown_keys_are_listed():
    skipped = _unsupported(from_horovod({"HOROVOD_CYCLE_TIME": "5", "cycle_time_ms": 3.5, "HOROVOD_TIMELINE": "/t.json",
                                         "HOROVOD_SOMETHING_NEW": "1"}))
    assert "as soon as its gradients are ready" in skipped["HOROVOD_CYCLE_TIME"]
    assert "as soon as its gradients are ready" in skipped["cycle_time_ms"]
    assert "--trace-window" in skipped["HOROVOD_TIMELINE"]
    assert skipped["HOROVOD_SOMETHING_NEW"] == "no torsh-tune counterpart"


@pytest.mark.parametrize("value", ["fp16", "hvd.Compression.fp16", "Compression.fp16"])
def test_horovod_fp16_compression(value):
    assert from_horovod({"compression": value}).to_run_config().strategy.compression.method == "fp16"


def test_horovod_hierarchical_and_backward_passes():
    config = from_horovod({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "backward_passes_per_step": 4}).to_run_config()
    assert config.strategy.collectives.hierarchical is True
    assert config.strategy.training.gradient_accumulation_steps == 4
    off = from_horovod({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}).to_run_config()
    assert off.strategy.collectives.hierarchical is False


def test_horovod_hierarchical_with_compression_keeps_compression_and_lists_hierarchical():
    result = from_horovod({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "compression": "fp16"})
    config = result.to_run_config()  # both at once would be rejected: both are the DDP comm hook
    assert config.strategy.compression.method == "fp16" and config.strategy.collectives.hierarchical is False
    assert "comm hook" in _unsupported(result)["HOROVOD_HIERARCHICAL_ALLREDUCE"]


@pytest.mark.parametrize("settings, message", [
    ({"HOROVOD_FUSION_THRESHOLD": "lots"}, "horovod HOROVOD_FUSION_THRESHOLD must be a number >= 0, but got 'lots'"),
    ({"HOROVOD_FUSION_THRESHOLD": -5}, "horovod HOROVOD_FUSION_THRESHOLD must be a number >= 0, but got -5"),
    ({"compression": "Compression.zstd"}, "horovod compression must be 'none' or 'fp16'"),
    ({"HOROVOD_HIERARCHICAL_ALLREDUCE": "sometimes"}, "horovod HOROVOD_HIERARCHICAL_ALLREDUCE must be true or false"),
    ({"backward_passes_per_step": 0}, "horovod backward_passes_per_step must be an integer >= 1, but got 0"),
])
def test_horovod_bad_values_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError) as exc:
        from_horovod(settings)
    assert message in _one_line(exc)


# -- FSDP1 --------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy, kind, reshard", [
    ("FULL_SHARD", "fsdp", True),
    ("ShardingStrategy.FULL_SHARD", "fsdp", True),
    ("SHARD_GRAD_OP", "fsdp", False),
    ("NO_SHARD", "ddp", None),
    ("HYBRID_SHARD", "hsdp", True),
    ("ShardingStrategy._HYBRID_SHARD_ZERO2", "hsdp", False),
])
def test_fsdp1_sharding_strategy(strategy, kind, reshard):
    config = from_fsdp1_kwargs({"sharding_strategy": strategy}).to_run_config()
    assert config.strategy.kind == kind
    if reshard is not None:
        assert config.strategy.fsdp.reshard_after_forward is reshard


def test_fsdp1_hybrid_shard_notes_why_it_is_a_2d_mesh():
    notes = from_fsdp1_kwargs({"sharding_strategy": "HYBRID_SHARD"}).notes
    assert any("2-D" in n and "one host" in n for n in notes)


def test_fsdp1_default_is_full_shard_with_note():
    result = from_fsdp1_kwargs({"cpu_offload": True})
    assert result.to_run_config().strategy.kind == "fsdp"
    assert any("FULL_SHARD assumed" in n for n in result.notes)


@pytest.mark.parametrize("param, reduce, want_param, want_reduce", [
    ("torch.bfloat16", "torch.float32", "bf16", "fp32"),
    ("bfloat16", None, "bf16", None),
    ("bf16", "bf16", "bf16", "bf16"),
    ("torch.float16", "torch.half", "fp16", "fp16"),
    ("torch.float32", None, "none", None),
])
def test_fsdp1_mixed_precision(param, reduce, want_param, want_reduce):
    mp = {"param_dtype": param, "reduce_dtype": reduce, "buffer_dtype": param}
    result = from_fsdp1_kwargs({"sharding_strategy": "FULL_SHARD", "mixed_precision": mp})
    fsdp = result.to_run_config().strategy.fsdp
    assert (fsdp.mixed_precision, fsdp.reduce_dtype) == (want_param, want_reduce)
    assert "buffers" in _unsupported(result)["mixed_precision.buffer_dtype"]


@pytest.mark.parametrize("value, on", [(True, True), (False, False), ({"offload_params": True}, True),
                                       ({"offload_params": False}, False), (None, False)])
def test_fsdp1_cpu_offload(value, on):
    assert from_fsdp1_kwargs({"cpu_offload": value}).to_run_config().strategy.fsdp.cpu_offload is on


def test_fsdp1_wrap_policies():
    transformer = from_fsdp1_kwargs({"auto_wrap_policy": "transformer_auto_wrap_policy",
                                     "transformer_layer_cls": ["GPT2Block"]})
    assert transformer.unsupported == []
    assert any("GPT2Block" in n and "fsdp.wrap" in n for n in transformer.notes)
    assert transformer.to_run_config().strategy.fsdp.wrap == []
    size = from_fsdp1_kwargs({"auto_wrap_policy": "size_based_auto_wrap_policy", "min_num_params": 1e6})
    skipped = _unsupported(size)
    assert "module name" in skipped["auto_wrap_policy"] and "by module" in skipped["min_num_params"]


@pytest.mark.parametrize("key", ["backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params",
                                 "sync_module_states"])
def test_fsdp1_knobs_fsdp2_does_itself_are_listed_with_reasons(key):
    result = from_fsdp1_kwargs({"sharding_strategy": "FULL_SHARD", key: True})
    assert "FSDP2" in _unsupported(result)[key]


def test_fsdp1_no_shard_lists_what_ddp_cannot_take():
    result = from_fsdp1_kwargs({"sharding_strategy": "NO_SHARD", "cpu_offload": True,
                                "mixed_precision": {"param_dtype": "bf16"}})
    skipped = _unsupported(result)
    assert {"cpu_offload", "mixed_precision"} <= set(skipped)
    assert result.to_run_config().strategy.kind == "ddp"


@pytest.mark.parametrize("kwargs, message", [
    ({"sharding_strategy": "HALF_SHARD"}, "fsdp1 sharding_strategy must be one of"),
    ({"sharding_strategy": 1}, "fsdp1 sharding_strategy must be one of"),
    ({"mixed_precision": {"param_dtype": "torch.int8"}}, "fsdp1 mixed_precision.param_dtype must be a dtype"),
    ({"mixed_precision": "bf16"}, "fsdp1 mixed_precision must be a table of settings"),
    ({"cpu_offload": "yes please"}, "fsdp1 cpu_offload must be true or false"),
    ({"transformer_layer_cls": 3}, "fsdp1 transformer_layer_cls must be a policy or class name"),
])
def test_fsdp1_bad_values_are_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        from_fsdp1_kwargs(kwargs)
    assert message in _one_line(exc)


# -- files and TOML -----------------------------------------------------------------------

def test_import_file_detects_each_format(tmp_path):
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    hvd = tmp_path / "horovod.toml"
    hvd.write_text("HOROVOD_FUSION_THRESHOLD = 67108864\nHOROVOD_CYCLE_TIME = 5\n")
    fsdp1 = tmp_path / "fsdp1.json"
    fsdp1.write_text(json.dumps({"sharding_strategy": "SHARD_GRAD_OP"}))
    assert import_file(ds).source == "deepspeed"
    assert import_file(hvd).source == "horovod"
    assert import_file(fsdp1).source == "fsdp1"
    assert import_file(hvd, "horovod").to_run_config().strategy.ddp.bucket_cap_mb == 64.0


def test_import_file_with_explicit_format_overrides_detection(tmp_path):
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"compression": "fp16"}))
    assert import_file(path, "horovod").to_run_config().strategy.compression.method == "fp16"


@pytest.mark.parametrize("content, fmt, message", [
    (None, "auto", "FILE must be an existing JSON or TOML file"),
    ("{not json", "auto", "must be valid JSON"),
    ('{"colour": "blue"}', "auto", "must be a DeepSpeed, Horovod or FSDP1 settings file (or pass --from)"),
    ("[1, 2]", "deepspeed", "must be a JSON object or TOML table of settings"),
    ('{"a": 1}', "megatron", "import format must be one of"),
])
def test_import_file_bad_inputs_are_one_line_errors(tmp_path, content, fmt, message):
    path = tmp_path / "settings.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as exc:
        import_file(path, fmt)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_to_toml_lists_unsupported_keys_as_comments_and_loads_back():
    result = from_deepspeed({"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True},
                             "optimizer": {"type": "Adam"}, "gradient_accumulation_steps": 2})
    text = result.to_toml()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert any(line.startswith("# not imported: zero_optimization.overlap_comm: ") for line in header)
    assert any(line.startswith("# not imported: optimizer: ") for line in header)
    assert RunConfig.from_toml(text) == result.to_run_config()
    assert "[launch]" not in text  # a strategy file: launch, budget and profiler stay with the command line


def test_to_run_config_applies_onto_a_base():
    base = RunConfig.from_dict({"budget": {"steps": 7}})
    config = from_fsdp1_kwargs({"sharding_strategy": "SHARD_GRAD_OP"}).to_run_config(base)
    assert config.budget.steps == 7 and config.strategy.kind == "fsdp"


def test_load_config_file_imports_a_deepspeed_json(tmp_path, capsys):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True}, "bf16": {"enabled": True},
                                "train_micro_batch_size_per_gpu": 4}))
    config = load_config_file(path)
    assert config.strategy.kind == "fsdp" and config.strategy.fsdp.reshard_after_forward is False
    assert config.strategy.fsdp.mixed_precision == "bf16"
    err = capsys.readouterr().err
    assert "not imported: zero_optimization.overlap_comm" in err
    assert "not imported: train_micro_batch_size_per_gpu" in err


def test_load_config_file_still_reads_a_runconfig_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(RunConfig.from_dict({"budget": {"steps": 3}}).to_json())
    assert load_config_file(path).budget.steps == 3
    path.write_text(json.dumps({"ddp": {"bucket_cap_mb": 50}}))  # strategy sections may stand at top level
    assert load_config_file(path).strategy.ddp.bucket_cap_mb == 50
