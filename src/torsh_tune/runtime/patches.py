"""Zero-code instrumentation: patches installed into torch before the user's script runs.

Each patch is installed once per process by `install(rt)` and records into the rank's
`StepTracker`; none of them changes what the script computes, except where the run's
StrategyConfig explicitly asks for it (DDP knobs, DataLoader overrides, backend).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..errors import invalid
from ..profiler import CollectiveCapture, TimedCommHook, default_allreduce, now
from ..profiler.collectives import issuer_of
from ..profiler._clock import exchange_with_rank0
from ..profiler._clock import offset as clock_offset
from ..profiler._compiling import flags, traced
from ..profiler.traces import TraceWindows
from ..strategies.collectives import HierarchicalState
from ..strategies.ddp import comm_hook_of, ddp_kwargs
from .budget import StepBudgetReached
from .fingerprint import DataFingerprint

if TYPE_CHECKING:
    from .context import RankRuntime

__all__ = ["install"]


def install(rt: "RankRuntime") -> None:
    """Install every patch for this rank (idempotent)."""
    if getattr(torch, "_torsh_tune_patched", False):
        return
    torch._torsh_tune_patched = True  # type: ignore[attr-defined]
    if rt.config.profiler.enabled and rt.writer is not None:
        rt.collectives = CollectiveCapture(rt.tracker, rank=rt.rank, on_cuda=rt.training_on_cuda)
        rt.collectives.install()
        rt.tracker.release_comm = rt.collectives.release_unwaited
    _patch_init_process_group(rt)
    _patch_destroy_process_group(rt)
    _patch_ddp(rt)
    _patch_dataloader(rt)
    _patch_backward(rt)
    _install_optimizer_hooks(rt)
    _patch_checkpoint_saves(rt)


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
        _exchange_clocks(rt, "start")
        rt.save_meta()
        return result

    c10d.init_process_group = init_process_group
    dist.init_process_group = init_process_group


def _exchange_clocks(rt: "RankRuntime", when: str) -> None:
    """Ranks on several hosts: each host's clock measured against rank 0's (`meta["clock_sync"]` at start-up,
    `meta["clock_sync_end"]` when the default group is destroyed: how far the clocks drifted apart between).

    One rank per host (local rank 0) takes part; the analysis puts the hosts on rank 0's clock with it
    where the collectives cannot (device-clock records on NCCL) and checks it against them where they can.
    """
    env = rt.env
    if rt.writer is None or env is None or env.local_rank != 0:
        return
    try:
        nnodes = int(os.environ.get("GROUP_WORLD_SIZE") or env.nnodes)
    except ValueError:
        nnodes = env.nnodes
    if nnodes < 2:
        return
    key = "clock_sync" if when == "start" else "clock_sync_end"
    # At the end rank 0 answers the nodes that answered at start-up (the others made no exchange then either).
    peers = rt.meta["clock_sync"].get("answered") if when == "end" and env.rank == 0 else None
    # Every rank inits and destroys its groups in the same order: the count names the exchange alike on all (and
    # torchrun's restart count keeps a restarted job's keys apart from the last attempt's on a store that outlived it).
    rt.clock_exchanges += 1
    tag = f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{rt.clock_exchanges}"
    try:
        rt.meta[key] = exchange_with_rank0(c10d._get_default_store(), env.node_rank, nnodes, tag=tag, peers=peers)
    except Exception as exc:  # noqa: BLE001 - the run goes on; its hosts' clocks are then read from the collectives only
        rt.note(f"hosts' clocks: the {when} exchange with rank 0 failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})")
        return
    failed = rt.meta[key].get("failed")
    if failed:
        rt.note(f"hosts' clocks: the {when} exchange found no answer from node(s) "
                f"{', '.join(str(n) for n in sorted(failed))} ({next(iter(failed.values()))})")


def _patch_destroy_process_group(rt: "RankRuntime") -> None:
    """The clocks' second exchange, as the default group goes: the script's own destroy_process_group() at
    its end or the bootstrap's (after its barrier at the step budget), where every rank is about to stop."""
    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        if group is None or group is c10d.GroupMember.WORLD:
            if dist.is_initialized() and "clock_sync" in rt.meta and "clock_sync_end" not in rt.meta:
                _exchange_clocks(rt, "end")
                rt.save_meta()
        return original(group)

    destroy_process_group._torsh_capture = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    if dist.destroy_process_group is original:
        dist.destroy_process_group = destroy_process_group


