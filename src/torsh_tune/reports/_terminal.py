"""The end-of-run summary in the terminal (rich)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ._format import PHASE_LABELS, advice_headline, fmt_pct, fmt_s, fmt_value, gain_text, throughput_text
from ._info import ReportInfo, self_check_clocks, self_check_table
from ._patch import patch_to_dotted

__all__ = ["SEVERITY_STYLES", "render_summary"]

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
