"""The per-campaign counters of migration 0028 equal a full recount of the send log, whatever happened.

After a random mix of the writers' statements (mint in every state, claim, send, reject, release,
dead-letter, cancel, decide, outcome reports, a rolled-back change), with folds interleaved anywhere,
the counters (``counters.progress`` / ``counters.outcomes``: folded counts plus the unfolded deltas)
equal ``mail.campaign_progress`` and ``mail.campaign_outcomes``, which count every row. Concurrent
writers and folds count nothing twice; a fold while another runs is skipped; the first fold after
an upgrade seeds the counters from the send log.
"""

from __future__ import annotations

import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mailflow.orchestration.ui import progress_queries as page
from mailflow.store.sql import query

CAMPAIGNS = ("lc_a", "lc_b", "sc_c")
RUN = {"dag_id": "d", "run_id": "r", "task_id": "t"}
COUNTED = ("total", "pending", "sending", "sent", "failed", "cancelled", "rolled_back", "dead_lettered", "done",
           "percent_done", "duplicate", "skipped", "invalid", "holdout", "first_minted_at", "next_due_at",
           "last_due_at", "last_sent_at", "kind", "campaign_status", "active")
OUTCOME_COLUMNS = ("sent", "delivered", "hard_bounced", "soft_bounced", "complained", "failed_after_send", "suppressed",
                   "unique_opens", "unique_clicks", "no_outcome_yet", "delivered_rate", "hard_bounce_rate",
                   "complaint_rate", "open_rate", "click_rate", "guard_state", "account_guard_state", "holdout")


#: mail.campaign_outcomes_daily as 0021 defined it: every sent email of the campaign and its delivery_status row,
#: counted on each read (the day counters of 0031 must give exactly this).
OUTCOMES_DAILY_RECOUNT = """
select l.campaign, l.kind, coalesce(c.timezone, 'UTC') as timezone,
       (l.sent_at at time zone coalesce(c.timezone, 'UTC'))::date as day,
       count(*) as sent, count(d.delivered_at), count(d.hard_bounced_at), count(d.soft_bounced_at),
       count(d.complained_at), count(d.failed_at), count(d.suppressed_at), count(d.first_opened_at),
       count(d.first_clicked_at), count(*) filter (where d.outcome is null or d.outcome = 'delayed')
from mail.send_log l
left join mail.campaign c on l.kind = 'scheduled' and c.name = l.campaign
left join mail.delivery_status d on d.send_log_id = l.id
where l.status = 'sent'
group by 1, 2, 3, 4
order by 1, 2, 4
"""
OUTCOMES_DAILY = ("select campaign, kind, timezone, day, sent, delivered, hard_bounced, soft_bounced, complained,"
                  " failed_after_send, suppressed, unique_opens, unique_clicks, no_outcome_yet"
                  " from mail.campaign_outcomes_daily order by campaign, kind, day")


def day_counters_used(conn: psycopg.Connection) -> bool:
    """Whether the day counters hold every sent email (seeded), as mail.campaign_outcomes_daily reads them."""
    return conn.execute("select seeded_at is not null from mail.campaign_day_counter_state").fetchone() == (True,)


def _by_campaign(conn: psycopg.Connection, sql: str, params: dict[str, Any] | None, columns: tuple[str, ...]
                 ) -> dict[str, tuple[Any, ...]]:
    cur = conn.execute(sql, params)
    names = [d.name for d in cur.description or ()]
    return {r[names.index("campaign")]: tuple(r[names.index(c)] for c in columns) for r in cur.fetchall()}


def assert_counters_exact(conn: psycopg.Connection) -> None:
    """Counters (folded + unfolded) equal the views' full recount, column by column, campaign by campaign."""
    view = _by_campaign(conn, "select * from mail.campaign_progress", None, COUNTED)
    counted = _by_campaign(conn, query("counters", "progress"), {"campaign": None}, COUNTED)
    assert counted == view
    view_o = _by_campaign(conn, "select * from mail.campaign_outcomes", None, OUTCOME_COLUMNS)
    counted_o = _by_campaign(conn, query("counters", "outcomes"), {"campaign": None}, OUTCOME_COLUMNS)
    assert counted_o == view_o
    # per day of sending (Q12): the day counters (folded + unfolded) equal the recount, day by day
    assert day_counters_used(conn)
    assert conn.execute(OUTCOMES_DAILY).fetchall() == conn.execute(OUTCOMES_DAILY_RECOUNT).fetchall()
    for name in CAMPAIGNS:  # the page's one-campaign form and its day table read the same numbers
        one = _by_campaign(conn, query("counters", "progress"), {"campaign": name}, COUNTED)
        assert one == {k: v for k, v in view.items() if k == name}
        params = {"campaign": name, "days": 14}
        assert conn.execute(query("counters", "latest_days"), params).fetchall() == conn.execute(
            page.DAYS_SQL, params).fetchall()


