"""Scheduled campaigns end to end: real PostgreSQL (provisioning, claims, the shared pacer), the real
Renderer, and the Resend emulator over HTTP through ResendClient. The outbox is the witness.

Dispatch tests plan their rows in the past (fixed dates in January 2026), so every row is due at
the database's ``now()``; resume tests pass an explicit resume instant so re-planned times are exact.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from scheduled_rig import (
    ALL_DAY,
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
    utc,
)

from mailflow.model.outcome import RunContext, SendError
from mailflow.provider.client import RetryPolicy
from mailflow.reconciler import reconcile
from mailflow.sources import scheduled
from mailflow.sources.scheduled import CampaignStateError, DispatchSummary, claiming
from mailflow.sources.scheduled.planning import PlanSpec, plan_send_times
from mailflow.store.suppression import suppress_address

BERLIN, NEW_YORK = ZoneInfo("Europe/Berlin"), ZoneInfo("America/New_York")


def spec_of(**kw: Any) -> PlanSpec:
    return PlanSpec(timezone=kw.get("timezone", "Europe/Berlin"), emails_per_day=kw.get("emails_per_day", 20),
                    weekdays=frozenset(kw.get("weekdays", (1, 2, 3, 4, 5))),
                    windows=tuple(kw.get("windows", ("09:00-12:00", "14:00-17:00"))))


def test_provisioned_times_equal_the_planner_output_and_rows_carry_a_snapshot(rig: Rig) -> None:
    rig.users(45)
    rig.users(3, start=1000, plan="pro")  # not on the list
    start = datetime(2026, 3, 25, 10, 30, tzinfo=BERLIN)  # Wednesday, across the DST change of 03-29
    cid = rig.campaign(emails_per_day=4, start_at=start)

    s = rig.provision(cid, chunk=7, now=start - timedelta(days=3))

    expected = list(plan_send_times(spec_of(emails_per_day=4), 45, start))
    assert rig.times() == expected
    assert (s.created, s.chunks, s.provisioned_total, s.complete) == (45, 7, 45, True)
    assert (s.first_send, s.last_send) == (expected[0], expected[-1])
    rows = rig.rows()
    assert [r["user_id"] for r in rows] == list(range(1, 46))
    r0 = rows[0]
    assert (r0["kind"], r0["status"], r0["email"], r0["attempts"]) == ("scheduled", "pending", "user1@example.com", 0)
    assert r0["context"] == {"first_name": "First1", "signed_up_at": "2025-01-01T00:00:00+00:00",
                             "subject": "First1, the full practice library"}
    assert rig.events(r0["id"]) == [(None, "pending")]
    c = rig.campaign_row(cid)
    assert (c["status"], c["provisioned_count"], c["provision_cursor"]) == ("scheduled", 45, 45)
    assert (c["planned_through"], c["plan_start"]) == (expected[-1], start)
    assert c["provisioned_at"] is not None
    assert [r[0] for r in rig.db.execute("select to_status from mail.campaign_event where campaign_id = %s"
                                         " order by id", (cid,)).fetchall()] == ["draft", "scheduled", "scheduled"]


def test_provisioning_twice_creates_nothing_twice_and_keeps_the_times(rig: Rig) -> None:
    rig.users(30)
    start = datetime(2026, 6, 1, tzinfo=BERLIN)
    cid = rig.campaign(start_at=start)
    rig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at)"
                   " values (7, 'outreach_test', 'scheduled', 'planted@example.com', 'pending', '2026-01-01')")

    first = rig.provision(cid, chunk=8, now=start - timedelta(days=1))
    times = rig.times()
    second = rig.provision(cid, chunk=8, now=start + timedelta(hours=1))

    assert (first.created, first.skipped_existing) == (29, 1)
    assert (second.created, second.chunks, second.complete, second.provisioned_total) == (0, 0, True, 29)
    assert rig.times() == times
    assert len(rig.rows()) == 30
    planned = list(plan_send_times(spec_of(), 30, start))
    assert times == planned[:6] + [utc(2026, 1, 1)] + planned[7:]  # the planted row kept its own time


class Crash(RuntimeError):
    pass


@pytest.mark.parametrize("crash_after", [1, 3])
def test_a_killed_provisioning_resumes_with_exactly_the_uninterrupted_times(rig: Rig, crash_after: int) -> None:
    rig.users(100)
    start = datetime(2026, 10, 20, 15, 0, tzinfo=NEW_YORK)  # spans the fall-back of 2026-11-01
    cid = rig.campaign(emails_per_day=7, timezone="America/New_York", start_at=start)

    def crash(summary: scheduled.ProvisionSummary) -> None:
        if summary.chunks == crash_after:
            raise Crash("killed after a committed chunk")

    with pytest.raises(Crash):
        rig.provision(cid, chunk=9, now=start - timedelta(days=1), after_chunk=crash)
    assert len(rig.rows()) == 9 * crash_after
    assert rig.campaign_row(cid)["provision_cursor"] == 9 * crash_after

    rest = rig.provision(cid, chunk=9, now=start - timedelta(hours=20))

    assert rest.created == 100 - 9 * crash_after
    assert rig.times() == list(plan_send_times(spec_of(emails_per_day=7, timezone="America/New_York"), 100, start))
    assert len({r["user_id"] for r in rig.rows()}) == 100


# Exact UTC expectations on DST days of two zones (weekdays: all; one window per case).
DST_CASES = {
    # Europe/Berlin spring forward 2026-03-29 02:00 CET -> 03:00 CEST: 09:00 local is 08:00 UTC the day
    # before and 07:00 UTC on the day; 01:00-04:00 loses its 02:00-03:00 gap (2 h left).
    "berlin_spring": ("Europe/Berlin", ["09:00-12:00"], 3, datetime(2026, 3, 28, tzinfo=BERLIN), 6,
                      [utc(2026, 3, 28, 8), utc(2026, 3, 28, 9), utc(2026, 3, 28, 10),
                       utc(2026, 3, 29, 7), utc(2026, 3, 29, 8), utc(2026, 3, 29, 9)]),
    "berlin_gap": ("Europe/Berlin", ["01:00-04:00"], 2, datetime(2026, 3, 29, tzinfo=BERLIN), 2,
                   [utc(2026, 3, 29, 0), utc(2026, 3, 29, 1)]),
    # Europe/Berlin fall back 2026-10-25 03:00 CEST -> 02:00 CET.
    "berlin_fall": ("Europe/Berlin", ["09:00-12:00"], 3, datetime(2026, 10, 24, tzinfo=BERLIN), 6,
                    [utc(2026, 10, 24, 7), utc(2026, 10, 24, 8), utc(2026, 10, 24, 9),
                     utc(2026, 10, 25, 8), utc(2026, 10, 25, 9), utc(2026, 10, 25, 10)]),
    # America/New_York spring forward 2026-03-08 02:00 EST -> 03:00 EDT.
    "new_york_spring": ("America/New_York", ["09:00-11:00"], 2, datetime(2026, 3, 7, tzinfo=NEW_YORK), 4,
                        [utc(2026, 3, 7, 14), utc(2026, 3, 7, 15), utc(2026, 3, 8, 13), utc(2026, 3, 8, 14)]),
    # America/New_York fall back 2026-11-01 02:00 EDT -> 01:00 EST: 01:00-02:00 happens twice (2 h).
    "new_york_repeated_hour": ("America/New_York", ["01:00-02:00"], 2, datetime(2026, 11, 1, tzinfo=NEW_YORK), 2,
                               [utc(2026, 11, 1, 5), utc(2026, 11, 1, 6)]),
}


@pytest.mark.parametrize("case", sorted(DST_CASES))
def test_dst_days_of_two_zones_get_exact_utc_times(rig: Rig, case: str) -> None:
    tz, windows, per_day, start, n, expected = DST_CASES[case]
    rig.users(n)
    cid = rig.campaign(timezone=tz, windows=windows, emails_per_day=per_day, weekdays=list(range(1, 8)),
                       start_at=start)
    rig.provision(cid, chunk=1, now=start - timedelta(days=1))  # one row per chunk: every day is resumed
    assert rig.times() == expected


def test_dry_run_summarises_the_plan_and_writes_nothing(rig: Rig) -> None:
    rig.users(50)
    start = datetime(2026, 6, 1, tzinfo=BERLIN)  # Monday
    cid = rig.campaign(start_at=start)

    s = rig.provision(cid, dry_run=True, now=start - timedelta(days=1))

    assert rig.rows() == []
    assert rig.campaign_row(cid)["status"] == "draft"
    assert (s.recipients, s.emails_per_day, s.per_day_max, s.sending_days, s.days_spanned) == (50, 20, 20, 3, 3)
    assert (s.first_send, s.last_send) == (utc(2026, 6, 1, 7), list(plan_send_times(spec_of(), 50, start))[-1])
    assert json.loads(json.dumps(s.as_dict()))["first_send"] == "2026-06-01T07:00:00+00:00"


def test_an_uploaded_recipient_list_is_provisioned_with_its_context(rig: Rig, tmp_path: Path) -> None:
    csv_file = tmp_path / "list.csv"
    csv_file.write_text("user_id,email,first_name,company\n3,a@example.com,Ann,Acme\n1,b@example.com,,Bcorp\n"
                        "2,,Nobody,None\n")
    cid = scheduled.create_campaign(rig.db, {
        "name": "uploaded", "template": "outreach", "subject": "News for {{ user.company }}",
        "from": "Outreach <outreach@mail.example.com>", "recipients_csv": "list.csv", **ALL_DAY,
        "start_at": "2026-01-05T00:00:00+00:00"}, base_dir=tmp_path)

    s = rig.provision(cid)

    assert (s.created, s.skipped_no_email) == (2, 1)
    rows = rig.rows()
    assert [(r["user_id"], r["email"], r["context"]) for r in rows] == [
        (1, "b@example.com", {"first_name": "", "company": "Bcorp", "subject": "News for Bcorp"}),
        (3, "a@example.com", {"first_name": "Ann", "company": "Acme", "subject": "News for Acme"})]


def test_two_concurrent_dispatchers_send_every_row_exactly_once(rig: Rig) -> None:
    cid = provisioned(rig, 500)
    rig.emulator.configure(latency_ms=50)
    results: dict[str, DispatchSummary] = {}
    errors: list[BaseException] = []
    clients = [rig.client(), rig.client()]
    conns = [rig.conn(), rig.conn()]
    renderer = rig.renderer()

    def worker(i: int) -> None:
        try:
            results[f"d{i}"] = scheduled.dispatch(conns[i], clients[i], renderer, budget_seconds=60,
                                                  coalesce_seconds=0, batch_size=50,
                                                  run=RunContext("dispatch_scheduled_emails", f"run-{i}", "dispatch"))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    assert not errors
    assert all(s.claimed > 0 for s in results.values()), results  # both did work, neither blocked
    assert sum(s.claimed for s in results.values()) == sum(s.sent for s in results.values()) == 500
    rows = rig.rows()
    assert Counter(r["status"] for r in rows) == {"sent": 500}
    assert all(r["attempts"] == 1 for r in rows)
    outbox = rig.emulator.read_outbox()
    assert len(outbox) == 500
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rows})
    assert {e["id"] for e in outbox} == {r["provider_message_id"] for r in rows}
    claims = rig.db.execute("select send_log_id, count(*) from mail.send_event where to_status = 'sending'"
                            " group by send_log_id").fetchall()
    assert len(claims) == 500 and {n for _, n in claims} == {1}  # no row claimed twice
    assert {r["run_id"] for r in rows} == {"run-0", "run-1"}
    assert rig.campaign_row(cid)["status"] == "completed"


def test_a_dispatcher_skips_rows_another_holds_without_waiting(rig: Rig, tmp_path: Path) -> None:
    cid = provisioned(rig, 6)
    (tmp_path / "other.csv").write_text("user_id,email\n" + "".join(f"{u},other{u}@example.com\n"
                                                                    for u in range(101, 107)))
    other = scheduled.create_campaign(rig.db, {  # 6 other users, planned at the same times
        "name": "other_test", "template": "outreach", "subject": "Hello", "from": "Outreach <outreach@mail.example.com>",
        "recipients_csv": "other.csv", **ALL_DAY, "start_at": "2026-01-05T00:00:00+00:00"}, base_dir=tmp_path)
    assert rig.provision(other).created == 6
    a, b, c = rig.conn(), rig.conn(), rig.conn()
    for x in (b, c):
        x.execute("set lock_timeout = '1s'")
        x.commit()
    renderer = rig.renderer()
    da = claiming.Dispatcher(a, renderer, RUN, batch_size=4)
    db_ = claiming.Dispatcher(b, renderer, RUN, batch_size=4)
    with a.transaction():  # A's claim stays uncommitted: its rows and its campaign's row stay locked
        _, ca = da.claim()
        with b.transaction():
            _, cb = db_.claim()  # would raise LockNotAvailable if it waited for A
            assert ca is not None and cb is not None
            # claims of one campaign are serialised (its per-day cap counts them): B took the other campaign's
            # rows, and locked none of the campaign A holds on its way
            assert (ca.campaign.name, cb.campaign.name) == ("outreach_test", "other_test")
            rest = [r["id"] for r in rig.rows("campaign = 'outreach_test'") if r["id"] not in {x.id for x in ca.rows}]
            assert len(rest) == 2
            with c.transaction():
                assert len(c.execute("select id from mail.send_log where id = any(%s) for update nowait",
                                     (rest,)).fetchall()) == 2
    _, again = db_.claim()  # A committed: B takes the rest of A's campaign
    assert again is not None
    ids_a, ids_b, ids_again = {r.id for r in ca.rows}, {r.id for r in cb.rows}, {r.id for r in again.rows}
    assert (len(ids_a), len(ids_b), len(ids_again), ids_a & ids_again) == (4, 4, 2, set())
    assert again.campaign.name == "outreach_test" and rig.campaign_row(cid)["status"] == "scheduled"


def test_cancel_turns_pending_into_cancelled_and_leaves_rows_in_flight(rig: Rig) -> None:
    cid = provisioned(rig, 10)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set status = 'sending', claimed_at = now(), attempts = 1 where id = any(%s)",
                   (ids[:2],))
    rig.db.execute("update mail.send_log set status = 'sent', sent_at = now(), provider_message_id = 'p-3'"
                   " where id = %s", (ids[2],))

    out = scheduled.cancel(rig.db, cid, actor="ops")

    assert out == {"campaign": "outreach_test", "status": "cancelled", "changed": True, "rows_cancelled": 7}
    assert [r["status"] for r in rig.rows()] == ["sending"] * 2 + ["sent"] + ["cancelled"] * 7
    assert rig.events(ids[5]) == [(None, "pending"), ("pending", "cancelled")]
    assert rig.db.execute("select from_status, to_status, actor from mail.campaign_event where campaign_id = %s"
                          " order by id desc limit 1", (cid,)).fetchone() == ("scheduled", "cancelled", "ops")
    summary = rig.dispatch()
    assert (summary.claimed, summary.sent) == (0, 0)
    assert rig.emulator.read_outbox() == []
    assert scheduled.cancel(rig.db, cid)["changed"] is False  # idempotent
    with pytest.raises(CampaignStateError, match="cancelled"):
        scheduled.resume(rig.db, cid)
    assert rig.provision(cid).stopped == "campaign cancelled"


def test_pause_stops_dispatch_and_resume_replans_the_overdue_rows_in_order(rig: Rig) -> None:
    spec = {"timezone": "Europe/Berlin", "weekdays": [1, 2, 3, 4, 5], "windows": ["09:00-12:00", "14:00-17:00"],
            "emails_per_day": 10}
    cid = provisioned(rig, 20, **spec)
    ids = [r["id"] for r in rig.rows()]
    # the first 5 went out before the pause
    rig.db.execute("update mail.send_log set status = 'sent', sent_at = scheduled_at + interval '3 seconds',"
                   " provider_message_id = 'early-' || id where id = any(%s)", (ids[:5],))
    assert scheduled.pause(rig.db, cid)["changed"] is True

    paused = rig.dispatch()
    assert (paused.claimed, rig.emulator.read_outbox()) == (0, [])
    assert Counter(r["status"] for r in rig.rows()) == {"pending": 15, "sent": 5}

    resume_at = datetime(2026, 2, 3, 10, 7, tzinfo=BERLIN)  # Tuesday, inside the morning window
    out = scheduled.resume(rig.db, cid, now=resume_at, actor="ops")

    replanned = list(plan_send_times(spec_of(**spec), 15, resume_at))
    assert (out["overdue"], out["replanned"], out["first"]) == (15, 15, replanned[0].isoformat())
    assert rig.times()[5:] == replanned  # in their original order, from the resume instant
    assert replanned[0] == resume_at and replanned[-1].astimezone(BERLIN).date().isoformat() == "2026-02-04"
    c = rig.campaign_row(cid)
    assert (c["status"], c["plan_start"], c["plan_skip"], c["planned_through"]) == (
        "scheduled", resume_at, 0, replanned[-1])

    # the first plan day's 10 rows fall due (the other 5 are the next day's): exactly those are sent, each once
    rig.db.execute("update mail.send_log set scheduled_at = case when id = any(%s) then now() - interval '1 minute'"
                   " else now() + interval '1 day' end where status = 'pending'", (ids[5:15],))
    summary = rig.dispatch()
    assert (summary.sent, summary.replanned) == (10, {})
    assert Counter(r["status"] for r in rig.rows()) == {"sent": 15, "pending": 5}
    assert rig.outbox_ids() == Counter({i: 1 for i in ids[5:15]})  # nobody skipped, nobody twice


def test_resume_keeps_the_daily_cap_on_the_resume_day(rig: Rig) -> None:
    spec = {"timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["09:00-17:00"], "emails_per_day": 8}
    cid = provisioned(rig, 12, **spec)
    ids = [r["id"] for r in rig.rows()]
    resume_at = utc(2026, 2, 10, 9, 0)
    rig.db.execute("update mail.send_log set status = 'sent', sent_at = %s, provider_message_id = 'x-' || id"
                   " where id = any(%s)", (resume_at - timedelta(minutes=30), ids[:3]))
    scheduled.pause(rig.db, cid)

    out = scheduled.resume(rig.db, cid, now=resume_at)

    # 3 of the day's 8 slots are used: the 9 pending rows take the day's last 5 slots, then the next day
    expected = list(plan_send_times(spec_of(**spec), 12, resume_at))[3:]
    assert rig.times()[3:] == expected
    assert expected[:5] == [utc(2026, 2, 10, h) for h in (12, 13, 14, 15, 16)]
    assert (out["replanned"], rig.campaign_row(cid)["plan_skip"]) == (9, 3)


def test_resume_without_overdue_rows_moves_nothing(rig: Rig) -> None:
    rig.users(5)
    start = datetime(2030, 1, 7, tzinfo=BERLIN)
    cid = rig.campaign(start_at=start)
    rig.provision(cid, now=start - timedelta(days=3))
    before = rig.times()
    scheduled.pause(rig.db, cid)
    assert scheduled.pause(rig.db, cid)["changed"] is False

    out = scheduled.resume(rig.db, cid, now=start - timedelta(days=1))

    assert (out["overdue"], out["replanned"]) == (0, 0)
    assert rig.times() == before
    assert scheduled.resume(rig.db, cid)["changed"] is False


def test_rows_already_sent_or_cancelled_are_skipped_without_error(rig: Rig) -> None:
    provisioned(rig, 4)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set status = 'sent', sent_at = now(), provider_message_id = 'done-1'"
                   " where id = %s", (ids[0],))
    rig.db.execute("update mail.send_log set status = 'cancelled' where id = %s", (ids[1],))

    d = claiming.Dispatcher(rig.conn(), rig.renderer(), RUN, batch_size=100)
    _, claim = d.claim()
    assert claim is not None and [r.id for r in claim.rows] == ids[2:]
    # a reconciler settles one of the claimed rows while its batch is in flight
    rig.db.execute("update mail.send_log set status = 'sent', sent_at = now(), provider_message_id = 'other'"
                   " where id = %s", (ids[3],))
    summary = DispatchSummary()
    d.send(claim, rig.client(), deadline=float("inf"), summary=summary)

    assert summary.sent == 1
    rows = rig.rows()
    assert [(r["status"], r["provider_message_id"]) for r in rows][:2] == [("sent", "done-1"), ("cancelled", None)]
    assert rows[3]["provider_message_id"] == "other"  # applied once, by its first writer
    assert rig.events(ids[0]) == rig.events(ids[1]) == [(None, "pending")]
    assert rig.dispatch().claimed == 0


def test_suppressed_users_and_addresses_are_cancelled_at_dispatch(rig: Rig) -> None:
    provisioned(rig, 5)
    rig.db.execute("insert into mail.suppression (user_id, scope, source) values (2, 'all', 'unsubscribe')")
    suppress_address(rig.db, "USER4@example.com", scope="outreach_test", source="unsubscribe")
    rig.db.execute("insert into mail.suppression (user_id, scope, source) values (5, 'other_campaign', 'unsubscribe')")

    summary = rig.dispatch()

    assert (summary.suppressed, summary.sent) == (2, 3)
    by_user = {r["user_id"]: r for r in rig.rows()}
    assert {u: r["status"] for u, r in by_user.items()} == {1: "sent", 2: "cancelled", 3: "sent", 4: "cancelled",
                                                            5: "sent"}
    assert rig.events(by_user[2]["id"]) == [(None, "pending"), ("pending", "cancelled")]
    # the address is judged after the claim gave the row its user's current address (still this one)
    assert by_user[4]["error"] == "suppressed before sending (address)"
    assert sorted(e["to"][0] for e in rig.emulator.read_outbox()) == [
        "user1@example.com", "user3@example.com", "user5@example.com"]


def test_scheduled_5xx_after_processing_keeps_key_and_bytes_and_never_returns_to_pending(rig: Rig) -> None:
    # Before issue 12 a whole-request 5xx returned the rows to `pending` without their key; the next
    # claim sent them again under a new key although the provider had processed them: mailed twice.
    provisioned(rig, 2)
    rig.emulator.configure(error_after_rate=1.0, error_after_status=502)
    with pytest.raises(SendError, match="provider down") as failed:  # the 502 opens the breaker: not green
        rig.dispatch(client=rig.client(policy=RetryPolicy(max_attempts=1)))  # the sender's budget ends
    summary = failed.value.summary
    assert (summary.claimed, summary.sent, summary.released, summary.unknown) == (2, 0, 0, 2)
    assert summary.stopped == "provider unavailable"
    rows = rig.rows()
    [key] = {r["idempotency_key"] for r in rows}
    assert key is not None and all(r["status"] == "sending" and r["ambiguous_at"] is not None for r in rows)
    assert all("HTTP 502 bad_gateway" in r["error"] for r in rows)
    assert len(rig.emulator.read_outbox()) == 2  # the provider did process the batch

    rig.emulator.configure(error_after_rate=0.0)
    again = rig.dispatch(budget_seconds=2)
    assert (again.claimed, again.sent) == (0, 0)  # never claimed again, never re-keyed
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - interval '1 hour'")
    rep = reconcile(rig.conn(), rig.client(), now=rig.db.execute("select now()").fetchone()[0],  # type: ignore[index]
                    run=RUN)
    assert (rep.batches_resent, rep.resent_sent) == (1, 2)
    rows = rig.rows()
    assert {(r["status"], r["idempotency_key"]) for r in rows} == {("sent", key)}
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rows})  # each delivered exactly once
    assert rig.emulator.stats()["replays"] == 1


def test_scheduled_quota_stop_returns_rows_to_pending_uncharged_and_stops_the_run(rig: Rig) -> None:
    provisioned(rig, 3)
    rig.emulator.configure(quota_emails=0)
    for _ in range(3):  # three quota stops charge nobody
        with pytest.raises(SendError, match="daily_quota_exceeded"):
            rig.dispatch(batch_size=1)
        rows = rig.rows()
        assert {(r["status"], r["attempts"], r["idempotency_key"], r["dead_lettered_at"]) for r in rows} == {
            ("pending", 0, None, None)}
    assert rig.emulator.stats()["requests"] == 3  # one request per run: the run stops at once
    rig.emulator.configure(quota_emails=None)
    summary = rig.dispatch()
    assert summary.sent == 3
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rig.rows()})


def test_dispatch_waits_for_a_row_due_inside_its_budget_and_leaves_later_ones(rig: Rig) -> None:
    cid = provisioned(rig, 3)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set scheduled_at = now() + interval '2 seconds' where id = %s", (ids[1],))
    rig.db.execute("update mail.send_log set scheduled_at = now() + interval '1 hour' where id = %s", (ids[2],))

    summary = rig.dispatch(budget_seconds=15, coalesce_seconds=0.5, poll_seconds=1)

    assert (summary.sent, summary.batches, summary.stopped) == (2, 2, None)
    assert 1.0 < summary.idle_seconds < 5 and summary.seconds < 10  # left before the budget: next row is far
    lateness = rig.db.execute("select extract(epoch from sent_at - scheduled_at) from mail.send_log where id = %s",
                              (ids[1],)).fetchone()
    assert lateness is not None and 0 <= lateness[0] < 3
    assert rig.campaign_row(cid)["status"] == "scheduled"  # one row still pending


def test_cli_creates_and_reports_a_campaign(rig: Rig, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rig.users(3)
    spec = tmp_path / "spring.toml"
    spec.write_text('name = "spring_outreach"\ntemplate = "outreach"\nsubject = "Hi {{ user.first_name }}"\n'
                    'from = "Outreach <outreach@mail.example.com>"\nrecipients_sql = "free_plan_users"\n'
                    'timezone = "America/New_York"\nemails_per_day = 5\nwindows = ["10:00-12:00"]\n'
                    "start_at = 2030-01-07T00:00:00Z\n")  # a Monday, in the future (the CLI plans from now)
    assert scheduled.main(["--dsn", rig.dsn, "create", str(spec)]) == 0
    created = json.loads(capsys.readouterr().out)
    assert (created["name"], created["status"], created["windows"]) == ("spring_outreach", "draft", ["10:00-12:00"])
    assert scheduled.main(["--dsn", rig.dsn, "provision", "spring_outreach", "--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert (dry["recipients"], dry["first_send"]) == (3, "2030-01-07T15:00:00+00:00")  # 10:00 EST
    assert scheduled.main(["--dsn", rig.dsn, "provision", "spring_outreach", "--approve-as", "ops",
                           "--reason", "spring plan"]) == 0
    assert json.loads(capsys.readouterr().out)["created"] == 3
    assert scheduled.main(["--dsn", rig.dsn, "pause", "spring_outreach"]) == 0
    capsys.readouterr()
    assert scheduled.main(["--dsn", rig.dsn, "status", str(created["id"])]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["status"], st["rows"]["pending"], st["provisioned_count"]) == ("paused", 3, 3)


def test_create_refuses_an_invalid_spec(rig: Rig) -> None:
    base = {"name": "bad", "template": "outreach", "subject": "x", "from": "a@mail.example.com",
            "recipients_sql": "free_plan_users"}
    with pytest.raises(ValueError, match="unknown IANA timezone"):
        scheduled.create_campaign(rig.db, base | {"timezone": "Mars/Olympus"})
    with pytest.raises(ValueError, match="template"):
        scheduled.create_campaign(rig.db, base | {"template": "nope"})
    with pytest.raises(ValueError, match="exactly one of"):
        scheduled.create_campaign(rig.db, base | {"recipients_table": "mail.campaign_recipient"})
    with pytest.raises(ValueError, match="overlap"):
        scheduled.create_campaign(rig.db, base | {"windows": ["09:00-12:00", "11:00-13:00"]})


def test_a_row_that_cannot_render_fails_alone_and_the_run_says_so(rig: Rig) -> None:
    provisioned(rig, 3)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set context = context - 'first_name' where id = %s", (ids[1],))

    with pytest.raises(SendError, match="could not be rendered"):
        rig.dispatch()

    rows = rig.rows()
    assert [r["status"] for r in rows] == ["sent", "failed", "sent"]
    assert "render failed" in rows[1]["error"] and "first_name" in rows[1]["error"]
    assert rig.outbox_ids() == Counter({ids[0]: 1, ids[2]: 1})
    assert rig.dispatch().claimed == 0  # the failed row is terminal: the next run is clean


def test_a_missing_template_fails_the_run_and_leaves_rows_pending(rig: Rig) -> None:
    cid = provisioned(rig, 2)
    rig.db.execute("update mail.campaign set template = 'no_such_template' where id = %s", (cid,))

    with pytest.raises(SendError, match="outreach_test: dispatch failed: TemplateNotFound"):
        rig.dispatch()
    assert rig.campaign_row(cid)["status"] == "paused"  # taken out of the queue, with the reason

    rows = rig.rows()
    assert [(r["status"], r["attempts"]) for r in rows] == [("pending", 0), ("pending", 0)]
    assert rig.events(rows[0]["id"]) == [(None, "pending")]  # the claim rolled back entirely
    assert rig.db.execute("select count(*) from mail.send_batch").fetchone() == (0,)


def test_windows_to_midnight_and_across_it_are_accepted_and_provisioned_in_chunks(rig: Rig) -> None:
    # The spec loader takes 22:00-24:00 and 23:00-01:00+1; chunked provisioning across midnight
    # equals one uninterrupted plan, and each crossing window counts towards the day it opened on.
    rig.users(9)
    start = datetime(2026, 10, 23, 12, tzinfo=BERLIN)  # Friday; Berlin falls back on Sunday 10-25 03:00
    cid = rig.campaign(emails_per_day=3, start_at=start, weekdays=[1, 2, 3, 4, 5, 6, 7],
                       windows=["20:00-21:00", "23:00-03:30+1"])
    assert rig.campaign_row(cid)["windows"] == ["20:00-21:00", "23:00-03:30+1"]
    rig.provision(cid, chunk=2, now=start - timedelta(days=1))
    spec = spec_of(emails_per_day=3, weekdays=range(1, 8), windows=("20:00-21:00", "23:00-03:30"))
    assert rig.times() == list(plan_send_times(spec, 9, start))
    # Friday: 1 h + 4.5 h = 5.5 h, slots 1 h 50 min apart: 20:00, 23:50, 01:40 (Saturday) local CEST
    assert rig.times()[:3] == [datetime(2026, 10, 23, 18, tzinfo=UTC), datetime(2026, 10, 23, 21, 50, tzinfo=UTC),
                               datetime(2026, 10, 23, 23, 40, tzinfo=UTC)]
    # Saturday's 23:00 CEST-03:30 CET is 5.5 h real time: 6.5 h in all, 2 h 10 min apart
    assert rig.times()[3:6] == [datetime(2026, 10, 24, 18, tzinfo=UTC), datetime(2026, 10, 24, 22, 10, tzinfo=UTC),
                                datetime(2026, 10, 25, 0, 20, tzinfo=UTC)]
    with pytest.raises(ValueError, match="overlap"):
        scheduled.create_campaign(rig.db, {"name": "bad", "template": "outreach", "subject": "x",
                                           "from": "a@mail.example.com", "recipients_sql": "free_plan_users",
                                           "windows": ["23:00-01:00+1", "00:30-09:00"]})
