"""API mode: `parallelize` a model and run `train_step` under any strategy kind.

Switching a model between DDP, FSDP2, HSDP and a pipeline cannot be done from outside the
script, so the script hands its model over once:

    model, optimizer = tt.parallelize(model, optimizer, example_batch=batch, loss_fn=loss_fn)
    for batch in loader:
        loss = tt.train_step(model, optimizer, batch, loss_fn)

Inside a torsh-tune run the strategy is the run's `[strategy]`; under bare torchrun it is
the `config` argument (a StrategyConfig, RunConfig or TOML/JSON path) or plain DDP; in a
single process without a launcher nothing is distributed and `train_step` is an ordinary
step, so one script runs everywhere (nanoGPT's rule).

Parallelisms are applied in one fixed order, as in torchtitan: pipeline split, then FSDP
or DDP. The optimizer is rebuilt over the parameters this rank owns afterwards (FSDP2
replaces parameters by sharded DTensors; a pipeline stage owns only its own), keeping its
param groups and hyper-parameters, so it must not have stepped yet.

Placement follows the strategy, so a model that only fits sharded is never whole on the
GPU: DDP moves the whole model to the device (every rank holds all of it); FSDP/HSDP shard
first and FSDP2's `fully_shard` moves one unit at a time (with `cpu_offload` the shards go
back to the CPU), after the old optimizer let go of the unsharded parameters; a pipeline
moves only this rank's stages. On CUDA the peak-memory counter is reset once the model is
set up, so the steps' `peak_mem_bytes` is the training peak; the setup peak is recorded in
the strategy facts (`setup_peak_mem_bytes`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..config import DistEnv, RunConfig, StrategyConfig, dist_env
from ..errors import TorshTuneError, invalid
from ..importers import load_config_file
from . import context

__all__ = ["PipelineModule", "count_tokens", "data_parallel_info", "parallelize", "train_step"]


@dataclass
class _Parallel:
    """What train_step needs to know about a parallelized model."""

    kind: str  # ddp, fsdp, hsdp, pipeline or single (no process group)
    strategy: StrategyConfig
    device: torch.device
    runner: Any = None  # PipelineRunner for kind pipeline
    micro: int = 0  # micro-batches since the last optimizer step
    steps: int = 0  # optimizer steps taken through train_step
    target_lrs: list[float] = field(default_factory=list)  # per param group, after lr_scaling
    loss_src: int = 0  # global rank holding the pipeline's last stage
    loss_observer: Callable[[torch.Tensor], None] | None = None  # a loss-driven comm hook's observe_loss


_PARALLEL: "weakref.WeakKeyDictionary[nn.Module, _Parallel]" = weakref.WeakKeyDictionary()


class PipelineModule(nn.Module):
    """This rank's pipeline stage(s); runs only through `train_step` (a schedule drives them)."""

    def __init__(self, runner: Any) -> None:
        super().__init__()
        self.stages = nn.ModuleList(runner.stage_modules)
        self.runner = runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TorshTuneError("a pipelined model runs only through torsh_tune.train_step(model, optimizer, batch, loss_fn)")


