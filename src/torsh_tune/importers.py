"""Import DeepSpeed, Horovod and FSDP1 settings as a torsh-tune strategy.

Each importer reads another framework's settings and returns an `ImportResult`: a config
patch in the shape `RunConfig.apply_patch` accepts (strategy sections at top level and
`{"strategy": {"kind": ...}}`), the keys it could not map, each with the reason, and notes
on mappings that are approximate. Nothing is dropped silently: every key of the input is
either mapped or listed in `unsupported`.

Pure Python: no torch import.

Example:
    >>> from torsh_tune.importers import from_deepspeed
    >>> result = from_deepspeed({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    >>> result.config
    {'strategy': {'kind': 'fsdp'}, 'fsdp': {'reshard_after_forward': True, 'mixed_precision': 'bf16'}}
    >>> result.to_run_config().strategy.fsdp.mixed_precision
    'bf16'
"""

from __future__ import annotations

import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .config import RunConfig, dump_toml
from .errors import ConfigError, invalid

__all__ = [
    "IMPORT_FORMATS",
    "ImportResult",
    "from_deepspeed",
    "from_fsdp1_kwargs",
    "from_horovod",
    "import_file",
    "load_config_file",
    "looks_like_deepspeed",
]

IMPORT_FORMATS = ("auto", "deepspeed", "horovod", "fsdp1")
_MIB = 1 << 20


@dataclass(frozen=True, kw_only=True)
class ImportResult:
    """What an importer made of another framework's settings.

    Attributes:
        source: "deepspeed", "horovod" or "fsdp1".
        config: A patch for `RunConfig.apply_patch`: `{"strategy": {"kind": ...}}` plus
            strategy sections such as `{"fsdp": {...}, "training": {...}}`.
        unsupported: "dotted.key: reason" for every input key that was not mapped.
        notes: Mappings that are approximate, and defaults the importer assumed.
    """

    source: str
    config: dict[str, Any]
    unsupported: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_run_config(self, base: RunConfig | None = None) -> RunConfig:
        """The validated RunConfig: `base` (default: all defaults) with this patch applied."""
        return (base or RunConfig()).apply_patch(self.config)

    def comment_lines(self) -> list[str]:
        """The unsupported keys and notes as TOML comment lines (for the top of a file)."""
        lines = [f"# imported from {self.source} settings by `torsh-tune import-config`"]
        lines += [f"# not imported: {u}" for u in self.unsupported]
        lines += [f"# note: {n}" for n in self.notes]
        return lines

    def to_toml(self, base: RunConfig | None = None) -> str:
        """The strategy tables of the resulting RunConfig as TOML, headed by `comment_lines()`.

        Only `[strategy]` and its sub-tables are written (launch, budget and profiler stay
        with the command line), so the file is a strategy `--config` loads as it is.
        """
        lines = dump_toml(self.to_run_config(base)).splitlines()
        start = lines.index("[strategy]")  # always written: kind is a scalar of [strategy]
        return "\n".join(self.comment_lines() + [""] + lines[start:]) + "\n"


class _Builder:
    """Collects a patch, the unsupported keys and the notes while an importer walks its input."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.patch: dict[str, Any] = {}
        self.unsupported: list[str] = []
        self.notes: list[str] = []

    def set(self, section: str, key: str, value: Any) -> None:
        if section == "strategy":
            self.patch.setdefault("strategy", {})[key] = value
        else:
            self.patch.setdefault(section, {})[key] = value

    def get(self, section: str, key: str, default: Any = None) -> Any:
        return self.patch.get(section, {}).get(key, default)

    def skip(self, key: str, reason: str) -> None:
        self.unsupported.append(f"{key}: {reason}")

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def result(self) -> ImportResult:
        return ImportResult(source=self.source, config=self.patch, unsupported=self.unsupported, notes=self.notes)


_AUTO_NOTE = ("'auto' values are filled in by the Hugging Face Trainer at run time; torsh-tune keeps its own "
              "default for them (set a number to import it)")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _number(what: str, value: Any, *, minimum: float = 0.0, strict: bool = True) -> float:
    """A JSON/TOML/env number (env values arrive as strings) that is > minimum (>= when not strict)."""
    rule = f"a number {'>' if strict else '>='} {minimum:g}"
    if isinstance(value, bool):
        raise invalid(what, rule, value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise invalid(what, rule, value) from None
    if not isinstance(value, (int, float)) or value != value:
        raise invalid(what, rule, value)
    if value < minimum or (strict and value == minimum):
        raise invalid(what, rule, value)
    return float(value)


def _integer(what: str, value: Any, *, minimum: int) -> int:
    rule = f"an integer >= {minimum}"
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise invalid(what, rule, value)
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _flag(what: str, value: Any) -> bool:
    """true/false, 1/0, or their string spellings (environment variables)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise invalid(what, "true or false (or 1/0)", value)


