"""No hold ends in a burst: a deferred canary row never freezes a campaign, and every path that lets a
held campaign send again (a canary release, the reputation guard's resume of a campaign it held without
pausing it, a person's resume while the account was tripped followed by the guard's resume) re-plans the
overdue rows under ``emails_per_day``, with the dispatcher's per-day cap behind them (also under
concurrent dispatchers). A held campaign says why (campaign status, the progress page, the metrics).

Real PostgreSQL, the real renderer, the emulator over HTTP (its outbox is the witness). Time moves as
in the other scheduled tests: rows are planned on 2026-01-05 (long due), a hold that lasts days is
simulated by moving planned times back, and the re-planned times are checked against the planner from
the release instant the campaign event records.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb
from scheduled_rig import (
    ALL_DAY,
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.model.outcome import RunContext
from mailflow.orchestration import metrics
from mailflow.orchestration.ui.progress_queries import load_campaign, load_list
from mailflow.sources import scheduled
from mailflow.sources.scheduled import DispatchSummary
from mailflow.sources.scheduled.cli import campaign as campaign_cli
from mailflow.sources.scheduled.control import resume_reputation
from mailflow.sources.scheduled.holds import HOLD_KINDS
from mailflow.sources.scheduled.planning import day_bounds, plan_after, plan_spec
from mailflow.store.sql import query

PER_DAY = 50
SPEC = ALL_DAY | {"emails_per_day": PER_DAY}  # every day 00:00-23:59 UTC, 50 emails a day
ACCOUNT = "https://api.resend.com"


def db_now(db: psycopg.Connection) -> datetime:
    row = db.execute("select now()").fetchone()
    assert row is not None
    return row[0]


def outcomes(db: psycopg.Connection, ids: list[int], outcome: str = "delivered") -> None:
    """An outcome for each sent row of ``ids`` (the webhook applier's job)."""
    col = {"delivered": "delivered_at"}[outcome]
    db.execute(f"insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome,"
               f" outcome_at, {col}) select id, provider_message_id, %s, 0, %s, now(), now()"
               f" from mail.send_log where status = 'sent' and id = any(%s)", (outcome, outcome, ids))


def trip(db: psycopg.Connection, scope: str, name: str) -> list[str]:
    """The guard trips ``scope`` ``name`` as its evaluation does (the rate rule is not under test here): the
    guard row becomes tripped with a reason, and in the same transaction the scheduled campaigns it stops
    are paused by ``reputation_guard`` (``pause_campaigns``). Returns the campaigns paused."""
    reason = "hard-bounce rate 50% (50 of 100) >= 4%"
    with db.transaction():
        db.execute("insert into mail.reputation_guard (scope, name, state, tripped_at, reason, sample,"
                   " hard_bounce_rate, complaint_rate, evaluated_at) values (%s, %s, 'tripped', now(), %s, 100, 0.5,"
                   " 0, now()) on conflict (scope, name) do update set state = 'tripped', tripped_at = now(),"
                   " reason = excluded.reason", (scope, name, reason))
        return [str(r[0]) for r in db.execute(query("reputation", "pause_campaigns"), {
            "all": scope == "account", "name": name,
            "detail": Jsonb({"reason": f"reputation guard tripped ({scope} {name}): {reason}", "scope": scope,
                             "name": name})}).fetchall()]


def trip_account(db: psycopg.Connection) -> list[str]:
    return trip(db, "account", ACCOUNT)


def replan_event(db: psycopg.Connection, cid: int, reason: str) -> dict[str, Any]:
    """The detail of the campaign's last re-plan whose reason starts with ``reason``."""
    row = db.execute("select detail from mail.campaign_event where campaign_id = %s and detail->>'reason' like %s"
                     " order by id desc limit 1", (cid, reason + "%")).fetchone()
    assert row is not None, reason
    return dict(row[0])


def pending_times(db: psycopg.Connection, campaign: str = "outreach_test") -> list[datetime]:
    return [r[0] for r in db.execute("select scheduled_at from mail.send_log where campaign = %s and status = 'pending'"
                                     " order by scheduled_at, id", (campaign,))]


def per_plan_day(db: psycopg.Connection, spec_row: dict[str, Any]) -> Counter[Any]:
    """Emails per plan day: sent (by sent time) and planned (pending, by planned time)."""
    spec = plan_spec(spec_row)
    rows = db.execute("select coalesce(sent_at, scheduled_at) from mail.send_log where campaign = 'outreach_test'"
                      " and status in ('sent', 'pending')").fetchall()
    return Counter(day_bounds(t, spec)[0] for (t,) in rows)


def dispatched(rig: Rig, **kw: Any) -> tuple[DispatchSummary, datetime]:
    """One dispatch run and the database clock right after it."""
    s = rig.dispatch(**kw)
    return s, db_now(rig.db)


# -- the canary ------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["outcomes", "maximum wait"])
def test_canary_deferred_row_does_not_freeze_campaign(rig: Rig, rule: str) -> None:
    """1 of 30 canary rows is deferred by the cooldown (its user got another email 2 days ago: 5 days to
    go). The other 29 are sent and judged: released by their outcomes, or (the release needing every
    outcome and one missing) by canary_max_wait after the last send, whatever the deferred row does."""
    rig.users(300)
    cid = rig.campaign(**SPEC, canary_share=0.1, canary_max_wait_minutes=0.01,  # 0.6 s
                       canary_min_outcome_share=0.9 if rule == "outcomes" else 1)
    assert rig.provision(cid).created == 300
    rig.db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
                   " values (7, 'first_practice', 'lifecycle', 'user7@example.com', 'sent', now() - interval '2 days',"
                   " 'lifecycle-7')")
    canary_ids = [r["id"] for r in rig.rows("campaign = 'outreach_test'")][:30]
    assert rig.campaign_row(cid)["canary_last_id"] == canary_ids[-1]

    s = rig.dispatch()

    assert (s.sent, s.deferred, s.canaries_released) == (29, 1, [])
    [deferred] = rig.rows("campaign = 'outreach_test' and user_id = 7")
    assert deferred["status"] == "pending" and deferred["error"].startswith("contact policy: cooldown 7 days")
    assert deferred["scheduled_at"] > db_now(rig.db) + timedelta(days=4)
    sent = [r["id"] for r in rig.rows("campaign = 'outreach_test' and status = 'sent'")]
    assert len(sent) == 29 and set(sent) < set(canary_ids)
    hold = scheduled.status(rig.db, cid)["hold"]
    assert (hold["kind"], hold["canary_sent"], hold["canary_deferred"], hold["canary_open"]) == ("canary", 29, 1, 0)
    outcomes(rig.db, sent if rule == "outcomes" else sent[:28])
    if rule == "maximum wait":
        assert rig.dispatch().canaries_released == []  # 28 of 29 < 100 %: the maximum wait has not passed
        time.sleep(1.0)

    s, after = dispatched(rig)

    assert s.canaries_released == ["outreach_test"]
    [(detail,)] = rig.db.execute("select detail from mail.campaign_event where detail->>'reason' = 'canary released'"
                                 ).fetchall()
    assert (detail["rule"], detail["canary_sent"], detail["canary_deferred"]) == (rule, 29, 1)
    assert detail["canary_with_outcome"] == (29 if rule == "outcomes" else 28)
    # released, the rest is re-planned from the release (the deferred row, planned last, goes last): 21 slots
    # are left today after the canary's 29, so nothing past the cap is sent
    replan = replan_event(rig.db, cid, "canary released")
    at = datetime.fromisoformat(replan["replanned_from"])
    expected = list(plan_after(plan_spec(rig.campaign_row(cid)), at, 29, None, 271))
    assert (replan["overdue"], replan["replanned"], replan["plan_skip"]) == (270, 271, 29)  # the deferred row is not due
    assert s.sent == sum(1 for t in expected if t <= after)
    assert pending_times(rig.db) == expected[s.sent:]
    assert max(per_plan_day(rig.db, rig.campaign_row(cid)).values()) == PER_DAY
    assert scheduled.status(rig.db, cid)["hold"] is None


