"""FSDP2 (`torch.distributed.fsdp.fully_shard`) and HSDP applied to a model in place.

Strategy kind `fsdp` shards every unit over a 1-D mesh `("shard",)` of all ranks; kind
`hsdp` uses a 2-D mesh `("replicate", "shard")`: parameters are sharded inside a shard
group of contiguous ranks (one node, so the fast intra-node link carries the all-gather and
reduce-scatter) and replicated across groups (one all-reduce of the shards per step).
FSDP1's `HYBRID_SHARD` is deliberately not used: on torch 2.13 it silently degrades on a
single host and the replicas drift.

A *unit* is a module sharded on its own: its parameters are all-gathered in one collective
before its forward and its gradients reduce-scattered in one collective. Units are the
modules matching `fsdp.wrap`, or by default the children of the model's outermost
`nn.ModuleList`/`nn.Sequential` containers (the transformer blocks). The root is sharded
last and owns the remaining parameters (embeddings, head).

`reshard_after_forward` maps onto FSDP1's strategies: `True` is FULL_SHARD, `False`
SHARD_GRAD_OP and an integer `k` reshards each unit to groups of `k` ranks after forward,
so backward all-gathers within the group only. `k` equal to the shard group size is
`True`, `k = 1` is `False`; the normalised value is what `FSDPInfo` records. The root
keeps FSDP2's default (no reshard after forward): backward needs it at once, as in FSDP1.

Example:
    >>> from torsh_tune.config import FSDPConfig
    >>> from torsh_tune.strategies.fsdp import apply_fsdp
    >>> info = apply_fsdp(model, FSDPConfig(), kind="fsdp", world_size=2, ranks_per_node=2,
    ...                   device=torch.device("cpu"))  # doctest: +SKIP
    >>> info.units  # doctest: +SKIP
    ['blocks.0', 'blocks.1', 'blocks.2']
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from fnmatch import fnmatch
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from torsh_tune.config import FSDPConfig
from torsh_tune.errors import invalid

__all__ = ["FSDPInfo", "apply_fsdp", "gather_full_state", "select_units"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class FSDPInfo:
    """Facts about one rank's sharded model, stored in the rank's meta.json."""

    kind: str
    """'fsdp' (1-D mesh) or 'hsdp' (2-D mesh replicate x shard)."""
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    replicate_degree: int
    """Replicas of the model (1 for fsdp)."""
    shard_degree: int
    """Ranks one copy of the model is sharded over."""
    shard_ranks: list[int]
    """Global ranks of this rank's shard group (contiguous: one node for hsdp)."""
    reshard_after_forward: bool | int
    """Effective value of the units: True, False or a group size strictly between 1 and shard_degree."""
    units: list[str]
    """Dotted names of the modules sharded as units, in the order they were sharded (root excluded)."""
    param_dtype: str | None
    """Compute dtype of forward/backward ('fp16', 'bf16'), None: the parameters' own."""
    reduce_dtype: str | None
    """Dtype of the gradient reduction, None: the gradients' own."""
    cpu_offload: bool
    num_params: int
    """Parameters of the whole (unsharded) model."""
    local_param_bytes: int
    """Bytes of this rank's parameter shards."""
    notes: list[str]
    """Options that had no effect or were mapped to an equivalent (for the rank's meta.json notes)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (tuples become lists)."""
        d = asdict(self)
        d["mesh_shape"], d["mesh_dim_names"] = list(self.mesh_shape), list(self.mesh_dim_names)
        return d