# -- DistributedDataParallel -------------------------------------------------------------
def _ddp_overrides(rt: "RankRuntime", module: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Overlay the run's `[ddp]` knobs on the script's DDP arguments (in place); return what was applied."""
    merged, applied = ddp_kwargs(rt.config.strategy.ddp, module, kwargs)
    for name, value in applied.items():
        if name in kwargs and kwargs[name] != value:
            rt.note(f"ddp.{name}: the script's {kwargs[name]!r} replaced by the run's {value!r}")
    kwargs.update(merged)
    return applied


#: Who builds a DDP model, most specific first: the framework whose own settings reach its arguments
#: (a Hugging Face Trainer builds it through accelerate; TrainingArguments is where a user sets them).
_BUILDERS = ("transformers", "lightning", "accelerate")


def _built_by(frame: Any) -> str:
    """The framework on the stack that builds a DDP model (`_BUILDERS`), "torsh-tune" for
    `torsh_tune.parallelize` (its config sets DDP's arguments), else "user"."""
    found = set()
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(("torsh_tune.runtime.api", "torsh_tune.strategies.")):
            return "torsh-tune"
        found.add(issuer_of(name))
        frame = frame.f_back
    return next((b for b in _BUILDERS if b in found), "user")


def _patch_ddp(rt: "RankRuntime") -> None:
    original_init = DistributedDataParallel.__init__
    original_register = DistributedDataParallel.register_comm_hook
    original_builtin = DistributedDataParallel._register_builtin_comm_hook

    @functools.wraps(original_init)
    def __init__(self: DistributedDataParallel, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        applied = _ddp_overrides(rt, module, kwargs)
        original_init(self, module, *args, **kwargs)
        rt.on_ddp_created(self, applied, built_by=_built_by(sys._getframe(1)))
        on_cuda = any(p.is_cuda for p in module.parameters())
        if on_cuda:
            rt.training_on_cuda()
        if rt.config.profiler.enabled:
            # No forward hooks on DDP itself: under `torch.compile(DDP(model))` hooks on DDP are traced
            # and add a graph break; the forward is probed from the first optimizer step on, on the
            # outermost module holding the parameters (DDP, or the compiled wrapper around it).
            if rt.config.profiler.comm_hook_timing or _configured_hook(rt.config.strategy):
                # A Python hook is there anyway: its collectives go through the c10d capture per bucket.
                _install_timed_hook(rt, self, original_register, default_allreduce, self.process_group, "allreduce")
            elif not on_cuda:
                # On CPU, PyTorch's C++ all-reduce stays (a Python hook costs a future hop per bucket)
                # and the reducer's host timers, sampled every iteration, give one record per step.
                self._set_ddp_runtime_logging_sample_rate(1)
            else:
                # On CUDA the C++ all-reduce stays too. A Python hook per bucket cost ~1.3 ms per step on an
                # H100 (NCCL futures' callbacks), and DDP's timers are CUDA events it synchronizes when it
                # reads them: PyTorch's own sampling (the first 10 iterations, then every 100th) is kept,
                # so the sampled steps carry a device-timed record and no other step is stalled.
                rt.note("DDP on CUDA: the builtin all-reduce is timed by DDP's own sampled CUDA timers "
                        "(iterations 1-10, then every 100th); set profiler.comm_hook_timing for every bucket")
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
    timed = TimedCommHook(rt.collectives, inner=inner, inner_state=inner_state, name=name)
    original_register(model, None, timed)
    model._torsh_timed_hook = timed


# -- the configured comm hook: gradient compression or the hierarchical all-reduce ---------
def _configured_hook(strategy: Any) -> bool:
    """Whether the strategy puts a Python comm hook of its own on every DDP model."""
    return strategy.compression.method != "none" or strategy.collectives.hierarchical


class _CompressionSlot:
    """The comm hook registered when profiling is off, so that a later script hook can replace it."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.inner, self.inner_state = hook, state
        self.__qualname__ = self.__name__ = "torsh_tune_compression"

    def __call__(self, state, bucket):  # noqa: ANN001, ANN204 - DDP compares annotations by identity
        return self.inner(self.inner_state, bucket)


def _apply_compression(rt: "RankRuntime", model: DistributedDataParallel, original_register: Any) -> None:
    """Install the configured comm hook (`[compression]`, `collectives.hierarchical`), inside the timing hook if any."""
    built = comm_hook_of(rt.config.strategy, model.process_group, env=rt.env)
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
    # The data the measured steps read, for the tuner's data-integrity guard (meta.json data_fingerprint):
    # only in the tuner's runs, which ask for it.
    fingerprint = (DataFingerprint(rt.meta, first_step=rt.config.budget.warmup_steps, end_step=rt.budget_total)
                   if rt.config.profiler.data_fingerprint else None)

    perf, off = time.perf_counter, clock_offset()
    windows = rt.traces

    def __next__(self: _BaseDataLoaderIter) -> Any:
        if windows is not None and windows.pending is not None:  # a compiled optimizer step's boundary
            windows.run_pending()
        t0 = perf()
        try:
            batch = original_next(self)
        except StopIteration:  # the epoch's end: an iterator without persistent workers shuts its workers down
            if self._num_workers and not self._persistent_workers:
                tracker.on_loader(t0 + off, perf() + off, 0)
            raise
        t1 = perf()
        n = _batch_size(batch)
        if tracker.idle:
            tracker.mark_activity(t0 + off)
        tracker.phases.append(("data", t0 + off, t1 + off, n, None))
        if fingerprint is not None:
            fingerprint.observe(batch, n, tracker.step, self)
        if not getattr(self, "_torsh_seen", False):
            self._torsh_seen = True
            _record_loader(rt, self)
            workers = int(self._num_workers)
            rt.on_loader_started(workers, getattr(self, "_prefetch_factor", None) if workers else None, tracker.step)
        return batch

    _BaseDataLoaderIter.__next__ = __next__

    # A new iterator over a loader with workers starts their processes (every epoch, unless the loader keeps
    # them: persistent_workers); a persistent loader's later epochs only reset its iterator, which is not timed.
    original_get = DataLoader._get_iterator

    @functools.wraps(original_get)
    def _get_iterator(self: DataLoader) -> _BaseDataLoaderIter:
        workers = self.num_workers
        if not workers:
            return original_get(self)
        t0 = perf()
        it = original_get(self)
        tracker.on_loader(t0 + off, perf() + off, int(workers))
        return it

    DataLoader._get_iterator = _get_iterator


def _record_loader(rt: "RankRuntime", it: _BaseDataLoaderIter) -> None:
    """Keep the settings this DataLoader iterator really runs with in meta.json `dataloaders`.

    What ran, not what was asked: pin_memory is off without an accelerator, prefetch_factor and
    persistent_workers only count with workers. The tuner compares these between runs
    (`effective_settings`).
    """
    workers = int(it._num_workers)
    prefetch = getattr(it, "_prefetch_factor", None) if workers else None
    info = {"num_workers": workers, "prefetch_factor": prefetch, "pin_memory": bool(it._pin_memory),
            "persistent_workers": bool(workers and it._persistent_workers)}
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
    traces = rt.traces
    scaled = _patch_grad_scaler_scale()

    perf, off = time.perf_counter, clock_offset()

    @functools.wraps(original)
    def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if traced() or flags._is_compiling_flag:
            return original(tensors, *args, **kwargs)
        # `scaler.scale(loss).backward()`: the loss is the unscaled one (the scale changes over the run).
        unscaled = scaled.pop(id(tensors), None) if scaled else None
        loss_of = unscaled[1] if unscaled is not None and unscaled[0]() is tensors else tensors
        # Before the backward: its comm hooks piggyback this loss (a detached view, no host sync).
        if _loss_observers and isinstance(loss_of, torch.Tensor) and loss_of.dim() == 0:
            _observe_loss(loss_of.detach())
        if not profiled:
            return original(tensors, *args, **kwargs)
        if traces is not None and traces.pending is not None:  # a compiled optimizer step's boundary
            traces.run_pending()
        events = tracker.device_events
        ev0 = events.record() if events is not None else None
        t0 = perf()
        scope = traces.annotate("backward") if traces is not None and traces.recording else None
        try:
            return original(tensors, *args, **kwargs)
        finally:
            if scope is not None:
                TraceWindows.end_annotation(scope)
            t1 = perf()
            # The loss is kept (detached) only on the steps that read it. On CUDA it is copied to pinned
            # host memory on the stream now: read once the step's events completed, it needs no sync.
            keep = tracker.loss_due and isinstance(loss_of, torch.Tensor) and loss_of.dim() == 0
            loss = loss_of.detach() if keep else None
            if loss is not None and ev0 is not None and loss.is_cuda:
                loss = _pinned_copy(loss)  # ordered before the step's end event, which is waited for
            ev1 = events.record() if ev0 is not None else None
            if tracker.idle:
                tracker.mark_activity(t0 + off)
            tracker.phases.append(("backward", t0 + off, t1 + off, loss, (ev0, ev1) if ev0 is not None else None))

    torch.autograd.backward = backward


def _patch_grad_scaler_scale() -> dict[int, tuple[Any, torch.Tensor]]:
    """id(scaled loss) -> (a weak reference to it, the unscaled loss, detached), for the backward probe.

    `GradScaler.scale(loss)` multiplies the loss by a scale that grows and shrinks over the run;
    the step's loss is the unscaled one. Entries are dropped when their backward runs (or their
    scaled tensor is freed).
    """
    scaled: dict[int, tuple[Any, torch.Tensor]] = {}
    scaler_types = {getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)}
    for scaler_type in (t for t in scaler_types if t is not None):
        original = scaler_type.scale
        if getattr(original, "_torsh_patched", False):
            continue

        def scale(self: Any, outputs: Any, _original: Callable = original) -> Any:
            out = _original(self, outputs)
            if isinstance(outputs, torch.Tensor) and isinstance(out, torch.Tensor) and out is not outputs \
                    and not (traced() or flags._is_compiling_flag):
                key = id(out)
                scaled[key] = (weakref.ref(out, lambda _: scaled.pop(key, None)), outputs.detach())
            return out

        functools.update_wrapper(scale, original)
        scale._torsh_patched = True  # type: ignore[attr-defined]
        scaler_type.scale = scale
    return scaled


_PINNED: list[torch.Tensor] = []


def _pinned_copy(loss: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy of a CUDA scalar into one of a ring of pinned host buffers."""
    if len(_PINNED) < 8:
        _PINNED.append(torch.empty((), dtype=torch.float32, pin_memory=True))
    host = _PINNED.pop(0)
    _PINNED.append(host)
    host.copy_(loss, non_blocking=True)
    return host


def _install_optimizer_hooks(rt: "RankRuntime") -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    # "outer": the optimizer whose step is running, "nested": how many steps it runs inside its own (a
    # wrapper such as ZeroRedundancyOptimizer steps its local optimizer, then broadcasts the updated
    # shards): the outermost step is the phase and ends the iteration, its inner steps are part of it.
    # "seen": an optimizer has stepped (its first step finds the module to probe). Not "owner": a step
    # GradScaler skips (inf/NaN gradients, common while its scale calibrates) owns the boundary without one.
    state: dict[str, Any] = {"t0": 0.0, "ev0": None, "owner": None, "stepped": False, "scope": None,
                             "outer": None, "nested": 0, "seen": False}
    tracker = rt.tracker
    traces = rt.traces
    profiled = rt.config.profiler.enabled
    perf, off = time.perf_counter, clock_offset()

    def pre(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, compiled: bool = False) -> None:
        if traced():  # a compiled optimizer step: the hook runs when its graph runs (`_compiled_step_marker`)
            if marker is not None:
                marker(0, id(optimizer))
            return
        if flags._is_compiling_flag:
            return
        # A step that raised never ran its post-hook: its optimizer stepping again is not nested in itself.
        if state["outer"] is not None and state["outer"] != id(optimizer):
            state["nested"] += 1
            return
        state["outer"], state["nested"] = id(optimizer), 0
        if not state["seen"]:
            state["seen"] = True
            _first_optimizer_step(rt, optimizer)
        events = tracker.device_events
        state["ev0"] = events.record() if events is not None else None
        state["t0"] = perf() + off
        if traces is not None and traces.recording and state["scope"] is None:
            # From a compiled graph's op a span would outlive the op's own profiler event: two marks instead.
            if not compiled:
                state["scope"] = traces.annotate("optimizer")
            elif traces.mark("optimizer.begin"):
                state["scope"] = _MARKED

    def post(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any, compiled: bool = False) -> None:
        if traced():
            if marker is not None:
                marker(1, id(optimizer))
            return
        if flags._is_compiling_flag:
            return
        if state["nested"]:
            state["nested"] -= 1
            return
        state["outer"] = None
        if state["scope"] is not None:  # closed before the step boundary, which may end the window
            if state["scope"] is _MARKED:
                traces.mark("optimizer.end")
            else:
                TraceWindows.end_annotation(state["scope"])
            state["scope"] = None
        t1 = perf() + off
        ev0 = state["ev0"]
        ev1 = tracker.device_events.record() if ev0 is not None else None
        tracker.phases.append(("optimizer", state["t0"], t1, None, (ev0, ev1) if ev0 is not None else None))
        # With several optimizers (a GAN), the first one to step marks the step boundary.
        if state["owner"] is None:
            state["owner"] = id(optimizer)
        elif state["owner"] != id(optimizer):
            return
        state["stepped"] = True
        boundary(t1, compiled=compiled)

    def boundary(t1: float, *, compiled: bool = False) -> None:
        if not profiled:
            tracker.step += 1
            done = tracker.step
        else:
            done = tracker.end_step(t1)
        rt.steps_done = done
        unusual = tracker.last_unusual
        if (done == tracker.warmup_steps or done == rt.budget_total) and rt.sampler is not None:
            rt.sampler.mark()  # the measured window's edges: a window shorter than the interval is still sampled

        def after() -> None:
            if traces is not None:
                traces.on_step_end(done, t1, unusual=unusual)
            if rt.ddp_models and profiled:
                rt.ddp_sample_rate_for(done)

        if compiled and traces is not None:  # inside a compiled graph's op: the windows act outside it
            traces.defer(after)
        else:
            after()
        if rt.budget_total is not None and done >= rt.budget_total:  # the warm-up may grow it (on_loader_started)
            raise StepBudgetReached(done)

    marker = _compiled_step_marker(rt, (pre, post))
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    _patch_grad_scaler(state, boundary)


# The optimizer phase of a compiled step, marked at its begin (`TraceWindows.mark`) rather than annotated.
_MARKED = object()

# Optimizers by id(), for the compiled step marker: a graph can only carry an int (registered at construction).
_OPTIMIZERS: dict[int, weakref.ref] = {}


def _compiled_step_marker(rt: "RankRuntime", hooks: tuple[Callable, Callable]) -> Callable[[int, int], None] | None:
    """An ordered custom op that runs the optimizer's pre (0) or post (1) hook from inside a compiled graph.

    `torch.compile` of a function that calls `optimizer.step()` traces the global step hooks into
    its graphs, where a probe does nothing (it must not change the program), so the step's boundary
    never came: no step record at all. Traced, the hooks instead put `torsh_tune::optimizer_step_hook`
    in the graph: an op with an ordered side effect (`_EffectType.ORDERED`, as `aten::_print`), so
    AOTAutograd keeps it in place and Inductor does not drop it; when the graph runs it calls the
    hook as eager code would, at the same point of the step. torch's own optimizer step graph-breaks
    before and after its body (`_use_grad`), so the hooks sit in graphs of their own: no graph break,
    no recompile, two small graphs more per compiled step. None where torch lacks these APIs.
    """
    def optimizer_step_hook(which: int, key: int) -> None:
        ref = _OPTIMIZERS.get(key)
        optimizer = ref() if ref is not None else None
        if optimizer is not None:
            hooks[which](optimizer, (), {}, compiled=True)

    try:  # private APIs (torch >= 2.4): a torch without them gets a note, never a failed run
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        op = torch.library.custom_op("torsh_tune::optimizer_step_hook", optimizer_step_hook, mutates_args=())
        op.register_fake(lambda which, key: None)
        _register_effectful_op(torch.ops.torsh_tune.optimizer_step_hook.default, _EffectType.ORDERED)
    except Exception as exc:  # noqa: BLE001
        rt.note(f"a compiled optimizer step is not seen (its graph cannot carry the step's marker: "
                f"{type(exc).__name__}: {exc})")
        return None
    original = torch.optim.Optimizer.__init__

    @functools.wraps(original)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _OPTIMIZERS[id(self)] = weakref.ref(self, lambda _, key=id(self): _OPTIMIZERS.pop(key, None))

    torch.optim.Optimizer.__init__ = __init__
    return torch.ops.torsh_tune.optimizer_step_hook


def _patch_grad_scaler(state: dict[str, Any], boundary: Callable[[float], None]) -> None:
    """A step GradScaler skips (inf/NaN gradients) never calls `optimizer.step()`; it still ends the iteration."""
    scaler_types = {getattr(torch.amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)}
    for scaler_type in (t for t in scaler_types if t is not None):
        original = scaler_type.step
        if getattr(original, "_torsh_patched", False):
            continue

        def step(self: Any, optimizer: torch.optim.Optimizer, *args: Any, _original: Any = original,
                 **kwargs: Any) -> Any:
            state["stepped"] = False
            result = _original(self, optimizer, *args, **kwargs)
            owner = state["owner"]
            if (not state["stepped"] and (owner is None or owner == id(optimizer))
                    and not (traced() or flags._is_compiling_flag)):
                state["owner"] = id(optimizer)
                boundary(now())
            return result

        step._torsh_patched = True  # type: ignore[attr-defined]
        scaler_type.step = step


def _first_optimizer_step(rt: "RankRuntime", optimizer: torch.optim.Optimizer) -> None:
    """At the first optimizer step: is the run on CUDA, and which module's forward is the step's?

    The forward probed is that of the outermost module(s) holding the optimizer's parameters:
    DDP, an FSDP2 root, a plain module under a hand-written all-reduce, the `torch.compile`
    wrapper around a model (outside the compiled region). Found once, by a scan of live
    modules; probes start with the next step (API-mode models are probed by `parallelize`).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(getattr(p, "is_cuda", False) for p in params):
        rt.training_on_cuda()
    rt.meta["trained"] = _trained(params, optimizer)
    if not rt.config.profiler.enabled or rt.tracker.microbatches:
        return
    owners = _outermost_owners({id(p) for p in params})
    roots = [m for m in owners if m not in rt.probed_modules]
    for i, module in enumerate(roots):
        rt.probed_modules.add(module)
        module.register_forward_pre_hook(rt.forward_pre_hook, with_kwargs=True)
        module.register_forward_hook(rt.forward_post_hook)
        if i:
            rt._no_samples.add(module)
        # A wrapper's inner module runs an evaluation pass without it (the Trainer evaluates DDP's `module`).
        # Not inside a compiled model: a hook added to a module Dynamo has traced would recompile it.
        for inner in () if _compiled(module) else owners[module]:
            _patch_train_mode(rt)
            rt.watch_for_evaluation(inner, samples=not i)
    rt.meta["probed_modules"] = [type(m).__name__ for m in roots]
    rt.count_ddp_syncs(roots)
    rt.save_meta()


def _patch_train_mode(rt: "RankRuntime") -> None:
    """`Module.train(mode)` (and so `eval()`) tells the runtime, for the modules it watches for an evaluation."""
    original = torch.nn.Module.train
    if getattr(original, "_torsh_tune", False):
        return

    @functools.wraps(original)
    def train(self: torch.nn.Module, mode: bool = True) -> torch.nn.Module:
        out = original(self, mode)
        if not (traced() or flags._is_compiling_flag):
            rt.on_train_mode(self, mode)
        return out

    train._torsh_tune = True  # type: ignore[attr-defined]
    torch.nn.Module.train = train


def _compiled(module: torch.nn.Module) -> bool:
    """`torch.compile(module)`'s wrapper, or a module compiled in place (`Module.compile()`)."""
    return type(module).__name__ == "OptimizedModule" or module.__dict__.get("_compiled_call_impl") is not None


def _trained(params: list[Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The parameters the first stepping optimizer owns: how many, their bytes, whether sharded.

    What the strategy advice needs when no DDP model or `parallelize` call says it (FSDP2
    applied by the script, a hand-written all-reduce). A DTensor counts whole (its global
    shape), as DDP's and FSDP's own counts do.
    """
    unique = list({id(p): p for p in params}.values())
    numels = [_whole_numel(p) for p in unique]
    # A wrapper that steps an optimizer of its own (ZeroRedundancyOptimizer's local one over this rank's shard).
    inner = getattr(optimizer, "optim", None)
    return {"num_params": sum(numels),
            "param_bytes": sum(n * p.dtype.itemsize for n, p in zip(numels, unique)),
            "sharded": any(type(p).__name__ == "DTensor" or n > p.numel() for n, p in zip(numels, unique)),
            "optimizer": type(optimizer).__name__,
            **({"wrapped_optimizer": type(inner).__name__} if isinstance(inner, torch.optim.Optimizer) else {})}


def _whole_numel(param: Any) -> int:
    """A parameter's elements on all ranks together: a DTensor's global shape; FSDP1's flat parameter (a
    `Parameter` flagged `_is_flat_param`) holds this rank's shard of its original parameters, whose
    elements `_numels` gives (padding left out)."""
    numels = getattr(param, "_numels", None) if getattr(param, "_is_flat_param", False) else None
    return int(sum(numels)) if numels else param.numel()


def _outermost_owners(param_ids: set[int]) -> dict[torch.nn.Module, list[torch.nn.Module]]:
    """The outermost modules holding any of `param_ids`, each with the modules inside it that hold the same of
    them (a wrapper's inner module: DDP's `module`, torch.compile's `_orig_mod`, Lightning's LightningModule)."""
    import gc

    # type(), not isinstance(): gc also holds weak proxies, which raise once their object is gone.
    modules = [m for m in gc.get_objects() if issubclass(type(m), torch.nn.Module)]
    held = {id(m): frozenset(id(p) for p in m.parameters() if id(p) in param_ids) for m in modules}
    holders = [m for m in modules if held[id(m)]]
    inner = {id(child) for m in holders for child in m.modules() if child is not m}
    # torch.compile's wrapper holds the model as `_orig_mod` (a submodule): it is outermost.
    return {m: [c for c in m.modules() if c is not m and held.get(id(c)) == held[id(m)]]
            for m in holders if id(m) not in inner}


# -- checkpoint saves ------------------------------------------------------------------
#: Modules whose save functions are timed once they are imported: distributed checkpointing's (its package
#: re-exports them: ``dcp.save``) and safetensors' (Hugging Face's model files: `save_pretrained`, the Trainer).
_SAVERS = {
    "torch.distributed.checkpoint.state_dict_saver": ("save", "async_save", "save_state_dict"),
    "safetensors.torch": ("save_file",),
}


def _patch_checkpoint_saves(rt: "RankRuntime") -> None:
    """Time checkpoint saves on the training thread: `torch.save`, distributed checkpointing's
    `save`, `async_save` (its blocking part: planning and staging) and `save_state_dict`, and
    safetensors' `save_file`.

    A save blocks the step that makes it (`StepRecord.checkpoint_s`, host clock). Only the thread
    that runs the script counts (async_save writes on a thread of its own) and only the outermost
    call (DCP's writer and a framework's save call `torch.save` inside). The other modules are patched
    when they are imported (DCP's import costs ~40 ms, which a run that never saves should not pay),
    before whoever imports them binds the names (DCP's package, accelerate's `safe_save_file`).
    """
    if not rt.config.profiler.enabled:
        return
    tracker = rt.tracker
    training = threading.get_ident()
    perf, off = time.perf_counter, clock_offset()
    depth = [0]

    def timed(original: Callable[..., Any]) -> Callable[..., Any]:
        if getattr(original, "_torsh_checkpoint", False):
            return original

        @functools.wraps(original)
        def save(*args: Any, **kwargs: Any) -> Any:
            if traced() or flags._is_compiling_flag or depth[0] or threading.get_ident() != training:
                return original(*args, **kwargs)
            depth[0] += 1
            t0 = perf()
            try:
                return original(*args, **kwargs)
            finally:
                depth[0] -= 1
                tracker.on_checkpoint(t0 + off, perf() + off)

        save._torsh_checkpoint = True  # type: ignore[attr-defined]
        return save

    torch.save = torch.serialization.save = timed(torch.serialization.save)

    for module_name, names in _SAVERS.items():
        def patch(module: Any, names: tuple[str, ...] = names) -> None:
            for name in names:
                if callable(getattr(module, name, None)):
                    setattr(module, name, timed(getattr(module, name)))

        if module_name in sys.modules:  # imported before the script (not by torch itself so far): its package too
            patch(sys.modules[module_name])
            package = sys.modules.get(module_name.rpartition(".")[0])
            if package is not None:
                patch(package)
        else:
            sys.meta_path.insert(0, _AfterImport(module_name, patch))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `patch(module)` once module `name` has run, before whoever imported it gets it (one shot)."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: Any) -> None:
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec

