"""Shared access to ``mail.campaign`` for the scheduled steps: lock or read a campaign row,
append a campaign event, the actor recorded on it, the database clock, a day's used slots."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

import psycopg

from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.planning import PlanSpec, day_bounds
from mailflow.store.scheduled import ScheduledStore


class CampaignStateError(ValueError):
    """The operation is not allowed in the campaign's current status (names both)."""


def lock_campaign(conn: psycopg.Connection, campaign_id: int) -> dict[str, Any]:
    row = ScheduledStore(conn).lock_campaign(campaign_id)
    if row is None:
        raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
    return row


def record_event(conn: psycopg.Connection, campaign_id: int, from_status: str | None, to_status: str,
           actor: str | None, **detail: Any) -> None:
    ScheduledStore(conn).record_event(campaign_id, from_status, to_status, actor, detail)


def actor_name(run: RunContext | None, actor: str | None) -> str | None:
    if actor:
        return actor
    if run and run.dag_id:
        return f"{run.dag_id}/{run.run_id}/{run.task_id}"
    return None


def used_on_day(conn: psycopg.Connection, c: Mapping[str, Any], spec: PlanSpec, at: datetime,
                 include_pending: bool) -> int:
    start, end = day_bounds(at, spec)
    return ScheduledStore(conn).sent_between(c["name"], start, end, include_pending)


def json_default(v: Any) -> Any:
    if isinstance(v, datetime | date):
        return v.isoformat()
    return str(v)


def db_now(conn: psycopg.Connection) -> datetime:
    return ScheduledStore(conn).db_now()
