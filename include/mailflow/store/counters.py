"""The per-campaign counters of migration 0028 (and 0031's per day of sending): fold the pending changes,
and read the counts.

Statement-level triggers on ``mail.send_log`` and ``mail.delivery_status`` append each statement's net
change per (campaign, key) to ``mail.campaign_counter_delta`` in the writer's transaction;
:func:`fold` moves them into ``mail.campaign_counter``. Readers add both (``mail.campaign_counts``), so the
counts are exact whenever they are read; folding only keeps the delta table short (docs/send_log.md,
"Counters").
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from mailflow.store.sql import query


def seeded(conn: psycopg.Connection) -> bool:
    """Whether the counters hold the whole send log (False until the first fold after the upgrade to 0028
    counted it; an empty send log is seeded by the migration itself)."""
    row = conn.execute(query("counters", "seeded")).fetchone()
    return bool(row and row[0])


def day_seeded(conn: psycopg.Connection) -> bool:
    """Whether the day counters of migration 0031 hold every sent email (the migration seeds them with the
    first fold; False only if that fold was skipped or the state was reset: the next fold seeds them)."""
    row = conn.execute(query("counters", "day_seeded")).fetchone()
    return bool(row and row[0])


def fold(conn: psycopg.Connection) -> int | None:
    """Fold the pending changes into the counters and the day counters of migration 0031 (the sent emails
    and their outcomes per campaign and day of sending: ``mail.campaign_outcomes_daily``), in a transaction
    of its own; the first call seeds each (a full count of the send log: about a minute at 20M rows).

    :returns: the delta rows folded into the per-campaign counters (the seed: counter rows written), or None
        when another fold is running (that one folds the same rows; nothing waits).
    """
    with conn.transaction():
        row = conn.execute(query("counters", "fold")).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def progress(conn: psycopg.Connection, campaign: str | None = None) -> list[dict[str, Any]]:
    """``mail.campaign_progress``'s rows (its columns), every campaign or one, from the counters.

    Only valid once :func:`seeded`."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("counters", "progress"), {"campaign": campaign}).fetchall()


def outcomes(conn: psycopg.Connection, campaign: str | None = None) -> list[dict[str, Any]]:
    """``mail.campaign_outcomes``'s counts, rates and guard columns by campaign, from the counters.

    Only valid once :func:`seeded`."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("counters", "outcomes"), {"campaign": campaign}).fetchall()
