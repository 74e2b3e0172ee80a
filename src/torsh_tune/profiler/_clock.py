"""One clock for every record: Unix seconds with perf_counter resolution.

`time.time()` aligns ranks on one host (and across hosts as far as NTP does); `perf_counter`
gives sub-microsecond deltas. The offset is taken once per process: later, the two clocks part
whenever the system's realtime clock is stepped (NTP or PTP corrections, a VM resumed), and a
time another component read from the realtime clock (DDP's reducer timers) is brought onto
this one with `realtime_minus_now()` at the moment it is read.
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


def realtime_minus_now(tries: int = 3) -> float:
    """How far the realtime clock (`time.time()`, CLOCK_REALTIME) is ahead of `now()` at this moment (s).

    A realtime reading `r` is `r - realtime_minus_now()` on this process's clock. The realtime read
    is bracketed by two perf_counter reads and placed at their midpoint; of `tries` brackets the
    narrowest wins, so that a thread preempted between the reads does not move the result.
    """
    perf, real = time.perf_counter, time.time
    best_width, best = float("inf"), 0.0
    for _ in range(tries):
        p0 = perf()
        r = real()
        p1 = perf()
        if p1 - p0 < best_width:
            best_width, best = p1 - p0, r - ((p0 + p1) / 2 + _OFFSET)
    return best
