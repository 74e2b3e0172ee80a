"""Record the study fixtures `tests/data/study_small/` and `tests/data/study_pareto/` with the real tuner.

    .venv/bin/python tests/data/record_study.py            # both
    .venv/bin/python tests/data/record_study.py study_small

Each is a real `tune()` of `tests/autotune/scripts/train_tune.py` (2 ranks, gloo, CPU), kept
as the tuner wrote it except for what a report does not read: the run directories keep
`run.json`, `config.json` and `ranks/` (their `logs/`, `report/` and Parquet copies are
dropped), `study.db` is dropped (the reports read `result.json`), and the machine's study
directory in `result.json`, `trials.csv`/`.parquet` and every `run.json` becomes relative
(`trials/0001`, ...), which `reports.get_tuning_info` resolves against the study directory,
and the repository's own path (script, interpreter, tracebacks) becomes repository-relative.

- study_small: one objective. The user's config is slow on purpose (bucket_cap_mb = 75,
  which train_tune.py slows by 0.3 s a step), so the PyTorch defaults (25 MiB) are
  confirmed faster; trial 1 (150 MiB) is the planted failure.
- study_pareto: throughput + loss over gradient compression (none, fp16, topk): a Pareto front.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd

from torsh_tune.autotune import tune
from torsh_tune.config import RunConfig, StudyConfig

HERE = Path(__file__).resolve().parent
SCRIPT = HERE.parent / "autotune" / "scripts" / "train_tune.py"
BASE = {"launch": {"nproc_per_node": 2}, "profiler": {"loss_every": 1}, "budget": {"kill_grace_s": 2.0}}

STUDIES = {
    "study_small": dict(
        base_config=RunConfig.from_dict({**BASE, "strategy": {"ddp": {"bucket_cap_mb": 75.0}}}),
        space_spec={"ddp.bucket_cap_mb": {"choices": [25.0, 150.0, 5.0, 75.0]},
                    "compression.method": {"choices": ["none", "fp16"]}},
        initial_params=[{"ddp.bucket_cap_mb": 150.0, "compression.method": "none"},
                        {"ddp.bucket_cap_mb": 5.0, "compression.method": "fp16"}],
        study=StudyConfig(sampler="random", seed=0, steps=5, warmup_steps=2, n_trials=7, baseline_repeats=2,
                          confirm_top=1, confirm_pairs=2, loss_tolerance=0.05),
    ),
    "study_pareto": dict(
        base_config=RunConfig.from_dict(BASE),
        space_spec={"ddp.bucket_cap_mb": {"value": 25.0}, "compression.method": {"choices": ["none", "fp16", "topk"]},
                    "compression.ratio": {"value": 0.1}},
        initial_params=[{"compression.method": "fp16"}, {"compression.method": "topk"}],
        study=StudyConfig(sampler="random", seed=0, steps=5, warmup_steps=2, n_trials=3, baseline_repeats=1,
                          confirm_top=1, confirm_pairs=1, loss_tolerance=0.05, objectives=("throughput", "loss")),
    ),
}


def record(name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        study_dir = Path(tmp) / name
        tune(SCRIPT, [], study_dir=study_dir, cpu_count=2, **STUDIES[name])
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        prefix = str(study_dir.resolve()) + "/"
        repo = str(HERE.parents[1]) + "/"  # the script's and the venv's paths become repository-relative
        for f in ("result.json", "best.toml", "trials.csv"):
            text = (study_dir / f).read_text().replace(prefix, "").replace(str(study_dir.resolve()), ".")
            text = text.replace(repo, "")
            (out / f).write_text(text)
        frame = pd.read_parquet(study_dir / "trials.parquet")
        frame["run_dir"] = frame["run_dir"].str.replace(prefix, "", regex=False)
        frame.to_parquet(out / "trials.parquet", index=False)
        for run_json in sorted(study_dir.glob("*/*/run.json")):
            src = run_json.parent
            dst = out / src.relative_to(study_dir)
            (dst / "ranks").mkdir(parents=True)
            for p in sorted((src / "ranks").iterdir()):
                shutil.copy2(p, dst / "ranks" / p.name)
            for f in ("run.json", "config.json"):
                if (src / f).is_file():
                    text = (src / f).read_text().replace(prefix, "").replace(str(src), ".")
                    (dst / f).write_text(text.replace(repo, ""))
        result = json.loads((out / "result.json").read_text())
        print(name, [(t["number"], t["state"], t["samples_s"]) for t in result["trials"]],
              "best", result["best_trial"], result["best_speedup"])


if __name__ == "__main__":
    for name in sys.argv[1:] or list(STUDIES):
        record(name)
