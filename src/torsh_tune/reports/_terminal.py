"""What torsh-tune prints on the terminal (rich): a run's summary and outcome, a trace analysis,
strategy advice, a study's progress, result and summary. The CLI parses and dispatches; the
lines and tables it shows are built here."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ._format import (PHASE_LABELS, advice_headline, fmt_pct, fmt_s, fmt_value, gain_text, migration_cell,
                      throughput_text)
from ._info import ReportInfo, self_check_clocks, self_check_table
from ._patch import patch_to_dotted

__all__ = ["SEVERITY_STYLES", "StudyProgress", "advice_lines", "render_outcome", "render_report_warnings",
           "render_seeded_recommendations", "render_study_result", "render_study_summary", "render_study_verdict",
           "render_summary", "render_trace_analysis", "run_progress_text"]

#: rich styles of the bottleneck severities.
SEVERITY_STYLES = {"critical": "bold white on red", "high": "bold red", "medium": "yellow", "low": "cyan"}

_BAR_WIDTH = 30
_TOP_RECOMMENDATIONS = 3
_MAX_EVIDENCE = 6  # items per bottleneck on screen; report.md has them all
_SELF_CHECK_RANKS = 4  # rank rows per trace window on screen (largest differences); report.md has more


def render_summary(
    info: ReportInfo,
    console: Console,
    *,
    report_paths: Mapping[str, str | os.PathLike[str]] | None = None,
) -> None:
    """Print the run summary: headline numbers, breakdown, bottlenecks, top recommendations.

    Args:
        info: the report data.
        console: where to print (a `Console(record=True)` captures it for tests).
        report_paths: format -> path of written reports to list at the end; by default
            the report/report.{json,md} files that exist in the run directory.

    Example:
        >>> from rich.console import Console
