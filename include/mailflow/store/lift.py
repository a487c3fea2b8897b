"""The lift's rollup of closed conversion windows (docs/send_log.md, Q15).

``mail.fold_campaign_lift`` (``store/sql/analytics/campaign_lift_fold.sql``) counts, per campaign with a
holdout group, the treated and held-out users whose conversion window has closed into
``mail.campaign_lift_day`` (migration 0031), so the lift query reads those counts and only the rows of the
last horizon. It reads the product's conversions (``app.assessments``), so it is no migration: it is
installed where both schemas are visible (:func:`install`; the demo loader does it), and the reconcile DAG
folds on every run where it is installed (:func:`fold`).
"""

from __future__ import annotations

import psycopg

from mailflow.store.sql import analytics

FOLD = "mail.fold_campaign_lift(interval, interval)"
"""The fold's signature (its defaults: a 7-day horizon, a settling day)."""


def installed(conn: psycopg.Connection) -> bool:
    """Whether ``mail.fold_campaign_lift`` exists in the send-log database."""
    row = conn.execute("select to_regprocedure(%s) is not null", (FOLD,)).fetchone()
    return bool(row and row[0])


def install(conn: psycopg.Connection) -> None:
    """Create or replace ``mail.fold_campaign_lift`` from ``campaign_lift_fold.sql`` (needs ``app.assessments``
    and migration 0031), in the caller's transaction.

    :raises psycopg.errors.UndefinedTable: if the send log is not migrated to 0031 (the function body is
        checked when it first runs: a database without ``app.assessments`` fails at :func:`fold`).
    """
    conn.execute(analytics("campaign_lift_fold"))


def fold(conn: psycopg.Connection) -> int | None:
    """Fold the closed windows of every campaign with a holdout group (7-day horizon, a settling day), in a
    transaction of its own; nothing when the fold is not installed.

    The first fold after installing reads every campaign's history once (as the unfolded lift query does);
    later ones read the sends since the previous fold.

    :returns: the rollup rows written, or None when the fold is not installed or another one is running.
    """
    if not installed(conn):
        return None
    with conn.transaction():
        row = conn.execute("select mail.fold_campaign_lift()").fetchone()
    return None if row is None or row[0] is None else int(row[0])
