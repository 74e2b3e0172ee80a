"""Layout of a run directory. The launcher creates it; ranks write into it; analysis reads it.

    RUN/
      run.json                      RunInfo: command, config, versions, hardware, status
      config.json                   the RunConfig handed to the ranks (TORSH_TUNE_CONFIG)
      ranks/rank00000.steps.jsonl   StepRecord lines (append-only, flushed >= 1/s)
      ranks/rank00000.comm.jsonl    CommRecord lines
      ranks/rank00000.system.jsonl  SystemRecord lines
      ranks/rank00000.meta.json     facts a rank learned (DDP buckets, backend, devices)
      ranks/rank00000.exit.json     how the script ended on that rank (ok, budget, error)
      logs/rank00000.log            the rank's stdout+stderr
      logs/launcher.log             torchrun's own output
      steps.parquet comm.parquet system.parquet   compacted at the end of the run
      report/report.json report/report.md
      traces/<window>/rank-<r>.json.gz              deep-trace windows

A study directory (`StudyDir`) holds the tuner's files and one run directory per run:

    STUDY/
      study.db                      the Optuna storage (SQLite) unless --storage names another
      result.json                   TuneResult, written when the study ends
      best.toml                     the confirmed best config (the user's own when nothing won)
      trials.csv trials.parquet     one row per trial
      summary.json summary.md       the main job's summary
      report.json report.md report.html
      profile/                      the main job's baseline profile (a run directory)
      baseline/NN/ trials/NNNN/ confirm/NNNN-i-A|B/ ablation/NNNN-name-i-A|B/   run directories
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from .errors import invalid

__all__ = ["ENV_CONFIG", "ENV_RUN_DIR", "STACKS_SIGNAL", "RunDir", "StudyDir", "is_study_dir", "new_run_dir",
           "world_size_of", "write_json_atomic", "write_text_atomic"]

ENV_RUN_DIR = "TORSH_TUNE_RUN_DIR"
ENV_CONFIG = "TORSH_TUNE_CONFIG"
#: The signal that asks a rank to write every Python thread's stack to ranks/rankNNNNN.stacks.txt (faulthandler),
#: sent by the supervisor before it stops a hung or timed-out run, to the ranks whose meta.json says they answer it.
STACKS_SIGNAL = signal.SIGUSR2

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class RunDir:
    """Paths inside one run directory (creating nothing but what is asked for)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_json(self) -> Path:
        return self.path / "run.json"

    @property
    def config_json(self) -> Path:
        return self.path / "config.json"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def traces(self) -> Path:
        return self.path / "traces"

    def rank_file(self, rank: int, kind: str) -> Path:
        """`kind` is steps, comm, system (jsonl), meta, exit (json) or stacks (text: Python's stacks at a
        fatal signal, `runtime.bootstrap`)."""
        ext = "json" if kind in ("meta", "exit") else "txt" if kind == "stacks" else "jsonl"
        return self.ranks / f"rank{rank:05d}.{kind}.{ext}"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank:05d}.log"

    def parquet(self, kind: str) -> Path:
        return self.path / f"{kind}.parquet"

    def rank_ids(self) -> list[int]:
        """Ranks that wrote anything, sorted."""
        found = set()
        if self.ranks.is_dir():
            for p in self.ranks.iterdir():
                m = re.match(r"rank(\d+)\.", p.name)
                if m:
                    found.add(int(m.group(1)))
        return sorted(found)


def world_size_of(ranks: Iterable[int], meta: Mapping[int, Mapping[str, Any]], info: Mapping[str, Any],
                  config: Mapping[str, Any]) -> int:
    """How many ranks a run has: the largest number any of its documents states, or the ranks seen.

    Args:
        ranks: Ranks that wrote anything.
        meta: Rank -> its meta.json (`world_size`).
        info: run.json (`world_size`, and the launch config under `config`).
        config: config.json (`launch.nproc_per_node` x `launch.nnodes`).
    """
    ranks = list(ranks)
    candidates = [max(ranks) + 1 if ranks else 0]
    candidates += [int(m["world_size"]) for m in meta.values() if isinstance(m.get("world_size"), int)]
    for doc in (info.get("config"), config):
        launch = doc.get("launch") if isinstance(doc, dict) else None
        if isinstance(launch, dict):
            nproc, nnodes = launch.get("nproc_per_node"), launch.get("nnodes", 1)
            if isinstance(nproc, int) and isinstance(nnodes, int):
                candidates.append(nproc * nnodes)
    if isinstance(info.get("world_size"), int):
        candidates.append(info["world_size"])
    return max(candidates)


