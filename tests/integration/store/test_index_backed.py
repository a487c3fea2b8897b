"""Every reader of the send log that must stay index-backed (docs/send_log.md's questions, the views
filtered as documented, the progress page's queries, the deliverability poll) plans without a Seq
Scan of ``mail.send_log`` on a send log big enough for realistic plans (200,000 rows, ten campaigns,
two years, ``VACUUM ANALYZE``): a reader that loses its index when one is dropped (migration 0011)
fails here, not only in ``python -m bench.analytics`` at 1M users."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from send_log_demo import doc_query, doc_questions

from mailflow.orchestration.ui import progress_queries as progress
from mailflow.store.migrate import migrate
from mailflow.store.sql import query
from mailflow_dev import devenv
from mailflow_dev.demo.loader import schema_sql

ROWS = 200_000

# 93% sent, 3% failed (a third of them rolled back), 1% cancelled, 2% pending / in flight; hourly
# run ids; a newer day is denser (a tenth of the rows in the last 30 days)
HISTORY_SQL = """
insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, minted_at, claimed_at, sent_at,
                           released_at, dead_lettered_at, provider_message_id, attempts, error, run_id)
select u, c, k, 'user' || u || '@example.com', st,
       case when k = 'scheduled' then t end, t,
       case when st <> 'pending' then t end, case when st = 'sent' then t + interval '2 seconds' end,
       case when st = 'failed' and r >= 0.97 then t + interval '1 second' end,
       case when st = 'failed' and r >= 0.979 then t + interval '1 day' end,
       case when st = 'sent' then 'hist-' || g end, 1, case when st = 'failed' then 'rejected' end,
       'scheduled__' || to_char(t, 'YYYY-MM-DD"T"HH24') || ':00:00+00:00'
from (select g, u, c, r, t,
             case when c like 'newsletter%%' then 'scheduled' else 'lifecycle' end as k,
             case when r < 0.93 then 'sent' when r < 0.96 then 'failed' when r < 0.97 then 'cancelled'
                  when r < 0.99 then (case when c like 'newsletter%%' then 'pending' else 'failed' end)
                  else 'sending' end as st
      from (select g, (g / 5) + 1 as u,
                   (array['first_practice', 'finish_assessment', 'upgrade_offer', 'practice_tips', 'newsletter_1',
                          'newsletter_2', 'newsletter_3', 'newsletter_4', 'newsletter_5', 'newsletter_6'])[1 + g %% 10] as c,
                   random() as r,
                   now() - case when g %% 10 = 0 then interval '30 days' * random()
                                else interval '730 days' * random() end as t
            from generate_series(0, %(n)s - 1) g) as x) as y
