"""The search space: define-by-run, conditional, over what the runtime can apply.

Dimensions are named by their config path (`ddp.bucket_cap_mb`, `dataloader.num_workers`,
`compression.method`, `strategy.kind`, ...) plus `omp_num_threads` (the `OMP_NUM_THREADS` of
every rank, set through `launch.env`). A trial's parameters become a `RunConfig` through
`RunConfig.apply_patch` and `check_layout`, so every trial goes through the same validation
as a user's config.

Conditional dimensions (each rule is asked in `SearchSpace.suggest`, offered or not in
`build_space`, and explained in `SearchSpace.unavailable` when not offered):

- `ddp.static_graph` only when the baseline run showed one micro-batch per step and the
  trial does not accumulate gradients: with `no_sync` a static graph silently stops
  all-reducing gradients (pytorch#187732), which would look like a large, wrong speedup.
- `ddp.broadcast_buffers` (PyTorch's True, or False) only when the baseline's DDP model
  broadcast buffers before each forward and none of them is a normalization layer's running
  statistics (which the forward updates: turning the broadcast off would leave each rank its
  own, a change of the model's state the loss guard cannot see).
- `ddp.first_bucket_cap_mb` (log) never above the trial's bucket cap, and not when the base
  config sizes every bucket (`bucket_cap_mb_list`; config forbids both).
- `dataloader.prefetch_factor` and `dataloader.persistent_workers` only when
  `dataloader.num_workers > 0` (PyTorch rejects them otherwise; `CONDITIONS`);
  `dataloader.pin_memory` only with CUDA (it only speeds host-to-device copies).
- `compression.*` only for DDP; `compression.rank`/`start_iter` only for PowerSGD,
  `compression.ratio` only for Top-K and adaptive.
- `collectives.nccl_algo` (Ring, Tree) and `collectives.nccl_proto` (Simple, LL, LL128) only
  with CUDA; "auto" leaves the choice to NCCL (PyTorch's default, trial 0).
- `collectives.hierarchical` only with more than one node, DDP and no compression (both are
  the DDP comm hook).
- API mode (the script calls `torsh_tune.parallelize`): `strategy.kind` in ddp, fsdp, hsdp
  (nnodes > 1 or world size >= 4), pipeline (only with `[pipeline] split_points` in the base
  config: world - 1 names for gpipe/1f1b, 2 x world - 1 for the interleaved schedules);
  `fsdp.reshard_after_forward` for fsdp/hsdp (true, false, and with world size >= 4 the
  partial-reshard group sizes that divide it); `pipeline.schedule` and
  `pipeline.n_microbatches` (2, 4, 8) for pipelines.
- `training.gradient_accumulation_steps` (1, 2, 4) changes the effective batch: only in API
  mode with `allow_batch_changes`, never for pipelines.

A TOML file narrows, widens or fixes any dimension:

    [space.ddp.bucket_cap_mb]
    low = 5
    high = 100
    log = true
    [space.compression.method]
    choices = ["none", "fp16"]
    [space.omp_num_threads]
    value = 1
    [space.strategy.kind]
    choices = ["ddp", "fsdp"]

Example:
    >>> import optuna
    >>> space = build_space(nproc_per_node=2, cpu_count=8)
    >>> study = optuna.create_study(direction="maximize")
    >>> params = space.suggest(study.ask())
    >>> config = space.to_config(RunConfig(launch=LaunchConfig(nproc_per_node=2)), params)
"""

from __future__ import annotations

import math
import os
import tomllib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..config import PIPELINE_SCHEDULES, STRATEGY_KINDS, CompressionConfig, LaunchConfig, RunConfig
from ..errors import ConfigError, invalid

if TYPE_CHECKING:  # optuna is only needed when a trial is suggested
    import optuna

__all__ = [
    "BASELINE_PARAMS",
    "CONDITIONS",
    "Dimension",
    "SearchSpace",
    "build_space",
    "load_space_file",
    "parse_space",
]

