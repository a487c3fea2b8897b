"""Storing verified webhooks durably and applying them to the send log, a whole group per transaction.

:func:`ingest` is what the receiver's group-commit writer runs for every group of verified requests:
one transaction inserts them all into ``mail.webhook_event`` (``ON CONFLICT (svix_id) DO NOTHING``: a
retried delivery changes nothing) and applies the new ones whose email the send log knows, through
:func:`mailflow.store.outcomes.apply_reports` (the same code as the poll). Only after the COMMIT does
the receiver answer 2xx, so an acknowledged event is never lost. An event whose email id is not in the
send log yet (the webhook can arrive before the batch answer that stores the id) stays pending
(``applied_at`` null, ``attempts`` 1); :func:`apply_pending` applies it later (the receiver's sweep
loop every few seconds, and the ``deliverability_feedback`` DAG), and after ``give_up_after`` decides
it ``unknown_email``, which is alerted with mismatches and failures (:func:`alert_lines`).

An event of a **test email** (a campaign's ``[TEST]`` email, never a send-log row) is matched to it by
the provider's email id or by our tag ``mailflow_test`` in ``data.tags``
(:mod:`mailflow.store.test_emails`), recorded on it at once (decided ``test_email``) and never left
pending, swept again or decided ``unknown_email``; its hard bounce or complaint suppresses the address.

Event types the send log does not track (``email.scheduled``, ``email.received``, contact and domain
events, anything new) are stored and decided ``ignored``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from mailflow.store import test_emails
from mailflow.store.outcomes import (
    APPLIED,
    BOUNCE_TYPES,
    EVENTS,
    FAILED,
    MISMATCH,
    UNKNOWN,
    Report,
    SentEmail,
    apply_reports,
    find_sent,
    recipient_matches,
)
from mailflow.store.reputation import evaluate
from mailflow.store.send_log import mask_email
from mailflow.store.sql import query

log = logging.getLogger(__name__)

IGNORED = "ignored"
GIVE_UP_AFTER = timedelta(hours=72)
"""An event whose email id no send-log row has after this long is decided ``unknown_email`` (alerted)."""
_UNSAFE_ESCAPE = re.compile(rb"\\u(0000|[dD][89abAB][0-9a-fA-F]{2}|[dD][c-fC-F][0-9a-fA-F]{2})")


class MalformedEvent(ValueError):
    """A verified body that is not a JSON object with a string ``type`` (400: the provider never sends one)."""


@dataclass(frozen=True)
class WebhookEvent:
    """One verified webhook: ``svix_id`` (the dedupe key), ``event_type`` (the envelope's ``type``),
    ``provider_message_id`` (``data.email_id``; None for other events), ``occurred_at`` (the
    envelope's ``created_at``, in UTC; None if absent, unparsable, without an offset or outside
    years 1..9999 in UTC), ``payload`` (the envelope,
    JSON-ready) and ``payload_json`` (the text stored as jsonb)."""

    svix_id: str
    event_type: str
    provider_message_id: str | None
    occurred_at: datetime | None
    payload: dict[str, Any]
    payload_json: str

    def report(self) -> Report | None:
        """The delivery report this event makes (None: a type the send log does not track, or no email id)."""
        if not self.event_type.startswith("email.") or self.provider_message_id is None:
            return None
        event = self.event_type[len("email."):]
        if event not in EVENTS:
            return None
        data = self.payload.get("data")
        data = data if isinstance(data, dict) else {}
        bounce_type = None
        detail = f"webhook {self.event_type}"
        if event == "bounced":
            bounce = data.get("bounce")
            given = bounce.get("type") if isinstance(bounce, dict) else None
            bounce_type = given if isinstance(given, str) and given in BOUNCE_TYPES else "Undetermined"  # unknown: never a hard bounce
            detail += f" ({bounce_type})"
        tags = data.get("tags")
        tag = tags.get(test_emails.TAG_NAME) if isinstance(tags, dict) else None
        return Report(provider_message_id=self.provider_message_id, event=event, recipients=data.get("to"),
                      source="webhook", detail=detail, occurred_at=self.occurred_at, bounce_type=bounce_type,
                      svix_id=self.svix_id, tag=tag if isinstance(tag, str) and 0 < len(tag) <= 256 else None)


def _clean(value: Any) -> Any:
    """``value`` with NUL characters and lone surrogates replaced (PostgreSQL's jsonb and text refuse them)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def _when(value: Any) -> datetime | None:
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        at = datetime.fromisoformat(value.strip())
        # in UTC, or None: a time that leaves Python's years 1..9999 there cannot be stored (the
        # driver refuses it, which would answer 503 for every retry of the event)
        return at.astimezone(UTC) if at.tzinfo is not None else None
    except (ValueError, OverflowError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_event(svix_id: str, body: bytes) -> WebhookEvent:
    """Parse a verified body (Resend's envelope ``{"type", "created_at", "data": {...}}``).

    :raises MalformedEvent: if it is not strict JSON (``NaN`` and ``Infinity``, which Python's parser
        takes and PostgreSQL's jsonb refuses, are not), is nested deeper than the parser's stack, or is
        not an object with a string ``type``.
    """
    try:
        obj = json.loads(body, parse_constant=_no_constant)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError and NaN/Infinity (not JSON; jsonb refuses them)
        raise MalformedEvent("body is not JSON") from None
    except RecursionError:  # nesting deeper than the parser's stack: no provider envelope is
        raise MalformedEvent("body is nested too deeply") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str) or not obj["type"]:
        raise MalformedEvent("body is not an event envelope (an object with a type)")
    if _UNSAFE_ESCAPE.search(body):
        obj = _clean(obj)  # rare: rebuild the text, else PostgreSQL would refuse the whole group
        text = json.dumps(obj, ensure_ascii=False)
    else:
        text = body.decode("utf-8")
    data = obj.get("data")
    pid = data.get("email_id") if isinstance(data, dict) else None
    pid = pid if isinstance(pid, str) and 0 < len(pid) <= 256 else None
    return WebhookEvent(svix_id=svix_id, event_type=str(obj["type"])[:128], provider_message_id=pid,
                        occurred_at=_when(obj.get("created_at")), payload=obj, payload_json=text)


@dataclass
class IngestResult:
    """What :func:`ingest` did for one group: ``decisions`` per svix-id of the events inserted now
    (applied, failed, recipient_mismatch, duplicate_outcome, ignored, or None: pending), the svix-ids
    that were there before (``duplicates``), new suppressions, and the campaigns whose emails got an
    outcome (for the reputation guard)."""

    decisions: dict[str, str | None] = field(default_factory=dict)
    duplicates: set[str] = field(default_factory=set)
    suppressed: int = 0
    campaigns: set[str] = field(default_factory=set)


def _find_tests(conn: psycopg.Connection, reports: Iterable[Report | None],
                rows: dict[str, SentEmail]) -> test_emails.Found:
    """The test emails the reports no send-log row has may be about (no such report: no query)."""
    return test_emails.find(conn, (r for r in reports if r is not None and r.provider_message_id not in rows))


def _expected(event: WebhookEvent, report: Report | None, rows: dict[str, SentEmail],
              tests: test_emails.Found) -> str | None:
    """The decision applying will make for a new event (None: its email is not known yet)."""
    if report is None:
        return IGNORED
    row = rows.get(report.provider_message_id)
    if row is None:
        test = tests.of(report)
        return None if test is None else test_emails.expected(report, test)
    if not recipient_matches(report.recipients, row.email):
        return MISMATCH
    return FAILED if report.event == "failed" else APPLIED


def ingest(conn: psycopg.Connection, events: Sequence[WebhookEvent]) -> IngestResult:
    """Insert a group of verified events and apply the new ones, in ONE transaction (committed on
    return: the caller may acknowledge all of them then).

    :param conn: a psycopg 3 connection (autocommit: this function opens the transaction).
    :param events: the group; a svix-id given twice is stored once.
    :returns: :class:`IngestResult`.
    :raises psycopg.Error: on any database failure (nothing of the group is stored then).
    """
    unique: dict[str, WebhookEvent] = {}
    for e in events:
        unique.setdefault(e.svix_id, e)
    group = list(unique.values())
    reports = {e.svix_id: e.report() for e in group}
    out = IngestResult()
    with conn.transaction():
        rows = find_sent(conn, (r.provider_message_id for r in reports.values() if r is not None))
        tests = _find_tests(conn, reports.values(), rows)
        expected = {e.svix_id: _expected(e, reports[e.svix_id], rows, tests) for e in group}
        new = {r[0] for r in conn.execute(query("webhooks", "insert_events"), {
            "svix_ids": [e.svix_id for e in group], "types": [e.event_type for e in group],
            "pids": [e.provider_message_id for e in group], "occurred": [e.occurred_at for e in group],
            "payloads": [e.payload_json for e in group], "decisions": [expected[e.svix_id] for e in group],
            "attempts": [1 if expected[e.svix_id] is None else 0 for e in group]}).fetchall()}
        out.duplicates = set(unique) - new
        fresh = [r for sid, r in reports.items() if sid in new and r is not None and expected[sid] is not None]
        to_apply = [r for r in fresh if r.provider_message_id in rows]
        to_test = [(r, t) for r in fresh if r.provider_message_id not in rows and (t := tests.of(r)) is not None]
        for sid in new:
            out.decisions[sid] = expected[sid]
        if to_apply:
            applied = apply_reports(conn, to_apply, rows=rows)
            _correct(conn, ((d.report.svix_id, d.decision) for d in applied.decisions), expected, out)
            out.suppressed, out.campaigns = applied.suppressed, applied.campaigns
        if to_test:
            tested = test_emails.apply_reports(conn, to_test)
            _correct(conn, ((r.svix_id, d) for (r, _), d in zip(to_test, tested.decisions, strict=True)),
                     expected, out)
            out.suppressed += tested.suppressed
    return out


def _correct(conn: psycopg.Connection, decisions: Iterable[tuple[str | None, str]], expected: dict[str, str | None],
             out: IngestResult) -> None:
    fix = {sid: decision for sid, decision in decisions if sid is not None and decision != expected.get(sid)}
    for sid, decision in fix.items():
        out.decisions[sid] = decision
    if fix:
        conn.execute(query("webhooks", "set_decisions"), {"svix_ids": list(fix), "decisions": list(fix.values())})


@dataclass
class ApplySummary:
    """Counts of one :func:`apply_pending` sweep (events): ``taken`` = pending rows looked at,
    ``applied`` (including failed, duplicate_outcome and test emails), ``mismatched``, ``failed``,
    ``test_emails`` (applied to a test email), ``ignored``, ``still_pending`` (email still unknown,
    tried again later), ``unknown_email`` (given up), ``suppressed`` (new suppressions) and the
    ``campaigns`` touched (test emails touch none: they are in no reputation rate)."""

    taken: int = 0
    applied: int = 0
    mismatched: int = 0
    failed: int = 0
    test_emails: int = 0
    ignored: int = 0
    still_pending: int = 0
    unknown_email: int = 0
    suppressed: int = 0
    campaigns: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (a task's XCom; campaigns sorted)."""
        d = dict(self.__dict__)
        d["campaigns"] = sorted(self.campaigns)
        return d


def apply_pending(conn: psycopg.Connection, limit: int = 500, *,
                  give_up_after: timedelta = GIVE_UP_AFTER) -> ApplySummary:
    """Apply inbox rows still waiting for their email, in one transaction: those whose provider id the
    send log has now are applied (:func:`mailflow.store.outcomes.apply_reports`), those of a test email
    are recorded on it (:func:`mailflow.store.test_emails.apply_reports`, whatever their age); the
    others count an attempt, and those received more than ``give_up_after`` ago are decided
    ``unknown_email`` (alerted by :func:`alert_lines`). Safe to run concurrently (rows are taken FOR
    UPDATE SKIP LOCKED).

    :param conn: psycopg 3 connection (autocommit: this function opens the transaction).
    :param limit: rows per call at most (fewest attempts first, then the oldest).
    :raises ValueError: for a limit below 1.
    :raises psycopg.Error: on a database failure (nothing applied then).
    """
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    summary = ApplySummary()
    with conn.transaction():
        taken = conn.execute(query("webhooks", "pending_events"), {
            "limit": int(limit), "give_up_seconds": give_up_after.total_seconds()}).fetchall()
        summary.taken = len(taken)
        if not taken:
            return summary
        events: list[tuple[WebhookEvent, bool]] = []
        for sid, etype, pid, occurred, payload, expired in taken:
            obj = payload if isinstance(payload, dict) else {}
            events.append((WebhookEvent(str(sid), str(etype), pid, occurred, obj, ""), bool(expired)))
        reports = {e.svix_id: e.report() for e, _ in events}
        rows = find_sent(conn, (r.provider_message_id for r in reports.values() if r is not None))
        tests = _find_tests(conn, reports.values(), rows)
        decided: dict[str, str] = {}
        retry: list[str] = []
        to_apply: list[Report] = []
        to_test: list[tuple[Report, test_emails.TestEmail]] = []
        for e, expired in events:
            r = reports[e.svix_id]
            test = tests.of(r) if r is not None and r.provider_message_id not in rows else None
            if r is None:
                decided[e.svix_id] = IGNORED
                summary.ignored += 1
            elif r.provider_message_id in rows:
                to_apply.append(r)
            elif test is not None:
                to_test.append((r, test))
            elif expired:
                decided[e.svix_id] = UNKNOWN
                summary.unknown_email += 1
            else:
                retry.append(e.svix_id)
        summary.still_pending = len(retry)
        if to_apply:
            applied = apply_reports(conn, to_apply, rows=rows)
            for d in applied.decisions:
                assert d.report.svix_id is not None
                decided[d.report.svix_id] = d.decision
                if d.decision == MISMATCH:
                    summary.mismatched += 1
                else:
                    summary.applied += 1
                    summary.failed += d.decision == FAILED
            summary.suppressed, summary.campaigns = applied.suppressed, applied.campaigns
        if to_test:
            tested = test_emails.apply_reports(conn, to_test)
            for (r, _), decision in zip(to_test, tested.decisions, strict=True):
                assert r.svix_id is not None
                decided[r.svix_id] = decision
                if decision == MISMATCH:
                    summary.mismatched += 1
                else:
                    summary.applied += 1
                    summary.failed += decision == FAILED
                    summary.test_emails += 1
            summary.suppressed += tested.suppressed
        if decided:
            conn.execute(query("webhooks", "set_decisions"), {
                "svix_ids": list(decided), "decisions": list(decided.values())})
        if retry:
            conn.execute(query("webhooks", "count_attempts"), {"svix_ids": retry})
    if summary.applied or summary.mismatched or summary.unknown_email:
        log.info("webhook sweep: %s", summary.as_dict())
    return summary


def alert_lines(conn: psycopg.Connection, limit: int = 1000) -> tuple[list[str], list[str]]:
    """The decisions a person must see that no alert named yet: recipient mismatches, provider
    failures, emails never found. Returns ``(lines, svix_ids)``; call :func:`mark_alerted` with the
    ids in the same transaction after the alert went out (rows are locked, SKIP LOCKED, until then).
    Each line names the svix-id, event type, provider id, the send-log row (or the test email and its
    campaign) and the masked address."""
    rows = conn.execute(query("webhooks", "unalerted_decisions"), {"limit": int(limit)}).fetchall()
    lines = []
    for sid, etype, pid, decision, _received, log_id, address, test_id, test_campaign, test_to in rows:
        if log_id is not None:
            where = f"send_log.id={log_id} to={mask_email(str(address))}"
        elif test_id is not None:
            where = f"test email {test_id} of campaign {test_campaign} to={test_to}"
        else:
            where = "no send-log row"
        lines.append(f"webhook {sid} ({etype}) provider id={pid} {where}: {decision}")
    return lines, [str(r[0]) for r in rows]


def mark_alerted(conn: psycopg.Connection, svix_ids: list[str]) -> None:
    """Record that an alert named these inbox rows (not alerted again)."""
    if svix_ids:
        conn.execute(query("webhooks", "mark_alerted"), {"svix_ids": svix_ids})


def guard_reputation(conn: psycopg.Connection, campaigns: Iterable[str]) -> list[Any]:
    """Let the reputation guard evaluate the campaigns that just got outcomes
    (:func:`mailflow.store.reputation.evaluate`: it trips a campaign or the account over a threshold);
    returns its trips. The one call site the receiver, the sweep and the poll share. Runs in the
    caller's connection and transaction; nothing to evaluate: no database work.
    """
    names = sorted(set(campaigns))
    if not names:
        return []
    return list(evaluate(conn, names))