from rich.markup import escape
        >>> render_summary(info, Console())  # doctest: +SKIP
    """
    run = info.run
    title = Text.assemble(("torsh-tune ", "bold"), (str(run.get("name") or "run"), "cyan"))
    status = str(run.get("status"))
    status_style = "green" if status in ("ok", "budget") and not info.partial else "bold red"
    console.print()
    console.rule(title)
    if info.partial:
        body = Text(
            f"PARTIAL RESULTS: the run ended with status {status!r} or a rank did not finish cleanly; "
            "the numbers cover only what was recorded.",
            style="bold",
        )
        if run.get("message"):
            body.append(f"\n{run['message']}", style="")
        console.print(Panel(body, border_style="red", title="partial", title_align="left"))

    console.print(_headline(info, status, status_style))
    console.print()
    if info.breakdown:
        console.print(_breakdown_table(info))
    console.print(_bottleneck_table(info))
    for check in info.self_check:
        console.print(_self_check_table(check))
        threshold = check.get("threshold_pp")
        for finding in check.get("findings") or []:
            console.print(Text(f"⚠ {finding.get('message', '')}", style="yellow"))
        if not check.get("findings"):
            console.print(Text(f"always-on and trace agree within {threshold:g} pp (step time: {threshold:g} %)",
                               style="green"))
        console.print()
    if info.recommendations:
        console.print(_recommendation_table(info))
    advice = advice_headline(info.strategy_advice)
    if advice:
        console.print(Text(f"strategy advice: {advice} (report.md has the candidates)", style="dim"))
    for warning in info.warnings[:5]:
        console.print(Text(f"warning: {warning}", style="yellow"))
    if len(info.warnings) > 5:
        console.print(Text(f"… and {len(info.warnings) - 5} more warnings in report.md", style="yellow"))

    run_dir = run.get("run_dir")
    if run_dir:
        console.print(Text.assemble(("run dir: ", "bold"), str(run_dir)))
    for fmt, path in _report_paths(run_dir, report_paths).items():
        console.print(Text.assemble((f"report ({fmt}): ", "bold"), str(path)))


def _headline(info: ReportInfo, status: str, status_style: str) -> Text:
    # Two lines of text rather than a table: they wrap cleanly on narrow terminals.
    s = info.summary
    world = info.run.get("world_size")
    text = Text()
    if s is None:
        text.append("no measured steps", style="bold")
    else:
        tput_text = throughput_text(s)
        text.append("median step ")
        text.append(fmt_s(s.get("median_step_s")), style="bold cyan")
        text.append("   p90 ")
        text.append(fmt_s(s.get("p90_step_s")), style="bold")
        text.append("   throughput ")
        text.append(tput_text, style="bold cyan")
        text.append(f"\nspread (IQR) {fmt_s(s.get('iqr_step_s'))} ({_pct0(s.get('iqr_pct'))})")
        text.append(f"   {fmt_value('n', s.get('num_steps'))} measured steps")
    text.append(f" on {world} rank{'s' if world != 1 else ''}   status ")
    text.append(status + (" (partial)" if info.partial else ""), style=status_style)
    return text


def _pct0(pct: float | None) -> str:
    return "–" if pct is None else f"{pct:.0f} %" if pct >= 9.95 else f"{pct:.1f} %"


def _breakdown_table(info: ReportInfo) -> Table:
    t = Table(box=box.SIMPLE_HEAD, title="Where a step's time goes", title_justify="left", header_style="bold")
    t.add_column("phase")
    t.add_column("time", justify="right")
    t.add_column("share", justify="right")
    t.add_column("", no_wrap=True)
    for row in info.breakdown:
        pct = row.get("pct") or 0.0
        style = "red" if row["phase"] in ("exposed_comm", "data") and pct >= 30 else "cyan"
        t.add_row(
            PHASE_LABELS.get(row["phase"], row["phase"]),
            fmt_s(row.get("time_s")),
            fmt_pct(row.get("pct")),
            Text("█" * max(0, round(pct / 100 * _BAR_WIDTH)), style=style),
        )
    return t


def _bottleneck_table(info: ReportInfo) -> Table | Text:
    if not info.bottlenecks:
        return Text("No bottleneck found above the thresholds.", style="green")
    t = Table(box=box.SIMPLE_HEAD, title="Bottlenecks", title_justify="left", header_style="bold", expand=False)
    t.add_column("severity", no_wrap=True)
    t.add_column("category", no_wrap=True)
    t.add_column("ranks", no_wrap=True)
    t.add_column("finding and evidence", ratio=1)
    for b in info.bottlenecks:
        sev = str(b.get("severity"))
        evidence = b.get("evidence") or {}
        # Thresholds are settings, not measurements: report.md lists them, the screen does not.
        measured = [(k, v) for k, v in evidence.items() if not str(k).startswith("threshold")]
        items = [f"{k}={fmt_value(k, v)}" for k, v in measured[:_MAX_EVIDENCE]]
        cell = Text(str(b.get("message", "")))
        if items:
            cell.append("\n" + ", ".join(items), style="dim")
        t.add_row(
            Text(sev.upper(), style=SEVERITY_STYLES.get(sev, "")),
            str(b.get("category")),
            ", ".join(map(str, b.get("ranks") or [])) or "all",
            cell,
        )
    return t


def _self_check_table(check: dict[str, Any]) -> Table:
    header, rows = self_check_table(check, max_ranks=_SELF_CHECK_RANKS, compact=True)
    t = Table(box=box.SIMPLE_HEAD, header_style="bold", title_justify="left", caption_justify="left",
              caption_style="dim", caption=self_check_clocks(check),
              title=f"Self-check against trace window {check.get('window')} (steps {check.get('start_step')}–"
                    f"{check.get('end_step')}): always-on/trace (difference: pp; step time: %)")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def _recommendation_table(info: ReportInfo) -> Table:
    # A grid of text blocks rather than a wide table: it stays readable on 80 columns.
    median = (info.summary or {}).get("median_step_s")
    shown = info.recommendations[:_TOP_RECOMMENDATIONS]
    title = "Recommendations" + (
        f" (top {len(shown)} of {len(info.recommendations)}; all in report.md)"
        if len(info.recommendations) > len(shown)
        else ""
    )
    t = Table.grid(padding=(0, 1))
    t.title = title
    t.title_justify = "left"
    t.title_style = "bold"
    t.add_column(justify="right", no_wrap=True)
    t.add_column(ratio=1)
    for r in shown:
        body = Text(str(r.get("title", "")), style="bold")
        body.append("\nexpected gain ", style="")
        body.append(gain_text(r.get("expected_gain") or {}, median), style="magenta")
        body.append(f" · effort {r.get('effort')}")
        if r.get("rationale"):
            body.append("\n" + str(r["rationale"]), style="dim")
        patch = r.get("config_patch") or {}
        for line in patch_to_dotted(patch) if patch else ["(no config knob: a code change)"]:
            body.append("\n" + line, style="green" if patch else "dim")
        t.add_row(f"{r.get('priority')}.", body)
        t.add_row("", "")
    return t


def _report_paths(run_dir: Any, given: Mapping[str, str | os.PathLike[str]] | None) -> dict[str, str]:
    if given is not None:
        return {fmt: str(p) for fmt, p in given.items()}
    if not run_dir:
        return {}
    found = {}
    for fmt, name in (("json", "report.json"), ("md", "report.md")):
        path = Path(run_dir) / "report" / name
        if path.is_file():
            found[fmt] = str(path)
    return found


# -- a run's end ------------------------------------------------------------------------------


def run_progress_text(progress: Any, total: int | None) -> str:
    """The live status line of a run: step i/N, last step time, elapsed, ranks reporting."""
    steps = f"{progress.steps_done}/{total}" if total else str(progress.steps_done)
    last = f" · last step {progress.last_step_s * 1e3:.1f} ms" if progress.last_step_s else ""
    return f"step {steps}{last} · {progress.elapsed_s:.0f} s · {progress.ranks_reporting} rank(s) reporting"


def render_outcome(outcome: Any, logs_dir: Any, console: Console) -> None:
    """How a launched run ended, after its summary: the warnings of a clean run, or the failure's
    classification and the failing rank's last output lines (torchrun's own account of the
    failure, its traceback and banner, was kept off the terminal and stays in logs/)."""
    if outcome.status == "ok":
        for warning in outcome.warnings:  # an abort at exit after every rank finished: torchrun's report is in logs/
            console.print(f"warning: {warning}", markup=False, highlight=False)
        return
    console.print(f"[bold red]run {outcome.status}[/]: {escape(outcome.message)}")
    if outcome.stderr_tail:
        whose = "the" if outcome.failing_rank is None else f"rank {outcome.failing_rank}'s"
        console.print(f"{whose} last output lines (all output in {logs_dir}):", markup=False, highlight=False)
    for line in outcome.stderr_tail[-10:]:
        console.print(f"  {line}", markup=False, highlight=False)


# -- trace analysis (`torsh-tune analyze`) -----------------------------------------------------


def render_trace_analysis(window: Any, analysis: Any, console: Console,
                          report_paths: Mapping[str, str | os.PathLike[str]]) -> None:
    """One trace window's analysis: per-rank breakdown and overlap, the straggler, the bottlenecks
    and the files written."""
    table = Table(title=f"trace analysis: {window}")
    for col in ("rank", "idle %", "compute %", "non-compute %", "comm s", "exposed comm s", "overlap %"):
        table.add_column(col, justify="right")
    merged = analysis.breakdown.merge(analysis.overlap, on="rank", how="left", suffixes=("", "_o"))
    for row in merged.to_dict(orient="records"):
        table.add_row(
            str(row["rank"]),
            *(f"{row.get(k, float('nan')):.2f}" for k in ("idle_pct", "compute_pct", "non_compute_pct")),
            *(f"{row.get(k, float('nan')):.4f}" for k in ("comm_s", "exposed_comm_s")),
            f"{row.get('overlap_pct', float('nan')):.2f}",
        )
    console.print(table)
    s = analysis.summary
    if s.get("straggler_rank") is not None:
        console.print(f"last to arrive at collectives most often: rank {s['straggler_rank']} "
                      f"({s.get('straggler_last_share_pct', 0):.0f} %)")
    for b in analysis.bottlenecks:
        console.print(f"{b.severity:<8} {b.category:<13} {b.message}", markup=False, soft_wrap=True)
    for fmt, p in report_paths.items():
        console.print(f"analysis ({fmt}): {p}")


# -- strategy advice (`torsh-tune advise`) -----------------------------------------------------


def advice_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The ranked candidates of `strategies.advisor.advice_table` as plain lines."""
    lines = []
    for row in rows:
        fits = {True: "fits", False: "does not fit", None: "memory unknown"}[row["fits"]]
        lines.append(f"{row['rank']}. {row['name']}  (score {row['score']:g}; {row['memory_per_rank_gb']:g} GB model "
                     f"state per rank, {fits})")
        lines.append(f"   patch: {json.dumps(row['config_patch'])}")
        lines += [f"   - {reason}" for reason in row["reasons"]]
    return lines


