"""Deliverability feedback, the safety net: ask the provider about sent emails that still have no outcome.

Outcomes arrive as signed webhooks (:mod:`mailflow.feedback.webhooks`, docs/feedback.md), seconds after
the provider sees them. This poll only covers what the webhooks did not deliver (the receiver down longer
than the provider retries, an endpoint not registered yet): the ``deliverability_feedback`` DAG calls
:func:`feedback_task` every 30 minutes, and one run asks ``GET /emails/{provider id}`` (Resend's Email
object, field ``last_event``) for the ``sent`` emails of the last ``lookback`` hours that are at least
``min_age`` old (default 1 h: webhooks come first) and have **no outcome** yet
(``mail.delivery_status.outcome`` is null; see ``store/sql/queries/feedback.sql``, ``due_checks``).

It stays off the critical rate path: every GET claims a slot of the same shared pacer as the sends,
and a run makes at most ``rate_share`` (default 1%) of the slots the account has between two runs
(:func:`request_budget`: ``share * requests_per_second * interval``), retries included, never more.

Per email, in one transaction, the answer is recorded in ``mail.delivery_status`` (last_event, checks,
checked_at; ``final`` for an answer that will not change, so an email is polled at most ``max_checks``
times, spaced ``recheck_after * 2^(checks - 1)`` apart) and then applied through the same code as the
webhooks (:func:`mailflow.store.outcomes.apply_reports`), so the poll and the webhook record the same
outcome:

* **the recipient is checked first**: the Email object's ``to`` must be exactly the send log's address
  (normalised). On a mismatch nothing is applied to that row; the provider's own ``to`` is the address
  that really bounced or complained, and for a hard bounce, a complaint or the provider's suppression
  list **that** address is suppressed (nobody else); the email is recorded as ``recipient_mismatch``
  (final) and the run alerts;
* ``bounced`` (Resend reports a permanent rejection as ``bounced``), ``complained`` and ``suppressed``
  suppress the **address** for all mail (source ``bounce`` / ``complaint`` / ``provider_suppressed``);
* ``failed`` (the provider could not send it; the cause may be ours, so the address is not
  suppressed) is recorded (final) and alerted;
* every decision is an event of the email in ``mail.send_event`` (sent -> sent), so
  ``mail.user_email_history`` shows it; the answer is a typed ``mail.delivery_event`` (source poll).

Needs a **full-access** API key: a sending-only key gets 401 ``restricted_api_key`` on
``GET /emails/{id}`` (``settings.FEEDBACK_CONN_ID`` may name a connection of its own).

Requests honour 429 ``retry-after`` by pushing the shared schedule back for every sender, retry 5xx and
transport errors a bounded number of times, and stop at the run's time budget.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import psycopg

from mailflow.feedback.webhook_ingest import guard_reputation
from mailflow.model.outcome import RunContext
from mailflow.provider.client import ResendClient, error_fields, parse_retry_after
from mailflow.provider.errors import describe_refusal
from mailflow.store.outcomes import (
    EVENTS,
    Report,
    SentEmail,
    apply_reports,
    normalise_recipient,
    recipient_matches,
)
from mailflow.store.sql import query

log = logging.getLogger(__name__)

SUPPRESSING_EVENTS = {"bounced": "bounce", "complained": "complaint", "suppressed": "provider_suppressed"}
"""last_event -> mail.suppression.source for the events that stop all further mail to the address."""
MISMATCH = "recipient_mismatch"
"""Recorded instead of the provider's last_event when its ``to`` is not the send log's address."""
FINAL_EVENTS = frozenset({"bounced", "complained", "suppressed", "failed", "canceled", "cancelled", "not_found",
                          MISMATCH})
"""Events after which an email is not polled again (``not_found``: the provider no longer has it)."""
MAX_CONSECUTIVE_ERRORS = 5


class FeedbackError(RuntimeError):
    """The provider refused the request (401/403: a sending-only or unknown key, ...): a person must
    fix the named connection (the message says how, :func:`mailflow.provider.errors.describe_refusal`)."""


def normalise_address(value: str) -> str:
    """``"Name <A.B@Example.COM> "`` -> ``"a.b@example.com"`` (:func:`mailflow.store.outcomes.normalise_recipient`)."""
    return normalise_recipient(value)


__all__ = ["FeedbackError", "FeedbackSummary", "PacedReader", "normalise_address", "poll_feedback",
           "recipient_matches", "request_budget"]


def request_budget(requests_per_second: float, share: float, interval_seconds: float) -> int:
    """Requests one poll run may make: ``floor(share * requests_per_second * interval_seconds)``, the
    given share of the account's slots between two runs (e.g. 1% of 10 requests/s over 30 minutes: 180).

    :raises ValueError: for a share outside [0, 1] or a negative rate or interval.
    """
    if not 0 <= share <= 1 or requests_per_second < 0 or interval_seconds < 0:
        raise ValueError(f"share must be in [0, 1], rate and interval >= 0; got {share}, {requests_per_second}, "
                         f"{interval_seconds}")
    return math.floor(share * requests_per_second * interval_seconds + 1e-9)


@dataclass
class FeedbackSummary:
    """Counts of one poll (emails). ``due`` = emails selected for a check, ``checked`` = answers
    recorded, ``events`` = answers by last_event, ``suppressed`` = new suppressions,
    ``already_suppressed`` = bounces/complaints whose address was suppressed before,
    ``provider_suppressed`` / ``failed`` = last_event suppressed / failed, ``mismatched`` = answers
    whose ``to`` was not the send log's address (nothing applied to the row; the provider's recipient
    suppressed for a hard bounce or complaint, counted in ``suppressed``), ``errors`` = emails left for
    a later run after retries, ``requests`` made of ``request_budget`` (None: unbounded), ``stopped`` =
    why the run ended early (or None). ``alerts`` lists the mismatches and failures (send-log id,
    masked address, provider id) for the run's alert; ``campaigns`` those whose emails got an outcome."""

    due: int = 0
    checked: int = 0
    bounced: int = 0
    complained: int = 0
    suppressed: int = 0
    already_suppressed: int = 0
    provider_suppressed: int = 0
    failed: int = 0
    mismatched: int = 0
    not_found: int = 0
    errors: int = 0
    requests: int = 0
    stopped: str | None = None
    request_budget: int | None = None
    events: dict[str, int] = field(default_factory=dict)
    alerts: list[str] = field(default_factory=list)
    campaigns: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the task's XCom)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Answer:
    kind: str  # "ok" | "not_found" | "error" | "stop"
    body: dict[str, Any] | None = None
    reason: str = ""


