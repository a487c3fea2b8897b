"""The lifecycle send path end to end: real PostgreSQL (PostgresStore, PostgresPacer), the real
Renderer, and the Resend emulator over HTTP through ResendClient.

Every population is inserted here with exact timestamps, so each expected set is computed from the
audience rules by hand; the outbox (what the emulator accepted) is the witness of delivery.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg
import pytest
from lifecycle_rig import (
    END,
    INTERVAL,
    RUN,
    D,
    H,
    RacingConnection,
    Rig,
    add_assessment,
    add_user,
    plant_row,
    rig,  # noqa: F401  (fixture)
    simple_campaign,
)

from mailflow import cli
from mailflow.campaigns import load_campaigns
from mailflow.model.apply_by_index import reconcile_by_index
from mailflow.model.outcome import SendError
from mailflow.provider.client import RetryPolicy
from mailflow.store.send_log import PostgresStore
from mailflow.store.suppression import suppress_address


def sent_to(rig: Rig) -> dict[str, str]:
    """Outbox: recipient address -> provider id (asserts one email per address)."""
    out = {}
    for e in rig.outbox():
        [to] = e["to"]
        assert to not in out, f"{to} delivered twice"
        out[to] = e["id"]
    return out


def test_priority_order_and_ordered_exclusion_with_the_real_campaigns(rig: Rig) -> None:
    db = rig.db
    # u1: unfinished assessment in the window (finish_assessment, 1), a free test finished in the window
    #     (upgrade_offer, 3) and active in the hour (practice_tips, 4) -> only finish_assessment
    add_user(db, 1, last_active_at=END - timedelta(minutes=30))
    add_assessment(db, 101, 1, END - 6 * H, finished_at=END - 5 * H, score=70)
    add_assessment(db, 102, 1, END - 3 * H, kind="situational_judgement")
    # u2: signed up in the window with no assessment (first_practice, 2) and active (4) -> first_practice
    add_user(db, 2, signed_up_at=END - 10 * H, last_active_at=END - timedelta(minutes=20))
    # u3: free test finished 3 days ago (3) and started within 7 days (4) -> upgrade_offer
    add_user(db, 3)
    add_assessment(db, 301, 3, END - 3 * D, finished_at=END - 3 * D + 30 * timedelta(minutes=1), score=55)
    # u4: pro plan, active 2 days ago -> practice_tips
    add_user(db, 4, plan="pro", last_active_at=END - 2 * D)
    add_assessment(db, 401, 4, END - 10 * D, finished_at=END - 10 * D + H, score=80)
    # u5: pro plan, free test finished yesterday (not upgrade: pro) -> practice_tips
    add_user(db, 5, plan="pro")
    add_assessment(db, 501, 5, END - D - H, finished_at=END - D, score=90)
    # u6: nothing in any window -> nobody
    add_user(db, 6, last_active_at=END - 20 * D)
    # u7: unfinished assessment 3 days ago (outside the 2-day window) -> practice_tips
    add_user(db, 7)
    add_assessment(db, 701, 7, END - 3 * D)
    # u8: started in the hour, finished only after the window end -> finish_assessment
    add_user(db, 8)
    add_assessment(db, 801, 8, END - H, finished_at=END + timedelta(minutes=10), kind="verbal")
    # u9: would be first_practice but signed up exactly at the window end (half-open) -> nobody
    add_user(db, 9, signed_up_at=END)

    campaigns = load_campaigns()
    summaries = rig.run(list(reversed(campaigns)))  # passed unsorted: still run by priority

    expected = {1: "finish_assessment", 2: "first_practice", 3: "upgrade_offer", 4: "practice_tips",
                5: "practice_tips", 7: "practice_tips", 8: "finish_assessment"}
    rows = rig.rows()
    assert {r["user_id"]: r["campaign"] for r in rows} == expected
    assert len(rows) == len(expected)  # nobody has two rows in one run
    assert [r["campaign"] for r in rows] == ["finish_assessment", "finish_assessment", "first_practice",
                                             "upgrade_offer", "practice_tips", "practice_tips", "practice_tips"]
    assert [(s.campaign, s.eligible, s.minted, s.sent, s.chunks) for s in summaries] == [
        ("finish_assessment", 2, 2, 2, 1), ("first_practice", 1, 1, 1, 1),
        ("upgrade_offer", 1, 1, 1, 1), ("practice_tips", 3, 3, 3, 1)]
    assert all(r["status"] == "sent" and r["released_at"] is None for r in rows)
    for r in rows:
        assert (r["data_interval_start"], r["data_interval_end"]) == (INTERVAL.start, INTERVAL.end)
        assert (r["dag_id"], r["run_id"], r["task_id"]) == (RUN.dag_id, RUN.run_id, RUN.task_id)
        assert r["email"] == f"user{r['user_id']}@example.com"
        assert r["attempts"] == 1
    by_user = {r["user_id"]: r for r in rows}
    assert by_user[1]["context"] == {"first_name": "First1", "assessment_id": 102,
                                     "assessment_kind": "situational_judgement"}
    assert by_user[3]["context"] == {"first_name": "First3", "free_tests_finished": 1, "best_score": 55}
    assert by_user[5]["context"] == {"first_name": "First5", "recent_kind": "numerical"}
    assert by_user[4]["context"] == {"first_name": "First4", "recent_kind": None}
    # the outbox holds exactly these emails, each tagged with its row's campaign and id
    outbox = rig.outbox()
    assert len(outbox) == 7
    for e in outbox:
        row = by_user[int(e["to"][0].removeprefix("user").split("@")[0])]
        assert e["headers"]["X-Mailflow-Send-Id"] == str(row["id"])
        assert e["tags"] == [{"name": "campaign", "value": row["campaign"]}]
        assert e["id"] == row["provider_message_id"]
        assert e["idempotency_key"] == row["idempotency_key"]
    # every state change has an event: minted -> sending, sending -> sent
    for r in rows:
        assert rig.events(r["id"]) == [(None, "sending"), ("sending", "sent")]
    ev = rig.db.execute("select provider_message_id, dag_id, run_id, task_id, attempt from mail.send_event"
                        " where to_status = 'sent' and send_log_id = %s", (by_user[2]["id"],)).fetchone()
    assert ev == (by_user[2]["provider_message_id"], RUN.dag_id, RUN.run_id, RUN.task_id, 1)
    assert rig.db.execute("select count(*) from mail.send_event").fetchone() == (14,)
    # the audit finds nothing wrong
    assert cli.audit(rig.db, rig.emulator.outbox_path) == {
        "delivered": 7, "sent_rows": 7, "duplicate_deliveries": 0, "sent_without_delivery": 0,
        "delivered_without_sent": 0, "provider_id_mismatch": 0}


def test_cooldown_across_campaigns(rig: Rig) -> None:
    for uid in range(1, 9):
        add_user(rig.db, uid)
    plant_row(rig.db, 1, "a", "sent", sent_at=END - 3 * D)  # within 7 days: excluded
    plant_row(rig.db, 2, "a", "sent", sent_at=END - 8 * D)  # 8 days ago: included
    plant_row(rig.db, 3, "a", "sent", sent_at=END - 7 * D)  # exactly at the boundary: excluded
    plant_row(rig.db, 4, "a", "sent", sent_at=END - 7 * D - timedelta(seconds=1))  # just outside: included
    plant_row(rig.db, 5, "a", "sending")  # a live email of any age: excluded
    plant_row(rig.db, 6, "a", "failed")  # rejected, never sent: no cooldown
    plant_row(rig.db, 7, "a", "sent", sent_at=END + 2 * D)  # sent after the interval (backfill): excluded
    # user 8: no email at all: included
    [s] = rig.run([simple_campaign("b", 1)])
    assert sorted(r["user_id"] for r in rig.rows("campaign = 'b'")) == [2, 4, 6, 8]
    assert (s.eligible, s.minted, s.sent) == (4, 4, 4)
    assert sorted(sent_to(rig)) == ["user2@example.com", "user4@example.com", "user6@example.com",
                                    "user8@example.com"]


def test_a_short_cooldown_lets_the_8_day_old_and_3_day_old_through(rig: Rig) -> None:
    for uid in (1, 2):
        add_user(rig.db, uid)
    plant_row(rig.db, 1, "a", "sent", sent_at=END - 3 * D)
    plant_row(rig.db, 2, "a", "sent", sent_at=END - 8 * D)
    [s] = rig.run([simple_campaign("b", 1, cooldown=2 * D)])
    assert sorted(r["user_id"] for r in rig.rows("campaign = 'b'")) == [1, 2]
    assert s.sent == 2


def test_suppression_by_user_and_by_email_with_scope(rig: Rig) -> None:
    for uid in range(1, 7):
        add_user(rig.db, uid)
    for user_id, email, scope in [(1, None, "all"), (None, "USER2@Example.com", "all"), (3, None, "b"),
                                  (4, None, "other_campaign"), (None, "user5@example.com", "b")]:
        if email is None:
            rig.db.execute("insert into mail.suppression (user_id, scope, source) values (%s, %s, 'test')",
                           (user_id, scope))
        else:
            suppress_address(rig.db, email, scope=scope, source="test")
    summaries = rig.run([simple_campaign("c", 2, "user_id in (1, 2, 3, 5)"), simple_campaign("b", 1)])
    assert {r["user_id"]: r["campaign"] for r in rig.rows()} == {4: "b", 6: "b", 3: "c", 5: "c"}
    assert [(s.campaign, s.eligible, s.sent) for s in summaries] == [("b", 2, 2), ("c", 2, 2)]
    assert sorted(sent_to(rig)) == [f"user{u}@example.com" for u in (3, 4, 5, 6)]


def test_released_rows_never_exclude_a_user(rig: Rig) -> None:
    # A release (a request proven not processed) charges nobody: only a rejection of that exact
    # email or an unknown outcome past the idempotency window excludes a user (issue 12).
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    for _ in range(5):
        plant_row(rig.db, 1, "a", "failed", released=True)
    summaries = rig.run([simple_campaign("a", 1), simple_campaign("b", 2, "user_id = 1")])
    assert {(r["user_id"], r["campaign"]) for r in rig.rows("released_at is null")} == {(1, "a"), (2, "a"), (3, "a")}
    assert [(s.campaign, s.eligible, s.sent) for s in summaries] == [("a", 3, 3), ("b", 0, 0)]


def test_a_pre_existing_row_leaves_exactly_two_of_three_users_claimed(rig: Rig) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    planted = plant_row(rig.db, 2, "a", "failed")  # rejected earlier: keeps its (user, campaign) key
    [s] = rig.run([simple_campaign("a", 1)])
    rows = rig.rows()
    assert [(r["user_id"], r["status"]) for r in rows] == [(2, "failed"), (1, "sent"), (3, "sent")]
    assert rows[0]["id"] == planted
    assert (s.eligible, s.minted, s.sent) == (2, 2, 2)
    assert sorted(sent_to(rig)) == ["user1@example.com", "user3@example.com"]


@pytest.mark.parametrize("exempt", [False, True])
def test_on_conflict_the_claimed_set_is_what_the_insert_returned(rig: Rig, exempt: bool) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    racing = RacingConnection(conn, rig.db, uid=2, campaign="a")
    campaign = dataclasses.replace(simple_campaign("a", 1), exempt=exempt)
    [s] = rig.run([campaign], store=PostgresStore(racing))  # type: ignore[arg-type]
    assert racing.fired
    rows = rig.rows()
    assert [(r["user_id"], r["status"], r["run_id"]) for r in rows] == [
        (2, "sending", "concurrent-run"), (1, "sent", RUN.run_id), (3, "sent", RUN.run_id)]
    # the page had 3 candidates, 2 were claimed; the batch carries only those. Under the policy the
    # contact guard sees the concurrent claim (held); an exempt campaign loses the ON CONFLICT race.
    assert (s.eligible, s.minted, s.sent, s.held, s.skipped, s.chunks) == (3, 2, 2, 0 if exempt else 1,
                                                                             1 if exempt else 0, 1)
    [batch] = rig.db.execute("select email_count, body from mail.send_batch").fetchall()
    assert batch[0] == 2
    assert [e["to"] for e in json.loads(bytes(batch[1]))] == [["user1@example.com"], ["user3@example.com"]]
    assert sorted(sent_to(rig)) == ["user1@example.com", "user3@example.com"]


def test_a_rejection_in_the_middle_of_a_permissive_batch(rig: Rig) -> None:
    # user 3's subject renders empty: the provider rejects that one email of the batch
    addresses = [add_user(rig.db, uid, first_name="" if uid == 3 else None) for uid in range(1, 6)]
    campaign = dataclasses.replace(simple_campaign("a", 1), subject="{{ user.first_name }}")
    [s] = rig.run([campaign])
    rows = rig.rows()
    assert [r["email"] for r in rows] == addresses
    assert [r["batch_index"] for r in rows] == [0, 1, 2, 3, 4]
    failed = rows[2]
    assert (failed["user_id"], failed["status"], failed["provider_message_id"], failed["released_at"]) == (
        3, "failed", None, None)
    assert failed["error"] == "Invalid `subject` field. It must be a non-empty string."
    outbox = rig.outbox()
    assert [e["batch_index"] for e in outbox] == [0, 1, 3, 4]
    ids = sent_to(rig)
    for r in rows[:2] + rows[3:]:
        assert r["status"] == "sent" and r["error"] is None
        assert r["provider_message_id"] == ids[r["email"]]
    assert (s.minted, s.sent, s.failed) == (5, 4, 1)
    assert rig.events(failed["id"]) == [(None, "sending"), ("sending", "failed")]
    assert rig.db.execute("select error from mail.send_event where send_log_id = %s and to_status = 'failed'",
                          (failed["id"],)).fetchone() == (failed["error"],)


def test_every_email_rejected_raises_after_recording(rig: Rig) -> None:
    # every email of the batch refused for the same rendered field: the template is at fault, not
    # the recipients, so nobody is charged (released) and the task fails naming the field
    for uid in (1, 2):
        add_user(rig.db, uid, first_name="")
    campaign = dataclasses.replace(simple_campaign("a", 1), subject="{{ user.first_name }}")
    with pytest.raises(SendError, match=r"^a: campaign refused: `subject` \(Invalid `subject` field") as err:
        rig.run([campaign])
    assert [(s.minted, s.failed, s.released) for s in err.value.summaries] == [(2, 0, 2)]
    assert [(r["status"], r["released_at"] is not None) for r in rig.rows()] == [("failed", True)] * 2
    assert rig.outbox() == []


def test_a_whole_request_5xx_keeps_the_chunk_and_its_key_and_stops_the_run(rig: Rig) -> None:
    for uid in (1, 2, 3, 4, 5):
        add_user(rig.db, uid)
    rig.emulator.configure(error_rate=1.0)
    with pytest.raises(SendError, match="provider down") as failed:  # a run that could not send is not green
        rig.run([simple_campaign("a", 1, "user_id in (2, 4, 5)")], chunk_size=2)
    [s] = failed.value.summaries
    assert (s.minted, s.sent, s.released, s.unknown, s.chunks, s.stopped) == (2, 0, 0, 2, 1, "provider unavailable")
    rows = rig.rows()
    assert [(r["user_id"], r["status"]) for r in rows] == [(2, "sending"), (4, "sending")]
    assert all(r["released_at"] is None and r["ambiguous_at"] is not None for r in rows)
    assert {r["error"] for r in rows} == {
        "gave up after 2 attempts: HTTP 500 internal_server_error: Emulated internal server error.; "
        "an earlier attempt may have been processed"}
    assert rig.outbox() == []
    assert rig.emulator.stats()["requests"] == 2  # 1 chunk x 2 attempts, then the run stops
    for r in rows:
        assert rig.events(r["id"]) == [(None, "sending"), ("sending", "sending")]

    rig.emulator.configure(error_rate=0.0)
    [s2] = rig.run([simple_campaign("a", 1, "user_id in (2, 4, 5)")], chunk_size=2)
    assert (s2.eligible, s2.minted, s2.sent) == (1, 1, 1)  # only user 5: 2 and 4 wait for the same key
    assert len(rig.rows()) == 3


def test_rerunning_the_same_data_interval_sends_nothing(rig: Rig) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    campaigns = [simple_campaign("a", 1, "user_id <> 2"), simple_campaign("b", 2)]
    first = rig.run(campaigns)
    assert [(s.campaign, s.sent) for s in first] == [("a", 2), ("b", 1)]
    rows_before, outbox_before = rig.rows(), rig.outbox()
    requests_before = rig.emulator.stats()["requests"]
    again = rig.run(campaigns)
    assert [(s.campaign, s.eligible, s.minted, s.chunks) for s in again] == [("a", 0, 0, 0), ("b", 0, 0, 0)]
    assert rig.rows() == rows_before
    assert rig.outbox() == outbox_before
    assert rig.emulator.stats()["requests"] == requests_before


def test_chunks_are_separate_batches_with_their_own_keys_and_bytes(rig: Rig) -> None:
    for uid in range(1, 6):
        add_user(rig.db, uid)
    [s] = rig.run([simple_campaign("a", 1)], chunk_size=2)
    assert (s.chunks, s.sent) == (3, 5)
    rows = rig.rows()
    assert [r["batch_index"] for r in rows] == [0, 1, 0, 1, 0]
    batches = rig.db.execute("select idempotency_key, email_count from mail.send_batch order by created_at,"
                             " idempotency_key").fetchall()
    assert sorted(n for _, n in batches) == [1, 2, 2]
    keys = {r["idempotency_key"] for r in rows}
    assert keys == {k for k, _ in batches} and len(keys) == 3
    assert {e["idempotency_key"] for e in rig.outbox()} == keys


def test_an_ambiguous_response_leaves_rows_sending_with_the_exact_bytes_stored(rig: Rig) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    rig.emulator.configure(reset_after_accept_rate=1.0)
    client = rig.client(policy=RetryPolicy(max_attempts=1), timeout=2.0)
    with pytest.raises(SendError, match="provider down") as failed:  # the reset opens the breaker: not green
        rig.run([simple_campaign("a", 1)], client=client)
    [s] = failed.value.summaries
    assert (s.minted, s.sent, s.unknown, s.released) == (3, 0, 3, 0)
    rows = rig.rows()
    [key] = {r["idempotency_key"] for r in rows}
    assert key is not None
    assert [(r["status"], r["provider_message_id"], r["batch_index"]) for r in rows] == [
        ("sending", None, 0), ("sending", None, 1), ("sending", None, 2)]
    for r in rows:
        assert r["error"].startswith("gave up after 1 attempts: ")
        assert r["error"].endswith("; an earlier attempt may have been processed")
        assert rig.events(r["id"]) == [(None, "sending"), ("sending", "sending")]
    # the emulator accepted (and recorded) the batch whose response was lost
    outbox = rig.outbox()
    assert [e["idempotency_key"] for e in outbox] == [key, key, key]
    assert rig.emulator.stats()["resets_after_accept"] == 1
    [(count, body)] = rig.db.execute("select email_count, body from mail.send_batch where idempotency_key = %s",
                                     (key,)).fetchall()
    body = bytes(body)
    assert count == 3
    stored = json.loads(body)
    for i, (sent, got) in enumerate(zip(stored, outbox, strict=True)):
        assert got["batch_index"] == i
        assert {k: got[k] for k in ("from", "to", "subject", "headers", "tags")} == {
            k: sent[k] for k in ("from", "to", "subject", "headers", "tags")}
        assert got["html_sha256"] == hashlib.sha256(sent["html"].encode()).hexdigest()
        assert got["text_sha256"] == hashlib.sha256(sent["text"].encode()).hexdigest()
        assert got["headers"]["X-Mailflow-Send-Id"] == str(rows[i]["id"])
    # resending the stored bytes under the stored key is an idempotent replay (the provider
    # fingerprints the exact bytes: any difference would be a 409) and delivers nothing new
    rig.emulator.configure(reset_after_accept_rate=0.0)
    resp = httpx.post(f"{rig.emulator.base_url}/emails/batch", content=body, timeout=5.0,
                      headers={**rig.emulator.auth_headers, "Idempotency-Key": key, "Content-Type": "application/json",
                               "x-batch-validation": "permissive"})
    assert resp.status_code == 200
    assert rig.emulator.stats()["replays"] == 1
    assert rig.outbox() == outbox
    outcome = reconcile_by_index(3, resp.json())
    assert outcome.kind == "accepted"
    assert outcome.ids == {i: e["id"] for i, e in enumerate(outbox)}  # type: ignore[union-attr]


def test_audit_detects_a_planted_duplicate_delivery(rig: Rig, capsys: pytest.CaptureFixture[str]) -> None:
    for uid in (1, 2, 3):
        add_user(rig.db, uid)
    rig.run([simple_campaign("a", 1)])
    path: Path = rig.emulator.outbox_path
    assert cli.audit(rig.db, path) == {"delivered": 3, "sent_rows": 3, "duplicate_deliveries": 0,
                                       "sent_without_delivery": 0, "delivered_without_sent": 0,
                                       "provider_id_mismatch": 0}
    assert cli.main(["--dsn", rig.dsn, "audit", "--outbox", str(path)]) == 0
    # plant a duplicate: the first email delivered again under a fresh key (a resend bug would do this)
    [(body,)] = rig.db.execute("select body from mail.send_batch").fetchall()
    first = json.loads(bytes(body))[0]
    resp = httpx.post(f"{rig.emulator.base_url}/emails/batch", json=[first], timeout=5.0,
                      headers={**rig.emulator.auth_headers, "Idempotency-Key": "planted-duplicate"})
    assert resp.status_code == 200
    assert cli.audit(rig.db, path) == {"delivered": 4, "sent_rows": 3, "duplicate_deliveries": 1,
                                       "sent_without_delivery": 0, "delivered_without_sent": 0,
                                       "provider_id_mismatch": 1}
    capsys.readouterr()
    assert cli.main(["--dsn", rig.dsn, "audit", "--outbox", str(path)]) == 1
    assert json.loads(capsys.readouterr().out)["duplicate_deliveries"] == 1


def test_audit_detects_a_sent_row_without_delivery(rig: Rig) -> None:
    add_user(rig.db, 1)
    rig.run([simple_campaign("a", 1)])
    plant_row(rig.db, 9, "a", "sent", sent_at=END)
    assert cli.audit(rig.db, rig.emulator.outbox_path) == {
        "delivered": 1, "sent_rows": 2, "duplicate_deliveries": 0, "sent_without_delivery": 1,
        "delivered_without_sent": 0, "provider_id_mismatch": 0}
