"""Where a study lives: the Optuna storage behind `--storage`.

    (none)                          sqlite:///STUDY_DIR/study.db (one machine)
    journal:PATH                    an Optuna journal file (a file system every tuner mounts)
    postgresql://USER@HOST:PORT/DB  a database server every tuner reaches (any SQLAlchemy URL
                                    whose driver is installed: `pip install torsh-tune[postgres]`)

`check_storage` is the command line's look before anything is created (a bad URL, a
missing driver, an unreachable server, an unusable journal path: one line, exit 2, no study
directory left behind); `open_storage` opens it for the study. Passwords never reach a
message or result.json: put them in ~/.pgpass or PGPASSWORD, or they are shown as ***.

Example:
    >>> url, storage = open_storage("journal:/shared/study.log", Path("runs/tune-1"))  # doctest: +SKIP
    >>> optuna.create_study(storage=storage, load_if_exists=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import invalid
from ..rundir import StudyDir

__all__ = ["JOURNAL_PREFIX", "check_storage", "open_storage", "shown_url"]

JOURNAL_PREFIX = "journal:"
#: Seconds a database server may take to accept the connection (libpq's connect_timeout).
CONNECT_TIMEOUT_S = 10
_URL_RULE = ("an Optuna storage URL: sqlite:///FILE, postgresql://USER@HOST:PORT/DB (or another SQLAlchemy "
             "URL whose driver is installed) or journal:PATH")


def shown_url(storage: str) -> str:
    """`storage` as it may be printed or recorded: a URL's password replaced by ***."""
    if storage.startswith(JOURNAL_PREFIX):
        return storage
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(storage).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return storage


def check_storage(storage: str) -> None:
    """Raise a one-line `ConfigError` unless `storage` can hold a study; creates nothing.

    A journal file's directory must exist and the file (when it exists) be a readable,
    writable file; a SQLite file's directory must exist; a server must accept a connection.

    Raises:
        ConfigError: `--storage must be <rule>, but got <value>`.
    """
    if storage.startswith(JOURNAL_PREFIX):
        _check_journal(storage)
        return
    url = _parse(storage)
    if url.get_backend_name() == "sqlite":
        _check_sqlite(storage, url.database)
        return
    engine = _engine(storage, url)
    try:
        with engine.connect():
            pass
    except Exception as exc:  # the driver's own error types: OperationalError, InterfaceError, ...
        raise invalid("--storage", "a database that accepts a connection", f"{shown_url(storage)} ({_one_line(exc)})") from None
    finally:
        engine.dispose()


def open_storage(storage: str | None, study_dir: Path) -> tuple[str, Any]:
    """(the URL to record, an Optuna storage) for `storage`; None is SQLite in `study_dir`.

    Raises:
        ConfigError: `storage` cannot be opened (the same rules as `check_storage`).
    """
    import optuna

    if storage is None:
        storage = StudyDir(study_dir).sqlite_url()
    if storage.startswith(JOURNAL_PREFIX):
        path = _check_journal(storage)
        try:
            backend = optuna.storages.journal.JournalFileBackend(str(path))
        except OSError as exc:
            raise invalid("--storage", "journal:PATH with a writable file", f"{storage} ({exc.strerror})") from None
        return storage, optuna.storages.JournalStorage(backend)
    url = _parse(storage)
    engine_kwargs: dict[str, Any] = {}
    if url.get_backend_name() == "sqlite":
        _check_sqlite(storage, url.database)
    else:
        _engine(storage, url).dispose()  # the driver is there: one line here, not optuna's ImportError
        engine_kwargs = _server_engine_kwargs(url)
    try:
        return shown_url(storage), optuna.storages.RDBStorage(storage, engine_kwargs=engine_kwargs)
    except Exception as exc:  # sqlalchemy's and the driver's errors (connection refused, bad credentials)
        raise invalid("--storage", "a database that accepts a connection", f"{shown_url(storage)} ({_one_line(exc)})") from None


def _check_journal(storage: str) -> Path:
    text = storage[len(JOURNAL_PREFIX):]
    if not text:
        raise invalid("--storage", "journal:PATH with a file path", storage)
    path = Path(text).expanduser()
    if path.is_dir():
        raise invalid("--storage", "journal:PATH naming a file, not a directory", storage)
    if path.exists():
        if not os.access(path, os.R_OK | os.W_OK):
            raise invalid("--storage", "journal:PATH naming a readable and writable file", storage)
    elif not path.parent.is_dir():
        raise invalid("--storage", "journal:PATH in an existing directory", storage)
    elif not os.access(path.parent, os.W_OK | os.X_OK):
        raise invalid("--storage", "journal:PATH in a writable directory", storage)
    return path


def _check_sqlite(storage: str, database: str | None) -> None:
    if not database or database == ":memory:":
        raise invalid("--storage", "sqlite:///FILE with a file path (an in-memory study dies with the tuner)", storage)
    parent = Path(database).expanduser().parent
    if not parent.is_dir():
        raise invalid("--storage", "sqlite:///FILE in an existing directory", storage)


def _parse(storage: str) -> Any:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(storage)
    except (ArgumentError, ValueError):
        raise invalid("--storage", _URL_RULE, storage) from None


def _engine(storage: str, url: Any) -> Any:
    """A SQLAlchemy engine for a server URL (no connection yet): a dialect and a driver that exist."""
    import sqlalchemy
    from sqlalchemy.exc import NoSuchModuleError

    try:
        return sqlalchemy.create_engine(url, **_server_engine_kwargs(url))
    except NoSuchModuleError:
        raise invalid("--storage", _URL_RULE, shown_url(storage)) from None
    except ImportError as exc:
        extra = " (pip install torsh-tune[postgres])" if url.get_backend_name() == "postgresql" else ""
        raise invalid("--storage", f"a URL whose database driver is installed{extra}",
                      f"{shown_url(storage)} (no module {exc.name or exc})") from None


def _server_engine_kwargs(url: Any) -> dict[str, Any]:
    """Connections that survive a long trial (pre-ping) and give up on a dead server in seconds."""
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.get_backend_name() == "postgresql" and url.get_driver_name() in ("psycopg2", "psycopg") \
            and "connect_timeout" not in url.query:
        kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    return kwargs


def _one_line(exc: BaseException) -> str:
    """The driver's message (not SQLAlchemy's wrapper with its SQL and link), first line only."""
    cause = getattr(exc, "orig", None) or exc
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"
