"""The send log for analysts (migration 0004, docs/send_log.md) on a real PostgreSQL:

* every view's columns and exact values on a small hand-made send log (days in a scheduled
  campaign's own timezone across a DST-shifted offset, rolled-back attempts, dead letters, cancelled
  rows, the send rate and ETA against the database clock);
* the read-only role ``mail_analyst``: SELECT on every table and view, and the exact permission
  errors for INSERT / UPDATE / DELETE / TRUNCATE / CREATE and for the app schema;
* a comment on every table, view and column of schema ``mail`` (read from pg_description);
* the ten example queries, extracted from the markdown and run against the demo data (the demo
  loader plus one real lifecycle run through the engine and the emulator, with a few planted rows),
  each compared with results computed independently: the engine's run summaries, the emulator's
  outbox (the witness of delivery) and the planted rows' definitions.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import errors
from send_log_demo import (
    current_hour,
    doc_questions,
    lifecycle_run_context,
    raw_audience,
    run_doc_query,
    run_lifecycle_once,
)

from mailflow.campaigns import load_campaigns
from mailflow.emulator.testing import EmulatorProcess
from mailflow.model.holdout import in_holdout
from mailflow.store.migrate import migrate
from mailflow.store.policy import normalise_address
from mailflow_dev import devenv
from mailflow_dev.demo.loader import load_demo_data

VIEWS = ("campaign_counts", "campaign_daily", "campaign_outcomes", "campaign_outcomes_daily", "campaign_progress", "email_status",
         "sent_email", "user_email_history")


def at(day: int, hour: int, minute: int = 0) -> datetime:
    return datetime(2026, 3, day, hour, minute, tzinfo=UTC)


# -- a hand-made send log --------------------------------------------------------------------------

@dataclass
class Put:
    """One planted send-log row and its events ``(from, to, at, error)``."""

    user_id: int
    campaign: str
    status: str
    minted: datetime
    kind: str = "lifecycle"
    claimed: datetime | None = None
    sent: datetime | None = None
    released: datetime | None = None
    dead: datetime | None = None
    scheduled: datetime | None = None
    error: str | None = None
    attempts: int = 1
    run_id: str | None = None
    events: list[tuple[str | None, str, datetime, str | None]] = field(default_factory=list)
    address: str | None = None
    id: int = 0

    @property
    def email(self) -> str:
        return self.address or f"user{self.user_id}@example.com"

    @property
    def pid(self) -> str | None:
        return f"pm-{self.campaign}-{self.user_id}-{self.minted:%d%H%M}" if self.status == "sent" else None


def put(db: psycopg.Connection, p: Put) -> Put:
    row = db.execute(
        "insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, minted_at, claimed_at,"
        " sent_at, released_at, provider_message_id, attempts, error, dead_lettered_at, run_id)"
        " values (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) returning id",
        (p.user_id, p.campaign, p.kind, p.email, p.status, p.scheduled, p.minted, p.claimed, p.sent, p.released,
         p.pid, p.attempts, p.error, p.dead, p.run_id)).fetchone()
    assert row is not None
    p.id = int(row[0])
    for frm, to, when, err in p.events:
        db.execute("insert into mail.send_event (send_log_id, from_status, to_status, at, attempt, error,"
                   " provider_message_id, run_id) values (%s, %s, %s, %s, %s, %s, %s, %s)",
                   (p.id, frm, to, when, p.attempts, err, p.pid if to == "sent" else None, p.run_id))
    return p


def add_campaign(db: psycopg.Connection, name: str, timezone: str, status: str) -> None:
    db.execute("insert into mail.campaign (name, timezone, status, template, subject, from_address, recipients_sql)"
               " values (%s, %s, %s, 'outreach', 'Hello', 'Team <team@mail.example.com>', 'free_plan_users')",
               (name, timezone, status))


@pytest.fixture
def handmade(db: psycopg.Connection) -> dict[str, Put]:
    """Rows of three lifecycle campaigns (UTC days) and a scheduled campaign in America/New_York
    (EDT, UTC-4, after the 8 March 2026 switch), plus an empty draft campaign."""
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    add_campaign(db, "sc_b", "America/New_York", "scheduled")
    add_campaign(db, "sc_empty", "Europe/Berlin", "draft")
    s, f = "sending", "failed"
    rows = {
        # lc_a: sent and rejected late on the 9th; a rolled-back attempt on the 10th, dead-lettered on the
        # 11th, and the user's second attempt; one stuck claim
        "r1": Put(1, "lc_a", "sent", at(9, 23, 30), claimed=at(9, 23, 30), sent=at(9, 23, 31),
                  events=[(None, s, at(9, 23, 30), None), (s, "sent", at(9, 23, 31), None)]),
        "r2": Put(2, "lc_a", f, at(9, 23, 50), claimed=at(9, 23, 50), error="rejected: mailbox unavailable",
                  events=[(None, s, at(9, 23, 50), None), (s, f, at(9, 23, 50), "rejected: mailbox unavailable")]),
        "r3": Put(3, "lc_a", f, at(10, 1), claimed=at(10, 1), released=at(10, 1, 5), dead=at(11, 2),
                  error="HTTP 500 (attempts exhausted)",
                  events=[(None, s, at(10, 1), None), (s, f, at(10, 1, 5), "HTTP 500"),
                          (f, f, at(11, 2), "dead-lettered: HTTP 500")]),
        "r4": Put(3, "lc_a", "sent", at(11, 1), claimed=at(11, 1), sent=at(11, 1, 1),
                  events=[(None, s, at(11, 1), None), (s, "sent", at(11, 1, 1), None)]),
        "r5": Put(4, "lc_a", s, at(11, 5), claimed=at(11, 5), events=[(None, s, at(11, 5), None)]),
        # lc_c: a row without any event (as a hand-repaired row would be)
        "r10": Put(9, "lc_c", "sent", at(9, 10), claimed=at(9, 10), sent=at(9, 10, 1)),
        # sc_b: provisioned on the 8th (08:00 EDT); sent 02:00 UTC on the 10th = 22:00 EDT on the 9th;
        # cancelled 03:30 UTC on the 10th = 23:30 EDT on the 9th; out of attempts 05:00 UTC = 01:00 EDT on
        # the 10th; one still pending on the 12th
        "r6": Put(5, "sc_b", "sent", at(8, 12), kind="scheduled", scheduled=at(10, 1, 59), claimed=at(10, 2),
                  sent=at(10, 2), events=[(None, "pending", at(8, 12), None), ("pending", s, at(10, 2), None),
                                          (s, "sent", at(10, 2), None)]),
        "r7": Put(6, "sc_b", "pending", at(8, 12), kind="scheduled", scheduled=at(12, 14), attempts=0,
                  events=[(None, "pending", at(8, 12), None)]),
        "r8": Put(7, "sc_b", "cancelled", at(8, 12), kind="scheduled", scheduled=at(10, 14), attempts=0,
                  error="campaign cancelled", events=[(None, "pending", at(8, 12), None),
                                                      ("pending", "cancelled", at(10, 3, 30), "campaign cancelled")]),
        "r9": Put(8, "sc_b", f, at(8, 12), kind="scheduled", scheduled=at(10, 4), claimed=at(10, 5), attempts=3,
                  dead=at(10, 5), error="gave up", events=[(None, "pending", at(8, 12), None),
                                                           ("pending", s, at(10, 5), None), (s, f, at(10, 5), "gave up")]),
    }
    for p in rows.values():
        put(db, p)
    return rows


def fetch(db: psycopg.Connection, sql: str, params: Any = None) -> tuple[list[str], list[tuple[Any, ...]]]:
    cur = db.execute(sql, params)
    return [d.name for d in cur.description or []], cur.fetchall()


def test_campaign_daily_counts_each_event_on_its_local_day(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    cols, rows = fetch(db, "select * from mail.campaign_daily order by campaign, day")
    assert cols == ["campaign", "kind", "timezone", "day", "minted", "sent", "failed", "rolled_back", "cancelled",
                    "dead_lettered", "unique_users", "duplicate", "skipped", "holdout"]
    utc, ny = "UTC", "America/New_York"
    assert rows == [
        ("lc_a", "lifecycle", utc, date(2026, 3, 9), 2, 1, 1, 0, 0, 0, 2, 0, 0, 0),
        ("lc_a", "lifecycle", utc, date(2026, 3, 10), 1, 0, 0, 1, 0, 0, 1, 0, 0, 0),
        ("lc_a", "lifecycle", utc, date(2026, 3, 11), 2, 1, 0, 0, 0, 1, 2, 0, 0, 0),
        ("lc_c", "lifecycle", utc, date(2026, 3, 9), 1, 1, 0, 0, 0, 0, 1, 0, 0, 0),
        ("sc_b", "scheduled", ny, date(2026, 3, 8), 4, 0, 0, 0, 0, 0, 4, 0, 0, 0),
        ("sc_b", "scheduled", ny, date(2026, 3, 9), 0, 1, 0, 0, 1, 0, 2, 0, 0, 0),
        ("sc_b", "scheduled", ny, date(2026, 3, 10), 0, 0, 1, 0, 0, 1, 1, 0, 0, 0),
    ]


def test_campaign_progress_counts_percent_rate_and_eta(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    cols, rows = fetch(db, "select * from mail.campaign_progress order by campaign")
    assert cols == ["campaign", "kind", "campaign_status", "timezone", "total", "pending", "sending", "sent", "failed",
                    "cancelled", "rolled_back", "dead_lettered", "done", "percent_done", "sent_last_5m",
                    "send_rate_per_min", "first_minted_at", "last_sent_at", "next_due_at", "last_due_at", "eta",
                    "active", "duplicate", "skipped", "invalid", "holdout"]
    d0, d1 = Decimal("0.0"), Decimal("75.0")
    assert rows == [
        ("lc_a", "lifecycle", None, "UTC", 4, 0, 1, 2, 1, 0, 1, 1, 3, d1, 0, d0,
         at(9, 23, 30), at(11, 1, 1), None, None, None, True, 0, 0, 0, 0),
        ("lc_c", "lifecycle", None, "UTC", 1, 0, 0, 1, 0, 0, 0, 0, 1, Decimal("100.0"), 0, d0,
         at(9, 10), at(9, 10, 1), None, None, None, False, 0, 0, 0, 0),
        ("sc_b", "scheduled", "scheduled", "America/New_York", 4, 1, 0, 1, 1, 1, 0, 1, 3, d1, 0, d0,
         at(8, 12), at(10, 2), at(12, 14), at(12, 14), at(12, 14), True, 0, 0, 0, 0),
        ("sc_empty", "scheduled", "draft", "Europe/Berlin", 0, 0, 0, 0, 0, 0, 0, 0, 0, Decimal("0"), 0, d0,
         None, None, None, None, None, False, 0, 0, 0, 0),
    ]
    # a campaign sending now (one transaction: one now()): 10 sent 2 minutes ago (5.0 a minute since
    # the first of them), 1 sent 10 minutes ago, 20 in flight: ETA = now + 20 emails / 5 per minute
    with db.transaction():
        live = live_campaign(db)
    assert live == (31, 20, 11, 11, Decimal("35.5"), 10, Decimal("5.0"), timedelta(minutes=4), True)
    with db.transaction():  # the same, sent 30 s ago: the rate's window is at least 30 s
        db.execute("update mail.send_log set sent_at = now() - interval '10 seconds'"
                   " where campaign = 'lc_live' and sent_at > now() - interval '5 minutes'")
        assert db.execute("select send_rate_per_min, eta - now() from mail.campaign_progress"
                          " where campaign = 'lc_live'").fetchone() == (Decimal("20.0"), timedelta(minutes=1))


def live_campaign(db: psycopg.Connection) -> tuple[Any, ...] | None:
    db.execute("insert into mail.send_log (user_id, campaign, email, status, minted_at, claimed_at, sent_at,"
               " provider_message_id) select g, 'lc_live', 'u' || g || '@example.com', 'sent', now() - interval"
               " '20 minutes', now() - interval '2 minutes', now() - case when g = 11 then interval '10 minutes'"
               " else interval '2 minutes' end, 'pm-live-' || g from generate_series(1, 11) as g")
    db.execute("insert into mail.send_log (user_id, campaign, email, status, minted_at, claimed_at) select g,"
               " 'lc_live', 'u' || g || '@example.com', 'sending', now() - interval '1 minute', now() - interval"
               " '30 seconds' from generate_series(12, 31) as g")
    return db.execute("select total, sending, sent, done, percent_done, sent_last_5m, send_rate_per_min,"
                      " eta - now(), active from mail.campaign_progress where campaign = 'lc_live'").fetchone()


def test_user_email_history_is_every_event_of_every_email(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    r3, r4, r10 = handmade["r3"], handmade["r4"], handmade["r10"]
    cols, rows = fetch(db, "select * from mail.user_email_history where user_id = 3 order by event_at, event_id")
    assert cols == ["user_id", "send_log_id", "campaign", "kind", "email", "current_status", "scheduled_at",
                    "minted_at", "sent_at", "released_at", "dead_lettered_at", "provider_message_id", "event_id",
                    "event_at", "from_status", "to_status", "attempt", "event_error", "dag_id", "run_id", "task_id"]
    head3 = (3, r3.id, "lc_a", "lifecycle", "user3@example.com", "failed", None, at(10, 1), None, at(10, 1, 5),
             at(11, 2), None)
    head4 = (3, r4.id, "lc_a", "lifecycle", "user3@example.com", "sent", None, at(11, 1), at(11, 1, 1), None, None,
             r4.pid)
    assert [r[:12] + r[13:] for r in rows] == [
        head3 + (at(10, 1), None, "sending", 1, None, None, None, None),
        head3 + (at(10, 1, 5), "sending", "failed", 1, "HTTP 500", None, None, None),
        head4 + (at(11, 1), None, "sending", 1, None, None, None, None),
        head4 + (at(11, 1, 1), "sending", "sent", 1, None, None, None, None),
        head3 + (at(11, 2), "failed", "failed", 1, "dead-lettered: HTTP 500", None, None, None),
    ]
    assert sorted(r[12] for r in rows) == [r[0] for r in db.execute(
        "select id from mail.send_event where send_log_id in (%s, %s) order by id", (r3.id, r4.id))]
    # an email without events appears once, with empty event columns
    assert db.execute("select send_log_id, current_status, event_id, event_at, to_status"
                      " from mail.user_email_history where user_id = 9").fetchall() == [(r10.id, "sent", None, None, None)]


def test_email_status_is_one_row_per_email(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    cols, rows = fetch(db, "select * from mail.email_status order by send_log_id")
    assert cols == ["send_log_id", "campaign", "kind", "user_id", "email", "status", "rolled_back", "dead_lettered",
                    "attempts", "error", "scheduled_at", "minted_at", "claimed_at", "sent_at", "released_at",
                    "dead_lettered_at", "provider_message_id", "dag_id", "run_id", "task_id", "data_interval_start",
                    "data_interval_end"]
    assert rows == [
        (p.id, p.campaign, p.kind, p.user_id, p.email, p.status, p.released is not None, p.dead is not None,
         p.attempts, p.error, p.scheduled, p.minted, p.claimed, p.sent, p.released, p.dead, p.pid, None, None, None,
         None, None)
        for p in sorted(handmade.values(), key=lambda p: p.id)]
    assert db.execute("select send_log_id from mail.email_status where rolled_back").fetchall() == [(handmade["r3"].id,)]
    assert db.execute("select send_log_id from mail.email_status where dead_lettered order by 1").fetchall() == [
        (handmade["r3"].id,), (handmade["r9"].id,)]


def test_sent_email_is_one_row_per_sent_email(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    cols, rows = fetch(db, "select * from mail.sent_email order by send_log_id")
    assert cols == ["send_log_id", "campaign", "kind", "user_id", "email", "sent_at", "provider_message_id"]
    assert rows == [(p.id, p.campaign, p.kind, p.user_id, p.email, p.sent, p.pid)
                    for p in sorted(handmade.values(), key=lambda p: p.id) if p.status == "sent"]
    # filtered by time (each campaign: one range of send_log_campaign_sent_idx) and by campaign
    assert db.execute("select send_log_id from mail.sent_email where sent_at >= %s and sent_at < %s order by 1",
                      (at(10, 0), at(11, 0))).fetchall() == [(handmade["r6"].id,)]
    assert db.execute("select count(*) from mail.sent_email where campaign = 'lc_a'").fetchone() == (2,)
    db.execute("truncate mail.send_event, mail.send_log restart identity cascade")
    assert db.execute("select count(*) from mail.sent_email").fetchone() == (0,)


# -- the read-only role ----------------------------------------------------------------------------

def mail_relations(db: psycopg.Connection) -> list[tuple[str, str]]:
    """``(name, relkind)`` of every table and view of schema mail."""
    return [(r[0], r[1]) for r in db.execute(
        "select c.relname, c.relkind::text from pg_class c join pg_namespace n on n.oid = c.relnamespace"
        " where n.nspname = 'mail' and c.relkind in ('r', 'v', 'm', 'p') order by c.relname").fetchall()]


def as_analyst(db: psycopg.Connection, sql: str) -> list[tuple[Any, ...]]:
    with db.transaction():
        db.execute("set local role mail_analyst")
        return db.execute(sql).fetchall()


def denied(db: psycopg.Connection, sql: str) -> str:
    with pytest.raises(errors.InsufficientPrivilege) as exc:
        as_analyst(db, sql)
    return str(exc.value).splitlines()[0]


def test_mail_analyst_reads_everything_in_mail_and_nothing_else(db: psycopg.Connection,
                                                                handmade: dict[str, Put]) -> None:
    role = db.execute("select rolcanlogin, rolsuper, rolcreatedb, rolcreaterole, rolinherit, rolbypassrls"
                      " from pg_roles where rolname = 'mail_analyst'").fetchone()
    assert role == (False, False, False, False, True, False)
    relations = mail_relations(db)
    # mail.campaign_lift comes from the demo loader (it reads app.*), so it is there only after a test
    # loaded demo data into this database
    assert {r for r, k in relations if k == "v"} - {"campaign_lift"} == set(VIEWS)
    for name, _ in relations:
        if name == "send_batch":
            continue
        as_analyst(db, f"select * from mail.{name} limit 1")
    assert as_analyst(db, "select count(*) from mail.send_log") == [(len(handmade),)]
    assert as_analyst(db, "select sent from mail.campaign_progress where campaign = 'lc_a'") == [(2,)]
    # the counters' fold writes as its owner (SECURITY DEFINER): an analyst may bring them up to date
    assert as_analyst(db, "select mail.fold_campaign_counters() >= 0") == [(True,)]
    assert as_analyst(db, "select n from mail.campaign_counts where campaign = 'lc_a' and key = 'sent'") == [(2,)]
    # send_batch: everything but the rendered bodies (signed unsubscribe links)
    as_analyst(db, "select idempotency_key, campaign, email_count, created_at from mail.send_batch")
    assert denied(db, "select body from mail.send_batch") == "permission denied for table send_batch"
    # privileges in the catalog: SELECT only, on every table and view (send_batch: by column)
    privs = db.execute(
        "select c.relname, a.privilege_type from pg_class c join pg_namespace n on n.oid = c.relnamespace,"
        " aclexplode(c.relacl) as a where n.nspname = 'mail' and a.grantee = 'mail_analyst'::regrole").fetchall()
    assert {p for _, p in privs} == {"SELECT"}
    assert {r for r, _ in privs} == {r for r, _ in relations} - {"send_batch"}


def test_mail_analyst_cannot_write_or_create(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    assert denied(db, "insert into mail.send_log (user_id, campaign, email) values (1, 'x', 'x@example.com')") == (
        "permission denied for table send_log")
    assert denied(db, "update mail.send_log set status = 'sent'") == "permission denied for table send_log"
    assert denied(db, "delete from mail.send_event") == "permission denied for table send_event"
    assert denied(db, "update mail.suppression set reason = 'x'") == "permission denied for table suppression"
    assert denied(db, "insert into mail.campaign (name) values ('x')") == "permission denied for table campaign"
    assert denied(db, "truncate mail.send_log") == "permission denied for table send_log"
    assert denied(db, "delete from mail.email_status") == "permission denied for view email_status"
    assert denied(db, "create table mail.analyst_scratch (id int)") == "permission denied for schema mail"
    assert denied(db, "create view mail.analyst_view as select 1 as one") == "permission denied for schema mail"
    assert denied(db, "create table public.analyst_scratch (id int)") == "permission denied for schema public"
    assert denied(db, "select count(*) from app.users") == "permission denied for schema app"
    assert db.execute("select count(*) from mail.send_log").fetchone() == (len(handmade),)


# -- comments ----------------------------------------------------------------------------------------

def test_every_table_view_and_column_of_mail_has_a_comment(db: psycopg.Connection) -> None:
    missing_tables = db.execute(
        "select c.relname from pg_class c join pg_namespace n on n.oid = c.relnamespace"
        " left join pg_description d on d.objoid = c.oid and d.classoid = 'pg_class'::regclass and d.objsubid = 0"
        " where n.nspname = 'mail' and c.relkind in ('r', 'v', 'm', 'p') and coalesce(trim(d.description), '') = ''"
        " order by 1").fetchall()
    missing_columns = db.execute(
        "select c.relname || '.' || a.attname from pg_attribute a join pg_class c on c.oid = a.attrelid"
        " join pg_namespace n on n.oid = c.relnamespace"
        " left join pg_description d on d.objoid = c.oid and d.classoid = 'pg_class'::regclass"
        "  and d.objsubid = a.attnum"
        " where n.nspname = 'mail' and c.relkind in ('r', 'v', 'm', 'p') and a.attnum > 0 and not a.attisdropped"
        " and coalesce(trim(d.description), '') = '' order by 1").fetchall()
    assert missing_tables == []
    assert missing_columns == []
    n = db.execute("select count(*) from pg_attribute a join pg_class c on c.oid = a.attrelid join pg_namespace s"
                   " on s.oid = c.relnamespace where s.nspname = 'mail' and c.relkind in ('r', 'v') and a.attnum > 0"
                   " and not a.attisdropped").fetchone()
    assert n is not None and n[0] > 150  # the check above did look at the columns
    assert db.execute("select obj_description('mail'::regnamespace, 'pg_namespace') <> ''").fetchone() == (True,)


# -- the questions of docs/send_log.md, against the demo data -----------------------------------

FP_CAMPAIGN = "first_practice"


@dataclass
class Demo:
    dsn: str
    end: datetime
    run_id: str
    summaries: dict[str, Any]
    outbox: list[dict[str, Any]]
    planted: dict[str, Put]
    fp_audience: list[tuple[int, str]]
    ran_at: float
    conn: psycopg.Connection

    def delivered(self) -> Counter[tuple[str, str]]:
        """``(campaign, address)`` of every email the emulator accepted."""
        return Counter((e["headers"]["X-Mailflow-Campaign"], e["to"][0]) for e in self.outbox)


def plant_demo_rows(conn: psycopg.Connection, fp: list[tuple[int, str]], end: datetime) -> dict[str, Put]:
    """Rows that exist before the run, for seven users of first_practice's audience. d(n, h) is hour
    h of the UTC day n days before the run's day, so every planted event has an unambiguous day."""
    day0 = datetime(end.year, end.month, end.day, tzinfo=UTC)

    def d(days: int, hour: int = 12, minute: int = 0) -> datetime:
        return day0 - timedelta(days=days) + timedelta(hours=hour, minutes=minute)

    s, f = "sending", "failed"
    u = [uid for uid, _ in fp[:7]]
    address = dict(fp)
    spec = {
        # blocks first_practice by cooldown: sent 2 and 3 days ago, a live claim, a pending scheduled email
        "u1": Put(u[0], "practice_tips", "sent", d(2, 11, 59), claimed=d(2, 11, 59), sent=d(2),
                  events=[(None, s, d(2, 11, 59), None), (s, "sent", d(2), None)]),
        "u2": Put(u[1], "upgrade_offer", "sent", d(3, 11, 59), claimed=d(3, 11, 59), sent=d(3),
                  events=[(None, s, d(3, 11, 59), None), (s, "sent", d(3), None)]),
        "u4": Put(u[3], "finish_assessment", s, d(1, 8), claimed=d(1, 8), error="read timeout",
                  events=[(None, s, d(1, 8), None), (s, s, d(1, 8, 1), "read timeout")]),
        "u6": Put(u[5], "spring_sale", "pending", d(4), kind="scheduled", scheduled=d(-2), attempts=0,
                  events=[(None, "pending", d(4), None)]),
        # does not block: sent 8 days ago, a rejected email, a rolled-back dead-lettered attempt
        "u3": Put(u[2], "practice_tips", "sent", d(8, 11, 59), claimed=d(8, 11, 59), sent=d(8),
                  events=[(None, s, d(8, 11, 59), None), (s, "sent", d(8), None)]),
        "u5": Put(u[4], "practice_tips", f, d(1), claimed=d(1), error="planted: mailbox full",
                  events=[(None, s, d(1), None), (s, f, d(1, 12, 1), "planted: mailbox full")]),
        "u7": Put(u[6], "finish_assessment", f, d(5), claimed=d(5), released=d(5, 12, 1), dead=d(2, 3),
                  error="planted: HTTP 500 (attempts exhausted)",
                  events=[(None, s, d(5), None), (s, f, d(5, 12, 1), "planted: HTTP 500"),
                          (f, f, d(2, 3), "dead-lettered")]),
    }
    for p in spec.values():
        p.address = address[p.user_id]
        put(conn, p)
    return spec


