"""The webhook receiver: the provider's signed outcome events (Resend, Svix scheme) into the send log.

``POST /resend`` (a Starlette app, standalone or mounted in the Airflow API server at
``/mailflow-webhooks``, so the provider's endpoint is ``https://<host>/mailflow-webhooks/resend``):

1. **Bounded**: a body over ``max_body_bytes`` (256 KiB) is refused with 413 before more is read; a body
   not complete within ``body_timeout`` seconds gets 408; more than ``max_in_flight`` requests at once,
   or more than the writer's ``max_waiting`` events queued, get 503 with ``Retry-After``.
2. **Verified** (:mod:`mailflow.feedback.webhook_verify`, the ``standardwebhooks`` library): missing or
   malformed headers 400, a stale or future timestamp (more than 5 minutes off) or no signature by any
   configured secret 401. Never a 500: an unexpected error answers 503 (the provider retries).
3. **Durable before acknowledged**: the event joins the next group of the group-commit writer
   (:mod:`mailflow.feedback.webhook_writer`): one transaction inserts every waiting event into
   ``mail.webhook_event`` (``ON CONFLICT (svix_id) DO NOTHING``) and applies those whose email is known
   (:mod:`mailflow.store.outcomes`: a hard bounce or complaint is suppressed in that same transaction).
   Only after the COMMIT does the handler answer **200**. A duplicate svix-id answers 200 and changes
   nothing. The database down: **503** with ``Retry-After`` (nothing acknowledged; the provider
   retries for about a day). Unknown event types are stored, decided ``ignored``, answered 200.
4. **Pending**: an event whose email id is not in the send log yet is stored and answered 200; the
   writer's sweep applies it once the id is there (every few seconds), the ``deliverability_feedback``
   DAG too (:func:`apply_pending`); after 72 h it is decided ``unknown_email`` and alerted. An event of
   a campaign's test email (matched by its provider id or our ``mailflow_test`` tag,
   :mod:`mailflow.store.test_emails`) is never pending: it is recorded on the test email at once.

Secrets: one or more ``whsec_...`` (rotation: a request is genuine if any verifies), from the Airflow
connection ``mail_webhook`` (password) in the API server, from ``MAILFLOW_WEBHOOK_SECRETS`` standalone.
Nothing logs a secret, a body or an unmasked address.

Standalone: ``mailflow webhooks serve --port 8091 --dsn postgresql://...`` (uvicorn with the
unsubscribe server's header/body timeouts and connection cap, :mod:`mailflow.feedback.unsubscribe_server`).
Setup against Resend: docs/feedback.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import click
import psycopg
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mailflow import settings
from mailflow.feedback.unsubscribe_server import FD_RESERVE, ServerLimits, dsn_option, serve
from mailflow.feedback.webhook_ingest import (
    GIVE_UP_AFTER,
    ApplySummary,
    MalformedEvent,
    WebhookEvent,
    alert_lines,
    apply_pending,
    guard_reputation,
    ingest,
    mark_alerted,
    parse_event,
)
from mailflow.feedback.webhook_verify import NoSecrets, Rejected, WebhookVerifier, parse_secrets, sign
from mailflow.feedback.webhook_writer import DUPLICATE_DELIVERY, Connect, GroupWriter, Overloaded, Unavailable

__all__ = [
    "ApplySummary", "GroupWriter", "MalformedEvent", "NoSecrets", "Rejected", "Unavailable", "WebhookEvent",
    "WebhookVerifier", "alert_lines", "apply_pending", "connect_factory", "create_app", "guard_reputation",
    "ingest", "mark_alerted", "parse_event", "parse_secrets", "secrets_from_env", "sign",
]

log = logging.getLogger(__name__)

SECRETS_ENV = "MAILFLOW_WEBHOOK_SECRETS"
DSN_ENV = "MAILFLOW_WEBHOOK_DSN"
MAX_BODY_BYTES = 256 * 1024
"""Resend's event envelopes are a few KiB; anything this large is not one."""
BODY_TIMEOUT_SECONDS = 10.0
MAX_IN_FLIGHT = 4000
RETRY_AFTER_SECONDS = 30
SECRETS_REFRESH_SECONDS = 300.0
"""A secrets factory (the Airflow connection) is asked again this often, so a rotation is picked up."""

