"""The operator's controls: cancel, pause, resume (the pause/resume rule of
:mod:`mailflow.sources.scheduled`), complete, status. Each one transaction."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.campaign_db import (
    CampaignStateError,
    actor_name,
    db_now,
    json_default,
    lock_campaign,
    record_event,
)
from mailflow.sources.scheduled.holds import campaign_holds
from mailflow.sources.scheduled.replan import replan_locked, replan_overdue
from mailflow.store import reputation, test_emails
from mailflow.store.scheduled import ScheduledStore

log = logging.getLogger(__name__)


def _transition(conn: psycopg.Connection, campaign_id: int, allowed: Sequence[str], to_status: str,
                actor: str | None, **detail: Any) -> tuple[dict[str, Any], bool]:
    """Lock the campaign and move it to ``to_status`` from one of ``allowed`` (in the caller's
    transaction). Returns ``(row before, changed)``; already in ``to_status`` = not changed."""
    c = lock_campaign(conn, campaign_id)
    if c["status"] == to_status:
        return c, False
    if c["status"] not in allowed:
        raise CampaignStateError(f"campaign {c['name']!r} is {c['status']}: cannot become {to_status} "
                                 f"(only from {', '.join(allowed)})")
    ScheduledStore(conn).set_status(campaign_id, c["status"], to_status)
    record_event(conn, campaign_id, c["status"], to_status, actor, **detail)
    return c, True


def cancel(conn: psycopg.Connection, campaign_id: int, *, actor: str | None = None,
           run: RunContext | None = None) -> dict[str, Any]:
    """Cancel a campaign: status -> ``cancelled`` and every ``pending`` row -> ``cancelled`` (with an
    event each), in one transaction. Rows already ``sending`` finish as they are: accepted ones are
    ``sent``; one proven not processed becomes ``cancelled`` (never ``pending`` again: the release
    sees the campaign's status, see ``send_log.release``); an ambiguous one keeps its key for the
    reconciler. Terminal rows are untouched. Idempotent: cancelling a cancelled campaign again
    changes its status nothing and cancels any ``pending`` row found there (a straggler).

    :returns: ``{"campaign", "status", "changed", "rows_cancelled"}``.
    :raises CampaignStateError: if the campaign is completed.
    """
    run = run or RunContext()
    with conn.transaction():
        c, changed = _transition(conn, campaign_id, ("draft", "scheduled", "paused"), "cancelled",
                                 actor_name(run, actor))
        n = ScheduledStore(conn).cancel_pending(c["name"], "campaign cancelled", {
            "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id})
    log.info("campaign %s cancelled: %d pending rows cancelled", c["name"], n)
    return {"campaign": c["name"], "status": "cancelled", "changed": changed, "rows_cancelled": n}


def pause(conn: psycopg.Connection, campaign_id: int, *, actor: str | None = None) -> dict[str, Any]:
    """Pause a draft or scheduled campaign: the dispatcher stops claiming its rows (rows in flight
    finish); the plan is kept. Pausing a paused campaign changes no status, but is recorded (a
    paused -> paused event by ``actor``): the latest pause is then this decision, so a reputation-guard
    resume (which lifts only the guard's own pauses, :func:`mailflow.store.reputation.resume`) leaves
    the campaign paused.

    :raises CampaignStateError: if the campaign is cancelled or completed.
    """
    with conn.transaction():
        c, changed = _transition(conn, campaign_id, ("draft", "scheduled"), "paused", actor)
        if not changed:
            record_event(conn, campaign_id, "paused", "paused", actor,
                         reason=f"paused again by {actor or 'an operator'} (it was paused already)")
    return {"campaign": c["name"], "status": "paused", "changed": changed}


def hold(conn: psycopg.Connection, name: str, reason: str, *, actor: str | None = None) -> bool:
    """Pause the ``scheduled`` campaign ``name`` because the campaign itself is at fault (the
    provider refused one of its fields, or its dispatch raised): the dispatcher stops claiming its
    rows, the others go on; ``reason`` is recorded on the campaign event (``detail.reason``) for the
    person who fixes it and resumes (:func:`resume`). Its own transaction.

    :returns: True if the campaign was paused now; False if it is not ``scheduled`` (already
        paused, cancelled, completed) or does not exist.
    """
    with conn.transaction():
        found = ScheduledStore(conn).campaign_id_by_name(name)
        if found is None:
            return False
        c = lock_campaign(conn, found)
        if c["status"] != "scheduled":
            return False
        _transition(conn, found, ("scheduled",), "paused", actor, reason=reason[:1000])
    log.error("campaign %s paused: %s", name, reason)
    return True


def resume(conn: psycopg.Connection, campaign_id: int, *, now: datetime | None = None,
           actor: str | None = None) -> dict[str, Any]:
    """Resume a paused campaign (status -> ``scheduled``; -> ``draft`` if it was paused before any
    row was provisioned, so it still goes through its approval) under the module's pause/resume rule: if a
    pending row's time passed (``scheduled_at < now``), every pending row is re-planned in its
    order from ``now`` (the resume day keeps its per-day cap); otherwise no time changes. One
    transaction; resuming a scheduled campaign changes nothing.

    :param now: the resume instant (aware; default: the database clock).
    :returns: ``{"campaign", "status", "changed", "overdue", "replanned", "first", "last"}``
        (first/last: ISO text of the re-planned range, or None).
    :raises CampaignStateError: if the campaign is not paused (or scheduled).
    """
    with conn.transaction():
        at = now or db_now(conn)
        if at.tzinfo is None:
            raise ValueError("now must be a timezone-aware datetime")
        c = lock_campaign(conn, campaign_id)
        if c["status"] == "scheduled":
            return {"campaign": c["name"], "status": "scheduled", "changed": False, "overdue": 0,
                    "replanned": 0, "first": None, "last": None}
        if c["status"] != "paused":
            raise CampaignStateError(f"campaign {c['name']!r} is {c['status']}: only a paused campaign resumes")
        if c["provision_cursor"] is None and int(c["provisioned_count"]) == 0:
            # paused before any provisioning: it goes back to draft, so it still needs its approval
            # (provision_campaign) before anything is scheduled, and its definition stays editable
            _transition(conn, campaign_id, ("paused",), "draft", actor, reason="resumed before provisioning")
            return {"campaign": c["name"], "status": "draft", "changed": True, "overdue": 0,
                    "replanned": 0, "first": None, "last": None}
        # the pause held the campaign: its overdue rows are re-planned from now (the rule every release shares)
        done = replan_locked(conn, c, at)
        _transition(conn, campaign_id, ("paused",), "scheduled", actor, overdue=done.overdue, replanned=done.replanned,
                    resumed_at=at.isoformat(), first=done.first.isoformat() if done.first else None,
                    last=done.last.isoformat() if done.last else None)
    log.info("campaign %s resumed at %s: %d overdue, %d re-planned", c["name"], at, done.overdue, done.replanned)
    return {"campaign": c["name"], "status": "scheduled", "changed": True, "overdue": done.overdue,
            "replanned": done.replanned, "first": done.first.isoformat() if done.first else None,
            "last": done.last.isoformat() if done.last else None}


def complete(conn: psycopg.Connection, campaign_id: int | None = None, *, actor: str | None = None) -> list[str]:
    """Mark ``scheduled`` campaigns ``completed`` when their list is fully provisioned and no row
    is ``pending`` or ``sending`` (only ``campaign_id`` if given); return the names completed."""
    with conn.transaction():
        rows = ScheduledStore(conn).complete_finished(campaign_id, actor)
    return [str(r[1]) for r in rows]


def status(conn: psycopg.Connection, campaign_id: int) -> dict[str, Any]:
    """A campaign's settings, checkpoint and rows by state, the next due time and the send
    lateness (``sent_at - scheduled_at``) p50/p99 in seconds, for a paused campaign
    ``paused_reason`` (why it was paused, or None), ``hold``: why a scheduled or paused campaign
    does not send as planned (:class:`~mailflow.sources.scheduled.holds.Hold` as a dict: ``kind``
    paused / guard_account / guard_campaign / guard_waiting / canary, ``reason``, ``since`` and the canary's
    counts), or None when it sends as planned, and ``test_emails``: its test emails with their outcomes
    (:func:`mailflow.store.test_emails.of_campaign`). Datetimes as ISO text."""
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(campaign_id)
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        counts = ScheduledStore(conn).campaign_counts(c["name"]) or {}
        reason = ScheduledStore(conn).pause_reason(campaign_id) if c["status"] == "paused" else None
        hold = campaign_holds(conn, c["name"]).get(c["name"])
        tests = test_emails.of_campaign(conn, campaign_id)
    out = {**c, "rows": counts, "paused_reason": reason, "hold": hold.as_dict() if hold else None,
           "test_emails": tests}
    return json.loads(json.dumps(out, default=json_default))


def resume_reputation(conn: psycopg.Connection, scope: str, name: str, *, actor: str,
                      reason: str) -> dict[str, Any]:
    """A person resumes what the reputation guard stopped (:func:`mailflow.store.reputation.resume`):
    the scope (``campaign`` or ``account``) becomes ok; every scheduled campaign the guard paused that
    nothing trips any more resumes by :func:`resume`, and every campaign the scope held while it was
    ``scheduled`` (provisioned, or resumed by a person, while the scope was tripped) has its overdue rows
    re-planned from the resume instant (:func:`~mailflow.sources.scheduled.replan.replan_overdue`):
    no campaign the scope held sends its backlog at once. All in one transaction. Shared by
    ``mailflow reputation resume`` and the ``resume_sending`` DAG.

    :returns: ``{"scope", "name", "changed", "resumed_at" (ISO text or None), "unpaused": [names],
        "released": [names of the held scheduled campaigns, re-planned where rows were overdue]}``.
    :raises ValueError: for an unknown scope or an empty ``actor`` / ``reason``.
    :raises LookupError: if the guard never evaluated that scope.
    """
    if not reason or not reason.strip():
        raise ValueError("resuming after a reputation trip needs a reason (recorded with who resumed)")
    why = f"reputation guard resumed ({scope} {name})"
    with conn.transaction():
        at = db_now(conn)
        done = reputation.resume(conn, scope, name, actor, reason,
                                 unpause=lambda c, cid, who: resume(c, cid, now=at, actor=who),
                                 release=lambda c, cid, who: replan_overdue(c, cid, at, actor=who, reason=why))
    return {"scope": done.scope, "name": done.name, "changed": done.changed,
            "resumed_at": done.resumed_at.isoformat() if done.resumed_at else None, "unpaused": list(done.unpaused),
            "released": list(done.released)}