def fold(conn: psycopg.Connection) -> int | None:
    return conn.execute(query("counters", "fold")).fetchone()[0]  # type: ignore[index]


def ids_where(conn: psycopg.Connection, where: str, pick: list[int]) -> list[int]:
    """Some ids of rows matching ``where`` (a constant condition of this test), chosen by ``pick``."""
    rows = [r[0] for r in conn.execute(f"select id from mail.send_log where {where} order by id").fetchall()]
    return sorted({rows[i % len(rows)] for i in pick}) if rows else []


def mint(conn: psycopg.Connection, campaign: str, status: str, users: list[int]) -> None:
    """Rows as the writers create them: lifecycle claimed ('sending', claimed_at), decided at once
    ('failed' invalid, 'duplicate', 'holdout': never claimed), scheduled 'pending' with a planned time."""
    kind = "scheduled" if campaign.startswith("sc_") else "lifecycle"
    conn.execute(
        "with m as (insert into mail.send_log (user_id, campaign, kind, email, status, claimed_at, scheduled_at,"
        "                                     attempts)"
        " select u, %(c)s, %(kind)s, 'u' || u || '@example.com', %(s)s,"
        "        case when %(s)s = 'sending' then now() end,"
        "        case when %(s)s = 'pending' then now() + u * interval '1 minute' end,"
        "        case when %(s)s = 'sending' then 1 else 0 end"
        " from unnest(%(u)s::bigint[]) as u"
        " on conflict (user_id, campaign) where released_at is null do nothing returning id, status)"
        " insert into mail.send_event (send_log_id, from_status, to_status) select id, null, status from m",
        {"c": campaign, "kind": kind, "s": status, "u": users})


def apply(conn: psycopg.Connection, op: tuple[Any, ...]) -> None:
    """One writer statement of the product (named queries where the product has one)."""
    what = op[0]
    if what == "mint":
        mint(conn, op[1], op[2], op[3])
    elif what == "claim":  # scheduled: pending -> sending (scheduled.claim_rows' change)
        ids = ids_where(conn, "status = 'pending'", op[1])
        conn.execute(query("scheduled", "claim_rows"),
                     {"ids": ids, "emails": [f"{i}@example.com" for i in ids], "keys": [None] * len(ids), **RUN})
    elif what == "send":
        ids = ids_where(conn, "status = 'sending'", op[1])
        conn.execute(query("send_log", "mark_sent"), {"ids": ids, "pids": [f"p-{i}" for i in ids], **RUN})
    elif what == "reject":
        ids = ids_where(conn, "status = 'sending'", op[1])
        conn.execute(query("send_log", "mark_failed"), {"ids": ids, "msgs": ["550 no"] * len(ids), **RUN})
    elif what == "release":  # lifecycle: failed + released_at (rolled back); scheduled: back to pending
        ids = ids_where(conn, "status = 'sending'", op[1])
        conn.execute(query("send_log", "release"), {"ids": ids, "reason": "503", **RUN})
    elif what == "dead_letter":  # repair.fail_past_window's change
        ids = ids_where(conn, "status = 'sending'", op[1])
        conn.execute("update mail.send_log set status = 'failed', dead_lettered_at = now(), error = 'unknown outcome'"
                     " where id = any(%s::bigint[]) and status = 'sending'", (ids,))
    elif what == "cancel":
        conn.execute(query("scheduled", "cancel_pending"), {"campaign": "sc_c", "reason": "cancelled", **RUN})
    elif what == "decide":  # scheduled.decide_rows: skipped, failed (invalid address) or cancelled
        ids = ids_where(conn, "status = 'pending'", op[1])
        conn.execute(query("scheduled", "decide_rows"),
                     {"ids": ids, "statuses": [op[2]] * len(ids), "reasons": ["why"] * len(ids),
                      "ats": [None] * len(ids), **RUN})
    elif what == "outcome":
        ids = ids_where(conn, "status = 'sent'", op[1])
        event, bounce = op[2]
        now = datetime.now(UTC)
        conn.execute(query("outcomes", "record_events"), {
            "send_log_ids": ids, "pids": [f"p-{i}" for i in ids], "events": [event] * len(ids),
            "bounce_types": [bounce] * len(ids), "occurred": [now - timedelta(seconds=op[3])] * len(ids),
            "sources": ["webhook"] * len(ids), "svix_ids": [uuid.uuid4().hex for _ in ids]})
    elif what == "rolled_back":  # a change whose transaction rolls back leaves no delta
        with pytest.raises(RuntimeError), conn.transaction():
            apply(conn, op[1])
            raise RuntimeError("roll back")
    elif what == "fold":
        fold(conn)
    else:  # pragma: no cover
        raise AssertionError(what)