@pytest.fixture(scope="module")
def demo(pg_admin_dsn: str, emulator_process: EmulatorProcess) -> Iterator[Demo]:
    """A database of its own: 5,000 demo users (seed 42, anchored at the current hour), the planted
    rows, then one real lifecycle run (all four campaigns) for the hour that just ended."""
    name = f"mailflow_analytics_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    end = current_hour()
    run = lifecycle_run_context(end)
    emulator_process.reset()
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        migrate(conn)
        load_demo_data(conn, users=5000, seed=42, anchor=end)
        [fp_campaign] = load_campaigns(only=[FP_CAMPAIGN])
        fp = raw_audience(conn, fp_campaign, end)
        assert len(fp) >= 20, "the demo's first_practice audience is too small for this test"
        planted = plant_demo_rows(conn, fp, end)
        summaries = {s.campaign: s for s in run_lifecycle_once(dsn, emulator_process, end, run)}
        ran_at = time.monotonic()
        outbox = emulator_process.read_outbox()
        yield Demo(dsn=dsn, end=end, run_id=str(run.run_id), summaries=summaries, outbox=outbox, planted=planted,
                   fp_audience=fp, ran_at=ran_at, conn=conn)
    finally:
        conn.close()
        devenv.drop_database(pg_admin_dsn, name)


