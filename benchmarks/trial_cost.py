"""Per-trial fixed cost: one tuner trial's launch vs a bare torchrun launch of the same script.

Issue 4's target: bootstrap + launch + teardown of a trial within 0.5 s of a bare torchrun
launch of the same script. Four arms, interleaved in rounds (the order rotates and reverses
from round to round, so every arm takes every position equally often), each running the same
5 DDP steps of `examples/ddp_mlp.py` on 2 ranks:

- torchrun: `python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_mlp.py --steps 5`
- torchrun_flags: the same with the flags torsh-tune adds to torchrun (`--max-restarts 0
            --shutdown-timeout 10 --log-dir DIR --tee 3`), no torsh-tune in the ranks: the
            ablation that tells torchrun's log handling from torsh-tune's own cost.
- trial:    `autotune.runner.run_measured` in this process, with the tuner's per-run config
            (profiler on, 2 warm-up + 3 measured steps: the step budget stops the script at
            step 5 as it stops a trial), then the objective read back (`measure_run`).
            The tuner process is already running; torchrun's agent starts as a new process
            (`--no-warm-agent`).
- trial_warm: the same with a study's warm agent server (`launch.warm.WarmAgents`, started
            once in the untimed round): torchrun's agent is forked from a process that has
            torch imported. What every tuner trial does by default.
- cli:      `torsh-tune profile --quiet --nproc-per-node 2 --warmup-steps 2 --steps 3 ...`
            as a command (adds the CLI's start and the report).

Every rank of every arm imports a tiny `sitecustomize` (put on PYTHONPATH by this script) that
notes when the rank's interpreter started and when it reached `atexit`, so all arms are
split at the same points: launch -> rank start, inside the ranks, ranks' exit -> done. The
trial and cli arms are split further with torsh-tune's own records (run.json, meta, step and
exit records), and the trial arm's supervisor after torchrun's exit with timing wrappers.

    .venv/bin/python benchmarks/trial_cost.py --rounds 12

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "ddp_mlp.py"
ARMS = ("torchrun", "torchrun_flags", "trial", "trial_warm", "cli")
_WARM: list[Any] = []  # the trial_warm arm's one WarmAgents, as a study holds one for all its runs
WARMUP_STEPS, MEASURED_STEPS = 2, 3

# Written next to the runs and put first on PYTHONPATH: only ranks (RANK is set) take notes.
_SITECUSTOMIZE = '''
import os, time
if "RANK" in os.environ and "TRIAL_COST_PROBE_DIR" in os.environ:
    import atexit, json
    _t_start = time.time()
    _path = os.path.join(os.environ["TRIAL_COST_PROBE_DIR"], "rank%s.json" % os.environ["RANK"])
    def _note_exit():
        with open(_path, "w") as f:
            json.dump({"t_start": _t_start, "t_atexit": time.time()}, f)
    atexit.register(_note_exit)
'''


@contextlib.contextmanager
def _supervisor_probes() -> Iterator[dict[str, float]]:
    """Time the supervisor's steps after torchrun exits (trial arm: it runs in this process).

    Wraps, for the duration of one run, the names `launch.supervisor` calls: `_finish`
    (entered once torchrun has exited), `kill_run_processes` (the scan for leftovers),
    `LogDemux.join`, `classify_run` and `finish_run_info`. Unix seconds / durations.
    """
    from torsh_tune.launch import supervisor as sup

    notes: dict[str, float] = {}
    saved = {name: getattr(sup, name) for name in ("kill_run_processes", "classify_run", "finish_run_info")}
    saved_finish, saved_join = sup._Supervisor._finish, sup.LogDemux.join

    def timed(name: str, fn):
        def wrapper(*a, **k):
            t = time.time()
            try:
                return fn(*a, **k)
            finally:
                notes[f"{name}_s"] = notes.get(f"{name}_s", 0.0) + time.time() - t
        return wrapper

    def finish(self, *a, **k):
        notes["t_finish_entered"] = time.time()
        return saved_finish(self, *a, **k)

    for name, fn in saved.items():
        setattr(sup, name, timed(name, fn))
    sup._Supervisor._finish = finish
    sup.LogDemux.join = timed("log_join", saved_join)
    try:
        yield notes
    finally:
        for name, fn in saved.items():
            setattr(sup, name, fn)
        sup._Supervisor._finish, sup.LogDemux.join = saved_finish, saved_join


def _script_args(steps: int, hidden: int) -> list[str]:
    return ["--steps", str(steps), "--hidden", str(hidden), "--log-every", "100000"]


def _probes(probe_dir: Path, nproc: int) -> tuple[float, float]:
    """(earliest rank start, latest rank atexit), unix seconds."""
    notes = [json.loads((probe_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    return min(n["t_start"] for n in notes), max(n["t_atexit"] for n in notes)


def _records(run_dir: Path) -> dict[str, float]:
    """Timestamps of a torsh-tune run from its own records (unix seconds)."""
    run = json.loads((run_dir / "run.json").read_text())
    ranks = run_dir / "ranks"
    metas = [json.loads(p.read_text()) for p in sorted(ranks.glob("rank*.meta.json"))]
    exits = [json.loads(p.read_text()) for p in sorted(ranks.glob("rank*.exit.json"))]
    steps = [json.loads(line) for p in sorted(ranks.glob("rank*.steps.jsonl")) for line in p.read_text().splitlines()
             if line.strip()]
    return {
        "started": run["started_at_unix"],
        "runtime": min(m["t_start"] for m in metas),
        "first_step": min(s["t_start"] for s in steps),
        "last_step": max(s["t_end"] for s in steps),
        "exit_record": max(e["t_exit"] for e in exits),
        "finished": run["finished_at_unix"],
        "steps_recorded": len(steps),
    }


def run_arm(arm: str, args: argparse.Namespace, work: Path, i: int) -> dict[str, Any]:
    probe_dir = work / f"probe-{arm}-{i}"
    probe_dir.mkdir()
    env = dict(os.environ, TRIAL_COST_PROBE_DIR=str(probe_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(work / "site"), os.environ.get("PYTHONPATH")])))
    script_args = _script_args(WARMUP_STEPS + MEASURED_STEPS, args.hidden)
    run_dir = None
    t0 = time.time()
    if arm == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
               str(SCRIPT), *script_args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        ok, why = proc.returncode == 0, proc.stderr[-2000:]
    elif arm == "torchrun_flags":
        # build_torchrun_command's flags (kill_grace_s = 10 s by default).
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "--max-restarts", "0", "--shutdown-timeout", "10", "--log-dir", str(work / f"tl-{i}"), "--tee", "3",
               str(SCRIPT), *script_args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        ok, why = proc.returncode == 0, proc.stderr[-2000:]
    elif arm == "cli":
        cmd = [sys.executable, "-m", "torsh_tune.cli", "profile", "--quiet", "--nproc-per-node", str(args.nproc),
               "--warmup-steps", str(WARMUP_STEPS), "--steps", str(MEASURED_STEPS), "--runs-dir", str(work / "runs"),
               "--run-name", f"cli-{i}", str(SCRIPT), *script_args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        ok, why = proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-1000:]
        run_dir = work / "runs" / f"cli-{i}"
    else:
        from torsh_tune.autotune import fresh_run_dir, run_measured
        from torsh_tune.config import LaunchConfig, RunConfig
        from torsh_tune.launch.warm import WarmAgents

        if arm == "trial_warm" and not _WARM:
            _WARM.append(WarmAgents())
        agents = _WARM[0] if arm == "trial_warm" else None

        # The tuner's per-run config (study._budgeted): the step budget ends the script.
        config = RunConfig(launch=LaunchConfig(nproc_per_node=args.nproc)).apply_patch(
            {"budget": {"steps": MEASURED_STEPS, "warmup_steps": WARMUP_STEPS}, "profiler": {"enabled": True}})
        saved = dict(os.environ)
        os.environ.update(env)  # launch_run hands this process's environment to torchrun
        try:
            with _supervisor_probes() as sup_notes:
                run = run_measured(config, fresh_run_dir(work / "runs", f"{arm}-{i}"), SCRIPT, script_args,
                                   agents=agents)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        ok, why = run.state == "COMPLETE", f"{run.failure_reason}\n" + "\n".join(run.stderr_tail)
        run_dir = Path(run.run_dir)
    t_end = time.time()
    if not ok:
        raise SystemExit(f"{arm} run {i} failed:\n{why}")
    rank_start, rank_atexit = _probes(probe_dir, args.nproc)
    row: dict[str, Any] = {
        "arm": arm,
        "wall_s": t_end - t0,
        "to_rank_start_s": rank_start - t0,
        "in_ranks_s": rank_atexit - rank_start,
        "after_ranks_s": t_end - rank_atexit,
    }
    if run_dir is not None:
        rec = _records(run_dir)
        row.update({
            "prelaunch_s": rec["started"] - t0,
            "launch_to_rank_start_s": rank_start - rec["started"],
            "rank_start_to_runtime_s": rec["runtime"] - rank_start,
            "runtime_to_first_step_s": rec["first_step"] - rec["runtime"],
            "steps_s": rec["last_step"] - rec["first_step"],
            "last_step_to_exit_record_s": rec["exit_record"] - rec["last_step"],
            "exit_record_to_atexit_s": rank_atexit - rec["exit_record"],
            "atexit_to_finished_s": rec["finished"] - rank_atexit,
            "finished_to_done_s": t_end - rec["finished"],
            "steps_recorded": rec["steps_recorded"],
        })
    if arm in ("trial", "trial_warm"):
        if agents is not None and json.loads((run_dir / "run.json").read_text()).get("agent_start") != "forked":
            raise SystemExit(f"{arm} run {i}: the agent was not forked ({agents.failed})")
        row.update({
            "atexit_to_torchrun_exit_seen_s": sup_notes["t_finish_entered"] - rank_atexit,
            "leftover_scan_s": sup_notes["kill_run_processes_s"],
            "log_join_s": sup_notes["log_join_s"],
            "classify_and_run_json_s": sup_notes["classify_run_s"] + sup_notes["finish_run_info_s"],
        })
    return row


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0], xs[0], xs[0]]
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "min": xs[0], "max": xs[-1]}


_PHASES = (
    ("prelaunch_s", "call -> torchrun started (config, run.json; cli: CLI start)"),
    ("launch_to_rank_start_s", "torchrun started -> first rank interpreter"),
    ("rank_start_to_runtime_s", "rank interpreter -> torsh-tune runtime up (imports)"),
    ("runtime_to_first_step_s", "runtime up -> first step starts (script setup)"),
    ("steps_s", "first step start -> last step end (5 steps)"),
    ("last_step_to_exit_record_s", "last step -> exit record (barrier, destroy group)"),
    ("exit_record_to_atexit_s", "exit record -> rank atexit"),
    ("atexit_to_finished_s", "rank atexit -> run finished (exit, torchrun, reap)"),
    ("finished_to_done_s", "run finished -> done (trial: measure_run; cli: report)"),
)

# The trial arm's "rank atexit -> run finished", split by the supervisor probes.
_SUPERVISOR = (
    ("atexit_to_torchrun_exit_seen_s", "trial_warm: rank atexit -> torchrun exit seen (finalize, torchrun)"),
    ("leftover_scan_s", "trial_warm: scan for leftover processes (kill_run_processes)"),
    ("log_join_s", "trial_warm: log demultiplexer join"),
    ("classify_and_run_json_s", "trial_warm: classify_run + finish_run_info (run.json)"),
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="rounds of one run per arm")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024, help="ddp_mlp.py --hidden (its default)")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(_SITECUSTOMIZE)
        # One untimed round: page cache, .pyc files, the first torsh_tune import of this process.
        for arm in ARMS:
            run_arm(arm, args, work, -1)
        for i in range(args.rounds):
            k = (i // 2) % len(ARMS)
            order = ARMS[k:] + ARMS[:k]
            order = order[::-1] if i % 2 else order
            res = {arm: run_arm(arm, args, work, i) for arm in order}
            for arm in order:
                rows.append({"round": i, "position": order.index(arm), **res[arm]})
            print(f"round {i}: " + "   ".join(f"{arm} {res[arm]['wall_s']:5.2f} s" for arm in order)
                  + f"   trial-torchrun {res['trial']['wall_s'] - res['torchrun']['wall_s']:+.2f} s", flush=True)

    if _WARM:
        _WARM[0].close()
    by_arm = {arm: [r for r in rows if r["arm"] == arm] for arm in ARMS}
    by_round = {(r["round"], r["arm"]): r for r in rows}
    rounds = range(args.rounds)
    deltas = {arm: [by_round[(i, arm)]["wall_s"] - by_round[(i, "torchrun")]["wall_s"] for i in rounds]
              for arm in ARMS[1:]}
    wall = {arm: _stats([r["wall_s"] for r in by_arm[arm]]) for arm in ARMS}
    delta = {arm: _stats(d) for arm, d in deltas.items()}
    common = {k: {arm: _stats([r[k] for r in by_arm[arm]])["median"] for arm in ARMS}
              for k in ("to_rank_start_s", "in_ranks_s", "after_ranks_s")}
    torsh_arms = ("trial", "trial_warm", "cli")
    phases = {k: {arm: _stats([r[k] for r in by_arm[arm]])["median"] for arm in torsh_arms} for k, _ in _PHASES}
    supervisor = {k: _stats([r[k] for r in by_arm["trial_warm"]])["median"] for k, _ in _SUPERVISOR}

    print()
    print(f"{'arm':<16}{'wall, median':>14}{'IQR':>18}{'vs torchrun, median of ' + str(args.rounds) + ' rounds':>34}"
          f"{'IQR':>20}{'range':>20}")
    for arm in ARMS:
        w = wall[arm]
        line = f"{arm:<16}{w['median']:12.2f} s{w['q1']:9.2f} .. {w['q3']:.2f}"
        if arm in delta:
            d = delta[arm]
            line += f"{d['median']:+32.2f} s{d['q1']:+11.2f} .. {d['q3']:+.2f}{d['min']:+11.2f} .. {d['max']:+.2f}"
        print(line)
    print()
    print(f"{'where the time goes (medians, s)':<58}" + "".join(f"{arm:>16}" for arm in ARMS))
    for k, label in (("to_rank_start_s", "launch call -> first rank interpreter"),
                     ("in_ranks_s", "first rank interpreter -> last rank atexit"),
                     ("after_ranks_s", "last rank atexit -> done")):
        print(f"{label:<58}" + "".join(f"{common[k][arm]:16.2f}" for arm in ARMS))
    print()
    for k, label in _PHASES:
        print(f"  {label:<56}{'':>32}" + "".join(f"{phases[k][arm]:16.2f}" for arm in torsh_arms))
    print()
    for k, label in _SUPERVISOR:
        print(f"  {label:<56}{'':>32}{supervisor[k]:16.3f}")

    summary = {
        "benchmark": "trial_cost",
        "script": "examples/ddp_mlp.py",
        "script_args": _script_args(WARMUP_STEPS + MEASURED_STEPS, args.hidden),
        "nproc": args.nproc,
        "rounds": args.rounds,
        "wall_s": wall,
        "delta_vs_torchrun_s": delta,
        "target_s": 0.5,
        "trial_meets_target": delta["trial_warm"]["median"] <= 0.5,
        "phases_common_median_s": common,
        "phases_torsh_median_s": phases,
        "supervisor_after_exit_median_s": supervisor,
        "machine": (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
