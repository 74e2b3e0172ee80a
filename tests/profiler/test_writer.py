"""The record writer: shared fields, its own thread, nothing lost, failures raised."""

from __future__ import annotations

import json
import threading
import time

import pytest

from torsh_tune.profiler.writer import HOST_CALL_FIELDS, RecordWriter, SharedFields
from torsh_tune.rundir import RunDir


def _lines(run: RunDir, kind: str) -> list[dict]:
    path = run.rank_file(0, kind)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_shared_fields_are_written_once_per_record_with_its_own_fields(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=60)
    shared = SharedFields({"rank": 0, "collective": "all_reduce", "group_ranks": [0, 1], "issuer": "user"})
    writer.write("comm", {"_s": shared, "step": 3, "seq": 7, "t_issue": 12.5, "duration_s": 1e-6})
    writer.write("comm", {"_s": shared})
    writer.write("steps", {"rank": 0, "step": 3})
    writer.close()
    assert _lines(run, "comm") == [
        {"rank": 0, "collective": "all_reduce", "group_ranks": [0, 1], "issuer": "user", "step": 3, "seq": 7,
         "t_issue": 12.5, "duration_s": 1e-6},
        {"rank": 0, "collective": "all_reduce", "group_ranks": [0, 1], "issuer": "user"},
    ]
    assert _lines(run, "steps") == [{"rank": 0, "step": 3}]
    assert shared["issuer"] == "user"  # readers in the process see the fields as a dict


def test_a_host_call_record_is_written_in_fixed_point_as_the_encoder_would_write_its_fields(tmp_path):
    # A synchronous host-clock call's tuple takes its kind's prefix and one f-string; its record
    # (helpers.host_call_record), the same fields in another order, or a record with one more field, take the
    # encoder: the lines read the same fields, the tuple's times in fixed point (Unix seconds to 0.1 us,
    # durations to 1 ns).
    from helpers import host_call_record

    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=60)
    shared = SharedFields({"rank": 1, "collective": "all_reduce", "group_ranks": [0, 1], "async_op": False,
                           "dtype": "float32", "bucket": -1})
    sites = [(SharedFields({}), "user"), (shared, "user")]
    kept = (1, 4, 9, 4096, 10.000001, 10.0000135)  # as the capture keeps the call: its site's index in `sites`
    # perf_counter times as the capture takes them; the line adds the process's clock offset (a Unix time)
    call = host_call_record(kept, sites)
    assert call.pop("_s") is shared and tuple(call) == HOST_CALL_FIELDS
    other = dict(reversed(list(call.items())))
    longer = {**call, "grad_bytes": 4096}
    bare = {"step": 0, "seq": 0, "bytes": 8, "wire_bytes": 8, "t_issue": 1.5, "blocked_s": 0.25,
            "duration_s": 0.25, "t_complete": 1.75}
    for record, fields in ((call, shared), (other, shared), (longer, shared), (bare, SharedFields({}))):
        writer.write("comm", {"_s": fields, **record})
    writer.write_calls([kept], sites)  # the tuple itself, as a step's calls are written
    writer.close()
    lines = run.rank_file(0, "comm").read_text().splitlines()
    assert lines[0].startswith('{"rank":1,') and lines[3].startswith('{"step":0,')
    assert lines[4] == lines[0]  # the tuple's line is the encoder's, character for character
    got = [json.loads(line) for line in lines]
    assert got[0] == got[1] and got[2] == {**got[0], "grad_bytes": 4096}
    for line, want in ((got[0], {**shared, **call}), (got[3], bare)):
        assert list(line) == list(want)  # the encoder's order: fixed-point times after the rest
        for key, value in want.items():
            assert line[key] == (pytest.approx(value, rel=0, abs=1e-7 if key.startswith("t_") else 1e-9)
                                 if isinstance(value, float) else value), key
    assert got[0]["blocked_s"] == got[0]["duration_s"] == 12.5e-6
    assert lines[0].endswith(f'"t_issue":{call["t_issue"]:.7f},"blocked_s":0.000012500,"duration_s":0.000012500,'
                             f'"t_complete":{call["t_complete"]:.7f}}}')


