"""Provisioning: one planned ``pending`` send-log row per recipient, in resumable chunks (rows and
checkpoint commit together); the dry run. The plan rules are in :mod:`mailflow.sources.scheduled`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import jinja2
import psycopg
from psycopg import sql as pgsql

from mailflow import settings
from mailflow.campaigns import CampaignFolder
from mailflow.campaigns.templating import check_campaign_templates, subject_template
from mailflow.model.holdout import in_holdout
from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.approval import (
    ApprovalRefused,
    ApprovedRecipients,
    Fingerprint,
    check_approved,
    record_refusal,
    snapshot,
)
from mailflow.sources.scheduled.campaign_db import (
    actor_name,
    lock_campaign,
    record_event,
    used_on_day,
)
from mailflow.sources.scheduled.definition import check_stored
from mailflow.sources.scheduled.planning import (
    PlanSpec,
    describe_schedule,
    holidays_skipped,
    plan_after,
    plan_day,
    plan_spec,
    summarize,
)
from mailflow.sources.scheduled.spec import TABLE_NAME, check_templates, recipients_file
from mailflow.store.policy import mailbox_key
from mailflow.store.scheduled import ScheduledStore

log = logging.getLogger(__name__)


_MIN_BIGINT = -(2**63)


@dataclass
class ProvisionSummary:
    """What one provisioning call did (or, with ``dry_run``, would do).

    Counts are rows (emails). ``first_send``/``last_send`` are aware UTC datetimes of the rows
    planned by this call (dry run: of the recipients still to provision); ``emails_per_day`` is the
    campaign's setting, ``per_day_max`` the largest count on one local day of those rows,
    ``days_spanned`` calendar days from the first to the last local date (inclusive) and
    ``sending_days`` the local dates that have sends. ``complete`` = the recipient list is exhausted.

    Local send hours, for a person checking the plan: ``local_windows`` the windows, zone, weekdays
    and holiday calendar (``"09:00-12:00, 14:00-17:00 Europe/Berlin, Mon-Fri, DE-BY holidays
    skipped"``; a window into the next day ends in ``+1``), ``first_send_local``/``last_send_local``
    the first and last send as ISO-8601 text in the campaign's zone (with its offset), and
    ``holidays_skipped`` the holidays on an allowed weekday from the plan day this call planned
    from (the plan's start, or its last planned send) through the last send's plan day: days that
    sent nothing because of the holiday calendar.

    ``approval_id`` and ``fingerprint``: the approval this call provisioned under and the fingerprint
    it checked (:mod:`mailflow.sources.scheduled.approval`); None without an approval.
    """

    campaign_id: int
    campaign: str = ""
    dry_run: bool = False
    chunks: int = 0
    recipients: int = 0
    created: int = 0
    skipped_existing: int = 0
    skipped_no_email: int = 0
    holdout: int = 0
    provisioned_total: int = 0
    complete: bool = False
    stopped: str | None = None
    reanchored: bool = False
    timezone: str = ""
    emails_per_day: int = 0
    first_send: datetime | None = None
    last_send: datetime | None = None
    per_day_max: int = 0
    days_spanned: int = 0
    sending_days: int = 0
    local_windows: str = ""
    first_send_local: str | None = None
    last_send_local: str | None = None
    holidays_skipped: int = 0
    approval_id: int | None = None
    fingerprint: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO-8601 UTC text)."""
        out = dataclasses.asdict(self)
        for k in ("first_send", "last_send"):
            out[k] = out[k].isoformat() if out[k] else None
        return out

    def set_local(self, spec: PlanSpec, planned_from: datetime | None) -> None:
        """Fill the local fields from ``first_send``/``last_send`` and ``spec``; ``planned_from``:
        the instant this call's plan continued from (its holidays count from that plan day)."""
        self.local_windows = describe_schedule(spec)
        zone = spec.zone
        self.first_send_local = self.first_send.astimezone(zone).isoformat() if self.first_send else None
        self.last_send_local = self.last_send.astimezone(zone).isoformat() if self.last_send else None
        if planned_from is not None and self.last_send is not None:
            self.holidays_skipped = holidays_skipped(spec, plan_day(spec, planned_from), plan_day(spec, self.last_send))


def recipient_source(conn: psycopg.Connection, c: Mapping[str, Any], folder: CampaignFolder) -> pgsql.Composable:
    """The campaign's recipient query (trusted: a version-controlled file, or a checked table name)."""
    if c["recipients_sql"]:
        text = recipients_file(str(c["recipients_sql"]), c["name"], folder).read_text(encoding="utf-8")
        return pgsql.SQL(text.strip().rstrip(";"))  # trusted file from the package
    m = TABLE_NAME.match(str(c["recipients_table"] or ""))
    if not m:
        raise ValueError(f"campaign {c['name']!r}: recipients_table {c['recipients_table']!r} is not a table name")
    schema, table = m.group(1) or "public", m.group(2)
    cols = {r[0] for r in conn.execute(
        "select column_name from information_schema.columns where table_schema = %s and table_name = %s",
        (schema, table)).fetchall()}
    if not {"user_id", "email"} <= cols:
        raise ValueError(f"campaign {c['name']!r}: table {schema}.{table} needs user_id and email columns "
                         f"(has {sorted(cols) or 'no columns: does it exist?'})")
    source: pgsql.Composable = pgsql.SQL("select * from {}").format(pgsql.Identifier(schema, table))
    if "campaign_id" in cols:
        source = pgsql.SQL("{} where campaign_id = %(campaign_id)s").format(source)
    return source


def _snapshot(rec: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    """``(user_id, email, context)`` of one recipient row (a JSON object)."""
    rec = dict(rec)
    uid = int(rec.pop("user_id"))
    email = rec.pop("email", None)
    rec.pop("campaign_id", None)
    extra = rec.pop("context", None)
    ctx = {**(extra if isinstance(extra, dict) else {}), **rec}
    return uid, (str(email).strip() if email else None), ctx


def current_fingerprint(conn: psycopg.Connection, c: Mapping[str, Any], folder: CampaignFolder) -> Fingerprint:
    """The fingerprint of campaign ``c`` (a ``mail.campaign`` row) as it would be provisioned now: its
    stored definition, its files in ``folder`` and every recipient of its recipient source
    (:func:`mailflow.sources.scheduled.approval.snapshot`). One read of the recipients' user ids in the
    caller's transaction.

    :raises ValueError: for a bad recipients table name or a missing template or recipients file.
    """
    return snapshot(conn, c, recipient_source(conn, c, folder), folder)


def provision(conn: psycopg.Connection, campaign_id: int, *, now: datetime, chunk: int = 5000,
              dry_run: bool = False, run: RunContext | None = None,
              after_chunk: Callable[[ProvisionSummary], None] | None = None,
              folder: CampaignFolder | None = None, approval_id: int | None = None,
              actor: str | None = None) -> ProvisionSummary:
    """Create one ``pending`` send-log row (``kind = 'scheduled'``) per recipient, with its planned
    ``scheduled_at`` (UTC) and a snapshot (address; context = the recipient's extra columns plus the
    rendered ``subject``), ``chunk`` recipients per transaction. A recipient in the campaign's holdout
    group (``mail.campaign.holdout_share``, :func:`mailflow.model.holdout.in_holdout`) gets a ``holdout``
    row instead, with the slot the plan gave it as its ``scheduled_at`` (the plan is made for every
    recipient, so treated and held-out users are spread over the same days; the lift starts a held-out
    user's window there), never claimed or sent (``holdout`` counts them, of ``created``). The summary's
    send times and per-day counts are of the emails (``first_send``, ``last_send``, ``per_day_max``).

    Idempotent and resumable: each chunk's rows and the checkpoint commit together, rows are
    inserted ``ON CONFLICT DO NOTHING``, and a second call continues after the checkpoint (creating
    nothing if the list is exhausted; recipients added later with a higher user_id are appended).
    A draft campaign becomes ``scheduled`` with its first chunk; a paused one stays paused.
    ``cancelled``/``completed`` campaigns are left alone (``stopped`` says so). Recipients
    without an address are skipped and get no slot.

    :param now: aware "now"; anchors a first plan at ``max(start_at, now)``.
    :param dry_run: plan the recipients still to provision and summarise; write nothing.
    :param after_chunk: called after each chunk commits (tests inject a crash here).
    :param folder: the campaigns folder of the templates and recipients files (default: resolved).
    :param approval_id: the approval this provisioning carries out (``mail.campaign_approval``; the
        DAG and the CLI always pass one). Checked in the first chunk's transaction, under the
        campaign's row lock: the request must be approved and the campaign's fingerprint now equal
        to the approved one (:func:`mailflow.sources.scheduled.approval.check_approved`); rows are
        then created only for the approved recipients. None: no check (tests and tools that build
        a campaign directly); the ``draft -> scheduled`` event then records ``approval_id: null``.
    :param actor: who is recorded on the campaign's events (default: the run's task path).
    :raises ApprovalRefused: (a ValueError) before anything is written, if the approval is missing,
        not approved, or approved a different fingerprint (naming each change: definition fields,
        files, recipients added and removed); or, at a later chunk, if a recipient the approval does
        not cover appeared meanwhile (that chunk is not written). Recorded as the campaign event
        ``provision_refused``; a draft stays a draft.
    :raises ValueError: for a naive ``now``, a bad chunk size, a missing template or recipients
        file, a subject that needs a column the recipients lack (naming campaign and user), or a
        subject or template that tries to leave the sandbox (refused before anything renders).
    :raises CampaignDefinitionError: (a ValueError) before anything is written, if the stored row
        breaks a definition rule (an invalid ``from`` or ``reply_to``, timezone, window or holiday
        code: :func:`~mailflow.sources.scheduled.definition.check_stored`), naming the field.
    :raises LookupError: if the campaign does not exist.
    """
    if now.tzinfo is None:
        raise ValueError("now must be a timezone-aware datetime")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 recipients, got {chunk}")
    run = run or RunContext()
    folder = folder or CampaignFolder.resolve()
    summary = ProvisionSummary(campaign_id=campaign_id, dry_run=dry_run)
    if dry_run:
        return _dry_run(conn, campaign_id, now, summary, folder)
    try:
        return _provision_chunks(conn, campaign_id, now, chunk, run, after_chunk, folder, summary, approval_id,
                                 actor_name(run, actor))
    except ApprovalRefused as exc:
        record_refusal(conn, campaign_id, exc, actor_name(run, actor))
        log.error("%s", exc)
        raise


def _provision_chunks(conn: psycopg.Connection, campaign_id: int, now: datetime, chunk: int, run: RunContext,
                      after_chunk: Callable[[ProvisionSummary], None] | None, folder: CampaignFolder,
                      summary: ProvisionSummary, approval_id: int | None, actor: str | None) -> ProvisionSummary:
    """The chunks of :func:`provision` (its rules and errors)."""
    approved: ApprovedRecipients | None = None
    per_day: dict[date, int] = {}
    subject_t: jinja2.Template | None = None
    planned_from: datetime | None = None
    spec: PlanSpec | None = None
    while True:
        with conn.transaction():
            c = lock_campaign(conn, campaign_id)
            if subject_t is None and c["status"] not in ("cancelled", "completed"):
                check_stored(c)  # a row created before a rule, or edited by hand: refused, nothing written
            spec = plan_spec(c)
            summary.campaign, summary.timezone, summary.emails_per_day = c["name"], spec.timezone, spec.emails_per_day
            if c["status"] in ("cancelled", "completed"):
                summary.stopped = f"campaign {c['status']}"
                summary.complete = c["provisioned_at"] is not None
                summary.provisioned_total = int(c["provisioned_count"])
                log.info("campaign %s is %s: nothing to provision", c["name"], c["status"])
                break
            if subject_t is None:
                check_templates(c["template"], c["name"], folder)
                # a campaign created before subjects were checked: refused here, never run
                check_campaign_templates(c["name"], c["subject"], c["template"], folder.templates_dir)
                subject_t = subject_template(c["subject"])
                if approval_id is not None:
                    # under the campaign's row lock: no definition update interleaves with the check
                    approved = check_approved(conn, c, approval_id, current_fingerprint(conn, c, folder))
                    summary.approval_id, summary.fingerprint = approved.approval_id, approved.fingerprint
            plan_start = c["plan_start"] or max(c["start_at"], now)
            source = recipient_source(conn, c, folder)
            after = c["provision_cursor"] if c["provision_cursor"] is not None else _MIN_BIGINT
            page = ScheduledStore(conn).recipients_page(source, after, chunk, c["name"], campaign_id)
            current = c["status"]
            if current == "draft":
                ScheduledStore(conn).set_status(campaign_id, "draft", "scheduled")
                record_event(conn, campaign_id, "draft", "scheduled", actor, reason="provisioning started",
                             approval_id=summary.approval_id, fingerprint=summary.fingerprint)
                current = "scheduled"
            if not page:
                ScheduledStore(conn).mark_provisioned(campaign_id, plan_start)
                if c["provisioned_at"] is None:
                    record_event(conn, campaign_id, current, current, actor, reason="provisioned",
                           provisioned_count=int(c["provisioned_count"]),
                           planned_through=c["planned_through"].isoformat() if c["planned_through"] else None)
                summary.complete = True
                summary.provisioned_total = int(c["provisioned_count"])
                break
            recipients = [_snapshot(r[0]) for r in page]
            if approved is not None:
                _refuse_unapproved(c, approved, recipients)
            cursor = max(uid for uid, _, _ in recipients)
            usable = [r for r in recipients if r[1]]
            summary.skipped_no_email += len(recipients) - len(usable)
            share = float(c.get("holdout_share") or 0.0)
            summary.recipients += len(recipients)
            planned_through, plan_skip = c["planned_through"], int(c["plan_skip"])
            # every recipient gets its slot, the held-out ones too: the plan is the one a campaign without a
            # holdout group would make, so a held-out user's window starts where its email would have gone
            # out, distributed over the campaign's weeks exactly as the treated users' (docs/model.md,
            # "Holdout groups"); a held-out slot sends nothing
            slots = list(plan_after(spec, plan_start, plan_skip, planned_through, len(usable)))
            if slots and slots[0] < now:
                # the plan ran out while provisioning was stopped: continue from now, not in the past
                plan_start, planned_through = now, None
                plan_skip = used_on_day(conn, c, spec, now, include_pending=True)
                ScheduledStore(conn).set_plan(campaign_id, plan_start, plan_skip, None)
                slots = list(plan_after(spec, plan_start, plan_skip, None, len(usable)))
                summary.reanchored = True
                planned_from = now
            if planned_from is None:
                planned_from = planned_through or plan_start
            held_out = [(r, at) for r, at in zip(usable, slots, strict=True) if in_holdout(c["name"], r[0], share)]
            planned = [(r, at) for r, at in zip(usable, slots, strict=True) if not in_holdout(c["name"], r[0], share)]
            times = [at for _, at in planned]
            rows = []
            for (uid, email, ctx), at in planned:
                user = {"user_id": uid, "email": email, **ctx}
                try:
                    subject = " ".join(subject_t.render(user=user, campaign=c["name"], app_url=settings.app_url()).split())
                except jinja2.UndefinedError as exc:
                    raise ValueError(f"campaign {c['name']!r}: the subject needs {exc} (user {uid})") from None
                except jinja2.exceptions.SecurityError as exc:
                    raise ValueError(f"campaign {c['name']!r}: subject refused by the sandbox: {exc} (user {uid})") from None
                rows.append({"user_id": uid, "email": email, "email_key": mailbox_key(email),
                             "context": {**ctx, "subject": subject}, "scheduled_at": at.isoformat()})
            rows += [{"user_id": uid, "email": email, "email_key": mailbox_key(email), "context": ctx,
                      "scheduled_at": at.isoformat(), "status": "holdout"} for (uid, email, ctx), at in held_out]
            created = holdout = 0
            if rows:
                created, holdout = ScheduledStore(conn).provision_rows(c["name"], rows, {
                    "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id})
            ScheduledStore(conn).advance_checkpoint(campaign_id, created, cursor,
                                                    slots[-1] if slots else planned_through, plan_start)
        summary.chunks += 1
        summary.created += created
        summary.holdout += holdout
        summary.skipped_existing += len(rows) - created
        summary.provisioned_total = int(c["provisioned_count"]) + created
        if times:
            summary.first_send = summary.first_send or times[0]
            summary.last_send = times[-1]
            for t in times:
                d = t.astimezone(spec.zone).date()
                per_day[d] = per_day.get(d, 0) + 1
        log.info("campaign %s chunk %d: %d recipients -> %d rows created (%d existed), through %s",
                 c["name"], summary.chunks, len(recipients), created, len(rows) - created,
                 times[-1].isoformat() if times else "-")
        if after_chunk is not None:
            after_chunk(summary)
    if per_day:
        summary.per_day_max = max(per_day.values())
        summary.sending_days = len(per_day)
        summary.days_spanned = (max(per_day) - min(per_day)).days + 1
    if spec is not None:
        summary.set_local(spec, planned_from)
    return summary


def _refuse_unapproved(c: Mapping[str, Any], approved: ApprovedRecipients,
                       recipients: list[tuple[int, str | None, dict[str, Any]]]) -> None:
    """Refuse a page holding recipients the approval does not cover (the recipient source changed
    while earlier chunks were provisioned): nobody the approver was not shown gets a row."""
    outside = [uid for uid, _, _ in recipients if not approved.covers(uid)]
    if outside:
        shown = ", ".join(str(u) for u in outside[:5]) + (" ..." if len(outside) > 5 else "")
        raise ApprovalRefused(
            f"campaign {c['name']!r}: {len(outside)} recipients appeared that approval #{approved.approval_id} does "
            f"not cover (users {shown}): this chunk was not provisioned (rows provisioned before stay); plan and "
            f"approve the campaign again for them", campaign=str(c["name"]), approval_id=approved.approval_id,
            changes=[f"recipients: {len(outside)} added while provisioning"],
            fingerprint_approved=approved.fingerprint)


def _dry_run(conn: psycopg.Connection, campaign_id: int, now: datetime, summary: ProvisionSummary,
             folder: CampaignFolder) -> ProvisionSummary:
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(campaign_id)
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        check_stored(c)
        spec = plan_spec(c)
        check_templates(c["template"], c["name"], folder)
        after = c["provision_cursor"] if c["provision_cursor"] is not None else _MIN_BIGINT
        remaining = ScheduledStore(conn).recipients_count(recipient_source(conn, c, folder), after, c["name"], campaign_id)
    plan_start = c["plan_start"] or max(c["start_at"], now)
    planned_from = c["planned_through"] or plan_start
    times = list(plan_after(spec, plan_start, int(c["plan_skip"]), c["planned_through"], remaining))
    if times and times[0] < now:
        times = list(plan_after(spec, now, 0, None, remaining))
        summary.reanchored = True
        planned_from = now
    ps = summarize(times, spec.timezone, day_start=spec.day_start)
    summary.campaign, summary.timezone, summary.emails_per_day = c["name"], spec.timezone, spec.emails_per_day
    summary.recipients = remaining
    summary.provisioned_total = int(c["provisioned_count"])
    summary.first_send, summary.last_send = ps.first, ps.last
    summary.per_day_max = max(ps.emails_per_day.values(), default=0)
    summary.sending_days = len(ps.emails_per_day)
    summary.days_spanned = ps.days_spanned
    summary.complete = c["provisioned_at"] is not None and remaining == 0
    summary.set_local(spec, planned_from)
    log.info("dry run %s: %d recipients to provision, first %s, last %s, %d/day over %d days",
             c["name"], remaining, ps.first, ps.last, spec.emails_per_day, ps.days_spanned)
    return summary
