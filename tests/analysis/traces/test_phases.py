"""The always-on phases as a trace sees them (`phase_table`), and the self-check's compute basis on a GPU."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from torsh_tune.analysis import self_check
from torsh_tune.analysis.traces import analyze_traces

PID, TID, STREAM = 100, 100, 7


def _x(name: str, cat: str, ts: float, dur: float, **args) -> dict:
    gpu = cat in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")
    return {"ph": "X", "cat": cat, "name": name, "pid": 0 if gpu else PID, "tid": STREAM if gpu else TID,
            "ts": ts, "dur": dur, "args": ({"device": 0, "stream": STREAM} if gpu and cat != "gpu_user_annotation"
                                            else {}) | args}


def _launch(ts: float, corr: int, kernel_ts: float, kernel_dur: float, name: str = "gemm") -> list[dict]:
    return [_x("cudaLaunchKernel", "cuda_runtime", ts, 5, correlation=corr),
            _x(name, "kernel", kernel_ts, kernel_dur, correlation=corr)]


def _analyzed(tmp_path, events: list[dict]):
    """`analyze_traces` of a one-rank trace holding `events`."""
    d = tmp_path / "w"
    d.mkdir()
    (d / "rank-0.json").write_text(json.dumps({"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1},
                                               "traceEvents": events}))
    return analyze_traces(d)


def _trace(tmp_path, *, annotated: bool = True):
    """Two ProfilerSteps (the second is cut off by the window, as the analysis assumes). In step 5 the
    host launches forward kernels at 200 and 900 µs (the second runs at 2000-2500: the GPU lags) and a
    backward kernel at 1300 (2600-3600); the GPU idles between them. The optimizer launches one at 3700."""
    ev = [_x("ProfilerStep#5", "user_annotation", 0, 10_000), _x("ProfilerStep#6", "user_annotation", 10_000, 5_000)]
    if annotated:
        ev += [_x("torsh-tune::forward", "user_annotation", 100, 1000),
               _x("torsh-tune::backward", "user_annotation", 1200, 1800),
               _x("torsh-tune::optimizer", "user_annotation", 3650, 100),
               # Kineto's device-side twin of an annotation: not a host span.
               _x("torsh-tune::forward", "gpu_user_annotation", 300, 2200)]
    ev += _launch(200, 1, 300, 100) + _launch(900, 2, 2000, 500) + _launch(1300, 3, 2600, 1000)
    ev += _launch(3700, 4, 3800, 200, "adam")
    ev += _launch(10_100, 5, 10_200, 300)  # step 6: dropped with its step
    return _analyzed(tmp_path, ev)


def test_a_phase_on_a_gpu_is_the_span_of_the_kernels_launched_inside_it(tmp_path):
    a = _trace(tmp_path)
    row = a.phases.set_index("rank").loc[0]
    # forward 300-2500, backward 2600-3600, optimizer 3800-4000 over the span 300-4000 (step 6 dropped).
    assert row["device"] == "gpu" and row["num_phases"] == 3
    assert row["phase_s"] * 1e6 == pytest.approx(2200 + 1000 + 200)
    assert row["phase_pct"] == pytest.approx(100 * 3400 / 3700)
    assert row["phase_compute_pct"] == pytest.approx(row["phase_pct"])  # no communication to take out
    # The kernels' busy time is far less: the GPU idled inside the forward.
    assert a.breakdown.set_index("rank").loc[0, "compute_pct"] == pytest.approx(100 * 1800 / 3700)


def test_a_phase_on_a_gpu_is_also_read_as_its_cuda_events_would_read_it(tmp_path):
    # An event completes once the host recorded it and the stream finished what was launched before:
    # forward 300 (the window's start)-2500 (its second kernel ends after the annotation), backward
    # 2500 (the forward's last kernel)-3600, optimizer 3650-4000. The kernel spans leave out the edges
    # where the device waited for the host: 2500-2600 and 3650-3800.
    a = _trace(tmp_path)
    row = a.phases.set_index("rank").loc[0]
    assert row["event_phase_compute_pct"] == pytest.approx(100 * (3300 + 350) / 3700)
    assert row["phase_compute_pct"] == pytest.approx(100 * 3400 / 3700)


def test_the_event_reading_follows_the_compute_stream_only(tmp_path):
    # A copy kernel on a side stream (FSDP2's all-gather copy-in) launched in the forward runs until
    # 3500: the compute stream's events do not wait for it, so the backward still starts at 2500.
    ev = [_x("ProfilerStep#5", "user_annotation", 0, 10_000), _x("ProfilerStep#6", "user_annotation", 10_000, 5_000),
          _x("torsh-tune::forward", "user_annotation", 100, 1000),
          _x("torsh-tune::backward", "user_annotation", 1200, 1800)]
    ev += _launch(200, 1, 300, 100) + _launch(900, 2, 2000, 500) + _launch(1300, 3, 2600, 1000)
    side = _launch(1000, 4, 1050, 2450, "copy")
    side[1]["tid"], side[1]["args"]["stream"] = STREAM + 1, STREAM + 1
    ev += side + _launch(10_100, 5, 10_200, 300)
    row = _analyzed(tmp_path, ev).phases.set_index("rank").loc[0]
    lo, hi = 300, 3600  # the kernels' first start and last end, step 6 dropped
    assert row["event_phase_compute_pct"] == pytest.approx(100 * (2500 - 300 + 3600 - 2500) / (hi - lo))


def test_the_gpu_self_check_compares_the_phases_with_their_kernel_spans(tmp_path):
    a = _trace(tmp_path)
    # Device-clock step records whose phases span what the trace's kernels span (3.4 of 3.7 ms).
    steps = pd.DataFrame([{"rank": 0, "step": s, "step_s": 0.0037, "data_s": 0.0, "forward_s": 0.0022,
                           "backward_s": 0.001, "optimizer_s": 0.0002, "comm_s": 0.0, "exposed_comm_s": 0.0,
                           "clock": "device"} for s in (4, 5, 6)])
    check = self_check(steps, a, window="w", window_steps=(5, 6), threshold_pp=5.0)
    row = check.per_rank[0]
    assert row["trace_compute_basis"] == "phase kernel spans"
    assert row["compute_diff_pp"] == pytest.approx(0.0, abs=1e-6)
    assert row["trace_kernel_compute_pct"] == pytest.approx(100 * 1800 / 3700)
    # Beside it, the phases as their events would read them (idle edges included).
    assert row["trace_event_compute_pct"] == pytest.approx(100 * 3650 / 3700)
    assert not [f for f in check.findings if f["metric"] == "compute"]
    assert check.overall["trace_compute_basis"] == "phase kernel spans"


def test_a_gpu_trace_without_phase_annotations_falls_back_to_the_kernels(tmp_path):
    a = _trace(tmp_path, annotated=False)
    assert len(a.phases) == 0
    steps = pd.DataFrame([{"rank": 0, "step": 5, "step_s": 0.0037, "data_s": 0.0, "forward_s": 0.0022,
                           "backward_s": 0.001, "optimizer_s": 0.0002, "comm_s": 0.0, "exposed_comm_s": 0.0,
                           "clock": "device"}])
    check = self_check(steps, a, window="w", window_steps=(5, 6), threshold_pp=5.0)
    row = check.per_rank[0]
    assert row["trace_compute_basis"] == "kernels"
    # The definitional gap of kernels vs phase spans shows, and is a finding.
    assert row["compute_diff_pp"] == pytest.approx(100 * 3400 / 3700 - 100 * 1800 / 3700)
    assert [f for f in check.findings if f["metric"] == "compute"]


def _running_ahead(tmp_path, num_steps: int = 4):
    """A GPU that falls behind its host: each host step takes 1 ms, each device step 1.3 ms, so step k's
    kernels run while the host is in step k+1 or later. Per step (device time, from D = 500 + 1300 k):
    forward's gemm D..D+800, an all-reduce D+700..D+1100 on another stream (100 µs under the gemm, 300
    exposed), the optimizer's kernel D+1100..D+1200. One more ProfilerStep is cut off by the window."""
    ev = []
    for k in range(num_steps + 1):
        h, d, step = 1000 * k, 500 + 1300 * k, 5 + k
        ev += [_x(f"ProfilerStep#{step}", "user_annotation", h, 1000),
               _x("torsh-tune::forward", "user_annotation", h + 50, 150),
               _x("torsh-tune::optimizer", "user_annotation", h + 750, 150)]
        ev += _launch(h + 100, 10 * k + 1, d, 800)
        if k == num_steps:
            break  # the cut-off step: its kernel is dropped with it
        nccl = _launch(h + 400, 10 * k + 2, d + 700, 400, "ncclDevKernel_AllReduce_Sum_f32_RING_LL")
        nccl[1]["tid"], nccl[1]["args"]["stream"] = STREAM + 1, STREAM + 1
        ev += nccl + _launch(h + 800, 10 * k + 3, d + 1100, 100, "adam")
    return _analyzed(tmp_path, ev)


