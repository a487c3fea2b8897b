"""HTTP client for a Resend-compatible email API: batches, pacing, retries, idempotency.

Contract (``shared/reference/resend-contract.md`` and Resend's docs on batch sending, idempotency
keys and rate limits):

* ``POST /emails/batch`` with 1-100 emails, ``x-batch-validation`` (``permissive`` by default here),
  ``Idempotency-Key`` (1-256 chars, kept 24 h). Every retry sends the same bytes under the same key.
* 429 ``rate_limit_exceeded``: wait ``retry-after`` (delta-seconds, fractional, or an HTTP-date
  measured against the response's own ``Date``; garbage or missing -> exponential backoff with
  full jitter) and push the shared schedule back for every sender. A wait above
  ``RetryPolicy.max_retry_after`` stops the run with an alert (``rate limited``, fatal) and holds
  the others only for the cap. Never wait past the run's deadline: not for a retry, and not for a
  first slot that another sender's 429 pushed back (:data:`SLOT_GRACE_SECONDS`).
* 429 ``daily_quota_exceeded`` / ``monthly_quota_exceeded``: not retried, the run stops.
* 5xx, timeouts, transport errors after the request was written: the outcome is *ambiguous*
  (Resend's error-code page: a 5xx is an infrastructure issue and says nothing about whether the
  batch was processed; an edge 502/504 can follow processing). Retried a bounded number of times
  with the same key and bytes; never reported as "not sent".
* 409 ``concurrent_idempotent_requests``: the same key is still in flight, so its outcome is
  unknown: retried later. 409 ``invalid_idempotent_request``: surfaced loudly, never resent
  under a fresh key.
* 401/403, 400/413/422 on the whole body, quota: refused as a whole, will be refused again: the run
  stops at once (see :func:`refused_request`); a 401/403 is named with its fix
  (``provider.errors.describe_refusal``: missing, restricted or invalid key, unverified domain,
  test-only account).

The classification (docs/model.md, "The outcome model"): a request is *proven not processed*
only when the provider's answer says so (:func:`refused_request`, 429, 409 concurrent on a first
attempt) or nothing was written (a connect error); everything else is ambiguous.
"""

from __future__ import annotations

import email.utils
import hashlib
import logging
import random
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from mailflow.model.apply_by_index import reconcile_by_index
from mailflow.model.clock import Clock, SystemClock
from mailflow.model.outcome import NotSent, Outcome, PreparedBatch, Refused, Unknown
from mailflow.provider.errors import describe_refusal
from mailflow.provider.pacing import DEFAULT_MAX_HOLD_SECONDS, Pacer, check_max_hold, late_tolerance

log = logging.getLogger(__name__)

QUOTA_ERRORS = frozenset({"daily_quota_exceeded", "monthly_quota_exceeded"})
#: Seconds the first request of a chunk may start after the deadline its caller passed (another
#: sender took the predicted or reserved slot: a few slots' spacing). A later first slot (the shared
#: schedule was pushed back by a 429) gives the chunk up, proven not processed, with "time budget".
#: Counted in ``orchestration.budgets.SETUP_SECONDS``.
SLOT_GRACE_SECONDS = 5.0


#: ``Retry-After`` as RFC 9110 delta-seconds, with a fraction tolerated (not in the RFC).
_DELTA_SECONDS = re.compile(r"[0-9]+(?:\.[0-9]+)?")
#: The largest wait :func:`parse_retry_after` returns (s): anything longer is equally "too long".
RETRY_AFTER_CEILING = 366 * 86400.0


def _http_date(text: str | None) -> datetime | None:
    """An RFC 9110 HTTP-date (IMF-fixdate; the obsolete RFC 850 and asctime forms as far as
    :func:`email.utils.parsedate_to_datetime` reads them) as an aware UTC datetime, or None."""
    if not text:
        return None
    try:
        when = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None:
        return None
    # HTTP-dates are always GMT (RFC 9110 section 5.6.7); "-0000" parses naive
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when


