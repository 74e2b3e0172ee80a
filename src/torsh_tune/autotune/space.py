"""The search space: define-by-run, conditional, over what the zero-code runtime applies.

Dimensions are named by their config path (`ddp.bucket_cap_mb`, `dataloader.num_workers`,
`compression.method`, ...) plus `omp_num_threads` (the `OMP_NUM_THREADS` of every rank,
set through `launch.env`). A trial's parameters become a `RunConfig` through
`RunConfig.apply_patch`, so every trial goes through the same validation as a user's config.

Conditional dimensions:

- `ddp.static_graph` is offered only when the baseline run showed one micro-batch per
  step: with `no_sync` (gradient accumulation) a static graph silently stops all-reducing
  gradients (pytorch#187732), which would look like a large, wrong speedup.
- `dataloader.prefetch_factor` only when `dataloader.num_workers > 0` (PyTorch rejects it
  otherwise).
- `dataloader.pin_memory` only with CUDA (it only speeds host-to-device copies).
- `compression.rank`/`compression.start_iter` only for PowerSGD, `compression.ratio` only
  for Top-K.

A TOML file narrows, widens or fixes any dimension:

    [space.ddp.bucket_cap_mb]
    low = 5
    high = 100
    log = true
    [space.compression.method]
    choices = ["none", "fp16"]
    [space.omp_num_threads]
    value = 1

Example:
    >>> import optuna
    >>> space = build_space(nproc_per_node=2, cpu_count=8)
    >>> study = optuna.create_study(direction="maximize")
    >>> params = space.suggest(study.ask())
    >>> config = space.to_config(RunConfig(), params)
"""

from __future__ import annotations

import math
import os
import tomllib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..config import CompressionConfig, RunConfig
from ..errors import ConfigError, invalid

if TYPE_CHECKING:  # optuna is only needed when a trial is suggested
    import optuna

__all__ = [
    "BASELINE_PARAMS",
    "Dimension",
    "SearchSpace",
    "build_space",
    "load_space_file",
    "parse_space",
]

_COMPRESSION_METHODS: tuple[str, ...] = typing.get_args(typing.get_type_hints(CompressionConfig)["method"])

#: PyTorch's own defaults, the values the baseline trial (trial 0) is enqueued with.
#: torchrun sets OMP_NUM_THREADS=1 for multi-process jobs.
BASELINE_PARAMS: dict[str, Any] = {
    "ddp.bucket_cap_mb": 25.0,
    "ddp.gradient_as_bucket_view": False,
    "ddp.static_graph": False,
    "dataloader.num_workers": 0,
    "dataloader.prefetch_factor": 2,
    "dataloader.pin_memory": False,
    "omp_num_threads": 1,
    "compression.method": "none",
    "compression.rank": 4,
    "compression.start_iter": 10,
    "compression.ratio": 0.01,
}

_SPEC_KEYS = {"low", "high", "log", "step", "choices", "value"}


@dataclass(frozen=True, kw_only=True)
class Dimension:
    """One searchable knob.

    Attributes:
        name: Config path of the knob (`ddp.bucket_cap_mb`) or `omp_num_threads`.
        kind: "float", "int", "bool" or "categorical".
        low: Lower bound (float/int kinds).
        high: Upper bound (float/int kinds).
        log: Sample on a log scale.
        choices: The values of a bool/categorical dimension (or a TOML `choices` list).
        value: When not None, the dimension is fixed to this value and not searched.
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    value: Any = None

    @property
    def fixed(self) -> bool:
        return self.value is not None

    def contains(self, v: Any) -> bool:
        """Whether `v` lies in this dimension."""
        if self.fixed:
            return v == self.value
        if self.choices:
            return v in self.choices
        return isinstance(v, (int, float)) and not isinstance(v, bool) and self.low <= v <= self.high

    def suggest(self, trial: "optuna.trial.BaseTrial") -> Any:
        if self.fixed:
            return self.value
        if self.choices:
            return trial.suggest_categorical(self.name, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """The dimensions of a study and the conditions between them.

    Attributes:
        dims: Dimension name -> Dimension, only those available in this context.
        unavailable: Dimension name -> why it is not offered here (e.g. static_graph with
            gradient accumulation, pin_memory without CUDA).
    """

    dims: dict[str, Dimension]
    unavailable: dict[str, str] = field(default_factory=dict)

    def suggest(self, trial: "optuna.trial.BaseTrial") -> dict[str, Any]:
        """Ask `trial` for a value of every dimension active under the earlier choices.

        Returns:
            Dimension name -> value, fixed dimensions included.
        """
        params: dict[str, Any] = {}

        def take(name: str) -> None:
            if name in self.dims:
                params[name] = self.dims[name].suggest(trial)

        for name in ("ddp.bucket_cap_mb", "ddp.gradient_as_bucket_view", "ddp.static_graph"):
            take(name)
        take("dataloader.num_workers")
        if params.get("dataloader.num_workers", 0) > 0:
            take("dataloader.prefetch_factor")
        take("dataloader.pin_memory")
        take("omp_num_threads")
        take("compression.method")
        method = params.get("compression.method")
        if method == "powersgd":
            take("compression.rank")
            take("compression.start_iter")
        elif method in ("topk", "adaptive"):  # adaptive starts from the ratio and moves within its bounds
            take("compression.ratio")
        return params

    def patch_of(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A `RunConfig.apply_patch` patch setting the given parameters."""
        patch: dict[str, Any] = {}
        for name, value in params.items():
            if name == "omp_num_threads":
                patch.setdefault("launch", {}).setdefault("env", {})["OMP_NUM_THREADS"] = str(int(value))
                continue
            section, key = name.split(".", 1)
            patch.setdefault(section, {})[key] = value
        return patch

    def to_config(self, base: RunConfig, params: Mapping[str, Any]) -> RunConfig:
        """`base` with the trial's parameters applied (validated).

        Raises:
            ConfigError: The combination is not a valid configuration.
        """
        return base.apply_patch(self.patch_of(params))

    def baseline_params(self) -> dict[str, Any]:
        """PyTorch's defaults restricted to this space's active dimensions (for trial 0).

        A default outside a narrowed dimension is left out, so the sampler picks that one.
        """
        out: dict[str, Any] = {}
        for name, dim in self.dims.items():
            v = BASELINE_PARAMS.get(name)
            if dim.fixed or v is None or not dim.contains(v):
                continue
            out[name] = v
        # Conditional parameters that would not be asked for under the defaults are dropped.
        if out.get("dataloader.num_workers", 0) == 0:
            out.pop("dataloader.prefetch_factor", None)
        if out.get("compression.method") != "powersgd":
            out.pop("compression.rank", None)
            out.pop("compression.start_iter", None)
        if out.get("compression.method") != "topk":
            out.pop("compression.ratio", None)
        return out