def ask(demo: Demo, n: int, **params: Any) -> list[tuple[Any, ...]]:
    """Question n of the doc, as mail_analyst (Q3 reads the app schema: as the owner)."""
    return run_doc_query(demo.conn, n, role=None if n == 3 else "mail_analyst", **params)[1]


def test_the_doc_has_fifteen_questions_each_with_sql() -> None:
    questions = doc_questions()
    assert sorted(questions) == list(range(1, 16))
    assert all(sql.lstrip().lower().startswith(("select", "with")) for _, _, sql in questions.values())


def test_every_question_runs_unmodified_on_the_demo_data(demo: Demo) -> None:
    # Issue 17: a newcomer pastes each block into `make psql` after `make demo`, defaults untouched.
    today = demo.conn.execute("select current_date").fetchone()[0].isoformat()  # type: ignore[index]
    got = {n: ask(demo, n) for n in range(1, 11)}  # no parameter given: the doc's \set defaults
    assert got[1] == ask(demo, 1, day=today) and len(got[1]) >= len(demo.outbox) > 0
    yesterday = demo.conn.execute("select current_date - 1").fetchone()[0].isoformat()  # type: ignore[index]
    assert got[2] == ask(demo, 2, since=yesterday) and sum(r[3] for r in got[2]) > 0  # the malformed addresses
    assert got[3] == ask(demo, 3, run_id=demo.run_id)  # empty run_id: the latest run, the demo's
    assert got[4] == ask(demo, 4, run_id=demo.run_id) and len(got[4]) == sum(
        1 for s in demo.summaries.values() if s.minted)
    assert got[5] == ask(demo, 5, since="2000-01-01") and got[5]
    assert [r[0] for r in got[6]] == ["practice_tips"]
    assert sum(r[0] * r[1] for r in got[10]) >= len(demo.outbox)
    for n in (7, 8, 9):  # may legitimately be empty on a healthy demo; they run as written
        assert isinstance(got[n], list)