def test_canary_release_respects_emails_per_day(rig: Rig) -> None:
    """300 rows at 50 a day; the canary (30) goes out, its outcomes arrive, and the 270 rows that waited
    behind it are released. They are re-planned from the release: the first day keeps the 20 slots the
    canary left, and even with every row forced due the dispatcher sends 20 more that day, never 21."""
    cid = provisioned(rig, 300, **SPEC, canary_share=0.1)
    assert rig.dispatch().sent == 30
    outcomes(rig.db, [r["id"] for r in rig.rows("status = 'sent'")])

    s, after = dispatched(rig)

    assert s.canaries_released == ["outreach_test"]
    replan = replan_event(rig.db, cid, "canary released")
    at = datetime.fromisoformat(replan["replanned_from"])
    expected = list(plan_after(plan_spec(rig.campaign_row(cid)), at, 30, None, 270))
    assert (replan["overdue"], replan["replanned"], replan["plan_skip"]) == (270, 270, 30)
    assert s.sent == sum(1 for t in expected if t <= after)  # not 270
    assert pending_times(rig.db) == expected[s.sent:]
    days = per_plan_day(rig.db, rig.campaign_row(cid))
    assert days[day_bounds(at, plan_spec(rig.campaign_row(cid)))[0]] == PER_DAY  # 30 sent + 20 planned
    assert max(days.values()) == PER_DAY

    # the cap behind the plan: whatever makes rows due, the day's 50 hold
    left = PER_DAY - 30 - s.sent
    first = [r[0] for r in rig.db.execute("select id from mail.send_log where status = 'pending' order by scheduled_at, id"
                                          " limit %s", (left,))]
    rig.db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where id = any(%s)", (first,))
    assert (rig.dispatch().sent, len(rig.emulator.read_outbox())) == (left, PER_DAY)
    rig.db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where status = 'pending'")

    s = rig.dispatch()

    assert (s.sent, s.claimed, s.replanned) == (0, 0, {"outreach_test": 250})
    assert len(rig.emulator.read_outbox()) == PER_DAY
    capped = replan_event(rig.db, cid, "per-day cap")
    assert (capped["overdue"], capped["replanned"], capped["plan_skip"]) == (250, 250, PER_DAY)
    assert min(pending_times(rig.db)) >= day_bounds(db_now(rig.db), plan_spec(rig.campaign_row(cid)))[1]


