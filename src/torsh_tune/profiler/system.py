"""System sampler thread: process CPU and RSS (with DataLoader workers), the cores left idle, NVML GPU
metrics and NVLink throughput."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

import psutil

from ._clock import now

__all__ = ["SystemSampler", "field_value", "idle_cores", "nvlink_rates", "open_nvml_device", "sum_counters",
           "usable_cores"]


def usable_cores() -> tuple[int, ...] | None:
    """The CPU ids this process may run on (its affinity mask), None where the OS does not say."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows: every core
        return None


def idle_cores(busy_pct_per_cpu: list[float], usable: tuple[int, ...] | None) -> tuple[int, float]:
    """(usable cores, how many of them were idle): the per-core busy % summed over the usable cores.

    Example:
        >>> idle_cores([100.0, 25.0, 0.0, 50.0], (1, 3))  # cores 1 and 3 are this process's
        (2, 1.25)
    """
    ids = [i for i in usable if i < len(busy_pct_per_cpu)] if usable is not None else range(len(busy_pct_per_cpu))
    busy = [busy_pct_per_cpu[i] for i in ids]
    return len(busy), sum(100.0 - min(max(b, 0.0), 100.0) for b in busy) / 100.0


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
    """Daemon thread writing a SystemRecord every `interval_s` through `emit`.

    Besides the process's CPU (`cpu_pct`, its DataLoader workers included) and the whole
    host's (`sys_cpu_pct`), each record holds `cpu_cores`, the cores this process may run on
    (its affinity mask), and `idle_cores`, how many of those were idle since the previous
    sample: the room DataLoader workers would have (analysis divides it among the host's ranks).

    A sample that fails, or an NVML query that fails, never stops the thread (nor the
    training) but is never silent either: the first failure of each kind is kept in
    `errors` (and passed to `on_error`) for the caller to put in meta.json; `stop()` passes
    on how often each kind failed in all, and what could not be stopped.

    NVLink throughput (`nvlink_tx_bytes_per_s`, `nvlink_rx_bytes_per_s`) is recorded only
    on a GPU whose driver reports NVLink counters, from the second sample on;
    `nvlink_status` says which case this is.

    Every record's CPU numbers are averages over (`t_since`, `t`]: since the previous sample
    (or `start()`). Besides the periodic samples, `mark()` takes one now (the runtime marks the
    measured window's first and last step, so that a window shorter than the interval is still
    measured, not taken from start-up's samples) and `stop()` takes a last one.
    """

    def __init__(self, rank: int, emit: Callable[[dict[str, Any]], None], *, interval_s: float, nvml_handle: Any = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self._rank = rank
        self._emit = emit
        self._interval = interval_s
        self._nvml = nvml_handle
        self._on_error = on_error
        self._errors: list[str] = []
        self._failures: dict[str, int] = {}  # kind -> failures, the first kept in _errors
        self._usable = usable_cores()
        self._nvlink = _NvlinkCounters(nvml_handle, self._error) if nvml_handle is not None else None
        self._stop = threading.Event()
        self._wake = threading.Event()  # mark(): sample now
        self._since = now()  # start of the interval the next sample's CPU numbers cover
        self._proc = psutil.Process()
        self._children: dict[int, psutil.Process] = {}
        self._mem_total = psutil.virtual_memory().total
        self._thread = threading.Thread(target=self._run, name="torsh-tune-system", daemon=True)

    @property
    def errors(self) -> tuple[str, ...]:
        """The first failure of each kind ("<where>: <ExceptionType>: <message>")."""
        return tuple(self._errors)

    @property
    def failure_counts(self) -> dict[str, int]:
        """Kind ("<where>") -> how many times it failed, every kind counted (kept in `errors` or not)."""
        return dict(self._failures)

    @property
    def nvlink_status(self) -> str:
        """How NVLink is read: no GPU, not read yet, aggregate over links, summed over N links, unavailable: <why>."""
        return "no GPU" if self._nvlink is None else self._nvlink.status

    def use_nvml(self, handle: Any) -> None:
        """Sample this NVML device from the next sample on (the run was seen training on it)."""
        if handle is None or handle is self._nvml:
            return
        # The counters first: the sampler thread reads `_nvml`, then `_nvlink`.
        self._nvlink = _NvlinkCounters(handle, self._error)
        self._nvml = handle

    def start(self) -> None:
        # Prime the counters: cpu_percent(None) reports the time since its previous call.
        try:
            self._proc.cpu_percent(None)
            psutil.cpu_percent(None)
            psutil.cpu_percent(None, percpu=True)
        except Exception as exc:  # noqa: BLE001 - the first sample then covers the time since import
            self._error("start", exc)
        self._since = now()
        self._thread.start()

    def mark(self) -> None:
        """Take a sample now (on the sampler's thread: the caller does not wait for it)."""
        self._wake.set()

    def stop(self) -> None:
        """Take a last sample, stop the thread, and pass on what failed more than once, and a thread
        that would not stop."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=_STOP_TIMEOUT_S)
        if self._thread.is_alive():
            self._error("stop", TimeoutError(f"the sampler thread was still running {_STOP_TIMEOUT_S:g} s "
                                             "after stop(); its last sample may be missing"))
        repeated = {k: n for k, n in self._failures.items() if n > 1}
        if repeated:
            self._tell("failures in all: " + ", ".join(f"{k} {n} times" for k, n in repeated.items()))
        dropped = sum(n for k, n in self._failures.items() if not any(e.startswith(f"{k}: ") for e in self._errors))
        if dropped:
            self._tell(f"{dropped} failure(s) of kinds beyond the first {_MAX_ERRORS} not kept")

    def _error(self, where: str, exc: BaseException) -> None:
        first = where not in self._failures
        self._failures[where] = self._failures.get(where, 0) + 1
        if not first or len(self._errors) >= _MAX_ERRORS:
            return  # counted: stop() says how many
        message = f"{where}: {type(exc).__name__}: {exc}"
        self._errors.append(message)
        self._tell(message)

    def _tell(self, message: str) -> None:
        if self._on_error is None:
            return
        try:
            self._on_error(message)
        except Exception as exc:  # noqa: BLE001 - the caller's note failed: keep that too
            if not any(e.startswith("on_error: ") for e in self._errors):
                self._errors.append(f"on_error: {type(exc).__name__}: {exc} (while passing on {message!r})")

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval)
            self._wake.clear()
            try:
                record = self.sample()
            except Exception as exc:  # a failed sample must never take the training down
                self._error("sample", exc)
            else:
                try:
                    self._emit(record)
                except Exception as exc:
                    self._error("emit", exc)
            if self._stop.is_set():
                return

    def sample(self) -> dict[str, Any]:
        cpu = self._proc.cpu_percent(None)
        rss = self._proc.memory_info().rss
        live = {}
        for child in self._proc.children(recursive=True):
            proc = self._children.get(child.pid)
            try:
                if proc is None:  # first sight: prime cpu_percent, count from the next sample
                    proc = child
                    proc.cpu_percent(None)
                else:
                    cpu += proc.cpu_percent(None)
                rss += proc.memory_info().rss
            except psutil.NoSuchProcess:  # the worker exited since it was listed (zombies too)
                continue
            except psutil.Error as exc:  # e.g. AccessDenied: its CPU and RSS are missing from this record
                self._error("worker", exc)
                continue
            live[child.pid] = proc
        self._children = live
        cores, idle = idle_cores(psutil.cpu_percent(None, percpu=True), self._usable)
        t, since = now(), self._since
        self._since = t
        record: dict[str, Any] = {
            "rank": self._rank,
            "t": t,
            "t_since": since,
            "cpu_pct": cpu,
            "sys_cpu_pct": psutil.cpu_percent(None),
            "cpu_cores": cores,
            "idle_cores": round(idle, 3),
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
            record.update(self._nvml_sample())
        return record

    def _nvml_sample(self) -> dict[str, Any]:
        import pynvml

        handle = self._nvml
        out: dict[str, Any] = {}
        try:
            # NVML's utilisation is "a kernel was running"; a kernel spinning in an NCCL
            # collective counts as busy (see analysis GPU_UTIL_CAVEAT).
            out["gpu_util_pct"] = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError as exc:
            self._error("gpu_util_pct", exc)
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out["gpu_mem_used_bytes"] = int(mem.used)
            out["gpu_mem_total_bytes"] = int(mem.total)
        except pynvml.NVMLError as exc:
            self._error("gpu_mem_used_bytes", exc)
        try:
            out["gpu_power_w"] = pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
        except pynvml.NVMLError as exc:
            self._error("gpu_power_w", exc)
        try:  # KB/s over the driver's 20 ms window
            tx = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES)
            rx = pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES)
            out["pcie_tx_bytes_per_s"], out["pcie_rx_bytes_per_s"] = 1024.0 * tx, 1024.0 * rx
        except pynvml.NVMLError as exc:
            self._error("pcie_bytes_per_s", exc)
        if self._nvlink is not None:
            out.update(self._nvlink.sample())
        return out


_MAX_ERRORS = 20
_STOP_TIMEOUT_S = 5.0
# nvml.h: "A scopeId of UINT_MAX returns aggregate value summed up across all links".
_ALL_LINKS = 0xFFFFFFFF
_NVLINK_MAX_LINKS_FALLBACK = 18  # Hopper's link count, when pynvml does not say


def nvlink_rates(prev: tuple[float, int, int], cur: tuple[float, int, int]) -> dict[str, float] | None:
    """Bytes/s between two readings (t_s, tx_kib, rx_kib) of NVLink's cumulative KiB counters.

    None when no time passed or a counter went backwards (a reset or a wrap).

    Example:
        >>> nvlink_rates((0.0, 100, 50), (2.0, 100 + 2048, 50 + 1024))
        {'nvlink_tx_bytes_per_s': 1048576.0, 'nvlink_rx_bytes_per_s': 524288.0}
    """
    dt = cur[0] - prev[0]
    d_tx, d_rx = cur[1] - prev[1], cur[2] - prev[2]
    if dt <= 0 or d_tx < 0 or d_rx < 0:
        return None
    return {"nvlink_tx_bytes_per_s": 1024.0 * d_tx / dt, "nvlink_rx_bytes_per_s": 1024.0 * d_rx / dt}


def field_value(value: Any) -> int | float | None:
    """The number in an `nvmlFieldValue_t`, or None when NVML answered it with an error."""
    import pynvml

    if value.nvmlReturn != pynvml.NVML_SUCCESS:
        return None
    member = {
        pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
        getattr(pynvml, "NVML_VALUE_TYPE_SIGNED_INT", 5): "siVal",
        getattr(pynvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", 6): "usVal",
    }.get(int(value.valueType))
    return None if member is None else getattr(value.value, member)


def sum_counters(values: Any, tx_field: int, rx_field: int) -> tuple[int, int] | None:
    """(TX KiB, RX KiB) summed over the answered entries of an `nvmlDeviceGetFieldValues` result.

    None unless both directions were answered at least once (no NVLink, or not counted).
    """
    sums = {tx_field: 0, rx_field: 0}
    seen: set[int] = set()
    for v in values:
        number = field_value(v)
        if number is None or int(v.fieldId) not in sums:
            continue
        sums[int(v.fieldId)] += int(number)
        seen.add(int(v.fieldId))
    return (sums[tx_field], sums[rx_field]) if seen == set(sums) else None


class _NvlinkCounters:
    """NVLink data throughput of one GPU from NVML's cumulative per-link KiB counters.

    The first read decides how: the all-links aggregate scope, else the sum of the links
    one by one (drivers without the aggregate), else NVLink is unavailable and nothing is
    ever recorded. A GPU that reports zero links has no NVLink (PCIe only).
    """

    def __init__(self, handle: Any, error: Callable[[str, BaseException], None]) -> None:
        self._handle = handle
        self._error = error
        self._scopes: list[int] | None = None  # None: not decided yet; []: unavailable
        self._prev: tuple[float, int, int] | None = None
        self.status = "not read yet"

    def sample(self) -> dict[str, float]:
        if self._scopes == []:
            return {}
        try:
            reading = self._read()
        except Exception as exc:  # noqa: BLE001 - NVML or ctypes; recorded, never raised
            self._error("nvlink", exc)
            if self._scopes is None:  # failed while deciding (e.g. an nvidia-ml-py without the fields)
                self._scopes = []
                self.status = f"unavailable: {type(exc).__name__}: {exc}"
            return {}
        if reading is None:
            return {}
        prev, self._prev = self._prev, reading
        return (nvlink_rates(prev, reading) or {}) if prev is not None else {}

    def _read(self) -> tuple[float, int, int] | None:
        import pynvml

        tx, rx = pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX
        if self._scopes is None:
            self._scopes = self._decide(pynvml, tx, rx)
            if not self._scopes:
                return None
        t = time.monotonic()
        values = pynvml.nvmlDeviceGetFieldValues(self._handle, [(f, s) for s in self._scopes for f in (tx, rx)])
        t = (t + time.monotonic()) / 2
        counters = sum_counters(values, tx, rx)
        if counters is None:
            self._error("nvlink", RuntimeError("NVML stopped answering the NVLink counters it answered before"))
            return None
        return (t, *counters)

    def _decide(self, pynvml: Any, tx: int, rx: int) -> list[int]:
        try:
            (count,) = pynvml.nvmlDeviceGetFieldValues(self._handle, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
            links = field_value(count)
        except pynvml.NVMLError as exc:
            self.status = f"unavailable: {type(exc).__name__}: {exc}"
            return []
        if links == 0:
            self.status = "unavailable: the GPU reports no NVLink"
            return []
        try:
            if sum_counters(pynvml.nvmlDeviceGetFieldValues(self._handle, [(tx, _ALL_LINKS), (rx, _ALL_LINKS)]),
                            tx, rx) is not None:
                self.status = "aggregate over links"
                return [_ALL_LINKS]
            n = int(links) if links else getattr(pynvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS_FALLBACK)
            per_link = pynvml.nvmlDeviceGetFieldValues(self._handle, [(f, i) for i in range(n) for f in (tx, rx)])
        except pynvml.NVMLError as exc:
            self.status = f"unavailable: {type(exc).__name__}: {exc}"
            return []
        answered = sorted({int(v.scopeId) for v in per_link if field_value(v) is not None})
        if sum_counters(per_link, tx, rx) is None:
            self.status = "unavailable: NVML answers no NVLink throughput counter"
            return []
        self.status = f"summed over {len(answered)} links"
        return answered
