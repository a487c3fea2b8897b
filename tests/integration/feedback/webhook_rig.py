"""Helpers for the webhook receiver tests: signed Resend envelopes, seeded send-log rows, readers of the
inbox, the typed events, the outcome columns and the suppressions."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from mailflow.feedback.webhook_verify import sign
from mailflow.feedback.webhooks import GroupWriter, connect_factory, create_app
from mailflow.store.policy import mailbox_key

SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SECOND = "whsec_c2Vjb25kLXNlY3JldC0wMTIzNDU2Nzg5YWJjZA=="
RETIRED = "whsec_cmV0aXJlZC1zZWNyZXQtMDEyMzQ1Njc4OWFiY2Q="
T0 = datetime(2026, 3, 2, 9, 0, tzinfo=UTC)
_ids = itertools.count(1)


def envelope(kind: str, email_id: str | None, to: str | list[str] | None = None, *, at: datetime = T0,
             bounce_type: str | None = None, **data: Any) -> dict[str, Any]:
    """A Resend webhook envelope (resend-openapi.yaml, ``webhooks:``) for ``email.<kind>``."""
    body: dict[str, Any] = {"email_id": email_id, "created_at": T0.isoformat().replace("+00:00", "Z"),
                            "from": "Practice Team <practice@mail.example.com>",
                            "to": [to] if isinstance(to, str) else to, "subject": "Hello"}
    if email_id is None:
        body.pop("email_id")
    if kind == "bounced":
        body["bounce"] = {"type": bounce_type or "Permanent", "subType": "General", "message": "no such user"}
    if kind == "failed":
        body["failed"] = {"reason": "reached_daily_quota"}
    body.update(data)
    return {"type": f"email.{kind}" if "." not in kind else kind,
            "created_at": at.isoformat().replace("+00:00", "Z"), "data": body}


def signed(payload: dict[str, Any] | bytes, *, secret: str = SECRET, svix_id: str | None = None,
           timestamp: int | None = None) -> tuple[bytes, dict[str, str]]:
    """``(body, headers)`` of a webhook signed as the provider does."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    sid = svix_id or f"msg_{next(_ids):027d}"
    ts = int(time.time()) if timestamp is None else timestamp
    return body, {"svix-id": sid, "svix-timestamp": str(ts), "svix-signature": sign(secret, sid, ts, body),
                  "content-type": "application/json"}


def seed_sent(db: psycopg.Connection, rows: dict[str, str], campaign: str = "welcome") -> dict[str, int]:
    """Sent send-log rows ``{provider id: address}`` (user ids 1, 2, ...); returns provider id -> send_log.id."""
    out = {}
    for pid, address in rows.items():
        uid = db.execute("select coalesce(max(user_id), 0) + 1 from mail.send_log").fetchone()[0]  # type: ignore[index]
        out[pid] = db.execute(
            "insert into mail.send_log (user_id, campaign, email, email_key, status, sent_at, provider_message_id)"
            " values (%s, %s, %s, %s, 'sent', now() - interval '2 hours', %s) returning id",
            (uid, campaign, address, mailbox_key(address), pid)).fetchone()[0]  # type: ignore[index]
    return out


def inbox(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    """``(svix_id, event_type, provider id, decision, applied, attempts)`` of every inbox row, by svix-id."""
    return db.execute("select svix_id, event_type, provider_message_id, decision, applied_at is not null, attempts"
                      " from mail.webhook_event order by svix_id").fetchall()


OUTCOME_COLUMNS = ("outcome", "delivered_at", "hard_bounced_at", "soft_bounced_at", "complained_at", "failed_at",
                   "delayed_at", "suppressed_at", "first_opened_at", "first_clicked_at", "opens", "clicks")


def status(db: psycopg.Connection, send_log_id: int) -> dict[str, Any] | None:
    """The outcome columns of one email's delivery_status (None: no row)."""
    row = db.execute(f"select {', '.join(OUTCOME_COLUMNS)} from mail.delivery_status where send_log_id = %s",
                     (send_log_id,)).fetchone()
    return None if row is None else dict(zip(OUTCOME_COLUMNS, row, strict=True))


def suppressions(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    """``(user_id, email, email_key, scope, source)`` of every suppression, by id."""
    return db.execute("select user_id, email, email_key, scope, source from mail.suppression order by id").fetchall()


def events(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    """``(send_log_id, event, bounce_type, occurred_at, source)`` of every delivery event, by id."""
    return db.execute("select send_log_id, event, bounce_type, occurred_at, source from mail.delivery_event"
                      " order by id").fetchall()


def decisions(db: psycopg.Connection) -> list[tuple[int, str]]:
    """``(send_log_id, error)`` of every feedback decision kept as a send event, by id."""
    return db.execute("select send_log_id, error from mail.send_event where error like 'feedback:%%'"
                      " order by id").fetchall()


def at(minutes: float) -> datetime:
    return T0 + timedelta(minutes=minutes)


def post(client: Any, payload: dict[str, Any] | bytes, **kw: Any) -> Any:
    """POST ``payload`` signed (:func:`signed`'s keywords) to the receiver's ``/resend``."""
    body, headers = signed(payload, **kw)
    return client.post("/resend", content=body, headers=headers)


@pytest.fixture
def wdb(db: psycopg.Connection) -> psycopg.Connection:
    """The send log, emptied (the ``db`` fixture empties the webhook inbox and the delivery events too).
    Test modules import this fixture and :func:`client` from here."""
    return db


@pytest.fixture
def client(wdb: psycopg.Connection, db_dsn: str) -> Iterator[TestClient]:
    """The receiver with both secrets and no sweep loop (the tests run apply_pending themselves)."""
    app = create_app([SECRET, SECOND], connect_factory(db_dsn),
                     writer=GroupWriter(connect_factory(db_dsn), sweep_every=0))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c
