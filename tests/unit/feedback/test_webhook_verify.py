"""Verification of the provider's signed webhooks (Svix scheme through standardwebhooks): every secret of a
rotation, the time window, and every malformed input a 4xx."""

from __future__ import annotations

import json
import time

import pytest

from mailflow.feedback.webhook_ingest import MalformedEvent, parse_event
from mailflow.feedback.webhook_verify import NoSecrets, Rejected, WebhookVerifier, parse_secrets, sign

NEW = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
OLD = "whsec_c2Vjb25kLXNlY3JldC0wMTIzNDU2Nzg5YWJjZA=="
# The library checks the time window on its own clock too, so the tests use the real clock, read when each
# request is made (a long test session moves it on).
BODY = json.dumps({"type": "email.delivered", "created_at": "2026-05-28T20:26:40Z",
                   "data": {"email_id": "em_1", "to": ["a@example.com"]}}).encode()


def headers(secret: str = NEW, *, ts: int | None = None, msg_id: str = "msg_1", body: bytes = BODY) -> dict[str, str]:
    ts = int(time.time()) if ts is None else ts
    return {"svix-id": msg_id, "svix-timestamp": str(ts), "svix-signature": sign(secret, msg_id, ts, body)}


def verifier(*secrets: str, now: int | None = None) -> WebhookVerifier:
    at = int(time.time()) if now is None else now
    return WebhookVerifier(list(secrets) or [NEW], clock=lambda: at)


def rejected(v: WebhookVerifier, body: bytes, h: dict[str, str]) -> tuple[int, str]:
    with pytest.raises(Rejected) as info:
        v.verify(body, h)
    return info.value.status, info.value.reason


def test_a_genuine_request_verifies_under_either_secret_of_a_rotation() -> None:
    v = verifier(NEW, OLD)
    assert v.verify(BODY, headers(NEW)).svix_id == "msg_1"
    h = headers(OLD)
    assert v.verify(BODY, h).timestamp == int(h["svix-timestamp"])
    assert v.count == 2
    # the standard header names are accepted too
    h = headers(OLD)
    std = {"webhook-id": h["svix-id"], "webhook-timestamp": h["svix-timestamp"], "webhook-signature": h["svix-signature"]}
    assert v.verify(BODY, std).svix_id == "msg_1"


def test_a_secret_that_was_rotated_out_no_longer_verifies() -> None:
    assert rejected(verifier(NEW), BODY, headers(OLD)) == (401, "no matching signature")


def test_a_changed_body_id_or_timestamp_does_not_verify() -> None:
    v = verifier()
    assert rejected(v, BODY.replace(b"em_1", b"em_2"), headers()) == (401, "no matching signature")
    h = headers()
    assert rejected(v, BODY, {**h, "svix-id": "msg_2"}) == (401, "no matching signature")
    assert rejected(v, BODY, {**h, "svix-timestamp": str(int(h["svix-timestamp"]) + 1)}) == (
        401, "no matching signature")


@pytest.mark.parametrize(("offset", "reason"), [(-301, "svix-timestamp too old"),
                                                (301, "svix-timestamp in the future")])
def test_timestamps_more_than_five_minutes_off_are_refused(offset: int, reason: str) -> None:
    now = int(time.time())
    assert rejected(verifier(now=now), BODY, headers(ts=now + offset)) == (401, reason)
    assert verifier(now=now).verify(BODY, headers(ts=now - 250)).timestamp == now - 250


@pytest.mark.parametrize("change", [
    {"svix-id": ""}, {"svix-timestamp": ""}, {"svix-signature": ""}, {"svix-id": "a b"}, {"svix-id": "x" * 257},
    {"svix-timestamp": "-5"}, {"svix-timestamp": "1e9"}, {"svix-timestamp": "nan"}, {"svix-timestamp": "9" * 13},
    {"svix-signature": "v1"}, {"svix-signature": "v1,!!"}, {"svix-signature": "v1,a,b"}, {"svix-signature": "v1,YQ"},
    {"svix-signature": "x" * 5000},
])
def test_malformed_headers_are_400_never_an_exception(change: dict[str, str]) -> None:
    status, _reason = rejected(verifier(), BODY, {**headers(), **change})
    assert status in (400, 401)
    if any(k in change for k in ("svix-id", "svix-timestamp")) or change.get("svix-signature") in ("", "v1"):
        assert status == 400


def test_a_body_that_is_not_utf8_is_400() -> None:
    body = b"\xff\xfe" + BODY
    h = {"svix-id": "msg_1", "svix-timestamp": str(int(time.time())), "svix-signature": "v1,AAAA"}
    assert rejected(verifier(), body, h) == (400, "body is not UTF-8")


def test_secrets_are_parsed_from_text_and_never_echoed() -> None:
    assert parse_secrets(f" {NEW},{OLD}\n") == [NEW, OLD]
    with pytest.raises(NoSecrets, match="no webhook signing secret"):
        parse_secrets(" , ")
    with pytest.raises(NoSecrets) as info:
        parse_secrets(f"{NEW} whsec_%%%notbase64")
    assert "#2" in str(info.value) and "notbase64" not in str(info.value)
    with pytest.raises(NoSecrets):
        WebhookVerifier([])


def test_parse_event_reads_the_envelope_and_refuses_what_is_not_one() -> None:
    e = parse_event("msg_1", BODY)
    assert (e.event_type, e.provider_message_id, e.occurred_at.isoformat()) == (  # type: ignore[union-attr]
        "email.delivered", "em_1", "2026-05-28T20:26:40+00:00")  # the envelope's created_at, not the header
    report = e.report()
    assert report is not None and (report.event, report.source, report.recipients) == (
        "delivered", "webhook", ["a@example.com"])
    bounce = parse_event("m", json.dumps({"type": "email.bounced", "data": {"email_id": "x", "bounce": {}}}).encode())
    assert bounce.report().bounce_type == "Undetermined"  # type: ignore[union-attr]  # never a hard bounce
    assert parse_event("m", b'{"type": "contact.created", "data": {}}').report() is None
    for bad in (b"[]", b"{}", b'{"type": ""}', b"nope", b'{"type": 1}'):
        with pytest.raises(MalformedEvent):
            parse_event("m", bad)
