"""The outcome model against the provider's real failure modes (issue 12), end to end: real
PostgreSQL, the real renderer and client, the emulator over HTTP. One test per fault that was seen;
each failed before issue 12. The outbox (what the emulator processed) is the witness.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from datetime import timedelta
from functools import partial

import httpx
import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET
from lifecycle_rig import INTERVAL, RUN, Rig, add_user, rig, simple_campaign  # noqa: F401

from mailflow.emulator.testing import free_port
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import RunContext, SendError
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.reconciler import reconcile
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.migrate import migrate
from mailflow.store.send_log import PostgresStore
from mailflow_dev import devenv
from mailflow_dev.demo.loader import schema_sql

ONE_SHOT = RetryPolicy(max_attempts=1)  # the sender's retries are spent at once: the rows go to the reconciler
REPAIR = RunContext(dag_id="reconcile_send_log", run_id="r1", task_id="reconcile")


def repair(rig: Rig, **kw):
    now = rig.db.execute("select now()").fetchone()[0]  # type: ignore[index]
    return reconcile(rig.store().conn, kw.pop("client", None) or rig.client(), now=now, run=REPAIR, **kw)


def age_claims(rig: Rig, minutes: int = 16) -> None:
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - make_interval(mins => %s)", (minutes,))


def deliveries_per_user(rig: Rig) -> Counter[str]:
    return Counter(e["to"][0] for e in rig.outbox())


def failed_run(rig: Rig, campaigns: list, **kw) -> list:
    """A run the provider's failure stopped: it fails (SendError, an alert), after recording everything."""
    with pytest.raises(SendError, match="provider down") as failed:
        rig.run(campaigns, **kw)
    return failed.value.summaries


def users(rig: Rig, n: int) -> None:
    for uid in range(1, n + 1):
        add_user(rig.db, uid)


# -- 5xx ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("status", [500, 502, 504])
def test_5xx_after_processing_is_never_released(rig: Rig, status: int) -> None:
    users(rig, 3)
    c = simple_campaign("a", 1)
    rig.emulator.configure(error_after_rate=1.0, error_after_status=status)
    [s] = failed_run(rig, [c], client=rig.client(policy=ONE_SHOT))
    assert (s.minted, s.sent, s.released, s.unknown) == (3, 0, 0, 3)
    rows = rig.rows()
    [key] = {r["idempotency_key"] for r in rows}
    assert all(r["status"] == "sending" and r["released_at"] is None and r["ambiguous_at"] is not None for r in rows)
    assert len(rig.outbox()) == 3  # processed although the answer was a 5xx

    rig.emulator.configure(error_after_rate=0.0)
    [again] = rig.run([c])
    assert (again.eligible, again.minted) == (0, 0)  # never re-minted under new ids and a new key
    age_claims(rig)
    rep = repair(rig)
    assert (rep.batches_resent, rep.resent_sent, rep.resent_rolled_back) == (1, 3, 0)
    assert {(r["status"], r["idempotency_key"]) for r in rig.rows()} == {("sent", key)}
    assert deliveries_per_user(rig) == Counter({f"user{u}@example.com": 1 for u in (1, 2, 3)})
    assert rig.emulator.stats()["replays"] == 1


def test_5xx_before_processing_is_ambiguous_too_and_resolved_by_the_same_key(rig: Rig) -> None:
    users(rig, 2)
    rig.emulator.configure(error_rate=1.0)  # the client cannot tell this 5xx from the one above
    [s] = failed_run(rig, [simple_campaign("a", 1)])
    assert (s.sent, s.released, s.unknown, s.stopped) == (0, 0, 2, "provider unavailable")
    [key] = {r["idempotency_key"] for r in rig.rows()}
    rig.emulator.configure(error_rate=0.0)
    age_claims(rig)
    assert repair(rig).resent_sent == 2
    assert {(r["status"], r["idempotency_key"]) for r in rig.rows()} == {("sent", key)}
    assert sorted(deliveries_per_user(rig).values()) == [1, 1]


# -- the reconciler's resend ----------------------------------------------------------------------

