"""Per-rank runtime state: the parsed config, the tracker, the writer and the sampler."""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import DistEnv, RunConfig
from ..profiler import RecordWriter, SharedFields, StepTracker, SystemSampler, now, open_nvml_device
from ..profiler._clock import offset as _clock_offset, realtime_minus_now
from ..profiler._compiling import flags, traced
from ..profiler.writer import _c_record_lines
from ..profiler.traces import TraceWindows
from ..rundir import RunDir, write_json_atomic
from .patches import _batch_size

__all__ = ["RankRuntime", "active_runtime"]

_perf, _OFF = time.perf_counter, _clock_offset()  # the forward hooks' clock: now() without its call

_ACTIVE: "RankRuntime | None" = None


def active_runtime() -> "RankRuntime | None":
    """The runtime of this rank when it runs under torsh-tune's bootstrap, else None."""
    return _ACTIVE


class RankRuntime:
    """Everything one rank's instrumentation needs, created once by the bootstrap."""

    def __init__(self, config: RunConfig, run_dir: RunDir | None, *, env: DistEnv | None) -> None:
        global _ACTIVE
        _ACTIVE = self
        self.config = config
        self.run_dir = run_dir
        self.env = env  # the launcher's description of this rank (None: not launched), parsed once by the bootstrap
        self.rank = env.rank if env else 0
        self.local_rank = env.local_rank if env else 0
        self.world_size = env.world_size if env else 1
        self.local_world_size = env.local_world_size if env else 1
        self.parallelized: list[tuple[Any, Any]] = []  # (model, pipeline runner or None) from the API
        # Whether the run trains on CUDA is known later (`on_cuda`): from the DDP model or the
        # optimizer's parameters. CUDA is not touched here (`cuda` is asked lazily): a script may
        # still choose its device, e.g. CUDA_VISIBLE_DEVICES per rank, which the driver reads once.
        self._cuda: bool | None = None
        self.on_cuda = False
        self.steps_done = 0
        self._loader_checked = False  # the first DataLoader iterator's start-up stock (on_loader_started)
        budget = config.budget
        self.budget_total = None if budget.steps is None else budget.warmup_steps + budget.steps
        enabled = config.profiler.enabled and run_dir is not None
        self.writer = (
            RecordWriter(run_dir, self.rank, flush_interval_s=config.profiler.flush_interval_s) if enabled else None
        )
        self.tracker = StepTracker(
            rank=self.rank,
            writer=self.writer,
            warmup_steps=budget.warmup_steps,
            loss_every=config.profiler.loss_every,
        )
        self.ddp_models: list[Any] = []
        self.collectives: Any = None  # the c10d capture (profiler.collectives), installed with the patches
        self.clock_exchanges = 0  # hosts' clock exchanges made (`patches._exchange_clocks`): names the next one
        self.tracker.step_comm = self.ddp_step_comm
        self.tracker.ddp_timers_every = config.profiler.ddp_timers_every
        self._ddp_rate, self._detailed = 1, True  # DDP's runtime-stats sample rate set on the builtin models
        # The one DDP model with the builtin all-reduce whose forward is probed (the probed module: DDP, or the
        # compiled wrapper around it), and its meta: its all-reduces per step are counted (`_ddp_forward`).
        self._sync_ddp: tuple[Any, dict[str, Any]] | None = None
        self._sync_root: Any = None
        self.meta: dict[str, Any] = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": "cpu",  # "cuda" once the run is seen training on CUDA
            "torch_version": torch.__version__,
            # "c": the record lines are written by profiler/_lines.c; "python": it was not built for this Python
            # (the same lines at 6-8x the CPU per line)
            "record_writer": "python" if _c_record_lines is None else "c",
            "num_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "t_start": now(),
            "notes": [],
        }
        self.sampler: SystemSampler | None = None
        self._fwd: tuple[float, Any, int, Any] | None = None  # (t0, start event, batch, trace annotation)
        # The evaluation forward in progress (no gradients, the module in eval mode): (module, t0, start event, batch).
        self._eval: tuple[Any, float, Any, int] | None = None
        # Modules a wrapper holds with the same parameters: id -> [module, its eval hooks' handles while in eval mode].
        self._eval_watched: dict[int, list[Any]] = {}
        # Modules whose forward is probed, and those whose batches are not the step's samples
        # (a GAN's second network).
        self.probed_modules: set[Any] = set()
        self._no_samples: set[Any] = set()
        self.traces: TraceWindows | None = None
        if config.profiler.traces_enabled and run_dir is not None:
            self.traces = TraceWindows(
                config=config.profiler, run_dir=run_dir, rank=self.rank, world_size=self.world_size, cuda=lambda: self.cuda,
                warmup_steps=budget.warmup_steps, note=self.note,
                # Export runs between two steps; the next step record starts after it.
                restart_step_clock=self.tracker.restart_clock,
            )
            self.tracker.traces = self.traces  # a traced step's timers are read: the self-check

    @property
    def cuda(self) -> bool:
        """Whether this host has CUDA (the backend's `auto`, trace activities); asked at first use."""
        if self._cuda is None:
            self._cuda = torch.cuda.is_available()
        return self._cuda

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.writer is None:
            return
        writer = self.writer
        self.sampler = SystemSampler(
            self.rank, lambda r: writer.write("system", r), interval_s=self.config.profiler.system_interval_s,
            on_error=lambda message: self.note(f"system sampler: {message}"),
        )
        self.sampler.start()
        if self.local_rank == 0:  # one per node: its NICs, InfiniBand, GPUs and their links
            self._node_facts: list[dict[str, Any]] = []
            self._facts_thread = threading.Thread(target=self._detect_node, name="torsh-tune-topology", daemon=True)
            self._facts_thread.start()
        self.save_meta()

    def training_on_cuda(self) -> None:
        """The script trains on CUDA (a CUDA DDP model, or an optimizer over CUDA parameters): from
        the next step on, phases and NCCL collectives are device time, and NVML samples its GPU."""
        if self.on_cuda:
            return
        self.on_cuda = True
        self.meta["device"] = "cuda"
        self.tracker.ddp_timers_every = 1  # PyTorch samples its CUDA timers itself
        if self.writer is None:
            return
        self.tracker.use_device_clock(self._cuda_peak)
        device = torch.cuda.current_device()  # the script has chosen its device by now
        handle, reason = open_nvml_device(device)
        self.meta["nvml"] = reason or "ok"
        self.meta["gpu_name"] = torch.cuda.get_device_name(device)
        if self.sampler is not None and handle is not None:
            self.sampler.use_nvml(handle)
        self.save_meta()

    def _detect_node(self) -> None:
        """Read this host's topology facts off the training thread (nvidia-smi can take a while)."""
        from dataclasses import asdict

        from ..fabric import detect_node  # pure Python: sysfs and nvidia-smi

        try:
            # nvidia-smi, not torch: this thread must not initialise CUDA before the script chose its device.
            self._node_facts.extend(asdict(f) for f in detect_node(gpus=shutil.which("nvidia-smi") is not None))
        except Exception as exc:  # noqa: BLE001 - facts are optional
            self._node_facts.append({"name": "node", "value": None, "source": "assumed",
                                     "detail": f"detection failed: {type(exc).__name__}: {exc}"})

    def finish(self, status: str, *, error: BaseException | None = None, tb: str | None = None) -> None:
        """Write the final meta and exit records; safe to call on any path out of the script."""
        if self.sampler is not None:
            self.sampler.stop()
        if self.traces is not None:
            self.traces.close()
            self.meta["trace_windows"] = [w["window"] for w in self.traces.windows]
        kind = self.config.strategy.kind
        if kind != "ddp" and not self.parallelized and status in ("ok", "budget"):
            self.note(f"strategy.kind={kind!r} had no effect: the script never called torsh_tune.parallelize")
        for _, runner in self.parallelized:
            if runner is not None:
                self.meta["pipeline"] = runner.stats()
        thread = getattr(self, "_facts_thread", None)
        if thread is not None:
            thread.join(timeout=2.0)
            if thread.is_alive():
                self.note("node topology facts not recorded: their detection (nvidia-smi) still ran at exit")
            else:
                self.meta["node_facts"] = list(self._node_facts)
        if self.writer is None:
            return
        try:
            self.tracker.flush_comm()
        except Exception as exc:  # device events may be unusable after an error
            self.note(f"pending collectives not written: {exc}")
        for i, model in enumerate(self.ddp_models):
            try:
                data = model._get_ddp_logging_data()
            except Exception as exc:
                self.note(f"DDP logging data unavailable: {exc}")
                continue
            key = "ddp_logging" if i == 0 else f"ddp_logging_{i}"
            self.meta[key] = {k: v for k, v in data.items() if isinstance(v, (int, float, str))}
            # The buckets DDP actually used (rebuilt after the first iteration), for the analysis.
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or "")
            sizes_bytes = [int(x) for x in sizes.replace(",", " ").split() if x.isdigit()]
            if sizes_bytes and i < len(self.meta.get("ddp_models", [])):
                self.meta["ddp_models"][i]["num_buckets"] = len(sizes_bytes)
                self.meta["ddp_models"][i]["bucket_sizes_bytes"] = sizes_bytes
        if self.collectives is not None:
            self.meta["collectives"] = self.collectives.by_issuer
            for name in self.collectives.untimed_waits:
                self.note(f"the waits on {name} works are not timed (the type takes no wrapper): their blocked time "
                          "is the issuing call's alone")
        if self.tracker.device_errors:
            self.note(f"{len(self.tracker.device_errors)} step(s) kept on the host clock, their CUDA events "
                      f"unreadable; first: {self.tracker.device_errors[0]}")
        try:  # every record is queued by now (the sampler stopped, pending steps flushed)
            self.writer.close()
        except OSError as exc:  # the run's records are incomplete: meta.json says so
            self.note(str(exc))
        self.meta["t_end"] = now()
        self.save_meta()
        write_json_atomic(
            self.run_dir.rank_file(self.rank, "exit"),
            {
                "rank": self.rank,
                "status": status,
                "error_type": None if error is None else type(error).__name__,
                "message": None if error is None else str(error),
                "traceback": tb,
                "t_exit": time.time(),
                "steps_done": self.steps_done,
            },
        )

    # -- facts ------------------------------------------------------------------------
    def on_loader_started(self, workers: int, prefetch: int | None, step: int) -> None:
        """The first DataLoader iterator's first batch arrived at `step`: its start-up stock is warm-up.

        Worker processes fill `workers x prefetch_factor` batches while the script is still
        setting up (model, DDP, the first collectives); the steps that consume that stock never
        wait for data, so a short window would measure start-up time, not the loader's steady
        rate (a 6-step window showed 8x for workers whose steady gain is 2x). When the iterator
        starts inside the warm-up, the warm-up runs until the stock is consumed, and the step
        budget grows by the same steps so the measured window keeps its length. The data
        fingerprint keeps its window: the samples compared between runs stay the same steps.
        Ranks run the same script and config, so every rank extends by the same steps.
        """
        if self._loader_checked:
            return
        self._loader_checked = True
        stock = workers * (prefetch or 0)
        if not stock or step >= self.tracker.warmup_steps:
            return
        added = self.tracker.extend_warmup(step + stock)
        if not added:
            return
        if self.budget_total is not None:
            self.budget_total += added
        self.meta["warmup_steps"] = self.tracker.warmup_steps
        self.note(f"warm-up extended by {added} step(s) to {self.tracker.warmup_steps}: the DataLoader's "
                  f"{workers} worker(s) x prefetch_factor {prefetch} = {stock} batches were ready before the "
                  f"loop, so those steps never waited for data")
        self.save_meta()

    def note(self, message: str) -> None:
        self.meta["notes"].append(message)

    def save_meta(self) -> None:
        if self.writer is not None:
            write_json_atomic(self.run_dir.rank_file(self.rank, "meta"), self.meta)

    def on_ddp_created(self, model: Any, applied: dict[str, Any], *, built_by: str = "user") -> None:
        self.ddp_models.append(model)
        self._sync_ddp = self._sync_root = None  # a second DDP model: none is counted (`count_ddp_syncs`)
        params = [p for p in model.module.parameters() if p.requires_grad]
        info = {
            **_bucket_caps_mb(model),
            "gradient_as_bucket_view": bool(model.gradient_as_bucket_view),
            "static_graph": bool(model.static_graph),
            "find_unused_parameters": bool(model.find_unused_parameters),
            "broadcast_buffers": bool(model.broadcast_buffers),
            "num_params": sum(p.numel() for p in params),
            "num_param_tensors": len(params),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            # What DDP broadcasts from rank 0 before each forward (its buffers: BatchNorm's running statistics,
            # a transformer's position ids), a `broadcast` record of issuer ddp every step; 0 when it does not.
            **(_broadcast_buffers(model) if model.broadcast_buffers
               else {"buffer_bytes": 0, "running_stats_bytes": 0, "largest_buffers": []}),
            "comm_hook": "allreduce",
            "applied_from_config": applied,
            "built_by": built_by,  # transformers, lightning, accelerate, torsh-tune or user: whose settings reach DDP
            "module": type(model.module).__name__,
        }
        self.meta.setdefault("ddp_models", []).append(info)
        self.meta["ddp"] = self.meta["ddp_models"][0]
        if len(self.ddp_models) == 2 and self.tracker.ddp_timers_every > 1 and not self.on_cuda:
            # Each model counts its own iterations (a discriminator may run two forwards per step): the
            # iterations DDP collects at a rate k > 1 differ between them, so every step is read, at rate 1
            # (`ddp_sample_rate_for` sets it at the next step boundary).
            self.tracker.ddp_timers_every = 1
            self.note("two DDP models: DDP's timers are read at every step (profiler.ddp_timers_every = 1), "
                      "as each model's iterations are its own")
        self.save_meta()

    def on_parallelize(self, model: Any, facts: dict[str, Any], runner: Any) -> None:
        """`torsh_tune.parallelize` applied a strategy: record it and probe the model's forward."""
        self.parallelized.append((model, runner))
        self.meta["strategy"] = facts
        if runner is not None:
            self.meta["pipeline"] = facts.get("pipeline")
        if self.config.profiler.enabled and facts["kind"] != "ddp":  # DDP's constructor patch probes DDP
            modules = list(model.stages) if runner is not None else [model]
            for module in modules:
                self.probed_modules.add(module)
                module.register_forward_pre_hook(self.forward_pre_hook, with_kwargs=True)
                module.register_forward_hook(self.forward_post_hook)
        self.save_meta()

    def count_ddp_syncs(self, roots: list[Any]) -> None:
        """Count the all-reduces per step of the run's one DDP model, when it has the builtin all-reduce and its
        forward is a probed root's (DDP itself, or the `torch.compile` wrapper around it). With several DDP
        models (a GAN: each counts its own iterations, a discriminator may run two forwards per backward),
        none is counted: their steps keep one read per model at the step's end."""
        if len(self.ddp_models) != 1:
            return
        found = []
        for root in roots:
            # `torch.compile`'s wrapper holds the model as its `_orig_mod` child; a module compiled in place is itself
            inner = root.__dict__.get("_modules", {}).get("_orig_mod", root)
            for model, info in zip(self.ddp_models, self.meta.get("ddp_models", [])):
                if model is inner and model.__dict__.get("_torsh_timed_hook") is None:
                    found.append((root, model, info))
        if len(found) == 1:
            self._sync_root, model, info = found[0]
            self._sync_ddp = (model, info)

    def on_comm_hook(self, model: Any, name: str) -> None:
        for info, m in zip(self.meta.get("ddp_models", []), self.ddp_models):
            if m is model:
                info["comm_hook"] = name
        self.save_meta()

    def ddp_step_comm(self, step: int, seq: int, *, read: bool = True, snapshots: list[dict[str, int]] | None = None,
                      syncs: int = 0) -> tuple[list[dict[str, Any]], float, bool]:
        """One CommRecord per DDP model whose buckets are not timed by a Python hook.

        PyTorch's C++ all-reduce stays in place for those models; DDP's own runtime timers
        (sampled every iteration on CPU) say when the step's communication started (first
        bucket ready) and ended, and when backward compute ended. On CUDA PyTorch samples them
        (iterations 1-10, then every 100th), and a step's timers are reported at the next
        forward: a step that is not sampled is not timed, nor one whose timers are not read
        (`read=False`: a run's last step, and on CPU the steps `profiler.ddp_timers_every`
        skips). Returns (records, exposed comm s, whether every such model's comm was timed).

        A step whose model all-reduced after each of its `syncs` (> 1) micro-batches (accumulation
        outside `no_sync`) has one record per all-reduce, from the timers read at the forward that
        reported each (`snapshots`, `StepTracker.ddp_sync_read`), and their exposures add up; with
        fewer distinct ones than `syncs` (DDP did not collect them all) its communication is not timed.
        """
        if syncs:
            return self._ddp_sync_comm(step, seq, snapshots or [], syncs)
        records, exposed = [], 0.0
        # Our attributes on a model are read from its __dict__: `getattr(model, name, None)` on a name
        # never set goes through Module.__getattr__, which formats and raises an AttributeError (every step).
        builtin = [(m, info) for m, info in zip(self.ddp_models, self.meta.get("ddp_models", []))
                   if m.__dict__.get("_torsh_timed_hook") is None]
        if not builtin:
            return records, exposed, True
        # On CUDA DDP collects its timers at iterations 1-10 and every 100th (its default rate), and the
        # step's iteration is step + offset (1 unless the script ran other synchronizing forwards).
        n = step + self.tracker.ddp_offset
        if not read or (self.on_cuda and not (n <= 12 or n % 100 <= 2)):
            return records, exposed, False
        timed = True
        shift = realtime_minus_now()  # DDP's timers read the realtime clock: onto ours, as it stands now
        for model, info in builtin:
            data = _ddp_timers(model)
            start, end = data.get("backward_comm_time_start"), data.get("backward_comm_time_end")
            if not start or not end:
                timed = False  # no timer on this device (yet)
                continue
            if model.__dict__.get("_torsh_last_comm") == (start, end):
                # Sampled every iteration (CPU, ddp_timers_every 1): no all-reduce ran (a no_sync micro-batch):
                # timed, none. Sampled (CUDA, or CPU past the detailed steps): an iteration DDP did not collect.
                timed = timed and not (self.on_cuda or self.tracker.ddp_timers_every > 1)
                continue
            model._torsh_last_comm = (start, end)
            if model is builtin[0][0] and data.get("iteration"):
                self.tracker.ddp_offset = int(data["iteration"]) - step
            t_issue, t_complete = start / 1e9 - shift, end / 1e9 - shift
            exposed = max(exposed, _ddp_exposed(data, t_issue, t_complete, shift, on_cuda=self.on_cuda))
            records.append(self._ddp_record(model, info, step, seq + len(records), t_issue, t_complete))
        return records, max(0.0, exposed), timed

    def _ddp_record(self, model: Any, info: dict[str, Any], step: int, seq: int, t_issue: float,
                    t_complete: float) -> dict[str, Any]:
        """The CommRecord of one builtin all-reduce of `model`'s gradients, from its reducer's timers."""
        shared = model.__dict__.get("_torsh_comm_fields")
        if shared is None:
            group = self.collectives.group_of(model.process_group) if self.collectives is not None else {}
            shared = model._torsh_comm_fields = SharedFields({
                "rank": self.rank, "bucket": -1, "collective": "all_reduce", "hook": "builtin", "issuer": "ddp",
                "num_tensors": info["num_param_tensors"], "clock": "device" if self.on_cuda else "host",
                "async_op": True, **group})
        nbytes = info["param_bytes"]
        return {"_s": shared, "step": step, "seq": seq, "bytes": nbytes, "wire_bytes": nbytes, "grad_bytes": nbytes,
                "t_issue": t_issue, "t_complete": t_complete, "duration_s": t_complete - t_issue}

    def _ddp_sync_comm(self, step: int, seq: int, snapshots: list[dict[str, int]],
                       syncs: int) -> tuple[list[dict[str, Any]], float, bool]:
        """A step of the probed DDP model (`_sync_ddp`) that all-reduced after each of `syncs` micro-batches."""
        model, info = self._sync_ddp
        windows = []
        shift = realtime_minus_now()
        for data in snapshots:
            start, end = data.get("backward_comm_time_start"), data.get("backward_comm_time_end")
            if start and end and (start, end) != model.__dict__.get("_torsh_last_comm"):
                model._torsh_last_comm = (start, end)
                windows.append((data, start / 1e9 - shift, end / 1e9 - shift))
        if len(windows) < syncs:  # an iteration DDP did not collect: the step's communication is unknown
            return [], 0.0, False
        records = [self._ddp_record(model, info, step, seq + i, t0, t1) for i, (_, t0, t1) in enumerate(windows)]
        exposed = sum(_ddp_exposed(data, t0, t1, shift, on_cuda=self.on_cuda) for data, t0, t1 in windows)
        return records, max(0.0, exposed), True

    def ddp_sample_rate_for(self, done: int) -> None:
        """At a step boundary (`done` steps completed), DDP's sample rate for the next forward (CPU).

        DDP collects its timers at iteration n when n % rate == 0 (past its first 10) and reports
        them at the next forward under the rate then in force. Around the detailed steps (the
        warm-up, the first measured ones, trace windows) the rate is 1, from the forward before
        them to the one after; elsewhere `profiler.ddp_timers_every`, and the steps read are
        the iterations that rate collects (`StepTracker.ddp_offset`): DDP's runtime stats at
        every iteration cost ~25-50 µs per step on a 2-core host.
        """
        if self.on_cuda:
            return
        k = self.tracker.ddp_timers_every
        detailed = k == 1 or self.tracker.detailed(done)
        want = 1 if detailed or self._detailed else k
        self._detailed = detailed
        if want != self._ddp_rate:
            self._ddp_rate = want
            for model in self.ddp_models:
                if model.__dict__.get("_torsh_timed_hook") is None:
                    model._set_ddp_runtime_logging_sample_rate(want)

    # -- forward hooks (hot path) ------------------------------------------------------
    # Invisible to torch.compile: under Dynamo (a compiled DDP forward runs DDP's hooks inside
    # the graph) they do nothing, so they add no graph break; the module outside the compiled
    # region (found at the first optimizer step) is probed instead.
    def forward_pre_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        if traced() or flags._is_compiling_flag:
            return
        # No gradient, no training forward: an evaluation pass (`torch.no_grad()`, `inference_mode`) of the
        # trained module between steps is neither the step's forward nor its samples (`eval_pre_hook`).
        if not torch.is_grad_enabled():
            self.eval_pre_hook(module, args, kwargs)
            return
        batch = 0 if module in self._no_samples else (_batch_size(args) if args else 0) or _batch_size(kwargs)
        events = self.tracker.device_events
        traces = self.traces
        if traces is not None and traces.pending is not None:  # a compiled optimizer step's boundary
            traces.run_pending()
        if self._fwd is not None:  # the last forward raised before its post hook: close its annotation
            TraceWindows.end_annotation(self._fwd[3])
        self._eval = None  # an evaluation forward that raised before its post hook
        t0 = _perf() + _OFF
        ev0 = events.record() if events is not None else None
        self._fwd = (t0, ev0, batch, traces.annotate("forward") if traces is not None and traces.recording else None)

    def forward_post_hook(self, module: Any, args: Any, output: Any) -> None:
        if traced() or flags._is_compiling_flag:
            return
        if self._fwd is None:
            if self._eval is not None:
                self.eval_post_hook(module, args, output)
            return
        t0, ev0, batch, scope = self._fwd
        self._fwd = None
        tracker = self.tracker
        if scope is not None:
            TraceWindows.end_annotation(scope)
        ev1 = tracker.device_events.record() if ev0 is not None else None
        t1 = _perf() + _OFF
        if tracker.idle:
            tracker.mark_activity(t0)
        tracker.phases.append(("forward", t0, t1, batch, (ev0, ev1) if ev0 is not None else None))
        if module is self._sync_root:
            self._ddp_forward(tracker)

    def _ddp_forward(self, tracker: StepTracker) -> None:
        """A training forward of the probed DDP model: count its all-reduce, keep the timers it reported.

        DDP reports an iteration's timers at the model's next forward that synchronizes: with one
        such forward per step that is the next step's, where the step's end reads them; with more
        (accumulation outside `no_sync`) each one's timers are kept here, at the forward after it.
        """
        model = self._sync_ddp[0]
        if not model.require_backward_grad_sync:  # inside no_sync: no all-reduce, no report
            return
        n = tracker.ddp_syncs
        step = tracker.step if n else (tracker.step - 1 if tracker.prev_ddp_syncs > 1 else None)
        if not n:
            tracker.prev_ddp_syncs = 0
        if step is not None and tracker.ddp_sync_read(step):
            tracker.ddp_snapshots.append((step, _ddp_timers(model)))
        tracker.ddp_syncs = n + 1

    # An evaluation pass: a forward of the trained module without gradients and in eval mode (`model.eval()`,
    # as the Trainer's, Lightning's and any validation loop do). A no-grad forward in train mode is part of
    # training (pseudo-labels, a rollout) and stays in the step's other. Probed here, and on the modules a
    # wrapper holds with the same parameters while they are in eval mode (DDP's `module`: the Trainer
    # evaluates the unwrapped model); the outermost one is the pass's forward. Host clock (`StepRecord.eval_s`);
    # on CUDA its start is also an event, so that the device's data time ends at the first forward of either kind.
    def watch_for_evaluation(self, module: Any, *, samples: bool = True) -> None:
        """Probe `module`'s evaluation forwards while it is in eval mode (`on_train_mode`). Its hooks come and go
        with the mode: a module with hooks takes nn.Module's slow call path (~3 us per training forward here)."""
        if id(module) in self._eval_watched:
            return
        if not samples:
            self._no_samples.add(module)
        self._eval_watched[id(module)] = [module, None]
        self.on_train_mode(module, module.training)

    def on_train_mode(self, module: Any, mode: bool) -> None:
        entry = self._eval_watched.get(id(module))
        if entry is None or entry[0] is not module:
            return
        if not mode and entry[1] is None:
            entry[1] = (module.register_forward_pre_hook(self.eval_pre_hook, with_kwargs=True),
                        module.register_forward_hook(self.eval_post_hook))
        elif mode and entry[1] is not None:
            self._training_again(entry)

    def _training_again(self, entry: list[Any]) -> None:
        """A watched module is back in train mode: its evaluation hooks go, and the pass has ended."""
        for handle in entry[1]:
            handle.remove()
        entry[1] = None
        self.tracker.on_training_mode(_perf() + _OFF)

    def eval_pre_hook(self, module: Any, args: Any, kwargs: Any) -> None:
        if traced() or flags._is_compiling_flag:
            return
        if module.training:
            # Back in train mode without a train() call: Lightning restores the mode by assigning each
            # module's `training` (`_ModuleMode.restore`). Seen at the first training forward after it.
            entry = self._eval_watched.get(id(module))
            if entry is not None and entry[0] is module and entry[1] is not None:
                self._training_again(entry)
            return
        if self._eval is not None or torch.is_grad_enabled():
            return
        batch = 0 if module in self._no_samples else (_batch_size(args) if args else 0) or _batch_size(kwargs)
        events = self.tracker.device_events
        self._eval = (module, _perf() + _OFF, events.record() if events is not None else None, batch)

    def eval_post_hook(self, module: Any, args: Any, output: Any) -> None:
        if traced() or flags._is_compiling_flag or self._eval is None or self._eval[0] is not module:
            return
        _, t0, ev0, batch = self._eval
        self._eval = None
        self.tracker.on_eval(t0, _perf() + _OFF, batch, ev0)

    @staticmethod
    def _cuda_peak() -> int:
        # The raw counters: max_memory_allocated() flattens the allocator's whole nested stats dict
        # (~0.3 ms per call on an H100).
        stats = torch._C._cuda_memoryStats(torch._C._cuda_getDevice())
        return int(stats["allocated_bytes"]["all"]["peak"])


