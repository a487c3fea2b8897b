"""The progress page's read-only queries, the chart series and the masking of addresses in free text.
Plain psycopg, no Airflow: tested on a real send log (tests/integration/orchestration/test_progress_series.py).

The counts of the list and of a campaign (``mail.campaign_progress``'s and ``mail.campaign_outcomes``'s
columns) come from the per-campaign counters of migration 0028 (store/sql/queries/counters.sql: folded
counts plus the unfolded changes, exact at any time), so a page costs the same at 1M or 20M send-log rows;
until the counters are seeded (the first fold after the upgrade) they come from the views themselves."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import dict_row

from mailflow.sources.scheduled.holds import campaign_holds
from mailflow.store import counters
from mailflow.store.send_log import mask_email
from mailflow.store.sql import query

_EMAIL = re.compile(r"[^\s<>\"'`(),;:\[\]]+@[^\s<>\"'`(),;:\[\]]+")

RECENT_LIMIT = 20
DAYS = 14


LIST_SQL = "select * from mail.campaign_progress order by campaign"
ONE_SQL = "select * from mail.campaign_progress where campaign = %(campaign)s"
# Outcomes after sending and the reputation guard (migration 0021), merged into each progress row.
OUTCOMES_ALL_SQL = """
select campaign, delivered, hard_bounced, complained, no_outcome_yet, delivered_rate, hard_bounce_rate,
       complaint_rate, open_rate, click_rate, guard_state, guard_reason, account_guard_state, account_guard_reason
from mail.campaign_outcomes
"""
OUTCOMES_ONE_SQL = OUTCOMES_ALL_SQL + "where campaign = %(campaign)s\n"
#: What a campaign without a sent email shows (no rates yet; the guard has not tripped).
NO_OUTCOMES = {"delivered": 0, "hard_bounced": 0, "complained": 0, "no_outcome_yet": 0, "delivered_rate": None,
               "hard_bounce_rate": None, "complaint_rate": None, "open_rate": None, "click_rate": None,
               "guard_state": "ok", "guard_reason": None, "account_guard_state": "ok", "account_guard_reason": None}
# The view's way of reading a campaign's latest days (it groups the campaign's whole history); the page reads
# the same rows through counters.latest_days.
DAYS_SQL = """
select day, timezone, minted, sent, failed, rolled_back, cancelled, dead_lettered, unique_users, duplicate, skipped,
       holdout
from mail.campaign_daily where campaign = %(campaign)s order by day desc limit %(days)s
"""
RECENT_SQL = """
select * from (
    (select send_log_id, user_id, email, status, rolled_back, dead_lettered, attempts, error,
            scheduled_at, minted_at, claimed_at, sent_at
     from mail.email_status
     where campaign = %(campaign)s and status = 'sent' order by sent_at desc limit %(limit)s)
    union all
    (select send_log_id, user_id, email, status, rolled_back, dead_lettered, attempts, error,
            scheduled_at, minted_at, claimed_at, sent_at
     from mail.email_status
     where campaign = %(campaign)s and status = 'sending' order by claimed_at desc limit %(limit)s)
    union all
    (select send_log_id, user_id, email, status, rolled_back, dead_lettered, attempts, error,
            scheduled_at, minted_at, claimed_at, sent_at
     from mail.email_status
     where campaign = %(campaign)s and status in ('failed', 'cancelled') order by minted_at desc limit %(limit)s)
) as r
order by coalesce(sent_at, claimed_at, minted_at) desc, send_log_id desc
limit %(limit)s
"""
ERRORS_SQL = """
select error, rolled_back, dead_lettered, count(*) as emails,
       max(coalesce(released_at, claimed_at, minted_at)) as last_at
