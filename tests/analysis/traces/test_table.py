"""The numpy Table the trace analyzers run on, and the pandas-free import of the trace package."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from torsh_tune.analysis.traces import Table, analyze_traces

from helpers import REPO

TRACES = REPO / "tests" / "data" / "traces"


def test_table_selects_sorts_and_converts() -> None:
    t = Table({"rank": [1, 0, 1], "name": ["b", "a", "c"], "dur_us": [3.0, np.nan, 1.0]})
    assert len(t) == 3 and t.columns == ["rank", "name", "dur_us"]
    assert t["name"].dtype == object and t["rank"].dtype == np.int64
    ones = t[t["rank"] == 1]
    assert ones["name"].tolist() == ["b", "c"]
    assert t.sort("dur_us")["name"].tolist() == ["c", "b", "a"]  # NaN last
    assert t.sort("rank")["name"].tolist() == ["a", "b", "c"]  # stable
    assert t.rows()[0] == {"rank": 1, "name": "b", "dur_us": 3.0}
    df = t.to_pandas()
    assert list(df.columns) == ["rank", "name", "dur_us"] and df["rank"].tolist() == [1, 0, 1]
    assert t.with_columns(x=np.zeros(3)).columns[-1] == "x"


def test_empty_and_concat_keep_declared_columns() -> None:
    empty = Table(names=["rank", "dur_us"])
    assert empty.empty and empty.columns == ["rank", "dur_us"]
    both = Table.concat([empty, Table({"rank": [2], "dur_us": [1.5]})], ["rank", "dur_us"])
    assert both.rows() == [{"rank": 2, "dur_us": 1.5}]
    assert Table.concat([empty], ["rank"]).columns == ["rank"]
    with pytest.raises(ValueError, match="unequal length"):
        Table({"a": [1, 2], "b": [1]})


def test_analysis_tables_and_dataframes_agree() -> None:
    a = analyze_traces(TRACES / "gloo-ddp-2rank")
    for name, table in a.tables.items():
        frame = getattr(a, name)
        assert isinstance(frame, pd.DataFrame)
        assert list(frame.columns) == table.columns, name
        assert len(frame) == len(table), name
    assert a.breakdown is a.breakdown  # built once
    assert a.tables["breakdown"]["idle_pct"].tolist() == pytest.approx(a.breakdown["idle_pct"].tolist())


def test_load_traces_passes_chunk_bytes_and_warns_about_the_python_scanner(monkeypatch) -> None:
    from torsh_tune.analysis.traces import _parser, load_traces

    src = TRACES / "hta-sampled-2rank"
    want = load_traces(src)
    small = load_traces(src, chunk_bytes=4096)
    for rank, rt in want.ranks.items():
        got = small.ranks[rank].table
        for col in rt.table.columns:
            a, b = rt.table[col], got[col]
            # Ids differ only if interning order did; it must not, chunking changes nothing.
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), col
    assert want.warnings == ()
    monkeypatch.setattr(_parser, "SCANNER", "python")
    slow = load_traces(src)
    assert any("C event scanner is not built" in w for w in slow.warnings)
