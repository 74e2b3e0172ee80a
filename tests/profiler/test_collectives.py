"""CollectiveCapture in one process: torch's fake process group (world size 2, nothing sent) for what
each call records; a one-rank gloo group where the real Work.wait() matters (the fake group's works
have a wait of their own)."""

from __future__ import annotations

import importlib.machinery
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.testing._internal.distributed.fake_pg import FakeStore

from torsh_tune.profiler.collectives import issuer_of
from torsh_tune.records import FRAMEWORK_ISSUERS

from helpers import host_call_record


def _fake(world_size: int = 2) -> None:
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())


def _records(tracker) -> list[dict]:
    """The records handed to the tracker, each with its shared fields inlined (as written to comm.jsonl)."""
    records = [host_call_record(c, tracker.call_sites) if type(c) is tuple else c for c in tracker.comm_done]
    return [{**c["_s"], **{k: v for k, v in c.items() if k != "_s"}} for c in records]


def _completed(tracker, n: int) -> list[dict]:
    """n records in issue order, once the async ones' future callbacks (the backend's thread, which may run
    them after `wait()` returned) handed them over."""
    deadline = time.monotonic() + 30
    while len(tracker.comm_done) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    return sorted(_records(tracker), key=lambda r: r["seq"])


def test_each_call_is_one_record_with_its_bytes_dtype_and_group(capture):
    cap, tracker = capture
    _fake()
    i64 = torch.int64
    dist.all_reduce(torch.ones(10))
    dist.all_reduce(torch.ones(3, dtype=torch.float16), async_op=True).wait()
    dist.broadcast(torch.zeros(3, dtype=i64), src=0)
    dist.reduce(torch.ones(2, dtype=torch.float64), dst=0)
    dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
    # torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor, recorded under the older ones.
    dist.all_gather_single(torch.empty(8, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16))
    dist.reduce_scatter_single(torch.empty(4, dtype=torch.float64), torch.ones(8, dtype=torch.float64))
    dist.all_to_all_single(torch.empty(6, dtype=torch.int32), torch.ones(6, dtype=torch.int32))
    # A batch of p2p ops is one record: the isend/irecv it calls are not counted again.
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(5), 1),
                                        dist.P2POp(dist.irecv, torch.empty(3), 1)]):
        work.wait()
    dist.isend(torch.ones(2, dtype=i64), dst=1).wait()
    dist.barrier()
    expected = [
        ("all_reduce", 40, "float32", False),
        ("all_reduce", 6, "float16", True),
        ("broadcast", 24, "int64", False),
        ("reduce", 16, "float64", False),
        ("all_gather", 32, "float32", False),
        ("all_gather_into_tensor", 16, "bfloat16", False),
        ("reduce_scatter_tensor", 64, "float64", False),
        ("all_to_all_single", 24, "int32", False),
        ("batch_isend_irecv", 32, "float32", True),
        ("send", 16, "int64", True),
        ("barrier", 0, None, False),
    ]
    records = _completed(tracker, len(expected))
    assert [(r["collective"], r["bytes"], r.get("dtype"), r["async_op"]) for r in records] == expected
    assert [(r["step"], r["seq"]) for r in records] == [(0, i) for i in range(len(expected))]
    for r in records:
        assert (r["rank"], r["issuer"], r["group"], r["group_ranks"], r["group_size"], r["backend"], r["clock"],
                r["bucket"], r["wire_bytes"]) == (0, "user", "world", [0, 1], 2, "fake", "host", -1, r["bytes"])
        assert r["t_complete"] - r["t_issue"] == r["duration_s"] >= 0
        if not r["async_op"]:  # a synchronous call blocks the training thread for all of it
            assert r["blocked_s"] == r["duration_s"]
    assert cap.by_issuer == {"user": {"count": len(expected), "bytes": sum(e[1] for e in expected)}}