def _table(what: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(what, "a table of settings", value)
    return value


def _mib(num_bytes: float) -> float:
    return round(num_bytes / _MIB, 3)


# -- DeepSpeed ----------------------------------------------------------------------------

_DS_MARKERS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "fp16", "bf16", "bfloat16", "gradient_clipping", "zero_allow_untested_optimizer", "steps_per_print",
    "wall_clock_breakdown", "communication_data_type",
})

_SCRIPT_OWN = "the script's own: torsh-tune does not change it"
_DS_TOP_REASONS = {
    "train_batch_size": f"the batch size is {_SCRIPT_OWN} (its DataLoader)",
    "train_micro_batch_size_per_gpu": f"the batch size is {_SCRIPT_OWN} (its DataLoader)",
    "optimizer": f"the optimizer is {_SCRIPT_OWN}",
    "scheduler": f"the learning-rate schedule is {_SCRIPT_OWN} (see training.lr_scaling for world-size scaling)",
    "steps_per_print": "logging: torsh-tune's profiler records every step",
    "wall_clock_breakdown": "timing: torsh-tune's profiler records the step breakdown",
    "memory_breakdown": "memory logging: torsh-tune's profiler records peak memory per step",
    "dump_state": "DeepSpeed debugging output",
    "flops_profiler": "monitoring: torsh-tune's profiler and reports replace it",
    "comms_logger": "monitoring: torsh-tune's profiler records communication",
    "tensorboard": "monitoring: torsh-tune writes its own reports and dashboard",
    "wandb": "monitoring: torsh-tune writes its own reports and dashboard",
    "csv_monitor": "monitoring: torsh-tune writes its own reports and dashboard",
    "comet": "monitoring: torsh-tune writes its own reports and dashboard",
    "activation_checkpointing": f"activation checkpointing is {_SCRIPT_OWN} (torch.utils.checkpoint)",
    "prescale_gradients": "DDP and FSDP2 average gradients over the world size themselves",
    "gradient_predivide_factor": "DDP and FSDP2 average gradients over the world size themselves",
    "sparse_gradients": "DDP handles sparse gradients itself",
    "zero_allow_untested_optimizer": "a DeepSpeed-only optimizer check",
    "zero_force_ds_cpu_optimizer": "a DeepSpeed-only optimizer check",
    "amp": "apex AMP: use torch.autocast in the script (or fsdp.mixed_precision)",
    "pipeline": "DeepSpeed PipelineModule settings: use strategy kind 'pipeline' with pipeline.split_points",
    "elasticity": "use launch.max_restarts (torchrun elastic restarts)",
    "checkpoint": f"checkpointing is {_SCRIPT_OWN}",
    "seed": f"seeding is {_SCRIPT_OWN}",
}

_DS_ZERO_REASONS = {
    "overlap_comm": "DDP and FSDP2 always overlap gradient communication with backward",
    "contiguous_gradients": "DDP and FSDP2 manage gradient memory themselves (for DDP see ddp.gradient_as_bucket_view)",
    "reduce_scatter": "FSDP2 always reduce-scatters gradients; DDP all-reduces them",
    "allgather_partitions": "FSDP2 always all-gathers the parameters of one wrapped module at a time",
    "stage3_prefetch_bucket_size": "FSDP2 prefetches the next wrapped module's all-gather; it has no size knob",
    "prefetch_bucket_size": "FSDP2 prefetches the next wrapped module's all-gather; it has no size knob",
    "stage3_param_persistence_threshold": "FSDP2 shards every wrapped module; leave small modules out of fsdp.wrap instead",
    "param_persistence_threshold": "FSDP2 shards every wrapped module; leave small modules out of fsdp.wrap instead",
    "stage3_max_live_parameters": "FSDP2 frees parameters per wrapped module (fsdp.reshard_after_forward); no count knob",
    "stage3_max_reuse_distance": "FSDP2 frees parameters per wrapped module (fsdp.reshard_after_forward); no distance knob",
    "stage3_gather_16bit_weights_on_model_save": f"checkpointing is {_SCRIPT_OWN}",
    "gather_16bit_weights_on_model_save": f"checkpointing is {_SCRIPT_OWN}",
    "zero_hpz_partition_size": "ZeRO++ hierarchical partitioning: the torsh-tune counterpart is strategy kind 'hsdp' "
                               "(shard within a node, replicate across nodes)",
    "mics_shard_size": "MiCS sharding groups: the torsh-tune counterpart is strategy kind 'hsdp' with fsdp.replicate_degree",
    "mics_hierarchical_params_gather": "MiCS: the torsh-tune counterpart is strategy kind 'hsdp'",
    "zero_quantized_weights": "ZeRO++ quantised collectives have no FSDP2 counterpart",
    "zero_quantized_nontrainable_weights": "ZeRO++ quantised collectives have no FSDP2 counterpart",
    "zero_quantized_gradients": "ZeRO++ quantised collectives have no FSDP2 counterpart",
}
_DS_INTERNAL = "a DeepSpeed-internal knob without a DDP/FSDP2 counterpart"
_DS_OFFLOAD_REASON = "FSDP2's CPUOffloadPolicy has no such option (it pins host memory itself)"
_DS_LOSS_SCALE = "loss scaling is the script's own (torch.amp.GradScaler)"