def test_records_write_times_and_durations_in_fixed_point_and_every_other_value_as_json_does(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=60)
    record = {"rank": 0, "step": 3, "t_start": 1796613308.3540378, "step_s": 0.001066446304321289,
              "loss": 0.026325833052396774, "cpu_pct": 12.3456789012345, "pcie_tx_bytes_per_s": 1234.56789012345,
              "eval_s": float("nan"), "timeout_s": float("inf"), "host_step_s": -0.5, "tokens": None, "warmup": True}
    writer.write("steps", dict(record))
    writer.close()
    line = run.rank_file(0, "steps").read_text()
    for text in ('"t_start":1796613308.3540378', '"step_s":0.001066446', '"host_step_s":-0.500000000'):
        assert text in line
    got = json.loads(line)
    assert got["t_start"] == record["t_start"]  # 0.1 us: the same float for a Unix time of these decades
    # a loss, a percentage and a rate keep every digit; NaN and infinities keep json's spelling
    for key in ("loss", "cpu_pct", "pcie_tx_bytes_per_s", "tokens", "warmup", "rank", "step"):
        assert got[key] == record[key], key
    assert got["eval_s"] != got["eval_s"] and got["timeout_s"] == float("inf")


def test_a_host_call_line_reads_back_as_the_same_unix_time():
    # Fixed point to 0.1 us loses nothing of a Unix time of these decades (a float64 holds 0.24 us of it).
    import random

    from torsh_tune.profiler._clock import offset as clock_offset
    from torsh_tune.profiler.writer import _line

    rng = random.Random(0)
    sites = [(SharedFields({"rank": 0}), "user")]
    offset = clock_offset()
    for _ in range(2000):
        t0 = time.perf_counter() + rng.uniform(0, 1e6)
        t1 = t0 + rng.uniform(0, 0.01)
        got = json.loads(_line((0, 1, 2, 8, t0, t1), sites))
        assert got["t_issue"] == t0 + offset and got["t_complete"] == t1 + offset
        assert abs(got["duration_s"] - (t1 - t0)) <= 5e-10


