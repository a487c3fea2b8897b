"""The live campaign progress page: a FastAPI app that the ``mailflow_progress`` Airflow plugin
(``plugins/mailflow_progress.py``) mounts in the Airflow API server at ``/mailflow``, linked from
the Airflow UI navigation (Browse -> Mail campaigns).

Routes, relative to the mount; every one is behind Airflow's own authentication (the JWT of the
Airflow UI session cookie or an ``Authorization: Bearer`` token; 401 without one, 403 for an invalid
one) and Airflow's "website" view permission:

====================================  ====================================================================
``GET /``                             the page: every campaign with counts by state, send rate and ETA
``GET /campaigns/{name}``             one campaign: progress, days, recent emails and errors
``GET /static/{file}``                the page's script and stylesheet
``GET /api/campaigns``                JSON: every campaign (``mail.campaign_progress``)
``GET /api/campaigns/{name}``         JSON: one campaign (progress, ``days``, ``recent``, ``errors``)
``GET /api/stream``                   server-sent events: ``progress`` (the list) every
                                      ``MAILFLOW_UI_REFRESH_SECONDS`` while any campaign is active, then
                                      ``done`` and the stream ends
``GET /api/campaigns/{name}/stream``  the same for one campaign
``GET /api/series``                   JSON for the charts: every campaign's sends over time (per minute,
                                      last 2 h, while any is active; else per day, last 30 days, UTC)
``GET /api/campaigns/{name}/series``  the same for one campaign (per day in its timezone, its whole
                                      history) and, for a scheduled campaign, planned vs sent as
                                      cumulative counts per hour (per day beyond 21 days)
====================================  ====================================================================

The charts are drawn with uPlot (MIT, vendored from its npm package into ``static/``, see
``static/VENDORED.md``); nothing is loaded from a CDN.

Read-only: the data comes from the send log through the views of migration 0004, read per request
over a new connection of the ``send_log_db`` Airflow connection in a read-only session with a
statement timeout; nothing is read from the Airflow metadata database. The page refreshes over
server-sent events and falls back to polling the JSON routes if the stream fails; both stop once
nothing is active.

Addresses are masked (``j***@example.com``, also inside error messages) unless
``MAILFLOW_UI_SHOW_ADDRESSES=true`` **and** the user may read the ``send_log_db`` connection (whoever
can read it can read the send log anyway). Row context, batch bodies, keys and connection details
are never returned.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any, cast

import anyio
import psycopg
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse
from psycopg.rows import dict_row

from mailflow import settings
from mailflow.store.send_log import mask_email

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
_ASSETS = {"progress.js": "text/javascript", "progress.css": "text/css",
           "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
_EMAIL = re.compile(r"[^\s<>\"'`(),;:\[\]]+@[^\s<>\"'`(),;:\[\]]+")
STREAM_SECONDS = 300.0  # a stream ends after this; the browser reconnects (and re-authenticates)
RECENT_LIMIT = 20
DAYS = 14

Connect = Callable[[], AbstractContextManager[psycopg.Connection]]

LIST_SQL = "select * from mail.campaign_progress order by campaign"
ONE_SQL = "select * from mail.campaign_progress where campaign = %(campaign)s"
DAYS_SQL = """
select day, timezone, minted, sent, failed, rolled_back, cancelled, dead_lettered, unique_users
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
PER_MINUTE_SQL = """
select campaign, date_trunc('minute', sent_at) as t, count(*) as sent
from mail.send_log
where status = 'sent' and sent_at >= %(since)s and (%(campaign)s::text is null or campaign = %(campaign)s)
group by 1, 2 order by 2
"""
PER_DAY_ALL_SQL = """
select campaign, (sent_at at time zone 'UTC')::date as t, count(*) as sent
from mail.send_log
where status = 'sent' and sent_at >= %(since)s
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
    from mail.send_log where campaign = %(campaign)s and kind = 'scheduled' and status <> 'cancelled'
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
    every row not cancelled at its ``scheduled_at``.
    """
    if now is None:
        now = conn.execute("select now()").fetchone()[0]  # type: ignore[index]
    assert now is not None
    progress = _rows(conn, ONE_SQL if name else LIST_SQL, {"campaign": name} if name else None)
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