# -- studies ------------------------------------------------------------------------------------


def render_seeded_recommendations(seeded: Sequence[tuple[int, str]], skipped: Sequence[str],
                                  console: Console) -> None:
    """Which of the baseline profile's recommendations become trials of the study, and which not."""
    for rank, title in seeded:
        console.print(f"  recommendation #{rank} becomes a trial: {title}", markup=False)
    for line in skipped:
        console.print(f"  recommendation not tried: {line}", markup=False)


def render_study_result(result: Any, console: Console) -> None:
    """A finished study (`autotune.TuneResult`): baseline and noise, each confirmation's verdict,
    the data guard's exclusions, the best configuration and its minimal form, the files."""
    b = result.baseline
    console.print(f"baseline: {b.median_samples_s:,.1f} {b.unit} (run-to-run noise {100 * b.noise_rel:.1f} %)")
    for c in result.confirmations:
        if c.speedup is None:
            console.print(f"trial {c.trial_number}: not confirmed ({'; '.join(c.failures) or 'no successful pair'})")
            continue
        verdict = "[green]confirmed faster[/]" if c.better else "not better beyond noise"
        console.print(f"trial {c.trial_number}: paired speedup {c.speedup:.3f}x (95 % CI {c.ci_low:.3f}–{c.ci_high:.3f}) — {verdict}")
    for note in result.confirmation_notes:
        console.print(note, markup=False)
    for knob, guard in result.data_guard.items():
        console.print(f"{knob} left the search at trial {guard['trial']}: {guard['reason']}", markup=False)
    if result.best_trial is None:
        console.print("no configuration beat the baseline beyond noise: best.toml is your configuration as it is")
    elif result.ablation is None or not result.ablation.better:
        console.print(f"best: trial {result.best_trial} at {result.best_speedup:.3f}x — {result.best_params}")
    if result.ablation is not None:
        _render_ablation(result.ablation, console)
    for name, path in result.files.items():
        console.print(f"{name}: {path}")


