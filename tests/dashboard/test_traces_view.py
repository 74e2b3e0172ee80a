"""The trace view: a run's deep-trace windows (real 2-rank gloo Kineto traces) in the dashboard."""

from __future__ import annotations

import http.client
import json
import os
import shutil
from pathlib import Path

import pytest

from torsh_tune.dashboard import RunStore, create_app
from torsh_tune.dashboard._traces import TraceWindowNotFound

from .conftest import DATA, add_run, snapshot
from .test_browser import CHROMIUM, browser, page, shot  # noqa: F401 (fixtures)

TRACES = DATA / "traces" / "gloo-ddp-2rank"  # rank 1 sleeps 5 ms before its extra collectives: a straggler
WINDOW = "step00020-00024"
BROKEN = "step00040-00044"


def add_traced_run(runs_dir: Path, name: str = "traced", *, broken: bool = False,
                   thresholds: dict | None = None) -> Path:
    """A recorded run (healthy) with RUN/traces/<WINDOW>/rank-<r>.json.gz, as `profile --trace-window` writes.

    broken: add a second window whose rank-1 trace is cut mid-gzip (a window still being written).
    """
    run = add_run(runs_dir, "healthy", name)
    shutil.copytree(TRACES, run / "traces" / WINDOW)
    (run / "traces" / "windows.jsonl").write_text(json.dumps({"window": WINDOW, "rank": 0}) + "\n")
    if broken:
        shutil.copytree(TRACES, run / "traces" / BROKEN)
        cut = run / "traces" / BROKEN / "rank-1.json.gz"
        cut.write_bytes(cut.read_bytes()[:7000])
    if thresholds is not None:
        config = json.loads((run / "config.json").read_text())
        config["thresholds"] = thresholds
        (run / "config.json").write_text(json.dumps(config))
    return run


def _post(client, output: str, outputs, inputs, state=()) -> str:
    payload = {"output": output, "outputs": outputs, "inputs": list(inputs), "state": list(state),
               "changedPropIds": [f"{inputs[0]['id']}.{inputs[0]['property']}"]}
    r = client.post("/_dash-update-component", json=payload)
    assert r.status_code == 200, r.get_data(as_text=True)[:500]
    return r.get_data(as_text=True)


def _route(client, pathname: str) -> str:
    return _post(client, "page.children", {"id": "page", "property": "children"},
                 [{"id": "url", "property": "pathname", "value": pathname},
                  {"id": "url", "property": "search", "value": ""}])


def _trace_panel(client, run: str, window: str) -> str:
    outs = [{"id": "tr-content", "property": "children"}, {"id": "tr-sig", "property": "data"},
            {"id": "tr-tick", "property": "disabled"}]
    return _post(client, "..tr-content.children...tr-sig.data...tr-tick.disabled..", outs,
                 [{"id": "tr-tick", "property": "n_intervals", "value": 0}],
                 [{"id": "tr-run", "property": "data", "value": {"run": run, "window": window}},
                  {"id": "tr-sig", "property": "data", "value": None}])


def test_trace_view_has_the_findings_and_tables_of_the_window(runs_dir):
    run = add_traced_run(runs_dir)
    add_run(runs_dir, "healthy")
    before = snapshot(runs_dir)
    store = RunStore(runs_dir)
    assert store.trace_windows("traced") == [WINDOW]  # windows.jsonl is not a window
    assert store.trace_windows("healthy") == []

    view = store.trace_view("traced", WINDOW)
    assert view.error is None and view.window == WINDOW
    assert view.summary["backend"] == "gloo" and view.summary["ranks"] == [0, 1]
    first = view.bottlenecks[0]
    assert (first["category"], first["severity"], list(first["ranks"])) == ("straggler", "critical", [1])
    assert "rank 1 is a straggler" in first["message"] and first["evidence"]["threshold_pct"] == 10.0
    rec = next(r for r in view.recommendations if r["category"] == "straggler")
    assert rec["expected_gain"]["high_pct"] > 0 and rec["expected_gain"]["basis"]
    assert view.median_step_s and 0.01 < view.median_step_s < 1

    ranks = view.tables["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert set(r) == {"rank", "device", "idle_pct", "compute_pct", "non_compute_pct", "comm_s",
                          "exposed_comm_s", "overlap_pct"}
        assert r["idle_pct"] + r["compute_pct"] + r["non_compute_pct"] == pytest.approx(100, abs=0.01)
        assert 0 <= r["exposed_comm_s"] <= r["comm_s"] and 0 <= r["overlap_pct"] <= 100
    assert ranks[1]["idle_pct"] > ranks[0]["idle_pct"]  # the sleeping rank idles
    causes = {r["rank"]: r for r in view.tables["idle_causes"]}
    assert causes[1]["host_wait_pct"] > 90  # its idle time is the host (the sleep), not the device
    strag = {r["rank"]: r for r in view.tables["stragglers"]}
    assert strag[1]["times_last"] > strag[0]["times_last"]
    top = view.tables["top_kernels"]
    assert top and all(sum(r["rank"] == k for r in top) <= 10 for k in (0, 1))
    assert {r["step"] for r in view.tables["steps"]} >= {view.step}

    # The timeline of a typical step: one row per rank.
    assert view.figure is not None
    ys = {y for trace in view.figure.data for y in trace.y}
    assert ys == {"rank 0", "rank 1"}

    # Cached in memory until a trace file changes; nothing written into the run.
    assert store.trace_view("traced", WINDOW) is view and store.traces.analyses == 1
    f = run / "traces" / WINDOW / "rank-0.json.gz"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert store.trace_view("traced", WINDOW) is not view and store.traces.analyses == 2
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert snapshot(runs_dir) == before


