"""write_reports and the layering rule: reports never import torch or plotly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from torsh_tune.reports import write_reports

from .conftest import make_analysis


def test_write_reports_writes_json_and_markdown_into_the_run_dir(tmp_path):
    paths = write_reports(make_analysis(run_dir=str(tmp_path)), tmp_path)
    assert paths == {"json": tmp_path / "report" / "report.json", "md": tmp_path / "report" / "report.md"}
    assert json.loads(paths["json"].read_text())["run"]["name"] == "demo-run"
    assert "Raise DDP bucket_cap_mb to 100" in paths["md"].read_text()
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".")]  # no temp files left


def test_reports_do_not_import_torch_or_plotly(tmp_path):
    code = textwrap.dedent(
        f"""
        import io, sys
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).resolve().parents[2])!r})
        from rich.console import Console
        from torsh_tune.reports import build_report_info, render_summary, write_reports
        from tests.reports.conftest import make_analysis
        analysis = make_analysis(run_dir={str(tmp_path)!r})
        write_reports(analysis, {str(tmp_path)!r})
        render_summary(build_report_info(analysis), Console(file=io.StringIO()))
        bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "plotly", "dash"))
        print(bad)
        sys.exit(1 if bad else 0)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