def looks_like_deepspeed(doc: Any) -> bool:
    """Whether a parsed JSON document is a DeepSpeed config (it has a DeepSpeed-only top-level key)."""
    return isinstance(doc, dict) and any(k in _DS_MARKERS for k in doc)


def from_deepspeed(doc: dict[str, Any]) -> ImportResult:
    """Map a DeepSpeed config (ds_config.json) onto DDP or FSDP2.

    ZeRO stage 0 is DDP; stages 1 and 2 are FSDP2 grad-op shard (`reshard_after_forward =
    false`: parameters stay gathered from forward to backward, gradients and optimizer
    state are sharded); stage 3 is FSDP2 full shard. `offload_param`/`offload_optimizer`
    to the CPU become `fsdp.cpu_offload`; fp16/bf16 become `fsdp.mixed_precision`;
    `communication_data_type` becomes `fsdp.reduce_dtype` (FSDP) or gradient compression
    (DDP); `reduce_bucket_size` (elements, fp32: x 4 bytes) becomes `ddp.bucket_cap_mb`;
    `gradient_accumulation_steps` and `gradient_clipping` go to `[training]`.

    Raises:
        ConfigError: a mapped value is invalid (e.g. ZeRO stage 4, fp16 and bf16 both on).

    Example:
        >>> r = from_deepspeed({"zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7}})
        >>> r.config["ddp"]["bucket_cap_mb"]
        190.735
    """
    doc = _table("DeepSpeed config", doc)
    b = _Builder("deepspeed")
    zero_raw = doc.get("zero_optimization", {})
    if isinstance(zero_raw, bool):  # old DeepSpeed: `"zero_optimization": true` meant stage 1
        zero: dict[str, Any] = {"stage": 1 if zero_raw else 0}
    else:
        zero = _table("deepspeed zero_optimization", zero_raw)
    stage_raw = zero.get("stage", 0)
    if _is_auto(stage_raw):
        b.skip("zero_optimization.stage", "'auto' is not a ZeRO stage torsh-tune can map; stage 0 (DDP) assumed")
        b.note(_AUTO_NOTE)
        stage_raw = 0
    stage = _integer("deepspeed zero_optimization.stage", stage_raw, minimum=0)
    if stage > 3:
        raise invalid("deepspeed zero_optimization.stage", "0, 1, 2 or 3", stage)
    kind = "ddp" if stage == 0 else "fsdp"
    b.set("strategy", "kind", kind)
    if stage in (1, 2):
        b.set("fsdp", "reshard_after_forward", False)
        if stage == 1:
            b.note("ZeRO-1 shards only optimizer state; FSDP2 has no optimizer-only mode, so its closest mode, "
                   "grad-op shard (reshard_after_forward = false), also shards gradients")
    elif stage == 3:
        b.set("fsdp", "reshard_after_forward", True)

    fp16 = _ds_precision(b, doc, "fp16", kind)
    bf16 = _ds_precision(b, doc, "bf16", kind)
    bf16 = _ds_precision(b, doc, "bfloat16", kind) or bf16  # DeepSpeed's older spelling
    if kind == "fsdp" and (fp16 or bf16):
        b.set("fsdp", "mixed_precision", "fp16" if fp16 else "bf16")
        if "communication_data_type" not in doc:
            b.note("DeepSpeed reduces gradients in the model's half precision by default; torsh-tune reduces them "
                   "in fp32 unless communication_data_type (fsdp.reduce_dtype) is set")

    for key, value in doc.items():
        if key in ("zero_optimization", "fp16", "bf16", "bfloat16"):
            continue
        if key == "communication_data_type":
            _ds_comm_dtype(b, value, kind)
        elif key == "gradient_accumulation_steps":
            if _is_auto(value):
                b.skip(key, "'auto' (set by the Hugging Face Trainer); training.gradient_accumulation_steps stays 1")
                b.note(_AUTO_NOTE)
            else:
                b.set("training", "gradient_accumulation_steps",
                      _integer("deepspeed gradient_accumulation_steps", value, minimum=1))
        elif key == "gradient_clipping":
            if _is_auto(value):
                b.skip(key, "'auto' (set by the Hugging Face Trainer); training.max_grad_norm stays unset")
                b.note(_AUTO_NOTE)
            elif _number("deepspeed gradient_clipping", value, minimum=0.0, strict=False) == 0:
                b.note("gradient_clipping = 0 means no clipping in DeepSpeed; training.max_grad_norm stays unset")
            else:
                b.set("training", "max_grad_norm", float(value))
        else:
            b.skip(key, _DS_TOP_REASONS.get(key, "no torsh-tune counterpart"))
            if _is_auto(value):
                b.note(_AUTO_NOTE)

    for key, value in zero.items():
        dotted = f"zero_optimization.{key}"
        if key == "stage":
            continue
        if key in ("offload_param", "offload_optimizer"):
            _ds_offload(b, dotted, value, kind)
        elif key == "cpu_offload":  # DeepSpeed < 0.3.16 spelling of offload_optimizer
            if _flag(f"deepspeed {dotted}", value):
                _ds_offload(b, dotted, {"device": "cpu"}, kind)
        elif key == "reduce_bucket_size":
            _ds_bucket(b, dotted, value, kind)
        elif key == "allgather_bucket_size":
            reason = ("DDP all-reduces gradients and never all-gathers parameters" if kind == "ddp" else
                      "FSDP2 has no bucket knob: it all-gathers one wrapped module at a time (size units with fsdp.wrap)")
            b.skip(dotted, reason)
        else:
            b.skip(dotted, _DS_ZERO_REASONS.get(key, _DS_INTERNAL))
            if _is_auto(value):
                b.note(_AUTO_NOTE)
    return b.result()