from mail.email_status
where campaign = %(campaign)s and status = 'failed'
group by error, rolled_back, dead_lettered
order by last_at desc
limit %(limit)s
"""


LIVE_MINUTES = 120
HISTORY_DAYS = 30
PLAN_HOURLY_MAX_DAYS = 21
# The send charts over every campaign read mail.sent_email (0011): one range of
# send_log_campaign_sent_idx per campaign, index-only (the send log has no sent_at index of its own).
PER_MINUTE_SQL = """
select campaign, date_trunc('minute', sent_at) as t, count(*) as sent
from mail.sent_email
where sent_at >= %(since)s and (%(campaign)s::text is null or campaign = %(campaign)s)
group by 1, 2 order by 2
"""
PER_DAY_ALL_SQL = """
select campaign, (sent_at at time zone 'UTC')::date as t, count(*) as sent
from mail.sent_email
where sent_at >= %(since)s
group by 1, 2 order by 2
"""
PER_DAY_ONE_SQL = """
select campaign, (sent_at at time zone %(tz)s)::date as t, count(*) as sent
from mail.send_log
where campaign = %(campaign)s and status = 'sent'
group by 1, 2 order by 2
"""
PLAN_SQL = """
select t, sum(planned)::bigint as planned, sum(sent)::bigint as sent from (
    select date_trunc('hour', scheduled_at) as t, 1 as planned, 0 as sent
    from mail.send_log where campaign = %(campaign)s and kind = 'scheduled' and status not in ('cancelled', 'holdout')
    union all
    select date_trunc('hour', sent_at), 0, 1
    from mail.send_log where campaign = %(campaign)s and kind = 'scheduled' and status = 'sent'
) x group by t order by t
"""


def _epoch(value: Any) -> int:
    """Epoch seconds of a datetime (aware) or a date (its UTC midnight: the chart labels days)."""
    if isinstance(value, datetime):
        return int(value.timestamp())
    return int(datetime(value.year, value.month, value.day, tzinfo=UTC).timestamp())


def _grid(rows: list[tuple[str, Any, int]], steps: list[Any]) -> dict[str, Any]:
    """``{"t": [epoch s], "series": {campaign: [count per step]}}`` with zeros where nothing was sent."""
    index = {step: i for i, step in enumerate(steps)}
    series: dict[str, list[int]] = {}
    for campaign, t, n in rows:
        if t in index:
            series.setdefault(campaign, [0] * len(steps))[index[t]] += int(n)
    return {"t": [_epoch(x) for x in steps], "series": dict(sorted(series.items()))}


def load_series(conn: psycopg.Connection, name: str | None = None, *, now: datetime | None = None) -> dict[str, Any] | None:
    """The charts' data (shapes in the module docstring); None for an unknown campaign.

    ``sends``: ``{"unit": "minute" | "day", "t": [...], "series": {campaign: [...]}}``: per minute
    over the last 120 minutes while the campaign (the list: any campaign) is active, else per day
    (the list: the last 30 UTC days; one campaign: from its first to its last sending day, in its
    timezone). ``plan`` (scheduled campaigns only, else None): ``{"unit": "hour" | "day", "t": [...],
    "planned": [...], "sent": [...]}``, cumulative counts at the end of each step; planned counts
    every row not cancelled at its ``scheduled_at`` (a holdout row keeps its slot but sends nothing: not planned).
    """
    if now is None:
        now = conn.execute("select now()").fetchone()[0]  # type: ignore[index]
    assert now is not None
    progress = _progress(conn, name)
    if name and not progress:
        return None
    active = any(p["active"] for p in progress)
    out: dict[str, Any] = {"campaign": name, "plan": None}
    if active:
        start = (now - timedelta(minutes=LIVE_MINUTES - 1)).replace(second=0, microsecond=0)
        rows = conn.execute(PER_MINUTE_SQL, {"since": start, "campaign": name}).fetchall()
        steps = [start + timedelta(minutes=i) for i in range(LIVE_MINUTES)]
        out["sends"] = {"unit": "minute", **_grid([(c, t, n) for c, t, n in rows], steps)}
    else:
        if name:
            tz = progress[0].get("timezone") or "UTC"
            rows = conn.execute(PER_DAY_ONE_SQL, {"campaign": name, "tz": tz}).fetchall()
            first = rows[0][1] if rows else now.date()
            last = rows[-1][1] if rows else now.date()
        else:
            last = now.astimezone(UTC).date()
            first = last - timedelta(days=HISTORY_DAYS - 1)
            rows = conn.execute(PER_DAY_ALL_SQL, {"since": datetime(first.year, first.month, first.day, tzinfo=UTC)}).fetchall()
        steps = [first + timedelta(days=i) for i in range((last - first).days + 1)]
        out["sends"] = {"unit": "day", **_grid([(c, t, n) for c, t, n in rows], steps)}
    if name and progress[0].get("kind") == "scheduled":
        plan = conn.execute(PLAN_SQL, {"campaign": name}).fetchall()
        unit = "hour"
        if plan and plan[-1][0] - plan[0][0] > timedelta(days=PLAN_HOURLY_MAX_DAYS):
            unit = "day"
            by_day: dict[datetime, tuple[int, int]] = {}
            for t, planned, sent in plan:
                day = t.replace(hour=0)
                p0, s0 = by_day.get(day, (0, 0))
                by_day[day] = (p0 + planned, s0 + sent)
            plan = [(t, p, s) for t, (p, s) in sorted(by_day.items())]
        planned_c, sent_c, total_p, total_s = [], [], 0, 0
        for _, p, s in plan:
            total_p += int(p)
            total_s += int(s)
            planned_c.append(total_p)
            sent_c.append(total_s)
        out["plan"] = {"unit": unit, "t": [_epoch(t) for t, _, _ in plan], "planned": planned_c, "sent": sent_c}
    out["active"] = active
    return out


def mask_text(text: str | None) -> str | None:
    """Mask every address inside a free text (provider error messages quote them)."""
    return None if text is None else _EMAIL.sub(lambda m: mask_email(m.group(0)), text)


def plain_value(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    return value


def _rows(conn: psycopg.Connection, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # constant statements of this module; values bound
        return [{k: plain_value(v) for k, v in r.items()} for r in cur.fetchall()]


def _progress(conn: psycopg.Connection, name: str | None = None) -> list[dict[str, Any]]:
    """``mail.campaign_progress`` rows (its columns, by campaign): every campaign, or only ``name``."""
    if counters.seeded(conn):
        return [{k: plain_value(v) for k, v in r.items()} for r in counters.progress(conn, name)]
    return _rows(conn, ONE_SQL if name else LIST_SQL, {"campaign": name} if name else None)


def _outcomes(conn: psycopg.Connection, name: str | None = None) -> list[dict[str, Any]]:
    """``mail.campaign_outcomes`` rows (the columns of :data:`OUTCOMES_ALL_SQL` and ``campaign``)."""
    if counters.seeded(conn):
        keep = ("campaign", *NO_OUTCOMES)
        return [{k: plain_value(r[k]) for k in keep} for r in counters.outcomes(conn, name)]
    return _rows(conn, OUTCOMES_ONE_SQL if name else OUTCOMES_ALL_SQL, {"campaign": name} if name else None)


def _with_outcomes(conn: psycopg.Connection, progress: list[dict[str, Any]], name: str | None = None) -> None:
    """Add each campaign's outcome rates and guard state (``mail.campaign_outcomes``) to its progress row."""
    found = {o.pop("campaign"): o for o in _outcomes(conn, name)}
    account = next(iter(found.values()), None)
    if account is None:  # no sent email anywhere yet: the account guard's state still shows
        account = _rows(conn, ACCOUNT_GUARD_SQL)[0]
    for p in progress:
        p.update(found.get(p["campaign"], NO_OUTCOMES | {
            "account_guard_state": account["account_guard_state"],
            "account_guard_reason": account["account_guard_reason"]}))


