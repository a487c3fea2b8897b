"""The reputation guard (mail.reputation_guard) against a real PostgreSQL: it trips at the threshold and
not below, never before the minimum sample, stays tripped until a person resumes it, forgets outcomes
from before the resume, pauses a scheduled campaign (which is then not dispatched), makes the lifecycle
source skip a campaign, trips once under concurrent evaluators; the canary of a scheduled campaign; the
CLI and the alert. Outcomes are written straight into mail.delivery_status (the webhook applier's job)."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from lifecycle_rig import INTERVAL, simple_campaign
from lifecycle_rig import RUN as LIFECYCLE_RUN
from scheduled_rig import (
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.cli import main as mailflow_cli
from mailflow.orchestration.reputation import reputation_alerts
from mailflow.sources import scheduled
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.sources.scheduled.control import resume_reputation
from mailflow.sources.scheduled.definition import CampaignDefinitionError
from mailflow.store import reputation
from mailflow.store.reputation import GuardConfig
from mailflow.store.send_log import PostgresStore

CONFIG = GuardConfig(account_every=timedelta(0))  # the default lines, the account read at every call
ACCOUNT = "https://api.resend.com"


@pytest.fixture
def db(db: psycopg.Connection) -> psycopg.Connection:  # type: ignore[override]
    db.execute("truncate mail.reputation_guard, mail.campaign_event, mail.campaign_recipient, mail.campaign"
               " restart identity cascade")
    return db


def emails(db: psycopg.Connection, campaign: str, n: int, *, hard: int = 0, complained: int = 0,
           soft: int = 0, first_user: int = 100_000, kind: str = "lifecycle") -> list[int]:
    """``n`` sent emails of ``campaign`` (sent now) with an outcome each: ``hard`` hard bounces, then
    ``complained`` complaints, ``soft`` soft bounces, the rest delivered. Returns their send-log ids."""
    ids = [int(r[0]) for r in db.execute(
        "insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
        " select u, %(c)s, %(k)s, 'u' || u || '@example.com', 'sent', now(), %(c)s || '-' || u"
        " from generate_series(%(a)s::bigint, %(b)s::bigint) as u order by u returning id",
        {"c": campaign, "k": kind, "a": first_user, "b": first_user + n - 1}).fetchall()]
    outcomes = ["hard_bounced"] * hard + ["complained"] * complained + ["soft_bounced"] * soft
    outcomes += ["delivered"] * (n - len(outcomes))
    db.execute(
        "insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome, outcome_at,"
        " delivered_at, hard_bounced_at, complained_at, soft_bounced_at)"
        " select l.id, l.provider_message_id, o.outcome, 0, o.outcome, now(),"
        " case when o.outcome in ('delivered', 'complained') then now() end,"
        " case when o.outcome = 'hard_bounced' then now() end, case when o.outcome = 'complained' then now() end,"
        " case when o.outcome = 'soft_bounced' then now() end"
        " from unnest(%(ids)s::bigint[], %(o)s::text[]) as o(id, outcome) join mail.send_log l on l.id = o.id",
        {"ids": ids, "o": outcomes})
    return ids


def guard(db: psycopg.Connection, scope: str, name: str) -> dict[str, Any]:
    cur = db.execute("select * from mail.reputation_guard where scope = %s and name = %s", (scope, name))
    names = [d.name for d in cur.description or []]
    row = cur.fetchone()
    assert row is not None, (scope, name)
    return dict(zip(names, row, strict=True))


def bounce(db: psycopg.Connection, send_log_id: int) -> None:
    db.execute("update mail.delivery_status set hard_bounced_at = now(), outcome = 'hard_bounced'"
               " where send_log_id = %s", (send_log_id,))


def sent_without_outcome(db: psycopg.Connection, campaign: str, n: int, first_user: int) -> None:
    """``n`` emails of ``campaign`` sent now whose outcomes have not arrived."""
    db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
               " select u, %(c)s, 'lifecycle', 'u' || u || '@example.com', 'sent', now(), %(c)s || '-' || u"
               " from generate_series(%(a)s::bigint, %(b)s::bigint) as u", {"c": campaign, "a": first_user,
                                                                           "b": first_user + n - 1})


def test_guard_blind_spot_outcomes_behind_the_newest_sends_are_counted(db: psycopg.Connection) -> None:
    # at full speed the newest sends are exactly the emails without an outcome: 1,900 bounced emails
    # followed by 4,100 newer ones still waiting must trip the campaign and the account
    emails(db, "welcome", 1900, hard=1900)
    sent_without_outcome(db, "welcome", 4100, first_user=500_000)

    trips = reputation.evaluate(db, ["welcome"], config=CONFIG, account=ACCOUNT)

    assert sorted((t.scope, t.sample, t.hard_bounces) for t in trips) == [("account", 1900, 1900),
                                                                          ("campaign", 1900, 1900)]
    g = guard(db, "campaign", "welcome")
    assert (g["state"], g["sample"], g["cum_hard"], g["awaiting"]) == ("tripped", 1900, 1900, 4100)


def test_guard_counts_every_outcome_once_whenever_it_arrives(db: psycopg.Connection) -> None:
    # outcomes that arrive between evaluations add up; an evaluation with nothing new adds nothing
    ids = emails(db, "welcome", 40)
    for _ in range(3):
        assert reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False) == []
    assert guard(db, "campaign", "welcome")["sample"] == 40
    for i in ids[:4]:
        bounce(db, i)
    assert reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False) == []
    g = guard(db, "campaign", "welcome")
    assert (g["sample"], g["cum_hard"]) == (40, 4)


def test_sequential_rule_trips_a_bad_list_on_few_outcomes_and_not_one_outcome_early(db: psycopg.Connection) -> None:
    # every email bounces: each hard bounce adds log(4) = 1.386; the trip line is log(0.99 / 0.001) = 6.898,
    # so the 5th bounce trips and the 4th does not (no minimum sample: the test is sound at any size)
    ids = emails(db, "welcome", 4, hard=4)
    assert reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False) == []
    assert guard(db, "campaign", "welcome")["llr_bounce"] == pytest.approx(4 * math.log(4))
    emails(db, "welcome", 1, hard=1, first_user=200_000)

    [trip] = reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False)

    assert (trip.sample, trip.hard_bounces, trip.hard_bounce_rate) == (5, 5, Decimal("1"))
    assert trip.reason == ("hard bounces 100% (5 of 5 emails with an outcome) against the 2% line: the sequential "
                           "test crossed its trip line (log-likelihood ratio >= 6.90; false-trip probability <= 0.001)")
    assert len(ids) == 4


def test_sequential_rule_trips_at_the_line_and_proves_a_healthy_list(db: psycopg.Connection) -> None:
    # a healthy list (0.5 % hard bounces, no complaints) is proven and never trips; one at 4 % (Resend's
    # line) trips; neither needs a minimum sample
    emails(db, "healthy", 2000, hard=10)
    emails(db, "bad", 400, hard=16, first_user=300_000)
    trips = reputation.evaluate(db, ["healthy", "bad"], config=CONFIG, include_account=False)
    assert [(t.name, t.sample, t.hard_bounces) for t in trips] == [("bad", 400, 16)]
    g = guard(db, "campaign", "healthy")
    assert (g["state"], g["proven"], g["llr_bounce"], g["llr_gross"]) == ("ok", True, pytest.approx(CONFIG.lower),
                                                                          pytest.approx(CONFIG.lower))


def test_gross_complaints_trip_on_deliveries_at_half_a_percent(db: psycopg.Connection) -> None:
    # 0.5 % complaints among deliveries: the gross test (H1 0.4 %, H0 0.04 %) crosses at the 5th complaint
    # in 1,000 (5 x log(10) + 995 x log(0.996 / 0.9996) = 7.92) and not at the 4th (5.61)
    emails(db, "four", 1000, complained=4)
    emails(db, "five", 1000, complained=5, first_user=300_000)

    [trip] = reputation.evaluate(db, ["four", "five"], config=CONFIG, include_account=False)

    assert (trip.name, trip.complaints, trip.complaint_rate) == ("five", 5, Decimal("0.005"))
    assert "complaints 0.5% (5 of 1000 delivered) against 0.4% (10x the 0.04% line)" in trip.reason
    assert guard(db, "campaign", "four")["llr_gross"] == pytest.approx(4 * math.log(10) + 996 * math.log(0.996 / 0.9996))
    assert guard(db, "campaign", "four")["state"] == "ok"


def test_complaint_lag_a_fresh_delivery_is_not_evidence_of_no_complaint(db: psycopg.Connection) -> None:
    # 5 complaints among 3,000 emails delivered a moment ago (0.17 %): the gross test does not cross, but
    # complaints arrive over a day, so fresh deliveries weigh almost nothing against them: the complaint
    # test trips. The same counts delivered over the last two days (weighing 0.75 on average) do not.
    assert reputation.admit(db, "digest", 100, account=ACCOUNT, config=CONFIG).granted == 100  # about to send
    emails(db, "digest", 3000, complained=5)
    [trip] = reputation.evaluate(db, ["digest"], config=CONFIG, include_account=False)
    assert "(5 of 3000 delivered, 0 weighed by the 1 day, 0:00:00 complaint lag) against the 0.04% line" in trip.reason
    assert guard(db, "campaign", "digest")["llr_gross"] < CONFIG.upper

    assert reputation.admit(db, "matured", 100, account=ACCOUNT, config=CONFIG).granted == 100
    db.execute("update mail.reputation_guard set delivered_marks = jsonb_build_array(jsonb_build_array("
               "extract(epoch from now() - interval '2 days')::float8, 0)) where name = 'matured'")
    emails(db, "matured", 3000, complained=5, first_user=400_000)
    assert reputation.evaluate(db, ["matured"], config=CONFIG, include_account=False) == []
    g = guard(db, "campaign", "matured")
    assert (g["state"], round(g["evidence"])) == ("ok", 2250)


def test_stays_tripped_until_resumed_and_earlier_outcomes_then_no_longer_count(db: psycopg.Connection) -> None:
    emails(db, "welcome", 100, hard=10)
    assert len(reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False)) == 1
    tripped_at = guard(db, "campaign", "welcome")["tripped_at"]

    # the bounces stop (say the provider re-classified them): the scope stays tripped, nothing re-trips
    db.execute("update mail.delivery_status set hard_bounced_at = null, outcome = 'delivered'")
    for _ in range(3):
        assert reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False) == []
    g = guard(db, "campaign", "welcome")
    assert (g["state"], g["tripped_at"], g["sample"]) == ("tripped", tripped_at, 100)
    assert reputation.blocked(db, "welcome").startswith("reputation guard tripped (campaign welcome)")
    db.execute("update mail.delivery_status set hard_bounced_at = now(), outcome = 'hard_bounced'"
               " where send_log_id in (select id from mail.send_log order by id limit 10)")

    with pytest.raises(ValueError, match="person"):
        reputation.resume(db, "campaign", "welcome", " ")
    done = reputation.resume(db, "campaign", "welcome", "alice", "list cleaned")
    assert (done.changed, done.unpaused) == (True, ())
    g = guard(db, "campaign", "welcome")
    assert (g["state"], g["resumed_by"], g["resume_reason"], g["resumed_at"]) == (
        "ok", "alice", "list cleaned", done.resumed_at)
    assert (g["proven"], g["llr_bounce"], g["sample"]) == (False, 0, 0)  # the exposure bound applies again
    assert reputation.resume(db, "campaign", "welcome", "alice", "again").changed is False
    with pytest.raises(LookupError, match="no campaign 'nosuch'"):
        reputation.resume(db, "campaign", "nosuch", "alice", "x")

    # the same 10 % of bounces, all counted before the resume: no immediate re-trip
    assert reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False) == []
    assert (guard(db, "campaign", "welcome")["sample"], reputation.blocked(db, "welcome")) == (0, None)
    # outcomes after the resume count again
    emails(db, "welcome", 100, hard=7, first_user=300_000)
    assert [t.hard_bounces for t in reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False)] == [7]


def test_upgrade_a_campaign_first_seen_is_judged_on_its_history_as_old_deliveries(db: psycopg.Connection) -> None:
    # a campaign sent before the guard knew it (an upgrade): its 12 complaints in 100,000 deliveries (0.012 %)
    # are old news, weighed against deliveries that lived the lag: no trip, and the history proves it
    emails(db, "old_digest", 20_000, complained=12)
    emails(db, "old_digest", 80_000, first_user=1_000_000)
    assert reputation.evaluate(db, ["old_digest"], config=CONFIG, include_account=False) == []
    g = guard(db, "campaign", "old_digest")
    assert (g["state"], g["proven"], g["cum_complaints"], round(g["evidence"])) == ("ok", True, 12, 100_000)


def test_lagged_evidence_weighs_each_delivery_by_the_lag_it_lived() -> None:
    # 100 delivered at t=0, 100 more at t=50; lag 100 s: at t=100 the first weigh 1, the second 0.5
    marks = [[0.0, 0.0], [0.0 + 1e-9, 100.0], [50.0, 100.0], [50.0 + 1e-9, 200.0]]
    assert reputation.lagged_evidence(marks, 100.0, 200.0, 100.0) == pytest.approx(150.0, rel=1e-6)
    assert reputation.lagged_evidence(marks, 1000.0, 200.0, 100.0) == pytest.approx(200.0)
    assert reputation.lagged_evidence([[0.0, 0.0]], 10.0, 100.0, 100.0) == pytest.approx(5.0)  # a ramp over 10 s


def test_defaults_sit_below_the_strictest_published_lines_and_the_environment_overrides() -> None:
    d = GuardConfig()
    # Resend's acceptable-use policy: bounces under 4 %, complaints under 0.08 %: half of each
    assert (d.hard_bounce_rate, d.complaint_rate, d.exposure, d.complaint_lag, d.false_trip, d.miss) == (
        0.02, 0.0004, 10_000, timedelta(hours=24), 0.001, 0.01)
    assert (round(d.upper, 3), round(d.lower, 3)) == (6.898, -4.604)
    assert round(reputation.operating_characteristics(1.0)) == 5
    assert round(reputation.operating_characteristics(0.005, "gross")) == 871
    assert reputation.operating_characteristics(0.002) == math.inf  # a list under a quarter of the line never drifts up
    env = GuardConfig.from_env({"MAILFLOW_GUARD_HARD_BOUNCE_RATE": "0.03", "MAILFLOW_GUARD_COMPLAINT_RATE": "0.0005",
                                "MAILFLOW_GUARD_EXPOSURE": "2000", "MAILFLOW_GUARD_COMPLAINT_LAG_HOURS": "6"})
    assert (env.hard_bounce_rate, env.complaint_rate, env.exposure, env.complaint_lag) == (
        0.03, 0.0005, 2000, timedelta(hours=6))
    with pytest.raises(ValueError, match="MAILFLOW_GUARD_EXPOSURE='lots' is not a number"):
        GuardConfig.from_env({"MAILFLOW_GUARD_EXPOSURE": "lots"})
    with pytest.raises(ValueError, match="complaint_rate must be a fraction"):
        GuardConfig.from_env({"MAILFLOW_GUARD_COMPLAINT_RATE": "0.2"})


def test_thresholds_are_settings_per_provider_account(db: psycopg.Connection) -> None:
    reputation.set_config(db, "ses-eu", "ops", hard_bounce_rate=0.025, complaint_rate=0.0005, exposure=1000)
    got = reputation.config_for(db, "ses-eu", GuardConfig())
    assert (got.hard_bounce_rate, got.complaint_rate, got.exposure) == (0.025, 0.0005, 1000)
    assert reputation.config_for(db, "other", GuardConfig()) == GuardConfig()
    with pytest.raises(ValueError, match="hard_bounce_rate must be a fraction"):
        reputation.set_config(db, "ses-eu", "ops", hard_bounce_rate=4)
    with pytest.raises(ValueError, match="unknown reputation setting"):
        reputation.set_config(db, "ses-eu", "ops", min_sample=5)


def test_exposure_bound_grants_at_most_e_per_round_until_the_rates_are_known(db: psycopg.Connection) -> None:
    # a new scope is not proven: at most E = 250 emails a round; the round starts again when as many
    # outcomes arrived as it sent; once proven, everything is granted
    cfg = dataclasses.replace(CONFIG, exposure=250)
    grants = [reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted for _ in range(4)]
    assert grants == [100, 100, 50, 0]
    g = guard(db, "campaign", "welcome")
    assert (g["round_sent"], g["waiting"], guard(db, "account", ACCOUNT)["round_sent"]) == (250, True, 250)
    waiting = reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg)
    assert waiting.granted == 0 and "exposure E" in (waiting.waiting or "")

    emails(db, "welcome", 200)  # 200 of the round's 250 outcomes: still waiting
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["waiting"] is True
    emails(db, "welcome", 50, first_user=300_000)
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    g = guard(db, "campaign", "welcome")
    assert (g["waiting"], g["round_sent"], g["proven"]) == (False, 0, False)  # 250 deliveries prove nothing yet
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100

    reputation.refund(db, "welcome", 40, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["round_sent"] == 60
    emails(db, "welcome", 1500, first_user=400_000)  # enough clean outcomes to prove both tests
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert (guard(db, "campaign", "welcome")["proven"], guard(db, "account", ACCOUNT)["proven"]) == (True, True)
    assert [reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted for _ in range(30)] == [100] * 30


def test_exposure_round_time_alone_never_opens_a_round(db: psycopg.Connection) -> None:
    # a round whose outcomes never come keeps waiting, however long: a dead feedback channel holds the
    # scope; once 90 % of its outcomes are in, the few lost for good no longer hold it after the outcome wait
    cfg = dataclasses.replace(CONFIG, exposure=100, outcome_wait=timedelta(milliseconds=300))
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100
    assert reputation.waiting_campaigns(db) == ["welcome"]
    time.sleep(0.4)
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["waiting"] is True  # no outcome at all: still waiting
    emails(db, "welcome", 89)
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["waiting"] is True  # 89 of 100: not enough
    emails(db, "welcome", 1, first_user=200_000)
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert (guard(db, "campaign", "welcome")["waiting"], reputation.waiting_campaigns(db)) == (False, [])


def test_the_account_scope_is_read_at_most_once_per_account_every(db: psycopg.Connection) -> None:
    emails(db, "welcome", 100)
    every = GuardConfig()  # the default: once per second
    reputation.evaluate(db, ["welcome"], config=every, account=ACCOUNT)
    emails(db, "welcome", 100, hard=100, first_user=300_000)
    trips = reputation.evaluate(db, ["welcome"], config=every, account=ACCOUNT)
    assert [(t.scope, t.sample) for t in trips] == [("campaign", 200)]  # the account was read < 1 s ago
    assert guard(db, "account", ACCOUNT)["sample"] == 100
    time.sleep(1.1)
    assert [(t.scope, t.sample) for t in reputation.evaluate(db, ["welcome"], config=every, account=ACCOUNT)] == [
        ("account", 200)]


def test_an_account_trip_blocks_every_campaign(rig: Rig) -> None:
    db = rig.db
    cid = provisioned(rig, 10)
    emails(db, "welcome", 60, hard=5)  # 8 %: 5 bounces in 60 is not yet enough evidence on its own
    emails(db, "digest", 60, hard=2, first_user=200_000)  # 3 %

    trips = reputation.evaluate(db, ["welcome", "digest"], config=CONFIG, account=ACCOUNT)

    assert [(t.scope, t.name, t.sample, t.hard_bounces, t.paused) for t in trips] == [
        ("account", ACCOUNT, 120, 7, ("outreach_test",))]
    for name in ("welcome", "digest", "outreach_test", "never_evaluated"):
        assert reputation.blocked(db, name).startswith(f"reputation guard tripped (account {ACCOUNT})")
    assert rig.campaign_row(cid)["status"] == "paused"
    assert rig.dispatch().sent == 0
    # even a person's campaign resume does not send past a tripped account: the claim SQL holds it
    scheduled.resume(db, cid, actor="bob")  # re-plans from now: the first row is due at once
    assert db.execute("select count(*) from mail.send_log where status = 'pending' and scheduled_at <= now()"
                      ).fetchone() == (1,)
    assert rig.dispatch().sent == 0
    assert db.execute("select count(*) from mail.send_log where campaign = 'outreach_test' and status = 'pending'"
                      ).fetchone() == (10,)

    out = resume_reputation(db, "account", ACCOUNT, actor="alice", reason="bounced list removed")
    assert (out["changed"], out["unpaused"]) == (True, [])  # bob had resumed it already
    db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where status = 'pending'")
    assert rig.dispatch().sent == 10


def test_a_tripped_scheduled_campaign_is_paused_and_not_dispatched_until_resumed(rig: Rig) -> None:
    db = rig.db
    cid = provisioned(rig, 10)
    emails(db, "outreach_test", 100, hard=7, kind="scheduled")  # earlier sends of the same campaign: 7 % trips

    [trip] = reputation.evaluate(db, ["outreach_test"], config=CONFIG, include_account=False)

    assert trip.paused == ("outreach_test",)
    assert rig.campaign_row(cid)["status"] == "paused"
    [(actor, detail)] = db.execute("select actor, detail from mail.campaign_event where campaign_id = %s"
                                   " and to_status = 'paused'", (cid,)).fetchall()
    assert actor == "reputation_guard"
    assert (detail["hard_bounce_rate"], detail["complaint_rate"], detail["sample"], detail["hard_bounces"]) == (
        "0.070000", "0.000000", 100, 7)
    assert detail["reason"].startswith("reputation guard tripped (campaign outreach_test): hard bounces 7% (7 of 100")
    assert scheduled.status(db, cid)["paused_reason"] == detail["reason"]

    s = rig.dispatch()
    assert (s.sent, s.claimed) == (0, 0)
    assert len(rig.emulator.read_outbox()) == 0

    # a campaign someone else paused stays paused on resume; the guard's own pause is lifted
    out = resume_reputation(db, "campaign", "outreach_test", actor="alice", reason="bad segment removed")
    assert (out["changed"], out["unpaused"]) == (True, ["outreach_test"])
    assert rig.campaign_row(cid)["status"] == "scheduled"
    [(actor,)] = db.execute("select actor from mail.campaign_event where campaign_id = %s and to_status = 'scheduled'"
                            " and from_status = 'paused'", (cid,)).fetchall()
    assert actor == "alice"
    # resumed as a person's resume does: the 10 overdue rows re-planned from now (no burst)
    assert db.execute("select count(*) from mail.send_log where status = 'pending' and scheduled_at > now() - "
                      "interval '1 minute'").fetchone() == (10,)
    db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where status = 'pending'")
    assert rig.dispatch().sent == 10


def test_resume_leaves_a_campaign_paused_by_a_person_paused(rig: Rig) -> None:
    cid = provisioned(rig, 3)
    scheduled.pause(rig.db, cid, actor="carol")
    emails(rig.db, "outreach_test", 100, hard=9, kind="scheduled")
    [trip] = reputation.evaluate(rig.db, ["outreach_test"], config=CONFIG, include_account=False)
    assert trip.paused == ()  # already paused: no second pause event

    out = resume_reputation(rig.db, "campaign", "outreach_test", actor="alice", reason="ok")
    assert out["unpaused"] == [] and rig.campaign_row(cid)["status"] == "paused"


def test_the_lifecycle_source_skips_a_tripped_campaign_with_the_reason(rig: Rig) -> None:
    rig.users(5, start=1, plan="pro")
    emails(rig.db, "welcome", 100, hard=7)
    reputation.evaluate(rig.db, ["welcome"], config=CONFIG, include_account=False)
    from lifecycle_rig import FAST_RETRY  # noqa: F401  (the same retry policy as the scheduled rig)

    summaries = run_lifecycle(PostgresStore(rig.conn()), rig.client(), rig.renderer(),
                              [simple_campaign("welcome", 1, "user_id <= 5"), simple_campaign("other", 2, "user_id <= 5")],
                              INTERVAL, run=LIFECYCLE_RUN, chunk_size=10, budget_seconds=20)

    welcome, other = summaries
    assert (welcome.eligible, welcome.minted, welcome.sent) == (0, 0, 0)
    assert welcome.stopped.startswith("reputation guard tripped (campaign welcome)")
    assert "hard bounces 7% (7 of 100 emails with an outcome)" in welcome.stopped
    assert (other.sent, other.stopped) == (5, None)
    assert rig.db.execute("select count(*) from mail.send_log where campaign = 'welcome' and sent_at > now()"
                          " - interval '1 minute' and user_id <= 5").fetchone() == (0,)


def test_two_evaluators_at_once_trip_once_and_pause_once(rig: Rig) -> None:
    cid = provisioned(rig, 3)
    emails(rig.db, "outreach_test", 100, hard=20, kind="scheduled")
    a, b = rig.conn(), rig.conn()
    a.autocommit = b.autocommit = True
    got_b: list[Any] = []
    with a.transaction():  # A trips and holds the row lock until it commits
        got_a = reputation.evaluate(a, ["outreach_test"], config=CONFIG, include_account=False)
        t = threading.Thread(target=lambda: got_b.append(
            reputation.evaluate(b, ["outreach_test"], config=CONFIG, include_account=False)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # B read ok and waits on A's row lock
    t.join(10)

    assert [x.name for x in got_a] == ["outreach_test"] and got_b == [[]]
    assert rig.db.execute("select count(*) from mail.campaign_event where campaign_id = %s and to_status = 'paused'",
                          (cid,)).fetchone() == (1,)
    assert rig.db.execute("select count(*) from mail.reputation_guard").fetchone() == (1,)


def test_a_trip_is_alerted_once_with_the_rates_and_the_sample(db: psycopg.Connection,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    emails(db, "welcome", 100, hard=10, complained=1)
    reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False)

    with caplog.at_level("ERROR", logger="mailflow.alerts"):
        lines = reputation_alerts(db)
    assert lines == ["campaign welcome: hard bounces 10% of 100 emails with an outcome, complaints 1.111% of 90 "
                     "delivered; hard bounces 10% (10 of 100 emails with an outcome) against the 2% line: the "
                     "sequential test crossed its trip line (log-likelihood ratio >= 6.90; false-trip probability "
                     "<= 0.001); resume: mailflow reputation resume --campaign welcome --reason ..."]
    assert "reputation guard: 1 scope(s) tripped" in caplog.text and lines[0] in caplog.text
    assert reputation_alerts(db) == []
    assert guard(db, "campaign", "welcome")["alerted_at"] is not None


def test_the_cli_shows_and_resumes(db: psycopg.Connection, db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    emails(db, "welcome", 100, hard=50)
    reputation.evaluate(db, ["welcome"], config=CONFIG, include_account=False)

    assert mailflow_cli(["reputation", "status", "--dsn", db_dsn]) == 0
    out = capsys.readouterr().out
    assert "tripped" in out and "campaign welcome tripped: hard bounces 50% (50 of 100 emails with an outcome)" in out
    assert mailflow_cli(["reputation", "resume", "--campaign", "welcome", "--by", "dave", "--dsn", db_dsn]) == 2
    assert "--reason" in capsys.readouterr().err
    assert mailflow_cli(["reputation", "resume", "--campaign", "nosuch", "--by", "dave", "--reason", "x",
                         "--dsn", db_dsn]) == 1
    assert "no campaign 'nosuch'" in capsys.readouterr().err
    assert mailflow_cli(["reputation", "resume", "--campaign", "welcome", "--by", "dave", "--reason", "list fixed",
                         "--dsn", db_dsn]) == 0
    assert "resumed campaign welcome" in capsys.readouterr().out
    g = guard(db, "campaign", "welcome")
    assert (g["state"], g["resumed_by"], g["resume_reason"]) == ("ok", "dave", "list fixed")

    # an account's settings: set, refused with the reason, back to the default
    assert mailflow_cli(["reputation", "set", "--account", "acct-1", "--exposure", "2000", "--by", "ana",
                         "--dsn", db_dsn]) == 0
    assert "account acct-1: lines 0.02 hard bounces, 0.0004 complaints; E 2000" in capsys.readouterr().out
    assert mailflow_cli(["reputation", "set", "--account", "acct-1", "--hard-bounce-rate", "4", "--by", "ana",
                         "--dsn", db_dsn]) == 2
    assert "hard_bounce_rate must be a fraction" in capsys.readouterr().err
    assert mailflow_cli(["reputation", "set", "--account", "acct-1", "--complaint-rate", "0.0005", "--by", "ana",
                         "--dsn", db_dsn]) == 0
    assert "0.0005 complaints; E 2000" in capsys.readouterr().out  # the other settings are kept
    assert mailflow_cli(["reputation", "set", "--account", "acct-1", "--exposure", "default", "--by", "ana",
                         "--dsn", db_dsn]) == 0
    assert "E 10000" in capsys.readouterr().out
    assert db.execute("select updated_by from mail.reputation_setting").fetchone() == ("ana",)


# -- the canary of a scheduled campaign --------------------------------------------------------------


def _outcomes(db: psycopg.Connection, where: str, outcome: str = "delivered") -> None:
    col = {"delivered": "delivered_at", "hard_bounced": "hard_bounced_at"}[outcome]
    db.execute(f"insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome,"
               f" outcome_at, {col}) select id, provider_message_id, %s, 0, %s, now(), now()"
               f" from mail.send_log where status = 'sent' and {where}", (outcome, outcome))


def test_canary_only_the_canary_share_is_dispatched_until_its_outcomes_arrive(rig: Rig) -> None:
    cid = provisioned(rig, 20, canary_share=0.1)  # the first 2 rows
    c = rig.campaign_row(cid)
    first_two = [r["id"] for r in rig.rows()][:2]
    assert (c["canary_share"], c["canary_last_id"], c["canary_released_at"]) == (Decimal("0.1"), first_two[-1], None)

    s = rig.dispatch()
    assert (s.sent, s.canaries_released) == (2, [])
    assert [r["id"] for r in rig.rows("status = 'sent'")] == first_two
    assert rig.dispatch().sent == 0  # no outcome yet: the rest is held
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending'").fetchone() == (18,)

    _outcomes(rig.db, f"id = {first_two[0]}")  # 1 of 2 < 90 %: still held
    assert rig.dispatch().sent == 0
    _outcomes(rig.db, f"id = {first_two[1]}")
    s = rig.dispatch()
    assert s.canaries_released == ["outreach_test"]
    assert rig.campaign_row(cid)["canary_released_at"] is not None
    [(detail,)] = rig.db.execute("select detail from mail.campaign_event where detail->>'reason' = 'canary released'"
                                 ).fetchall()
    assert (detail["canary_sent"], detail["canary_with_outcome"], detail["rule"]) == (2, 2, "outcomes")
    # the rest waited behind the canary: re-planned from the release, not sent at once (the re-plan is pinned by
    # test_canary_release_respects_emails_per_day); once due it all goes
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending' and scheduled_at >= "
                          "(select canary_released_at from mail.campaign)").fetchone() == (18 - s.sent,)
    rig.db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where status = 'pending'")
    assert s.sent + rig.dispatch().sent == 18


def test_canary_is_released_after_the_maximum_wait_without_outcomes(rig: Rig) -> None:
    cid = provisioned(rig, 10, canary_share=0.3, canary_max_wait_minutes=0.01)  # 0.6 s
    assert rig.dispatch().sent == 3
    time.sleep(1.0)
    s = rig.dispatch()
    assert s.canaries_released == ["outreach_test"]
    assert rig.campaign_row(cid)["canary_released_at"] is not None
    [(detail,)] = rig.db.execute("select detail from mail.campaign_event where detail->>'reason' = 'canary released'"
                                 ).fetchall()
    assert (detail["canary_sent"], detail["canary_with_outcome"], detail["rule"]) == (3, 0, "maximum wait")
    rig.db.execute("update mail.send_log set scheduled_at = now() - interval '1 minute' where status = 'pending'")
    assert s.sent + rig.dispatch().sent == 7


def test_a_canary_that_bounces_trips_the_guard_and_the_rest_is_never_sent(rig: Rig,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    cid = provisioned(rig, 50, canary_share=0.1)
    assert rig.dispatch().sent == 5
    _outcomes(rig.db, "true", "hard_bounced")

    s = rig.dispatch()

    assert (s.sent, s.canaries_released) == (0, [])
    c = rig.campaign_row(cid)
    assert (c["status"], c["canary_released_at"]) == ("paused", None)
    assert guard(rig.db, "campaign", "outreach_test")["state"] == "tripped"
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending'").fetchone() == (45,)


def test_canary_fields_are_validated_by_name(rig: Rig) -> None:
    for bad, field, message in (({"canary_share": 1.5}, "canary_share", "less than 1"),
                                ({"canary_share": "x"}, "canary_share", "valid number"),
                                ({"canary_max_wait_minutes": 5}, "canary_max_wait_minutes", "needs a canary_share"),
                                ({"canary_share": 0.05, "canary_min_outcome_share": 0}, "canary_min_outcome_share",
                                 "greater than 0"),
                                ({"canary_share": 0.05, "canary_max_wait_minutes": -1}, "canary_max_wait_minutes",
                                 "greater than 0")):
        with pytest.raises(CampaignDefinitionError, match=message) as info:
            rig.campaign("bad_canary", **bad)
        assert info.value.fields == [field]
    assert RUN.dag_id == "dispatch_scheduled_emails"


def test_a_person_who_pauses_a_guard_paused_campaign_keeps_it_paused_through_a_resume(rig: Rig) -> None:
    cid = provisioned(rig, 3)
    emails(rig.db, "outreach_test", 100, hard=9, kind="scheduled")
    [trip] = reputation.evaluate(rig.db, ["outreach_test"], config=CONFIG, include_account=False)
    assert trip.paused == ("outreach_test",)
    # a person decides it stays paused (the list is being cleaned), while the guard's pause holds it
    out = scheduled.pause(rig.db, cid, actor="carol")
    assert (out["status"], out["changed"]) == ("paused", False)

    out = resume_reputation(rig.db, "campaign", "outreach_test", actor="alice", reason="rates checked")
    assert (out["changed"], out["unpaused"]) == (True, [])
    assert rig.campaign_row(cid)["status"] == "paused"
    assert rig.dispatch().sent == 0


# -- the exposure bound on the sending paths -----------------------------------------------------------


def test_exposure_bound_a_lifecycle_run_sends_at_most_e_before_any_outcome(rig: Rig,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # no outcome arrives (every webhook late): the run mints and sends exactly E, then waits for feedback
    # until its budget ends; once the outcomes are in, the next run goes on
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "120")
    rig.users(300, start=1, plan="pro")
    campaign = simple_campaign("welcome", 1, "user_id <= 300")

    def run() -> Any:
        [summary] = run_lifecycle(PostgresStore(rig.conn()), rig.client(), rig.renderer(), [campaign], INTERVAL,
                                  run=LIFECYCLE_RUN, chunk_size=50, budget_seconds=3)
        return summary

    first = run()
    assert (first.minted, first.sent) == (120, 120)
    assert first.stopped.startswith("time budget while waiting for outcomes: account ")
    assert "is not proven yet: 120 of its emails await their outcomes (exposure E)" in first.stopped
    assert len(rig.emulator.read_outbox()) == 120
    g = guard(rig.db, "campaign", "welcome")
    assert (g["round_sent"], g["waiting"]) == (120, True)

    _outcomes(rig.db, "campaign = 'welcome'")  # the 120 delivered
    second = run()
    assert (second.sent, len(rig.emulator.read_outbox())) == (120, 240)


def test_exposure_bound_the_dispatcher_claims_at_most_e_before_any_outcome(rig: Rig,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "100")
    cid = provisioned(rig, 300)

    assert rig.dispatch(batch_size=40).sent == 100  # 40 + 40 + 20: the round is spent
    assert rig.dispatch().sent == 0  # the claim statements skip a waiting campaign: no spin, nothing sent
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending'").fetchone() == (200,)
    assert guard(rig.db, "campaign", "outreach_test")["waiting"] is True

    _outcomes(rig.db, "campaign = 'outreach_test'")  # the round's outcomes arrive: the next run evaluates it
    assert rig.dispatch().sent == 100
    assert len(rig.emulator.read_outbox()) == 200
    assert rig.campaign_row(cid)["status"] == "scheduled"


def test_exposure_concurrent_senders_share_one_round_and_never_deadlock(db: psycopg.Connection, db_dsn: str) -> None:
    # four senders admit and give back at once (as four lifecycle processes do): the round counts every
    # grant once, never exceeds E, and no lock order makes two of them wait on each other
    cfg = dataclasses.replace(CONFIG, exposure=3000)
    granted: list[int] = []
    errors: list[BaseException] = []

    def sender() -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as conn:
                for _ in range(25):
                    got = reputation.admit(conn, "welcome", 100, account=ACCOUNT, config=cfg).granted
                    reputation.refund(conn, "welcome", got // 2, account=ACCOUNT)
                    granted.append(got - got // 2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=sender) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    kept = guard(db, "campaign", "welcome")["round_sent"]
    assert sum(granted) == kept == guard(db, "account", ACCOUNT)["round_sent"]  # every grant counted once
    assert 2900 <= kept <= 3000  # 4 x 25 x 50 = 5,000 asked for: the round is full, never over E
