"""PostgreSQL adapter for the send log: the engine's *store* of rows.

Every write is a named statement from ``sql/queries``; every state change is guarded on the
current state and appends a ``mail.send_event`` row in the same statement.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import psycopg
from psycopg import sql as pgsql
from psycopg.types.json import Jsonb

from mailflow import settings
from mailflow.campaigns import Campaign
from mailflow.model import Accepted, MintedRow, NotSent, Outcome, PreparedBatch, Refused, RunContext, Unknown
from mailflow.sql import query


@dataclass(frozen=True)
class MintResult:
    """One page of the audience and what became of it.

    ``page_size`` = candidates read (0 = audience exhausted), ``cursor`` = the last user_id read
    (keyset), ``batch`` = the prepared request for the rows actually minted (None if every candidate
    lost the ON CONFLICT race to another run)."""

    page_size: int
    cursor: int
    batch: PreparedBatch | None
    rows: tuple[MintedRow, ...] = ()


@dataclass(frozen=True)
class Applied:
    """Rows changed by applying an outcome: sent, failed (rejected), released, left unknown."""

    sent: int = 0
    failed: int = 0
    released: int = 0
    unknown: int = 0

    def __add__(self, other: Applied) -> Applied:
        return Applied(self.sent + other.sent, self.failed + other.failed, self.released + other.released,
                       self.unknown + other.unknown)


class Store(Protocol):
    """What the engine needs from a send log."""

    def count_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int: ...

    def mint_chunk(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime,
                   after: int, limit: int, run: RunContext, interval: tuple[datetime, datetime],
                   prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> MintResult: ...

    def apply(self, batch: PreparedBatch, outcome: Outcome, run: RunContext) -> Applied: ...

    def rebatch(self, batch: PreparedBatch) -> None: ...


class PostgresStore:
    """The send log in PostgreSQL (schema ``mail``, see ``sql/migrations``).

    :param conn: a psycopg 3 connection, idle; the store switches it to autocommit so that nothing
        can hold a transaction open by accident: every unit of work is an explicit
        ``conn.transaction()`` that commits when it ends (a send is never recorded inside a
        transaction that a later crash could roll back).
    :raises ValueError: if the connection is inside a transaction.
    """

    def __init__(self, conn: psycopg.Connection):
        if not conn.autocommit:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raise ValueError("PostgresStore needs an idle connection (commit or roll back first)")
            conn.autocommit = True
        self.conn = conn
        self._sql_cache: dict[tuple[str, str], pgsql.Composed] = {}

    def _audience_sql(self, name: str, campaign: Campaign) -> pgsql.Composed:
        key = (name, campaign.name)
        if key not in self._sql_cache:
            # The audience file is trusted, version-controlled SQL (not input): composed in as SQL.
            eligible = pgsql.SQL(query("lifecycle", "eligible")).format(audience=pgsql.SQL(campaign.audience_sql))
            self._sql_cache[key] = pgsql.SQL(query("lifecycle", name)).format(eligible=eligible)
        return self._sql_cache[key]

    @staticmethod
    def _params(campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> dict[str, Any]:
        return {"campaign": campaign.name, "window_start": window[0], "window_end": window[1],
                "cooldown_since": cooldown_since, "cooldown_until": cooldown_since + 2 * campaign.cooldown,
                "max_attempts": settings.max_attempts()}

    def count_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int:
        """Audience size after exclusions (emails), read in its own short transaction."""
        with self.conn.transaction():
            row = self.conn.execute(self._audience_sql("audience_count", campaign),
                                    self._params(campaign, window, cooldown_since)).fetchone()
        return int(row[0]) if row else 0

    def mint_chunk(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime,
                   after: int, limit: int, run: RunContext, interval: tuple[datetime, datetime],
                   prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> MintResult:
        """Read the next audience page, mint it, render it and store the batch, in ONE transaction.

        Either all of it commits (rows ``sending`` with their batch bytes, re-sendable by the
        reconciler) or none of it does (a crash here sends nothing and leaves nothing behind).
        """
        params = self._params(campaign, window, cooldown_since) | {"after": after, "limit": limit}
        with self.conn.transaction():
            page = self.conn.execute(self._audience_sql("audience_page", campaign), params).fetchall()
            if not page:
                return MintResult(page_size=0, cursor=after, batch=None)
            cursor = max(r[0] for r in page)
            minted = self.conn.execute(query("lifecycle", "mint"), {
                "campaign": campaign.name,
                "page": Jsonb([{"user_id": r[0], "email": r[1], "context": r[2]} for r in page]),
                "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id,
                "interval_start": interval[0], "interval_end": interval[1],
            }).fetchall()
            if not minted:
                return MintResult(page_size=len(page), cursor=cursor, batch=None)
            rows = tuple(MintedRow(id=r[0], user_id=r[1], email=r[2], context=r[3] or {}) for r in minted)
            batch = prepare(rows)
            self._save_batch(batch)
        return MintResult(page_size=len(page), cursor=cursor, batch=batch, rows=rows)

    def _save_batch(self, batch: PreparedBatch) -> None:
        self.conn.execute(query("send_log", "save_batch"), {
            "key": batch.idempotency_key, "campaign": batch.campaign,
            "count": len(batch.row_ids), "body": batch.body})
        self.conn.execute(query("send_log", "assign_batch"), {
            "key": batch.idempotency_key, "ids": list(batch.row_ids),
            "idx": list(range(len(batch.row_ids)))})

    def save_batch(self, batch: PreparedBatch) -> None:
        """Store a batch's exact request bytes and give its rows (``sending``) the batch's key and
        request indices, inside the CALLER's transaction (the scheduled dispatcher claims, renders
        and stores in one transaction, so a ``sending`` row always has bytes to resend).

        :raises psycopg.errors.UniqueViolation: if the idempotency key is already stored.
        """
        self._save_batch(batch)

    def rebatch(self, batch: PreparedBatch) -> None:
        """Store a new batch for rows already ``sending`` (after a strict-mode refusal): the rows
        take its key and indices, and its bytes become what any retry resends."""
        with self.conn.transaction():
            self._save_batch(batch)

    def apply(self, batch: PreparedBatch, outcome: Outcome, run: RunContext) -> Applied:
        """Apply a provider outcome to the batch's rows, by request index, in one transaction."""
        who = {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}
        ids = list(batch.row_ids)
        with self.conn.transaction():
            if isinstance(outcome, Accepted):
                sent = failed = 0
                if outcome.ids:
                    idx = sorted(outcome.ids)
                    sent = len(self.conn.execute(query("send_log", "mark_sent"), who | {
                        "ids": [ids[i] for i in idx], "pids": [outcome.ids[i] for i in idx]}).fetchall())
                if outcome.rejected:
                    idx = sorted(outcome.rejected)
                    failed = len(self.conn.execute(query("send_log", "mark_failed"), who | {
                        "ids": [ids[i] for i in idx],
                        "msgs": [outcome.rejected[i][:1000] for i in idx]}).fetchall())
                return Applied(sent=sent, failed=failed)
            if isinstance(outcome, Refused):
                idx = sorted(outcome.rejected)
                failed = len(self.conn.execute(query("send_log", "mark_failed"), who | {
                    "ids": [ids[i] for i in idx],
                    "msgs": [outcome.rejected[i][:1000] for i in idx]}).fetchall())
                return Applied(failed=failed)
            if isinstance(outcome, NotSent):
                n = len(self.conn.execute(query("send_log", "release"), who | {
                    "ids": ids, "reason": outcome.reason[:1000], "max_attempts": settings.max_attempts()}).fetchall())
                return Applied(released=n)
            assert isinstance(outcome, Unknown)
            n = len(self.conn.execute(query("send_log", "note_unknown"), who | {
                "ids": ids, "reason": outcome.reason[:1000]}).fetchall())
            return Applied(unknown=n)

    def preview(self, campaigns: Sequence[Campaign], interval: Any, renderer: Any, sample: int = 3) -> list[dict[str, Any]]:
        """Dry run: per campaign, the audience size after exclusions and ``sample`` rendered emails
        (subject and masked recipient). Writes nothing. Later campaigns do not see earlier ones'
        audiences as minted, so the counts are upper bounds of what a real run mints."""
        out: list[dict[str, Any]] = []
        for c in campaigns:
            window = c.window(interval)
            since = interval.end - c.cooldown
            params = self._params(c, window, since) | {"after": 0, "limit": sample}
            with self.conn.transaction():
                rows = self.conn.execute(self._audience_sql("audience_page", c), params).fetchall()
            emails = [renderer.render_email(c, MintedRow(id=0, user_id=r[0], email=r[1], context=r[2] or {}))
                      for r in rows]
            out.append({
                "campaign": c.name,
                "eligible": self.count_audience(c, window, since),
                "window": [window[0].isoformat(), window[1].isoformat()],
                "sample": [{"to": mask_email(e["to"][0]), "subject": e["subject"]} for e in emails],
            })
        return out


def mask_email(address: str) -> str:
    """``jane.doe@example.com`` -> ``j***@example.com`` (for logs, XCom and UI pages)."""
    local, _, domain = address.partition("@")
    return f"{local[:1]}***@{domain}" if domain else "***"
