"""A Resend-compatible HTTP emulator: the test double, the demo's email API and the benchmark's provider.

Built to ``/work/shared/reference/resend-openapi.yaml`` (POST /emails, POST /emails/batch, GET /emails,
GET /emails/{id}, GET /domains) and to every point of ``resend-contract.md`` ("the contract" below):
batch validation modes, Idempotency-Key semantics, rate-limit headers, quota errors, error bodies.

Honesty rules: an email is "accepted" only once its outbox line is written and flushed; idempotent
replays write nothing; faults are drawn from a seeded ``random.Random`` so a run is reproducible.

The :class:`Emulator` class is one cohesive thing (the emulated API's state and request
handling), hence over 400 lines; validation rules and configuration are in their own modules.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import random
import uuid
from collections import OrderedDict, deque
from datetime import UTC, datetime
from email.utils import formatdate
from functools import lru_cache
from typing import Any, TextIO

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mailflow.emulator.config import EmulatorConfig, coerce_update
from mailflow.emulator.validation import ApiError, _check_address, validate_email_payload

log = logging.getLogger("mailflow.emulator")


MAX_BATCH = 100  # contract "POST /emails/batch": 1 to 100 emails

MAX_BODY_BYTES = 40 * 1024 * 1024  # Resend: an email may be up to 40 MB including attachments
MAX_IDEMPOTENCY_KEY = 256  # contract "Idempotency-Key": 1 to 256 characters

_TEST_DOMAIN_EVENTS = {"bounced": "bounced", "complained": "complained", "delivered": "delivered"}


def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return Response(body, status, headers=headers, media_type="application/json")


def _error(err: ApiError, headers: dict[str, str] | None = None) -> Response:
    body = {"statusCode": err.status, "name": err.name, "message": err.message}
    return _json(err.status, body, {**(headers or {}), **err.headers})


@lru_cache(maxsize=64)
def _api_key_id(key: str) -> str:
    """A stable, non-secret id of an API key (SHA-256 prefix) for idempotency scopes."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _sha(value: str | None) -> str | None:
    return hashlib.sha256(value.encode()).hexdigest() if value is not None else None