def test_a_known_sites_synchronous_call_is_kept_as_numbers_the_cyclic_gc_lets_go_of(capture):
    import gc

    cap, tracker = capture
    _fake()
    for _ in range(3):  # the first call of the site learns it; the next ones take the fast path
        dist.all_reduce(torch.ones(10))
    kept = [c for c in tracker.comm_done if type(c) is tuple]
    assert len(kept) == 2 and all(type(v) in (int, float) for c in kept for v in c)
    gc.collect()
    assert not any(gc.is_tracked(c) for c in kept)  # never promoted to the old generations: no full collections
    records = _completed(tracker, 3)
    assert [(r["collective"], r["bytes"], r["issuer"], r["seq"]) for r in records] == [
        ("all_reduce", 40, "user", i) for i in range(3)]

def test_a_known_site_called_inside_a_ddp_bucket_scope_carries_the_bucket(capture):
    # The common call skips the bucket's thread-local read while no bucket scope is open anywhere: a site
    # learned outside a bucket (a script's helper that a comm hook calls too) must still carry the bucket
    # inside one, and take the common call again after it.
    import threading

    cap, tracker = capture
    _fake()

    def reduce(t):  # one call site
        dist.all_reduce(t)

    for _ in range(2):
        reduce(torch.ones(4))  # learned, then the common call
    with cap.bucket(3, "my_hook", 16, 1):
        reduce(torch.ones(4))
        other = threading.Thread(target=reduce, args=(torch.ones(4),))  # another thread: not in the bucket
        other.start()
        other.join()
    reduce(torch.ones(4))
    assert cap._open_buckets.count == 0
    kinds = ["tuple" if type(c) is tuple else c.get("bucket") for c in tracker.comm_done]
    assert kinds[:3] == [None, "tuple", 3] and kinds[3:] == ["tuple", "tuple"]
    in_bucket = tracker.comm_done[2]
    assert (in_bucket["_s"]["hook"], in_bucket["grad_bytes"], in_bucket["num_tensors"]) == ("my_hook", 16, 1)


def test_a_subgroup_is_recorded_with_its_own_ranks_and_name(capture):
    _, tracker = capture
    _fake(world_size=4)
    group = dist.new_group([0, 2])
    dist.all_reduce(torch.ones(4), group=group)
    dist.all_reduce(torch.ones(4))
    sub, world = _records(tracker)
    assert (sub["group"], sub["group_ranks"], sub["group_size"]) == (group.group_name, [0, 2], 2)
    assert (world["group"], world["group_ranks"], world["group_size"]) == ("world", [0, 1, 2, 3], 4)


def test_an_object_collective_is_sized_by_the_calls_it_makes(capture):
    _, tracker = capture
    _fake()
    objects = [{"lr": 0.1, "name": "x" * 100}, list(range(50))]
    dist.broadcast_object_list(objects, src=0)
    (record,) = _records(tracker)  # its inner broadcasts (sizes, then payload) are not records of their own
    payload = sum(c10d._object_to_tensor(o, torch.device("cpu"), None)[1].item() for o in objects)
    assert payload > 150
    assert (record["collective"], record["bytes"], record["wire_bytes"]) == (
        "broadcast_object_list", 8 * len(objects) + payload, 8 * len(objects) + payload)


def test_the_time_blocked_in_work_wait_is_the_async_collectives(capture):
    cap, tracker = capture
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    work = dist.all_reduce(torch.ones(1000), async_op=True)
    (record,) = [r for r in cap._works.values()]  # held until the script waits for it
    # So far the training thread was held only by the issuing call.
    issued = record["issue_s"]
    assert record["blocked_s"] == issued > 0
    work.wait()
    blocked = record["blocked_s"]
    assert blocked > issued and cap._works == {}
    work.wait()  # a second wait is not the collective's
    assert record["blocked_s"] == blocked
    dist.all_reduce(torch.ones(1000))
    async_record, sync_record = _completed(tracker, 2)
    assert (async_record["async_op"], async_record["blocked_s"], async_record["backend"]) == (True, blocked, "gloo")
    assert async_record["duration_s"] > 0
    assert sync_record["blocked_s"] == sync_record["duration_s"] > 0 and not sync_record["async_op"]


