"""Trace parsing: the C scanner, its pure-Python fallback and a plain json.loads reference agree.

`parse_trace_file` streams a Kineto trace through ``_scan.Scanner`` (C) or
``_reader.PyScanner``; the reference below decodes the whole file with ``json.loads`` and
builds the same columns the obvious way, so all three must match to the bit.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from torsh_tune.analysis.traces import _parser, _reader
from torsh_tune.analysis.traces._parser import (
    CHUNK_BYTES,
    EVENT_COLUMNS,
    dtype_bytes,
    parse_trace_file,
)
from torsh_tune.analysis.traces._reader import event_bounds
from torsh_tune.analysis.traces._symbols import SymbolTable
from torsh_tune.errors import ConfigError

DATA = Path(__file__).resolve().parents[2] / "data" / "traces"
TRACES = sorted(DATA.glob("*/*.json.gz"))
SCANNERS = ("c", "python")
STRING_COLUMNS = ("name_id", "cat_id", "coll_name_id", "dtype_id", "pg_name_id", "pg_ranks_id")
DTYPES = {
    **dict.fromkeys(("name_id", "cat_id", "coll_name_id", "dtype_id", "pg_name_id", "pg_ranks_id",
                     "stream", "device", "group_size"), np.int32),
    **dict.fromkeys(("pid", "tid", "correlation", "external_id", "in_nelems", "out_nelems", "coll_seq",
                     "input_numel", "input_bytes"), np.int64),
    "ts_us": np.float64, "dur_us": np.float64, "ph": np.int8,
}
INT_ARGS = {"External id": "external_id", "correlation": "correlation", "stream": "stream",
            "device": "device", "In msg nelems": "in_nelems", "Out msg nelems": "out_nelems",
            "Group size": "group_size", "Seq": "coll_seq"}
STR_ARGS = {"Collective name": "coll_name_id", "dtype": "dtype_id", "Process Group Name": "pg_name_id",
            "Process Group Ranks": "pg_ranks_id"}
DETAIL = re.compile(r"^(c10d::|gloo:|record_param_comms|nccl:)")


# --------------------------------------------------------------------------- reference

def _json_number(v: Any) -> Any:
    if isinstance(v, str):
        if not re.fullmatch(r"-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?", v, re.ASCII):
            return None
        return json.loads(v)
    return v


def _ref_int(v: Any, bits: int) -> int:
    v = _json_number(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return -1
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return -1
        v = math.trunc(v)
    return v if -(2 ** (bits - 1)) <= v < 2 ** (bits - 1) else -1


def _ref_float(v: Any) -> float:
    v = _json_number(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    try:
        return float(v)
    except OverflowError:
        return math.copysign(math.inf, v)


def _ref_sizes(ev: dict) -> tuple[int, int]:
    args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
    numel, nbytes, known = 0, 0, True
    types = args.get("Input type") or []
    for i, dims in enumerate(args.get("Input Dims") or []):
        if not isinstance(dims, list) or not dims:
            continue
        shapes = dims if isinstance(dims[0], list) else [dims]
        n = 0
        for shape in shapes:
            if isinstance(shape, list) and shape:
                try:
                    n += math.prod(int(x) for x in shape)
                except (TypeError, ValueError):
                    return -1, -1
        kind = types[i] if i < len(types) else ""
        if n == 0 or kind in ("Scalar", "ScalarList"):
            continue
        numel += n
        if dtype_bytes(kind) < 0:
            known = False
        nbytes += n * max(dtype_bytes(kind), 0)
    return (numel or -1), (nbytes if numel and known else -1)


def reference(text: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[tuple[int, int], str]]:
    """Columns (strings decoded) from json.loads of the whole file."""
    doc = json.loads(text)
    cols: dict[str, list] = {c: [] for c in EVENT_COLUMNS}
    threads: dict[tuple[int, int], str] = {}
    for ev in doc["traceEvents"]:
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        ph = ev.get("ph")
        if ph == "M" and ev.get("name") == "thread_name" and isinstance(args.get("name"), str):
            key, name = (_ref_int(ev.get("pid"), 64), _ref_int(ev.get("tid"), 64)), args["name"]
            old = threads.get(key)
            threads[key] = name if old is None or name in old else f"{old} | {name}"
        if ph not in ("X", "i"):
            continue
        name = ev.get("name") if isinstance(ev.get("name"), str) else None
        row = {"name_id": name, "cat_id": ev.get("cat") if isinstance(ev.get("cat"), str) else None,
               "ph": 0 if ph == "X" else 1, "ts_us": _ref_float(ev.get("ts")), "dur_us": _ref_float(ev.get("dur")),
               "pid": _ref_int(ev.get("pid"), 64), "tid": _ref_int(ev.get("tid"), 64)}
        for key, col in INT_ARGS.items():
            row[col] = _ref_int(args.get(key), 32 if DTYPES[col] is np.int32 else 64)
        for key, col in STR_ARGS.items():
            row[col] = args.get(key) if isinstance(args.get(key), str) else None
        row["input_numel"], row["input_bytes"] = _ref_sizes(ev) if name and DETAIL.match(name) else (-1, -1)
        for c in EVENT_COLUMNS:
            cols[c].append(row[c])
    out = {c: v if c in STRING_COLUMNS else np.array(v, dtype=DTYPES[c]) for c, v in cols.items()}
    return out, {k: v for k, v in doc.items() if k != "traceEvents"}, threads


def parse(path: Path, scanner: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any], dict]:
    """parse_trace_file with the string columns decoded (symbol ids differ between runs)."""
    symbols = SymbolTable()
    cols, meta, threads = parse_trace_file(path, symbols, scanner=scanner, **kw)
    assert tuple(cols) == EVENT_COLUMNS
    for c, v in cols.items():
        assert isinstance(v, np.ndarray) and v.dtype == DTYPES[c] and v.ndim == 1, c
        assert len(v) == len(cols["ph"])
    out = {c: symbols.decode(v.tolist()) if c in STRING_COLUMNS else v for c, v in cols.items()}
    return out, meta, threads


def assert_same(got: tuple, want: tuple) -> None:
    gcols, gmeta, gthreads = got
    wcols, wmeta, wthreads = want
    for c in EVENT_COLUMNS:
        g, w = gcols[c], wcols[c]
        if c in STRING_COLUMNS:
            assert g == w, c
        else:
            assert g.dtype == w.dtype, c
            # bit-exact, NaN included (-0.0 and 0.0 differ too)
            assert g.tobytes() == w.tobytes(), (c, np.flatnonzero(g != w)[:5])
    assert gmeta == wmeta
    assert gthreads == wthreads


# --------------------------------------------------------------------------- bundled traces

@pytest.mark.parametrize("path", TRACES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_scanners_match_each_other_and_the_json_reference(path):
    assert len(TRACES) == 8
    want = reference(gzip.decompress(path.read_bytes()))
    got_c = parse(path, "c")
    got_py = parse(path, "python")
    assert_same(got_c, got_py)
    assert_same(got_c, want)
    assert_same(got_py, want)
    assert len(got_c[0]["ph"]) > 400


def test_known_values_of_the_nccl_trace():
    cols, meta, threads = parse(DATA / "hta-nccl-2rank-rank0" / "rank-0.json.gz", "c")
    assert len(cols["ph"]) == 26935 and (cols["ph"] == 1).sum() == 2
    assert meta["distributedInfo"]["rank"] == 0 and "traceEvents" not in meta
    assert cols["ts_us"][0] == 4458676522690.655 and cols["dur_us"][0] == 156.777
    assert cols["name_id"][0] == "autograd::engine::evaluate_function: DivBackward1"
    assert (cols["pid"] == -1).any()  # Kineto's "Spans"/"Traces" rows
    kernels = [i for i, n in enumerate(cols["name_id"]) if n and n.startswith("ncclKernel_AllReduce")]
    assert kernels and all(cols["coll_name_id"][i] == "allreduce" for i in kernels)
    assert (cols["in_nelems"][kernels] > 0).all() and (cols["group_size"][kernels] == 2).all()
    assert len(threads) == 4 and all(isinstance(k[0], int) for k in threads)


def test_known_sizes_of_the_gloo_trace():
    cols = parse(DATA / "gloo-ddp-2rank" / "rank-0.json.gz", "c")[0]
    gathers = [i for i, n in enumerate(cols["name_id"]) if n == "gloo:all_gather"]
    assert len(gathers) == 2
    assert cols["input_numel"][gathers].tolist() == [4096, 4096]
    assert cols["input_bytes"][gathers].tolist() == [4096 * 4, 4096 * 4]


@pytest.mark.parametrize("scanner", SCANNERS)
def test_chunk_sizes_members_and_plain_json_agree(tmp_path, scanner):
    """Events straddle chunk edges; gzip members and plain text change nothing."""
    src = DATA / "hta-sampled-2rank" / "rank-0.json.gz"
    text = gzip.decompress(src.read_bytes())
    plain = tmp_path / "rank-0.json"
    plain.write_bytes(text)
    minified = tmp_path / "minified.json"
    minified.write_bytes(json.dumps(json.loads(text), separators=(",", ":")).encode())
    members = tmp_path / "members.json.gz"
    cuts = [0, 1000, len(text) // 3, len(text) // 3 + 7, len(text)]
    members.write_bytes(b"".join(gzip.compress(text[a:b]) for a, b in zip(cuts, cuts[1:])))
    want = parse(src, scanner)
    assert_same(want, reference(text))
    for chunk in (4096, 65536, CHUNK_BYTES):
        for path in (src, plain, minified, members):
            assert_same(parse(path, scanner, chunk_bytes=chunk), want)


def test_tiny_blocks_split_every_token(tmp_path, monkeypatch):
    """Decompressed blocks of a few bytes: tokens, escapes and UTF-8 cut everywhere."""
    text = nasty_trace()
    (tmp_path / "t.json").write_bytes(text)
    (tmp_path / "t.json.gz").write_bytes(gzip.compress(text))
    want = reference(text)
    monkeypatch.setattr(_reader, "_READ_BYTES", 24)
    for scanner in SCANNERS:
        for name in ("t.json", "t.json.gz"):
            for chunk in (1, 50):
                assert_same(parse(tmp_path / name, scanner, chunk_bytes=chunk), want)


@pytest.mark.parametrize("scanner", SCANNERS)
def test_scanner_fed_byte_by_byte(scanner):
    """The scanner API itself: consume, carry the tail over, finish; any cut gives the same."""
    text = nasty_trace()
    body = text[text.index(b"[", text.index(b'"traceEvents"')) + 1:]
    one = _parser._new_scanner(scanner)
    consumed, close, details = one.feed(body)
    assert close == consumed - 1 and body[close:close + 1] == b"]"
    want = one.finish()
    many = _parser._new_scanner(scanner)
    buf, rows, fed = b"", [], 0
    for i in range(len(body)):
        buf += body[i:i + 1]
        consumed, found_close, found = many.feed(buf, fed)
        rows += [r for r, _ in found]
        if found_close >= 0:
            assert fed + found_close == i == close
            break
        buf = buf[consumed:]
        fed += consumed
    assert rows == [r for r, _ in details] and rows
    got = many.finish()
    assert {k: bytes(v) for k, v in got[0].items()} == {k: bytes(v) for k, v in want[0].items()}
    assert got[1:] == want[1:]
    with pytest.raises(RuntimeError):
        many.feed(b"{}")


# --------------------------------------------------------------------------- nasty JSON

def nasty_trace() -> bytes:
    """A hand-written trace with most of what JSON allows (not produced by json.dumps)."""
    long_name = "x" * 9000
    events = [
        # escapes and separators inside strings
        r'{"ph": "X", "cat": "cpu_op", "name": "aten::mm \"q\" }, {\\ \/ \b\f\n\r\t", "pid": 1, "tid": 2, '
        r'"ts": 1.5e3, "dur": 2E-1, "args": {"note": "}, {\"ph\": \"X\"}", "External id": 7}}',
        # \u escapes: BMP, surrogate pair, lone surrogate; raw UTF-8 of the same text
        r'{"ph": "X", "cat": "caf\u00e9 \ud83d\ude00 \u4e2d", "name": "lone \ud800 end", "pid": 1, "tid": 2, '
        r'"ts": 2, "dur": 0.1}',
        '{"ph": "X", "cat": "caf\u00e9 \U0001F600 \u4e2d", "name": "utf8 \u00e9", "pid": 1, "tid": 2, '
        '"ts": 3, "dur": 0}',
        # escaped keys, duplicate keys (the last wins, a second args replaces the first)
        r'{"ph": "X", "n\u0061me": "first", "name": "second", "pid": 1, "tid": 2, "ts": 4, '
        r'"args": {"stream": 3, "device": 4}, "args": {"stream": 5}}',
        # nested args, int args as floats / numeric strings / junk, out-of-range values
        '{"ph": "X", "cat": "kernel", "name": "k", "pid": "3", "tid": 2.9, "ts": "5.25", "dur": "bad", '
        '"args": {"nested": {"a": [1, {"b": [[], {}]}], "c": null}, "External id": 1e3, "correlation": "12", '
        '"stream": 7.9, "device": "cuda", "Group size": 1e10, "Seq": true, "In msg nelems": null, '
        '"Out msg nelems": -0.5, "Collective name": ["not", "a", "string"], "dtype": "Float", '
        '"Process Group Name": "0", "Process Group Ranks": "[0, 1]", "list": [1.5e-3, -2, 0, "s", false]}}',
        # numbers at the edges: int64 limits, huge/tiny floats, long decimals, -0
        '{"ph": "i", "name": "edge", "pid": 9223372036854775807, "tid": -9223372036854775808, '
        '"ts": 12345678901234567890123, "dur": 1e400, '
        '"args": {"External id": 9223372036854775808, "correlation": 9.223372036854774e18, '
        '"In msg nelems": "-9223372036854775808", "Out msg nelems": 1.0e2, "Seq": 123456789012345678901234567890, '
        '"stream": 2147483647, "device": -2147483649}}',
        '{"ph": "X", "name": "digits", "pid": 0, "tid": 0, "ts": 3.14159265358979323846264338327950288, '
        '"dur": -0.0, "args": {"External id": -0}}',
        '{"ph": "X", "name": "tiny", "pid": 0, "tid": 0, "ts": 4.9e-324, "dur": 2.2250738585072011e-308}',
        '{"ph": "X", "name": "fast path", "pid": 0, "tid": 0, "ts": 0.1, "dur": 9007199254740993}',
        # more than 53 bits of mantissa: rounding it first, then scaling, would be off by one ulp
        '{"ph": "X", "name": "ulp", "pid": 0, "tid": 0, "ts": 44667375401.9253276, "dur": "84088621752.6361412"}',
        # Kineto's string pid rows, missing dur, missing everything
        '{"ph": "X", "name": "Spans", "pid": "Spans", "tid": "PyTorch Profiler", "ts": 6}',
        '{"ph": "i"}',
        '{"ph": "X", "name": 42, "cat": null, "args": [1, 2]}',
        # other phases and metadata
        '{"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "thread 2 (loop)"}}',
        '{"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "thread 2 (python)"}}',
        '{"ph": "M", "name": "thread_name", "pid": "Spans", "tid": 3, "args": {"name": "spans"}}',
        '{"ph": "M", "name": "thread_name", "pid": 1, "tid": 4, "args": {"name": 5}}',
        '{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}}',
        '{"ph": "s", "id": 1, "pid": 1, "tid": 2, "ts": 7, "cat": "ac2g", "name": "ac2g"}',
        '{"ph": "B", "name": "begin", "pid": 1, "tid": 2, "ts": 8}',
        '{"ph": ["X"], "name": "not a phase"}',
        # collectives with sizes
        '{"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": 2, "ts": 9, "dur": 1, '
        '"args": {"Input Dims": [[2, 3], [[4], [5, 6]]], "Input type": ["float", "TensorList"], '
        '"Collective name": "allreduce", "dtype": "Float", "Group size": 2}}',
        '{"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "pid": 1, "tid": 2, "ts": 10, "dur": 1, '
        '"args": {"Input Dims": [[[8, 2]], [], [1]], "Input type": ["c10::BFloat16", "Scalar", "long int"]}}',
        '{"ph": "X", "cat": "cpu_op", "name": "gloo:all_reduce", "pid": 1, "tid": 2, "ts": 11, "dur": 1, '
        '"args": {"Input Dims": "junk"}}',
        '{"ph": "X", "cat": "cpu_op", "name": "nccl:all_reduce", "pid": 1, "tid": 2, "ts": 12, "dur": 1, '
        '"args": {"Input Dims": [["a"]], "Input type": ["float"]}}',
        # an event far longer than a chunk
        '{"ph": "X", "name": "' + long_name + '", "pid": 1, "tid": 2, "ts": 13, "dur": 1}',
        '{"ph":"X","name":"compact","pid":1,"tid":2,"ts":14,"dur":1,"args":{"External id":1}}',
    ]
    seps = [",", " ,\r\n", "\r\n,\t", ",\n\n   ", ","]
    body = ""
    for i, ev in enumerate(events):
        body += ev if i == 0 else seps[i % len(seps)] + ev
    return ('{"schemaVersion": 1, "s": "\\"traceEvents\\": [", "traceEvents":\r\n [ '
            + body + ' \r\n] , "distributedInfo": {"rank": 3}, "after": [{"k": "]"}]}\n').encode()


@pytest.mark.parametrize("scanner", SCANNERS)
def test_nasty_json(tmp_path, scanner):
    text = nasty_trace()
    path = tmp_path / "t.json"
    path.write_bytes(text)
    got = parse(path, scanner)
    want = reference(text)
    assert_same(got, want)
    cols, meta, threads = got
    assert meta == {"schemaVersion": 1, "s": '"traceEvents": [', "distributedInfo": {"rank": 3},
                    "after": [{"k": "]"}]}
    assert cols["name_id"][:4] == ['aten::mm "q" }, {\\ / \b\f\n\r\t', "lone \ud800 end", "utf8 \u00e9", "second"]
    assert cols["cat_id"][1] == cols["cat_id"][2] == "caf\u00e9 \U0001F600 \u4e2d"
    assert cols["ts_us"][:2].tolist() == [1500.0, 2.0] and cols["dur_us"][0] == 0.2
    assert cols["stream"][3] == 5 and cols["device"][3] == -1  # the second args replaced the first
    k = 4  # the float/str/junk argument row
    assert (cols["pid"][k], cols["tid"][k], cols["ts_us"][k]) == (3, 2, 5.25) and np.isnan(cols["dur_us"][k])
    assert (cols["external_id"][k], cols["correlation"][k], cols["stream"][k], cols["device"][k]) == (1000, 12, 7, -1)
    assert (cols["group_size"][k], cols["coll_seq"][k], cols["in_nelems"][k], cols["out_nelems"][k]) == (-1, -1, -1, 0)
    assert cols["coll_name_id"][k] is None and cols["pg_ranks_id"][k] == "[0, 1]"
    e = 5  # edges
    assert cols["ph"][e] == 1 and (cols["pid"][e], cols["tid"][e]) == (2**63 - 1, -(2**63))
    assert cols["dur_us"][e] == math.inf and cols["ts_us"][e] == 1.2345678901234568e22
    assert cols["external_id"][e] == -1 and cols["in_nelems"][e] == -(2**63) and cols["coll_seq"][e] == -1
    assert cols["correlation"][e] == int(9.223372036854774e18) and cols["out_nelems"][e] == 100
    assert cols["stream"][e] == 2**31 - 1 and cols["device"][e] == -1
    assert cols["ts_us"][6] == math.pi and math.copysign(1, cols["dur_us"][6]) == -1
    assert cols["ts_us"][7] == 5e-324 and cols["dur_us"][7] == float("2.2250738585072011e-308")
    assert cols["ts_us"][8] == 0.1 and cols["dur_us"][8] == 9007199254740992.0
    assert cols["ts_us"][9] == 44667375401.9253276 and cols["dur_us"][9] == 84088621752.6361412
    assert (cols["pid"][10], cols["tid"][10]) == (-1, -1) and np.isnan(cols["dur_us"][10])
    assert cols["name_id"][11] is None and cols["ph"][11] == 1
    assert threads == {(1, 2): "thread 2 (loop) | thread 2 (python)", (-1, 3): "spans"}
    rpc = cols["name_id"].index("record_param_comms")
    assert (cols["input_numel"][rpc], cols["input_bytes"][rpc]) == (6 + 4 + 30, -1)
    # c10::BFloat16 is 2 bytes, long int 8, the Scalar is skipped: 16 * 2 + 1 * 8
    assert (cols["input_numel"][rpc + 1], cols["input_bytes"][rpc + 1]) == (17, 40)
    assert (cols["input_numel"][rpc + 2], cols["input_bytes"][rpc + 2]) == (-1, -1)
    assert (cols["input_numel"][rpc + 3], cols["input_bytes"][rpc + 3]) == (-1, -1)
    assert cols["name_id"][-2] == "x" * 9000 and cols["external_id"][-1] == 1


def test_nasty_json_input_bytes_when_every_dtype_is_known(tmp_path):
    ev = {"ph": "X", "name": "c10d::allgather_", "pid": 1, "tid": 1, "ts": 1, "dur": 1,
          "args": {"Input Dims": [[[8, 2]], [], [1]], "Input type": ["c10::BFloat16", "Scalar", "long int"]}}
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [ev]}))
    for scanner in SCANNERS:
        cols = parse(tmp_path / "t.json", scanner)[0]
        assert (cols["input_numel"][0], cols["input_bytes"][0]) == (17, 16 * 2 + 8)


def test_random_edits_both_scanners_agree_or_both_reject(tmp_path):
    """Byte edits of a valid trace: the same result from both scanners (one json.loads
    accepts too) or a one-line ConfigError from both."""
    rng = random.Random(0)
    base = nasty_trace().replace(b"x" * 9000, b"x" * 50)
    alphabet = b'{}[],:"\\ \n0123456789-+.eEtrufalsn\xff\xc3\xa9'
    path = tmp_path / "t.json"
    accepted = 0
    for _ in range(200):
        text = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            k, op = rng.randrange(len(text)), rng.randrange(3)
            if op == 0:
                del text[k]
            elif op == 1:
                text.insert(k, rng.choice(alphabet))
            else:
                text[k] = rng.choice(alphabet)
        path.write_bytes(bytes(text))
        outcome = {}
        for scanner in SCANNERS:
            try:
                outcome[scanner] = parse(path, scanner)
            except ConfigError as exc:
                assert "\n" not in str(exc)
                outcome[scanner] = None
        if outcome["c"] is None or outcome["python"] is None:
            assert outcome["c"] is None and outcome["python"] is None, bytes(text)
            continue
        assert_same(outcome["c"], outcome["python"])
        assert_same(outcome["c"], reference(bytes(text)))
        accepted += 1
    assert 10 < accepted < 190


def test_events_with_false_separators_and_a_string_pid(tmp_path):
    """`}, {` inside a string or between nested objects never splits an event."""
    events = [{"ph": "X", "cat": "cpu_op", "name": f"op{i}", "pid": 1, "tid": 1, "ts": float(i), "dur": 0.5,
               "args": {"External id": i}} for i in range(300)]
    events[100]["name"] = 'tricky "}, {" name'
    events[200]["args"]["nested"] = [{"a": 1}, {"b": [2, {"c": 3}]}]
    events[250]["pid"] = "Spans"  # a string pid far from the end of the file
    p = tmp_path / "rank-0.json"
    p.write_text(json.dumps({"traceEvents": events, "deviceProperties": [{"id": 0}, {"id": 1}]}, indent=1))
    for scanner in SCANNERS:
        cols, meta, _ = parse(p, scanner, chunk_bytes=4096)
        assert cols["ts_us"].tolist() == [float(i) for i in range(300)]
        assert cols["external_id"].tolist() == list(range(300))
        assert cols["pid"][250] == -1 and cols["pid"][249] == 1
        assert cols["name_id"][100] == 'tricky "}, {" name'
        assert meta == {"deviceProperties": [{"id": 0}, {"id": 1}]}


@pytest.mark.parametrize("text", [
    '{"a": 1, "traceEvents": [], "distributedInfo": {"rank": 5}, "z": [{"k": "]"}]}',
    '{"traceEvents": [],"a": 1,"distributedInfo": {"rank": 5},"z": [{"k": "]"}]}',
    '{"a": 1, "distributedInfo": {"rank": 5}, "z": [{"k": "]"}] ,\n"traceEvents":[ ] }',
    '\r\n {"a": 1, "distributedInfo": {"rank": 5}, "traceEvents": [\n], "z": [{"k": "]"}]}',
])
def test_metadata_keeps_keys_before_and_after_trace_events(tmp_path, text):
    p = tmp_path / "t.json"
    p.write_text(text)
    for scanner in SCANNERS:
        cols, meta, threads = parse(p, scanner)
        assert len(cols["ph"]) == 0 and threads == {}
        assert meta == {"a": 1, "distributedInfo": {"rank": 5}, "z": [{"k": "]"}]}
    (tmp_path / "only.json").write_text('{"traceEvents": []}')
    assert parse(tmp_path / "only.json", "c")[1] == {}


def test_event_bounds_respect_strings_and_escapes():
    data = b'{"a": "}{\\\\"}, {"b": "\\"}"}, {"c": [1, {"d": 2}]}]' + b', "x": 1}'
    starts, ends, close = event_bounds(data)
    assert len(starts) == len(ends) == 3
    assert [json.loads(data[s:e + 1]) for s, e in zip(starts, ends)] == [
        {"a": "}{\\"}, {"b": '"}'}, {"c": [1, {"d": 2}]}]
    assert data[close:close + 1] == b"]"


# --------------------------------------------------------------------------- errors

EVENT = b'{"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 1, "dur": 1}'
MALFORMED = {
    # case: (events text, the offending text whose first byte is reported)
    "missing value": (EVENT + b', {"ph": "X", "name": }', b'}'),
    "trailing comma": (EVENT + b", ", b""),
    "missing comma": (EVENT + b" " + EVENT, b'{"ph"'),
    "bad escape": (b'{"name": "a\\x"}', b"\\x"),
    "control character": (b'{"name": "a\tb"}', b"\tb"),
    "invalid utf-8": (b'{"name": "a\xff"}', b"\xff"),
    "leading zero": (b'{"ts": 01}', b"1}"),
    "NaN": (b'{"ts": NaN}', None),
    "not an object": (b"1, 2", None),
    "unbalanced": (EVENT + b"}, " + EVENT, None),
    "bad literal": (b'{"x": tru}', None),
}


@pytest.mark.parametrize("scanner", SCANNERS)
@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_events_are_one_line_errors_with_the_offset(tmp_path, scanner, case):
    events, culprit = MALFORMED[case]
    head = b'{"traceEvents": ['
    text = head + events + b'], "x": 1}'
    (tmp_path / "t.json").write_bytes(text)
    with pytest.raises(ConfigError) as err:
        parse_trace_file(tmp_path / "t.json", SymbolTable(), scanner=scanner)
    msg = str(err.value)
    assert "\n" not in msg and " must be " in msg and str(tmp_path / "t.json") in msg
    assert "valid JSON" in msg and "malformed JSON" in msg
    if culprit is not None:  # the last occurrence in the events ("" -> the closing bracket)
        at = len(head) + (events.rindex(culprit) if culprit else len(events))
        assert f"at byte {at}:" in msg, msg


def _src() -> bytes:
    return (DATA / "hta-sampled-2rank" / "rank-0.json.gz").read_bytes()


ERRORS = {
    "truncated gzip": (lambda: _src()[: len(_src()) // 2], "json.gz", "a complete gzip file"),
    "corrupt gzip": (lambda: _src()[:100_000] + bytes(b ^ 0x5A for b in _src()[100_000:100_400])
                     + _src()[100_400:], "json.gz", None),
    "bad crc": (lambda: _src()[:-8] + b"\0\0\0\0" + _src()[-4:], "json.gz", "a valid gzip file"),
    "ends inside an event": (lambda: gzip.decompress(_src())[:500_000], "json",
                             "a file that ends inside traceEvents"),
    "ends after an event": (lambda: b'{"traceEvents": [' + EVENT, "json", "a file that ends inside traceEvents"),
    "not an object": (lambda: b'[{"traceEvents": []}]', "json", "does not start with a JSON object"),
    "not json": (lambda: b"not a trace\n", "json", "does not start with a JSON object"),
    "no traceEvents": (lambda: json.dumps({"schemaVersion": 1, "other": [1, 2]}).encode(), "json",
                       "no top-level traceEvents array"),
    "traceEvents not an array": (lambda: b'{"traceEvents": {"a": 1}}', "json", "no top-level traceEvents array"),
    "broken trailer": (lambda: b'{"traceEvents": [], "x": }', "json", "a broken top-level object"),
    "no comma before": (lambda: b'{"a": 1 "traceEvents": []}', "json", "a broken top-level object"),
    "no comma after": (lambda: b'{"traceEvents": [] "a": 1}', "json", "a broken top-level object"),
    "comma first": (lambda: b'{, "traceEvents": []}', "json", "a broken top-level object"),
    "comma last": (lambda: b'{"traceEvents": [], }', "json", "a broken top-level object"),
    "empty": (lambda: b"", "json", "no top-level traceEvents array"),
}


@pytest.mark.parametrize("scanner", SCANNERS)
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_bad_files_are_one_line_config_errors(tmp_path, scanner, case):
    make, suffix, expected = ERRORS[case]
    path = tmp_path / f"rank-0.{suffix}"
    path.write_bytes(make())
    for chunk in (4096, CHUNK_BYTES):
        with pytest.raises(ConfigError) as err:
            parse_trace_file(path, SymbolTable(), scanner=scanner, chunk_bytes=chunk)
        msg = str(err.value)
        assert "\n" not in msg and " must be " in msg and str(path) in msg
        if expected is not None:
            assert expected in msg


# --------------------------------------------------------------------------- the build

def test_c_scanner_is_built_and_used():
    """CI must test the extension, not only the fallback (pip install -e . builds it)."""
    from torsh_tune.analysis.traces import _scan

    assert _parser.SCANNER == "c", "the C scanner is not built: run `pip install -e .` with a C compiler"
    assert isinstance(_parser._new_scanner(None), _scan.Scanner)
    assert isinstance(_parser._new_scanner("python"), _reader.PyScanner)
    assert [c for c, _ in _scan.COLUMNS] == [c for c in EVENT_COLUMNS if c not in ("input_numel", "input_bytes")]
    assert _scan.COLUMNS == _reader.SCAN_COLUMNS
    with pytest.raises(ValueError):
        _parser._new_scanner("rust")


def test_parse_memory_is_bounded():
    """The parse adds about a chunk plus the columns to the peak RSS (its imports: test_import_contract)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from torsh_tune.analysis.traces._parser import parse_trace_file, SCANNER\n"
        "from torsh_tune.analysis.traces._symbols import SymbolTable\n"
        "def hwm():\n"
        "    status = open('/proc/self/status').read()\n"
        "    return int(status.split('VmHWM:')[1].split()[0]) / 1024\n"
        "before = hwm()\n"
        "cols, _, _ = parse_trace_file(Path(sys.argv[1]), SymbolTable())\n"
        "assert len(cols['ph']) == 67219\n"
        "print(SCANNER, hwm() - before)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(DATA / "hta-16rank-rank0" / "rank-0.json.gz")],
                         check=True, capture_output=True, text=True).stdout.split()
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc: RSS not measured")
    # 25.8 MB of JSON, 67k rows (~6 MB of columns): the whole text must never be in memory.
    assert out[0] == "c" and float(out[1]) < 25, out
