"""Zero-code instrumentation: patches installed into torch before the user's script runs.

Each patch is installed once per process by `install(rt)` and records into the rank's
`StepTracker`; none of them changes what the script computes, except where the run's
StrategyConfig explicitly asks for it (DDP knobs, DataLoader overrides, backend).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..errors import invalid
from ..profiler import TimedCommHook, default_allreduce, now
from ..strategies.collectives import HierarchicalState
from ..strategies.compression import wire_bytes_of
from ..strategies.ddp import comm_hook_of, ddp_kwargs
from .budget import StepBudgetReached

if TYPE_CHECKING:
    from .context import RankRuntime

__all__ = ["install"]


def install(rt: "RankRuntime") -> None:
    """Install every patch for this rank (idempotent)."""
    if getattr(torch, "_torsh_tune_patched", False):
        return
    torch._torsh_tune_patched = True  # type: ignore[attr-defined]
    _patch_init_process_group(rt)
    _patch_ddp(rt)
    _patch_dataloader(rt)
    _patch_backward(rt)
    _install_optimizer_hooks(rt)


# -- process group ----------------------------------------------------------------------
def _resolve_backend(requested: Any, configured: str, cuda: bool) -> Any:
    backend = requested
    if configured != "auto":
        backend = configured
    elif backend is None or backend == "auto" or backend == "":
        backend = "nccl" if cuda else "gloo"
    if isinstance(backend, str) and backend.lower() == "nccl" and not cuda:
        raise invalid("process-group backend", "gloo when CUDA is not available (nccl needs a GPU)", backend)
    return backend


def _patch_init_process_group(rt: "RankRuntime") -> None:
    original = c10d.init_process_group

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            requested, args = args[0], args[1:]
        else:
            requested = kwargs.pop("backend", None)
        backend = _resolve_backend(requested, rt.config.launch.backend, rt.cuda)
        timeout_s = rt.config.strategy.distributed.timeout_s
        if timeout_s is not None and not args:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        result = original(backend, *args, **kwargs)
        rt.meta["backend"] = str(dist.get_backend())
        rt.meta["backend_requested"] = None if requested is None else str(requested)
        rt.save_meta()
        return result

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


# -- DistributedDataParallel -------------------------------------------------------------
def _ddp_overrides(rt: "RankRuntime", module: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Overlay the run's `[ddp]` knobs on the script's DDP arguments (in place); return what was applied."""
    merged, applied = ddp_kwargs(rt.config.strategy.ddp, module, kwargs)
    for name, value in applied.items():
        if name in kwargs and kwargs[name] != value:
            rt.note(f"ddp.{name}: the script's {kwargs[name]!r} replaced by the run's {value!r}")
    kwargs.update(merged)
    return applied