def parse_retry_after(value: str | None, clock: Clock, date: str | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 section 10.2.3), or None if unusable.

    :param value: the header: delta-seconds (``"2"``), a fraction (``"0.25"``, tolerated though not
        in the RFC) or an HTTP-date.
    :param clock: our clock; its ``now()`` is the reference for an HTTP-date only when ``date`` is
        absent or unusable.
    :param date: the same response's ``Date`` header. An HTTP-date is measured against it, not our
        clock: the provider's clock may run ahead or behind ours, and both headers come from it.
    :returns: seconds (0 <= s <= :data:`RETRY_AFTER_CEILING`); a date in the past is 0. None for
        garbage, a sign, an exponent, NaN or infinity (the caller then backs off with jitter).
        Never raises. The caller decides whether the wait is acceptable (``RetryPolicy.max_retry_after``).
    """
    if value is None:
        return None
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        seconds = float(text)  # many digits overflow to inf: clamped below
    else:
        when = _http_date(text)
        if when is None:
            return None
        reference = _http_date(date) or clock.now()
        try:
            seconds = (when - reference).total_seconds()
        except OverflowError:
            return RETRY_AFTER_CEILING
    if seconds != seconds:
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_CEILING)


def key_identity(api_key: str) -> str:
    """A non-secret identity of an API key: ``key#<16 hex>``, e.g. ``key#3f2a9c0e5b7d4e1f``.

    The hex is the first 16 of sha256(``"mailflow-key-id:" + api_key``): stable, the same for the
    same key, and it reveals nothing usable about the key (a salted prefix of a hash). Stored with
    every batch (``mail.send_batch.key_identity``): the provider scopes idempotency keys per API key,
    so an ambiguous batch may only be resent under the key it was first sent with (docs/operations.md,
    "Rotating the API key"). The base URL is deliberately not part of it: a key belongs to one
    account whatever URL reaches it (a proxy, a moved endpoint, an emulator restarted on another
    port keeps its idempotency memory), and the account's rate limit and breaker are keyed by the
    base URL already.
    """
    digest = hashlib.sha256(("mailflow-key-id:" + api_key).encode("utf-8")).hexdigest()
    return f"key#{digest[:16]}"


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: at most ``max_attempts`` requests per batch; backoff ``base * 2**(n-1)``
    seconds capped at ``cap``, with full jitter (AWS architecture blog, "Exponential Backoff And
    Jitter"); a Retry-After above ``max_retry_after`` seconds stops the run with an alert instead of
    waiting, and holds the shared schedule only ``max_retry_after`` seconds.

    :raises ValueError: if ``max_retry_after`` is not in ``(0, pacing.MAX_HOLD_SECONDS]`` (120 s).
    """

    max_attempts: int = 5
    base: float = 0.5
    cap: float = 20.0
    max_retry_after: float = DEFAULT_MAX_HOLD_SECONDS

    def __post_init__(self) -> None:
        check_max_hold(self.max_retry_after)

    def backoff(self, attempt: int, rng: random.Random) -> float:
        return rng.uniform(0, min(self.cap, self.base * 2 ** (attempt - 1)))


