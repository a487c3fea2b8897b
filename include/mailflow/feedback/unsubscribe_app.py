"""The one-click unsubscribe endpoint: a small ASGI (Starlette) app the product team deploys behind
their domain (``MAILFLOW_PUBLIC_URL``), standalone or mounted in the Airflow API server.

Every marketing email links to ``<public_url>/u/<token>`` (footer and ``List-Unsubscribe``); the
token (:mod:`mailflow.feedback.unsubscribe_tokens`) names the user and the list. Behaviour (RFC 8058, and the
Gmail/Yahoo bulk-sender rules):

* ``POST /u/<token>`` with the body ``List-Unsubscribe=One-Click`` (form-urlencoded or
  multipart, as mail providers send it; no cookies needed): the user is suppressed for the token's
  list (a campaign name, or ``all`` marketing) with source ``one_click`` and the answer is **200**
  with a short page, never a redirect. Repeating it changes nothing and answers 200 again
  (``ON CONFLICT DO NOTHING``).
* ``GET /u/<token>`` (a person clicked the link, or a link scanner fetched it): a confirmation
  page with a button; **nothing changes** and the database is not touched. ``HEAD`` likewise.
  The button POSTs ``confirm=yes`` (source ``confirm_page``); the person may widen the scope to
  all marketing email.
* A tampered, truncated, foreign or expired token: a friendly page with **400** (never a 500).
  A POST whose body has neither field: 400 with the confirmation form, nothing changed.
* The database or the signing secret unavailable: a friendly page with **503** and
  ``Retry-After`` (the mail provider retries a one-click POST), never a 500 with a traceback.

"Stop all marketing" (the list ``all``) also suppresses every mailbox the user was mailed at (their
stored keys in ``mail.send_log``), so another user id at the same mailbox gets no more marketing
either. The endpoint's database role needs ``INSERT, SELECT (id)`` on ``mail.suppression`` and
``SELECT (user_id, email, email_key)`` on ``mail.send_log``, nothing else.

Suppressions land in ``mail.suppression`` (user_id, scope, source, created_at); the next audience
selection (``store/sql/queries/lifecycle.sql``) and the scheduled dispatcher (which cancels a due row of
a suppressed user) honour them. Pages are plain HTML built from escaped strings, with
``Cache-Control: no-store``, ``X-Robots-Tag: noindex``, ``Referrer-Policy: no-referrer`` and a CSP
that forbids framing (a hidden confirm button cannot be clickjacked). Tokens are never logged.

Run it: ``mailflow unsubscribe serve --port 8090 --dsn postgresql://...`` (secret from
``MAILFLOW_UNSUBSCRIBE_SECRET`` or ``AIRFLOW_CONN_MAIL_UNSUBSCRIBE``); in Airflow, the plugin
``plugins/mailflow_unsubscribe.py`` mounts :func:`create_airflow_app` at ``/mailflow-unsubscribe``.
Standalone, it times out half-sent requests and caps its connections
(:mod:`mailflow.feedback.unsubscribe_server`); docs/unsubscribe.md says what a reverse proxy adds.
"""

from __future__ import annotations

import html
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import click
import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mailflow import settings
from mailflow.feedback.unsubscribe_pages import confirm_form, render_page, scope_label
from mailflow.feedback.unsubscribe_server import FD_RESERVE, ServerLimits, dsn_option, serve
from mailflow.feedback.unsubscribe_tokens import (
    ALL_MARKETING,
    ExpiredToken,
    InvalidToken,
    UnsubscribeSigner,
    signer_from_connection,
)
from mailflow.store.sql import query

log = logging.getLogger(__name__)

SignerSource = UnsubscribeSigner | Callable[[], UnsubscribeSigner]
"""A signer, or a factory called on first use (and again after a failure) for lazy secrets."""
Connect = Callable[[], psycopg.Connection]
"""Returns a new psycopg 3 connection to the send-log database (closed after each request)."""

SECRET_ENV = "MAILFLOW_UNSUBSCRIBE_SECRET"
DSN_ENV = "MAILFLOW_UNSUBSCRIBE_DSN"
MAX_BODY_BYTES = 16 * 1024  # a one-click body is 26 bytes; anything this large is not a mail client
RETRY_AFTER_SECONDS = 120


class Unavailable(RuntimeError):
    """The endpoint cannot serve yet: no signing secret or no database configured (the message
    names what to set and never contains a secret)."""


