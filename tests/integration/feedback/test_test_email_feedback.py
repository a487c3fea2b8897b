"""A campaign's test email is never a send-log row: its webhooks are matched to its own record (by the
provider's email id, or by our tag before that id is stored), recorded on it and shown with the plan, never
left pending, swept for days and alerted as unknown; its hard bounce or complaint suppresses the address.
An email nobody knows is still alerted."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from scheduled_rig import Rig, rig  # noqa: F401 - the rig and its fixture
from starlette.testclient import TestClient
from test_webhooks_server import receiver as standalone_receiver
from webhook_rig import SECRET, envelope, inbox, signed, suppressions

from mailflow.feedback.webhooks import GroupWriter, alert_lines, apply_pending, connect_factory, create_app
from mailflow.model.outcome import Accepted
from mailflow.sources.scheduled import status
from mailflow.sources.scheduled.test_email import send_test_email
from mailflow.store.migrate import migrate
from mailflow_dev import devenv

TO = "approver@example.com"


@pytest.fixture
def receiver(rig: Rig, db_dsn: str) -> Iterator[TestClient]:  # noqa: F811
    """The receiver (no sweep loop: the tests sweep themselves)."""
    app = create_app([SECRET], connect_factory(db_dsn), writer=GroupWriter(connect_factory(db_dsn), sweep_every=0))
    with TestClient(app) as c:
        yield c


def _campaign(rig: Rig) -> int:  # noqa: F811
    rig.users(3)
    return rig.campaign("spring_test")  # a draft, as when provision_campaign sends its test email


def _send(rig: Rig, cid: int, to: str = TO, client: Any = None) -> dict[str, Any]:  # noqa: F811
    conn = rig.conn()
    conn.autocommit = True
    return send_test_email(conn, client or rig.client(), cid, to, "tester", renderer=rig.renderer())


def _pushed(rig: Rig, provider_id: str, kind: str, *, to: str | None = None, **data: Any) -> dict[str, Any]:  # noqa: F811
    """The envelope the provider pushes for the email it accepted as ``provider_id``: its recipient and its
    tags as sent (Resend echoes an email's tags in every event, ``data.tags``)."""
    [mail] = [m for m in rig.emulator.read_outbox() if m["id"] == provider_id]
    return envelope(kind, provider_id, to or mail["to"][0], tags={t["name"]: t["value"] for t in mail["tags"]}, **data)


def _post(client: TestClient, payload: dict[str, Any]) -> str:
    body, headers = signed(payload)
    r = client.post("/resend", content=body, headers=headers)
    assert r.status_code == 200, r.text
    return str(r.json()["decision"])


def _test_email(db: psycopg.Connection) -> dict[str, Any]:
    cur = db.execute("select * from mail.test_email")
    [row] = cur.fetchall()
    return dict(zip([d.name for d in cur.description or []], row, strict=True))


def _recorded(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("select test_email_id, event, bounce_type from mail.test_email_event order by id").fetchall()


def test_a_test_emails_webhooks_are_recorded_on_it_never_pending_or_alerted_unknown(
        rig: Rig, receiver: TestClient) -> None:  # noqa: F811
    cid = _campaign(rig)
    sent = _send(rig, cid)
    pid = sent["provider_id"]

    decided = [_post(receiver, _pushed(rig, pid, kind)) for kind in ("sent", "delivered", "opened", "clicked")]

    assert decided == ["test_email"] * 4
    assert [(r[2], r[3], r[4], r[5]) for r in inbox(rig.db)] == [(pid, "test_email", True, 0)] * 4
    assert rig.db.execute("select count(*) from mail.webhook_event where applied_at is null").fetchone() == (0,)
    test = _test_email(rig.db)
    assert _recorded(rig.db) == [(test["id"], "sent", None), (test["id"], "delivered", None),
                                 (test["id"], "opened", None), (test["id"], "clicked", None)]
    assert (test["status"], test["provider_message_id"], test["outcome"], test["opens"], test["clicks"]) == (
        "sent", pid, "delivered", 1, 1)
    # nothing is left to sweep, even past the give-up age, and nothing is alerted as unknown
    swept = apply_pending(rig.conn(), give_up_after=timedelta(0))
    assert (swept.taken, swept.unknown_email) == (0, 0)
    assert alert_lines(rig.db) == ([], [])
    # the outcome is linked to the campaign event that records the test email, and shown with the campaign
    [(event_id, detail)] = rig.db.execute("select id, detail from mail.campaign_event"
                                          " where detail->>'reason' = 'test_email'").fetchall()
    assert (test["campaign_event_id"], detail["provider_id"], detail["test_email_id"]) == (event_id, pid, test["id"])
    [shown] = status(rig.db, cid)["test_emails"]
    assert {k: shown[k] for k in ("id", "campaign_event_id", "to", "status", "provider_id", "outcome", "opens",
                                  "clicks", "events")} == {
        "id": test["id"], "campaign_event_id": event_id, "to": "a***@example.com", "status": "sent",
        "provider_id": pid, "outcome": "delivered", "opens": 1, "clicks": 1,
        "events": ["sent", "delivered", "opened", "clicked"]}
    # a test email is in no count: no send-log row, no delivery event of one
    assert rig.db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert rig.db.execute("select count(*) from mail.delivery_event").fetchone() == (0,)


@pytest.mark.parametrize(("kind", "bounce_type", "source", "outcome"), [
    ("bounced", "Permanent", "bounce", "hard_bounced"),
    ("complained", None, "complaint", "complained"),
    ("bounced", "Transient", None, "soft_bounced"),
])
def test_a_test_emails_hard_bounce_or_complaint_suppresses_its_address(
        rig: Rig, receiver: TestClient, kind: str, bounce_type: str | None, source: str | None,  # noqa: F811
        outcome: str) -> None:
    cid = _campaign(rig)
    pid = _send(rig, cid, "Approver@Example.com")["provider_id"]
    extra = {"bounce_type": bounce_type} if bounce_type else {}

    assert _post(receiver, _pushed(rig, pid, "sent")) == "test_email"
    assert _post(receiver, _pushed(rig, pid, kind, **extra)) == "test_email"

    assert _test_email(rig.db)["outcome"] == outcome
    if source is None:  # a soft bounce may pass: it suppresses nobody, as for any email
        assert suppressions(rig.db) == []
        _send(rig, cid, "Approver@Example.com")
        return
    assert suppressions(rig.db) == [(None, "Approver@example.com", "approver@example.com", "all", source)]
    [(reason,)] = rig.db.execute("select reason from mail.suppression").fetchall()
    assert f"test email {_test_email(rig.db)['id']} of campaign spring_test, email {pid}" in reason
    # suppressed for all mail: no further test email goes there either
    with pytest.raises(ValueError, match=rf"a\*\*\*@example.com is suppressed \(source {source}\)"):
        _send(rig, cid, "approver@example.com")
    assert rig.db.execute("select count(*) from mail.test_email").fetchone() == (1,)
    assert alert_lines(rig.db) == ([], [])


class _AnswerLate:
    """A client whose webhooks beat the provider's answer: after the provider accepted the email, its
    ``email.sent`` is pushed (and committed) before ``send_batch`` returns."""

    def __init__(self, rig: Rig, receiver: TestClient) -> None:  # noqa: F811
        self.inner, self.rig, self.receiver = rig.client(), rig, receiver
        self.clock, self.key_identity = self.inner.clock, self.inner.key_identity
        self.decisions: list[str] = []

    def send_batch(self, batch: Any, deadline: float) -> Any:
        outcome = self.inner.send_batch(batch, deadline)
        assert isinstance(outcome, Accepted)
        self.decisions.append(_post(self.receiver, _pushed(self.rig, outcome.ids[0], "sent")))
        self.decisions.append(_post(self.receiver, _pushed(self.rig, outcome.ids[0], "delivered")))
        return outcome


def test_a_webhook_that_beats_the_providers_answer_is_matched_by_the_tag(
        rig: Rig, receiver: TestClient) -> None:  # noqa: F811
    cid = _campaign(rig)
    client = _AnswerLate(rig, receiver)

    sent = _send(rig, cid, client=client)

    assert client.decisions == ["test_email", "test_email"]  # matched while the test email had no provider id
    test = _test_email(rig.db)
    assert (test["provider_message_id"], test["status"], test["outcome"]) == (sent["provider_id"], "sent", "delivered")
    assert [r[1] for r in _recorded(rig.db)] == ["sent", "delivered"]
    assert rig.db.execute("select count(*) from mail.webhook_event where applied_at is null").fetchone() == (0,)


def test_an_unknown_email_still_alerts(rig: Rig, receiver: TestClient) -> None:  # noqa: F811
    cid = _campaign(rig)
    pid = _send(rig, cid)["provider_id"]
    real = _pushed(rig, pid, "delivered")
    unknown = envelope("delivered", "em_nobody", "someone@example.com")
    # our tag on an email id the provider never gave our test email: not this test email
    other_id = envelope("delivered", "em_other", TO, tags=real["data"]["tags"])
    stray_tag = envelope("delivered", "em_stray", TO, tags={"test": "true", "mailflow_test": uuid.uuid4().hex})

    assert [_post(receiver, e) for e in (unknown, other_id, stray_tag)] == ["pending"] * 3

    swept = apply_pending(rig.conn(), give_up_after=timedelta(0))
    assert (swept.taken, swept.unknown_email) == (3, 3)
    lines, _ = alert_lines(rig.db)
    assert sorted(line.split(" provider id=")[1] for line in lines) == [
        "em_nobody no send-log row: unknown_email", "em_other no send-log row: unknown_email",
        "em_stray no send-log row: unknown_email"]
    assert _recorded(rig.db) == []


def test_a_test_emails_failure_and_a_mismatch_are_alerted_naming_it(rig: Rig, receiver: TestClient) -> None:  # noqa: F811
    cid = _campaign(rig)
    failed_pid = _send(rig, cid)["provider_id"]
    mismatched_pid = _send(rig, cid, "second@example.com")["provider_id"]

    assert _post(receiver, _pushed(rig, failed_pid, "failed")) == "failed"
    # the provider says another address complained about the second test email: that address is suppressed,
    # nothing is recorded on the test email
    assert _post(receiver, _pushed(rig, mismatched_pid, "complained", to="else@example.com")) == "recipient_mismatch"

    ids = dict(rig.db.execute("select provider_message_id, id from mail.test_email").fetchall())
    assert _recorded(rig.db) == [(ids[failed_pid], "failed", None)]
    assert [r[1:] for r in suppressions(rig.db)] == [("else@example.com", "else@example.com", "all", "complaint")]
    lines, _ = alert_lines(rig.db)
    assert sorted(line.split(" provider id=")[1] for line in lines) == sorted([
        f"{failed_pid} test email {ids[failed_pid]} of campaign spring_test to=a***@example.com: failed",
        f"{mismatched_pid} test email {ids[mismatched_pid]} of campaign spring_test to=s***@example.com: "
        "recipient_mismatch"])


def test_the_emulated_providers_signed_pushes_for_a_test_email_are_all_recorded_on_it(
        rig: Rig, db_dsn: str, tmp_path: Path) -> None:  # noqa: F811
    cid = _campaign(rig)
    with standalone_receiver(db_dsn, tmp_path, "--sweep-every", "0.2") as base:
        rig.emulator.configure(webhook_url=f"{base}/resend", webhook_secrets=[SECRET], open_rate=1.0, click_rate=1.0,
                               webhook_time_scale=0.001)
        pid = _send(rig, cid)["provider_id"]
        totals = rig.emulator.wait_webhooks(timeout=30)
    assert (totals["acknowledged"], totals["pending"]) == (4, 0)
    assert {(m["type"], m["final"]) for m in rig.emulator.webhook_messages()} == {
        ("email.sent", "acknowledged"), ("email.delivered", "acknowledged"), ("email.opened", "acknowledged"),
        ("email.clicked", "acknowledged")}
    assert rig.db.execute("select decision, count(*) from mail.webhook_event group by decision").fetchall() == [
        ("test_email", 4)]
    test = _test_email(rig.db)
    assert (test["provider_message_id"], test["outcome"], test["opens"], test["clicks"]) == (pid, "delivered", 1, 1)
    assert sorted(r[1] for r in _recorded(rig.db)) == ["clicked", "delivered", "opened", "sent"]
    assert alert_lines(rig.db) == ([], [])


# -- the upgrade --------------------------------------------------------------------------------------


@pytest.fixture
def fresh(pg_admin_dsn: str) -> Iterator[str]:
    name = f"mailflow_testmail_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    yield dsn
    devenv.drop_database(pg_admin_dsn, name)


def test_test_emails_sent_before_the_upgrade_get_their_given_up_webhooks_back(fresh: str) -> None:
    with psycopg.connect(fresh, autocommit=True) as conn:
        migrate(conn, target=31)
        cid = conn.execute(
            "insert into mail.campaign (name, template, subject, from_address, recipients_table, timezone,"
            " emails_per_day, weekdays, windows, start_at) values ('old_spring', 'outreach', 'Hi', 'a@mail.example.com',"
            " 'x', 'UTC', 10, '{1,2,3,4,5}', '{09:00-17:00}', now()) returning id").fetchone()[0]  # type: ignore[index]
        conn.execute("insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor) values"
                     " (%s, 'draft', 'draft', %s, 'tester')", (cid, psycopg.types.json.Jsonb({
                         "reason": "test_email", "provider_id": "em_old", "to": "a***@example.com",
                         "idempotency_key": f"test-email/old_spring/{'ab' * 16}", "subject": "[TEST] Hi"})))
        body = envelope("bounced", "em_old", TO, bounce_type="Permanent")
        conn.execute("insert into mail.webhook_event (svix_id, event_type, provider_message_id, payload, applied_at,"
                     " attempts, decision, alerted_at, received_at) values ('msg_old', 'email.bounced', 'em_old',"
                     " %s, now(), 1200, 'unknown_email', now(), now() - interval '4 days')",
                     (psycopg.types.json.Jsonb(body),))

        migrate(conn)

        row = conn.execute("select campaign_id, tag, provider_message_id, email, to_masked, status from mail.test_email"
                           ).fetchone()
        assert row == (cid, "ab" * 16, "em_old", None, "a***@example.com", "sent")
        assert conn.execute("select decision, applied_at from mail.webhook_event").fetchone() == (None, None)
        swept = apply_pending(conn, give_up_after=timedelta(hours=72))
        assert (swept.taken, swept.test_emails, swept.unknown_email, swept.suppressed) == (1, 1, 0, 1)
        assert conn.execute("select decision, alerted_at is not null from mail.webhook_event").fetchone() == (
            "test_email", True)
        assert conn.execute("select outcome from mail.test_email").fetchone() == ("hard_bounced",)
        assert conn.execute("select email, source from mail.suppression").fetchone() == (TO, "bounce")
        assert alert_lines(conn) == ([], [])
        migrate(conn)  # nothing left to do: idempotent
        assert conn.execute("select count(*) from mail.test_email").fetchone() == (1,)
