"""Binding, token checks, run-id validation and read-only behaviour, over real HTTP paths."""

from __future__ import annotations

import http.client
import inspect
import json
import os

import pytest
import requests

from torsh_tune.dashboard import ENV_TOKEN, RunNotFound, check_bind, create_app, make_server, resolve_run, serve
from torsh_tune.errors import ConfigError

from .conftest import add_run, snapshot

TOKEN = "s3cret-token-123"
TRAVERSALS = [
    "/runs/../../etc/passwd",
    "/runs/..%2f..%2fetc%2fpasswd",
    "/runs/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
    "/runs/%252e%252e%252f%252e%252e%252fetc%252fpasswd",
    "/runs/%2e%2e",
    "/runs/..",
    "/runs/.hidden",
    "/runs/healthy%2f..%2f..%2fetc",
    "/runs/%2fetc%2fpasswd",
    "/runs/..%5c..%5cetc",
    "/../../etc/passwd",
    "/static/../../etc/passwd",
    "/assets/x.css",
    "/studies/../../etc/passwd",
    "/studies/..%2f..%2fetc",
    "/studies/%2e%2e",
    "/studies/healthy/../..",
]


def test_default_bind_is_loopback():
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(make_server).parameters["host"].default == "127.0.0.1"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_token(host):
    check_bind(host, None)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_off_loopback_needs_a_token(host):
    with pytest.raises(ConfigError, match="--host must be a loopback address"):
        check_bind(host, None)
    check_bind(host, TOKEN)


def test_serve_refuses_off_loopback_before_binding(runs_dir, monkeypatch):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    with pytest.raises(ConfigError) as exc:
        serve(runs_dir, host="0.0.0.0", port=0)
    assert "\n" not in str(exc.value)


def test_serve_reads_the_token_from_the_environment(runs_dir, monkeypatch):
    monkeypatch.setenv(ENV_TOKEN, "short")  # malformed: proves serve read it (and validates it)
    with pytest.raises(ConfigError, match="--token"):
        serve(runs_dir, host="0.0.0.0", port=0)


def test_served_on_all_interfaces_with_a_token(runs_dir):
    server = make_server(runs_dir, host="0.0.0.0", port=0, token=TOKEN)
    try:
        assert server.server_address[0] == "0.0.0.0"
    finally:
        server.server_close()


def test_default_server_binds_loopback(runs_dir):
    server = make_server(runs_dir, port=0)
    try:
        assert server.server_address[0] == "127.0.0.1"
    finally:
        server.server_close()


def test_debug_mode_is_off(runs_dir):
    app = create_app(runs_dir)
    assert not app.server.debug
    assert not app._dev_tools.ui and not app._dev_tools.hot_reload