def _ds_precision(b: _Builder, doc: dict[str, Any], name: str, kind: str) -> bool:
    """Walk an fp16/bf16 section; True when it enables that precision."""
    if name not in doc:
        return False
    section = _table(f"deepspeed {name}", doc[name])
    enabled = section.get("enabled", False)
    on = False
    if _is_auto(enabled):
        b.skip(f"{name}.enabled", "'auto' (set by the Hugging Face Trainer from --fp16/--bf16); not imported")
        b.note(_AUTO_NOTE)
    else:
        on = _flag(f"deepspeed {name}.enabled", enabled)
        for other in ("bf16", "bfloat16") if name == "fp16" else ("fp16",):
            if on and other in doc and _ds_enabled(doc[other]):
                raise invalid(f"deepspeed {name}.enabled", f"false when {other}.enabled is true (one mixed precision)",
                              True)
        if on and kind == "ddp":
            comp = "fp16" if name == "fp16" else "bf16"
            b.skip(f"{name}.enabled", "DDP has no mixed-precision policy: the compute dtype is the script's own "
                                      f"(torch.autocast); set compression.method = '{comp}' to halve all-reduce bytes "
                                      "as DeepSpeed's half-precision gradients do")
            on = False
    for key, value in section.items():
        if key == "enabled":
            continue
        if key == "auto_cast":
            b.skip(f"{name}.{key}", "autocast is the script's own (torch.autocast)")
        elif name == "fp16":
            b.skip(f"{name}.{key}", _DS_LOSS_SCALE)
        else:
            b.skip(f"{name}.{key}", "no FSDP2 counterpart")
    return on


def _ds_enabled(section: Any) -> bool:
    """Whether an fp16/bf16 section is on (for the conflict check; invalid values are reported elsewhere)."""
    enabled = section.get("enabled", False) if isinstance(section, dict) else False
    return enabled is True or (isinstance(enabled, (str, int)) and str(enabled).strip().lower() in _TRUE)


_DS_COMM_DTYPES = {"fp16": "fp16", "half": "fp16", "bf16": "bf16", "bfp16": "bf16", "bfloat16": "bf16",
                   "fp32": "fp32", "float": "fp32", "float32": "fp32"}


def _ds_comm_dtype(b: _Builder, value: Any, kind: str) -> None:
    if _is_auto(value):
        b.skip("communication_data_type", "'auto'; not imported")
        b.note(_AUTO_NOTE)
        return
    dtype = _DS_COMM_DTYPES.get(value.strip().lower()) if isinstance(value, str) else None
    if dtype is None:
        raise invalid("deepspeed communication_data_type", "one of 'fp16', 'bf16' or 'fp32'", value)
    if kind == "fsdp":
        b.set("fsdp", "reduce_dtype", dtype)
    elif dtype != "fp32":
        b.set("compression", "method", dtype)
        b.note(f"communication_data_type = {value!r} on DDP becomes the {dtype} compression comm hook")