def test_q14_tells_the_analyst_which_campaign_version_each_email_came_from(demo: Demo) -> None:
    # as mail_analyst: migration 0023 granted the new column; one version, the packaged examples'
    [(content_hash, emails, first_sent, last_sent)] = ask(demo, 14)
    [fp] = load_campaigns(only=[FP_CAMPAIGN])
    assert FP_CAMPAIGN == "first_practice"
    assert content_hash == fp.content_hash and len(content_hash) == 16
    assert emails == demo.summaries[FP_CAMPAIGN].sent > 0 and first_sent <= last_sent


def test_q15_the_lift_of_the_demos_holdout_group(demo: Demo) -> None:
    """first_practice holds out 10% of its audience (lifecycle.toml): Q15, as written, compares its sent
    and held-out users, and the demo loader's view mail.campaign_lift gives the same rows. The demo's
    assessments all lie before the run (anchored at the current hour): nobody converts yet."""
    s = demo.summaries[FP_CAMPAIGN]
    assert s.holdout > 0 and s.sent > 0
    rows = run_doc_query(demo.conn, 15)[1]  # reads app.assessments: as the owner (like Q3)
    assert [r[:10] for r in rows] == [(FP_CAMPAIGN, "lifecycle", s.sent, 0, Decimal(0), s.holdout, 0, Decimal(0),
                                       Decimal(0), timedelta(days=7))]
    assert demo.conn.execute("select * from mail.campaign_lift").fetchall() == rows
    held = {int(u) for (u,) in demo.conn.execute("select user_id from mail.send_log where status = 'holdout'")}
    sent = {int(u) for (u,) in demo.conn.execute("select user_id from mail.send_log where status = 'sent'"
                                                 " and campaign = %s", (FP_CAMPAIGN,))}
    members = {u for u, _ in demo.fp_audience if in_holdout(FP_CAMPAIGN, u, 0.1)}
    assert len(held) == s.holdout and held <= members and not sent & members
    assert as_analyst(demo.conn, "select holdout, treated from mail.campaign_lift") == [(s.holdout, s.sent)]


