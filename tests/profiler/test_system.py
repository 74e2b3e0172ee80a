"""The system sampler: CPU/RSS and idle-core records, NVLink counters to rates, failures kept instead of swallowed."""

from __future__ import annotations

import doctest
import multiprocessing
import os
import threading
import time

import pynvml
import pytest

from torsh_tune.profiler import system
from torsh_tune.profiler.system import (
    SystemSampler,
    field_value,
    idle_cores,
    nvlink_rates,
    open_nvml_device,
    sum_counters,
    usable_cores,
)
from torsh_tune.records import SystemRecord

TX, RX = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX


def _values(entries):
    """A real `nvmlFieldValue_t` array as nvmlDeviceGetFieldValues returns it: (field, scope, ret, KiB)."""
    arr = (pynvml.c_nvmlFieldValue_t * len(entries))()
    for v, (field, scope, ret, kib) in zip(arr, entries):
        v.fieldId, v.scopeId, v.nvmlReturn = field, scope, ret
        v.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
        v.value.ullVal = kib
    return arr


def test_nvlink_rates_convert_cumulative_kib_to_bytes_per_second():
    assert nvlink_rates((10.0, 1000, 0), (10.5, 1000 + 512, 256)) == {
        "nvlink_tx_bytes_per_s": 1024.0 * 512 / 0.5, "nvlink_rx_bytes_per_s": 1024.0 * 256 / 0.5}
    assert nvlink_rates((10.0, 1000, 0), (10.0, 2000, 0)) is None  # no time passed
    assert nvlink_rates((10.0, 1000, 0), (11.0, 10, 0)) is None  # counter reset


def test_field_values_sum_over_answered_links_only():
    ok, unsupported = pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED
    per_link = _values([(TX, 0, ok, 100), (RX, 0, ok, 40), (TX, 1, ok, 20), (RX, 1, ok, 2),
                        (TX, 2, unsupported, 999), (RX, 2, unsupported, 999)])
    assert sum_counters(per_link, TX, RX) == (120, 42)
    assert field_value(per_link[4]) is None
    # A GPU without NVLink answers every entry with an error: nothing to record.
    assert sum_counters(_values([(TX, 0xFFFFFFFF, unsupported, 0), (RX, 0xFFFFFFFF, unsupported, 0)]), TX, RX) is None
    # One direction alone is not a reading.
    assert sum_counters(_values([(TX, 0xFFFFFFFF, ok, 5), (RX, 0xFFFFFFFF, unsupported, 0)]), TX, RX) is None


def test_cpu_sample_has_the_record_keys_and_no_nvlink():
    sampler = SystemSampler(3, lambda r: None, interval_s=1.0)
    record = sampler.sample()
    assert record["rank"] == 3 and record["rss_bytes"] > 0 and record["gpu_util_pct"] is None
    assert "nvlink_tx_bytes_per_s" not in record and sampler.nvlink_status == "no GPU"
    assert set(record) <= {f for f in SystemRecord.__dataclass_fields__}
    assert record["cpu_cores"] == len(os.sched_getaffinity(0)) and 0.0 <= record["idle_cores"] <= record["cpu_cores"]
    assert sampler.errors == ()


def test_idle_cores_count_only_the_cores_this_process_may_use():
    assert idle_cores([100.0, 25.0, 0.0, 50.0], None) == (4, 2.25)
    assert idle_cores([100.0, 25.0, 0.0, 50.0], (0, 2)) == (2, 1.0)
    assert idle_cores([10.0, 20.0], (1, 7)) == (1, 0.8)  # an id psutil does not report is not counted
    assert usable_cores() == tuple(sorted(os.sched_getaffinity(0)))


def _spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_busy_child_leaves_less_idle_core_time_and_counts_in_cpu_pct():
    """A worker process pinned to one core, spinning: it shows in this process's CPU, and that core is not idle."""
    core = min(os.sched_getaffinity(0))
    sampler = SystemSampler(0, lambda r: None, interval_s=1.0)
    sampler._usable = (core,)  # judge only the worker's core (other tenants may load the rest)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=lambda: (os.sched_setaffinity(0, {core}), _spin(1.5)))
    child.start()
    try:
        time.sleep(0.3)
        sampler.start()  # primes the child's counter
        sampler.sample()
        time.sleep(0.8)
        record = sampler.sample()
    finally:
        child.join()
    # The spinning child counts as this process's (which only sleeps here); on a shared host it
    # gets a share of its core, so no more than "clearly busy" is asked.
    assert record["cpu_pct"] > 5.0
    assert record["cpu_cores"] == 1 and record["idle_cores"] < 0.5


