"""`torsh-tune` command line.

    torsh-tune [OPTIONS] SCRIPT [SCRIPT ARGS...]           the main job: baseline profile, study, confirmation, report
    torsh-tune profile [OPTIONS] SCRIPT [SCRIPT ARGS...]   run under the always-on profiler
    torsh-tune tune [OPTIONS] SCRIPT [SCRIPT ARGS...]      the Optuna study alone (best.toml, result.json)
    torsh-tune run --config STUDY [OPTIONS] SCRIPT ...     the full training with a study's best.toml, profiled
    torsh-tune report RUN [--format md|json|html]         re-analyse a run dir, rewrite its report
    torsh-tune report STUDY [--format md|json|html]       a study's report (report.md, report.html, report.json)
    torsh-tune import-config FILE [--from FMT] [--out F]  DeepSpeed/Horovod/FSDP1 settings -> strategy TOML
    torsh-tune advise --params N --world-size W ...       ranked strategies for a model size and cluster

Options before the script are torsh-tune's; everything after the script path is the
script's own (torchrun's convention). User mistakes print one line and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from . import __version__
from .config import (
    STUDY_DEFAULT_STEPS,
    STUDY_PRUNERS,
    STUDY_SAMPLERS,
    BudgetConfig,
    LaunchConfig,
    ProfilerConfig,
    RunConfig,
    StudyConfig,
    help_of,
)
from .errors import ConfigError, TorshTuneError, invalid
from .importers import load_config_file
from .rundir import StudyDir, is_study_dir

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
SUBCOMMANDS = ("profile", "run", "tune", "apply", "report", "analyze", "compare", "dashboard", "bench", "import-config", "advise")
RUN_END_FORMATS = ("json", "md", "html")


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{self.prog}: {message}")


def _number(kind: type, rule: str, ok: Any):
    """An argparse `type` that reports "must be <rule>, but got <value>"."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {rule}, but got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, but got {value!r}")
        return value

    return parse


_POSITIVE_INT = _number(int, "an integer >= 1", lambda v: v >= 1)
_NON_NEGATIVE_INT = _number(int, "an integer >= 0", lambda v: v >= 0)
_POSITIVE_FLOAT = _number(float, "a number > 0", lambda v: v > 0)
_PORT = _number(int, "a TCP port 1-65535", lambda v: 1 <= v <= 65535)


def _runs_dir(text: str) -> str:
    """An argparse `type` for --runs-dir: a directory, or a path where one can be made (no file on the way)."""
    path = Path(text)
    on_the_way = next((p for p in (path, *path.parents) if _exists(p)), None)
    if on_the_way is not None and not on_the_way.is_dir():
        raise argparse.ArgumentTypeError(f"must be a directory (or a path where one can be made), but got {text!r}"
                                         + (f" ({on_the_way} is a file)" if on_the_way != path else ""))
    return text


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # no permission to look: making the run directory later says what is wrong
        return False


_EMULATE_HELP = ("Run on an emulated multi-node cluster on this host (root, iproute2): SPEC is "
                 "nodes=N,procs_per_node=P,link=RATE[,latency=T][,burst=SIZE][,clock_skew=T][,clock_drift=PPM], e.g. "
                 "nodes=2,procs_per_node=2,link=1gbit. Nodes are network namespaces joined by veth links shaped with tc "
                 "tbf; clock_skew runs node i's clocks i x T ahead, clock_drift i x PPM fast (libfaketime); torn down on exit "
                 "(docs/emulate.md).")
#: Launch flags an emulated cluster sets itself.
_EMULATE_SETS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "launcher")


def _add_launch_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("launch (torchrun)")
    g.add_argument("--nproc-per-node", type=_POSITIVE_INT, help=help_of(LaunchConfig, "nproc_per_node"))
    g.add_argument("--nnodes", type=_POSITIVE_INT, help=help_of(LaunchConfig, "nnodes"))
    g.add_argument("--node-rank", type=_NON_NEGATIVE_INT, help=help_of(LaunchConfig, "node_rank"))
    g.add_argument("--rdzv-backend", help=help_of(LaunchConfig, "rdzv_backend"))
    g.add_argument("--rdzv-endpoint", help=help_of(LaunchConfig, "rdzv_endpoint"))
    g.add_argument("--rdzv-id", help=help_of(LaunchConfig, "rdzv_id"))
    g.add_argument("--backend", choices=("auto", "gloo", "nccl"), help=help_of(LaunchConfig, "backend"))
    g.add_argument("--launcher", metavar="TEMPLATE", help=help_of(LaunchConfig, "launcher"))
    g.add_argument("--max-restarts", type=_NON_NEGATIVE_INT, help=help_of(LaunchConfig, "max_restarts"))
    g.add_argument("--emulate", metavar="SPEC", help=_EMULATE_HELP)
    b = p.add_argument_group("budget")
    b.add_argument("--steps", type=_POSITIVE_INT, help=help_of(BudgetConfig, "steps"))
    b.add_argument("--warmup-steps", type=_NON_NEGATIVE_INT, help=help_of(BudgetConfig, "warmup_steps"))
    b.add_argument("--timeout", type=_POSITIVE_FLOAT, metavar="SECONDS", help=help_of(BudgetConfig, "timeout_s"))
    b.add_argument(
        "--no-progress-timeout", type=_POSITIVE_FLOAT, metavar="SECONDS",
        help=help_of(BudgetConfig, "no_progress_timeout_s"),
    )
    r = p.add_argument_group("profiler and output")
    r.add_argument("--loss-every", type=_POSITIVE_INT, help=help_of(ProfilerConfig, "loss_every"))
    r.add_argument("--comm-hook-timing", action="store_const", const=True,
                   help=help_of(ProfilerConfig, "comm_hook_timing"))
    t = p.add_argument_group("deep-trace windows (torch.profiler)")
    t.add_argument("--trace-window", metavar="START:LEN", help=help_of(ProfilerConfig, "trace_window"))
    t.add_argument("--trace-every", type=_POSITIVE_INT, metavar="N", help=help_of(ProfilerConfig, "trace_every"))
    t.add_argument("--trace-len", type=_POSITIVE_INT, metavar="N", help=help_of(ProfilerConfig, "trace_len"))
    t.add_argument("--trace-on-anomaly", action="store_const", const=True, help=help_of(ProfilerConfig, "trace_on_anomaly"))
    t.add_argument("--trace-anomaly-factor", type=_POSITIVE_FLOAT, metavar="K", help=help_of(ProfilerConfig, "trace_anomaly_factor"))
    t.add_argument("--trace-max-windows", type=_POSITIVE_INT, metavar="N", help=help_of(ProfilerConfig, "trace_max_windows"))
    t.add_argument("--trace-shapes", action="store_const", const=True, help=help_of(ProfilerConfig, "trace_shapes"))
    t.add_argument("--trace-stack", action="store_const", const=True, help=help_of(ProfilerConfig, "trace_stack"))
    t.add_argument("--trace-memory", action="store_const", const=True, help=help_of(ProfilerConfig, "trace_memory"))
    r.add_argument("--config", metavar="FILE", help="TOML or JSON RunConfig; flags override it.")
    r.add_argument("--runs-dir", type=_runs_dir, default="torsh-runs", help="Directory that receives a new run directory (default ./torsh-runs).")
    r.add_argument("--run-name", help="Name of the new run directory (default: time-script-random); never reused.")
    r.add_argument("--quiet", action="store_true", help="Do not echo the script's output to the terminal.")
    r.add_argument("--reference-bench", metavar="BENCH_RUN",
                   help="A `torsh-tune bench` run of this fabric: its measured busbw is what `network` findings compare against; "
                        "tune and the main job also enqueue the settings its alpha-beta model predicts fastest.")
    r.add_argument("--dashboard", nargs="?", const=8050, type=_PORT, metavar="PORT",
                   help="Serve the live dashboard on 127.0.0.1:PORT (default 8050) while the run goes.")
    r.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="Show tracebacks of errors.")
    p.add_argument("script", help="The training script (what you would pass to torchrun).")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="Arguments for the script.")


