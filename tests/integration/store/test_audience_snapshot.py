"""The run's audience snapshot (``PostgresStore.open_audience``, issue 16) against the live audience
query (``lifecycle.eligible``, which counts, dry runs and live pages read), on the demo population
with a send-log history that exercises every exclusion: for every lifecycle campaign the snapshot
holds exactly the rows, emails and contexts the live query returns. The snapshot is one statement
(the policy as one probe per candidate, the context built per page) and the live query the
set-based anti-joins: the same rules by two routes. Also: an audience file's rewrite selects what
its earlier form selected (practice_tips' DISTINCT ON set against the lateral probe it replaced),
and a user listed twice by an audience file counts once."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.model.outcome import DataInterval
from mailflow.store.migrate import migrate
from mailflow.store.send_log import PostgresStore, eligible_sql
from mailflow.store.sql import query
from mailflow_dev import devenv
from mailflow_dev.demo import load_demo_data

ANCHOR = datetime(2025, 3, 10, 12, 0, tzinfo=UTC)
INTERVAL = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
LIFECYCLE = ("finish_assessment", "first_practice", "upgrade_offer", "practice_tips")

# Every other user has 1-3 rows: sent over the last 40 days (cooldown 7 days, cap 3 per 28 days),
# failed (a fifth of them released: not a dedupe), pending scheduled mail of the coming days,
# in-flight and cancelled rows, over the four lifecycle campaigns and a newsletter.
HISTORY_SQL = """
insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, claimed_at, sent_at, released_at,
                           provider_message_id, attempts, error)
select user_id, campaign, case when campaign like 'newsletter%%' then 'scheduled' else 'lifecycle' end, email, st,
       case when st = 'pending' then %(anchor)s + interval '10 days' * r end,
       case when st in ('sending', 'sent', 'failed') then %(anchor)s - interval '40 days' * r end,
       case when st = 'sent' then %(anchor)s - interval '40 days' * r end,
       case when st = 'failed' and r2 < 0.2 then %(anchor)s - interval '40 days' * r end,
       case when st = 'sent' then 'planted-' || user_id || '-' || g end, 1,
       case when st = 'failed' then 'rejected' end
from (select u.user_id, u.email, g, random() as r, random() as r2,
             (array['finish_assessment', 'first_practice', 'upgrade_offer', 'practice_tips', 'newsletter_1'])
                 [1 + floor(random() * 5)::int] as campaign,
             (array['sent', 'sent', 'sent', 'sent', 'sent', 'sent', 'failed', 'pending', 'sending', 'cancelled'])
                 [1 + floor(random() * 10)::int] as st
      from app.users u, generate_series(1, 3) g
      where u.user_id %% 2 = 0 and g <= 1 + u.user_id %% 3) as x
