"""Run configuration: frozen dataclasses, TOML/JSON (de)serialisation and validation.

One `RunConfig` document describes a run. The CLI builds it from a TOML file overlaid with
flags; the launcher serialises it to JSON and hands it to every rank through a single
environment variable, where `RunConfig.from_json` parses it once.

Every field carries its help text in `metadata["help"]`; the CLI uses that text verbatim.
All cross-field validation lives in `RunConfig.validate` (one place, as in torchtitan's
`ParallelDims._validate`).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError, invalid

__all__ = [
    "BACKENDS",
    "BudgetConfig",
    "CompressionConfig",
    "DDPConfig",
    "DataLoaderConfig",
    "LaunchConfig",
    "ProfilerConfig",
    "RunConfig",
    "StrategyConfig",
    "ThresholdsConfig",
    "dump_toml",
    "help_of",
    "load_config_file",
    "parse_trace_window",
]

BACKENDS = ("auto", "gloo", "nccl")


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """How torchrun is started."""

    nproc_per_node: int = _f(1, "Worker processes per node (torchrun --nproc-per-node).")
    nnodes: int = _f(1, "Number of nodes; > 1 uses rendezvous instead of --standalone.")
    node_rank: int | None = _f(None, "This node's rank for static rendezvous (torchrun --node-rank).")
    rdzv_backend: str = _f("c10d", "Rendezvous backend for multi-node runs (c10d, etcd, static).")
    rdzv_endpoint: str | None = _f(None, "HOST:PORT of the rendezvous for multi-node runs.")
    rdzv_id: str | None = _f(None, "Rendezvous job id shared by all nodes (default: the run name).")
    backend: Literal["auto", "gloo", "nccl"] = _f(
        "auto", "Process-group backend: auto picks nccl when CUDA is available, else gloo."
    )
    launcher: str | None = _f(
        None, "Command template wrapping torchrun for clusters, e.g. 'srun -N2 {cmd}'."
    )
    max_restarts: int = _f(0, "torchrun elastic restarts after a worker failure.")
    env: dict = _f({}, "Extra environment variables for every rank.")


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """How long a run may go on."""

    steps: int | None = _f(
        None, "Measured optimizer steps after warm-up; the script is stopped cleanly on every rank after them."
    )
    warmup_steps: int = _f(5, "Steps excluded from statistics at the start of the run.")
    timeout_s: float | None = _f(None, "Wall-clock limit of the whole run in seconds.")
    no_progress_timeout_s: float = _f(
        300.0, "A run that writes no step record for this many seconds is a hang and is stopped."
    )
    kill_grace_s: float = _f(10.0, "Seconds between SIGTERM and SIGKILL when a run is stopped.")


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    """The always-on profiler inside each rank."""

    enabled: bool = _f(True, "Record step, communication and system records.")
    loss_every: int = _f(10, "Read the loss every k steps (a host sync on GPU, so not every step).")
    system_interval_s: float = _f(1.0, "Seconds between system samples (CPU, RSS, NVML).")
    flush_interval_s: float = _f(1.0, "Records are flushed to disk at least this often.")
    comm_hook_timing: bool = _f(
        False,
        "Time every DDP bucket with a Python comm-hook wrapper (per-bucket records, a future hop per bucket). "
        "Off: PyTorch's C++ all-reduce stays and DDP's own timers give one record per step; a Python hook "
        "(the script's or compression) is always timed per bucket, at no extra cost.",
    )
    trace_window: str | None = _f(
        None, "Deep-trace steps START:LEN with torch.profiler, e.g. '20:5' traces steps 20-24 (0-based, as in step records)."
    )
    trace_every: int | None = _f(None, "Deep-trace trace_len steps every N steps (windows start at steps N, 2N, ...).")
    trace_len: int = _f(3, "Steps per deep-trace window for trace_every and trace_on_anomaly.")
    trace_on_anomaly: bool = _f(
        False, "Deep-trace trace_len steps when a step is slower than trace_anomaly_factor x the running median step."
    )
    trace_anomaly_factor: float = _f(2.0, "A step slower than this many times the running median step is an anomaly.")
    trace_max_windows: int = _f(3, "At most this many anomaly-triggered deep-trace windows per run.")
    trace_shapes: bool = _f(False, "Record operator input shapes in deep traces (torch.profiler record_shapes).")
    trace_stack: bool = _f(False, "Record Python stacks in deep traces (torch.profiler with_stack; costly).")
    trace_memory: bool = _f(False, "Record allocations in deep traces (torch.profiler profile_memory).")

    @property
    def trace_window_steps(self) -> tuple[int, int] | None:
        """`trace_window` as (first step, number of steps), or None when unset."""
        return None if self.trace_window is None else parse_trace_window(self.trace_window)

    @property
    def traces_enabled(self) -> bool:
        """Whether any deep-trace window can open in this run."""
        return self.trace_window is not None or self.trace_every is not None or self.trace_on_anomaly


def parse_trace_window(text: str) -> tuple[int, int]:
    """Parse "START:LEN" (e.g. "20:5": steps 20-24) into (start, length).

    Raises:
        ConfigError: not two integers START >= 0 and LEN >= 1 separated by a colon.
    """
    rule = "START:LEN with integers START >= 0 and LEN >= 1 (e.g. '20:5')"
    parts = text.split(":") if isinstance(text, str) else []
    try:
        start, length = (int(x) for x in parts)
    except ValueError:
        raise invalid("profiler.trace_window", rule, text) from None
    if start < 0 or length < 1:
        raise invalid("profiler.trace_window", rule, text)
    return start, length


@dataclass(frozen=True, kw_only=True)
class ThresholdsConfig:
    """Bottleneck thresholds (the ToRSh guide's defaults)."""

    comm_high_pct: float = _f(30.0, "Exposed communication above this % of step time is high.")
    comm_critical_pct: float = _f(50.0, "Exposed communication above this % of step time is critical.")
    memory_high_pct: float = _f(85.0, "Peak memory above this % of capacity is high.")
    memory_critical_pct: float = _f(95.0, "Peak memory above this % of capacity is critical.")
    gpu_util_medium_pct: float = _f(80.0, "GPU utilisation below this % is a medium bottleneck.")
    io_high_pct: float = _f(10.0, "Data-loading wait above this % of step time is high.")
    io_critical_pct: float = _f(30.0, "Data-loading wait above this % of step time is critical.")
    straggler_pct: float = _f(
        10.0, "A rank later than the others by this % of the step is a straggler (medium; high above 2x, critical above 3x)."
    )


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """DistributedDataParallel knobs; None keeps the script's (or PyTorch's) own value."""

    bucket_cap_mb: float | None = _f(None, "Gradient bucket size in MiB (PyTorch default 25).")
    first_bucket_cap_mb: float | None = _f(None, "Size of the first bucket in MiB (PyTorch default 1).")
    gradient_as_bucket_view: bool | None = _f(None, "Let gradients alias bucket memory (saves a copy).")
    static_graph: bool | None = _f(None, "Declare the graph static (enables DDP optimisations).")
    find_unused_parameters: bool | None = _f(None, "Search for parameters without gradients each step.")
    broadcast_buffers: bool | None = _f(None, "Broadcast buffers from rank 0 before each forward.")


@dataclass(frozen=True, kw_only=True)
class DataLoaderConfig:
    """DataLoader overrides applied without code changes; None keeps the script's value."""

    num_workers: int | None = _f(None, "Worker processes per DataLoader.")
    prefetch_factor: int | None = _f(None, "Batches prefetched per worker (needs num_workers > 0).")
    pin_memory: bool | None = _f(None, "Pin host memory for faster host-to-GPU copies.")
    persistent_workers: bool | None = _f(None, "Keep workers alive between epochs.")


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """Gradient compression as a DDP comm hook (strategies.compression)."""

    method: Literal["none", "fp16", "bf16", "powersgd", "topk", "int8"] = _f(
        "none", "Gradient compression: none, fp16, bf16, powersgd, topk or int8 (a DDP comm hook)."
    )
    ratio: float = _f(0.01, "Top-K: fraction of each bucket's entries sent, in (0, 1].")
    rank: int = _f(4, "PowerSGD: rank of the low-rank gradient approximation (>= 1).")
    start_iter: int = _f(10, "PowerSGD: plain all-reduce for this many iterations before compressing.")
    error_feedback: bool = _f(True, "Add each bucket's compression error to its next gradient (lossy methods).")


@dataclass(frozen=True, kw_only=True)
class StrategyConfig:
    """What is applied to the user's training: parallelism and data-loading knobs."""

    kind: Literal["ddp"] = _f("ddp", "Parallelism strategy.")
    ddp: DDPConfig = _f(DDPConfig(), "DDP knobs.")
    dataloader: DataLoaderConfig = _f(DataLoaderConfig(), "DataLoader overrides.")
    compression: CompressionConfig = _f(CompressionConfig(), "Gradient compression.")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything one run needs; the single document handed to every rank."""

    launch: LaunchConfig = _f(LaunchConfig(), "Launch options.")
    budget: BudgetConfig = _f(BudgetConfig(), "Step and time budget.")
    profiler: ProfilerConfig = _f(ProfilerConfig(), "Always-on profiler options.")
    thresholds: ThresholdsConfig = _f(ThresholdsConfig(), "Bottleneck thresholds.")
    strategy: StrategyConfig = _f(StrategyConfig(), "Strategy applied to the script.")

    # -- validation -------------------------------------------------------------------
    def validate(self) -> "RunConfig":
        """Check every field and cross-field rule; raise ConfigError on the first violation."""
        _check_types(self, "")
        la, bu, pr, th = self.launch, self.budget, self.profiler, self.thresholds
        if la.nproc_per_node < 1:
            raise invalid("launch.nproc_per_node", "an integer >= 1", la.nproc_per_node)
        if la.nnodes < 1:
            raise invalid("launch.nnodes", "an integer >= 1", la.nnodes)
        if la.node_rank is not None and not 0 <= la.node_rank < la.nnodes:
            raise invalid("launch.node_rank", f"in [0, {la.nnodes - 1}]", la.node_rank)
        if la.nnodes > 1 and la.rdzv_endpoint is None and la.launcher is None:
            raise invalid("launch.rdzv_endpoint", "set (HOST:PORT) when nnodes > 1", None)
        if la.rdzv_endpoint is not None and ":" not in la.rdzv_endpoint:
            raise invalid("launch.rdzv_endpoint", "of the form HOST:PORT", la.rdzv_endpoint)
        if la.launcher is not None and "{cmd}" not in la.launcher:
            raise invalid("launch.launcher", "a template containing {cmd}", la.launcher)
        if la.max_restarts < 0:
            raise invalid("launch.max_restarts", "an integer >= 0", la.max_restarts)
        if bu.steps is not None and bu.steps < 1:
            raise invalid("budget.steps", "an integer >= 1", bu.steps)
        if bu.warmup_steps < 0:
            raise invalid("budget.warmup_steps", "an integer >= 0", bu.warmup_steps)
        for name in ("timeout_s",):
            v = getattr(bu, name)
            if v is not None and v <= 0:
                raise invalid(f"budget.{name}", "a number > 0", v)
        if bu.no_progress_timeout_s <= 0:
            raise invalid("budget.no_progress_timeout_s", "a number > 0", bu.no_progress_timeout_s)
        if bu.kill_grace_s < 0:
            raise invalid("budget.kill_grace_s", "a number >= 0", bu.kill_grace_s)
        if pr.loss_every < 1:
            raise invalid("profiler.loss_every", "an integer >= 1", pr.loss_every)
        for name in ("system_interval_s", "flush_interval_s"):
            if getattr(pr, name) <= 0:
                raise invalid(f"profiler.{name}", "a number > 0", getattr(pr, name))
        if pr.trace_window is not None:
            first, _ = parse_trace_window(pr.trace_window)
            if bu.steps is not None and first >= bu.warmup_steps + bu.steps:
                last = bu.warmup_steps + bu.steps - 1
                raise invalid("profiler.trace_window", f"a window starting by step {last} (the budget's last step)",
                              pr.trace_window)
        if pr.trace_len < 1:
            raise invalid("profiler.trace_len", "an integer >= 1", pr.trace_len)
        if pr.trace_every is not None and pr.trace_every <= pr.trace_len:
            raise invalid("profiler.trace_every", f"an integer > profiler.trace_len ({pr.trace_len})", pr.trace_every)
        if not pr.trace_anomaly_factor > 1.0:
            raise invalid("profiler.trace_anomaly_factor", "a number > 1", pr.trace_anomaly_factor)
        if pr.trace_max_windows < 1:
            raise invalid("profiler.trace_max_windows", "an integer >= 1", pr.trace_max_windows)
        for f in dataclasses.fields(th):
            v = getattr(th, f.name)
            if not 0 <= v <= 100:
                raise invalid(f"thresholds.{f.name}", "a percentage in [0, 100]", v)
        if th.comm_high_pct > th.comm_critical_pct:
            raise invalid("thresholds.comm_high_pct", "<= thresholds.comm_critical_pct", th.comm_high_pct)
        if th.io_high_pct > th.io_critical_pct:
            raise invalid("thresholds.io_high_pct", "<= thresholds.io_critical_pct", th.io_high_pct)
        if th.memory_high_pct > th.memory_critical_pct:
            raise invalid("thresholds.memory_high_pct", "<= thresholds.memory_critical_pct", th.memory_high_pct)
        ddp, dl = self.strategy.ddp, self.strategy.dataloader
        for name in ("bucket_cap_mb", "first_bucket_cap_mb"):
            v = getattr(ddp, name)
            if v is not None and v <= 0:
                raise invalid(f"ddp.{name}", "a number of MiB > 0", v)
        if dl.num_workers is not None and dl.num_workers < 0:
            raise invalid("dataloader.num_workers", "an integer >= 0", dl.num_workers)
        if dl.prefetch_factor is not None:
            if dl.prefetch_factor < 1:
                raise invalid("dataloader.prefetch_factor", "an integer >= 1", dl.prefetch_factor)
            if dl.num_workers == 0:
                raise invalid("dataloader.prefetch_factor", "unset when num_workers is 0", dl.prefetch_factor)
        if dl.persistent_workers and dl.num_workers == 0:
            raise invalid("dataloader.persistent_workers", "false when num_workers is 0", True)
        co = self.strategy.compression
        if not 0 < co.ratio <= 1:
            raise invalid("compression.ratio", "a fraction in (0, 1]", co.ratio)
        if co.rank < 1:
            raise invalid("compression.rank", "an integer >= 1", co.rank)
        if co.start_iter < 0:
            raise invalid("compression.start_iter", "an integer >= 0", co.start_iter)
        return self

    @property
    def world_size(self) -> int:
        return self.launch.nnodes * self.launch.nproc_per_node

    # -- (de)serialisation --------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return _build(cls, data, "").validate()

    @classmethod
    def from_json(cls, text: str) -> "RunConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_toml(cls, text: str, *, source: str = "config") -> "RunConfig":
        """Parse a TOML document. Strategy sections ([ddp], [dataloader]) may stand at top level."""
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source} must be valid TOML, but got: {exc}") from None
        return cls.from_dict(_hoist_strategy_sections(data))

    def replace(self, **sections: Any) -> "RunConfig":
        """A copy with whole sections or `section.field` overrides applied (validated)."""
        data = self.to_dict()
        for key, value in sections.items():
            data[key] = value
        return RunConfig.from_dict(data)

    def with_overrides(self, overrides: dict[str, Any]) -> "RunConfig":
        """Apply dotted overrides like {"budget.steps": 50, "strategy.ddp.bucket_cap_mb": 50}."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            node = data
            parts = dotted.split(".")
            for part in parts[:-1]:
                if part not in node or not isinstance(node[part], dict):
                    raise invalid("config key", "a known option", dotted)
                node = node[part]
            if parts[-1] not in node:
                raise invalid("config key", "a known option", dotted)
            node[parts[-1]] = value
        return RunConfig.from_dict(data)

    def apply_patch(self, patch: dict[str, Any]) -> "RunConfig":
        """Apply a recommendation's `config_patch` (strategy sections such as {"ddp": {...}})."""
        data = self.to_dict()
        for section, values in _hoist_strategy_sections(patch).items():
            if not isinstance(values, dict):
                raise invalid("config patch section", "a table", section)
            for key, sub in values.items():
                target = data.setdefault(section, {})
                if isinstance(sub, dict) and isinstance(target.get(key), dict):
                    target[key].update(sub)
                else:
                    target[key] = sub
        return RunConfig.from_dict(data)


_STRATEGY_SECTIONS = {f.name for f in dataclasses.fields(StrategyConfig)} - {"kind"}


def _hoist_strategy_sections(data: dict[str, Any]) -> dict[str, Any]:
    """Accept ToRSh-style top-level [ddp]/[dataloader] tables as strategy sub-sections."""
    out = dict(data)
    strategy = dict(out.pop("strategy", {}) or {})
    for name in list(out):
        if name in _STRATEGY_SECTIONS:
            strategy[name] = out.pop(name)
    if strategy:
        out["strategy"] = strategy
    return out


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise invalid(path or "config", "a table", data)
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(names))
    if unknown:
        where = f"{path}." if path else ""
        raise invalid(f"config key {where}{unknown[0]}", f"one of {sorted(names)}", unknown[0])
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        sub = f"{path}.{name}" if path else name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, sub)
        else:
            kwargs[name] = _coerce(hint, value, sub)
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin is Literal:
        if value not in args:
            raise invalid(path, f"one of {list(args)}", value)
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise invalid(path, "true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(path, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(path, "a number", value)
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise invalid(path, "a string", value)
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, dict):
            raise invalid(path, "a table", value)
        return {str(k): str(v) for k, v in value.items()}
    raise AssertionError(f"unsupported config type {hint!r} at {path}")


