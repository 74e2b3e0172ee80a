"""Our clock (perf_counter + an offset taken at import) against the realtime clock that DDP's reducer timers read."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torsh_tune.profiler import _clock
from torsh_tune.runtime.context import _ddp_timers


def test_the_realtime_clock_is_read_against_ours_and_a_step_of_it_is_seen(monkeypatch):
    assert abs(_clock.realtime_minus_now()) < 0.05  # taken at import: apart by how far realtime moved since
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3.0)  # the realtime clock stepped back 3 s
    assert _clock.realtime_minus_now() == pytest.approx(-3.0, abs=0.05)


def test_ddps_timers_land_in_the_backward_that_ran_them_when_our_clock_is_apart_from_realtime(monkeypatch):
    # As if the realtime clock had been stepped back 2 s after this process took its offset: our clock runs 2 s ahead.
    monkeypatch.setattr(_clock, "_OFFSET", _clock.offset() + 2.0)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)))
        x = torch.randn(8, 64)
        model(x).sum().backward()  # DDP's first iteration is not collected
        model(x)
        t0 = _clock.now()
        model(x).sum().backward()
        t1 = _clock.now()
        model(x)  # DDP reports an iteration's timers at the next forward
        data = _ddp_timers(model)
        start, end = data["backward_comm_time_start"], data["backward_comm_time_end"]
        shift = _clock.realtime_minus_now()
        assert t0 <= start / 1e9 - shift <= end / 1e9 - shift <= t1
        assert start / 1e9 < t0 - 1.0  # read as it is, the realtime timer lies 2 s before the backward on our clock
    finally:
        dist.destroy_process_group()


def _exchange_rank(rank: int, port: int, ahead: float, results) -> None:  # noqa: ANN001 - a spawned process
    from datetime import timedelta

    # Rank 1 plays a second host whose clock runs `ahead` of rank 0's (both read `now()`).
    _clock._OFFSET += ahead if rank == 1 else 0.0
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    results[rank] = _clock.exchange_with_rank0(store, rank, 2, timeout_s=20.0)


def test_the_start_up_exchange_reads_a_second_hosts_clock_against_rank_0s():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_exchange_rank, args=(port, 0.030, results), nprocs=2, join=True)
    assert results[0] == {"answered": [1], "failed": {}}
    sync = results[1]
    assert sync["reference_rank"] == 0 and sync["rounds"] == _clock.EXCHANGE_ROUNDS and sync["t"] > 1.7e9
    assert 0 < sync["rtt_s"] < 0.05
    # NTP's bound: off by at most half the best round trip, whatever the two directions took
    assert abs(sync["ahead_s"] - 0.030) <= sync["rtt_s"] / 2 + 1e-6


def test_rank_0_gives_up_on_hosts_that_never_answer_and_says_which(monkeypatch):
    from datetime import timedelta

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    tried = []
    real = dist.ProcessGroupGloo

    def pair(prefixed, *args):  # the real gloo group; which pairs rank 0 tried to build
        tried.append(prefixed)
        return real(prefixed, *args)

    monkeypatch.setattr(dist, "ProcessGroupGloo", pair)
    result = _clock.exchange_with_rank0(store, 0, 3, timeout_s=1.0)
    assert result["answered"] == [] and sorted(result["failed"]) == [1, 2]
    assert result["failed"][1].startswith("DistStoreError")
    assert len(tried) == 1  # the first silence ends the exchange: node 2 is not waited for too