def _add_study_options(p: argparse.ArgumentParser) -> None:
    """The study's flags: help texts and defaults are `StudyConfig`'s fields'."""

    def helped(name: str, *, default: bool = True) -> str:
        value = getattr(StudyConfig, name, None)
        shown = f" (default {value})" if default and value is not None and not isinstance(value, bool) else ""
        return help_of(StudyConfig, name).replace("%", "%%") + shown

    g = p.add_argument_group("study")
    g.add_argument("--trials", type=_POSITIVE_INT, default=StudyConfig.n_trials, help=helped("n_trials"))
    g.add_argument("--sampler", choices=STUDY_SAMPLERS, default=StudyConfig.sampler, help=helped("sampler"))
    g.add_argument("--seed", type=_NON_NEGATIVE_INT, help=helped("seed"))
    g.add_argument("--storage", metavar="URL", help=helped("storage"))
    g.add_argument("--study-name", default=StudyConfig.study_name, help=helped("study_name"))
    g.add_argument("--resume", metavar="STUDY_DIR", help="Continue the study in this directory (completed trials are kept).")
    g.add_argument("--baseline-repeats", type=_POSITIVE_INT, default=StudyConfig.baseline_repeats,
                   help=helped("baseline_repeats"))
    g.add_argument("--confirm-top", type=_NON_NEGATIVE_INT, default=StudyConfig.confirm_top, help=helped("confirm_top"))
    g.add_argument("--confirm-pairs", type=_POSITIVE_INT, default=StudyConfig.confirm_pairs,
                   help=helped("confirm_pairs"))
    g.add_argument("--ablation-pairs", type=_NON_NEGATIVE_INT, metavar="N", help=helped("ablation_pairs"))
    g.add_argument("--trial-timeout", type=_POSITIVE_FLOAT, metavar="SECONDS", help=helped("trial_timeout_s"))
    g.add_argument("--study-timeout", type=_POSITIVE_FLOAT, metavar="SECONDS", help=helped("timeout_s"))
    g.add_argument("--loss-tolerance", type=_POSITIVE_FLOAT, default=StudyConfig.loss_tolerance,
                   help=helped("loss_tolerance"))
    g.add_argument("--space", metavar="FILE", help="TOML [space] table narrowing, widening or fixing dimensions.")
    g.add_argument("--no-compression", action="store_true", help="Do not search gradient compression.")
    g.add_argument("--api", action=argparse.BooleanOptionalAction, default=None,
                   help=helped("api_mode") + " (default: detected in the script's source)")
    g.add_argument("--allow-batch-changes", action="store_true", help=helped("allow_batch_changes"))
    g.add_argument("--objectives", default=",".join(StudyConfig.objectives),
                   help=helped("objectives", default=False) + " Comma-separated (default throughput).")
    g.add_argument("--pruner", choices=STUDY_PRUNERS, default=StudyConfig.pruner, help=helped("pruner"))
    g.add_argument("--pruner-percentile", type=_POSITIVE_FLOAT, metavar="PCT", help=helped("pruner_percentile"))
    g.add_argument("--pruner-warmup-steps", type=_NON_NEGATIVE_INT, metavar="N", help=helped("pruner_warmup_steps"))
    g.add_argument("--pruner-startup-trials", type=_NON_NEGATIVE_INT, metavar="N",
                   help=helped("pruner_startup_trials"))
    g.add_argument("--max-peak-mem-bytes", type=_POSITIVE_INT, metavar="BYTES", help=helped("max_peak_mem_bytes"))
    g.add_argument("--warm-agent", action=argparse.BooleanOptionalAction, default=StudyConfig.warm_agent,
                   help=helped("warm_agent"))
    g.add_argument("--main-job", action="store_true", help=argparse.SUPPRESS)


