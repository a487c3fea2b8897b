"""Apply the numbered migrations in ``sql/migrations`` in order, each once, recorded in a table.

Safe to run twice and from several processes at once: a transaction-scoped advisory lock
serialises runners, and every applied version is recorded in ``mail.schema_migrations``.
"""

from __future__ import annotations

import re
from importlib import resources

import psycopg

_LOCK_KEY = 7_406_215_001  # arbitrary, fixed: pg_advisory_xact_lock key for migrations
_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def migration_files() -> list[tuple[int, str, str]]:
    """Return ``[(version, filename, sql)]`` sorted by version.

    :raises ValueError: if two files share a version number.
    """
    folder = resources.files("mailflow.sql").joinpath("migrations")
    found: dict[int, tuple[int, str, str]] = {}
    for entry in folder.iterdir():
        m = _FILE.match(entry.name)
        if not m:
            continue
        version = int(m.group(1))
        if version in found:
            raise ValueError(f"two migrations share version {version}: {found[version][1]} and {entry.name}")
        found[version] = (version, entry.name, entry.read_text(encoding="utf-8"))
    return [found[v] for v in sorted(found)]


def migrate(conn: psycopg.Connection) -> list[str]:
    """Apply pending migrations on ``conn``; return the filenames applied (empty if up to date).

    Each migration runs in its own transaction together with its record, so a failing file
    leaves the schema at the previous version.
    """
    applied: list[str] = []
    for version, name, sql in migration_files():
        with conn.transaction():
            conn.execute("select pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            conn.execute("create schema if not exists mail")
            conn.execute(
                "create table if not exists mail.schema_migrations ("
                " version integer primary key, name text not null,"
                " applied_at timestamptz not null default now())"
            )
            done = conn.execute("select 1 from mail.schema_migrations where version = %s", (version,)).fetchone()
            if done:
                continue
            conn.execute(sql)  # trusted file from the package
            conn.execute("insert into mail.schema_migrations (version, name) values (%s, %s)", (version, name))
            applied.append(name)
    return applied
