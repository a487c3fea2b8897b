"""The statements on ``mail.campaign_approval``: approval requests of scheduled campaigns, their
fingerprints and answers (migration 0029), and the recipient snapshot they are computed from.

Every statement is a named query of ``store/sql/queries/approval.sql``; each method runs one statement
on the connection given, inside whatever transaction the caller holds (none is opened here). The
rules (what the fingerprint covers, when a request is voided) are in
:mod:`mailflow.sources.scheduled.approval`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow.store.sql import query


class ApprovalStore:
    """Named statements on approval requests, on one open connection (no transaction of its own).

    :param conn: an open psycopg connection to the send-log database.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def _one(self, name: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query("approval", name), params)
            return cur.fetchone()

    def insert(self, campaign_id: int, *, state: str, how: str, fingerprint: str, definition: Mapping[str, Any],
               files: Mapping[str, str], recipient_count: int, recipients_sha256: str,
               recipient_ids: Sequence[int], requested_by: str | None, expires_at: datetime | None = None,
               decided_by: str | None = None, reason: str | None = None) -> int:
        """Insert one request (``state`` ``pending``, or ``approved`` answered now by ``decided_by``
        with ``reason``); return its id. ``recipient_ids`` ascending."""
        row = self.conn.execute(query("approval", "approval_insert"), {
            "campaign_id": campaign_id, "state": state, "how": how, "fingerprint": fingerprint,
            "definition": Jsonb(dict(definition)), "files": Jsonb(dict(files)), "recipient_count": recipient_count,
            "recipients_sha256": recipients_sha256, "recipient_ids": list(recipient_ids),
            "requested_by": requested_by, "expires_at": expires_at, "decided_by": decided_by, "reason": reason,
        }).fetchone()
        assert row is not None
        return int(row[0])

    def by_id(self, approval_id: int) -> dict[str, Any] | None:
        """The request as a dict (``recipient_ids`` a list), or None."""
        return self._one("approval_by_id", {"id": approval_id})

    def decide(self, approval_id: int, state: str, decided_by: str | None, reason: str | None) -> bool:
        """Answer a pending request (``approved``, ``rejected`` or ``expired``); False if it was not
        pending any more (voided meanwhile, or answered already)."""
        return self.conn.execute(query("approval", "approval_decide"), {
            "id": approval_id, "state": state, "decided_by": decided_by, "reason": reason}).fetchone() is not None

    def void_open(self, campaign_id: int, decided_by: str | None, reason: str) -> list[tuple[int, str, str]]:
        """Void the campaign's pending and approved requests; ``(id, previous state, fingerprint)`` of each."""
        rows = self.conn.execute(query("approval", "approval_void_open"), {
            "campaign_id": campaign_id, "decided_by": decided_by, "reason": reason}).fetchall()
        return [(int(i), str(s), str(f)) for i, s, f in rows]

    def latest_decided(self, campaign_id: int) -> dict[str, Any] | None:
        """The campaign's latest answered request (not pending) as a dict, or None."""
        return self._one("approval_latest_decided", {"campaign_id": campaign_id})

    def recipient_ids(self, source: pgsql.Composable, campaign: str, campaign_id: int) -> list[int]:
        """Every user_id of recipient ``source``, ascending (the bound parameters ``campaign`` and
        ``campaign_id`` are the ones a recipients file may use)."""
        stmt = pgsql.SQL(query("approval", "recipient_ids")).format(source=source)
        return [int(r[0]) for r in self.conn.execute(stmt, {"campaign": campaign, "campaign_id": campaign_id})]
