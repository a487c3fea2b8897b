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
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, cast

import anyio
import psycopg
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse

from mailflow import settings
from mailflow.orchestration.ui.progress_queries import load_campaign, load_list, load_series, plain_value

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
_ASSETS = {"progress.js": "text/javascript", "progress.css": "text/css",
           "uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}

STREAM_SECONDS = 300.0  # a stream ends after this; the browser reconnects (and re-authenticates)


Connect = Callable[[], AbstractContextManager[psycopg.Connection]]


def show_addresses_setting() -> bool:
    """``MAILFLOW_UI_SHOW_ADDRESSES`` (default false): full addresses for users who may read the
    ``send_log_db`` connection."""
    return os.environ.get("MAILFLOW_UI_SHOW_ADDRESSES", "").strip().lower() in ("1", "true", "yes", "on")


def refresh_seconds() -> float:
    """Seconds between two updates of a live page (``MAILFLOW_UI_REFRESH_SECONDS``, default 2)."""
    return max(0.5, float(os.environ.get("MAILFLOW_UI_REFRESH_SECONDS", "2")))


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


def _sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, default=plain_value)}\n\n"


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
