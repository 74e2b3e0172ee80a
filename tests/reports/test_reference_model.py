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