def test_a_gpu_step_holds_the_kernels_it_launched_on_the_device_clock(tmp_path):
    a = _running_ahead(tmp_path)
    steps = a.steps.set_index("step")
    # The host's spans hold other steps' kernels; the device spans tile the device timeline from each
    # step's first kernel to the next one's (the last compared step to its own last kernel's end).
    assert steps["step_s"].tolist() == pytest.approx([0.001] * 5)
    assert steps.loc[5:7, "device_step_s"].tolist() == pytest.approx([0.0013] * 3)
    assert steps.loc[8, "device_step_s"] == pytest.approx(0.0012)
    assert steps.loc[5:8, "comm_s"].tolist() == pytest.approx([0.0004] * 4)
    assert steps.loc[5:8, "exposed_comm_s"].tolist() == pytest.approx([0.0003] * 4)
    # The phases: the gemm's and the optimizer's spans, no exposed communication inside them.
    assert steps.loc[5:8, "phase_compute_s"].tolist() == pytest.approx([0.0009] * 4)
    assert steps.loc[9, "comm_s"] == 0 and pd.isna(steps.loc[9, "device_step_s"])  # the cut-off step
    # The steps add up to the window.
    overlap = a.overlap.set_index("rank").loc[0]
    assert steps["comm_s"].sum() == pytest.approx(overlap["comm_s"])
    assert steps["exposed_comm_s"].sum() == pytest.approx(overlap["exposed_comm_s"])
    assert steps["device_step_s"].sum() == pytest.approx(a.breakdown.set_index("rank").loc[0, "span_s"])


