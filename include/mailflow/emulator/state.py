"""The emulator's shared state and request envelope pieces: emails, idempotency records and their
journal, rate windows, stats, the clock, authentication and the rate limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
from collections import OrderedDict, deque
from email.utils import formatdate
from typing import Any, TextIO

from starlette.requests import Request
from starlette.responses import Response

from mailflow.emulator.config import EmulatorConfig
from mailflow.emulator.validation import ApiError
from mailflow.emulator.webhooks import WebhookDispatcher

log = logging.getLogger("mailflow.emulator")


class EmulatorState:
    """Shared state of one emulator: emails, idempotency records, rate windows, stats, outbox."""

    def __init__(self, config: EmulatorConfig):
        self.initial = config
        self.cfg = config
        self._outbox = open(config.outbox, "a", encoding="utf-8") if config.outbox else None
        self._idem_store: TextIO | None = None
        self.hooks = WebhookDispatcher(lambda: self.cfg)
        self.reset(keep_config=False, truncate=False)  # an existing outbox is appended to, never lost
        if config.idempotency_store:
            self._load_idem_store(config.idempotency_store)

    def _load_idem_store(self, path: str) -> None:
        """Read the journal's live records into ``self.idem``; rewrite it with only those (a torn
        last line from a crash is dropped), then keep it open for appending."""
        horizon = self.now() - self.cfg.idempotency_ttl_seconds
        live: list[str] = []
        try:
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    try:
                        r = json.loads(line)
                        slot, record = (r["key"], r["idem"]), {"digest": r["digest"], "status": int(r["status"]),
                                                               "body": r["body"].encode(), "at": float(r["at"])}
                    except (ValueError, KeyError, TypeError):
                        continue
                    if record["at"] > horizon:
                        self.idem[slot] = record
                        live.append(line if line.endswith("\n") else line + "\n")
        except FileNotFoundError:
            pass
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.writelines(live)
        os.replace(tmp, path)
        self._idem_store = open(path, "a", encoding="utf-8")
        log.info("idempotency store %s: %d live key(s) loaded", path, len(self.idem))

    def _remember(self, slot: tuple[str, str], record: dict[str, Any]) -> None:
        self.idem[slot] = record
        if self._idem_store is not None:
            self._idem_store.write(json.dumps({"key": slot[0], "idem": slot[1], "digest": record["digest"],
                                               "status": record["status"], "body": record["body"].decode(),
                                               "at": record["at"]}, separators=(",", ":")) + "\n")
            self._idem_store.flush()

    # -- state -----------------------------------------------------------------------------------
    def reset(self, keep_config: bool, truncate: bool = True) -> None:
        """Clear emails, idempotency records, rate windows and stats; truncate the outbox."""
        if not keep_config:
            self.cfg = self.initial
        self.hooks.clear(truncate=truncate)
        self.rng = random.Random(self.cfg.seed)
        self.clock_offset = 0.0
        self.emails: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.idem: OrderedDict[tuple[str, str], dict[str, Any]] = OrderedDict()
        self.inflight: set[tuple[str, str]] = set()
        self.windows: dict[str, deque[float]] = {}
        self.accepted = 0
        self.accepted_today = 0
        self.quota_day = -1
        self.stats: dict[str, Any] = {
            "requests": 0, "accepted_emails": 0, "responses_by_status": {}, "errors_by_name": {},
            "rate_limited": {}, "status_5xx": 0, "replays": 0, "conflicts": {}, "timeouts_injected": 0,
            "resets_after_accept": 0, "errors_after_accept": 0, "outbox_lines": 0,
        }
        if self._outbox and truncate:
            self._outbox.seek(0)
            self._outbox.truncate()
            self._outbox.flush()
        store: TextIO | None = getattr(self, "_idem_store", None)
        if store is not None and truncate:
            store.seek(0)
            store.truncate()
            store.flush()

    def now(self) -> float:
        return float(self.cfg.clock()) + self.clock_offset

    def chance(self, rate: float) -> bool:
        return rate >= 1.0 or (rate > 0.0 and self.rng.random() < rate)

    def count(self, response: Response, name: str | None = None) -> Response:
        """Record a response in the stats and return it."""
        by_status = self.stats["responses_by_status"]
        by_status[str(response.status_code)] = by_status.get(str(response.status_code), 0) + 1
        if response.status_code >= 500:
            self.stats["status_5xx"] += 1
        if name:
            self.stats["errors_by_name"][name] = self.stats["errors_by_name"].get(name, 0) + 1
            bucket = "rate_limited" if response.status_code == 429 else "conflicts" if response.status_code == 409 else None
            if bucket:
                self.stats[bucket][name] = self.stats[bucket].get(name, 0) + 1
        return response

    # -- auth and rate limit ---------------------------------------------------------------------
    def admit(self, request: Request) -> tuple[str, dict[str, str]]:
        """Authenticate and count the request in its key's sliding 1 s window (contract "Rate limits").

        Returns (api_key, ratelimit headers); raises ApiError 401/403/429.
        """
        self.stats["requests"] += 1
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer ") or not auth[7:].strip():
            raise ApiError(401, "missing_api_key", "Missing API key in the authorization header. Include the "
                           "following header in the request: Authorization: Bearer YOUR_API_KEY")
        key = auth[7:].strip()
        if key in self.cfg.revoked_keys or (key not in self.cfg.api_keys and key not in self.cfg.restricted_keys):
            raise ApiError(403, "invalid_api_key", "API key is invalid")
        if self.chance(self.cfg.rate_limited_rate):
            raise ApiError(429, "rate_limit_exceeded", "Too many requests. Emulated rate limit.",
                           {"ratelimit-limit": str(max(1, int(self.cfg.rate_limit or 10))),
                            "ratelimit-remaining": "0", "ratelimit-reset": "1", "retry-after": self._retry_after(1.0)})
        limit = self.cfg.rate_limit
        if limit <= 0:
            return key, {}
        now = self.now()
        window = self.windows.setdefault("team", deque())  # Resend: the limit is per team, all keys
        while window and window[0] <= now - 1.0:
            window.popleft()
        cap = max(1, int(limit))
        reset = (window[0] + 1.0 - now) if window else 1.0
        if len(window) >= cap:
            headers = {"ratelimit-limit": str(cap), "ratelimit-remaining": "0",
                       "ratelimit-reset": str(max(1, math.ceil(reset))), "retry-after": self._retry_after(reset)}
            raise ApiError(429, "rate_limit_exceeded", "Too many requests. You can only make "
                           f"{cap} requests per second. See rate limit response headers for more information.",
                           headers)
        window.append(now)
        reset = window[0] + 1.0 - now
        return key, {"ratelimit-limit": str(cap), "ratelimit-remaining": str(cap - len(window)),
                     "ratelimit-reset": str(max(1, math.ceil(reset)))}

    def provider_now(self) -> float:
        """The provider's clock (epoch s): the emulator's clock plus ``date_skew_seconds``."""
        return self.now() + self.cfg.date_skew_seconds

    def _retry_after(self, seconds: float) -> str:
        style = self.cfg.retry_after_style
        if self.cfg.retry_after_value:
            return self.cfg.retry_after_value
        if style == "fraction":
            return f"{max(seconds, 0.001):.3f}"
        if style == "http-date":
            return formatdate(self.provider_now() + max(1, math.ceil(seconds)), usegmt=True)
        return str(max(1, math.ceil(seconds)))

    async def latency(self) -> None:
        delay = self.cfg.latency_ms + (self.rng.uniform(0, self.cfg.latency_jitter_ms) if self.cfg.latency_jitter_ms else 0)
        if delay > 0:
            await asyncio.sleep(delay / 1000.0)