def _ds_offload(b: _Builder, dotted: str, value: Any, kind: str) -> None:
    section = _table(f"deepspeed {dotted}", value)
    device = section.get("device", "none")
    device = device.strip().lower() if isinstance(device, str) else device
    if device not in ("cpu", "nvme", "none", None):
        raise invalid(f"deepspeed {dotted}.device", "one of 'cpu', 'nvme' or 'none'", section.get("device"))
    if device == "cpu":
        if kind == "ddp":
            b.skip(f"{dotted}.device", "offloading needs sharding (ZeRO stage >= 1 / FSDP); DDP keeps everything on the device")
        else:
            b.set("fsdp", "cpu_offload", True)
            b.note("FSDP2's CPUOffloadPolicy offloads parameters, gradients and optimizer state together "
                   f"({dotted} alone offloads less in DeepSpeed)")
    elif device == "nvme":
        b.skip(f"{dotted}.device", "NVMe offload (ZeRO-Infinity) has no FSDP2 counterpart; fsdp.cpu_offload is the closest")
    for key in section:
        if key != "device":
            b.skip(f"{dotted}.{key}", _DS_OFFLOAD_REASON)


def _ds_bucket(b: _Builder, dotted: str, value: Any, kind: str) -> None:
    if _is_auto(value):
        b.skip(dotted, "'auto' (set by the Hugging Face Trainer from the model's hidden size); not imported")
        b.note(_AUTO_NOTE)
        return
    elements = _number(f"deepspeed {dotted}", value)
    if kind != "ddp":
        b.skip(dotted, "FSDP2 has no bucket knob: it reduce-scatters one wrapped module's gradients at a time "
                       "(size units with fsdp.wrap)")
        return
    b.set("ddp", "bucket_cap_mb", _mib(elements * 4))
    b.note(f"{dotted} = {elements:g} elements x 4 bytes (fp32 gradients) = {_mib(elements * 4):g} MiB DDP buckets")


# -- Horovod ------------------------------------------------------------------------------

_HVD_REASONS = {
    "cycle_time": "DDP launches each bucket's all-reduce as soon as its gradients are ready; there is no cycle",
    "cycle_time_ms": "DDP launches each bucket's all-reduce as soon as its gradients are ready; there is no cycle",
    "hierarchical_allgather": "DDP all-reduces gradients and never all-gathers them",
    "timeline": "use torsh-tune's deep-trace windows (--trace-window) instead of the Horovod timeline",
    "timeline_mark_cycles": "use torsh-tune's deep-trace windows (--trace-window) instead of the Horovod timeline",
    "autotune": "use `torsh-tune tune` (an Optuna study over the DDP knobs)",
    "autotune_log": "use `torsh-tune tune` (an Optuna study over the DDP knobs)",
    "cache_capacity": "DDP has no response cache (it builds its buckets once)",
    "num_nccl_streams": "DDP uses one NCCL stream per process group",
    "gradient_predivide_factor": "DDP averages gradients over the world size itself",
    "op": "DDP averages gradients (Horovod's Average); Sum and Adasum have no DDP counterpart",
    "np": "the number of processes is set by --nproc-per-node and --nnodes",
    "num_proc": "the number of processes is set by --nproc-per-node and --nnodes",
    "hosts": "hosts are set by the launcher (--nnodes, --rdzv-endpoint or --launcher)",
    "log_level": "torsh-tune writes its own logs",
    "stall_check_disable": "torsh-tune detects hangs with budget.no_progress_timeout_s",
    "stall_check_time_seconds": "torsh-tune detects hangs with budget.no_progress_timeout_s",
    "stall_shutdown_time_seconds": "torsh-tune detects hangs with budget.no_progress_timeout_s",
}
_HVD_COMPRESSION = {"fp16": "fp16", "none": "none", "bf16": "bf16"}
_HVD_KEYS = frozenset({"fusion_threshold", "fusion_threshold_mb", "compression", "hierarchical_allreduce",
                       "backward_passes_per_step"}) | frozenset(_HVD_REASONS)


def _hvd_key(key: str) -> str:
    """HOROVOD_FUSION_THRESHOLD, --fusion-threshold-mb and fusion_threshold_mb all become fusion_threshold[_mb]."""
    k = key.strip().lstrip("-").lower().replace("-", "_")
    return k[len("horovod_"):] if k.startswith("horovod_") else k


