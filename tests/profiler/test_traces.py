"""Deep-trace windows on real 2-rank gloo runs of an unmodified DDP script."""

from __future__ import annotations

import json
import re

import pytest

from torsh_tune.analysis.traces import load_traces
from torsh_tune.config import RunConfig
from torsh_tune.errors import ConfigError
from torsh_tune.profiler.traces import ANOMALY_SYNC_EVERY_STEPS, window_name
from torsh_tune.rundir import RunDir

from helpers import SCRIPTS, read_jsonl, torchrun_bootstrap

SCRIPT = SCRIPTS / "train_small.py"


def _windows(run: RunDir) -> list[dict]:
    return read_jsonl(run.traces / "windows.jsonl")


def _profiler_steps(ts, rank: int) -> list[int]:
    names = ts.names(rank)
    return sorted(int(n.split("#")[1]) for n in set(names) if n.startswith("ProfilerStep#"))


def test_explicit_and_periodic_windows_trace_exactly_their_steps_on_every_rank(tmp_path):
    run = RunDir(tmp_path / "run")
    # 12 steps (0-11): the explicit window traces 4-5, trace_every=7 traces 7-8; 14 is past the end. Each
    # warms the profiler up in the step before it (3, 6), which the trace does not hold.
    config = {"budget": {"steps": 10, "warmup_steps": 2},
              "profiler": {"trace_window": "4:2", "trace_every": 7, "trace_len": 2}}
    proc = torchrun_bootstrap(run.path, SCRIPT, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "USDT" not in proc.stderr + proc.stdout

    assert sorted(p.name for p in run.traces.iterdir() if p.is_dir()) == ["step00004-00005", "step00007-00008"]
    for name, steps in (("step00004-00005", [4, 5]), ("step00007-00008", [7, 8])):
        window_dir = run.traces / name
        assert sorted(p.name for p in window_dir.iterdir()) == ["rank-0.json.gz", "rank-1.json.gz"]
        ts = load_traces(window_dir)
        assert sorted(ts.ranks) == [0, 1]
        for rank in (0, 1):
            assert ts.ranks[rank].rank_source == "distributedInfo"
            assert _profiler_steps(ts, rank) == steps
            names = set(ts.names(rank))
            # One DDP all-reduce per traced step, on the main thread and on gloo's worker thread.
            assert "gloo:all_reduce" in names and "c10d::allreduce_" in names
            assert int((ts.names(rank) == "c10d::allreduce_").sum()) == len(steps)

    lines = _windows(run)
    assert sorted((w["window"], w["rank"], w["reason"]) for w in lines) == [
        ("step00004-00005", 0, "explicit"), ("step00004-00005", 1, "explicit"),
        ("step00007-00008", 0, "every"), ("step00007-00008", 1, "every"),
    ]
    for w in lines:
        assert w["error"] is None and not w["truncated"] and w["num_steps"] == 2
        assert w["trace_bytes"] > 0 and (run.path / w["path"]).is_file()
        assert w["export_s"] > 0 and w["traced_step_s"] > 0
        assert w["capture_cost_s"] is not None and w["num_reference_steps"] >= 1
        assert w["warmup_step"] == w["start_step"] - 1
        # The ranks leave the warm start and the stop/export together (each rank's own pause would otherwise
        # land in another rank's next collective: a step-time spike the script never had).
        assert w["start_align_s"] >= 0 and w["end_align_s"] >= 0
    # The reference steps outside windows: 2 only (3 and 6 warm the profiler up, 4-5 are traced), 9-11 after.
    assert {w["window"]: w["num_reference_steps"] for w in lines} == {"step00004-00005": 1, "step00007-00008": 1}

    # The always-on tier still records every step, traced or not, and says which the profiler slowed.
    for rank in (0, 1):
        steps = read_jsonl(run.rank_file(rank, "steps"))
        assert [s["step"] for s in steps] == list(range(12))
        assert {s["step"]: s["trace"] for s in steps if "trace" in s} == {
            3: "warmup", 4: "recorded", 5: "recorded", 6: "warmup", 7: "recorded", 8: "recorded"}
        meta = json.loads(run.rank_file(rank, "meta").read_text())
        assert meta["trace_windows"] == ["step00004-00005", "step00007-00008"]


def test_a_window_at_step_1_starts_cold_after_the_scripts_setup(tmp_path):
    run = RunDir(tmp_path / "run")
    config = {"budget": {"steps": 4, "warmup_steps": 0}, "profiler": {"trace_window": "1:2"}}
    proc = torchrun_bootstrap(run.path, SCRIPT, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ts = load_traces(run.traces / "step00001-00002")
    assert all(_profiler_steps(ts, rank) == [1, 2] for rank in (0, 1))
    # No warm-up in step 0: before the script has run the profiler cannot know whether it will use CUDA.
    assert {(w["warmup_step"], w["num_steps"]) for w in _windows(run)} == {(None, 2)}


def test_anomaly_windows_open_at_the_same_agreed_step_on_every_rank(tmp_path):
    run = RunDir(tmp_path / "run")
    # A factor just above 1 makes about half the steps "anomalies", so every agreement fires.
    config = {"budget": {"steps": 45, "warmup_steps": 0},
              "profiler": {"trace_on_anomaly": True, "trace_anomaly_factor": 1.01, "trace_len": 2,
                           "trace_max_windows": 2}}
    proc = torchrun_bootstrap(run.path, SCRIPT, config=config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "USDT" not in proc.stderr + proc.stdout
    lines = _windows(run)
    by_rank = {r: sorted(w["window"] for w in lines if w["rank"] == r) for r in (0, 1)}
    assert by_rank[0] == by_rank[1] and len(by_rank[0]) == 2  # trace_max_windows
    for w in lines:
        assert w["reason"] == "anomaly" and w["num_steps"] == 2
        assert w["warmup_step"] is None  # decided at its own first boundary: started cold
        assert w["start_align_s"] is None and w["end_align_s"] >= 0
        # Decided at a sync boundary, opened one step later on every rank.
        assert w["start_step"] % ANOMALY_SYNC_EVERY_STEPS == 1
        assert w["trigger"]["ratios"] and all(v > 1.01 for v in w["trigger"]["ratios"].values())
    for name in by_rank[0]:
        assert sorted(load_traces(run.traces / name).ranks) == [0, 1]
    # The agreements and alignments on the profiler's side group are not the script's collectives.
    for rank in (0, 1):
        comm = read_jsonl(run.rank_file(rank, "comm"))
        assert comm and {(c["issuer"], c["collective"]) for c in comm} == {("ddp", "all_reduce")}
        assert not any("torsh_tune" in (c.get("origin") or "") for c in comm)


def test_no_trace_option_means_no_traces_dir(tmp_path):
    run = RunDir(tmp_path / "run")
    proc = torchrun_bootstrap(run.path, SCRIPT, config={"budget": {"steps": 3, "warmup_steps": 0}})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not run.traces.exists()
    assert "trace_windows" not in json.loads(run.rank_file(0, "meta").read_text())


def test_window_name():
    assert window_name(20, 24) == "step00020-00024"


@pytest.mark.parametrize(
    ("profiler", "message"),
    [
        ({"trace_window": "20"}, "profiler.trace_window must be START:LEN"),
        ({"trace_window": "a:5"}, "profiler.trace_window must be START:LEN"),
        ({"trace_window": "-1:5"}, "profiler.trace_window must be START:LEN"),
        ({"trace_window": "20:0"}, "profiler.trace_window must be START:LEN"),
        ({"trace_window": 20}, "profiler.trace_window must be a string"),
        ({"trace_len": 0}, "profiler.trace_len must be an integer >= 1, but got 0"),
        ({"trace_every": 3, "trace_len": 3}, "profiler.trace_every must be an integer > profiler.trace_len (3), but got 3"),
        ({"trace_anomaly_factor": 1.0}, "profiler.trace_anomaly_factor must be a number > 1, but got 1.0"),
        ({"trace_max_windows": 0}, "profiler.trace_max_windows must be an integer >= 1, but got 0"),
        ({"trace_shapes": "yes"}, "profiler.trace_shapes must be true or false"),
    ],
)
def test_invalid_trace_options_are_one_line_config_errors(profiler, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        RunConfig.from_dict({"profiler": profiler})


def test_trace_window_after_the_step_budget_is_rejected():
    message = "profiler.trace_window must be a window starting by step 11 (the budget's last step), but got '12:2'"
    with pytest.raises(ConfigError, match="^" + re.escape(message) + "$"):
        RunConfig.from_dict({"profiler": {"trace_window": "12:2"}, "budget": {"steps": 10, "warmup_steps": 2}})
    RunConfig.from_dict({"profiler": {"trace_window": "11:2"}, "budget": {"steps": 10, "warmup_steps": 2}})


def test_valid_trace_options_round_trip():
    cfg = RunConfig.from_dict({"profiler": {"trace_window": "20:5", "trace_every": 50, "trace_on_anomaly": True}})
    assert cfg.profiler.trace_window_steps == (20, 5) and cfg.profiler.traces_enabled
    assert RunConfig.from_json(cfg.to_json()) == cfg
    assert not RunConfig().profiler.traces_enabled


def test_a_step_slow_for_its_evaluation_or_checkpoint_is_no_anomaly_nor_a_reference_step(tmp_path):
    from torsh_tune.profiler.traces import TraceWindows

    config = RunConfig.from_dict({"profiler": {"trace_on_anomaly": True, "trace_anomaly_factor": 2.0}}).profiler
    windows = TraceWindows(config=config, run_dir=RunDir(tmp_path / "run"), rank=0, world_size=1)
    t = 0.0
    for done in range(1, 9):  # steps 0-7 of 0.1 s: the reference
        t += 0.1
        windows.on_step_end(done, t)
    t += 1.0
    windows.on_step_end(9, t, unusual=True)  # step 8 held an evaluation pass: 10x, by design
    assert windows._open is None and max(windows._history) == pytest.approx(0.1)
    t += 1.0
    windows.on_step_end(10, t)  # step 9: as slow, for nothing the records explain: a window opens at once (1 rank)
    opened = windows._open
    windows.close()
    assert opened is not None and opened.reason == "anomaly" and opened.start == 10
    assert (opened.trigger["local"]["step"], opened.trigger["local"]["ratio"]) == (9, pytest.approx(10.0))
