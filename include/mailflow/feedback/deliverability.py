"""Deliverability feedback: ask the provider what became of recent sends and suppress the addresses
that hard-bounced, complained or are on the provider's suppression list, so no further mail goes to them.

The ``deliverability_feedback`` DAG calls :func:`feedback_task` every 30 minutes. One run reads the
send log's ``sent`` emails of the last ``lookback`` hours that are due for a check (see
``store/sql/queries/feedback.sql``), asks ``GET /emails/{provider id}`` for each (Resend's Email object,
field ``last_event``), and per email, in one transaction:

* records what it saw in ``mail.delivery_status`` (last_event, checks, checked_at; ``final`` for
  ``bounced``, ``complained``, ``failed``, ``canceled`` and an email the provider no longer knows),
  so an email is polled at most ``max_checks`` times, spaced ``recheck_after * 2^(checks - 1)``
  apart, and never again after a final event;
* **checks the recipient first**: the Email object's ``to`` must be exactly the send log's address
  (normalised: display name dropped, trimmed, compared case-insensitively, local part included).
  On a mismatch (ids attached to the wrong rows, e.g. a provider answering a batch out of order)
  nobody is suppressed, the email is recorded as ``recipient_mismatch`` (final) and the run alerts;
* for ``bounced`` (Resend reports a permanent rejection as ``bounced``; temporary problems are
  ``delivery_delayed``), ``complained`` (the recipient marked it as spam) and ``suppressed`` (the
  address is on Resend's own suppression list: the email was not delivered), inserts a suppression
  of the **address** for all mail (``scope = 'all'``, source ``bounce`` / ``complaint`` /
  ``provider_suppressed``, ``ON CONFLICT DO NOTHING``). The audiences and the scheduled dispatcher
  exclude suppressed addresses case-insensitively;
* for ``failed`` (the provider could not send it; the cause may be ours, so the address is not
  suppressed: invariant 8), records it (final) and alerts, so a person looks;
* records every decision (suppressed, already suppressed, mismatch, failed) as an event of the email
  in ``mail.send_event`` (``sent -> sent``: the row stays ``sent``, its request was accepted; the
  event's ``error`` says what the provider reported and what was decided), so
  ``mail.user_email_history`` shows it.

Needs a **full-access** API key: a sending-only key gets 401 ``restricted_api_key`` on
``GET /emails/{id}`` (``settings.FEEDBACK_CONN_ID`` may name a connection of its own).

Requests go through the same client and the same shared pacer as sends: each GET claims a slot
first (``client.pacer.claim()``), honours 429 ``retry-after`` by pushing the shared schedule back
for every sender, retries 5xx and transport errors a bounded number of times, and stops at the
run's time budget. A run is bounded by ``limit`` emails, so polling never starves sending.
Webhooks (``email.bounced``/``email.complained``) are the push alternative (docs/unsubscribe.md).
"""

from __future__ import annotations

import dataclasses
import email.utils
import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import psycopg

from mailflow.model.outcome import RunContext
from mailflow.provider.client import ResendClient, error_fields, parse_retry_after
from mailflow.provider.errors import describe_refusal
from mailflow.store.policy import mailbox_key
from mailflow.store.policy import normalise_address as check_address
from mailflow.store.sql import query
from mailflow.store.suppression import suppress_address, suppress_user

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
    """``"Name <A.B@Example.COM> "`` -> ``"a.b@example.com"``: the mailbox key
    (:func:`mailflow.store.policy.mailbox_key`) of an RFC 5322 mailbox's address; the domain is
    case-insensitive (RFC 5321 section 2.4) and so, in practice, is the local part (every mailbox
    provider we send to treats it so). Not a valid address: the trimmed text, case-folded."""
    _name, addr = email.utils.parseaddr(value.strip())
    text = (addr or value).strip()
    return mailbox_key(text) or text.casefold()


def recipient_matches(to: Any, address: str) -> bool:
    """True if the provider's ``to`` (a list of addresses, or one string) is exactly ``address``,
    normalised. Several recipients, none, or another one: False (we send one recipient per email)."""
    items = [to] if isinstance(to, str) else to if isinstance(to, list) else []
    return [normalise_address(str(a)) for a in items] == [normalise_address(address)]


