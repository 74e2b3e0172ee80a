from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest

from torsh_tune.analysis import RunAnalysis, analyze_run

from .conftest import DATA, SCENARIOS


@pytest.mark.parametrize("name", SCENARIOS)
def test_analysis_is_json_serialisable(name):
    a = analyze_run(DATA / name)
    assert isinstance(a, RunAnalysis) and a.name == name
    text = json.dumps(dataclasses.asdict(a))
    assert json.loads(text)["world_size"] == a.world_size


def test_complete_run_is_not_partial():
    a = analyze_run(DATA / "healthy")
    assert a.status == "ok" and not a.partial and a.warnings == ()
    assert a.steps.num_steps == 10 and a.world_size == 2


def test_crashed_run_is_partial_and_explains_why():
    a = analyze_run(DATA / "crashed")
    assert a.status == "script_error" and a.partial
    text = " ".join(a.warnings)
    assert "rank 0 left no exit.json" in text and "rank 1 ended with status 'error'" in text
    assert "torn last line" in text and "warm-up" in text
    assert a.steps is not None and a.steps.num_steps == 3


def test_run_without_run_json_is_judged_by_rank_exits(run_copy):
    run = run_copy("healthy")
    (run / "run.json").unlink()
    a = analyze_run(run)
    assert a.status == "unknown" and not a.partial and a.info == {}
    (run / "ranks" / "rank00001.exit.json").write_text(json.dumps({"rank": 1, "status": "config_error"}))
    assert analyze_run(run).partial


def test_mangled_runs_never_crash_the_analysis(tmp_path):
    # What killed ranks and disk trouble leave behind: deleted, truncated and corrupted files.
    rng = random.Random(7)
    for i in range(24):
        name = SCENARIOS[i % len(SCENARIOS)]
        run = tmp_path / f"{name}-{i}"
        shutil.copytree(DATA / name, run)
        for f in sorted((run / "ranks").iterdir()):
            roll = rng.random()
            if roll < 0.15:
                f.unlink()
            elif roll < 0.35:
                text = f.read_text()
                f.write_text(text[: rng.randint(0, len(text))])
            elif roll < 0.55 and f.suffix == ".jsonl":
                rows = [json.loads(line) for line in f.read_text().splitlines() if line.endswith("}")]
                for row in rows:
                    row[rng.choice(list(row))] = rng.choice([None, "x", -1, 1e30, [], True])
                f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        if i % 5 == 0:
            (run / "config.json").write_text('{"thresholds": {"io_high_pct": "x"}}')
        if i % 7 == 0:
            (run / "run.json").write_text("[")
        a = analyze_run(run)
        json.dumps(dataclasses.asdict(a))
        assert not [w for w in a.warnings if " failed: " in w], a.warnings


def test_the_ranks_notes_are_the_reports_warnings(run_copy):
    # What a rank noted while it ran (meta.json's notes: a setting without effect, steps kept on the host clock)
    # says how to read its numbers: one line per note, with the ranks that made it.
    run = run_copy("healthy")
    notes = {0: ["ddp.bucket_cap_mb: the script's 25 replaced by the run's 1.0", "system sampler: psutil failed"],
             1: ["ddp.bucket_cap_mb: the script's 25 replaced by the run's 1.0"]}
    for rank, mine in notes.items():
        path = run / "ranks" / f"rank{rank:05d}.meta.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "notes": mine}))
    a = analyze_run(run)
    assert a.warnings == ("ranks 0-1: ddp.bucket_cap_mb: the script's 25 replaced by the run's 1.0",
                          "rank 0: system sampler: psutil failed")
    assert not a.partial
