"""Test emails of scheduled campaigns, and the provider's outcomes of them (``mail.test_email``).

A test email (:mod:`mailflow.sources.scheduled.test_email`) is never a send-log row: it is in no count,
no contact policy and no reputation rate. Its record here is written **before** the request
(:func:`record_request`: status ``sending``, a new tag id), and completed after the answer: the
provider's email id and the campaign event ``test_email`` that records it (:func:`record_accepted`), or
the status of a request that was not accepted (:func:`record_not_accepted`). The email carries our
tag ``mailflow_test = <tag id>`` (:data:`TAG_NAME`); Resend echoes an email's tags in every webhook
(``data.tags``, resend-openapi.yaml ``OutboundEmailEventData``).

The webhook receiver and its sweep (:mod:`mailflow.feedback.webhook_ingest`) match an event that no
send-log row has to a test email (:func:`find`, :meth:`Found.of`): by the provider's email id, or by
the tag while that id is not stored yet (the webhook can beat the provider's answer; the id is then
learnt from the event). :func:`apply_reports` decides it like a send-log row's
(:mod:`mailflow.store.outcomes`):

* **the recipient is checked**: the provider's ``to`` must be the test email's address (normalised;
  for a row backfilled from a campaign event, which kept only the masked address, the masked forms
  must agree). A mismatch is not recorded on the test email; for a hard bounce, a complaint or the
  provider's suppression the provider's own recipient is suppressed; decided ``recipient_mismatch``
  and alerted;
* the event is recorded (``mail.test_email_event``, one per svix-id) and folded into the test email's
  outcome columns (earliest time per column, opens and clicks added, the outcome by precedence);
  decided ``test_email`` (:data:`TEST_EMAIL`), or ``failed`` for ``email.failed`` (alerted, like any
  email the provider did not send), or ``duplicate_outcome`` for an event recorded before;
* a **hard bounce** (bounce type Permanent), a **complaint** or the provider's **suppression** suppresses
  the address for all mail, like any other email's (sources ``bounce``, ``complaint``,
  ``provider_suppressed``): the provider counts them against the account whoever the recipient is, and
  a later test email to that address is refused (:func:`suppressed_as`).

Such events are never left pending, never swept again and never decided ``unknown_email``; an event
that matches neither a send-log row nor a test email still is (and is alerted).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from mailflow.store.outcomes import (
    DUPLICATE,
    FAILED,
    MISMATCH,
    SOURCE_RANK,
    Report,
    provider_recipient,
    recipient_matches,
)
from mailflow.store.policy import mailbox_key
from mailflow.store.send_log import mask_email
from mailflow.store.sql import query

log = logging.getLogger(__name__)

TAG_NAME = "mailflow_test"
"""The tag a test email carries (value: its ``mail.test_email.tag``); Resend echoes it in ``data.tags``."""
TEST_EMAIL = "test_email"
"""The ``mail.webhook_event.decision`` of an event recorded on a test email."""
NOT_ACCEPTED = frozenset({"not_sent", "refused", "unknown"})
"""``mail.test_email.status`` values of a request the provider did not accept."""


@dataclass(frozen=True)
class TestEmail:
    """A test email an event may be about: ``id`` (mail.test_email.id), ``tag``, the provider's id
    (None until known), the address sent to (``email``; None for a row backfilled from a campaign
    event), ``to_masked`` and the ``campaign``'s name."""

    __test__ = False  # not a pytest class

    id: int
    tag: str
    provider_message_id: str | None
    email: str | None
    to_masked: str
    campaign: str


class Found:
    """The test emails :func:`find` looked up, by provider id and by tag."""

    def __init__(self, rows: Iterable[TestEmail]) -> None:
        rows = list(rows)
        self._by_pid = {t.provider_message_id: t for t in rows if t.provider_message_id is not None}
        self._by_tag = {t.tag: t for t in rows}

    def __bool__(self) -> bool:
        return bool(self._by_tag)

    def of(self, report: Report) -> TestEmail | None:
        """The test email ``report`` is about: the one with its provider id, else the one with its tag
        whose provider id is not known yet (or is the same). None: no test email."""
        found = self._by_pid.get(report.provider_message_id)
        if found is not None:
            return found
        if report.tag is None:
            return None
        found = self._by_tag.get(report.tag)
        if found is None or found.provider_message_id not in (None, report.provider_message_id):
            return None  # the tag names a test email the provider gave another id: not this one
        return found


def find(conn: psycopg.Connection, reports: Iterable[Report]) -> Found:
    """The test emails ``reports`` may be about (by provider id or tag); no reports: no query.

    :raises psycopg.Error: on a database failure.
    """
    reports = list(reports)
    pids = sorted({r.provider_message_id for r in reports})
    tags = sorted({r.tag for r in reports if r.tag is not None})
    if not pids and not tags:
        return Found([])
    rows = conn.execute(query("test_emails", "find"), {"pids": pids, "tags": tags}).fetchall()
    return Found(TestEmail(int(r[0]), str(r[1]), r[2], r[3], str(r[4]), str(r[5])) for r in rows)


