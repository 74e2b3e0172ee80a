"""One clock for every record: Unix seconds with perf_counter resolution.

`time.time()` aligns ranks on one host (and across hosts as far as NTP does); `perf_counter`
gives sub-microsecond deltas. The offset is taken once per process: later, the two clocks part
whenever the system's realtime clock is stepped (NTP or PTP corrections, a VM resumed), and a
time another component read from the realtime clock (DDP's reducer timers) is brought onto
this one with `realtime_minus_now()` at the moment it is read. Hosts' clocks differ by what NTP or
PTP leaves; `exchange_with_rank0` measures each host's against rank 0's at start-up and at the end.
"""

from __future__ import annotations

import time
from typing import Any

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


#: Round trips per host in an exchange (`exchange_with_rank0`); the one with the least round trip wins.
EXCHANGE_ROUNDS = 16


def exchange_with_rank0(store: Any, node_rank: int, nnodes: int, *, tag: str = "0", peers: list[int] | None = None,
                        rounds: int = EXCHANGE_ROUNDS, timeout_s: float = 10.0) -> dict[str, Any]:
    """How far this host's clock (`now()`) is ahead of rank 0's, by ping-pong with rank 0 (NTP's estimate).

    Called by one rank per host (local rank 0) right after the process group is up and again as it
    is destroyed (`runtime.patches`): rank 0 (node 0) answers each other host in turn, `rounds`
    times, with its clock's reading as the ping arrives; a host takes, from the round with the
    least round trip, the midpoint of its own send and receive minus that reading. Its error is at
    most half that round trip, whatever the two directions' delays. A two-rank gloo group per host
    pair, built on the job's store under a key prefix of its own (`tag`: one per exchange, the same
    on every rank) and never registered with c10d: no collective of the job's, no group count,
    nothing a capture or a script sees.

    `peers`: on rank 0, the nodes to answer (default: 1 to nnodes - 1).

    Returns, on a host other than rank 0's, {"reference_rank": 0, "ahead_s", "rtt_s", "t" (the
    best round's midpoint, on this host's clock), "rounds"}; on rank 0, {"answered": [node ranks],
    "failed": {node rank: error}}. Raises what gloo raised on a host other than rank 0's (its
    caller notes it).
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    buf = torch.zeros(1, dtype=torch.float64)

    def pair(node: int, me: int) -> Any:
        # Rank 0 answers the hosts in turn (milliseconds each): a host waits for those before it too.
        timeout = timedelta(seconds=timeout_s + (0 if me == 0 else 0.1 * node))
        return dist.ProcessGroupGloo(dist.PrefixStore(f"torsh_tune/clock/{tag}/{node}", store), me, 2, timeout)

    if node_rank == 0:
        answered: list[int] = []
        failed: dict[int, str] = {}
        todo = list(range(1, nnodes) if peers is None else peers)
        for i, node in enumerate(todo):
            try:
                pg = pair(node, 0)
                for _ in range(rounds):
                    pg.recv([buf], 1, 0).wait()
                    buf[0] = now()
                    pg.send([buf], 1, 0).wait()
                answered.append(node)
            except RuntimeError as exc:
                # Every host passed init_process_group, so one that does not answer is one gloo cannot reach (an
                # interface or address setting all hosts share, GLOO_SOCKET_IFNAME): the others are not waited for
                # either, `timeout_s` each. Their own waits end at their timeouts.
                why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                failed.update({n: why for n in todo[i:]})
                break
        return {"answered": answered, "failed": failed}
    pg = pair(node_rank, 1)
    best_rtt, ahead, mid = float("inf"), 0.0, 0.0
    for _ in range(rounds):
        t1 = now()
        pg.send([buf], 0, 0).wait()
        pg.recv([buf], 0, 0).wait()
        t4 = now()
        if t4 - t1 < best_rtt:
            best_rtt, mid = t4 - t1, (t1 + t4) / 2
            ahead = mid - float(buf[0])
    return {"reference_rank": 0, "ahead_s": ahead, "rtt_s": best_rtt, "t": mid, "rounds": rounds}