def _render_ablation(a: Any, console: Console) -> None:
    """The minimal best config: each kept knob with its measured share, each dropped one as no measurable effect."""
    if a.speedup is not None:
        state = "confirmed faster, in best.toml" if a.better else "not confirmed faster: best.toml keeps the winner"
        console.print(f"[bold]minimal best config[/] (trial {a.trial_number} reduced): {a.speedup:.3f}x "
                      f"(95 % CI {a.ci_low:.3f}–{a.ci_high:.3f}), {state}")
    for name, (found, rounded) in sorted(a.rounded.items()):
        console.print(f"  rounded {name}: {found!r} -> {rounded!r}", markup=False)
    for e in sorted(a.effects, key=lambda e: (not e.kept, -(e.share or 0.0))):
        if e.kept and e.share is not None:
            console.print(f"  {e.knob} = {_short(e.value)}: {100 * e.share:.0f} % of the speedup (95 % CI "
                          f"{100 * e.share_ci[0]:.0f}–{100 * e.share_ci[1]:.0f} %; {e.ratio:.3f}x with it)", markup=False)
        elif e.kept:
            console.print(f"  {e.knob} = {_short(e.value)}: kept ({e.verdict})", markup=False)
        else:
            # The pairs stop once a drop is decided: one pair's ratio is no measurement of harm.
            n = len(e.ratios)
            together = f" with {', '.join(e.tested_with)}" if e.tested_with else ""
            measured = (f" ({e.ratio:.3f}x with {'them' if together else 'it'}, {n} pair{'s' if n != 1 else ''})"
                        if e.ratio is not None else "")
            console.print(f"  {e.knob} = {_short(e.value)}: dropped{together}, no measurable effect{measured}",
                          markup=False)
    for note in a.notes:
        console.print(f"  {note}", markup=False)


def render_study_summary(summary: Mapping[str, Any], files: Mapping[str, str], console: Console) -> None:
    """The study report's essentials (`autotune.summary.build_summary`): the verdict, the ToRSh
    migration checks of baseline vs best, how to reproduce, the files (the rest is in report.html)."""
    v = summary["verdict"]
    style = "bold green" if v["confirmed"] else "bold yellow"
    console.print(f"[{style}]{v['title']}.[/] {v['text']}")
    table = Table(title="baseline vs best (ToRSh migration checks)", title_justify="left")
    for col in ("metric", "baseline", "best", "change", "rule", "check"):
        table.add_column(col)
    for m in summary["migration"]:
        table.add_row(m["label"], migration_cell(m, "baseline"), migration_cell(m, "best"), migration_cell(m, "change"),
                      m["rule"], {True: "[green]pass[/]", False: "[red]fail[/]", None: "—"}[m["ok"]])
    console.print(table)
    console.print("reproduce:")
    for name in ("run", "apply"):
        console.print(f"  {summary['commands'][name]}", markup=False, highlight=False, soft_wrap=True)
    for name, path in files.items():
        console.print(f"{name}: {path}", markup=False)


