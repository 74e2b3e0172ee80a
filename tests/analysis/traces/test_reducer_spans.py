"""A gloo worker span of a DDP bucket ends, at the latest, when the reducer has copied every bucket.

The worker closes its span in a callback after it completed the all-reduce and woke the training
thread; on a busy host that thread takes the core first and the span ends milliseconds late, past
the optimizer. Seen in `make gpu-check`'s CPU DDP run: 1.3-3.5 ms late spans moved the self-check's
comm by -3 to -7 pp; with the bound, +1.6 to +3.5 pp on the same four runs.
"""

from __future__ import annotations

import json

from torsh_tune.analysis.traces import load_traces, rank_collectives
from torsh_tune.analysis.traces._timeline import CommPatterns, rank_timeline

PID, MAIN, WORKER = 100, 100, 200
COPY = "torch.distributed.ddp.reducer::copy_bucket_to_grad"


def _x(name: str, ts: float, dur: float, *, cat: str = "cpu_op", tid: int = MAIN) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": {}}


def _gloo(ts: float, dur: float) -> dict:
    return _x("gloo:all_reduce", ts, dur, cat="user_annotation", tid=WORKER)


def _worker_spans(tmp_path, *, copies: bool) -> list[tuple[float, float]]:
    """One DDP step, 0-10000 µs. An async all-reduce in the forward (issued 300, its span to 3000); backward
    from 1000, whose bucket all-reduce is issued at 1600 and whose worker span closes at 8000; the reducer
    waits until 2500, then copies the bucket (2500-2520, 2530-2560); the optimizer 2600-3600; then a
    hand-written asynchronous all-reduce issued at 4000 (its span 4060-4900)."""
    ev = [_x("ProfilerStep#3", 0, 10_000, cat="user_annotation"),
          _x("aten::mm", 100, 150), _x("c10d::allreduce_", 300, 20), _gloo(330, 2670), _x("aten::relu", 400, 100),
          _x("autograd::engine::evaluate_function: AddmmBackward0", 1000, 500), _x("aten::mm", 1010, 480),
          _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 1500, 200),
          _x("c10d::allreduce_", 1600, 50), _gloo(1660, 8000 - 1660)]
    if copies:
        ev += [_x(COPY, 2500, 20), _x("aten::copy_", 2501, 18), _x(COPY, 2530, 30), _x("aten::copy_", 2531, 28)]
    ev += [_x("Optimizer.step#SGD.step", 2600, 1000, cat="user_annotation"), _x("aten::add_", 2650, 900),
           _x("c10d::allreduce_", 4000, 50), _gloo(4060, 840), _x("aten::mm", 4100, 5000)]
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    (tmp_path / "rank-0.json").write_text(json.dumps({**meta, "traceEvents": ev}))
    traces = load_traces(tmp_path)
    tl = rank_timeline(traces.ranks[0], traces.symbols, CommPatterns())
    gloo = tl.name_id == traces.symbols.id_of("gloo:all_reduce")
    spans = sorted(zip(tl.start_us[gloo].tolist(), tl.end_us[gloo].tolist()))
    # The per-collective table (durations, stragglers, bus bandwidth) reads the same ends.
    coll = rank_collectives(traces.ranks[0], traces.symbols, CommPatterns())
    assert sorted(zip(coll["start_us"].tolist(), coll["end_us"].tolist())) == spans
    assert (coll["dur_us"] == coll["end_us"] - coll["start_us"]).all()
    return spans


def test_a_bucket_span_still_open_after_the_reducers_copies_ends_with_them(tmp_path):
    # The step's first bucket is the first the reducer waits for: its span ends by its first copy (2500), not
    # only by the last copy's end (2560).
    assert _worker_spans(tmp_path, copies=True) == [(330, 3000), (1660, 2500), (4060, 4900)]


def test_without_the_reducers_copies_every_span_is_kept(tmp_path):
    # gradient_as_bucket_view (no copies), or no DDP: nothing tells when the result was used.
    assert _worker_spans(tmp_path, copies=False) == [(330, 3000), (1660, 8000), (4060, 4900)]


