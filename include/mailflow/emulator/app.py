"""A Resend-compatible HTTP emulator: the test double, the demo's email API and the benchmark's provider.

Built to ``/work/shared/reference/resend-openapi.yaml`` (POST /emails, POST /emails/batch, GET /emails,
GET /emails/{id}, GET /domains, POST/GET/PATCH/DELETE /webhooks) and to every point of
``resend-contract.md`` ("the contract" below): batch validation modes, Idempotency-Key semantics,
rate-limit headers, quota errors, error bodies, and webhooks pushed with Svix signatures, retries and
switchable faults (:mod:`.webhooks`; each email's events come from :mod:`.lifecycle`, which
GET /emails/{id} reports too).

Honesty rules: an email is "accepted" only once its outbox line is written and flushed; idempotent
replays write nothing; faults are drawn from a seeded ``random.Random`` so a run is reproducible.

Layout: :mod:`.state` holds the shared state (emails, idempotency records, rate windows, stats),
:mod:`.routes` one module per endpoint group (sending, reading, control), :mod:`.responses` the
response helpers; this module joins them into :class:`Emulator` with the common request envelope
and builds the app. Validation rules and configuration are in their own modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from email.utils import formatdate
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mailflow.emulator.config import EmulatorConfig
from mailflow.emulator.responses import error_response, json_response
from mailflow.emulator.routes.control import ControlRoutes
from mailflow.emulator.routes.emails import SendRoutes
from mailflow.emulator.routes.reads import ReadRoutes
from mailflow.emulator.routes.webhooks import WebhookRoutes
from mailflow.emulator.validation import ApiError

log = logging.getLogger("mailflow.emulator")


class Emulator(SendRoutes, ReadRoutes, WebhookRoutes, ControlRoutes):
    """Shared state of one emulator: emails, idempotency records, rate windows, stats, outbox."""

    async def api(self, request: Request, handler: Any) -> Response:
        """Common envelope: auth, rate limit, injected timeout and latency, errors, stats; every
        answer carries ``Date`` from the provider's clock (:meth:`provider_now`)."""
        response = await self._api(request, handler)
        response.headers["date"] = formatdate(self.provider_now(), usegmt=True)
        return response

    async def _api(self, request: Request, handler: Any) -> Response:
        rl: dict[str, str] = {}
        try:
            key, rl = self.admit(request)
            if key in self.cfg.restricted_keys and handler != self.send:
                raise ApiError(401, "restricted_api_key", "This API key is restricted to only send emails")
            if self.cfg.outage:
                raise ApiError(503, "service_unavailable", "Emulated outage: the service is unavailable.")
            if self.chance(self.cfg.timeout_rate):
                self.stats["timeouts_injected"] += 1
                self.count(Response(status_code=500), "internal_server_error")
                await asyncio.sleep(self.cfg.hang_seconds)
                err = ApiError(500, "internal_server_error", "Emulated timeout: the request was not processed.")
                return error_response(err, rl)
            return self.count(await handler(request, key, rl))
        except ApiError as err:
            return self.count(error_response(err, {**rl, **err.headers}), err.name)


def create_app(config: EmulatorConfig) -> Starlette:
    """Build the Starlette app. ``app.state.emulator`` is the :class:`Emulator` (for in-process tests)."""
    emu = Emulator(config)

    def api(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            return await emu.api(request, handler)
        return endpoint

    async def health(request: Request) -> Response:
        return json_response(200, {"status": "ok"})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/emails", api(emu.send), methods=["POST"]),
        Route("/emails", api(emu.list_emails), methods=["GET"]),
        Route("/emails/batch", api(emu.send), methods=["POST"]),
        Route("/emails/{email_id}", api(emu.get_email), methods=["GET"]),
        Route("/domains", api(emu.domains), methods=["GET"]),
        Route("/webhooks", api(emu.create_webhook), methods=["POST"]),
        Route("/webhooks", api(emu.list_webhooks), methods=["GET"]),
        Route("/webhooks/{webhook_id}", api(emu.get_webhook), methods=["GET"]),
        Route("/webhooks/{webhook_id}", api(emu.update_webhook), methods=["PATCH"]),
        Route("/webhooks/{webhook_id}", api(emu.delete_webhook), methods=["DELETE"]),
    ]
    if config.control:
        routes += [
            Route("/_emulator/config", emu.control_config, methods=["GET", "POST"]),
            Route("/_emulator/stats", emu.control_stats, methods=["GET"]),
            Route("/_emulator/reset", emu.control_reset, methods=["POST"]),
            Route("/_emulator/webhooks", emu.control_webhooks, methods=["GET"]),
            Route("/_emulator/webhooks/rotate", emu.control_rotate, methods=["POST"]),
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        name = {404: "not_found", 405: "method_not_allowed"}.get(status, "application_error")
        return error_response(ApiError(status, name, str(getattr(exc, "detail", "")) or name))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        emu.stats["status_5xx"] += 1
        return error_response(ApiError(500, "internal_server_error", "Unexpected error in the emulator."))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # the webhook pool starts with the app (or lazily at the first accepted email when the
        # server runs without lifespan events) and stops with it
        emu.hooks.ensure_started()
        try:
            yield
        finally:
            await emu.hooks.stop()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    lifespan=lifespan)
    app.state.emulator = emu
    return app