ACCOUNT_GUARD_SQL = """
select case when count(*) > 0 then 'tripped' else 'ok' end as account_guard_state,
       string_agg(name || ': ' || reason, '; ' order by name) as account_guard_reason
from mail.reputation_guard where scope = 'account' and state = 'tripped'
"""


def _with_holds(conn: psycopg.Connection, progress: list[dict[str, Any]], name: str | None = None) -> None:
    """Add ``hold`` to each progress row: why a scheduled or paused campaign does not send as planned
    (:func:`mailflow.sources.scheduled.holds.campaign_holds` as a dict: ``kind``, ``reason``, ``since``
    and the canary's counts), or None."""
    held = campaign_holds(conn, name)
    for p in progress:
        hold = held.get(p["campaign"])
        p["hold"] = {k: plain_value(v) for k, v in hold.as_dict().items()} if hold else None
        if p["hold"]:  # a pause's reason may quote a provider's error, which can name an address
            p["hold"]["reason"] = mask_text(p["hold"]["reason"])


def load_list(conn: psycopg.Connection) -> dict[str, Any]:
    """Every campaign's progress (``mail.campaign_progress``) with its outcome rates and guard state
    (``mail.campaign_outcomes``) and why it is held (``hold``, or None), and whether any is active."""
    campaigns = _progress(conn)
    _with_outcomes(conn, campaigns)
    _with_holds(conn, campaigns)
    return {"campaigns": campaigns, "active": any(c["active"] for c in campaigns)}


def load_campaign(conn: psycopg.Connection, name: str, *, show: bool, days: bool = True) -> dict[str, Any] | None:
    """One campaign: ``progress`` (with ``hold``: why it is held, or None), ``days`` (latest first, up to 14), ``recent`` emails (latest
    20 sent / in flight / failed / cancelled) and ``errors`` (by message); None if unknown."""
    found = _progress(conn, name)
    if not found:
        return None
    _with_outcomes(conn, found, name)
    _with_holds(conn, found, name)
    params = {"campaign": name, "limit": RECENT_LIMIT, "days": DAYS}
    recent = _rows(conn, RECENT_SQL, params)
    errors = _rows(conn, ERRORS_SQL, params)
    for r in recent:
        if not show:
            r["email"] = mask_email(r["email"])
            r["error"] = mask_text(r["error"])
    if not show:
        for e in errors:
            e["error"] = mask_text(e["error"])
    out = {"progress": found[0], "recent": recent, "errors": errors, "active": bool(found[0]["active"])}
    if days:
        # mail.campaign_daily's latest rows without grouping the campaign's whole history (same numbers)
        out["days"] = _rows(conn, query("counters", "latest_days"), params)
    return out
