"""The dashboard in real headless Chromium (Debian's, driven by Playwright; never downloaded)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import ARTIFACTS, add_run, snapshot

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = [
    pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is missing (`make browser` installs "
                                                     "Debian's chromium); browser tests need a real browser"),
    pytest.mark.timeout(120),
]
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser) -> Iterator:
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"JavaScript errors in the page: {errors}"


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def append_steps(run: Path, first_step: int, count: int) -> None:
    """Append `count` step records per rank, continuing each rank's last record (real file I/O)."""
    for path in sorted((run / "ranks").glob("*.steps.jsonl")):
        last = json.loads(path.read_text().strip().splitlines()[-1])
        with open(path, "a") as f:
            for i in range(count):
                rec = dict(last, step=first_step + i, warmup=False, t_start=last["t_end"] + i * last["step_s"])
                rec["t_end"] = rec["t_start"] + rec["step_s"]
                f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())


def test_runs_list_shows_finished_and_running_runs(runs_dir, serve_runs, page):
    add_run(runs_dir, "healthy", "finished-run")
    add_run(runs_dir, "data_bound", "live-run", status="running")
    add_run(runs_dir, "crashed", "crashed-run", status="error")
    before = snapshot(runs_dir)
    served = serve_runs(runs_dir)

    page.goto(served.url + "/")
    page.wait_for_selector("tr.run-row[data-run='live-run']")
    assert page.get_attribute("tr[data-run='finished-run']", "data-status") == "finished"
    assert page.get_attribute("tr[data-run='live-run']", "data-status") == "running"
    assert page.get_attribute("tr[data-run='crashed-run']", "data-status") == "failed"
    live_row = page.inner_text("tr[data-run='live-run']")
    assert "running" in live_row and "ms" in live_row  # median step time shown while running
    assert "critical io" in live_row  # the data_bound fixture's top bottleneck
    shot(page, "runs_list")

    page.fill("#runs-filter", "running")  # filtering narrows the table client-driven, no reload
    page.wait_for_function("document.querySelectorAll('tr.run-row').length === 1")
    assert page.get_attribute("tr.run-row", "data-run") == "live-run"
    page.fill("#runs-filter", "")
    page.wait_for_function("document.querySelectorAll('tr.run-row').length === 3")

    # Navigation is client-side: a marker set on window survives the click.
    page.evaluate("window.__no_reload = 1")
    page.click("tr[data-run='finished-run'] a")
    page.wait_for_selector("#kpi-steps")
    assert page.evaluate("window.__no_reload") == 1
    assert page.url.endswith("/runs/finished-run")
    assert snapshot(runs_dir) == before  # the app wrote nothing into the run directories


def test_live_overview_advances_while_the_run_writes(runs_dir, serve_runs, page):
    run = add_run(runs_dir, "healthy", "live", status="running")
    served = serve_runs(runs_dir, refresh_s=0.5)

    page.goto(served.url + "/runs/live")
    page.wait_for_function("document.querySelector('#kpi-steps')?.innerText === '12'")
    assert page.inner_text("#run-status") == "running"
    page.wait_for_selector("#fig-step_series .main-svg")
    shot(page, "overview_live_before")

    append_steps(run, 12, 8)
    page.wait_for_function("document.querySelector('#kpi-steps')?.innerText === '20'")
    assert page.inner_text("#kpi-last-step") == "19"
    # Half a line (a writer mid-flush) is not read until it is complete.
    path = run / "ranks" / "rank00000.steps.jsonl"
    last = json.loads(path.read_text().strip().splitlines()[-1])
    line = json.dumps(dict(last, step=20, t_start=last["t_end"], t_end=last["t_end"] + last["step_s"])) + "\n"
    with open(path, "a") as f:
        f.write(line[:25])
    page.wait_for_timeout(1500)  # three refreshes
    assert page.inner_text("#kpi-steps") == "20"
    with open(path, "a") as f:
        f.write(line[25:])
    page.wait_for_function("document.querySelector('#kpi-steps')?.innerText === '21'")
    shot(page, "overview_live_after")


def test_data_bound_cards_show_the_io_bottleneck(runs_dir, serve_runs, page):
    add_run(runs_dir, "data_bound")
    served = serve_runs(runs_dir)

    page.goto(served.url + "/runs/data_bound/bottlenecks")
    page.wait_for_selector(".card.bottleneck")
    first = page.locator(".card.bottleneck").first
    assert first.get_attribute("data-category") == "io"
    assert first.get_attribute("data-severity") in ("critical", "high")
    assert "data_wait_pct" in first.inner_text()  # the evidence is on the card
    severities = page.eval_on_selector_all(".card.bottleneck", "els => els.map(e => e.dataset.severity)")
    order = ["critical", "high", "medium", "low"]
    assert [order.index(s) for s in severities] == sorted(order.index(s) for s in severities)
    rec = page.locator(".card.recommendation").first
    assert "expected gain" in rec.inner_text()
    assert re.search(r"num_workers\s*=\s*\d+", rec.locator("pre.patch").inner_text())
    shot(page, "bottlenecks_data_bound")


def test_compare_view_and_404_page(runs_dir, serve_runs, page):
    add_run(runs_dir, "healthy")
    add_run(runs_dir, "data_bound")
    served = serve_runs(runs_dir)

    page.goto(served.url + "/compare?a=healthy&b=data_bound")
    page.wait_for_selector("#compare-table")
    text = page.inner_text("#compare-table")
    assert "median step time" in text and "healthy" in text and "data_bound" in text
    page.wait_for_selector("#compare-breakdown .main-svg")
    shot(page, "compare")

    resp = page.goto(served.url + "/runs/no-such-run")
    assert resp.status == 404
    assert "No run named 'no-such-run'" in page.inner_text("body")
