"""Request pacing: one provider rate limit shared by every process, run and worker that sends.

Each request claims its start slot *before* any wait or I/O. Slots are spaced
``1 / (requests_per_second * target_fraction)`` seconds apart (default 0.8 of the cap, headroom
for clock jitter and other API users). :class:`PostgresPacer` keeps the schedule in
``mail.rate_slot`` (one row per provider account) and claims with one atomic statement, so four
processes on four workers share one cap; :class:`LocalPacer` is the in-process equivalent for a
single sender (tests, tools).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol

import psycopg

from mailflow.clock import Clock, SystemClock
from mailflow.sql import query

log = logging.getLogger(__name__)


class Pacer(Protocol):
    """Claims request start slots for one provider account."""

    def claim(self) -> float:
        """Claim the next slot; return seconds (>= 0) to wait before starting the request."""
        ...

    def push_back(self, seconds: float) -> None:
        """Make every sender of the account wait ``seconds`` from now before its next request."""
        ...

    def observe(self, headers: Mapping[str, str]) -> None:
        """Adapt to the provider's ``ratelimit-*`` response headers."""
        ...


def spacing_for(requests_per_second: float, target_fraction: float) -> float:
    """Seconds between request starts for a cap (requests/s) and the fraction of it to use.

    :raises ValueError: if the cap is not positive or the fraction is outside (0, 1].
    """
    if requests_per_second <= 0:
        raise ValueError(f"requests_per_second must be > 0, got {requests_per_second}")
    if not 0 < target_fraction <= 1:
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction}")
    return 1.0 / (requests_per_second * target_fraction)


class _Adaptive:
    """Shared ``observe``: ``ratelimit-remaining: 0`` pushes back until ``ratelimit-reset``; a
    ``ratelimit-limit`` lower than configured lowers the rate (never raises it)."""

    requests_per_second: float
    target_fraction: float
    spacing: float

    def push_back(self, seconds: float) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def observe(self, headers: Mapping[str, str]) -> None:
        try:
            limit = float(headers.get("ratelimit-limit", "") or 0)
        except ValueError:
            limit = 0
        if 0 < limit < self.requests_per_second:
            log.warning("provider reports a limit of %s requests/s, lower than configured %s: adopting it",
                        limit, self.requests_per_second)
            self.requests_per_second = limit
            self.spacing = spacing_for(limit, self.target_fraction)
        remaining, reset = headers.get("ratelimit-remaining"), headers.get("ratelimit-reset")
        if remaining is not None and remaining.strip() == "0" and reset:
            try:
                seconds = float(reset)
            except ValueError:
                return
            if 0 < seconds <= 60:
                self.push_back(seconds)


class PostgresPacer(_Adaptive):
    """Shared slot schedule in PostgreSQL (``mail.rate_slot``).

    :param connect: returns a new psycopg connection to the send-log database (used in autocommit).
    :param account: the provider account the cap belongs to (Resend: per team), e.g. the API host.
    :param requests_per_second: the provider's cap (Resend docs have said 2, 5 and 10: configuration).
    :param target_fraction: fraction of the cap to use (0 < f <= 1, default 0.8).
    """

    def __init__(self, connect: Callable[[], psycopg.Connection], account: str,
                 requests_per_second: float, target_fraction: float = 0.8):
        self.account = account
        self.requests_per_second = requests_per_second
        self.target_fraction = target_fraction
        self.spacing = spacing_for(requests_per_second, target_fraction)
        self._connect = connect
        self._conn: psycopg.Connection | None = None

    def _db(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._conn.autocommit = True
        return self._conn

    def claim(self) -> float:
        row = self._db().execute(query("pacing", "claim_slot"),
                                 {"account": self.account, "spacing": self.spacing}).fetchone()
        assert row is not None
        slot, db_now = row
        return max((slot - db_now).total_seconds(), 0.0)

    def push_back(self, seconds: float) -> None:
        self._db().execute(query("pacing", "push_back"), {"account": self.account, "seconds": float(seconds)})

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class LocalPacer(_Adaptive):
    """In-process slot schedule (thread-safe) for a single sender; same rules as PostgresPacer."""

    def __init__(self, requests_per_second: float, target_fraction: float = 0.8, clock: Clock | None = None):
        self.requests_per_second = requests_per_second
        self.target_fraction = target_fraction
        self.spacing = spacing_for(requests_per_second, target_fraction)
        self.clock = clock or SystemClock()
        self._next = float("-inf")
        self._lock = threading.Lock()

    def claim(self) -> float:
        with self._lock:
            now = self.clock.monotonic()
            slot = max(self._next, now)
            self._next = slot + self.spacing
            return slot - now

    def push_back(self, seconds: float) -> None:
        with self._lock:
            self._next = max(self._next, self.clock.monotonic() + seconds)