def apply_fsdp(model: nn.Module, cfg: FSDPConfig, *, kind: str, world_size: int, ranks_per_node: int,
               device: torch.device) -> FSDPInfo:
    """Shard `model` in place (kind 'fsdp': 1-D mesh; kind 'hsdp': 2-D mesh replicate x shard) and return facts.

    Every check runs before the first collective, so a bad configuration raises the same
    one-line `ConfigError` on every rank. The process group must be initialised and
    `world_size` must be its size. Leave the model on the CPU when it does not fit the device
    whole: `fully_shard` moves one unit at a time to `device` (the mesh's: the current CUDA
    device), shards it and, with `cpu_offload`, moves the shards back, and the unsharded
    parameters are freed as each call returns unless something else holds them (an optimizer
    over them, a list of them). Build the optimizer after this call, over the sharded parameters.

    Args:
        model: The module to shard; its units (see `select_units`) are sharded children first, then the root.
        cfg: The `[strategy.fsdp]` options.
        kind: 'fsdp' or 'hsdp'.
        world_size: Number of ranks.
        ranks_per_node: Ranks per node (torchrun's LOCAL_WORLD_SIZE); the default HSDP replicate degree
            is world_size // ranks_per_node.
        device: This rank's device; its type ('cpu' with gloo, 'cuda' with NCCL) is the mesh's.

    Returns:
        The mesh, units, dtypes and parameter counts of this rank.

    Raises:
        ConfigError: A mesh that does not divide the world, an invalid reshard group size, a wrap
            pattern that matches no module with parameters, or cpu_offload without CUDA.

    Example:
        >>> import torch, torch.distributed as dist, torch.nn as nn
        >>> from torsh_tune.config import FSDPConfig
        >>> dist.init_process_group("gloo")  # doctest: +SKIP
        >>> model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        >>> info = apply_fsdp(model, FSDPConfig(mixed_precision="bf16"), kind="fsdp",
        ...                   world_size=dist.get_world_size(), ranks_per_node=dist.get_world_size(),
        ...                   device=torch.device("cpu"))  # doctest: +SKIP
        >>> info.units, info.param_dtype, info.reduce_dtype  # doctest: +SKIP
        (['0', '2'], 'bf16', 'fp32')
    """
    replicate, shard = _mesh_degrees(cfg, kind, world_size, ranks_per_node)
    reshard = _effective_reshard(cfg.reshard_after_forward, shard)
    units = select_units(model, cfg.wrap)
    notes = []
    if isinstance(reshard, bool) and not isinstance(cfg.reshard_after_forward, bool):
        notes.append(f"fsdp.reshard_after_forward={cfg.reshard_after_forward} is the same as {str(reshard).lower()} "
                     f"with a shard group of {shard} ranks")
    if not units:
        notes.append("fsdp.reshard_after_forward has no effect: the model has no nn.ModuleList/nn.Sequential blocks, "
                     "so the root is the only unit (no overlap of communication and compute); set fsdp.wrap")
    if cfg.cpu_offload and device.type != "cuda":
        raise invalid("fsdp.cpu_offload", f"false on device {device.type!r} (CPUOffloadPolicy needs CUDA)", True)
    param_dtype = None if cfg.mixed_precision == "none" else cfg.mixed_precision
    reduce_dtype = cfg.reduce_dtype if cfg.reduce_dtype is not None else ("fp32" if param_dtype else None)
    mp_policy = MixedPrecisionPolicy(param_dtype=_DTYPES.get(param_dtype), reduce_dtype=_DTYPES.get(reduce_dtype))
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    num_params = sum(p.numel() for p in model.parameters())

    if kind == "fsdp":
        mesh = init_device_mesh(device.type, (shard,), mesh_dim_names=("shard",))
    else:
        # Row-major: shard groups are rows of contiguous ranks, i.e. the ranks of one node.
        mesh = init_device_mesh(device.type, (replicate, shard), mesh_dim_names=("replicate", "shard"))
    modules = dict(model.named_modules())
    for name in units:
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    offload_policy=offload)
    # None: FSDP2 keeps the root unsharded after forward, since backward starts with it.
    fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=mp_policy, offload_policy=offload)

    local_bytes = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                      for p in model.parameters())
    return FSDPInfo(
        kind=kind,
        mesh_shape=tuple(mesh.mesh.shape),
        mesh_dim_names=tuple(mesh.mesh_dim_names),
        replicate_degree=replicate,
        shard_degree=shard,
        shard_ranks=sorted(dist.get_process_group_ranks(mesh.get_group("shard"))),
        reshard_after_forward=reshard,
        units=units,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        cpu_offload=cfg.cpu_offload,
        num_params=num_params,
        local_param_bytes=local_bytes,
        notes=notes,
    )