def record_unsubscribe(conn: psycopg.Connection, user_id: int, scope: str, source: str,
                       reason: str | None = None) -> bool:
    """Suppress ``user_id`` for ``scope`` (a campaign name or ``all``) in ``mail.suppression``.

    "Stop all marketing" (``scope == 'all'``) acts on the mailbox as well as the user: every mailbox
    the user was mailed at (the stored keys of their send-log rows) is suppressed for all mail in the
    same transaction, so another user id at that mailbox gets nothing more either
    (docs/model.md, "The mailbox key"). One list (a campaign name) stays per user.

    Idempotent (``ON CONFLICT DO NOTHING``): returns True if the user's suppression is new, False if
    it existed (the mailboxes are suppressed either way). Runs in the caller's connection and
    commits on its own transaction block.

    :param source: ``one_click``, ``confirm_page`` or e.g. ``mailto`` (a processed unsubscribe email).
    :raises psycopg.Error: on any database failure.
    """
    with conn.transaction():
        row = conn.execute(query("suppression", "suppress_user"),
                           {"user_id": int(user_id), "scope": scope, "source": source, "reason": reason}).fetchone()
        if scope == ALL_MARKETING:
            boxes = conn.execute(query("suppression", "mailboxes_of_user"), {"user_id": int(user_id)}).fetchall()
            if boxes:
                conn.execute(query("suppression", "suppress_mailboxes"), {
                    "keys": [str(b[0]) for b in boxes], "emails": [str(b[1]) for b in boxes], "scope": ALL_MARKETING,
                    "source": source, "reason": f"all marketing stopped by user {int(user_id)}"})
    return row is not None


class _Lazy:
    """Resolve a signer once (thread-safe); a failed resolution is retried on the next request."""

    def __init__(self, source: SignerSource):
        self._source = source
        self._value = source if isinstance(source, UnsubscribeSigner) else None
        self._lock = threading.Lock()

    def peek(self) -> UnsubscribeSigner | None:
        """The signer if already resolved (no I/O), else None."""
        return self._value

    def get(self) -> UnsubscribeSigner:
        if self._value is not None:
            return self._value
        with self._lock:
            if self._value is None:
                assert not isinstance(self._source, UnsubscribeSigner)
                try:
                    self._value = self._source()
                except Unavailable:
                    raise
                except Exception as exc:  # never let the cause's text (could hold a secret) out
                    raise Unavailable(f"the unsubscribe signing secret could not be loaded "
                                      f"({type(exc).__name__})") from None
            return self._value


def _form_fields(body: bytes) -> list[tuple[str, str]]:
    """Fields of a urlencoded body (also when the content type is missing or wrong: some clients
    send ``text/plain``). Multipart is handled by the caller."""
    return parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True)


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None if it is larger than ``limit`` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


async def _multipart_fields(request: Request, body: bytes) -> list[tuple[str, str]]:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(request.scope, replay).form(max_files=0, max_fields=32)
    return [(k, v) for k, v in form.multi_items() if isinstance(v, str)]


