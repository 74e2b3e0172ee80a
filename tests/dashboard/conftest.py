"""Runs directories made of the recorded fixtures, and a real dashboard server."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Iterator

import pytest

from torsh_tune.dashboard import make_server

DATA = Path(__file__).resolve().parents[1] / "data"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"


def add_run(runs_dir: Path, fixture: str, name: str | None = None, *, status: str | None = None,
            script: str | None = None) -> Path:
    """Copy tests/data/<fixture> into runs_dir as <name>; optionally set run.json's status."""
    dst = runs_dir / (name or fixture)
    shutil.copytree(DATA / fixture, dst)
    info_path = dst / "run.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    if status is not None:
        info["status"] = status
        info["outcome"] = None if status == "running" else {"status": status}
    info.setdefault("script", f"/home/user/project/examples/{script or fixture}.py")
    info.setdefault("config", {"strategy": {"kind": "ddp"}})
    info_path.write_text(json.dumps(info))
    if status == "running":  # a live run has not written its exit documents yet
        for p in (dst / "ranks").glob("*.exit.json"):
            p.unlink()
    return dst


def add_study(runs_dir: Path, fixture: str = "study_small", name: str | None = None) -> Path:
    """Copy a recorded study (tests/data/<fixture>, a real `tune()`) into runs_dir as a study directory.

    `new_run_dir` gives a study directory the same empty ranks/, logs/ and report/ as a run,
    so the copy has them too: the store must still tell it is a study.
    """
    dst = runs_dir / (name or fixture)
    shutil.copytree(DATA / fixture, dst)
    for sub in ("ranks", "logs", "report"):
        (dst / sub).mkdir(exist_ok=True)
    return dst


def add_planted_run(runs_dir: Path, name: str = "planted") -> Path:
    """The planted-alerts run (tests/analysis/planted_alerts.py) written into runs_dir."""
    from analysis.planted_alerts import write_planted_run

    return write_planted_run(runs_dir / name)


def snapshot(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under path with its size and mtime (to prove the app wrote nothing)."""
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    d.mkdir()
    return d


class Served:
    def __init__(self, server) -> None:
        self.server = server
        self.url = f"http://127.0.0.1:{server.server_port}"
        self.app = server.dash_app


@pytest.fixture
def serve_runs() -> Iterator:
    """serve_runs(runs_dir, token=None) -> Served: a real threaded HTTP server, stopped after the test."""
    servers = []
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request drowns failures

    def start(runs_dir: Path, *, token: str | None = None, refresh_s: float = 0.5) -> Served:
        server = make_server(runs_dir, host="127.0.0.1", port=0, token=token, refresh_s=refresh_s)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        servers.append((server, thread))
        return Served(server)

    yield start
    for server, thread in servers:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