class StudyDir:
    """Paths inside one study directory (the module docstring shows the layout); creates nothing."""

    #: The sub-directories that hold one run directory per run, by the phase that made them.
    RUN_KINDS = ("baseline", "trials", "confirm", "ablation")
    #: The files `tune()` writes when the study ends (TuneResult.files).
    RESULT_FILES = ("best.toml", "trials.csv", "trials.parquet", "result.json")
    #: Every file a study report lists (those that exist).
    REPORTED_FILES = ("best.toml", "result.json", "trials.csv", "trials.parquet", "summary.json", "summary.md")
    #: The files a study's TuningInfo is read from: a change to any of them changes it.
    INFO_FILES = ("result.json", "study.db", "summary.json", "trials.parquet", "trials.csv")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"StudyDir({str(self.path)!r})"

    @property
    def study_db(self) -> Path:
        return self.path / "study.db"

    @property
    def result_json(self) -> Path:
        return self.path / "result.json"

    @property
    def best_toml(self) -> Path:
        return self.path / "best.toml"

    @property
    def trials_csv(self) -> Path:
        return self.path / "trials.csv"

    @property
    def summary_json(self) -> Path:
        return self.path / "summary.json"

    @property
    def profile(self) -> Path:
        """The main job's baseline profile run."""
        return self.path / "profile"

    def runs(self, kind: str) -> Path:
        """The directory of the `kind` runs (one of RUN_KINDS)."""
        assert kind in self.RUN_KINDS, kind
        return self.path / kind

    def file(self, name: str) -> Path:
        """One of the files the constants above name."""
        assert name in (*self.REPORTED_FILES, *self.INFO_FILES), name
        return self.path / name

    def sqlite_url(self) -> str:
        """The default Optuna storage: SQLite in `study.db`."""
        return f"sqlite:///{self.study_db.resolve()}"

    def is_study(self) -> bool:
        """Whether this is a study directory: results, an Optuna storage, a trial table or the
        directories of the study's first runs (the main job's profile, the baseline, trials),
        and no run.json (a run directory is never a study)."""
        if self.result_json.is_file():
            return True
        if RunDir(self.path).run_json.is_file():
            return False
        return any(p.is_file() for p in (self.study_db, self.trials_csv)) or any(
            p.is_dir() for p in (self.profile, self.runs("baseline"), self.runs("trials")))


def is_study_dir(path: str | os.PathLike[str]) -> bool:
    """`StudyDir(path).is_study()`."""
    return StudyDir(path).is_study()


def new_run_dir(runs_dir: str | os.PathLike[str], script: str, *, name: str | None = None) -> RunDir:
    """Create a fresh run directory; an existing one is never reused or overwritten."""
    root = Path(runs_dir)
    if name is not None and not _NAME_RE.match(name):
        raise invalid("--run-name", "letters, digits, '.', '_' or '-' (max 128)", name)
    root.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(script).stem)[:40] or "run"
    for _ in range(100):
        candidate = name or f"{time.strftime('%Y%m%d-%H%M%S')}-{stem}-{secrets.token_hex(2)}"
        path = root / candidate
        try:
            path.mkdir()
        except FileExistsError:
            if name is not None:
                raise invalid("--run-name", "the name of a run directory that does not exist yet", name) from None
            continue
        for sub in ("ranks", "logs", "report"):
            (path / sub).mkdir()
        return RunDir(path)
    raise AssertionError("could not find a free run directory name")


def write_text_atomic(path: Path, text: str) -> Path:
    """Write `text` through a temporary file in the same directory: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """`write_text_atomic` of `data` as indented JSON (unknown types as strings)."""
    return write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")
