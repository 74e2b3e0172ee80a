"""Every collective and p2p operation at the c10d layer, whoever issues it.

DDP comm hooks, FSDP1/FSDP2, pipelining, Trainer/accelerate/Lightning helpers and a
script's own `dist.all_reduce` all call the functions of `torch.distributed`; wrapping
those (once per process, before the script runs) makes one `CommRecord` per outermost
call: op, process group (ranks, backend), bytes, dtype, issuer, host issue time and a
duration that says its clock.

Clocks (design principle 6):
- NCCL: device time. A CUDA event is recorded on the current stream before the call; the
  end event after it (a synchronous NCCL call leaves the current stream waiting for the
  collective) or, for `async_op=True`, in the work's future callback (NCCL runs it at
  once, on streams that wait for the collective). Events are resolved later with
  `query()` by the `StepTracker`; nothing here synchronizes.
- gloo (and any other backend): host time. A synchronous call returns when the
  collective has completed; an asynchronous one completes in its future's callback on
  the backend's thread, which only timestamps and appends (never waits).
The time the training thread itself blocks in the collective is recorded as its
`blocked_s` (host time): with synchronous calls, the whole call; with asynchronous ones, the
issuing call (`issue_s`) and then the time inside `Work.wait()`.

DDP's builtin C++ all-reduce never reaches Python: the reducer's own timers cover it (host
time on CPU, its sampled CUDA timers on a GPU); a Python comm hook's collectives come here
with their bucket.
Probes are invisible to `torch.compile`: while Dynamo traces, the originals run.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ..records import FRAMEWORK_ISSUERS, FRAMEWORK_SYNC_MAX_BYTES
from ._clock import now, offset as _clock_offset
from ._compiling import flags, traced
from .steps import StepTracker
from .writer import SharedFields

__all__ = ["CollectiveCapture", "issuer_of"]

# op name -> the argument whose tensors are the collective's size (nccl-tests' S: the whole
# buffer of an all-gather's output / a reduce-scatter's input). None: sized by nested calls.
_SIZE_ARG: dict[str, str | None] = {
    "all_reduce": "tensor",
    "all_reduce_coalesced": "tensors",
    "broadcast": "tensor",
    "reduce": "tensor",
    "all_gather": "tensor_list",
    "all_gather_coalesced": "output_tensor_lists",
    "all_gather_into_tensor": "output_tensor",
    "_all_gather_base": "output_tensor",
    "all_gather_single": "output_tensor",
    "reduce_scatter": "input_list",
    "reduce_scatter_tensor": "input",
    "_reduce_scatter_base": "input",
    "reduce_scatter_single": "input",
    "all_to_all": "input_tensor_list",
    "all_to_all_single": "input",
    "gather": "tensor",
    "scatter": "tensor",
    "send": "tensor",
    "recv": "tensor",
    "isend": "tensor",
    "irecv": "tensor",
    "batch_isend_irecv": "p2p_op_list",
    "barrier": None,
    "monitored_barrier": None,
    "all_gather_object": None,
    "broadcast_object_list": None,
    "gather_object": None,
    "scatter_object_list": None,
    "send_object_list": None,
    "recv_object_list": None,
}
# Names as records show them (nccl-tests / the trace parser's vocabulary).
_OP_NAME = {
    "_all_gather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "isend": "send",
    "irecv": "recv",
}
_ALWAYS_ASYNC = {"isend", "irecv", "batch_isend_irecv"}
# Collectives that PyTorch's own modules call as C++ bindings of `torch.distributed`, outside
# distributed_c10d's Python functions: name -> (size argument, the binding's parameters, the
# record's op). DDP broadcasts its buffers (BatchNorm's running statistics, a transformer's
# position ids) with it before every forward (`broadcast_buffers=True`, the default): a
# collective every step that the c10d functions never see. (Its broadcast of the module's
# states when it is built goes through torch.distributed.utils: set-up, not recorded.)
_BINDINGS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "_broadcast_coalesced": ("tensors", ("process_group", "tensors", "buffer_size", "src"), "broadcast"),
}

# torch.distributed._functional_collectives (DTensor's redistributions, tensor parallelism, funcol in a
# script): name -> the record's op. They call c10d's ops directly, never the functions above, and return
# a tensor whose collective completes when `wait_tensor` is called on it (at first use).
_FUNCTIONAL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_gather_tensor": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "broadcast": "broadcast",
}

# Caller module prefix -> issuer. The first frame outside torch.distributed's own c10d
# plumbing and this module decides.
_ISSUERS = (
    ("torch.distributed.fsdp", "fsdp"),
    ("torch.distributed._composable.fsdp", "fsdp"),
    ("torch.distributed.pipelining", "pipeline"),
    ("torch.nn.parallel", "ddp"),
    ("torch.distributed.algorithms.ddp_comm_hooks", "ddp"),
    ("torsh_tune.strategies.compression", "ddp"),
    ("torsh_tune.strategies.collectives", "ddp"),
    ("torsh_tune.strategies.pipeline", "pipeline"),
    ("torsh_tune.strategies.fsdp", "fsdp"),
    # The DDP comm hook that times buckets; the rest of the profiler (the trace windows' agreements and
    # alignments on their side group) is ours, not the script's.
    ("torsh_tune.profiler.comm", "ddp"),
    ("torsh_tune.profiler", "torsh-tune"),
    ("torsh_tune.runtime", "torsh-tune"),
    ("torch.distributed.tensor", "dtensor"),
    # Distributed checkpointing (DCP's save/load plan and metadata exchange: object collectives, a barrier).
    ("torch.distributed.checkpoint", "checkpoint"),
    # ZeroRedundancyOptimizer: the updated parameter shards broadcast from their owners after each step.
    ("torch.distributed.optim", "zero"),
    ("accelerate", "accelerate"),
    ("transformers", "transformers"),
    ("lightning", "lightning"),
    ("pytorch_lightning", "lightning"),
    ("deepspeed", "deepspeed"),
    # DDP's and FSDP's broadcast of the module's states when they are built: set-up, before any step.
    ("torch.distributed.utils", "setup"),
)
# Issuers whose calls are not recorded: our own (the teardown barrier), a wrapper's set-up.
_NOT_RECORDED = frozenset({"torsh-tune", "setup"})
_PLUMBING = ("torch.distributed.distributed_c10d", "torch.distributed.c10d_logger", __name__, "functools",
             "torch._dynamo", "torch.utils._contextlib", "torch.distributed._functional_collectives")


@functools.lru_cache(maxsize=4096)  # module names: a framework's calls walk their callers at every call (`_via`)
def issuer_of(module_name: str) -> str:
    """Who issued a collective called from `module_name` (ddp, fsdp, pipeline, user, ...)."""
    for prefix, issuer in _ISSUERS:
        if module_name == prefix or module_name.startswith(prefix + "."):
            return issuer
    return "user"


# (the calling function's code object, its module's globals) -> (issuer, origin): one walk per call site.
# Code objects compare by value (not by file): the same function in two modules must not share an entry.
_ISSUER_OF_SITE: dict[tuple[Any, int], tuple[str, str | None]] = {}
# Frames that never say why a framework called torch.distributed: torch's own, ours, the interpreter's.
_NOT_A_REASON = ("torch.", "torsh_tune.", "runpy", "importlib", "threading", "contextlib", "functools")


def _caller_site(frame: Any) -> tuple[str, str | None]:
    """(issuer, origin) of a call from `frame`: who issued it, and the function that called torch.distributed.

    A framework's call (`records.FRAMEWORK_ISSUERS`) adds " via " and the first frame above it outside that
    framework and torch: accelerate's gather for the Trainer's token count, Lightning's flag under the
    script's `fit`. That frame differs from call to call of one site (a framework's gather serves every
    caller), so it is found at each call of the general path (a framework's small calls take it: `_learn_site`).
    """
    key = (frame.f_code, id(frame.f_globals))
    site = _ISSUER_OF_SITE.get(key)
    if site is None:
        site = _walk_issuer(frame)
        if not frame.f_globals.get("__name__", "").startswith(_PLUMBING):  # shared plumbing: its callers differ
            _ISSUER_OF_SITE[key] = site
    issuer, origin = site
    if issuer in FRAMEWORK_ISSUERS and origin is not None:
        via = _via(frame, issuer)
        if via is not None:
            return issuer, f"{origin} via {via}"
    return site


def _module_name(frame: Any) -> str:
    name = frame.f_globals.get("__name__", "")
    if name == "__main__":  # a module run with -m (our bootstrap) keeps its real name in __spec__
        spec = frame.f_globals.get("__spec__")
        name = spec.name if spec is not None else name
    return name


def _where(frame: Any, name: str) -> str:
    """`module:qualname` of a frame's function (a script's file name for its `__main__`)."""
    code = frame.f_code
    module = os.path.basename(code.co_filename) if name == "__main__" else name
    return f"{module}:{getattr(code, 'co_qualname', code.co_name)}"


def _walk_issuer(frame: Any) -> tuple[str, str | None]:
    """(issuer, origin) from the first frame outside c10d's plumbing and this module: the issuer from its
    module, the origin `module:qualname` of its function."""
    while frame is not None:
        name = _module_name(frame)
        if not name.startswith(_PLUMBING):
            return issuer_of(name), _where(frame, name)
        frame = frame.f_back
    return "user", None


# (ids of a frame's code and globals, the issuer) -> (that frame's `module:qualname` if it says why the issuer
# was called, else None; the code and globals, kept alive so that their ids are not reused).
_REASON_OF_FRAME: dict[tuple[int, int, str], tuple[str | None, Any, Any]] = {}


def _via(frame: Any, issuer: str, depth: int = 64) -> str | None:
    """The first frame above `frame` that is neither `issuer`'s, c10d's plumbing, torch's nor ours. Each
    frame's verdict is remembered: a call under 16 frames of a framework walks them in ~5 us (8 us without)."""
    while frame is not None and depth:
        key = (id(frame.f_code), id(frame.f_globals), issuer)
        seen = _REASON_OF_FRAME.get(key)
        if seen is None:
            name = _module_name(frame)
            reason = (not name.startswith(_PLUMBING) and not name.startswith(_NOT_A_REASON)
                      and issuer_of(name) != issuer)
            seen = _REASON_OF_FRAME[key] = (_where(frame, name) if reason else None, frame.f_code, frame.f_globals)
        if seen[0] is not None:
            return seen[0]
        frame, depth = frame.f_back, depth - 1
    return None


