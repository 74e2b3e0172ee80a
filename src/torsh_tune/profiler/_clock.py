"""One clock for every record: Unix seconds with perf_counter resolution.

`time.time()` aligns ranks on one host (and across hosts as far as NTP does); `perf_counter`
gives sub-microsecond deltas. The offset is taken once per process.
"""

from __future__ import annotations

import time

_OFFSET = time.time() - time.perf_counter()


def now() -> float:
    """Unix time in seconds, monotonic within this process."""
    return time.perf_counter() + _OFFSET


def offset() -> float:
    """What `now()` adds to `time.perf_counter()`: hot paths add it themselves and skip a call."""
    return _OFFSET
