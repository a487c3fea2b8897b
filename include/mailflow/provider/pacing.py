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
and 1M-user runs lost a tenth of their slots to it. A real overshoot answers 429, which waits
Retry-After and lowers the shared rate.

**Every hold is bounded.** Nothing a provider says can hold the shared schedule longer than the
pacer's ``max_hold`` (default :data:`DEFAULT_MAX_HOLD_SECONDS`, configurable up to
:data:`MAX_HOLD_SECONDS`): ``push_back`` and the ``ratelimit-remaining`` hold are clamped in Python
and again in SQL (``least(seconds, max_hold)``), and a claim never takes a slot further than
``max_hold`` + :data:`QUEUE_SECONDS` ahead (which also heals a schedule pushed back by an older
version). A client that is asked to wait longer than its cap stops its run with an alert instead
(``mailflow.provider.client``); every other sender waits at most the cap.

**A slot's start is computed on our clock, whatever the database's latency.** The database answers
with its slot and its own clock at the moment it executed the claim; that moment lies somewhere
between sending the statement and reading the answer. :class:`PostgresPacer` keeps the tightest
bounds on the offset between the database's clock and ``time.monotonic()`` that all its statements
so far prove (NTP's idea: each round trip brackets the offset), so a slow answer does not shift the
start late; it asks for a slot no earlier than ``now + lead``, where the lead is the longest recent
round trip, so the answer normally arrives before its slot; and it forfeits a slot that already
started more than :func:`late_tolerance` ago when the answer arrives, and claims again. Late starts
crowd the provider's window (a late start joins the next second's requests).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import psycopg

from mailflow.model.clock import Clock, SystemClock
from mailflow.store.sql import query

log = logging.getLogger(__name__)

#: Share of the cap one 429 ``rate_limit_exceeded`` takes off the shared rate.
PENALTY_STEP = 0.1
#: The largest total penalty (the rate never drops below half the learned cap x fraction).
MAX_PENALTY = 0.5
#: Seconds over which a penalty decays linearly back to 0.
PENALTY_RECOVERY_SECONDS = 600.0
#: The default cap (s) on a hold of the shared schedule: ``RetryPolicy.max_retry_after``'s default.
DEFAULT_MAX_HOLD_SECONDS = 60.0
#: The largest cap (s) that may be configured: a shared hold longer than a couple of minutes would
#: silently freeze every sender of the account, so anything longer stops the run with an alert.
MAX_HOLD_SECONDS = 120.0
#: Seconds of queued slots a claim may still find beyond ``max_hold`` (senders queued behind a hold).
QUEUE_SECONDS = 10.0
#: Uncertainty (s) a bound on the database clock's offset gains per second of age (clock drift and
#: slewing: 1 ms/s is twice NTP's 500 ppm slew limit).
OFFSET_DRIFT = 1e-3
#: The least lateness (s) a claim accepts before forfeiting a slot, whatever the target fraction (at
#: 1.0 the fraction leaves no slack at all; a round trip to a local database takes about 1 ms).
MIN_LATE_TOLERANCE = 0.01
#: Late slots one claim forfeits in a row at most (then it uses the next one and counts it late).
MAX_FORFEITS = 8
#: Extra reads of the database clock a claim takes at most while the offset is still uncertain.
CALIBRATION_PROBES = 3
#: Claim round trips remembered for the lead.
LEAD_SAMPLES = 8


def late_tolerance(target_fraction: float) -> float:
    """Seconds a slot may have passed and still be used: half the slack that pacing at
    ``target_fraction`` f leaves in the provider's 1 s window, ``(1/f - 1) / 2`` (125 ms at 0.8,
    26 ms at 0.95); the other half is left for network jitter."""
    return (1.0 / float(target_fraction) - 1.0) / 2.0


def check_max_hold(seconds: float) -> float:
    """Validate a cap on shared holds (seconds).

    :raises ValueError: unless ``0 < seconds <= MAX_HOLD_SECONDS``.
    """
    value = float(seconds)
    if not 0 < value <= MAX_HOLD_SECONDS:
        raise ValueError(f"the cap on a shared rate-limit hold must be in (0, {MAX_HOLD_SECONDS:g}] seconds, "
                         f"got {seconds!r}: a longer hold would freeze every sender of the account")
    return value


def bounded_hold(seconds: float, max_hold: float) -> float:
    """``seconds`` clamped to ``[0, max_hold]`` (NaN -> ``max_hold``): what a hold may really be."""
    if seconds != seconds:
        return max_hold
    return min(max(float(seconds), 0.0), max_hold)


