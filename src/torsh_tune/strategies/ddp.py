"""DistributedDataParallel as a strategy: constructor arguments and the comm hook from a StrategyConfig.

Used twice: by the zero-code patch of `DistributedDataParallel.__init__` (a script's own DDP
construction gets the run's `[ddp]` knobs) and by `torsh_tune.parallelize` (API mode), so
both paths build DDP the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import DDPConfig, DistEnv, StrategyConfig

__all__ = ["DDP_KWARGS", "comm_hook_of", "ddp_kwargs"]

#: DDPConfig fields that are DistributedDataParallel keyword arguments of the same name.
DDP_KWARGS = ("bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "find_unused_parameters", "broadcast_buffers")


def ddp_kwargs(cfg: DDPConfig, module: torch.nn.Module, given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`given` overlaid with the configured knobs, the knobs that were applied).

    None in the config keeps the caller's (or PyTorch's) value. `first_bucket_cap_mb` and
    `bucket_cap_mb_list` become torch 2.13's `bucket_cap_mb_list` (one entry per bucket; a
    list as long as the number of gradient tensors bounds the number of buckets).
    """
    kwargs = dict(given)
    applied: dict[str, Any] = {}
    for name in DDP_KWARGS:
        value = getattr(cfg, name)
        if value is not None:
            kwargs[name] = value
            applied[name] = value
    num = sum(1 for p in module.parameters() if p.requires_grad)
    if cfg.bucket_cap_mb_list is not None:
        sizes = list(cfg.bucket_cap_mb_list)
        kwargs["bucket_cap_mb_list"] = sizes + [sizes[-1]] * max(1, num - len(sizes) + 1)
        applied["bucket_cap_mb_list"] = sizes
    elif cfg.first_bucket_cap_mb is not None:
        cap = kwargs.get("bucket_cap_mb") or 25.0
        kwargs["bucket_cap_mb_list"] = [cfg.first_bucket_cap_mb] + [cap] * max(1, num)
        applied["first_bucket_cap_mb"] = cfg.first_bucket_cap_mb
    return kwargs, applied


def comm_hook_of(strategy: StrategyConfig, process_group: Any, *, env: DistEnv | None) -> tuple[str, Any, Any] | None:
    """(name, state, hook) of the DDP comm hook the strategy asks for, or None for PyTorch's all-reduce.

    `env` is the rank's place in the job (the runtime's `DistEnv`; None without a launcher):
    the hierarchical all-reduce's node size unless `collectives.ranks_per_node` sets it.
    Must run on every rank in the same order (the hooks create process groups).
    """
    if strategy.collectives.hierarchical:
        from .collectives import HierarchicalState, hierarchical_hook

        state = HierarchicalState(process_group, ranks_per_node=strategy.collectives.ranks_per_node, env=env)
        return "torsh_tune_hierarchical", state, hierarchical_hook
    if strategy.compression.method != "none":
        from .compression import hook_from_config

        state, hook = hook_from_config(strategy.compression, process_group)
        return f"torsh_tune_{strategy.compression.method}", state, hook
    return None