class PacedReader:
    """Paced, retrying ``GET /emails/{id}`` over a :class:`ResendClient`'s pool, pacer and clock,
    at most ``max_requests`` requests in all (None: unbounded).

    Every attempt claims a pacer slot before any wait or I/O (the slot schedule is shared with every
    sender); 429 pushes the schedule back (``retry-after``, else the client's backoff); 5xx and
    transport errors are retried with the client's backoff; at most ``client.policy.max_attempts``
    attempts per email. Nothing waits past ``deadline`` (``client.clock.monotonic()`` seconds).
    """

    def __init__(self, client: ResendClient, max_requests: int | None = None):
        self.client = client
        self.requests = 0
        self.max_requests = max_requests

    def get_email(self, provider_id: str, deadline: float) -> _Answer:
        """Return ``ok`` with the Email object, ``not_found`` (404), ``error`` (gave up on this one)
        or ``stop`` (budget reached or rate limited for too long).

        :raises FeedbackError: on 401/403, naming the connection.
        """
        c = self.client
        last = "no attempt made"
        for attempt in range(1, c.policy.max_attempts + 1):
            if self.max_requests is not None and self.requests >= self.max_requests:
                return _Answer("stop", reason=f"request budget ({self.max_requests} requests) spent")
            wait = c.pacer.claim()
            if c.clock.monotonic() + wait >= deadline:
                return _Answer("stop", reason="time budget")
            c.clock.sleep(wait)
            self.requests += 1
            c.stats["requests"] += 1
            try:
                resp = c.http.get(f"/emails/{provider_id}")
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                last = f"{type(exc).__name__}: {exc or 'no response'}"
            else:
                c.pacer.observe(resp.headers)
                status = resp.status_code
                if status == 200:
                    try:
                        body = resp.json()
                    except ValueError:
                        return _Answer("error", reason=f"200 with a body that is not JSON: {resp.text[:120]!r}")
                    if not isinstance(body, dict) or body.get("id") != provider_id:
                        return _Answer("error", reason="answer is not the requested email")
                    return _Answer("ok", body=body)
                if status == 404:
                    return _Answer("not_found")
                if status in (401, 403):
                    raise FeedbackError(describe_refusal(status, *error_fields(resp), c.conn_id).message)
                last = f"HTTP {status}: {resp.text[:200]}"
                if status == 429:
                    c.stats["429"] += 1
                    delay = parse_retry_after(resp.headers.get("retry-after"), c.clock, resp.headers.get("date"))
                    if delay is None:
                        delay = c.policy.backoff(attempt, c.rng)
                    c.pacer.push_back(delay)  # every sender of the account waits, not just us
                    if delay > c.policy.max_retry_after or c.clock.monotonic() + delay > deadline:
                        return _Answer("stop", reason=f"rate limited ({last})")
                    continue  # the next claim lands after the pushed-back schedule
                if status < 500:
                    return _Answer("error", reason=last)  # a 4xx will not get better by retrying
                c.stats["5xx"] += 1
            if attempt < c.policy.max_attempts:
                delay = c.policy.backoff(attempt, c.rng)
                if c.clock.monotonic() + delay > deadline:
                    return _Answer("stop", reason=f"time budget reached while retrying ({last})")
                c.clock.sleep(delay)
        return _Answer("error", reason=f"gave up after {c.policy.max_attempts} attempts: {last}")


