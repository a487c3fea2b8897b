"""GET /emails, GET /emails/{id} and GET /domains."""

from __future__ import annotations

import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mailflow.emulator.lifecycle import last_event as lifecycle_last_event
from mailflow.emulator.lifecycle import plan_lifecycle
from mailflow.emulator.responses import json_response
from mailflow.emulator.state import EmulatorState
from mailflow.emulator.validation import ApiError


class ReadRoutes(EmulatorState):
    """The reading endpoints."""

    # -- reading ---------------------------------------------------------------------------------
    def last_event(self, rec: dict[str, Any]) -> str:
        """The email's lifecycle (:func:`.lifecycle.plan_lifecycle`, the same one its webhooks tell)
        up to now on the emulator's clock: ``sent``, ``delivered``, ``bounced`` (permanent only),
        ``delivery_delayed`` (also a transient bounce), ``complained``, ``opened``, ``clicked``,
        ``failed``, ``suppressed``; ``scheduled`` for a scheduled email. Address rules are read now,
        so a rule set after the send is an outcome that arrived later (no webhook is pushed for it)."""
        if rec.get("scheduled_at"):
            return "scheduled"
        plan = plan_lifecycle(rec["id"], rec["to"] + rec["cc"] + rec["bcc"], self.cfg)
        return lifecycle_last_event(plan, self.now() - rec.get("accepted_epoch", 0.0))

    def email_object(self, rec: dict[str, Any], full: bool) -> dict[str, Any]:
        obj = {"object": "email", "id": rec["id"], "to": rec["to"], "from": rec["from"],
               "created_at": rec["created_at"], "subject": rec["subject"], "bcc": rec["bcc"] or None,
               "cc": rec["cc"] or None, "reply_to": rec["reply_to"] or None,
               "last_event": self.last_event(rec), "scheduled_at": rec["scheduled_at"]}
        if full:
            obj.update(html=rec["html"], text=rec["text"], tags=rec["tags"] or None)
        return obj

    async def get_email(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /emails/{email_id}: the spec's Email object, or 404 not_found."""
        await self.latency()
        rec = self.emails.get(request.path_params["email_id"])
        if rec is None:
            raise ApiError(404, "not_found", "Email not found")
        return json_response(200, self.email_object(rec, full=True), rl)

    async def list_emails(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /emails?limit=&after=&before=: newest first, ``{"object":"list","has_more","data"}``."""
        await self.latency()
        q = request.query_params
        try:
            limit = int(q.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ApiError(422, "validation_error", "The `limit` parameter must be between 1 and 100.")
        after, before = q.get("after"), q.get("before")
        if after is not None and before is not None:
            raise ApiError(422, "validation_error", "Use only one of `after` and `before`.")
        ids = list(reversed(self.emails))  # newest first
        cursor = after if after is not None else before
        if cursor is not None and cursor not in self.emails:
            raise ApiError(422, "validation_error", "Invalid pagination cursor.")
        if before is not None:  # the `limit` emails just newer than the cursor
            stop = ids.index(before)
            start = max(0, stop - limit)
            page, has_more = ids[start:stop], start > 0
        else:
            start = ids.index(after) + 1 if after is not None else 0
            page, has_more = ids[start:start + limit], len(ids) > start + limit
        data = [self.email_object(self.emails[i], full=False) for i in page]
        return json_response(200, {"object": "list", "has_more": has_more, "data": data}, rl)

    async def domains(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /domains: a cheap authenticated call for connection tests; one fake verified domain."""
        await self.latency()
        data = []
        if self.cfg.domain:
            data.append({"id": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.cfg.domain)), "name": self.cfg.domain,
                         "status": "verified", "created_at": "2026-01-01 00:00:00.000000+00",
                         "region": "us-east-1", "open_tracking": False, "click_tracking": False,
                         "capabilities": {"sending": "enabled", "receiving": "disabled"}})
        return json_response(200, {"object": "list", "has_more": False, "data": data}, rl)
