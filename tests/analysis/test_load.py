from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from torsh_tune.analysis import analyze_run, compact_run, load_run
from torsh_tune.records import columns_of

from helpers import assert_record_schema

from .conftest import DATA, SCENARIOS, read_jsonl


@pytest.mark.parametrize("name", SCENARIOS)
def test_fixture_lines_follow_the_record_schema(name):
    # Every complete line has the required fields of its record type (in order) and no field the
    # type does not know, so fixtures track records.py; optional fields (clocks, issuers) may be absent.
    for path in sorted((DATA / name / "ranks").glob("*.jsonl")):
        kind = path.name.split(".")[1]
        for row in read_jsonl(path):
            assert_record_schema(row, kind)
    assert sum(p.stat().st_size for p in (DATA / name).rglob("*") if p.is_file()) < 50_000


def test_load_run_reads_every_rank_into_schema_frames():
    frames = load_run(DATA / "healthy")
    for kind in ("steps", "comm", "system"):
        assert list(frames.frame(kind).columns) == columns_of(kind)
    assert len(frames.steps) == 2 * 12
    assert len(frames.comm) == 2 * 12 * 3
    assert sorted(frames.steps["rank"].unique()) == [0, 1]
    assert set(frames.meta) == {0, 1} and set(frames.exits) == {0, 1}
    assert frames.info["name"] == "healthy"
    assert frames.config["budget"]["warmup_steps"] == 2
    assert frames.world_size == 2
    assert frames.warnings == ()


def test_torn_last_line_is_skipped_with_a_warning():
    frames = load_run(DATA / "torn_line")
    assert len(frames.steps[frames.steps["rank"] == 1]) == 11
    assert len(frames.steps[frames.steps["rank"] == 0]) == 12
    assert len(frames.comm[frames.comm["rank"] == 0]) == 35
    assert any("rank00001.steps.jsonl: torn last line" in w for w in frames.warnings)
    assert any("rank00000.comm.jsonl: torn last line" in w for w in frames.warnings)


def test_malformed_middle_line_is_reported_as_such(run_copy):
    run = run_copy("healthy")
    path = run / "ranks" / "rank00000.steps.jsonl"
    lines = path.read_text().splitlines()
    lines[3] = lines[3][:20]
    path.write_text("\n".join(lines) + "\n")
    frames = load_run(run)
    assert len(frames.steps[frames.steps["rank"] == 0]) == 11
    assert any("malformed line 4" in w for w in frames.warnings)


def test_missing_rank_is_a_warning_and_a_partial_analysis(run_copy):
    run = run_copy("healthy")
    for p in (run / "ranks").glob("rank00001.*"):
        p.unlink()
    frames = load_run(run)
    assert frames.world_size == 2  # from meta.json / config.json, not from the files seen
    assert any("ranks [1] wrote no files" in w for w in frames.warnings)
    analysis = analyze_run(run)
    assert analysis.partial
    assert analysis.steps is not None and analysis.steps.samples_per_step == 32


def test_nonexistent_or_empty_run_never_crashes(tmp_path):
    missing = analyze_run(tmp_path / "nope")
    assert missing.steps is None and missing.bottlenecks == () and missing.recommendations == ()
    assert any("does not exist" in w for w in missing.warnings)
    empty = tmp_path / "empty"
    (empty / "ranks").mkdir(parents=True)
    (empty / "run.json").write_text(json.dumps({"outcome": "error"}))
    a = analyze_run(empty)
    assert a.status == "error" and a.partial and a.steps is None and a.breakdown is None


def test_compact_run_writes_parquet_that_readers_prefer(run_copy):
    run = run_copy("torn_line")
    from_jsonl = load_run(run)
    written = compact_run(run)
    assert set(written) == {"steps", "comm", "system"}
    assert all(p.is_file() and p.parent == run for p in written.values())
    for p in (run / "ranks").glob("*.jsonl"):
        p.unlink()  # only the Parquet files can answer now
    from_parquet = load_run(run)
    for kind in ("steps", "comm", "system"):
        pd.testing.assert_frame_equal(from_parquet.frame(kind), from_jsonl.frame(kind), check_dtype=False)
    assert analyze_run(run).steps == analyze_run(DATA / "torn_line").steps


def test_stale_parquet_is_ignored(run_copy):
    run = run_copy("healthy")
    compact_run(run)
    steps_file = run / "ranks" / "rank00000.steps.jsonl"
    with steps_file.open("a") as f:  # the run went on after compaction
        row = read_jsonl(steps_file)[-1]
        f.write(json.dumps({**row, "step": 12, "t_start": row["t_end"], "t_end": row["t_end"] + 0.1}) + "\n")
    later = os.stat(run / "steps.parquet").st_mtime + 5
    os.utime(steps_file, (later, later))
    frames = load_run(run)
    assert len(frames.steps) == 25
    assert any("steps.parquet is older" in w for w in frames.warnings)