def _first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of a tensor, a (nested) list of tensors, or a list of P2POps."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for v in value:
            t = _first_tensor(getattr(v, "tensor", v))
            if t is not None:
                return t
    return None


def _nbytes_dtype(value: Any) -> tuple[int, Any]:
    """Bytes and dtype (a torch.dtype, or None) of a tensor, a (nested) list of tensors, or a list of P2POps."""
    if isinstance(value, torch.Tensor):
        return value.nbytes, value.dtype
    if isinstance(value, (list, tuple)):
        total, dtype = 0, None
        for v in value:
            n, d = _nbytes_dtype(getattr(v, "tensor", v))
            total += n
            dtype = dtype or d
        return total, dtype
    return 0, None


#: Functional collectives that are deprecated aliases: each call warns (FutureWarning, at its caller).
_DEPRECATED_FUNCTIONAL = frozenset({"all_gather_tensor", "reduce_scatter_tensor"})


def _warning_at(caller: Any, call: Callable, *args: Any, **kwargs: Any) -> Any:
    """`call(*args, **kwargs)`, its warnings attributed to the frame `caller` where they named this module's.

    A deprecated functional collective warns with a stack level that counts its direct caller, which
    is the capture's wrapper: the user would read this file and line instead of their own. Only these
    calls come here (catching warnings swaps the module's filters: not for every call).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = call(*args, **kwargs)
    for w in caught:
        if w.filename == __file__:
            where = caller.f_globals
            warnings.warn_explicit(w.message, w.category, caller.f_code.co_filename, caller.f_lineno,
                                   module=where.get("__name__"), registry=where.setdefault("__warningregistry__", {}))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return result


_AWAITING_MAX = 4096  # records awaiting a wait (Work.wait(), wait_tensor) kept at most


def _forget_oldest(records: dict[int, Any], limit: int = _AWAITING_MAX) -> None:
    """Past `limit` records awaiting a wait that never comes, drop the older half (insertion order)."""
    if len(records) > limit:
        for key in list(records)[:limit // 2]:
            del records[key]


def _storage_key(tensor: Any) -> int:
    """The data pointer of a tensor's storage: a functional collective's result and every view of it share it."""
    try:
        return tensor.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - a tensor without storage (a fake or meta tensor)
        return id(tensor)


try:
    from torch.distributed.device_mesh import DeviceMesh as _DeviceMesh
except ImportError:  # a torch without device meshes: no group is one
    class _DeviceMesh:  # type: ignore[no-redef]
        pass


def _functional_site(frame: Any, group: Any, dtype: Any) -> tuple | None:
    """A functional collective's call-site key: the ids of the caller's code and globals, the group, the dtype.

    The group as passed: a name as it is, DTensor's `(mesh, dim)` by the mesh's id, a process group or
    mesh by its id (the site keeps them alive, and `destroy_process_group` forgets every site); a list of
    ranks (deprecated) or anything else has no key and takes the general path at every call.
    """
    if type(group) is str:
        g: Any = group
    elif type(group) is tuple:
        if len(group) != 2 or type(group[1]) not in (int, str):
            return None
        g = (id(group[0]), group[1])
    elif isinstance(group, (c10d.ProcessGroup, _DeviceMesh)):
        g = id(group)
    else:
        return None
    return id(frame.f_code), id(frame.f_globals), g, dtype


class _GroupInfo:
    __slots__ = ("name", "ranks", "backend", "size", "nccl")

    def __init__(self, name: str, ranks: list[int], backend: str) -> None:
        self.name, self.ranks, self.backend, self.size = name, ranks, backend, len(ranks)
        self.nccl = "nccl" in backend  # also "cpu:gloo,cuda:nccl"

    def fields(self) -> dict[str, Any]:
        return {"group": self.name, "group_ranks": self.ranks, "group_size": self.size, "backend": self.backend}


class CollectiveCapture:
    """Wraps `torch.distributed`'s collectives; hands records to a `StepTracker`.

    A record holds what changes per call (step, seq, bytes, times, DDP bucket); what all calls
    of one kind share (op, group, issuer, dtype, clock, stream, hook) is one `SharedFields`
    per kind, built and encoded once (`_s`).
    """

    def __init__(self, tracker: StepTracker, *, rank: int, on_cuda: Callable[[], None] | None = None) -> None:
        self.tracker = tracker
        self.rank = rank
        # Called once, at the first collective on CUDA tensors (the script trains on CUDA): a
        # hand-written all-reduce before the first optimizer step is on the device clock already.
        # (a build without CUDA has no CUDA tensor: nothing to look for at every call)
        self._on_cuda = on_cuda if torch.backends.cuda.is_built() else None
        self._local = _CallState()  # depth of nested calls; the DDP bucket being reduced
        self._open_buckets = _OpenBuckets()
        self._groups: dict[int, _GroupInfo] = {}
        self._default: _GroupInfo | None = None  # the default group's, until it is destroyed
        # kind of call -> (its shared fields, [count, bytes])
        self._kinds: dict[tuple, tuple[SharedFields, list[int]]] = {}
        self._works: dict[int, dict[str, Any]] = {}  # id(work) -> its record, until waited on
        self._wait_types: set[type] = set()  # the work types whose wait() is timed (`_patch_wait`)
        self.untimed_waits: list[str] = []  # work types that refused the wrapper: their waits are not timed
        # Device clock: id(work) -> the record of an asynchronous NCCL collective not waited on yet. Handed
        # to the tracker at its Work.wait() (with an event where the stream reached the wait) or, never
        # waited on (a chained future), when its step ends (`release_unwaited`).
        self._unwaited: dict[int, dict[str, Any]] = {}
        # Per wrapped function, (ids of the caller's code and globals, id(group), dtype, async_op) -> (shared
        # fields, [count, bytes], issuer, its index in `tracker.call_sites`, (code, globals) kept alive, whether a
        # framework issues it): the fast path's one lookup per call (host clock, outside DDP buckets).
        self._sites: list[dict[tuple, tuple]] = []
        self._sites_lock = threading.Lock()  # a new site's index in `tracker.call_sites`
        self.installed: list[str] = []

    @property
    def by_issuer(self) -> dict[str, dict[str, int]]:
        """issuer -> {"count", "bytes"} of every collective captured so far (for meta.json)."""
        out: dict[str, dict[str, int]] = {}
        for shared, (count, nbytes) in self._kinds.values():
            totals = out.setdefault(shared["issuer"], {"count": 0, "bytes": 0})
            totals["count"] += count
            totals["bytes"] += nbytes
        return out

    # -- installation -------------------------------------------------------------------
    def install(self) -> None:
        # Imported before c10d's functions are wrapped: it keeps references to them ("legacy" collectives)
        # that Dynamo rewrites into traceable ones; taken after, they would be our wrappers and a compiled
        # dist.all_reduce would be traced into c10d's Python instead.
        try:
            import torch.distributed._functional_collectives  # noqa: F401
        except ImportError:
            pass
        for name, size_arg in _SIZE_ARG.items():
            original = getattr(c10d, name, None)
            if original is None or getattr(original, "_torsh_capture", False):
                continue
            self._replace(name, original, self._wrap(name, original, size_arg))
            self.installed.append(name)
        for name, (size_arg, params, op) in _BINDINGS.items():
            original = getattr(dist, name, None)
            if original is None or getattr(original, "_torsh_capture", False):
                continue
            wrapper = self._wrap(name, original, size_arg, params=params, op=op)
            wrapper._torsh_capture = True  # type: ignore[attr-defined]
            setattr(dist, name, wrapper)  # callers look it up on torch.distributed at each call
            self.installed.append(name)
        self._replace("destroy_process_group", c10d.destroy_process_group, self._wrap_destroy(c10d.destroy_process_group))
        self._patch_wait()
        self._install_functional()

    @staticmethod
    def _replace(name: str, original: Callable, wrapper: Callable) -> None:
        wrapper._torsh_capture = True  # type: ignore[attr-defined]
        setattr(c10d, name, wrapper)
        if getattr(dist, name, None) is original:
            setattr(dist, name, wrapper)

    def _wrap_destroy(self, original: Callable) -> Callable:
        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            # Group objects (and their ids) do not outlive this: forget what was learned about them.
            self._groups.clear()
            for sites in self._sites:
                sites.clear()
            self._default = None
            return original(*args, **kwargs)

        return destroy_process_group

    def _patch_wait(self, work_type: type = torch._C._distributed_c10d.Work) -> None:
        """Time `work_type.wait()` (c10d's `Work`; `_end` brings a subclass with a `wait` of its own here: torch's
        fake group's `FakeWork`, a Python backend's works), once per type: a subclass's `wait` that calls the
        base's finds its record taken, and the base's passes through."""
        self._wait_types.add(work_type)
        original = work_type.wait
        if getattr(original, "_torsh_capture", False):
            return
        works, unwaited, tracker = self._works, self._unwaited, self.tracker

        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            record = works.pop(id(work), None)
            if record is None or traced() or flags._is_compiling_flag:
                return original(work, *args, **kwargs)
            # An asynchronous NCCL collective: the current stream waits for it from here (Work.wait() makes
            # it); the time from this event to the collective's end is what the stream idled for it.
            device = unwaited.pop(id(work), None) is not None
            if device:
                record["_wait"] = tracker.device_events.record()
            # In a trace window the wait is annotated (`WAIT_ANNOTATION`): no profiler event records a
            # Work.wait(), and inside an enclosing annotation (ZeroRedundancyOptimizer's step) the trace
            # would read the blocked training thread as that annotation's compute. Timed inside the
            # annotation: timed around its opening, the always-on tier counted the profiler's ~20 us per
            # annotation as waiting, +1.5 pp of a ZeRO step's exposed comm beside the trace's.
            windows = tracker.traces
            scope = windows.annotate("wait") if windows is not None and windows.recording else None
            t0 = now()
            try:
                return original(work, *args, **kwargs)
            finally:
                t1 = now()
                if scope is not None:
                    windows.end_annotation(scope)
                record["blocked_s"] += t1 - t0
                if device:
                    if "_end" in record:
                        tracker.on_collective(record)
                    else:  # its future's callback has not run yet: it hands the record on
                        record["_waited"] = True
                else:
                    record["_wait_end"] = t1  # often well after the completion: `_comm_times` places the wait
                    if record.pop("_on_wait", False):  # a work without a future: it completed when wait() returned
                        record["t_complete"], record["duration_s"] = t1, t1 - record["t_issue"]
                        tracker.on_collective(record)

        wait._torsh_capture = True  # type: ignore[attr-defined]
        try:
            work_type.wait = wait
        except (TypeError, AttributeError):  # a type that takes no attribute: the run goes on, meta.json says so
            self.untimed_waits.append(f"{work_type.__module__}.{work_type.__qualname__}")

    # -- functional collectives --------------------------------------------------------
    def _install_functional(self) -> None:
        """Wrap `torch.distributed._functional_collectives`' collectives and its `wait_tensor`.

        DTensor (tensor parallelism, FSDP2's DTensor parameters when redistributed) looks them up on the
        module at each call. A call is issued asynchronously; its record completes when `wait_tensor` is
        called on its result (at the tensor's first use): on the host clock it completed by then (the time
        the training thread waited in it is its exposed part), on the device clock at an event recorded
        after that wait (the stream now waits for it), with one before it for where the stream reached it.
        """
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:  # an older torch: nothing to wrap
            return
        pending: dict[int, dict[str, Any]] = {}  # the result's storage -> its record, until waited on
        for name, op in _FUNCTIONAL.items():
            original = getattr(funcol, name, None)
            if original is None or getattr(original, "_torsh_capture", False):
                continue
            wrapper = self._wrap_functional(funcol, original, op, pending)
            wrapper._torsh_capture = True  # type: ignore[attr-defined]
            setattr(funcol, name, wrapper)
            self.installed.append(f"functional.{name}")
        original_wait = funcol.wait_tensor
        if getattr(original_wait, "_torsh_capture", False):
            return
        tracker, perf, offset = self.tracker, time.perf_counter, _clock_offset()

        @functools.wraps(original_wait)
        def wait_tensor(tensor: Any) -> Any:
            # Under Dynamo (a compiled region's wait) nothing but the original: it folds traced() to True.
            if traced() or flags._is_compiling_flag or not pending:
                return original_wait(tensor)
            record = pending.pop(_storage_key(tensor), None)
            if record is None:
                return original_wait(tensor)
            device = "_start" in record
            if device:
                record["_wait"] = tracker.device_events.record()
            t0 = perf()
            try:
                return original_wait(tensor)
            finally:
                t1 = perf()
                record["blocked_s"] += t1 - t0
                if device:
                    record["_end"] = tracker.device_events.record()
                else:
                    t1 += offset
                    record["t_complete"], record["duration_s"] = t1, t1 - record["t_issue"]
                tracker.on_collective(record)

        wait_tensor._torsh_capture = True  # type: ignore[attr-defined]
        funcol.wait_tensor = wait_tensor

    def _wrap_functional(self, funcol: Any, original: Callable, op: str, pending: dict[int, dict[str, Any]]) -> Callable:
        params = list(inspect.signature(original).parameters)
        i_group = params.index("group")
        local, getframe, tracker = self._local, sys._getframe, self.tracker
        gathers = op == "all_gather_into_tensor"
        deprecated = original.__name__ in _DEPRECATED_FUNCTIONAL
        # (ids of the caller's code and globals, the group: its name, else its id, dtype) -> (shared fields,
        # [count, bytes], bytes per input byte, (code, globals, group) kept alive): a known call site's one lookup.
        sites: dict[tuple, tuple] = {}
        self._sites.append(sites)
        perf, offset, tensor_type = time.perf_counter, _clock_offset(), torch.Tensor

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            # Dynamo rewrites a traced dist.all_reduce into these functions: under tracing, nothing but the
            # original (it folds traced() to True before reading anything else).
            if traced() or flags._is_compiling_flag or local.depth:
                return original(*args, **kwargs)
            frame = getframe(1)
            tensor = args[0] if args else kwargs.get("self")
            group = kwargs["group"] if "group" in kwargs else args[i_group] if len(args) > i_group else None
            # The common call (a known call site and group, host clock): no issuer walk, no group resolution.
            # Its counting and timing are `_wrap`'s common call's, written out again: a shared helper's call
            # would be a measurable part of what this path costs.
            key = site = None
            if tracker.device_events is None and isinstance(tensor, tensor_type) and "tag" not in kwargs:
                key = _functional_site(frame, group, tensor.dtype)
                site = sites.get(key)
            if site is not None:
                nbytes = tensor.nbytes * site[2]
                counts = site[1]
                counts[0] += 1
                counts[1] += nbytes
                seq = tracker._comm_seq
                tracker._comm_seq = seq + 1
                step = tracker.step
                local.depth = 1
                t0 = perf()
                try:
                    result = original(*args, **kwargs)
                finally:
                    local.depth = 0
                issue = perf() - t0
                record = {"_s": site[0], "step": step, "seq": seq, "bytes": nbytes, "wire_bytes": nbytes,
                          "t_issue": t0 + offset, "blocked_s": issue}
                elem = getattr(result, "elem", None)
                if isinstance(elem, tensor_type) and not getattr(result, "completed", True):
                    record["issue_s"] = issue
                    pending[_storage_key(elem)] = record
                    if len(pending) > _AWAITING_MAX:
                        _forget_oldest(pending)
                else:
                    record["t_complete"], record["duration_s"] = record["t_issue"] + issue, issue
                    tracker.on_collective(record)
                return result
            issuer, origin = _caller_site(frame)
            if issuer in _NOT_RECORDED:
                return original(*args, **kwargs)
            try:
                # A list of ranks (deprecated: funcol warns about it) resolved without a second warning of ours.
                pg = (c10d._resolve_group_name_by_ranks_and_tag(group, kwargs.get("tag", ""))
                      if isinstance(group, list) else funcol._resolve_group(group, kwargs.get("tag", "")))
                if isinstance(pg, str):
                    pg = c10d._resolve_process_group(pg)
            except Exception:  # noqa: BLE001 - what the call itself will refuse: let it say so
                return original(*args, **kwargs)
            info = self._group(pg)
            nbytes = tensor.nbytes * (info.size if gathers else 1) if isinstance(tensor, torch.Tensor) else 0
            record = self._begin(op, pg, nbytes, getattr(tensor, "dtype", None), issuer, True, origin, info)
            if (key is not None and "_start" not in record and not deprecated and issuer not in FRAMEWORK_ISSUERS
                    and not _module_name(frame).startswith(_PLUMBING)):  # shared plumbing: its callers differ
                sites[key] = (record["_s"], self._kind_counts(record["_s"]), info.size if gathers else 1,
                              (frame.f_code, frame.f_globals, group[0] if type(group) is tuple else group))
            local.depth = 1
            try:
                if deprecated or isinstance(group, list):  # it warns: at the script's line, not this one
                    result = _warning_at(getframe(1), original, *args, **kwargs)
                else:
                    result = original(*args, **kwargs)
            finally:
                local.depth = 0
            elem = getattr(result, "elem", None)  # an AsyncCollectiveTensor: completes at its wait_tensor
            if isinstance(elem, torch.Tensor) and not getattr(result, "completed", True):
                if "_start" in record:  # enqueued: from here the collective's stream may run it (see `_begin`)
                    record["_issued"] = tracker.device_events.record()
                record["issue_s"] = record["blocked_s"] = now() - record["t_issue"]
                pending[_storage_key(elem)] = record
                _forget_oldest(pending)  # results nobody waited on
            else:  # already waited (a gather that concatenated): done on return, as a synchronous call
                self._end(record, None)
            return result

        return collective

    def _wrap(self, name: str, original: Callable, size_arg: str | None, *, params: tuple[str, ...] | None = None,
              op: str | None = None) -> Callable:
        """`params`: the parameter names of a binding without a signature; `op`: the records' op name."""
        params = list(params or inspect.signature(original).parameters)
        group_arg = "group" if "group" in params else "process_group"
        i_group = params.index(group_arg) if group_arg in params else None
        i_async = params.index("async_op") if "async_op" in params else None
        i_size = params.index(size_arg) if size_arg in params else None
        # Where a positional group / async_op would be; a function without one: past any call's arguments.
        i_group_at = i_group if i_group is not None else sys.maxsize
        i_async_at = i_async if i_async is not None else sys.maxsize
        op = op or _OP_NAME.get(name, name)
        always_async = name in _ALWAYS_ASYNC
        local = self._local
        tracker = self.tracker
        sites: dict[tuple, tuple] = {}  # this function's call sites
        self._sites.append(sites)
        getframe = sys._getframe
        perf, offset = time.perf_counter, _clock_offset()
        append = tracker.comm_done.append
        tensor_type = torch.Tensor
        not_recorded = _NOT_RECORDED
        sync_bytes = FRAMEWORK_SYNC_MAX_BYTES
        open_buckets = self._open_buckets

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if local.depth:  # inside a captured call: an object collective's own calls
                if i_size is not None and local.record is not None:
                    n, d = _nbytes_dtype(kwargs.get(size_arg) if size_arg in kwargs else
                                         args[i_size] if len(args) > i_size else None)
                    local.record["bytes"] += n
                    local.record["wire_bytes"] += n
                    local.dtype = local.dtype or d
                return original(*args, **kwargs)
            if traced() or flags._is_compiling_flag:
                return original(*args, **kwargs)
            frame = getframe(1)
            group = kwargs.get(group_arg) if group_arg in kwargs else (
                args[i_group] if len(args) > i_group_at else None)
            async_op = always_async or bool(kwargs.get("async_op") if "async_op" in kwargs else (
                args[i_async] if len(args) > i_async_at else False))
            if i_size is None:  # sized by the calls it makes
                issuer, origin = _caller_site(frame)
                if issuer in not_recorded:  # our own teardown barrier is not the script's
                    return original(*args, **kwargs)
                record = self._begin(op, group, 0, None, issuer, async_op, origin)
                local.depth, local.record, local.dtype = 1, record, None
                try:
                    result = original(*args, **kwargs)
                finally:
                    local.depth, local.record = 0, None
                if local.dtype is not None:
                    record["dtype"] = str(local.dtype).removeprefix("torch.")
                self._end(record, result)
                return result
            value = kwargs.get(size_arg) if size_arg in kwargs else args[i_size] if len(args) > i_size else None
            if isinstance(value, tensor_type):
                nbytes, dtype, first = value.nbytes, value.dtype, value
            else:
                (nbytes, dtype), first = _nbytes_dtype(value), None
            if self._on_cuda is not None and getattr(first if first is not None else _first_tensor(value),
                                                     "is_cuda", False):
                on_cuda, self._on_cuda = self._on_cuda, None
                on_cuda()
            # The common call (a known call site, group and dtype; host clock; not a DDP bucket's): one
            # lookup for its shared fields, counters and issuer, and (synchronous) a tuple for the tracker.
            # Anything else goes through _begin/_end.
            site = sites.get((id(frame.f_code), id(frame.f_globals), id(group), dtype, async_op))
            if (site is None or tracker.device_events is not None or (open_buckets.count and local.bucket is not None)
                    or (site[5] and nbytes <= sync_bytes)):  # a framework's flag: who called it, at every call
                issuer, origin = (_caller_site(frame) if site is None or site[5]
                                  else (site[2], site[0].get("origin")))
                if issuer in not_recorded:
                    return original(*args, **kwargs)
                record = self._begin(op, group, nbytes, dtype, issuer, async_op, origin)
                if site is None:
                    self._learn_site(sites, frame, group, dtype, async_op, issuer, record)
                local.depth, local.record = 1, None
                try:
                    result = original(*args, **kwargs)
                finally:
                    local.depth = 0
                self._end(record, result)
                return result
            # (a site is learned only for a recorded issuer: `_learn_site`)
            counts = site[1]
            counts[0] += 1
            counts[1] += nbytes
            seq = tracker._comm_seq
            tracker._comm_seq = seq + 1
            step = tracker.step
            local.depth = 1
            t0 = perf()
            try:
                result = original(*args, **kwargs)
            finally:
                local.depth = 0
            t1 = perf()
            if result is None or not async_op:
                # Synchronous: done on return. Kept as a tuple of numbers (its site's index in
                # `tracker.call_sites`, perf_counter times), which Python's cyclic GC stops tracking at its
                # first collection: the step's accounting and the writer use it as it is.
                append((site[3], step, seq, nbytes, t0, t1))
            else:
                record = {"_s": site[0], "step": step, "seq": seq, "bytes": nbytes, "wire_bytes": nbytes,
                          "t_issue": t0 + offset, "blocked_s": 0.0}
                self._end(record, result)
            return result

        return collective

    def _learn_site(self, sites: dict[tuple, Any], frame: Any, group: Any, dtype: Any, async_op: bool, issuer: str,
                    record: dict[str, Any]) -> None:
        """Remember a call site's shared fields for the fast path (not for shared plumbing: its callers differ).

        A framework's site is remembered too, flagged: its small calls (flags, counters, logged values, at most
        `FRAMEWORK_SYNC_MAX_BYTES`) still take the general path, so that each names the caller of the framework
        (one framework function serves many); its larger ones (the gradients DeepSpeed's engine averages
        itself, tens per step) take the fast path and keep the caller seen first.
        """
        if "_start" in record or "bucket" in record or frame.f_globals.get("__name__", "").startswith(_PLUMBING):
            return
        shared = record["_s"]
        table = self.tracker.call_sites
        with self._sites_lock:
            table.append((shared, issuer))
            index = len(table) - 1
        # Keyed by the code object's id, not the object: hashing a code object hashes its constants, ~1.5 us
        # for a long training function, on every call. The entry holds the code and the globals, so
        # neither id is reused while it lives.
        sites[(id(frame.f_code), id(frame.f_globals), id(group), dtype, async_op)] = (
            shared, self._kind_counts(shared), issuer, index, (frame.f_code, frame.f_globals), issuer in FRAMEWORK_ISSUERS)

    def _kind_counts(self, shared: SharedFields) -> list[int]:
        """The [count, bytes] counters of the kind whose shared fields are `shared`."""
        return next(counts for fields, counts in self._kinds.values() if fields is shared)

    # -- records ------------------------------------------------------------------------
    def _group(self, group: Any) -> _GroupInfo:
        if group is None and self._default is not None:
            return self._default
        pg = group if group is not None else c10d._get_default_group()
        info = self._groups.get(id(pg))
        if info is None:
            try:
                ranks = dist.get_process_group_ranks(pg)
            except Exception:  # noqa: BLE001 - a group this rank is not in
                ranks = []
            backend = str(dist.get_backend(pg))
            default = pg is c10d._get_default_group()
            label = "world" if default else getattr(pg, "group_name", "") or f"group{len(self._groups)}"
            info = self._groups[id(pg)] = _GroupInfo(str(label), ranks, backend)
            if default:
                self._default = info
        return info

    def group_of(self, group: Any) -> dict[str, Any]:
        """The record fields of a process group (None: the default group)."""
        return self._group(group).fields()

    def _kind(self, key: tuple, info: _GroupInfo) -> tuple[SharedFields, list[int]]:
        op, _, issuer, dtype, async_op, stream, hook, origin = key
        fields: dict[str, Any] = {"rank": self.rank, "collective": op, "issuer": issuer, **info.fields(),
                                  "async_op": async_op, "clock": "host" if stream is None else "device"}
        if origin is not None:
            fields["origin"] = origin
        if dtype is not None:
            fields["dtype"] = str(dtype).removeprefix("torch.")
        if stream is not None:
            fields["stream"] = stream
        if hook is not None:
            fields["hook"] = hook
        else:
            fields["bucket"] = -1
        kind = self._kinds[key] = (SharedFields(fields), [0, 0])
        return kind

    def _begin(self, op: str, group: Any, nbytes: int, dtype: Any, issuer: str, async_op: bool,
               origin: str | None = None, info: _GroupInfo | None = None) -> dict[str, Any]:
        tracker = self.tracker
        info = info or self._group(group)
        events = tracker.device_events if info.nccl else None
        stream = None if events is None else "default" if events.current_stream()[1] else "side"
        bucket = self._local.bucket
        key = (op, info, issuer, dtype, async_op, stream, None if bucket is None else bucket[1], origin)
        kind = self._kinds.get(key) or self._kind(key, info)
        kind[1][0] += 1
        kind[1][1] += nbytes
        step, seq = tracker.next_comm()
        record: dict[str, Any] = {"_s": kind[0], "step": step, "seq": seq, "bytes": nbytes, "wire_bytes": nbytes,
                                  "t_issue": now(), "blocked_s": 0.0}
        if bucket is not None:
            record["bucket"] = bucket[0]
            if bucket[2] is not None:  # only the bucket's first collective carries its gradient bytes
                record["grad_bytes"], record["num_tensors"] = bucket[2], bucket[3]
                self._local.bucket = (bucket[0], bucket[1], None, None)
        if events is not None:
            # Where the current stream stood at the issue. An asynchronous collective's stream waits for
            # it; on a starved GPU (the host launching slower than the device runs) the device reaches it
            # long before the host has enqueued the collective, and the issue's own host time (~0.1 ms
            # in c10d and NCCL) would count as communication. So an asynchronous record's device start is
            # a second event, `_issued`, recorded once the call returned (`_end`, the functional wrapper).
            # A synchronous NCCL call runs on the current stream itself (torch >= 2.7), enqueued inside
            # the call: nothing after it could mark its start, so its record starts here.
            record["_start"] = events.record()
        return record

    def _end(self, record: dict[str, Any], result: Any) -> None:
        t_return = now()
        work = result if isinstance(result, torch._C._distributed_c10d.Work) else (
            result[-1] if isinstance(result, list) and result and isinstance(result[-1], torch._C._distributed_c10d.Work)
            else None)
        device = "_start" in record
        if work is None or not record["_s"]["async_op"]:
            # Synchronous: done on return (gloo), or the current stream now waits for it (NCCL).
            record["blocked_s"] = t_return - record["t_issue"]
            if device:
                record["_end"] = self.tracker.device_events.record()
            else:
                record["t_complete"] = t_return
                record["duration_s"] = t_return - record["t_issue"]
            self.tracker.on_collective(record)
            return
        # The issuing call itself held the training thread (gloo enqueues, checks and copies there: 30 µs to
        # ms on a busy host); Work.wait() adds to it.
        record["issue_s"] = t_return - record["t_issue"]
        record["blocked_s"] += record["issue_s"]
        if device:  # enqueued: from here the collective's stream may run it (see `_begin`)
            record["_issued"] = self.tracker.device_events.record()
        self._works[id(work)] = record
        _forget_oldest(self._works)  # works nobody waits on (futures instead)
        if type(work) not in self._wait_types:  # a subclass whose wait() is its own
            self._patch_wait(type(work))
        tracker, events = self.tracker, self.tracker.device_events

        def _complete(fut: Any) -> None:
            if device:
                # NCCL runs this at once, on a stream that waits for the collective: its end on the device.
                # The record waits for the script's Work.wait() (or its step's end) before it is handed on.
                record["_end"] = events.record()
                if not record.pop("_waited", False):
                    return
            else:
                record["t_complete"] = now()
                record["duration_s"] = record["t_complete"] - record["t_issue"]
            tracker.on_collective(record)

        if device:
            self._unwaited[id(work)] = record
        try:
            # Not `then`: it builds a second future for a callback that returns nothing (~0.8 us more per
            # collective). Both register the callback the same way (the future's streams current on CUDA); an
            # error raised in it is logged by torch instead of set on a future nobody reads.
            work.get_future().add_done_callback(_complete)
        except RuntimeError:
            # No future for this work (some p2p works): completion is when wait() returns (host clock).
            record["_on_wait"] = True
            if device:  # rare: the kind's host-clock twin, built for this record
                self._unwaited.pop(id(work), None)
                record["_s"] = SharedFields({k: v for k, v in record["_s"].items() if k != "stream"} | {"clock": "host"})
                del record["_start"]
                self.tracker.device_events.release(record.pop("_issued"))

    def release_unwaited(self) -> None:
        """At a step's end (device clock): hand on the asynchronous collectives nobody waited on with Work.wait().

        Their results were used through their futures (or not at all): nothing timed a wait on the
        stream, so they count as overlapped. Those whose future's callback has not run yet stay.
        """
        unwaited = self._unwaited
        if not unwaited:
            return
        for key, record in list(unwaited.items()):
            if "_end" in record:
                del unwaited[key]
                self.tracker.on_collective(record)

    # -- DDP buckets --------------------------------------------------------------------
    def bucket(self, index: int, hook: str, grad_bytes: int, num_tensors: int) -> "_BucketScope":
        """Context for a DDP comm hook call: its collectives carry the bucket's index and hook."""
        return _BucketScope(self._local, (index, hook, grad_bytes, num_tensors), self._open_buckets)

    def averages_on_host(self, group: Any) -> bool:
        """Whether `averaged_bucket` may run for `group`: a host-clock group (gloo; not NCCL, whose collectives
        are timed by CUDA events)."""
        return not self._group(group).nccl

    def averaged_bucket(self, group: Any, buf: torch.Tensor, index: int, hook: str, num_tensors: int) -> Any:
        """PyTorch's default DDP hook (divide by the group's size, all-reduce) on `buf`, captured: its Future.

        The same arithmetic as `default_hooks.allreduce_hook`, issued on the process group itself with
        one future hop, which records the bucket's completion and hands DDP the buffer. Through PyTorch's
        hook, `dist.all_reduce` and the capture wrapper (two hops) a bucket cost ~105-185 us over DDP's
        C++ path on a 2-core host, this way ~15-80 us (`benchmarks/probe_cost.py --workload ddp --profiler
        '{"comm_hook_timing": true}'`, BENCHMARKS.md). Host clock only (`averages_on_host`).
        """
        pg = group if group is not None else c10d._get_default_group()
        buf.div_(pg.size())  # first, as PyTorch's hook does: no overflow in half precision
        nbytes = buf.numel() * buf.element_size()
        with self.bucket(index, hook, nbytes, num_tensors):
            record = self._begin("all_reduce", group, nbytes, buf.dtype, "ddp", True)
        on_collective = self.tracker.on_collective

        def done(fut: Any) -> torch.Tensor:
            fut.value()  # a failed all-reduce fails the bucket's future, as PyTorch's hook does
            t = now()
            record["t_complete"] = t
            record["duration_s"] = t - record["t_issue"]
            on_collective(record)
            return buf

        # Issued when the process group is called (the `c10d::allreduce_` a trace shows): the Python above is
        # the capture's own, 10-25 µs per bucket on a busy 2-core host, which the self-check's trace reads as
        # the backward's compute and the record would count as the bucket's issue.
        record["t_issue"] = now()
        work = pg.allreduce([buf])
        # The issuing call held the training thread (gloo enqueues, checks and copies there; on a busy host
        # the thread may lose its core to a worker mid-call: ms). Set before `then`, which may run `done` now.
        record["issue_s"] = record["blocked_s"] = now() - record["t_issue"]
        return work.get_future().then(done)


class _CallState(threading.local):
    """Per thread: the depth of captured calls, the record an object collective's calls add to, the
    DDP bucket being reduced. Class-level defaults, so that no lookup misses: `getattr(local, name,
    default)` on a missing name builds and drops an AttributeError (~0.5 us per call)."""

    depth = 0
    record: dict[str, Any] | None = None
    dtype: Any = None
    bucket: tuple | None = None


class _OpenBuckets:
    """How many DDP bucket scopes are open, in any thread: while none is, a collective need not read its
    thread's bucket (a thread-local read: 78 ns against 21 ns for this count in `timeit`, on every call of
    the common path)."""

    __slots__ = ("count", "lock")

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()  # two threads' scopes must not lose a count


class _BucketScope:
    __slots__ = ("_local", "_value", "_prev", "_open")

    def __init__(self, local: threading.local, value: tuple, open_buckets: _OpenBuckets) -> None:
        self._local, self._value, self._open = local, value, open_buckets

    def __enter__(self) -> None:
        with self._open.lock:
            self._open.count += 1
        self._prev = self._local.bucket
        self._local.bucket = self._value

    def __exit__(self, *exc: Any) -> None:
        self._local.bucket = self._prev
        with self._open.lock:
            self._open.count -= 1