def test_a_work_type_with_a_wait_of_its_own_is_timed_too(capture):
    # torch's fake group returns FakeWork, a subclass whose wait() is its own binding (as a Python backend's
    # works have theirs): patching Work.wait alone left its waits untimed and its records held until forgotten.
    cap, tracker = capture
    _fake()
    fake_wait = torch._C._distributed_c10d.FakeWork.wait
    first = dist.all_reduce(torch.ones(1000), async_op=True)
    assert type(first).__name__ == "FakeWork" and torch._C._distributed_c10d.FakeWork.wait is not fake_wait
    (record,) = cap._works.values()
    issued = record["blocked_s"]
    first.wait()
    assert cap._works == {} and record["blocked_s"] > issued and "_wait_end" in record
    second = dist.all_reduce(torch.ones(1000), async_op=True)  # the type is patched once: the same wrapper
    patched = torch._C._distributed_c10d.FakeWork.wait
    second.wait()
    assert cap._works == {} and torch._C._distributed_c10d.FakeWork.wait is patched
    assert [r["async_op"] for r in _completed(tracker, 2)] == [True, True]
    assert cap.untimed_waits == []


def test_a_work_type_that_takes_no_wrapper_is_named_and_the_call_goes_on(capture):
    cap, _ = capture

    class Frozen(type):
        def __setattr__(cls, name, value):
            raise TypeError("frozen")

    class FrozenWork(metaclass=Frozen):
        def wait(self):
            return True

    cap._patch_wait(FrozenWork)
    assert FrozenWork().wait() is True and "_torsh_capture" not in vars(FrozenWork.wait)
    assert cap.untimed_waits == [f"{__name__}.{FrozenWork.__qualname__}"]


def test_a_functional_collective_completes_at_its_wait_tensor(capture):
    import torch.distributed._functional_collectives as funcol

    cap, tracker = capture
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    y = funcol.all_reduce(torch.ones(1000), "sum", dist.group.WORLD)
    assert list(tracker.comm_done) == []  # in flight until the result is used
    z = funcol.all_gather_single(torch.ones(10), 0, dist.group.WORLD)
    assert (y + 1).sum().item() == 2000.0  # first use: wait_tensor
    z.sum().item()
    reduce, gather = sorted(_completed(tracker, 2), key=lambda r: r["seq"])
    assert (reduce["collective"], reduce["async_op"], reduce["bytes"], reduce["backend"]) == ("all_reduce", True, 4000,
                                                                                              "gloo")
    assert 0 < reduce["issue_s"] <= reduce["blocked_s"] and reduce["duration_s"] >= reduce["blocked_s"] - reduce["issue_s"]
    assert (gather["collective"], gather["bytes"]) == ("all_gather_into_tensor", 40)  # the gathered buffer
    assert cap.installed[-1].startswith("functional.")


