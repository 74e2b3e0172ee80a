"""Two tuner processes on one study (a journal file), as on a shared file system.

The second tuner joins after the first has measured the baseline; each asks its own trials,
neither mistakes the other's running trial for a stale one, and the study ends with every
trial finished exactly once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

SCRIPT = Path(__file__).parent / "scripts" / "train_tune.py"
SPACE = "[space.ddp.bucket_cap_mb]\nchoices = [25.0, 5.0, 10.0]\n[space.dataloader.num_workers]\nvalue = 0\n"


def _cmd(root: Path, journal: Path, name: str, trials: int) -> list[str]:
    return [sys.executable, "-m", "torsh_tune.cli", "tune", "--nproc-per-node", "2", "--steps", "4",
            "--warmup-steps", "1", "--trials", str(trials), "--baseline-repeats", "1", "--confirm-top", "0",
            "--sampler", "random", "--storage", f"journal:{journal}", "--space", str(root / "space.toml"),
            "--no-compression", "--quiet", "--runs-dir", str(root), "--run-name", name, str(SCRIPT)]


def _study(journal: Path) -> optuna.Study | None:
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(journal)))
    try:
        return optuna.load_study(study_name="torsh-tune", storage=storage)
    except KeyError:
        return None


@pytest.mark.slow
def test_two_tuners_share_one_study_on_a_journal_file(tmp_path):
    (tmp_path / "space.toml").write_text(SPACE)
    journal = tmp_path / "journal.log"
    first = subprocess.Popen(_cmd(tmp_path, journal, "tuner-a", 5), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            study = _study(journal) if journal.exists() else None
            if study is not None and study.user_attrs.get("baseline") and study.trials:
                break
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.3)
        else:
            raise AssertionError("the first tuner measured no baseline in 120 s")
        second = subprocess.run(_cmd(tmp_path, journal, "tuner-b", 5), capture_output=True, text=True, timeout=300)
        out_first = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, out_first[-3000:]
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    trials = _study(journal).trials
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") >= 5 and "RUNNING" not in states, states
    assert not any(str(t.user_attrs.get("failure_reason", "")).startswith("stale") for t in trials)
    tuners = {t.user_attrs["tuner"]["pid"] for t in trials}
    assert len(tuners) == 2  # both asked trials
    # the second tuner reused the first one's baseline: it measured none of its own
    assert not (tmp_path / "tuner-b" / "baseline").exists() or not any((tmp_path / "tuner-b" / "baseline").iterdir())
    run_dirs = [t.user_attrs["run_dir"] for t in trials]
    assert len(set(run_dirs)) == len(run_dirs)