def _default_dims(*, nproc_per_node: int, cpu_count: int) -> dict[str, Dimension]:
    cores_per_rank = max(1, cpu_count // max(1, nproc_per_node))
    return {
        d.name: d
        for d in (
            Dimension(name="ddp.bucket_cap_mb", kind="float", low=1.0, high=200.0, log=True),
            Dimension(name="ddp.gradient_as_bucket_view", kind="bool", choices=(False, True)),
            Dimension(name="ddp.static_graph", kind="bool", choices=(False, True)),
            Dimension(name="dataloader.num_workers", kind="int", low=0, high=min(8, cores_per_rank)),
            Dimension(name="dataloader.prefetch_factor", kind="int", low=1, high=8),
            Dimension(name="dataloader.pin_memory", kind="bool", choices=(False, True)),
            Dimension(name="omp_num_threads", kind="int", low=1, high=cores_per_rank),
            Dimension(name="compression.method", kind="categorical", choices=_COMPRESSION_METHODS),
            Dimension(name="compression.rank", kind="int", low=1, high=16, log=True),
            Dimension(name="compression.start_iter", kind="int", low=0, high=20),
            Dimension(name="compression.ratio", kind="float", low=0.001, high=0.1, log=True),
        )
    }


# The smallest value each numeric dimension may take, whatever a space file says.
_MINIMUM = {
    "ddp.bucket_cap_mb": 0.0,  # exclusive
    "dataloader.num_workers": 0,
    "dataloader.prefetch_factor": 1,
    "omp_num_threads": 1,
    "compression.rank": 1,
    "compression.start_iter": 0,
    "compression.ratio": 0.0,  # exclusive
}
_MAXIMUM = {"compression.ratio": 1.0}


def build_space(
    *,
    nproc_per_node: int,
    cpu_count: int | None = None,
    cuda: bool = False,
    baseline_num_microbatches: int | None = 1,
    include_compression: bool = True,
    spec: Mapping[str, Any] | None = None,
) -> SearchSpace:
    """The default space for this machine and baseline, narrowed/widened/fixed by `spec`.

    Args:
        nproc_per_node: Ranks per node (bounds workers and OMP threads per rank).
        cpu_count: Host cores (default `os.cpu_count()`).
        cuda: Whether the ranks use CUDA (`pin_memory` is only offered then).
        baseline_num_microbatches: Largest micro-batch count per step the baseline showed;
            `static_graph` is offered only when it is 1 (pytorch#187732). None: unknown,
            not offered.
        include_compression: Offer gradient compression (lossy: guarded by the loss check).
        spec: Parsed `[space]` table (see `parse_space`), dimension name -> overrides.

    Raises:
        ConfigError: The spec names an unknown or unavailable dimension, or is invalid.
    """
    dims = _default_dims(nproc_per_node=nproc_per_node, cpu_count=cpu_count or os.cpu_count() or 1)
    unavailable: dict[str, str] = {}
    if baseline_num_microbatches != 1:
        unavailable["ddp.static_graph"] = (
            "static_graph with no_sync (gradient accumulation) silently stops all-reducing (pytorch#187732)"
            if baseline_num_microbatches is not None else "the baseline's micro-batches per step are unknown"
        )
    if not cuda:
        unavailable["dataloader.pin_memory"] = "pin_memory only speeds host-to-GPU copies (no CUDA here)"
    if not include_compression:
        for name in list(dims):
            if name.startswith("compression."):
                unavailable[name] = "compression is not searched in this study"
    for name, overrides in (spec or {}).items():
        if name not in dims:
            raise invalid("space dimension", f"one of {sorted(dims)}", name)
        if name in unavailable:
            raise invalid(f"space.{name}", f"omitted ({unavailable[name]})", dict(overrides))
        dims[name] = _narrow(dims[name], overrides)
    active = {n: d for n, d in dims.items() if n not in unavailable}
    # A numeric range of one point is a fixed value, not a search dimension.
    for n, d in active.items():
        if not d.fixed and not d.choices and d.low == d.high:
            active[n] = replace(d, value=int(d.low) if d.kind == "int" else float(d.low))
    return SearchSpace(dims=active, unavailable=unavailable)


def _narrow(dim: Dimension, overrides: Mapping[str, Any]) -> Dimension:
    where = f"space.{dim.name}"
    if not isinstance(overrides, Mapping):
        raise invalid(where, "a table with low/high/log, choices or value", overrides)
    unknown = sorted(set(overrides) - _SPEC_KEYS)
    if unknown:
        raise invalid(f"{where}.{unknown[0]}", f"one of {sorted(_SPEC_KEYS)}", unknown[0])
    kinds = {k for k in ("choices", "value") if k in overrides} | ({"range"} if {"low", "high", "log"} & set(overrides) else set())
    if len(kinds) > 1:
        raise invalid(where, "one of: low/high/log, choices or value", dict(overrides))
    if "value" in overrides:
        v = overrides["value"]
        _check_value(dim, v, f"{where}.value")
        return replace(dim, value=v, choices=())
    if "choices" in overrides:
        choices = overrides["choices"]
        if not isinstance(choices, list) or not choices:
            raise invalid(f"{where}.choices", "a non-empty list", choices)
        for v in choices:
            _check_value(dim, v, f"{where}.choices")
        return replace(dim, choices=tuple(dict.fromkeys(choices)))
    if dim.kind in ("bool", "categorical"):
        raise invalid(where, "choices = [...] or value = ... (it is not numeric)", dict(overrides))
    low, high = overrides.get("low", dim.low), overrides.get("high", dim.high)
    log = overrides.get("log", dim.log)
    for key, v in (("low", low), ("high", high)):
        _check_value(dim, v, f"{where}.{key}")
    if not isinstance(log, bool):
        raise invalid(f"{where}.log", "true or false", log)
    if low > high:
        raise invalid(f"{where}.low", f"<= high ({high})", low)
    if log and low <= 0:
        raise invalid(f"{where}.low", "> 0 on a log scale", low)
    return replace(dim, low=low, high=high, log=log)


def _check_value(dim: Dimension, v: Any, where: str) -> None:
    if dim.kind == "bool":
        if not isinstance(v, bool):
            raise invalid(where, "true or false", v)
        return
    if dim.kind == "categorical":
        if v not in _COMPRESSION_METHODS:
            raise invalid(where, f"one of {list(_COMPRESSION_METHODS)}", v)
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (dim.kind == "int" and not isinstance(v, int)):
        raise invalid(where, "an integer" if dim.kind == "int" else "a number", v)
    if not math.isfinite(v):
        raise invalid(where, "finite", v)
    lo = _MINIMUM.get(dim.name)
    exclusive = dim.name in ("ddp.bucket_cap_mb", "compression.ratio")
    if lo is not None and (v <= lo if exclusive else v < lo):
        raise invalid(where, f"{'>' if exclusive else '>='} {lo}", v)
    hi = _MAXIMUM.get(dim.name)
    if hi is not None and v > hi:
        raise invalid(where, f"<= {hi}", v)


def parse_space(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Flatten a `[space]` table (nested by config path) into dimension name -> overrides.

    A table is a dimension's overrides when any of its keys is low/high/log/step/choices/value.
    """
    out: dict[str, dict[str, Any]] = {}

    def walk(node: Mapping[str, Any], prefix: str) -> None:
        if not isinstance(node, Mapping):
            raise invalid(f"space.{prefix}" if prefix else "space", "a table", node)
        if prefix and set(node) & _SPEC_KEYS:
            out[prefix] = dict(node)
            return
        for key, sub in node.items():
            walk(sub, f"{prefix}.{key}" if prefix else key)

    walk(data, "")
    return out


def load_space_file(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Read a TOML file with a `[space]` table into `parse_space`'s form.

    Raises:
        ConfigError: Missing file, invalid TOML, or no `[space]` table.
    """
    p = Path(path)
    if not p.is_file():
        raise invalid("--space", "an existing TOML file", str(path))
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} must be valid TOML, but got: {exc}") from None
    if set(data) != {"space"}:
        raise invalid(f"{path}", "a file with only a [space] table", sorted(data))
    return parse_space(data["space"])