class _AbortedResponse(Response):
    """Sends 200 headers announcing a body, then returns without it: uvicorn closes the connection,
    so the client sees a transport error (httpx.RemoteProtocolError, requests ChunkedEncodingError)."""

    def __init__(self, body_len: int, headers: dict[str, str]):
        super().__init__(b"", 200, headers=headers, media_type="application/json")
        self._announced = body_len

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        raw.append((b"content-length", str(self._announced).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": raw})
        await send({"type": "http.response.body", "body": b"", "more_body": True})


class Emulator:
    """Shared state of one emulator: emails, idempotency records, rate windows, stats, outbox."""

    def __init__(self, config: EmulatorConfig):
        self.initial = config
        self.cfg = config
        self._outbox = open(config.outbox, "a", encoding="utf-8") if config.outbox else None
        self._idem_store: TextIO | None = None
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
                return _error(err, rl)
            return self.count(await handler(request, key, rl))
        except ApiError as err:
            return self.count(_error(err, {**rl, **err.headers}), err.name)

    # -- sending ---------------------------------------------------------------------------------
    async def send(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """POST /emails and POST /emails/batch, with Idempotency-Key (contract "Idempotency-Key").

        Keys are scoped per API key; the payload fingerprint is SHA-256 of the path and the exact body
        bytes (the same key on the other endpoint is a different payload). Only 200 responses are
        recorded (24 h, injectable clock): a 4xx/5xx leaves the key free for a corrected retry.
        """
        batch = request.url.path.endswith("/batch")
        if self.chance(self.cfg.error_rate):
            raise ApiError(500, "internal_server_error", "Emulated internal server error.")
        idem = request.headers.get("idempotency-key")
        if idem is not None and not 1 <= len(idem) <= MAX_IDEMPOTENCY_KEY:
            raise ApiError(400, "invalid_idempotency_key",
                           f"The key must be between 1-{MAX_IDEMPOTENCY_KEY} characters.")
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(413, "validation_error",
                           f"The request body is {len(body)} bytes; the limit is {MAX_BODY_BYTES} bytes.")
        digest = hashlib.sha256(request.url.path.encode() + b"\0" + body).hexdigest()
        # scoped per API key; the key is kept hashed (the journal holds no secret)
        slot = (_api_key_id(key), idem) if idem is not None else None
        if slot is not None:
            if slot in self.inflight:
                raise ApiError(409, "concurrent_idempotent_requests", "Same idempotency key used while "
                               "original request is still in progress.")
            record = self._idem_get(slot)
            if record is not None:
                if record["digest"] != digest:
                    raise ApiError(409, "invalid_idempotent_request",
                                   "Same idempotency key used with a different request payload.")
                self.stats["replays"] += 1
                return Response(record["body"], record["status"], headers=rl, media_type="application/json")
            self.inflight.add(slot)
        try:
            await self.latency()
            status, payload, emails = self._accept(body, batch, request, idem)
            out = json.dumps(payload, separators=(",", ":")).encode()
            if slot is not None:
                self._remember(slot, {"digest": digest, "status": status, "body": out, "at": self.now()})
                self._purge_idem()
        finally:
            if slot is not None:
                self.inflight.discard(slot)
        if emails and self.chance(self.cfg.error_after_rate):
            code = int(self.cfg.error_after_status)
            self.stats["errors_after_accept"] += 1
            name = {500: "internal_server_error", 502: "bad_gateway", 503: "service_unavailable",
                    504: "gateway_timeout"}[code]
            raise ApiError(code, name, f"Emulated {code} after the batch was processed.", rl)
        if emails and self.chance(self.cfg.reset_after_accept_rate):
            self.stats["resets_after_accept"] += 1
            log.info("reset_after_accept: %d email(s) accepted, response withheld (%s)", len(emails),
                     self.cfg.reset_mode)
            if self.cfg.reset_mode == "abort":
                return _AbortedResponse(len(out), rl)
            await asyncio.sleep(self.cfg.hang_seconds)
        return Response(out, status, headers=rl, media_type="application/json")

    def _idem_get(self, slot: tuple[str, str]) -> dict[str, Any] | None:
        record = self.idem.get(slot)
        if record is not None and self.now() - record["at"] >= self.cfg.idempotency_ttl_seconds:
            del self.idem[slot]
            return None
        return record

    def _purge_idem(self) -> None:
        horizon = self.now() - self.cfg.idempotency_ttl_seconds
        while self.idem:
            slot, record = next(iter(self.idem.items()))
            if record["at"] > horizon:
                break
            del self.idem[slot]

    def _accept(self, body: bytes, batch: bool, request: Request, idem: str | None,
                ) -> tuple[int, dict[str, Any], list[dict[str, Any]]]:
        """Validate, apply the quota, write the outbox and store the emails. No await inside."""
        try:
            parsed = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            raise ApiError(422, "validation_error", "The request body is not valid JSON.") from None
        errors: list[dict[str, Any]] = []
        permissive = False
        valid: list[tuple[int | None, dict[str, Any]]] = []
        if not batch:
            valid.append((None, validate_email_payload(parsed, in_batch=False)))
        else:
            if not isinstance(parsed, list):
                raise ApiError(422, "validation_error", "The request body must be a JSON array of emails.")
            if not 1 <= len(parsed) <= MAX_BATCH:
                raise ApiError(422, "validation_error",
                               f"The batch must contain between 1 and {MAX_BATCH} emails, got {len(parsed)}.")
            mode = (request.headers.get("x-batch-validation") or "strict").strip().lower()
            if mode not in ("strict", "permissive"):
                raise ApiError(422, "validation_error", "Invalid `x-batch-validation` header. "
                               "It must be `strict` or `permissive`.")
            permissive = mode == "permissive" and not self.cfg.strict_only
            for i, item in enumerate(parsed):
                try:
                    valid.append((i, validate_email_payload(item, in_batch=True)))
                except ApiError as err:
                    if not permissive:
                        # Resend's strict mode answers the first validation error as prose and
                        # documents no index (contract "POST /emails/batch"): none is given here.
                        raise ApiError(422, "validation_error", err.message) from None
                    errors.append({"index": i, "message": err.message})
        self._check_domains([email for _, email in valid])
        quota = self.cfg.quota_emails
        now = self.now()
        day = int(now // 86400)
        if day != self.quota_day:
            self.quota_day, self.accepted_today = day, 0
        if quota is not None and valid and self.accepted_today + len(valid) > quota:
            raise ApiError(429, "daily_quota_exceeded", f"You have reached your daily email sending quota "
                           f"({quota} emails, {self.accepted_today} used today).")
        received = datetime.fromtimestamp(now, UTC)
        stored = []
        for index, email in valid:
            stored.append({**email, "id": str(uuid.uuid4()), "batch_index": index, "idempotency_key": idem,
                           "received_at": received.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                           "created_at": received.strftime("%Y-%m-%d %H:%M:%S.%f+00")})
        self._write_outbox(stored)
        keep = self.cfg.store_bodies
        for rec in stored:
            self.emails[rec["id"]] = rec if keep else {**rec, "html": None, "text": None}
        self.accepted += len(stored)
        self.accepted_today += len(stored)
        self.stats["accepted_emails"] = self.accepted
        if not batch:
            return 200, {"id": stored[0]["id"]}, stored
        data = [{"id": rec["id"]} for rec in stored]
        if self.cfg.scramble_order:
            self.rng.shuffle(data)
        payload: dict[str, Any] = {"data": data}
        if permissive:
            payload["errors"] = errors
        return 200, payload, stored

    def _check_domains(self, emails: list[dict[str, Any]]) -> None:
        """403 validation_error for an unverified `from` domain or, on a test-only account, any
        recipient but the owner (contract "Errors"; Resend's wording). The whole request is refused."""
        if self.cfg.check_from_domain:
            verified = self.cfg.domain.lower()
            for email in emails:
                domain = (_check_address(email["from"]) or "").rpartition("@")[2].rstrip(">")
                if not verified or (domain != verified and not domain.endswith("." + verified)):
                    raise ApiError(403, "validation_error", f"The {domain} domain is not verified. Please, add "
                                   "and verify your domain on https://resend.com/domains")
        if self.cfg.test_only:
            owner = self.cfg.owner_email.strip().lower()
            for email in emails:
                for addr in email["to"] + email["cc"] + email["bcc"]:
                    if (_check_address(addr) or "").rpartition("<")[2].rstrip(">") != owner:
                        raise ApiError(403, "validation_error", "You can only send testing emails to your own "
                                       f"email address ({owner}). To send emails to other recipients, please verify "
                                       "a domain at resend.com/domains, and change the `from` address to an email "
                                       "using this domain.")

    def _write_outbox(self, stored: list[dict[str, Any]]) -> None:
        """Append one JSON line per email and flush, before any response is produced."""
        if not stored:
            return
        lines = []
        for r in stored:
            line = {"id": r["id"], "from": r["from"], "to": r["to"], "cc": r["cc"], "bcc": r["bcc"],
                    "reply_to": r["reply_to"], "subject": r["subject"], "headers": r["headers"],
                    "tags": r["tags"], "idempotency_key": r["idempotency_key"], "batch_index": r["batch_index"],
                    "received_at": r["received_at"], "text_sha256": _sha(r["text"]),
                    "html_sha256": _sha(r["html"])}
            lines.append(json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
        if self._outbox:
            self._outbox.write("".join(lines))
            self._outbox.flush()
        self.stats["outbox_lines"] += len(lines)

    # -- reading ---------------------------------------------------------------------------------
    def last_event(self, rec: dict[str, Any]) -> str:
        """'bounced' / 'complained' if a recipient is configured so (or is bounced@resend.dev etc.)."""
        if rec.get("scheduled_at"):
            return "scheduled"
        events = set()
        for addr in rec["to"] + rec["cc"] + rec["bcc"]:
            norm = _check_address(addr) or addr.lower()
            local, _, domain = norm.partition("@")
            if norm in self.cfg.bounce:
                events.add("bounced")
            elif norm in self.cfg.complain:
                events.add("complained")
            elif norm in self.cfg.suppress:
                events.add("suppressed")
            elif norm in self.cfg.fail:
                events.add("failed")
            elif domain == "resend.dev" and local.split("+")[0] in _TEST_DOMAIN_EVENTS:
                events.add(_TEST_DOMAIN_EVENTS[local.split("+")[0]])
        for event in ("bounced", "complained", "suppressed", "failed"):
            if event in events:
                return event
        return "delivered"

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
        return _json(200, self.email_object(rec, full=True), rl)

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
        return _json(200, {"object": "list", "has_more": has_more, "data": data}, rl)

    async def domains(self, request: Request, key: str, rl: dict[str, str]) -> Response:
        """GET /domains: a cheap authenticated call for connection tests; one fake verified domain."""
        await self.latency()
        data = []
        if self.cfg.domain:
            data.append({"id": str(uuid.uuid5(uuid.NAMESPACE_DNS, self.cfg.domain)), "name": self.cfg.domain,
                         "status": "verified", "created_at": "2026-01-01 00:00:00.000000+00",
                         "region": "us-east-1", "open_tracking": False, "click_tracking": False,
                         "capabilities": {"sending": "enabled", "receiving": "disabled"}})
        return _json(200, {"object": "list", "has_more": False, "data": data}, rl)

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
                return _error(ApiError(400, "invalid_parameter", str(exc)))
            if "seed" in update:
                self.rng = random.Random(new.seed)
            self.cfg = new
            self.clock_offset += float(advance)
        return _json(200, self.cfg.public())

    async def control_stats(self, request: Request) -> Response:
        """Counters since the last reset, plus the in-memory sizes."""
        return _json(200, {**self.stats, "emails_stored": len(self.emails), "idempotency_keys": len(self.idem),
                           "inflight": len(self.inflight)})

    async def control_reset(self, request: Request) -> Response:
        """Clear state and stats, truncate the outbox; restores the startup settings unless
        the body is ``{"keep_config": true}``."""
        raw = await request.body()
        keep = bool(json.loads(raw).get("keep_config")) if raw.strip() else False
        self.reset(keep_config=keep)
        return _json(200, {"ok": True})


def create_app(config: EmulatorConfig) -> Starlette:
    """Build the Starlette app. ``app.state.emulator`` is the :class:`Emulator` (for in-process tests)."""
    emu = Emulator(config)

    def api(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            return await emu.api(request, handler)
        return endpoint

    async def health(request: Request) -> Response:
        return _json(200, {"status": "ok"})

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/emails", api(emu.send), methods=["POST"]),
        Route("/emails", api(emu.list_emails), methods=["GET"]),
        Route("/emails/batch", api(emu.send), methods=["POST"]),
        Route("/emails/{email_id}", api(emu.get_email), methods=["GET"]),
        Route("/domains", api(emu.domains), methods=["GET"]),
    ]
    if config.control:
        routes += [
            Route("/_emulator/config", emu.control_config, methods=["GET", "POST"]),
            Route("/_emulator/stats", emu.control_stats, methods=["GET"]),
            Route("/_emulator/reset", emu.control_reset, methods=["POST"]),
        ]

    async def http_error(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        name = {404: "not_found", 405: "method_not_allowed"}.get(status, "application_error")
        return _error(ApiError(status, name, str(getattr(exc, "detail", "")) or name))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error", exc_info=exc)
        emu.stats["status_5xx"] += 1
        return _error(ApiError(500, "internal_server_error", "Unexpected error in the emulator."))

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.emulator = emu
    return app