def _device_records(num_steps: int = 4, changes: dict[int, dict] | None = None) -> pd.DataFrame:
    rows = []
    for k in range(num_steps + 1):
        step = 5 + k
        rows.append({"rank": 0, "step": step, "step_s": 0.0012 if k == num_steps - 1 else 0.0013, "data_s": 0.0,
                     "forward_s": 0.0008, "backward_s": 0.0003, "optimizer_s": 0.0001, "comm_s": 0.0004,
                     "exposed_comm_s": 0.0003, "clock": "device", **(changes or {}).get(step, {})})
    return pd.DataFrame(rows)


def test_the_gpu_self_check_says_which_step_disagrees(tmp_path):
    a = _running_ahead(tmp_path)
    check = self_check(_device_records(), a, window="w", window_steps=(5, 9), threshold_pp=5.0)
    row = check.per_rank[0]
    assert (check.start_step, check.end_step) == (5, 8)
    for metric in ("compute", "comm", "exposed_comm"):
        assert row[f"{metric}_diff_pp"] == pytest.approx(0.0, abs=1e-6)
        assert row["per_step"][metric]["median_step_diff_pp"] == pytest.approx(0.0, abs=1e-6)
    assert not check.findings
    # Step 7's all-reduce read 0.6 ms longer always-on: its own contribution is the whole difference.
    check = self_check(_device_records(changes={7: {"comm_s": 0.001}}), a, window="w", window_steps=(5, 9),
                       threshold_pp=5.0)
    row = check.per_rank[0]
    where = row["per_step"]["comm"]
    assert row["comm_diff_pp"] == pytest.approx(100 * 0.0006 / 0.0051)
    assert (where["largest_step"], where["largest_step_pp"]) == (7, pytest.approx(row["comm_diff_pp"]))
    assert (where["largest_step_always_on_s"], where["largest_step_trace_s"]) == pytest.approx((0.001, 0.0004))
    assert where["median_step_diff_pp"] == pytest.approx(0.0, abs=1e-6)
    (finding,) = [f for f in check.findings if f["metric"] == "comm"]
    assert "step 7 alone makes" in finding["message"] and "one step disagrees" in finding["message"]