"""


@pytest.fixture(scope="module")
def big(pg_admin_dsn: str) -> Iterator[psycopg.Connection]:
    name = f"mailflow_plans_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    conn = psycopg.connect(dsn, autocommit=True)
    try:
        migrate(conn)
        conn.execute(schema_sql())
        conn.execute("select setseed(0.16)")
        conn.execute(HISTORY_SQL, {"n": ROWS})
        conn.execute("insert into mail.send_event (send_log_id, from_status, to_status, at, attempt, run_id)"
                     " select id, null, status, minted_at, attempts, run_id from mail.send_log")
        conn.execute("vacuum analyze mail.send_log")
        conn.execute("vacuum analyze mail.send_event")
        yield conn
    finally:
        conn.close()
        devenv.drop_database(pg_admin_dsn, name)


def _scans(node: dict[str, Any]) -> list[tuple[str, str, str]]:
    out = [(node["Node Type"], node.get("Relation Name", ""), node.get("Index Name", ""))]
    for child in node.get("Plans", []):
        out += _scans(child)
    return out


def plan(conn: psycopg.Connection, sql: str, params: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    with conn.transaction(force_rollback=True):
        conn.execute("set local jit = off")
        [[doc]] = conn.execute(f"explain (format json) {sql}", params).fetchall()  # type: ignore[arg-type]
    return _scans((doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"])


def seq_scans_of_send_log(conn: psycopg.Connection, sql: str, params: dict[str, Any] | None = None) -> list[str]:
    return [t for t, rel, _ in plan(conn, sql, params) if t == "Seq Scan" and rel == "send_log"]


def _doc_params(conn: psycopg.Connection) -> dict[str, str]:
    day = conn.execute("select (max(sent_at) at time zone 'UTC')::date - 1 from mail.send_log").fetchone()
    assert day is not None
    return {"day": day[0].isoformat(), "since": (day[0] - timedelta(days=6)).isoformat(), "campaign": "practice_tips",
            "user_id": "42", "run_id": "", "days": "30", "cooldown": "7 days", "stale": "15 minutes"}


def test_the_indexes_of_send_log_after_0011(big: psycopg.Connection) -> None:
    names = {r[0] for r in big.execute("select indexname from pg_indexes where schemaname = 'mail'"
                                       " and tablename = 'send_log'").fetchall()}
    assert "send_log_sent_idx" not in names and "send_log_campaign_sent_idx" in names


@pytest.mark.parametrize("n", sorted(doc_questions()))
def test_every_doc_question_is_index_backed(big: psycopg.Connection, n: int) -> None:
    defaults, sql = doc_query(n)
    params = {k: v for k, v in (defaults | _doc_params(big)).items() if k in defaults}
    assert seq_scans_of_send_log(big, sql, params) == [], f"Q{n} reads mail.send_log with a Seq Scan"


READERS: dict[str, tuple[str, dict[str, Any]]] = {
    "campaign_daily by campaign": ("select * from mail.campaign_daily where campaign = %(c)s", {"c": "newsletter_3"}),
    "campaign_progress by campaign": ("select * from mail.campaign_progress where campaign = %(c)s",
                                      {"c": "newsletter_3"}),
    "user_email_history by user": ("select * from mail.user_email_history where user_id = 42", {}),
    "email_status by user": ("select * from mail.email_status where user_id = 42", {}),
    "email_status by run": ("select * from mail.email_status where run_id = %(r)s",
                            {"r": "scheduled__2000-01-01T00:00:00+00:00"}),
    "sent_email by day": ("select * from mail.sent_email where sent_at >= now() - interval '1 day'", {}),
    "sent_email by user": ("select * from mail.sent_email where user_id = 42", {}),
    "page: list": (progress.LIST_SQL, {}),
    "page: recent": (progress.RECENT_SQL, {"campaign": "practice_tips", "limit": 20}),
    "page: errors": (progress.ERRORS_SQL, {"campaign": "practice_tips", "limit": 20}),
    "page: days": (progress.DAYS_SQL, {"campaign": "practice_tips", "days": 14}),
    "page: outcomes, all": (progress.OUTCOMES_ALL_SQL, {}),
    "page: outcomes, one": (progress.OUTCOMES_ONE_SQL, {"campaign": "practice_tips"}),
    "page: sends per minute, all": (progress.PER_MINUTE_SQL, {"since": "2 hours", "campaign": None}),
    "page: sends per minute, one": (progress.PER_MINUTE_SQL, {"since": "2 hours", "campaign": "practice_tips"}),
    "page: sends per day, all": (progress.PER_DAY_ALL_SQL, {"since": "30 days"}),
    "page: sends per day, one": (progress.PER_DAY_ONE_SQL, {"campaign": "practice_tips", "tz": "UTC"}),
    # the contact guard's mailbox probes (0018) and "stop all"'s read of the user's mailboxes
    "guard: mailbox contact times": (query("contact", "mailbox_contact_times"), {
        "keys": [f"user{u}@example.com" for u in range(1, 101)], "ref": "2026-12-01T00:00:00+00:00",
        "widest": "7 days", "include_planned": True}),
    "guard: mailbox contacts": (query("contact", "mailbox_contacts"), {
        "keys": [f"user{u}@example.com" for u in range(1, 101)], "except_ids": [], "since": "30 days",
        "until": "2027-01-01T00:00:00+00:00", "include_planned": False}),
    "stop all: mailboxes of user": (query("suppression", "mailboxes_of_user"), {"user_id": 42}),
    "deliverability poll": (query("feedback", "due_checks"), {
        "lookback_seconds": 48 * 3600, "min_age_seconds": 300, "max_checks": 4, "recheck_seconds": 7200,
        "limit": 500}),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_views_page_and_poll_are_index_backed(big: psycopg.Connection, name: str) -> None:
    sql, params = READERS[name]
    if "since" in params:  # the page's window: that long before now
        params = params | {"since": big.execute("select now() - %s::interval", (params["since"],)).fetchone()[0]}  # type: ignore[index]
    assert seq_scans_of_send_log(big, sql, params) == [], f"{name} reads mail.send_log with a Seq Scan"


def test_sent_email_reads_one_range_of_the_campaign_sent_index_per_campaign(big: psycopg.Connection) -> None:
    scans = plan(big, "select campaign, count(*) from mail.sent_email where sent_at >= now() - interval '30 days'"
                      " group by campaign")
    assert ("Index Only Scan", "send_log", "send_log_campaign_sent_idx") in scans
    assert ("Function Scan", "", "") in scans  # unnest() of the campaign names, joined by a nested loop
    got = big.execute("select campaign, count(*) from mail.sent_email where sent_at >= now() - interval '30 days'"
                      " group by campaign order by campaign").fetchall()
    expected = big.execute("select campaign, count(*) from mail.send_log where status = 'sent'"
                           " and sent_at >= now() - interval '30 days' group by campaign order by campaign").fetchall()
    assert got == expected and len(got) == 10


def _actual(node: dict[str, Any]) -> list[tuple[str, str, str, int]]:
    """(node type, relation, index, rows it returned over all its loops) of every node of an analysed plan."""
    out = [(node["Node Type"], node.get("Relation Name", ""), node.get("Index Name", ""),
            int(node.get("Actual Rows", 0)) * int(node.get("Actual Loops", 1)))]
    for child in node.get("Plans", []):
        out += _actual(child)
    return out


#: The indexes the counters' page queries may read mail.send_log through: bounded ranges (the last 5
#: minutes of sends, the last send, the first row, the first and last planned pending time).
COUNTER_READ_INDEXES = {"send_log_campaign_sent_idx", "send_log_campaign_minted_idx",
                        "send_log_campaign_minted_cover_idx", "send_log_campaign_open_idx"}


@pytest.mark.parametrize("name, campaign", [("progress", None), ("progress", "practice_tips"),
                                            ("outcomes", None), ("outcomes", "practice_tips")])
def test_the_page_counts_from_counters_not_from_the_rows(big: psycopg.Connection, name: str,
                                                         campaign: str | None) -> None:
    sql = query("counters", name)
    with big.transaction(force_rollback=True):
        big.execute("set local jit = off")
        [[doc]] = big.execute(f"explain (analyze, format json) {sql}", {"campaign": campaign}).fetchall()
    nodes = _actual((doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"])
    send_log = [(t, i, n) for t, rel, i, n in nodes if rel == "send_log"]
    assert [n for n in nodes if n[1] == "delivery_status"] == []
    assert {t for t, _, _ in send_log} <= {"Index Scan", "Index Only Scan", "Index Scan Backward",
                                           "Index Only Scan Backward"}, send_log
    assert {i for _, i, _ in send_log} <= COUNTER_READ_INDEXES, send_log
    # a few rows per campaign (each read is a LIMIT or the last 5 minutes), not its 20,000 rows
    assert sum(n for _, _, n in send_log) <= 100, send_log
    assert sum(n for t, rel, _, n in nodes if rel == "send_log" and t.startswith("Seq")) == 0


def test_the_counters_equal_the_views_on_the_big_send_log(big: psycopg.Connection) -> None:
    view = big.execute("select campaign, total, pending, sending, sent, failed, cancelled, rolled_back,"
                       " dead_lettered, invalid, holdout, last_sent_at, next_due_at, last_due_at, first_minted_at"
                       " from mail.campaign_progress order by campaign").fetchall()
    cur = big.execute(query("counters", "progress"), {"campaign": None})
    names = [d.name for d in cur.description or ()]
    cols = ("campaign", "total", "pending", "sending", "sent", "failed", "cancelled", "rolled_back", "dead_lettered",
            "invalid", "holdout", "last_sent_at", "next_due_at", "last_due_at", "first_minted_at")
    counted = [tuple(r[names.index(c)] for c in cols) for r in cur.fetchall()]
    assert counted == view and len(view) == 10


@pytest.mark.parametrize("days", [14, 3, 1])
def test_the_page_day_table_equals_campaign_daily(big: psycopg.Connection, days: int) -> None:
    for (campaign,) in big.execute("select distinct campaign from mail.send_log").fetchall():
        params = {"campaign": campaign, "days": days}
        got = big.execute(query("counters", "latest_days"), params).fetchall()
        assert got == big.execute(progress.DAYS_SQL, params).fetchall(), campaign
        assert len(got) == days


def test_the_page_day_table_reads_the_latest_days_not_the_history(big: psycopg.Connection) -> None:
    # practice_tips: 20,000 rows over two years; its 14 latest days are a few percent of them
    with big.transaction(force_rollback=True):
        big.execute("set local jit = off")
        [[doc]] = big.execute("explain (analyze, format json) " + query("counters", "latest_days"),
                              {"campaign": "practice_tips", "days": 14}).fetchall()
    nodes = _actual((doc if isinstance(doc, list) else json.loads(doc))[0]["Plan"])
    read = [(t, i, n) for t, rel, i, n in nodes if rel == "send_log"]
    assert all(t.startswith("Index") or t == "Bitmap Heap Scan" for t, _, _ in read), read
    assert sum(n for _, _, n in read) < 4_000, read  # failed rows (4%), 44 days of mints and sends, probes
