"""write_reports and the layering rule: reports never import torch or plotly."""

from __future__ import annotations

import json

from torsh_tune.reports import write_reports

from .conftest import make_analysis


def test_write_reports_writes_json_and_markdown_into_the_run_dir(tmp_path):
    paths = write_reports(make_analysis(run_dir=str(tmp_path)), tmp_path)
    assert paths == {"json": tmp_path / "report" / "report.json", "md": tmp_path / "report" / "report.md"}
    assert json.loads(paths["json"].read_text())["run"]["name"] == "demo-run"
    assert "Raise DDP bucket_cap_mb to 100" in paths["md"].read_text()
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".")]  # no temp files left
