"""What the dashboard lets in: loopback-or-token binding, token checks, run-id validation.

The dashboard shows the files of every run under one directory, so three rules keep it
from becoming a file server for anyone on the network:

- it binds 127.0.0.1 unless a token is given (`check_bind`);
- with a token, every request must carry it (`install_guard`): an
  `Authorization: Bearer <token>` header, or `?token=<token>` once, which is traded for an
  HttpOnly cookie and a redirect that drops the token from the address bar;
- a run id names a direct child directory of the runs directory and nothing else
  (`resolve_run`), and only the app's own routes are served (everything else is a 404).
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import os
import re
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from ..errors import invalid

__all__ = [
    "COOKIE_NAME",
    "ENV_TOKEN",
    "RUN_ID_RE",
    "RunNotFound",
    "check_bind",
    "check_token",
    "install_guard",
    "is_loopback",
    "resolve_run",
]

#: Environment variable read by `serve` when no token is passed.
ENV_TOKEN = "TORSH_TUNE_DASH_TOKEN"
#: Cookie that carries proof of the token after `?token=` was accepted once.
COOKIE_NAME = "torsh_tune_dash"
#: What a run id may look like: the names `rundir.new_run_dir` creates (no '/', no '..').
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MIN_TOKEN_CHARS = 8
# Paths Dash itself serves to the browser (renderer bundles, layout, callbacks, favicon).
_DASH_PREFIXES = ("/_dash-", "/_favicon.ico")


class RunNotFound(LookupError):
    """A run id that is malformed or names no run directory under the runs directory."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run {run_id!r} in the runs directory")
        self.run_id = run_id


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name could resolve anywhere: treat it as off-loopback


def check_token(token: str | None) -> str | None:
    """Validate a token (None means no token); return it unchanged.

    Raises:
        ConfigError: the token is shorter than 8 characters or contains whitespace.
    """
    if token is None:
        return None
    if len(token) < _MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise invalid("--token", f"at least {_MIN_TOKEN_CHARS} characters without whitespace",
                      f"{len(token)} characters")
    return token


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve off-loopback without a token.

    Raises:
        ConfigError: `host` is not a loopback address and `token` is None, or the token is
            malformed.
    """
    check_token(token)
    if token is None and not is_loopback(host):
        raise invalid("--host", f"a loopback address unless --token (or {ENV_TOKEN}) is set", host)


def resolve_run(runs_dir: str | os.PathLike[str], run_id: Any) -> Path:
    """The run directory named `run_id`, checked to be a direct child of `runs_dir`.

    Rejects anything that is not a plain name (separators, '..', percent-encoded or
    double-encoded forms all fail the pattern) and anything whose resolved path (symlinks
    followed) leaves the runs directory.

    Raises:
        RunNotFound: malformed id, or no such run directory.
    """
    if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
        raise RunNotFound(str(run_id)[:200])
    root = Path(runs_dir).resolve()
    path = (root / run_id).resolve()
    if path.parent != root or not path.is_dir():
        raise RunNotFound(run_id)
    return path


def _cookie_value(secret: bytes, token: str) -> str:
    return hmac.new(secret, token.encode(), hashlib.sha256).hexdigest()


def install_guard(server: Any, *, token: str | None, page_paths: tuple[re.Pattern[str], ...],
                  runs_dir: str | os.PathLike[str]) -> None:
    """Check every request of the Flask `server`: token (when set), route allow-list, run ids.

    Args:
        server: the Dash app's Flask server.
        token: the shared secret, or None (loopback only; `check_bind` enforces that).
        page_paths: patterns of the app's page paths; group "run" (when present) is a run id
            that must resolve under `runs_dir`.
        runs_dir: the runs directory.
    """
    from flask import Response, redirect, request

    # The cookie proves the token without storing it: an HMAC under a per-process key,
    # so cookies die with the server.
    secret = secrets.token_bytes(32)
    expected_cookie = _cookie_value(secret, token) if token is not None else ""

    def authorized() -> bool:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer ") and hmac.compare_digest(header[7:].strip().encode(), token.encode()):
            return True
        cookie = request.cookies.get(COOKIE_NAME, "")
        return bool(cookie) and hmac.compare_digest(cookie.encode(), expected_cookie.encode())

    @server.before_request
    def _guard() -> Any:
        if token is not None and not authorized():
            supplied = request.args.get("token")
            if supplied is not None and hmac.compare_digest(supplied.encode(), token.encode()):
                rest = [(k, v) for k, v in request.args.items(multi=True) if k != "token"]
                resp = redirect(request.path + (f"?{urlencode(rest)}" if rest else ""), code=302)
                resp.set_cookie(COOKIE_NAME, expected_cookie, httponly=True, samesite="Strict", path="/")
                return resp
            return Response("401 Unauthorized: this dashboard needs its token "
                            "(Authorization: Bearer <token>, or ?token=<token> once)\n",
                            status=401, mimetype="text/plain", headers={"WWW-Authenticate": "Bearer"})
        path = request.path
        if path.startswith(_DASH_PREFIXES):
            return None
        for pattern in page_paths:
            m = pattern.fullmatch(path)
            if m is None:
                continue
            run_id = m.groupdict().get("run")
            if run_id is None:
                return None
            try:
                resolve_run(runs_dir, run_id)
                return None
            except RunNotFound:
                return not_found_response(f"No run named {run_id!r} in the runs directory.")
        return not_found_response(f"No page at {path!r}.")

    @server.after_request
    def _headers(resp: Any) -> Any:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("X-Frame-Options", "DENY")
        resp.headers.setdefault("Referrer-Policy", "no-referrer")
        return resp


def not_found_response(message: str) -> Any:
    """A small, self-contained 404 page (the message is HTML-escaped)."""
    from flask import Response

    body = (
        "<!DOCTYPE html><html><head><title>404 - torsh-tune dashboard</title></head><body>"
        "<h1>404: not found</h1>"
        f"<p id='not-found-message'>{html.escape(message[:300])}</p>"
        "<p><a href='/'>Back to the runs list</a></p></body></html>"
    )
    return Response(body, status=404, mimetype="text/html")