def from_horovod(settings: dict[str, Any]) -> ImportResult:
    """Map Horovod settings (environment names like HOROVOD_FUSION_THRESHOLD or horovodrun flags) onto DDP.

    `HOROVOD_FUSION_THRESHOLD` (bytes) or `fusion_threshold_mb` become `ddp.bucket_cap_mb`;
    `compression = "fp16"` (hvd.Compression.fp16) becomes the fp16 compression hook;
    `HOROVOD_HIERARCHICAL_ALLREDUCE=1` becomes `collectives.hierarchical`;
    `backward_passes_per_step` becomes `training.gradient_accumulation_steps`.

    Raises:
        ConfigError: a mapped value is invalid (e.g. a negative fusion threshold).

    Example:
        >>> from_horovod({"HOROVOD_FUSION_THRESHOLD": "67108864"}).config["ddp"]
        {'bucket_cap_mb': 64.0}
    """
    settings = _table("Horovod settings", settings)
    b = _Builder("horovod")
    b.set("strategy", "kind", "ddp")
    hierarchical_key = None
    for key, value in settings.items():
        k = _hvd_key(key)
        what = f"horovod {key}"
        if k in ("fusion_threshold", "fusion_threshold_mb"):
            limit = _number(what, value, minimum=0.0, strict=False)
            if limit == 0:
                b.skip(key, "0 disables Horovod's tensor fusion; DDP always buckets (the smallest bucket is "
                            "ddp.bucket_cap_mb > 0)")
                continue
            mb = _mib(limit) if k == "fusion_threshold" else limit
            b.set("ddp", "bucket_cap_mb", mb)
            if k == "fusion_threshold":
                b.note(f"{key} = {limit:g} bytes = {mb:g} MiB DDP buckets")
        elif k == "compression":
            name = value.strip().lower().rpartition(".")[2] if isinstance(value, str) else None
            method = _HVD_COMPRESSION.get(name) if name else None
            if method is None:
                raise invalid(what, "'none' or 'fp16' (hvd.Compression.none / hvd.Compression.fp16)", value)
            b.set("compression", "method", method)
        elif k == "hierarchical_allreduce":
            if _flag(what, value):
                b.set("collectives", "hierarchical", True)
                hierarchical_key = key
        elif k == "backward_passes_per_step":
            b.set("training", "gradient_accumulation_steps", _integer(what, value, minimum=1))
        else:
            b.skip(key, _HVD_REASONS.get(k, "no torsh-tune counterpart"))
    if hierarchical_key and b.get("compression", "method", "none") != "none":
        b.patch["collectives"].pop("hierarchical")
        if not b.patch["collectives"]:
            del b.patch["collectives"]
        b.skip(hierarchical_key, "cannot be combined with gradient compression in torsh-tune (both are the DDP comm "
                                 "hook); compression was kept")
    return b.result()


# -- FSDP1 --------------------------------------------------------------------------------

_FSDP1_SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_FSDP1_REASONS = {
    "backward_prefetch": "FSDP2 always prefetches the next all-gather in backward (BACKWARD_PRE behaviour)",
    "forward_prefetch": "FSDP2 prefetches implicitly; explicit prefetch is set_modules_to_forward_prefetch in code",
    "limit_all_gathers": "FSDP2 bounds in-flight all-gathers with its stream design; it has no rate limiter",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "sync_module_states": "FSDP2 has no broadcast at wrap time: every rank must build the same weights (same seed) "
                          "or load a checkpoint",
    "device_id": "FSDP2 uses the device of the model's parameters (the script's own)",
    "process_group": "the process group or mesh is built by torsh-tune from the launch and strategy kind",
    "device_mesh": "the process group or mesh is built by torsh-tune from the launch and strategy kind",
    "param_init_fn": "initialisation is the script's own",
    "ignored_modules": "FSDP2 shards the modules named by fsdp.wrap; others stay with their parent",
    "ignored_states": "FSDP2 shards the modules named by fsdp.wrap; others stay with their parent",
    "state_dict_type": "checkpointing is the script's own (torch.distributed.checkpoint)",
    "activation_checkpointing": "activation checkpointing is the script's own (torch.utils.checkpoint)",
    "min_num_params": "FSDP2 wraps by module, not by size: name the units with fsdp.wrap",
}
_FSDP1_KEYS = frozenset({"sharding_strategy", "mixed_precision", "cpu_offload", "auto_wrap_policy",
                         "transformer_layer_cls", "transformer_layer_cls_to_wrap"}) | frozenset(_FSDP1_REASONS)
_DTYPES = {
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "fp16": "fp16", "half": "fp16",
    "float32": "fp32", "fp32": "fp32", "float": "fp32",
}