def poll_feedback(conn: psycopg.Connection, client: ResendClient, *, lookback: timedelta = timedelta(hours=48),
                  min_age: timedelta = timedelta(hours=1), recheck_after: timedelta = timedelta(hours=2),
                  max_checks: int = 4, limit: int = 500, budget_seconds: float = 600.0,
                  max_requests: int | None = None, run: RunContext | None = None) -> FeedbackSummary:
    """Ask once about the sent emails that have no outcome yet and apply the answers.

    :param conn: psycopg 3 connection to the send log (autocommit is switched on; each email's
        record and suppression is one transaction, so a crash loses at most the email in flight).
    :param client: the paced Resend client (``ResendHook(...).get_conn()``).
    :param lookback: only emails sent within this span before the database's now() (UTC).
    :param min_age: an email is first asked about this long after it was sent (webhooks come first).
    :param recheck_after: a non-final answer is asked again after this, doubling per check.
    :param max_checks: polls per email at most (then its last answer stands).
    :param limit: emails per run at most.
    :param budget_seconds: no request starts after this many seconds (monotonic).
    :param max_requests: requests per run at most, retries included (:func:`request_budget`; None:
        ``limit`` bounds it alone). The emails selected are at most this many too.
    :param run: the Airflow run, recorded on the decisions' send events.
    :returns: the run's :class:`FeedbackSummary`.
    :raises FeedbackError: on 401/403 (after recording what was checked before).
    :raises ValueError: for a non-positive limit or max_checks, or a negative max_requests.
    """
    if limit < 1 or max_checks < 1 or (max_requests is not None and max_requests < 0):
        raise ValueError(f"limit and max_checks must be >= 1 and max_requests >= 0, got {limit}, {max_checks}, "
                         f"{max_requests}")
    if not conn.autocommit:
        conn.autocommit = True
    deadline = client.clock.monotonic() + budget_seconds
    summary = FeedbackSummary(request_budget=max_requests)
    reader = PacedReader(client, max_requests)
    if max_requests == 0:
        summary.stopped = "request budget (0 requests) spent"
        return summary
    with conn.transaction():
        due = conn.execute(query("feedback", "due_checks"), {
            "lookback_seconds": lookback.total_seconds(), "min_age_seconds": min_age.total_seconds(),
            "recheck_seconds": recheck_after.total_seconds(), "max_checks": max_checks,
            "limit": min(limit, max_requests) if max_requests is not None else limit,
        }).fetchall()
    summary.due = len(due)
    consecutive_errors = 0
    campaigns: set[str] = set()
    try:
        for send_log_id, email, provider_id, _checks, campaign, user_id in due:
            answer = reader.get_email(str(provider_id), deadline)
            if answer.kind == "stop":
                summary.stopped = answer.reason
                break
            if answer.kind == "error":
                summary.errors += 1
                consecutive_errors += 1
                log.warning("email %s (send_log %s): no status this run: %s", provider_id, send_log_id, answer.reason)
                if consecutive_errors >= MAX_CONSECUTIVE_ERRORS:
                    summary.stopped = f"{consecutive_errors} emails in a row without an answer ({answer.reason})"
                    break
                continue
            consecutive_errors = 0
            body = answer.body or {}
            event = "not_found" if answer.kind == "not_found" else str(body.get("last_event") or "unknown")
            if answer.kind == "ok" and not recipient_matches(body.get("to"), str(email)):
                event = MISMATCH  # never act on what may be another person's email
            row = SentEmail(int(send_log_id), str(provider_id), str(email), str(campaign), user_id, "sent")
            _record(conn, summary, row, event, run or RunContext(), reported=str(body.get("last_event") or ""),
                    to=body.get("to"), campaigns=campaigns)
    finally:
        summary.requests = reader.requests
        summary.campaigns = sorted(campaigns)
        log.info("deliverability feedback: %s", summary.as_dict())
    if campaigns:
        with conn.transaction():
            guard_reputation(conn, campaigns)
    return summary


