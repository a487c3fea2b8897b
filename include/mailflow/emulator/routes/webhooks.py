"""Resend's webhook endpoints (``POST/GET /webhooks``, ``GET/PATCH/DELETE /webhooks/{id}``) and the
control view of what was pushed (``GET /_emulator/webhooks``, ``POST /_emulator/webhooks/rotate``)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mailflow.emulator.config import check_secret
from mailflow.emulator.lifecycle import EMAIL_EVENTS
from mailflow.emulator.responses import error_response, json_response
from mailflow.emulator.state import EmulatorState
from mailflow.emulator.validation import ApiError

# Resend's other event families: accepted at registration, never emitted by the emulator.
_OTHER_EVENTS = ("email.scheduled", "email.received", "contact.created", "contact.updated", "contact.deleted",
                 "domain.created", "domain.updated", "domain.deleted")
KNOWN_EVENTS = frozenset(EMAIL_EVENTS + _OTHER_EVENTS)


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise ApiError(422, "validation_error", "The request body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(422, "validation_error", "The request body must be a JSON object.")
    return body


def _check_endpoint(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")) or len(value) > 2048:
        raise ApiError(422, "validation_error", "Invalid `endpoint` field: an http(s) URL is required.")
    return value


def _check_events(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(e, str) for e in value):
        raise ApiError(422, "validation_error", "Invalid `events` field: a non-empty array of event types.")
    unknown = sorted(set(value) - KNOWN_EVENTS)
    if unknown:
        raise ApiError(422, "validation_error", f"Invalid `events` field: unknown event type(s) {unknown}.")
    return tuple(dict.fromkeys(value))


class WebhookRoutes(EmulatorState):
    """The webhook endpoints; the pushing is :class:`mailflow.emulator.webhooks.WebhookDispatcher`."""

    async def create_webhook(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """POST /webhooks {endpoint, events} -> 201 {object: "webhook", id, signing_secret}."""
        body = _parse_body(await request.body())
        ep = self.hooks.register(_check_endpoint(body.get("endpoint")), _check_events(body.get("events")))
        return json_response(201, {"object": "webhook", "id": ep.id, "signing_secret": ep.secrets[0]}, rl)

    async def list_webhooks(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /webhooks: every endpoint, oldest first, without secrets (ListWebhooksResponse)."""
        data = []
        for ep in self.hooks.endpoints.values():
            item = ep.public(with_secret=False)
            item.pop("object")
            data.append(item)
        return json_response(200, {"object": "list", "has_more": False, "data": data}, rl)

    def _endpoint(self, request: Request) -> Any:
        ep = self.hooks.endpoints.get(request.path_params["webhook_id"])
        if ep is None:
            raise ApiError(404, "not_found", "Webhook not found")
        return ep

    async def get_webhook(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /webhooks/{id}: GetWebhookResponse (with the newest signing secret) or 404 not_found."""
        return json_response(200, self._endpoint(request).public(with_secret=True), rl)

    async def update_webhook(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """PATCH /webhooks/{id} {endpoint?, events?, status?: enabled|disabled}. A disabled endpoint
        gets no new messages and its pending ones end as ``endpoint_gone``."""
        ep = self._endpoint(request)
        body = _parse_body(await request.body())
        if "endpoint" in body:
            ep.url = _check_endpoint(body["endpoint"])
        if "events" in body:
            ep.events = _check_events(body["events"])
        if "status" in body:
            if body["status"] not in ("enabled", "disabled"):
                raise ApiError(422, "validation_error", "Invalid `status` field: enabled or disabled.")
            ep.status = body["status"]
        return json_response(200, {"object": "webhook", "id": ep.id}, rl)

    async def delete_webhook(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """DELETE /webhooks/{id} -> {object, id, deleted: true}; pending messages end as ``endpoint_gone``."""
        ep = self._endpoint(request)
        del self.hooks.endpoints[ep.id]
        return json_response(200, {"object": "webhook", "id": ep.id, "deleted": True}, rl)

    # -- control -----------------------------------------------------------------------------------
    async def control_webhooks(self, request: Request) -> Response:
        """GET /_emulator/webhooks: ``{"totals": {...}, "messages": [...], "has_more"}``.

        Query: ``limit`` (default 1000; 0 = totals only), ``offset``, and filters ``kind`` (genuine,
        duplicate, forged, stale, future), ``final`` (pending, acknowledged, given_up, endpoint_gone,
        rejected), ``email_id``, ``svix_id``, ``type``. Messages are in creation order; each has
        svix_id, email_id, type, endpoint_id, kind, event_created_at, first_emitted_at, attempts
        [{at, status}], final, acknowledged_at (epoch seconds).
        """
        q = request.query_params
        try:
            limit = int(q.get("limit", "1000"))
            offset = int(q.get("offset", "0"))
            if limit < 0 or offset < 0:
                raise ValueError
        except ValueError:
            return error_response(ApiError(400, "invalid_parameter", "limit and offset are non-negative integers"))
        filters = {name: q[name] for name in ("kind", "final", "email_id", "svix_id", "type") if name in q}
        page: list[dict[str, Any]] = []
        has_more = False
        if limit:
            skipped = 0
            for msg in self.hooks.records:
                if any(getattr(msg, k) != v for k, v in filters.items()):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                if len(page) == limit:
                    has_more = True
                    break
                page.append(msg.public())
        return json_response(200, {"totals": self.hooks.summary(), "messages": page, "has_more": has_more})

    async def control_rotate(self, request: Request) -> Response:
        """POST /_emulator/webhooks/rotate {"id", "secret"?}: put a new secret in front of the endpoint's
        secrets (generated if absent); every active secret is signed for. Returns the endpoint with
        ``signing_secrets``."""
        try:
            body = json.loads(await request.body() or b"{}")
            secret = body.get("secret")
            if secret is not None:
                check_secret(secret)
            ep = self.hooks.rotate(str(body.get("id")), secret)
        except KeyError:
            return error_response(ApiError(404, "not_found", "Webhook not found"))
        except (ValueError, AttributeError) as exc:
            return error_response(ApiError(400, "invalid_parameter", str(exc)))
        return json_response(200, {**ep.public(with_secret=True), "signing_secrets": list(ep.secrets)})