def _bucket_caps_mb(model: Any) -> dict[str, float]:
    """DDP's bucket caps in MiB. torch 2.13 keeps them in `_bucket_config`, where the first
    bucket's real cap is `per_bucket_bytes_caps[0]` when a `bucket_cap_mb_list` is given (its
    `first_bucket_bytes_cap` is then the largest); earlier releases keep `bucket_bytes_cap`
    on the module and use c10d's fixed first-bucket size."""
    config = getattr(model, "_bucket_config", None)
    if config is None:
        return {"bucket_cap_mb": model.bucket_bytes_cap / 2**20,
                "first_bucket_cap_mb": dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20}
    per_bucket = getattr(config, "per_bucket_bytes_caps", ())
    first = int(per_bucket[0]) if per_bucket else int(config.first_bucket_bytes_cap)
    return {"bucket_cap_mb": config.bucket_bytes_cap / 2**20, "first_bucket_cap_mb": first / 2**20}


def _broadcast_buffers(model: Any) -> dict[str, Any]:
    """What DDP broadcasts before each forward: its buffers' bytes, the share that is normalization
    layers' running statistics (which the forward updates in training), and the largest three."""
    from torch.nn.modules.batchnorm import _NormBase

    named = getattr(model, "named_module_buffers", None) or dict(
        (str(i), b) for i, b in enumerate(getattr(model, "modules_buffers", ())))
    stats = {id(b) for m in model.module.modules() if isinstance(m, _NormBase) and m.track_running_stats
             for b in m.buffers(recurse=False)}
    sizes = [(name, b.numel() * b.element_size(), id(b) in stats) for name, b in named.items()]
    largest = sorted(sizes, key=lambda s: -s[1])[:3]
    return {"buffer_bytes": sum(s[1] for s in sizes),
            "running_stats_bytes": sum(s[1] for s in sizes if s[2]),
            "largest_buffers": [{"name": n, "bytes": b, "running_stats": r} for n, b, r in largest]}