class ResendClient:
    """Sends batches to a Resend-compatible API through one pooled ``httpx.Client``.

    :param base_url: API root, e.g. ``https://api.resend.com``.
    :param api_key: the secret key (from the connection's password; never logged).
    :param pacer: the shared slot schedule (requests/s cap).
    :param validation: ``permissive`` (per-index errors) or ``strict`` (x-batch-validation).
    :param timeout: httpx timeout (seconds): connect, read, write, pool.
    :param conn_id: named in error messages (which Airflow connection to fix).
    """

    def __init__(self, base_url: str, api_key: str, *, pacer: Pacer, clock: Clock | None = None,
                 validation: str = "permissive", timeout: httpx.Timeout | None = None,
                 policy: RetryPolicy | None = None, rng: random.Random | None = None,
                 transport: httpx.BaseTransport | None = None, conn_id: str = "resend_default"):
        if validation not in ("permissive", "strict"):
            raise ValueError(f"batch validation must be 'permissive' or 'strict', got {validation!r}")
        self.pacer = pacer
        self.clock = clock or SystemClock()
        self.validation = validation
        self.policy = policy or RetryPolicy()
        self.rng = rng or random.Random()
        self.conn_id = conn_id
        self.key_identity = key_identity(api_key)
        """Non-secret identity of this client's key (:func:`key_identity`); stored with each batch."""
        self.stats = {"requests": 0, "429": 0, "5xx": 0, "timeouts": 0, "replays": 0, "late_slots": 0,
                      "pacing_wait_ms": 0}
        """Counts of this client's batch sends: requests made, their 429s, 5xx and timeouts, late
        reserved slots, and ``pacing_wait_ms``: the milliseconds it slept for its request slots of the
        shared schedule (the pacer's spacing and every 429's push-back), not the retry backoffs."""
        self.http = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "mailflow/0.1"},
            timeout=timeout or httpx.Timeout(connect=5.0, read=30.0, write=30.0, pool=5.0),
            limits=httpx.Limits(max_connections=4, max_keepalive_connections=4),
            transport=transport,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ResendClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ---------------------------------------------------------------------------------
    def get(self, path: str, **params: Any) -> Any:
        """GET a JSON resource (``/domains``, ``/emails/{id}``, ``/emails``); raises httpx.HTTPStatusError."""
        resp = self.http.get(path, params=params or None)
        resp.raise_for_status()
        return resp.json()

    def probe_send(self) -> int:
        """POST ``/emails/batch`` with an empty array and no Idempotency-Key: a request to the
        sending path that can send nothing (a batch holds 1-100 emails, so the provider refuses it
        with a validation error). The circuit breaker's probe for a key that may not read (a
        sending-only key answers every read 401 ``restricted_api_key``, outage or not). Returns the
        status; raises httpx.HTTPError for a transport failure."""
        resp = self.http.post("/emails/batch", content=b"[]",
                              headers={"Content-Type": "application/json", "x-batch-validation": "strict"})
        return resp.status_code

    # -- the batch send ------------------------------------------------------------------------
    def late_tolerance(self) -> float:
        """Seconds a reserved slot may have passed and still be used: half the slack that pacing at
        ``target_fraction`` f leaves in the provider's 1 s window, ``(1/f - 1) / 2`` (125 ms at 0.8,
        26 ms at 0.95); the other half is left for network jitter."""
        return late_tolerance(float(getattr(self.pacer, "target_fraction", 0.8)))

    def _claim(self) -> float:
        """Claim the next slot of the shared schedule; return its ``clock.monotonic()`` start. The
        pacer's wait counts from its return (a slow pacer database does not shift the start)."""
        wait = self.pacer.claim()
        return self.clock.monotonic() + wait

    def reserve_slot(self, deadline: float) -> float | None:
        """Claim the next request slot of the shared schedule, before a chunk is minted.

        :param deadline: ``clock.monotonic()`` value of the run's time budget.
        :returns: the ``clock.monotonic()`` time at which the slot starts, or None when it starts
            after ``deadline`` (then nothing should be minted: a minted chunk is always sent).
        """
        start = self._claim()
        return None if start > deadline else start

    def peek_slot(self, deadline: float) -> float | None:
        """Predict when the next request slot of the shared schedule starts, without claiming it.

        :param deadline: ``clock.monotonic()`` value of the run's time budget.
        :returns: the predicted ``clock.monotonic()`` start, or None when it is after ``deadline``.
            A pacer without ``peek`` predicts "now".
        """
        peek = getattr(self.pacer, "peek", None)
        start = self.clock.monotonic() + (float(peek()) if peek is not None else 0.0)
        return None if start > deadline else start

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None, *,
                   claim_at_send: bool = False) -> Outcome:
        """Send one prepared batch; return what is known about its delivery.

        :param deadline: ``clock.monotonic()`` value after which no new wait or retry starts.
        :param slot: a slot from :meth:`reserve_slot`: the first attempt starts then, whatever the
            deadline (the budget was checked when the slot was reserved, before minting). If it
            passed by more than :meth:`late_tolerance`, a new slot is claimed.
        :param claim_at_send: claim the first attempt's slot now, here (the budget was checked
            before minting with :meth:`peek_slot`): the pipelined engine's way, so no hand-over
            between threads can make the slot late.
            A first slot claimed here (or claimed again for a late reserved slot) that starts more
            than :data:`SLOT_GRACE_SECONDS` after ``deadline`` (or after now, if that is later: a
            chunk whose preparation overran the deadline) (the schedule was pushed back by a
            429, maybe another sender's) is not waited for: the batch is given up as not sent
            (``time budget``; an ambiguous batch stays ambiguous).
        :returns: :class:`Accepted` (reconciled by index), :class:`NotSent` (proven not processed;
            always with ``stop_run``), :class:`Refused` (strict validation refused the whole
            request; nothing processed) or :class:`Unknown` (maybe processed). Never raises for HTTP
            or transport failures.
        """
        validation = batch.validation or self.validation
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": batch.idempotency_key,
            "x-batch-validation": validation,
        }
        n = len(batch.row_ids)
        maybe_delivered = False
        last = "no attempt made"

        def give_up(reason: str, *, stop: str, fatal: bool = False) -> Outcome:
            if maybe_delivered:
                return Unknown(reason=f"{reason}; an earlier attempt may have been processed",
                               stop_run=stop, fatal=fatal)
            return NotSent(reason=reason, stop_run=stop, fatal=fatal)

        rate_limited = False  # the last answer was a 429 rate_limit_exceeded
        for attempt in range(1, self.policy.max_attempts + 1):
            if attempt == 1 and slot is not None and not claim_at_send \
                    and self.clock.monotonic() - slot <= self.late_tolerance():
                start = slot
            else:
                if attempt == 1 and slot is not None and not claim_at_send:
                    # The reserved slot passed while the chunk was being prepared. Starting now would
                    # crowd the provider's window (docs/operations.md "The shared rate"): take the
                    # next slot instead.
                    self.stats["late_slots"] += 1
                start = self._claim()  # the slot is claimed before any wait or I/O
                # a minted chunk's first attempt may start a few slots past the deadline (or past now,
                # if preparing it overran the deadline), never a shared hold past it
                limit = max(deadline, self.clock.monotonic()) + SLOT_GRACE_SECONDS if attempt == 1 else deadline
                if start > limit:
                    why = "rate limited" if rate_limited else last
                    return give_up(f"time budget reached before attempt {attempt}: the next request slot starts "
                                   f"{start - deadline:.1f} s after the deadline ({why})", stop="time budget")
            wait = max(start - self.clock.monotonic(), 0.0)
            self.stats["pacing_wait_ms"] += round(wait * 1000)
            self.clock.sleep(wait)
            self.stats["requests"] += 1
            started = self.clock.monotonic()
            rate_limited = False
            try:
                resp = self.http.post("/emails/batch", content=batch.body, headers=headers)
            except httpx.ConnectError as exc:  # nothing was written: certainly not processed
                last = f"connection failed: {exc}"
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                # connect/pool timeouts never reached the server; anything later may have been processed
                self.stats["timeouts"] += 1
                if not isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    maybe_delivered = True
                last = f"{type(exc).__name__}: {exc or 'no response'}"
            else:
                self.pacer.observe(resp.headers, since_start=self.clock.monotonic() - started)
                status = resp.status_code
                name, message = error_fields(resp)
                if 200 <= status < 300:
                    try:
                        payload = resp.json()
                    except ValueError:
                        return Unknown(reason=f"2xx with a body that is not JSON: {resp.text[:200]!r}")
                    return reconcile_by_index(n, payload)
                last = f"HTTP {status} {name}: {message}"
                if is_strict_refusal(status, name, validation) and not maybe_delivered:
                    return Refused(reason=last)
                refused = refused_request(status, name, message, self.conn_id)
                if refused is not None:
                    return give_up(refused.reason, stop=refused.stop, fatal=refused.fatal)
                if status == 429:
                    self.stats["429"] += 1
                    rate_limited = True
                    header = resp.headers.get("retry-after")
                    delay = parse_retry_after(header, self.clock, resp.headers.get("date"))
                    if delay is None:
                        delay = self.policy.backoff(attempt, self.rng)
                    cap = self.policy.max_retry_after
                    # every sender of the account waits, not just us; never longer than the cap
                    self.pacer.push_back(min(delay, cap))
                    if delay > cap:
                        asked = "over a year" if delay >= RETRY_AFTER_CEILING else f"{delay:.0f} s"
                        log.error("%s asked every sender to wait %s (Retry-After %r, Date %r), above the "
                                  "%g s cap: the run stops; the shared schedule is held %g s", self.conn_id,
                                  asked, header, resp.headers.get("date"), cap, cap)
                        return give_up(f"rate limited: the provider asked for a wait of {asked} "
                                       f"(Retry-After {header!r}), above the {cap:g} s cap ({last})",
                                       stop="rate limited", fatal=True)
                    if self.clock.monotonic() + delay > deadline:
                        return give_up(f"time budget reached while rate limited ({last})", stop="time budget")
                    continue  # the next claim lands after the pushed-back schedule
                if status == 409 and name == "concurrent_idempotent_requests":
                    maybe_delivered = True  # the first request with this key is still in flight
                elif status == 409:
                    return Unknown(reason=f"idempotency conflict, not resent under a new key: {last}",
                                   stop_run="idempotency conflict", fatal=True)
                else:
                    # any 5xx (an edge 502/504 can follow processing) or another status: ambiguous
                    if status >= 500:
                        self.stats["5xx"] += 1
                    maybe_delivered = True
            if attempt < self.policy.max_attempts:
                delay = self.policy.backoff(attempt, self.rng)
                if self.clock.monotonic() + delay > deadline:
                    return give_up(f"time budget reached while retrying ({last})", stop="time budget")
                self.clock.sleep(delay)
        stop = "provider unavailable" if maybe_delivered else "rate limited" if rate_limited else "provider unreachable"
        return give_up(f"gave up after {self.policy.max_attempts} attempts: {last}", stop=stop)