def test_the_run_itself(demo: Demo) -> None:
    s = demo.summaries
    assert sum(x.sent for x in s.values()) == len(demo.outbox) > 1000
    assert sum(x.failed for x in s.values()) == 0
    assert sum(x.invalid for x in s.values()) > 0  # the demo's malformed addresses: failed locally, no request
    assert all(x.released == x.unknown == 0 for x in s.values())


def test_q1_who_got_which_campaign_on_a_day(demo: Demo) -> None:
    rows = ask(demo, 1, day=demo.end.date().isoformat())
    assert Counter((r[1], r[3]) for r in rows) == demo.delivered()
    assert len(rows) == len(demo.outbox)
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)
    u1 = demo.planted["u1"]
    assert ask(demo, 1, day=u1.sent.date().isoformat()) == [(u1.sent, "practice_tips", u1.user_id,  # type: ignore[union-attr]
                                                               dict(demo.fp_audience)[u1.user_id])]


def test_q2_failure_reasons(demo: Demo) -> None:
    since = (demo.end - timedelta(days=6)).date().isoformat()
    rows = ask(demo, 2, since=since)
    # the demo's malformed addresses fail locally, each with the validator's reason
    invalid = Counter((c, f"invalid address: {normalise_address(e).error}") for c, e in demo.conn.execute(
        "select l.campaign, u.email from mail.send_log l join app.users u using (user_id)"
        " where l.run_id = %s and l.status = 'failed' and l.attempts = 0", (demo.run_id,)).fetchall())
    assert sum(invalid.values()) == sum(s.invalid for s in demo.summaries.values()) > 0
    expected = {(c, "invalid address: not sent", error, n) for (c, error), n in invalid.items()}
    expected |= {("practice_tips", "rejected by the provider", "planted: mailbox full", 1),
                 ("finish_assessment", "dead letter", "planted: HTTP 500 (attempts exhausted)", 1)}
    assert set(rows) == expected and len(rows) == len(expected)
    assert [r[3] for r in rows] == sorted((r[3] for r in rows), reverse=True)
    # the dead letter was minted 5 days before the run's day: outside a 4-day window
    assert ("finish_assessment", "dead letter") not in {
        (r[0], r[1]) for r in ask(demo, 2, since=(demo.end - timedelta(days=4)).date().isoformat())}


def test_q3_users_excluded_by_cooldown_in_the_run(demo: Demo) -> None:
    assert ask(demo, 3, run_id=demo.run_id) == [(4,)]  # u1, u2 (sent 2 and 3 days ago), u4 (sending), u6 (pending)
    # the engine agrees: first_practice's eligible audience is its raw audience minus exactly those four
    # (no suppressions in the demo; finish_assessment's audience never overlaps first_practice's)
    assert demo.summaries[FP_CAMPAIGN].eligible == len(demo.fp_audience) - 4
    minted = {r[0] for r in demo.conn.execute(
        "select user_id from mail.send_log where run_id = %s and campaign = %s", (demo.run_id, FP_CAMPAIGN))}
    planted = {k: p.user_id for k, p in demo.planted.items()}
    assert {planted[k] for k in ("u1", "u2", "u4", "u6")} & minted == set()
    assert {planted[k] for k in ("u3", "u5", "u7")} <= minted
    # a cooldown of 2 days lets through the user emailed 3 days ago and the one whose scheduled email
    # is planned 2 days after the interval end (not before end + cooldown): u1 and u4 remain
    assert ask(demo, 3, run_id=demo.run_id, cooldown="2 days") == [(2,)]


def test_q4_what_one_run_did(demo: Demo) -> None:
    rows = ask(demo, 4, run_id=demo.run_id)
    assert [r[:6] for r in rows] == [(c, s.minted + s.invalid, s.sent, s.failed + s.invalid, 0, 0)
                                      for c, s in sorted(demo.summaries.items()) if s.minted]
    assert all(r[6] is not None and r[7] is not None and r[6] <= r[7] for r in rows)
    assert {r[0]: r[8] for r in rows} == {c: s.holdout for c, s in demo.summaries.items() if s.minted}
    assert demo.summaries["first_practice"].holdout > 0  # the demo holds out 10% of first_practice
    assert ask(demo, 4, run_id="no such run") == []