def select_units(model: nn.Module, wrap: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Dotted names of the modules `apply_fsdp` shards as units, children before parents.

    With `wrap` patterns: every module (not the root) whose name matches one of them by
    fnmatch and that has parameters; each pattern must match at least one. Without: the
    children (with parameters) of the model's outermost `nn.ModuleList`/`nn.Sequential`
    containers, the root's own children when the root is one; `[]` when there are none.

    Example:
        >>> m = nn.Module(); m.inp = nn.Linear(2, 4)
        >>> m.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(2))
        >>> select_units(m), select_units(m, ["blocks.*.0"])
        (['blocks.0', 'blocks.1'], ['blocks.0.0', 'blocks.1.0'])
    """
    if not wrap:
        return list(_auto_units(model, "", set()))
    named = [(name, m) for name, m in _post_order(model, "", set()) if _has_params(m)]
    for pattern in wrap:
        if not any(fnmatch(name, pattern) for name, _ in named):
            raise invalid("fsdp.wrap", "fnmatch patterns that each match a module with parameters "
                          f"(such as {named[0][0] if named else 'blocks.*'!r})", pattern)
    return [name for name, _ in named if any(fnmatch(name, p) for p in wrap)]


def gather_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, parameters and buffers, on every rank.

    A collective: every rank of the mesh must call it, between steps (not between a
    forward and its backward). Parameters keep their stored dtype (fp32 under mixed precision).

    Example:
        >>> full = gather_full_state(model)  # doctest: +SKIP
        >>> full["blocks.0.lin.weight"].shape  # doctest: +SKIP
        torch.Size([32, 32])
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # no-op unless a forward without backward left parameters unsharded
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach() for k, v in state.items()}


def _mesh_degrees(cfg: FSDPConfig, kind: str, world_size: int, ranks_per_node: int) -> tuple[int, int]:
    if kind == "fsdp":
        if cfg.replicate_degree is not None:
            raise invalid("fsdp.replicate_degree", "unset with strategy kind 'fsdp' (use kind 'hsdp' for a 2-D mesh)",
                          cfg.replicate_degree)
        return 1, world_size
    if kind != "hsdp":
        raise invalid("strategy.kind", "'fsdp' or 'hsdp' for apply_fsdp", kind)
    if cfg.replicate_degree is None:
        if ranks_per_node < 1 or ranks_per_node > world_size or world_size % ranks_per_node:
            raise invalid("ranks_per_node", f"a divisor of the world size {world_size} (HSDP replicates once per "
                          "node; or set fsdp.replicate_degree)", ranks_per_node)
        replicate = world_size // ranks_per_node
    else:
        replicate = cfg.replicate_degree
        if replicate < 1 or replicate > world_size or world_size % replicate:
            raise invalid("fsdp.replicate_degree", f"a divisor of the world size {world_size} (HSDP mesh replicate x "
                          "shard)", replicate)
    return replicate, world_size // replicate


def _effective_reshard(value: bool | int, shard: int) -> bool | int:
    if isinstance(value, bool):
        return value
    if not isinstance(value, int) or value < 1 or shard % value:
        raise invalid("fsdp.reshard_after_forward", f"true, false or a divisor of the shard group size {shard}", value)
    # torch maps these itself, but warns for 1; the normalised value is what FSDPInfo records.
    if value == shard:
        return True
    if value == 1:
        return False
    return value


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _post_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        full = f"{prefix}.{name}" if prefix else name
        yield from _post_order(child, full, seen)
        yield full, child


def _auto_units(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[str]:
    container = isinstance(module, (nn.ModuleList, nn.Sequential))
    for name, child in module.named_children():
        if id(child) in seen:  # a module shared under two names is sharded once
            continue
        seen.add(id(child))
        full = f"{prefix}.{name}" if prefix else name
        if container:
            if _has_params(child):
                yield full
        else:
            yield from _auto_units(child, full, seen)
