"""The address at send time: the dispatcher reads each claimed user's current address from the
campaign's recipient source before the contact policy and the address checks, records a change in
mail.address_change, skips a user the source no longer returns, and never re-addresses a row that was
already attempted. Real PostgreSQL, the real renderer, the emulator over HTTP (its outbox is the witness)."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql
from scheduled_rig import (
    ALL_DAY,
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.campaigns import CampaignFolder
from mailflow.model.outcome import SendError
from mailflow.provider.client import RetryPolicy
from mailflow.reconciler import reconcile
from mailflow.sources.scheduled.provisioning import recipient_source
from mailflow.store.scheduled import ScheduledStore
from mailflow.store.sql import query
from mailflow.store.suppression import suppress_address
from mailflow_dev.demo.loader import load_demo_data

D = timedelta(days=1)


def db_now(db: psycopg.Connection) -> datetime:
    row = db.execute("select now()").fetchone()
    assert row is not None
    return row[0]


def outbox_to(rig: Rig) -> list[str]:
    return sorted(e["to"][0] for e in rig.emulator.read_outbox())


def changes(rig: Rig) -> list[tuple[Any, ...]]:
    return rig.db.execute("select send_log_id, user_id, campaign, old_email, old_email_key, new_email, new_email_key,"
                          " dag_id, run_id, task_id from mail.address_change order by id").fetchall()


def row_of(rig: Rig, uid: int) -> dict[str, Any]:
    [row] = rig.rows(f"kind = 'scheduled' and user_id = {int(uid)}")
    return row


def set_email(rig: Rig, uid: int, email: str) -> None:
    rig.db.execute("update app.users set email = %s where user_id = %s", (email, uid))


def test_a_changed_address_is_sent_to_and_the_change_is_recorded(rig: Rig) -> None:
    provisioned(rig, 3)
    set_email(rig, 2, "  Bert.New@Example.ORG ")
    set_email(rig, 3, " user3@EXAMPLE.com")  # the same address as sent (domain case, spaces): no change
    s = rig.dispatch()
    assert (s.claimed, s.sent, s.readdressed, s.gone, s.skipped) == (3, 3, 1, 0, 0)
    assert outbox_to(rig) == ["Bert.New@example.org", "user1@example.com", "user3@example.com"]
    row = row_of(rig, 2)
    assert (row["status"], row["email"], row["email_key"]) == ("sent", "Bert.New@example.org", "bert.new@example.org")
    assert changes(rig) == [(row["id"], 2, "outreach_test", "user2@example.com", "user2@example.com",
                             "Bert.New@Example.ORG", "bert.new@example.org", RUN.dag_id, RUN.run_id, RUN.task_id)]
    # the row's stored bytes carry the new address
    body = json.loads(bytes(rig.db.execute("select body from mail.send_batch where idempotency_key = %s",
                                           (row["idempotency_key"],)).fetchone()[0]))  # type: ignore[index]
    assert body[row["batch_index"]]["to"] == ["Bert.New@example.org"]
    assert row_of(rig, 3)["email"] == "user3@example.com"


def test_a_suppressed_new_address_is_not_sent(rig: Rig) -> None:
    provisioned(rig, 2)
    set_email(rig, 1, "gone.bad@example.org")
    suppress_address(rig.db, "Gone.Bad@example.org", source="bounce")
    s = rig.dispatch()
    assert (s.sent, s.suppressed, s.readdressed) == (1, 1, 1)
    assert outbox_to(rig) == ["user2@example.com"]
    row = row_of(rig, 1)
    assert (row["status"], row["error"], row["email"], row["idempotency_key"]) == (
        "cancelled", "suppressed before sending (address)", "gone.bad@example.org", None)
    assert [c[3:7] for c in changes(rig)] == [("user1@example.com", "user1@example.com", "gone.bad@example.org",
                                               "gone.bad@example.org")]


def test_a_user_whose_old_address_is_suppressed_is_sent_to_the_new_one(rig: Rig) -> None:
    provisioned(rig, 3)
    suppress_address(rig.db, "user1@example.com", source="bounce")  # the old address bounced ...
    set_email(rig, 1, "fixed1@example.org")  # ... and the user gave a new one
    suppress_address(rig.db, "user2@example.com", source="bounce")  # bounced, still the user's address
    s = rig.dispatch()
    assert (s.sent, s.suppressed, s.readdressed) == (2, 1, 1)
    assert outbox_to(rig) == ["fixed1@example.org", "user3@example.com"]
    assert (row_of(rig, 1)["status"], row_of(rig, 1)["email"]) == ("sent", "fixed1@example.org")
    assert (row_of(rig, 2)["status"], row_of(rig, 2)["error"]) == ("cancelled", "suppressed before sending (address)")


@pytest.mark.parametrize("on_policy", ["defer", "skip"])
def test_a_new_address_inside_its_mailbox_cooldown_is_held_per_on_policy(rig: Rig, on_policy: str) -> None:
    provisioned(rig, 2, on_policy=on_policy)
    now = db_now(rig.db)
    # another user was mailed at that mailbox 2 days ago: the mailbox's cooldown holds the new address
    sent = rig.db.execute(
        "insert into mail.send_log (user_id, campaign, kind, email, email_key, status, sent_at, provider_message_id)"
        " values (99, 'first_practice', 'lifecycle', 'shared@example.org', 'shared@example.org', 'sent', %s, 'p-99')"
        " returning id", (now - 2 * D,)).fetchone()[0]  # type: ignore[index]
    set_email(rig, 1, "Shared@example.org")
    s = rig.dispatch()
    assert (s.sent, s.readdressed) == (1, 1)
    assert (s.deferred, s.skipped) == ((1, 0) if on_policy == "defer" else (0, 1))
    assert outbox_to(rig) == ["user2@example.com"]
    row = row_of(rig, 1)
    assert row["status"] == ("pending" if on_policy == "defer" else "skipped")
    assert row["error"].startswith(f"contact policy: cooldown 7 days: row {sent} (first_practice, sent ")
    assert (row["email"], row["email_key"], row["idempotency_key"]) == ("Shared@example.org", "shared@example.org",
                                                                        None)
    if on_policy == "defer":
        assert row["scheduled_at"] > now - 2 * D + 7 * D


def test_an_invalid_new_address_fails_hygiene_like_any_invalid_address(rig: Rig) -> None:
    provisioned(rig, 2)
    set_email(rig, 2, "bert@@example.org")
    s = rig.dispatch()
    assert (s.sent, s.invalid, s.readdressed, s.failed) == (1, 1, 1, 0)
    assert outbox_to(rig) == ["user1@example.com"]
    row = row_of(rig, 2)
    assert (row["status"], row["attempts"], row["idempotency_key"], row["email"], row["email_key"]) == (
        "failed", 0, None, "bert@@example.org", None)
    assert row["error"] == "invalid address: The part after the @-sign contains invalid characters: '@'."
    assert [c[3:7] for c in changes(rig)] == [("user2@example.com", "user2@example.com", "bert@@example.org", None)]


def test_a_user_the_recipients_no_longer_return_is_skipped_with_the_reason(rig: Rig) -> None:
    provisioned(rig, 4)
    rig.db.execute("delete from app.users where user_id = 1")  # deleted
    rig.db.execute("update app.users set plan = 'pro' where user_id = 2")  # upgraded: no longer on the free plan
    set_email(rig, 3, "   ")  # no address any more
    s = rig.dispatch()
    assert (s.claimed, s.sent, s.skipped, s.gone, s.readdressed) == (1, 1, 3, 3, 0)
    assert outbox_to(rig) == ["user4@example.com"]
    for uid in (1, 2):
        row = row_of(rig, uid)
        why = (f"recipient gone: user {uid} is no longer returned by the campaign's recipients (free_plan_users) "
               "at send time: skipped, not sent")
        assert (row["status"], row["error"], row["attempts"], row["idempotency_key"]) == ("skipped", why, 0, None)
        assert rig.db.execute("select from_status, to_status, error from mail.send_event where send_log_id = %s"
                              " order by id", (row["id"],)).fetchall() == [(None, "pending", None),
                                                                           ("pending", "skipped", why)]
    assert row_of(rig, 3)["error"] == ("recipient gone: the campaign's recipients (free_plan_users) return user 3 "
                                       "without an address at send time: skipped, not sent")
    assert changes(rig) == []
    again = rig.dispatch(budget_seconds=2)  # skipped is final: nothing left to send
    assert (again.claimed, again.skipped) == (0, 0)


def test_a_retried_ambiguous_row_keeps_its_address_key_and_bytes(rig: Rig) -> None:
    provisioned(rig, 2)
    rig.emulator.configure(error_after_rate=1.0, error_after_status=502)
    with pytest.raises(SendError, match="provider down"):
        rig.dispatch(client=rig.client(policy=RetryPolicy(max_attempts=1)))
    [key] = {r["idempotency_key"] for r in rig.rows()}
    body = rig.db.execute("select body from mail.send_batch where idempotency_key = %s", (key,)).fetchone()
    set_email(rig, 1, "new1@example.org")  # changed while the request is ambiguous
    rig.emulator.configure(error_after_rate=0.0)
    again = rig.dispatch(budget_seconds=2)
    assert (again.claimed, again.readdressed) == (0, 0)
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - interval '1 hour'")
    rep = reconcile(rig.conn(), rig.client(), now=db_now(rig.db), run=RUN)
    assert (rep.batches_resent, rep.resent_sent) == (1, 2)
    assert {(r["user_id"], r["status"], r["email"], r["idempotency_key"]) for r in rig.rows()} == {
        (1, "sent", "user1@example.com", key), (2, "sent", "user2@example.com", key)}
    assert rig.db.execute("select body from mail.send_batch where idempotency_key = %s", (key,)).fetchone() == body
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rig.rows()})
    assert outbox_to(rig) == ["user1@example.com", "user2@example.com"]
    assert changes(rig) == []


def test_a_row_with_an_idempotency_key_is_never_readdressed(rig: Rig) -> None:
    provisioned(rig, 2)
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set idempotency_key = 'k-attempted', batch_index = 0 where id = %s",
                   (ids[0],))
    changed = ScheduledStore(rig.db).readdress_rows(
        {"dag_id": "d", "run_id": "r", "task_id": "t"}, ids, ["a@example.org", "b@example.org"],
        ["a@example.org", "b@example.org"])
    assert changed == [ids[1]]
    assert [(r["email"], r["email_key"]) for r in rig.rows()] == [
        ("user1@example.com", "user1@example.com"), ("b@example.org", "b@example.org")]
    assert [c[0] for c in changes(rig)] == [ids[1]]


def test_an_uploaded_list_keeps_its_addresses(rig: Rig) -> None:
    rig.users(2)
    cid = rig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ALL_DAY)
    for uid in (1, 2):
        rig.db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                       " values (%s, %s, %s, 'X')", (cid, uid, f"listed{uid}@example.com"))
    assert rig.provision(cid).created == 2
    rig.db.execute("update mail.campaign_recipient set email = 'other@example.com' where user_id = 1")
    rig.db.execute("delete from mail.campaign_recipient where user_id = 2")
    set_email(rig, 1, "app1@example.org")
    s = rig.dispatch()
    assert (s.sent, s.readdressed, s.gone) == (2, 0, 0)
    assert outbox_to(rig) == ["listed1@example.com", "listed2@example.com"]
    assert changes(rig) == []


def test_the_address_lookup_reads_the_users_primary_key_on_the_demo_schema(rig: Rig) -> None:
    load_demo_data(rig.db, users=5000, anchor=db_now(rig.db), reset=True)
    cid = rig.campaign(**ALL_DAY)
    c = rig.campaign_row(cid)
    source = recipient_source(rig.db, c, CampaignFolder.resolve())
    stmt = pgsql.SQL("explain (format json) " + query("scheduled", "current_addresses")).format(source=source)
    user_ids = list(range(1, 5001, 50))  # 100 users: one claim's batch
    [[plan]] = rig.db.execute(stmt, {"user_ids": user_ids, "campaign": c["name"], "campaign_id": cid}).fetchone()

    def nodes(n: dict[str, Any]) -> list[dict[str, Any]]:
        return [n, *(x for p in n.get("Plans", []) for x in nodes(p))]

    scans = [(n["Node Type"], n.get("Index Name"), n.get("Relation Name")) for n in nodes(plan["Plan"])
             if "Scan" in n["Node Type"]]
    assert scans == [("Index Scan", "users_pkey", "users")], scans
    found = ScheduledStore(rig.db).current_addresses(source, user_ids, c["name"], cid)
    expected = dict(rig.db.execute("select user_id, email from app.users where plan = 'free'"
                                   " and user_id = any(%s)", (user_ids,)).fetchall())
    assert found == {u: e.strip() or None for u, e in expected.items()} and 0 < len(found) < 100


def test_a_claim_that_fails_after_the_refresh_rolls_the_address_change_back_too(rig: Rig) -> None:
    cid = provisioned(rig, 2)
    set_email(rig, 1, "new1@example.org")
    rig.db.execute("delete from app.users where user_id = 2")
    rig.db.execute("update mail.campaign set template = 'no_such_template' where id = %s", (cid,))
    with pytest.raises(SendError, match="outreach_test: dispatch failed: TemplateNotFound"):
        rig.dispatch()
    # one transaction: the new address, its record and the gone user's skip went with the claim
    assert [(r["status"], r["email"], r["error"]) for r in rig.rows()] == [
        ("pending", "user1@example.com", None), ("pending", "user2@example.com", None)]
    assert changes(rig) == []
    assert rig.emulator.read_outbox() == []
