"""CUDA events for device time: recorded on the current stream, resolved later with `query()`.

Nothing here synchronizes on the hot path: a step's events are read once the last of them
has completed (a step or two later), and only `drain(wait=True)` at the end of a run waits.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceEvents"]


class DeviceEvents:
    """A pool of timing events, so that recording one costs a `record()` and no allocation."""

    def __init__(self) -> None:
        self._free: list[Any] = []
        # (device, raw stream) -> Stream: `torch.cuda.current_stream()` builds a new Stream object per
        # call (tens of µs on an H100 under load); the raw handle is one C call.
        self._streams: dict[tuple[int, int], Any] = {}
        self._default: dict[int, int] = {}

    def current_stream(self) -> tuple[Any, bool]:
        """(the current CUDA stream, whether it is its device's default stream)."""
        device = torch._C._cuda_getDevice()
        raw = torch._C._cuda_getCurrentRawStream(device)
        stream = self._streams.get((device, raw))
        if stream is None:
            stream = self._streams[(device, raw)] = torch.cuda.current_stream(device)
            self._default.setdefault(device, torch.cuda.default_stream(device).cuda_stream)
        return stream, raw == self._default[device]

    def record(self) -> Any:
        """An event recorded now on the current CUDA stream."""
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record(self.current_stream()[0])
        return event

    def release(self, *events: Any) -> None:
        """Give resolved events back to the pool."""
        self._free.extend(e for e in events if e is not None)

    @staticmethod
    def done(event: Any) -> bool:
        return event.query()

    @staticmethod
    def seconds(start: Any, end: Any) -> float:
        """Device time from `start` to `end` (both completed), in seconds; negative if `end` came first."""
        return start.elapsed_time(end) / 1000.0