def test_the_wait_for_a_single_bucket_ends_where_the_reducer_resumes(tmp_path):
    """One bucket (Lightning's tiny model, 2 ranks on 2 cores): the training thread issues it at the end of the
    backward and waits in the reducer's finalize until 4000; the finalize's own ops (4000-4020) come before its
    first copy (4030), and the worker span closes late (9000). The gap 1650-4000 is the step's wait for its
    all-reduce: before, the bounded span (to the copies) ended after the gap and no wait was found."""
    from torsh_tune.analysis.traces._timeline import MAIN_THREAD_WAIT

    ev = [_x("ProfilerStep#3", 0, 10_000, cat="user_annotation"),
          _x("Optimizer.step#AdamW.step", 50, 9_900, cat="user_annotation"),  # Lightning: the step holds the rest
          _x("autograd::engine::evaluate_function: AddmmBackward0", 1000, 500), _x("aten::mm", 1010, 480),
          _x("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 1500, 160),
          _x("c10d::allreduce_", 1600, 50), _gloo(1660, 9000 - 1660),
          _x("aten::as_strided", 4000, 20), _x(COPY, 4030, 20), _x("aten::copy_", 4031, 18),
          _x(COPY, 4060, 300), _x("aten::copy_", 4061, 298), _x("aten::add_", 4500, 900)]
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    (tmp_path / "rank-0.json").write_text(json.dumps({**meta, "traceEvents": ev}))
    traces = load_traces(tmp_path)
    tl = rank_timeline(traces.ranks[0], traces.symbols, CommPatterns())
    gloo = tl.name_id == traces.symbols.id_of("gloo:all_reduce")
    assert list(zip(tl.start_us[gloo], tl.end_us[gloo])) == [(1660, 4030)]  # its first copy, not the last's end
    wait = tl.name_id == traces.symbols.id_of(MAIN_THREAD_WAIT)
    assert list(zip(tl.start_us[wait], tl.end_us[wait])) == [(1650, 4000)]


def test_a_bucket_its_worker_started_after_the_first_copy_still_ends_with_the_copies(tmp_path):
    """Compiled DDP's last bucket on a busy host: issued at 1800, its worker not scheduled until 2510, after
    the reducer's copy of the first bucket (2500); the span closes late (9000). The reducer's last copy
    (2600-2630) used its result: it ends there. Its queued time (1850-2510) is in flight, not exposed."""
    ev = [_x("ProfilerStep#3", 0, 10_000, cat="user_annotation"),
          _x("autograd::engine::evaluate_function: AddmmBackward0", 1000, 500), _x("aten::mm", 1010, 480),
          _x("c10d::allreduce_", 1600, 50), _gloo(1660, 2400 - 1660),
          _x("aten::mm", 1660, 130), _x("c10d::allreduce_", 1800, 50), _gloo(2510, 9000 - 2510),
          _x(COPY, 2500, 20), _x("aten::copy_", 2501, 18), _x(COPY, 2600, 30), _x("aten::copy_", 2601, 28)]
    meta = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 2}}
    (tmp_path / "rank-0.json").write_text(json.dumps({**meta, "traceEvents": ev}))
    from torsh_tune.analysis.traces import analyze_traces

    a = analyze_traces(tmp_path, exclude_last_step=False)
    coll = a.tables["collectives"]
    assert sorted(zip(coll["issue_us"].tolist(), coll["start_us"].tolist(), coll["end_us"].tolist())) == [
        (1600, 1660, 2400), (1800, 2510, 2630)]
    tl = a.timelines[0]
    assert sorted(zip(*(x.tolist() for x in tl.queued_us))) == [(1600, 1660), (1800, 2510)]
    overlap = a.tables["overlap"].rows()[0]
    assert overlap["comm_s"] * 1e6 == 2630 - 1600  # in flight from the first issue to the last copy
    # Exposed: the issuing calls, the worker spans and the thread's wait (1850-2500) less the operators under
    # them (1660-1790, 2510-2520, 2600-2630): 50 + (1660-2500) + (2510-2630) - 170. Not the queued time.
    assert overlap["exposed_comm_s"] * 1e6 == 50 + 840 + 120 - 170