def _patch_ddp(rt: "RankRuntime") -> None:
    original_init = DistributedDataParallel.__init__
    original_register = DistributedDataParallel.register_comm_hook
    original_builtin = DistributedDataParallel._register_builtin_comm_hook

    @functools.wraps(original_init)
    def __init__(self: DistributedDataParallel, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        applied = _ddp_overrides(rt, module, kwargs)
        original_init(self, module, *args, **kwargs)
        rt.on_ddp_created(self, applied)
        if rt.config.profiler.enabled:
            self._set_ddp_runtime_logging_sample_rate(1)
            self.register_forward_pre_hook(rt.forward_pre_hook, with_kwargs=True)
            self.register_forward_hook(rt.forward_post_hook)
            # A Python hook costs a future hop per bucket over PyTorch's C++ all-reduce, so the
            # per-bucket timer is installed here only when asked for or when compression puts a
            # Python hook in place anyway; otherwise DDP's own timers give one record per step.
            if rt.config.profiler.comm_hook_timing or _configured_hook(rt.config.strategy):
                _install_timed_hook(rt, self, original_register, default_allreduce, self.process_group, "allreduce")
        _apply_compression(rt, self, original_register)

    @functools.wraps(original_register)
    def register_comm_hook(self: DistributedDataParallel, state: object, hook: Any) -> None:
        if _script_hook_replaces_compression(rt, self, state, hook):
            return None
        timed = getattr(self, "_torsh_timed_hook", None)
        if timed is None and not rt.config.profiler.enabled:
            return original_register(self, state, hook)
        self._check_comm_hook(hook)
        name = getattr(hook, "__qualname__", type(hook).__name__)
        if timed is None:
            # The script's Python hook already pays the future hop: timing it adds nothing.
            _install_timed_hook(rt, self, original_register, hook, state, name)
        else:
            timed.set_inner(hook, state, name)
        self.logger._set_comm_hook_name(name)
        rt.on_comm_hook(self, name)

    @functools.wraps(original_builtin)
    def _register_builtin_comm_hook(self: DistributedDataParallel, comm_hook_type: Any) -> None:
        timed = getattr(self, "_torsh_timed_hook", None)
        if timed is None and getattr(self, "_torsh_compression_slot", None) is None:
            return original_builtin(self, comm_hook_type)
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            register_comm_hook(self, self.process_group, default_hooks.fp16_compress_hook)
        else:
            register_comm_hook(self, self.process_group, default_allreduce)

    DistributedDataParallel.__init__ = __init__
    DistributedDataParallel.register_comm_hook = register_comm_hook
    DistributedDataParallel._register_builtin_comm_hook = _register_builtin_comm_hook


def _install_timed_hook(rt: "RankRuntime", model: DistributedDataParallel, original_register: Any, inner: Any,
                        inner_state: Any, name: str) -> None:
    timed = TimedCommHook(rt.tracker, inner=inner, inner_state=inner_state, name=name, cuda=rt.cuda)
    # Compression and hierarchical hooks (configured or registered by the script) report their own bytes.
    timed.wire_bytes_of = _wire_bytes_of
    original_register(model, None, timed)
    model._torsh_timed_hook = timed


# -- the configured comm hook: gradient compression or the hierarchical all-reduce ---------
def _configured_hook(strategy: Any) -> bool:
    """Whether the strategy puts a Python comm hook of its own on every DDP model."""
    return strategy.compression.method != "none" or strategy.collectives.hierarchical


def _wire_bytes_of(state: Any, nbytes: int) -> int:
    """Bytes on the wire of the latest hook call: inter-node bytes for the hierarchical all-reduce."""
    if isinstance(state, HierarchicalState):
        return state.last_wire_bytes
    return wire_bytes_of(state, nbytes)


class _CompressionSlot:
    """The comm hook registered when profiling is off, so that a later script hook can replace it."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.inner, self.inner_state = hook, state
        self.__qualname__ = self.__name__ = "torsh_tune_compression"

    def __call__(self, state, bucket):  # noqa: ANN001, ANN204 - DDP compares annotations by identity
        return self.inner(self.inner_state, bucket)


def _apply_compression(rt: "RankRuntime", model: DistributedDataParallel, original_register: Any) -> None:
    """Install the configured comm hook (`[compression]`, `collectives.hierarchical`), inside the timing hook if any."""
    built = comm_hook_of(rt.config.strategy, model.process_group)
    if built is None:
        return
    name, state, hook = built
    timed = getattr(model, "_torsh_timed_hook", None)
    if timed is not None:
        timed.set_inner(hook, state, name)
    else:
        model._torsh_compression_slot = _CompressionSlot(hook, state)
        original_register(model, None, model._torsh_compression_slot)
    model._torsh_compression = state
    model.logger._set_comm_hook_name(name)
    if hasattr(state, "observe_loss"):
        _loss_observers.append(weakref.WeakMethod(state.observe_loss))
    # A live dict: the hooks update its values, the meta written at exit shows the totals.
    key = "hierarchical" if isinstance(state, HierarchicalState) else "compression"
    rt.meta.setdefault(key, []).append(state.stats)
    rt.meta["ddp_models"][-1]["comm_hook"] = name
    rt.save_meta()


def _script_hook_replaces_compression(rt: "RankRuntime", model: DistributedDataParallel, state: object,
                                      hook: Any) -> bool:
    """The script's own comm hook wins over the configured one; say so. True when fully handled here."""
    comp = getattr(model, "_torsh_compression", None)
    if comp is None:
        return False
    model._torsh_compression = None
    comp.stats["replaced_by_script_hook"] = True
    name = getattr(hook, "__qualname__", type(hook).__name__)
    setting = ("collectives.hierarchical=true" if isinstance(comp, HierarchicalState)
               else f"compression.method={comp.method!r}")
    rt.note(f"{setting} has no effect on this model: the script registered its own comm hook {name}")
    slot = getattr(model, "_torsh_compression_slot", None)
    if slot is None:
        return False  # the timing hook takes the script's hook as its inner hook
    model._check_comm_hook(hook)
    slot.inner, slot.inner_state = hook, state
    model.logger._set_comm_hook_name(name)
    rt.save_meta()
    return True


# -- DataLoader --------------------------------------------------------------------------
def _patch_dataloader(rt: "RankRuntime") -> None:
    dl_cfg = rt.config.strategy.dataloader
    overrides = {f.name: getattr(dl_cfg, f.name) for f in dataclasses.fields(dl_cfg) if getattr(dl_cfg, f.name) is not None}
    if overrides:
        original_init = DataLoader.__init__

        @functools.wraps(original_init)
        def __init__(self: DataLoader, *args: Any, **kwargs: Any) -> None:
            if len(args) > 5:  # num_workers is the 6th positional parameter after dataset
                raise invalid("DataLoader arguments", "passed by keyword after batch_sampler when overrides apply", "positional")
            kwargs.update(overrides)
            if kwargs.get("num_workers", 0) == 0:
                kwargs.pop("prefetch_factor", None)
                kwargs["persistent_workers"] = False
            rt.meta["dataloader_overrides"] = overrides
            original_init(self, *args, **kwargs)

        DataLoader.__init__ = __init__

    if not rt.config.profiler.enabled:
        return
    original_next = _BaseDataLoaderIter.__next__
    tracker = rt.tracker

    def __next__(self: _BaseDataLoaderIter) -> Any:
        t0 = now()
        batch = original_next(self)
        tracker.on_data(t0, now(), _batch_size(batch))
        if not getattr(self, "_torsh_seen", False):
            self._torsh_seen = True
            _record_loader(rt, self)
        return batch

    _BaseDataLoaderIter.__next__ = __next__


def _record_loader(rt: "RankRuntime", it: _BaseDataLoaderIter) -> None:
    """Keep the settings this DataLoader iterator really runs with in meta.json `dataloaders`.

    What ran, not what was asked: pin_memory is off without an accelerator, prefetch_factor
    only counts with workers. The tuner compares these between runs (`effective_settings`).
    """
    workers = int(it._num_workers)
    prefetch = getattr(it, "_prefetch_factor", None) if workers else None
    info = {"num_workers": workers, "prefetch_factor": prefetch, "pin_memory": bool(it._pin_memory)}
    seen = rt.meta.setdefault("dataloaders", [])
    if info not in seen:  # a new iterator per epoch: the meta file is written once per setting
        seen.append(info)
        rt.save_meta()


def _batch_size(batch: Any) -> int:
    """First dimension of the first tensor in a batch (0 when there is none)."""
    for _ in range(4):
        if isinstance(batch, torch.Tensor):
            return int(batch.shape[0]) if batch.dim() else 1
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        elif isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        else:
            return 0
    return 0


# -- backward and optimizer ------------------------------------------------------------
# Loss-driven comm hooks (adaptive compression): `observe_loss` of their states, weakly held.
_loss_observers: list[weakref.WeakMethod] = []


def _observe_loss(loss: torch.Tensor) -> None:
    for ref in list(_loss_observers):
        observe: Callable[[torch.Tensor], None] | None = ref()
        if observe is None:
            _loss_observers.remove(ref)
        else:
            observe(loss)


def _patch_backward(rt: "RankRuntime") -> None:
    profiled = rt.config.profiler.enabled
    if not profiled and rt.config.strategy.compression.method != "adaptive":
        return
    original = torch.autograd.backward
    tracker = rt.tracker

    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        # Before the backward: its comm hooks piggyback this loss (a detached view, no host sync).
        if _loss_observers and isinstance(tensors, torch.Tensor) and tensors.dim() == 0:
            _observe_loss(tensors.detach())
        if not profiled:
            return original(tensors, *args, **kwargs)
        t0 = now()
        try:
            return original(tensors, *args, **kwargs)
        finally:
            # The loss is kept (detached) only on the steps that read it.
            keep = tracker.wants_loss() and isinstance(tensors, torch.Tensor) and tensors.dim() == 0
            tracker.on_backward(t0, now(), tensors.detach() if keep else None)

    torch.autograd.backward = backward


def _install_optimizer_hooks(rt: "RankRuntime") -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    state = {"t0": 0.0, "owner": None}
    tracker = rt.tracker
    budget_total = rt.budget_total
    traces = rt.traces

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state["t0"] = now()

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        t1 = now()
        tracker.on_optimizer(state["t0"], t1)
        # With several optimizers, the first one to step marks the step boundary.
        if state["owner"] is None:
            state["owner"] = id(optimizer)
        elif state["owner"] != id(optimizer):
            return
        if not rt.config.profiler.enabled:
            tracker.step += 1
            done = tracker.step
        else:
            done = tracker.end_step(t1)
        rt.steps_done = done
        if traces is not None:
            traces.on_step_end(done, t1)
        if budget_total is not None and done >= budget_total:
            raise StepBudgetReached(done)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
