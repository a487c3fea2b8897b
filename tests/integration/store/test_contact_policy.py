"""One contact policy for every path, enforced by the database (issue 14): the contact guard under
concurrency, scheduled dispatch under the policy (defer / skip / ignore), backfills and planned
emails, frequency caps, and address hygiene on both paths."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
import scheduled_rig as ts
from conftest import UNSUBSCRIBE_SECRET
from lifecycle_rig import RacingConnection, add_user, simple_campaign
from lifecycle_rig import Rig as LRig

from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import DataInterval, SendError
from mailflow.model.policy import Cap, ContactPolicy
from mailflow.sendloop.render import Renderer
from mailflow.sources import scheduled
from mailflow.sources.scheduled.planning import plan_day, plan_send_times
from mailflow.store.contact_guard import lock_contacts
from mailflow.store.send_log import PostgresStore
from mailflow.store.suppression import suppress_address
from mailflow_dev import contact_chaos


def test_concurrent_lifecycle_and_scheduled_claimers_never_mail_a_user_twice(db: psycopg.Connection,
                                                                            db_dsn: str) -> None:
    # several processes at once: a provisioner, 3 lifecycle runs (overlapping campaigns) and 2
    # dispatchers, over 2,000 users who are in every audience
    report = contact_chaos.run(db_dsn, users=2000, lifecycle=3, dispatchers=2, rounds=1, seconds=60)
    assert report["failed"] == []
    assert report["invariants"] == {"users_with_two_contacts_in_cooldown": 0, "users_never_decided": 0,
                                    "due_rows_left_pending": 0, "processes_failed": 0}
    c = report["counts"]
    # every user got exactly one email, whichever path won
    assert c["users_emailed"] == 2000 and c["emails_sent"] == 2000
    assert c["lifecycle_sent"] + c["scheduled_sent"] == 2000
    # both paths sent: users on no scheduled list (1 in 3) only get lifecycle mail; the pre-provisioned
    # campaign's users are held back from lifecycle mail by their planned email and get that one
    assert c["lifecycle_sent"] >= 2000 // 3 and c["scheduled_sent"] >= 1
    # the claimers met at the contact guard, not only at the audience pre-filter
    assert c["lifecycle_held_under_guard"] + c["scheduled_held_by_lifecycle"] >= 1
    # every scheduled row the policy held back is visible: deferred (with an event) or skipped
    sched = db.execute("select count(*) from mail.send_log where kind = 'scheduled'").fetchone()
    assert sched is not None and sched[0] == 1000 + 666
    assert c["scheduled_sent"] + c["scheduled_deferred"] + c["scheduled_skipped"] == 1000 + 666
    assert c["skip_events"] == c["scheduled_skipped"]
    assert c["deferral_events"] >= c["scheduled_deferred"]
    held = db.execute("select count(*) from mail.send_log where kind = 'scheduled' and status in ('pending', 'skipped')"
                      " and error like 'contact policy: cooldown 7 days: row %'").fetchone()
    assert held is not None and held[0] == c["scheduled_deferred"] + c["scheduled_skipped"]


# -- rigs ------------------------------------------------------------------------------------------

D, H = timedelta(days=1), timedelta(hours=1)
BERLIN_WORKDAYS = {"timezone": "Europe/Berlin", "weekdays": [1, 2, 3, 4, 5], "windows": ["09:00-12:00", "14:00-17:00"],
                   "emails_per_day": 3}


@pytest.fixture
def lrig(db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> Iterator[LRig]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    r = LRig(db=db, dsn=db_dsn, emulator=emulator)
    yield r
    for c in reversed(r.conns):
        c.close()


@pytest.fixture
def srig(lrig: LRig) -> Iterator[ts.Rig]:
    r = ts.Rig(db=lrig.db, dsn=lrig.dsn, emulator=lrig.emulator)
    yield r
    for c in reversed(r.closers):
        c.close()


def db_now(db: psycopg.Connection) -> datetime:
    row = db.execute("select now()").fetchone()
    assert row is not None
    return row[0]


def live_interval(db: psycopg.Connection) -> DataInterval:
    end = db_now(db)
    return DataInterval(end - H, end)


def plant_sent(db: psycopg.Connection, uid: int, campaign: str, sent_at: datetime, kind: str = "lifecycle") -> int:
    row = db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
                     " values (%s, %s, %s, %s, 'sent', %s, %s) returning id",
                     (uid, campaign, kind, f"user{uid}@example.com", sent_at, f"p-{campaign}-{uid}")).fetchone()
    assert row is not None
    return int(row[0])


def recipients(srig: ts.Rig, cid: int, rows: list[tuple[int, str]]) -> None:
    for uid, email in rows:
        srig.db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                        " values (%s, %s, %s, %s)", (cid, uid, email, f"First{uid}"))


def outbox_to(emulator: EmulatorProcess) -> list[str]:
    return sorted(e["to"][0] for e in emulator.read_outbox())


# -- 1. the cooldown is no longer a read followed by an insert ---------------------------------------

def test_a_claim_committed_after_the_audience_was_read_holds_the_user_back(lrig: LRig) -> None:
    """Two mints of different campaigns overlap: the other one commits its claim for user 2 after
    this run read its audience page; the contact guard re-checks under the lock and holds user 2."""
    for uid in (1, 2, 3):
        add_user(lrig.db, uid)
    conn = psycopg.connect(lrig.dsn)
    lrig.conns.append(conn)
    racing = RacingConnection(conn, lrig.db, uid=2, campaign="other_campaign")
    [s] = lrig.run([simple_campaign("a", 1)], store=PostgresStore(racing))  # type: ignore[arg-type]
    assert racing.fired
    assert [(r["user_id"], r["campaign"], r["status"]) for r in lrig.rows()] == [
        (2, "other_campaign", "sending"), (1, "a", "sent"), (3, "a", "sent")]
    assert (s.eligible, s.minted, s.held, s.skipped) == (3, 2, 1, 0)
    assert outbox_to(lrig.emulator) == ["user1@example.com", "user3@example.com"]


def test_a_claimer_waits_for_the_contact_lock_and_then_sees_the_other_claim(lrig: LRig) -> None:
    add_user(lrig.db, 1)
    locked, release = threading.Event(), threading.Event()

    def other_claimer() -> None:
        with psycopg.connect(lrig.dsn, autocommit=True) as conn, conn.transaction():
            lock_contacts(conn, [1])
            conn.execute("insert into mail.send_log (user_id, campaign, email, status, claimed_at)"
                         " values (1, 'other_campaign', 'user1@example.com', 'sending', now())")
            locked.set()
            release.wait(5)

    t = threading.Thread(target=other_claimer)
    t.start()
    assert locked.wait(5)
    threading.Timer(0.5, release.set).start()
    t0 = time.monotonic()
    [s] = lrig.run([simple_campaign("a", 1)], interval=live_interval(lrig.db))
    waited = time.monotonic() - t0
    t.join()
    assert waited >= 0.4  # the mint waited for the other claim to commit
    assert (s.eligible, s.minted, s.held) == (1, 0, 1)
    assert lrig.emulator.read_outbox() == []


def test_a_dispatcher_waits_for_a_lifecycle_claim_of_the_same_user_and_then_defers(srig: ts.Rig) -> None:
    """The other direction across paths: a lifecycle mint holds user 1's contact lock (its claim not
    yet committed) when the dispatcher picks user 1's due scheduled email. The dispatcher waits for
    the lock, then sees the lifecycle claim and defers its email: one email, not two."""
    srig.users(1)
    cid = srig.campaign(**ts.ALL_DAY)
    srig.provision(cid)  # due since 2026-01-05
    locked, release = threading.Event(), threading.Event()
    lifecycle_row: list[int] = []

    def lifecycle_claimer() -> None:
        with psycopg.connect(srig.dsn, autocommit=True) as conn, conn.transaction():
            lock_contacts(conn, [1])
            row = conn.execute("insert into mail.send_log (user_id, campaign, kind, email, status, claimed_at)"
                               " values (1, 'first_practice', 'lifecycle', 'user1@example.com', 'sending', now())"
                               " returning id").fetchone()
            assert row is not None
            lifecycle_row.append(int(row[0]))
            locked.set()
            release.wait(5)

    t = threading.Thread(target=lifecycle_claimer)
    t.start()
    assert locked.wait(5)
    threading.Timer(0.5, release.set).start()
    t0 = time.monotonic()
    s = srig.dispatch()
    waited = time.monotonic() - t0
    t.join()
    assert waited >= 0.4  # the claim waited for the lifecycle claim to commit
    assert (s.sent, s.deferred, s.claimed) == (0, 1, 0)
    [row] = srig.rows("campaign = 'outreach_test'")
    assert row["status"] == "pending" and row["error"].startswith(
        f"contact policy: cooldown 7 days: row {lifecycle_row[0]} (first_practice, sending); free from ")
    assert srig.emulator.read_outbox() == []


# -- 2. scheduled dispatch obeys the policy: defer (default), skip, ignore ---------------------------

def test_scheduled_dispatch_defers_a_due_email_inside_the_cooldown_to_the_next_planned_slot(srig: ts.Rig) -> None:
    srig.users(3)
    now = db_now(srig.db)
    sent = plant_sent(srig.db, 1, "first_practice", now - 2 * D)  # user 1: emailed 2 days ago
    cid = srig.campaign(**BERLIN_WORKDAYS)
    srig.provision(cid)
    s = srig.dispatch()
    assert (s.sent, s.deferred, s.skipped) == (2, 1, 0)
    [row] = srig.rows("campaign = 'outreach_test' and user_id = 1")
    spec = scheduled.plan_spec(srig.campaign_row(cid))
    free_at = now - 2 * D + 7 * D
    expected = next(iter(plan_send_times(spec, 1, free_at + timedelta(microseconds=1))))
    assert row["status"] == "pending" and row["scheduled_at"] == expected
    assert row["scheduled_at"] > free_at
    local = row["scheduled_at"].astimezone(spec.zone)
    assert local.isoweekday() in (1, 2, 3, 4, 5)
    assert any(w.start <= local.time() < w.end for w in spec.windows)
    assert row["error"] == (f"contact policy: cooldown 7 days: row {sent} (first_practice, sent "
                            f"{(now - 2 * D).isoformat()}); free from {free_at.isoformat()}; deferred to "
                            f"{expected.isoformat()}")
    assert srig.db.execute("select from_status, to_status, error from mail.send_event where send_log_id = %s"
                           " order by id", (row["id"],)).fetchall() == [
        (None, "pending", None), ("pending", "pending", row["error"])]
    assert outbox_to(srig.emulator) == ["user2@example.com", "user3@example.com"]


def test_a_deferral_keeps_the_daily_count(srig: ts.Rig) -> None:
    """Three users held until the same instant, 2 emails per day: the third goes to the next day."""
    srig.users(3)
    now = db_now(srig.db)
    for uid in (1, 2, 3):
        plant_sent(srig.db, uid, "first_practice", now - 2 * D)
    cid = srig.campaign(**(BERLIN_WORKDAYS | {"emails_per_day": 2}))
    srig.provision(cid)
    # two due at a time (the per-day cap re-plans a campaign with more due than a day allows): the third later
    srig.db.execute("update mail.send_log set scheduled_at = now() + interval '1 day' where user_id = 3"
                    " and campaign = 'outreach_test'")
    s = srig.dispatch()
    assert (s.sent, s.deferred) == (0, 2)
    srig.db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where user_id = 3"
                    " and campaign = 'outreach_test'")
    s = srig.dispatch()
    assert (s.sent, s.deferred, s.replanned) == (0, 1, {})
    spec = scheduled.plan_spec(srig.campaign_row(cid))
    times = [r["scheduled_at"] for r in srig.rows("campaign = 'outreach_test'")]
    days = [plan_day(spec, t) for t in times]
    assert days[0] == days[1] and days[2] > days[1]
    assert all(t > now + 5 * D for t in times)


def test_a_deferral_skips_a_day_the_campaigns_own_plan_already_fills(srig: ts.Rig) -> None:
    """User 1 is free from tomorrow; the campaign (2 per day) already has 2 emails planned on that
    day for users 2 and 3: the deferred email goes to the day after, inside the window."""
    now = db_now(srig.db)
    spec_kw = {"timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"], "emails_per_day": 2}
    cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **spec_kw)
    recipients(srig, cid, [(1, "user1@example.com")])
    srig.provision(cid)  # user 1: due since 2026-01-05
    plant_sent(srig.db, 1, "first_practice", now - 6 * D)
    free_at = (now - 6 * D + 7 * D).astimezone(UTC)
    day = free_at.date()  # the plan day in the campaign's zone (UTC, windows from 00:00)
    for uid, at in ((2, datetime.combine(day, datetime.min.time(), UTC) + timedelta(minutes=1)),
                    (3, datetime.combine(day, datetime.max.time(), UTC) - timedelta(minutes=5))):
        srig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                        " values (%s, 'outreach_test', 'scheduled', %s, 'pending', %s)",
                        (uid, f"user{uid}@example.com", at))
    s = srig.dispatch()
    assert (s.sent, s.deferred) == (0, 1)
    [row] = srig.rows("campaign = 'outreach_test' and user_id = 1")
    spec = scheduled.plan_spec(srig.campaign_row(cid))
    assert row["status"] == "pending" and plan_day(spec, row["scheduled_at"]) == day + D
    assert row["scheduled_at"].astimezone(UTC).time() < datetime.strptime("23:59", "%H:%M").time()


def test_scheduled_skip_and_ignore(srig: ts.Rig) -> None:
    srig.users(2)
    now = db_now(srig.db)
    plant_sent(srig.db, 1, "first_practice", now - 2 * D)
    plant_sent(srig.db, 2, "first_practice", now - 2 * D)
    skip = srig.campaign("outreach_skip", on_policy="skip", **BERLIN_WORKDAYS)
    ignore = srig.campaign("outreach_ignore", on_policy="ignore", **BERLIN_WORKDAYS)
    srig.provision(skip)
    srig.provision(ignore)
    s = srig.dispatch()
    assert (s.sent, s.skipped, s.deferred) == (2, 2, 0)
    rows = {(r["campaign"], r["user_id"]): r for r in srig.rows("kind = 'scheduled'")}
    for uid in (1, 2):
        assert rows[("outreach_skip", uid)]["status"] == "skipped"
        assert rows[("outreach_skip", uid)]["error"].startswith("contact policy: cooldown 7 days: row ")
        assert rows[("outreach_ignore", uid)]["status"] == "sent"
    assert srig.db.execute("select count(*) from mail.send_event where to_status = 'skipped'"
                           " and error like 'contact policy: cooldown 7 days: %'").fetchone() == (2,)
    assert sorted(srig.emulator.read_outbox()[i]["to"][0] for i in range(2)) == ["user1@example.com",
                                                                                  "user2@example.com"]


def test_a_scheduled_email_after_a_lifecycle_email_is_held_back(lrig: LRig, srig: ts.Rig) -> None:
    """The reported case: a lifecycle run and a scheduled campaign for the same users."""
    srig.users(60)
    [s] = lrig.run([simple_campaign("lc", 1)], interval=live_interval(lrig.db))
    assert s.sent == 60
    cid = srig.campaign(on_policy="skip", **(BERLIN_WORKDAYS | {"emails_per_day": 60}))
    srig.provision(cid)
    d = srig.dispatch()
    assert (d.sent, d.skipped) == (0, 60)
    assert len(srig.emulator.read_outbox()) == 60


# -- 3. backfills see planned emails ---------------------------------------------------------------

def test_a_backfill_never_sends_inside_a_planned_emails_cooldown(lrig: LRig) -> None:
    add_user(lrig.db, 1)
    add_user(lrig.db, 2)
    now = db_now(lrig.db)
    # user 1's scheduled email is planned 5 days ahead; user 2's 10 days ahead
    for uid, ahead in ((1, 5 * D), (2, 10 * D)):
        lrig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                        " values (%s, 'outreach', 'scheduled', %s, 'pending', %s)",
                        (uid, f"user{uid}@example.com", now + ahead))
    backfill = DataInterval(now - 3 * D - H, now - 3 * D)  # an interval 3 days old
    [s] = lrig.run([simple_campaign("lc", 1)], interval=backfill)
    assert (s.eligible, s.sent) == (1, 1)
    assert outbox_to(lrig.emulator) == ["user2@example.com"]


# -- 4. case and whitespace duplicates; 5. address hygiene -------------------------------------------

def test_one_email_per_normalised_address_within_a_lifecycle_campaign(lrig: LRig) -> None:
    add_user(lrig.db, 1, email="Same@Example.com")
    add_user(lrig.db, 2, email="same@EXAMPLE.com ")
    add_user(lrig.db, 3, email="\tSAME@example.com")
    add_user(lrig.db, 4, email="other@example.com")
    [s] = lrig.run([simple_campaign("a", 1)])
    rows = {r["user_id"]: r for r in lrig.rows()}
    assert {u: r["status"] for u, r in rows.items()} == {1: "sent", 2: "duplicate", 3: "duplicate", 4: "sent"}
    for uid in (2, 3):
        assert rows[uid]["error"] == "duplicate address: same@example.com gets this campaign as user 1"
        assert lrig.events(rows[uid]["id"]) == [(None, "duplicate")]
    assert (s.minted, s.sent, s.duplicates) == (2, 2, 2)
    assert outbox_to(lrig.emulator) == ["Same@example.com", "other@example.com"]
    # a later run: a new user at the same mailbox is a duplicate too
    add_user(lrig.db, 5, email=" SAME@example.COM")  # (app.users: one row per lower(email))
    [s2] = lrig.run([simple_campaign("a", 1, cooldown=timedelta(0))])
    assert (s2.minted, s2.duplicates) == (0, 1)
    assert len(lrig.emulator.read_outbox()) == 2


def test_one_email_per_normalised_address_within_a_scheduled_campaign(srig: ts.Rig) -> None:
    cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
    recipients(srig, cid, [(1, "Same@Example.com"), (2, " same@example.com"), (3, "other@example.com")])
    srig.provision(cid)
    s = srig.dispatch()
    assert (s.sent, s.duplicates) == (2, 1)
    rows = {r["user_id"]: r for r in srig.rows()}
    assert rows[2]["status"] == "duplicate"
    assert rows[2]["error"] == "duplicate address: same@example.com gets this campaign as user 1"
    assert outbox_to(srig.emulator) == ["Same@example.com", "other@example.com"]


@pytest.mark.parametrize("path", ["lifecycle", "scheduled"])
def test_addresses_are_checked_and_normalised_before_any_request_on_both_paths(lrig: LRig, srig: ts.Rig,
                                                                               path: str) -> None:
    given = {1: "anna@@example.com", 2: "\tbert@example.com", 3: "jörg@Bücher.example", 4: "Carl@EXAMPLE.org  ",
             5: "dora..x@example.com"}
    if path == "lifecycle":
        for uid, email in given.items():
            add_user(lrig.db, uid, email=email)
        [s] = lrig.run([simple_campaign("a", 1)])
        assert (s.minted, s.sent, s.invalid, s.failed) == (3, 3, 2, 0)
    else:
        cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
        recipients(srig, cid, list(given.items()))
        srig.provision(cid)
        d = srig.dispatch()
        assert (d.sent, d.invalid, d.failed) == (3, 2, 0)
    assert outbox_to(lrig.emulator) == ["Carl@example.org", "bert@example.com", "jörg@xn--bcher-kva.example"]
    rows = {r["user_id"]: r for r in lrig.rows()}
    assert rows[1]["status"] == "failed" and rows[1]["attempts"] == 0 and rows[1]["idempotency_key"] is None
    assert rows[1]["error"] == "invalid address: The part after the @-sign contains invalid characters: '@'."
    assert rows[5]["error"] == "invalid address: An email address cannot have two periods in a row."
    # each local decision is an event carrying the validator's reason (after provisioning's 'pending')
    for uid in (1, 5):
        assert lrig.db.execute("select to_status, attempt, error from mail.send_event where send_log_id = %s"
                               " and to_status <> 'pending' order by id", (rows[uid]["id"],)).fetchall() == [
            ("failed", 0, rows[uid]["error"])]
    assert rows[3]["email"] == "jörg@xn--bcher-kva.example"
    assert rows[3]["email_key"] == "jörg@xn--bcher-kva.example"
    assert rows[4]["email_key"] == "carl@example.org"


def test_an_address_the_provider_rejected_is_not_tried_again_in_the_same_run(lrig: LRig) -> None:
    add_user(lrig.db, 1, email="x@example.com", first_name="")  # campaign a's subject renders empty: rejected
    add_user(lrig.db, 2, email="X@example.com ")                  # the same mailbox, another user
    add_user(lrig.db, 3)
    a = dataclasses.replace(simple_campaign("a", 1, "user_id = 1"), subject="{{ user.first_name }}")
    b = simple_campaign("b", 2)
    with pytest.raises(SendError, match=r"^a: every one of 1 emails was rejected by the provider$") as err:
        lrig.run([a, b])
    sa, sb = err.value.summaries
    assert (sa.minted, sa.failed) == (1, 1)
    # users 1 and 2 left out (the address was rejected this run), accounted for as held, not skipped
    assert (sb.eligible, sb.minted, sb.sent, sb.held, sb.skipped) == (3, 1, 1, 2, 0)
    assert outbox_to(lrig.emulator) == ["user3@example.com"]
    assert [(r["user_id"], r["campaign"], r["status"]) for r in lrig.rows()] == [(1, "a", "failed"), (3, "b", "sent")]


def test_suppression_matches_normalised_addresses_on_both_paths(lrig: LRig, srig: ts.Rig) -> None:
    suppress_address(lrig.db, "anna@example.com", source="bounce")
    suppress_address(lrig.db, "jörg@bücher.example", source="complaint")
    add_user(lrig.db, 1, email="  ANNA@Example.com")
    add_user(lrig.db, 2, email="jörg@xn--bcher-kva.example")
    add_user(lrig.db, 3)
    add_user(lrig.db, 4, email="JÖRG@Bücher.example")
    [s] = lrig.run([simple_campaign("a", 1)])
    assert s.sent == 1 and outbox_to(lrig.emulator) == ["user3@example.com"]
    # users 1 and 2 are left out by the audience query (the stored mailbox key against the trimmed
    # address with its ASCII letters lower-cased), user 4 (a non-ASCII capital and a Unicode domain,
    # which SQL does not fold) by the guard at mint on the key computed in Python: held, not
    # silently skipped
    assert (s.eligible, s.minted, s.held, s.skipped) == (2, 1, 1, 0)
    cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
    recipients(srig, cid, [(11, "Anna@EXAMPLE.com\t"), (12, "JÖRG@bücher.example"), (13, "user13@example.com")])
    srig.provision(cid)
    d = srig.dispatch()
    assert (d.sent, d.suppressed) == (1, 2)
    assert {r["user_id"]: r["status"] for r in srig.rows("user_id > 10")} == {11: "cancelled", 12: "cancelled",
                                                                            13: "sent"}


# -- frequency caps, transactional opt-out, counts and dry runs ---------------------------------------

def test_frequency_caps_count_emails_of_every_campaign_in_a_rolling_window(lrig: LRig) -> None:
    now = db_now(lrig.db)
    for uid in (1, 2, 3):
        add_user(lrig.db, uid)
    # cap: 2 per 7 days (cooldown 1 day): user 1 had 2 emails within the week, user 2 one, user 3 two
    # but one of them 7 days + 1 minute ago (outside)
    plant_sent(lrig.db, 1, "x1", now - 2 * D)
    plant_sent(lrig.db, 1, "x2", now - 5 * D)
    plant_sent(lrig.db, 2, "x1", now - 3 * D)
    plant_sent(lrig.db, 3, "x1", now - 2 * D)
    plant_sent(lrig.db, 3, "x2", now - 7 * D - timedelta(minutes=1))
    c = dataclasses.replace(simple_campaign("a", 1, cooldown=D), caps=(Cap(7 * D, 2),))
    store = lrig.store()
    interval = live_interval(lrig.db)
    assert store.count_audience(c, c.window(interval), interval.end - c.cooldown) == 2
    [s] = lrig.run([c], interval=interval)
    assert (s.eligible, s.sent) == (2, 2)
    assert outbox_to(lrig.emulator) == ["user2@example.com", "user3@example.com"]
    assert c.contact_policy == ContactPolicy(cooldown=D, caps=(Cap(7 * D, 2),))


def test_a_transactional_campaign_is_exempt_but_still_counts(lrig: LRig) -> None:
    add_user(lrig.db, 1)
    now = db_now(lrig.db)
    plant_sent(lrig.db, 1, "x1", now - D)
    receipt = dataclasses.replace(simple_campaign("receipt", 1), exempt=True)
    [s] = lrig.run([receipt, simple_campaign("news", 2)], interval=live_interval(lrig.db))[:1]
    assert s.sent == 1
    assert [r["campaign"] for r in lrig.rows("status = 'sent'")] == ["x1", "receipt"]


def test_dry_run_counts_apply_the_policy(lrig: LRig) -> None:
    now = db_now(lrig.db)
    for uid in (1, 2):
        add_user(lrig.db, uid)
    plant_sent(lrig.db, 1, "x1", now - 2 * D)
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    [p] = lrig.store().preview([simple_campaign("a", 1)], live_interval(lrig.db), renderer)
    assert p["eligible"] == 1 and [x["to"] for x in p["sample"]] == ["u***@example.com"]


def test_an_overdue_planned_email_holds_lifecycle_mail_back_under_the_guard(lrig: LRig) -> None:
    """A planned email whose time passed (waiting for the dispatcher) goes out now: the mint's check
    under the lock counts it even when the audience pre-filter did not see it (it appeared after)."""
    for uid in (1, 2):
        add_user(lrig.db, uid)
    conn = psycopg.connect(lrig.dsn)
    lrig.conns.append(conn)

    class Planting(RacingConnection):
        def execute(self, query: object, params: object = None) -> object:
            cur = self._conn.execute(query, params)  # type: ignore[call-overload]
            if not self.fired and isinstance(params, dict) and "after" in params:
                self.fired = True
                self._other.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                                    " values (2, 'outreach', 'scheduled', 'user2@example.com', 'pending',"
                                    " '2026-01-05T09:00:00Z')")
            return cur

    racing = Planting(conn, lrig.db, uid=2, campaign="outreach")
    [s] = lrig.run([simple_campaign("a", 1)], store=PostgresStore(racing), interval=live_interval(lrig.db))  # type: ignore[arg-type]
    assert racing.fired
    assert (s.eligible, s.minted, s.held) == (2, 1, 1)
    assert outbox_to(lrig.emulator) == ["user1@example.com"]


# -- the whole kind: caps on the scheduled path, Unicode spellings of one mailbox, dry run = real run --

def test_scheduled_dispatch_applies_frequency_caps_across_campaigns_and_a_campaign_may_opt_out(srig: ts.Rig) -> None:
    """Policy 1 per day and 2 per 7 days. User 1 had 2 emails of other campaigns (lifecycle and
    scheduled) within the week, 2 and 5 days ago: held by the cap until the older one is 7 days old,
    deferred to a planned slot after that. User 2 had one (3 days ago): sent. User 3 had one 2 days
    ago and one 7 days + 1 minute ago (outside the window): sent. The opted-out campaign
    (on_policy = ignore) mails user 1 all the same."""
    srig.users(3)
    now = db_now(srig.db)
    r1 = plant_sent(srig.db, 1, "x1", now - 2 * D)
    r2 = plant_sent(srig.db, 1, "x2", now - 5 * D, kind="scheduled")
    plant_sent(srig.db, 2, "x1", now - 3 * D)
    plant_sent(srig.db, 3, "x1", now - 2 * D)
    plant_sent(srig.db, 3, "x2", now - 7 * D - timedelta(minutes=1))
    policy = ContactPolicy(cooldown=D, caps=(Cap(7 * D, 2),))
    capped = srig.campaign("outreach_capped", **ts.ALL_DAY)
    receipts = srig.campaign("receipts", on_policy="ignore", recipients_sql=None,
                             recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
    recipients(srig, receipts, [(1, "user1@example.com")])
    srig.provision(capped)
    s = srig.dispatch(policy=policy)
    assert (s.sent, s.deferred, s.skipped) == (2, 1, 0)
    assert outbox_to(srig.emulator) == ["user2@example.com", "user3@example.com"]
    [row] = srig.rows("campaign = 'outreach_capped' and user_id = 1")
    free_at = now - 5 * D + 7 * D
    assert row["status"] == "pending" and free_at < row["scheduled_at"] <= free_at + D
    assert row["error"] == (f"contact policy: frequency cap 2 per 7 days: row {r1} (x1, sent {(now - 2 * D).isoformat()}),"
                            f" row {r2} (x2, sent {(now - 5 * D).isoformat()}); free from {free_at.isoformat()};"
                            f" deferred to {row['scheduled_at'].isoformat()}")
    assert srig.events(row["id"]) == [(None, "pending"), ("pending", "pending")]
    # the transactional campaign opts out: user 1 gets it although the cap (and now the cooldown) is full
    srig.provision(receipts)
    s2 = srig.dispatch(policy=policy)
    assert (s2.sent, s2.deferred) == (1, 0)
    assert outbox_to(srig.emulator) == ["user1@example.com", "user2@example.com", "user3@example.com"]
    # ... and its email is a contact for everyone else: a lifecycle-style cap check now sees 3 in the week
    assert srig.db.execute("select count(*) from mail.send_log where user_id = 1 and status = 'sent'"
                           " and sent_at >= %s", (now - 7 * D,)).fetchone() == (3,)


@pytest.mark.parametrize("path", ["lifecycle", "scheduled"])
def test_unicode_spellings_of_one_mailbox_get_one_email_on_both_paths(lrig: LRig, srig: ts.Rig, path: str) -> None:
    """One mailbox spelled four ways: NFC, NFD (o + combining diaeresis), an upper-case local part
    with the domain in punycode, and punycode with whitespace around it (app.users is unique on
    lower(email), so these are four users there too). One email; the others are duplicates naming
    user 1."""
    given = {1: "jörg@bücher.example", 2: "jo\u0308rg@bücher.example", 3: "JÖRG@XN--BCHER-KVA.example",
             4: " jörg@xn--bcher-kva.example\t", 5: "other@example.com"}
    if path == "lifecycle":
        for uid, email in given.items():
            add_user(lrig.db, uid, email=email)
        [s] = lrig.run([simple_campaign("a", 1)])
        assert (s.minted, s.sent, s.duplicates, s.invalid) == (2, 2, 3, 0)
    else:
        cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
        recipients(srig, cid, list(given.items()))
        srig.provision(cid)
        d = srig.dispatch()
        assert (d.sent, d.duplicates, d.invalid) == (2, 3, 0)
    assert outbox_to(lrig.emulator) == ["jörg@xn--bcher-kva.example", "other@example.com"]
    rows = {r["user_id"]: r for r in lrig.rows()}
    assert {u: r["status"] for u, r in rows.items()} == {1: "sent", 2: "duplicate", 3: "duplicate", 4: "duplicate",
                                                         5: "sent"}
    for uid in (2, 3, 4):
        assert rows[uid]["error"] == "duplicate address: jörg@xn--bcher-kva.example gets this campaign as user 1"
        # the decision is an event (after the 'pending' one of provisioning, on the scheduled path)
        assert lrig.db.execute("select to_status, error from mail.send_event where send_log_id = %s"
                               " and to_status <> 'pending' order by id",
                               (rows[uid]["id"],)).fetchall() == [("duplicate", rows[uid]["error"])]


def test_a_dry_run_counts_exactly_what_the_real_run_then_mints(lrig: LRig) -> None:
    """Every rule of the policy at once, in the dry run and then in the real run of the same interval:
    cooldown 1 day (user 1, sent 12 hours ago), a planned scheduled email 12 hours ahead (user 2), a frequency
    cap (user 3: 2 emails in 7 days, cooldown 1 day), address suppression with another spelling
    (user 4), user suppression (user 5); users 6 and 7 are free."""
    now = db_now(lrig.db)
    for uid in range(1, 8):
        add_user(lrig.db, uid, email=" USER4@Example.COM" if uid == 4 else None)
    plant_sent(lrig.db, 1, "x1", now - 12 * H)
    lrig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                    " values (2, 'outreach', 'scheduled', 'user2@example.com', 'pending', %s)", (now + 12 * H,))
    plant_sent(lrig.db, 3, "x1", now - 2 * D)
    plant_sent(lrig.db, 3, "x2", now - 4 * D)
    suppress_address(lrig.db, "user4@example.com", source="bounce")
    lrig.db.execute("insert into mail.suppression (user_id, scope, source) values (5, 'all', 'unsubscribe')")
    c = dataclasses.replace(simple_campaign("a", 1, cooldown=D), caps=(Cap(7 * D, 2),))
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    interval = live_interval(lrig.db)
    [p] = lrig.store().preview([c], interval, renderer, sample=10)
    assert p["eligible"] == 2 and [x["to"] for x in p["sample"]] == ["u***@example.com", "u***@example.com"]
    assert lrig.db.execute("select count(*) from mail.send_log where campaign = 'a'").fetchone() == (0,)
    [s] = lrig.run([c], interval=interval)
    assert (s.eligible, s.minted, s.sent, s.held) == (2, 2, 2, 0)
    assert outbox_to(lrig.emulator) == ["user6@example.com", "user7@example.com"]


def test_a_dry_run_of_several_campaigns_applies_priority_as_the_run_does(lrig: LRig) -> None:
    """Users 1-4 are in every audience; user 4 was emailed 12 hours ago. Campaign a (priority 1)
    takes users 1-3, so b (priority 2) has nobody left; the exempt receipt (priority 3) counts all
    four. The dry run (campaigns passed out of order) reports what the real run then reports."""
    now = db_now(lrig.db)
    for uid in range(1, 5):
        add_user(lrig.db, uid)
    plant_sent(lrig.db, 4, "x1", now - 12 * H)
    receipt = dataclasses.replace(simple_campaign("receipt", 3), exempt=True)
    campaigns = [simple_campaign("b", 2), receipt, simple_campaign("a", 1)]
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    interval = live_interval(lrig.db)
    preview = lrig.store().preview(campaigns, interval, renderer, sample=2)
    assert [(p["campaign"], p["eligible"], len(p["sample"])) for p in preview] == [("a", 3, 2), ("b", 0, 0),
                                                                                   ("receipt", 4, 2)]
    assert lrig.db.execute("select count(*) from mail.send_log").fetchone() == (1,)
    summaries = lrig.run(campaigns, interval=interval)
    assert [(s.campaign, s.eligible, s.minted) for s in summaries] == [("a", 3, 3), ("b", 0, 0), ("receipt", 4, 4)]
