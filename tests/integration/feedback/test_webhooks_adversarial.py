"""Adversarial tests of the webhook receiver, the outcome SQL and the recipient check, against a real
PostgreSQL through the real app (Starlette TestClient) and a real uvicorn server where the transport
matters: every malformed input is a clear 4xx, a forged or replayed request changes nothing, a 2xx follows
a COMMIT only, and outcomes do not depend on arrival order or on two writers at once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from starlette.testclient import TestClient
from test_webhooks_server import receiver
from webhook_rig import (
    SECRET,
    at,
    client,  # noqa: F401 - a fixture
    envelope,
    events,
    inbox,
    post,
    seed_sent,
    signed,
    status,
    suppressions,
    wdb,  # noqa: F401 - a fixture
)

from mailflow.feedback.webhook_ingest import WebhookEvent, ingest, parse_event
from mailflow.feedback.webhook_verify import sign
from mailflow.feedback.webhooks import GroupWriter, Unavailable, connect_factory, create_app
from mailflow.store.outcomes import provider_recipient, recipient_matches
from mailflow.store.sql import query


def stored(db: psycopg.Connection) -> int:
    return db.execute("select count(*) from mail.webhook_event").fetchone()[0]  # type: ignore[index]


# -- signatures ------------------------------------------------------------------------------------


@pytest.mark.parametrize("junk", ["v1", "v1,a,b", "garbage", "v1,!!!notbase64", "v2,abc"])
def test_a_signature_list_with_a_junk_entry_before_a_valid_one_is_accepted(
        client: TestClient, wdb: psycopg.Connection, junk: str) -> None:
    body, headers = signed(envelope("delivered", "em_x", "x@example.com"), svix_id="msg_junk")
    headers["svix-signature"] = f"{junk} {headers['svix-signature']}"
    r = client.post("/resend", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert [row[0] for row in inbox(wdb)] == ["msg_junk"]


@pytest.mark.parametrize("junk", ["v1", "v1,a,b", "garbage", "v1,!!!notbase64", "  "])
def test_a_signature_list_of_junk_only_is_4xx_and_stores_nothing(
        client: TestClient, wdb: psycopg.Connection, junk: str) -> None:
    body, headers = signed(envelope("delivered", "em_x", "x@example.com"))
    headers["svix-signature"] = junk
    r = client.post("/resend", content=body, headers=headers)
    assert r.status_code in (400, 401), r.text
    assert stored(wdb) == 0


def test_a_captured_event_replayed_with_a_fresh_timestamp_or_a_new_id_is_refused(
        client: TestClient, wdb: psycopg.Connection) -> None:
    ids = seed_sent(wdb, {"em_r": "r@example.com"})
    body, headers = signed(envelope("bounced", "em_r", "r@example.com"), svix_id="msg_orig",
                           timestamp=int(time.time()) - 10)
    assert client.post("/resend", content=body, headers=headers).status_code == 200
    fresh = dict(headers, **{"svix-timestamp": str(int(time.time()))})
    renamed = dict(headers, **{"svix-id": "msg_other"})
    assert client.post("/resend", content=body, headers=fresh).status_code == 401
    assert client.post("/resend", content=body, headers=renamed).status_code == 401
    assert client.post("/resend", content=body, headers=headers).json() == {"received": True, "duplicate": True}
    assert [row[0] for row in inbox(wdb)] == ["msg_orig"]
    assert len(events(wdb)) == 1 and status(wdb, ids["em_r"])["outcome"] == "hard_bounced"  # type: ignore[index]


# -- bodies ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", [
    b'{"type": "email.delivered", "created_at": "2026-03-02T09:00:00Z", "data": {"email_id": "em_n", "n": NaN}}',
    b'{"type": "email.delivered", "data": {"email_id": "em_n", "n": Infinity}}',
    b'{"type": "email.delivered", "data": {"email_id": "em_n", "n": -Infinity}}',
    b'{"type": "email.delivered", "data": ' + b'[' * 100_000 + b']' * 100_000 + b'}',
    b'[1, 2]', b'"email.delivered"', b'null', b'{"type": 5}', b'{"type": ""}', b'not json', b'',
    b'\xff\xfe{"type": "email.delivered"}',
])
def test_a_signed_body_that_is_not_an_event_is_400_and_stores_nothing(
        client: TestClient, wdb: psycopg.Connection, body: bytes) -> None:
    sid = "msg_bad"
    ts = int(time.time())
    try:
        sig = sign(SECRET, sid, ts, body)
    except ValueError:
        sig = "v1,AAAA"
    r = client.post("/resend", content=body, headers={"svix-id": sid, "svix-timestamp": str(ts),
                                                      "svix-signature": sig})
    assert r.status_code == 400, r.text
    assert stored(wdb) == 0


@pytest.mark.parametrize("data", [
    None, {}, {"email_id": 17, "to": ["a@example.com"]}, {"email_id": ["em_1"]}, {"email_id": ""},
    {"email_id": "em_u", "to": "u@example.com"}, {"email_id": "em_u", "to": 5}, {"email_id": "em_u", "to": [None]},
    {"email_id": "em_u", "to": [{"a": 1}]}, {"email_id": "em_u", "to": ["ü@exämple.com"]},
    {"email_id": "em_u", "bounce": "Permanent", "to": ["u@example.com"]},
    {"email_id": "em_u", "bounce": {"type": ["Permanent"]}, "to": ["u@example.com"]},
])
@pytest.mark.parametrize("kind", ["email.bounced", "email.opened"])
def test_odd_data_never_500s_and_never_hard_bounces(client: TestClient, wdb: psycopg.Connection,
                                                     data: Any, kind: str) -> None:
    ids = seed_sent(wdb, {"em_u": "u@example.com"})
    payload: dict[str, Any] = {"type": kind, "created_at": "garbage \u2603"}
    if data is not None:
        payload["data"] = data
    r = post(client, payload)
    assert r.status_code == 200, r.text
    assert suppressions(wdb) == []
    st = status(wdb, ids["em_u"])
    assert st is None or st["hard_bounced_at"] is None


@pytest.mark.parametrize("created_at", ["garbage", "", 12345, None, "2026-13-45T99:00:00Z", "2026-03-02T09:00:00",
                                        "9999-12-31T23:59:59-14:00", "0001-01-01T00:00:00+14:00", "x" * 10_000])
def test_created_at_garbage_is_stored_and_applied(client: TestClient, wdb: psycopg.Connection,
                                                 created_at: Any) -> None:
    ids = seed_sent(wdb, {"em_c": "c@example.com"})
    payload = envelope("delivered", "em_c", "c@example.com")
    payload["created_at"] = created_at
    r = post(client, payload)
    assert r.status_code == 200, r.text
    assert status(wdb, ids["em_c"])["outcome"] == "delivered"  # type: ignore[index]


def test_a_body_at_the_limit_is_read_and_one_byte_over_is_413(wdb: psycopg.Connection, db_dsn: str) -> None:
    limit = 4096
    app = create_app([SECRET], connect_factory(db_dsn), max_body_bytes=limit,
                     writer=GroupWriter(connect_factory(db_dsn), sweep_every=0))
    base = envelope("delivered", "em_l", "l@example.com")
    base["data"]["pad"] = ""
    pad = limit - len(json.dumps(base).encode())
    with TestClient(app, raise_server_exceptions=False) as c:
        for extra, want in ((pad, 200), (pad + 1, 413)):
            base["data"]["pad"] = "p" * extra
            body, headers = signed(base)
            assert len(body) == limit + (extra - pad)
            assert c.post("/resend", content=body, headers=headers).status_code == want
            # chunked (no content-length): the same limit while streaming
            body, headers = signed(base)
            r = c.post("/resend", content=iter([body[:100], body[100:]]), headers=headers)
            assert r.status_code == want, r.text


# -- recipients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("to", [["a@x.com, b@y.com"], ["Name <a@x.com>, b@y.com"], ["a@x.com;b@y.com"],
                                ["a@x.com <b@y.com>"], ["b@y.com <a@x.com>"], ["evil <a@x.com> <b@y.com>"],
                                ["a@x.com", "b@y.com"], [], None, "a@x.com, b@y.com"])
def test_several_recipients_never_match_one_address(to: Any) -> None:
    assert recipient_matches(to, "a@x.com") is False


@pytest.mark.parametrize("to", [["a@x.com"], ["A@X.COM"], ["Ann <a@x.com>"], ['"Smith, Ann" <A@x.com>'], " a@x.com ",
                                ["<a@x.com>"]])
def test_one_recipient_with_a_display_name_or_case_matches(to: Any) -> None:
    assert recipient_matches(to, "a@x.com") is True


@pytest.mark.parametrize("to", [["a@x.com, b@y.com"], ["a@x.com <b@y.com>"], ["x <a@x.com> <b@y.com>"]])
def test_the_providers_recipient_is_none_when_it_names_several(to: Any) -> None:
    assert provider_recipient(to) is None


# -- concurrency -----------------------------------------------------------------------------------


def test_two_writers_applying_opens_of_one_email_at_once_lose_no_count(wdb: psycopg.Connection, db_dsn: str) -> None:
    ids = seed_sent(wdb, {"em_cc": "cc@example.com"})
    n, writers = 60, 4
    groups = [[parse_event(f"msg_cc_{w}_{i}", json.dumps(envelope(
        "opened" if i % 2 else "clicked", "em_cc", "cc@example.com", at=at(w + i))).encode()) for i in range(n)]
        for w in range(writers)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(writers)

    def run(group: list[Any]) -> None:
        try:
            with psycopg.connect(db_dsn, autocommit=True) as conn:
                barrier.wait()
                for i in range(0, len(group), 5):
                    ingest(conn, group[i:i + 5])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = status(wdb, ids["em_cc"])
    assert st is not None
    assert (st["opens"], st["clicks"], st["outcome"], st["delivered_at"]) == (writers * n // 2, writers * n // 2,
                                                                            "delivered", at(0))


class _Poison(WebhookEvent):
    """An event our own code fails on (not the database): it must not fail the events grouped with it."""

    def report(self) -> Any:
        raise TypeError("unhashable type: 'list'")


def test_an_event_our_code_fails_on_does_not_fail_its_group(wdb: psycopg.Connection, db_dsn: str) -> None:
    ids = seed_sent(wdb, {"em_g1": "g1@example.com", "em_g2": "g2@example.com"})
    good = [parse_event(f"msg_g{i}", json.dumps(envelope("delivered", f"em_g{i}", f"g{i}@example.com")).encode())
            for i in (1, 2)]
    bad = parse_event("msg_gbad", json.dumps(envelope("delivered", "em_g1", "g1@example.com")).encode())
    poison = _Poison(**{f.name: getattr(bad, f.name) for f in dataclasses.fields(bad)})

    async def run() -> list[Any]:
        writer = GroupWriter(connect_factory(db_dsn), lanes=1, sweep_every=0)
        try:
            return await asyncio.gather(*(writer.submit(e) for e in (good[0], poison, good[1])),
                                        return_exceptions=True)
        finally:
            await writer.aclose()

    got = asyncio.run(run())
    assert got[0] == "applied" and got[2] == "applied"
    assert isinstance(got[1], Unavailable)
    assert [row[0] for row in inbox(wdb)] == ["msg_g1", "msg_g2"]
    assert status(wdb, ids["em_g1"])["outcome"] == "delivered"  # type: ignore[index]


# -- transport (the standalone server: uvicorn with the receiver's limits) ---------------------------


def _recv_all(s: socket.socket, deadline: float) -> bytes:
    got = b""
    while time.monotonic() < deadline:
        try:
            part = s.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not part:
            break
        got += part
    return got


def test_slow_headers_trickled_chunks_and_huge_headers_get_4xx_or_a_close(wdb: psycopg.Connection, db_dsn: str,
                                                                          tmp_path: Path) -> None:
    seed_sent(wdb, {"em_t": "t@example.com"})
    body, headers = signed(envelope("bounced", "em_t", "t@example.com"), svix_id="msg_trickle")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with receiver(db_dsn, tmp_path, "--header-timeout", "1", "--body-timeout", "1", "--sweep-every", "0") as base:
        port = int(base.rsplit(":", 1)[1])
        # slowloris: the request line and headers one byte at a time, never finished
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        started = time.monotonic()
        closed = False
        for ch in b"POST /resend HTTP/1.1\r\nHost: x\r\n" + head.encode():
            try:
                s.sendall(bytes([ch]))
            except OSError:
                closed = True
                break
            time.sleep(0.05)
            if time.monotonic() - started > 6:
                break
        got = _recv_all(s, time.monotonic() + 2) if not closed else b""
        s.close()
        assert closed or got == b"" or got.startswith(b"HTTP/1.1 4"), got[:80]
        assert time.monotonic() - started < 6

        # a chunked body trickled forever: cut off by the body timeout, nothing stored
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(f"POST /resend HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n{head}\r\n".encode())
        started = time.monotonic()
        got = b""
        for i in range(40):
            try:
                s.sendall(b"1\r\n" + body[i:i + 1] + b"\r\n")
            except OSError:
                break
            s.settimeout(0.25)
            try:
                got = s.recv(4096)
            except TimeoutError:
                continue
            break
        s.close()
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:80]
        assert time.monotonic() - started < 6

        # headers far larger than any provider's: refused, never a 5xx, and the server still answers
        huge = dict(headers, **{"svix-signature": "v1,AAAA " * 20_000})
        try:
            r = httpx.post(f"{base}/resend", content=body, headers=huge, timeout=5)
            assert 400 <= r.status_code < 500, r.status_code
        except httpx.TransportError:
            pass  # the server closed the connection: also a refusal
        assert inbox(wdb) == []
        r = httpx.post(f"{base}/resend", content=body, headers=headers, timeout=5)
        assert r.status_code == 200 and [x[0] for x in inbox(wdb)] == ["msg_trickle"]


# -- the safety-net poll -----------------------------------------------------------------------------


def test_the_poll_asks_about_emails_without_a_final_outcome_only(client: TestClient, wdb: psycopg.Connection) -> None:
    ids = seed_sent(wdb, {"em_none": "n@example.com", "em_delayed": "d@example.com", "em_deliv": "v@example.com",
                          "em_soft": "s@example.com", "em_hard": "h@example.com", "em_open": "o@example.com",
                          "em_sent": "e@example.com"})
    for kind, pid, to, kw in (("delivery_delayed", "em_delayed", "d@example.com", {}),
                              ("delivered", "em_deliv", "v@example.com", {}),
                              ("bounced", "em_soft", "s@example.com", {"bounce_type": "Transient"}),
                              ("bounced", "em_hard", "h@example.com", {}),
                              ("opened", "em_open", "o@example.com", {}),
                              ("sent", "em_sent", "e@example.com", {})):
        assert post(client, envelope(kind, pid, to, **kw)).status_code == 200
    due = wdb.execute(query("feedback", "due_checks"), {
        "lookback_seconds": 48 * 3600, "min_age_seconds": 3600, "recheck_seconds": 7200, "max_checks": 4,
        "limit": 100}).fetchall()
    # a delay is no outcome yet: if the delivery or bounce that follows is never pushed, only the poll finds it
    assert sorted(r[0] for r in due) == sorted([ids["em_none"], ids["em_delayed"], ids["em_sent"]])
    # younger than the configured age: not yet
    assert wdb.execute(query("feedback", "due_checks"), {
        "lookback_seconds": 48 * 3600, "min_age_seconds": 3 * 3600, "recheck_seconds": 7200, "max_checks": 4,
        "limit": 100}).fetchall() == []