def _dtype(what: str, value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text is not None and text.startswith("torch."):
        text = text[len("torch."):]
    dtype = _DTYPES.get(text) if text is not None else None
    if dtype is None:
        raise invalid(what, "a dtype: torch.bfloat16, torch.float16 or torch.float32 (or bf16, fp16, fp32)", value)
    return dtype


def from_fsdp1_kwargs(kwargs: dict[str, Any]) -> ImportResult:
    """Map FSDP1 `FullyShardedDataParallel(...)` keyword arguments onto FSDP2 (`fully_shard`).

    sharding_strategy FULL_SHARD is FSDP2 full shard, SHARD_GRAD_OP grad-op shard
    (`reshard_after_forward = false`), NO_SHARD DDP, HYBRID_SHARD (and _HYBRID_SHARD_ZERO2)
    strategy kind `hsdp`: FSDP2 on a 2-D (replicate x shard) mesh. `mixed_precision`
    (param_dtype, reduce_dtype) and `cpu_offload` carry over; enum spellings such as
    "ShardingStrategy.FULL_SHARD" and dtypes such as "torch.bfloat16" are accepted.

    Raises:
        ConfigError: an unknown sharding strategy or dtype, or a malformed value.

    Example:
        >>> from_fsdp1_kwargs({"sharding_strategy": "ShardingStrategy.SHARD_GRAD_OP"}).config
        {'strategy': {'kind': 'fsdp'}, 'fsdp': {'reshard_after_forward': False}}
    """
    kwargs = _table("FSDP1 keyword arguments", kwargs)
    b = _Builder("fsdp1")
    raw = kwargs.get("sharding_strategy")
    if raw is None:
        strategy = "FULL_SHARD"
        b.note("no sharding_strategy: FSDP1's default FULL_SHARD assumed")
    else:
        strategy = raw.strip().rpartition(".")[2].upper() if isinstance(raw, str) else None
        if strategy not in _FSDP1_SHARDING:
            raise invalid("fsdp1 sharding_strategy", f"one of {list(_FSDP1_SHARDING)}", raw)
    if strategy == "NO_SHARD":
        kind = "ddp"
        b.note("NO_SHARD replicates parameters and all-reduces gradients: that is DDP")
    elif strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        kind = "hsdp"
        b.note("HYBRID_SHARD becomes FSDP2 on a 2-D (replicate x shard) mesh, not FSDP1's hybrid mode: FSDP1 "
               "HYBRID_SHARD silently degrades to plain FULL_SHARD on one host, while the 2-D mesh's replicate "
               "degree is explicit (fsdp.replicate_degree, default: the number of nodes)")
    else:
        kind = "fsdp"
    b.set("strategy", "kind", kind)
    if kind != "ddp":
        b.set("fsdp", "reshard_after_forward", strategy in ("FULL_SHARD", "HYBRID_SHARD"))

    for key, value in kwargs.items():
        if key == "sharding_strategy":
            continue
        if key == "mixed_precision":
            _fsdp1_mixed_precision(b, value, kind)
        elif key == "cpu_offload":
            if isinstance(value, dict):
                unknown = sorted(set(value) - {"offload_params"})
                for sub in unknown:
                    b.skip(f"cpu_offload.{sub}", "FSDP2's CPUOffloadPolicy has no such option")
                on = _flag("fsdp1 cpu_offload.offload_params", value.get("offload_params", False))
            elif value is None:
                on = False
            else:
                on = _flag("fsdp1 cpu_offload", value)
            if on and kind == "ddp":
                b.skip("cpu_offload", "offloading needs sharding; with NO_SHARD (DDP) everything stays on the device")
            elif on:
                b.set("fsdp", "cpu_offload", True)
        elif key in ("auto_wrap_policy", "transformer_layer_cls", "transformer_layer_cls_to_wrap"):
            _fsdp1_wrap(b, key, value, kind)
        else:
            b.skip(key, _FSDP1_REASONS.get(key, "not an FSDP1 argument torsh-tune knows"))
    return b.result()


def _fsdp1_mixed_precision(b: _Builder, value: Any, kind: str) -> None:
    if value is None:
        return
    mp = _table("fsdp1 mixed_precision", value)
    if kind == "ddp":
        b.skip("mixed_precision", "DDP has no mixed-precision policy: the compute dtype is the script's own "
                                  "(torch.autocast)")
        return
    for key, sub in mp.items():
        if key == "param_dtype":
            dtype = _dtype("fsdp1 mixed_precision.param_dtype", sub) if sub is not None else "fp32"
            b.set("fsdp", "mixed_precision", "none" if dtype == "fp32" else dtype)
        elif key == "reduce_dtype":
            if sub is not None:
                b.set("fsdp", "reduce_dtype", _dtype("fsdp1 mixed_precision.reduce_dtype", sub))
        elif key == "buffer_dtype":
            b.skip("mixed_precision.buffer_dtype", "FSDP2 leaves buffers in the module's own dtype")
        elif key in ("cast_forward_inputs", "cast_root_forward_inputs"):
            b.skip(f"mixed_precision.{key}", "FSDP2 always casts floating-point forward inputs to param_dtype")
        elif key == "keep_low_precision_grads":
            b.skip("mixed_precision.keep_low_precision_grads", "FSDP2 keeps gradients in the sharded parameters' dtype")
        else:
            b.skip(f"mixed_precision.{key}", "not a MixedPrecision field torsh-tune knows")


def _fsdp1_wrap(b: _Builder, key: str, value: Any, kind: str) -> None:
    if kind == "ddp":
        b.skip(key, "NO_SHARD (DDP) wraps nothing")
        return
    names = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple, set)) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise invalid(f"fsdp1 {key}", "a policy or class name, or a list of names", value)
    if key == "auto_wrap_policy" and not any("transformer" in n.lower() for n in names):
        b.skip(key, f"{', '.join(names)}: FSDP2 wraps by module name (fsdp.wrap patterns such as 'blocks.*'), "
                    "not by policy")
        return
    b.note(f"{key} = {', '.join(names)}: fsdp.wrap stays at its default (every child of the model's "
           "ModuleList/Sequential blocks), which is the transformer layers in most models; fsdp.wrap takes "
           "module names such as 'layers.*', not class names")