def test_every_request_needs_the_token(runs_dir):
    add_run(runs_dir, "healthy")
    c = create_app(runs_dir, token=TOKEN).server.test_client()
    for path in ("/", "/runs/healthy", "/_dash-layout", "/_dash-dependencies", "/compare"):
        assert c.get(path).status_code == 401, path
    assert c.post("/_dash-update-component", json={}).status_code == 401
    assert c.get("/", headers={"Authorization": "Bearer wrong-token-xx"}).status_code == 401
    assert c.get("/?token=wrong-token-xx").status_code == 401
    assert c.get("/", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert c.get("/_dash-layout", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_query_token_becomes_a_cookie(runs_dir):
    add_run(runs_dir, "healthy")
    c = create_app(runs_dir, token=TOKEN).server.test_client()
    r = c.get(f"/runs/healthy?token={TOKEN}&x=1")
    assert r.status_code == 302
    assert TOKEN not in r.headers["Location"] and r.headers["Location"].endswith("/runs/healthy?x=1")
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    assert c.get("/runs/healthy").status_code == 200  # the client now sends the cookie
    assert c.get("/_dash-layout").status_code == 200

    other = create_app(runs_dir, token=TOKEN).server.test_client()  # another server: other cookie key
    other.set_cookie("torsh_tune_dash", cookie.split(";")[0].split("=", 1)[1])
    assert other.get("/").status_code == 401


def test_token_over_real_http(runs_dir, serve_runs):
    add_run(runs_dir, "healthy")
    served = serve_runs(runs_dir, token=TOKEN)
    assert requests.get(served.url + "/", timeout=10).status_code == 401
    assert requests.get(served.url + "/", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).status_code == 200
    s = requests.Session()
    assert s.get(served.url + f"/?token={TOKEN}", timeout=10).status_code == 200  # redirect followed with cookie
    assert s.get(served.url + "/runs/healthy", timeout=10).status_code == 200


@pytest.mark.parametrize("path", TRAVERSALS)
def test_traversal_is_rejected(runs_dir, serve_runs, path):
    add_run(runs_dir, "healthy")
    served = serve_runs(runs_dir)
    # http.client sends the request line as written (requests/urllib3 would drop the dot segments).
    conn = http.client.HTTPConnection("127.0.0.1", served.server.server_port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read().decode(errors="replace")
    finally:
        conn.close()
    assert r.status == 404, path
    assert "root:" not in body and "404" in body


def test_unknown_run_is_a_clear_404_page(runs_dir):
    add_run(runs_dir, "healthy")
    c = create_app(runs_dir).server.test_client()
    for path in ("/runs/no-such-run", "/runs/no-such-run/bottlenecks"):
        r = c.get(path)
        assert r.status_code == 404
        assert "No run named &#x27;no-such-run&#x27;" in r.text or "No run named 'no-such-run'" in r.text
    assert c.get("/runs/healthy").status_code == 200
    assert c.get("/runs/healthy/bottlenecks").status_code == 200


def _route(client, pathname: str) -> str:
    payload = {"output": "page.children", "outputs": {"id": "page", "property": "children"},
               "inputs": [{"id": "url", "property": "pathname", "value": pathname},
                          {"id": "url", "property": "search", "value": ""}],
               "changedPropIds": ["url.pathname"]}
    r = client.post("/_dash-update-component", json=payload)
    assert r.status_code == 200
    return r.get_data(as_text=True)


def test_forged_callback_run_ids_are_rejected(runs_dir, tmp_path):
    """The routing callback validates ids itself: a forged POST gets the 404 content."""
    add_run(runs_dir, "healthy")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "run.json").write_text(json.dumps({"status": "ok"}))
    c = create_app(runs_dir).server.test_client()
    assert "not-found" not in _route(c, "/runs/healthy")
    for pathname in ("/runs/..", "/runs/../outside", "/runs/%2e%2e", "/runs/no-such-run"):
        assert "not-found" in _route(c, pathname), pathname


def test_resolve_run_accepts_only_direct_children(runs_dir, tmp_path):
    add_run(runs_dir, "healthy")
    assert resolve_run(runs_dir, "healthy") == (runs_dir / "healthy").resolve()
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, runs_dir / "escape")  # a link that leaves the runs directory
    (runs_dir / "afile").write_text("x")
    for bad in ("..", ".", "", "../outside", "healthy/../healthy", "/etc", "%2e%2e", "a" * 200, "escape", "afile",
                "missing", None, 3):
        with pytest.raises(RunNotFound):
            resolve_run(runs_dir, bad)


def test_pages_never_write_into_run_directories(runs_dir):
    add_run(runs_dir, "healthy")
    add_run(runs_dir, "data_bound", status="running")
    before = snapshot(runs_dir)
    app = create_app(runs_dir)
    c = app.server.test_client()
    for p in ("/", "/runs/healthy", "/runs/data_bound/bottlenecks", "/compare?a=healthy&b=data_bound"):
        _route(c, p.split("?")[0])
    app.torsh_store.frames("data_bound")
    app.torsh_store.analysis("healthy")
    app.torsh_store.list_runs()
    assert snapshot(runs_dir) == before
