"""`serve`: run the dashboard on a real HTTP server, refusing unsafe bindings."""

from __future__ import annotations

import os
import sys
from typing import Any

from ._app import create_app
from ._security import ENV_TOKEN, check_bind

__all__ = ["make_server", "serve"]


def make_server(runs_dir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8050,
                token: str | None = None, refresh_s: float = 2.0) -> Any:
    """A threaded werkzeug server for the dashboard, bound but not yet serving.

    `server.serve_forever()` serves; `server.shutdown()` stops it from another thread;
    `server.server_port` is the bound port (pass port=0 for a free one).

    Raises:
        ConfigError: a non-loopback `host` without a token, or a malformed token.
    """
    from werkzeug.serving import make_server as _make_server

    check_bind(host, token)
    app = create_app(runs_dir, token=token, refresh_s=refresh_s)
    server = _make_server(host, port, app.server, threaded=True)
    server.dash_app = app
    return server


def serve(runs_dir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8050,
          token: str | None = None, refresh_s: float = 2.0) -> None:
    """Serve the dashboard until interrupted (Ctrl-C). Dash debug mode is never on.

    Args:
        runs_dir: the runs directory to browse (read-only).
        host: address to bind; anything but loopback requires a token.
        port: TCP port.
        token: shared secret for every request; default the TORSH_TUNE_DASH_TOKEN
            environment variable, if set.
        refresh_s: how often live pages poll.

    Raises:
        ConfigError: a non-loopback `host` without a token, or a malformed token.

    Example:
        >>> serve("torsh-runs", port=8050)  # doctest: +SKIP
    """
    if token is None:
        token = os.environ.get(ENV_TOKEN) or None
    server = make_server(runs_dir, host=host, port=port, token=token, refresh_s=refresh_s)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_port}/" + ("?token=<token>" if token else "")
    print(f"torsh-tune dashboard: {url} (runs in {os.fspath(runs_dir)}); Ctrl-C stops it", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
