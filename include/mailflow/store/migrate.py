"""Schema migrations of the send log: ``store/sql/migrations/NNNN_name.sql``, each applied once, in order.

One step applies them (``mailflow migrate``, the deploy's migrate job); tasks never migrate, they call
:func:`require_current` and fail clearly when the database is behind the code (docs/operations.md,
"Upgrading").

Safe on a live database:

* **One runner at a time.** A session-level advisory lock (key ``LOCK_KEY``) serialises runners;
  a second runner polls for it (every 0.5 s), then finds nothing left to do. Every applied version is recorded in
  ``mail.schema_migrations``. A version missing there is applied, whatever its number, so a
  migration that lands after a higher number (parallel branches) is applied too.
* **Transactional files** (the default) run in one transaction with their record and with a short
  ``lock_timeout`` (``lock_timeout_seconds``, 1 s): a statement that needs a strong lock on a busy
  table gives up instead of queueing every reader behind it, and the file is retried
  (``lock_retries`` times, with a growing pause). Such files must only take brief locks (add a
  column, create a table or view); never build an index on a large table in one.
* **Non-transactional files** start with the line ``-- migrate: no-transaction``. Their statements
  (separated by ``;`` at the end of a line) run one by one in autocommit mode, for
  ``CREATE INDEX CONCURRENTLY`` and ``DROP INDEX CONCURRENTLY`` (PostgreSQL refuses them inside a
  transaction block). They must be idempotent (``if not exists`` / ``if exists``). Resumable: an
  interrupted concurrent build leaves an INVALID index behind (PostgreSQL docs, "Building Indexes
  Concurrently"); before each ``create index concurrently NAME``, an invalid index of that name is
  dropped concurrently and rebuilt, a valid one is kept. The file's record is written after its
  last statement, so an interrupted file runs again from its start.
* **Python steps.** A line ``-- migrate: python <name>`` in a non-transactional file runs the
  backfill step ``<name>`` of :mod:`mailflow.store.backfill` at that point, for values PostgreSQL
  cannot compute (0018's mailbox keys). A step must be idempotent and resumable, like the file.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from importlib import resources

import psycopg
from psycopg import sql as pgsql
from psycopg.pq import TransactionStatus

log = logging.getLogger(__name__)

LOCK_KEY = 7_406_215_001  # arbitrary, fixed: pg_advisory_lock key of the migrator
NO_TRANSACTION = "-- migrate: no-transaction"
"""First line of a migration file whose statements must run outside a transaction."""
PYTHON_STEP = "-- migrate: python "
"""Prefix of a line of a non-transactional file that runs a named step of ``mailflow.store.backfill``."""
_FILE = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
_STATEMENT_END = re.compile(r";[ \t]*(?:--[^\n]*)?$", re.MULTILINE)
_CREATE_INDEX = re.compile(
    r"^\s*create\s+(?:unique\s+)?index\s+concurrently\s+(?:if\s+not\s+exists\s+)?(?P<name>\w+)\s+on\s+"
    r"(?:only\s+)?(?:(?P<schema>\w+)\.)?\w+", re.IGNORECASE)


class SchemaNotCurrent(RuntimeError):
    """The send-log database is behind this code: run ``mailflow migrate`` (the message names the files)."""


@dataclass(frozen=True)
class Migration:
    """One file of ``store/sql/migrations``: ``version`` (its NNNN), ``name`` (file name), ``sql`` (text),
    ``transactional`` (False when its first line is :data:`NO_TRANSACTION`)."""

    version: int
    name: str
    sql: str
    transactional: bool

    def statements(self) -> list[str]:
        """The file's statements (comment-only pieces dropped), split on ``;`` at the end of a line.

        Only for non-transactional files, which hold simple statements (no ``$$`` bodies).
        """
        out = []
        for piece in _STATEMENT_END.split(self.sql):
            code: list[str] = []
            for line in piece.splitlines():
                if line.strip().lower().startswith(PYTHON_STEP):
                    if "\n".join(code).strip():
                        out.append("\n".join(code).strip())
                    code = []
                    out.append(PYTHON_STEP + line.strip()[len(PYTHON_STEP):].strip())
                elif not line.strip().startswith("--"):
                    code.append(line)
            if "\n".join(code).strip():
                out.append("\n".join(code).strip())
        return out


def migration_files() -> list[Migration]:
    """Every migration of the package, sorted by version.

    :raises ValueError: if two files share a version number, or a non-transactional file holds a
        ``$$`` body (it could not be split into statements safely).
    """
    folder = resources.files("mailflow.store.sql").joinpath("migrations")
    found: dict[int, Migration] = {}
    for entry in folder.iterdir():
        m = _FILE.match(entry.name)
        if not m:
            continue
        version = int(m.group(1))
        if version in found:
            raise ValueError(f"two migrations share version {version}: {found[version].name} and {entry.name}")
        text = entry.read_text(encoding="utf-8")
        first = text.split("\n", 1)[0].strip().lower()
        migration = Migration(version, entry.name, text, transactional=first != NO_TRANSACTION)
        if not migration.transactional and "$$" in text:
            raise ValueError(f"{entry.name}: a no-transaction migration cannot hold a $$ body")
        found[version] = migration
    return [found[v] for v in sorted(found)]


def applied_versions(conn: psycopg.Connection) -> set[int] | None:
    """Versions recorded in ``mail.schema_migrations``, or None if the table does not exist."""
    exists = conn.execute("select to_regclass('mail.schema_migrations') is not null").fetchone()
    if not exists or not exists[0]:
        return None
    return {int(r[0]) for r in conn.execute("select version from mail.schema_migrations").fetchall()}


def pending(conn: psycopg.Connection) -> list[Migration]:
    """The package's migrations not yet recorded in the database (all of them on an empty one)."""
    done = applied_versions(conn) or set()
    return [m for m in migration_files() if m.version not in done]


