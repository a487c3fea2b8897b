"""The control API (``/_emulator/config``, ``/_emulator/stats``, ``/_emulator/reset``): tests steer
faults and read counters."""

from __future__ import annotations

import json
import random

from starlette.requests import Request
from starlette.responses import Response

from mailflow.emulator.config import coerce_update
from mailflow.emulator.responses import error_response, json_response
from mailflow.emulator.state import EmulatorState
from mailflow.emulator.validation import ApiError


class ControlRoutes(EmulatorState):
    """The control endpoints (mounted only when the config enables them)."""

    # -- control API -----------------------------------------------------------------------------
    async def control_config(self, request: Request) -> Response:
        """GET: the settings. POST: a partial update; ``advance_clock_seconds`` moves the clock on."""
        if request.method == "POST":
            try:
                update = json.loads(await request.body() or b"{}")
                if not isinstance(update, dict):
                    raise ValueError("body must be a JSON object")
                advance = update.pop("advance_clock_seconds", 0)
                if isinstance(advance, bool) or not isinstance(advance, int | float):
                    raise ValueError("advance_clock_seconds must be a number")
                new = coerce_update(self.cfg, update)
            except ValueError as exc:
                return error_response(ApiError(400, "invalid_parameter", str(exc)))
            if "seed" in update:
                self.rng = random.Random(new.seed)
            self.cfg = new
            self.clock_offset += float(advance)
            if any(k in update for k in ("webhook_url", "webhook_secrets", "webhook_events")):
                self.hooks.sync_config()
        return json_response(200, self.cfg.public())

    async def control_stats(self, request: Request) -> Response:
        """Counters since the last reset, plus the in-memory sizes."""
        return json_response(200, {**self.stats, "emails_stored": len(self.emails), "idempotency_keys": len(self.idem),
                           "inflight": len(self.inflight)})

    async def control_reset(self, request: Request) -> Response:
        """Clear state and stats, truncate the outbox; restores the startup settings unless
        the body is ``{"keep_config": true}``."""
        raw = await request.body()
        keep = bool(json.loads(raw).get("keep_config")) if raw.strip() else False
        self.reset(keep_config=keep)
        return json_response(200, {"ok": True})
