"""The progress page's chart data (``mailflow.orchestration.ui.progress_queries.load_series``) on a real send log:
exact buckets, zero-filling, the live/history switch and planned-vs-sent cumulative curves."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import psycopg

from mailflow.orchestration.ui.progress_queries import load_series
from mailflow.sources import scheduled


def t(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def epoch(d: datetime | date) -> int:
    if isinstance(d, datetime):
        return int(d.timestamp())
    return int(datetime(d.year, d.month, d.day, tzinfo=UTC).timestamp())


def add(db: psycopg.Connection[Any], uid: int, campaign: str, kind: str, status: str,
        scheduled_at: datetime | None = None, sent_at: datetime | None = None) -> None:
    db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, sent_at,"
               " provider_message_id) values (%s, %s, %s, %s, %s, %s, %s, %s)",
               (uid, campaign, kind, f"u{uid}@example.com", status, scheduled_at, sent_at,
                f"pid-{campaign}-{uid}" if status == "sent" else None))


def populate(db: psycopg.Connection[Any]) -> None:
    # a scheduled campaign, still sending (status scheduled, pending rows): live
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    cid = scheduled.create_campaign(db, {"name": "sched_c", "template": "outreach", "subject": "x",
                                         "from": "a@mail.example.com", "recipients_sql": "free_plan_users"})
    db.execute("update mail.campaign set status = 'scheduled' where id = %s", (cid,))
    add(db, 1, "sched_c", "scheduled", "sent", t(2026, 1, 5, 9, 0), t(2026, 1, 5, 9, 0, 5))
    add(db, 2, "sched_c", "scheduled", "sent", t(2026, 1, 5, 9, 30), t(2026, 1, 5, 9, 30, 2))
    add(db, 3, "sched_c", "scheduled", "sent", t(2026, 1, 5, 10, 0), t(2026, 1, 5, 10, 0, 7))
    add(db, 4, "sched_c", "scheduled", "pending", t(2026, 1, 5, 10, 15))
    add(db, 5, "sched_c", "scheduled", "pending", t(2026, 1, 5, 11, 0))
    add(db, 6, "sched_c", "scheduled", "cancelled", t(2026, 1, 5, 12, 0))  # not planned any more
    # a lifecycle campaign, done long ago: history
    add(db, 1, "life_c", "lifecycle", "sent", sent_at=t(2026, 1, 3, 10, 0))
    add(db, 2, "life_c", "lifecycle", "sent", sent_at=t(2026, 1, 3, 23, 0))
    add(db, 3, "life_c", "lifecycle", "sent", sent_at=t(2026, 1, 5, 8, 0))
    add(db, 4, "life_c", "lifecycle", "failed")


NOW = t(2026, 1, 5, 10, 30, 40)


def test_live_campaign_sends_per_minute_and_planned_vs_sent_cumulative(db: psycopg.Connection[Any]) -> None:
    populate(db)
    s = load_series(db, "sched_c", now=NOW)
    assert s is not None and s["active"] is True
    sends = s["sends"]
    start = t(2026, 1, 5, 8, 31)  # the 120 minutes ending with the current one (10:30)
    assert sends["unit"] == "minute"
    assert sends["t"] == [epoch(start + timedelta(minutes=i)) for i in range(120)]
    counts = sends["series"]["sched_c"]
    assert {i: n for i, n in enumerate(counts) if n} == {29: 1, 59: 1, 89: 1}  # 09:00, 09:30, 10:00
    assert list(sends["series"]) == ["sched_c"]
    plan = s["plan"]
    assert plan == {"unit": "hour", "t": [epoch(t(2026, 1, 5, h)) for h in (9, 10, 11)],
                    "planned": [2, 4, 5], "sent": [2, 3, 3]}


def test_finished_campaign_sends_per_day_with_empty_days_and_no_plan(db: psycopg.Connection[Any]) -> None:
    populate(db)
    s = load_series(db, "life_c", now=NOW)
    assert s is not None and s["active"] is False and s["plan"] is None
    assert s["sends"] == {"unit": "day", "t": [epoch(date(2026, 1, d)) for d in (3, 4, 5)],
                          "series": {"life_c": [2, 0, 1]}}
    assert load_series(db, "nope", now=NOW) is None


def test_list_is_live_while_any_campaign_is_active(db: psycopg.Connection[Any]) -> None:
    populate(db)
    s = load_series(db, now=NOW)
    assert s is not None and s["active"] is True and s["plan"] is None
    assert s["sends"]["unit"] == "minute" and len(s["sends"]["t"]) == 120
    # life_c's last send (08:00) is before the window: only sched_c has a series
    assert {k: sum(v) for k, v in s["sends"]["series"].items()} == {"sched_c": 3}
    db.execute("update mail.send_log set status = 'cancelled' where status = 'pending'")
    s = load_series(db, now=NOW)
    assert s is not None and s["active"] is False
    days = s["sends"]
    assert days["unit"] == "day" and len(days["t"]) == 30 and days["t"][-1] == epoch(date(2026, 1, 5))
    assert days["series"]["life_c"][-3:] == [2, 0, 1] and days["series"]["sched_c"][-1] == 3