# -- the reputation guard's resume -----------------------------------------------------------------


def test_guard_resume_replans_campaigns_held_not_paused(rig: Rig) -> None:
    """The account is tripped; a campaign provisioned meanwhile is ``scheduled`` (the trip paused only
    the campaigns that were scheduled then) and held by the claim statements, while its 107 rows fall
    due. The account's resume re-plans it: the first dispatch sends what the plan allows, not 107."""
    trip_account(rig.db)
    cid = provisioned(rig, 107, **SPEC)
    assert rig.campaign_row(cid)["status"] == "scheduled"
    assert rig.dispatch().sent == 0
    hold = scheduled.status(rig.db, cid)["hold"]
    assert (hold["kind"], hold["scope"], hold["name"]) == ("guard_account", "account", ACCOUNT)

    out = resume_reputation(rig.db, "account", ACCOUNT, actor="alice", reason="bounced list removed")

    assert (out["changed"], out["unpaused"], out["released"]) == (True, [], ["outreach_test"])
    replan = replan_event(rig.db, cid, f"reputation guard resumed (account {ACCOUNT})")
    at = datetime.fromisoformat(replan["replanned_from"])
    assert at == datetime.fromisoformat(out["resumed_at"])
    expected = list(plan_after(plan_spec(rig.campaign_row(cid)), at, 0, None, 107))
    assert (replan["overdue"], replan["replanned"]) == (107, 107)
    assert pending_times(rig.db) == expected

    s, after = dispatched(rig)

    assert s.sent == sum(1 for t in expected if t <= after) <= PER_DAY  # 1: the first slot is the resume instant
    assert len(rig.emulator.read_outbox()) == s.sent
    assert max(per_plan_day(rig.db, rig.campaign_row(cid)).values()) == PER_DAY
    assert scheduled.status(rig.db, cid)["hold"] is None