VALIDATION_ERRORS = frozenset({"validation_error", "invalid_parameter", "missing_required_field",
                               "invalid_from_address", "invalid_attachment"})


def is_strict_refusal(status: int, name: str, validation: str) -> bool:
    """A strict-mode batch refused by validation: ``x-batch-validation: strict`` answered 400/422
    with a validation name (Resend, batch validation modes: "any invalid email fails the whole
    request; nothing is sent"). Its message names no index (Resend documents none), so it is never
    parsed for one: the caller re-sends the chunk permissive under a new key."""
    return validation == "strict" and status in (400, 422) and name in VALIDATION_ERRORS


@dataclass(frozen=True)
class RequestRefusal:
    """A whole-request refusal that will repeat: ``stop`` is the run's stop reason, ``reason`` the
    message for people (names the connection to fix), ``fatal`` fails the task (an alert)."""

    stop: str
    reason: str
    fatal: bool = True


def auth_refusal(status: int, name: str, message: str, conn_id: str) -> RequestRefusal:
    """401/403 (Resend's error-code page: 401 ``missing_api_key`` / ``restricted_api_key``, 403
    ``invalid_api_key`` and 403 ``validation_error`` for an unverified ``from`` domain or a
    test-only account): proven not processed, charges no user, stops the run at once with an alert.
    The stop reason and message (cause and fix, naming the connection) come from
    :func:`mailflow.provider.errors.describe_refusal`."""
    refusal = describe_refusal(status, name, message, conn_id)
    return RequestRefusal(stop=refusal.kind, reason=refusal.message)


