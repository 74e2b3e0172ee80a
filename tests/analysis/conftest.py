"""Shared helpers for analysis tests: the recorded fixture runs under tests/data/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
SCENARIOS = ("healthy", "data_bound", "comm_bound", "straggler", "torn_line", "crashed")


@pytest.fixture
def run_copy(tmp_path):
    """Copy a fixture run into tmp_path so a test can change it."""

    def copy(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(DATA / name, dst)
        return dst

    return copy


def read_jsonl(path: Path) -> list[dict]:
    """Complete JSON lines of a file (independent of the loader under test)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def rewrite_jsonl(path: Path, change) -> None:
    """Apply `change(row) -> row` to every line of a JSONL file."""
    rows = [change(r) for r in read_jsonl(path)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
