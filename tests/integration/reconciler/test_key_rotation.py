"""Rotating the API key while batches are ambiguous: the provider scopes idempotency keys per API
key (the emulator does; Resend does not document the scope), so an ambiguous batch is resent only
under the key it was first sent with, held (with an alert) while that key is not configured, and
`mailflow keys` shows what still needs each key."""

from __future__ import annotations

import logging

import httpx
import psycopg
import pytest
from lifecycle_rig import (
    Rig,
    add_user,
    rig,  # noqa: F401  (fixture)
    simple_campaign,
)
from reconciler_rig import REPAIR, age_claims, db_now

from mailflow.cli import keys, main
from mailflow.model.outcome import SendError
from mailflow.orchestration.alerts import held_batch_alert, key_refused_alert
from mailflow.provider.breaker import CircuitBreaker
from mailflow.provider.client import ResendClient, RetryPolicy, key_identity
from mailflow.provider.pacing import PostgresPacer
from mailflow.reconciler import reconcile

ONE_SHOT = RetryPolicy(max_attempts=1)  # the answer is lost and not retried: outcome unknown
SENDING_ONLY = "re_sending_only_new"  # the new key: a sending-only key, as Resend recommends


def _client(rig: Rig, api_key: str) -> ResendClient:
    pacer = PostgresPacer(lambda: psycopg.connect(rig.dsn), account=rig.emulator.base_url, requests_per_second=200)
    client = ResendClient(rig.emulator.base_url, api_key, pacer=pacer, timeout=httpx.Timeout(5.0))
    rig.conns += [client, pacer]
    return client


def _ambiguous_batch_under_key_a(rig: Rig, users: int) -> tuple[ResendClient, str]:
    """``users`` users minted and sent under key A, accepted by the provider, the answer lost."""
    for uid in range(1, users + 1):
        add_user(rig.db, uid)
    rig.emulator.configure(reset_after_accept_rate=1.0, restricted_keys=[SENDING_ONLY])
    old = rig.client(policy=ONE_SHOT, timeout=1.0)
    with pytest.raises(SendError, match="provider down") as failed:  # the reset opened the breaker
        rig.run([simple_campaign("c1", 1)], client=old)
    [s] = failed.value.summaries
    assert (s.minted, s.sent, s.unknown) == (users, 0, users)
    rig.emulator.configure(reset_after_accept_rate=0.0)
    assert len(rig.outbox()) == users  # the provider did deliver, once
    [(key, stored)] = rig.db.execute("select idempotency_key, key_identity from mail.send_batch").fetchall()
    assert stored == old.key_identity == key_identity(rig.emulator.api_key)
    age_claims(rig, 16)  # the sender is gone: the reconciler's turn
    return old, key