@pytest.mark.parametrize("late", [False, True], ids=["at-start", "use_nvml"])
def test_nvml_failures_are_recorded_once_and_never_raised(late):
    """A handle NVML cannot answer for (here: no driver, or an uninitialised library)."""
    notes: list[str] = []
    handle, _ = open_nvml_device(0)
    handle = handle or object()
    sampler = SystemSampler(0, lambda r: None, interval_s=1.0, nvml_handle=None if late else handle,
                            on_error=notes.append)
    if late:  # the runtime hands the device over once it sees the run train on CUDA
        assert sampler.sample()["gpu_util_pct"] is None and sampler.errors == ()
        sampler.use_nvml(handle)
    first, second = sampler.sample(), sampler.sample()
    if handle is not None and not sampler.errors:
        pytest.skip("NVML answers every query on this machine: nothing fails")
    assert first["cpu_pct"] is not None and second["rss_bytes"] > 0
    assert "nvlink_tx_bytes_per_s" not in second
    wheres = [e.split(":")[0] for e in sampler.errors]
    assert len(wheres) == len(set(wheres)) and "gpu_util_pct" in wheres  # each kind once, not per sample
    assert notes == list(sampler.errors)  # the runtime prefixes "system sampler: " to its meta.json note
    assert sampler.nvlink_status.startswith("unavailable")
    assert sampler.failure_counts["gpu_util_pct"] == 2  # both samples failed; the message is kept once
    sampler.stop()
    assert notes[-1].startswith("failures in all: ") and "gpu_util_pct 2 times" in notes[-1]


def test_a_failing_emit_leaves_a_trace_and_the_thread_goes_on():
    calls = []
    done = threading.Event()

    def emit(record):
        calls.append(record)
        if len(calls) >= 4:
            done.set()
        if len(calls) <= 2:
            raise OSError("disk full")

    notes: list[str] = []
    sampler = SystemSampler(0, emit, interval_s=0.01, on_error=notes.append)
    sampler.start()
    try:
        assert done.wait(10.0)
    finally:
        sampler.stop()
    assert len(calls) >= 4  # kept sampling after the failures
    assert sampler.errors == ("emit: OSError: disk full",)
    assert notes == ["emit: OSError: disk full", "failures in all: emit 2 times"]


def test_mark_samples_at_once_and_stop_takes_a_last_sample_intervals_end_to_end():
    calls: list[dict] = []
    sampler = SystemSampler(0, calls.append, interval_s=60.0)  # no periodic sample in this test
    sampler.start()
    try:
        sampler.mark()
        deadline = time.monotonic() + 10.0
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 1, "mark() took no sample"
    finally:
        sampler.stop()
    assert len(calls) == 2  # the last one, at stop()
    first, last = calls
    assert first["t_since"] < first["t"] == last["t_since"] < last["t"]  # each covers since the one before


def test_a_failing_note_and_a_failing_sample_are_kept():
    def broken_note(message):
        raise RuntimeError("meta.json not writable")

    sampler = SystemSampler(0, lambda r: None, interval_s=0.01, on_error=broken_note)
    sampler.sample = lambda: 1 / 0  # every sample fails
    sampler.start()
    time.sleep(0.2)
    sampler.stop()
    assert sampler.errors[0] == "sample: ZeroDivisionError: division by zero"
    assert sampler.errors[1].startswith("on_error: RuntimeError: meta.json not writable")
    assert sampler.failure_counts["sample"] >= 2


def test_failures_beyond_the_kept_kinds_are_counted():
    notes: list[str] = []
    sampler = SystemSampler(0, lambda r: None, interval_s=1.0, on_error=notes.append)
    for i in range(system._MAX_ERRORS + 3):
        sampler._error(f"kind{i}", ValueError(i))
    sampler.stop()  # never started: nothing to join
    assert len(sampler.errors) == system._MAX_ERRORS
    assert notes[-1] == f"3 failure(s) of kinds beyond the first {system._MAX_ERRORS} not kept"


def test_docstring_examples_run():
    assert doctest.testmod(system, raise_on_error=False).failed == 0


@pytest.mark.gpu
def test_nvml_sample_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    handle, reason = open_nvml_device(0)
    if handle is None:
        pytest.skip(f"NVML unavailable: {reason}")
    sampler = SystemSampler(0, lambda r: None, interval_s=1.0, nvml_handle=handle)
    x = torch.ones(64 << 20, device="cuda")
    sampler.sample()
    for _ in range(20):
        x.mul_(1.0001)
    torch.cuda.synchronize()
    time.sleep(0.2)
    record = sampler.sample()
    assert 0.0 <= record["gpu_util_pct"] <= 100.0 and record["gpu_mem_used_bytes"] > 0
    status = sampler.nvlink_status
    if status.startswith("unavailable"):
        assert "nvlink_tx_bytes_per_s" not in record
    else:  # an NVLink GPU: a rate from the second sample on
        assert record["nvlink_tx_bytes_per_s"] >= 0.0 and record["nvlink_rx_bytes_per_s"] >= 0.0
    print(f"nvlink: {status}; errors: {sampler.errors}; record: {record}")
