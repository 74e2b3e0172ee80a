"""CUDA streams and clocks of the strategies: compression hook callbacks, the pipeline's device clock.

Skipped without CUDA (this project's CI machine has none); run them where a GPU is lent:
`pytest -m gpu tests/strategies`. One GPU is enough: the module holds a 1-rank NCCL group.
On CPU these paths are no-ops, which is why they are checked here, on the device.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.config import PipelineConfig
from torsh_tune.strategies.compression import CompressionState, build_hook
from torsh_tune.strategies.pipeline import _Clock, build_pipeline

from data.scripts._pipeline_model import Net

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL")]


@pytest.fixture(scope="module")
def nccl_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield
    torch.cuda.synchronize()
    dist.destroy_process_group()


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future(devices=[value.device])
    fut.set_result(value)
    return fut


def test_a_deferred_second_collective_waits_for_the_kernels_that_prepared_it(nccl_group):
    # Bucket 1's first collective completes before bucket 0's: its second one is deferred and
    # then issued from bucket 0's callback, on that callback's stream. The "collective" here
    # is a copy on the issuing stream; it must see what bucket 1's prepare wrote on its own
    # stream after a long kernel. (Without the wait it read zeros on an H100, from the second
    # try on; the first one pays lazy CUDA module loading on the host.)
    dev = torch.device("cuda", 0)
    for attempt in range(3):
        state = CompressionState()
        source = torch.zeros(1 << 20, device=dev)
        buf0, buf1 = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
        first0, first1 = torch.futures.Future(devices=[dev]), torch.futures.Future(devices=[dev])

        def prepare1(value, source=source):
            torch.cuda._sleep(int(4e8))  # ~0.2 s of device time on this callback's stream
            ready = source.add(1)
            return lambda: _done(ready.clone())

        r0 = state.chain_second(first0, buf0, lambda v, b=buf0: (lambda: _done(b)), lambda v, b=buf0: b)
        r1 = state.chain_second(first1, buf1, prepare1, lambda v: v)
        first1.set_result([buf1])  # prepared at once, issue deferred (ticket 0 has not run)
        assert not r1.done()
        first0.set_result([buf0])  # issues 0, then 1 from this callback's thread and stream
        r0.wait()
        copied = r1.wait()
        assert torch.equal(copied, torch.ones_like(copied)), f"attempt {attempt}: the issue read its input unwritten"


def _train(method: str, steps: int = 40) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(6)), nn.Linear(256, 1)).to(dev)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.3)  # a bucket per layer or so
    built = build_hook(method, None, ratio=0.3, rank=8, start_iter=3, max_ratio=0.5)
    if built is not None:
        state, hook = built
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator(device=dev).manual_seed(1)
    w = torch.randn(256, 1, device=dev, generator=g) / 16
    losses = []
    for _ in range(steps):
        x = torch.randn(512, 256, device=dev, generator=g)
        loss = nn.functional.mse_loss(ddp(x), x @ w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return [float(v) for v in losses], (built[0].stats if built is not None else {})


@pytest.mark.parametrize("method", ["fp16", "bf16", "topk", "int8", "powersgd", "adaptive"])
def test_compression_hooks_train_on_cuda_streams(nccl_group, method):
    # Many buckets, callbacks on pool streams, second collectives issued out of order: a
    # gradient read before it is written or from reused memory shows up as NaN or no progress.
    losses, stats = _train(method)
    assert stats["calls"] > 0 and stats["num_buckets"] > 2
    # Uncompressed, the loss falls from 1.08 to 0.04 in 40 steps (top-k at 30 %: 0.08, on CPU).
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.15 * losses[0], (method, losses[0], losses[-1])


def test_the_pipeline_clock_on_cuda_is_device_time_read_without_a_synchronize():
    dev = torch.device("cuda", 0)
    clock = _Clock([0, 2], dev)
    torch.cuda.synchronize()
    host_span_s = 0.0
    for _ in range(3):
        clock.begin_step()
        t0 = time.perf_counter()
        clock.timed(lambda: torch.cuda._sleep(int(0.05 * 2e9)), 0)()  # enqueued in microseconds
        host_span_s = max(host_span_s, time.perf_counter() - t0)
        with clock.span(2):
            torch.cuda._sleep(int(0.02 * 2e9))
        clock.end_step()
    assert clock.clock == "device"
    assert clock.steps_pending >= 1  # nothing waited for the device
    torch.cuda.synchronize()
    clock.resolve()
    assert clock.steps_pending == 0 and len(clock.steps) == 3
    for step in clock.steps:
        stage0, stage2 = step["stage_busy_s"]
        assert stage0 > 0.01 and stage2 > 0.004 and stage0 > 2 * stage2  # the sleeps, on the device
        assert stage0 > 20 * host_span_s  # what a host clock would have measured: the launch
        assert step["busy_s"] <= step["step_s"] * 1.01


def test_a_pipeline_on_cuda_places_only_its_stages_and_measures_device_time(nccl_group):
    # One rank holding two stages (interleaved 1F1B, no P2P). The model stays on the CPU: the
    # chain check runs there and only this rank's stages move.
    dev = torch.device("cuda", 0)
    model = Net()
    cfg = PipelineConfig(schedule="interleaved1f1b", n_microbatches=4, stages_per_rank=2)
    runner = build_pipeline(model, cfg, loss_fn=nn.functional.mse_loss, example_inputs=torch.randn(8, 8, device=dev),
                            device=dev, rank=0, world_size=1, split_points=["blocks.4"])
    assert all(p.is_cuda for m in runner.stage_modules for p in m.parameters())
    x, y = torch.randn(8, 8, device=dev), torch.randn(8, 1, device=dev)
    for _ in range(4):
        runner.step(x, y)
    stats = runner.stats(wait=True)
    assert (stats["clock"], stats["device"], stats["steps_pending"], stats["steps_measured"]) == ("device", "cuda", 0, 3)
    assert 0 <= stats["bubble_pct"] < 100 and 0 < stats["busy_s"] <= stats["step_s"]
    assert stats["host_step_s"] > 0


def test_a_pipeline_split_of_a_cpu_model_leaves_the_other_ranks_stages_on_the_cpu(nccl_group):
    dev = torch.device("cuda", 0)
    model = Net()
    cfg = PipelineConfig(schedule="1f1b", n_microbatches=2)
    runner = build_pipeline(model, cfg, loss_fn=nn.functional.mse_loss, example_inputs=torch.randn(8, 8, device=dev),
                            device=dev, rank=0, world_size=2, split_points=["blocks.4"])
    mine = {id(p) for m in runner.stage_modules for p in m.parameters()}
    assert mine and all(p.is_cuda for m in runner.stage_modules for p in m.parameters())
    others = [p for p in model.parameters() if id(p) not in mine]
    assert others and all(p.device.type == "cpu" for p in others)