def recipient_ok(report: Report, test: TestEmail) -> bool:
    """True if the provider's ``to`` is the test email's address (normalised), or, for a row that
    kept only the masked address, masks to the same text (case-insensitive)."""
    if test.email is not None:
        return recipient_matches(report.recipients, test.email)
    theirs = provider_recipient(report.recipients)
    return theirs is not None and mask_email(theirs).casefold() == test.to_masked.casefold()


def expected(report: Report, test: TestEmail) -> str:
    """The decision :func:`apply_reports` makes for a new event about ``test`` (before duplicates)."""
    if not recipient_ok(report, test):
        return MISMATCH
    return FAILED if report.event == "failed" else TEST_EMAIL


@dataclass
class TestApplied:
    """What :func:`apply_reports` did: ``decisions`` (one per report, in order: test_email, failed,
    recipient_mismatch or duplicate_outcome), new suppressions and existing ones, and ``alerts``
    (one line per mismatch, failure or address nobody could be suppressed for)."""

    __test__ = False  # not a pytest class

    decisions: list[str] = field(default_factory=list)
    recorded: int = 0
    suppressed: int = 0
    already_suppressed: int = 0
    alerts: list[str] = field(default_factory=list)


def apply_reports(conn: psycopg.Connection, matched: Sequence[tuple[Report, TestEmail]]) -> TestApplied:
    """Apply webhook reports to the test emails they are about (see the module docstring), set-based,
    in the caller's transaction.

    :param matched: ``(report, test email)`` pairs (:meth:`Found.of`); several may concern one email.
    :returns: :class:`TestApplied`, its decisions in the order of ``matched``.
    :raises ValueError: for a report without a svix-id (only webhooks are matched to test emails).
    :raises psycopg.Error: on a database failure (nothing is applied then).
    """
    out = TestApplied()
    if not matched:
        return out
    for report, _ in matched:
        if report.svix_id is None:
            raise ValueError(f"test email report for {report.provider_message_id} has no svix-id (not a webhook)")
    decisions = [expected(r, t) for r, t in matched]
    learnt = {t.id: r.provider_message_id for (r, t), d in zip(matched, decisions, strict=True)
              if d != MISMATCH and t.provider_message_id is None}
    if learnt:
        ids = sorted(learnt)
        conn.execute(query("test_emails", "learn_provider_ids"), {"ids": ids, "pids": [learnt[i] for i in ids]})
    record = [(r, t) for (r, t), d in zip(matched, decisions, strict=True) if d != MISMATCH]
    recorded: set[str] = set()
    if record:
        got = conn.execute(query("test_emails", "record_events"), {
            "ids": [t.id for _, t in record], "pids": [r.provider_message_id for r, _ in record],
            "events": [r.event for r, _ in record],
            "bounce_types": [r.bounce_type if r.event == "bounced" else None for r, _ in record],
            "occurred": [r.occurred_at for r, _ in record], "svix_ids": [r.svix_id for r, _ in record]}).fetchall()
        recorded = {str(row[0]) for row in got}
    out.recorded = len(recorded)
    for i, ((report, test), decision) in enumerate(zip(matched, decisions, strict=True)):
        if decision != MISMATCH and report.svix_id not in recorded:
            decisions[i] = DUPLICATE  # recorded by an earlier delivery of the same webhook: nothing changes
        elif decision == FAILED:
            out.alerts.append(f"test email {test.id} of campaign {test.campaign} to {test.to_masked} provider id="
                              f"{report.provider_message_id}: {report.detail} (the provider did not send it)")
    out.decisions = decisions
    _suppress(conn, matched, decisions, out)
    for line in out.alerts:
        log.warning("%s", line)
    return out


