"""One mailbox, one key, whoever holds it and however it is spelled: the contact policy and "stop
all" act on the mailbox as well as the user, and a bounce suppresses the mailbox under any database
locale (the key is computed once, in Python, and compared as stored)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
import scheduled_rig as ts
from conftest import UNSUBSCRIBE_SECRET
from lifecycle_rig import Rig as LRig
from lifecycle_rig import add_user, simple_campaign
from psycopg import sql
from starlette.testclient import TestClient

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.deliverability import FeedbackSummary, poll_feedback
from mailflow.feedback.unsubscribe_app import create_app
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import DataInterval, RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.contact_guard import lock_contacts
from mailflow.store.migrate import migrate
from mailflow.store.policy import mailbox_key, normalise_address
from mailflow.store.send_log import PostgresStore
from mailflow_dev import devenv
from mailflow_dev.demo.loader import schema_sql

SPELLINGS = {
    # the product's own normalisation makes these one mailbox: an IDN domain and its punycode ...
    "idn_vs_punycode": ("jörg@bücher.example", "JÖRG@xn--bcher-kva.example"),
    # ... and whitespace around the address
    "whitespace": ("anna@example.com", " \tanna@example.com  "),
}


@pytest.fixture
def lrig(db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> Iterator[LRig]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    r = LRig(db=db, dsn=db_dsn, emulator=emulator)
    yield r
    for c in reversed(r.conns):
        c.close()


@pytest.fixture
def srig(lrig: LRig) -> Iterator[ts.Rig]:
    r = ts.Rig(db=lrig.db, dsn=lrig.dsn, emulator=lrig.emulator)
    yield r
    for c in reversed(r.closers):
        c.close()


def outbox_to(emulator: EmulatorProcess) -> list[str]:
    return sorted(e["to"][0] for e in emulator.read_outbox())


# -- the contact policy covers the mailbox --------------------------------------------------------

@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_one_mailbox_under_two_user_ids_gets_one_campaign_within_the_cooldown(lrig: LRig, spelling: str) -> None:
    """Two user ids, one mailbox: campaign a goes to user 1, campaign b (the next one in the same
    run, milliseconds later) would go to user 2. The cooldown counts the mailbox's email to user 1,
    so user 2 is held: one email to the mailbox, not two."""
    first, second = SPELLINGS[spelling]
    add_user(lrig.db, 1, email=first)
    add_user(lrig.db, 2, email=second)
    add_user(lrig.db, 3)
    sa, sb = lrig.run([simple_campaign("a", 1, "user_id = 1"), simple_campaign("b", 2, "user_id in (2, 3)")])
    assert (sa.minted, sa.sent) == (1, 1)
    assert (sb.eligible, sb.minted, sb.sent, sb.held, sb.duplicates) == (2, 1, 1, 1, 0)
    assert len([e for e in lrig.emulator.read_outbox() if mailbox_key(e["to"][0]) == mailbox_key(first)]) == 1
    assert [(r["user_id"], r["campaign"], r["status"]) for r in lrig.rows()] == [(1, "a", "sent"), (3, "b", "sent")]


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_one_mailbox_under_two_user_ids_is_held_across_paths(lrig: LRig, srig: ts.Rig, spelling: str) -> None:
    """The lifecycle path mails user 1; a scheduled campaign then has user 2 at the same mailbox:
    the dispatcher's guard sees the mailbox's email and skips user 2's, naming user 1's row."""
    first, second = SPELLINGS[spelling]
    add_user(lrig.db, 1, email=first)
    [s] = lrig.run([simple_campaign("a", 1, "user_id = 1")])
    assert s.sent == 1
    [sent] = lrig.rows("campaign = 'a'")
    cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", on_policy="skip",
                        **ts.ALL_DAY)
    srig.db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                    " values (%s, 2, %s, 'Two'), (%s, 3, 'user3@example.com', 'Three')", (cid, second, cid))
    srig.provision(cid)
    d = srig.dispatch()
    assert (d.sent, d.skipped) == (1, 1)
    [held] = srig.rows("campaign = 'outreach_test' and user_id = 2")
    assert held["status"] == "skipped"
    assert held["error"].startswith(f"contact policy: cooldown 7 days: row {sent['id']} (a, sent ")
    assert len(lrig.emulator.read_outbox()) == 2


def test_a_claim_of_another_user_at_the_mailbox_waits_for_the_mailbox_lock(lrig: LRig) -> None:
    """Two claimers at once: another process holds the mailbox of user 1's address (its claim for
    user 9 at that mailbox not yet committed). The mint of user 1 waits for it, then sees it and
    holds user 1 back."""
    add_user(lrig.db, 1, email="Anna@Example.com ")
    key = mailbox_key("anna@example.com")
    assert key is not None
    locked, release = threading.Event(), threading.Event()

    def other_claimer() -> None:
        with psycopg.connect(lrig.dsn, autocommit=True) as conn, conn.transaction():
            lock_contacts(conn, [9], [key])
            conn.execute("insert into mail.send_log (user_id, campaign, email, email_key, status, claimed_at)"
                         " values (9, 'other_campaign', 'anna@example.com', %s, 'sending', now())", (key,))
            locked.set()
            release.wait(5)

    t = threading.Thread(target=other_claimer)
    t.start()
    assert locked.wait(5)
    threading.Timer(0.5, release.set).start()
    t0 = time.monotonic()
    [s] = lrig.run([simple_campaign("a", 1)])
    waited = time.monotonic() - t0
    t.join()
    assert waited >= 0.4
    assert (s.eligible, s.minted, s.held) == (1, 0, 1)
    assert lrig.emulator.read_outbox() == []


# -- "stop all" suppresses the mailbox ------------------------------------------------------------

@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_stop_all_under_one_user_id_suppresses_the_mailbox_for_the_other(lrig: LRig, srig: ts.Rig,
                                                                         spelling: str) -> None:
    """User 1 (mailed once) clicks "unsubscribe from all marketing". User 2 has the same mailbox
    under another spelling: neither the lifecycle path nor a scheduled campaign mails it again."""
    first, second = SPELLINGS[spelling]
    add_user(lrig.db, 1, email=first)
    [s] = lrig.run([simple_campaign("a", 1, "user_id = 1")])
    assert s.sent == 1
    signer = signer_from_secret(UNSUBSCRIBE_SECRET)
    with TestClient(create_app(signer, lambda: psycopg.connect(lrig.dsn, autocommit=True))) as c:
        token = signer.token(1, "all")
        r = c.post(f"/u/{token}", content=b"List-Unsubscribe=One-Click",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200
    add_user(lrig.db, 2, email=second)
    add_user(lrig.db, 3)
    [s2] = lrig.run([simple_campaign("b", 1, "user_id in (2, 3)", cooldown=timedelta(0))])
    assert (s2.sent, s2.minted) == (1, 1)
    cid = srig.campaign(recipients_sql=None, recipients_table="mail.campaign_recipient", **ts.ALL_DAY)
    srig.db.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                    " values (%s, 2, %s, 'Two')", (cid, second))
    srig.provision(cid)
    d = srig.dispatch()
    assert (d.sent, d.suppressed) == (0, 1)
    assert outbox_to(lrig.emulator) == sorted([mailbox_send(first), "user3@example.com"])
    # the user's suppression, and the mailbox's (by its stored key)
    assert lrig.db.execute("select user_id, email_key, scope, source from mail.suppression order by id").fetchall() == [
        (1, None, "all", "one_click"), (None, mailbox_key(first), "all", "one_click")]


def mailbox_send(address: str) -> str:
    return normalise_address(address).send


# -- a bounce suppresses the mailbox whatever the database's locale --------------------------------

class FeedbackRig:
    """Lifecycle sends and the feedback poll against the emulator, on any database (the locale ones)."""

    def __init__(self, db: psycopg.Connection, dsn: str, emulator: EmulatorProcess):
        self.db, self.dsn, self.emulator = db, dsn, emulator
        self.closers: list[Any] = []

    def client(self) -> ResendClient:
        pacer = PostgresPacer(lambda: psycopg.connect(self.dsn), account=self.emulator.base_url,
                              requests_per_second=200)
        client = ResendClient(self.emulator.base_url, self.emulator.api_key, pacer=pacer,
                              policy=RetryPolicy(max_attempts=3, base=0.01, cap=0.05), timeout=httpx.Timeout(5.0))
        self.closers += [client, pacer]
        return client

    def conn(self) -> psycopg.Connection:
        c = psycopg.connect(self.dsn, autocommit=True)
        self.closers.append(c)
        return c

    def users(self, emails: dict[int, str]) -> None:
        for uid, email in emails.items():
            self.db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                            " values (%s, %s, %s, now() - interval '60 days', 'UTC', 'free')", (uid, email, f"N{uid}"))

    def send(self, name: str) -> dict[int, str]:
        """One lifecycle run of a campaign over every app user (cooldown 0); returns user -> status."""
        row = self.db.execute("select date_trunc('minute', now()) + interval '1 minute'").fetchone()
        assert row is not None
        end = row[0]
        campaign = Campaign(name=name, priority=1, audience_sql="select user_id, email, first_name from app.users",
                            template="first_practice", subject="Hello {{ user.first_name }}",
                            from_address="Practice Team <practice@mail.example.com>", reply_to=None,
                            cooldown=timedelta(0), audience_window=timedelta(hours=1))
        renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com",
                            "https://app.example.com", mailto="")
        run_lifecycle(PostgresStore(self.conn()), self.client(), renderer, [campaign],
                      DataInterval(end - timedelta(hours=1), end), run=RunContext(task_id="send"))
        return dict(self.db.execute("select user_id, status from mail.send_log where campaign = %s", (name,)).fetchall())

    def poll(self) -> FeedbackSummary:
        return poll_feedback(self.conn(), self.client(), min_age=timedelta(0))


NON_ASCII = {
    # (the address that bounced, another spelling of the same mailbox)
    1: ("ΟΔΟΣ@example.gr", "οδος@example.gr"),        # capital sigma vs final sigma
    2: ("İnci@example.com", "i\u0307nci@example.com"),  # capital dotted I vs i + combining dot
    3: ("Äpfel@example.de", " äpfel@example.de"),      # a non-ASCII capital
    4: ("Straße@example.de", "STRASSE@example.de"),    # sharp s vs its upper case
}


@pytest.fixture(params=["C", "C.UTF-8"])
def locale_dsn(request: pytest.FixtureRequest, pg_admin_dsn: str) -> Iterator[str]:
    """A migrated database (with the demo app schema) whose LC_COLLATE and LC_CTYPE are ``param``."""
    name = f"mailflow_test_loc_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("create database {} template template0 encoding 'UTF8' lc_collate {} lc_ctype {}")
                     .format(sql.Identifier(name), sql.Literal(request.param), sql.Literal(request.param)))
    dsn = devenv.with_dbname(pg_admin_dsn, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("select datctype from pg_database where datname = current_database()").fetchone() == (
            request.param,)
        migrate(conn)
        conn.execute(schema_sql())
    yield dsn
    devenv.drop_database(pg_admin_dsn, name)


def test_bounce_suppression_matches_non_ascii_local_part(locale_dsn: str, emulator: EmulatorProcess) -> None:
    """Mailboxes with a non-ASCII local part bounce; the feedback poll suppresses them. The next run
    mails none of them, neither as the same user and spelling nor as another user with another
    spelling of the mailbox (final sigma, İ, Ä, ß), in a database whose locale is C or C.UTF-8."""
    with psycopg.connect(locale_dsn, autocommit=True) as db:
        rig = FeedbackRig(db, locale_dsn, emulator)
        try:
            rig.users({uid: bounced for uid, (bounced, _) in NON_ASCII.items()} | {5: "plain@example.com"})
            emulator.configure(bounce=[bounced for bounced, _ in NON_ASCII.values()])
            assert rig.send("feedback_a") == dict.fromkeys([1, 2, 3, 4, 5], "sent")
            summary = rig.poll()
            assert (summary.bounced, summary.suppressed) == (4, 4)
            rig.users({10 + uid: other for uid, (_, other) in NON_ASCII.items()} | {15: "other@example.com"})
            assert rig.send("feedback_b") == {5: "sent", 15: "sent"}
            to = sorted(e["to"][0] for e in emulator.read_outbox() if e["tags"][0]["value"] == "feedback_b")
            assert to == ["other@example.com", "plain@example.com"]
            assert sorted(r[0] for r in db.execute("select email_key from mail.suppression")) == sorted(
                str(mailbox_key(b)) for b, _ in NON_ASCII.values())
        finally:
            for c in reversed(rig.closers):
                c.close()


def test_concurrent_claimers_never_mail_one_mailbox_twice_under_two_user_ids(db: psycopg.Connection,
                                                                            db_dsn: str) -> None:
    """The contact-policy race with every 10th user id at the mailbox of the one before (another
    spelling): provisioner, 3 lifecycle runs and 2 dispatchers at once. Main's guard locked users
    only: 100 of 100 shared mailboxes got two emails."""
    from mailflow_dev import contact_chaos

    report = contact_chaos.run(db_dsn, users=1000, lifecycle=3, dispatchers=2, rounds=1, seconds=60,
                               shared_mailboxes=True)
    assert report["failed"] == []
    assert report["invariants"] == {"users_with_two_contacts_in_cooldown": 0, "users_never_decided": 0,
                                    "due_rows_left_pending": 0, "processes_failed": 0,
                                    "mailboxes_with_two_contacts_in_cooldown": 0}
    # one email per mailbox: 1,000 user ids, 900 mailboxes
    assert report["counts"]["emails_sent"] == 900
