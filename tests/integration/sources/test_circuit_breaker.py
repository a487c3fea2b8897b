"""The circuit breaker shared by every sender (mail.circuit_breaker): an outage of any length leaves
at most the batches that were in flight when it began, runs that could not send fail, one probe at
a time closes it. Real PostgreSQL and the emulator over HTTP; the outage's 30 hours are simulated
(the stored batches and claims age by each step, as the chaos runner's clock does)."""

from __future__ import annotations

import logging
from collections import Counter
from datetime import timedelta

import httpx
import psycopg
import pytest
from lifecycle_rig import INTERVAL, simple_campaign
from lifecycle_rig import RUN as LIFECYCLE_RUN
from scheduled_rig import (
    FAST_RETRY,
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.cli import main as mailflow_cli
from mailflow.model.outcome import NotSent, RunContext, SendError, Unknown
from mailflow.provider.breaker import CIRCUIT_OPEN, CircuitBreaker, whole_request_failure
from mailflow.provider.client import ResendClient
from mailflow.provider.pacing import PostgresPacer
from mailflow.reconciler import reconcile
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.sources.scheduled.dispatcher import dispatch
from mailflow.store.send_log import PostgresStore

STEP = timedelta(minutes=30)
REPAIR = RunContext(dag_id="reconcile_send_log", run_id="r", task_id="reconcile")


def _age(rig: Rig, by: timedelta) -> None:
    """The simulated clock moves on: stored batches and claims get older (the idempotency window and
    the stale threshold read them)."""
    rig.db.execute("update mail.send_batch set created_at = created_at - %s", (by,))
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - %s where claimed_at is not null", (by,))


def _now(rig: Rig):
    return rig.db.execute("select now()").fetchone()[0]  # type: ignore[index]


def _lifecycle(rig: Rig, client: ResendClient, where: str, store: PostgresStore | None = None) -> None:
    run_lifecycle(store or PostgresStore(rig.conn()), client, rig.renderer(), [simple_campaign("welcome", 1, where)],
                  INTERVAL, run=LIFECYCLE_RUN, chunk_size=10, budget_seconds=20)


def _dead_client(rig: Rig) -> ResendClient:
    """A client of the same account whose provider refuses every connection (nothing written)."""
    pacer = PostgresPacer(lambda: psycopg.connect(rig.dsn), account=rig.emulator.base_url, requests_per_second=200)
    client = ResendClient("http://127.0.0.1:9", rig.emulator.api_key, pacer=pacer, policy=FAST_RETRY,
                          timeout=httpx.Timeout(1.0))
    rig.closers += [client, pacer]
    return client


def test_outage_longer_than_idempotency_window_leaves_only_inflight_batches(rig: Rig) -> None:
    # 300 due scheduled rows and 100 lifecycle users; 30 simulated hours of 503s (every request,
    # reads included). Before the breaker, every dispatch run claimed a fresh batch into the outage
    # and left it ambiguous: after 23 h all 300 rows were dead letters, none ever processed.
    provisioned(rig, 300)
    rig.users(100, start=1001, plan="pro")  # lifecycle-only users (not in the free-plan recipients)
    lifecycle_users = "user_id > 1000"
    rig.emulator.configure(outage=True)
    failed_runs = Counter[str]()
    client, dispatch_conn, lifecycle_store, repair_conn = rig.client(), rig.conn(), PostgresStore(rig.conn()), rig.conn()
    for step in range(60):  # 30 h: dispatch every step, lifecycle every hour, the reconciler every step
        with pytest.raises(SendError, match="provider down"):
            dispatch(dispatch_conn, client, rig.renderer(), run=RUN, batch_size=10, budget_seconds=5,
                     coalesce_seconds=0)
        failed_runs["dispatch"] += 1
        if step % 2 == 0:
            with pytest.raises(SendError, match="provider down"):
                _lifecycle(rig, client, lifecycle_users, lifecycle_store)
            failed_runs["lifecycle"] += 1
        repair = reconcile(repair_conn, client, now=_now(rig), stale_after=timedelta(0), run=REPAIR)
        assert repair.circuit == "open"
        _age(rig, STEP)
    assert failed_runs == {"dispatch": 60, "lifecycle": 30}  # every run that could not send failed (alerted)
    assert rig.emulator.read_outbox() == []  # the provider processed nothing
    states = Counter((r["kind"], r["status"], r["dead_lettered_at"] is not None) for r in rig.rows())
    # only the batch in flight when the outage began (the first dispatch claim, 10 rows) was exposed;
    # it is a dead letter after the window; nobody else was claimed or minted
    assert states == {("scheduled", "failed", True): 10, ("scheduled", "pending", False): 290}
    [breaker] = rig.db.execute("select state, failures from mail.circuit_breaker").fetchall()
    assert breaker[0] == "open" and breaker[1] >= 60

    rig.emulator.configure(outage=False)
    repair = reconcile(rig.conn(), rig.client(), now=_now(rig), stale_after=timedelta(0), run=REPAIR)
    assert repair.circuit == "closed by probe"  # nothing ambiguous left inside the window: GET /domains
    summary = rig.dispatch(batch_size=100, budget_seconds=20)
    assert summary.sent == 290 and summary.stopped is None
    _lifecycle(rig, rig.client(), lifecycle_users)
    sent = Counter(r["kind"] for r in rig.rows("status = 'sent'"))
    assert sent == {"scheduled": 290, "lifecycle": 100}
    assert max(rig.outbox_ids().values()) == 1  # everyone mailed once


def test_unreachable_provider_fails_the_run(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    # A provider that refuses every connection used to end each dispatch run green, "provider
    # unreachable" at INFO only. Nothing was written, so nobody is charged; but the run fails.
    provisioned(rig, 3)
    with caplog.at_level(logging.INFO), pytest.raises(SendError, match="provider down") as failed:
        rig.dispatch(client=_dead_client(rig), batch_size=10)
    assert failed.value.summary.stopped == "provider unreachable"
    assert failed.value.summary.released == 3
    assert {(r["status"], r["attempts"], r["idempotency_key"]) for r in rig.rows()} == {("pending", 0, None)}
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and "provider unreachable" in r.getMessage()]
    assert errors, "an unreachable provider is logged at ERROR"
    [(state, reason)] = rig.db.execute("select state, reason from mail.circuit_breaker").fetchall()
    assert state == "open" and "connection failed" in reason

    # the next run claims nothing: its probe (GET /domains) is refused too; it fails again
    with pytest.raises(SendError, match="provider down") as again:
        rig.dispatch(client=_dead_client(rig), batch_size=10)
    assert again.value.summary.stopped == CIRCUIT_OPEN and again.value.summary.claimed == 0
    assert rig.emulator.stats()["requests"] == 0
    # the provider is back: the next run's probe closes the breaker and the run sends
    assert rig.dispatch(batch_size=10).sent == 3


def test_breaker_is_shared_and_probed_once(rig: Rig) -> None:
    # One sender's whole-request failure stops every other sender of the account from minting; only
    # one process holds the probe lease at a time, and it expires if its holder dies.
    provisioned(rig, 5)
    client = rig.client()
    a = CircuitBreaker(rig.conn(), rig.emulator.base_url, "run-a", lease_seconds=0.3)
    b = CircuitBreaker(rig.conn(), rig.emulator.base_url, "run-b", lease_seconds=0.3)
    assert not a.state().open and not a.take_probe()  # closed: nothing to probe
    a.record(Unknown(reason="gave up after 3 attempts: HTTP 503 service_unavailable: down",
                     stop_run="provider unavailable"))
    assert b.state().open and b.state().reason.startswith("gave up after 3 attempts: HTTP 503")
    assert a.take_probe() and not b.take_probe()  # one probe at a time
    assert b.state().probing and b.state().probe_holder == "run-a"
    import time

    time.sleep(0.4)  # run-a died holding the lease: it expires
    assert b.take_probe() and not a.take_probe()
    b.release_probe()
    # a holder killed mid-probe (its session gone) frees the lease at once, long before it expires
    dying = rig.conn()
    c = CircuitBreaker(dying, rig.emulator.base_url, "run-c", lease_seconds=3600)
    assert c.take_probe() and not b.take_probe()
    dying_pid = dying.info.backend_pid
    dying.close()
    for _ in range(100):  # the server ends the closed session's backend asynchronously
        if rig.db.execute("select count(*) from pg_stat_activity where pid = %s", (dying_pid,)).fetchone() == (0,):
            break
        time.sleep(0.05)
    assert b.take_probe()
    b.release_probe()

    # another sender of the account (a lifecycle run) mints nothing while a probe is out elsewhere
    assert a.take_probe()
    rig.users(3, start=2001, plan="pro")
    with pytest.raises(SendError, match="provider down") as failed:
        _lifecycle(rig, client, "user_id > 2000")
    [s] = failed.value.summaries
    assert (s.minted, s.stopped) == (0, CIRCUIT_OPEN)
    assert rig.rows("kind = 'lifecycle'") == []
    a.release_probe()

    # a failing probe keeps it open; an answered one closes it, then the dispatcher claims and sends
    rig.emulator.configure(outage=True)
    assert a.admit(client, float("inf"), client.clock) == CIRCUIT_OPEN and a.state().open
    assert a.admit(client, float("inf"), client.clock) == CIRCUIT_OPEN  # one probe per run, not a loop
    rig.emulator.configure(outage=False)
    assert b.admit(client, float("inf"), client.clock) is None and not b.state().open
    assert rig.dispatch(batch_size=10).sent == 5
    assert rig.emulator.stats()["requests"] == 3  # two probes and one batch


def test_whole_request_failures_are_told_from_answers() -> None:
    # what opens the breaker: the client's stops for an unavailable or unreachable provider, and a
    # budget that ran out while retrying one; never an answer (4xx, 429, 409 in flight)
    down = [Unknown(reason="gave up after 3 attempts: HTTP 502 bad_gateway: x", stop_run="provider unavailable"),
            NotSent(reason="gave up after 3 attempts: connection failed: [Errno 111]", stop_run="provider unreachable"),
            Unknown(reason="time budget reached while retrying (ReadTimeout: timed out); an earlier attempt may have "
                           "been processed", stop_run="time budget"),
            NotSent(reason="time budget reached before attempt 2 (HTTP 503 service_unavailable: x)",
                    stop_run="time budget")]
    answers = [NotSent(reason="provider quota exhausted: HTTP 429 daily_quota_exceeded: x",
                       stop_run="daily_quota_exceeded", fatal=True),
               NotSent(reason="time budget reached while rate limited (HTTP 429 rate_limit_exceeded: x)",
                       stop_run="time budget"),
               Unknown(reason="gave up after 3 attempts: HTTP 409 concurrent_idempotent_requests: x",
                       stop_run="provider unavailable"),
               NotSent(reason="not sent: the run stopped (time budget)")]
    assert [whole_request_failure(o) is not None for o in down] == [True] * 4
    assert [whole_request_failure(o) for o in answers] == [None] * 4


def test_dead_letter_decision_resend_reopens_and_close_keeps_history(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    # Past the idempotency window a person decides, through `mailflow dead-letters`: resend under a
    # new key (accepting a possible duplicate) or close. Nothing is deleted; every decision is an event.
    provisioned(rig, 4)
    rig.emulator.configure(outage=True)
    with pytest.raises(SendError):
        rig.dispatch(batch_size=2)  # one batch of 2 in flight when the outage began
    rig.emulator.configure(outage=False)
    _age(rig, timedelta(hours=24))
    reconcile(rig.conn(), rig.client(), now=_now(rig), stale_after=timedelta(0), run=REPAIR)
    dead = [r["id"] for r in rig.rows("dead_lettered_at is not null")]
    assert len(dead) == 2
    dsn = ["--dsn", rig.dsn]
    assert mailflow_cli(["dead-letters", "list", *dsn]) == 0
    assert "2 undecided dead letter(s)" in capsys.readouterr().out
    # a resend needs the risk accepted, a name and a reason
    assert mailflow_cli(["dead-letters", "resend", "--ids", str(dead[0]), *dsn]) == 2
    assert mailflow_cli(["dead-letters", "resend", "--ids", str(dead[0]), "--by", "ops@example.com", "--reason",
                         "provider confirmed the outage processed nothing", "--accept-duplicate-risk", *dsn]) == 0
    assert mailflow_cli(["dead-letters", "close", "--ids", str(dead[1]), "--by", "ops@example.com",
                         "--reason", "user asked for no more mail", *dsn]) == 0
    capsys.readouterr()
    by_id = {r["id"]: r for r in rig.rows()}
    reopened, closed = by_id[dead[0]], by_id[dead[1]]
    assert (reopened["status"], reopened["idempotency_key"], reopened["dead_letter_decision"]) == ("pending", None, "resend")
    assert reopened["dead_letter_decided_by"] == "ops@example.com" and reopened["dead_lettered_at"] is None
    assert (closed["status"], closed["dead_lettered_at"] is not None, closed["dead_letter_decision"]) == (
        "failed", True, "close")
    assert rig.events(dead[0])[-2:] == [("sending", "failed"), ("failed", "pending")]
    assert rig.events(dead[1])[-2:] == [("sending", "failed"), ("failed", "failed")]
    assert mailflow_cli(["dead-letters", "list", *dsn]) == 0
    assert "0 undecided dead letter(s)" in capsys.readouterr().out
    # the re-opened row is claimed again under a new key with the two never-claimed rows; the closed one never
    summary = rig.dispatch(batch_size=10)
    assert summary.sent == 3
    assert by_id[dead[1]]["id"] not in rig.outbox_ids()
    assert rig.rows(f"id = {dead[0]}")[0]["status"] == "sent"
