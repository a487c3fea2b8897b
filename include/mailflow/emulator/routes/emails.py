"""POST /emails and POST /emails/batch: validation, Idempotency-Key, quota, outbox, injected faults."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from mailflow.emulator.responses import AbortedResponse, api_key_id, sha256_hex
from mailflow.emulator.state import EmulatorState
from mailflow.emulator.validation import ApiError, check_address, validate_email_payload

log = logging.getLogger("mailflow.emulator")


MAX_BATCH = 100  # contract "POST /emails/batch": 1 to 100 emails

MAX_BODY_BYTES = 40 * 1024 * 1024  # Resend: an email may be up to 40 MB including attachments
MAX_IDEMPOTENCY_KEY = 256  # contract "Idempotency-Key": 1 to 256 characters


class SendRoutes(EmulatorState):
    """The sending endpoints."""

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
        slot = (api_key_id(key), idem) if idem is not None else None
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
                return AbortedResponse(len(out), rl)
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
                           "created_at": received.strftime("%Y-%m-%d %H:%M:%S.%f+00"), "accepted_epoch": now})
        self._write_outbox(stored)
        keep = self.cfg.store_bodies
        for rec in stored:
            self.emails[rec["id"]] = rec if keep else {**rec, "html": None, "text": None}
        self.accepted += len(stored)
        self.accepted_today += len(stored)
        self.stats["accepted_emails"] = self.accepted
        for rec in stored:  # webhooks only for what was written: an accepted email's lifecycle
            self.hooks.email_accepted(rec, now)
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
                domain = (check_address(email["from"]) or "").rpartition("@")[2].rstrip(">")
                if not verified or (domain != verified and not domain.endswith("." + verified)):
                    raise ApiError(403, "validation_error", f"The {domain} domain is not verified. Please, add "
                                   "and verify your domain on https://resend.com/domains")
        if self.cfg.test_only:
            owner = self.cfg.owner_email.strip().lower()
            for email in emails:
                for addr in email["to"] + email["cc"] + email["bcc"]:
                    if (check_address(addr) or "").rpartition("<")[2].rstrip(">") != owner:
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
                    "received_at": r["received_at"], "text_sha256": sha256_hex(r["text"]),
                    "html_sha256": sha256_hex(r["html"])}
            lines.append(json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
        if self._outbox:
            self._outbox.write("".join(lines))
            self._outbox.flush()
        self.stats["outbox_lines"] += len(lines)
