"""The system sampler: CPU/RSS records, NVLink counters to rates, failures kept instead of swallowed."""

from __future__ import annotations

import doctest
import threading
import time

import pynvml
import pytest

from torsh_tune.profiler import system
from torsh_tune.profiler.system import SystemSampler, field_value, nvlink_rates, open_nvml_device, sum_counters

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
    assert sampler.errors == ()


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
    assert notes == [f"system sampler: {e}" for e in sampler.errors]
    assert sampler.nvlink_status.startswith("unavailable")


def test_a_failing_emit_leaves_a_trace_and_the_thread_goes_on():
    calls = []
    done = threading.Event()

    def emit(record):
        calls.append(record)
        if len(calls) >= 4:
            done.set()
        if len(calls) <= 2:
            raise OSError("disk full")

    sampler = SystemSampler(0, emit, interval_s=0.01)
    sampler.start()
    try:
        assert done.wait(10.0)
    finally:
        sampler.stop()
    assert len(calls) >= 4  # kept sampling after the failures
    assert sampler.errors == ("emit: OSError: disk full",)


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