def test_key_rotation_never_duplicates_an_ambiguous_batch(rig: Rig, caplog, capsys) -> None:
    old, key = _ambiguous_batch_under_key_a(rig, 5)
    new = _client(rig, SENDING_ONLY)
    assert new.key_identity != old.key_identity
    conn = rig.store().conn
    requests_before = rig.emulator.stats()["requests"]

    # the connection now holds the new key only: the batch is held, not resent under another key
    with caplog.at_level(logging.ERROR):
        held = reconcile(conn, new, now=db_now(rig), run=REPAIR)
    assert (held.batches_resent, held.changed()) == (0, 0)
    assert [(h["key"], h["campaign"], h["key_identity"], h["rows"]) for h in held.held] == [
        (key, "c1", old.key_identity, 5)]
    assert held.as_dict()["held"] == 1
    # nothing was sent: the two requests are the breaker's probe (GET /domains, the lost answer opened
    # it; refused 401 to the sending-only key, so an empty batch asks the sending path)
    assert rig.emulator.stats()["requests"] == requests_before + 2
    assert len(rig.outbox()) == 5  # 0 duplicate deliveries
    rows = rig.rows()
    assert {r["status"] for r in rows} == {"sending"} and {r["idempotency_key"] for r in rows} == {key}
    assert all(r["attempts"] == 1 for r in rows)  # not even claimed
    assert any(r.levelno == logging.ERROR and "held, not resent under another key" in r.getMessage()
               for r in caplog.records if r.name == "mailflow.reconciler")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        held_batch_alert(held.held, {})
    [alert] = [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"]
    assert alert.startswith("ALERT: 1 ambiguous batch(es), 5 email(s), held")
    assert old.key_identity in alert and rig.emulator.api_key not in alert
    # `mailflow keys`: the old identity is not configured and still needed by 1 batch of 5 rows
    table = {r[0]: r[1:4] for r in keys(conn)}
    assert table == {new.key_identity: ("current", 0, 0), old.key_identity: ("NOT CONFIGURED", 1, 5)}
    assert main(["keys", "--dsn", rig.dsn]) == 0
    out = capsys.readouterr().out
    assert "NOT CONFIGURED" in out and out.endswith("1 batch(es) still need a key other than the current one\n")
    assert rig.emulator.api_key not in out and SENDING_ONLY not in out

    # the rotation procedure: the old key kept as a previous key: resent under it, delivered once
    built: list[str] = []

    def previous_a() -> ResendClient:
        built.append("a")
        return old

    done = reconcile(conn, new, now=db_now(rig), run=REPAIR, previous={old.key_identity: previous_a})
    assert (done.batches_resent, done.resent_sent, done.held) == (1, 5, [])
    assert built == ["a"]
    box = {e["to"][0]: e for e in rig.outbox()}
    assert len(rig.outbox()) == len(box) == 5  # still 0 duplicate deliveries
    assert rig.emulator.stats()["replays"] == 1  # the provider replayed the original answer
    assert all(r["status"] == "sent" and r["provider_message_id"] == box[r["email"]]["id"] for r in rig.rows())
    table = {r[0]: r[1:4] for r in keys(conn)}
    assert table == {new.key_identity: ("current", 0, 0), old.key_identity: ("previous", 0, 0)}
    again = reconcile(conn, new, now=db_now(rig), run=REPAIR, previous={old.key_identity: previous_a})
    assert again.changed() == 0 and again.batches_resent == 0 and built == ["a"]


def test_revoked_previous_key_is_no_verdict_for_the_breaker_and_keeps_the_batch_ambiguous(rig: Rig, caplog) -> None:
    # an outage (every request 503) while the previous key kept for resends has been revoked at the
    # provider: its 403 comes from authentication, in front of the failing sending path
    old, key = _ambiguous_batch_under_key_a(rig, 3)  # the lost answer opened the breaker
    new = _client(rig, SENDING_ONLY)
    conn = rig.store().conn
    rig.emulator.configure(outage=True, revoked_keys=[rig.emulator.api_key])
    requests_before = rig.emulator.stats()["requests"]

    with caplog.at_level(logging.ERROR):
        s = reconcile(conn, new, now=db_now(rig), run=REPAIR, previous={old.key_identity: lambda: old})

    assert s.circuit == "open"
    breaker = CircuitBreaker.for_run(conn, new, REPAIR).state()
    assert breaker.open and not breaker.probing  # the probe lease is given back, the breaker stays open
    assert rig.emulator.stats()["requests"] == requests_before + 1  # the one resend, refused 403
    assert (s.batches_resent, s.resent_sent, s.resent_rolled_back, s.resent_still_unknown) == (1, 0, 0, 3)
    assert [(r["key"], r["campaign"], r["key_identity"]) for r in s.key_refused] == [(key, "c1", old.key_identity)]
    assert s.as_dict()["key_refused"] == 1
    rows = rig.rows()
    assert [(r["status"], r["idempotency_key"], r["released_at"]) for r in rows] == [("sending", key, None)] * 3
    assert all(r["ambiguous_at"] is not None for r in rows)  # never released: only a 2xx under that key resolves
    assert len(rig.outbox()) == 3
    assert any(r.levelno == logging.ERROR and "previous API key" in r.getMessage() and "refused" in r.getMessage()
               for r in caplog.records if r.name == "mailflow.reconciler")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        key_refused_alert(s.key_refused, {})
    [alert] = [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"]
    assert alert.startswith("ALERT: 1 ambiguous batch(es) could not be resent: the provider refused the previous")
    assert old.key_identity in alert and rig.emulator.api_key not in alert

    # the key is valid again and the outage is over: the probe resend is answered, delivered once
    rig.emulator.configure(outage=False, revoked_keys=[])
    age_claims(rig, 16)
    done = reconcile(conn, new, now=db_now(rig), run=REPAIR, previous={old.key_identity: lambda: old})
    assert (done.circuit, done.batches_resent, done.resent_sent, done.key_refused) == ("closed by probe", 1, 3, [])
    assert not CircuitBreaker.for_run(conn, new, REPAIR).state().open
    assert len(rig.outbox()) == 3 and {r["status"] for r in rig.rows()} == {"sent"}


def test_a_batch_held_for_its_key_is_dead_lettered_past_the_window(rig: Rig) -> None:
    old, key = _ambiguous_batch_under_key_a(rig, 2)
    new = _client(rig, SENDING_ONLY)
    rig.db.execute("update mail.send_batch set created_at = created_at - interval '25 hours'")
    requests_before = rig.emulator.stats()["requests"]
    s = reconcile(rig.store().conn, new, now=db_now(rig), run=REPAIR)
    assert (s.unknown_outcome_failed, s.batches_resent, s.held) == (2, 0, [])
    # nothing resent: the two requests are the breaker's probe (GET /domains, 401 to the sending-only
    # key, then an empty batch to the sending path)
    assert rig.emulator.stats()["requests"] == requests_before + 2 and len(rig.outbox()) == 2
    assert all(r["status"] == "failed" and r["dead_lettered_at"] is not None for r in rig.rows())


def test_a_batch_stored_without_identity_is_resent_under_the_current_key(rig: Rig) -> None:
    """Batches stored before identities existed (NULL) keep recovering under the current key."""
    _, key = _ambiguous_batch_under_key_a(rig, 3)
    rig.db.execute("update mail.send_batch set key_identity = null")
    s = reconcile(rig.store().conn, rig.client(), now=db_now(rig), run=REPAIR)
    assert (s.batches_resent, s.resent_sent, s.held) == (1, 3, [])
    assert len(rig.outbox()) == 3
    assert [r[1:4] for r in keys(rig.db)] == [("current", 0, 0)]


def test_the_reconcile_task_holds_with_an_alert_then_resends_under_previous_api_keys(
        rig: Rig, caplog, monkeypatch) -> None:
    """The DAG's task end to end: connection ``resend_default`` with the new key; the held batch is
    alerted; with the old key in ``previous_api_keys`` the task resends it under that key, once."""
    import json

    from psycopg.conninfo import conninfo_to_dict

    from mailflow.orchestration import tasks

    old, key = _ambiguous_batch_under_key_a(rig, 3)
    db = conninfo_to_dict(rig.dsn)
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", json.dumps({
        "conn_type": "postgres", "host": db.get("host", "127.0.0.1"), "port": int(db.get("port", 5432)),
        "schema": db["dbname"], "login": db.get("user", "postgres")}))
    monkeypatch.setattr(tasks, "send_log_connection", lambda: psycopg.connect(rig.dsn))

    def connection(previous: list[str]) -> None:
        monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
            "conn_type": "resend", "host": rig.emulator.base_url, "password": SENDING_ONLY,
            "extra": {"requests_per_second": 100, "previous_api_keys": previous}}))

    class TI:
        dag_id, run_id, task_id = "reconcile_send_log", "manual", "reconcile"

    context = {"params": {"stale_after_seconds": 60, "time_budget_seconds": 60}, "ti": TI()}
    connection([])
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        held = tasks.reconcile_send_log(context)
    assert (held["held"], held["batches_resent"]) == (1, 0)
    [alert] = [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"]
    assert alert.startswith("ALERT: 1 ambiguous batch(es), 3 email(s), held") and key in alert
    assert len(rig.outbox()) == 3
    connection([rig.emulator.api_key])
    done = tasks.reconcile_send_log(context)
    assert (done["held"], done["batches_resent"], done["resent_sent"]) == (0, 1, 3)
    assert len(rig.outbox()) == 3 and rig.emulator.stats()["replays"] == 1
    assert {r["status"] for r in rig.rows()} == {"sent"}
