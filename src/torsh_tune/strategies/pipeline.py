"""Pipeline parallelism over `torch.distributed.pipelining`, with a measured bubble.

`build_pipeline` cuts a model into stages at named split points, places this rank's
stage(s) in a `PipelineStage` each and drives them with one of torch's schedules:

| schedule        | torch class                    | stages of rank r (p ranks, v per rank) |
|-----------------|--------------------------------|----------------------------------------|
| gpipe           | ScheduleGPipe                  | r                                      |
| 1f1b            | Schedule1F1B                   | r                                      |
| interleaved1f1b | ScheduleInterleaved1F1B        | r, r + p, ..., r + (v-1)p (looped)     |
| loopedbfs       | ScheduleLoopedBFS              | r, r + p, ..., r + (v-1)p (looped)     |
| interleavedzb   | ScheduleInterleavedZeroBubble  | r, r + p, ..., r + (v-1)p (looped)     |
| zbv             | ScheduleZBVZeroBubble          | r and 2p - 1 - r (a V, v = 2)          |

The split is manual, not traced: the model is flattened into an ordered chain of
segments by walking its children, descending into `nn.ModuleList` and plain
`nn.Sequential` containers. This assumes the model's forward applies those children in
order, like `nn.Sequential` (an `embed`, a `blocks` list, a `head`); `build_pipeline`
checks it by comparing `model(example_inputs)` with the chain's output and refuses a
model whose forward is anything else. Such a model can be split with
`torch.distributed.pipelining.pipeline(model, mb_args, split_spec=...)` (export-based
tracing; it works on CPU in torch 2.13) instead. The manual split was chosen because it
needs no tracing, keeps the model's own modules (a stage's parameter names are the
model's, `blocks.2.weight`) and works for any module a chain can call.

Each rank measures its pipeline bubble: the time its stages spend computing
(`forward_one_chunk`, `backward_one_chunk`, `backward_weight_one_chunk` and the loss)
against the time of the whole step. `bubble_pct = 100 * (1 - busy_s / step_s)` also
counts the schedule's own overhead and, on CPU, the time gloo's send/recv spend copying.
Every figure says its clock (`stats()["clock"]`). On CPU it is the host's (`perf_counter`):
the host runs the kernels. On CUDA the host only enqueues kernels, so a host clock would
measure launches; there each span and the step are bracketed by CUDA events on the current
stream (where the stages' kernels and the waits for their P2P transfers run) and read with
`query()` once they completed, at the end of a later step or in `stats()`; no step waits
for the device, and `clock` is "device".
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from ..config import PIPELINE_SCHEDULES, PipelineConfig
from ..errors import invalid

__all__ = ["PipelineRunner", "build_pipeline", "chain_segments", "stage_indices_of", "theoretical_bubble_pct"]

_SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "loopedbfs": ScheduleLoopedBFS,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
_SINGLE_STAGE = ("gpipe", "1f1b")
_TIMED_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


# -- the chain of segments and the split ---------------------------------------------------
def _is_chain_container(module: nn.Module) -> bool:
    # A Sequential subclass with its own forward may do anything: it stays one segment.
    return isinstance(module, nn.ModuleList) or (
        isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward
    )


def chain_segments(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model as an ordered chain of (FQN, module) segments.

    Walks the children in registration order and descends into `nn.ModuleList` and plain
    `nn.Sequential` children; every other child is one segment.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.ModuleList([nn.Tanh(), nn.Linear(4, 1)]))
        >>> [name for name, _ in chain_segments(net)]
        ['0', '1.0', '1.1']
    """
    segments: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            if _is_chain_container(child):
                walk(child, f"{prefix}{name}.")
            else:
                segments.append((f"{prefix}{name}", child))

    walk(model, "")
    return segments


def _call(module: nn.Module, x: Any) -> Any:
    # A tuple between segments is unpacked into positional arguments, as PipelineStage
    # does between stages, so a split anywhere sees the same calling convention.
    return module(*x) if isinstance(x, tuple) else module(x)