# -- files --------------------------------------------------------------------------------

_IMPORTERS: dict[str, Callable[[dict[str, Any]], ImportResult]] = {
    "deepspeed": from_deepspeed,
    "horovod": from_horovod,
    "fsdp1": from_fsdp1_kwargs,
}


def _detect(doc: dict[str, Any]) -> str | None:
    if looks_like_deepspeed(doc):
        return "deepspeed"
    if "sharding_strategy" in doc or any(k in _FSDP1_KEYS for k in doc):
        return "fsdp1"
    if any(_hvd_key(str(k)) in _HVD_KEYS or str(k).upper().startswith("HOROVOD_") for k in doc):
        return "horovod"
    return None


def import_file(path: str | Path, fmt: str = "auto") -> ImportResult:
    """Read a DeepSpeed, Horovod or FSDP1 settings file (JSON or TOML) and import it.

    `fmt = "auto"` detects the format from the keys: DeepSpeed-only keys
    (zero_optimization, train_batch_size, fp16, ...), FSDP1 arguments (sharding_strategy,
    auto_wrap_policy, ...) or Horovod names (HOROVOD_*, fusion_threshold_mb, ...).

    Raises:
        ConfigError: a missing or unreadable file, an undetectable format, or a bad value.
    """
    if fmt not in IMPORT_FORMATS:
        raise invalid("import format", f"one of {list(IMPORT_FORMATS)}", fmt)
    p = Path(path)
    if not p.is_file():
        raise invalid("FILE", "an existing JSON or TOML file", str(path))
    text = p.read_text()
    if p.suffix == ".toml":
        try:
            doc: Any = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} must be valid TOML, but got: {exc}") from None
    else:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} must be valid JSON, but got: {exc}") from None
    if not isinstance(doc, dict):
        raise invalid(str(path), "a JSON object or TOML table of settings", type(doc).__name__)
    if fmt == "auto":
        detected = _detect(doc)
        if detected is None:
            raise invalid(str(path), "a DeepSpeed, Horovod or FSDP1 settings file (or pass --from)",
                          f"keys {sorted(doc)[:5]}")
        fmt = detected
    return _IMPORTERS[fmt](doc)


def load_config_file(path: str | Path) -> RunConfig:
    """Load the RunConfig of `--config`: a torsh-tune .toml or .json file, or a DeepSpeed ds_config.json imported.

    A DeepSpeed config's keys that have no torsh-tune counterpart are listed on stderr
    (`from_deepspeed` maps the rest).

    Raises:
        ConfigError: a missing or unparsable file, or a bad value.
    """
    p = Path(path)
    if not p.is_file():
        raise invalid("--config", "an existing TOML or JSON file", str(path))
    text = p.read_text()
    if p.suffix != ".json":
        return RunConfig.from_toml(text, source=str(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config must be valid JSON, but got: {exc}") from None
    if not looks_like_deepspeed(data):
        return RunConfig.from_dict(data)
    result = from_deepspeed(data)
    for line in result.unsupported:
        print(f"torsh-tune: warning: {path}: not imported: {line}", file=sys.stderr)
    return result.to_run_config()
