"""The dashboard in real headless Chromium (Debian's, driven by Playwright; never downloaded)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterator

import pytest

from .conftest import ARTIFACTS, add_planted_run, add_run, add_study, snapshot

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


def test_tuning_view_shows_the_trials_of_a_study(runs_dir, serve_runs, page):
    add_run(runs_dir, "healthy")
    add_study(runs_dir)  # a real recorded tune() (tests/data/record_study.py): 7 trials, 1 planted failure
    add_study(runs_dir, "study_pareto")
    before = snapshot(runs_dir)
    served = serve_runs(runs_dir)

    page.goto(served.url + "/")
    page.wait_for_selector("tr.run-row[data-run='study_small'][data-kind='study']")
    assert "Confirmed speedup" in page.inner_text("tr[data-run='study_small']")
    assert page.get_attribute("tr[data-run='healthy']", "data-kind") == "run"
    page.click("tr[data-run='study_small'] a")
    page.wait_for_selector("#trials-table")
    assert page.url.endswith("/studies/study_small")
    states = page.eval_on_selector_all("tr.trial", "els => els.map(e => e.dataset.state)")
    assert len(states) == 7 and states[1] == "FAIL" and states.count("COMPLETE") >= 4
    assert "planted failure" in page.inner_text("tr.trial[data-number='1'] td.reason")
    assert "feasible" in page.inner_text("tr.trial[data-number='0'] td.constraint")
    assert re.fullmatch(r"\d+\.\d{3}x \(trial 0\)", page.inner_text("#tuning-speedup"))
    assert re.fullmatch(r"\d+\.\d{3}–\d+\.\d{3}", page.inner_text("#tuning-ci"))
    assert "confirmed faster" in page.inner_text("#confirmation-table")
    for key in ("confirmation", "history", "importances", "parallel"):
        page.wait_for_selector(f"#fig-tuning-{key} .main-svg")
    assert page.query_selector("#fig-tuning-pareto") is None  # one objective: no front
    shot(page, "tuning_study_small")

    page.goto(served.url + "/studies/study_pareto")  # throughput + loss: the Pareto front
    page.wait_for_selector("#fig-tuning-pareto .main-svg")
    assert page.eval_on_selector_all("tr.trial", "els => els.length") >= 3
    shot(page, "tuning_study_pareto")
    resp = page.goto(served.url + "/studies/..%2fhealthy")
    assert resp.status == 404
    assert snapshot(runs_dir) == before  # nothing written into the study directories


def test_overview_shows_alerts_of_a_planted_run_live(runs_dir, serve_runs, page):
    run = add_planted_run(runs_dir)
    info = json.loads((run / "run.json").read_text())
    info.update(status="running", outcome=None)  # live: the alert list follows the records
    (run / "run.json").write_text(json.dumps(info))
    served = serve_runs(runs_dir, refresh_s=0.5)

    page.goto(served.url + "/runs/planted")
    page.wait_for_selector(".alert[data-kind='low_gpu_utilization']")
    kinds = page.eval_on_selector_all(".alert", "els => els.map(e => e.dataset.kind)")
    assert kinds == ["low_gpu_utilization", "memory_pressure", "communication_overhead", "step_time_spike"]
    first = page.locator(".alert").first
    assert first.get_attribute("data-severity") == "critical" and "ranks: 1" in first.inner_text()
    shot(page, "alerts_planted")

    # 20 s more of rank 0 at 5 % GPU utilisation: a fifth alert appears without a reload.
    path = run / "ranks" / "rank00000.system.jsonl"
    last = json.loads(path.read_text().strip().splitlines()[-1])
    with open(path, "a") as f:
        f.writelines(json.dumps(dict(last, t=last["t"] + 1 + i, gpu_util_pct=5.0)) + "\n" for i in range(20))
    page.wait_for_function("document.querySelectorAll('.alert').length === 5")
    assert page.locator(".alert[data-kind='low_gpu_utilization']").count() == 2
