"""The emulator's configuration (faults, limits, validation modes) and its run-time update
through the control endpoint."""

from __future__ import annotations

import base64
import binascii
import time
from dataclasses import dataclass, fields, replace
from typing import Any

from mailflow.emulator.validation import check_address

SVIX_RETRY_SCHEDULE = (0.0, 5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0, 36000.0)
"""Svix's documented schedule: immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h (each after the
previous attempt failed), then the message is marked failed (resend-contract.md "Webhooks")."""


@dataclass
class EmulatorConfig:
    """Emulator settings. Fields marked (runtime) can be changed through ``POST /_emulator/config``.

    Rates are fractions in [0, 1]; durations are named with their unit. ``clock`` returns epoch
    seconds and is injectable (idempotency TTL and the rate-limit window use it).
    """

    outbox: str | None = None  # JSON-lines file, one line per accepted email (None: no file)
    api_keys: tuple[str, ...] = ("re_test_emulator",)
    control: bool = True  # register the unauthenticated /_emulator/* control API
    rate_limit: float = 10.0  # (runtime) requests per second per TEAM (shared by every API key; Resend's
    #   pages have said 2, 5 and 10), sliding 1 s window; 0 = off
    quota_emails: int | None = None  # (runtime) accepted emails per UTC day (emulator clock) before 429
    #   daily_quota_exceeded; the count starts again at the next UTC midnight
    error_rate: float = 0.0  # (runtime) POSTs answered 500 internal_server_error before processing
    error_after_rate: float = 0.0  # (runtime) sends processed (outbox written, key recorded), then
    #   answered with error_after_status: an edge 5xx after the origin accepted the batch
    error_after_status: int = 502  # (runtime) 500, 502, 503 or 504
    outage: bool = False  # (runtime) every API request answered 503 before processing (a long outage)
    latency_ms: float = 0.0  # (runtime) added to every API request
    latency_jitter_ms: float = 0.0  # (runtime) uniform extra 0..jitter
    timeout_rate: float = 0.0  # (runtime) requests that hang hang_seconds, then 500, nothing sent
    hang_seconds: float = 30.0  # (runtime)
    reset_after_accept_rate: float = 0.0  # (runtime) sends accepted + recorded, response lost
    reset_mode: str = "abort"  # (runtime) "abort": truncated response, connection closed; "hang"
    strict_only: bool = False  # (runtime) ignore x-batch-validation: permissive
    scramble_order: bool = False  # (runtime) shuffle batch `data` order: a deliberately broken provider
    bounce: tuple[str, ...] = ()  # (runtime) recipients whose last_event is "bounced"
    complain: tuple[str, ...] = ()  # (runtime) recipients whose last_event is "complained"
    suppress: tuple[str, ...] = ()  # (runtime) recipients on the account's suppression list: last_event "suppressed"
    fail: tuple[str, ...] = ()  # (runtime) recipients whose email failed to send: last_event "failed"
    retry_after_style: str = "seconds"  # (runtime) "seconds" | "fraction" | "http-date" (contract)
    # Provider headers a client must bound (all off by default):
    date_skew_seconds: float = 0.0  # (runtime) the provider's clock runs this far ahead (negative: behind):
    #   the Date header and an http-date Retry-After both come from it
    retry_after_value: str = ""  # (runtime) the literal Retry-After of every 429 rate_limit_exceeded
    #   (e.g. "100000000", "1e300"); "" = computed from the window in retry_after_style
    rate_limited_rate: float = 0.0  # (runtime) requests answered 429 rate_limit_exceeded before processing
    store_bodies: bool = True  # (runtime) keep html/text in memory for GET /emails/{id}
    domain: str = "mailflow.example"  # the one fake verified domain of GET /domains ("" = none)
    # Key types and domain checks (contract "Errors"; all off by default):
    restricted_keys: tuple[str, ...] = ()  # (runtime) sending-only keys: accepted by POST /emails and
    #   /emails/batch only; any other endpoint answers 401 restricted_api_key
    revoked_keys: tuple[str, ...] = ()  # (runtime) keys revoked at the provider: every request under one
    #   answers 403 invalid_api_key, outage or not (authentication comes first)
    check_from_domain: bool = False  # (runtime) a `from` outside `domain` (or its subdomains): 403 validation_error
    test_only: bool = False  # (runtime) an account without a verified domain: recipients other than
    #   owner_email get 403 validation_error
    owner_email: str = "owner@mailflow.example"  # (runtime) the account owner's address (test_only)
    seed: int = 0  # (runtime) seeds the fault RNG (re-seeded on reset)
    idempotency_ttl_seconds: float = 86400.0  # contract: keys kept for 24 hours
    # JSON-lines journal of idempotency records (API key hashed): loaded at start-up (records younger
    # than the TTL), appended on every recorded 200, so a restarted emulator still recognises a resend
    idempotency_store: str | None = None
    # -- each accepted email's lifecycle (pushed as webhooks, reported as last_event) --------------------
    soft_bounce: tuple[str, ...] = ()  # (runtime) recipients whose email bounces Transient (never suppress)
    delayed: tuple[str, ...] = ()  # (runtime) recipients whose email is delivery_delayed, then delivered
    hard_bounce_rate: float = 0.0  # (runtime) emails (matching no address rule) that bounce Permanent
    soft_bounce_rate: float = 0.0  # (runtime) ... that bounce Transient
    failed_rate: float = 0.0  # (runtime) ... that fail (email.failed); the three share one draw, sum <= 1
    delayed_rate: float = 0.0  # (runtime) delivered emails with a delivery_delayed first
    complaint_rate: float = 0.0  # (runtime) delivered emails later complained about
    open_rate: float = 0.0  # (runtime) delivered emails opened
    click_rate: float = 0.0  # (runtime) delivered emails clicked (a click implies an open)
    event_spread_seconds: float = 0.0  # (runtime) an email's events happen within this many seconds of
    #   the send (0: all at once); last_event follows the same times on the emulator's clock
    # -- webhooks (Svix scheme): a pre-registered endpoint, the provider's retries, faults --------------
    webhook_url: str = ""  # (runtime) an endpoint registered without an API call ("" = none)
    webhook_secrets: tuple[str, ...] = ()  # (runtime) its signing secrets, whsec_<base64>; several are
    #   all signed for (rotation); empty: one is generated (GET /webhooks/{id} shows it)
    webhook_events: tuple[str, ...] = ()  # (runtime) its event types (empty: every email event)
    webhook_retry_schedule: tuple[float, ...] = SVIX_RETRY_SCHEDULE  # (runtime) seconds before each
    #   attempt after the previous failed one; the first entry is the first attempt's delay
    webhook_time_scale: float = 1.0  # (runtime) multiplies the retry schedule (0.0001: a day in 8.6 s)
    webhook_timeout_seconds: float = 15.0  # (runtime) per attempt; a timeout is a failed attempt
    webhook_concurrency: int = 64  # attempts in flight at once (keep-alive connections)
    webhook_log: str | None = None  # JSON-lines file: one line per message or copy when it is final
    #   (acknowledged, given up, rejected...), the accounting of a run too long to keep in memory
    webhook_records_max: int = 0  # messages kept for GET /_emulator/webhooks (the newest; 0 = all);
    #   the totals always count everything
    webhook_duplicate_rate: float = 0.0  # (runtime) acknowledged messages delivered once more, same svix-id
    webhook_reorder_rate: float = 0.0  # (runtime) emails whose events are all emitted at the time of the
    #   last one, newest first (delivered after bounced, opened before delivered)
    webhook_delay_rate: float = 0.0  # (runtime) messages whose first attempt waits webhook_delay_seconds more
    webhook_delay_seconds: float = 0.0  # (runtime)
    webhook_latency_min_seconds: float = 0.0  # (runtime) every message's first attempt waits a further
    webhook_latency_max_seconds: float = 0.0  # (runtime) uniform random time in [min, max] (seeded per
    #   svix-id): outcomes that arrive late, each on its own, so an email's events also arrive out of order
    webhook_drop_rate: float = 0.0  # (runtime) attempts lost on the way: never reach the receiver, count
    #   as failed and are retried on the schedule
    webhook_forged_rate: float = 0.0  # (runtime) messages preceded by a forged copy: same svix-id, a
    #   tampered body (type email.complained), signed with a wrong secret
    webhook_stale_rate: float = 0.0  # (runtime) messages preceded by a replayed copy with a genuine
    #   signature over a timestamp 10 minutes old
    webhook_future_rate: float = 0.0  # (runtime) ... over a timestamp 10 minutes ahead
    clock: Any = time.time  # () -> epoch seconds

    def __post_init__(self) -> None:
        self.api_keys = tuple(self.api_keys)
        self.bounce = tuple(a.strip().lower() for a in self.bounce)
        self.complain = tuple(a.strip().lower() for a in self.complain)
        self.suppress = tuple(a.strip().lower() for a in self.suppress)
        self.fail = tuple(a.strip().lower() for a in self.fail)
        self.soft_bounce = tuple(a.strip().lower() for a in self.soft_bounce)
        self.delayed = tuple(a.strip().lower() for a in self.delayed)
        self.webhook_secrets = tuple(self.webhook_secrets)
        self.webhook_events = tuple(self.webhook_events)
        self.webhook_retry_schedule = tuple(float(s) for s in self.webhook_retry_schedule)
        self.restricted_keys = tuple(self.restricted_keys)
        self.revoked_keys = tuple(self.revoked_keys)

    def public(self) -> dict[str, Any]:
        """The JSON-serialisable settings (everything but ``clock``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "clock"}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


_RUNTIME = {
    "rate_limit", "quota_emails", "error_rate", "latency_ms", "latency_jitter_ms", "timeout_rate",
    "hang_seconds", "reset_after_accept_rate", "reset_mode", "strict_only", "scramble_order",
    "bounce", "complain", "retry_after_style", "store_bodies", "seed",
    "restricted_keys", "revoked_keys", "check_from_domain", "test_only", "owner_email", "suppress", "fail",
    "error_after_rate", "error_after_status", "outage",
    "date_skew_seconds", "retry_after_value", "rate_limited_rate",
    "soft_bounce", "delayed", "hard_bounce_rate", "soft_bounce_rate", "failed_rate", "delayed_rate",
    "complaint_rate", "open_rate", "click_rate", "event_spread_seconds",
    "webhook_url", "webhook_secrets", "webhook_events", "webhook_retry_schedule", "webhook_time_scale",
    "webhook_timeout_seconds", "webhook_duplicate_rate", "webhook_reorder_rate", "webhook_delay_rate",
    "webhook_delay_seconds", "webhook_latency_min_seconds", "webhook_latency_max_seconds", "webhook_drop_rate", "webhook_forged_rate", "webhook_stale_rate",
    "webhook_future_rate",
}
RUNTIME_SETTINGS = frozenset(_RUNTIME)
"""The settings ``POST /_emulator/config`` may change."""
_ADDRESS_LISTS = ("bounce", "complain", "suppress", "fail", "soft_bounce", "delayed")
_CHOICES = {"reset_mode": ("abort", "hang"), "retry_after_style": ("seconds", "fraction", "http-date"),
            "error_after_status": (500, 502, 503, 504)}


def coerce_update(cfg: EmulatorConfig, update: dict[str, Any]) -> EmulatorConfig:
    """Return ``cfg`` with a partial ``update`` applied; ValueError on an unknown key or bad value."""
    changes: dict[str, Any] = {}
    for key, value in update.items():
        if key not in _RUNTIME:
            raise ValueError(f"unknown or read-only setting {key!r}")
        if key in (*_ADDRESS_LISTS, "restricted_keys", "revoked_keys", "webhook_secrets", "webhook_events"):
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(a, str) for a in items):
                raise ValueError(f"{key} must be a list of strings")
            if key in _ADDRESS_LISTS:
                items = [a.strip().lower() for a in items]
            if key == "webhook_secrets":
                for secret in items:
                    check_secret(secret)
            value = tuple(items)
        elif key == "webhook_url":
            if not isinstance(value, str) or (value and not value.startswith(("http://", "https://"))):
                raise ValueError("webhook_url must be an http(s) URL or empty")
        elif key == "webhook_retry_schedule":
            if (not isinstance(value, list | tuple) or not value
                    or not all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)):
                raise ValueError("webhook_retry_schedule must be a non-empty list of non-negative seconds")
            value = tuple(float(v) for v in value)
        elif key == "owner_email":
            if not isinstance(value, str) or check_address(value) is None:
                raise ValueError("owner_email must be an email address")
        elif key in ("strict_only", "scramble_order", "store_bodies", "check_from_domain", "test_only",
                     "outage"):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be a boolean")
        elif key == "retry_after_value":
            if not isinstance(value, str) or len(value) > 200:
                raise ValueError("retry_after_value must be a string (at most 200 characters)")
        elif key == "date_skew_seconds":
            if isinstance(value, bool) or not isinstance(value, int | float) or not abs(value) < 1e9:
                raise ValueError("date_skew_seconds must be a number of seconds (negative: behind)")
            value = float(value)
        elif key in _CHOICES:
            if value not in _CHOICES[key]:
                raise ValueError(f"{key} must be one of {_CHOICES[key]}")
        elif key in ("quota_emails", "seed"):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{key} must be a non-negative integer or null")
            if key == "seed" and value is None:
                raise ValueError("seed must be an integer")
        else:
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{key} must be a non-negative number")
            if key.endswith("_rate") and key != "rate_limit" and value > 1:
                raise ValueError(f"{key} is a fraction in [0, 1]")
            value = float(value)
        changes[key] = value
    new = replace(cfg, **changes)
    if new.hard_bounce_rate + new.soft_bounce_rate + new.failed_rate > 1.0:
        raise ValueError("hard_bounce_rate + soft_bounce_rate + failed_rate must be at most 1")
    return new


def check_secret(secret: str) -> None:
    """ValueError unless ``secret`` is ``whsec_`` plus non-empty base64 (the Svix secret format)."""
    if not isinstance(secret, str) or not secret.startswith("whsec_"):
        raise ValueError("a webhook secret is whsec_<base64>")
    try:
        raw = base64.b64decode(secret[len("whsec_"):] + "==", validate=False)
    except (binascii.Error, ValueError):
        raise ValueError("a webhook secret is whsec_<base64>") from None
    if not raw:
        raise ValueError("a webhook secret is whsec_<base64> with at least one byte")