def test_trace_view_uses_the_runs_thresholds(runs_dir):
    add_traced_run(runs_dir, thresholds={"straggler_pct": 20.0})  # 50.8 % peer wait: > 2x, < 3x -> high
    first = RunStore(runs_dir).trace_view("traced", WINDOW).bottlenecks[0]
    assert first["category"] == "straggler" and first["severity"] == "high"
    assert first["evidence"]["threshold_pct"] == 20.0


def test_truncated_trace_is_a_one_line_error_until_it_is_complete(runs_dir):
    run = add_traced_run(runs_dir, broken=True)
    store = RunStore(runs_dir)
    assert store.trace_windows("traced") == [WINDOW, BROKEN]
    view = store.trace_view("traced", BROKEN)
    assert view.error is not None and "\n" not in view.error
    assert "truncated" in view.error and f"traces/{BROKEN}/rank-1.json.gz" in view.error
    assert str(runs_dir) not in view.error  # the server's paths stay on the server
    assert view.bottlenecks == () and view.figure is None

    c = create_app(runs_dir).server.test_client()
    body = _trace_panel(c, "traced", BROKEN)
    assert '"trace-error"' in body and "truncated" in body
    assert c.get(f"/runs/traced/traces/{BROKEN}").status_code == 200

    # The writer finishes the file: the next refresh analyses it.
    shutil.copy(TRACES / "rank-1.json.gz", run / "traces" / BROKEN / "rank-1.json.gz")
    assert store.trace_view("traced", BROKEN).error is None


FORGED_WINDOWS = ["..", ".", "%2e%2e", "%252e%252e", "..%2f..%2fetc", "..%2f..%2f..%2fhealthy", "no-such-window",
                  ".hidden", "windows.jsonl", "escape", "a" * 200, f"{WINDOW}%2f..%2f..%2f.."]


def test_unknown_or_forged_window_is_a_404(runs_dir, tmp_path, serve_runs):
    run = add_traced_run(runs_dir)
    add_run(runs_dir, "healthy")
    outside = tmp_path / "outside"
    shutil.copytree(TRACES, outside)
    os.symlink(outside, run / "traces" / "escape")  # a window link that leaves the run directory
    (run / "traces" / ".hidden").mkdir()
    store = RunStore(runs_dir)
    assert store.trace_windows("traced") == [WINDOW]
    served = serve_runs(runs_dir)
    c = served.app.server.test_client()
    for window in FORGED_WINDOWS:
        with pytest.raises(TraceWindowNotFound):
            store.trace_view("traced", window)
        conn = http.client.HTTPConnection("127.0.0.1", served.server.server_port, timeout=10)
        try:  # http.client sends the path as written (no dot-segment removal)
            conn.request("GET", f"/runs/traced/traces/{window}")
            r = conn.getresponse()
            body = r.read().decode(errors="replace")
        finally:
            conn.close()
        assert r.status == 404 and "404" in body and "straggler" not in body, window
        # A forged callback (a page path or the panel's state) gets the 404 content, never the traces.
        assert "not-found" in _route(c, f"/runs/traced/traces/{window}"), window
        assert '"not-found"' in _trace_panel(c, "traced", window), window