def test_q5_a_campaign_day_by_day(demo: Demo) -> None:
    s = demo.summaries["practice_tips"]
    p = demo.planted
    day = demo.end.date()
    rows = ask(demo, 5, campaign="practice_tips", since=(demo.end - timedelta(days=9)).date().isoformat())
    assert rows == sorted([
        (p["u3"].minted.date(), "UTC", 1, 1, 0, 0, 0, 0, 1),
        (p["u1"].minted.date(), "UTC", 1, 1, 0, 0, 0, 0, 1),
        (p["u5"].minted.date(), "UTC", 1, 0, 1, 0, 0, 0, 1),
        (day, "UTC", s.minted + s.invalid, s.sent, s.failed + s.invalid, 0, 0, 0, s.minted + s.invalid),
    ])
    assert ask(demo, 5, campaign="practice_tips", since=day.isoformat()) == rows[-1:]


def test_q6_campaign_progress(demo: Demo) -> None:
    s = demo.summaries["practice_tips"]
    [row] = ask(demo, 6, campaign="practice_tips")
    assert row[:12] == ("practice_tips", "lifecycle", None, s.minted + s.invalid + 3, 0, 0, s.sent + 2,
                        s.failed + s.invalid + 1, 0, 0, 0, Decimal("100.0"))
    assert row[13:] == (None, False)
    if time.monotonic() - demo.ran_at < 240:  # the run's sends are still inside the 5-minute rate window
        assert row[12] > 0
    [fa] = ask(demo, 6, campaign="finish_assessment")
    f = demo.summaries["finish_assessment"]
    # the stuck claim (u4) is open: active, 1 sending; the dead-lettered attempt (u7) is rolled back
    assert fa[3:11] == (f.minted + f.invalid + 1, 0, 1, f.sent, f.failed + f.invalid, 0, 1, 1)
    assert fa[14] is True


def test_q7_one_users_history(demo: Demo) -> None:
    u3 = demo.planted["u3"]
    rows = ask(demo, 7, user_id=u3.user_id)
    address = dict(demo.fp_audience)[u3.user_id]
    assert [(r[1], r[2], r[3], r[4], r[7]) for r in rows] == [
        ("practice_tips", address, None, "sending", "sent"),
        ("practice_tips", address, "sending", "sent", "sent"),
        (FP_CAMPAIGN, address, None, "sending", "sent"),
        (FP_CAMPAIGN, address, "sending", "sent", "sent"),
    ]
    assert rows[0][0] == u3.minted and rows[1][0] == u3.sent
    assert rows[3][8] is not None and rows[3][9] == demo.run_id
    assert (FP_CAMPAIGN, address) in demo.delivered()
    # a demo user with a malformed address: failed locally with the validator's reason, never requested
    malformed = demo.conn.execute(
        "select user_id from mail.send_log where status = 'failed' and run_id = %s and user_id <> all(%s)"
        " order by user_id limit 1", (demo.run_id, [p.user_id for p in demo.planted.values()])).fetchone()
    assert malformed is not None
    rows = ask(demo, 7, user_id=malformed[0])
    [raw] = demo.conn.execute("select email from app.users where user_id = %s", (malformed[0],)).fetchone() or [""]
    assert [(r[3], r[4], r[6], r[7]) for r in rows] == [
        (None, "failed", f"invalid address: {normalise_address(raw).error}", "failed")]


def test_q8_dead_letters(demo: Demo) -> None:
    u7 = demo.planted["u7"]
    assert ask(demo, 8) == [(u7.id, "finish_assessment", u7.user_id, dict(demo.fp_audience)[u7.user_id], 1,
                             "planted: HTTP 500 (attempts exhausted)", u7.dead)]


def test_q9_emails_stuck_in_flight(demo: Demo) -> None:
    u4 = demo.planted["u4"]
    [row] = ask(demo, 9)
    assert (row[0], row[1], row[2], row[3], row[4], row[6]) == (
        u4.id, "finish_assessment", u4.user_id, 1, u4.claimed, "read timeout")
    assert row[5] > timedelta(hours=1)
    assert ask(demo, 9, stale="3 days") == []


def test_q10_emails_per_user_in_30_days(demo: Demo) -> None:
    per_address = Counter(a for _, a in demo.delivered().elements())
    for k in ("u1", "u2", "u3"):  # planted sent emails within 30 days
        per_address[dict(demo.fp_audience)[demo.planted[k].user_id]] += 1
    expected = sorted(Counter(per_address.values()).items())
    assert ask(demo, 10) == expected
    assert expected[-1] == (2, 1)  # u3: emailed 8 days ago (outside the cooldown) and again by the run
    recent = Counter(a for _, a in demo.delivered().elements())
    recent.update(dict(demo.fp_audience)[demo.planted[k].user_id] for k in ("u1", "u2"))  # u3: 8 days ago
    assert ask(demo, 10, days="5") == sorted(Counter(recent.values()).items())


def test_q11_who_was_held_back_by_the_contact_policy_and_why(db: psycopg.Connection, db_dsn: str) -> None:
    """Two scheduled campaigns due now for users 1-3; user 1 was emailed 2 days ago, user 2 is
    emailed by the first campaign: the second campaign defers user 1 (and 2), the skip campaign skips."""
    from mailflow.sources import scheduled
    from mailflow_dev.contact_chaos import AcceptAll, _renderer

    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'user' || i || '@example.com', 'F' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, 3) as i")
    [(now,)] = db.execute("select now()").fetchall()
    [(sent_id,)] = db.execute(
        "insert into mail.send_log (user_id, campaign, email, status, sent_at, provider_message_id)"
        " values (1, 'first_practice', 'user1@example.com', 'sent', %s, 'p1') returning id",
        (now - timedelta(days=2),)).fetchall()
    spec = {"template": "outreach", "subject": "{{ user.first_name }}", "from": "O <o@mail.example.com>",
            "recipients_table": "mail.campaign_recipient", "start_at": datetime(2026, 1, 5, tzinfo=UTC),
            "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["09:00-17:00"], "emails_per_day": 50}
    defer = scheduled.create_campaign(db, spec | {"name": "q11_defer"})
    skip = scheduled.create_campaign(db, spec | {"name": "q11_skip", "on_policy": "skip"})
    db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email)"
               " select %s, i, 'user' || i || '@example.com' from generate_series(1, 2) as i", (defer,))
    db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email) values (%s, 2, 'user2@example.com')",
               (skip,))
    for cid in (defer, skip):
        scheduled.provision(db, cid, now=datetime(2026, 1, 5, tzinfo=UTC))
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        d = scheduled.dispatch(conn, AcceptAll(), _renderer(), budget_seconds=10, coalesce_seconds=0)
    assert (d.sent, d.deferred, d.skipped) == (1, 1, 1)
    ids = dict(db.execute("select campaign || ':' || user_id, id from mail.send_log").fetchall())
    sent2 = db.execute("select sent_at from mail.send_log where id = %s", (ids["q11_defer:2"],)).fetchone()
    assert sent2 is not None
    planned = db.execute("select scheduled_at from mail.send_log where id = %s", (ids["q11_defer:1"],)).fetchone()
    assert planned is not None
    cols, rows = run_doc_query(db, 11, role="mail_analyst", since=(now - timedelta(days=1)).date().isoformat())
    assert cols == ["decided_at", "campaign", "user_id", "decision", "rule", "status_now", "planned_at", "why"]
    free1 = now - timedelta(days=2) + timedelta(days=7)
    assert [r[1:] for r in rows] == [
        ("q11_defer", 1, "deferred", "cooldown 7 days", "pending", planned[0],
         f"contact policy: cooldown 7 days: row {sent_id} (first_practice, sent {(now - timedelta(days=2)).isoformat()}); "
         f"free from {free1.isoformat()}; deferred to {planned[0].isoformat()}"),
        ("q11_skip", 2, "skipped", "cooldown 7 days", "skipped", datetime(2026, 1, 5, 9, tzinfo=UTC),
         f"contact policy: cooldown 7 days: row {ids['q11_defer:2']} (q11_defer, sent {sent2[0].isoformat()}); "
         f"free from {(sent2[0] + timedelta(days=7)).isoformat()}")]
    assert run_doc_query(db, 11, role="mail_analyst", since=(now + timedelta(days=2)).date().isoformat())[1] == []