class Pacer(Protocol):
    """Claims request start slots for one provider account."""

    def claim(self) -> float:
        """Claim the next slot; return seconds (>= 0) to wait, counted from the moment ``claim``
        returns, before starting the request."""
        ...

    def push_back(self, seconds: float) -> None:
        """A 429 ``rate_limit_exceeded``: every sender of the account waits ``seconds`` from now
        (at most the pacer's ``max_hold``) before its next request, and the shared rate is lowered
        (see the module docstring)."""
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
    """The ``ratelimit-limit`` header as requests/s (>= 1), or None if absent or unusable.

    A limit below 1 request/s is taken as 1: no provider documents one, and a tiny value (a broken
    header) would otherwise space every sender's requests hours apart."""
    try:
        limit = float(headers.get("ratelimit-limit", "") or 0)
    except ValueError:
        return None
    if limit != limit or limit <= 0 or limit == float("inf"):
        return None
    return max(limit, 1.0)


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
    :param max_hold: the longest hold (s) of the schedule this pacer writes (see :func:`check_max_hold`).

    ``requests_per_second`` and ``spacing`` are updated from the database at every claim;
    ``forfeited`` counts slots given up because the database answered after they started,
    ``late`` slots used late anyway (after :data:`MAX_FORFEITS`).
    """

    def __init__(self, connect: Callable[[], psycopg.Connection], account: str,
                 requests_per_second: float, target_fraction: float = 0.8,
                 max_hold: float = DEFAULT_MAX_HOLD_SECONDS):
        self.account = account
        self.max_hold = check_max_hold(max_hold)
        self.forfeited = 0
        self.late = 0
        self.probes = 0
        # bounds on (database clock, epoch s) - time.monotonic(), each with the monotonic time it was proven
        self._offset_lo = (-math.inf, 0.0)
        self._offset_hi = (math.inf, 0.0)
        self._rtts: deque[float] = deque(maxlen=LEAD_SAMPLES)
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

    def _learn_offset(self, db_epoch: float, sent: float, answered: float) -> None:
        """One statement executed at ``db_epoch`` (database clock) between ``sent`` and ``answered``
        (``time.monotonic()``): the offset lies in ``[db_epoch - answered, db_epoch - sent]``.
        Older bounds widen by :data:`OFFSET_DRIFT` per second; a contradiction (the database's
        clock was stepped) restarts from this sample."""
        lo, lo_at = self._offset_lo
        hi, hi_at = self._offset_hi
        lo -= OFFSET_DRIFT * (answered - lo_at)
        hi += OFFSET_DRIFT * (answered - hi_at)
        new_lo, new_hi = db_epoch - answered, db_epoch - sent
        if new_lo > hi or new_hi < lo:
            lo, hi = -math.inf, math.inf
        self._offset_lo = (new_lo, answered) if new_lo >= lo else (lo, answered)
        self._offset_hi = (new_hi, answered) if new_hi <= hi else (hi, answered)

    def _offset(self) -> tuple[float, float]:
        """The offset estimate (database epoch s - ``time.monotonic()``) and its uncertainty (s)."""
        lo, hi = self._offset_lo[0], self._offset_hi[0]
        return (lo + hi) / 2.0, (hi - lo) / 2.0

    def _calibrate(self, tolerance: float) -> None:
        """Read the database clock a few more times while the offset is uncertain by more than half
        the late tolerance (a slow database at start-up); each read can only tighten the bounds."""
        for _ in range(CALIBRATION_PROBES):
            if self._offset()[1] <= tolerance / 2.0:
                return
            sent = time.monotonic()
            row = self._db().execute("select extract(epoch from clock_timestamp())::float8").fetchone()
            answered = time.monotonic()
            assert row is not None
            self.probes += 1
            self._rtts.append(answered - sent)
            self._learn_offset(float(row[0]), sent, answered)

    def claim(self) -> float:
        """Claim the next slot (see the module docstring: computed on our clock, late slots forfeited).

        :returns: seconds (>= 0) to wait from the moment this returns.
        """
        tolerance = max(late_tolerance(self.target_fraction), MIN_LATE_TOLERANCE)
        with self._lock:
            self._calibrate(tolerance)
            for forfeits in range(MAX_FORFEITS + 1):
                lead = max(self._rtts, default=0.0)
                sent = time.monotonic()
                row = self._db().execute(query("pacing", "claim_slot"),
                                         {"account": self.account, "rps": float(self.configured),
                                          "fraction": float(self.target_fraction),
                                          "recovery": PENALTY_RECOVERY_SECONDS, "lead": lead,
                                          "horizon": self.max_hold + QUEUE_SECONDS}).fetchone()
                answered = time.monotonic()
                assert row is not None
                slot, db_now, spacing, learned = row
                self._rtts.append(answered - sent)
                self._learn_offset(db_now.timestamp(), sent, answered)
                start = slot.timestamp() - self._offset()[0]
                if answered - start <= tolerance:
                    break
                if forfeits == MAX_FORFEITS:
                    self.late += 1
                    log.warning("pacer database on %s answered %.3f s after the claimed slot %d times in a row: "
                                "using the late slot", self.account, answered - start, forfeits + 1)
                    break
                self.forfeited += 1
        self.spacing = float(spacing)
        self.learned_limit = None if learned is None else float(learned)
        self.requests_per_second = min(self.configured, self.learned_limit or self.configured)
        return max(start - time.monotonic(), 0.0)

    def peek(self) -> float:
        """Seconds (>= 0, at most ``max_hold`` + :data:`QUEUE_SECONDS`) until the account's next slot
        would start if claimed now; claims nothing (a read of ``mail.rate_slot``). The pipelined
        engine checks its budget with it."""
        with self._lock:
            row = self._db().execute(query("pacing", "peek_slot"),
                                     {"account": self.account, "horizon": self.max_hold + QUEUE_SECONDS}).fetchone()
        return max(float(row[0]), 0.0) if row is not None and row[0] is not None else 0.0

    def push_back(self, seconds: float) -> None:
        hold = bounded_hold(seconds, self.max_hold)
        with self._lock:
            self._db().execute(query("pacing", "rate_limited"),
                               {"account": self.account, "seconds": hold, "step": PENALTY_STEP,
                                "max_penalty": MAX_PENALTY, "recovery": PENALTY_RECOVERY_SECONDS,
                                "max_hold": self.max_hold})

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
                self._db().execute(query("pacing", "push_back"), {
                    "account": self.account, "seconds": bounded_hold(hold - since_start, self.max_hold),
                    "max_hold": self.max_hold})

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

    def __init__(self, requests_per_second: float, target_fraction: float = 0.8, clock: Clock | None = None,
                 max_hold: float = DEFAULT_MAX_HOLD_SECONDS):
        self.max_hold = check_max_hold(max_hold)
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
            self._next = max(self._next, self.clock.monotonic() + bounded_hold(seconds, self.max_hold))

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
