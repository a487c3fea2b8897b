"""The bounce/complaint loop end to end: emails sent through the real engine to the Resend emulator
(told to bounce or complain for given addresses), the feedback poll over HTTP through the shared
pacer, the exact suppression rows, the next run excluding them, and bounded re-polling."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.deliverability import FeedbackSummary, poll_feedback
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import DataInterval, RunContext
from mailflow.orchestration.alerts import feedback_alert
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.suppression import suppress_address

H = timedelta(hours=1)
NOW_ISH = timedelta(0)


class CountingPacer(PostgresPacer):
    """The shared PostgreSQL pacer, counting the slots it hands out."""

    claims = 0

    def claim(self) -> float:
        self.claims += 1
        return super().claim()


class Rig:
    def __init__(self, db: psycopg.Connection, dsn: str, emulator: EmulatorProcess):
        self.db, self.dsn, self.emulator = db, dsn, emulator
        self.closers: list[Any] = []

    def client(self) -> ResendClient:
        pacer = CountingPacer(lambda: psycopg.connect(self.dsn), account=self.emulator.base_url,
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
        """One lifecycle run of a campaign over every app user, its interval ending a minute from the
        database's now (cooldown 0: earlier sends do not hold anyone back); returns user -> status."""
        from mailflow.store.send_log import PostgresStore

        end = self.db.execute("select date_trunc('minute', now()) + interval '1 minute'").fetchone()[0]  # type: ignore[index]
        campaign = Campaign(name=name, priority=1, audience_sql="select user_id, email, first_name from app.users",
                            template="first_practice", subject="Hello {{ user.first_name }}",
                            from_address="Practice Team <practice@mail.example.com>", reply_to=None,
                            cooldown=timedelta(0), audience_window=H)
        renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com",
                            "https://app.example.com", mailto="")
        run_lifecycle(PostgresStore(self.conn()), self.client(), renderer, [campaign], DataInterval(end - H, end),
                      run=RunContext(task_id="send"))
        return dict(self.db.execute("select user_id, status from mail.send_log where campaign = %s", (name,)).fetchall())

    def poll(self, client: ResendClient | None = None, **kw: Any) -> FeedbackSummary:
        kw.setdefault("min_age", NOW_ISH)
        return poll_feedback(self.conn(), client or self.client(), **kw)

    def suppressions(self) -> list[tuple[Any, ...]]:
        return self.db.execute("select user_id, email, scope, source from mail.suppression order by id").fetchall()

    def statuses(self) -> dict[str, tuple[str, bool, int]]:
        rows = self.db.execute("select l.email, ds.last_event, ds.final, ds.checks from mail.delivery_status ds"
                               " join mail.send_log l on l.id = ds.send_log_id").fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}


