"""The webhook receiver against a real PostgreSQL through the real app (Starlette TestClient): verification,
durability before the 2xx, duplicates, the database down, and what each event does to the send log."""

from __future__ import annotations

import itertools
import json
import random
import time
from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from starlette.testclient import TestClient
from webhook_rig import (
    RETIRED,
    SECOND,
    SECRET,
    at,
    client,  # noqa: F401 - a fixture
    decisions,
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

from mailflow.feedback.webhooks import (
    GroupWriter,
    alert_lines,
    apply_pending,
    connect_factory,
    create_app,
    mark_alerted,
)

# -- verification -----------------------------------------------------------------------------------


def test_a_valid_event_is_committed_before_the_200(client: TestClient, wdb: psycopg.Connection, db_dsn: str) -> None:
    ids = seed_sent(wdb, {"em_1": "user1@example.com"})
    r = post(client, envelope("delivered", "em_1", "user1@example.com", at=at(1)), svix_id="msg_a")
    assert (r.status_code, r.json()) == (200, {"received": True, "decision": "applied"})
    with psycopg.connect(db_dsn) as other:  # another session sees it at once: it was committed
        assert inbox(other) == [("msg_a", "email.delivered", "em_1", "applied", True, 0)]
        assert status(other, ids["em_1"]) == {
            "outcome": "delivered", "delivered_at": at(1), "hard_bounced_at": None, "soft_bounced_at": None,
            "complained_at": None, "failed_at": None, "delayed_at": None, "suppressed_at": None,
            "first_opened_at": None, "first_clicked_at": None, "opens": 0, "clicks": 0}
        assert events(other) == [(ids["em_1"], "delivered", None, at(1), "webhook")]
        row = other.execute("select last_event, final, checks, first_checked_at, checked_at"
                            " from mail.delivery_status").fetchone()
        assert row == ("webhook", False, 0, None, None)
        stored = other.execute("select payload from mail.webhook_event").fetchone()[0]  # type: ignore[index]
        assert stored == envelope("delivered", "em_1", "user1@example.com", at=at(1))


def test_a_forged_signature_is_401_and_stores_nothing(client: TestClient, wdb: psycopg.Connection) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    body, headers = signed(envelope("bounced", "em_1", "user1@example.com"))
    forged = body.replace(b"user1@", b"user2@")  # the signature was made over another body
    r = client.post("/resend", content=forged, headers=headers)
    assert (r.status_code, r.json()) == (401, {"error": "no matching signature"})
    assert post(client, envelope("bounced", "em_1", "user1@example.com"),
                secret="whsec_" + "Zm9yZ2VkLWJ5LXNvbWVvbmUtZWxzZQ==").status_code == 401
    assert inbox(wdb) == [] and suppressions(wdb) == []


def test_rotation_accepts_the_second_secret_and_refuses_a_retired_one(client: TestClient,
                                                                       wdb: psycopg.Connection) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    assert post(client, envelope("delivered", "em_1", "user1@example.com"), secret=RETIRED,
                svix_id="msg_old").status_code == 401
    assert post(client, envelope("delivered", "em_1", "user1@example.com"), secret=SECOND,
                svix_id="msg_second").status_code == 200
    # the provider signs with both while rotating: one valid entry among several is enough
    body, headers = signed(envelope("opened", "em_1", "user1@example.com"), secret=RETIRED, svix_id="msg_both")
    _, good = signed(body, secret=SECRET, svix_id="msg_both", timestamp=int(headers["svix-timestamp"]))
    headers["svix-signature"] = f"{headers['svix-signature']} {good['svix-signature']}"
    assert client.post("/resend", content=body, headers=headers).status_code == 200
    assert [r[0] for r in inbox(wdb)] == ["msg_both", "msg_second"]


@pytest.mark.parametrize(("offset", "error"), [(-301, "svix-timestamp too old"),
                                               (301, "svix-timestamp in the future")])
def test_stale_and_future_timestamps_are_refused(client: TestClient, wdb: psycopg.Connection, offset: int,
                                                 error: str) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    r = post(client, envelope("bounced", "em_1", "user1@example.com"), timestamp=int(time.time()) + offset)
    assert (r.status_code, r.json()) == (401, {"error": error})
    assert inbox(wdb) == [] and suppressions(wdb) == []


def _mutations(headers: dict[str, str], rng: random.Random) -> Iterator[dict[str, str]]:
    junk = ["", " ", "v1", "v1,", ",", "v1,!!!", "v1,a", "v2,abc", "v1,====", "v1,YWJj v1", "\u00e9", "0" * 5000,
            "-1", "1e9", "nan", "inf", "1" * 30, "msg id", "v1,AAAA,BBBB", "v1 ,x", "\t", "v1,\u00ff\u00fe"]
    names = ["svix-id", "svix-timestamp", "svix-signature"]
    for name in names:  # each header missing, or every junk value
        yield {k: v for k, v in headers.items() if k != name}
        for j in junk:
            yield {**headers, name: j}
    for _ in range(200):  # random combinations, truncations and flipped characters
        h = dict(headers)
        for name in rng.sample(names, rng.randint(1, 3)):
            v = h[name]
            choice = rng.randrange(4)
            if choice == 0:
                h[name] = v[: rng.randrange(len(v) + 1)]
            elif choice == 1 and v:
                i = rng.randrange(len(v))
                h[name] = v[:i] + rng.choice("x,. =/+\u00e90") + v[i + 1:]
            elif choice == 2:
                h[name] = rng.choice(junk)
            else:
                h.pop(name)
        yield h


def test_hundreds_of_malformed_header_sets_get_4xx_never_5xx(client: TestClient, wdb: psycopg.Connection) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    body, headers = signed(envelope("bounced", "em_1", "user1@example.com"))
    statuses: dict[int, int] = {}
    tried = 0
    for h in _mutations(headers, random.Random(7)):
        if h == headers:
            continue
        raw = [(k.encode(), v.encode("utf-8")) for k, v in h.items()]
        r = client.post("/resend", content=body, headers=raw)  # type: ignore[arg-type]
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        tried += 1
    assert tried >= 250
    assert set(statuses) <= {400, 401}, statuses
    assert inbox(wdb) == [] and suppressions(wdb) == []
    # the body itself: not UTF-8, not JSON, not an envelope (each correctly signed)
    for bad in (b"\xff\xfe{}", b"not json", b"[1, 2]", b'{"data": {}}', b'{"type": 7}'):
        b2, h2 = signed(b"" if bad.startswith(b"\xff") else bad)
        if bad.startswith(b"\xff"):
            h2["svix-signature"] = "v1,AAAA"
            b2 = bad
        assert client.post("/resend", content=b2, headers=h2).status_code in (400, 401), bad
    assert inbox(wdb) == []


def test_an_oversize_body_is_413_before_it_is_read(client: TestClient, wdb: psycopg.Connection) -> None:
    payload = envelope("delivered", "em_1", "user1@example.com", padding="x" * (300 * 1024))
    r = post(client, payload)
    assert r.status_code == 413
    # no content-length: counted while streaming
    body, headers = signed(payload)

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = client.post("/resend", content=chunks(), headers=headers)
    assert r.status_code == 413 and inbox(wdb) == []


# -- durability -------------------------------------------------------------------------------------


def test_a_duplicate_svix_id_is_absorbed(client: TestClient, wdb: psycopg.Connection) -> None:
    ids = seed_sent(wdb, {"em_1": "user1@example.com"})
    opened = envelope("opened", "em_1", "user1@example.com", at=at(3))
    assert post(client, opened, svix_id="msg_open").json() == {"received": True, "decision": "applied"}
    for _ in range(3):  # the provider retries (its answer got lost, say): 200, nothing changes
        r = post(client, opened, svix_id="msg_open")
        assert (r.status_code, r.json()) == (200, {"received": True, "duplicate": True})
    assert inbox(wdb) == [("msg_open", "email.opened", "em_1", "applied", True, 0)]
    assert len(events(wdb)) == 1
    got = status(wdb, ids["em_1"])
    assert got is not None and (got["opens"], got["first_opened_at"], got["outcome"]) == (1, at(3), "delivered")


def test_the_database_down_answers_503_and_acknowledges_nothing(wdb: psycopg.Connection, db_dsn: str) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    down = create_app([SECRET], connect_factory("postgresql://postgres@127.0.0.1:1/nowhere", connect_timeout=1))
    with TestClient(down, raise_server_exceptions=False) as c:
        r = post(c, envelope("bounced", "em_1", "user1@example.com"), svix_id="msg_down")
        assert r.status_code == 503 and r.headers["retry-after"] == "30"
        assert r.json() == {"error": "event not stored; retry later"}
    assert inbox(wdb) == [] and suppressions(wdb) == []

    # the receiver's connection dies between requests (the server restarted, a proxy dropped it): the next
    # group is retried once on a fresh connection and stored; the provider is not made to retry
    # one lane, and no other use of its connection
    quiet = GroupWriter(connect_factory(db_dsn), lanes=1, sweep_every=0, guard_every=3600)
    app = create_app([SECRET], connect_factory(db_dsn), writer=quiet)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert post(c, envelope("delivered", "em_1", "user1@example.com"), svix_id="msg_1").status_code == 200
        wdb.execute("select pg_terminate_backend(pid) from pg_stat_activity"
                    " where datname = current_database() and pid <> pg_backend_pid()"
                    " and application_name not like 'pytest%%' and backend_type = 'client backend'")
        r = post(c, envelope("bounced", "em_1", "user1@example.com"), svix_id="msg_2")
        assert (r.status_code, r.json()) == (200, {"received": True, "decision": "applied"})
        assert post(c, envelope("bounced", "em_1", "user1@example.com"), svix_id="msg_2").json() == {
            "received": True, "duplicate": True}
    assert [x[0] for x in inbox(wdb)] == ["msg_1", "msg_2"]
    assert [s[4] for s in suppressions(wdb)] == ["bounce"]


def test_a_commit_that_fails_is_never_acknowledged(client: TestClient, wdb: psycopg.Connection) -> None:
    """A deferred constraint fails at COMMIT time: the request must get 503, not a 200 for a lost event."""
    seed_sent(wdb, {"em_1": "user1@example.com", "em_2": "user2@example.com"})
    wdb.execute("""create or replace function mail.test_refuse_commit() returns trigger language plpgsql as $$
                   begin if new.svix_id = 'msg_doomed' then raise exception 'refused at commit'; end if;
                   return null; end $$""")
    wdb.execute("drop trigger if exists test_refuse_commit on mail.webhook_event")
    wdb.execute("create constraint trigger test_refuse_commit after insert on mail.webhook_event"
                " deferrable initially deferred for each row execute function mail.test_refuse_commit()")
    try:
        r = post(client, envelope("bounced", "em_1", "user1@example.com"), svix_id="msg_doomed")
        assert r.status_code == 503
        assert post(client, envelope("delivered", "em_2", "user2@example.com"), svix_id="msg_fine").status_code == 200
    finally:
        wdb.execute("drop trigger test_refuse_commit on mail.webhook_event")
    assert [x[0] for x in inbox(wdb)] == ["msg_fine"] and suppressions(wdb) == []


def test_unknown_event_types_are_stored_and_ignored(client: TestClient, wdb: psycopg.Connection) -> None:
    for i, kind in enumerate(("email.scheduled", "contact.created", "domain.updated", "email.future_thing")):
        r = post(client, envelope(kind, "em_9" if kind.startswith("email") else None), svix_id=f"msg_{i}")
        assert (r.status_code, r.json()) == (200, {"received": True, "decision": "ignored"})
    assert [(x[1], x[3], x[4]) for x in inbox(wdb)] == [
        ("email.scheduled", "ignored", True), ("contact.created", "ignored", True),
        ("domain.updated", "ignored", True), ("email.future_thing", "ignored", True)]
    assert events(wdb) == []


# -- what events do ---------------------------------------------------------------------------------

ORDER_EVENTS = {"delivered": ("delivered", None, 2), "bounced": ("bounced", "Permanent", 3),
                "opened": ("opened", None, 1), "complained": ("complained", None, 4)}


def test_every_arrival_order_gives_the_same_status_and_suppression(client: TestClient,
                                                                    wdb: psycopg.Connection) -> None:
    perms = list(itertools.permutations(ORDER_EVENTS))
    assert len(perms) == 24
    rows = seed_sent(wdb, {f"em_{i}": f"user{i}@example.com" for i in range(len(perms))})
    for i, perm in enumerate(perms):
        for name in perm:
            kind, bounce, minute = ORDER_EVENTS[name]
            r = post(client, envelope(kind, f"em_{i}", f"user{i}@example.com", at=at(minute), bounce_type=bounce))
            assert r.status_code == 200
    expected = {"outcome": "complained", "delivered_at": at(1), "hard_bounced_at": at(3), "soft_bounced_at": None,
                "complained_at": at(4), "failed_at": None, "delayed_at": None, "suppressed_at": None,
                "first_opened_at": at(1), "first_clicked_at": None, "opens": 1, "clicks": 0}
    for i in range(len(perms)):
        assert status(wdb, rows[f"em_{i}"]) == expected, perms[i]
    assert suppressions(wdb) == [(None, f"user{i}@example.com", f"user{i}@example.com", "all", "complaint")
                                 for i in range(len(perms))]


def test_a_late_delivered_never_undoes_a_bounce_and_an_open_before_delivered_counts(
        client: TestClient, wdb: psycopg.Connection) -> None:
    ids = seed_sent(wdb, {"em_b": "b@example.com", "em_o": "o@example.com"})
    post(client, envelope("bounced", "em_b", "b@example.com", at=at(2)))
    post(client, envelope("delivered", "em_b", "b@example.com", at=at(1)))
    got = status(wdb, ids["em_b"])
    assert got is not None and (got["outcome"], got["hard_bounced_at"], got["delivered_at"]) == (
        "hard_bounced", at(2), at(1))
    post(client, envelope("opened", "em_o", "o@example.com", at=at(5)))
    got = status(wdb, ids["em_o"])
    assert got is not None and (got["outcome"], got["delivered_at"], got["opens"]) == ("delivered", at(5), 1)
    post(client, envelope("delivered", "em_o", "o@example.com", at=at(4)))
    post(client, envelope("clicked", "em_o", "o@example.com", at=at(6)))
    post(client, envelope("opened", "em_o", "o@example.com", at=at(7)))
    got = status(wdb, ids["em_o"])
    assert got is not None and (got["outcome"], got["delivered_at"], got["first_opened_at"], got["opens"],
                                got["first_clicked_at"], got["clicks"]) == ("delivered", at(4), at(5), 2, at(6), 1)
    assert suppressions(wdb) == [(None, "b@example.com", "b@example.com", "all", "bounce")]


def test_transient_bounces_delays_and_failures_never_suppress_and_failed_alerts(
        client: TestClient, wdb: psycopg.Connection) -> None:
    ids = seed_sent(wdb, {"em_t": "t@example.com", "em_u": "u@example.com", "em_d": "d@example.com",
                          "em_f": "f@example.com"})
    assert post(client, envelope("bounced", "em_t", "t@example.com", bounce_type="Transient", at=at(1)),
                svix_id="msg_t").json()["decision"] == "applied"
    post(client, envelope("bounced", "em_u", "u@example.com", bounce_type="Undetermined", at=at(1)), svix_id="msg_u")
    post(client, envelope("delivery_delayed", "em_d", "d@example.com", at=at(1)), svix_id="msg_d")
    r = post(client, envelope("failed", "em_f", "f@example.com", at=at(1)), svix_id="msg_f")
    assert r.json() == {"received": True, "decision": "failed"}
    assert suppressions(wdb) == []
    assert [status(wdb, ids[p])["outcome"] for p in ("em_t", "em_u", "em_d", "em_f")] == [  # type: ignore[index]
        "soft_bounced", "soft_bounced", "delayed", "failed"]
    assert [(e[1], e[2]) for e in events(wdb)] == [("bounced", "Transient"), ("bounced", "Undetermined"),
                                                   ("delivery_delayed", None), ("failed", None)]
    assert decisions(wdb) == [(ids["em_f"], "feedback: webhook email.failed (the provider did not send it); "
                                            "address not suppressed")]
    lines, sids = alert_lines(wdb)
    assert sids == ["msg_f"]
    assert lines == [f"webhook msg_f (email.failed) provider id=em_f send_log.id={ids['em_f']} "
                     "to=f***@example.com: failed"]
    mark_alerted(wdb, sids)
    assert alert_lines(wdb) == ([], [])


def test_an_email_not_in_the_send_log_yet_waits_and_the_sweep_applies_it(client: TestClient,
                                                                          wdb: psycopg.Connection) -> None:
    r = post(client, envelope("bounced", "em_late", "late@example.com", at=at(1)), svix_id="msg_late")
    assert (r.status_code, r.json()) == (200, {"received": True, "decision": "pending"})
    assert inbox(wdb) == [("msg_late", "email.bounced", "em_late", None, False, 1)]
    s = apply_pending(wdb, 100)
    assert (s.taken, s.applied, s.still_pending) == (1, 0, 1)
    assert inbox(wdb)[0][3:] == (None, False, 2) and suppressions(wdb) == []

    ids = seed_sent(wdb, {"em_late": "late@example.com"})  # the batch answer stored the id
    s = apply_pending(wdb, 100)
    assert (s.taken, s.applied, s.still_pending, s.suppressed, s.campaigns) == (1, 1, 0, 1, {"welcome"})
    assert inbox(wdb)[0][3:] == ("applied", True, 2)
    assert status(wdb, ids["em_late"])["outcome"] == "hard_bounced"  # type: ignore[index]
    assert suppressions(wdb) == [(None, "late@example.com", "late@example.com", "all", "bounce")]
    assert apply_pending(wdb, 100).taken == 0


def test_an_email_never_found_is_decided_unknown_after_the_give_up_age_and_alerted(
        client: TestClient, wdb: psycopg.Connection) -> None:
    post(client, envelope("delivered", "em_ghost", "ghost@example.com"), svix_id="msg_ghost")
    assert apply_pending(wdb, 100, give_up_after=timedelta(hours=72)).still_pending == 1
    wdb.execute("update mail.webhook_event set received_at = now() - interval '73 hours'")
    s = apply_pending(wdb, 100, give_up_after=timedelta(hours=72))
    assert (s.taken, s.unknown_email, s.still_pending) == (1, 1, 0)
    assert inbox(wdb) == [("msg_ghost", "email.delivered", "em_ghost", "unknown_email", True, 2)]
    assert alert_lines(wdb)[0] == ["webhook msg_ghost (email.delivered) provider id=em_ghost no send-log row: "
                                   "unknown_email"]


def test_the_receiver_sweeps_by_itself(wdb: psycopg.Connection, db_dsn: str) -> None:
    app = create_app([SECRET], connect_factory(db_dsn),
                     writer=GroupWriter(connect_factory(db_dsn), sweep_every=0.2))
    with TestClient(app) as c:
        assert post(c, envelope("complained", "em_s", "s@example.com"), svix_id="msg_s").json()["decision"] == "pending"
        seed_sent(wdb, {"em_s": "s@example.com"})
        deadline = time.monotonic() + 10
        while inbox(wdb)[0][3] is None and time.monotonic() < deadline:
            c.get("/healthz")  # keeps the test client's event loop turning
            time.sleep(0.05)
    assert inbox(wdb)[0][3:5] == ("applied", True)
    assert suppressions(wdb) == [(None, "s@example.com", "s@example.com", "all", "complaint")]


def test_a_recipient_mismatch_suppresses_the_providers_address_only_and_alerts(
        client: TestClient, wdb: psycopg.Connection) -> None:
    # the provider ids ended up on each other's rows (a batch answered out of order)
    ids = seed_sent(wdb, {"em_x": "alice@example.com", "em_y": "bob@example.com"})
    r = post(client, envelope("bounced", "em_x", "bob@example.com", at=at(1)), svix_id="msg_x")
    assert r.json() == {"received": True, "decision": "recipient_mismatch"}
    post(client, envelope("delivered", "em_y", "alice@example.com", at=at(1)), svix_id="msg_y")
    assert status(wdb, ids["em_x"]) is None and status(wdb, ids["em_y"]) is None and events(wdb) == []
    # bob really bounced: bob is suppressed, alice is not
    assert suppressions(wdb) == [(None, "bob@example.com", "bob@example.com", "all", "bounce")]
    assert decisions(wdb) == [
        (ids["em_x"], "feedback: provider email em_x is addressed to someone else (webhook email.bounced "
                      "(Permanent)); the provider's recipient b***@example.com suppressed for all mail (source "
                      "bounce); nothing applied to this row, a person must check the provider ids"),
        (ids["em_y"], "feedback: provider email em_y is addressed to someone else (webhook email.delivered); "
                      "nobody suppressed, a person must check the provider ids")]
    lines, sids = alert_lines(wdb)
    assert sids == ["msg_x", "msg_y"]
    assert lines[0] == (f"webhook msg_x (email.bounced) provider id=em_x send_log.id={ids['em_x']} "
                        "to=a***@example.com: recipient_mismatch")
    assert all("alice@" not in line and "bob@" not in line for line in lines)


def test_a_body_postgres_would_refuse_is_stored_cleaned(client: TestClient, wdb: psycopg.Connection) -> None:
    seed_sent(wdb, {"em_1": "user1@example.com"})
    body = json.dumps(envelope("delivered", "em_1", "user1@example.com", subject="a\u0000b \ud800")).encode()
    r = post(client, body, svix_id="msg_nul")
    assert (r.status_code, r.json()) == (200, {"received": True, "decision": "applied"})
    subject = wdb.execute("select payload->'data'->>'subject' from mail.webhook_event").fetchone()[0]  # type: ignore[index]
    assert subject == "a\ufffdb ?"