def _check_types(obj: Any, path: str) -> None:
    """Re-check field types of an instance built directly (not through from_dict)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            _check_types(value, sub)
        else:
            _coerce(hints[f.name], value, sub)


def help_of(cls: type, name: str) -> str:
    """The help text of field `name` of config dataclass `cls`."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("help", "")
    raise KeyError(name)


def load_config_file(path: str | Path) -> RunConfig:
    """Load a RunConfig from a .toml or .json file."""
    p = Path(path)
    if not p.is_file():
        raise invalid("--config", "an existing TOML or JSON file", str(path))
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config must be valid JSON, but got: {exc}") from None
        return RunConfig.from_dict(_hoist_strategy_sections(data))
    return RunConfig.from_toml(text, source=str(path))


def dump_toml(config: RunConfig) -> str:
    """Serialise a RunConfig to TOML (unset values are omitted)."""
    lines: list[str] = []

    def emit(table: dict[str, Any], prefix: str) -> None:
        scalars = {k: v for k, v in table.items() if not isinstance(v, dict) or k == "env"}
        tables = {k: v for k, v in table.items() if isinstance(v, dict) and k != "env"}
        body = [f"{k} = {_toml_value(v)}" for k, v in scalars.items() if v is not None]
        if body and prefix:
            lines.append(f"[{prefix}]")
        lines.extend(body)
        if body:
            lines.append("")
        for k, v in tables.items():
            emit(v, f"{prefix}.{k}" if prefix else k)

    emit(config.to_dict(), "")
    return "\n".join(lines).rstrip() + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {json.dumps(str(x))}" for k, x in v.items()) + " }"
    return json.dumps(str(v))
