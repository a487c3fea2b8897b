"""The one place that applies a provider's report about a sent email to the send log: the webhook
receiver (:mod:`mailflow.feedback.webhooks`) and the safety-net poll
(:mod:`mailflow.feedback.deliverability`) both call :func:`apply_reports`, so they decide exactly alike.

A report names the provider's email id, what happened (the ``mail.delivery_event`` vocabulary: sent,
delivered, delivery_delayed, bounced, complained, opened, clicked, failed, suppressed) and the
provider's own recipient (``to``). Per report, in the caller's transaction:

* **match** by provider email id to ``mail.send_log`` (``send_log_provider_id_uq``: one row at most),
  then **check the recipient**: the provider's ``to`` must be exactly the row's address, normalised
  (:func:`recipient_matches`). A mismatch (ids on the wrong rows, e.g. a batch answered out of order)
  is never applied to that row: no event, no status, no suppression of the row's address. The
  provider's ``to`` is the address that really bounced or complained, so for a hard bounce, a
  complaint or the provider's suppression **that** address is suppressed (by its mailbox key) and
  nobody else; the decision is recorded on the row and alerted.
* **record** the report as a typed event (``mail.delivery_event``; a webhook's svix-id is unique, so
  a replay adds nothing) and fold it into ``mail.delivery_status`` order-independently: each time
  column takes the earliest report, opens and clicks add up, and the outcome follows precedence
  (complained > hard_bounced > suppressed > failed > delivered > soft_bounced > delayed), so a late
  ``delivered`` never undoes a bounce and an ``opened`` before its ``delivered`` still counts
  (``store/sql/queries/outcomes.sql``, ``record_events``).
* **suppress** the address for all mail on a permanent bounce (``bounced`` with bounce type
  Permanent; a poll's ``bounced``, which Resend uses for permanent rejections), a complaint, or the
  provider's own suppression list (sources ``bounce``, ``complaint``, ``provider_suppressed``). A
  transient or undetermined bounce, ``delivery_delayed`` and ``failed`` never suppress (the cause
  may be ours or pass: users are not charged for it); ``failed`` is alerted. An address without a
  mailbox key suppresses its row's user instead.
* **keep the decision** (suppressed, already suppressed, mismatch, failed) as an event of the email
  in ``mail.send_event`` (sent -> sent), so ``mail.user_email_history`` shows it.

Rules: Resend's webhook and Email object documentation (../shared/reference/resend-contract.md);
only permanent bounces and complaints are reasons to suppress (published provider guidance, same file).
"""

from __future__ import annotations

import email.utils
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from typing import Any

import psycopg

from mailflow.model.outcome import RunContext
from mailflow.store.policy import mailbox_key
from mailflow.store.policy import normalise_address as check_address
from mailflow.store.send_log import mask_email
from mailflow.store.sql import query
from mailflow.store.suppression import suppress_user

log = logging.getLogger(__name__)

EVENTS = frozenset({"sent", "delivered", "delivery_delayed", "bounced", "complained", "opened", "clicked",
                    "failed", "suppressed"})
"""The ``mail.delivery_event.event`` vocabulary (Resend's event names without the ``email.`` prefix)."""
BOUNCE_TYPES = frozenset({"Permanent", "Transient", "Undetermined"})
"""Resend's ``bounce.type`` values; only Permanent is a hard bounce."""
SOURCE_RANK = ("provider_suppressed", "bounce", "complaint")
"""Feedback suppression sources, weakest first (the outcome precedence: complained > hard_bounced > suppressed)."""

APPLIED = "applied"
DUPLICATE = "duplicate_outcome"
MISMATCH = "recipient_mismatch"
FAILED = "failed"
UNKNOWN = "unknown_email"
"""Decisions (``mail.webhook_event.decision``); ``unknown`` is only returned for reports without a row."""