def test_reconciler_resend_answered_5xx_429_or_out_of_budget_never_releases(rig: Rig) -> None:
    users(rig, 4)
    rig.emulator.configure(error_rate=1.0)  # a 5xx: maybe processed (here: not, so a 429 can answer the key)
    [s] = failed_run(rig, [simple_campaign("a", 1)], client=rig.client(policy=ONE_SHOT))
    assert s.unknown == 4
    [key] = {r["idempotency_key"] for r in rig.rows()}

    age_claims(rig)  # the resend is answered 5xx again
    rep = repair(rig, client=rig.client(policy=ONE_SHOT))
    assert (rep.batches_resent, rep.resent_rolled_back, rep.resent_still_unknown) == (1, 0, 4)
    rig.emulator.configure(error_rate=0.0, quota_emails=0)  # ... then a quota 429 (proves nothing about the key)
    age_claims(rig)
    rep = repair(rig, client=rig.client(policy=ONE_SHOT))
    assert (rep.batches_resent, rep.resent_rolled_back, rep.resent_still_unknown) == (1, 0, 4)
    rig.emulator.configure(quota_emails=None)
    age_claims(rig)
    rep = repair(rig, deadline=time.monotonic() - 1)  # ... then the reconciler's own budget is spent
    assert (rep.batches_resent, rep.changed()) == (0, 0)
    rows = rig.rows()
    assert all(r["status"] == "sending" and r["idempotency_key"] == key and r["released_at"] is None for r in rows)

    [again] = rig.run([simple_campaign("a", 1)])
    assert again.minted == 0  # the next run does not mail them again
    age_claims(rig)
    rep = repair(rig)
    assert rep.resent_sent == 4
    assert {(r["status"], r["idempotency_key"]) for r in rig.rows()} == {("sent", key)}
    assert deliveries_per_user(rig) == Counter({f"user{u}@example.com": 1 for u in range(1, 5)})


def test_a_stale_batch_whose_sender_died_is_ambiguous_for_the_reconciler(rig: Rig) -> None:
    # A sender killed after minting may or may not have written its request: the reconciler marks
    # the rows ambiguous when it claims them, so a 429 on its resend does not release them.
    users(rig, 2)
    store = rig.store()
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    c = simple_campaign("a", 1)
    minted = store.mint_chunk(c, c.window(INTERVAL), INTERVAL.end - c.cooldown, after=0, limit=10, run=RUN,
                              interval=(INTERVAL.start, INTERVAL.end), prepare=partial(renderer.prepare_batch, c))
    assert minted.batch is not None  # ... and the sender dies here
    age_claims(rig)
    rig.emulator.configure(quota_emails=0)
    rep = repair(rig, client=rig.client(policy=ONE_SHOT))
    assert (rep.resent_rolled_back, rep.resent_still_unknown) == (0, 2)
    assert all(r["ambiguous_at"] is not None and r["status"] == "sending" for r in rig.rows())


# -- attempts count only real attempts ------------------------------------------------------------

def test_quota_stops_never_charge_users_and_recovery_sends_each_once(rig: Rig) -> None:
    users(rig, 5)
    c = simple_campaign("a", 1)
    rig.emulator.configure(quota_emails=0)
    for _ in range(4):  # more quota stops than the old max_attempts (3)
        with pytest.raises(SendError, match="daily_quota_exceeded") as err:
            rig.run([c], chunk_size=2)
        [s] = err.value.summaries
        assert (s.minted, s.released, s.chunks, s.stopped) == (2, 2, 1, "daily_quota_exceeded")  # stops at once
    assert rig.emulator.stats()["requests"] == 4
    assert rig.rows("dead_lettered_at is not null") == []
    rig.emulator.configure(quota_emails=None)
    [s] = rig.run([c], chunk_size=2)
    assert (s.eligible, s.sent) == (5, 5)
    assert deliveries_per_user(rig) == Counter({f"user{u}@example.com": 1 for u in range(1, 6)})
    assert repair(rig).dead_letters == []


def test_auth_failure_stops_the_run_at_once_and_charges_nobody(rig: Rig) -> None:
    users(rig, 6)
    c = simple_campaign("a", 1)
    bad = ResendClient(rig.emulator.base_url, "re_wrong_key", pacer=PostgresPacer(
        lambda: psycopg.connect(rig.dsn), account=rig.emulator.base_url, requests_per_second=200),
        policy=RetryPolicy(max_attempts=2, base=0.01, cap=0.02), conn_id="resend_prod")
    rig.conns.append(bad)
    for _ in range(4):
        with pytest.raises(SendError, match="resend_prod") as err:
            rig.run([c], client=bad, chunk_size=2)
        assert [(x.minted, x.chunks, x.stopped) for x in err.value.summaries] == [(2, 1, "invalid API key")]
    [s] = rig.run([c], chunk_size=2)
    assert (s.eligible, s.sent) == (6, 6)
    assert sorted(deliveries_per_user(rig).values()) == [1] * 6