def _study_config(args: argparse.Namespace, config: RunConfig, *, api_mode: bool) -> StudyConfig:
    """The study's options from its flags (the run budget from the run config's); validated."""
    return StudyConfig(
        n_trials=args.trials, sampler=args.sampler, seed=args.seed, storage=args.storage, study_name=args.study_name,
        baseline_repeats=args.baseline_repeats, confirm_top=args.confirm_top, confirm_pairs=args.confirm_pairs,
        ablation_pairs=args.ablation_pairs, steps=config.budget.steps, warmup_steps=config.budget.warmup_steps,
        trial_timeout_s=args.trial_timeout, timeout_s=args.study_timeout, loss_tolerance=args.loss_tolerance,
        max_peak_mem_bytes=args.max_peak_mem_bytes, objectives=tuple(args.objectives.split(",")), pruner=args.pruner,
        pruner_percentile=args.pruner_percentile, pruner_warmup_steps=args.pruner_warmup_steps,
        pruner_startup_trials=args.pruner_startup_trials, include_compression=not args.no_compression,
        api_mode=api_mode, allow_batch_changes=args.allow_batch_changes, reference_bench=args.reference_bench,
        warm_agent=args.warm_agent,
    ).validate()


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="torsh-tune",
        description="Profile, diagnose and tune PyTorch distributed training.",
        epilog="Without a subcommand, `torsh-tune [OPTIONS] SCRIPT ...` runs the main job: a baseline profile, "
        "the Optuna study (the options of `tune`), the confirmation of its best candidates and a study report "
        "(STUDY/report.html, report.md, report.json, summary.md, summary.json). Exit status: 0 ok, 1 the run failed, 2 bad input, 130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"torsh-tune {__version__}")
    parser.add_argument("--debug", action="store_true", help="Show tracebacks of errors.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    prof = sub.add_parser("profile", help="Run a script under the always-on profiler and report its bottlenecks.")
    _add_launch_options(prof)
    run_ = sub.add_parser(
        "run", help="The full training with a study's tuned config (STUDY or STUDY/best.toml) under the always-on profiler.",
        description="Like `profile`, for the whole run: no step budget unless --steps is given (a budget in the "
        "config file is dropped). --config takes a study directory (its best.toml) or a config file.",
    )
    _add_launch_options(run_)
    tun = sub.add_parser("tune", help="Optuna study over DDP, compression, DataLoader and thread knobs; confirmed winners to best.toml.")
    _add_study_options(tun)
    _add_launch_options(tun)
    app_ = sub.add_parser("apply", help="Print the tuned config (best.toml) of a study.")
    app_.add_argument("study", help="A study directory written by `torsh-tune tune`.")
    rep = sub.add_parser("report", help="Re-analyse a run directory and rewrite its report, or write a study's report.")
    rep.add_argument("run", metavar="RUN|STUDY",
                     help="A run directory, or a study directory (holding result.json, or study.db while it runs).")
    rep.add_argument("--format", action="append", choices=("json", "md", "html", "csv", "parquet"), dest="formats",
                     help="Output format; repeat for several (default: json, md and html; csv and parquet: runs only).")
    rep.add_argument("--out", help="Write into this directory instead of RUN/report (a study: STUDY itself).")
    cmp_ = sub.add_parser("compare", help="Compare two runs (or a run and a baseline report.json) with noise-aware verdicts.")
    cmp_.add_argument("a", help="Baseline: a run directory or a report.json.")
    cmp_.add_argument("b", help="Candidate: a run directory or a report.json.")
    cmp_.add_argument("--fail-on-regression", type=_POSITIVE_FLOAT, metavar="PCT", default=5.0,
                      help="Exit 1 when the candidate's step time or throughput regresses by more than PCT %% beyond noise (default 5).")
    cmp_.add_argument("--format", choices=("md", "json"), default="md", help="Output format (default md).")
    ben = sub.add_parser("bench", help="Sweep collectives over message sizes (nccl-tests style) and fit an alpha-beta model.")
    ben.add_argument("--nproc-per-node", type=_POSITIVE_INT, help="Ranks (default 2).")
    ben.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto", help=help_of(LaunchConfig, "backend"))
    ben.add_argument("--min-bytes", type=_POSITIVE_INT, default=4 << 10, help="Smallest message (default 4 KiB).")
    ben.add_argument("--max-bytes", type=_POSITIVE_INT, default=256 << 20, help="Largest message (default 256 MiB).")
    ben.add_argument("--factor", type=_POSITIVE_INT, default=4, help="Size step factor (default 4).")
    ben.add_argument("--collectives", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all",
                     help="Comma-separated subset (default: all five).")
    ben.add_argument("--iters", type=_POSITIVE_INT, default=20, help="Timed iterations per size (default 20).")
    ben.add_argument("--warmup", type=_NON_NEGATIVE_INT, default=5, help="Untimed iterations per size (default 5).")
    ben.add_argument("--timeout", type=_POSITIVE_FLOAT, default=600.0, metavar="SECONDS", help="Wall-clock limit (default 600).")
    ben.add_argument("--runs-dir", type=_runs_dir, default="torsh-runs", help="Directory that receives the bench's run directory.")
    ben.add_argument("--run-name", help="Name of the new run directory; never reused.")
    ben.add_argument("--emulate", metavar="SPEC", help=_EMULATE_HELP)
    dash = sub.add_parser("dashboard", help="Serve the live Dash dashboard over a runs directory (read-only).")
    dash.add_argument("--runs-dir", type=_runs_dir, default="torsh-runs", help="Directory of run directories (default ./torsh-runs).")
    dash.add_argument("--host", default="127.0.0.1", help="Bind address (default 127.0.0.1; any other needs --token).")
    dash.add_argument("--port", type=_PORT, default=8050, help="Port, 1-65535 (default 8050).")
    dash.add_argument("--token", help="Access token required on every request (or env TORSH_TUNE_DASH_TOKEN).")
    ana = sub.add_parser("analyze", help="Analyse a directory of Kineto/Chrome traces (ours or any torch.profiler output).")
    ana.add_argument("path", help="A directory of rank traces (*.json or *.json.gz), or one window of RUN/traces/.")
    ana.add_argument("--out", help="Directory for analysis.json, analysis.md and analysis.html (default ./torsh-analysis/<name>-<time>); must not exist.")
    ana.add_argument("--hta-rounding", action="store_true", help="Round sub-microsecond times as HTA does (for parity checks).")
    imp = sub.add_parser("import-config", help="Turn DeepSpeed, Horovod or FSDP1 settings into a torsh-tune strategy TOML.")
    imp.add_argument("file", metavar="FILE", help="A ds_config.json, Horovod settings or FSDP1 keyword arguments (JSON or TOML).")
    imp.add_argument("--from", dest="fmt", choices=("auto", "deepspeed", "horovod", "fsdp1"), default="auto",
                     help="Format of FILE (default auto: detected from its keys).")
    imp.add_argument("--out", metavar="FILE",
                     help="Write the TOML here instead of stdout; an existing file is never overwritten.")
    adv = sub.add_parser("advise", help="Rank DDP/FSDP/HSDP/pipeline, compression and LR scaling for a model size and cluster.")
    adv.add_argument("--params", required=True, type=_number(float, "a number of parameters >= 1 (e.g. 1.3e9)", lambda v: v >= 1),
                     metavar="N", help="Trainable parameters, e.g. 1.3e9.")
    adv.add_argument("--world-size", required=True, type=_POSITIVE_INT, help="Ranks in all.")
    adv.add_argument("--nnodes", type=_POSITIVE_INT, default=1, help="Nodes (default 1); the world size must divide by it.")
    adv.add_argument("--device-memory-gb", type=_POSITIVE_FLOAT, metavar="GB",
                     help="Memory of one GPU (or host memory per rank on CPU) in GB; unknown when omitted.")
    adv.add_argument("--link-gbps", type=_POSITIVE_FLOAT, metavar="GBIT_S",
                     help="Inter-node link (inter-rank link on one node) in Gbit/s; drives compression and hierarchical all-reduce.")
    adv.add_argument("--intra-node-gbps", type=_POSITIVE_FLOAT, metavar="GBIT_S",
                     help="Link inside a node in Gbit/s (default: assumed faster than --link-gbps).")
    adv.add_argument("--param-bytes", type=_POSITIVE_INT, default=4, help="Bytes per parameter: 4 fp32 (default), 2 bf16/fp16.")
    adv.add_argument("--reference-world-size", type=_POSITIVE_INT, default=1,
                     help="World size the learning rate was tuned at (default 1); sets the LR scaling.")
    dev = adv.add_mutually_exclusive_group()
    dev.add_argument("--gpus", dest="gpus", action="store_true", default=True, help="Ranks are GPUs (default).")
    dev.add_argument("--cpu", dest="gpus", action="store_false", help="Ranks are CPU processes (gloo).")
    adv.add_argument("--json", action="store_true", help="Print the ranked candidates as JSON.")
    return parser


def _config_from_args(args: argparse.Namespace) -> RunConfig:
    config = load_config_file(args.config) if args.config else RunConfig()
    overrides: dict[str, Any] = {}
    mapping = {
        "nproc_per_node": "launch.nproc_per_node",
        "nnodes": "launch.nnodes",
        "node_rank": "launch.node_rank",
        "rdzv_backend": "launch.rdzv_backend",
        "rdzv_endpoint": "launch.rdzv_endpoint",
        "rdzv_id": "launch.rdzv_id",
        "backend": "launch.backend",
        "launcher": "launch.launcher",
        "max_restarts": "launch.max_restarts",
        "steps": "budget.steps",
        "warmup_steps": "budget.warmup_steps",
        "timeout": "budget.timeout_s",
        "no_progress_timeout": "budget.no_progress_timeout_s",
        "loss_every": "profiler.loss_every",
        "comm_hook_timing": "profiler.comm_hook_timing",
        "trace_window": "profiler.trace_window",
        "trace_every": "profiler.trace_every",
        "trace_len": "profiler.trace_len",
        "trace_on_anomaly": "profiler.trace_on_anomaly",
        "trace_anomaly_factor": "profiler.trace_anomaly_factor",
        "trace_max_windows": "profiler.trace_max_windows",
        "trace_shapes": "profiler.trace_shapes",
        "trace_stack": "profiler.trace_stack",
        "trace_memory": "profiler.trace_memory",
    }
    for attr, dotted in mapping.items():
        value = getattr(args, attr, None)
        if value is not None:
            overrides[dotted] = value
    config = config.with_overrides(overrides) if overrides else config
    cluster = getattr(args, "cluster", None)
    if cluster is not None:
        config = cluster.configure(config)
    return config.check_layout()


def check_script(script: str) -> Path:
    """The script must exist, be a Python file and compile."""
    path = Path(script)
    if not path.is_file():
        raise invalid("SCRIPT", "an existing Python file", script)
    if path.suffix != ".py":
        raise invalid("SCRIPT", "a Python file ending in .py", script)
    try:
        source = path.read_bytes()
        compile(source, str(path), "exec")
    except SyntaxError as exc:
        where = f"{path}:{exc.lineno}" if exc.lineno else str(path)
        raise ConfigError(f"SCRIPT must be valid Python, but got {type(exc).__name__} at {where}: {exc.msg}") from None
    except ValueError as exc:  # null bytes: not a text file
        raise invalid("SCRIPT", "a Python source file", f"{script} ({exc})") from None
    return path.resolve()


def _check_backend(config: RunConfig) -> None:
    if config.launch.backend != "nccl" or config.launch.nnodes > 1 or config.launch.launcher:
        return  # on other hosts the ranks themselves check
    from .launch.command import local_cuda_available

    if not local_cuda_available():
        raise invalid("--backend", "gloo or auto when CUDA is not available (nccl needs a GPU)", "nccl")


def cmd_profile(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return _profiled_run(args, argv, _config_from_args(args), verb="profiling")


def cmd_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """The full training with a tuned config: `profile` without a step budget unless --steps says so."""
    if args.config is not None:
        args.config = str(_config_of_study(args.config))
    config = _config_from_args(args)
    if args.steps is None and config.budget.steps is not None:
        config = config.with_overrides({"budget.steps": None})  # a study's per-trial budget is not the user's
    return _profiled_run(args, argv, config, verb="running")


def _config_of_study(path: str) -> Path:
    """`--config` of `run`: a study directory means its best.toml."""
    p = Path(path)
    if p.is_dir():
        best = StudyDir(p).best_toml
        if not best.is_file():
            raise invalid("--config", "a study directory holding best.toml, or a config file", path)
        return best
    return p


def _profiled_run(args: argparse.Namespace, argv: Sequence[str], config: RunConfig, *, verb: str) -> int:
    script = check_script(args.script)
    _check_backend(config)
    reference = _reference_from_bench(args.reference_bench) if args.reference_bench else None

    from rich.console import Console

    from .rundir import new_run_dir

    # Bound before the run directory exists: a busy port is one line and leaves nothing behind.
    server = _bind_dashboard(args.runs_dir, args.dashboard) if args.dashboard else None
    run_dir = new_run_dir(args.runs_dir, script.name, name=args.run_name)
    console = Console(stderr=False, highlight=False)
    console.print(f"[bold]torsh-tune[/] {verb} [cyan]{script.name}[/] on {config.world_size} rank(s) → {run_dir.path}")
    cluster = getattr(args, "cluster", None)
    if cluster is not None:
        console.print(f"emulated cluster: {cluster.spec.describe()}", markup=False)
        if reference is None:  # the link's configured rate is what `network` findings compare against
            reference = cluster.spec.link_bytes_per_s / 1e9
    if server is not None:
        _start_dashboard(server, run_dir, console)
    try:
        outcome = _launch_with_status(config, run_dir, script, list(args.script_args), argv=argv,
                                      console=console, quiet=args.quiet)
    finally:
        if server is not None:
            server.shutdown()
    if reference is not None:
        from .launch.runinfo import record_reference

        record_reference(run_dir, reference, bench_run=args.reference_bench or None)
    return _finish_run(config, run_dir, outcome, console)


def _launch_with_status(config: RunConfig, run_dir: Any, script: Path, script_args: list[str], *,
                        argv: Sequence[str] | None, console: Any, quiet: bool) -> Any:
    """`launch_run` with a live status line (step i/N, last step time) and the script's output echoed."""
    from .launch import launch_run
    from .reports._terminal import run_progress_text

    total = None if config.budget.steps is None else config.budget.steps + config.budget.warmup_steps
    _preload_the_report()
    with console.status("starting torchrun …") as status:

        def on_progress(p: Any) -> None:
            status.update(run_progress_text(p, total))

        def echo_line(line: str) -> None:
            if not quiet:
                console.print(line, markup=False, highlight=False, soft_wrap=True)

        return launch_run(config, run_dir, script, script_args, argv=list(argv) if argv is not None else None,
                          echo=echo_line, on_progress=on_progress)


def _preload_the_report() -> None:
    """Import what the report after the run needs (pandas, pyarrow, plotly: ~0.7 s) on a thread, now.

    They run while torchrun's agent imports torch on one core, before any rank starts (~1.2 s on a
    2-core host), so the report after the run starts sooner: the whole command −0.41 s there
    (BENCHMARKS.md). On a busy host they may still be running when the ranks start up. Nothing is
    imported twice: the report's own imports find the modules loaded (or wait for this thread).
    """
    import threading

    def load() -> None:
        try:
            from .analysis import analyze_run, compact_run  # noqa: F401
            from .reports import _html, build_report_info, render_summary, write_reports  # noqa: F401
            import plotly.graph_objects  # noqa: F401 - the report's figures
            import plotly.subplots  # noqa: F401
        except Exception:  # noqa: BLE001 - the report imports them again and says what failed
            pass

    threading.Thread(target=load, name="torsh-tune-preload", daemon=True).start()


def _bind_dashboard(runs_dir: str, port: int) -> Any:
    """The live dashboard's server over the runs directory, bound to 127.0.0.1:PORT (not serving yet)."""
    from .dashboard import make_server

    return make_server(runs_dir, port=port)


def _start_dashboard(server: Any, run_dir: Any, console: Any) -> None:
    """Serve the bound dashboard from a thread during the run."""
    import threading

    threading.Thread(target=server.serve_forever, name="torsh-tune-dashboard", daemon=True).start()
    console.print(f"live dashboard: http://127.0.0.1:{server.server_port}/runs/{run_dir.name}")


def _finish_run(config: RunConfig, run_dir: Any, outcome: Any, console: Any) -> int:
    return _report_run(config, run_dir, outcome, console)[0]


def _report_run(config: RunConfig, run_dir: Any, outcome: Any, console: Any) -> tuple[int, Any]:
    """Analyse a finished run, write its reports, print its summary: (exit status, RunAnalysis or None)."""
    from .analysis import analyze_run, compact_run
    from .reports import build_report_info, render_summary, write_reports
    from .reports._terminal import render_outcome

    if outcome.status == "config_error":
        print(f"torsh-tune: error: {outcome.message}", file=sys.stderr)
        return EXIT_USAGE, None
    compact_run(run_dir.path)
    analysis = analyze_run(run_dir.path, thresholds=config.thresholds)
    write_reports(analysis, run_dir.path, formats=RUN_END_FORMATS)
    render_summary(build_report_info(analysis), console)
    render_outcome(outcome, run_dir.logs, console)
    if outcome.status == "ok":
        return EXIT_OK, analysis
    return (EXIT_INTERRUPTED if outcome.status == "interrupted" else EXIT_FAILED), analysis


@contextlib.contextmanager
def _removed_if_refused(study_dir: Path, *, keep: bool) -> Iterator[None]:
    """A study the tuner refused before it began (bad objectives, pruner, sampler) leaves no empty directory."""
    try:
        yield
    except ConfigError:
        entries = [] if keep else list(study_dir.iterdir())
        # only what new_run_dir made (empty ranks/, logs/, report/); a profile or a storage stays
        if not keep and all(p.is_dir() and not any(p.iterdir()) for p in entries):
            with contextlib.suppress(OSError):
                for p in entries:
                    p.rmdir()
                study_dir.rmdir()
        raise


def cmd_report(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .analysis import analyze_run
    from .reports import build_report_info, render_summary, write_reports
    from .rundir import RunDir

    if is_study_dir(args.run):
        return cmd_report_study(args)
    run_dir = RunDir(args.run)
    if not run_dir.run_json.is_file() and not run_dir.ranks.is_dir():
        raise invalid("RUN", "a torsh-tune run directory", args.run)
    config = load_config_file(run_dir.config_json) if run_dir.config_json.is_file() else RunConfig()
    analysis = analyze_run(run_dir.path, thresholds=config.thresholds)
    console = Console(highlight=False)
    paths = write_reports(analysis, run_dir.path, formats=tuple(args.formats or RUN_END_FORMATS), out_dir=args.out)
    render_summary(build_report_info(analysis), console, report_paths=paths)
    return EXIT_OK


def cmd_report_study(args: argparse.Namespace) -> int:
    """`report STUDY`: the study report (report.json, report.md, report.html), the migration checks measured again."""
    from rich.console import Console

    from .autotune.summary import rebuild_summary
    from .reports import TUNING_REPORT_FORMATS, get_tuning_info, write_tuning_reports
    from .reports._terminal import render_report_warnings, render_study_summary, render_study_verdict

    formats = tuple(args.formats or TUNING_REPORT_FORMATS)
    for f in formats:
        if f not in TUNING_REPORT_FORMATS:
            raise invalid("--format of a study report", f"one of {', '.join(TUNING_REPORT_FORMATS)}", f)
    summary = rebuild_summary(args.run)
    info = get_tuning_info(args.run, summary=summary if summary is not None else {})
    paths = write_tuning_reports(info, args.out or args.run, formats=formats)
    console = Console(highlight=False)
    if summary is not None:
        render_study_summary(summary, {f"report.{k}": str(p) for k, p in paths.items()}, console)
    else:
        render_study_verdict(info, paths, console)
    render_report_warnings(info.warnings, console)
    return EXIT_OK


def cmd_tune(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`tune`: the study; with `--main-job` (torsh-tune SCRIPT ...) also the baseline profile and the report."""
    import os

    from rich.console import Console

    from .autotune import build_space, load_space_file, tune
    from .reports._terminal import StudyProgress, render_study_result, render_study_summary
    from .autotune.storage import check_storage, shown_url
    from .rundir import new_run_dir

    # The command line is recorded (run.json, result.json): a storage URL's password never is.
    argv = [f"--storage={shown_url(a.split('=', 1)[1])}" if a.startswith("--storage=") else
            shown_url(a) if i and argv[i - 1] == "--storage" else a for i, a in enumerate(argv)]

    config = _config_from_args(args)
    script = check_script(args.script)
    _check_backend(config)
    spec = load_space_file(args.space) if args.space else None
    api_mode = args.api if args.api is not None else uses_parallelize(script)
    if args.allow_batch_changes and not api_mode:
        raise invalid("--allow-batch-changes", "used with a script that calls torsh_tune.parallelize (API mode, --api)",
                      args.script)
    study = _study_config(args, config, api_mode=api_mode)
    cuda = _uses_cuda(config)
    if args.reference_bench:  # one line before anything runs: a bench run with a fitted model
        _reference_from_bench(args.reference_bench)
        from .fabric import load_model

        load_model(args.reference_bench)
    space_args: dict[str, Any] = {
        "nproc_per_node": config.launch.nproc_per_node, "cpu_count": os.cpu_count(), "cuda": cuda,
        "include_compression": study.include_compression, "spec": spec,
    }
    space_options = {"api_mode": study.api_mode, "allow_batch_changes": study.allow_batch_changes}
    # An invalid space is a one-line error before anything runs (the study rebuilds it after the baseline).
    space = build_space(**space_args, base=config, **space_options)
    if args.storage is not None:  # a bad URL, driver, server or journal path: one line, no study dir made
        check_storage(args.storage)
    if args.resume:
        study_dir = Path(args.resume)
        if not StudyDir(study_dir).study_db.is_file() and args.storage is None:
            raise invalid("--resume", "a study directory holding study.db (or pass --storage)", args.resume)
    else:
        study_dir = new_run_dir(args.runs_dir, f"tune-{script.stem}", name=args.run_name).path
    console = Console(highlight=False)
    job = "the main job (profile, tune, confirm, report)" if args.main_job else "tuning"
    console.print(f"[bold]torsh-tune[/] {job}: [cyan]{script.name}[/] on {config.world_size} rank(s) → {study_dir}")
    if getattr(args, "cluster", None) is not None:  # every run of the study (baseline, trials, confirmation) launches on it
        console.print(f"emulated cluster: {args.cluster.spec.describe()}", markup=False)
    mode = "API mode (torsh_tune.parallelize)" if api_mode else "zero code"
    # Offered or not once the baseline has run (what its DDP model broadcasts, its micro-batches).
    pending = [n for n, why in space.unavailable.items() if why.startswith("the baseline's") and "unknown" in why]
    later = f" (after the baseline, if it allows: {', '.join(pending)})" if pending else ""
    console.print(f"search space ({mode}): {', '.join(space.dims)}{later}", markup=False)

    initial_params: list[dict[str, Any]] = []
    seeded: list[str] = []
    profile_dir = StudyDir(study_dir).profile
    if args.main_job and not profile_dir.is_dir():
        code, initial_params, seeded = _baseline_profile(
            args, argv, config, script, profile_dir, console, space_args=space_args, space_options=space_options)
        if code != EXIT_OK:
            console.print("the baseline profile did not succeed: no study was started")
            return code

    progress = StudyProgress(console, n_trials=study.n_trials, baseline_runs=study.baseline_repeats,
                             confirm_runs=2 * study.confirm_top * study.confirm_pairs)
    with progress, _removed_if_refused(study_dir, keep=bool(args.resume)):
        result = tune(script, list(args.script_args), base_config=config, study=study, study_dir=study_dir,
                      space_spec=spec, cuda=cuda, cpu_count=os.cpu_count(), initial_params=initial_params,
                      on_trial=progress.on_trial, on_run=progress.on_run)
    render_study_result(result, console)
    if not args.main_job:
        run_cmd = _shell_join(["torsh-tune", "run", "--config", str(StudyDir(study_dir).best_toml), args.script,
                               *args.script_args])
        console.print(f"run it: {run_cmd}", markup=False)
        return EXIT_INTERRUPTED if result.interrupted else EXIT_OK

    from .autotune.summary import build_summary, write_summary

    summary = build_summary(
        study_dir, script=args.script, script_args=list(args.script_args), loss_tolerance=study.loss_tolerance,
        profile_run=profile_dir if profile_dir.is_dir() else None, recommendations_tried=seeded,
        study_command=["torsh-tune", *argv],
    )
    files = write_summary(study_dir, summary)
    render_study_summary(summary, files, console)
    return EXIT_INTERRUPTED if result.interrupted else EXIT_OK


def uses_parallelize(script: Path) -> bool:
    """Whether the script's source calls `torsh_tune.parallelize` (API mode); `--api/--no-api` overrides."""
    import re

    source = script.read_text(errors="replace")
    return "torsh_tune" in source and re.search(r"\bparallelize\s*\(", source) is not None


def _uses_cuda(config: RunConfig) -> bool:
    """Whether the ranks will use CUDA (judged on this host: the launch node; torch-free on a CPU host)."""
    if config.launch.backend == "gloo":
        return False
    from .launch.command import local_cuda_available

    return local_cuda_available()


def _baseline_profile(args: argparse.Namespace, argv: Sequence[str], config: RunConfig, script: Path,
                      profile_dir: Path, console: Any, *, space_args: dict[str, Any],
                      space_options: dict[str, Any]) -> tuple[int, list[dict[str, Any]], list[str]]:
    """The main job's first step: one profiled run of the user's config with its bottleneck report.

    Its recommendations whose patches the search space can express become the study's first
    trials after the PyTorch defaults, so the study confirms or refutes each of them.

    Returns:
        (exit status, initial trial parameters, the titles of the recommendations they test).
    """
    from .autotune import advisor_params, build_space, measure_run
    from .autotune.objective import recorded_ddp
    from .reports._terminal import render_seeded_recommendations
    from .rundir import new_run_dir

    steps = config.budget.steps or STUDY_DEFAULT_STEPS
    profile_config = config.apply_patch({"budget": {"steps": steps}, "profiler": {"enabled": True}})
    run_dir = new_run_dir(profile_dir.parent, profile_dir.name, name=profile_dir.name)
    console.print(f"[bold]1. baseline profile[/] ({steps} measured steps) → {run_dir.path}")
    outcome = _launch_with_status(profile_config, run_dir, script, list(args.script_args), argv=argv,
                                  console=console, quiet=True)
    code, analysis = _report_run(profile_config, run_dir, outcome, console)
    if code != EXIT_OK or analysis is None:
        return code, [], []
    space = build_space(**space_args, baseline_num_microbatches=measure_run(run_dir.path).max_microbatches,
                        base=config, baseline_buffers=recorded_ddp([run_dir.path]), **space_options)
    rows = [{"rank": r.priority, "name": r.title, "config_patch": r.config_patch}
            for r in analysis.recommendations if r.config_patch]
    skipped = [f"#{r.priority} {r.title}: no config knob (a code change)"
               for r in analysis.recommendations if not r.config_patch]
    seeds = advisor_params(rows, space, skipped=skipped)
    titles = {int(r["rank"]): str(r["name"]) for r in rows}
    render_seeded_recommendations([(rank, titles[rank]) for rank, _ in seeds], skipped, console)
    console.print("[bold]2. study[/] (baseline repeats, trials, confirmation)")
    return EXIT_OK, [params for _, params in seeds], [titles[rank] for rank, _ in seeds]


def _shell_join(parts: Sequence[str]) -> str:
    import shlex

    return shlex.join([str(p) for p in parts])


def cmd_apply(args: argparse.Namespace) -> int:
    path = StudyDir(args.study).best_toml
    if not path.is_file():
        raise invalid("STUDY", "a study directory holding best.toml", args.study)
    load_config_file(path)  # refuse to print something `--config` would reject
    print(path.read_text(), end="")
    return EXIT_OK


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from rich.console import Console

    from .bench import COLLECTIVES, render_bench_table, run_bench, size_range

    collectives = [c.strip() for c in args.collectives.split(",") if c.strip()]
    unknown = [c for c in collectives if c not in COLLECTIVES]
    if unknown or not collectives:
        raise invalid("--collectives", f"a comma-separated subset of {','.join(COLLECTIVES)}", args.collectives)
    if args.min_bytes > args.max_bytes:
        raise invalid("--min-bytes", f"<= --max-bytes ({args.max_bytes})", args.min_bytes)
    if args.factor < 2:
        raise invalid("--factor", "an integer >= 2", args.factor)
    cluster = getattr(args, "cluster", None)
    if cluster is None:  # as profile: nccl without CUDA is refused before a run directory is made
        _check_backend(RunConfig(launch=LaunchConfig(backend=args.backend)))
    console = Console(highlight=False)
    if cluster is not None:
        console.print(f"emulated cluster: {cluster.spec.describe()}", markup=False)
    result = run_bench(
        nproc_per_node=args.nproc_per_node or 2, cluster=cluster,
        sizes=size_range(args.min_bytes, args.max_bytes, args.factor),
        collectives=collectives, iters=args.iters, warmup=args.warmup, runs_dir=args.runs_dir,
        backend=args.backend, timeout_s=args.timeout, run_name=args.run_name, argv=list(argv),
        echo=lambda line: console.print(line, markup=False, highlight=False),
    )
    render_bench_table(result, console)
    return EXIT_OK


def _reference_from_bench(bench_run: str) -> float:
    """The measured bus bandwidth recorded by a `torsh-tune bench` run."""
    from .rundir import RunDir

    run = RunDir(bench_run)
    try:
        value = json.loads(run.run_json.read_text()).get("reference_busbw_gbps") if (run.path / "bench.json").is_file() else None
    except (OSError, ValueError):
        value = None
    if not isinstance(value, (int, float)) or value <= 0:
        raise invalid("--reference-bench", "a finished `torsh-tune bench` run directory", bench_run)
    return float(value)


def cmd_compare(args: argparse.Namespace) -> int:
    from .reports.compare import run_compare

    text, code = run_compare(args.a, args.b, threshold_pct=args.fail_on_regression, fmt=args.format)
    print(text)
    return code


def _trace_windows(path: Path) -> list[Path]:
    """A trace directory, or every window of a run's `traces/` (given the run or its traces dir)."""
    if (path / "traces").is_dir():
        path = path / "traces"
    if path.is_dir():
        has_files = any(f.is_file() and f.name.endswith((".json", ".json.gz")) for f in path.iterdir())
        windows = sorted(d for d in path.iterdir() if d.is_dir())
        if not has_files and windows:
            return windows
    return [path]


def _run_thresholds_near(path: Path) -> Any:
    """The `[thresholds]` of the run a trace path belongs to (RUN, RUN/traces or a window), else None."""
    from .analysis import run_thresholds

    for candidate in (path, path.parent, path.parent.parent):
        config = candidate / "config.json"
        if config.is_file():
            try:
                return run_thresholds(json.loads(config.read_text()), [])
            except ValueError:
                return None
    return None


def cmd_analyze(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console

    from .analysis.traces import analyze_traces
    from .reports._terminal import render_trace_analysis
    from .reports._traces import write_trace_reports

    path = Path(args.path)
    out = Path(args.out) if args.out else Path("torsh-analysis") / f"{path.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if out.exists():
        raise invalid("--out", "a directory that does not exist yet", str(out))
    windows = _trace_windows(path)
    thresholds = _run_thresholds_near(path)
    analyses = [(w, analyze_traces(w, hta_rounding=args.hta_rounding, thresholds=thresholds)) for w in windows]
    console = Console(highlight=False)
    for window, analysis in analyses:
        target = out / window.name if len(analyses) > 1 else out
        render_trace_analysis(window, analysis, console, write_trace_reports(analysis, target))
    return EXIT_OK


def cmd_import_config(args: argparse.Namespace) -> int:
    from .importers import import_file

    out = Path(args.out) if args.out else None
    if out is not None and out.exists():
        raise invalid("--out", "a file that does not exist yet", str(out))
    result = import_file(args.file, args.fmt)
    text = result.to_toml()
    for line in result.unsupported:
        print(f"torsh-tune: not imported: {line}", file=sys.stderr)
    for line in result.notes:
        print(f"torsh-tune: note: {line}", file=sys.stderr)
    if out is None:
        print(text, end="")
        return EXIT_OK
    try:
        with out.open("x") as f:  # "x": never overwrite, even a file created since the check
            f.write(text)
    except FileExistsError:
        raise invalid("--out", "a file that does not exist yet", str(out)) from None
    except OSError as exc:
        raise invalid("--out", "a writable file path", f"{out} ({exc.strerror})") from None
    print(f"torsh-tune: wrote {out}", file=sys.stderr)
    return EXIT_OK


def cmd_advise(args: argparse.Namespace) -> int:
    from .reports._terminal import advice_lines
    from .strategies.advisor import advice_table, advise

    candidates = advise(
        num_params=int(round(args.params)), param_bytes_per_param=args.param_bytes,
        device_memory_bytes=None if args.device_memory_gb is None else int(args.device_memory_gb * 1e9),
        world_size=args.world_size, nnodes=args.nnodes, link_gbps=args.link_gbps, gpus=args.gpus,
        intra_node_gbps=args.intra_node_gbps, reference_world_size=args.reference_world_size,
    )
    rows = advice_table(candidates)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for line in advice_lines(rows):
        print(line)
    return EXIT_OK


def _split_default_command(argv: list[str]) -> list[str]:
    """`torsh-tune [OPTS] SCRIPT ...` without a subcommand means the main job (`tune --main-job`)."""
    for token in argv:
        if token in SUBCOMMANDS:
            return argv
        if token in ("-h", "--help", "--version"):
            return argv
        if not token.startswith("-"):
            return ["tune", "--main-job"] + argv
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = None
    try:
        parser = build_parser()
        args = parser.parse_args(_split_default_command(argv))
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        with _emulated_cluster(args) as args.cluster:
            return _dispatch(args, argv)
    except TorshTuneError as exc:
        if args is not None and args.debug:
            raise
        print(f"torsh-tune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("torsh-tune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _emulated_cluster(args: argparse.Namespace) -> Any:
    """`--emulate SPEC`: the cluster's context (up for the whole command, every trial on it); else a no-op."""
    import contextlib

    spec_text = getattr(args, "emulate", None)
    if spec_text is None:
        return contextlib.nullcontext()
    from .launch.emulate import EmulatedCluster, EmulateSpec

    spec = EmulateSpec.parse(spec_text)
    given = [f"--{name.replace('_', '-')}" for name in _EMULATE_SETS if getattr(args, name, None) is not None]
    if given:
        raise invalid("--emulate", f"used without {', '.join(given)} (the emulated cluster sets them)", spec_text)
    return EmulatedCluster(spec)


def _dispatch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    with_argv = {"profile": cmd_profile, "run": cmd_run, "tune": cmd_tune, "bench": cmd_bench}
    without = {"apply": cmd_apply, "report": cmd_report, "analyze": cmd_analyze, "compare": cmd_compare,
               "import-config": cmd_import_config, "advise": cmd_advise}
    if args.command in with_argv:
        return with_argv[args.command](args, argv)
    if args.command in without:
        return without[args.command](args)
    if args.command == "dashboard":
        from .dashboard import serve

        serve(args.runs_dir, host=args.host, port=args.port, token=args.token)
        return EXIT_OK
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