def require_current(conn: psycopg.Connection) -> None:
    """Check that every migration of this code is applied; tasks call this instead of migrating.

    One indexed read; leaves ``conn`` idle (the read is committed or rolled back if it opened a
    transaction). A database *ahead* of the code (a migration this code does not know) is accepted:
    migrations are additive, so old code keeps running during a rolling deploy. One exception:
    after 0018 an address suppression must carry its mailbox key, so the previous release's
    deliverability feedback cannot record a bounce (its poll fails on that row, rolled back, and
    the email is polled again by the new code): pause the feedback DAG while 0018 runs and until
    the rollout is done, then ``mailflow migrate --backfill`` (:func:`rerun_backfills`) keys what
    the old workers wrote meanwhile (docs/operations.md, "Upgrading").

    :raises SchemaNotCurrent: naming the missing files and the command that applies them.
    """
    started_idle = conn.info.transaction_status == TransactionStatus.IDLE
    try:
        missing = pending(conn)
    finally:
        if started_idle and conn.info.transaction_status != TransactionStatus.IDLE:
            conn.rollback()
    if missing:
        names = ", ".join(m.name for m in missing)
        raise SchemaNotCurrent(
            f"the send-log database {conn.info.dbname!r} is behind this code: {len(missing)} migration(s) "
            f"not applied ({names}). Run `mailflow migrate --dsn ...` (the deploy's migrate step, "
            "docs/operations.md 'Upgrading') before the tasks; tasks never migrate on their own.")


def migrate(conn: psycopg.Connection, *, target: int | None = None, lock_timeout_seconds: float = 1.0,
            lock_retries: int = 10) -> list[str]:
    """Apply the pending migrations (up to version ``target`` inclusive, default all); return the
    file names applied, in order (empty if up to date).

    :param conn: an idle psycopg 3 connection; it is switched to autocommit (each transactional
        file is an explicit transaction, each statement of a no-transaction file its own).
    :param lock_timeout_seconds: ``lock_timeout`` of transactional files (s); 0 = wait forever.
    :param lock_retries: further attempts of a transactional file whose lock wait timed out.
    :raises ValueError: if ``conn`` is inside a transaction.
    :raises psycopg.errors.LockNotAvailable: if a file still could not get its locks after the retries.
    :raises psycopg.Error: from a failing file (a transactional file leaves nothing behind; a
        no-transaction file is resumed by the next run).
    """
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise ValueError("migrate() needs an idle connection (it runs statements outside a transaction)")
    conn.autocommit = True
    # Poll instead of waiting inside pg_advisory_lock(): a statement waiting for the lock is an open
    # transaction, and the holder's CREATE INDEX CONCURRENTLY waits for every open transaction
    # (deadlock).
    _take_lock(conn)
    try:
        conn.execute("create schema if not exists mail")
        conn.execute("create table if not exists mail.schema_migrations ("
                     " version integer primary key, name text not null,"
                     " applied_at timestamptz not null default now())")
        applied: list[str] = []
        for m in pending(conn):
            if target is not None and m.version > target:
                continue
            t0 = time.monotonic()
            if m.transactional:
                _apply_transactional(conn, m, lock_timeout_seconds, lock_retries)
            else:
                _apply_concurrently(conn, m)
            log.info("applied %s in %.1f s", m.name, time.monotonic() - t0)
            applied.append(m.name)
        return applied
    finally:
        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.rollback()
        conn.execute("select pg_advisory_unlock(%s)", (LOCK_KEY,))