@pytest.fixture
def rig(db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> Iterator[Rig]:
    r = Rig(db, db_dsn, emulator)
    yield r
    for c in reversed(r.closers):
        c.close()


USERS = {1: "user1@example.com", 2: "user2@example.com", 3: "User3@Example.com", 4: "user4@example.com",
         5: "user5@example.com"}  # user 3's address is sent (and recorded) with its domain lower-cased


def test_bounces_and_complaints_are_suppressed_exactly_once_and_excluded_from_the_next_run(rig: Rig) -> None:
    rig.users(USERS)
    rig.emulator.configure(bounce=["user2@example.com"], complain=["user3@example.com"])
    assert rig.send("feedback_a") == dict.fromkeys(USERS, "sent")

    client = rig.client()
    summary = rig.poll(client)

    assert (summary.due, summary.checked, summary.bounced, summary.complained) == (5, 5, 1, 1)
    assert (summary.suppressed, summary.already_suppressed, summary.errors, summary.stopped) == (2, 0, 0, None)
    assert summary.events == {"delivered": 3, "bounced": 1, "complained": 1}
    assert summary.requests == 5 and client.pacer.claims == 5  # type: ignore[attr-defined]  # one slot per GET
    assert rig.suppressions() == [(None, "user2@example.com", "all", "bounce"),
                                  (None, "User3@example.com", "all", "complaint")]
    ids = dict(rig.db.execute("select email, id from mail.send_log").fetchall())
    pids = dict(rig.db.execute("select email, provider_message_id from mail.send_log").fetchall())
    reasons = [r[0] for r in rig.db.execute("select reason from mail.suppression order by id").fetchall()]
    assert reasons == [f"provider last_event bounced (send_log {ids['user2@example.com']}, "
                       f"email {pids['user2@example.com']})",
                       f"provider last_event complained (send_log {ids['User3@example.com']}, "
                       f"email {pids['User3@example.com']})"]
    assert rig.statuses() == {"user1@example.com": ("delivered", False, 1), "user2@example.com": ("bounced", True, 1),
                              "User3@example.com": ("complained", True, 1), "user4@example.com": ("delivered", False, 1),
                              "user5@example.com": ("delivered", False, 1)}

    # a second poll right away: nothing is due (recheck after 2 h), nothing is added, no request
    again = rig.poll()
    assert (again.due, again.checked, again.suppressed, again.requests) == (0, 0, 0, 0)
    assert len(rig.suppressions()) == 2

    # the next run excludes the bounced and the complained address (case-insensitively)
    assert rig.send("feedback_b") == {1: "sent", 4: "sent", 5: "sent"}
    to = sorted(e["to"][0] for e in rig.emulator.read_outbox() if e["tags"][0]["value"] == "feedback_b")
    assert to == ["user1@example.com", "user4@example.com", "user5@example.com"]


def test_re_polling_is_bounded_and_stops_once_an_email_has_an_outcome(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com"})
    rig.send("feedback_a")
    assert rig.poll().events == {"delivered": 2}
    # delivered is an outcome: the safety net does not ask again (a later complaint comes by webhook)
    assert rig.poll(recheck_after=timedelta(0)).due == 0
    # an email whose answer carried no outcome ("sent": still on its way) is asked again, at most max_checks times
    rig.db.execute("update mail.delivery_status set last_event = 'sent', outcome = null, delivered_at = null"
                   " where send_log_id = (select id from mail.send_log where user_id = 2)")
    rig.emulator.configure(complain=["user2@example.com"])  # a complaint arrives hours later
    second = rig.poll(recheck_after=timedelta(0))
    assert (second.due, second.complained, second.suppressed) == (1, 1, 1)
    assert rig.suppressions() == [(None, "user2@example.com", "all", "complaint")]
    assert rig.statuses() == {"user1@example.com": ("delivered", False, 1), "user2@example.com": ("complained", True, 2)}
    assert rig.poll(recheck_after=timedelta(0)).due == 0

    rig.db.execute("update mail.delivery_status set last_event = 'sent', outcome = null, final = false")
    third = rig.poll(recheck_after=timedelta(0), max_checks=3)
    assert (third.due, third.checked, third.suppressed, third.already_suppressed) == (2, 2, 0, 1)
    rig.db.execute("update mail.delivery_status set outcome = null")
    assert rig.poll(recheck_after=timedelta(0), max_checks=3).due == 1  # user 1: 2 checks; user 2: final
    assert rig.poll(recheck_after=timedelta(0), max_checks=3).due == 0


def test_an_email_the_provider_no_longer_knows_is_final_and_suppresses_nothing(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com"})
    rig.send("feedback_a")
    rig.emulator.reset()  # the provider forgot them (retention, or another account)
    s = rig.poll()
    assert (s.checked, s.not_found, s.suppressed, s.errors) == (2, 2, 0, 0)
    assert {v for v in rig.statuses().values()} == {("not_found", True, 1)}
    assert rig.poll(recheck_after=timedelta(0)).due == 0


def test_the_window_the_minimum_age_and_the_per_run_limit(rig: Rig) -> None:
    rig.users({i: f"user{i}@example.com" for i in range(1, 6)})
    rig.send("feedback_a")
    assert rig.poll(min_age=timedelta(minutes=10)).due == 0  # just sent: bounces take a moment
    rig.db.execute("update mail.send_log set sent_at = now() - interval '3 days' where user_id = 5")
    first = rig.poll(limit=2)
    assert (first.due, first.checked) == (2, 2)
    assert rig.poll(limit=10).due == 2  # the rest; user 5 is outside the 48 h window
    assert 5 not in {r[0] for r in rig.db.execute(
        "select l.user_id from mail.delivery_status ds join mail.send_log l on l.id = ds.send_log_id").fetchall()}


def test_a_time_budget_stops_the_poll_before_the_next_request(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com"})
    rig.send("feedback_a")
    s = rig.poll(budget_seconds=0)
    assert (s.due, s.checked, s.requests, s.stopped) == (2, 0, 0, "time budget")
    assert rig.statuses() == {}


# -- issue 13: the recipient check, suppressed and failed, decisions as send events, key types -----

def events_of(rig: Rig) -> list[tuple[Any, ...]]:
    return rig.db.execute("select l.email, e.from_status, e.to_status, e.error, e.provider_message_id = l.provider_message_id,"
                          " e.dag_id, e.run_id, e.task_id from mail.send_event e join mail.send_log l on l.id = e.send_log_id"
                          " where e.error like 'feedback:%' order by e.id").fetchall()


def test_a_recipient_mismatch_suppresses_only_the_providers_recipient_and_alerts(
        rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com"})
    rig.emulator.configure(bounce=["user2@example.com"])
    rig.send("feedback_a")
    # the provider ids ended up on each other's rows (e.g. a batch answered out of order)
    ids = dict(rig.db.execute("select user_id, provider_message_id from mail.send_log").fetchall())
    rig.db.execute("update mail.send_log set provider_message_id = 'tmp' where user_id = 1")
    rig.db.execute("update mail.send_log set provider_message_id = %s where user_id = 2", (ids[1],))
    rig.db.execute("update mail.send_log set provider_message_id = %s where user_id = 1", (ids[2],))

    s = rig.poll(run=RunContext(dag_id="deliverability_feedback", run_id="r1", task_id="poll_feedback"))
    assert (s.checked, s.mismatched, s.suppressed, s.bounced, s.errors) == (2, 2, 1, 0, 0)
    assert s.events == {"recipient_mismatch": 2}
    # user2 really bounced (the provider's `to`): user2 is suppressed; user1, whose row has the id, is not
    assert rig.suppressions() == [(None, "user2@example.com", "all", "bounce")]
    assert rig.statuses() == {"user1@example.com": ("recipient_mismatch", True, 1),
                              "user2@example.com": ("recipient_mismatch", True, 1)}
    assert rig.db.execute("select count(*), count(outcome) from mail.delivery_status").fetchone() == (2, 0)
    assert rig.db.execute("select count(*) from mail.delivery_event").fetchone() == (0,)
    assert events_of(rig) == [
        ("user1@example.com", "sent", "sent", f"feedback: provider email {ids[2]} is addressed to someone else "
         "(last_event bounced); the provider's recipient u***@example.com suppressed for all mail (source bounce); "
         "nothing applied to this row, a person must check the provider ids", True,
         "deliverability_feedback", "r1", "poll_feedback"),
        ("user2@example.com", "sent", "sent", f"feedback: provider email {ids[1]} is addressed to someone else "
         "(last_event delivered); nobody suppressed, a person must check the provider ids", True,
         "deliverability_feedback", "r1", "poll_feedback")]
    assert len(s.alerts) == 2 and all("user1@example.com" not in a and "user2@example.com" not in a for a in s.alerts)
    assert rig.poll(recheck_after=timedelta(0)).due == 0  # final: a person decides
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        feedback_alert(s.alerts, {})
    [alert] = [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"]
    assert alert.startswith("ALERT: deliverability feedback: 2 email(s) need a look (nothing was suppressed for them):")
    assert "u***@example.com provider id=" in alert and "user1@example.com" not in alert


def test_provider_suppressed_is_suppressed_and_failed_alerts_without_suppressing(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com", 3: "user3@example.com"})
    rig.emulator.configure(suppress=["user1@example.com"], fail=["user2@example.com"])
    rig.send("feedback_a")
    s = rig.poll()
    assert (s.checked, s.provider_suppressed, s.failed, s.suppressed, s.mismatched) == (3, 1, 1, 1, 0)
    assert s.events == {"suppressed": 1, "failed": 1, "delivered": 1}
    assert rig.suppressions() == [(None, "user1@example.com", "all", "provider_suppressed")]
    assert rig.statuses() == {"user1@example.com": ("suppressed", True, 1), "user2@example.com": ("failed", True, 1),
                              "user3@example.com": ("delivered", False, 1)}
    assert [(e[0], e[3]) for e in events_of(rig)] == [
        ("user1@example.com", "feedback: last_event suppressed; address suppressed for all mail "
                              "(source provider_suppressed)"),
        ("user2@example.com", "feedback: last_event failed (the provider did not send it); address not suppressed")]
    assert len(s.alerts) == 1 and "last_event failed" in s.alerts[0]
    # no longer mailed: the next run skips the address on the provider's suppression list
    assert rig.send("feedback_b") == {2: "sent", 3: "sent"}


def test_every_suppression_decision_is_a_send_event_even_when_already_suppressed(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com"})
    rig.emulator.configure(bounce=["user1@example.com"], complain=["user2@example.com"])
    rig.send("feedback_a")
    suppress_address(rig.db, "USER2@example.com", source="manual")
    s = rig.poll()
    assert (s.suppressed, s.already_suppressed) == (1, 1)
    assert [(e[0], e[1], e[2], e[3], e[4]) for e in events_of(rig)] == [
        ("user1@example.com", "sent", "sent", "feedback: last_event bounced; address suppressed for all mail "
                                              "(source bounce)", True),
        ("user2@example.com", "sent", "sent", "feedback: last_event complained; address already suppressed", True)]
    assert s.alerts == []


def test_a_sending_only_key_fails_the_poll_saying_it_needs_a_full_access_key(rig: Rig) -> None:
    from mailflow.feedback.deliverability import FeedbackError

    rig.users({1: "user1@example.com"})
    rig.send("feedback_a")
    rig.emulator.configure(restricted_keys=["re_sending_only"])
    restricted = ResendClient(rig.emulator.base_url, "re_sending_only", pacer=rig.client().pacer,
                              policy=RetryPolicy(max_attempts=3, base=0.01, cap=0.05), conn_id="resend_default")
    rig.closers.append(restricted)
    with pytest.raises(FeedbackError, match=r"the API key of connection 'resend_default' is sending-only \(HTTP 401 "
                                            r"restricted_api_key: .*\).*full-access key.*MAILFLOW_FEEDBACK_CONN_ID"):
        rig.poll(restricted)
    assert rig.statuses() == {} and rig.suppressions() == []


class RewritesTo:
    """The provider's answer for these provider ids names ``to`` as given: the address a row was sent
    to under an older, laxer validator (the provider accepted it; today's validator rejects it)."""

    def __init__(self, http: Any, to: dict[str, str]):
        self.http, self.to = http, to

    def __getattr__(self, name: str) -> Any:
        return getattr(self.http, name)

    def get(self, url: str, **kw: Any) -> httpx.Response:
        resp = self.http.get(url, **kw)
        pid = url.rsplit("/", 1)[-1]
        if resp.status_code != 200 or pid not in self.to:
            return resp
        body = resp.json() | {"to": [self.to[pid]]}
        headers = {k: v for k, v in resp.headers.items() if k.startswith("ratelimit") or k == "date"}
        return httpx.Response(200, json=body, headers=headers, request=resp.request)


def test_an_address_without_a_mailbox_key_suppresses_its_user_and_the_poll_goes_on(rig: Rig) -> None:
    rig.users({1: "user1@example.com", 2: "user2@example.com", 3: "user3@example.com"})
    rig.emulator.configure(bounce=["user2@example.com", "user3@example.com"])
    rig.send("feedback_a")
    bad = "user2@example..com"  # no mailbox key: the validator rejects it (an empty domain label)
    pids = dict(rig.db.execute("select user_id, provider_message_id from mail.send_log").fetchall())
    rig.db.execute("update mail.send_log set email = %s where user_id = 2", (bad,))
    client = rig.client()
    client.http = RewritesTo(client.http, {pids[2]: bad})  # type: ignore[assignment]

    s = rig.poll(client, run=RunContext(dag_id="deliverability_feedback", run_id="r1", task_id="poll_feedback"))

    assert (s.due, s.checked, s.bounced, s.suppressed, s.already_suppressed, s.errors, s.stopped) == (
        3, 3, 2, 2, 0, 0, None)
    assert rig.suppressions() == [(2, None, "all", "bounce"), (None, "user3@example.com", "all", "bounce")]
    assert rig.statuses() == {"user1@example.com": ("delivered", False, 1), bad: ("bounced", True, 1),
                              "user3@example.com": ("bounced", True, 1)}
    [(email, frm, to, decision, same_pid, *_), user3] = events_of(rig)
    assert (email, frm, to, same_pid) == (bad, "sent", "sent", True)
    assert decision.startswith("feedback: last_event bounced; the address has no mailbox key (")
    assert decision.endswith("): user 2 suppressed for all mail (source bounce)")
    assert user3[0] == "user3@example.com"
    [reason] = rig.db.execute("select reason from mail.suppression where user_id = 2").fetchone() or [None]
    [row2] = rig.db.execute("select id from mail.send_log where user_id = 2").fetchone() or [None]
    assert reason.startswith(f"provider last_event bounced (send_log {row2}, email {pids[2]}); the address has no "
                             "mailbox key (")
    # a second poll of the same rows (rechecks due at once) decides the same, as already suppressed
    rig.db.execute("update mail.delivery_status set final = false, outcome = null")
    again = rig.poll(client, recheck_after=timedelta(0))
    assert (again.checked, again.suppressed, again.already_suppressed, again.errors) == (3, 0, 2, 0)
    # the next run mails neither user 2 (suppressed by user) nor user 3 (by address)
    assert rig.send("feedback_b") == {1: "sent"}
