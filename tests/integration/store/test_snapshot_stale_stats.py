"""The audience snapshot plans defensively while the send log's statistics are stale (issue 16):
``lifecycle.send_log_stats_stale`` says so after a bulk load that ANALYZE has not seen, and then the
snapshot transaction runs without Materialize (a materialised campaign range filtered per candidate
took 240 s for 1M candidates in ``make bench``'s memory suite), while fresh statistics leave the
planner's choice alone. Real PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest

from mailflow.store.migrate import migrate
from mailflow.store.sql import query
from mailflow_dev import devenv


@pytest.fixture
def db(pg_admin_dsn: str) -> Iterator[psycopg.Connection]:
    name = f"mailflow_stale_{uuid.uuid4().hex[:6]}"
    dsn = devenv.create_database(pg_admin_dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            yield conn
    finally:
        devenv.drop_database(pg_admin_dsn, name)


def stale(conn: psycopg.Connection) -> bool:
    conn.execute("select pg_stat_force_next_flush()")  # this session's counters, visible now
    conn.execute("select 1")
    conn.execute("select pg_stat_clear_snapshot()")
    row = conn.execute(query("lifecycle", "send_log_stats_stale")).fetchone()
    assert row is not None
    return bool(row[0])


def test_stats_are_stale_after_a_load_analyze_has_not_seen_and_fresh_after_it(db: psycopg.Connection) -> None:
    db.execute("analyze mail.send_log")
    assert stale(db) is False  # analysed, empty, unchanged
    db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
               " select g, 'first_practice', 'lifecycle', 'u' || g || '@example.com', 'sent', now(), 'p' || g"
               " from generate_series(1, 5000) g")
    assert stale(db) is True  # 5,000 changes against an analysed size of 0
    db.execute("analyze mail.send_log")
    assert stale(db) is False
    db.execute("update mail.send_log set error = 'x' where user_id <= 2000")
    assert stale(db) is False  # 2,000 changes against 5,000 analysed rows: under half + 1,000
    db.execute("update mail.send_log set error = 'y' where user_id <= 2000")
    assert stale(db) is True  # 4,000 > 3,500