def show_addresses_setting() -> bool:
    """``MAILFLOW_UI_SHOW_ADDRESSES`` (default false): full addresses for users who may read the
    ``send_log_db`` connection."""
    return os.environ.get("MAILFLOW_UI_SHOW_ADDRESSES", "").strip().lower() in ("1", "true", "yes", "on")


def refresh_seconds() -> float:
    """Seconds between two updates of a live page (``MAILFLOW_UI_REFRESH_SECONDS``, default 2)."""
    return max(0.5, float(os.environ.get("MAILFLOW_UI_REFRESH_SECONDS", "2")))


def mask_text(text: str | None) -> str | None:
    """Mask every address inside a free text (provider error messages quote them)."""
    return None if text is None else _EMAIL.sub(lambda m: mask_email(m.group(0)), text)


@contextmanager
def send_log_readonly() -> Iterator[psycopg.Connection]:
    """A new connection of the ``send_log_db`` Airflow connection in a read-only session (every
    statement its own read-only transaction, 10 s statement timeout, no JIT); closed at the end."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    conn = cast(psycopg.Connection, PostgresHook(postgres_conn_id=settings.SEND_LOG_CONN_ID).get_conn())
    try:
        conn.autocommit = True
        conn.execute("set default_transaction_read_only = on")
        conn.execute("set statement_timeout = '10s'")
        conn.execute("set jit = off")  # short queries: compiling them costs more than it saves
        conn.execute("set application_name = 'mailflow progress page'")
        yield conn
    finally:
        conn.close()


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    return value


def _rows(conn: psycopg.Connection, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # constant statements of this module; values bound
        return [{k: _plain(v) for k, v in r.items()} for r in cur.fetchall()]


def load_list(conn: psycopg.Connection) -> dict[str, Any]:
    """Every campaign's progress (``mail.campaign_progress``) and whether any is active."""
    campaigns = _rows(conn, LIST_SQL)
    return {"campaigns": campaigns, "active": any(c["active"] for c in campaigns)}


def load_campaign(conn: psycopg.Connection, name: str, *, show: bool, days: bool = True) -> dict[str, Any] | None:
    """One campaign: ``progress``, ``days`` (latest first, up to 14), ``recent`` emails (latest
    20 sent / in flight / failed / cancelled) and ``errors`` (by message); None if unknown."""
    found = _rows(conn, ONE_SQL, {"campaign": name})
    if not found:
        return None
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
        out["days"] = _rows(conn, DAYS_SQL, params)
    return out


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, default=_plain)}\n\n"