def refused_request(status: int, name: str, message: str, conn_id: str) -> RequestRefusal | None:
    """Classify an answer that proves the whole request was NOT processed and will be refused again.

    Sources: Resend's error-code page and the rate-limit / quota pages. Returns a :class:`RequestRefusal`
    for 401/403 (:func:`auth_refusal`), 429 ``daily_quota_exceeded`` / ``monthly_quota_exceeded``,
    400/413/422 on the whole body (a body the provider refuses; ``invalid_idempotency_key`` too),
    else None (429 rate limits, 409 and everything ambiguous are handled by the caller).
    """
    if status in (401, 403):
        return auth_refusal(status, name, message, conn_id)
    if status == 429 and name in QUOTA_ERRORS:
        return RequestRefusal(stop=name, reason=f"provider quota exhausted: HTTP {status} {name}: {message}")
    if status in (400, 413, 422):
        return RequestRefusal(stop="request refused",
                       reason=f"provider refused the whole request: HTTP {status} {name}: {message}")
    return None


def error_fields(resp: httpx.Response) -> tuple[str, str]:
    """``(name, message)`` of a Resend error body; tolerant of non-JSON bodies."""
    if resp.status_code < 400:
        return "", ""
    try:
        body = resp.json()
    except ValueError:
        return "unknown_error", resp.text[:200]
    if not isinstance(body, dict):
        return "unknown_error", str(body)[:200]
    return str(body.get("name") or "unknown_error"), str(body.get("message") or "")