@dataclass(frozen=True)
class Report:
    """One provider report about one email.

    :ivar provider_message_id: the provider's email id (Resend ``data.email_id`` or the polled id).
    :ivar event: one of :data:`EVENTS`.
    :ivar recipients: the provider's ``to`` as given (a list of addresses, or one string; None if absent).
    :ivar source: ``webhook`` or ``poll``.
    :ivar detail: how decisions name the report, e.g. ``last_event bounced`` or
        ``webhook email.bounced (Permanent)``.
    :ivar occurred_at: the provider's time of the event (aware); None: the database's now() (a poll).
    :ivar bounce_type: Permanent, Transient or Undetermined for a webhook's ``bounced``; None for a
        poll (whose ``bounced`` is permanent) and for other events.
    :ivar svix_id: the webhook's svix-id (None for a poll).
    :ivar tag: our test-email tag id the provider echoed (``data.tags.mailflow_test``,
        :data:`mailflow.store.test_emails.TAG_NAME`); None for every other email and for a poll.
    """

    provider_message_id: str
    event: str
    recipients: Any
    source: str
    detail: str
    occurred_at: datetime | None = None
    bounce_type: str | None = None
    svix_id: str | None = None
    tag: str | None = None

    def suppression_source(self) -> str | None:
        """``bounce`` / ``complaint`` / ``provider_suppressed`` if this report suppresses the address, else None."""
        if self.event == "complained":
            return "complaint"
        if self.event == "suppressed":
            return "provider_suppressed"
        if self.event == "bounced" and (self.bounce_type or "Permanent") == "Permanent":
            return "bounce"
        return None


@dataclass(frozen=True)
class SentEmail:
    """A send-log row a provider id points at: ``id`` (send_log.id), the provider id, the recipient
    ``email`` as snapshotted, its ``campaign``, ``user_id`` and ``status``."""

    id: int
    provider_message_id: str
    email: str
    campaign: str
    user_id: int | None
    status: str


@dataclass
class Decision:
    """What applying one report decided: ``decision`` is applied, duplicate_outcome,
    recipient_mismatch, failed or unknown_email (no row); ``note`` the text kept on the row's
    ``mail.send_event`` (None when nothing was decided worth keeping); ``suppressed`` True for a new
    suppression, False for one that existed, None when nothing was to be suppressed."""

    report: Report
    row: SentEmail | None
    decision: str
    note: str | None = None
    suppressed: bool | None = None


@dataclass
class Applied:
    """The result of :func:`apply_reports`: one :class:`Decision` per report (same order), counts of
    new suppressions and existing ones, the campaigns whose emails got a new event (for the reputation
    guard), and ``alerts``: one line per mismatch and failure (send-log id, masked address, provider id)."""

    decisions: list[Decision] = field(default_factory=list)
    recorded: int = 0
    suppressed: int = 0
    already_suppressed: int = 0
    campaigns: set[str] = field(default_factory=set)
    alerts: list[str] = field(default_factory=list)

    def count(self, decision: str) -> int:
        """How many reports got ``decision``."""
        return sum(1 for d in self.decisions if d.decision == decision)


def _one_address(value: str) -> str | None:
    """The address of ``value`` if it names exactly one RFC 5322 mailbox (display name dropped), else
    None. ``getaddresses`` and not ``parseaddr``: this Python's ``parseaddr`` returns the first address
    of ``"a@x.com, b@y.com"`` (or of ``"a@x.com <b@y.com>"``) as if it were the only one."""
    pairs = email.utils.getaddresses([value.strip()])
    if len(pairs) != 1 or not pairs[0][1]:
        return None
    return pairs[0][1].strip()


@lru_cache(maxsize=65536)
def normalise_recipient(value: str) -> str | None:
    """``"Name <A.B@Example.COM> "`` -> ``"a.b@example.com"``: the mailbox key
    (:func:`mailflow.store.policy.mailbox_key`) of an RFC 5322 mailbox's address; not a valid
    address: the trimmed address text, case-folded; None if ``value`` names no address or several
    (``"a@x.com, b@y.com"``). Cached (the receiver checks every event)."""
    text = _one_address(value)
    if text is None:
        return None
    return mailbox_key(text) or text.casefold()


def recipient_matches(to: Any, address: str) -> bool:
    """True if the provider's ``to`` (a list of addresses, or one string) is exactly ``address``,
    normalised (:func:`normalise_recipient`). Several recipients (as list items or in one string),
    none, or another one: False (we send one recipient per email)."""
    items = [to] if isinstance(to, str) else to if isinstance(to, list) else []
    if len(items) != 1:
        return False
    if items[0] == address:  # the provider echoes what we sent: the common case needs no parsing
        return True
    theirs = normalise_recipient(str(items[0]))
    return theirs is not None and theirs == normalise_recipient(address)


def provider_recipient(to: Any) -> str | None:
    """The one address the provider names in ``to`` (display name dropped), or None if it names
    none, several, or something that is not an address with a mailbox key."""
    items = [to] if isinstance(to, str) else to if isinstance(to, list) else []
    if len(items) != 1 or not isinstance(items[0], str):
        return None
    text = _one_address(items[0])
    return text if text is not None and mailbox_key(text) is not None else None


