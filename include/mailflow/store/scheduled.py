"""The scheduled source's statements on ``mail.campaign``, its events and its send-log rows.

Every statement is a named query of ``store/sql/queries/scheduled.sql``; the scheduled steps
(:mod:`mailflow.sources.scheduled`) call these methods instead of running SQL themselves, as the
lifecycle source does with :class:`~mailflow.store.send_log.PostgresStore`. Each method runs one
statement on the connection given, inside whatever transaction the caller holds (none is opened
here). Datetimes are aware (UTC or the campaign's zone, as passed); rows come back as the
connection's default tuples unless the method says ``dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow.store.sql import query


@dataclass(frozen=True)
class CanaryRelease:
    """One canary released: the campaign (``campaign_id``, ``name``), its canary emails ``sent``, of them
    ``with_outcome``, its rows ``deferred`` by the contact policy (not waited for) and the ``rule`` that
    released it: ``outcomes`` (the outcome share of the sent canary), ``maximum wait`` or
    ``nothing to judge`` (no canary email sent and none deferred)."""

    campaign_id: int
    name: str
    sent: int
    with_outcome: int
    deferred: int
    rule: str


class ScheduledStore:
    """Named statements of the scheduled source on one open connection (no transaction of its own).

    :param conn: an open psycopg connection to the send-log database.
    """

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn = conn

    def _one(self, name: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query("scheduled", name), params)
            return cur.fetchone()

    def _run(self, name: str, params: Mapping[str, Any]) -> psycopg.Cursor[Any]:
        return self.conn.execute(query("scheduled", name), params)

    # -- the campaign row ----------------------------------------------------------------------

    def lock_campaign(self, campaign_id: int) -> dict[str, Any] | None:
        """The campaign row as a dict, locked ``FOR UPDATE`` until the caller's transaction ends; None if absent."""
        return self._one("campaign_lock", {"id": campaign_id})

    def campaign_by_id(self, campaign_id: int) -> dict[str, Any] | None:
        """The campaign row as a dict (no lock), or None."""
        return self._one("campaign_by_id", {"id": campaign_id})

    def campaign_by_name(self, name: str) -> dict[str, Any] | None:
        """The campaign row named ``name`` as a dict (no lock), or None."""
        return self._one("campaigns_by_name", {"names": [name]})

    def campaign_id_by_name(self, name: str) -> int | None:
        """The id of the campaign named ``name``, or None."""
        row = self._run("campaign_id_by_name", {"name": name}).fetchone()
        return None if row is None else int(row[0])

    def insert_campaign(self, values: Mapping[str, Any]) -> int:
        """Insert a draft campaign from the ``campaign_insert`` parameters (name, timezone,
        emails_per_day, weekdays, windows, holidays (a holidays-library code or None), start_at
        (None: now), template, subject, from_address, reply_to, recipients_sql, recipients_table,
        marketing, on_policy, canary_share, canary_min_outcome_share, canary_max_wait, holdout_share
        (a fraction in [0, 1); 0 or left out: no holdout group)); return its id."""
        row = self._run("campaign_insert", {"holidays": None, "holdout_share": 0.0, **values}).fetchone()
        assert row is not None
        return int(row[0])

    def update_definition(self, campaign_id: int, values: Mapping[str, Any]) -> bool:
        """Replace a draft campaign's definition (the ``insert_campaign`` values but the name);
        False if the campaign is not (or no longer) a draft."""
        return self._run("campaign_update_definition", {"holidays": None, **values, "id": campaign_id}).fetchone() \
            is not None

    def clear_recipients(self, campaign_id: int) -> None:
        """Delete the campaign's uploaded recipient list (``mail.campaign_recipient``)."""
        self._run("campaign_recipients_clear", {"id": campaign_id})

    def lifecycle_name_used(self, name: str) -> bool:
        """True if the send log has lifecycle rows under campaign ``name``."""
        row = self._run("lifecycle_name_used", {"name": name}).fetchone()
        return bool(row and row[0])

    def recipient_columns(self, source: pgsql.Composable, campaign: str, campaign_id: int) -> list[str]:
        """The column names of recipient ``source`` (run with ``limit 0``: no row is read).

        :raises psycopg.Error: if the query fails; the caller runs it in a savepoint.
        """
        stmt = pgsql.SQL(query("scheduled", "recipients_probe")).format(source=source)
        cur = self.conn.execute(stmt, {"campaign": campaign, "campaign_id": campaign_id})
        return [d.name for d in cur.description or ()]

    def set_status(self, campaign_id: int, from_status: str, to_status: str) -> None:
        """Move the campaign from ``from_status`` to ``to_status`` (the caller checked the transition)."""
        self._run("campaign_set_status", {"id": campaign_id, "from_status": from_status, "to_status": to_status})

    def record_event(self, campaign_id: int, from_status: str | None, to_status: str, actor: str | None,
                     detail: Mapping[str, Any]) -> None:
        """Append one ``mail.campaign_event`` (``detail`` stored as JSON)."""
        self._run("campaign_event", {"id": campaign_id, "from_status": from_status, "to_status": to_status,
                                     "detail": Jsonb(dict(detail)), "actor": actor})

    def set_plan(self, campaign_id: int, plan_start: datetime, plan_skip: int,
                 planned_through: datetime | None) -> None:
        """Anchor the campaign's send plan (start instant, slots already used that day, last planned time)."""
        self._run("set_plan", {"id": campaign_id, "plan_start": plan_start, "plan_skip": plan_skip,
                               "planned_through": planned_through})

    def pause_reason(self, campaign_id: int) -> str | None:
        """Why the dispatcher paused the campaign (its last pause event), or None."""
        row = self._run("pause_reason", {"id": campaign_id}).fetchone()
        return row[0] if row else None

    def campaign_counts(self, campaign: str) -> dict[str, Any] | None:
        """The campaign's send-log rows counted by status, as a dict."""
        return self._one("campaign_counts", {"campaign": campaign})

    def complete_finished(self, campaign_id: int | None, actor: str | None) -> list[tuple[Any, ...]]:
        """Complete every scheduled campaign (or only ``campaign_id``) with nothing pending or sending;
        the completed rows ``(id, name, ...)``."""
        return self._run("complete_finished", {"id": campaign_id, "actor": actor}).fetchall()

    # -- planning --------------------------------------------------------------------------------

    def sent_between(self, campaign: str, start: datetime, end: datetime, include_pending: bool) -> int:
        """Rows of ``campaign`` sent (or also pending) with a time in ``[start, end)``."""
        row = self._run("sent_between", {"campaign": campaign, "start": start, "end": end,
                                         "include_pending": include_pending}).fetchone()
        return int(row[0]) if row else 0

    def day_counts(self, campaign: str, tz: str, since: datetime, day_start: timedelta) -> list[tuple[Any, ...]]:
        """``(plan day, rows)`` of ``campaign`` from ``since``, days cut at ``day_start`` in zone ``tz``."""
        return self._run("day_counts", {"campaign": campaign, "tz": tz, "since": since,
                                        "day_start": day_start}).fetchall()

    def pending_in_order(self, campaign: str) -> list[tuple[Any, ...]]:
        """``(id, scheduled_at)`` of the campaign's pending rows, in send order."""
        return self._run("pending_in_order", {"campaign": campaign}).fetchall()

    def replan_rows(self, ids: Sequence[int], times: Sequence[datetime]) -> None:
        """Give row ``ids[i]`` the send time ``times[i]``."""
        self._run("replan_rows", {"ids": list(ids), "times": list(times)})

    def cancel_pending(self, campaign: str, reason: str, who: Mapping[str, Any]) -> int:
        """Cancel the campaign's pending rows (``who``: dag_id, run_id, task_id); how many."""
        return len(self._run("cancel_pending", {"campaign": campaign, "reason": reason, **who}).fetchall())

    # -- provisioning ----------------------------------------------------------------------------

    def recipients_page(self, source: pgsql.Composable, after: int, limit: int, campaign: str,
                        campaign_id: int) -> list[tuple[Any, ...]]:
        """The next ``limit`` recipients of ``source`` with an id above ``after``."""
        stmt = pgsql.SQL(query("scheduled", "recipients_page")).format(source=source)
        return self.conn.execute(stmt, {"after": after, "limit": limit, "campaign": campaign,
                                        "campaign_id": campaign_id}).fetchall()

    def recipients_count(self, source: pgsql.Composable, after: int, campaign: str, campaign_id: int) -> int:
        """How many recipients of ``source`` have an id above ``after``."""
        stmt = pgsql.SQL(query("scheduled", "recipients_count")).format(source=source)
        row = self.conn.execute(stmt, {"after": after, "campaign": campaign, "campaign_id": campaign_id}).fetchone()
        return int(row[0]) if row else 0

    def mark_provisioned(self, campaign_id: int, plan_start: datetime | None) -> None:
        """Record that every recipient has a row."""
        self._run("mark_provisioned", {"id": campaign_id, "plan_start": plan_start})

    def provision_rows(self, campaign: str, page: list[dict[str, Any]], who: Mapping[str, Any]) -> tuple[int, int]:
        """Insert one page of rows (``who``: dag_id, run_id, task_id): each planned (``scheduled_at``) or,
        with ``"status": "holdout"``, held out at the slot it would have been sent in; ``(rows created, of
        them holdout)``."""
        res = self._run("provision_rows", {"campaign": campaign, "page": Jsonb(page), **who}).fetchone()
        return (int(res[0]), int(res[1])) if res else (0, 0)

    def advance_checkpoint(self, campaign_id: int, created: int, cursor: int | None,
                           planned_through: datetime | None, plan_start: datetime | None) -> None:
        """Move the provisioning checkpoint past one page."""
        self._run("advance_checkpoint", {"id": campaign_id, "created": created, "cursor": cursor,
                                         "planned_through": planned_through, "plan_start": plan_start})

    # -- dispatch --------------------------------------------------------------------------------

    def due_wait(self, coalesce: float, batch: int) -> float | None:
        """Seconds until a batch is due (0 if one is now), or None if nothing is pending."""
        row = self._run("due_wait", {"coalesce": coalesce, "batch": batch}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def cancel_suppressed_due(self, who: Mapping[str, Any]) -> int:
        """Cancel due rows whose address is suppressed; how many."""
        return len(self._run("cancel_suppressed_due", who).fetchall())

    def pick_due(self, who: Mapping[str, Any], limit: int) -> list[tuple[Any, ...]]:
        """Lock up to ``limit`` due rows of one campaign, in send order."""
        return self._run("pick_due", {**who, "limit": limit}).fetchall()

    def day_sends(self, campaign: str, start: datetime, end: datetime) -> int:
        """Emails of ``campaign`` sent (by ``sent_at``) or in flight (by ``claimed_at``) in ``[start, end)``."""
        row = self._run("day_sends", {"campaign": campaign, "start": start, "end": end}).fetchone()
        return int(row[0]) if row else 0

    def due_count(self, campaign: str, limit: int) -> int:
        """How many of ``campaign``'s rows are due and claimable now, counted up to ``limit``."""
        row = self._run("due_count", {"campaign": campaign, "limit": limit}).fetchone()
        return int(row[0]) if row else 0

    def current_addresses(self, source: pgsql.Composable, user_ids: Sequence[int], campaign: str,
                          campaign_id: int) -> dict[int, str | None]:
        """The addresses the recipient ``source`` holds now for ``user_ids``: ``{user_id: address}``
        (trimmed; None if null or blank). A user the source no longer returns is absent. One statement."""
        stmt = pgsql.SQL(query("scheduled", "current_addresses")).format(source=source)
        rows = self.conn.execute(stmt, {"user_ids": list(user_ids), "campaign": campaign,
                                        "campaign_id": campaign_id}).fetchall()
        return {int(uid): email for uid, email in rows}

    def readdress_rows(self, who: Mapping[str, Any], ids: Sequence[int], emails: Sequence[str],
                       keys: Sequence[str | None]) -> list[int]:
        """Give row ``ids[i]`` the address ``emails[i]`` (mailbox key ``keys[i]``, None if invalid) and
        record the change in ``mail.address_change``; only rows pending and never attempted (no
        idempotency key) change. The ids changed."""
        return [int(r[0]) for r in self._run("readdress_rows", {**who, "ids": list(ids), "emails": list(emails),
                                                                 "keys": list(keys)}).fetchall()]

    def decide_rows(self, who: Mapping[str, Any], ids: Sequence[int], statuses: Sequence[str],
                    reasons: Sequence[str | None], ats: Sequence[datetime | None]) -> None:
        """Give row ``ids[i]`` the final ``statuses[i]`` with ``reasons[i]`` (held to ``ats[i]`` if deferred)."""
        self._run("decide_rows", {**who, "ids": list(ids), "statuses": list(statuses),
                                  "reasons": list(reasons), "ats": list(ats)})

    def claim_rows(self, who: Mapping[str, Any], ids: Sequence[int], emails: Sequence[str],
                   keys: Sequence[str]) -> list[tuple[Any, ...]]:
        """Claim rows ``ids`` (``sending``) with their normalised addresses and mailbox keys; the claimed rows."""
        return self._run("claim_rows", {**who, "ids": list(ids), "emails": list(emails),
                                        "keys": list(keys)}).fetchall()

    def canaries_waiting(self) -> list[str]:
        """Names of the scheduled campaigns whose canary is fixed and not released yet."""
        return [str(r[0]) for r in self._run("canaries_waiting", {}).fetchall()]

    def release_canaries(self, actor: str | None) -> list[CanaryRelease]:
        """Release the rest of every campaign whose canary is in and that the reputation guard does not
        trip (``release_canaries``: the rule is the statement's comment); one :class:`CanaryRelease`
        per campaign released. The campaign rows stay locked until the caller's transaction ends."""
        return [CanaryRelease(int(i), str(n), int(s), int(o), int(d), str(r))
                for i, n, s, o, d, r in self._run("release_canaries", {"actor": actor}).fetchall()]

    def db_now(self) -> datetime:
        """The database's ``now()`` (the transaction's start, aware)."""
        row = self.conn.execute("select now()").fetchone()
        assert row is not None
        return row[0]


def check_name_collisions(conn: psycopg.Connection, names: Sequence[str]) -> None:
    """Refuse lifecycle campaign ``names`` that a scheduled campaign (``mail.campaign``) already has:
    a campaign name is unique across both kinds (it is the send log's ``campaign``, the cooldown's
    and the reports' key), so a lifecycle run must not mint rows under a scheduled campaign's name.
    Runs one statement in the caller's transaction (or autocommit).

    :raises ValueError: naming every colliding campaign and what to do.
    """
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query("scheduled", "campaigns_by_name"), {"names": list(names)})
        taken = sorted(str(r["name"]) for r in cur.fetchall())
    if taken:
        raise ValueError(f"lifecycle campaign(s) {', '.join(taken)} in lifecycle.toml have the name of a scheduled "
                         f"campaign in mail.campaign; campaign names are unique across lifecycle and scheduled "
                         f"campaigns: rename the lifecycle campaign")
