"""How long do readers and writers of ``mail.send_log`` wait while the send log is upgraded from
migration 0003 to head? (the goal: "at 1M rows, a reader's wait during the upgrade is under 1 s")

    PYTHONPATH=include python scripts/migration_lock_wait.py --dsn postgresql://postgres@127.0.0.1/postgres --rows 1000000

Creates a scratch database, applies 0001-0003 from the package on PYTHONPATH (recorded in
``mail.schema_migrations`` as every version of the migrator does), fills ``mail.send_log`` with
``--rows`` rows by ``generate_series`` (80 % sent, 10 % failed, 10 % cancelled, 20 campaigns), then
runs ``mailflow.store.migrate.migrate(conn)`` (the migrator of the package on PYTHONPATH, so the same
script measures an older checkout too) while one thread reads one row by primary key and another
updates one row, each in a tight loop of autocommit statements. Prints JSON: the longest single
read and write (s), how many took over 1 s, the migration's duration and the files it applied.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
import uuid
from importlib import resources
from typing import Any

import psycopg

from mailflow_dev import devenv

FILL = """
insert into mail.send_log (user_id, campaign, kind, email, status, minted_at, claimed_at, sent_at,
                           provider_message_id, idempotency_key, batch_index, run_id, attempts)
select g, 'campaign_' || (g %% 20), 'lifecycle', 'user' || g || '@example.com',
       case when g %% 10 < 8 then 'sent' when g %% 10 = 8 then 'failed' else 'cancelled' end,
       now() - make_interval(secs => g), now() - make_interval(secs => g),
       case when g %% 10 < 8 then now() - make_interval(secs => g) end,
       case when g %% 10 < 8 then 'msg-' || g end,
       'key-' || (g / 100), (g %% 100)::smallint, 'scheduled__' || (g / 3600), 1
from generate_series(1, %(rows)s) as g
"""


def _apply_raw_up_to(conn: psycopg.Connection, last: int) -> None:
    folder = resources.files("mailflow.store.sql").joinpath("migrations")
    conn.execute("create schema if not exists mail")
    conn.execute("create table if not exists mail.schema_migrations (version integer primary key,"
                 " name text not null, applied_at timestamptz not null default now())")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql") or int(entry.name[:4]) > last:
            continue
        with conn.transaction():
            conn.execute(entry.read_text(encoding="utf-8").encode())
            conn.execute("insert into mail.schema_migrations (version, name) values (%s, %s)",
                         (int(entry.name[:4]), entry.name))


class _Prober(threading.Thread):
    """Runs one statement in a loop on its own autocommit connection; keeps the longest duration."""

    def __init__(self, dsn: str, statement: str, rows: int):
        super().__init__(daemon=True)
        self.dsn, self.statement, self.rows = dsn, statement, rows
        self.stop = threading.Event()
        self.max_wait = 0.0
        self.count = 0
        self.over_1s = 0
        self.error: str | None = None

    def run(self) -> None:
        rng = random.Random(1)
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    t0 = time.perf_counter()
                    conn.execute(self.statement, {"id": rng.randint(1, self.rows)}).fetchall()
                    dt = time.perf_counter() - t0
                    self.count += 1
                    self.max_wait = max(self.max_wait, dt)
                    self.over_1s += dt > 1.0
                    time.sleep(0.005)
        except Exception as exc:  # reported, not swallowed
            self.error = f"{type(exc).__name__}: {exc}"


def measure(admin_dsn: str, rows: int, *, keep: bool = False) -> dict[str, Any]:
    """Fill a scratch database to ``rows`` send-log rows at version 0003, migrate it to head under
    read and write probes, and return the figures (seconds). The database is dropped unless ``keep``."""
    from mailflow.store.migrate import migrate  # the migrator of the checkout on PYTHONPATH

    name = f"mailflow_lockwait_{uuid.uuid4().hex[:6]}"
    dsn = devenv.create_database(admin_dsn, name, exist_ok=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            _apply_raw_up_to(conn, 3)
            t0 = time.perf_counter()
            conn.execute(FILL, {"rows": rows})
            conn.execute("vacuum analyze mail.send_log")
            fill_seconds = time.perf_counter() - t0
            reader = _Prober(dsn, "select id, email, status from mail.send_log where id = %(id)s", rows)
            writer = _Prober(dsn, "update mail.send_log set attempts = attempts + 1 where id = %(id)s returning id",
                             rows)
            reader.start()
            writer.start()
            time.sleep(0.3)
            t0 = time.perf_counter()
            applied = migrate(conn)
            migrate_seconds = time.perf_counter() - t0
            time.sleep(0.3)
            for p in (reader, writer):
                p.stop.set()
            for p in (reader, writer):
                p.join(timeout=30)
        return {
            "rows": rows, "fill_seconds": round(fill_seconds, 1), "migrate_seconds": round(migrate_seconds, 2),
            "applied": applied,
            "reader_max_wait_seconds": round(reader.max_wait, 3), "reader_queries": reader.count,
            "reader_over_1s": reader.over_1s, "reader_error": reader.error,
            "writer_max_wait_seconds": round(writer.max_wait, 3), "writer_statements": writer.count,
            "writer_over_1s": writer.over_1s, "writer_error": writer.error,
        }
    finally:
        if not keep:
            devenv.drop_database(admin_dsn, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default="postgresql://postgres@127.0.0.1:5432/postgres", help="maintenance database")
    p.add_argument("--rows", type=int, default=1_000_000)
    args = p.parse_args()
    print(json.dumps(measure(args.dsn, args.rows), indent=2))


if __name__ == "__main__":
    main()