def find_sent(conn: psycopg.Connection, provider_ids: Iterable[str]) -> dict[str, SentEmail]:
    """The send-log rows of these provider ids, by provider id (ids no row has are absent).

    :raises psycopg.Error: on a database failure.
    """
    pids = sorted(set(provider_ids))
    if not pids:
        return {}
    rows = conn.execute(query("outcomes", "sent_by_provider_id"), {"pids": pids}).fetchall()
    return {str(r[1]): SentEmail(int(r[0]), str(r[1]), str(r[2]), str(r[3]), r[4], str(r[5])) for r in rows}


def apply_reports(conn: psycopg.Connection, reports: Sequence[Report], *, rows: dict[str, SentEmail] | None = None,
                  run: RunContext | None = None) -> Applied:
    """Apply provider reports to the send log (see the module docstring), set-based: a handful of
    statements for the whole sequence, in the caller's transaction (run it inside one: a failure
    leaves nothing half applied).

    :param reports: the reports; several may concern one email (their order does not matter).
    :param rows: the send-log rows by provider id if the caller looked them up already
        (:func:`find_sent`); else they are looked up here.
    :param run: the Airflow run recorded on the decisions' send events (None: the receiver).
    :returns: :class:`Applied`, its decisions in the order of ``reports``. A report whose provider
        id no row has gets decision ``unknown_email`` and changes nothing (the caller keeps it for later).
    :raises psycopg.Error: on a database failure (nothing is applied then).
    :raises ValueError: for an event outside :data:`EVENTS` or a source other than webhook/poll.
    """
    run = run or RunContext()
    if rows is None:
        rows = find_sent(conn, (r.provider_message_id for r in reports))
    out = Applied()
    matched: list[Decision] = []
    for report in reports:
        if report.event not in EVENTS or report.source not in ("webhook", "poll"):
            raise ValueError(f"not a delivery event report: {report.event!r} from {report.source!r}")
        row = rows.get(report.provider_message_id)
        d = Decision(report, row, UNKNOWN)
        out.decisions.append(d)
        if row is None:
            continue
        if not recipient_matches(report.recipients, row.email):
            d.decision = MISMATCH
            continue
        d.decision = APPLIED
        matched.append(d)

    new_events = _record_events(conn, matched)
    out.recorded = len(new_events)
    for d in matched:
        assert d.row is not None
        if d.report.svix_id is not None and d.report.svix_id not in new_events:
            d.decision = DUPLICATE  # recorded by an earlier delivery of the same webhook: nothing changes
            continue
        out.campaigns.add(d.row.campaign)
        if d.report.event == "failed":
            d.decision = FAILED
            d.note = f"feedback: {d.report.detail} (the provider did not send it); address not suppressed"

    _suppress(conn, out)
    notes = [d for d in out.decisions if d.note is not None and d.row is not None]
    if notes:
        conn.execute(query("outcomes", "record_decisions"), {
            "ids": [d.row.id for d in notes if d.row], "pids": [d.report.provider_message_id for d in notes],
            "decisions": [d.note for d in notes], "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id})
    for d in out.decisions:
        if d.decision in (MISMATCH, FAILED) and d.row is not None:
            out.alerts.append(f"send_log.id={d.row.id} to={mask_email(d.row.email)} "
                              f"provider id={d.report.provider_message_id}: {d.note}")
            log.warning("email %s (send_log %s): %s", d.report.provider_message_id, d.row.id, d.note)
    return out


def _record_events(conn: psycopg.Connection, matched: list[Decision]) -> set[str | None]:
    """Insert the matched reports as delivery events and fold them into delivery_status; returns the
    svix-ids recorded now (None stands for the poll's reports, which have none)."""
    if not matched:
        return set()
    reps = [d.report for d in matched]
    got = conn.execute(query("outcomes", "record_events"), {
        "send_log_ids": [d.row.id for d in matched if d.row is not None],
        "pids": [r.provider_message_id for r in reps],
        "events": [r.event for r in reps],
        "bounce_types": [r.bounce_type if r.event == "bounced" else None for r in reps],
        "occurred": [r.occurred_at for r in reps],
        "sources": [r.source for r in reps],
        "svix_ids": [r.svix_id for r in reps],
    }).fetchall()
    return {row[1] for row in got}


def _suppress(conn: psycopg.Connection, out: Applied) -> None:
    """Suppress what the decisions call for: the row's address for an applied hard bounce, complaint
    or provider suppression; the provider's own recipient for such a report on a mismatched row.
    Sets each decision's ``suppressed`` and ``note``; counts into ``out``."""
    wanted: dict[str, tuple[int, str, str, str]] = {}  # key -> (rank, address, source, reason)
    by_key: dict[str, list[Decision]] = {}
    for d in out.decisions:
        source = d.report.suppression_source()
        row = d.row
        if row is None or d.decision == DUPLICATE:
            continue
        where = f"send_log {row.id}, email {d.report.provider_message_id}"
        if d.report.svix_id is not None:
            where += f", svix-id {d.report.svix_id}"
        if d.decision == MISMATCH:
            target = provider_recipient(d.report.recipients) if source is not None else None
            if target is None:
                d.note = (f"feedback: provider email {d.report.provider_message_id} is addressed to someone else "
                          f"({d.report.detail}); nobody suppressed, a person must check the provider ids")
                continue
            reason = (f"provider {d.report.detail} for email {d.report.provider_message_id}, addressed to this "
                      f"address (the send log has the id on send_log {row.id}, another address)")
        elif source is None:
            continue
        elif mailbox_key(row.email) is None:
            _suppress_unkeyable(conn, out, d, source)
            continue
        else:
            target, reason = row.email, f"provider {d.report.detail} ({where})"
        assert source is not None
        key = mailbox_key(target)
        assert key is not None
        rank = SOURCE_RANK.index(source)
        if key not in wanted or rank > wanted[key][0]:
            wanted[key] = (rank, target.strip(), source, reason)
        by_key.setdefault(key, []).append(d)
    if not wanted:
        return
    keys = sorted(wanted)
    got = conn.execute(query("outcomes", "suppress_addresses"), {
        "emails": [wanted[k][1] for k in keys], "keys": keys, "sources": [wanted[k][2] for k in keys],
        "reasons": [wanted[k][3] for k in keys]}).fetchall()
    inserted = {str(r[0]) for r in got if r[1]}
    for key in keys:
        new = key in inserted
        if new:
            out.suppressed += 1
        else:
            out.already_suppressed += 1
        for i, d in enumerate(by_key[key]):
            source = d.report.suppression_source()
            first = new and i == 0  # several reports for one mailbox: the first carries "suppressed"
            d.suppressed = first
            if d.decision == MISMATCH:
                done = (f"the provider's recipient {mask_email(wanted[key][1])} suppressed for all mail (source "
                        f"{source})" if first else "the provider's recipient was already suppressed")
                d.note = (f"feedback: provider email {d.report.provider_message_id} is addressed to someone else "
                          f"({d.report.detail}); {done}; nothing applied to this row, a person must check the "
                          "provider ids")
            elif first:
                d.note = f"feedback: {d.report.detail}; address suppressed for all mail (source {source})"
            else:
                d.note = f"feedback: {d.report.detail}; address already suppressed"


def _suppress_unkeyable(conn: psycopg.Connection, out: Applied, d: Decision, source: str) -> None:
    """A row whose address has no mailbox key (stored by an older validator): suppress its user instead."""
    row = d.row
    assert row is not None
    why = check_address(row.email).error or "not a valid address"
    pid = d.report.provider_message_id
    if row.user_id is None:
        d.note = (f"feedback: {d.report.detail}; the address has no mailbox key ({why}) and the row no user: "
                  "nobody suppressed, a person must suppress it")
        out.alerts.append(f"send_log.id={row.id} to={mask_email(row.email)} provider id={pid}: {d.note}")
        return
    new = suppress_user(conn, int(row.user_id), source=source, reason=(
        f"provider {d.report.detail} (send_log {row.id}, email {pid}); the address has no mailbox key ({why})"))
    d.suppressed = new
    if new:
        out.suppressed += 1
    else:
        out.already_suppressed += 1
    log.warning("email %s (send_log %s): %s for an address with no mailbox key (%s): user %s %s",
                pid, row.id, d.report.detail, why, row.user_id, "suppressed" if new else "already suppressed")
    d.note = (f"feedback: {d.report.detail}; the address has no mailbox key ({why}): "
              f"user {row.user_id} {'suppressed for all mail' if new else 'already suppressed'} (source {source})")