def test_the_writer_thread_writes_within_the_interval_and_loses_nothing_written_meanwhile(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=0.05)
    stop = threading.Event()
    written = []

    def produce() -> None:
        i = 0
        while not stop.is_set() and i < 200_000:
            writer.write("steps", {"rank": 0, "step": i})
            written.append(i)
            i += 1
            if i % 100 == 0:
                time.sleep(0.001)

    producer = threading.Thread(target=produce)
    producer.start()
    deadline = time.monotonic() + 10
    path = run.rank_file(0, "steps")
    while not (path.exists() and path.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert path.exists() and path.stat().st_size, "nothing written by the writer's thread within 10 s"
    time.sleep(0.2)  # several flushes while the producer appends
    stop.set()
    producer.join()
    writer.close()
    assert [r["step"] for r in _lines(run, "steps")] == written


def test_a_failed_write_is_raised_by_close(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=60)
    writer.write("steps", {"rank": 0, "bad": object()})  # not JSON: the flush fails
    with pytest.raises(OSError, match="could not all be written"):
        writer.close()


def test_records_that_are_not_json_fail_alone_and_every_other_line_is_written_once(tmp_path):
    run = RunDir(tmp_path / "run")
    writer = RecordWriter(run, 0, flush_interval_s=60)
    bad = {5, 21, 22, 40}  # in the first, second and third chunk of records encoded together
    for i in range(50):
        writer.write("steps", {"rank": 0, "step": i, "bad": object()} if i in bad else {"rank": 0, "step": i})
    with pytest.raises(OSError, match="could not all be written"):
        writer.close()
    assert [r["step"] for r in _lines(run, "steps")] == [i for i in range(50) if i not in bad]


def _random_record(rng, sites, t0: float, d: float) -> dict:
    """A record of the kinds the writer writes (CommRecord, StepRecord, SystemRecord fields), with values of every
    type JSON takes, some of which the C writer turns down (the Python writer then writes them)."""
    pick = rng.choice
    values = [None, True, False, -3, 0, 7, 2**70, 0.1, -2.5e-7, 1e20, float("nan"), float("inf"), -float("inf"),
              "forward", 'say "hi"', "back\\slash", "caf\u00e9", "tab\there", [0, 1, 3], (2, 3), [], [[1], [2.5, None]],
              {"nested": 1}, 12.3456789012345]
    record = {"step": rng.randrange(1000), "seq": rng.randrange(-1, 10**6), "t_issue": t0, "duration_s": pick([d, -d, -0.0]),
              "t_complete": t0 + d, "exposed_comm_s": pick([d, -1e-12, 0.0, 1e16]), "loss": pick([0.0263, float("nan"), None]),
              "cpu_pct": rng.uniform(0, 400), "pcie_tx_bytes_per_s": rng.uniform(0, 1e10), "phase": pick(values),
              pick(["peak_mem_bytes", "group_ranks", "clock", "warmup"]): pick(values)}
    for key in rng.sample(list(record), rng.randrange(3)):  # fields come and go
        del record[key]
    if rng.random() < 0.7:
        record = {"_s": pick(sites)[0], **record}
    return record


def test_the_c_writer_is_built_and_writes_every_record_as_python_does_character_for_character(tmp_path, monkeypatch):
    import random

    from torsh_tune.profiler import writer as writer_module

    assert writer_module._c_record_lines is not None, "the C writer (profiler/_lines.c) was not built"
    rng = random.Random(0)
    sites = [(SharedFields({"rank": 0, "collective": "all_reduce", "group_ranks": [0, 1], "origin": "train:main"}), "user"),
             (SharedFields({}), "user"), (SharedFields({"rank": 0, "collective": "broadcast", "dtype": "float16"}), "user")]
    records: list = []
    for i in range(500):
        t0 = rng.uniform(0, 5e6)
        d = 10 ** rng.uniform(-9, 1) if i % 50 else [0.0, 0.0009765625, 5e-10][i // 50 % 3]  # zero, ties, the rounding edge
        records.append((rng.randrange(3), rng.randrange(10**6), rng.randrange(10**9), rng.randrange(2**40), t0, t0 + d))
        if i % 7 == 0:  # the other records (dicts: any value json writes) keep their places among the calls
            records.append(_random_record(rng, sites, t0, d))
    # What the C writer turns down the Python one writes: an int time, a bool, a negative duration (a clock that
    # went back), NaN
    records += [(0, 1, 2, 3, 5, 6.0), (0, True, 2, 3, 5.0, 6.0), (1, 1, 2, 3, 7.0, 6.5), (2, 1, 2, 3, 7.0, float("nan"))]
    records.append((0, 2**63 - 1, 2**63 - 1, 2**63 - 1, 4e15, 4e15 + 0.5))  # the longest line the C writer writes

    def written(c_writer) -> list[str]:
        monkeypatch.setattr(writer_module, "_c_record_lines", c_writer)
        run = RunDir(tmp_path / ("c" if c_writer else "py"))
        w = RecordWriter(run, 0, flush_interval_s=60)
        w._call_sites = sites
        w._streams["comm"].pending.extend(records)
        w.close()
        return run.rank_file(0, "comm").read_text().splitlines()

    c_writer = writer_module._c_record_lines
    c_lines, py_lines = written(c_writer), written(None)
    assert len(c_lines) == len(records) and c_lines == py_lines
    declined = sum(line is None for line in c_writer(
        records, [site[0].prefix for site in sites], writer_module._OFFSET, writer_module._FIXED_POINT))
    assert 0 < declined < len(records) / 4  # most records written in C; what it cannot write exactly, in Python
    assert json.loads(c_lines[-3])["duration_s"] == -0.5 and len(c_lines[-1]) > 256


def test_the_c_fixed_point_is_pythons_correctly_rounded_format():
    import math
    import random

    from torsh_tune.profiler._lines import fixed

    rng = random.Random(1)
    values = [rng.uniform(1.6e9, 1.9e9) for _ in range(20000)] + [10 ** rng.uniform(-12, 6) for _ in range(20000)]
    # exact halves at the last digit (round half to even), carries into the integer part, the smallest numbers
    values += [k / 2**m for m in range(1, 34) for k in range(1, 600, 7)] + [0.0, 0.0009765625, 0.99999999995, 9.9999999995,
                                                                           2.0**53 - 1, 5e-324, 1e-300]
    for x in values:
        for digits in (7, 9):
            assert fixed(x, digits) == format(x, f".{digits}f"), (x, digits)
    for x in (-1.0, -0.0, math.inf, math.nan, 2.0**53):  # what the writer leaves to Python
        assert fixed(x, 7) is None