def test_person_resume_while_tripped_then_guard_resume_does_not_burst(rig: Rig) -> None:
    """A person resumes a campaign the account trip paused while the account is still tripped: it is
    re-planned then, but stays held, and its rows fall due again during the trip (two days, simulated).
    The account's resume re-plans it again (it is no longer the guard's pause: it was the person's
    resume that made it scheduled), so the first dispatch after it sends no backlog."""
    cid = provisioned(rig, 107, **SPEC)
    trip_account(rig.db)
    assert rig.campaign_row(cid)["status"] == "paused"
    bob = scheduled.resume(rig.db, cid, actor="bob")
    assert (bob["status"], bob["replanned"]) == ("scheduled", 107)
    assert rig.dispatch().sent == 0  # still held by the account
    assert scheduled.status(rig.db, cid)["hold"]["kind"] == "guard_account"
    rig.db.execute("update mail.send_log set scheduled_at = scheduled_at - interval '2 days'"
                   " where campaign = 'outreach_test' and status = 'pending'")  # the trip lasted two more days

    out = resume_reputation(rig.db, "account", ACCOUNT, actor="alice", reason="list cleaned")

    assert (out["unpaused"], out["released"]) == ([], ["outreach_test"])
    at = datetime.fromisoformat(out["resumed_at"])
    expected = list(plan_after(plan_spec(rig.campaign_row(cid)), at, 0, None, 107))
    assert pending_times(rig.db) == expected

    s, after = dispatched(rig)

    assert s.sent == sum(1 for t in expected if t <= after) <= PER_DAY
    assert len(rig.emulator.read_outbox()) == s.sent


def test_guard_resume_replans_the_campaign_it_paused(rig: Rig) -> None:
    """The campaign scope's own resume, for the campaign its trip paused: re-planned as a person's resume."""
    cid = provisioned(rig, 60, **SPEC)
    assert trip(rig.db, "campaign", "outreach_test") == ["outreach_test"]

    out = resume_reputation(rig.db, "campaign", "outreach_test", actor="alice", reason="segment fixed")

    assert (out["unpaused"], out["released"]) == (["outreach_test"], [])
    at = datetime.fromisoformat(out["resumed_at"])
    assert pending_times(rig.db) == list(plan_after(plan_spec(rig.campaign_row(cid)), at, 0, None, 60))


# -- the per-day cap under concurrent dispatchers --------------------------------------------------