picks = st.lists(st.integers(0, 50), min_size=1, max_size=6)
plain_ops = st.one_of(
    st.tuples(st.just("mint"), st.sampled_from(CAMPAIGNS[:2]),
              st.sampled_from(("sending", "sending", "failed", "duplicate", "holdout")),
              st.lists(st.integers(1, 40), min_size=1, max_size=8)),
    st.tuples(st.just("mint"), st.just("sc_c"), st.sampled_from(("pending", "pending", "holdout")),
              st.lists(st.integers(1, 40), min_size=1, max_size=8)),
    st.tuples(st.just("claim"), picks),
    st.tuples(st.just("send"), picks),
    st.tuples(st.just("reject"), picks),
    st.tuples(st.just("release"), picks),
    st.tuples(st.just("dead_letter"), picks),
    st.tuples(st.just("cancel")),
    st.tuples(st.just("decide"), picks, st.sampled_from(("skipped", "failed", "cancelled"))),
    st.tuples(st.just("outcome"), picks,
              st.sampled_from((("delivered", None), ("opened", None), ("clicked", None), ("bounced", "Permanent"),
                               ("bounced", "Transient"), ("complained", None), ("delivery_delayed", None),
                               ("failed", None), ("suppressed", None))),
              st.integers(0, 3600)),
    st.tuples(st.just("fold")),
)
ops = st.one_of(plain_ops, st.tuples(st.just("rolled_back"), plain_ops))


@pytest.fixture
def campaign_row(db: psycopg.Connection) -> psycopg.Connection:
    db.execute("insert into mail.campaign (name, timezone, emails_per_day, weekdays, windows, start_at, template,"
               " subject, from_address, recipients_table, status)"
               " values ('sc_c', 'Europe/Berlin', 100, '{1,2,3,4,5}', '{09:00-17:00}', now(), 't', 's',"
               " 'Team <t@example.com>', 'mail.campaign_recipient', 'scheduled') on conflict (name) do nothing")
    return db


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink))
@given(steps=st.lists(ops, min_size=1, max_size=30))
def test_counters_equal_a_full_recount_after_any_mix_of_changes(campaign_row: psycopg.Connection,
                                                                steps: list[tuple[Any, ...]]) -> None:
    db = campaign_row
    db.execute("truncate mail.send_event, mail.delivery_event, mail.delivery_status, mail.send_log cascade")
    assert db.execute("select count(*) from mail.campaign_counts").fetchone() == (0,)
    # rows in flight and planned in every campaign first, so most steps find rows to change
    for campaign, status in (("lc_a", "sending"), ("lc_b", "sending"), ("sc_c", "pending")):
        mint(db, campaign, status, list(range(100, 112)))
    for step in steps:
        apply(db, step)
    assert_counters_exact(db)  # before the fold: counters + unfolded deltas
    fold(db)
    assert db.execute("select count(*) from mail.campaign_counter_delta").fetchone() == (0,)
    assert db.execute("select count(*) from mail.campaign_day_counter_delta").fetchone() == (0,)
    assert_counters_exact(db)


def test_an_example_by_hand_counts_each_state_and_outcome(campaign_row: psycopg.Connection) -> None:
    db = campaign_row
    mint(db, "lc_a", "sending", [1, 2, 3, 4, 5, 6])
    mint(db, "lc_a", "failed", [7])
    mint(db, "lc_a", "holdout", [8])
    apply(db, ("send", [0, 1, 2]))        # 1, 2, 3 sent
    apply(db, ("reject", [0]))            # 4 failed (rejected)
    apply(db, ("release", [0]))           # 5 rolled back
    apply(db, ("dead_letter", [0]))       # 6 dead-lettered
    apply(db, ("outcome", [0], ("opened", None), 5))          # 1: delivered (implied) + opened
    apply(db, ("outcome", [1], ("bounced", "Permanent"), 5))  # 2: hard bounce
    fold(db)
    counts = dict(db.execute("select key, n from mail.campaign_counts where campaign = 'lc_a'").fetchall())
    assert counts == {"sending": 0, "sent": 3, "failed": 3, "rolled_back": 1, "dead_lettered": 1, "invalid": 1,
                      "holdout": 1, "delivered": 1, "unique_opens": 1, "hard_bounced": 1, "with_outcome": 2}
    assert_counters_exact(db)


def test_two_folds_at_once_skip_rather_than_count_twice(db_dsn: str, db: psycopg.Connection) -> None:
    mint(db, "lc_a", "sending", list(range(1, 21)))
    with psycopg.connect(db_dsn) as other:
        assert fold(other) == 1  # holds the state row until it commits
        assert fold(db) is None  # busy: skipped, nothing folded
        other.commit()
    assert fold(db) == 0
    assert db.execute("select n from mail.campaign_counter where campaign = 'lc_a' and key = 'sending'"
                      ).fetchone() == (20,)