def test_outage_of_any_length_then_the_next_healthy_run_sends_every_user_once(rig: Rig) -> None:
    users(rig, 6)
    c = simple_campaign("a", 1)
    # a refused connection (nothing written) is proven not processed: released, uncharged, the run stops
    dead = ResendClient(f"http://127.0.0.1:{free_port()}", "re_x", pacer=PostgresPacer(
        lambda: psycopg.connect(rig.dsn), account="dead", requests_per_second=200),
        policy=RetryPolicy(max_attempts=2, base=0.01, cap=0.02), timeout=httpx.Timeout(1.0))
    rig.conns.append(dead)
    # every run fails (an alert); the first one's chunk opens the account's circuit breaker, and the
    # runs after it mint nothing while their probe (GET /domains) is not answered
    for i in range(4):
        [s] = failed_run(rig, [c], client=dead, chunk_size=2)
        assert (s.minted, s.released, s.stopped) == ((2, 2, "provider unreachable") if i == 0 else
                                                     (0, 0, "circuit open"))
    rig.emulator.configure(outage=True)  # 503s: ambiguous, the chunk keeps its key
    for i in range(3):
        [s] = failed_run(rig, [c], chunk_size=2)
        assert (s.minted, s.unknown, s.released, s.stopped) == ((2, 2, 0, "provider unavailable") if i == 0 else
                                                                (0, 0, 0, "circuit open"))
    assert rig.rows("dead_lettered_at is not null") == []
    assert len(rig.rows("status = 'sending'")) == 2  # only the chunk in flight when the 503s began
    rig.emulator.configure(outage=False)
    age_claims(rig)
    rep = repair(rig)
    assert (rep.resent_sent, rep.circuit) == (2, "closed by probe")  # the same-key resend was the probe
    [s] = rig.run([c], chunk_size=2)
    assert (s.eligible, s.sent) == (4, 4)
    assert deliveries_per_user(rig) == Counter({f"user{u}@example.com": 1 for u in range(1, 7)})


# -- the budget -----------------------------------------------------------------------------------

def test_budget_is_checked_before_minting_including_the_wait_for_the_pacer_slot(rig: Rig) -> None:
    users(rig, 6)
    slow = ResendClient(rig.emulator.base_url, rig.emulator.api_key, pacer=PostgresPacer(
        lambda: psycopg.connect(rig.dsn), account="slow-" + rig.emulator.base_url, requests_per_second=0.5,
        target_fraction=1.0), policy=RetryPolicy(max_attempts=2, base=0.01, cap=0.02))  # slots 2 s apart
    rig.conns.append(slow)
    [s] = rig.run([simple_campaign("a", 1)], client=slow, chunk_size=2, budget_seconds=1.0)
    assert (s.minted, s.sent, s.released, s.unknown, s.stopped) == (2, 2, 0, 0, "time budget")
    assert len(rig.rows()) == 2  # the second chunk's slot was past the budget: never minted
    assert len(rig.outbox()) == 2


# -- strict mode ----------------------------------------------------------------------------------

def test_strict_refusal_without_index_resends_the_chunk_permissive_under_a_new_key(rig: Rig) -> None:
    # user 2's subject renders empty: the provider refuses that email (an address check before the
    # request cannot catch it). Strict mode refuses the whole request with prose naming no index.
    for uid in (1, 2, 3):
        add_user(rig.db, uid, first_name="" if uid == 2 else None)
    c = dataclasses.replace(simple_campaign("a", 1), subject="{{ user.first_name }}")
    strict = rig.client()
    strict.validation = "strict"
    [s] = rig.run([c], client=strict)
    assert (s.minted, s.sent, s.failed, s.released, s.unknown) == (3, 2, 1, 0, 0)
    rows = rig.rows()
    assert [(r["user_id"], r["status"]) for r in rows] == [(1, "sent"), (2, "failed"), (3, "sent")]
    assert "Invalid `subject` field" in rows[1]["error"]
    batches = rig.db.execute("select idempotency_key, validation from mail.send_batch order by created_at").fetchall()
    assert [v for _, v in batches] == [None, "permissive"] and batches[0][0] != batches[1][0]
    assert {r["idempotency_key"] for r in rows} == {batches[1][0]}
    assert sorted(deliveries_per_user(rig)) == ["user1@example.com", "user3@example.com"]