def _ddp_exposed(data: dict[str, int], t_issue: float, t_complete: float, shift: float, *, on_cuda: bool) -> float:
    """The exposed part (s) of a step's builtin all-reduce, from DDP's timers: from its compute end to the end.

    `t_issue` and `t_complete` are on our clock already; DDP's realtime timers are moved onto it by `shift`
    (`realtime_minus_now()`).

    With one bucket on the host clock, all of it: the bucket is launched once every gradient is ready, so
    nothing computes under it, and DDP records its compute end in a callback after the launch returned: a
    launch that stalls on the host (5 ms inside `c10d::allreduce_` with 2 ranks on 2 cores, in a Lightning
    trace) would read as compute hiding the all-reduce. (On CUDA the timers are events on the streams: the
    launch's host time is not in them.)
    """
    if not on_cuda and data.get("num_buckets_reduced") == 1:
        return t_complete - t_issue
    compute_end = data.get("backward_compute_time_end")
    return t_complete - (compute_end / 1e9 - shift) if compute_end else 0.0


def _ddp_timers(model: Any) -> dict[str, int]:
    """DDP's integer logging fields, its runtime timers among them (ns since the epoch, the realtime clock: CPU and
    CUDA timers both stamp each event with `clock_gettime(CLOCK_REALTIME)` when it is recorded).

    `DistributedDataParallel._get_ddp_logging_data()` copies and merges the string fields too
    (bucket sizes, module name, ...): ~40 µs per step on a 2-core host against ~12 µs for the
    integers alone, read the same way (the reducer's logger, under its lock).
    """
    logger = getattr(model, "logger", None)
    if logger is None:
        return model._get_ddp_logging_data()
    return logger._get_ddp_logging_data().ints_map
