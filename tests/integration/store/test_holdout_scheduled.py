"""Holdout groups of scheduled campaigns (docs/model.md, "Holdout groups"): provisioning records the
members of the campaign's holdout group as ``holdout`` rows without a slot in the plan; dispatch never
claims them; the canary is a share of the rows that are sent. Real PostgreSQL and the emulator over
HTTP (tests/scheduled_rig.py); every expected set comes from :func:`mailflow.model.holdout.in_holdout`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import psycopg
from conftest import MAIL_TABLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scheduled_rig import ALL_DAY, Rig
from scheduled_rig import rig as rig  # noqa: F401  (fixture)

from mailflow.model.holdout import in_holdout
from mailflow.store.scheduled import ScheduledStore

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
