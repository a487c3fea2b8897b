"""The reputation guard under the faults its own tests did not cover: refused asks that keep a round alive
forever, an account scope named differently by the senders and the webhook receiver, history counted as
fresh deliveries, a resume that forgets the complaint lag, grants of emails that were never sent, a waiting
account nobody re-evaluates, a counter seed in the middle of a round, bad operator input. Outcomes are
written straight into mail.delivery_status (the webhook applier's job), as in test_reputation."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
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
from test_reputation import ACCOUNT, CONFIG, _outcomes, emails, guard

from mailflow.cli import main as mailflow_cli
from mailflow.feedback.webhook_ingest import guard_reputation
from mailflow.model.outcome import SendError
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.sources.scheduled import claiming
from mailflow.store import reputation
from mailflow.store.migrate import migrate
from mailflow.store.send_log import PostgresStore
from mailflow_dev import devenv


@pytest.fixture
def db(db: psycopg.Connection) -> psycopg.Connection:  # type: ignore[override]
    db.execute("truncate mail.reputation_guard, mail.campaign_event, mail.campaign_recipient, mail.campaign"
               " restart identity cascade")
    return db


# -- rounds ------------------------------------------------------------------------------------------


def test_outcome_wait_is_not_reset_by_asks_the_guard_refused(db: psycopg.Connection) -> None:
    # a waiting lifecycle run asks the guard every second and is granted nothing; those refusals are not
    # grants: the round whose outcomes never come must still end after the outcome wait
    cfg = dataclasses.replace(CONFIG, exposure=100, outcome_wait=timedelta(milliseconds=600))
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100
    emails(db, "welcome", 95)  # 5 of the round's outcomes are lost for good
    granted = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # what lifecycle._admitted does, ten times faster
        got = reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted
        granted.append(got)
        if got:
            break
        time.sleep(0.1)
        reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert granted[-1] == 100, f"still waiting after 2 s with a 0.6 s outcome wait: {len(granted)} refusals"
    assert 4 <= len(granted) <= 9  # about 0.6 s of refusals, then a new round


def test_a_round_whose_outcomes_never_came_waits_and_says_so(db: psycopg.Connection,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    # time alone never opens a round; with no outcome at all the feedback channel is likely down: the
    # operator must hear of it (once a minute per scope, not at every evaluation)
    cfg = dataclasses.replace(CONFIG, exposure=100, outcome_wait=timedelta(milliseconds=300))
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100
    time.sleep(0.4)
    with caplog.at_level("WARNING", logger="mailflow.store.reputation"):
        for _ in range(3):
            reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    line = ("reputation guard (campaign welcome): 100 of its round's 100 emails still have no outcome after the "
            "outcome wait (0:00:00.300000); the round waits for them (it needs 90% of them): no outcome arrived at "
            "all; are the webhooks and the deliverability poll running?")
    assert caplog.text.count(line) == 1
    assert guard(db, "campaign", "welcome")["waiting"] is True


def test_dispatcher_re_evaluates_a_waiting_account_scope(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # the campaign is proven but the account (resumed, say) is not: the account's round is spent and its
    # outcomes never come. The claim statements skip every campaign while an account waits, so only an
    # evaluation can start its next round: the dispatcher must make it, as it does for waiting campaigns
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "100")
    monkeypatch.setenv("MAILFLOW_GUARD_OUTCOME_WAIT_MINUTES", "0.01")  # 0.6 s
    provisioned(rig, 150)
    account = rig.emulator.base_url
    rig.db.execute("insert into mail.reputation_guard (scope, name, proven, seen) values ('campaign', 'outreach_test',"
                   " true, '{}'::jsonb), ('account', %s, false, '{}'::jsonb)", (account,))

    assert rig.dispatch(batch_size=50).sent == 100
    assert guard(rig.db, "account", account)["waiting"] is True
    rig.db.execute("insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome,"
                   " outcome_at, delivered_at) select id, provider_message_id, 'delivered', 0, 'delivered', now(), now()"
                   " from mail.send_log where status = 'sent' order by id limit 95")  # 5 lost for good
    time.sleep(1.0)

    assert rig.dispatch(batch_size=50).sent == 50  # the outcome wait passed: a new round
    assert guard(rig.db, "account", account)["round_sent"] == 50



def test_dispatcher_re_evaluates_a_waiting_account_scope_of_another_name(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # the lifecycle workers name the account otherwise (MAILFLOW_GUARD_ACCOUNT set only there) and their
    # round waits for outcomes that never come: that scope holds the claim statements too, so the
    # dispatcher must re-evaluate it as well
    monkeypatch.setenv("MAILFLOW_GUARD_OUTCOME_WAIT_MINUTES", "0.01")  # 0.6 s
    provisioned(rig, 20)
    rig.db.execute("insert into mail.reputation_guard (scope, name, proven, seen) values ('campaign', 'outreach_test',"
                   " true, '{}'::jsonb), ('account', %s, true, '{}'::jsonb)", (rig.emulator.base_url,))
    rig.db.execute("insert into mail.reputation_guard (scope, name, seen, round_sent, round_outcomes, waiting,"
                   " last_grant_at) values ('account', 'lifecycle-workers', '{}'::jsonb, 100, 0, true,"
                   " now() - interval '1 second')")
    emails(rig.db, "lifecycle_sends", 95)  # the workers' round: 95 of its 100 outcomes came, 5 never will

    assert rig.dispatch(batch_size=50).sent == 20
    assert guard(rig.db, "account", "lifecycle-workers")["waiting"] is False


def test_a_counter_seed_does_not_start_a_new_round(db: psycopg.Connection) -> None:
    # an installation upgraded with a live send log: the counters hold only the changes since migration 0028
    # until the first fold seeds them with a full count. A round that started before the seed must not
    # read the history the seed adds as its outcomes
    emails(db, "welcome", 1000)
    db.execute("select mail.fold_campaign_counters()")
    db.execute("update mail.campaign_counter_state set seeded_at = null")
    db.execute("delete from mail.campaign_counter")  # as before the seed: only the deltas are known
    cfg = dataclasses.replace(CONFIG, exposure=100)
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    emails(db, "welcome", 30, first_user=500_000)  # 30 of the round's 100 outcomes
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["waiting"] is True

    db.execute("select mail.fold_campaign_counters()")  # the seed: 1,030 outcomes now known
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)

    g = guard(db, "campaign", "welcome")
    assert (g["waiting"], g["round_sent"]) == (True, 100)
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 0
    emails(db, "welcome", 70, first_user=600_000)  # the round's last 70 outcomes: now it is over
    reputation.evaluate(db, ["welcome"], config=cfg, account=ACCOUNT)
    assert guard(db, "campaign", "welcome")["waiting"] is False


def test_a_waiting_lifecycle_run_applies_its_chunk_in_flight_first(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # pipelined without a second connection, the last chunk of a round is answered but applied only when it
    # is collected: while the run waits for the round's outcomes, that chunk's rows stay 'sending' and its
    # outcomes cannot be matched (the receiver keeps them pending), so the round waited for itself until the
    # budget. A webhook receiver stands in: it records an outcome for every email that is 'sent'.
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "120")
    rig.users(400, start=1, plan="pro")
    campaign = simple_campaign("welcome", 1, "user_id <= 400")
    stop = threading.Event()

    def receiver() -> None:
        with psycopg.connect(rig.dsn, autocommit=True) as conn:
            while not stop.is_set():
                _outcomes(conn, "campaign = 'welcome' and id not in (select send_log_id from mail.delivery_status)")
                guard_reputation(conn, ["welcome"])
                time.sleep(0.2)

    t = threading.Thread(target=receiver)
    t.start()
    try:
        [summary] = run_lifecycle(PostgresStore(rig.conn()), rig.client(), rig.renderer(), [campaign], INTERVAL,
                                  run=LIFECYCLE_RUN, chunk_size=50, budget_seconds=8, pipelined=True)
    finally:
        stop.set()
        t.join(10)
    assert summary.sent == 400, summary.stopped
    assert summary.waited < 8


# -- concurrent senders ------------------------------------------------------------------------------------


def test_claims_of_an_unproven_scope_count_every_grant_without_holding_the_guard(rig: Rig,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # two dispatchers claim for a campaign whose rates are not known: the first claim's grant is committed at
    # once on the guard's own connection (its claim, still open, holds no guard row), and the second gets what
    # is left of the round, never more
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "6")
    provisioned(rig, 10)
    rig.db.execute("insert into mail.reputation_guard (scope, name, seen) values"
                   " ('account', 'default', '{}'::jsonb), ('campaign', 'outreach_test', '{}'::jsonb)")
    a, b = rig.conn(), rig.conn()
    b.execute("set lock_timeout = '1s'")
    b.commit()
    renderer = rig.renderer()
    da = claiming.Dispatcher(a, renderer, RUN, batch_size=4)
    db_ = claiming.Dispatcher(b, renderer, RUN, batch_size=4)
    with a.transaction():
        _, ca = da.claim()
        assert guard(rig.db, "campaign", "outreach_test")["round_sent"] == 4  # committed while A's claim is open
        with rig.conn() as probe:  # nobody holds the guard's rows
            probe.execute("set lock_timeout = '1s'")
            assert len(probe.execute("select 1 from mail.reputation_guard for update nowait").fetchall()) == 2
    _, cb = db_.claim()
    b.commit()
    assert ca is not None and cb is not None
    assert (len(ca.rows), len(cb.rows)) == (4, 2)
    assert {r.id for r in ca.rows} & {r.id for r in cb.rows} == set()
    assert guard(rig.db, "campaign", "outreach_test")["round_sent"] == 6


def test_a_trip_waits_for_a_claim_that_holds_a_proven_scope(rig: Rig) -> None:
    # claims of proven scopes do not wait on each other, but a trip does wait for a claim in progress (and
    # the next claim for the trip): no claim sends past a trip it could have seen
    provisioned(rig, 8)
    zero = '{"sent": 0, "with_outcome": 0, "hard": 0, "complaints": 0, "delivered": 0, "seeded": true}'
    rig.db.execute("insert into mail.reputation_guard (scope, name, proven, seen) values"
                   " ('account', 'default', true, %s::jsonb), ('campaign', 'outreach_test', true, %s::jsonb)",
                   (zero, zero))
    emails(rig.db, "outreach_test", 100, hard=30, kind="scheduled")
    a, e = rig.conn(), rig.conn()
    e.autocommit = True
    da = claiming.Dispatcher(a, rig.renderer(), RUN, batch_size=4)
    trips: list[Any] = []
    with a.transaction():
        _, ca = da.claim()
        assert ca is not None and len(ca.rows) == 4
        t = threading.Thread(target=lambda: trips.append(
            reputation.evaluate(e, ["outreach_test"], config=CONFIG, account="default")))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()  # the trip waits for the claim holding the scope
    t.join(10)
    a.commit()
    assert sorted(x.scope for x in trips[0]) == ["account", "campaign"]
    _, after = da.claim()
    a.commit()
    assert after is None  # tripped: nothing more is picked


# -- the account scope's name ----------------------------------------------------------------------------


def test_admit_refuses_while_an_account_scope_of_another_name_is_tripped(db: psycopg.Connection) -> None:
    # the webhook receiver named the account differently (no pacer in its process, or MAILFLOW_GUARD_ACCOUNT
    # set only there) and tripped it: the claim statements and blocked() stop every campaign; admit too
    emails(db, "welcome", 100, hard=50)
    [trip] = reputation.evaluate(db, [], config=CONFIG, account="default")
    assert (trip.scope, trip.name) == ("account", "default")
    assert reputation.blocked(db, "welcome").startswith("reputation guard tripped (account default)")

    got = reputation.admit(db, "welcome", 100, account=ACCOUNT, config=CONFIG)

    assert got.granted == 0
    assert (got.reason or "").startswith("reputation guard tripped (account default)")
    assert db.execute("select round_sent from mail.reputation_guard where scope = 'account' and name = %s",
                      (ACCOUNT,)).fetchall() in ([], [(0,)])


def test_the_webhook_receiver_names_the_account_as_its_senders_do(db: psycopg.Connection) -> None:
    # a sender without a pacer row in this database (its pacer elsewhere, or none) names the account by its
    # client; the receiver has no provider: it must evaluate the account scope the senders admit against,
    # or that scope's rounds and its proof are never updated by the outcomes
    cfg = dataclasses.replace(CONFIG, exposure=100)
    assert db.execute("select count(*) from mail.rate_slot").fetchone() == (0,)
    assert reputation.admit(db, "welcome", 100, account=ACCOUNT, config=cfg).granted == 100
    assert reputation.guard_account(db) == ACCOUNT
    emails(db, "welcome", 100)

    guard_reputation(db, ["welcome"])  # the receiver, after applying the 100 outcomes

    assert db.execute("select scope, name from mail.reputation_guard order by scope, name").fetchall() == [
        ("account", ACCOUNT), ("campaign", "welcome")]
    assert (guard(db, "account", ACCOUNT)["sample"], guard(db, "account", ACCOUNT)["waiting"]) == (100, False)


# -- the complaint lag ------------------------------------------------------------------------------------


def test_a_scope_first_seen_by_a_sender_counts_its_history_as_old_deliveries(db: psycopg.Connection) -> None:
    # a send log with a healthy history (12 complaints in 100,000 deliveries, 0.012 %) gets a new account
    # scope name (a new pacer account, MAILFLOW_GUARD_ACCOUNT set): the first sender creates the scope. The
    # history lived the complaint lag; weighed as fresh deliveries it would trip the account at once and
    # pause every campaign
    emails(db, "old_digest", 20_000, complained=12)
    emails(db, "old_digest", 80_000, first_user=1_000_000)
    assert reputation.admit(db, "old_digest", 100, account=ACCOUNT, config=CONFIG).granted == 100

    assert reputation.evaluate(db, ["old_digest"], config=CONFIG, account=ACCOUNT) == []

    for scope, name in (("account", ACCOUNT), ("campaign", "old_digest")):
        g = guard(db, scope, name)
        assert (g["state"], g["cum_complaints"], g["cum_delivered"]) == ("ok", 12, 100_000)
        assert round(g["evidence"]) == 100_000
    assert guard(db, "campaign", "old_digest")["proven"] is True


def test_after_a_resume_fresh_deliveries_are_not_evidence_of_no_complaint(db: psycopg.Connection) -> None:
    # after a resume the complaint test starts again; what is delivered from then on is as fresh as a new
    # campaign's: 5 complaints among 3,000 emails delivered a moment ago trip it (as for a new scope)
    emails(db, "digest", 100, hard=10)
    assert len(reputation.evaluate(db, ["digest"], config=CONFIG, include_account=False)) == 1
    reputation.resume(db, "campaign", "digest", "alice", "list cleaned")
    emails(db, "digest", 3000, complained=5, first_user=300_000)

    [trip] = reputation.evaluate(db, ["digest"], config=CONFIG, include_account=False)

    assert "(5 of 3000 delivered, 0 weighed by the 1 day, 0:00:00 complaint lag) against the 0.04% line" in trip.reason


# -- grants of emails that were never sent ----------------------------------------------------------------


def test_grants_of_emails_the_provider_did_not_take_are_given_back_dispatcher(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    # a batch answered 429 (proven not processed) goes back to pending: its grants were not sent and will
    # never have outcomes. Kept in the round they shrink what it sends, then hold the campaign for the
    # outcome wait waiting for outcomes of emails that do not exist
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "100")
    provisioned(rig, 300)
    rig.emulator.configure(quota_emails=0)
    with pytest.raises(SendError, match="daily_quota_exceeded"):
        rig.dispatch(batch_size=40)
    assert rig.db.execute("select count(*) from mail.send_log where status = 'pending'").fetchone() == (300,)
    assert guard(rig.db, "campaign", "outreach_test")["round_sent"] == 0
    rig.emulator.configure(quota_emails=1_000_000)

    assert rig.dispatch(batch_size=40).sent == 100  # a whole round
    _outcomes(rig.db, "campaign = 'outreach_test'")
    assert rig.dispatch(batch_size=40).sent == 100  # its outcomes are in: the next round


def test_grants_of_emails_the_provider_did_not_take_are_given_back_lifecycle(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILFLOW_GUARD_EXPOSURE", "120")
    rig.users(300, start=1, plan="pro")
    campaign = simple_campaign("welcome", 1, "user_id <= 300")

    def run() -> Any:
        [summary] = run_lifecycle(PostgresStore(rig.conn()), rig.client(), rig.renderer(), [campaign], INTERVAL,
                                  run=LIFECYCLE_RUN, chunk_size=50, budget_seconds=3)
        return summary

    rig.emulator.configure(quota_emails=0)
    with pytest.raises(SendError, match="daily_quota_exceeded"):
        run()
    assert guard(rig.db, "campaign", "welcome")["round_sent"] == 0
    rig.emulator.configure(quota_emails=1_000_000)

    first = run()
    assert (first.sent, guard(rig.db, "campaign", "welcome")["round_sent"]) == (120, 120)
    _outcomes(rig.db, "campaign = 'welcome'")
    assert run().sent == 120


# -- the upgrade ------------------------------------------------------------------------------------------


@pytest.fixture
def fresh(pg_admin_dsn: str) -> Iterator[str]:
    """An empty database (no schema mail), dropped afterwards."""
    name = f"mailflow_guard_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    yield dsn
    devenv.drop_database(pg_admin_dsn, name)


def test_0033_proves_only_scopes_whose_window_held_what_the_gross_test_needs(fresh: str) -> None:
    # a scope proven by the upgrade has no exposure bound; the new tests prove one after ~300 clean outcomes
    # (bounces) AND ~1,280 clean deliveries (gross complaints): a window of 600 outcomes is not that evidence
    with psycopg.connect(fresh, autocommit=True) as conn:
        migrate(conn, target=32)
        conn.execute("insert into mail.reputation_guard (scope, name, state, hard_bounce_rate, complaint_rate, sample)"
                     " values ('campaign', 'small', 'ok', 0.005, 0, 600), ('campaign', 'large', 'ok', 0.005, 0, 1500),"
                     " ('campaign', 'bouncy', 'ok', 0.03, 0, 4000)")
        migrate(conn)
        proven = dict(conn.execute("select name, proven from mail.reputation_guard").fetchall())
    assert proven == {"small": False, "large": True, "bouncy": False}


# -- operator input -------------------------------------------------------------------------------------


def test_reputation_set_refuses_an_exposure_the_settings_table_refuses_with_the_reason(
        db: psycopg.Connection, db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert mailflow_cli(["reputation", "set", "--account", "acct-1", "--exposure", "50", "--by", "ana",
                         "--dsn", db_dsn]) == 2
    err = capsys.readouterr().err
    assert "exposure must be at least 100 emails" in err and "50" in err
    assert db.execute("select count(*) from mail.reputation_setting").fetchone() == (0,)
