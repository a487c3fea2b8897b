"""HTTP client for a Resend-compatible email API: batches, pacing, retries, idempotency.

Contract (``shared/reference/resend-contract.md`` and Resend's docs on batch sending, idempotency
keys and rate limits):

* ``POST /emails/batch`` with 1-100 emails, ``x-batch-validation`` (``permissive`` by default here),
  ``Idempotency-Key`` (1-256 chars, kept 24 h). Every retry sends the same bytes under the same key.
* 429 ``rate_limit_exceeded``: wait ``retry-after`` (delta-seconds, fractional, or HTTP-date;
  garbage or missing -> exponential backoff with full jitter) and push the shared schedule back
  for every sender. Never wait past the run's deadline.
* 429 ``daily_quota_exceeded`` / ``monthly_quota_exceeded``: not retried, the run stops.
* 5xx, timeouts, transport errors: retried a bounded number of times (same key, same bytes).
  A timeout or a connection lost after the request was written makes the outcome *ambiguous*.
* 409 ``concurrent_idempotent_requests``: retried later. 409 ``invalid_idempotent_request``:
  surfaced loudly, never resent under a fresh key.
* 401/403: stop at once, naming the connection and the fix (``provider.errors.describe_refusal``:
  missing, restricted or invalid key, unverified domain, test-only account).
"""

from __future__ import annotations

import email.utils
import logging
import random
import re
from dataclasses import dataclass
from typing import Any

import httpx

from mailflow.clock import Clock, SystemClock
from mailflow.model import NotSent, Outcome, PreparedBatch, Refused, Unknown
from mailflow.provider.errors import describe_refusal
from mailflow.provider.pacing import Pacer
from mailflow.reconcile import reconcile_by_index

log = logging.getLogger(__name__)

QUOTA_ERRORS = frozenset({"daily_quota_exceeded", "monthly_quota_exceeded"})


def parse_retry_after(value: str | None, clock: Clock) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (RFC 9110 section 10.2.3), or None if unusable.

    Accepts delta-seconds (``"2"``), a fraction (``"0.25"``, tolerated though not in the RFC) or an
    HTTP-date (measured against ``clock.now()``). Negative, NaN, infinite or garbage -> None.
    """
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when is None or when.tzinfo is None:
            return None
        seconds = (when - clock.now()).total_seconds()
        return max(seconds, 0.0)
    if seconds != seconds or seconds in (float("inf"), float("-inf")) or seconds < 0:
        return None
    return seconds


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries: at most ``max_attempts`` requests per batch; backoff ``base * 2**(n-1)``
    seconds capped at ``cap``, with full jitter (AWS architecture blog, "Exponential Backoff And
    Jitter"); a Retry-After above ``max_retry_after`` seconds stops the run instead of waiting."""

    max_attempts: int = 5
    base: float = 0.5
    cap: float = 20.0
    max_retry_after: float = 60.0

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
        self.stats = {"requests": 0, "429": 0, "5xx": 0, "timeouts": 0, "replays": 0}
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

    # -- the batch send ------------------------------------------------------------------------
    def send_batch(self, batch: PreparedBatch, deadline: float) -> Outcome:
        """Send one prepared batch; return what is known about its delivery.

        :param deadline: ``clock.monotonic()`` value after which no new wait or attempt starts.
        :returns: Accepted (reconciled by index), NotSent (certainly nothing delivered) or Unknown
            (maybe delivered). Never raises for HTTP or transport failures.
        """
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": batch.idempotency_key,
            "x-batch-validation": self.validation,
        }
        n = len(batch.row_ids)
        maybe_delivered = False
        last = "no attempt made"

        def give_up(reason: str, *, stop: str | None = None, fatal: bool = False) -> Outcome:
            if maybe_delivered:
                return Unknown(reason=f"{reason}; an earlier attempt may have been accepted",
                               stop_run=stop, fatal=fatal)
            return NotSent(reason=reason, stop_run=stop, fatal=fatal)

        for attempt in range(1, self.policy.max_attempts + 1):
            wait = self.pacer.claim()  # the slot is claimed before any wait or I/O
            if self.clock.monotonic() + wait > deadline:
                return give_up(f"time budget reached before attempt {attempt} ({last})", stop="time budget")
            self.clock.sleep(wait)
            self.stats["requests"] += 1
            try:
                resp = self.http.post("/emails/batch", content=batch.body, headers=headers)
            except httpx.ConnectError as exc:  # nothing was written: certainly not delivered
                last = f"connection failed: {exc}"
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                # connect timeouts never reached the server; anything later may have been accepted
                self.stats["timeouts"] += 1
                if not isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    maybe_delivered = True
                last = f"{type(exc).__name__}: {exc or 'no response'}"
            else:
                self.pacer.observe(resp.headers)
                status = resp.status_code
                name, message = _error_fields(resp)
                if 200 <= status < 300:
                    try:
                        payload = resp.json()
                    except ValueError:
                        return Unknown(reason=f"2xx with a body that is not JSON: {resp.text[:200]!r}")
                    return reconcile_by_index(n, payload)
                last = f"HTTP {status} {name}: {message}"
                if status in (401, 403):  # key, permission or domain: each named with its fix
                    refusal = describe_refusal(status, name, message, self.conn_id)
                    return give_up(refusal.message, stop=refusal.kind, fatal=True)
                if status == 429 and name in QUOTA_ERRORS:
                    return give_up(f"provider quota exhausted: {last}", stop=name)
                if status == 429:
                    self.stats["429"] += 1
                    delay = parse_retry_after(resp.headers.get("retry-after"), self.clock)
                    if delay is None:
                        delay = self.policy.backoff(attempt, self.rng)
                    if delay > self.policy.max_retry_after:
                        self.pacer.push_back(delay)
                        return give_up(f"rate limited for {delay:.0f} s: {last}", stop="rate limited")
                    self.pacer.push_back(delay)  # every sender of the account waits, not just us
                    if self.clock.monotonic() + delay > deadline:
                        return give_up(f"time budget reached while rate limited ({last})", stop="time budget")
                    continue  # the next claim lands after the pushed-back schedule
                if status == 409 and name == "concurrent_idempotent_requests":
                    maybe_delivered = True  # the first request with this key is still in flight
                elif status == 409:
                    return Unknown(reason=f"idempotency conflict, not resent under a new key: {last}", fatal=True)
                elif status >= 500:
                    self.stats["5xx"] += 1
                else:
                    # 4xx other than the above: the request as a whole was refused; nothing sent.
                    # Strict validation names the offending email: that row fails, the rest go again.
                    index = _named_index(message, n)
                    if index is not None and not maybe_delivered:
                        return Refused(rejected={index: message}, reason=last)
                    return give_up(f"request refused: {last}")
            if attempt < self.policy.max_attempts:
                delay = self.policy.backoff(attempt, self.rng)
                if self.clock.monotonic() + delay > deadline:
                    return give_up(f"time budget reached while retrying ({last})", stop="time budget")
                self.clock.sleep(delay)
        return give_up(f"gave up after {self.policy.max_attempts} attempts: {last}")


_INDEX = re.compile(r"(?:emails)?\[(\d+)\]")


def _named_index(message: str, size: int) -> int | None:
    """The request index a strict-mode validation message names (``emails[2]: ...``), if any."""
    m = _INDEX.search(message)
    if m is None:
        return None
    index = int(m.group(1))
    return index if 0 <= index < size else None


def _error_fields(resp: httpx.Response) -> tuple[str, str]:
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
