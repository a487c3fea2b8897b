"""Re-planning a held campaign's overdue rows: the one step every path that lets a held campaign send
again goes through (a person's resume, the reputation guard's resume at campaign or account scope, a
canary release, and the dispatcher's per-day cap), so no release sends the backlog of the hold at once.

The rule (the module docstring of :mod:`mailflow.sources.scheduled`, "Pause / resume rule"): if a
pending row's time passed, every pending row of the campaign is re-planned in its order from the
release instant with the planner, so the overdue rows take the next slots in the campaign's windows
and everyone after them shifts back; the release day keeps only the slots left after the campaign's
emails already sent or in flight that day (``plan_skip``), so ``emails_per_day`` holds on it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from mailflow.sources.scheduled.campaign_db import db_now, lock_campaign, record_event
from mailflow.sources.scheduled.planning import day_bounds, plan_after, plan_spec
from mailflow.store.scheduled import ScheduledStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replanned:
    """What :func:`replan_overdue` did: ``overdue`` pending rows whose time had passed at ``at``,
    ``replanned`` rows given a new time (every pending row when any was overdue, else 0), the first and
    last new time (aware UTC, None when nothing moved) and ``skip`` (slots of the release day already
    used by the campaign's emails sent or in flight)."""

    campaign: str
    at: datetime
    overdue: int
    replanned: int
    first: datetime | None
    last: datetime | None
    skip: int

    def detail(self) -> dict[str, Any]:
        """The campaign event's detail: counts, and instants as ISO text."""
        return {"overdue": self.overdue, "replanned": self.replanned, "replanned_from": self.at.isoformat(),
                "first": self.first.isoformat() if self.first else None,
                "last": self.last.isoformat() if self.last else None, "plan_skip": self.skip}


def replan_locked(conn: psycopg.Connection, c: dict[str, Any], at: datetime) -> Replanned:
    """Re-plan the pending rows of campaign row ``c`` from ``at`` if any is overdue (the module's rule),
    in the caller's transaction, which must hold the campaign row's lock (``lock_campaign``: re-planning
    and claiming one campaign are serialised on it). The pending rows are locked in plan order; the
    campaign's plan anchor (``plan_start``, ``plan_skip``, ``planned_through``) moves to ``at``.

    :param at: the release instant (aware; the database clock in production).
    :raises ValueError: for a naive ``at``, or a campaign row whose schedule the planner refuses.
    """
    if at.tzinfo is None:
        raise ValueError("the re-plan instant must be a timezone-aware datetime")
    store = ScheduledStore(conn)
    pending = store.pending_in_order(c["name"])
    overdue = sum(1 for _, t in pending if t is not None and t < at)
    if not overdue:
        return Replanned(c["name"], at, 0, 0, None, None, 0)
    spec = plan_spec(c)
    start, end = day_bounds(at, spec)
    skip = store.day_sends(str(c["name"]), start, end)  # sent or in flight on the release's plan day
    times = list(plan_after(spec, at, skip, None, len(pending)))
    store.replan_rows([r[0] for r in pending], times)
    store.set_plan(int(c["id"]), at, skip, times[-1])
    return Replanned(c["name"], at, overdue, len(times), times[0], times[-1], skip)


def replan_overdue(conn: psycopg.Connection, campaign_id: int, at: datetime | None = None, *, actor: str | None,
                   reason: str) -> Replanned:
    """Lock the campaign and re-plan its overdue rows from ``at`` (default: the database clock, the
    transaction's start) with :func:`replan_locked`, recording a
    campaign event (status unchanged; ``detail.reason`` = ``reason`` and the counts) when rows moved.
    Runs in the caller's transaction (a savepoint if one is open, else its own). A campaign that is not
    ``scheduled`` is left alone (a paused one is re-planned by its resume; a draft has no rows; a
    cancelled or completed one sends nothing).

    :param reason: why the campaign may send again (recorded), e.g. ``"canary released"``.
    :raises LookupError: if the campaign does not exist.
    """
    with conn.transaction():
        at = at or db_now(conn)
        c = lock_campaign(conn, campaign_id)
        if c["status"] != "scheduled":
            return Replanned(c["name"], at, 0, 0, None, None, 0)
        done = replan_locked(conn, c, at)
        if done.replanned:
            record_event(conn, campaign_id, "scheduled", "scheduled", actor,
                         reason=f"{reason}: overdue rows re-planned from now", **done.detail())
    if done.replanned:
        log.info("campaign %s (%s): %d overdue, %d pending rows re-planned from %s (%s .. %s)", c["name"], reason,
                 done.overdue, done.replanned, at.isoformat(), done.first, done.last)
    return done