def create_app(connect: Connect = send_log_readonly, *, auth: bool = True) -> FastAPI:
    """Build the app. ``connect`` opens a read-only send-log connection (tests inject their own);
    ``auth=False`` drops Airflow's authentication (only for tests of the data layer).
    """
    dependencies: list[Any] = []
    if auth:
        from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
        from airflow.api_fastapi.core_api.security import get_user, requires_access_view

        # (annotations are strings here: the dependency goes in the default, not in Annotated)
        async def remember_user(request: Request, user: Any = Depends(get_user)) -> None:  # noqa: B008
            request.state.mailflow_user = user  # for may_show (get_user runs once per request)

        dependencies += [Depends(requires_access_view(AccessView.WEBSITE)), Depends(remember_user)]
    app = FastAPI(title="mailflow campaign progress", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=dependencies)

    def may_show(request: Request) -> bool:
        if not show_addresses_setting():
            return False
        if not auth:
            return True
        from airflow.api_fastapi.app import get_auth_manager
        from airflow.api_fastapi.auth.managers.models.resource_details import ConnectionDetails

        user = getattr(request.state, "mailflow_user", None)
        if user is None:
            return False
        return bool(get_auth_manager().is_authorized_connection(
            method="GET", details=ConnectionDetails(conn_id=settings.SEND_LOG_CONN_ID), user=user))

    def read(fn: Callable[[psycopg.Connection], Any]) -> Any:
        try:
            with connect() as conn:
                return fn(conn)
        except Exception as exc:  # the connection is missing, the server is down, a view is missing, ...
            log.warning("send log unavailable: %s", exc)  # details in the server log, not to the browser
            raise HTTPException(status_code=503, detail="send log database unavailable") from None

    def page(request: Request, campaign: str | None) -> HTMLResponse:
        text = (STATIC / "index.html").read_text(encoding="utf-8")
        root = request.scope.get("root_path", "").rstrip("/")
        text = text.replace("{{ROOT}}", html.escape(root, quote=True))
        text = text.replace("{{CAMPAIGN}}", html.escape(campaign or "", quote=True))
        text = text.replace("{{REFRESH_MS}}", str(int(refresh_seconds() * 1000)))
        return HTMLResponse(text, headers={"Cache-Control": "no-store"})

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        return page(request, None)

    @app.get("/campaigns/{name}", response_class=HTMLResponse)
    def campaign_page(request: Request, name: str) -> HTMLResponse:
        return page(request, name)

    @app.get("/static/{file}")
    def static(file: str) -> FileResponse:
        if file not in _ASSETS:
            raise HTTPException(status_code=404, detail="not found")
        return FileResponse(STATIC / file, media_type=_ASSETS[file], headers={"Cache-Control": "no-cache"})

    @app.get("/api/campaigns")
    def campaigns(request: Request) -> dict[str, Any]:
        return read(load_list) | {"generated_at": datetime.now().astimezone().isoformat()}

    @app.get("/api/campaigns/{name}")
    def campaign(request: Request, name: str, days: bool = True) -> dict[str, Any]:
        show = may_show(request)
        found = read(lambda conn: load_campaign(conn, name, show=show, days=days))
        if found is None:
            raise HTTPException(status_code=404, detail=f"no campaign {name!r} in the send log")
        return dict(found) | {"show_addresses": show, "generated_at": datetime.now().astimezone().isoformat()}

    @app.get("/api/series")
    def series(request: Request) -> dict[str, Any]:
        return dict(read(load_series))

    @app.get("/api/campaigns/{name}/series")
    def campaign_series(request: Request, name: str) -> dict[str, Any]:
        found = read(lambda conn: load_series(conn, name))
        if found is None:
            raise HTTPException(status_code=404, detail=f"no campaign {name!r} in the send log")
        return dict(found)

    async def stream(request: Request, load: Callable[[psycopg.Connection], dict[str, Any] | None]) -> AsyncIterator[str]:
        deadline = time.monotonic() + STREAM_SECONDS
        yield "retry: 3000\n\n"
        while True:
            started = time.monotonic()
            try:
                payload = await anyio.to_thread.run_sync(lambda: _with(connect, load))
            except Exception as exc:
                log.warning("send log unavailable: %s", exc)
                yield _sse("failure", {"detail": "send log database unavailable"})
                payload = {"active": True}
            else:
                if payload is None:
                    yield _sse("failure", {"detail": "no such campaign"})
                    return
                payload["generated_at"] = datetime.now().astimezone().isoformat()
                yield _sse("progress", payload)
            if not payload.get("active"):
                yield _sse("done", {})
                return
            if time.monotonic() >= deadline:
                return
            # a big send log makes the queries slow: then refresh less often than that takes, twice over
            await anyio.sleep(max(refresh_seconds(), 2 * (time.monotonic() - started)))
            if await request.is_disconnected():
                return

    sse_headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}

    @app.get("/api/stream")
    async def list_stream(request: Request) -> StreamingResponse:
        return StreamingResponse(stream(request, load_list), media_type="text/event-stream", headers=sse_headers)

    @app.get("/api/campaigns/{name}/stream")
    async def campaign_stream(request: Request, name: str) -> StreamingResponse:
        show = may_show(request)
        return StreamingResponse(stream(request, lambda conn: load_campaign(conn, name, show=show)),
                                 media_type="text/event-stream", headers=sse_headers)

    return app


def _with(connect: Connect, load: Callable[[psycopg.Connection], Any]) -> Any:
    with connect() as conn:
        return load(conn)