def test_per_day_cap_holds_under_concurrent_dispatchers(rig: Rig) -> None:
    """Four dispatchers at once on a campaign of 50 a day: 40 rows are due now and 80 more fall due
    4 s later, while the dispatchers still run (a plan gone wrong: 120 on one day). The 40 go out; the 80
    are more than the 10 left, so they are re-planned, not sent, whichever dispatcher meets them."""
    cid = provisioned(rig, 120, **SPEC)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set scheduled_at = case when id = any(%s) then now() - interval '1 minute'"
                   " else now() + interval '4 seconds' end", (ids[:40],))
    results: list[DispatchSummary] = []
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results.append(scheduled.dispatch(rig.conn(), rig.client(), rig.renderer(), budget_seconds=8,
                                              coalesce_seconds=0, batch_size=5,
                                              run=RunContext(RUN.dag_id, f"run-{i}", RUN.task_id)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)

    assert errors == []
    assert sum(s.sent for s in results) == 40
    assert sum(sum(s.replanned.values()) for s in results) == 80
    assert Counter(r["status"] for r in rig.rows()) == {"sent": 40, "pending": 80}
    assert rig.outbox_ids() == Counter({i: 1 for i in ids[:40]})
    assert max(per_plan_day(rig.db, rig.campaign_row(cid)).values()) == PER_DAY


# -- why a held campaign does not send -------------------------------------------------------------


class FakeStats:
    def __init__(self) -> None:
        self.gauges: dict[str, int] = {}

    def gauge(self, name: str, value: int, **kw: Any) -> None:
        self.gauges[name] = value


def test_held_campaign_status_shows_the_reason(rig: Rig, db_dsn: str, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Campaign status, the progress page and the dispatch metrics say why a campaign is held: its canary
    is waiting (with its counts), the account is tripped (while it shows ``scheduled``), a person paused it."""
    canary = provisioned(rig, 20, **SPEC, canary_share=0.1)
    assert rig.dispatch().sent == 2
    hold = scheduled.status(rig.db, canary)["hold"]
    assert {k: hold[k] for k in ("kind", "canary_rows", "canary_sent", "canary_with_outcome", "canary_outcomes_needed",
                                 "canary_open", "canary_deferred")} == {
        "kind": "canary", "canary_rows": 2, "canary_sent": 2, "canary_with_outcome": 0, "canary_outcomes_needed": 2,
        "canary_open": 0, "canary_deferred": 0}
    assert hold["reason"].startswith("canary waiting: 2 of 2 canary emails sent, 0 with an outcome (the release "
                                     "needs 2, 90% of those sent)")

    trip_account(rig.db)  # pauses the scheduled campaign; a campaign provisioned after it stays scheduled
    rig.users(5, start=1001)
    later = rig.campaign("later_test", **SPEC)
    rig.provision(later)
    assert (rig.campaign_row(canary)["status"], rig.campaign_row(later)["status"]) == ("paused", "scheduled")
    s = rig.dispatch()
    assert s.held["later_test"]["kind"] == "guard_account"
    assert s.held["outreach_test"]["kind"] == "guard_account"
    for name, cid in (("later_test", later), ("outreach_test", canary)):
        got = scheduled.status(rig.db, cid)
        assert got["hold"]["kind"] == "guard_account", name
        assert got["hold"]["reason"].startswith(f"reputation guard tripped (account {ACCOUNT}) at ")
    assert "scheduled, but nothing is claimed while it is tripped" in scheduled.status(rig.db, later)["hold"]["reason"]

    # the CLI prints the same
    assert campaign_cli.main(["status", "later_test", "--dsn", db_dsn], standalone_mode=False) == 0
    assert '"kind": "guard_account"' in capsys.readouterr().out

    # the progress page: the list and the campaign
    listed = {c["campaign"]: c for c in load_list(rig.db)["campaigns"]}
    assert listed["later_test"]["hold"]["kind"] == "guard_account"
    assert listed["outreach_test"]["hold"]["kind"] == "guard_account"
    page = load_campaign(rig.db, "later_test", show=False)
    assert page is not None and page["progress"]["hold"]["reason"] == scheduled.status(rig.db, later)["hold"]["reason"]

    # the metrics: one gauge per campaign and kind, and the totals
    stats = FakeStats()
    monkeypatch.setattr(metrics, "_stats", lambda: stats)
    metrics.campaign_holds(s.held, "dispatch_scheduled_emails")
    assert stats.gauges["mailflow.campaign.later_test.hold.guard_account"] == 1
    assert stats.gauges["mailflow.campaign.later_test.hold.canary"] == 0
    assert stats.gauges["mailflow.campaigns.held.guard_account"] == 2

    # a person's pause comes first, with who and why
    resume_reputation(rig.db, "account", ACCOUNT, actor="alice", reason="ok")
    scheduled.pause(rig.db, later, actor="carol")
    hold = scheduled.status(rig.db, later)["hold"]
    assert (hold["kind"], hold["paused_by"]) == ("paused", "carol")
    assert hold["reason"].startswith("paused by carol at ")
    assert scheduled.status(rig.db, canary)["hold"]["kind"] == "canary"  # the guard's pause was lifted
    assert rig.dispatch().held == {"later_test": scheduled.status(rig.db, later)["hold"],
                                   "outreach_test": scheduled.status(rig.db, canary)["hold"]}
    assert metrics.HOLD_KINDS == HOLD_KINDS
