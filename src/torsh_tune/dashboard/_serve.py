"""`serve`: run the dashboard on a real HTTP server, refusing unsafe bindings."""

from __future__ import annotations

import errno
import os
import socket
import sys
from typing import Any

from ..errors import invalid
from ._app import create_app
from ._security import ENV_TOKEN, check_bind

__all__ = ["make_server", "serve"]


def make_server(runs_dir: str | os.PathLike[str], *, host: str = "127.0.0.1", port: int = 8050,
                token: str | None = None, refresh_s: float = 2.0) -> Any:
    """A threaded werkzeug server for the dashboard, bound but not yet serving.

    `server.serve_forever()` serves; `server.shutdown()` stops it from another thread;
    `server.server_port` is the bound port (pass port=0 for a free one).

    Raises:
        ConfigError: a non-loopback `host` without a token, a malformed token, a port outside
            0-65535, or an address that cannot be bound (in use, not this machine's, unknown).
    """
    from werkzeug.serving import make_server as _make_server

    check_bind(host, token)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise invalid("the dashboard port", "a TCP port 1-65535 (0: any free one)", port)
    app = create_app(runs_dir, token=token, refresh_s=refresh_s)
    sock = _bind(host, port)
    try:  # werkzeug serves a duplicate of the bound socket
        server = _make_server(host, port, app.server, threaded=True, fd=sock.fileno())
    finally:
        sock.close()
    server.server_port = server.port  # what HTTPServer.server_bind sets, skipped for a given socket
    server.dash_app = app
    return server


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, bound here so that a failure is one line, not werkzeug's
    message and sys.exit(1) (nor a port above 65535 silently wrapped by getaddrinfo)."""
    from werkzeug.serving import LISTEN_QUEUE, select_address_family

    family = select_address_family(host, port)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise invalid("the dashboard host", "an address or a name this machine resolves",
                      f"{host} ({exc.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as werkzeug: a port in TIME_WAIT is free
        sock.bind(address)
        sock.listen(LISTEN_QUEUE)
    except OSError as exc:
        sock.close()
        if exc.errno in (errno.EADDRINUSE, errno.EACCES):
            raise invalid("the dashboard port", f"free to bind on {host}", f"{port} ({exc.strerror})") from None
        raise invalid("the dashboard host", "an address of this machine", f"{host} ({exc.strerror})") from None
    return sock


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
        ConfigError: a non-loopback `host` without a token, a malformed token, or an
            address that cannot be bound (see `make_server`).

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