def test_a_functional_calls_known_site_is_recorded_as_its_first_call_was(capture):
    """The functional collectives' fast path (a known site and group: no issuer walk, no group resolution)
    records what the general path does: each group its own, a name like its group, a gather's bytes x size."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    cap, tracker = capture
    _fake(world_size=2)
    sub = dist.new_group([0, 1])
    mesh = init_device_mesh("cpu", (2,))
    # by object, by a name built anew at every call (equal, not identical), DTensor's (mesh, dim)
    groups = [lambda: dist.group.WORLD, lambda: sub, lambda: "".join(list(sub.group_name)), lambda: (mesh, 0)]
    for _ in range(3):
        for group in groups:
            funcol.all_reduce(torch.ones(10), "sum", group()).sum().item()  # one call site for every group
            funcol.all_gather_single(torch.ones(5, dtype=torch.float64), 0, group()).sum().item()
    records = _completed(tracker, 24)
    assert len(records) == 24 and sum(map(len, cap._sites)) >= 8  # both functions' sites were learned
    per_call = {}
    for r in records:
        per_call.setdefault((r["seq"] // 2) % 4, []).append(r)
    shared = ("collective", "issuer", "origin", "group", "group_ranks", "dtype", "bytes", "async_op")
    for calls in per_call.values():
        reduces = {repr([r[k] for k in shared]) for r in calls if r["collective"] == "all_reduce"}
        gathers = {repr([r[k] for k in shared]) for r in calls if r["collective"] == "all_gather_into_tensor"}
        assert len(reduces) == len(gathers) == 1, calls  # the first call and the two after it alike
        assert {r["bytes"] for r in calls if r["collective"] == "all_gather_into_tensor"} == {5 * 8 * 2}  # x size
        assert all(0 < r["issue_s"] <= r["blocked_s"] <= r["duration_s"] for r in calls)
    names = [per_call[i][0]["group"] for i in range(4)]
    assert names[0] == "world" and names[1] == names[2] == sub.group_name != names[0]
    assert {r["origin"] for r in records} == {f"{__name__}:test_a_functional_calls_known_site_is_recorded_"
                                              "as_its_first_call_was"}
    # destroy_process_group forgets every site: a group made after it may take a forgotten one's id.
    dist.destroy_process_group()
    assert not any(cap._sites)


def test_a_deprecated_functional_call_warns_at_the_scripts_line_not_the_captures(capture):
    import warnings

    import torch.distributed._functional_collectives as funcol

    _, tracker = capture
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        y = funcol.all_reduce(torch.ones(4), "sum", [0])  # ranks + tag as the group: deprecated
        z = funcol.all_gather_tensor(torch.ones(2), 0, dist.group.WORLD)  # a deprecated alias
    future = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert len(future) == 2 and all("deprecated" in str(w.message) for w in future), [str(w.message) for w in caught]
    assert [(w.filename, w.lineno) for w in future] == [(__file__, line), (__file__, line + 1)]
    assert (y.sum().item(), z.sum().item()) == (4.0, 2.0)
    assert {r["collective"] for r in _completed(tracker, 2)} == {"all_reduce", "all_gather_into_tensor"}


def test_the_profilers_own_calls_are_ours_but_its_ddp_comm_hook_is_ddps():
    # The trace windows' anomaly agreement and alignment barrier were recorded as DDP's collectives once.
    assert issuer_of("torsh_tune.profiler.traces") == "torsh-tune"
    assert issuer_of("torsh_tune.profiler.comm") == "ddp"


@pytest.mark.parametrize(
    ("module", "issuer"),
    [
        ("torch.nn.parallel.distributed", "ddp"),
        ("torch.distributed.algorithms.ddp_comm_hooks.default_hooks", "ddp"),
        ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "fsdp"),
        ("torch.distributed.pipelining.schedules", "pipeline"),
        ("torch.distributed.tensor._redistribute", "dtensor"),
        ("torch.distributed.checkpoint.utils", "checkpoint"),
        ("accelerate.utils.operations", "accelerate"),
        ("transformers.trainer", "transformers"),
        ("lightning.fabric.strategies.ddp", "lightning"),
        ("pytorch_lightning.strategies", "lightning"),
        ("torsh_tune.strategies.compression._topk", "ddp"),
        ("accelerated_training", "user"),  # a prefix of a name is not the package
        ("train", "user"),
    ],
)
def test_the_issuer_is_the_calling_module(capture, module, issuer):
    _, tracker = capture
    _fake()
    assert issuer_of(module) == issuer
    function = "call_" + module.replace(".", "_")
    _call_from(module, function)
    # The origin: the function that called torch.distributed, in its module; a framework's, with who called it.
    origin = f"{module}:{function}"
    if issuer in FRAMEWORK_ISSUERS:
        origin += f" via {__name__}:_call_from"
    assert [(r["issuer"], r["origin"]) for r in _records(tracker)] == [(issuer, origin)]


def _call_from(module: str, function: str) -> None:
    """Call `dist.all_reduce` from a function `function` that lives in module `module`."""
    code = compile(f"def {function}():\n    dist.all_reduce(torch.ones(1))\n", f"<{module}>", "exec")
    scope = {"__name__": module, "dist": dist, "torch": torch}
    exec(code, scope)  # noqa: S102
    scope[function]()


def test_identical_functions_in_two_modules_keep_their_own_issuers(capture):
    _, tracker = capture
    _fake()
    _call_from("accelerate.utils.operations", "gather")
    _call_from("train", "gather")
    assert [r["issuer"] for r in _records(tracker)] == ["accelerate", "user"]


def test_torsh_tunes_own_calls_are_not_the_scripts(capture):
    _, tracker = capture
    _fake()
    # The bootstrap runs as __main__ under `python -m`: its real name is in __spec__.
    spec = importlib.machinery.ModuleSpec("torsh_tune.runtime.bootstrap", None)
    for scope in ({"__name__": "torsh_tune.runtime.bootstrap"}, {"__name__": "__main__", "__spec__": spec}):
        exec(compile("dist.barrier()\n", "<bootstrap>", "exec"), {**scope, "dist": dist})  # noqa: S102
    assert list(tracker.comm_done) == []
    script = "steps = 1\ndist.barrier()\n"  # not the same code as the bootstrap's (issuers are cached per code)
    exec(compile(script, os.path.join("scripts", "train.py"), "exec"), {"__name__": "__main__", "__spec__": None, "dist": dist})  # noqa: S102
    # A script's own module is named by its file.
    assert [(r["issuer"], r["origin"]) for r in _records(tracker)] == [("user", "train.py:<module>")]


def test_a_new_default_group_after_destroy_is_not_the_old_one(capture):
    _, tracker = capture
    _fake(world_size=2)
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    _fake(world_size=3)
    dist.all_reduce(torch.ones(1))
    before, after = _records(tracker)
    assert (before["group_ranks"], before["group_size"]) == ([0, 1], 2)
    assert (after["group_ranks"], after["group_size"]) == ([0, 1, 2], 3)


def test_probes_are_invisible_to_torch_compile(capture):
    _, tracker = capture
    _fake()

    def step(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    torch._dynamo.reset()
    try:
        # fullgraph: a graph break in the capture's wrapper would raise here.
        compiled = torch.compile(step, backend="eager", fullgraph=True)
        assert compiled(torch.ones(4)).tolist() == [3.0] * 4  # the fake group leaves y as it is
    finally:
        torch._dynamo.reset()
    assert list(tracker.comm_done) == []
    step(torch.ones(4))  # the same function run eagerly is recorded
    assert [r["collective"] for r in _records(tracker)] == ["all_reduce"]


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what the capture looks at to learn the script trains there."""

    is_cuda = property(lambda self: True)


