"""Shared access to ``mail.campaign`` for the scheduled steps: lock or read a campaign row,
append a campaign event, the actor recorded on it, the database clock, a day's used slots."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.planning import PlanSpec, day_bounds
from mailflow.store.sql import query


class CampaignStateError(ValueError):
    """The operation is not allowed in the campaign's current status (names both)."""


def fetch_one(conn: psycopg.Connection, sql: str | pgsql.Composable, params: Mapping[str, Any]) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # type: ignore[arg-type]  # named statements from store/sql/queries
        return cur.fetchone()


def lock_campaign(conn: psycopg.Connection, campaign_id: int) -> dict[str, Any]:
    row = fetch_one(conn, query("scheduled", "campaign_lock"), {"id": campaign_id})
    if row is None:
        raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
    return row


def record_event(conn: psycopg.Connection, campaign_id: int, from_status: str | None, to_status: str,
           actor: str | None, **detail: Any) -> None:
    conn.execute(query("scheduled", "campaign_event"), {
        "id": campaign_id, "from_status": from_status, "to_status": to_status,
        "detail": Jsonb(detail), "actor": actor})


def actor_name(run: RunContext | None, actor: str | None) -> str | None:
    if actor:
        return actor
    if run and run.dag_id:
        return f"{run.dag_id}/{run.run_id}/{run.task_id}"
    return None


def used_on_day(conn: psycopg.Connection, c: Mapping[str, Any], spec: PlanSpec, at: datetime,
                 include_pending: bool) -> int:
    start, end = day_bounds(at, spec)
    row = conn.execute(query("scheduled", "sent_between"), {
        "campaign": c["name"], "start": start, "end": end, "include_pending": include_pending}).fetchone()
    return int(row[0]) if row else 0


def json_default(v: Any) -> Any:
    if isinstance(v, datetime | date):
        return v.isoformat()
    return str(v)


def db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("select now()").fetchone()
    assert row is not None
    return row[0]