def test_trace_view_shows_the_self_check_of_its_window(runs_dir):
    # tests/data/trace_window: a real run with its own window (steps 8-11); its always-on numbers disagree with
    # the trace on rank 1's step 10 (a 5.9 ms stall inside DDP's reducer window, the README says).
    add_run(runs_dir, "trace_window", "checked")
    before = snapshot(runs_dir)
    c = create_app(runs_dir).server.test_client()
    body = json.loads(_trace_panel(c, "checked", "step00008-00011"))
    text = json.dumps(body)
    assert '"trace-self-check"' in text and "Self-check: the always-on numbers against this trace" in text
    assert "mean of ranks" in text and "communication share (host / host)" in text
    assert '"trace-self-check-findings"' in text and "step 10 alone makes" in text
    # Same view, same signature: nothing to send again; nothing written into the run.
    sig = body["response"]["tr-sig"]["data"]
    assert sig and snapshot(runs_dir) == before
    # The recorded window of a different run (tests/dashboard's traced run): its steps have records too.
    add_traced_run(runs_dir)
    assert '"trace-self-check"' in _trace_panel(c, "traced", WINDOW)


def test_trace_paths_check_the_run_and_the_token(runs_dir):
    add_traced_run(runs_dir)
    add_run(runs_dir, "healthy")
    c = create_app(runs_dir).server.test_client()
    assert c.get("/runs/no-such-run/traces").status_code == 404
    assert c.get(f"/runs/no-such-run/traces/{WINDOW}").status_code == 404
    assert c.get(f"/runs/..%2ftraced/traces/{WINDOW}").status_code == 404
    assert '"not-found"' in _trace_panel(c, "../traced", WINDOW)
    assert "tab-traces" in _route(c, "/runs/traced") and "tab-traces" in _route(c, "/runs/traced/bottlenecks")
    assert "tab-traces" not in _route(c, "/runs/healthy")  # no window, no link
    assert "no-trace-windows" in _route(c, "/runs/healthy/traces")

    token = "s3cret-token-123"
    guarded = create_app(runs_dir, token=token).server.test_client()
    assert guarded.get(f"/runs/traced/traces/{WINDOW}").status_code == 401
    assert guarded.get("/runs/traced/traces/nope").status_code == 401  # the token first: no window oracle
    auth = {"Authorization": f"Bearer {token}"}
    assert guarded.get(f"/runs/traced/traces/{WINDOW}", headers=auth).status_code == 200
    assert guarded.get("/runs/traced/traces/nope", headers=auth).status_code == 404


@pytest.mark.skipif(not CHROMIUM.exists(), reason="/usr/bin/chromium is missing (`make browser` installs "
                                                  "Debian's chromium); browser tests need a real browser")
@pytest.mark.timeout(120)
def test_trace_view_in_the_browser(runs_dir, serve_runs, page):  # noqa: F811 (fixture)
    add_traced_run(runs_dir, broken=True)
    before = snapshot(runs_dir)
    served = serve_runs(runs_dir)

    page.goto(served.url + "/runs/traced")
    page.wait_for_selector("#kpi-steps")
    page.evaluate("window.__no_reload = 1")
    page.click("#tab-traces")  # the run overview links to its trace windows
    page.wait_for_selector("#fig-trace-timeline .main-svg")
    assert page.url.endswith("/runs/traced/traces") and page.evaluate("window.__no_reload") == 1
    assert page.inner_text("#trace-window") == WINDOW
    # The timeline figure: a plotly graph with one row per rank.
    rows = page.evaluate("""() => {
        const el = document.querySelector('#fig-trace-timeline .js-plotly-plot');
        return [...new Set(el.data.flatMap(t => Array.from(t.y)))].sort();
    }""")
    assert rows == ["rank 0", "rank 1"]
    card = page.locator(".card.bottleneck").first
    assert card.get_attribute("data-category") == "straggler"
    assert card.get_attribute("data-severity") == "critical"
    assert "rank 1 is a straggler" in card.inner_text() and "peer_wait_pct" in card.inner_text()
    assert "expected gain" in page.locator(".card.recommendation").first.inner_text()
    assert page.locator("#trace-ranks tbody tr").count() == 2
    assert "overlap %" in page.inner_text("#trace-ranks thead")
    assert page.locator("#trace-idle_causes tbody tr").count() == 2
    assert page.locator("#trace-top_kernels tbody tr").count() > 2
    # The self-check of the window: the mean of ranks, then a row per rank.
    assert page.locator("#trace-self-check tbody tr").count() == 3
    shot(page, "traces_view")

    page.click(f"[data-window='{BROKEN}'] a")  # a window still being written: one line, no 500
    page.wait_for_selector("#trace-error")
    assert "truncated" in page.inner_text("#trace-error")
    assert page.query_selector("#fig-trace-timeline") is None
    shot(page, "traces_truncated")

    resp = page.goto(served.url + "/runs/traced/traces/no-such-window")
    assert resp.status == 404 and "No trace window named 'no-such-window'" in page.inner_text("body")
    assert snapshot(runs_dir) == before
