"""Request pacing: one provider rate limit shared by every process, run and worker that sends.

Each request claims its start slot *before* any wait or I/O. Slots are spaced
``1 / (rate * target_fraction * (1 - penalty))`` seconds apart, where

* ``rate`` = ``least(configured requests_per_second, learned limit)``. The learned limit is the
  provider's latest ``ratelimit-limit`` header (Resend: requests per second per team, "the header is
  the truth", shared/reference/resend-contract.md "Rate limits"). The configured value is the
  operator's ceiling and the starting guess before any response was seen.
* ``target_fraction`` (0 < f <= 1, default 0.8) is the share of the cap we aim for. Under a sliding
  1 s window it leaves ``1/f - 1`` seconds of slack per window of ``limit`` requests (0.25 s at 0.8,
  53 ms at 0.95) for request-start jitter; see docs/performance.md "How the rate is chosen".
* ``penalty`` (0-0.5): each 429 ``rate_limit_exceeded`` lowers the shared rate by
  :data:`PENALTY_STEP` (at most once a second), decaying linearly back to 0 over
  :data:`PENALTY_RECOVERY_SECONDS` (additive-decrease, time-based recovery).

:class:`PostgresPacer` keeps the schedule *and what was learned* in ``mail.rate_slot`` (one row per
provider account, migration 0008) and claims with one atomic statement that computes the spacing
from that row, so a process that starts now paces at the learned rate from its first request and
four processes on four workers share one cap. :class:`LocalPacer` is the in-process equivalent for
a single sender (tests, tools).

``ratelimit-remaining: 0`` holds the schedule until ``min(ratelimit-reset, 1 / limit)`` seconds after
the START of the request that saw it (the window was counted when it arrived): the header's reset
is whole seconds (Resend, IETF RateLimit fields), and in a paced stream the oldest request of a
full window leaves it within about one slot at the full cap; waiting the whole reset would halve
the rate at a target fraction near 1. Counted from the response instead, the hold added the
request's latency to every full window: at 0.95 ten requests span 945 ms, so every window is full,
and 1M-user runs lost a tenth of their slots to it (issue 16). A real overshoot answers 429, which waits
Retry-After and lowers the shared rate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import psycopg

from mailflow.sendloop.clock import Clock, SystemClock
from mailflow.store.sql import query

log = logging.getLogger(__name__)

#: Share of the cap one 429 ``rate_limit_exceeded`` takes off the shared rate.
PENALTY_STEP = 0.1
#: The largest total penalty (the rate never drops below half the learned cap x fraction).
MAX_PENALTY = 0.5
#: Seconds over which a penalty decays linearly back to 0.
PENALTY_RECOVERY_SECONDS = 600.0


class Pacer(Protocol):
    """Claims request start slots for one provider account."""

    def claim(self) -> float:
        """Claim the next slot; return seconds (>= 0) to wait before starting the request."""
        ...

    def push_back(self, seconds: float) -> None:
        """A 429 ``rate_limit_exceeded``: every sender of the account waits ``seconds`` from now
        before its next request, and the shared rate is lowered (see the module docstring)."""
        ...

    def observe(self, headers: Mapping[str, str], since_start: float = 0.0) -> None:
        """Learn from the provider's ``ratelimit-*`` response headers of a request that started
        ``since_start`` seconds ago (the ``ratelimit-remaining: 0`` hold counts from its start)."""
        ...


def spacing_for(requests_per_second: float, target_fraction: float, penalty: float = 0.0) -> float:
    """Seconds between request starts for a cap (requests/s), the fraction of it to use, and the
    429 penalty in force (0 <= penalty <= :data:`MAX_PENALTY`).

    :raises ValueError: if the cap is not positive or the fraction is outside (0, 1].
    """
    if requests_per_second <= 0:
        raise ValueError(f"requests_per_second must be > 0, got {requests_per_second}")
    if not 0 < target_fraction <= 1:
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction}")
    return 1.0 / (requests_per_second * target_fraction * (1.0 - min(max(penalty, 0.0), MAX_PENALTY)))


def parse_limit(headers: Mapping[str, str]) -> float | None:
    """The ``ratelimit-limit`` header as requests/s (> 0), or None if absent or unusable."""
    try:
        limit = float(headers.get("ratelimit-limit", "") or 0)
    except ValueError:
        return None
    if limit != limit or limit <= 0 or limit == float("inf"):
        return None
    return limit


def remaining_zero_hold(headers: Mapping[str, str], limit: float) -> float | None:
    """Seconds to hold the schedule for ``ratelimit-remaining: 0``: ``min(ratelimit-reset, 1/limit)``;
    None if the window is not full or the reset is unusable (absent, garbage, <= 0 or > 60 s)."""
    remaining, reset = headers.get("ratelimit-remaining"), headers.get("ratelimit-reset")
    if remaining is None or remaining.strip() != "0" or not reset:
        return None
    try:
        seconds = float(reset)
    except ValueError:
        return None
    if not 0 < seconds <= 60:
        return None
    return min(seconds, 1.0 / limit)


class PostgresPacer:
    """Shared slot schedule and learned rate in PostgreSQL (``mail.rate_slot``).

    :param connect: returns a new psycopg connection to the send-log database (used in autocommit).
    :param account: the provider account the cap belongs to (Resend: per team), e.g. the API host.
    :param requests_per_second: the operator's ceiling and first guess (Resend docs have said 2, 5
        and 10: configuration); a lower learned ``ratelimit-limit`` of the account wins.
    :param target_fraction: fraction of the cap to use (0 < f <= 1, default 0.8).

    ``requests_per_second`` and ``spacing`` are updated from the database at every claim.
    """

    def __init__(self, connect: Callable[[], psycopg.Connection], account: str,
                 requests_per_second: float, target_fraction: float = 0.8):
        self.account = account
        self.configured = requests_per_second
        self.requests_per_second = requests_per_second
        self.target_fraction = target_fraction
        self.spacing = spacing_for(requests_per_second, target_fraction)
        self.learned_limit: float | None = None
        self._connect = connect
        self._conn: psycopg.Connection | None = None
        # one connection, used by the engine's thread (reserve_slot) and by the pipelined send's
        # background thread (claim, observe, push_back): one statement at a time
        self._lock = threading.RLock()

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._conn.autocommit = True
        return self._conn

    def claim(self) -> float:
        with self._lock:
            row = self._db().execute(query("pacing", "claim_slot"),
                                     {"account": self.account, "rps": float(self.configured),
                                      "fraction": float(self.target_fraction),
                                      "recovery": PENALTY_RECOVERY_SECONDS}).fetchone()
        assert row is not None
        slot, db_now, spacing, learned = row
        self.spacing = float(spacing)
        self.learned_limit = None if learned is None else float(learned)
        self.requests_per_second = min(self.configured, self.learned_limit or self.configured)
        return max((slot - db_now).total_seconds(), 0.0)

    def peek(self) -> float:
        """Seconds (>= 0) until the account's next slot would start if claimed now; claims nothing
        (a read of ``mail.rate_slot``). The pipelined engine checks its budget with it."""
        with self._lock:
            row = self._db().execute(query("pacing", "peek_slot"), {"account": self.account}).fetchone()
        return max(float(row[0]), 0.0) if row is not None and row[0] is not None else 0.0

    def push_back(self, seconds: float) -> None:
        with self._lock:
            self._db().execute(query("pacing", "rate_limited"),
                               {"account": self.account, "seconds": float(seconds), "step": PENALTY_STEP,
                                "max_penalty": MAX_PENALTY, "recovery": PENALTY_RECOVERY_SECONDS})

    def observe(self, headers: Mapping[str, str], since_start: float = 0.0) -> None:
        limit = parse_limit(headers)
        if limit is not None and limit != self.learned_limit:
            if limit < self.configured:
                log.warning("provider reports a limit of %s requests/s on %s, below the configured %s: "
                            "every sender of the account adopts it", limit, self.account, self.configured)
            with self._lock:
                self._db().execute(query("pacing", "observe_limit"), {"account": self.account, "limit": limit})
            self.learned_limit = limit
            self.requests_per_second = min(self.configured, limit)
            self.spacing = spacing_for(self.requests_per_second, self.target_fraction)
        hold = remaining_zero_hold(headers, self.learned_limit or self.requests_per_second)
        if hold is not None and hold > since_start:
            with self._lock:
                self._db().execute(query("pacing", "push_back"), {"account": self.account,
                                                                  "seconds": hold - since_start})

    def learned(self) -> dict[str, object] | None:
        """The account's row: ``limit_per_second`` (requests/s or None), ``penalty_now`` (0-0.5),
        ``rate_limited_total``, ``last_rate_limited_at``, ``spacing`` (s), ``next_slot``; None if
        no sender has used the account yet."""
        with self._lock:
            cur = self._db().execute(query("pacing", "learned"),
                                     {"account": self.account, "recovery": PENALTY_RECOVERY_SECONDS})
            row = cur.fetchone()
        if row is None:
            return None
        return dict(zip([d.name for d in cur.description or ()], row, strict=True))

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()


class LocalPacer:
    """In-process slot schedule (thread-safe) for a single sender; same rules as PostgresPacer,
    on ``clock.monotonic()``."""

    def __init__(self, requests_per_second: float, target_fraction: float = 0.8, clock: Clock | None = None):
        self.configured = requests_per_second
        self.requests_per_second = requests_per_second
        self.target_fraction = target_fraction
        self.spacing = spacing_for(requests_per_second, target_fraction)
        self.learned_limit: float | None = None
        self.rate_limited_total = 0
        self.clock = clock or SystemClock()
        self._penalty = 0.0
        self._penalty_at = float("-inf")
        self._next = float("-inf")
        self._lock = threading.Lock()

    def penalty_now(self) -> float:
        """The 429 penalty in force now (0-0.5), after its linear decay."""
        age = self.clock.monotonic() - self._penalty_at
        return self._penalty * max(0.0, 1.0 - age / PENALTY_RECOVERY_SECONDS)

    def claim(self) -> float:
        with self._lock:
            now = self.clock.monotonic()
            self.spacing = spacing_for(self.requests_per_second, self.target_fraction, self.penalty_now())
            slot = max(self._next, now)
            self._next = slot + self.spacing
            return slot - now

    def peek(self) -> float:
        """Seconds (>= 0) until the next slot would start if claimed now; claims nothing."""
        with self._lock:
            return max(self._next - self.clock.monotonic(), 0.0)

    def _hold(self, seconds: float) -> None:
        with self._lock:
            self._next = max(self._next, self.clock.monotonic() + seconds)

    def push_back(self, seconds: float) -> None:
        self._hold(seconds)
        with self._lock:
            now = self.clock.monotonic()
            self.rate_limited_total += 1
            if now - self._penalty_at >= 1.0:
                self._penalty = min(MAX_PENALTY, self.penalty_now() + PENALTY_STEP)
                self._penalty_at = now

    def observe(self, headers: Mapping[str, str], since_start: float = 0.0) -> None:
        limit = parse_limit(headers)
        if limit is not None and limit != self.learned_limit:
            if limit < self.configured:
                log.warning("provider reports a limit of %s requests/s, below the configured %s: adopting it",
                            limit, self.configured)
            self.learned_limit = limit
            self.requests_per_second = min(self.configured, limit)
            self.spacing = spacing_for(self.requests_per_second, self.target_fraction, self.penalty_now())
        hold = remaining_zero_hold(headers, self.learned_limit or self.requests_per_second)
        if hold is not None and hold > since_start:
            self._hold(hold - since_start)
