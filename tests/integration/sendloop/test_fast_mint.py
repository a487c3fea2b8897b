"""The pipelined engine as the Airflow task runs it (issue 16): the mint inserts rows once with their
batch key and index (ids allocated first), the sender thread applies each answer on a second
connection, the run's rejected addresses are remembered across campaigns and attempts, and the
request slot is claimed right before the send (budget checked before the mint with a peek).
Real PostgreSQL, the real store, renderer and client against the emulator over HTTP."""

from __future__ import annotations

import dataclasses
import json

import psycopg
from lifecycle_rig import RUN, RacingConnection, Rig, add_user, plant_row, rig, simple_campaign  # noqa: F401

from mailflow.model.keys import batch_key
from mailflow.store.send_log import PostgresStore


def companion(rig: Rig, store: PostgresStore) -> PostgresStore:
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    return store.companion(conn)


def test_rows_are_minted_once_with_their_key_index_and_the_stored_bytes(rig: Rig) -> None:
    for uid in range(1, 151):
        add_user(rig.db, uid)
    store = rig.store()
    [s] = rig.run([simple_campaign("a", 1)], store=store, chunk_size=100, pipelined=True,
                  apply_store=companion(rig, store))
    assert (s.eligible, s.minted, s.sent, s.chunks) == (150, 150, 150, 2)
    rows = rig.rows()
    batches = rig.db.execute("select idempotency_key, body from mail.send_batch order by idempotency_key").fetchall()
    assert len(batches) == 2
    installation = rig.db.execute("select id from mail.installation").fetchone()[0]  # type: ignore[index]
    for key, body in batches:
        mine = sorted((r for r in rows if r["idempotency_key"] == key), key=lambda r: r["batch_index"])
        assert [r["batch_index"] for r in mine] == list(range(len(mine)))
        emails = json.loads(bytes(body))
        # request index i is row i of the batch: its id in the header, its address as recipient
        assert [e["headers"]["X-Mailflow-Send-Id"] for e in emails] == [str(r["id"]) for r in mine]
        assert [e["to"] for e in emails] == [[r["email"]] for r in mine]
        serial = int(key.split("-")[-2])
        assert key == batch_key(str(installation), "a", serial, bytes(body))
    # one version per row: minted 'sending' with its key, then sent (no separate key assignment)
    assert {tuple(rig.events(r["id"])) for r in rows} == {((None, "sending"), ("sending", "sent"))}
    assert len(rig.outbox()) == 150


def test_a_row_lost_to_the_on_conflict_backstop_is_never_named_by_the_batch(rig: Rig) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    # right before the keyed mint, another session commits a live row for user 2 WITHOUT passing the
    # contact lock (as a misconfigured writer would): only the INSERT's ON CONFLICT backstop sees it
    racing = RacingConnection(conn, rig.db, uid=2, campaign="a", before="already carry their batch key")
    campaign = dataclasses.replace(simple_campaign("a", 1), exempt=True)
    [s] = rig.run([campaign], store=PostgresStore(racing))  # type: ignore[arg-type]
    assert racing.fired
    assert sorted((r["user_id"], r["status"], r["run_id"]) for r in rig.rows()) == [
        (1, "sent", RUN.run_id), (2, "sending", "concurrent-run"), (3, "sent", RUN.run_id)]
    assert (s.eligible, s.minted, s.sent, s.chunks) == (3, 2, 2, 1)
    # the first rendering (3 emails) was rolled back with its savepoint: one batch, two emails
    [(count, body)] = rig.db.execute("select email_count, body from mail.send_batch").fetchall()
    assert count == 2
    assert [e["to"] for e in json.loads(bytes(body))] == [["user1@example.com"], ["user3@example.com"]]
    ours = [r for r in rig.rows() if r["run_id"] == RUN.run_id]
    assert [r["batch_index"] for r in ours] == [0, 1]
    assert len(rig.outbox()) == 2


def test_an_address_rejected_on_the_sender_thread_is_not_retried_by_a_later_campaign(rig: Rig) -> None:
    # user 3's subject renders empty for campaign a: the provider rejects it (permissive, by index).
    # Campaign b (exempt from the cooldown) must not try that address again in the same run, even
    # though the rejection was applied by the companion store on the sender thread.
    for uid in range(1, 6):
        add_user(rig.db, uid, first_name="" if uid == 3 else "Ann")
    a = dataclasses.replace(simple_campaign("a", 1), subject="{{ user.first_name }}", exempt=True)
    b = dataclasses.replace(simple_campaign("b", 2), exempt=True)
    store = rig.store()
    sa, sb = rig.run([a, b], store=store, pipelined=True, apply_store=companion(rig, store), chunk_size=2)
    assert (sa.minted, sa.sent, sa.failed) == (5, 4, 1)
    assert (sb.eligible, sb.minted, sb.sent, sb.held) == (5, 4, 4, 1)
    assert sorted(r["user_id"] for r in rig.rows("campaign = 'b'")) == [1, 2, 4, 5]


def test_a_retried_attempt_of_the_run_remembers_the_rejections_of_the_first(rig: Rig) -> None:
    # the first attempt of the run (another process) had user 3's address rejected for campaign a;
    # the retried attempt's campaign b reads the run's rejections from the send log once
    for uid in range(1, 4):
        add_user(rig.db, uid)
    row = plant_row(rig.db, 3, "a", "failed", run_id=RUN.run_id)
    rig.db.execute("update mail.send_log set attempts = 1, email_key = 'user3@example.com' where id = %s", (row,))
    b = dataclasses.replace(simple_campaign("b", 2), exempt=True)
    [sb] = rig.run([b])
    assert (sb.eligible, sb.minted, sb.held) == (3, 2, 1)
    assert sorted(r["user_id"] for r in rig.rows("campaign = 'b'")) == [1, 2]


def test_pipelined_with_the_real_client_claims_each_slot_when_it_sends_so_no_slot_is_late(rig: Rig) -> None:
    for uid in range(1, 501):
        add_user(rig.db, uid)
    client = rig.client()
    client.pacer.target_fraction = 0.95  # type: ignore[attr-defined]
    store = rig.store()
    [s] = rig.run([simple_campaign("a", 1)], client=client, store=store, chunk_size=50, pipelined=True,
                  apply_store=companion(rig, store))
    assert (s.minted, s.sent, s.chunks) == (500, 500, 10)
    assert client.stats["late_slots"] == 0
    assert client.stats["requests"] == 10
    assert len(rig.outbox()) == 500


def test_pipelined_budget_uses_the_predicted_slot_and_never_mints_past_it(rig: Rig) -> None:
    # a pacer whose next slot is 30 s away: the peek says so before the first mint, nothing is minted
    for uid in range(1, 11):
        add_user(rig.db, uid)
    client = rig.client()
    client.pacer.push_back(30.0)
    [s] = rig.run([simple_campaign("a", 1)], client=client, pipelined=True, budget_seconds=5.0)
    assert (s.minted, s.sent, s.stopped) == (0, 0, "time budget")
    assert rig.rows() == [] and client.stats["requests"] == 0
