"""What a person approves for a scheduled campaign: a **fingerprint** of everything that decides what
is sent, recorded in ``mail.campaign_approval`` with who approved it, when and how; provisioning
refuses a campaign whose fingerprint now differs (:func:`check_approved`).

**The fingerprint** (:func:`fingerprint`, a pure function) is sha256 hex over one canonical JSON
document (keys sorted, no spaces, UTF-8)::

    {"v": 1,
     "definition": {every field of the definition, as stored: name, template, subject, from, reply_to,
                    timezone, emails_per_day, weekdays, windows, holidays, start_at (ISO-8601 UTC),
                    marketing, on_policy, holdout_share, canary_share, canary_min_outcome_share,
                    canary_max_wait_minutes, recipients_sql, recipients_table},
     "files": {path in the campaigns folder: sha256 hex of its bytes}   # the template's .html.j2 and
                                                                        # .txt.j2, every layout they use,
                                                                        # the recipients SQL file
     "recipients": {"count": n, "sha256": sha256 hex of the user ids ascending, each as decimal text
                                          followed by a newline}}

So a change of any definition field, of one byte of a template, layout or recipients file, or of the
set of recipients (one user added or removed) gives another fingerprint; the same campaign, files and
recipients give the same fingerprint in any process on any machine. The recipients' addresses and
other columns are not in it: they are the users' current data, read when the rows are provisioned
(an address that changes before the send is followed, docs/model.md), while *who* is mailed is bound.

**The record.** A request is ``pending`` until answered (``approved``, ``rejected``, ``expired``) or
``voided``: replacing a draft's definition (:func:`mailflow.sources.scheduled.spec.update_draft`)
voids its pending and approved requests in the same transaction and records the campaign event
``approval_voided`` (the answer to a voided request changes nothing). Every answer is a campaign event
(``approval_approved`` / ``approval_rejected`` / ``approval_expired``) naming who acted, the request and
the fingerprint. Provisioning with an approval checks, under the campaign's row lock, that the request
is approved and that the campaign's fingerprint now equals the approved one, and creates rows only for
the approved recipients; otherwise it raises :class:`ApprovalRefused` naming what changed (definition
fields, files, recipients added and removed) and writes nothing (the event ``provision_refused``).
"""

from __future__ import annotations

import hashlib
import json
import logging
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql as pgsql

from mailflow.campaigns import CampaignFolder
from mailflow.sources.scheduled.campaign_db import lock_campaign, record_event
from mailflow.store.approval import ApprovalStore

log = logging.getLogger(__name__)

VERSION = 1
"""Version of the fingerprint's document; a change of what it covers changes the version."""

DEFINITION_COLUMNS: dict[str, str] = {
    "name": "name", "template": "template", "subject": "subject", "from": "from_address", "reply_to": "reply_to",
    "timezone": "timezone", "emails_per_day": "emails_per_day", "weekdays": "weekdays", "windows": "windows",
    "holidays": "holidays", "start_at": "start_at", "marketing": "marketing", "on_policy": "on_policy",
    "holdout_share": "holdout_share", "canary_share": "canary_share",
    "canary_min_outcome_share": "canary_min_outcome_share", "canary_max_wait_minutes": "canary_max_wait",
    "recipients_sql": "recipients_sql", "recipients_table": "recipients_table",
}
"""Definition key (as a spec file spells it) -> ``mail.campaign`` column: every field of
:class:`~mailflow.sources.scheduled.definition.CampaignDefinition` (``recipients_csv`` is stored as the
uploaded list ``recipients_table = 'mail.campaign_recipient'``, its rows are the recipient snapshot)."""

HOW = ("airflow_hitl", "cli")
"""How an approval is given: a Required Action of ``provision_campaign``, or ``mailflow campaign
provision --approve-as``."""


class ApprovalRefused(ValueError):
    """Provisioning was refused: no approval, an approval not (or no longer) approved, or a campaign
    whose fingerprint differs from the approved one. ``changes`` names what changed (empty when the
    approval itself is missing or not approved); the message names the campaign, the approval and
    each change."""

    def __init__(self, message: str, *, campaign: str, approval_id: int | None = None,
                 changes: Sequence[str] = (), fingerprint_now: str | None = None,
                 fingerprint_approved: str | None = None) -> None:
        super().__init__(message)
        self.campaign = campaign
        self.approval_id = approval_id
        self.changes = list(changes)
        self.fingerprint_now = fingerprint_now
        self.fingerprint_approved = fingerprint_approved

    def detail(self) -> dict[str, Any]:
        """The campaign event's detail of this refusal."""
        return {"reason": "provision_refused", "approval_id": self.approval_id, "changes": self.changes,
                "fingerprint_now": self.fingerprint_now, "fingerprint_approved": self.fingerprint_approved,
                "message": str(self)[:2000]}