def render_study_verdict(info: Any, report_paths: Mapping[str, str | os.PathLike[str]], console: Console) -> None:
    """A study report without a summary (still running: nothing confirmed to measure): its verdict and files."""
    v = info.verdict
    console.print(f"[bold yellow]{v['title']}.[/] {v['text']}")
    for fmt, path in report_paths.items():
        console.print(f"report.{fmt}: {path}", markup=False)


def render_report_warnings(warnings: Sequence[str], console: Console) -> None:
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {warning}")


class StudyProgress:
    """Progress of a study: trial i/N, state, objective, best so far and ETA.

    A live table on a terminal; one plain line per run otherwise (pipes, CI, tests). Its
    `on_trial` and `on_run` are `autotune.tune`'s callbacks.
    """

    _ROWS = 12

    def __init__(self, console: Console, *, n_trials: int, baseline_runs: int, confirm_runs: int) -> None:
        self.console, self.n_trials = console, n_trials
        self.baseline_runs, self.confirm_runs = baseline_runs, confirm_runs
        self.baseline_done = self.trials_done = self.confirm_done = self.ablation_done = self.runs = 0
        self.best: float | None = None
        self.unit = "samples/s"
        self.rows: list[tuple[str, ...]] = []
        self.t0 = self.t_last = time.monotonic()
        self.run_s: list[float] = []
        self.live: Any = None

    def __enter__(self) -> "StudyProgress":
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self, console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def _tick(self) -> None:
        now = time.monotonic()
        self.run_s.append(now - self.t_last)
        self.t_last = now

    def eta(self) -> str:
        """Remaining runs times the median run so far; '?' before the first run ends and during the
        ablation (how many knobs it keeps decides how many runs it takes)."""
        if not self.run_s or self.ablation_done:
            return "?"
        left = (max(self.baseline_runs - self.baseline_done, 0) if self.trials_done == 0 else 0)
        left += max(self.n_trials - self.trials_done, 0) + max(self.confirm_runs - self.confirm_done, 0)
        run_s = sorted(self.run_s)[len(self.run_s) // 2]
        return _duration(left * run_s)

    def on_run(self, kind: str, run: Any) -> None:
        self._tick()
        if kind == "baseline":
            self.baseline_done += 1
            label = f"baseline ({self.baseline_done}/{self.baseline_runs})"
        elif kind.startswith("ablation"):
            self.ablation_done += 1
            label = f"{kind} ({self.ablation_done})"
        else:
            self.confirm_done += 1
            label = f"{kind} ({self.confirm_done}/{self.confirm_runs})"
        tp = run.measurement.throughput if run.measurement is not None else None
        if tp is not None:
            self.unit = tp.unit  # the baseline's unit is the study's
        value = f"{tp.samples_s:,.1f} {tp.unit}" if tp is not None else f"{run.failure_reason}"
        self._emit((label, run.state, value, "", ""),
                   f"  {label:<19} {run.state:<8} {value:<28} {'':<18} ETA {self.eta()}")

    def on_trial(self, t: Any) -> None:
        self._tick()
        self.trials_done = max(self.trials_done, t.number + 1)
        state = "VIOLATED" if t.constraint_status == "violated" else t.state
        if t.samples_s and t.constraint_status != "violated":
            self.best = max(self.best or 0.0, t.samples_s)
        obj = f"{t.samples_s:,.1f} {self.unit}" if t.samples_s else (t.failure_reason or "")
        top = f"best {self.best:,.1f}" if self.best else ""
        params = ", ".join(f"{k}={_short(v)}" for k, v in sorted(t.params.items()))
        role = f" ({t.role})" if t.role in ("advisor", "initial", "model", "recommendation") else ""
        done = f"({self.trials_done}/{self.n_trials})"
        self._emit((f"trial {t.number} {done}", state, obj, f"{self.best:,.1f}" if self.best else "", params + role),
                   f"  trial {t.number:>3} {done:<9} {state:<8} {obj:<28} {top:<18} ETA {self.eta():<7} "
                   f"{params}{role}")

    def _emit(self, row: tuple[str, ...], line: str) -> None:
        self.rows.append(row)
        if self.live is None:
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)

    def __rich__(self) -> Any:
        elapsed = _duration(time.monotonic() - self.t0)
        best = f"{self.best:,.1f} {self.unit}" if self.best else "—"
        table = Table(title=f"trial {self.trials_done}/{self.n_trials} · best {best} · elapsed {elapsed} · "
                            f"ETA {self.eta()}", title_justify="left", expand=False)
        for col in ("run", "state", "objective", "best so far", "parameters"):
            table.add_column(col, overflow="fold")
        for row in self.rows[-self._ROWS:]:
            table.add_row(*row)
        return table


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def _short(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