def parallelize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    example_batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    split_points: list[str] | None = None,
    config: StrategyConfig | RunConfig | str | Path | None = None,
    device: torch.device | str | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Apply the run's strategy (DDP, FSDP2, HSDP or pipeline) to `model`; return (model, optimizer).

    Args:
        model: the full model, built identically on every rank (same seed or a broadcast).
            Leave it on the CPU for FSDP/HSDP and pipelines: only what this rank keeps is
            placed on `device`.
        optimizer: an optimizer over `model`'s parameters that has not stepped yet; the
            returned one (rebuilt when parameters change) must be used from here on. Under
            FSDP/HSDP the one passed in is emptied (it would hold the unsharded parameters).
        example_batch: one `(inputs, targets)` batch; the pipeline checks its split with it.
        loss_fn: `loss_fn(output, targets) -> scalar`; required for kind pipeline.
        split_points: module names where pipeline stages begin (overrides `[pipeline] split_points`).
        config: strategy outside a torsh-tune run (inside one, the run's `[strategy]` applies).
        device: where the model lives (default: this rank's GPU, else CPU).

    Returns:
        (model to train, optimizer to step). For a pipeline the model is a `PipelineModule`.

    Raises:
        ConfigError: the strategy cannot apply (one line: what, rule, value).

    Example:
        >>> import torsh_tune as tt  # doctest: +SKIP
        >>> model, opt = tt.parallelize(model, opt, example_batch=(x, y), loss_fn=loss_fn)  # doctest: +SKIP
        >>> loss = tt.train_step(model, opt, (x, y), loss_fn)  # doctest: +SKIP
    """
    rt = context.active_runtime()
    strategy = _strategy_of(rt, config)
    cuda = torch.cuda.is_available()
    env = rt.env if rt is not None else dist_env()  # inside a torsh-tune run, as the bootstrap parsed it
    if env is None and not (dist.is_available() and dist.is_initialized()):
        dev = torch.device(device) if device is not None else torch.device("cuda" if cuda else "cpu")
        model.to(dev)
        _PARALLEL[model] = _Parallel(kind="single", strategy=strategy, device=dev)
        _init_lrs(_PARALLEL[model], optimizer, data_parallel=1)
        return model, optimizer
    _ensure_process_group(strategy, cuda, env.local_rank if env else 0)
    world, rank = dist.get_world_size(), dist.get_rank()
    env = env or DistEnv.one_node(rank=rank, world_size=world)
    nodes = env.with_ranks_per_node(strategy.collectives.ranks_per_node)  # the node layout the strategy works with
    if split_points is not None:
        strategy = RunConfig(strategy=strategy).with_overrides({"strategy.pipeline.split_points": list(split_points)}).strategy
    strategy.validate(world_size=world, nnodes=nodes.nnodes)
    dev = _device_of(device, cuda)
    names = {id(p): n for n, p in model.named_parameters()}
    kind = strategy.kind
    facts: dict[str, Any] = {"kind": kind, "api": True, "world_size": world, "device": str(dev)}
    # The whole model, before a pipeline split or sharding hides it (the strategy advisor's input).
    # Sums only: a list of the parameters would keep FSDP from freeing the unsharded ones.
    facts["num_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    facts["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    par = _Parallel(kind=kind, strategy=strategy, device=dev)
    # Placement is the strategy's (see the module docstring): no model.to(dev) before sharding.
    if kind == "pipeline":
        wrapped = _apply_pipeline(model, strategy, example_batch, loss_fn, dev, rank, world, par)
        owned_ids = {id(p) for p in wrapped.parameters()}
        owned = {n: p for n, p in model.named_parameters() if id(p) in owned_ids}
        facts["pipeline"] = par.runner.stats()
        data_parallel = 1
    elif kind in ("fsdp", "hsdp"):
        from ..strategies.fsdp import apply_fsdp

        groups = _release_optimizer(optimizer, names) if optimizer is not None else None
        try:
            info = apply_fsdp(model, strategy.fsdp, kind=kind, world_size=world, ranks_per_node=nodes.local_world_size,
                              device=dev)
        except BaseException:
            if groups is not None:  # a ConfigError before sharding: hand the user's optimizer back intact
                _restore_optimizer(optimizer, groups, dict(model.named_parameters()))
            raise
        wrapped, owned = model, dict(model.named_parameters())
        if groups is not None:
            optimizer = _optimizer_by_name(optimizer, groups, owned)
        facts["fsdp"] = info.to_dict()
        for note in info.notes:
            if rt is not None:
                rt.note(note)
        data_parallel = world
    else:
        model.to(dev)  # every DDP rank holds the whole model
        wrapped = _apply_ddp(model, strategy, dev, env=env, managed=rt is not None)
        par.loss_observer = getattr(getattr(wrapped, "_torsh_hook_state", None), "observe_loss", None)
        owned = dict(model.named_parameters())
        data_parallel = world
    if optimizer is not None and kind not in ("fsdp", "hsdp"):
        optimizer = _rebind_optimizer(optimizer, names, owned)
    _init_lrs(par, optimizer, data_parallel=data_parallel)
    facts["lr_scaling"] = strategy.training.lr_scaling
    facts["gradient_accumulation_steps"] = strategy.training.gradient_accumulation_steps
    _PARALLEL[wrapped] = par
    if rt is not None:
        _end_setup(dev, facts)
        rt.on_parallelize(wrapped, facts, par.runner)
    return wrapped, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Any,
               loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
    """One training step of a model returned by `parallelize`, for every strategy kind.

    `batch` is `(inputs, targets)`. With `[training] gradient_accumulation_steps = k` each
    call is one micro-batch and the optimizer steps on every k-th call (DDP's `no_sync`,
    FSDP2's `set_requires_gradient_sync(False)` on the others); the effective batch grows k
    times. A pipeline runs all its micro-batches (`[pipeline] n_microbatches`) in one call.

    Returns:
        The (detached) loss of this call, the same on every rank of a pipeline.
    """
    par = _PARALLEL.get(model)
    if par is None:
        raise invalid("train_step(model)", "a model returned by torsh_tune.parallelize", type(model).__name__)
    inputs, targets = _split_batch(batch, "train_step(batch)")
    inputs, targets = _to(inputs, par.device), _to(targets, par.device)
    if par.kind == "pipeline":
        loss = par.runner.step(inputs, targets)
        _optimizer_step(par, model, optimizer)
        return _pipeline_loss(par, loss)
    k = par.strategy.training.gradient_accumulation_steps
    last = (par.micro + 1) % k == 0
    with _gradient_sync(par.kind, model, enabled=last):
        loss = loss_fn(model(inputs), targets)
        if par.loss_observer is not None:  # adaptive compression outside a torsh-tune run
            par.loss_observer(loss.detach())
        # The unscaled loss is what the profiler records; the gradients carry the 1/k.
        loss.backward(torch.full_like(loss, 1.0 / k) if k > 1 else None)
    par.micro += 1
    if last:
        _optimizer_step(par, model, optimizer)
    return loss.detach()


def count_tokens(n: int) -> None:
    """Count `n` tokens towards this rank's current step (e.g. `batch["input_ids"].numel()`).

    With tokens counted, the step records carry them and the tuner's objective becomes
    tokens/s (summed over ranks) instead of samples/s: the throughput that stays comparable
    when the sequence length or the batch composition changes. Call it on every rank with
    the tokens of that rank's own data, any number of times per step (micro-batches add up);
    a pipeline's ranks share one batch, so count there on one rank only. Outside torsh-tune
    (the script run alone or under bare torchrun) it does nothing. Pass a host-side int
    (`input_ids.numel()` reads the shape, no sync); a one-element integer tensor is accepted
    too, but reading a CUDA tensor waits for the device at every call.

    Raises:
        ConfigError: `n` is not an integer >= 0.
    """
    if isinstance(n, torch.Tensor) and n.numel() == 1 and not n.is_floating_point() and n.dtype != torch.bool:
        n = int(n)  # e.g. attention_mask.sum()
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise invalid("count_tokens(n)", "an integer >= 0", n)
    rt = context.active_runtime()
    if rt is not None:
        rt.tracker.on_tokens(n)


def data_parallel_info(model: nn.Module) -> tuple[int, int]:
    """(this rank's index among the data-parallel replicas, their number) for a parallelized model.

    Feed replica i its own shard of the data (e.g. `DistributedSampler(num_replicas=n, rank=i)`).
    A pipeline is one replica: every rank passes the same batch to `train_step` (the first
    stage reads the inputs, the last stage the targets). Alone: (0, 1).
    """
    par = _PARALLEL.get(model)
    if par is None:
        raise invalid("data_parallel_info(model)", "a model returned by torsh_tune.parallelize", type(model).__name__)
    if par.kind in ("pipeline", "single"):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


# -- pieces ---------------------------------------------------------------------------------
def _strategy_of(rt: Any, config: Any) -> StrategyConfig:
    if rt is not None:
        if config is not None:
            rt.note("parallelize(config=...) ignored: this torsh-tune run's [strategy] applies")
        return rt.config.strategy
    if config is None:
        return StrategyConfig()
    if isinstance(config, StrategyConfig):
        return config
    if isinstance(config, RunConfig):
        return config.strategy
    if isinstance(config, (str, Path)):
        return load_config_file(config).strategy
    raise invalid("parallelize(config)", "a StrategyConfig, RunConfig or path of a TOML/JSON file", type(config).__name__)


def _ensure_process_group(strategy: StrategyConfig, cuda: bool, local_rank: int) -> None:
    if cuda:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    if dist.is_initialized():
        return
    kwargs: dict[str, Any] = {}
    if strategy.distributed.timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=strategy.distributed.timeout_s)
    dist.init_process_group("nccl" if cuda else "gloo", **kwargs)


def _device_of(device: Any, cuda: bool) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def _apply_ddp(model: nn.Module, strategy: StrategyConfig, dev: torch.device, *, env: DistEnv,
               managed: bool) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    from ..strategies.ddp import comm_hook_of, ddp_kwargs

    kwargs, _ = ddp_kwargs(strategy.ddp, model, {})
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None, **kwargs)
    # Inside a torsh-tune run the DDP constructor patch installs the hook (timed); here, ourselves.
    if not managed:
        hook = comm_hook_of(strategy, ddp.process_group, env=env)
        if hook is not None:
            _, state, fn = hook
            ddp.register_comm_hook(state, fn)
            ddp._torsh_hook_state = state  # its stats (bytes handed to collectives) for benchmarks
    return ddp


def _apply_pipeline(model: nn.Module, strategy: StrategyConfig, example_batch: Any, loss_fn: Any,
                    dev: torch.device, rank: int, world: int, par: _Parallel) -> nn.Module:
    from ..strategies.pipeline import build_pipeline

    if not strategy.pipeline.split_points:
        raise invalid("pipeline.split_points", "at least one module name ([pipeline] or parallelize(split_points=...))", [])
    if loss_fn is None:
        raise invalid("parallelize(loss_fn)", "a loss function for strategy kind 'pipeline' (the last stage computes it)",
                      None)
    if example_batch is None:
        raise invalid("parallelize(example_batch)", "an (inputs, targets) batch for strategy kind 'pipeline'", None)
    inputs, _ = _split_batch(example_batch, "parallelize(example_batch)")
    runner = build_pipeline(model, strategy.pipeline, loss_fn=loss_fn, example_inputs=inputs, device=dev,
                            rank=rank, world_size=world, split_points=list(strategy.pipeline.split_points))
    par.runner = runner
    last_stage = runner.num_stages - 1
    par.loss_src = _rank_of_stage(strategy, last_stage, world)
    return PipelineModule(runner)


def _rank_of_stage(strategy: StrategyConfig, stage: int, world: int) -> int:
    if strategy.pipeline.schedule == "zbv":
        return stage if stage < world else 2 * world - 1 - stage
    return stage % world


def _rebind_optimizer(optimizer: torch.optim.Optimizer, old_names: dict[int, str],
                      owned: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer over the parameters this rank owns now, param groups and defaults kept."""
    _check_fresh(optimizer)
    owned_ids = {id(p) for p in owned.values()}
    groups, changed = [], False
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in owned_ids:
                params.append(p)
                continue
            changed = True
            replacement = owned.get(old_names.get(id(p), ""))
            if replacement is not None:
                params.append(replacement)
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    if not changed:
        return optimizer
    if not groups:
        raise invalid("parallelize(optimizer)", "over parameters of the model (none of them lives on this rank)",
                      type(optimizer).__name__)
    return _same_kind(optimizer, groups)


def _check_fresh(optimizer: torch.optim.Optimizer) -> None:
    if any(len(s) for s in optimizer.state.values()):
        raise invalid("parallelize(optimizer)", "an optimizer that has not stepped yet", type(optimizer).__name__)


def _release_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[dict[str, Any]]:
    """The optimizer's param groups with parameter names for parameters; the optimizer lets go of them.

    FSDP2 frees a unit's unsharded parameters when `fully_shard` returns only if nothing else
    holds them; an optimizer over them would keep the whole model on the device. Parameters
    that are not the model's (no name) are dropped, as `_rebind_optimizer` drops them.
    """
    _check_fresh(optimizer)
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [names[id(p)] for p in group["params"] if id(p) in names]})
        group["params"] = []
    return groups


def _restore_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                       params: dict[str, torch.Tensor]) -> None:
    for group, saved in zip(optimizer.param_groups, groups):
        group["params"] = [params[n] for n in saved["params"] if n in params]


def _optimizer_by_name(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                       owned: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s type over `owned`, param groups (by name) and defaults kept."""
    new_groups = [{**g, "params": [owned[n] for n in g["params"] if n in owned]} for g in groups]
    new_groups = [g for g in new_groups if g["params"]]
    if not new_groups:
        raise invalid("parallelize(optimizer)", "over parameters of the model (none of them lives on this rank)",
                      type(optimizer).__name__)
    return _same_kind(optimizer, new_groups)


def _same_kind(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """A new optimizer of `optimizer`'s type and defaults over `groups` (which carry their own options)."""
    params = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = dict(optimizer.defaults)
    else:  # defaults may hold more than __init__ takes (AdamW's decoupled_weight_decay, torch 2.13)
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in params and k != "params"}
    return type(optimizer)(groups, **kwargs)


def _end_setup(dev: torch.device, facts: dict[str, Any]) -> None:
    """Record the setup's CUDA memory peak and restart the counter: the steps' peaks are the training's."""
    if dev.type != "cuda":
        return
    facts["setup_peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    torch.cuda.reset_peak_memory_stats(dev)


def _init_lrs(par: _Parallel, optimizer: torch.optim.Optimizer | None, *, data_parallel: int) -> None:
    tr = par.strategy.training
    if optimizer is None:
        return
    factor = {"none": 1.0, "linear": float(data_parallel), "sqrt": math.sqrt(data_parallel)}[tr.lr_scaling]
    for group in optimizer.param_groups:
        if "lr" in group and factor != 1.0:
            lr = group["lr"]
            group["lr"] = lr * factor if not isinstance(lr, torch.Tensor) else lr.mul_(factor)
    par.target_lrs = [float(g.get("lr", 0.0)) for g in optimizer.param_groups]


def _optimizer_step(par: _Parallel, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tr = par.strategy.training
    if tr.lr_warmup_steps and par.steps <= tr.lr_warmup_steps:
        ramp = min(1.0, (par.steps + 1) / tr.lr_warmup_steps)
        for group, target in zip(optimizer.param_groups, par.target_lrs):
            if not isinstance(group.get("lr"), torch.Tensor):
                group["lr"] = target * ramp
    if tr.max_grad_norm is not None:
        _clip(par, model, tr.max_grad_norm)
    par.steps += 1
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _clip(par: _Parallel, model: nn.Module, max_norm: float) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    if par.kind != "pipeline":
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    # Each stage holds part of the model: the global norm sums every stage's squares.
    sq = torch.zeros((), device=par.device, dtype=torch.float32)
    for p in params:
        sq += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(sq)
    scale = max_norm / (float(sq.sqrt()) + 1e-6)
    if scale < 1.0:
        for p in params:
            p.grad.detach().mul_(scale)


def _pipeline_loss(par: _Parallel, loss: torch.Tensor | None) -> torch.Tensor:
    value = torch.zeros((), device=par.device, dtype=torch.float32) if loss is None else loss.detach().float().reshape(())
    dist.broadcast(value, src=par.loss_src)
    return value


def _gradient_sync(kind: str, model: nn.Module, *, enabled: bool) -> contextlib.AbstractContextManager:
    if enabled:
        if kind in ("fsdp", "hsdp"):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if kind == "ddp":
        return model.no_sync()
    if kind in ("fsdp", "hsdp"):
        model.set_requires_gradient_sync(False)
    return contextlib.nullcontext()


def _split_batch(batch: Any, what: str) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise invalid(what, "an (inputs, targets) pair", type(batch).__name__)


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value