def test_the_first_collective_on_cuda_tensors_switches_the_device_clock_on_once(capture):
    cap, tracker = capture
    _fake()
    calls = []
    cap._on_cuda = lambda: calls.append(tracker.step)
    dist.all_reduce(torch.ones(4))
    dist.all_gather([torch.empty(4), torch.empty(4)], torch.ones(4))
    assert calls == []  # CPU tensors: nothing learned
    dist.all_reduce(torch.ones(4).as_subclass(_OnCuda))
    dist.all_gather([torch.empty(4).as_subclass(_OnCuda)] * 2, torch.ones(4))
    assert calls == [0]  # once, at the first one: a hand-written NCCL all-reduce before the first step


def test_ddps_broadcast_of_its_buffers_before_each_forward_is_a_record_of_ddp(capture):
    # DDP calls it through a C++ binding of torch.distributed (`_broadcast_coalesced`), not a c10d
    # function. Its broadcast of the module's states when it is built is set-up: not recorded.
    cap, tracker = capture
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    assert _records(tracker) == []
    buffers = sum(b.nbytes for b in model.buffers())  # running mean and variance, batches seen
    for _ in range(2):
        ddp(torch.randn(4, 8)).sum().backward()
    broadcasts = [r for r in _records(tracker) if r["collective"] == "broadcast"]
    assert [(r["bytes"], r["issuer"], r["group"], r["async_op"]) for r in broadcasts] == \
        [(buffers, "ddp", "world", False)] * 2
    assert {r["origin"] for r in broadcasts} == {
        "torch.nn.parallel.distributed:DistributedDataParallel._distributed_broadcast_coalesced"}
    assert all(r["duration_s"] == r["blocked_s"] > 0 for r in broadcasts)
    # What meta.json says of them: all running statistics (the forward updates them in training).
    from torsh_tune.runtime.context import _broadcast_buffers

    assert _broadcast_buffers(ddp) == {
        "buffer_bytes": buffers, "running_stats_bytes": buffers,
        "largest_buffers": [{"name": "1.running_mean", "bytes": 32, "running_stats": True},
                            {"name": "1.running_var", "bytes": 32, "running_stats": True},
                            {"name": "1.num_batches_tracked", "bytes": 8, "running_stats": True}]}
    # A module without buffers: DDP broadcasts nothing before its forwards.
    plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    before = len(tracker.comm_done)
    plain(torch.randn(4, 8)).sum().backward()
    assert not [r for r in _records(tracker)[before:] if r["collective"] == "broadcast"]