@dataclass(frozen=True)
class Fingerprint:
    """A campaign's fingerprint and its parts (:func:`fingerprint`).

    :ivar value: sha256 hex (64 characters).
    :ivar definition: the canonical definition (JSON-able; :data:`DEFINITION_COLUMNS` keys).
    :ivar files: ``{path relative to the campaigns folder: sha256 hex of the file's bytes}``.
    :ivar recipient_count: recipients in the snapshot (rows of the recipient source).
    :ivar recipients_sha256: sha256 hex of the ascending user ids (see the module docstring).
    :ivar recipient_ids: the ascending user ids (kept for the record, not part of :meth:`as_dict`).
    """

    value: str
    definition: dict[str, Any]
    files: dict[str, str]
    recipient_count: int
    recipients_sha256: str
    recipient_ids: tuple[int, ...] = field(repr=False, default=())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (without the ids): ``{"fingerprint", "definition", "files",
        "recipient_count", "recipients_sha256"}``."""
        return {"fingerprint": self.value, "definition": self.definition, "files": self.files,
                "recipient_count": self.recipient_count, "recipients_sha256": self.recipients_sha256}


def _canonical(v: Any) -> Any:
    """A stored value as canonical JSON: numbers as float (``0.10`` and ``0.1`` agree), instants as
    ISO-8601 UTC text, intervals as minutes."""
    if isinstance(v, bool) or v is None or isinstance(v, str | int):
        return v
    if isinstance(v, Decimal | float):
        return float(v)
    if isinstance(v, datetime):
        if v.tzinfo is None:
            raise ValueError(f"a stored instant without a zone: {v!r}")
        return v.astimezone(UTC).isoformat()
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, timedelta):
        return v.total_seconds() / 60
    if isinstance(v, list | tuple):
        return [_canonical(x) for x in v]
    return str(v)


def canonical_definition(row: Mapping[str, Any]) -> dict[str, Any]:
    """The definition of a ``mail.campaign`` row (a dict) in canonical form: every key of
    :data:`DEFINITION_COLUMNS`, values as :func:`fingerprint` hashes them."""
    return {key: _canonical(row.get(col)) for key, col in DEFINITION_COLUMNS.items()}


def recipients_digest(recipient_ids: Iterable[int]) -> tuple[int, str]:
    """``(count, sha256 hex)`` of user ids given in ascending order (each as decimal text and a
    newline). The caller sorts: the order is part of the digest."""
    h = hashlib.sha256()
    n = 0
    for uid in recipient_ids:
        h.update(b"%d\n" % uid)
        n += 1
    return n, h.hexdigest()


def fingerprint(definition: Mapping[str, Any], files: Mapping[str, bytes], recipient_ids: Sequence[int]) -> Fingerprint:
    """The fingerprint of a campaign (pure: the same arguments give the same value in any process).

    :param definition: the canonical definition (:func:`canonical_definition`).
    :param files: ``{path relative to the campaigns folder: the file's bytes}``: the template's two
        files, the layouts they use, the recipients SQL file if any.
    :param recipient_ids: the recipient snapshot's user ids, ascending.
    :returns: the :class:`Fingerprint` (sha256 hex over the document in the module docstring).
    :raises ValueError: if ``recipient_ids`` is not ascending.
    """
    ids = tuple(int(u) for u in recipient_ids)
    if any(a > b for a, b in zip(ids, ids[1:], strict=False)):
        raise ValueError("recipient_ids must be in ascending order")
    file_hashes = {path: hashlib.sha256(data).hexdigest() for path, data in sorted(files.items())}
    count, digest = recipients_digest(ids)
    doc = {"v": VERSION, "definition": dict(definition), "files": file_hashes,
           "recipients": {"count": count, "sha256": digest}}
    text = json.dumps(doc, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return Fingerprint(value=hashlib.sha256(text.encode()).hexdigest(), definition=dict(definition),
                       files=file_hashes, recipient_count=count, recipients_sha256=digest, recipient_ids=ids)


def campaign_files(row: Mapping[str, Any], folder: CampaignFolder) -> dict[str, bytes]:
    """The files a campaign renders and selects from, as they are now: ``{path relative to the
    folder: bytes}`` of its template's two files and every template they use, and its recipients
    SQL file.

    :raises mailflow.campaigns.CampaignFileError: (a ValueError) for a missing template or
        recipients file, naming it.
    """
    folder.check_template_files(str(row["template"]), str(row["name"]))
    out = {rel: (folder.root / rel).read_bytes() for rel in folder.template_sources(str(row["template"]))}
    if row.get("recipients_sql"):
        f = folder.recipients_file(str(row["recipients_sql"]), str(row["name"]))
        out[folder.relative(f)] = f.read_bytes()
    return out


def snapshot(conn: psycopg.Connection, row: Mapping[str, Any], source: pgsql.Composable,
             folder: CampaignFolder) -> Fingerprint:
    """The fingerprint of the campaign ``row`` now: its stored definition, its files in ``folder``
    and every recipient of ``source`` (its recipient query; one statement in the caller's
    transaction, reading only the user ids).

    :raises mailflow.campaigns.CampaignFileError: for a missing file.
    :raises psycopg.Error: if the recipient query fails.
    """
    ids = ApprovalStore(conn).recipient_ids(source, str(row["name"]), int(row["id"]))
    return fingerprint(canonical_definition(row), campaign_files(row, folder), ids)


def _short(value: str | None) -> str:
    return (value or "none")[:12]


def _show(v: Any) -> str:
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def changes(approved: Mapping[str, Any], now: Fingerprint) -> list[str]:
    """What differs between an approval request (a ``mail.campaign_approval`` row as a dict) and the
    campaign ``now``, one line each: ``definition subject: "A" -> "B"``, ``file templates/x.html.j2
    changed`` (added, removed), ``recipients: 35 added, 0 removed (5 approved, 40 now)``. Empty when
    the fingerprints are equal."""
    if approved.get("fingerprint") == now.value:
        return []
    out: list[str] = []
    old_def = approved.get("definition") or {}
    for key in sorted(set(old_def) | set(now.definition)):
        if old_def.get(key) != now.definition.get(key):
            out.append(f"definition {key}: {_show(old_def.get(key))} -> {_show(now.definition.get(key))}")
    old_files = approved.get("files") or {}
    for path in sorted(set(old_files) | set(now.files)):
        if path not in now.files:
            out.append(f"file {path} removed")
        elif path not in old_files:
            out.append(f"file {path} added")
        elif old_files[path] != now.files[path]:
            out.append(f"file {path} changed")
    if approved.get("recipients_sha256") != now.recipients_sha256:
        before = set(approved.get("recipient_ids") or ())
        after = set(now.recipient_ids)
        out.append(f"recipients: {len(after - before)} added, {len(before - after)} removed "
                   f"({approved.get('recipient_count')} approved, {now.recipient_count} now)")
    if not out:  # a fingerprint of another version of the document
        out.append(f"fingerprint {_short(approved.get('fingerprint'))} -> {_short(now.value)}")
    return out


@dataclass(frozen=True)
class ApprovedRecipients:
    """The recipients an approval covers (ascending user ids, :meth:`covers` by binary search) with
    the approval's id and fingerprint."""

    approval_id: int
    fingerprint: str
    ids: array = field(repr=False)  # array('q'), ascending

    def covers(self, user_id: int) -> bool:
        """True if ``user_id`` was approved."""
        i = bisect_left(self.ids, user_id)
        return i < len(self.ids) and self.ids[i] == user_id


def _who(row: Mapping[str, Any]) -> str:
    by = row.get("decided_by") or "nobody recorded"
    at = row.get("decided_at")
    return f"{by} at {at.isoformat() if isinstance(at, datetime) else at}"


def check_approved(conn: psycopg.Connection, c: Mapping[str, Any], approval_id: int,
                   now: Fingerprint) -> ApprovedRecipients:
    """Check, in the caller's transaction (which holds the campaign's row lock, so no definition
    update interleaves), that request ``approval_id`` approved campaign ``c`` as it is ``now``.

    :returns: the approved recipients.
    :raises ApprovalRefused: if the request is missing or of another campaign, is not approved
        (pending, rejected, expired, voided: the message says which, by whom and why), or its
        fingerprint differs from ``now`` (the message names every change).
    """
    name = str(c["name"])
    row = ApprovalStore(conn).by_id(approval_id)
    if row is None or int(row["campaign_id"]) != int(c["id"]):
        raise ApprovalRefused(f"campaign {name!r}: approval #{approval_id} is not an approval of this campaign; "
                              f"nothing provisioned", campaign=name, approval_id=approval_id,
                              fingerprint_now=now.value)
    found = changes(row, now)
    if row["state"] != "approved":
        why = {"pending": "is still waiting for its answer",
               "rejected": f"was rejected by {_who(row)}",
               "expired": f"expired unanswered at {row.get('decided_at')}",
               "voided": f"was voided by {_who(row)} ({row.get('reason')})"}.get(str(row["state"]), row["state"])
        tail = f"; changed since it was requested: {'; '.join(found)}" if found else ""
        raise ApprovalRefused(f"campaign {name!r}: approval #{approval_id} {why}{tail}; nothing provisioned, the "
                              f"campaign stays {c['status']}", campaign=name, approval_id=approval_id,
                              changes=found, fingerprint_now=now.value, fingerprint_approved=row["fingerprint"])
    if found:
        raise ApprovalRefused(
            f"campaign {name!r}: what it would send differs from what was approved (approval #{approval_id}, "
            f"fingerprint {_short(row['fingerprint'])}, by {_who(row)}; now {_short(now.value)}): {'; '.join(found)}. "
            f"Nothing provisioned, the campaign stays {c['status']}; plan and approve it again "
            f"(provision_campaign, or mailflow campaign provision --approve-as)",
            campaign=name, approval_id=approval_id, changes=found, fingerprint_now=now.value,
            fingerprint_approved=row["fingerprint"])
    return ApprovedRecipients(approval_id, str(row["fingerprint"]), array("q", row["recipient_ids"] or ()))


def record_refusal(conn: psycopg.Connection, campaign_id: int, exc: ApprovalRefused, actor: str | None) -> None:
    """Record a provisioning refusal as the campaign event ``provision_refused`` (status unchanged),
    in its own transaction."""
    with conn.transaction():
        c = lock_campaign(conn, campaign_id)
        record_event(conn, campaign_id, c["status"], c["status"], actor, **exc.detail())


def open_request(conn: psycopg.Connection, campaign_id: int, fp: Fingerprint, *, requested_by: str | None,
                 expires_at: datetime | None) -> int:
    """Record a pending approval request of ``fp`` (a Required Action will ask for it) and the
    campaign event ``approval_requested``; return the request's id. One transaction.

    :raises LookupError: if the campaign does not exist.
    """
    with conn.transaction():
        c = lock_campaign(conn, campaign_id)
        approval_id = ApprovalStore(conn).insert(
            campaign_id, state="pending", how="airflow_hitl", fingerprint=fp.value, definition=fp.definition,
            files=fp.files, recipient_count=fp.recipient_count, recipients_sha256=fp.recipients_sha256,
            recipient_ids=fp.recipient_ids, requested_by=requested_by, expires_at=expires_at)
        record_event(conn, campaign_id, c["status"], c["status"], requested_by, reason="approval_requested",
                     approval_id=approval_id, fingerprint=fp.value, recipients=fp.recipient_count)
    return approval_id


def decide(conn: psycopg.Connection, approval_id: int, decision: str, *, responded_by: Mapping[str, Any] | None,
           via: str) -> str:
    """Record the answer to request ``approval_id`` (``decision``: ``approved``, ``rejected`` or
    ``expired``) and the campaign event ``approval_<decision>``, whose ``detail`` names who acted
    (``responded_by``: the Airflow user ``{"id", "name"}``, None for an expiry), the request and its
    fingerprint; the event's actor is ``<name> via <via>``. The campaign's status is unchanged. One
    transaction. An answer to a request voided meanwhile is recorded on the event but leaves the
    request voided (``detail.request_state``).

    :returns: the request's state after the answer (``voided`` when it came too late).
    :raises ValueError: for another ``decision``.
    :raises LookupError: if the request does not exist.
    """
    if decision not in ("approved", "rejected", "expired"):
        raise ValueError(f"decision must be approved, rejected or expired, got {decision!r}")
    store = ApprovalStore(conn)
    name = responded_by.get("name") if responded_by else None
    with conn.transaction():
        row = store.by_id(approval_id)
        if row is None:
            raise LookupError(f"no approval request #{approval_id} in mail.campaign_approval")
        c = lock_campaign(conn, int(row["campaign_id"]))
        store.decide(approval_id, decision, str(name) if name else None,
                     "answered in Airflow's Required Actions" if decision != "expired" else "unanswered in time")
        state = str((store.by_id(approval_id) or row)["state"])
        record_event(conn, int(c["id"]), c["status"], c["status"], f"{name} via {via}" if name else via,
                     reason=f"approval_{decision}", approval_id=approval_id, fingerprint=row["fingerprint"],
                     responded_by=dict(responded_by) if responded_by else None, how="airflow_hitl",
                     request_state=state)
    log.info("campaign %s: approval #%d %s by %s (request now %s)", c["name"], approval_id, decision,
             name or "nobody", state)
    return state


def approve_now(conn: psycopg.Connection, campaign_id: int, fp: Fingerprint, *, approved_by: str, reason: str,
                actor: str | None, how: str = "cli") -> int:
    """Record an approval given at once by ``approved_by`` with ``reason`` (the CLI's
    ``--approve-as NAME --reason TEXT``) of the campaign as ``fp`` describes it, and the campaign
    event ``approval_approved`` naming the operator, the reason and the fingerprint; return the
    request's id. One transaction.

    :raises ValueError: for an empty ``approved_by`` or ``reason``, or another ``how``.
    :raises LookupError: if the campaign does not exist.
    """
    if not approved_by or not approved_by.strip():
        raise ValueError("--approve-as: give the name of the person who approves")
    if not reason or not reason.strip():
        raise ValueError("--reason: an approval given on the command line needs a reason (it is recorded)")
    if how not in HOW:
        raise ValueError(f"how must be one of {', '.join(HOW)}, got {how!r}")
    with conn.transaction():
        c = lock_campaign(conn, campaign_id)
        approval_id = ApprovalStore(conn).insert(
            campaign_id, state="approved", how=how, fingerprint=fp.value, definition=fp.definition, files=fp.files,
            recipient_count=fp.recipient_count, recipients_sha256=fp.recipients_sha256,
            recipient_ids=fp.recipient_ids, requested_by=actor, decided_by=approved_by.strip(),
            reason=reason.strip())
        record_event(conn, campaign_id, c["status"], c["status"], actor, reason="approval_approved",
                     approval_id=approval_id, fingerprint=fp.value, approved_by=approved_by.strip(),
                     approval_reason=reason.strip(), how=how, recipients=fp.recipient_count)
    log.info("campaign %s: approval #%d of fingerprint %s given by %s (%s)", c["name"], approval_id, fp.value,
             approved_by, how)
    return approval_id


def usable_approval(conn: psycopg.Connection, c: Mapping[str, Any]) -> int:
    """The approval the CLI provisions with: the campaign's latest answered request, which must be
    approved (a later rejection, expiry or void withdraws an earlier approval). Whether it approved
    the campaign as it is now is checked by the provisioning (:func:`check_approved`).

    :raises ApprovalRefused: if the campaign has no answered request or its latest is not approved.
    """
    name = str(c["name"])
    row = ApprovalStore(conn).latest_decided(int(c["id"]))
    hint = ("approve it in Airflow (provision_campaign) or record your approval with "
            "--approve-as NAME --reason TEXT")
    if row is None:
        raise ApprovalRefused(f"campaign {name!r} has no approval on record: nothing provisioned; {hint}",
                              campaign=name)
    if row["fingerprint"] is None:
        raise ApprovalRefused(f"campaign {name!r}: its latest approval #{row['id']} was recorded before approvals "
                              f"had fingerprints, so it approves nothing now: nothing provisioned; {hint}",
                              campaign=name, approval_id=int(row["id"]))
    if row["state"] != "approved":
        raise ApprovalRefused(f"campaign {name!r}: its latest approval request #{row['id']} was {row['state']} "
                              f"by {_who(row)}: nothing provisioned; {hint}", campaign=name,
                              approval_id=int(row["id"]))
    return int(row["id"])


def void_open(conn: psycopg.Connection, campaign_id: int, *, actor: str | None, cause: str,
              status: str = "draft") -> list[int]:
    """Void the campaign's pending and approved requests (its definition is being replaced: what
    they approved is no longer what would be sent) and record the campaign event
    ``approval_voided`` (``detail.approvals``: id, previous state, fingerprint of each). Runs in the
    caller's transaction, which holds the campaign's row lock. Returns the ids voided (none: no event)."""
    voided = ApprovalStore(conn).void_open(campaign_id, actor, cause)
    if voided:
        record_event(conn, campaign_id, status, status, actor, reason="approval_voided", cause=cause,
                     approvals=[{"id": i, "state": s, "fingerprint": f} for i, s, f in voided])
    return [i for i, _, _ in voided]