# -- outcomes after sending (migration 0021) ---------------------------------------------------------

def outcome(db: psycopg.Connection, p: Put, **columns: Any) -> None:
    """A delivery_status row for a sent email, as the webhook receiver or the poll writes it."""
    names = ", ".join(columns)
    db.execute(f"insert into mail.delivery_status (send_log_id, provider_message_id, last_event, {names})"
               f" values (%s, %s, 'delivered', {', '.join(['%s'] * len(columns))})",
               (p.id, p.pid, *columns.values()))


def test_campaign_outcomes_daily_counts_each_outcome_on_the_local_day_of_sending(
        db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    h = handmade
    # lc_a: r1 (sent 9th 23:31 UTC) delivered, opened and clicked, then complained; r4 (11th) hard bounce
    outcome(db, h["r1"], delivered_at=at(9, 23, 32), complained_at=at(10, 9), first_opened_at=at(10, 8),
            first_clicked_at=at(10, 8, 1), opens=2, clicks=1, outcome="complained")
    outcome(db, h["r4"], hard_bounced_at=at(11, 1, 2), outcome="hard_bounced")
    # sc_b: r6 sent 02:00 UTC on the 10th = 22:00 EDT on the 9th: only delayed so far (no final outcome)
    outcome(db, h["r6"], delayed_at=at(10, 3), outcome="delayed")
    # lc_c: r10 soft bounce then failed after acceptance
    outcome(db, h["r10"], soft_bounced_at=at(9, 10, 2), failed_at=at(9, 10, 3), outcome="failed")
    cols, rows = fetch(db, "select * from mail.campaign_outcomes_daily order by campaign, day")
    assert cols == ["campaign", "kind", "timezone", "day", "sent", "delivered", "hard_bounced", "soft_bounced",
                    "complained", "failed_after_send", "suppressed", "unique_opens", "unique_clicks",
                    "no_outcome_yet", "delivered_rate", "hard_bounce_rate", "complaint_rate", "open_rate",
                    "click_rate"]
    one, zero = Decimal("1.000000"), Decimal("0.000000")
    assert rows == [
        ("lc_a", "lifecycle", "UTC", date(2026, 3, 9), 1, 1, 0, 0, 1, 0, 0, 1, 1, 0, one, zero, one, one, one),
        ("lc_a", "lifecycle", "UTC", date(2026, 3, 11), 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, zero, one, zero, zero, zero),
        ("lc_c", "lifecycle", "UTC", date(2026, 3, 9), 1, 0, 0, 1, 0, 1, 0, 0, 0, 0, zero, zero, zero, zero, zero),
        ("sc_b", "scheduled", "America/New_York", date(2026, 3, 9), 1, 0, 0, 0, 0, 0, 0, 0, 0, 1,
         zero, zero, zero, zero, zero),
    ]
    # filtered by campaign: the campaign's range of the day counters (0031), never its sent emails or outcomes
    plan = "\n".join(r[0] for r in db.execute(
        "explain select * from mail.campaign_outcomes_daily where campaign = 'lc_a'").fetchall())
    assert "campaign_day_counter_pkey" in plan and " on send_log " not in plan and " on delivery_status " not in plan


def test_campaign_outcomes_sums_the_days_and_shows_the_guard(db: psycopg.Connection,
                                                            handmade: dict[str, Put]) -> None:
    h = handmade
    outcome(db, h["r1"], delivered_at=at(9, 23, 32), outcome="delivered")
    outcome(db, h["r4"], hard_bounced_at=at(11, 1, 2), outcome="hard_bounced")
    db.execute("insert into mail.reputation_guard (scope, name, state, tripped_at, reason) values"
               " ('campaign', 'lc_a', 'tripped', %s, 'hard-bounce rate 0.5 over 0.04 (sample 2)'),"
               " ('campaign', 'lc_new', 'ok', null, null)", (at(11, 2),))
    rows = db.execute("select campaign, kind, sent, delivered, hard_bounced, no_outcome_yet, delivered_rate,"
                      " hard_bounce_rate, guard_state, guard_reason, account_guard_state, account_guard_reason"
                      " from mail.campaign_outcomes order by campaign").fetchall()
    half = Decimal("0.500000")
    assert rows == [
        ("lc_a", "lifecycle", 2, 1, 1, 0, half, half, "tripped", "hard-bounce rate 0.5 over 0.04 (sample 2)", "ok", None),
        ("lc_c", "lifecycle", 1, 0, 0, 1, Decimal("0.000000"), Decimal("0.000000"), "ok", None, "ok", None),
        ("lc_new", None, 0, 0, 0, 0, None, None, "ok", None, "ok", None),
        ("sc_b", "scheduled", 1, 0, 0, 1, Decimal("0.000000"), Decimal("0.000000"), "ok", None, "ok", None),
    ]
    db.execute("insert into mail.reputation_guard (scope, name, state, tripped_at, reason) values"
               " ('account', 'https://api.resend.com', 'tripped', now(), 'complaint rate 0.01 over 0.003 (sample 900)')")
    assert db.execute("select distinct account_guard_state, account_guard_reason from mail.campaign_outcomes"
                      ).fetchall() == [("tripped", "https://api.resend.com: complaint rate 0.01 over 0.003 (sample 900)")]


def test_progress_counts_every_state_and_adds_up(db: psycopg.Connection, handmade: dict[str, Put]) -> None:
    """duplicate and skipped rows are in total and done; invalid is part of failed (never claimed)."""
    put(db, Put(20, "lc_a", "duplicate", at(11, 6), attempts=0, error="duplicate: user 4 has this address",
                events=[(None, "duplicate", at(11, 6), "duplicate")]))
    put(db, Put(21, "lc_a", "failed", at(11, 6), attempts=0, error="invalid address: no @",
                events=[(None, "failed", at(11, 6), "invalid address: no @")]))
    put(db, Put(22, "sc_b", "skipped", at(8, 12), kind="scheduled", scheduled=at(10, 9), attempts=0,
                error="contact policy: cooldown", events=[(None, "pending", at(8, 12), None),
                                                          ("pending", "skipped", at(10, 9), "contact policy")]))
    from mailflow.model.tally import STATE_COLUMNS, Tally

    cur = db.execute("select * from mail.campaign_progress order by campaign")
    names = [d.name for d in cur.description or []]
    progress = {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}
    for name, p in progress.items():
        rows = db.execute("select status, released_at is not null, dead_lettered_at is not null,"
                          " claimed_at is not null from mail.send_log where campaign = %s", (name,)).fetchall()
        assert Tally.of_mapping(p) == Tally.of_rows(rows), name
        assert p["done"] == p["total"] - p["pending"] - p["sending"]
    a = progress["lc_a"]
    assert (a["total"], a["failed"], a["invalid"], a["duplicate"], a["done"]) == (6, 2, 1, 1, 5)
    b = progress["sc_b"]
    assert (b["total"], b["skipped"], b["done"], b["percent_done"]) == (5, 1, 4, Decimal("80.0"))
    daily = db.execute("select day, duplicate, skipped from mail.campaign_daily where duplicate + skipped > 0"
                       " order by campaign, day").fetchall()
    assert daily == [(date(2026, 3, 11), 1, 0), (date(2026, 3, 10), 0, 1)]
    assert set(STATE_COLUMNS) <= set(names)


def test_every_summary_counts_the_same_way(demo: Demo) -> None:
    """The run's task summary, the demo's table (mailflow report), the progress page's JSON and the views
    give the same numbers for the same rows (mailflow.model.tally)."""
    from mailflow.cli import REPORT_HEAD, report
    from mailflow.model.tally import COLUMNS, Tally
    from mailflow.orchestration.ui.progress_queries import load_campaign, load_list

    conn = demo.conn
    row_sql = ("select status, released_at is not null, dead_lettered_at is not null, claimed_at is not null"
               " from mail.send_log where campaign = %s")
    # the task's return value counts the run's rows as the send log does (an invalid address is failed)
    for name, s in demo.summaries.items():
        run_rows = conn.execute(row_sql + " and run_id = %s", (name, demo.run_id)).fetchall()
        assert s.emails() == Tally.of_rows(run_rows), name
        assert {k: s.as_dict()[k] for k in COLUMNS} == Tally.of_rows(run_rows).as_dict()
    assert sum(s.as_dict()["invalid"] for s in demo.summaries.values()) > 0
    assert all(s.as_dict()["failed"] >= s.as_dict()["invalid"] for s in demo.summaries.values())
    # the demo's table, the progress JSON (list and one campaign) and the views, per campaign
    assert REPORT_HEAD == ("campaign", *COLUMNS)
    table = {r[0]: dict(zip(COLUMNS, r[1:], strict=True)) for r in report(conn)}
    listed = {c["campaign"]: c for c in load_list(conn)["campaigns"]}
    assert set(table) == set(listed) >= set(demo.summaries)
    for name, counts in table.items():
        truth = Tally.of_rows(conn.execute(row_sql, (name,)).fetchall())
        assert Tally.of_mapping(counts) == truth, name
        assert Tally.of_mapping(listed[name]) == truth, name
        one = load_campaign(conn, name, show=False)
        assert one is not None and Tally.of_mapping(one["progress"]) == truth, name
        daily = conn.execute("select sum(minted), sum(sent), sum(cancelled), sum(duplicate), sum(skipped)"
                             " from mail.campaign_daily where campaign = %s", (name,)).fetchone()
        assert daily == (truth.total + truth.rolled_back, truth.sent, truth.cancelled, truth.duplicate, truth.skipped)
        [sent] = conn.execute("select coalesce(sum(sent), 0) from mail.campaign_outcomes_daily where campaign = %s",
                              (name,)).fetchone() or [None]
        assert sent == truth.sent, name


def test_q12_and_q13_outcomes_per_campaign_and_day_and_the_guard(demo: Demo) -> None:
    """Outcomes for some of the run's emails, as the webhook receiver records them, and a tripped guard."""
    conn = demo.conn
    assert ask(demo, 13) == []  # nothing tripped yet
    sent = conn.execute("select id, campaign from mail.send_log where run_id = %s and status = 'sent'"
                        " order by id", (demo.run_id,)).fetchall()
    hard, comp, opened = sent[0::7], sent[1::11], sent[2::3]
    kinds = {i: set() for i, _ in sent}
    for group, kind in ((hard, "hard"), (comp, "comp"), (opened, "open")):
        for i, _ in group:
            kinds[i].add(kind)
    try:
        for i, _ in sent[:len(sent) // 2]:  # the later half has no outcome yet
            k = kinds[i]
            conn.execute(
                "insert into mail.delivery_status (send_log_id, provider_message_id, last_event, delivered_at,"
                " hard_bounced_at, complained_at, first_opened_at, outcome)"
                " select id, provider_message_id, 'x', case when %(h)s then null else now() end,"
                " case when %(h)s then now() end, case when %(c)s then now() end, case when %(o)s then now() end,"
                " case when %(c)s then 'complained' when %(h)s then 'hard_bounced' else 'delivered' end"
                " from mail.send_log where id = %(id)s",
                {"id": i, "h": "hard" in k, "c": "comp" in k and "hard" not in k, "o": "open" in k and "hard" not in k})
        rows = [r for c in sorted({c for _, c in sent}) for r in ask(demo, 12, campaign=c)]
        today = [r for r in rows if r[1] == demo.end.date()]
        expected: dict[str, list[int]] = {}
        for i, c in sent:
            e = expected.setdefault(c, [0, 0, 0, 0, 0])
            e[0] += 1
            if (i, c) in sent[:len(sent) // 2]:
                k = kinds[i]
                e[1] += "hard" not in k
                e[2] += "hard" in k
                e[3] += "comp" in k and "hard" not in k
            else:
                e[4] += 1
        got = {r[0]: [r[2], r[3], r[4], r[6], r[10]] for r in rows if r[1] == demo.end.date()}
        assert got == expected
        assert today and all(r[11] == round(Decimal(r[3]) / r[2], 6) and r[12] == round(Decimal(r[4]) / r[2], 6) for r in today)
        # a tripped campaign
        # (the guard's row exists: the demo's sends were admitted through it)
        conn.execute("insert into mail.reputation_guard (scope, name, state, tripped_at, reason, sample) values"
                     " ('campaign', 'practice_tips', 'tripped', now(), 'hard-bounce rate over 0.04', 50)"
                     " on conflict (scope, name) do update set state = excluded.state, tripped_at = excluded.tripped_at,"
                     " reason = excluded.reason, sample = excluded.sample")
        [row] = ask(demo, 13)
        assert row[:3] == ("practice_tips", "tripped", "hard-bounce rate over 0.04") and row[7] == "ok"
    finally:
        conn.execute("delete from mail.reputation_guard")
        conn.execute("delete from mail.delivery_status")
