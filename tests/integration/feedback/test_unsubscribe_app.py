"""The one-click unsubscribe endpoint against a real PostgreSQL: RFC 8058 POST, the confirmation
page, link scanners, replays, bad tokens, a database outage, a missing secret, and the effect on
the next lifecycle audience and on the scheduled dispatcher."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess, free_port
from mailflow.feedback.unsubscribe_app import Unavailable, connect_factory, create_app
from mailflow.feedback.unsubscribe_tokens import UnsubscribeSigner, signer_from_secret
from mailflow.model.outcome import DataInterval, RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources import scheduled
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import PostgresStore

with warnings.catch_warnings():  # starlette 1.x nags about httpx in its TestClient; it works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SIGNER = signer_from_secret(UNSUBSCRIBE_SECRET)
ONE_CLICK = {"content": b"List-Unsubscribe=One-Click",
             "headers": {"Content-Type": "application/x-www-form-urlencoded"}}
SCANNER_UA = {"User-Agent": "Mozilla/5.0 (compatible; SafeLinks-Scanner/1.0; +https://scanner.example)"}
END = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
H, D = timedelta(hours=1), timedelta(days=1)


@pytest.fixture
def client(db: psycopg.Connection, db_dsn: str) -> Iterator[TestClient]:
    app = create_app(SIGNER, connect_factory(db_dsn))
    with TestClient(app, follow_redirects=False) as c:
        yield c


def suppressions(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("select user_id, email, scope, source from mail.suppression order by id").fetchall()


def url(user_id: int, list_id: str, **kw: Any) -> str:
    return f"/u/{SIGNER.token(user_id, list_id, **kw)}"


# -- RFC 8058 one-click POST -------------------------------------------------------------------------

def test_one_click_post_unsubscribes_with_200_no_redirect_and_replays_are_harmless(
        client: TestClient, db: psycopg.Connection) -> None:
    r = client.post(url(42, "first_practice"), **ONE_CLICK)
    assert r.status_code == 200
    assert "location" not in r.headers and not r.is_redirect
    assert "You are unsubscribed" in r.text
    assert suppressions(db) == [(42, None, "first_practice", "one_click")]
    at = db.execute("select created_at from mail.suppression").fetchone()
    assert at is not None and at[0].tzinfo is not None

    for _ in range(3):  # mail providers retry; people click twice
        again = client.post(url(42, "first_practice"), **ONE_CLICK)
        assert again.status_code == 200 and "location" not in again.headers
    assert suppressions(db) == [(42, None, "first_practice", "one_click")]


def test_one_click_as_multipart_and_without_a_content_type(client: TestClient, db: psycopg.Connection) -> None:
    r = client.post(url(1, "all"), files={"List-Unsubscribe": (None, "One-Click")})
    assert r.status_code == 200
    r = client.post(url(2, "upgrade_offer"), content=b"List-Unsubscribe=One-Click")  # no Content-Type at all
    assert r.status_code == 200
    assert suppressions(db) == [(1, None, "all", "one_click"), (2, None, "upgrade_offer", "one_click")]


def test_a_post_without_the_one_click_field_changes_nothing(client: TestClient, db: psycopg.Connection) -> None:
    for body in (b"", b"List-Unsubscribe=Maybe", b"foo=bar"):
        r = client.post(url(3, "all"), content=body, headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400
        assert "<form method=\"post\">" in r.text  # the person can still confirm
    r = client.post(url(3, "all"), content=b"x" * 20_000)
    assert r.status_code == 413
    assert suppressions(db) == []


# -- GET: a person, or a link scanner ------------------------------------------------------------------

def test_get_shows_a_confirmation_page_and_writes_nothing(client: TestClient, db: psycopg.Connection) -> None:
    r = client.get(url(42, "finish_assessment"))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "Unsubscribe?" in r.text and "finish assessment" in r.text
    assert '<input type="hidden" name="confirm" value="yes">' in r.text
    assert 'name="scope" value="all"' in r.text  # may widen to all marketing
    assert " action=" not in r.text  # posts back to its own URL, whatever the mount prefix
    assert r.headers["cache-control"] == "no-store"
    assert r.headers["x-robots-tag"] == "noindex, nofollow"
    assert r.headers["referrer-policy"] == "no-referrer"
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    assert suppressions(db) == []


def test_link_scanners_change_nothing(client: TestClient, db: psycopg.Connection) -> None:
    path = url(42, "all")
    assert client.head(path, headers=SCANNER_UA).status_code == 200
    assert client.get(path, headers=SCANNER_UA).status_code == 200
    assert client.get(path + "?utm_source=scanner&sig=abc", headers=SCANNER_UA).status_code == 200
    assert client.get(path + "/", headers=SCANNER_UA).status_code == 200  # a trailing slash: no redirect
    assert client.options(path, headers=SCANNER_UA).status_code == 405
    assert suppressions(db) == []


def test_the_confirmation_form_unsubscribes_for_the_list_or_for_everything(
        client: TestClient, db: psycopg.Connection) -> None:
    form = {"headers": {"Content-Type": "application/x-www-form-urlencoded"}}
    assert client.post(url(5, "practice_tips"), content=b"confirm=yes", **form).status_code == 200
    assert client.post(url(6, "practice_tips"), content=b"confirm=yes&scope=all", **form).status_code == 200
    assert suppressions(db) == [(5, None, "practice_tips", "confirm_page"), (6, None, "all", "confirm_page")]


def test_mangled_links_still_work_for_the_same_user(client: TestClient, db: psycopg.Connection) -> None:
    token = SIGNER.token(8, "all")
    assert client.post(f"/u/{token.upper()}).", **ONE_CLICK).status_code == 200
    assert client.post(f"/u/{token}%20", **ONE_CLICK).status_code == 200
    assert suppressions(db) == [(8, None, "all", "one_click")]


# -- bad tokens ----------------------------------------------------------------------------------------

def _bad_tokens() -> list[str]:
    good = SIGNER.token(42, "first_practice")
    kid, uid, list_id, sig = good.split(".")
    return [
        good[:-1],  # truncated
        f"{kid}.{uid}.{list_id}.{sig[:-1]}{'a' if sig[-1] != 'a' else 'b'}",  # tampered signature
        f"{kid}.43.{list_id}.{sig}",  # another user
        f"{kid}.{uid}.all.{sig}",  # another list
        signer_from_secret("a-foreign-secret-0123456789").token(42, "first_practice"),  # foreign key
        signer_from_secret("a-foreign-secret-0123456789", kid="k7").token(42, "first_practice"),  # unknown kid
        "not-a-token", "%00", "k1..all." + sig, "\u00e9" * 40, "k1.42.all." + "a" * 5000,
    ]


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
def test_bad_tokens_get_a_friendly_400_and_change_nothing(client: TestClient, db: psycopg.Connection,
                                                           method: str) -> None:
    for bad in _bad_tokens():
        r = client.request(method, f"/u/{bad}", **(ONE_CLICK if method == "POST" else {}))
        assert r.status_code == 400, bad
        if method != "HEAD":
            assert "This link does not work" in r.text and "not valid" in r.text
            assert "Traceback" not in r.text
    assert suppressions(db) == []


def test_an_expired_token_gets_its_own_explanation(db: psycopg.Connection, db_dsn: str) -> None:
    expiring = signer_from_secret(UNSUBSCRIBE_SECRET, max_age_days=30)
    old = expiring.token(42, "all", issued=date.today() - timedelta(days=90))
    with TestClient(create_app(expiring, connect_factory(db_dsn))) as c:
        r = c.post(f"/u/{old}", **ONE_CLICK)
        assert r.status_code == 400 and "expired" in r.text
        assert c.post(f"/u/{expiring.token(42, 'all', issued=date.today())}", **ONE_CLICK).status_code == 200
    assert suppressions(db) == [(42, None, "all", "one_click")]


def test_unknown_paths_are_friendly_404s(client: TestClient) -> None:
    r = client.get("/unsubscribe")
    assert r.status_code == 404 and "Page not found" in r.text


# -- outages -------------------------------------------------------------------------------------------

def test_database_down_is_a_503_with_retry_after_never_a_500(db: psycopg.Connection) -> None:
    down = create_app(SIGNER, connect_factory("postgresql://postgres@127.0.0.1:1/nowhere", connect_timeout=2))
    with TestClient(down, raise_server_exceptions=False) as c:
        r = c.post(url(42, "all"), **ONE_CLICK)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "120"
        assert "try the link again" in r.text and "Traceback" not in r.text
        assert c.get(url(42, "all")).status_code == 200  # the page needs no database
    assert suppressions(db) == []


def test_a_database_error_mid_statement_is_a_503(db: psycopg.Connection, db_dsn: str) -> None:
    def read_only() -> psycopg.Connection:  # e.g. a failover left us on a replica
        return psycopg.connect(db_dsn, options="-c default_transaction_read_only=on")

    def shutting_down() -> psycopg.Connection:
        raise psycopg.errors.AdminShutdown("terminating connection due to administrator command")

    for factory in (read_only, shutting_down):
        with TestClient(create_app(SIGNER, factory), raise_server_exceptions=False) as c:
            r = c.post(url(42, "all"), **ONE_CLICK)
            assert r.status_code == 503 and "Traceback" not in r.text
    assert suppressions(db) == []


def test_a_missing_secret_is_a_503_until_it_is_configured(db: psycopg.Connection, db_dsn: str) -> None:
    configured: list[UnsubscribeSigner] = []

    def lazy_signer() -> UnsubscribeSigner:
        if not configured:
            raise Unavailable("no unsubscribe signing secret: set MAILFLOW_UNSUBSCRIBE_SECRET")
        return configured[0]

    with TestClient(create_app(lazy_signer, connect_factory(db_dsn))) as c:
        assert c.post(url(42, "all"), **ONE_CLICK).status_code == 503
        assert c.get("/healthz").status_code == 503
        configured.append(SIGNER)
        assert c.post(url(42, "all"), **ONE_CLICK).status_code == 200
        assert c.get("/healthz").json() == {"status": "ok"}
    assert suppressions(db) == [(42, None, "all", "one_click")]


def test_tokens_are_not_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    token = SIGNER.token(42, "all")
    with caplog.at_level(logging.DEBUG, logger="mailflow"):
        client.post(f"/u/{token}", **ONE_CLICK)
        client.get(f"/u/{token}")
        client.post(f"/u/{token[:-2]}", **ONE_CLICK)
    assert "unsubscribe: user 42 from all via one_click (new)" in caplog.text
    assert token.split(".")[-1] not in caplog.text and token[:-2] not in caplog.text


# -- the audiences honour it ---------------------------------------------------------------------------

def add_users(db: psycopg.Connection, *uids: int) -> None:
    for uid in uids:
        db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                   " values (%s, %s, %s, %s, 'UTC', 'free')", (uid, f"user{uid}@example.com", f"N{uid}", END - 60 * D))


def simple_campaign(name: str, priority: int = 1) -> Campaign:
    return Campaign(name=name, priority=priority, audience_sql="select user_id, email, first_name from app.users",
                    template="first_practice", subject="Hello {{ user.first_name }}",
                    from_address="Practice Team <practice@mail.example.com>", reply_to=None,
                    cooldown=timedelta(0), audience_window=H)


def test_the_next_audience_excludes_users_unsubscribed_from_that_list_or_from_all(
        client: TestClient, db: psycopg.Connection, db_dsn: str) -> None:
    add_users(db, 1, 2, 3, 4)
    assert client.post(url(2, "news_a"), **ONE_CLICK).status_code == 200
    assert client.post(url(3, "all"), **ONE_CLICK).status_code == 200
    window, since = (END - H, END), END
    with psycopg.connect(db_dsn) as conn:
        store = PostgresStore(conn)
        assert store.count_audience(simple_campaign("news_a"), window, since) == 2  # users 1 and 4
        assert store.count_audience(simple_campaign("news_b"), window, since) == 3  # 3 is out of everything
    # a whole run, news_a first: 2 still gets news_b (only news_a was refused), 3 gets nothing
    # (1 and 4 are in the cooldown of their news_a email by then)
    assert _run(db_dsn, [simple_campaign("news_a", 1), simple_campaign("news_b", 2)], db=db) == {
        ("news_a", 1), ("news_a", 4), ("news_b", 2)}


def _run(db_dsn: str, campaigns: list[Campaign], *, db: psycopg.Connection) -> set[tuple[str, int]]:
    """A lifecycle run with an in-process provider that accepts everything; returns the minted
    (campaign, user) pairs."""
    from mailflow.model.outcome import Accepted, PreparedBatch

    class AcceptAll:
        def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Accepted:
            return Accepted(ids={i: f"fake-{rid}" for i, rid in enumerate(batch.row_ids)}, rejected={})

    with psycopg.connect(db_dsn) as conn:
        run_lifecycle(PostgresStore(conn), AcceptAll(), Renderer(SIGNER, "https://mail.example.com",
                                                                 "https://app.example.com", mailto=""),
                      campaigns, DataInterval(END - H, END), run=RunContext(task_id="test"))
    return {(str(c), int(u)) for c, u in db.execute("select campaign, user_id from mail.send_log").fetchall()}


# -- the scheduled dispatcher honours it -----------------------------------------------------------------

@pytest.fixture
def campaigns_clean(db: psycopg.Connection) -> None:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")


def test_a_user_who_unsubscribes_after_provisioning_is_cancelled_at_dispatch(
        client: TestClient, db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess,
        campaigns_clean: None) -> None:
    add_users(db, 1, 2, 3, 4)
    cid = scheduled.create_campaign(db, {
        "name": "outreach_unsub", "template": "outreach", "subject": "{{ user.first_name }}, hello",
        "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
        "start_at": datetime(2026, 1, 5, tzinfo=UTC), "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7],
        "windows": ["00:00-23:59"], "emails_per_day": 1000}, actor="test")
    assert scheduled.provision(db, cid, now=datetime(2026, 1, 5, tzinfo=UTC)).created == 4  # all long due

    assert client.post(url(2, "outreach_unsub"), **ONE_CLICK).status_code == 200  # this list
    assert client.post(url(3, "all"), **ONE_CLICK).status_code == 200  # all marketing
    assert client.post(url(4, "another_list"), **ONE_CLICK).status_code == 200  # not this one

    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account=emulator.base_url, requests_per_second=200)
    resend = ResendClient(emulator.base_url, emulator.api_key, pacer=pacer,
                          policy=RetryPolicy(max_attempts=2, base=0.01, cap=0.02), timeout=httpx.Timeout(5.0))
    try:
        with psycopg.connect(db_dsn) as conn:
            summary = scheduled.dispatch(conn, resend, Renderer(SIGNER, "https://mail.example.com",
                                                                "https://app.example.com", mailto=""),
                                         budget_seconds=20, coalesce_seconds=0, run=RunContext(task_id="dispatch"))
    finally:
        resend.close()
        pacer.close()
    assert (summary.suppressed, summary.sent) == (2, 2)
    status = dict(db.execute("select user_id, status from mail.send_log where campaign = 'outreach_unsub'").fetchall())
    assert status == {1: "sent", 2: "cancelled", 3: "cancelled", 4: "sent"}
    assert sorted(e["to"][0] for e in emulator.read_outbox()) == ["user1@example.com", "user4@example.com"]


# -- the standalone server -------------------------------------------------------------------------

def test_the_standalone_server_runs_with_uvicorn(db: psycopg.Connection, db_dsn: str, tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "MAILFLOW_UNSUBSCRIBE_SECRET": UNSUBSCRIBE_SECRET}
    env.pop("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", None)
    log = tmp_path / "unsubscribe.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mailflow.cli", "unsubscribe", "serve", "--port", str(port),
                                 "--dsn", db_dsn], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        token = signer_from_secret(UNSUBSCRIBE_SECRET).token(7, "upgrade_offer")
        r = httpx.post(f"{base}/u/{token}", content=b"List-Unsubscribe=One-Click",
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=10)
    assert db.execute("select user_id, scope, source from mail.suppression").fetchall() == [
        (7, "upgrade_offer", "one_click")]
    text = log.read_text()
    assert UNSUBSCRIBE_SECRET not in text and token not in text  # no secret, no token in its log

    missing = subprocess.run([sys.executable, "-m", "mailflow.cli", "unsubscribe", "serve", "--dsn", db_dsn],
                             env={k: v for k, v in env.items() if k != "MAILFLOW_UNSUBSCRIBE_SECRET"},
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "MAILFLOW_UNSUBSCRIBE_SECRET" in missing.stderr


def test_the_endpoint_needs_only_insert_on_suppression_and_the_users_mailboxes(db: psycopg.Connection,
                                                                              db_dsn: str) -> None:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    role = f"mf_unsub_{os.getpid()}"
    db.execute(f"drop role if exists {role}")
    db.execute(f"create role {role} login password 'unsub-role-pw'")
    try:
        db.execute(f"grant usage on schema mail to {role}")
        db.execute(f"grant insert, select (id) on mail.suppression to {role}")
        # "stop all" suppresses the user's mailboxes too: their stored keys in the send log
        db.execute(f"grant select (user_id, email, email_key) on mail.send_log to {role}")
        params = conninfo_to_dict(db_dsn) | {"user": role, "password": "unsub-role-pw"}
        with TestClient(create_app(SIGNER, connect_factory(make_conninfo("", **params)))) as c:
            assert c.post(url(42, "all"), **ONE_CLICK).status_code == 200
            assert c.post(url(42, "all"), **ONE_CLICK).status_code == 200
        assert suppressions(db) == [(42, None, "all", "one_click")]
    finally:
        db.execute(f"drop owned by {role}")
        db.execute(f"drop role {role}")