def _run_chain(modules: list[nn.Module], args: tuple) -> Any:
    x: Any = args[0] if len(args) == 1 else args
    for module in modules:
        x = _call(module, x)
    return x


class _StageModule(nn.Module):
    """Some consecutive segments of a model, registered under the model's own names."""

    def __init__(self, segments: list[tuple[str, nn.Module]]):
        super().__init__()
        for fqn, module in segments:
            *path, leaf = fqn.split(".")
            parent: nn.Module = self
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.Module())
                parent = parent._modules[part]  # type: ignore[assignment]
            parent.add_module(leaf, module)
        self.segment_names = [fqn for fqn, _ in segments]
        self._chain = [module for _, module in segments]  # a plain list: not registered twice

    def forward(self, *args: Any) -> Any:
        return _run_chain(self._chain, args)


def _split_indices(segments: list[tuple[str, nn.Module]], names: list[str]) -> list[int]:
    """Segment index at which each split point's stage begins (split before the name)."""
    starts: dict[str, int] = {}
    for i, (fqn, _) in enumerate(segments):
        parts = fqn.split(".")
        for k in range(1, len(parts) + 1):
            starts.setdefault(".".join(parts[:k]), i)  # a container's name starts at its first segment
    indices = []
    for name in names:
        if name not in starts:
            example = ".".join(segments[min(1, len(segments) - 1)][0].split(".")[:2])
            raise invalid("pipeline.split_points", f"names of modules in the model's chain of children (e.g. {example!r})",
                          name)
        if starts[name] == 0:
            raise invalid("pipeline.split_points",
                          f"names after the model's first module {segments[0][0]!r} (splitting before it leaves stage 0 "
                          "empty)", name)
        indices.append(starts[name])
    if any(b <= a for a, b in zip(indices, indices[1:])):
        raise invalid("pipeline.split_points", "names in the model's execution order, each starting a different module",
                      names)
    return indices


def _device_of_module(module: nn.Module, default: torch.device) -> torch.device:
    first = next(itertools.chain(module.parameters(), module.buffers()), None)
    return default if first is None else first.device