def test_a_frameworks_call_names_who_called_the_framework_at_every_call(capture):
    _, tracker = capture
    _fake()
    # accelerate's gather, called by the Trainer and by the script: one function of accelerate serves both.
    helper = {"__name__": "accelerate.utils.operations", "dist": dist, "torch": torch}
    exec(compile("def gather():\n    dist.all_reduce(torch.ones(2))\n", "<accelerate>", "exec"), helper)  # noqa: S102
    trainer = {"__name__": "transformers.trainer", "gather": helper["gather"]}
    exec(compile("def get_batch_samples():\n    gather()\n", "<trainer>", "exec"), trainer)  # noqa: S102
    for _ in range(2):
        trainer["get_batch_samples"]()
        helper["gather"]()  # from this test: the first frame outside accelerate and torch is the test's
    origins = [r["origin"] for r in _records(tracker)]
    here = f"{__name__}:test_a_frameworks_call_names_who_called_the_framework_at_every_call"
    assert origins == [f"accelerate.utils.operations:gather via {x}"
                       for x in ("transformers.trainer:get_batch_samples", here)] * 2
    assert {r["issuer"] for r in _records(tracker)} == {"accelerate"}


def test_a_frameworks_large_calls_keep_the_fast_path(capture):
    # The gradients a framework averages itself (DeepSpeed's engine: tens of calls per step) are not walked at
    # every call: past its first call a site's large calls leave the capture's tuple of numbers.
    _, tracker = capture
    _fake()
    helper = {"__name__": "deepspeed.comm.comm", "dist": dist, "torch": torch}
    exec(compile("def all_reduce(t):\n    dist.all_reduce(t)\n", "<deepspeed>", "exec"), helper)  # noqa: S102
    grads, flag = torch.ones(4096), torch.ones(2)  # 16 KiB; 8 bytes
    for t in (grads, grads, grads, flag, flag):
        helper["all_reduce"](t)
    kept = [type(c) is tuple for c in tracker.comm_done]
    assert kept == [False, True, True, False, False]  # the flag's calls: the general path, each walked
    here = f"{__name__}:test_a_frameworks_large_calls_keep_the_fast_path"
    assert {r["origin"] for r in _records(tracker)} == {f"deepspeed.comm.comm:all_reduce via {here}"}
