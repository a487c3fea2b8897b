"""The circuit breaker shared by every sender of a provider account (``mail.circuit_breaker``,
migration 0016; SQL in ``store/sql/queries/breaker.sql``).

Why: during an outage every run used to claim or mint a fresh batch, send it into the 5xx or the
refused connection and leave it ambiguous; after a day of outage every row was a dead letter,
although the provider never processed one of them. With the breaker an outage of any length
leaves at most the batches that were in flight when it began.

* **closed** (no row, or ``state = 'closed'``): senders mint and claim as usual.
* **open**: a whole-request failure (:func:`whole_request_failure`: any 5xx after the client's
  retries, a timeout or reset, a refused connection) opened it, with ``opened_at``, ``reason`` and
  ``failures``. No path mints or claims NEW rows; the run stops with :data:`CIRCUIT_OPEN` and fails
  (an alert), charging nobody.
* **half-open**: open, and one process holds the probe lease (``probe_holder`` until
  ``probe_until``, database clock; :data:`PROBE_LEASE_SECONDS`). Only the holder probes. An answer
  that proves the provider processes requests (:func:`is_answer`: a 2xx, or a 4xx, which is an
  answer and not an outage) closes it; another whole-request failure keeps it open and gives the
  lease back.

The probe: the reconciler's same-key resend of the oldest ambiguous batch when there is one (it
mints nothing and may resolve rows), else ``GET /domains`` (:func:`probe`): an authenticated read
that mints nothing. A sending-only key answers every read 401 ``restricted_api_key``, outage or
not, so a 401/403 to the read is followed by ``POST /emails/batch`` with an empty array (refused by
validation: it can send nothing), whose answer is the verdict. A sender never probes with a new batch: that is what turned an outage into dead letters.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import psycopg

from mailflow.model.clock import Clock
from mailflow.model.outcome import Accepted, NotSent, Outcome, Refused, RunContext
from mailflow.store.sql import query

log = logging.getLogger(__name__)

#: The stop reason of a run that found the breaker open (docs/model.md, "The circuit breaker").
CIRCUIT_OPEN = "circuit open"
#: The client's stop reasons for a whole request the provider failed or never received.
PROVIDER_DOWN = frozenset({"provider unavailable", "provider unreachable"})
#: What :func:`probe` returns when no request slot was free before the deadline (no verdict).
PROBE_NO_SLOT = "probe: time budget (no request slot before the deadline)"
#: Seconds a probe lease lasts if its holder dies before giving it back.
PROBE_LEASE_SECONDS = 60.0

# The client's reason for a retry that ran out of budget names the last failure: a 5xx or a
# transport error (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``, "connection failed").
_FAILURE = re.compile(r"HTTP 5\d\d|connection failed|Timeout|Error:")
_ANSWER = re.compile(r"HTTP [1-4]\d\d|ambiguous response|2xx")


def whole_request_failure(outcome: Outcome) -> str | None:
    """The reason if ``outcome`` says the provider failed or never received a whole request: the
    client gave up with ``provider unavailable`` / ``provider unreachable`` (any 5xx, a timeout, a
    reset, a refused connection, after its retries), or its budget ran out while retrying one of
    those. None for any answer (2xx, 4xx, 429) and for outcomes that say nothing about the provider.
    """
    if isinstance(outcome, Accepted | Refused):
        return None
    reason = outcome.reason
    last = reason.split("(", 1)[-1] if outcome.stop_run == "time budget" else reason
    if re.search(r"HTTP 4\d\d", last):
        return None  # 409 concurrent_idempotent_requests and the like: the provider answered
    if outcome.stop_run in PROVIDER_DOWN:
        return reason
    if outcome.stop_run == "time budget" and _FAILURE.search(last):
        return reason
    return None


_KEY_REFUSED = re.compile(r"HTTP 40[13]\b")


def key_refused(outcome: Outcome) -> bool:
    """Whether ``outcome`` is a 401/403 refusal of the request as a whole (the client's
    ``NotSent`` for a missing, restricted, revoked or unknown key, an unverified domain)."""
    return isinstance(outcome, NotSent) and bool(_KEY_REFUSED.search(outcome.reason))


def is_answer(outcome: Outcome, *, previous_key: bool = False) -> bool:
    """Whether ``outcome`` proves the provider processes requests: a 2xx (even one that does not add
    up), a strict refusal, or any 4xx answer (refusals, 401/403, 429, 409).

    With ``previous_key`` (the request went under a key kept in ``previous_api_keys`` for resends),
    a 401/403 is no verdict: a revoked key is refused by the provider's authentication in front of
    the sending path, outage or not (the probe treats a 401/403 to ``GET /domains`` the same way)."""
    if isinstance(outcome, Accepted | Refused):
        return True
    if previous_key and key_refused(outcome):
        return False
    return whole_request_failure(outcome) is None and bool(_ANSWER.search(outcome.reason))


def probe(provider: Any, deadline: float, clock: Clock) -> str | None:
    """Test the provider without minting anything: ``GET /domains`` in the next request slot of the
    shared schedule (a read counts against the team's rate limit too).

    :param deadline: ``clock.monotonic()`` value; no slot after it is taken (then the probe fails
        with "time budget", and the breaker stays as it is).
    :returns: None if the provider answered (any status below 500, 401/403/429 included: an
        answer), else the failure (a 5xx, a timeout, a refused connection). A provider without
        ``get`` (a test double) cannot be probed and counts as answering.
    """
    get = getattr(provider, "get", None)
    if get is None:
        return None
    if not _wait_for_slot(provider, deadline, clock):
        return PROBE_NO_SLOT
    try:
        get("/domains")
    except httpx.HTTPStatusError as exc:
        status = exc.response.status_code
        if status >= 500:
            return f"probe GET /domains: HTTP {status}"
        if status in (401, 403) and getattr(provider, "probe_send", None) is not None:
            # a key that may not read (a sending-only key: 401 restricted_api_key, outage or not)
            # says nothing about the sending path: ask that path with a request that sends nothing
            return _probe_send(provider, deadline, clock)
        return None
    except httpx.HTTPError as exc:
        return f"probe GET /domains: {type(exc).__name__}: {exc or 'no response'}"
    except ValueError:
        return None  # an answer whose body is not JSON is still an answer
    return None


def _wait_for_slot(provider: Any, deadline: float, clock: Clock) -> bool:
    """Wait for the next request slot of the shared schedule (False if it starts after ``deadline``)."""
    reserve = getattr(provider, "reserve_slot", None)
    if reserve is not None:
        slot = reserve(deadline)
        if slot is None:
            return False
        clock.sleep(max(slot - clock.monotonic(), 0.0))
    return True


def _probe_send(provider: Any, deadline: float, clock: Clock) -> str | None:
    """The sending path's answer to an empty batch (``ResendClient.probe_send``: refused by
    validation, it can send nothing): None for any answer below 500, else the failure."""
    if not _wait_for_slot(provider, deadline, clock):
        return PROBE_NO_SLOT
    try:
        status = provider.probe_send()
    except httpx.HTTPError as exc:
        return f"probe POST /emails/batch []: {type(exc).__name__}: {exc or 'no response'}"
    return f"probe POST /emails/batch []: HTTP {status}" if status >= 500 else None


@dataclass(frozen=True)
class BreakerState:
    """A breaker's row: ``state`` ('closed' / 'open'), ``opened_at`` (aware UTC or None),
    ``reason``, ``failures`` since it opened, ``probing`` (a live probe lease), ``probe_holder``."""

    state: str
    opened_at: datetime | None = None
    reason: str | None = None
    failures: int = 0
    probing: bool = False
    probe_holder: str | None = None

    @property
    def open(self) -> bool:
        return self.state == "open"


def breaker_account(provider: Any) -> str:
    """The provider account a breaker belongs to: the pacer's account (the one ``mail.rate_slot``
    uses, the API host in production), else the client's base URL, else ``"default"``."""
    account = getattr(getattr(provider, "pacer", None), "account", None)
    if account:
        return str(account)
    base = getattr(getattr(provider, "http", None), "base_url", None)
    return str(base) if base else "default"