def _to_device(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _check_is_chain(model: nn.Module, segments: list[tuple[str, nn.Module]], example_args: tuple) -> None:
    """Raise unless the model's forward equals its chain of segments on the example inputs."""
    modes = {m: m.training for m in model.modules()}
    model.eval()  # dropout would make two forwards differ
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            expected = model(*example_args)
            try:
                got = _run_chain([m for _, m in segments], example_args)
            except Exception as exc:  # the chain's calling convention does not fit this model
                got = exc
    finally:
        for m, mode in modes.items():
            m.training = mode
    flat_expected = torch.utils._pytree.tree_leaves(expected)
    flat_got = [] if isinstance(got, Exception) else torch.utils._pytree.tree_leaves(got)
    same = len(flat_expected) == len(flat_got) and all(
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        and torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(flat_expected, flat_got)
    )
    if not same:
        why = f"chain raised {type(got).__name__}: {got}" if isinstance(got, Exception) else "outputs differ"
        raise invalid("model", "a chain of its children applied in order, like nn.Sequential, for a manual pipeline "
                      "split (else split it with torch.distributed.pipelining.pipeline tracing)",
                      f"{type(model).__name__} whose forward is not its chain {[n for n, _ in segments][:4]}... ({why})")


def stage_indices_of(rank: int, *, schedule: str, world_size: int, stages_per_rank: int) -> list[int]:
    """The stages rank `rank` holds: r (one per rank), r, r+p, ... (looped) or r, 2p-1-r (zbv).

    Example:
        >>> stage_indices_of(0, schedule="zbv", world_size=2, stages_per_rank=2)
        [0, 3]
    """
    if schedule == "zbv":
        return [rank, 2 * world_size - 1 - rank]
    return [rank + k * world_size for k in range(stages_per_rank)]


def theoretical_bubble_pct(schedule: str, *, ranks: int, n_microbatches: int, stages_per_rank: int) -> tuple[float, str]:
    """The textbook bubble of a schedule, in percent of the step, and its formula.

    GPipe and 1F1B idle (p-1) of (m+p-1) slots. Interleaving v stages per rank makes each
    slot 1/v as long: (p-1)/(v*m+p-1), for interleaved 1F1B and looped BFS alike.
    Interleaved zero bubble (ZB-H1, Qi et al. 2024) fills the bubble with weight
    gradients and leaves (p-1)/(3*v*m+p-1), assuming forward, input-gradient and
    weight-gradient passes take equal time; under the same assumption ZB-V leaves none.

    Example:
        >>> theoretical_bubble_pct("gpipe", ranks=4, n_microbatches=8, stages_per_rank=1)
        (27.272727272727273, '(p-1)/(m+p-1)')
    """
    p, m, v = ranks, n_microbatches, stages_per_rank
    if schedule in _SINGLE_STAGE:
        return 100 * (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule in ("interleaved1f1b", "loopedbfs"):
        return 100 * (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if schedule == "interleavedzb":
        return 100 * (p - 1) / (3 * v * m + p - 1), "(p-1)/(3*v*m+p-1), F=B=W"
    if schedule == "zbv":
        return 0.0, "0, F=B=W"
    raise invalid("pipeline.schedule", f"one of {', '.join(PIPELINE_SCHEDULES)}", schedule)


# -- timing ----------------------------------------------------------------------------------
class _Clock:
    """Per-stage busy time of the step in progress and every finished step's totals, in one clock.

    `clock` is "host" on CPU (perf_counter) and "device" on CUDA: there every span and the
    step record a pair of CUDA events on the current stream; a finished step's events are
    read once `query()` says they completed (`resolve`), so no step synchronises.
    """

    def __init__(self, stage_indices: list[int], device: torch.device) -> None:
        self.stage_indices = stage_indices
        self.device = device
        self.cuda = device.type == "cuda"
        self.clock = "device" if self.cuda else "host"
        self.steps: list[dict[str, Any]] = []  # resolved steps: step_s, busy_s, stage_busy_s, host_step_s
        self._host: dict[int, float] = {}  # host clock: seconds per stage of the step in progress
        self._spans: list[tuple[int, Any, Any]] = []  # device clock: (stage, start, end) events of that step
        self._host_t0 = 0.0
        self._start: Any = None
        self._unresolved: list[dict[str, Any]] = []  # device clock: finished steps whose events are pending
        self._free_events: list[Any] = []

    def _event(self) -> Any:
        return self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)

    def _record(self) -> Any:
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def span(self, stage_index: int) -> Iterator[None]:
        """Time what runs inside as busy time of `stage_index`."""
        if self.cuda:
            start = self._record()
            try:
                yield
            finally:
                self._spans.append((stage_index, start, self._record()))
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._host[stage_index] = self._host.get(stage_index, 0.0) + time.perf_counter() - t0

    def timed(self, fn: Callable, stage_index: int) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.span(stage_index):
                return fn(*args, **kwargs)

        return wrapper

    def begin_step(self) -> None:
        self._host = {i: 0.0 for i in self.stage_indices}
        self._spans = []
        if self.cuda:
            self._start = self._record()
        self._host_t0 = time.perf_counter()

    def end_step(self) -> None:
        host_s = time.perf_counter() - self._host_t0
        if not self.cuda:
            busy = [self._host.get(i, 0.0) for i in self.stage_indices]
            self.steps.append({"step_s": host_s, "busy_s": sum(busy), "stage_busy_s": busy, "host_step_s": host_s})
            return
        self._unresolved.append({"start": self._start, "end": self._record(), "spans": self._spans,
                                 "host_step_s": host_s})
        self._spans = []
        self.resolve()

    def resolve(self, *, wait: bool = False) -> None:
        """Move finished steps whose events completed into `steps`, in order; `wait`: wait for them (end of run)."""
        while self._unresolved:
            step = self._unresolved[0]
            events = [step["end"], *(end for _, _, end in step["spans"])]
            if wait:
                for event in events:
                    event.synchronize()
            elif not all(e.query() for e in events):
                return  # later steps completed later: try again at the next step
            self._unresolved.pop(0)
            busy = {i: 0.0 for i in self.stage_indices}
            for index, start, end in step["spans"]:
                busy[index] = busy.get(index, 0.0) + start.elapsed_time(end) / 1e3
            stage_busy = [busy[i] for i in self.stage_indices]
            self.steps.append({"step_s": step["start"].elapsed_time(step["end"]) / 1e3, "busy_s": sum(stage_busy),
                               "stage_busy_s": stage_busy, "host_step_s": step["host_step_s"]})
            self._free_events.extend([step["start"], step["end"],
                                      *itertools.chain.from_iterable((a, b) for _, a, b in step["spans"])])

    @property
    def steps_pending(self) -> int:
        return len(self._unresolved)


class _MicrobatchLoss:
    """The user's loss divided by m (so the schedule's summed gradients are the batch mean), timed."""

    def __init__(self, loss_fn: Callable, n_microbatches: int, clock: _Clock, last_stage: int):
        self.loss_fn, self.n, self.clock, self.last_stage = loss_fn, n_microbatches, clock, last_stage

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        with self.clock.span(self.last_stage):
            return self.loss_fn(output, target) / self.n


# -- the runner ------------------------------------------------------------------------------
class PipelineRunner:
    """One rank's part of a pipeline: its stage module(s), the schedule, and bubble measurement.

    Attributes:
        stage_modules: this rank's stage modules, in `stage_indices` order; their
            parameters are the model's own (same objects and names) and go to the optimizer.
        stage_indices: the global indices of those stages.
        num_stages: stages in the whole pipeline.
        is_first: this rank holds stage 0 (it needs the inputs).
        is_last: this rank holds the last stage (it needs the target and gets the loss).
    """

    def __init__(self, *, schedule: Any, stages: list[PipelineStage], stage_modules: list[nn.Module], num_stages: int,
                 schedule_name: str, n_microbatches: int, stages_per_rank: int, world_size: int, clock: _Clock):
        self.schedule = schedule
        self.stages = stages
        self.stage_modules = stage_modules
        self.stage_indices = [s.stage_index for s in stages]
        self.num_stages = num_stages
        self.is_first = 0 in self.stage_indices
        self.is_last = num_stages - 1 in self.stage_indices
        self.schedule_name = schedule_name
        self.n_microbatches = n_microbatches
        self.stages_per_rank = stages_per_rank
        self.world_size = world_size
        self._clock = clock

    def parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (for the optimizer)."""
        return [p for m in self.stage_modules for p in m.parameters()]

    def step(self, inputs: Any = None, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """Forward and backward of every microbatch; the mean microbatch loss on the last stage's rank.

        Gradients accumulate into `.grad` (zero them before, step the optimizer after).

        Args:
            inputs: the whole batch (a tensor or a tuple of tensors); needed where
                `is_first`, ignored elsewhere.
            target: the whole batch's target; needed where `is_last`.

        Raises:
            ConfigError: the batch's first dimension does not divide by n_microbatches, or
                inputs/target are missing where they are needed.
        """
        args: tuple = () if inputs is None else (inputs if isinstance(inputs, tuple) else (inputs,))
        if self.is_first and not args:
            raise invalid("inputs", "the batch on the rank holding stage 0", None)
        if self.is_last and target is None:
            raise invalid("target", f"the batch's target on the rank holding stage {self.num_stages - 1}", None)
        for batch in (*args[:1], target):
            if batch is not None:
                self._check_divisible(batch)
        losses: list[torch.Tensor] = []
        self._clock.begin_step()
        self.schedule.step(*(args if self.is_first else ()), target=target if self.is_last else None,
                           losses=losses if self.is_last else None, return_outputs=False)
        self._clock.end_step()
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()  # each is loss / m: the sum is the mean

    def _check_divisible(self, batch: Any) -> None:
        size = batch.shape[0] if isinstance(batch, torch.Tensor) else len(batch)
        if size % self.n_microbatches:
            raise invalid("pipeline.n_microbatches", f"a divisor of the batch's first dimension ({size})",
                          self.n_microbatches)

    def stats(self, *, wait: bool = False) -> dict:
        """This rank's schedule and bubble, JSON-serialisable.

        Measured values are medians over the steps after the first (the first one infers
        shapes and warms up communicators); None before two steps ran. `clock` says what
        the seconds are: "host" (CPU: what the host ran) or "device" (CUDA events on the
        stages' stream); `host_step_s` is the host's view of the step either way. On CUDA,
        steps whose events have not completed yet are left out (`steps_pending`) unless
        `wait` (for the end of a run: waits for the device once).

        Args:
            wait: on CUDA, wait for the pending steps' events instead of leaving them out.
        """
        self._clock.resolve(wait=wait)
        theory, formula = theoretical_bubble_pct(self.schedule_name, ranks=self.world_size,
                                                 n_microbatches=self.n_microbatches,
                                                 stages_per_rank=self.stages_per_rank)
        measured = self._clock.steps[1:]
        step_s = statistics.median(s["step_s"] for s in measured) if measured else None
        busy_s = statistics.median(s["busy_s"] for s in measured) if measured else None
        bubble = [100 * (1 - s["busy_s"] / s["step_s"]) for s in measured if s["step_s"] > 0]
        return {
            "schedule": self.schedule_name,
            "stages": self.num_stages,
            "ranks": self.world_size,
            "microbatches": self.n_microbatches,
            "stages_per_rank": self.stages_per_rank,
            "stage_indices": list(self.stage_indices),
            "steps_measured": len(measured),
            "steps_pending": self._clock.steps_pending,
            "clock": self._clock.clock,
            "device": self._clock.device.type,
            "bubble_pct": statistics.median(bubble) if bubble else None,
            "theoretical_bubble_pct": theory,
            "theoretical_formula": formula,
            "busy_s": busy_s,
            "step_s": step_s,
            "host_step_s": statistics.median(s["host_step_s"] for s in measured) if measured else None,
            "stage_busy_s": [statistics.median(s["stage_busy_s"][k] for s in measured) if measured else None
                             for k in range(len(self.stage_indices))],
        }


def _check_schedule(schedule: str, *, num_stages: int, world_size: int, stages_per_rank: int, n_microbatches: int) -> None:
    if schedule not in _SCHEDULE_CLASSES:
        raise invalid("pipeline.schedule", f"one of {', '.join(PIPELINE_SCHEDULES)}", schedule)
    if n_microbatches < 1:
        raise invalid("pipeline.n_microbatches", "an integer >= 1", n_microbatches)
    if schedule in _SINGLE_STAGE and stages_per_rank != 1:
        raise invalid("pipeline.stages_per_rank", f"1 for the {schedule} schedule (one stage per rank)", stages_per_rank)
    if schedule == "zbv" and stages_per_rank != 2:
        raise invalid("pipeline.stages_per_rank", "2 for the zbv schedule (a V of two stages per rank)", stages_per_rank)
    if stages_per_rank < 1:
        raise invalid("pipeline.stages_per_rank", "an integer >= 1", stages_per_rank)
    if schedule == "1f1b" and n_microbatches < num_stages:
        raise invalid("pipeline.n_microbatches", f">= the number of stages ({num_stages}) for the 1f1b schedule",
                      n_microbatches)
    if schedule in ("interleaved1f1b", "interleavedzb"):
        rounds = max(1, n_microbatches // world_size)
        if n_microbatches % rounds:
            raise invalid("pipeline.n_microbatches",
                          f"a multiple of its rounds max(1, m // {world_size} ranks) = {rounds} for the {schedule} "
                          "schedule", n_microbatches)


def build_pipeline(model: nn.Module, cfg: PipelineConfig, *, loss_fn: Callable, example_inputs: Any,
                   device: torch.device | str, rank: int, world_size: int,
                   split_points: list[str] | None = None) -> PipelineRunner:
    """Split `model` at named modules and return this rank's part of the pipeline.

    Call it on every rank of the default process group with the same arguments. The
    model is cut before each split point into `len(split_points) + 1` stages, which must
    be `world_size * cfg.stages_per_rank`; this rank's stages reuse the model's modules
    (moved to `device`; the other stages' stay where they are). The loss is computed per microbatch as `loss_fn(output,
    target) / n_microbatches`: the schedule sums the microbatches' gradients, so with a
    batch-mean `loss_fn` the gradients equal those of `loss_fn(model(x), y)` on the whole
    batch, and they accumulate across steps like ordinary gradients.

    Args:
        model: a model whose forward applies its children in order (see the module
            docstring); every rank builds it identically (same seed).
        cfg: schedule, n_microbatches, split_points and stages_per_rank.
        loss_fn: `loss_fn(output, target) -> scalar`, a mean over the microbatch.
        example_inputs: a batch (tensor or tuple) to check the chain with, on any device (the
            check runs where the model is; build it on the CPU when it does not fit one device).
        device: where this rank's stages run.
        rank: this rank in the default process group.
        world_size: ranks in the pipeline (the default group's size).
        split_points: module names where a stage begins, e.g. ["blocks.2"]; overrides
            `cfg.split_points`.

    Returns:
        The runner; `runner.step(x, y)` trains one batch, `runner.stats()` reports the bubble.

    Raises:
        ConfigError: an unknown, misplaced or mis-ordered split point, a stage count that is
            not world_size * stages_per_rank, a schedule constraint on n_microbatches, or a
            model whose forward is not its chain of children.

    Example:
        >>> model = Net()  # embed, blocks (ModuleList of 4), head  # doctest: +SKIP
        >>> cfg = PipelineConfig(schedule="1f1b", n_microbatches=4)  # doctest: +SKIP
        >>> runner = build_pipeline(model, cfg, loss_fn=nn.functional.mse_loss, example_inputs=x,
        ...                         device="cpu", rank=dist.get_rank(), world_size=2,
        ...                         split_points=["blocks.2"])  # doctest: +SKIP
        >>> opt = torch.optim.SGD(runner.parameters(), lr=0.1)  # doctest: +SKIP
        >>> opt.zero_grad(); loss = runner.step(x, target=y); opt.step()  # doctest: +SKIP
        >>> runner.stats()["bubble_pct"]  # doctest: +SKIP
    """
    names = list(cfg.split_points if split_points is None else split_points)
    v, m = cfg.stages_per_rank, cfg.n_microbatches
    num_stages = len(names) + 1
    if num_stages != world_size * v:
        raise invalid("pipeline.split_points", f"{world_size * v - 1} names ({world_size} ranks x {v} stages per rank = "
                      f"{world_size * v} stages)", names)
    _check_schedule(cfg.schedule, num_stages=num_stages, world_size=world_size, stages_per_rank=v, n_microbatches=m)
    segments = chain_segments(model)
    if not segments:
        raise invalid("model", "a module with children to split", type(model).__name__)
    bounds = [0, *_split_indices(segments, names), len(segments)]
    device = torch.device(device)
    # Checked where the model lives (it may be too large for one device); only this rank's stages move.
    example_args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    _check_is_chain(model, segments, _to_device(example_args, _device_of_module(model, device)))

    indices = stage_indices_of(rank, schedule=cfg.schedule, world_size=world_size, stages_per_rank=v)
    clock = _Clock(stage_indices=indices, device=device)
    stages, modules = [], []
    for index in indices:
        module = _StageModule(segments[bounds[index]:bounds[index + 1]]).to(device)
        stage = PipelineStage(module, index, num_stages, device)
        for name in _TIMED_METHODS:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, clock.timed(method, index))
        stages.append(stage)
        modules.append(module)
    loss = _MicrobatchLoss(loss_fn, m, clock, num_stages - 1)
    cls = _SCHEDULE_CLASSES[cfg.schedule]
    schedule = (cls(stages[0], m, loss_fn=loss, scale_grads=False) if cfg.schedule in _SINGLE_STAGE
                else cls(stages, m, loss_fn=loss, scale_grads=False))
    return PipelineRunner(schedule=schedule, stages=stages, stage_modules=modules, num_stages=num_stages,
                          schedule_name=cfg.schedule, n_microbatches=m, stages_per_rank=v, world_size=world_size,
                          clock=clock)
