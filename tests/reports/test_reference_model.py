"""The figures' reference bench model: an unreadable one is recorded as analysis records it."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from torsh_tune.analysis import analyze_run
from torsh_tune.fabric import MODEL_FILE
from torsh_tune.reports import figures as F

DATA = Path(__file__).resolve().parents[1] / "data"


def test_an_unreadable_bench_model_gives_the_warning_analysis_gives(tmp_path, caplog):
    bench = tmp_path / "bench-run"
    bench.mkdir()
    (bench / MODEL_FILE).write_text('{"world_size": 2, "fits": [')  # torn
    run = tmp_path / "run"
    shutil.copytree(DATA / "recorded" / "comm_bound", run)
    info = json.loads((run / "run.json").read_text())
    info["reference_bench"] = str(bench)
    (run / "run.json").write_text(json.dumps(info))

    from_analysis = [w for w in analyze_run(run).warnings if w.startswith("reference bench model unreadable")]
    assert len(from_analysis) == 1 and "JSONDecodeError" in from_analysis[0]
    warnings: list[str] = []
    assert F.reference_model(info, warnings=warnings) is None
    assert warnings == from_analysis
    with caplog.at_level(logging.WARNING, logger=F.__name__):  # no list: logged, not dropped
        assert F.reference_model(info) is None
    assert [r.getMessage() for r in caplog.records] == from_analysis
    # A run without a model file keeps quiet, as analysis does.
    (bench / MODEL_FILE).unlink()
    assert F.reference_model(info, warnings=warnings) is None and warnings == from_analysis


def test_the_dashboard_overview_shows_an_unreadable_bench_model_as_a_warning(tmp_path):
    from torsh_tune.dashboard import RunStore
    from torsh_tune.dashboard._views import overview_info

    bench = tmp_path / "bench-run"
    bench.mkdir()
    (bench / MODEL_FILE).write_text('{"world_size": 2, "fits": [')  # torn
    runs = tmp_path / "runs"
    shutil.copytree(DATA / "recorded" / "comm_bound", runs / "r")
    info = json.loads((runs / "r" / "run.json").read_text())
    info["reference_bench"] = str(bench)
    (runs / "r" / "run.json").write_text(json.dumps(info))
    store = RunStore(runs)
    (run_id,) = [r.run_id for r in store.list_runs()]
    view = overview_info(store, run_id)
    assert [w for w in view.warnings if w.startswith("reference bench model unreadable")]