def test_strict_refusal_of_a_stale_ambiguous_batch_is_resent_permissive_under_the_same_key(rig: Rig) -> None:
    # A strict sender died after minting; its stale batch is ambiguous for the reconciler, so it
    # cannot be re-rendered under a new key. Before the fix the resend was refused on every run and
    # the good emails of the chunk stayed `sending` until they became dead letters.
    for uid in (1, 2, 3):
        add_user(rig.db, uid, first_name="" if uid == 2 else None)
    c = dataclasses.replace(simple_campaign("a", 1), subject="{{ user.first_name }}")
    renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
    minted = rig.store().mint_chunk(c, c.window(INTERVAL), INTERVAL.end - c.cooldown, after=0, limit=10, run=RUN,
                                    interval=(INTERVAL.start, INTERVAL.end), prepare=partial(renderer.prepare_batch, c))
    assert minted.batch is not None  # ... and the sender dies here
    age_claims(rig)
    strict = rig.client()
    strict.validation = "strict"
    rep = repair(rig, client=strict)
    assert (rep.batches_resent, rep.resent_sent, rep.resent_failed, rep.resent_still_unknown) == (1, 2, 1, 0)
    rows = rig.rows()
    assert [(r["user_id"], r["status"], r["idempotency_key"]) for r in rows] == [
        (1, "sent", minted.batch.idempotency_key), (2, "failed", minted.batch.idempotency_key),
        (3, "sent", minted.batch.idempotency_key)]
    assert "Invalid `subject` field" in rows[1]["error"] and rows[1]["dead_lettered_at"] is None
    assert rig.db.execute("select count(*) from mail.send_batch").fetchone()[0] == 1  # type: ignore[index]
    assert deliveries_per_user(rig) == Counter({"user1@example.com": 1, "user3@example.com": 1})
    assert rig.emulator.stats()["conflicts"] == {}
    age_claims(rig)
    assert repair(rig, client=strict).batches_resent == 0  # resolved for good


# -- idempotency keys -----------------------------------------------------------------------------

def test_idempotency_keys_never_collide_across_databases_sharing_one_provider(rig: Rig, pg_admin_dsn: str) -> None:
    # staging and production (or a restored backup, or a demo reset) with the same row ids and
    # different bodies, one provider team: before issue 12 the keys collided (409).
    users(rig, 3)
    [s1] = rig.run([simple_campaign("a", 1)])
    name = "mailflow_test_other_install"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as other:
            other.execute("drop schema if exists mail cascade; drop schema if exists app cascade")
            migrate(other)
            other.execute(schema_sql())
            for uid in (1, 2, 3):
                other.execute("insert into app.users (user_id, email, first_name, last_name, signed_up_at, timezone,"
                              " plan) values (%s, %s, 'Other', 'Test', %s, 'UTC', 'free')",
                              (uid, f"staging{uid}@example.com", rig.rows()[0]["minted_at"] - timedelta(days=60)))
            renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com",
                                "https://app.example.com")
            [s2] = run_lifecycle(PostgresStore(other), rig.client(), renderer, [simple_campaign("a", 1)], INTERVAL,
                                 run=RUN)
            keys2 = {r[0] for r in other.execute("select idempotency_key from mail.send_log").fetchall()}
            inst2 = other.execute("select id from mail.installation").fetchone()[0]  # type: ignore[index]
    finally:
        devenv.drop_database(pg_admin_dsn, name)
    assert (s1.sent, s2.sent) == (3, 3)  # no 409 invalid_idempotent_request
    keys1 = {r["idempotency_key"] for r in rig.rows()}
    inst1 = rig.db.execute("select id from mail.installation").fetchone()[0]  # type: ignore[index]
    assert inst1 != inst2 and keys1.isdisjoint(keys2)
    assert all(k.startswith(f"mf-{inst1}-a-") for k in keys1) and all(k.startswith(f"mf-{inst2}-a-") for k in keys2)
    assert rig.emulator.stats()["conflicts"] == {}
    assert len(rig.outbox()) == 6
