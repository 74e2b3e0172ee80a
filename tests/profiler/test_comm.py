"""TimedCommHook on a real DDP model (a one-rank gloo group): each bucket's collectives carry the bucket's
index, the hook's name and the gradient bytes DDP handed the hook."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from torsh_tune.profiler import TimedCommHook, default_allreduce

from helpers import host_call_record


@pytest.fixture
def ddp(capture):
    """(capture, tracker, DDP model, what DDP handed the hook per bucket call: (index, buffer bytes, tensors))."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    yield (*capture, DistributedDataParallel(model, bucket_cap_mb=0.5), [])
    _quiesce()


def _quiesce() -> None:
    """Let gloo's worker threads finish disposing the futures' Python callbacks before the model's
    Reducer and process group are freed: freeing them joins those threads with the GIL held, and a
    thread still disposing a callback waits for the GIL (a deadlock seen once in a full suite run)."""
    time.sleep(0.2)


def _seen(calls):
    def inner(state, bucket):
        buf = bucket.buffer()
        calls.append((bucket.index(), buf.numel() * buf.element_size(), len(bucket.gradients())))
        return default_allreduce(state, bucket)

    return inner


def _step(model) -> None:
    model(torch.randn(4, 256)).sum().backward()


def _records(tracker, n: int) -> list[dict]:
    """n records in issue order, once the futures' callbacks (gloo's thread) handed them over."""
    deadline = time.monotonic() + 30
    while len(tracker.comm_done) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    records = [host_call_record(c, tracker.call_sites) if type(c) is tuple else c for c in tracker.comm_done]
    return sorted(({**c["_s"], **{k: v for k, v in c.items() if k != "_s"}} for c in records),
                  key=lambda r: r["seq"])


def test_each_bucket_is_labelled_with_its_index_hook_and_gradient_bytes(ddp):
    capture, tracker, model, calls = ddp
    model.register_comm_hook(None, TimedCommHook(capture, inner=_seen(calls), inner_state=None, name="my_hook"))
    _step(model)
    first = len(calls)
    _step(model)  # after the first iteration DDP rebuilds its buckets in gradient-ready order
    records = _records(tracker, len(calls))
    assert len(records) == len(calls) and len(calls) > first + 1  # several buckets once rebuilt
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for iteration in (calls[:first], calls[first:]):
        assert sum(nbytes for _, nbytes, _ in iteration) == param_bytes
    assert [(r["bucket"], r["grad_bytes"], r["bytes"], r["wire_bytes"]) for r in records] == \
        [(index, nbytes, nbytes, nbytes) for index, nbytes, _ in calls]
    assert [r["num_tensors"] for r in records[:first]] == [n for _, _, n in calls[:first]]
    for r in records:
        assert (r["hook"], r["issuer"], r["collective"], r["async_op"], r["dtype"]) == \
            ("my_hook", "ddp", "all_reduce", True, "float32")
    # Outside the hook, a collective is no bucket's.
    dist.all_reduce(torch.ones(3))
    assert _records(tracker, len(calls) + 1)[-1]["bucket"] == -1


def test_rebuilt_buckets_record_their_own_number_of_gradients(ddp):
    capture, tracker, model, calls = ddp
    model.register_comm_hook(None, TimedCommHook(capture, inner=_seen(calls), inner_state=None, name="my_hook"))
    _step(model)
    _step(model)
    records = _records(tracker, len(calls))
    assert [r["num_tensors"] for r in records] == [n for _, _, n in calls]


def test_only_a_buckets_first_collective_carries_its_gradient_bytes(ddp):
    capture, tracker, model, calls = ddp

    def two_collectives(state, bucket):  # e.g. a compression hook: a small exchange, then the payload
        buf = bucket.buffer()
        calls.append((bucket.index(), buf.numel() * buf.element_size(), len(bucket.gradients())))
        dist.all_reduce(torch.ones(2, dtype=torch.float64))
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    hook = TimedCommHook(capture, inner=two_collectives, inner_state=None, name="two")
    model.register_comm_hook(None, hook)
    _step(model)
    records = _records(tracker, 2 * len(calls))
    assert [(r["bucket"], r["bytes"], r.get("grad_bytes"), r.get("num_tensors")) for r in records] == [
        row for index, nbytes, n in calls for row in ((index, 16, nbytes, n), (index, nbytes, None, None))]
    assert {r["hook"] for r in records} == {"two"}
    # A hook registered later (the script's own, or a strategy's) becomes the inner hook: records say so.
    later = []
    hook.set_inner(_seen(later), None, "allreduce")
    _step(model)
    assert {r["hook"] for r in _records(tracker, len(records) + len(later))[len(records):]} == {"allreduce"}


def test_without_a_capture_the_inner_hook_runs_alone(ddp):
    _, tracker, model, calls = ddp
    model.register_comm_hook(None, TimedCommHook(None, inner=_seen(calls), inner_state=None, name="x"))
    _step(model)
    assert calls and [r["bucket"] for r in _records(tracker, len(calls))] == [-1] * len(calls)


def test_pytorchs_default_all_reduce_is_captured_in_one_hop_with_a_buckets_record(ddp):
    capture, tracker, model, _ = ddp
    torch.manual_seed(0)  # the fixture's model, without DDP
    local = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
    model.register_comm_hook(None, TimedCommHook(capture, inner=default_allreduce, inner_state=None, name="allreduce"))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        x = torch.randn(4, 256)
        model.zero_grad()
        model(x).sum().backward()
        local.zero_grad()
        local(x).sum().backward()
        for p, q in zip(model.parameters(), local.parameters()):
            assert torch.equal(p.grad, q.grad)  # world size 1: the average is the gradient
    records = _records(tracker, 3)
    assert len(records) >= 3  # one bucket, then two or more
    for r in records:
        assert (r["hook"], r["issuer"], r["collective"], r["async_op"], r["dtype"], r["clock"]) == \
            ("allreduce", "ddp", "all_reduce", True, "float32", "host")
        assert r["bucket"] >= 0 and r["bytes"] == r["wire_bytes"] == r["grad_bytes"]
        assert r["t_issue"] <= r["t_complete"] and r["duration_s"] == pytest.approx(r["t_complete"] - r["t_issue"])
    assert sum(r["grad_bytes"] for r in records) == 2 * param_bytes