def create_app(signer: SignerSource, connect: Connect, *, brand: str = "Aptitude Practice",
               max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """Build the unsubscribe ASGI app (routes ``/u/{token}`` GET/HEAD/POST and ``/healthz``).

    :param signer: verifies tokens; a factory is resolved on first use, so a missing secret makes
        the endpoint answer 503 instead of failing at start-up.
    :param connect: new psycopg 3 connection per unsubscribe (called in a worker thread; the
        blocking database work never runs on the event loop).
    :param brand: the sender's name shown on the pages.
    :param max_body_bytes: a larger POST body is refused with 413 (nothing changed).
    """
    lazy = _Lazy(signer)

    def page(title: str, body: str, status: int, request: Request, **kw: Any) -> Response:
        return render_page(title, body, status, brand=brand, head_only=request.method == "HEAD", **kw)

    def unavailable(request: Request) -> Response:
        return page("Please try again in a few minutes",
                    "<p>We could not process your request just now. Nothing went wrong on your side; "
                    "please try the link again in a few minutes.</p>", 503, request,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def bad_token(request: Request, expired: bool) -> Response:
        if expired:
            text = ("<p>This unsubscribe link has expired. Please use the link in a more recent email "
                    "from us, or reply to any of our emails and we will unsubscribe you.</p>")
        else:
            text = ("<p>This unsubscribe link is not valid. It may have been cut short or changed by "
                    "your email program. Please open the link in the email again (copy the whole "
                    "link), or reply to the email and we will unsubscribe you.</p>")
        return page("This link does not work", text, 400, request)

    def suppress(user_id: int, scope: str, source: str) -> bool:
        reason = "RFC 8058 one-click POST" if source == "one_click" else "confirmed on the unsubscribe page"
        with connect() as conn:
            return record_unsubscribe(conn, user_id, scope, source, reason)

    async def unsubscribe(request: Request) -> Response:
        try:
            ready = lazy.peek()
            current = ready if ready is not None else await run_in_threadpool(lazy.get)  # may do I/O
        except Unavailable as exc:
            log.error("unsubscribe endpoint unavailable: %s", exc)
            return unavailable(request)
        try:
            user_id, scope = current.verify(request.path_params["token"].strip("/"))
        except ExpiredToken:
            return bad_token(request, expired=True)
        except InvalidToken:
            return bad_token(request, expired=False)
        if request.method in ("GET", "HEAD"):
            # a person or a link scanner: show the question, change nothing
            return page("Unsubscribe?", f"<p>Do you want to stop receiving {html.escape(scope_label(scope))}?</p>"
                        + confirm_form(scope), 200, request)
        try:
            body = await _read_body(request, max_body_bytes)
        except ClientDisconnect:  # gone before its body arrived (e.g. the server's body timeout): nothing to do
            return Response(status_code=400)
        if body is None:
            return page("Request too large", "<p>Nothing was changed.</p>", 413, request)
        content_type = request.headers.get("content-type", "")
        try:
            if content_type.lower().startswith("multipart/form-data"):
                fields = await _multipart_fields(request, body)
            else:
                fields = _form_fields(body)
        except (MultiPartException, HTTPException, ValueError):
            fields = []
        one_click = any(k.strip().lower() == "list-unsubscribe" and v.strip().lower() == "one-click"
                        for k, v in fields)
        confirmed = any(k == "confirm" for k, _ in fields)
        if not one_click and not confirmed:
            return page("Unsubscribe?", "<p>Nothing was changed yet. Do you want to stop receiving "
                        f"{html.escape(scope_label(scope))}?</p>" + confirm_form(scope), 400, request)
        source = "one_click" if one_click else "confirm_page"
        if confirmed and not one_click and any(k == "scope" and v == ALL_MARKETING for k, v in fields):
            scope = ALL_MARKETING  # the person widened it on the confirmation page
        try:
            new = await run_in_threadpool(suppress, user_id, scope, source)
        except (psycopg.Error, OSError, Unavailable) as exc:
            log.error("unsubscribe of user %s (%s) not recorded: %s", user_id, scope, type(exc).__name__)
            return unavailable(request)
        log.info("unsubscribe: user %s from %s via %s (%s)", user_id, scope, source, "new" if new else "repeat")
        return page("You are unsubscribed",
                    f"<p>You will no longer receive {html.escape(scope_label(scope))}. "
                    "It can take up to two days for emails already on their way to stop.</p>", 200, request)

    async def healthz(request: Request) -> Response:
        try:
            await run_in_threadpool(lazy.get)
        except Unavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        if status == 405:
            return page("Not allowed", "<p>Please open the link from the email.</p>", 405, request,
                        headers={"Allow": "GET, HEAD, POST"})
        return page("Page not found", "<p>Please open the unsubscribe link from the email again.</p>",
                    404 if status == 404 else status, request)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("unsubscribe endpoint error: %s", type(exc).__name__)  # no traceback with the token
        return unavailable(request)

    routes = [
        Route("/u/{token:path}", unsubscribe, methods=["GET", "HEAD", "POST"]),
        # the path links carry (settings.unsubscribe_base_url), as in the Airflow plugin
        Route(f"{settings.UNSUBSCRIBE_PATH}/u/{{token:path}}", unsubscribe, methods=["GET", "HEAD", "POST"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def _conn_env_name(conn_id: str) -> str:
    return f"AIRFLOW_CONN_{conn_id.upper()}"


def _parse_airflow_conn(value: str) -> tuple[str | None, dict[str, Any]]:
    """``(password, extra)`` of an ``AIRFLOW_CONN_*`` value (JSON, or a URI with query extras)."""
    value = value.strip()
    if value.startswith("{"):
        c = json.loads(value)
        extra = c.get("extra") or {}
        if isinstance(extra, str):
            extra = json.loads(extra) if extra.strip() else {}
        return c.get("password"), dict(extra)
    parts = urlsplit(value)
    query_extra: dict[str, Any] = dict(parse_qsl(parts.query))
    if "__extra__" in query_extra:
        query_extra = json.loads(query_extra["__extra__"])
    return (unquote(parts.password) if parts.password else None), query_extra


def signer_from_env(environ: Mapping[str, str] | None = None) -> UnsubscribeSigner:
    """The signer from the environment: ``MAILFLOW_UNSUBSCRIBE_SECRET`` (with optional
    ``MAILFLOW_UNSUBSCRIBE_KID``, ``MAILFLOW_UNSUBSCRIBE_OLD_KEYS`` = JSON ``{kid: secret}``,
    ``MAILFLOW_UNSUBSCRIBE_MAX_AGE_DAYS``), else the ``AIRFLOW_CONN_MAIL_UNSUBSCRIBE`` connection
    (JSON or URI; password = secret, extra ``kid``/``old_keys``/``max_age_days``).

    :raises Unavailable: if neither is set or the value is unusable (never echoing a secret).
    """
    env = os.environ if environ is None else environ
    try:
        if env.get(SECRET_ENV):
            extra = {"kid": env.get("MAILFLOW_UNSUBSCRIBE_KID") or "k1",
                     "old_keys": json.loads(env.get("MAILFLOW_UNSUBSCRIBE_OLD_KEYS") or "{}"),
                     "max_age_days": env.get("MAILFLOW_UNSUBSCRIBE_MAX_AGE_DAYS")}
            return signer_from_connection(env[SECRET_ENV], extra)
        name = _conn_env_name(settings.UNSUBSCRIBE_CONN_ID)
        if env.get(name):
            return signer_from_connection(*_parse_airflow_conn(env[name]))
    except (ValueError, TypeError) as exc:  # json errors are ValueErrors; messages hold no secret
        msg = str(exc) if isinstance(exc, ValueError) and not isinstance(exc, json.JSONDecodeError) else "unparsable"
        raise Unavailable(f"unsubscribe signing secret misconfigured: {msg}") from None
    raise Unavailable(f"no unsubscribe signing secret: set {SECRET_ENV} or {_conn_env_name(settings.UNSUBSCRIBE_CONN_ID)}")


def connect_factory(dsn: str, *, connect_timeout: int = 5, statement_timeout_ms: int = 5000) -> Connect:
    """A :data:`Connect` for ``dsn`` with short connect and statement timeouts (seconds, ms), so a
    sick database gives a quick 503 instead of hanging mail providers."""
    def connect() -> psycopg.Connection:
        return psycopg.connect(dsn, connect_timeout=connect_timeout,
                               options=f"-c statement_timeout={int(statement_timeout_ms)}")
    return connect



_LIMITS = ServerLimits()


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8090, show_default=True)
@click.option("--dsn", callback=dsn_option(DSN_ENV), metavar="DSN",
              help=f"send-log database (default: {DSN_ENV} or MAILFLOW_DSN)")
@click.option("--brand", default="Aptitude Practice", show_default=True)
@click.option("--header-timeout", type=float, default=_LIMITS.header_timeout, show_default=True, metavar="SECONDS",
              help="a request's line and headers must arrive within this (else 408)")
@click.option("--body-timeout", type=float, default=_LIMITS.body_timeout, show_default=True, metavar="SECONDS",
              help="its body must arrive within this after the headers")
@click.option("--keep-alive", type=int, default=_LIMITS.keep_alive, show_default=True, metavar="SECONDS",
              help="an idle kept-alive connection is closed after this")
@click.option("--max-header-bytes", type=int, default=_LIMITS.max_header_bytes, show_default=True, metavar="BYTES",
              help="larger request headers get 431")
@click.option("--max-connections", type=int, default=None, metavar="N",
              help="open client connections at most (default 1000; never more than the soft "
                   f"file-descriptor limit minus {FD_RESERVE})")
def serve_command(host: str, port: int, dsn: str, brand: str, header_timeout: float, body_timeout: float,
                  keep_alive: int, max_header_bytes: int, max_connections: int | None) -> int:
    """Serve the unsubscribe endpoint with uvicorn (``mailflow unsubscribe serve``) until SIGINT/SIGTERM.

    The DSN comes from ``--dsn``, ``mailflow --dsn``, ``MAILFLOW_UNSUBSCRIBE_DSN`` or ``MAILFLOW_DSN``;
    the secret from the environment (:func:`signer_from_env`). Exits with 2 if either is missing.
    The access log is off (paths carry tokens); the app logs user ids and lists only. Slow or idle
    clients cannot hold it down: header and body read timeouts, a header size bound and a
    connection cap below the file-descriptor limit (:mod:`mailflow.feedback.unsubscribe_server`).
    """
    try:
        signer = signer_from_env()
    except Unavailable as exc:
        raise click.UsageError(str(exc)) from None
    limits = ServerLimits(header_timeout=header_timeout, body_timeout=body_timeout, keep_alive=keep_alive,
                          max_header_bytes=max_header_bytes, max_connections=max_connections)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(signer, connect_factory(dsn), brand=brand)
    log.info("unsubscribe endpoint on http://%s:%s/u/<token> (key ids %s)", host, port, sorted(signer.keys))
    serve(app, host=host, port=port, limits=limits)
    return 0


if __name__ == "__main__":
    # deprecated alias, kept for one release
    print("warning: `python -m mailflow.feedback.unsubscribe_app` is deprecated and goes away in the next minor "
          "release; run `mailflow unsubscribe serve` (same options)", file=sys.stderr, flush=True)
    serve_command.main(prog_name="mailflow unsubscribe serve")
