"""Faults that come from an operator's action or from one campaign, not from a recipient: a cancel
while a batch is in flight, a deferral the plan cannot place, one campaign whose dispatch raises,
and a provider refusal of a field that belongs to the campaign (its ``from``). Each must charge
nobody and stop nobody else. Real PostgreSQL, the real renderer, the emulator over HTTP (the outbox
is the witness).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from lifecycle_rig import Rig as LifecycleRig
from lifecycle_rig import add_user, simple_campaign
from lifecycle_rig import rig as lifecycle_rig  # noqa: F401  (fixture)
from scheduled_rig import (
    ALL_DAY,
    PAST,
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.cli import main as cli_main
from mailflow.model.outcome import NotSent, PreparedBatch, SendError
from mailflow.model.policy import ContactPolicy
from mailflow.sources import scheduled
from mailflow.store.migrate import migrate, migration_files
from mailflow.store.send_log import reopen_refused

BAD_FROM = "Outreach <outreach@@mail.example.com>"  # refused by the provider for every email: `from`


class CancelDuringSend:
    """A provider that cancels the campaign (another session, as an operator would) while the batch
    is on its way, then sends it through the real client."""

    def __init__(self, rig: Rig, campaign_id: int):
        self.inner, self.rig, self.campaign_id = rig.client(), rig, campaign_id
        self.cancelled: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None, **kw: Any) -> Any:
        if not self.cancelled:
            with psycopg.connect(self.rig.dsn, autocommit=True) as other:
                self.cancelled.append(scheduled.cancel(other, self.campaign_id, actor="ops"))
        return self.inner.send_batch(batch, deadline, slot, **kw)


def _campaign_events(rig: Rig, cid: int) -> list[tuple[Any, ...]]:
    return rig.db.execute("select from_status, to_status, detail->>'reason' from mail.campaign_event"
                          " where campaign_id = %s order by id", (cid,)).fetchall()


# -- a cancel while a batch is in flight ---------------------------------------------------------------


def test_cancel_while_batch_in_flight_then_not_processed_cancels_rows_instead_of_pending(rig: Rig) -> None:
    cid = provisioned(rig, 5)
    rig.emulator.configure(quota_emails=0)  # the batch in flight is answered 429 daily_quota_exceeded
    provider = CancelDuringSend(rig, cid)

    with pytest.raises(SendError, match="daily_quota_exceeded"):
        rig.dispatch(client=provider)

    assert provider.cancelled == [{"campaign": "outreach_test", "status": "cancelled", "changed": True,
                                   "rows_cancelled": 0}]  # every row was in flight when it was cancelled
    rows = rig.rows()
    assert [(r["status"], r["attempts"], r["idempotency_key"]) for r in rows] == [("cancelled", 0, None)] * 5
    assert all("daily_quota_exceeded" in r["error"] and "campaign cancelled" in r["error"] for r in rows)
    assert rig.events(rows[0]["id"]) == [(None, "pending"), ("pending", "sending"), ("sending", "cancelled")]
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending'").fetchone() == (0,)
    assert rig.emulator.read_outbox() == []


def test_cancel_is_idempotent_and_cancels_stragglers_left_pending(rig: Rig) -> None:
    cid = provisioned(rig, 3)
    assert scheduled.cancel(rig.db, cid)["rows_cancelled"] == 3
    # a row put back to pending inside the cancelled campaign (as the release did before)
    rig.db.execute("update mail.send_log set status = 'pending', error = null where user_id = 2")

    again = scheduled.cancel(rig.db, cid, actor="ops")

    assert again == {"campaign": "outreach_test", "status": "cancelled", "changed": False, "rows_cancelled": 1}
    assert [r["status"] for r in rig.rows()] == ["cancelled"] * 3
    assert scheduled.cancel(rig.db, cid)["rows_cancelled"] == 0


def test_cancelled_stragglers_are_cleaned_by_migration_0017_with_an_event(pg_admin_dsn: str) -> None:
    from mailflow_dev import devenv

    name = f"mailflow_m17_{datetime.now(UTC).strftime('%H%M%S%f')}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, target=16)
            conn.execute("insert into mail.campaign (name, template, subject, from_address, recipients_sql, status)"
                         " values ('gone', 'outreach', 's', 'a@example.com', 'free_plan_users', 'cancelled'),"
                         " ('live', 'outreach', 's', 'a@example.com', 'free_plan_users', 'scheduled')")
            conn.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at) values"
                         " (1, 'gone', 'scheduled', 'u1@example.com', 'pending', now()),"
                         " (2, 'gone', 'scheduled', 'u2@example.com', 'cancelled', now()),"
                         " (3, 'live', 'scheduled', 'u3@example.com', 'pending', now())")

            assert migrate(conn) == [m.name for m in migration_files() if m.version > 16]

            rows = conn.execute("select user_id, status, error is not null from mail.send_log order by user_id").fetchall()
            assert rows == [(1, "cancelled", True), (2, "cancelled", False), (3, "pending", False)]
            assert conn.execute("select l.user_id, e.from_status, e.to_status, e.task_id from mail.send_event e"
                                " join mail.send_log l on l.id = e.send_log_id").fetchall() == [
                (1, "pending", "cancelled", "migration 0017")]
    finally:
        devenv.drop_database(pg_admin_dsn, name)


def test_pending_rows_of_a_paused_or_cancelled_campaign_do_not_block_lifecycle_mail(
        lifecycle_rig: LifecycleRig) -> None:  # noqa: F811
    rig = lifecycle_rig
    rig.db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    rig.db.execute("insert into mail.campaign (name, template, subject, from_address, recipients_sql, status) values"
                   " ('paused_outreach', 'outreach', 's', 'a@example.com', 'free_plan_users', 'paused'),"
                   " ('cancelled_outreach', 'outreach', 's', 'a@example.com', 'free_plan_users', 'cancelled'),"
                   " ('live_outreach', 'outreach', 's', 'a@example.com', 'free_plan_users', 'scheduled')")
    now = datetime.now(UTC)
    for uid in (1, 2, 3, 4):
        add_user(rig.db, uid)
    # planned emails overdue by 3 days: user 1's campaign is paused (it sends nothing until resumed,
    # and its claim then re-checks the policy), user 2's was cancelled (a straggler left pending),
    # user 3's is active (waiting for the dispatcher: goes out now); user 4's is active, planned in 2 days
    for uid, campaign, at in ((1, "paused_outreach", now - 3 * timedelta(days=1)),
                              (2, "cancelled_outreach", now - 3 * timedelta(days=1)),
                              (3, "live_outreach", now - 3 * timedelta(days=1)),
                              (4, "live_outreach", now + 2 * timedelta(days=1))):
        rig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                       " values (%s, %s, 'scheduled', %s, 'pending', %s)", (uid, campaign, f"user{uid}@example.com", at))

    [s] = rig.run([simple_campaign("lc", 1)])

    assert (s.eligible, s.minted, s.sent, s.held) == (2, 2, 2, 0)
    assert [r["user_id"] for r in rig.rows("status = 'sent'")] == [1, 2]
    # and once that campaign is paused too, its planned emails stop holding users 3 and 4
    rig.db.execute("update mail.campaign set status = 'paused' where name = 'live_outreach'")
    [again] = rig.run([simple_campaign("lc2", 2, "user_id in (3, 4)")])
    assert (again.eligible, again.sent) == (2, 2)


# -- a deferral the plan cannot place ---------------------------------------------------------------


def test_unplannable_deferral_is_skipped_not_fatal_and_other_campaigns_go_on(rig: Rig) -> None:
    # Mondays only, one email a day, and 170 recipients: the plan runs ~3 years from now, so a row the
    # policy defers today finds no free plan day within 800 days. The first row is long due (its plan day
    # passed while the campaign waited); one is all the per-day cap lets through today.
    rig.users(170)
    spec = {"timezone": "UTC", "weekdays": [1], "windows": ["00:00-23:59"], "emails_per_day": 1}
    slow = rig.campaign("slow_weekly", **spec)
    assert rig.provision(slow, now=rig.db.execute("select now()").fetchone()[0]).created == 170  # type: ignore[index]
    rig.db.execute("update mail.send_log set scheduled_at = %s where campaign = 'slow_weekly' and user_id = 1", (PAST,))
    due = rig.db.execute("select count(*) from mail.send_log where campaign = 'slow_weekly'"
                         " and scheduled_at <= now()").fetchone()
    assert due is not None and due[0] in (1, 2)  # the first row, and on a Monday the day's own slot
    # user 1 was mailed an hour ago by another campaign: the cooldown holds the head of the queue
    rig.db.execute("insert into mail.send_log (user_id, campaign, email, status, sent_at, provider_message_id)"
                   " values (1, 'lc', 'user1@example.com', 'sent', now() - interval '1 hour', 'p-1')")
    other = rig.campaign("other_campaign", **ALL_DAY, start_at=PAST + timedelta(days=1))
    assert rig.provision(other, now=PAST + timedelta(days=1)).created == 170
    policy = ContactPolicy(cooldown=timedelta(days=7))

    first = rig.dispatch(policy=policy, budget_seconds=30)

    [head] = rig.rows("campaign = 'slow_weekly' and user_id = 1")
    assert head["status"] == "skipped" and head["attempts"] == 0
    assert "no planned slot within 800 days" in head["error"] and "cooldown" in head["error"]
    assert rig.events(head["id"]) == [(None, "pending"), ("pending", "skipped")]
    assert first.skipped == 1
    sent = rig.db.execute("select campaign, count(*) from mail.send_log where status = 'sent' and campaign <> 'lc'"
                          " group by campaign order by campaign").fetchall()
    assert dict(sent).get("slow_weekly", 0) == due[0] - 1
    # the other campaign went on (its users were held by slow_weekly's sends or sent)
    assert rig.db.execute("select count(*) from mail.send_log where campaign = 'other_campaign'"
                          " and status = 'pending' and scheduled_at <= now() - interval '1 day'").fetchone() == (0,)
    second = rig.dispatch(policy=policy, budget_seconds=5)  # and the next run does not fail either
    assert second.stopped in (None, "time budget")


# -- one campaign's error --------------------------------------------------------------------------


def test_one_campaign_error_does_not_stop_other_campaigns_and_pauses_it(rig: Rig) -> None:
    broken = provisioned(rig, 3, name="broken_campaign")
    rig.db.execute("update mail.campaign set template = 'no_such_template' where id = %s", (broken,))
    good = rig.campaign("good_campaign", **ALL_DAY, start_at=PAST + timedelta(days=1))
    assert rig.provision(good, now=PAST + timedelta(days=1)).created == 3

    with pytest.raises(SendError, match="broken_campaign: dispatch failed: TemplateNotFound"):
        rig.dispatch()

    rows = rig.rows()
    assert Counter((r["campaign"], r["status"], r["attempts"]) for r in rows) == Counter(
        {("broken_campaign", "pending", 0): 3, ("good_campaign", "sent", 1): 3})
    assert rig.events(rig.rows("campaign = 'broken_campaign'")[0]["id"]) == [(None, "pending")]  # rolled back
    assert rig.campaign_row(broken)["status"] == "paused"
    [(frm, to, reason)] = _campaign_events(rig, broken)[-1:]
    assert (frm, to) == ("scheduled", "paused") and "TemplateNotFound" in reason and "no_such_template" in reason
    assert rig.campaign_row(good)["status"] == "completed"
    assert "TemplateNotFound" in scheduled.status(rig.db, broken)["paused_reason"]
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rows if r["status"] == "sent"})
    assert rig.dispatch(budget_seconds=2).claimed == 0  # the next run is clean: the broken one is paused


# -- a refusal of the campaign's own field ---------------------------------------------------------


def test_campaign_level_rejection_charges_nobody_and_pauses_the_scheduled_campaign(rig: Rig) -> None:
    bad = provisioned(rig, 4, name="bad_from")
    rig.db.execute("update mail.campaign set from_address = %s where id = %s", (BAD_FROM, bad))
    good = rig.campaign("good_campaign", **ALL_DAY, start_at=PAST + timedelta(days=1))
    assert rig.provision(good, now=PAST + timedelta(days=1)).created == 4
    no_policy = ContactPolicy(cooldown=timedelta(0))

    with pytest.raises(SendError, match="bad_from: provider refused the campaign's `from`"):
        rig.dispatch(batch_size=2, policy=no_policy)

    rows = rig.rows("campaign = 'bad_from'")
    assert [(r["status"], r["attempts"], r["idempotency_key"], r["released_at"]) for r in rows] == [
        ("pending", 0, None, None)] * 4
    assert ["`from`" in (r["error"] or "") for r in rows] == [True, True, False, False]  # one batch of 2 was sent
    assert rig.events(rows[0]["id"]) == [(None, "pending"), ("pending", "sending"), ("sending", "pending")]
    assert rig.campaign_row(bad)["status"] == "paused"
    [(frm, to, reason)] = _campaign_events(rig, bad)[-1:]
    assert (frm, to) == ("scheduled", "paused") and "`from`" in reason
    assert [r["status"] for r in rig.rows("campaign = 'good_campaign'")] == ["sent"] * 4
    assert rig.emulator.stats()["requests"] == 3  # one refused batch of bad_from, two of good_campaign
    assert len(rig.emulator.read_outbox()) == 4

    # fixed and resumed: everyone gets it once
    rig.db.execute("update mail.campaign set from_address = 'Outreach <outreach@mail.example.com>' where id = %s",
                   (bad,))
    assert scheduled.resume(rig.db, bad)["replanned"] == 4
    rig.db.execute("update mail.send_log set scheduled_at = %s where campaign = 'bad_from'", (PAST,))  # all due
    assert rig.dispatch(policy=no_policy).sent == 4
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rig.rows()})


def test_campaign_level_rejection_charges_nobody_on_the_lifecycle_path(lifecycle_rig: LifecycleRig) -> None:  # noqa: F811
    rig = lifecycle_rig
    for uid in range(1, 16):
        add_user(rig.db, uid)
    campaign = dataclasses.replace(simple_campaign("lc_bad_from", 1), from_address=BAD_FROM)

    with pytest.raises(SendError, match="lc_bad_from: campaign refused: `from`"):
        rig.run([campaign], chunk_size=5)

    rows = rig.rows()
    assert len(rows) == 5  # one chunk: the run stopped at the first refusal
    assert all(r["status"] == "failed" and r["released_at"] is not None for r in rows)
    assert all("campaign refused" in r["error"] for r in rows)
    assert rig.outbox() == []
    # nobody was charged: after the fix all 15 are eligible and sent once
    [s] = rig.run([simple_campaign("lc_bad_from", 1)])
    assert (s.eligible, s.sent) == (15, 15)


@pytest.mark.parametrize("pipelined", [False, True])
def test_campaign_level_refusal_stops_only_that_lifecycle_campaign_and_the_others_go_on(
        lifecycle_rig: LifecycleRig, pipelined: bool) -> None:  # noqa: F811
    # the highest-priority campaign has a `from` the provider refuses: it stops after one batch;
    # the lower-priority campaign still sends all of its audience, and the task fails at the end
    rig = lifecycle_rig
    for uid in range(1, 21):
        add_user(rig.db, uid)
    bad = dataclasses.replace(simple_campaign("lc_bad_from", 1, "user_id <= 10"), from_address=BAD_FROM)
    good = simple_campaign("lc_good", 2, "user_id > 10")
    kw: dict[str, Any] = {}
    if pipelined:  # the second chunk of the refused campaign is minted while the first is in flight
        store = rig.store()
        conn = psycopg.connect(rig.dsn)
        rig.conns.append(conn)
        kw = {"store": store, "pipelined": True, "apply_store": store.companion(conn)}

    with pytest.raises(SendError, match="lc_bad_from: campaign refused: `from`") as raised:
        rig.run([bad, good], chunk_size=5, **kw)

    sb, sg = raised.value.summaries
    assert sb.stopped is not None and sb.stopped.startswith("campaign refused: `from`")
    assert (sb.minted, sb.sent, sb.failed, sb.released) == ((10, 0, 0, 10) if pipelined else (5, 0, 0, 5))
    assert (sg.eligible, sg.minted, sg.sent, sg.stopped) == (10, 10, 10, None)
    bad_rows = rig.rows("campaign = 'lc_bad_from'")
    assert len(bad_rows) == (10 if pipelined else 5)
    assert all(r["released_at"] is not None and r["sent_at"] is None for r in bad_rows)  # nobody charged
    assert Counter(r["status"] for r in rig.rows("campaign = 'lc_good'")) == Counter({"sent": 10})
    assert sorted(m["to"][0] for m in rig.outbox()) == sorted(f"user{u}@example.com" for u in range(11, 21))
    assert rig.emulator.stats()["requests"] == 3  # one refused batch of lc_bad_from, two of lc_good


def test_rows_failed_for_a_campaign_field_are_reopened_by_the_command(rig: Rig, capsys: pytest.CaptureFixture[str],
                                                                       db_dsn: str) -> None:
    cid = provisioned(rig, 3, name="old_bad_from")
    ids = [r["id"] for r in rig.rows()]
    # as the dispatcher recorded it before: every row failed for the campaign's `from`, campaign completed
    rig.db.execute("update mail.send_log set status = 'failed', attempts = 1, claimed_at = now(),"
                   " error = 'Invalid `from` field. The email address needs to follow the `email@example.com` or"
                   " `Name <email@example.com>` format.' where id = any(%s)", (ids[:2],))
    rig.db.execute("update mail.send_log set status = 'failed', attempts = 1,"
                   " error = 'Invalid `to` field. The email address needs to follow the `email@example.com`'"
                   " where id = %s", (ids[2],))
    rig.db.execute("update mail.campaign set status = 'completed' where id = %s", (cid,))

    assert cli_main(["reopen-refused", "--dsn", db_dsn, "--campaign", "old_bad_from"]) == 0
    assert '"found": 2' in capsys.readouterr().out
    assert [r["status"] for r in rig.rows()] == ["failed"] * 3  # a dry run changes nothing

    done = reopen_refused(rig.db, "old_bad_from", "from", apply=True)

    assert (done.found, done.reopened, done.kept_ambiguous, done.campaign_paused) == (2, 2, 0, True)
    rows = rig.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0), ("pending", 0), ("failed", 1)]
    assert "re-opened" in rows[0]["error"] and "Invalid `from` field" in rows[0]["error"]
    assert rig.events(ids[0])[-1] == ("failed", "pending")
    assert rig.campaign_row(cid)["status"] == "paused"
    with pytest.raises(ValueError, match="not a field of the campaign"):
        reopen_refused(rig.db, "old_bad_from", "to")


class RefusesWhole:
    """A provider that refuses every batch of ``campaign`` whole, naming its `from` (HTTP 422 to a
    permissive batch), and sends the others through the real client."""

    def __init__(self, rig: Rig, campaign: str):
        self.inner, self.campaign = rig.client(), campaign

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None, **kw: Any) -> Any:
        if batch.campaign == self.campaign:
            return NotSent(reason="provider refused the whole request: HTTP 422 validation_error: Invalid `from` "
                           "field. The email address needs to follow the `email@example.com` format.",
                           stop_run="request refused", fatal=True)
        return self.inner.send_batch(batch, deadline, slot, **kw)


def test_campaign_level_whole_request_refusal_pauses_that_campaign_and_the_others_go_on(rig: Rig) -> None:
    bad = provisioned(rig, 3, name="bad_from")
    good = rig.campaign("good_campaign", **ALL_DAY, start_at=PAST + timedelta(days=1))
    assert rig.provision(good, now=PAST + timedelta(days=1)).created == 3

    with pytest.raises(SendError, match="bad_from: provider refused the campaign's `from`"):
        rig.dispatch(client=RefusesWhole(rig, "bad_from"), policy=ContactPolicy(cooldown=timedelta(0)))

    assert [(r["status"], r["attempts"]) for r in rig.rows("campaign = 'bad_from'")] == [("pending", 0)] * 3
    assert [r["status"] for r in rig.rows("campaign = 'good_campaign'")] == ["sent"] * 3
    assert rig.campaign_row(bad)["status"] == "paused"


def test_cancel_committing_while_a_refusal_is_applied_still_cancels_the_rows(rig: Rig) -> None:
    # the race of the release with a cancel in progress: the release waits for the campaign row the
    # cancel holds and reads its committed status, so the rows never land pending in a cancelled campaign
    import threading

    from mailflow.store.send_log import PostgresStore

    cid = provisioned(rig, 3)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set status = 'sending', claimed_at = now(), attempts = 1 where id = any(%s)",
                   (ids,))
    batch = PreparedBatch(idempotency_key="k-race", campaign="outreach_test", row_ids=tuple(ids), body=b"[]")
    operator = psycopg.connect(rig.dsn)
    rig.closers.append(operator)
    operator.execute("select * from mail.campaign where id = %s for update", (cid,))  # cancel() in progress
    operator.execute("update mail.campaign set status = 'cancelled' where id = %s", (cid,))
    applied: list[Any] = []
    store = PostgresStore(rig.conn())
    worker = threading.Thread(target=lambda: applied.append(store.apply(
        batch, NotSent(reason="HTTP 429 daily_quota_exceeded", stop_run="daily_quota_exceeded"), RUN)))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive()  # waiting for the operator's campaign row
    operator.commit()
    worker.join(10)

    assert applied and applied[0].released == 3
    assert [(r["status"], r["attempts"]) for r in rig.rows()] == [("cancelled", 0)] * 3
    assert all(r["error"] == "HTTP 429 daily_quota_exceeded (campaign cancelled: not returned to pending)"
               for r in rig.rows())
