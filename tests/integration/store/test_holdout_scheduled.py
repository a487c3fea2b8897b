"""Holdout groups of scheduled campaigns (docs/model.md, "Holdout groups"): provisioning records the
members of the campaign's holdout group as ``holdout`` rows without a slot in the plan; dispatch never
claims them; the canary is a share of the rows that are sent. Real PostgreSQL and the emulator over
HTTP (tests/scheduled_rig.py); every expected set comes from :func:`mailflow.model.holdout.in_holdout`.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import psycopg
from conftest import MAIL_TABLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduled_rig import ALL_DAY, PAST, Rig
from scheduled_rig import rig as rig  # noqa: F401  (fixture)

from mailflow.model.holdout import in_holdout
from mailflow.store import lift
from mailflow.store.scheduled import ScheduledStore
from mailflow.store.sql import analytics
from mailflow_dev.demo.loader import install_lift_view

SLOW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def by_status(db: psycopg.Connection, campaign: str) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for uid, status in db.execute("select user_id, status from mail.send_log where campaign = %s", (campaign,)):
        out.setdefault(status, set()).add(int(uid))
    return out


def test_scheduled_holdout_rows_take_their_slot_of_the_plan_and_dispatch_never_sends_them(rig: Rig) -> None:
    """The plan is made for every recipient, then the holdout group is marked: a held-out row keeps the slot
    it would have been sent in (the lift's window starts there), exactly the plan of a campaign without a
    holdout group, and the treated rows keep theirs; the slot sends nothing."""
    rig.users(50)
    cid = rig.campaign(**(ALL_DAY | {"emails_per_day": 20, "holdout_share": 0.2}))
    assert rig.campaign_row(cid)["holdout_share"] == 0.2
    held = {u for u in range(1, 51) if in_holdout("outreach_test", u, 0.2)}
    summary = rig.provision(cid, chunk=9)
    assert (summary.created, summary.holdout) == (50, len(held))
    rows = rig.rows("campaign = 'outreach_test'")
    assert {r["user_id"] for r in rows if r["status"] == "holdout"} == held
    assert all(r["scheduled_at"] is not None for r in rows)
    # the same slots, user by user, as the plan of the same recipients without a holdout group
    slots = {r["user_id"]: r["scheduled_at"] for r in rows}
    cid2 = rig.campaign("outreach_plain", **(ALL_DAY | {"emails_per_day": 20, "recipients_sql": "free_plan_users"}))
    rig.provision(cid2, chunk=9)
    plain = {r["user_id"]: r["scheduled_at"] for r in rig.rows("campaign = 'outreach_plain'")}
    assert slots == plain and len(set(plain.values())) == 50
    # spread over the same days: 20 slots a day, held-out users among them (not after them)
    assert len({t.date() for t in plain.values()}) == 3
    assert {slots[u].date() for u in held} == {t.date() for t in plain.values()}
    # the summary's sends are the emails: the held-out slots are not sends
    treated_times = sorted(slots[u] for u in slots if u not in held)
    assert (summary.first_send, summary.last_send) == (treated_times[0], treated_times[-1])
    assert summary.per_day_max == max(Counter(t.date() for t in treated_times).values()) < 20
    rig.db.execute("update mail.campaign set status = 'cancelled' where id = %s", (cid2,))
    # three days of slots, all long overdue: the per-day cap at claim time would re-plan them (no burst);
    # here they are all due at once, as one day's
    rig.db.execute("update mail.campaign set emails_per_day = 1000 where id = %s", (cid,))
    d = rig.dispatch()
    assert d.sent == 50 - len(held)
    assert by_status(rig.db, "outreach_test") == {"holdout": held, "sent": set(range(1, 51)) - held}
    sent_ids = {r["id"] for r in rig.rows("campaign = 'outreach_test' and status = 'sent'")}
    assert set(rig.outbox_ids()) == sent_ids
    # nothing pending or sending is left: the campaign completes with its holdout rows
    assert rig.campaign_row(cid)["status"] == "completed"
    counts = ScheduledStore(rig.db).campaign_counts("outreach_test")
    assert counts is not None and (counts["holdout"], counts["sent"], counts["pending"]) == (len(held), 50 - len(held), 0)
    for r in rig.rows("campaign = 'outreach_test' and status = 'holdout'"):
        assert rig.events(r["id"]) == [(None, "holdout")]
        assert (r["claimed_at"], r["attempts"], r["sent_at"]) == (None, 0, None)


@SLOW
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=3), share=st.sampled_from([0.1, 0.3, 0.6]))
def test_scheduled_membership_is_stable_under_reprovisioning(rig: Rig, chunks: list[int], share: float) -> None:
    """Provisioning in any chunk sizes, interrupted and resumed, and provisioning again after the
    checkpoint is reset (a re-provisioning), gives the same holdout set: the members."""
    rig.db.execute(f"truncate {MAIL_TABLES}, app.assessments, app.users restart identity cascade")
    rig.db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    rig.users(60)
    cid = rig.campaign(**(ALL_DAY | {"holdout_share": share}))
    for i, chunk in enumerate(chunks):
        stop = {"n": 0}

        def crash(_s: Any, stop: dict[str, int] = stop, last: bool = i == len(chunks) - 1) -> None:
            stop["n"] += 1
            if not last and stop["n"] == 1:
                raise RuntimeError("crash after a chunk")

        try:
            rig.provision(cid, chunk=chunk, after_chunk=crash)
        except RuntimeError:
            pass
    expected = {u for u in range(1, 61) if in_holdout("outreach_test", u, share)}
    assert by_status(rig.db, "outreach_test") == {"holdout": expected, "pending": set(range(1, 61)) - expected}
    rig.db.execute("update mail.campaign set provision_cursor = null, provisioned_at = null where id = %s", (cid,))
    again = rig.provision(cid, chunk=chunks[0])
    assert (again.created, again.holdout) == (0, 0)
    assert by_status(rig.db, "outreach_test") == {"holdout": expected, "pending": set(range(1, 61)) - expected}


def test_the_canary_is_a_share_of_the_rows_that_are_sent(rig: Rig) -> None:
    rig.users(40)
    cid = rig.campaign(**(ALL_DAY | {"holdout_share": 0.5, "canary_share": 0.25}))
    rig.provision(cid)
    treated = rig.db.execute("select id from mail.send_log where campaign = 'outreach_test' and status = 'pending'"
                              " order by id").fetchall()
    last = rig.campaign_row(cid)["canary_last_id"]
    assert last == treated[-(-len(treated) // 4) - 1][0]  # ceil(share * treated rows), in id order


# -- the lift of a campaign spread over weeks -------------------------------------------------------------

SHARE = 0.5


def spread_campaign(rig: Rig, treated: int = 100) -> tuple[int, set[int], set[int]]:
    """A campaign of 10 emails a day to users 1..N, N the first with exactly ``treated`` users not held out
    (half held out: the plan of ~2N/10 days spreads both groups over three weeks), provisioned on PAST, then
    each treated email sent 30 s after its slot, as the dispatcher does. Returns (campaign id, treated users,
    held-out users)."""
    n = next(n for n in range(treated, 10 * treated)
             if sum(1 for u in range(1, n + 1) if not in_holdout("spread", u, SHARE)) == treated)
    rig.users(n)
    cid = rig.campaign("spread", **(ALL_DAY | {"emails_per_day": 10, "holdout_share": SHARE}))
    rig.provision(cid, chunk=50)
    rig.db.execute("update mail.send_log set minted_at = %s where campaign = 'spread'", (PAST,))
    rig.db.execute("update mail.send_log set status = 'sent', claimed_at = scheduled_at, attempts = 1,"
                   " sent_at = scheduled_at + interval '30 seconds', provider_message_id = 'pm-' || id"
                   " where campaign = 'spread' and status = 'pending'")
    rig.db.execute("update mail.campaign set status = 'completed' where id = %s", (cid,))
    held = {u for u in range(1, n + 1) if in_holdout("spread", u, SHARE)}
    return cid, set(range(1, n + 1)) - held, held


def convert(rig: Rig, at: dict[int, datetime]) -> None:
    """Each user of ``at`` finishes an assessment at that instant (started 30 minutes before)."""
    rig.db.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at, finished_at,"
                   " score) select row_number() over () + coalesce((select max(assessment_id) from app.assessments),"
                   " 0), u, 'numerical', true, f - interval '30 minutes', f, 50"
                   " from unnest(%s::bigint[], %s::timestamptz[]) as x(u, f)", (list(at), list(at.values())))


def lift_rows(db: psycopg.Connection, campaign: str) -> list[tuple[Any, ...]]:
    return [r for r in db.execute(analytics("campaign_lift")).fetchall() if r[0] == campaign]


def exact(converted: int, of: int) -> Decimal:
    return (Decimal(converted) / of).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP)


def test_lift_window_anchored_on_each_users_send_time_over_weeks(rig: Rig) -> None:
    """A campaign sent over three weeks: every one of its 100 treated users converted 2 days after their
    email. Each user's window starts at their send (held out: at the slot they would have been sent in), so
    the lift counts all 100; a window from provisioning closes before most of them were sent. Held out: users
    3k convert 2 days after their slot, 3k+1 an hour before it, 3k+2 8 days after it."""
    _, treated, held = spread_campaign(rig)
    assert len(treated) == 100 and len(held) > 60
    rows = {r["user_id"]: r for r in rig.rows("campaign = 'spread'")}
    sent = {u: rows[u]["sent_at"] for u in treated}
    slot = {u: rows[u]["scheduled_at"] for u in held}
    assert (max(sent.values()) - min(sent.values())).days >= 18  # the campaign spans weeks, both groups alike
    assert (max(slot.values()) - min(slot.values())).days >= 18
    offset = {0: timedelta(days=2), 1: -timedelta(hours=1), 2: timedelta(days=8)}
    convert(rig, {u: sent[u] + timedelta(days=2) for u in treated} | {u: slot[u] + offset[u % 3] for u in held})
    # a window from provisioning (PAST) would see only the users sent in the campaign's first 5 days
    assert sum(1 for u in treated if sent[u] + timedelta(days=2) < PAST + timedelta(days=7)) < 50
    hc = sum(1 for u in held if u % 3 == 0)
    want = [("spread", "scheduled", 100, 100, Decimal("1.000000"), len(held), hc, exact(hc, len(held)),
             (1 - Decimal(hc) / len(held)).quantize(Decimal("0.000001"), rounding=ROUND_HALF_UP), timedelta(days=7),
             0)]
    assert lift_rows(rig.db, "spread") == want
    # the same from the rollup of the closed windows (all of them: the campaign ended in January)
    lift.install(rig.db)
    assert lift.fold(rig.db) == 2 * len({t.date() for t in sent.values()})
    assert rig.db.execute("select sum(users), sum(converted) from mail.campaign_lift_day where campaign = 'spread'"
                          " and grp = 'treated'").fetchone() == (100, 100)
    assert lift_rows(rig.db, "spread") == want
    # and from the demo's view (rolled back: the session database keeps exactly the migrations' views)
    with rig.db.transaction(force_rollback=True), rig.db.cursor() as c:
        assert install_lift_view(c)
        assert c.execute("select * from mail.campaign_lift where campaign = 'spread'").fetchall() == want


def test_lift_counts_a_held_out_user_once_the_campaign_sent_past_their_slot(rig: Rig) -> None:
    """Paused after 8 days, a campaign's remaining treated users wait, and so do the held-out users planned
    among them: the held-out group is the users whose slot the sending passed (at or before its latest
    send). Cancelled, it never sends the rest: the same users. Everybody converts 2 days after their
    (planned) send; the fold agrees at every stage, and its watermark stops at the latest send."""
    cid, treated, held = spread_campaign(rig)
    rows = {r["user_id"]: r for r in rig.rows("campaign = 'spread'")}
    stop = PAST + timedelta(days=8)
    waiting = {u for u in treated if rows[u]["scheduled_at"] >= stop}
    rig.db.execute("update mail.send_log set status = 'pending', claimed_at = null, attempts = 0, sent_at = null,"
                   " provider_message_id = null where campaign = 'spread' and user_id = any(%s)", (sorted(waiting),))
    rig.db.execute("update mail.campaign set status = 'paused' where id = %s", (cid,))
    starts = {u: (rows[u]["sent_at"] if u in treated else rows[u]["scheduled_at"]) for u in rows}
    convert(rig, {u: t + timedelta(days=2) for u, t in starts.items()})
    lift.install(rig.db)
    last_sent = max(rows[u]["sent_at"] for u in treated - waiting)
    for stage, cut in (("paused", last_sent), ("cancelled", last_sent)):
        if stage == "cancelled":
            rig.db.execute("update mail.send_log set status = 'cancelled' where campaign = 'spread'"
                           " and status = 'pending'")
            rig.db.execute("update mail.campaign set status = 'cancelled' where id = %s", (cid,))
        counted = {u for u in held if rows[u]["scheduled_at"] <= cut}
        assert 10 < len(counted) < len(held) - 10
        n = len(treated - waiting)
        want = [("spread", "scheduled", n, n, Decimal("1.000000"), len(counted), len(counted), Decimal("1.000000"),
                 Decimal("0.000000"), timedelta(days=7), 0)]
        assert lift_rows(rig.db, "spread") == want, stage
        rig.db.execute("delete from mail.campaign_lift_fold")  # folded again from scratch at each stage
        assert lift.fold(rig.db) is not None
        assert lift_rows(rig.db, "spread") == want, stage
        [(through,)] = rig.db.execute("select through from mail.campaign_lift_fold where campaign = 'spread'")
        assert through == cut  # the watermark stops where the held-out group does
