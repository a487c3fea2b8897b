"""Deliverability feedback: ask the provider what became of recent sends and suppress the addresses
that hard-bounced or complained, so no further mail goes to them.

The ``deliverability_feedback`` DAG calls :func:`feedback_task` every 30 minutes. One run reads the
send log's ``sent`` emails of the last ``lookback`` hours that are due for a check (see
``sql/queries/feedback.sql``), asks ``GET /emails/{provider id}`` for each (Resend's Email object,
field ``last_event``), and per email, in one transaction:

* records what it saw in ``mail.delivery_status`` (last_event, checks, checked_at; ``final`` for
  ``bounced``, ``complained``, ``failed``, ``canceled`` and an email the provider no longer knows),
  so an email is polled at most ``max_checks`` times, spaced ``recheck_after * 2^(checks - 1)``
  apart, and never again after a final event;
* for ``bounced`` (Resend reports a permanent rejection as ``bounced``; temporary problems are
  ``delivery_delayed``) and ``complained`` (the recipient marked it as spam), inserts a suppression
  of the **address** for all mail (``scope = 'all'``, source ``bounce`` / ``complaint``,
  ``ON CONFLICT DO NOTHING``). The audiences and the scheduled dispatcher exclude suppressed
  addresses case-insensitively.

Requests go through the same client and the same shared pacer as sends: each GET claims a slot
first (``client.pacer.claim()``), honours 429 ``retry-after`` by pushing the shared schedule back
for every sender, retries 5xx and transport errors a bounded number of times, and stops at the
run's time budget. A run is bounded by ``limit`` emails, so polling never starves sending.
Webhooks (``email.bounced``/``email.complained``) are the push alternative (docs/unsubscribe.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import psycopg

from mailflow.provider.client import ResendClient, parse_retry_after
from mailflow.sql import query

log = logging.getLogger(__name__)

SUPPRESSING_EVENTS = {"bounced": "bounce", "complained": "complaint"}
"""last_event -> mail.suppression.source for the events that stop all further mail to the address."""
FINAL_EVENTS = frozenset({"bounced", "complained", "failed", "canceled", "cancelled", "not_found"})
"""Events after which an email is not polled again (``not_found``: the provider no longer has it)."""
MAX_CONSECUTIVE_ERRORS = 5


class FeedbackError(RuntimeError):
    """The provider refused the API key (401/403): a person must fix the named connection."""


@dataclass
class FeedbackSummary:
    """Counts of one poll (emails). ``due`` = emails selected for a check, ``checked`` = answers
    recorded, ``events`` = answers by last_event, ``suppressed`` = new suppressions,
    ``already_suppressed`` = bounces/complaints whose address was suppressed before, ``errors`` =
    emails left for a later run after retries, ``stopped`` = why the run ended early (or None)."""

    due: int = 0
    checked: int = 0
    bounced: int = 0
    complained: int = 0
    suppressed: int = 0
    already_suppressed: int = 0
    not_found: int = 0
    errors: int = 0
    requests: int = 0
    stopped: str | None = None
    events: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the task's XCom)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class _Answer:
    kind: str  # "ok" | "not_found" | "error" | "stop"
    body: dict[str, Any] | None = None
    reason: str = ""


class PacedReader:
    """Paced, retrying ``GET /emails/{id}`` over a :class:`ResendClient`'s pool, pacer and clock.

    Every attempt claims a pacer slot before any wait or I/O (the slot schedule is shared with every
    sender); 429 pushes the schedule back (``retry-after``, else the client's backoff); 5xx and
    transport errors are retried with the client's backoff; at most ``client.policy.max_attempts``
    attempts per email. Nothing waits past ``deadline`` (``client.clock.monotonic()`` seconds).
    """

    def __init__(self, client: ResendClient):
        self.client = client
        self.requests = 0

    def get_email(self, provider_id: str, deadline: float) -> _Answer:
        """Return ``ok`` with the Email object, ``not_found`` (404), ``error`` (gave up on this one)
        or ``stop`` (budget reached or rate limited for too long).

        :raises FeedbackError: on 401/403, naming the connection.
        """
        c = self.client
        last = "no attempt made"
        for attempt in range(1, c.policy.max_attempts + 1):
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
                    raise FeedbackError(f"provider refused the API key of connection {c.conn_id!r}: HTTP {status}")
                last = f"HTTP {status}: {resp.text[:200]}"
                if status == 429:
                    c.stats["429"] += 1
                    delay = parse_retry_after(resp.headers.get("retry-after"), c.clock)
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
                  min_age: timedelta = timedelta(minutes=5), recheck_after: timedelta = timedelta(hours=2),
                  max_checks: int = 4, limit: int = 500, budget_seconds: float = 600.0) -> FeedbackSummary:
    """Check the delivery status of recent sends once and suppress hard bounces and complaints.

    :param conn: psycopg 3 connection to the send log (autocommit is switched on; each email's
        record and suppression is one transaction, so a crash loses at most the email in flight).
    :param client: the paced Resend client (``ResendHook(...).get_conn()``).
    :param lookback: only emails sent within this span before the database's now() (UTC).
    :param min_age: an email is first checked this long after it was sent (bounces take a moment).
    :param recheck_after: a non-final answer is asked again after this, doubling per check.
    :param max_checks: polls per email at most (then its last answer stands).
    :param limit: emails per run at most (requests: about one each, more with retries).
    :param budget_seconds: no request starts after this many seconds (monotonic).
    :returns: the run's :class:`FeedbackSummary`.
    :raises FeedbackError: on 401/403 (after recording what was checked before).
    :raises ValueError: for a non-positive limit or max_checks.
    """
    if limit < 1 or max_checks < 1:
        raise ValueError(f"limit and max_checks must be >= 1, got {limit} and {max_checks}")
    if not conn.autocommit:
        conn.autocommit = True
    deadline = client.clock.monotonic() + budget_seconds
    summary = FeedbackSummary()
    reader = PacedReader(client)
    with conn.transaction():
        due = conn.execute(query("feedback", "due_checks"), {
            "lookback_seconds": lookback.total_seconds(), "min_age_seconds": min_age.total_seconds(),
            "recheck_seconds": recheck_after.total_seconds(), "max_checks": max_checks, "limit": limit,
        }).fetchall()
    summary.due = len(due)
    consecutive_errors = 0
    try:
        for send_log_id, email, provider_id, _checks in due:
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
            event = "not_found" if answer.kind == "not_found" else str((answer.body or {}).get("last_event") or "unknown")
            _record(conn, summary, int(send_log_id), str(email), str(provider_id), event)
    finally:
        summary.requests = reader.requests
        log.info("deliverability feedback: %s", summary.as_dict())
    return summary


def _record(conn: psycopg.Connection, summary: FeedbackSummary, send_log_id: int, email: str, provider_id: str,
            event: str) -> None:
    with conn.transaction():
        conn.execute(query("feedback", "record_check"), {
            "id": send_log_id, "pid": provider_id, "event": event, "final": event in FINAL_EVENTS})
        source = SUPPRESSING_EVENTS.get(event)
        if source is not None:
            row = conn.execute(query("suppression", "suppress_address"), {
                "email": email, "source": source,
                "reason": f"provider last_event {event} (send_log {send_log_id}, email {provider_id})"}).fetchone()
            if row is None:
                summary.already_suppressed += 1
            else:
                summary.suppressed += 1
    summary.checked += 1
    summary.events[event] = summary.events.get(event, 0) + 1
    if event == "bounced":
        summary.bounced += 1
    elif event == "complained":
        summary.complained += 1
    elif event == "not_found":
        summary.not_found += 1


def feedback_task(context: dict[str, Any]) -> dict[str, Any]:
    """The ``deliverability_feedback`` DAG's task: Params ``lookback_hours``, ``min_age_minutes``,
    ``recheck_after_minutes``, ``max_checks_per_email``, ``max_emails_per_run``,
    ``time_budget_seconds``. Connections ``send_log_db`` and ``resend_default``. Returns the
    :class:`FeedbackSummary` as a dict.

    :raises FeedbackError: if the provider refuses the API key.
    """
    from mailflow import settings
    from mailflow.migrate import require_current
    from mailflow.provider.hook import ResendHook
    from mailflow.tasks import budget_fits, send_log_connection

    params = context["params"]
    budget = budget_fits(context, float(params.get("time_budget_seconds", 600)), settings.FEEDBACK_CONN_ID)
    started = time.monotonic()
    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        client = ResendHook(settings.FEEDBACK_CONN_ID).get_conn()
        try:
            summary = poll_feedback(
                conn, client,
                lookback=timedelta(hours=float(params.get("lookback_hours", 48))),
                min_age=timedelta(minutes=float(params.get("min_age_minutes", 5))),
                recheck_after=timedelta(minutes=float(params.get("recheck_after_minutes", 120))),
                max_checks=int(params.get("max_checks_per_email", 4)),
                limit=int(params.get("max_emails_per_run", 500)),
                budget_seconds=budget,
            )
        finally:
            client.close()
            log.info("provider requests: %s (%.1f s)", client.stats, time.monotonic() - started)
    return summary.as_dict()