SecretsSource = list[str] | Callable[[], list[str]]
"""The signing secrets, or a factory called on first use and every :data:`SECRETS_REFRESH_SECONDS`."""


class _Verifiers:
    """The verifier, built from a secrets source on first use and refreshed; a failed lookup is tried
    again on the next request (and answers 503 meanwhile). Thread-safe."""

    def __init__(self, source: SecretsSource, refresh: float = SECRETS_REFRESH_SECONDS):
        self._source, self._refresh = source, refresh
        self._value: WebhookVerifier | None = WebhookVerifier(source) if isinstance(source, list) else None
        self._at = time.monotonic()
        self._lock = threading.Lock()

    def cached(self) -> WebhookVerifier | None:
        """The verifier if resolved and fresh (no I/O), else None."""
        if self._value is not None and (isinstance(self._source, list)
                                        or time.monotonic() - self._at < self._refresh):
            return self._value
        return None

    def get(self) -> WebhookVerifier:
        """Resolve (or refresh) the verifier. :raises Unavailable: if there are no usable secrets."""
        with self._lock:
            fresh = self.cached()
            if fresh is not None:
                return fresh
            assert not isinstance(self._source, list)
            try:
                self._value = WebhookVerifier(self._source())
                self._at = time.monotonic()
            except Exception as exc:  # never let the cause's text (could hold a secret) out
                if self._value is not None:  # keep verifying with the secrets we have
                    self._at = time.monotonic()
                    log.warning("webhook secrets could not be refreshed (%s): keeping the current ones",
                                type(exc).__name__)
                    return self._value
                msg = str(exc) if isinstance(exc, Unavailable | NoSecrets) else type(exc).__name__
                raise Unavailable(f"webhook signing secrets unavailable: {msg}") from None
            return self._value


