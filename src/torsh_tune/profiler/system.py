"""System sampler thread: process CPU and RSS (with DataLoader workers), NVML GPU metrics."""

from __future__ import annotations

import threading
from typing import Any, Callable

import psutil

from ._clock import now

__all__ = ["SystemSampler", "open_nvml_device"]


def open_nvml_device(device_index: int) -> tuple[Any, str | None]:
    """Return (nvml handle or None, reason when None) for a torch CUDA device index.

    `NVMLError_LibraryNotFound` means "no GPU driver here", not a failure.
    """
    try:
        import pynvml
    except ImportError:
        return None, "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    try:
        import torch

        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return pynvml.nvmlDeviceGetHandleByUUID(uuid), None
    except Exception as exc:  # mapping by UUID failed: fall back to the index
        try:
            return pynvml.nvmlDeviceGetHandleByIndex(device_index), f"matched by index ({exc})"
        except pynvml.NVMLError as exc2:
            return None, f"NVML device lookup failed: {exc2}"


class SystemSampler:
    """Daemon thread writing a SystemRecord every `interval_s` through `emit`."""

    def __init__(self, rank: int, emit: Callable[[dict[str, Any]], None], *, interval_s: float, nvml_handle: Any = None) -> None:
        self._rank = rank
        self._emit = emit
        self._interval = interval_s
        self._nvml = nvml_handle
        self._stop = threading.Event()
        self._proc = psutil.Process()
        self._children: dict[int, psutil.Process] = {}
        self._mem_total = psutil.virtual_memory().total
        self._thread = threading.Thread(target=self._run, name="torsh-tune-system", daemon=True)

    def start(self) -> None:
        self._proc.cpu_percent(None)
        psutil.cpu_percent(None)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._emit(self.sample())
            except Exception:  # a failed sample must never take the training down
                continue

    def sample(self) -> dict[str, Any]:
        cpu = self._proc.cpu_percent(None)
        rss = self._proc.memory_info().rss
        live = {}
        for child in self._proc.children(recursive=True):
            proc = self._children.get(child.pid)
            if proc is None:  # first sight: prime cpu_percent, count from the next sample
                proc = child
                try:
                    proc.cpu_percent(None)
                except psutil.Error:
                    continue
            else:
                try:
                    cpu += proc.cpu_percent(None)
                except psutil.Error:
                    continue
            try:
                rss += proc.memory_info().rss
            except psutil.Error:
                continue
            live[child.pid] = proc
        self._children = live
        record: dict[str, Any] = {
            "rank": self._rank,
            "t": now(),
            "cpu_pct": cpu,
            "sys_cpu_pct": psutil.cpu_percent(None),
            "rss_bytes": rss,
            "mem_total_bytes": self._mem_total,
            "gpu_util_pct": None,
            "gpu_mem_used_bytes": None,
            "gpu_mem_total_bytes": None,
            "gpu_power_w": None,
            "pcie_tx_bytes_per_s": None,
            "pcie_rx_bytes_per_s": None,
        }
        if self._nvml is not None:
            record.update(_nvml_sample(self._nvml))
        return record


def _nvml_sample(handle: Any) -> dict[str, Any]:
    import pynvml

    out: dict[str, Any] = {}
    try:
        out["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
        out["gpu_mem_used_bytes"] = int(mem.used)
        out["gpu_mem_total_bytes"] = int(mem.total)
    except pynvml.NVMLError:
        pass
    try:
        out["gpu_power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
    except pynvml.NVMLError:
        pass
    try:  # KB/s over the driver's 20 ms window
        out["pcie_tx_bytes_per_s"] = 1024.0 * pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
        out["pcie_rx_bytes_per_s"] = 1024.0 * pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
    except pynvml.NVMLError:
        pass
    return out
