"""RunStore: incremental reads agree with analysis.load_run; statuses; compare data."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from torsh_tune.analysis import load_run, measured, step_stats
from torsh_tune.dashboard import RunStore, get_compare_info, get_kpis, plot_compare_breakdown

from .conftest import add_run


def test_frames_match_load_run_and_grow_incrementally(runs_dir):
    run = add_run(runs_dir, "straggler")
    store = RunStore(runs_dir)
    ours, ref = store.frames("straggler"), load_run(run)
    for kind in ("steps", "comm", "system"):
        pd.testing.assert_frame_equal(ours.frame(kind).reset_index(drop=True), ref.frame(kind), check_dtype=False)
    assert ours.world_size == ref.world_size and ours.ranks == ref.ranks

    path = run / "ranks" / "rank00001.steps.jsonl"
    last = json.loads(path.read_text().splitlines()[-1])
    line = json.dumps(dict(last, step=last["step"] + 1)) + "\n"
    with open(path, "a") as f:
        f.write(line[:20])  # a torn line: not read yet
    assert len(store.frames("straggler").steps) == len(ref.steps)
    with open(path, "a") as f:
        f.write(line[20:] + "not json\n")
    grown = store.frames("straggler")
    assert len(grown.steps) == len(ref.steps) + 1
    assert any("malformed" in w for w in grown.warnings)
    path.write_text(path.read_text().splitlines()[0] + "\n")  # truncated/replaced: read again from the start
    assert len(store.frames("straggler").steps[lambda d: d["rank"] == 1]) == 1


def test_a_second_hosts_clock_is_put_on_rank_0s_hosts_as_load_run_does(runs_dir):
    run = add_run(runs_dir, "straggler")
    for rank in range(4):  # ranks 2-3 on a second host whose clock runs 30 ms ahead
        path = run / "ranks" / f"rank{rank:05d}.meta.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "hostname": "a" if rank < 2 else "b"}))
        if rank < 2:
            continue
        for kind, fields in (("steps", ("t_start", "t_end")), ("comm", ("t_issue", "t_complete"))):
            path = run / "ranks" / f"rank{rank:05d}.{kind}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            path.write_text("".join(json.dumps({**r, **{f: r[f] + 0.030 for f in fields if f in r}}) + "\n"
                                    for r in rows))
    ours, ref = RunStore(runs_dir).frames("straggler"), load_run(run)
    (clock,) = ours.host_clocks
    assert clock["applied"] and clock["offset_s"] == pytest.approx(0.030, abs=0.001) and ours.host_clocks == ref.host_clocks
    for kind in ("steps", "comm"):
        pd.testing.assert_frame_equal(ours.frame(kind).reset_index(drop=True), ref.frame(kind), check_dtype=False)
    assert any(w.startswith("hosts' clocks: b is 30.") for w in ours.warnings)


def test_statuses_and_rows(runs_dir):
    add_run(runs_dir, "healthy")
    add_run(runs_dir, "data_bound", "live", status="running")
    add_run(runs_dir, "crashed", status="error")
    (runs_dir / "not-a-run").mkdir()
    rows = {r.run_id: r for r in RunStore(runs_dir).list_runs()}
    assert set(rows) == {"healthy", "live", "crashed"}
    assert (rows["healthy"].status, rows["live"].status, rows["crashed"].status) == ("finished", "running", "failed")
    assert rows["live"].top_bottleneck == "critical io" and rows["live"].median_step_s > 0
    assert rows["healthy"].strategy == "ddp" and rows["healthy"].world_size == 2


def test_kpis_and_compare(runs_dir):
    add_run(runs_dir, "healthy")
    add_run(runs_dir, "data_bound")
    store = RunStore(runs_dir)
    k = get_kpis(store.frames("healthy"))
    assert k.num_steps == 12 and k.median_step_s > 0 and k.num_ranks_reporting == 2
    # Steps a trace window slowed: the live numbers leave them out as the report does.
    frames = store.frames("healthy")
    traced = frames.steps["step"].isin([6, 7])
    steps = frames.steps.assign(trace=traced.map({True: "recorded", False: None}),
                                step_s=frames.steps["step_s"].where(~traced, frames.steps["step_s"] * 10))
    live = get_kpis(dataclasses.replace(frames, steps=steps))
    report = step_stats(measured(steps, frames.comm)[0])
    assert live.median_step_s == pytest.approx(report.median_step_s)
    assert live.throughput_samples_s == pytest.approx(report.throughput_samples_s)
    assert live.median_step_s < 2 * k.median_step_s
    info = get_compare_info(store.analysis("healthy"), store.analysis("data_bound"))
    median = info.rows[0]
    assert median["metric"] == "median step time" and median["delta_pct"] > 0  # data_bound is slower
    assert info.bottlenecks[1][0] == "critical io"
    assert len(plot_compare_breakdown(info).data) == len(info.phases)