class CircuitBreaker:
    """One run's handle on the shared breaker of ``account`` (see the module docstring).

    :param conn: psycopg 3 connection to the send log; each statement runs in its own transaction
        (``conn.transaction()``), between the caller's units of work, on the caller's thread.
    :param holder: who probes (a run and process id; visible in ``mail.circuit_breaker``).
    """

    def __init__(self, conn: psycopg.Connection, account: str, holder: str,
                 lease_seconds: float = PROBE_LEASE_SECONDS):
        self.conn, self.account, self.holder, self.lease_seconds = conn, account, holder, lease_seconds
        self.opened_by_run: str | None = None  # the failure this run saw (it fails the run)
        self._probed = False

    @classmethod
    def for_run(cls, conn: psycopg.Connection, provider: Any, run: RunContext) -> CircuitBreaker:
        """The breaker of ``provider``'s account (:func:`breaker_account`) held by ``run``."""
        holder = f"{run.dag_id or '-'}/{run.run_id or '-'}/{run.task_id or '-'}/pid {os.getpid()}"
        return cls(conn, breaker_account(provider), holder)

    def _exec(self, name: str, **params: Any) -> tuple[Any, ...] | None:
        with self.conn.transaction():
            cur = self.conn.execute(query("breaker", name), {"account": self.account, "holder": self.holder} | params)
            row: tuple[Any, ...] | None = cur.fetchone() if cur.description is not None else None
        return row

    def state(self) -> BreakerState:
        """The breaker now (closed if the account has no row)."""
        row = self._exec("state")
        if row is None:
            return BreakerState("closed")
        return BreakerState(state=row[0], opened_at=row[1], reason=row[2], failures=int(row[3]),
                            probe_holder=row[4], probing=bool(row[5]))

    def trip(self, reason: str) -> None:
        """Open the breaker for ``reason`` (a whole-request failure), for every sender."""
        self.opened_by_run = reason
        row = self._exec("open", reason=reason[:500])
        if row is not None and row[0]:
            log.error("circuit breaker of %s OPENED: %s; no sender mints or claims new rows until a probe is "
                      "answered", self.account, reason)
        else:
            log.warning("circuit breaker of %s stays open: %s", self.account, reason)

    def reset(self, why: str) -> bool:
        """Close the breaker (an answer proved the provider processes requests). Returns whether it
        was open; a closed breaker is not written."""
        row = self._exec("close")
        if row is not None:
            log.warning("circuit breaker of %s closed (%s) after %s open: %s (%d failures)",
                        self.account, why, row[3], row[1], row[2])
        return row is not None

    def record(self, outcome: Outcome, *, previous_key: bool = False) -> str | None:
        """Note a send's outcome: a whole-request failure opens the breaker (returned), an answer
        closes it, anything else leaves it as it is (``previous_key``: see :func:`is_answer`; a
        401/403 to a previous key is no verdict)."""
        failure = whole_request_failure(outcome)
        if failure is not None:
            self.trip(failure)
        elif is_answer(outcome, previous_key=previous_key):
            self.reset("a request was answered")
        return failure

    def take_probe(self) -> bool:
        """Take the probe lease (atomic; only while open and nobody else holds a live lease)."""
        return self._exec("take_probe", lease=float(self.lease_seconds)) is not None

    def release_probe(self) -> None:
        """Give the probe lease back."""
        self._exec("release_probe")

    def admit(self, provider: Any, deadline: float, clock: Clock) -> str | None:
        """Whether this run may mint or claim new rows now: None if the breaker is closed, or this
        run's probe (:func:`probe`, at most one per run) got an answer and closed it; else
        :data:`CIRCUIT_OPEN` (nothing may be minted or claimed; the run stops and fails)."""
        st = self.state()
        if not st.open:
            return None
        if self._probed or not self.take_probe():
            self.opened_by_run = self.opened_by_run or st.reason or CIRCUIT_OPEN
            return CIRCUIT_OPEN
        self._probed = True
        try:
            failure = probe(provider, deadline, clock)
        except BaseException:
            self.release_probe()
            raise
        if failure is None:
            self.reset(f"probe answered ({self.holder})")
            return None
        if failure == PROBE_NO_SLOT:
            self.release_probe()  # no verdict: the next run probes
            self.opened_by_run = self.opened_by_run or st.reason or CIRCUIT_OPEN
            return CIRCUIT_OPEN
        self.trip(failure)
        return CIRCUIT_OPEN
