"""Deterministic demo data for the practice platform's ``app`` schema.

:func:`load_demo_data` creates the ``app`` schema (see ``app_schema.sql``) if
needed and fills ``app.users`` and ``app.assessments`` with a realistic,
seeded population: users sign up over the 14 days before ``anchor`` (the "now"
of the data), most start an assessment soon after, some abandon it, some finish
free tests, about 8% pay for the pro plan and a good share go quiet.

Every random choice comes from :class:`random.Random` streams seeded from
``seed`` (and Faker instances seeded the same way), so the same ``seed`` and
``anchor`` always produce identical rows (for a given Faker version).  Rows are
written with ``COPY``: 5,000 users load in a fraction of a second.

About 1% of the addresses are malformed in ways a real email API rejects
(see :data:`MALFORMED_KINDS`); a few percent more are odd but valid (plus tags,
subdomains, upper case) and must be accepted.  All domains are the reserved
``example.com`` / ``example.org`` / ``example.net`` (RFC 2606) and their
subdomains, so no demo address can reach a real mailbox.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from mailflow.store.sql import analytics
from mailflow_dev.demo.generate import MALFORMED_KINDS, generate

__all__ = ["MALFORMED_KINDS", "LoadSummary", "load_demo_data", "schema_sql"]


_USER_COLUMNS = (
    "user_id",
    "email",
    "first_name",
    "last_name",
    "signed_up_at",
    "timezone",
    "plan",
    "last_active_at",
)
_ASSESSMENT_COLUMNS = (
    "assessment_id",
    "user_id",
    "kind",
    "is_free",
    "started_at",
    "finished_at",
    "score",
)


@dataclass(frozen=True)
class LoadSummary:
    """What :func:`load_demo_data` did.

    Attributes:
        loaded: True if rows were written, False if the tables already had data
            and the call did nothing (see ``message``).
        users: rows in ``app.users`` after the call (written or pre-existing).
        assessments: rows in ``app.assessments`` after the call.
        pro_users: users on the ``pro`` plan after the call.
        malformed_emails: malformed addresses written by this call (0 when
            nothing was loaded: pre-existing data is not inspected).
        odd_valid_emails: odd-but-valid addresses written by this call.
        seed: the seed used (as passed).
        anchor: the data's "now", an aware UTC datetime; every generated
            timestamp is strictly before it.
        reset: True if the tables were truncated first.
        elapsed_s: wall-clock seconds spent in the call.
        message: one human-readable line.
    """

    loaded: bool
    users: int
    assessments: int
    pro_users: int
    malformed_emails: int
    odd_valid_emails: int
    seed: int
    anchor: datetime
    reset: bool
    elapsed_s: float
    message: str

    def __str__(self) -> str:
        return self.message


def schema_sql() -> str:
    """Return the text of ``app_schema.sql`` (idempotent DDL for schema ``app``)."""
    return resources.files("mailflow_dev.demo").joinpath("app_schema.sql").read_text(encoding="utf-8")


def load_demo_data(
    conn: psycopg.Connection[Any],
    *,
    users: int = 5000,
    seed: int = 42,
    anchor: datetime,
    reset: bool = False,
) -> LoadSummary:
    """Create schema ``app`` if needed and load a deterministic demo population.

    Args:
        conn: an open psycopg 3 connection (autocommit or not).  All work runs
            in ``conn.transaction()``: with no transaction open it is committed
            at the end; inside a caller's transaction it becomes a savepoint and
            the caller commits.
        users: number of users to create (>= 1); user_ids are ``1..users`` in
            sign-up order.
        seed: seed of every random stream; same ``seed`` + ``anchor`` (+ same
            Faker version) -> identical rows.
        anchor: aware datetime, the "now" of the data (converted to UTC).
            Users sign up in ``[anchor - 14 days, anchor)``; all timestamps are
            whole seconds and strictly before ``anchor``.
        reset: truncate ``app.assessments`` and ``app.users`` first.  Without
            it, if ``app.users`` already has rows the call changes nothing and
            returns a summary with ``loaded=False``.

    Returns:
        A :class:`LoadSummary`.

    Raises:
        ValueError: ``anchor`` is naive or ``users`` < 1.
        psycopg.Error: database errors (the transaction is rolled back).
    """
    if anchor.tzinfo is None or anchor.utcoffset() is None:
        raise ValueError("anchor must be an aware datetime (UTC recommended)")
    if users < 1:
        raise ValueError("users must be >= 1")
    anchor = anchor.astimezone(UTC)
    started = time.perf_counter()

    with conn.transaction(), conn.cursor() as cur:
        # Serialise concurrent loaders on the same database (DDL included).
        cur.execute("select pg_advisory_xact_lock(hashtext('mailflow.demo.load_demo_data'))")
        cur.execute(schema_sql())  # trusted static DDL from the package
        install_lift_view(cur)
        if reset:
            cur.execute("truncate app.assessments, app.users")
        else:
            cur.execute("select exists (select 1 from app.users)")
            row = cur.fetchone()
            if row is not None and row[0]:
                n_users, n_assessments, n_pro = _counts(cur)
                return LoadSummary(
                    loaded=False,
                    users=n_users,
                    assessments=n_assessments,
                    pro_users=n_pro,
                    malformed_emails=0,
                    odd_valid_emails=0,
                    seed=seed,
                    anchor=anchor,
                    reset=False,
                    elapsed_s=time.perf_counter() - started,
                    message=(
                        f"app.users already has {n_users} rows: nothing loaded "
                        f"(pass reset=True, or --reset to make demo / python -m mailflow_dev.demo, to reload)"
                    ),
                )

        user_rows, assessment_rows = generate(users=users, seed=seed, anchor=anchor)

        # Binary COPY: no text formatting/parsing of timestamps on either side.
        with cur.copy(f"copy app.users ({', '.join(_USER_COLUMNS)}) from stdin (format binary)") as copy:
            copy.set_types(["int8", "text", "text", "text", "timestamptz", "text", "text", "timestamptz"])
            for u in user_rows:
                copy.write_row(
                    (
                        u.user_id,
                        u.email,
                        u.first_name,
                        u.last_name,
                        u.signed_up_at,
                        u.timezone,
                        u.plan,
                        u.last_active_at,
                    )
                )
        with cur.copy(
            f"copy app.assessments ({', '.join(_ASSESSMENT_COLUMNS)}) from stdin (format binary)"
        ) as copy:
            copy.set_types(["int8", "int8", "text", "bool", "timestamptz", "timestamptz", "int4"])
            for a in assessment_rows:
                copy.write_row(a)
        cur.execute("analyze app.users")
        cur.execute("analyze app.assessments")

    malformed = sum(1 for u in user_rows if u.email_kind in MALFORMED_KINDS)
    odd = sum(1 for u in user_rows if u.email_kind == "odd_valid")
    pro = sum(1 for u in user_rows if u.plan == "pro")
    elapsed = time.perf_counter() - started
    return LoadSummary(
        loaded=True,
        users=len(user_rows),
        assessments=len(assessment_rows),
        pro_users=pro,
        malformed_emails=malformed,
        odd_valid_emails=odd,
        seed=seed,
        anchor=anchor,
        reset=reset,
        elapsed_s=elapsed,
        message=(
            f"loaded {len(user_rows)} users ({pro} pro, {malformed} malformed and {odd} odd-but-valid "
            f"addresses) and {len(assessment_rows)} assessments; seed={seed}, "
            f"anchor={anchor.isoformat()}{', after reset' if reset else ''}, in {elapsed:.2f}s"
        ),
    )


LIFT_COMMENTS = {
    None: "The lift of each campaign with a holdout group: treated (sent) against held-out users, conversion = "
          "an assessment finished within 7 days after the user's email was (or, held out, would have been) "
          "sent (store/sql/analytics/campaign_lift.sql; installed by the demo loader where schema app is "
          "present, docs/send_log.md Q15). Filter by campaign to read one campaign.",
    "campaign": "Campaign name (one with at least one holdout row).",
    "kind": "lifecycle or scheduled.",
    "treated": "Users of the treated group: rows with status sent (window from sent_at).",
    "treated_converted": "Of those, users who finished an assessment within the horizon after their sent_at.",
    "treated_rate": "treated_converted / treated (fraction 0..1, 6 decimals); null when treated = 0.",
    "holdout": "Users of the held-out group: rows with status holdout whose planned time has passed: the slot of "
               "the plan (scheduled_at, at or before the campaign's latest send) or the minting (lifecycle).",
    "holdout_converted": "Of those, users who finished an assessment within the horizon after that time.",
    "holdout_rate": "holdout_converted / holdout (fraction 0..1, 6 decimals); null when holdout = 0.",
    "lift": "treated_rate - holdout_rate (absolute, fraction); null when a group is empty.",
    "horizon": "The conversion window after each user's start (7 days).",
    "open_windows": "Users of either group whose window started within the horizon before now: their rates "
                    "still grow.",
}
"""Comments of ``mail.campaign_lift`` (every view and column of schema mail has one)."""


def install_lift_view(cur: psycopg.Cursor[Any]) -> bool:
    """Create ``mail.campaign_lift`` from the documented query (``mailflow/store/sql/analytics/
    campaign_lift.sql``) and the fold of its rollup, ``mail.fold_campaign_lift``
    (``campaign_lift_fold.sql``), when the send log is in this database.

    Both read ``app.assessments`` (the product's schema), so they are no migration: the demo's database
    holds both schemas, a production send-log database need not (docs/send_log.md, Q15). The view is
    dropped and created (its columns may change between versions). Returns whether they were installed
    (False: the database has no send log migrated to 0031 yet; load the demo again after ``mailflow
    migrate`` to install them).
    """
    cur.execute("select to_regclass('mail.send_log') is not null and to_regclass('mail.campaign_lift_fold') is not null")
    row = cur.fetchone()
    if row is None or not row[0]:
        return False
    cur.execute("drop view if exists mail.campaign_lift")
    cur.execute(sql.SQL("create view mail.campaign_lift as\n{}").format(sql.SQL(analytics("campaign_lift"))))
    for column, text in LIFT_COMMENTS.items():
        target = sql.SQL("view mail.campaign_lift") if column is None else \
            sql.SQL("column mail.campaign_lift.{}").format(sql.Identifier(column))
        cur.execute(sql.SQL("comment on {} is {}").format(target, sql.Literal(text)))
    cur.execute(analytics("campaign_lift_fold"))
    return True


def _counts(cur: psycopg.Cursor[Any]) -> tuple[int, int, int]:
    cur.execute(
        "select (select count(*) from app.users),"
        " (select count(*) from app.assessments),"
        " (select count(*) from app.users where plan = 'pro')"
    )
    row = cur.fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])