_COMPRESSION_METHODS: tuple[str, ...] = typing.get_args(typing.get_type_hints(CompressionConfig)["method"])
_NCCL_ALGOS = ("auto", "Ring", "Tree", "CollNet", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
_NCCL_PROTOS = ("auto", "Simple", "LL", "LL128")
# One stage per rank, or a loop of several (the split-point count decides which can run).
_FLAT_SCHEDULES = ("gpipe", "1f1b")
_LOOPED_SCHEDULES = tuple(s for s in PIPELINE_SCHEDULES if s not in _FLAT_SCHEDULES)

#: PyTorch's (and the config's) own defaults, the values the baseline trial (trial 0) is
#: enqueued with. torchrun sets OMP_NUM_THREADS=1 for multi-process jobs; "auto" leaves
#: NCCL's algorithm and protocol to NCCL. The strategy dimensions take the base config's
#: values instead (see `SearchSpace.defaults`).
BASELINE_PARAMS: dict[str, Any] = {
    "strategy.kind": "ddp",
    "training.gradient_accumulation_steps": 1,
    "ddp.bucket_cap_mb": 25.0,
    "ddp.first_bucket_cap_mb": 1.0,
    "ddp.gradient_as_bucket_view": False,
    "ddp.static_graph": False,
    "ddp.broadcast_buffers": True,
    "fsdp.reshard_after_forward": True,
    "pipeline.schedule": "1f1b",
    "pipeline.n_microbatches": 4,
    "dataloader.num_workers": 0,
    "dataloader.prefetch_factor": 2,
    "dataloader.persistent_workers": False,
    "dataloader.pin_memory": False,
    "omp_num_threads": 1,
    "collectives.nccl_algo": "auto",
    "collectives.nccl_proto": "auto",
    "compression.method": "none",
    "compression.rank": 4,
    "compression.start_iter": 10,
    "compression.ratio": 0.01,
    "collectives.hierarchical": False,
}

#: Dimension -> the dimension that must be above 0 for it to be asked (`SearchSpace.suggest`).
#: A patch that names one without its condition (keep the script's workers alive) needs the
#: script's own value of the condition, not PyTorch's default 0 (`seeding.advisor_params`).
CONDITIONS: dict[str, str] = {
    "dataloader.prefetch_factor": "dataloader.num_workers",
    "dataloader.persistent_workers": "dataloader.num_workers",
}

_SPEC_KEYS = {"low", "high", "log", "step", "choices", "value"}
# Dimensions whose value "auto" means: leave the config key unset.
_AUTO_UNSET = ("collectives.nccl_algo", "collectives.nccl_proto")


def _member(v: Any, values: tuple[Any, ...]) -> bool:
    """`v in values`, where True is not 1 (reshard_after_forward mixes bools and ints)."""
    return any(isinstance(v, bool) == isinstance(x, bool) and v == x for x in values)


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
        allowed: The values a `[space]` file may name for a categorical dimension (wider
            than the default `choices` where this context can run more).
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    value: Any = None
    allowed: tuple[Any, ...] = ()

    @property
    def fixed(self) -> bool:
        return self.value is not None

    def contains(self, v: Any) -> bool:
        """Whether `v` lies in this dimension."""
        if self.fixed:
            return _member(v, (self.value,))
        if self.choices:
            return _member(v, self.choices)
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
            gradient accumulation, pin_memory without CUDA); `strategy.kind=hsdp`-style keys
            say why a strategy kind is not among the choices.
        base_kind: The base config's strategy kind (the kind when `strategy.kind` is not searched).
        base_bucket_cap_mb: The bucket cap a trial has when it does not choose one.
        base_accumulation: The base config's gradient accumulation steps.
        defaults: Dimension name -> trial 0's value where it is the base config's rather
            than `BASELINE_PARAMS` (strategy kind, accumulation, pipeline and FSDP options).
        implied: (dimension name, value) -> config keys that value needs (e.g. the
            pipeline's stages per rank, no compression outside DDP).
    """

    dims: dict[str, Dimension]
    unavailable: dict[str, str] = field(default_factory=dict)
    base_kind: str = "ddp"
    base_bucket_cap_mb: float = 25.0
    base_accumulation: int = 1
    defaults: dict[str, Any] = field(default_factory=dict)
    implied: dict[tuple[str, Any], dict[str, Any]] = field(default_factory=dict)

    def suggest(self, trial: "optuna.trial.BaseTrial") -> dict[str, Any]:
        """Ask `trial` for a value of every dimension active under the earlier choices.

        Returns:
            Dimension name -> value, fixed dimensions included.
        """
        params: dict[str, Any] = {}

        def take(name: str, dim: Dimension | None = None) -> None:
            if name in self.dims:
                params[name] = (dim or self.dims[name]).suggest(trial)

        take("strategy.kind")
        kind = params.get("strategy.kind", self.base_kind)
        if kind != "pipeline":  # a pipeline's micro-batches are pipeline.n_microbatches
            take("training.gradient_accumulation_steps")
        accumulation = params.get("training.gradient_accumulation_steps", self.base_accumulation)
        if kind == "ddp":
            take("ddp.bucket_cap_mb")
            self._take_first_bucket(trial, params)
            take("ddp.gradient_as_bucket_view")
            if accumulation == 1:  # pytorch#187732: static_graph + no_sync skips the all-reduce
                take("ddp.static_graph")
            take("ddp.broadcast_buffers")
        elif kind in ("fsdp", "hsdp"):
            take("fsdp.reshard_after_forward")
        elif kind == "pipeline":
            take("pipeline.schedule")
            take("pipeline.n_microbatches")
        take("dataloader.num_workers")
        for name, condition in CONDITIONS.items():
            if params.get(condition, 0) > 0:
                take(name)
        take("dataloader.pin_memory")
        take("omp_num_threads")
        take("collectives.nccl_algo")
        take("collectives.nccl_proto")
        if kind == "ddp":
            take("compression.method")
            method = params.get("compression.method")
            if method == "powersgd":
                take("compression.rank")
                take("compression.start_iter")
            elif method in ("topk", "adaptive"):  # adaptive starts from the ratio and moves within its bounds
                take("compression.ratio")
            if params.get("compression.method", "none") == "none":
                take("collectives.hierarchical")
        return params

    def _take_first_bucket(self, trial: "optuna.trial.BaseTrial", params: dict[str, Any]) -> None:
        """`ddp.first_bucket_cap_mb`, never above this trial's bucket cap (a dynamic upper bound)."""
        dim = self.dims.get("ddp.first_bucket_cap_mb")
        if dim is None:
            return
        cap = float(params.get("ddp.bucket_cap_mb", self.base_bucket_cap_mb))
        if dim.fixed or dim.choices:  # Optuna's categorical choices cannot depend on the cap: clip instead
            params[dim.name] = min(dim.suggest(trial), cap)
        elif dim.low <= cap:
            params[dim.name] = replace(dim, high=min(dim.high, cap)).suggest(trial)

    def patch_of(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """A `RunConfig.apply_patch` patch setting the given parameters (and what they imply)."""
        flat: dict[str, Any] = {}
        for name, value in params.items():
            flat[name] = None if name in _AUTO_UNSET and value == "auto" else value
        for name, value in params.items():
            for key, implied in self.implied.get((name, value), {}).items():
                flat.setdefault(key, implied)
        patch: dict[str, Any] = {}
        for name, value in flat.items():
            if name == "omp_num_threads":
                patch.setdefault("launch", {}).setdefault("env", {})["OMP_NUM_THREADS"] = str(int(value))
                continue
            section, key = name.split(".", 1)
            patch.setdefault(section, {})[key] = value
        return patch

    def to_config(self, base: RunConfig, params: Mapping[str, Any]) -> RunConfig:
        """`base` with the trial's parameters applied, validated with its world size.

        Raises:
            ConfigError: The combination is not a valid configuration.
        """
        return base.apply_patch(self.patch_of(params)).check_layout()

    def default(self, name: str) -> Any:
        """Trial 0's value of a dimension: the base config's for the strategy ones, else PyTorch's."""
        return {**BASELINE_PARAMS, **self.defaults}.get(name)

    def normalize(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` as `suggest` would ask them: only the dimensions active under the earlier
        choices (a reverted `num_workers = 0` drops `prefetch_factor`), fixed ones at their value,
        a missing active one at its default (`default`)."""
        return self.suggest(_DefaultsReplay({**BASELINE_PARAMS, **self.defaults, **params}))  # type: ignore[arg-type]

    def without(self, reasons: Mapping[str, str]) -> "SearchSpace":
        """This space less the named dimensions (they run as the baseline does), each with why it left."""
        if not any(name in self.dims for name in reasons):
            return self
        return replace(self, dims={n: d for n, d in self.dims.items() if n not in reasons},
                       unavailable={**self.unavailable, **{n: why for n, why in reasons.items() if n in self.dims}})

    def baseline_params(self) -> dict[str, Any]:
        """The defaults (`BASELINE_PARAMS`, the base config's for the strategy dimensions)
        restricted to this space's active dimensions, as `suggest` asks them (for trial 0).

        A default outside a narrowed dimension is left out, so the sampler picks that one.
        """
        replay = _DefaultsReplay({**BASELINE_PARAMS, **self.defaults})
        self.suggest(replay)  # type: ignore[arg-type]  # duck-typed trial
        return replay.taken


class _DefaultsReplay:
    """A stand-in for an Optuna trial that answers `suggest` with the defaults it contains."""

    def __init__(self, defaults: Mapping[str, Any]) -> None:
        self.defaults, self.taken = defaults, {}

    def _take(self, name: str, contains, fallback: Any) -> Any:
        v = self.defaults.get(name)
        if v is not None and contains(v):
            self.taken[name] = v
            return v
        return fallback  # left to the sampler

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        return self._take(name, lambda v: _member(v, tuple(choices)), choices[0])

    def suggest_int(self, name: str, low: int, high: int, *, log: bool = False) -> int:
        return self._take(name, lambda v: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high, low)

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        return self._take(name, lambda v: isinstance(v, (int, float)) and low <= v <= high, low)


def _default_dims(*, nproc_per_node: int, cpu_count: int) -> dict[str, Dimension]:
    cores_per_rank = max(1, cpu_count // max(1, nproc_per_node))
    return {
        d.name: d
        for d in (
            Dimension(name="strategy.kind", kind="categorical", choices=("ddp",), allowed=("ddp",)),
            Dimension(name="training.gradient_accumulation_steps", kind="int", low=1, high=4, choices=(1, 2, 4)),
            Dimension(name="ddp.bucket_cap_mb", kind="float", low=1.0, high=200.0, log=True),
            Dimension(name="ddp.first_bucket_cap_mb", kind="float", low=0.25, high=25.0, log=True),
            Dimension(name="ddp.gradient_as_bucket_view", kind="bool", choices=(False, True)),
            Dimension(name="ddp.static_graph", kind="bool", choices=(False, True)),
            Dimension(name="ddp.broadcast_buffers", kind="bool", choices=(True, False)),
            Dimension(name="fsdp.reshard_after_forward", kind="categorical", choices=(True, False),
                      allowed=(True, False)),
            Dimension(name="pipeline.schedule", kind="categorical", choices=_FLAT_SCHEDULES, allowed=_FLAT_SCHEDULES),
            Dimension(name="pipeline.n_microbatches", kind="int", low=2, high=8, choices=(2, 4, 8)),
            # Up to 4 workers per rank even on small hosts: a loader that waits on storage (network
            # file systems, object stores) gains from workers beyond the cores; the trial measures it.
            Dimension(name="dataloader.num_workers", kind="int", low=0, high=min(8, max(4, cores_per_rank))),
            Dimension(name="dataloader.prefetch_factor", kind="int", low=1, high=8),
            Dimension(name="dataloader.persistent_workers", kind="bool", choices=(False, True)),
            Dimension(name="dataloader.pin_memory", kind="bool", choices=(False, True)),
            Dimension(name="omp_num_threads", kind="int", low=1, high=cores_per_rank),
            Dimension(name="collectives.nccl_algo", kind="categorical", choices=("auto", "Ring", "Tree"),
                      allowed=_NCCL_ALGOS),
            Dimension(name="collectives.nccl_proto", kind="categorical", choices=_NCCL_PROTOS, allowed=_NCCL_PROTOS),
            Dimension(name="compression.method", kind="categorical", choices=_COMPRESSION_METHODS,
                      allowed=_COMPRESSION_METHODS),
            Dimension(name="compression.rank", kind="int", low=1, high=16, log=True),
            Dimension(name="compression.start_iter", kind="int", low=0, high=20),
            Dimension(name="compression.ratio", kind="float", low=0.001, high=0.1, log=True),
            Dimension(name="collectives.hierarchical", kind="bool", choices=(False, True)),
        )
    }


# The smallest value each numeric dimension may take, whatever a space file says.
_MINIMUM = {
    "ddp.bucket_cap_mb": 0.0,  # exclusive
    "ddp.first_bucket_cap_mb": 0.0,  # exclusive
    "training.gradient_accumulation_steps": 1,
    "pipeline.n_microbatches": 1,
    "dataloader.num_workers": 0,
    "dataloader.prefetch_factor": 1,
    "omp_num_threads": 1,
    "compression.rank": 1,
    "compression.start_iter": 0,
    "compression.ratio": 0.0,  # exclusive
}
_EXCLUSIVE_MINIMUM = ("ddp.bucket_cap_mb", "ddp.first_bucket_cap_mb", "compression.ratio")
_MAXIMUM = {"compression.ratio": 1.0}
_DDP_ONLY = ("ddp.", "compression.", "collectives.hierarchical")


def _broadcast_buffers_unavailable(ddp: Mapping[str, Any] | None) -> str:
    """Why `ddp.broadcast_buffers` is not searched for this baseline ('' when it is)."""
    if not ddp or "running_stats_bytes" not in ddp:
        return "the baseline's DDP buffers are unknown (no DDP model, or recorded before torsh-tune kept them)"
    if not ddp.get("buffer_bytes"):
        return "the baseline's DDP model broadcasts no buffers before its forwards"
    if ddp["running_stats_bytes"]:
        return ("the baseline's buffers include normalization layers' running statistics, which the forward "
                "updates: without the broadcast each rank would keep its own (set [ddp] broadcast_buffers yourself)")
    return ""


def build_space(
    *,
    nproc_per_node: int,
    cpu_count: int | None = None,
    cuda: bool = False,
    baseline_num_microbatches: int | None = 1,
    include_compression: bool = True,
    spec: Mapping[str, Any] | None = None,
    base: RunConfig | None = None,
    api_mode: bool = False,
    allow_batch_changes: bool = False,
    baseline_buffers: Mapping[str, Any] | None = None,
) -> SearchSpace:
    """The default space for this machine, base config and baseline, narrowed/widened/fixed by `spec`.

    Args:
        nproc_per_node: Ranks per node (bounds workers and OMP threads per rank).
        cpu_count: Host cores (default `os.cpu_count()`).
        cuda: Whether the ranks use CUDA (`pin_memory` and the NCCL variables are only offered then).
        baseline_num_microbatches: Largest micro-batch count per step the baseline showed;
            `static_graph` is offered only when it is 1 (pytorch#187732). None: unknown,
            not offered.
        include_compression: Offer gradient compression (lossy: guarded by the loss check).
        spec: Parsed `[space]` table (see `parse_space`), dimension name -> overrides.
        base: The user's configuration (the baseline): its strategy kind, number of nodes,
            pipeline split points, bucket sizes and accumulation decide what is offered.
            Default: `RunConfig()` with `nproc_per_node` ranks on one node.
        api_mode: The script calls `torsh_tune.parallelize`, so the strategy kind (DDP, FSDP,
            HSDP, pipeline) and its options can be searched.
        allow_batch_changes: Offer knobs that change the effective batch
            (`training.gradient_accumulation_steps`; API mode only).
        baseline_buffers: The baseline's DDP model as its rank 0 meta.json `ddp` records it
            (`buffer_bytes`, `running_stats_bytes`): `ddp.broadcast_buffers` is offered only when
            it broadcast buffers and none were running statistics. None: unknown, not offered.

    Raises:
        ConfigError: The spec names an unknown or unavailable dimension, or is invalid.
    """
    if base is None:
        base = RunConfig(launch=LaunchConfig(nproc_per_node=nproc_per_node))
    st = base.strategy
    nnodes = base.launch.nnodes
    world = nnodes * nproc_per_node
    dims = _default_dims(nproc_per_node=nproc_per_node, cpu_count=cpu_count or os.cpu_count() or 1)
    unavailable: dict[str, str] = {}
    implied: dict[tuple[str, Any], dict[str, Any]] = {}
    off_ddp = {"compression.method": "none", "collectives.hierarchical": False}

    # -- strategy kinds (API mode) ------------------------------------------------------------
    kinds = [st.kind]
    hsdp_shard: int | None = None
    if api_mode:
        kinds += ["ddp", "fsdp"]
        replicas = _hsdp_replicas(st.fsdp.replicate_degree, nnodes=nnodes, world=world)
        if nnodes == 1 and world < 4:
            unavailable["strategy.kind=hsdp"] = f"HSDP needs nnodes > 1 or a world size >= 4, but the world size is {world}"
        elif replicas is None:
            unavailable["strategy.kind=hsdp"] = f"no 2-D mesh (replicate x shard, both > 1) divides the world size {world}"
        else:
            kinds.append("hsdp")
            hsdp_shard = world // replicas
            # One node: the replicas are explicit; several: torsh-tune's default (one per node).
            implied[("strategy.kind", "hsdp")] = {
                "fsdp.replicate_degree": replicas if nnodes == 1 or st.fsdp.replicate_degree else None, **off_ddp}
        split_reason = _pipeline_unavailable(st, world)
        if split_reason:
            unavailable["strategy.kind=pipeline"] = split_reason
        else:
            kinds.append("pipeline")
            stages_per_rank = (len(st.pipeline.split_points) + 1) // world
            implied[("strategy.kind", "pipeline")] = {"pipeline.stages_per_rank": stages_per_rank, **off_ddp}
        implied[("strategy.kind", "fsdp")] = {"fsdp.replicate_degree": None, **off_ddp}
    kinds = [k for k in STRATEGY_KINDS if k in kinds]
    dims["strategy.kind"] = replace(dims["strategy.kind"], choices=tuple(kinds), allowed=tuple(kinds))
    if not api_mode:
        unavailable["strategy.kind"] = ("the script does not call torsh_tune.parallelize: switching between DDP, "
                                        "FSDP, HSDP and pipeline needs API mode (--api)")
    for method in _COMPRESSION_METHODS:
        if method != "none":
            implied[("compression.method", method)] = {"collectives.hierarchical": False}

    # -- options of each kind ----------------------------------------------------------------
    if "ddp" not in kinds:
        for name in dims:
            if name.startswith(_DDP_ONLY):
                unavailable[name] = f"only for strategy kind ddp (this study runs {kinds[0]})"
    if not {"fsdp", "hsdp"} & set(kinds):
        unavailable["fsdp.reshard_after_forward"] = "only for strategy kinds fsdp and hsdp (API mode)"
    else:
        reshard = (True, False) + _partial_reshard_sizes(world, hsdp_shard)
        dims["fsdp.reshard_after_forward"] = replace(dims["fsdp.reshard_after_forward"], choices=reshard, allowed=reshard)
    if "pipeline" not in kinds:
        why = unavailable.get("strategy.kind=pipeline", "only for strategy kind pipeline (API mode)")
        unavailable["pipeline.schedule"] = unavailable["pipeline.n_microbatches"] = why
    else:
        # The split points fix the stages per rank, and so the schedules that can run them.
        flat = len(st.pipeline.split_points) + 1 == world
        allowed = _FLAT_SCHEDULES if flat else _LOOPED_SCHEDULES
        choices = _FLAT_SCHEDULES if flat else _unique(("interleaved1f1b", st.pipeline.schedule), allowed)
        dims["pipeline.schedule"] = replace(dims["pipeline.schedule"], choices=choices, allowed=allowed)
    if not api_mode:
        unavailable["training.gradient_accumulation_steps"] = "API mode only (torsh_tune.train_step accumulates)"
    elif not allow_batch_changes:
        unavailable["training.gradient_accumulation_steps"] = ("it changes the effective batch: pass "
                                                               "--allow-batch-changes to search it")
    elif kinds == ["pipeline"]:
        unavailable["training.gradient_accumulation_steps"] = "a pipeline accumulates with pipeline.n_microbatches"
    if st.ddp.bucket_cap_mb_list is not None:
        for name in ("ddp.bucket_cap_mb", "ddp.first_bucket_cap_mb"):
            unavailable.setdefault(name, "the base config's ddp.bucket_cap_mb_list sizes every bucket")

    # -- the baseline, the machine and the study's choices -----------------------------------
    if baseline_num_microbatches != 1:
        unavailable.setdefault("ddp.static_graph", (
            "static_graph with no_sync (gradient accumulation) silently stops all-reducing (pytorch#187732)"
            if baseline_num_microbatches is not None else "the baseline's micro-batches per step are unknown"
        ))
    why_not = _broadcast_buffers_unavailable(baseline_buffers)
    if why_not:
        unavailable.setdefault("ddp.broadcast_buffers", why_not)
    if not cuda:
        unavailable["dataloader.pin_memory"] = "pin_memory only speeds host-to-GPU copies (no CUDA here)"
        for name in ("collectives.nccl_algo", "collectives.nccl_proto"):
            unavailable[name] = "NCCL variables only matter on GPUs (no CUDA here)"
    if not include_compression:
        for name in list(dims):
            if name.startswith("compression."):
                unavailable.setdefault(name, "compression is not searched in this study")
    if nnodes == 1:
        unavailable.setdefault("collectives.hierarchical", "one node: there is no inter-node link to spare")
    elif not include_compression and st.compression.method != "none":
        unavailable.setdefault("collectives.hierarchical",
                               "the base config compresses gradients (both are the DDP comm hook)")

    # The base config's own value is always a choice (trial 0 runs it).
    for name, value in (("pipeline.n_microbatches", st.pipeline.n_microbatches),
                        ("training.gradient_accumulation_steps", st.training.gradient_accumulation_steps)):
        d = dims[name]
        dims[name] = replace(d, choices=tuple(sorted({*d.choices, value})), high=max(d.high, value))
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
    defaults = {
        "strategy.kind": st.kind,
        "training.gradient_accumulation_steps": st.training.gradient_accumulation_steps,
        "fsdp.reshard_after_forward": st.fsdp.reshard_after_forward,
        "pipeline.schedule": st.pipeline.schedule,
        "pipeline.n_microbatches": st.pipeline.n_microbatches,
        "collectives.hierarchical": st.collectives.hierarchical,
    }
    return SearchSpace(
        dims=active,
        unavailable=unavailable,
        base_kind=st.kind,
        base_bucket_cap_mb=st.ddp.bucket_cap_mb or BASELINE_PARAMS["ddp.bucket_cap_mb"],
        base_accumulation=st.training.gradient_accumulation_steps,
        defaults=defaults,
        implied=implied,
    )


def _unique(values: tuple[Any, ...], allowed: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(v for i, v in enumerate(values) if v in allowed and v not in values[:i])


def _hsdp_replicas(configured: int | None, *, nnodes: int, world: int) -> int | None:
    """Replicas of an HSDP mesh here: the configured degree, one per node, or on one node the
    smallest proper divisor of the world size; None when no mesh with both sizes > 1 fits."""
    if configured is not None:
        candidates = [configured]
    elif nnodes > 1:
        candidates = [nnodes]
    else:
        candidates = [r for r in range(2, world) if world % r == 0][:1]
    for r in candidates:
        if 1 < r < world and world % r == 0:
            return r
    return None


def _partial_reshard_sizes(world: int, hsdp_shard: int | None) -> tuple[int, ...]:
    """Partial-reshard group sizes (FSDP2's int `reshard_after_forward`) from world size 4 on:
    proper divisors of the world size > 1 that also divide the HSDP shard group when HSDP is
    searched too (one Optuna dimension needs one set of choices)."""
    if world < 4:
        return ()
    return tuple(d for d in range(2, world)
                 if world % d == 0 and (hsdp_shard is None or (d <= hsdp_shard and hsdp_shard % d == 0)))


def _pipeline_unavailable(st: Any, world: int) -> str:
    """Why a pipeline cannot be a trial of this base config ('' when it can)."""
    splits = st.pipeline.split_points
    if not splits:
        return "a pipeline needs [pipeline] split_points in the base config (where stages begin)"
    stages = len(splits) + 1
    if stages not in (world, 2 * world):
        return (f"the base config's {len(splits)} split points make {stages} stages: a pipeline here needs "
                f"{world} (gpipe/1f1b) or {2 * world} (interleaved)")
    if st.training.gradient_accumulation_steps > 1:
        return "the base config accumulates gradients, which a pipeline cannot (pipeline.n_microbatches does)"
    return ""


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
        unique: list[Any] = []
        for v in choices:
            if not _member(v, tuple(unique)):
                unique.append(v)
        return replace(dim, choices=tuple(unique))
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
    return replace(dim, low=low, high=high, log=log, choices=())


def _check_value(dim: Dimension, v: Any, where: str) -> None:
    if dim.kind == "bool":
        if not isinstance(v, bool):
            raise invalid(where, "true or false", v)
        return
    if dim.kind == "categorical":
        if not _member(v, dim.allowed):
            raise invalid(where, f"one of {list(dim.allowed)}", v)
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (dim.kind == "int" and not isinstance(v, int)):
        raise invalid(where, "an integer" if dim.kind == "int" else "a number", v)
    if not math.isfinite(v):
        raise invalid(where, "finite", v)
    lo = _MINIMUM.get(dim.name)
    exclusive = dim.name in _EXCLUSIVE_MINIMUM
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