def test_concurrent_writers_and_folds_count_each_change_once(db_dsn: str, db: psycopg.Connection) -> None:
    errors: list[BaseException] = []

    def writer(offset: int) -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                for i in range(15):
                    mint(c, "lc_a", "sending", [offset + i * 10 + j for j in range(10)])
                    ids = [r[0] for r in c.execute("select id from mail.send_log where status = 'sending'"
                                                   " and user_id between %s and %s", (offset, offset + 999))]
                    c.execute(query("send_log", "mark_sent"), {"ids": ids[::2], "pids": [f"p{i}" for i in ids[::2]],
                                                               **RUN})
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def folder() -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                for _ in range(40):
                    fold(c)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    def reporter(offset: int) -> None:  # outcomes of the sent emails arrive while they are sent and folded
        try:
            with psycopg.connect(db_dsn, autocommit=True) as c:
                for _ in range(20):
                    ids = [r[0] for r in c.execute(
                        "select l.id from mail.send_log l where l.status = 'sent' and l.user_id between %s and %s"
                        " and not exists (select 1 from mail.delivery_status d where d.send_log_id = l.id)"
                        " order by l.id limit 5", (offset, offset + 999))]
                    if ids:
                        c.execute(query("outcomes", "record_events"), {
                            "send_log_ids": ids, "pids": [f"p{i}" for i in ids], "events": ["delivered"] * len(ids),
                            "bounce_types": [None] * len(ids), "occurred": [datetime.now(UTC)] * len(ids),
                            "sources": ["webhook"] * len(ids), "svix_ids": [uuid.uuid4().hex for _ in ids]})
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(o,)) for o in (1000, 2000)]
    threads += [threading.Thread(target=reporter, args=(o,)) for o in (1000, 2000)]
    threads += [threading.Thread(target=folder) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert_counters_exact(db)
    fold(db)
    assert_counters_exact(db)
    assert db.execute("select sum(n) from mail.campaign_counts where key in ('sending', 'sent')").fetchone() == (300,)


def test_the_first_fold_seeds_from_the_send_log_and_keeps_later_changes(db: psycopg.Connection) -> None:
    mint(db, "lc_a", "sending", [1, 2, 3])
    apply(db, ("send", [0]))
    # as after an upgrade of a send log with rows: counters empty, not seeded, deltas of earlier writes around
    db.execute("update mail.campaign_counter_state set seeded_at = null")
    db.execute("delete from mail.campaign_counter")
    db.execute("insert into mail.campaign_counter_delta values ('lc_a', 'sent', 7)")  # seen by the seed: dropped
    assert db.execute(query("counters", "seeded")).fetchone() == (False,)
    assert fold(db) == 2  # counter rows written: sending 2, sent 1
    assert db.execute(query("counters", "seeded")).fetchone() == (True,)
    apply(db, ("send", [0]))
    assert_counters_exact(db)


def test_the_first_day_fold_seeds_from_the_send_log_and_keeps_later_changes(campaign_row: psycopg.Connection) -> None:
    """The day counters' first fold (migration 0031 runs it on a send log with sent emails) counts the send
    log once: the deltas that count saw are dropped, later ones kept."""
    db = campaign_row
    mint(db, "lc_a", "sending", [1, 2, 3, 4])
    mint(db, "sc_c", "pending", [5, 6])
    apply(db, ("claim", [0, 1]))
    apply(db, ("send", [0, 1, 2, 3, 4, 5]))
    apply(db, ("outcome", [0, 1], ("bounced", "Permanent"), 5))
    db.execute("update mail.campaign_day_counter_state set seeded_at = null")
    db.execute("delete from mail.campaign_day_counter")
    db.execute("insert into mail.campaign_day_counter_delta values ('lc_a', current_date, 'lifecycle', 'sent', 7)")
    assert not day_counters_used(db)
    folded = db.execute("select mail.fold_campaign_day_counters()").fetchone()
    assert folded is not None and folded[0] >= 4  # sent and the outcome keys of lc_a's day, sent of sc_c's
    assert day_counters_used(db)
    assert db.execute("select count(*) from mail.campaign_day_counter_delta").fetchone() == (0,)
    apply(db, ("outcome", [2], ("delivered", None), 5))  # after the seed: deltas, counted once
    assert db.execute("select key, n from mail.campaign_day_counter_delta order by key").fetchall() == [
        ("delivered", 1), ("with_outcome", 1)]
    assert_counters_exact(db)
    assert db.execute("select sum(sent), sum(hard_bounced), sum(delivered) from mail.campaign_outcomes_daily"
                      ).fetchone() == (6, 2, 1)