@dataclass
class FeedbackSummary:
    """Counts of one poll (emails). ``due`` = emails selected for a check, ``checked`` = answers
    recorded, ``events`` = answers by last_event, ``suppressed`` = new suppressions,
    ``already_suppressed`` = bounces/complaints whose address was suppressed before,
    ``provider_suppressed`` / ``failed`` = last_event suppressed / failed, ``mismatched`` = answers
    whose ``to`` was not the send log's address (nothing suppressed), ``errors`` = emails left for a
    later run after retries, ``stopped`` = why the run ended early (or None). ``alerts`` lists the
    mismatches and failures (send-log id, masked address, provider id) for the run's alert."""

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
    events: dict[str, int] = field(default_factory=dict)
    alerts: list[str] = field(default_factory=list)

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
                  min_age: timedelta = timedelta(minutes=5), recheck_after: timedelta = timedelta(hours=2),
                  max_checks: int = 4, limit: int = 500, budget_seconds: float = 600.0,
                  run: RunContext | None = None) -> FeedbackSummary:
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
    :param run: the Airflow run, recorded on the decisions' send events.
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
            body = answer.body or {}
            event = "not_found" if answer.kind == "not_found" else str(body.get("last_event") or "unknown")
            if answer.kind == "ok" and not recipient_matches(body.get("to"), str(email)):
                event = MISMATCH  # never act on what may be another person's email
            _record(conn, summary, int(send_log_id), str(email), str(provider_id), event, run or RunContext(),
                    reported=str(body.get("last_event") or ""))
    finally:
        summary.requests = reader.requests
        log.info("deliverability feedback: %s", summary.as_dict())
    return summary


def _suppress_unkeyable(conn: psycopg.Connection, summary: FeedbackSummary, send_log_id: int, email: str,
                        provider_id: str, event: str, source: str) -> str:
    """Suppress the user of a row whose address has no mailbox key (in the caller's transaction);
    returns the decision recorded on the row's event."""
    from mailflow.store.send_log import mask_email

    why = check_address(email).error or "not a valid address"
    row = conn.execute(query("feedback", "user_of_row"), {"id": send_log_id}).fetchone()
    user_id = row[0] if row is not None else None
    if user_id is None:
        summary.alerts.append(f"send_log.id={send_log_id} to={mask_email(email)} provider id={provider_id}: "
                              f"last_event {event}, address has no mailbox key and the row no user")
        return (f"feedback: last_event {event}; the address has no mailbox key ({why}) and the row no user: "
                "nobody suppressed, a person must suppress it")
    new = suppress_user(conn, int(user_id), source=source, reason=(
        f"provider last_event {event} (send_log {send_log_id}, email {provider_id}); the address has no "
        f"mailbox key ({why})"))
    if new:
        summary.suppressed += 1
    else:
        summary.already_suppressed += 1
    log.warning("email %s (send_log %s): last_event %s for an address with no mailbox key (%s): user %s %s",
                provider_id, send_log_id, event, why, user_id, "suppressed" if new else "already suppressed")
    return (f"feedback: last_event {event}; the address has no mailbox key ({why}): "
            f"user {user_id} {'suppressed for all mail' if new else 'already suppressed'} (source {source})")


def _record(conn: psycopg.Connection, summary: FeedbackSummary, send_log_id: int, email: str, provider_id: str,
            event: str, run: RunContext, reported: str = "") -> None:
    from mailflow.store.send_log import mask_email

    decision: str | None = None
    with conn.transaction():
        conn.execute(query("feedback", "record_check"), {
            "id": send_log_id, "pid": provider_id, "event": event, "final": event in FINAL_EVENTS})
        source = SUPPRESSING_EVENTS.get(event)
        if source is not None and mailbox_key(email) is None:
            # an address the validator rejects today (stored by an older worker or validator) has
            # no mailbox key to suppress: its user is suppressed instead, never the poll aborted
            decision = _suppress_unkeyable(conn, summary, send_log_id, email, provider_id, event, source)
        elif source is not None:
            new = suppress_address(conn, email, source=source,
                                   reason=f"provider last_event {event} (send_log {send_log_id}, email {provider_id})")
            if not new:
                summary.already_suppressed += 1
                decision = f"feedback: last_event {event}; address already suppressed"
            else:
                summary.suppressed += 1
                decision = f"feedback: last_event {event}; address suppressed for all mail (source {source})"
        elif event == MISMATCH:
            decision = (f"feedback: provider email {provider_id} is addressed to someone else (last_event "
                        f"{reported or 'unknown'}); nobody suppressed, a person must check the provider ids")
        elif event == "failed":
            decision = "feedback: last_event failed (the provider did not send it); address not suppressed"
        if decision is not None:
            conn.execute(query("feedback", "record_decision"), {
                "id": send_log_id, "pid": provider_id, "decision": decision,
                "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id})
    if event in (MISMATCH, "failed"):
        summary.alerts.append(f"send_log.id={send_log_id} to={mask_email(email)} provider id={provider_id}: "
                              f"{decision}")
        log.warning("email %s (send_log %s): %s", provider_id, send_log_id, decision)
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