def _answer(status: int, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> Response:
    return Response(json.dumps(body, separators=(",", ":")), status_code=status, media_type="application/json",
                    headers=dict(headers or {}))


def _unavailable(reason: str) -> Response:
    return _answer(503, {"error": reason}, {"Retry-After": str(RETRY_AFTER_SECONDS)})


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request body, or None if it is larger than ``limit`` bytes (reading stops there)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(secrets: SecretsSource, connect: Connect, *, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout: float = BODY_TIMEOUT_SECONDS, max_in_flight: int = MAX_IN_FLIGHT,
               writer: GroupWriter | None = None, on_answer: Callable[[str, str], None] | None = None) -> Starlette:
    """Build the receiver (routes ``POST /resend`` and ``GET /healthz``); see the module docstring.

    :param secrets: the ``whsec_`` secrets, or a factory (looked up on the first request, so a missing
        connection answers 503 instead of failing at start-up, and again every few minutes).
    :param connect: opens the writer's psycopg 3 connection (in its thread; again after a failure).
    :param max_body_bytes: larger bodies get 413.
    :param body_timeout: seconds a body may take to arrive (408 after).
    :param max_in_flight: requests handled at once at most (503 beyond).
    :param writer: the group-commit writer (default: a :class:`GroupWriter` over ``connect``).
    :param on_answer: told of every answer to ``POST /resend`` (metrics): ``(event_type, decision)``
        for an acknowledged event (``decision`` as :meth:`GroupWriter.submit` returns it, ``pending``
        for None), ``("refused", "<status>")`` otherwise. Called after the answer is decided; an
        error it raises is logged and changes nothing.
    """
    verifiers = _Verifiers(secrets)
    group_writer = writer or GroupWriter(connect)
    in_flight = 0

    def told(kind: str, outcome: str | int, answer: Response) -> Response:
        if on_answer is not None:
            try:
                on_answer(kind, str(outcome))
            except Exception as exc:  # the answer is decided; a metric must not change it
                log.warning("webhook answer not reported: %s", type(exc).__name__)
        return answer

    async def receive(request: Request) -> Response:
        nonlocal in_flight
        if in_flight >= max_in_flight:
            return told("refused", 503, _unavailable("too many requests in flight"))
        in_flight += 1
        try:
            answer, event_type, decision = await _receive(request)
        finally:
            in_flight -= 1
        if event_type is None:
            return told("refused", answer.status_code, answer)
        return told(event_type, decision or "pending", answer)

    async def _receive(request: Request) -> tuple[Response, str | None, str | None]:
        """The answer, and the acknowledged event's type and decision (None, None: refused)."""
        result = await _refuse_or_store(request)
        if isinstance(result, Response):
            return result, None, None
        event, decision = result
        if decision == DUPLICATE_DELIVERY:
            return _answer(200, {"received": True, "duplicate": True}), event.event_type, decision
        return _answer(200, {"received": True, "decision": decision or "pending"}), event.event_type, decision

    async def _refuse_or_store(request: Request) -> Response | tuple[WebhookEvent, str | None]:
        try:
            async with asyncio.timeout(body_timeout):  # no extra task per request (unlike wait_for)
                body = await _read_body(request, max_body_bytes)
        except TimeoutError:
            return _answer(408, {"error": "body not received in time"}, {"Connection": "close"})
        except ClientDisconnect:
            return _answer(400, {"error": "client disconnected"})
        if body is None:
            return _answer(413, {"error": f"body larger than {max_body_bytes} bytes"}, {"Connection": "close"})
        verifier = verifiers.cached()
        if verifier is None:
            try:
                verifier = await run_in_threadpool(verifiers.get)
            except Unavailable as exc:
                log.error("webhook refused with 503: %s", exc)
                return _unavailable("receiver not configured")
        try:
            verified = verifier.verify(body, request.headers)
        except Rejected as exc:
            log.info("webhook refused (%d): %s", exc.status, exc.reason)
            return _answer(exc.status, {"error": exc.reason})
        try:
            event = parse_event(verified.svix_id, body)
        except MalformedEvent as exc:
            log.info("webhook %s refused (400): %s", verified.svix_id, exc)
            return _answer(400, {"error": str(exc)})
        try:
            decision = await group_writer.submit(event)
        except Overloaded as exc:
            log.warning("webhook %s refused with 503: %s", verified.svix_id, exc)
            return _unavailable("receiver busy")
        except Unavailable as exc:
            log.warning("webhook %s not stored, 503: %s", verified.svix_id, exc)
            return _unavailable("event not stored; retry later")
        return event, decision

    async def healthz(request: Request) -> Response:
        try:
            await run_in_threadpool(verifiers.get)
        except Unavailable as exc:
            return JSONResponse({"status": "unavailable", "reason": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "waiting": group_writer.waiting, **group_writer.stats})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        headers = {"Allow": "POST"} if status == 405 else None
        return _answer(status, {"error": "not found" if status == 404 else "method not allowed"}, headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        log.error("webhook receiver error: %s", type(exc).__name__)  # no traceback with a payload
        return _unavailable("internal error; retry later")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await group_writer.aclose()

    routes = [Route("/resend", receive, methods=["POST"]), Route("/healthz", healthz, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    lifespan=lifespan)
    app.state.writer = group_writer
    return app


def secrets_from_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """The signing secrets from ``MAILFLOW_WEBHOOK_SECRETS`` (one or more ``whsec_``, whitespace or
    comma separated), else the password of ``AIRFLOW_CONN_MAIL_WEBHOOK`` (JSON or URI).

    :raises NoSecrets: if neither holds a usable secret (never echoing one).
    """
    env = os.environ if environ is None else environ
    if env.get(SECRETS_ENV):
        return parse_secrets(env[SECRETS_ENV])
    name = f"AIRFLOW_CONN_{settings.WEBHOOK_CONN_ID.upper()}"
    if env.get(name):
        from mailflow.feedback.unsubscribe_app import _parse_airflow_conn

        try:
            password, _extra = _parse_airflow_conn(env[name])
        except (ValueError, TypeError):
            raise NoSecrets(f"{name} is not a connection (JSON or URI)") from None
        return parse_secrets(password)
    raise NoSecrets(f"no webhook signing secret: set {SECRETS_ENV} or {name}")


def connect_factory(dsn: str, *, connect_timeout: int = 3, statement_timeout_ms: int = 10000) -> Connect:
    """A :data:`Connect` for ``dsn`` with short connect and statement timeouts (seconds, ms), so a
    sick database gives a quick 503 instead of holding the provider's requests."""
    def connect() -> psycopg.Connection:
        return psycopg.connect(dsn, connect_timeout=connect_timeout, autocommit=True,
                               options=f"-c statement_timeout={int(statement_timeout_ms)}")
    return connect



_LIMITS = ServerLimits()


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8091, show_default=True)
@click.option("--dsn", callback=dsn_option(DSN_ENV), metavar="DSN",
              help=f"send-log database (default: {DSN_ENV} or MAILFLOW_DSN)")
@click.option("--max-body-bytes", type=int, default=MAX_BODY_BYTES, show_default=True, metavar="BYTES")
@click.option("--max-group", type=int, default=1000, show_default=True, metavar="N",
              help="events per transaction at most")
@click.option("--lanes", type=int, default=2, show_default=True, metavar="N",
              help="groups written at once, each on its own connection")
@click.option("--max-waiting", type=int, default=20000, show_default=True, metavar="N",
              help="events waiting for the database at most (more get 503)")
@click.option("--sweep-every", type=float, default=3.0, show_default=True, metavar="SECONDS",
              help="apply events waiting for their email this often (0: never)")
@click.option("--give-up-hours", type=float, default=GIVE_UP_AFTER.total_seconds() / 3600, show_default=True,
              metavar="HOURS", help="an event whose email stays unknown this long is decided unknown_email")
@click.option("--header-timeout", type=float, default=_LIMITS.header_timeout, show_default=True, metavar="SECONDS")
@click.option("--body-timeout", type=float, default=_LIMITS.body_timeout, show_default=True, metavar="SECONDS")
@click.option("--keep-alive", type=int, default=_LIMITS.keep_alive, show_default=True, metavar="SECONDS")
@click.option("--max-connections", type=int, default=None, metavar="N",
              help=f"open client connections at most (default 1000; never more than the soft "
                   f"file-descriptor limit minus {FD_RESERVE})")
def serve_command(host: str, port: int, dsn: str, max_body_bytes: int, max_group: int, lanes: int,
                  max_waiting: int, sweep_every: float, give_up_hours: float, header_timeout: float,
                  body_timeout: float, keep_alive: int, max_connections: int | None) -> int:
    """Serve the webhook receiver with uvicorn (``mailflow webhooks serve``) until SIGINT/SIGTERM.

    The DSN from ``--dsn``, ``mailflow --dsn``, ``MAILFLOW_WEBHOOK_DSN`` or ``MAILFLOW_DSN``; the
    signing secrets from the environment (:func:`secrets_from_env`). Exits with 2 if either is
    missing. Access log off.
    """
    try:
        secrets = secrets_from_env()
    except NoSecrets as exc:
        raise click.UsageError(str(exc)) from None
    from datetime import timedelta

    limits = ServerLimits(header_timeout=header_timeout, body_timeout=body_timeout,
                          keep_alive=keep_alive, max_connections=max_connections)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    connect = connect_factory(dsn)
    writer = GroupWriter(connect, lanes=lanes, max_group=max_group, max_waiting=max_waiting,
                         sweep_every=sweep_every, give_up_after=timedelta(hours=give_up_hours))
    app = create_app(secrets, connect, max_body_bytes=max_body_bytes, body_timeout=body_timeout, writer=writer)
    log.info("webhook receiver on http://%s:%s/resend (%d signing secret(s))", host, port, len(secrets))
    serve(app, host=host, port=port, limits=limits)
    return 0


if __name__ == "__main__":
    # deprecated alias, kept for one release
    print("warning: `python -m mailflow.feedback.webhooks` is deprecated and goes away in the next minor "
          "release; run `mailflow webhooks serve` (same options)", file=sys.stderr, flush=True)
    serve_command.main(prog_name="mailflow webhooks serve")