def _suppress(conn: psycopg.Connection, matched: Sequence[tuple[Report, TestEmail]], decisions: list[str],
              out: TestApplied) -> None:
    """Suppress the address of an applied hard bounce, complaint or provider suppression, or the
    provider's own recipient for such a report that named another address."""
    wanted: dict[str, tuple[int, str, str, str]] = {}  # key -> (rank, address, source, reason)
    for (report, test), decision in zip(matched, decisions, strict=True):
        source = report.suppression_source()
        if source is None or decision == DUPLICATE:
            continue
        where = f"test email {test.id} of campaign {test.campaign}, email {report.provider_message_id}, " \
                f"svix-id {report.svix_id}"
        if decision == MISMATCH:
            target = provider_recipient(report.recipients)
            reason = f"provider {report.detail} ({where}, sent to {test.to_masked}: addressed to this address)"
            out.alerts.append(f"test email {test.id} of campaign {test.campaign} to {test.to_masked} provider id="
                              f"{report.provider_message_id}: {report.detail} is addressed to someone else; "
                              + ("the provider's recipient is suppressed" if target is not None
                                 else "nobody suppressed, a person must check"))
        else:
            target = test.email if test.email is not None else provider_recipient(report.recipients)
            reason = f"provider {report.detail} ({where})"
        key = mailbox_key(target) if target is not None else None
        if target is None or key is None:
            if decision != MISMATCH:
                out.alerts.append(f"test email {test.id} of campaign {test.campaign} to {test.to_masked}: "
                                  f"{report.detail}, but the address has no mailbox key: nobody suppressed, "
                                  "a person must suppress it")
            continue
        rank = SOURCE_RANK.index(source)
        if key not in wanted or rank > wanted[key][0]:
            wanted[key] = (rank, target.strip(), source, reason)
    if not wanted:
        return
    keys = sorted(wanted)
    got = conn.execute(query("outcomes", "suppress_addresses"), {
        "emails": [wanted[k][1] for k in keys], "keys": keys, "sources": [wanted[k][2] for k in keys],
        "reasons": [wanted[k][3] for k in keys]}).fetchall()
    inserted = {str(r[0]) for r in got if r[1]}
    out.suppressed += len(inserted)
    out.already_suppressed += len(keys) - len(inserted)


# -- the test email's own record (the sending side) ---------------------------------------------------


def suppressed_as(conn: psycopg.Connection, email_key: str, campaign: str) -> str | None:
    """The source of a suppression of this mailbox for all mail or for ``campaign`` (``bounce``,
    ``complaint``, ``manual``, ...), or None: a test email may go to it."""
    row = conn.execute(query("test_emails", "suppressed_as"), {"key": email_key, "campaign": campaign}).fetchone()
    return None if row is None else str(row[0])


def record_request(conn: psycopg.Connection, campaign_id: int, tag: str, email: str, subject: str) -> int:
    """Write the test email about to be requested (status ``sending``); returns its id. Commit it
    before the request: a webhook may arrive before the answer.

    :raises psycopg.Error: on a database failure (e.g. a tag used before).
    """
    row = conn.execute(query("test_emails", "insert_test_email"), {
        "campaign_id": campaign_id, "tag": tag, "email": email, "email_key": mailbox_key(email),
        "to_masked": mask_email(email), "subject": subject}).fetchone()
    assert row is not None
    return int(row[0])


def record_accepted(conn: psycopg.Connection, test_email_id: int, provider_id: str, status: str,
                    actor: str | None, detail: Mapping[str, Any]) -> int:
    """The provider accepted test email ``test_email_id`` as ``provider_id``: record it (status
    ``sent``) and the campaign event ``test_email`` (``from_status = to_status = status``, the
    campaign's current status; ``detail`` as given), in one statement. Returns the event's id.

    :raises LookupError: if there is no such test email.
    """
    row = conn.execute(query("test_emails", "accepted"), {
        "id": test_email_id, "pid": provider_id, "status": status, "actor": actor,
        "detail": Jsonb(dict(detail))}).fetchone()
    if row is None or row[0] is None:
        raise LookupError(f"no test email with id {test_email_id} in mail.test_email")
    return int(row[0])


def record_not_accepted(conn: psycopg.Connection, test_email_id: int, status: str) -> None:
    """Record why test email ``test_email_id`` was not accepted (a status of :data:`NOT_ACCEPTED`).

    :raises ValueError: for another status.
    """
    if status not in NOT_ACCEPTED:
        raise ValueError(f"not a status of a test email not accepted: {status!r} (one of {sorted(NOT_ACCEPTED)})")
    conn.execute(query("test_emails", "not_accepted"), {"id": test_email_id, "status": status})


_SHOWN = ("id", "campaign_event_id", "to", "subject", "status", "provider_id", "created_at", "sent_at", "outcome",
          "delivered_at", "hard_bounced_at", "soft_bounced_at", "complained_at", "failed_at", "delayed_at",
          "suppressed_at", "first_opened_at", "first_clicked_at", "opens", "clicks", "events")


def of_campaign(conn: psycopg.Connection, campaign_id: int) -> list[dict[str, Any]]:
    """A campaign's test emails, oldest first, as the plan and ``mailflow campaign status`` show them:
    ``id``, ``campaign_event_id``, ``to`` (masked), ``subject``, ``status``, ``provider_id``,
    ``created_at``, ``sent_at``, ``outcome`` (None: nothing reported yet), the outcome times (ISO text,
    UTC; None: not reported), ``opens``, ``clicks`` and ``events`` (the events recorded, in the order
    they happened, e.g. ``["sent", "delivered", "opened", "clicked"]`` or ``"bounced (Permanent)"``).

    :raises psycopg.Error: on a database failure.
    """
    rows = conn.execute(query("test_emails", "of_campaign"), {"campaign_id": campaign_id}).fetchall()
    return [{k: (v.isoformat() if isinstance(v, datetime) else list(v) if k == "events" else v)
             for k, v in zip(_SHOWN, r, strict=True)} for r in rows]