def _take_lock(conn: psycopg.Connection) -> None:
    waited = 0
    while not conn.execute("select pg_try_advisory_lock(%s)", (LOCK_KEY,)).fetchone()[0]:  # type: ignore[index]
        if waited % 60 == 0:
            log.info("another migrator holds the migration lock; waiting for it (%d s so far)", waited // 2)
        waited += 1
        time.sleep(0.5)


def rerun_backfills(conn: psycopg.Connection) -> list[str]:
    """Run again, in version order, the Python backfill steps (``-- migrate: python <name>``) of
    every migration already applied, under the migration lock; return the steps run.

    For a rolling deploy: workers of the previous release that kept running while a migration was
    applied may have written rows the step would have filled (0018: send-log rows with no mailbox
    key, or 0007's ``lower()`` key). The steps are idempotent and resumable, so running them after
    the rollout keys what was written meanwhile and changes nothing else (``mailflow migrate
    --backfill``, docs/operations.md "Upgrading").

    :param conn: an idle psycopg 3 connection; it is switched to autocommit.
    :raises ValueError: if ``conn`` is inside a transaction, or a file names an unknown step.
    :raises psycopg.Error: from a failing step (it is simply run again).
    """
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise ValueError("rerun_backfills() needs an idle connection")
    conn.autocommit = True
    _take_lock(conn)
    try:
        done = applied_versions(conn) or set()
        ran: list[str] = []
        for m in migration_files():
            if m.version not in done:
                continue
            for statement in m.statements():
                if statement.startswith(PYTHON_STEP):
                    ran.append(_run_step(conn, m, statement, again=True))
        return ran
    finally:
        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.rollback()
        conn.execute("select pg_advisory_unlock(%s)", (LOCK_KEY,))


def _run_step(conn: psycopg.Connection, m: Migration, statement: str, *, again: bool = False) -> str:
    """Run the Python backfill step a ``-- migrate: python <name>`` line of ``m`` names; return its name.

    :raises ValueError: if :mod:`mailflow.store.backfill` has no step of that name."""
    from mailflow.store.backfill import STEPS

    name = statement[len(PYTHON_STEP):]
    if name not in STEPS:
        raise ValueError(f"{m.name}: no backfill step named {name!r} in mailflow.store.backfill")
    log.info("%s: running the backfill step %s%s", m.name, name, " again" if again else "")
    STEPS[name](conn)
    return name


def _record(conn: psycopg.Connection, m: Migration) -> None:
    conn.execute("insert into mail.schema_migrations (version, name) values (%s, %s) on conflict do nothing",
                 (m.version, m.name))


def _apply_transactional(conn: psycopg.Connection, m: Migration, lock_timeout: float, retries: int) -> None:
    for attempt in range(retries + 1):
        try:
            with conn.transaction():
                conn.execute("select set_config('lock_timeout', %s, true)", (f"{int(lock_timeout * 1000)}ms",))
                conn.execute(m.sql.encode())  # trusted file from the package
                _record(conn, m)
            return
        except psycopg.errors.LockNotAvailable:
            if attempt == retries:
                raise
            pause = min(30.0, 0.5 * 2**attempt)
            log.warning("%s: a lock was not granted within %.1f s (busy table); retrying in %.1f s",
                        m.name, lock_timeout, pause)
            time.sleep(pause)


def _apply_concurrently(conn: psycopg.Connection, m: Migration) -> None:
    conn.execute("set lock_timeout = 0")  # a concurrent build may wait for old transactions; it blocks nobody
    try:
        for statement in m.statements():
            if statement.startswith(PYTHON_STEP):
                _run_step(conn, m, statement)
                continue
            index = _CREATE_INDEX.match(statement)
            if index is not None:
                schema = index.group("schema") or "public"
                state = conn.execute(
                    "select i.indisvalid from pg_index i join pg_class c on c.oid = i.indexrelid"
                    " join pg_namespace n on n.oid = c.relnamespace where n.nspname = %s and c.relname = %s",
                    (schema, index.group("name"))).fetchone()
                if state is not None and state[0]:
                    log.info("%s: index %s.%s already built", m.name, schema, index.group("name"))
                    continue
                if state is not None:
                    log.warning("%s: index %s.%s is INVALID (an interrupted build): dropping and rebuilding it",
                                m.name, schema, index.group("name"))
                    conn.execute(pgsql.SQL("drop index concurrently if exists {}").format(
                        pgsql.Identifier(schema, index.group("name"))))
            conn.execute(statement.encode())  # trusted file from the package
        _record(conn, m)
    finally:
        conn.execute("reset lock_timeout")