def _record(conn: psycopg.Connection, summary: FeedbackSummary, row: SentEmail, event: str, run: RunContext,
            reported: str = "", to: Any = None, campaigns: set[str] | None = None) -> None:
    """Record one answer (delivery_status's poll columns) and apply it as a report, in one transaction."""
    what = reported if event == MISMATCH else event
    with conn.transaction():
        conn.execute(query("feedback", "record_check"), {
            "id": row.id, "pid": row.provider_message_id, "event": event, "final": event in FINAL_EVENTS})
        if event == MISMATCH or (what in EVENTS and what != "sent"):  # "sent": the send log knows it already
            # a mismatch goes through the same code (nothing applied to the row; the provider's recipient
            # suppressed if the event calls for it); an event we do not track stands in as "sent"
            report = Report(row.provider_message_id, what if what in EVENTS else "sent", to, "poll",
                            f"last_event {what or 'unknown'}")
            applied = apply_reports(conn, [report], rows={row.provider_message_id: row}, run=run)
            summary.suppressed += applied.suppressed
            summary.already_suppressed += applied.already_suppressed
            summary.alerts += applied.alerts
            if campaigns is not None:
                campaigns |= applied.campaigns
    summary.checked += 1
    summary.events[event] = summary.events.get(event, 0) + 1
    if event == "bounced":
        summary.bounced += 1
    elif event == "complained":
        summary.complained += 1
    elif event == "not_found":
        summary.not_found += 1
    elif event == "suppressed":
        summary.provider_suppressed += 1
    elif event == "failed":
        summary.failed += 1
    elif event == MISMATCH:
        summary.mismatched += 1