on conflict (user_id, campaign) where released_at is null do nothing
"""
# Suppressions: by user for all mail and for one campaign, by address in another spelling.
SUPPRESSION_SQL = (
    "insert into mail.suppression (user_id, scope, source)"
    " select user_id, case when user_id % 2 = 0 then 'all' else 'practice_tips' end, 'unsubscribe'"
    " from app.users where user_id % 37 = 0",
    # the mailbox key of these ASCII test addresses is the trimmed address in lower case
    "insert into mail.suppression (email, email_key, source)"
    " select ' ' || upper(btrim(email)) || ' ', lower(btrim(email)), 'bounce' from app.users where user_id % 41 = 0"
    " on conflict do nothing",
)


@pytest.fixture(scope="module")
def store(pg_admin_dsn: str) -> Iterator[PostgresStore]:
    name = f"mailflow_snapshot_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            load_demo_data(conn, users=5000, seed=42, anchor=ANCHOR)
            conn.execute("select setseed(0.16)")
            conn.execute(HISTORY_SQL, {"anchor": ANCHOR})
            for statement in SUPPRESSION_SQL:
                conn.execute(statement)
            conn.execute("vacuum analyze")
            yield PostgresStore(conn)
    finally:
        devenv.drop_database(pg_admin_dsn, name)


def _campaign(name: str) -> Campaign:
    return next(c for c in load_campaigns() if c.name == name)


def _snapshot_rows(store: PostgresStore, c: Campaign) -> tuple[int, list[tuple[Any, ...]]]:
    """open_audience, then every page of the snapshot (as the mint reads them)."""
    size = store.open_audience(c, c.window(INTERVAL), INTERVAL.end - c.cooldown)
    page = pgsql.SQL(query("lifecycle", "snapshot_page")).format(snapshot=store._snapshots[c.name])
    rows: list[tuple[Any, ...]] = []
    while True:
        got = store.conn.execute(page, {"after": rows[-1][0] if rows else 0, "limit": 100}).fetchall()
        if not got:
            break
        rows += got
    store.close_audience(c)
    return size, rows


def _live_rows(store: PostgresStore, c: Campaign) -> list[tuple[Any, ...]]:
    params = store._params(c, c.window(INTERVAL), INTERVAL.end - c.cooldown)
    return store.conn.execute(pgsql.SQL("select e.user_id, e.email, e.context from ({}) as e order by e.user_id")
                              .format(eligible_sql(c)), params).fetchall()


@pytest.mark.parametrize("name", LIFECYCLE)
def test_the_snapshot_holds_exactly_the_live_audience(store: PostgresStore, name: str) -> None:
    c = _campaign(name)
    size, rows = _snapshot_rows(store, c)
    live = _live_rows(store, c)
    assert live, f"{name}: the planted population leaves nobody"
    assert size == len(rows) == len(live)
    assert rows == live  # same users, emails and contexts (key by key)
    # every exclusion removed someone, so the comparison is not vacuous
    params = store._params(c, c.window(INTERVAL), INTERVAL.end - c.cooldown)
    audience = store.conn.execute(pgsql.SQL("select count(*) from ({}) as a").format(pgsql.SQL(c.audience_sql)),
                                  params).fetchone()
    assert audience is not None and audience[0] > len(live)


def test_the_snapshot_of_an_exempt_campaign_skips_only_the_policy(store: PostgresStore) -> None:
    c = dataclasses.replace(_campaign("practice_tips"), name="receipt", exempt=True)
    size, rows = _snapshot_rows(store, c)
    assert size == len(rows) and rows == _live_rows(store, c)
    held = _live_rows(store, dataclasses.replace(c, exempt=False))
    assert len(held) < len(rows)  # the policy would hold some of them back


def test_a_user_listed_twice_counts_once(store: PostgresStore) -> None:
    once = dataclasses.replace(_campaign("practice_tips"), name="twice",
                               audience_sql="select user_id, email, first_name from app.users where user_id <= 300")
    twice = dataclasses.replace(once, audience_sql=once.audience_sql + "\nunion all\n" + once.audience_sql)
    size, rows = _snapshot_rows(store, twice)
    assert size == len(rows) == len({r[0] for r in rows})
    assert rows == _snapshot_rows(store, once)[1] == _live_rows(store, once)


# practice_tips.sql before issue 16's rewrite: the latest assessment per candidate by a lateral probe
PRACTICE_TIPS_LATERAL = """
select u.user_id, u.email, u.first_name, r.kind as recent_kind
from app.users u
left join lateral (
        select a.kind from app.assessments a
        where a.user_id = u.user_id and a.started_at >= %(window_start)s and a.started_at < %(window_end)s
        order by a.started_at desc, a.assessment_id desc
        limit 1
     ) r on true
where u.user_id in (
        select x.user_id from app.users x
        where x.last_active_at >= %(window_start)s and x.last_active_at < %(window_end)s
        union
        select a.user_id from app.assessments a
        where a.started_at >= %(window_start)s and a.started_at < %(window_end)s)
"""


@pytest.mark.parametrize("days_back", [0, 3, 30])
def test_practice_tips_selects_what_its_lateral_form_selected(store: PostgresStore, days_back: int) -> None:
    """Same users, same columns, same recent_kind (ties on started_at included: the demo data has
    none by chance, so two assessments of one user are planted at the same instant)."""
    conn = store.conn
    end = ANCHOR - timedelta(days=days_back)
    with conn.transaction(force_rollback=True):
        uid = conn.execute("select min(user_id) from app.users").fetchone()[0]  # type: ignore[index]
        top = conn.execute("select max(assessment_id) from app.assessments").fetchone()[0]  # type: ignore[index]
        for aid, kind in ((top + 1, "verbal"), (top + 2, "logical")):
            conn.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at)"
                         " values (%s, %s, %s, true, %s)", (aid, uid, kind, end - timedelta(hours=2)))
        params = {"window_start": end - timedelta(days=7), "window_end": end}
        new = conn.execute(pgsql.SQL("select * from ({}) as a order by user_id").format(
            pgsql.SQL(_campaign("practice_tips").audience_sql)), params)
        new_rows, new_cols = new.fetchall(), [d.name for d in new.description or []]
        old = conn.execute(pgsql.SQL("select * from ({}) as a order by user_id").format(
            pgsql.SQL(PRACTICE_TIPS_LATERAL)), params)
        assert [d.name for d in old.description or []] == new_cols
        assert new_rows == old.fetchall() and new_rows
        assert (uid, "logical") in {(r[0], r[3]) for r in new_rows}  # the tie: the highest assessment_id
