"""The webhook receiver and the safety-net poll decide alike (one outcomes module), and the poll only asks
about emails without an outcome, within its share of the rate limit."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from starlette.testclient import TestClient
from test_feedback import Rig, rig  # noqa: F401 - the poll's rig (emulator, engine, pacer) and its fixture
from webhook_rig import SECRET, envelope, signed

from mailflow.feedback.deliverability import request_budget
from mailflow.feedback.webhooks import GroupWriter, connect_factory, create_app


@pytest.fixture
def receiver(rig: Rig, db_dsn: str) -> Iterator[TestClient]:  # noqa: F811
    rig.db.execute("truncate mail.webhook_event")
    app = create_app([SECRET], connect_factory(db_dsn), writer=GroupWriter(connect_factory(db_dsn), sweep_every=0))
    with TestClient(app) as c:
        yield c


def _rows(db: psycopg.Connection) -> dict[str, tuple[int, str]]:
    return {r[0]: (r[1], r[2]) for r in db.execute("select email, id, provider_message_id from mail.send_log").fetchall()}


def test_the_poll_and_the_webhook_record_the_same_outcome(rig: Rig, receiver: TestClient) -> None:  # noqa: F811
    users = {i: f"user{i}@example.com" for i in range(1, 7)}
    rig.users(users)
    rig.emulator.configure(bounce=[users[1], users[2]], complain=[users[3], users[4]])
    assert rig.send("feedback_a") == dict.fromkeys(users, "sent")
    rows = _rows(rig.db)
    pushed = {1: "bounced", 3: "complained", 5: "delivered"}  # by webhook; 2, 4 and 6 are left to the poll
    for uid, kind in pushed.items():
        body, headers = signed(envelope(kind, rows[users[uid]][1], users[uid]))
        assert receiver.post("/resend", content=body, headers=headers).json()["decision"] == "applied"

    s = rig.poll()
    assert (s.due, s.checked, s.bounced, s.complained, s.suppressed) == (3, 3, 1, 1, 2)  # only those without outcome
    got = {r[0]: tuple(r[1:]) for r in rig.db.execute(
        "select l.email, ds.outcome, ds.hard_bounced_at is not null, ds.complained_at is not null,"
        " ds.delivered_at is not null, sp.source"
        " from mail.delivery_status ds join mail.send_log l on l.id = ds.send_log_id"
        " left join mail.suppression sp on sp.email_key = l.email_key").fetchall()}
    expected = {"bounced": ("hard_bounced", True, False, False, "bounce"),
                "complained": ("complained", False, True, False, "complaint"),
                "delivered": ("delivered", False, False, True, None)}
    for webhook_user, kind in pushed.items():
        polled_user = webhook_user + 1
        assert got[users[webhook_user]] == got[users[polled_user]] == expected[kind], kind
    sources = dict(rig.db.execute("select l.email, string_agg(e.source || ':' || e.event, ',')"
                                  " from mail.delivery_event e join mail.send_log l on l.id = e.send_log_id"
                                  " group by l.email").fetchall())
    assert sources == {users[1]: "webhook:bounced", users[2]: "poll:bounced", users[3]: "webhook:complained",
                       users[4]: "poll:complained", users[5]: "webhook:delivered", users[6]: "poll:delivered"}
    notes = [r[0] for r in rig.db.execute("select error from mail.send_event where error like 'feedback:%'"
                                          " order by id").fetchall()]
    assert notes == ["feedback: webhook email.bounced (Permanent); address suppressed for all mail (source bounce)",
                     "feedback: webhook email.complained; address suppressed for all mail (source complaint)",
                     "feedback: last_event bounced; address suppressed for all mail (source bounce)",
                     "feedback: last_event complained; address suppressed for all mail (source complaint)"]
    assert rig.poll().due == 0


def test_the_poll_waits_an_hour_by_default_and_spends_only_its_request_budget(rig: Rig) -> None:  # noqa: F811
    assert request_budget(10, 0.01, 1800) == 180  # 1% of a 10/s account's slots between two half-hourly runs
    assert request_budget(2, 0.01, 1800) == 36 and request_budget(10, 0.0, 1800) == 0
    with pytest.raises(ValueError):
        request_budget(10, 1.5, 1800)

    rig.users({i: f"user{i}@example.com" for i in range(1, 6)})
    rig.send("feedback_a")
    from mailflow.feedback.deliverability import poll_feedback

    assert poll_feedback(rig.conn(), rig.client()).due == 0  # sent just now: webhooks come first (min_age 1 h)
    client = rig.client()
    s = rig.poll(client, max_requests=2)
    assert (s.due, s.checked, s.requests, s.request_budget) == (2, 2, 2, 2)
    assert client.pacer.claims == 2  # type: ignore[attr-defined]
    s = rig.poll(max_requests=0)
    assert (s.due, s.requests, s.stopped) == (0, 0, "request budget (0 requests) spent")
    # retries count: every GET answered 503 is retried (3 attempts), and the budget ends the run there
    rig.emulator.configure(outage=True)
    s = rig.poll(max_requests=4)
    assert (s.due, s.checked, s.errors, s.requests, s.stopped) == (3, 0, 1, 4, "request budget (4 requests) spent")
