"""Group commit for the webhook receiver: every request waiting is stored and applied in ONE transaction.

A request handler hands its verified event to :meth:`GroupWriter.submit` and waits. A writer lane takes
every event waiting (up to ``max_group``), runs :func:`mailflow.feedback.webhook_ingest.ingest` for all of
them in its thread (one transaction, set-based SQL, on the lane's own connection), and after the COMMIT
releases every handler at once: each answers 2xx. While that transaction runs the next requests queue up
and become the next group, so a busy receiver writes large groups and a quiet one small ones; the
database sees one commit (one WAL flush) per group instead of per event. Two lanes (the default) let one
group's COMMIT wait for the disk while the next group's statements run; their statements lock rows in
key order (svix-id, send-log id, mailbox key), so two lanes cannot deadlock each other (one is retried
if the database says otherwise).

Failures answer the whole group 503 (:class:`Unavailable`): the database is down or refused the group
(the provider retries them). A group the database refuses for its data (a bad value in one event) is
retried event by event, so one event cannot fail its neighbours again and again. A deadlock or
serialization failure is retried once. More than ``max_waiting`` events waiting: new ones are refused at
once (:class:`Overloaded`, 503) instead of queueing without bound.

Between its groups the first lane runs the sweep (:func:`~mailflow.feedback.webhook_ingest.apply_pending`,
every ``sweep_every`` seconds, also when idle; pending rows are taken FOR UPDATE SKIP LOCKED) and lets the
reputation guard evaluate the campaigns that got outcomes (every ``guard_every`` seconds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import psycopg

from mailflow.feedback.webhook_ingest import (
    GIVE_UP_AFTER,
    IngestResult,
    WebhookEvent,
    apply_pending,
    guard_reputation,
    ingest,
)

log = logging.getLogger(__name__)

Connect = Callable[[], psycopg.Connection]
"""Returns a new psycopg 3 connection to the send-log database (the writer keeps it open)."""
DUPLICATE_DELIVERY = "duplicate"
"""What :meth:`GroupWriter.submit` returns for a svix-id stored before (a retried delivery)."""
_RETRYABLE = ("40P01", "40001")  # deadlock_detected, serialization_failure


class Unavailable(RuntimeError):
    """The event was not stored (database down or refusing): answer 503 so the provider retries.
    The message names the cause's class only (never a DSN or a payload)."""


class Overloaded(Unavailable):
    """Too many events are waiting for the database: answer 503 at once."""


class _Lane:
    """One writer thread with its own connection: groups, sweeps and evaluations run here one at a time."""

    def __init__(self, connect: Connect, name: str):
        self._connect = connect
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._conn: psycopg.Connection | None = None
        self.dirty: set[str] = set()

    def connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            conn = self._connect()
            conn.autocommit = True
            self._conn = conn
        return self._conn

    def drop_connection(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - a broken connection may fail to close; it is dropped anyway
                pass
        self._conn = None

    def ingest(self, events: Sequence[WebhookEvent]) -> IngestResult:
        for attempt in (1, 2):
            try:
                return ingest(self.connection(), events)
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self.drop_connection()
                if attempt == 2 or getattr(exc, "sqlstate", None) not in _RETRYABLE:
                    raise
            except psycopg.Error as exc:
                if attempt == 2 or getattr(exc, "sqlstate", None) not in _RETRYABLE:
                    raise
        raise AssertionError("unreachable")

    def write(self, events: Sequence[WebhookEvent]) -> dict[str, str | None | Exception]:
        """One transaction for the group; if the database refuses its data, one per event."""
        try:
            result = self.ingest(events)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise  # the database is unreachable: the whole group answers 503
        except psycopg.Error as exc:
            if len(events) == 1:
                raise
            log.warning("webhook group of %d refused (%s): storing its events one by one", len(events),
                        type(exc).__name__)
            out: dict[str, str | None | Exception] = {}
            for e in events:
                try:
                    out.update(self._answers(self.ingest([e]), [e]))
                except psycopg.Error as one:
                    log.error("webhook %s (%s) not stored: %s", e.svix_id, e.event_type, type(one).__name__)
                    out[e.svix_id] = Unavailable(f"not stored ({type(one).__name__})")
            return out
        return self._answers(result, events)

    def _answers(self, result: IngestResult, events: Sequence[WebhookEvent]) -> dict[str, str | None | Exception]:
        self.dirty |= result.campaigns
        out: dict[str, str | None | Exception] = {}
        for e in events:
            out[e.svix_id] = DUPLICATE_DELIVERY if e.svix_id in result.duplicates else result.decisions.get(e.svix_id)
        return out

    def sweep(self, limit: int, give_up_after: timedelta) -> None:
        try:
            summary = apply_pending(self.connection(), limit, give_up_after=give_up_after)
        except Exception as exc:  # noqa: BLE001 - the next sweep tries again; requests keep being answered
            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                self.drop_connection()
            log.warning("webhook sweep failed: %s", type(exc).__name__)
            return
        self.dirty |= summary.campaigns

    def guard(self, campaigns: set[str]) -> bool:
        try:
            with self.connection().transaction():
                trips = guard_reputation(self.connection(), campaigns)
        except Exception as exc:  # noqa: BLE001 - the outcomes are stored; the DAG evaluates again
            if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                self.drop_connection()
            log.warning("reputation evaluation of %d campaign(s) failed: %s", len(campaigns), type(exc).__name__)
            return False
        for trip in trips:
            log.warning("reputation guard tripped: %s", trip)
        return True


class GroupWriter:
    """Stores submitted events in groups, one transaction per group (see the module docstring).

    :param connect: opens a lane's connection (called in its thread; again after a failure).
    :param lanes: groups written at once, each by its own thread and connection (2: one group's COMMIT
        waits for the disk while the next group's statements run).
    :param max_group: events per transaction at most.
    :param max_waiting: events waiting at most; more are refused (:class:`Overloaded`).
    :param sweep_every: seconds between sweeps of pending events (0: no sweep loop).
    :param sweep_limit: events per sweep at most.
    :param give_up_after: pending events older than this are decided ``unknown_email``.
    :param guard_every: seconds between reputation evaluations of the campaigns that got outcomes.
    """

    def __init__(self, connect: Connect, *, lanes: int = 2, max_group: int = 1000, max_waiting: int = 20000,
                 sweep_every: float = 3.0, sweep_limit: int = 500, give_up_after: timedelta = GIVE_UP_AFTER,
                 guard_every: float = 5.0):
        if lanes < 1 or max_group < 1:
            raise ValueError(f"lanes and max_group must be >= 1, got {lanes} and {max_group}")
        self.max_group, self.max_waiting = max_group, max_waiting
        self.sweep_every, self.sweep_limit, self.give_up_after = sweep_every, sweep_limit, give_up_after
        self.guard_every = guard_every
        self._lanes = [_Lane(connect, f"webhook-writer-{i}") for i in range(lanes)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: list[tuple[WebhookEvent, asyncio.Future[str | None]]] = []
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._last_sweep, self._last_guard = 0.0, time.monotonic()  # sweep at once (a backlog after a restart)
        self.stats = {"groups": 0, "events": 0, "failed_groups": 0, "largest_group": 0}

    @property
    def waiting(self) -> int:
        """Events submitted and not yet taken into a group."""
        return len(self._queue)

    def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._tasks and not any(t.done() for t in self._tasks):
            return
        for t in self._tasks:
            t.cancel()
        # first use, or a new event loop (a test client's): pending futures of an old loop are gone with it
        self._loop, self._queue, self._wake = loop, [], asyncio.Event()
        self._tasks = [loop.create_task(self._run(lane, i == 0), name=f"webhook-group-writer-{i}")
                       for i, lane in enumerate(self._lanes)]

    async def submit(self, event: WebhookEvent) -> str | None:
        """Store ``event`` (and apply it if its email is known) with the next group; returns after the
        COMMIT: its decision (``applied``, ``failed``, ``recipient_mismatch``, ``ignored``, None for
        pending), or :data:`DUPLICATE_DELIVERY` if its svix-id was stored before.

        :raises Overloaded: if ``max_waiting`` events are waiting already.
        :raises Unavailable: if its group could not be committed.
        """
        self._ensure_running()
        if len(self._queue) >= self.max_waiting:
            raise Overloaded(f"{len(self._queue)} events waiting for the database")
        assert self._loop is not None and self._wake is not None
        fut: asyncio.Future[str | None] = self._loop.create_future()
        self._queue.append((event, fut))
        self._wake.set()
        return await fut

    async def _run(self, lane: _Lane, housekeeping: bool) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        wake = self._wake
        while True:
            if not self._queue:
                wake.clear()
                try:
                    timeout = self.sweep_every if housekeeping and self.sweep_every > 0 else None
                    await asyncio.wait_for(wake.wait(), timeout=timeout)
                except TimeoutError:
                    pass
            if self._queue:
                group = self._queue[:self.max_group]
                del self._queue[:self.max_group]
                if self._queue:
                    wake.set()  # more waiting: another lane may start on them now
                await self._write_group(loop, lane, group)
            if not housekeeping:
                continue
            now = time.monotonic()
            if self.sweep_every > 0 and now - self._last_sweep >= self.sweep_every:
                self._last_sweep = now
                await loop.run_in_executor(lane.executor, lane.sweep, self.sweep_limit, self.give_up_after)
            if now - self._last_guard >= self.guard_every:
                campaigns: set[str] = set()
                for each in self._lanes:
                    campaigns |= each.dirty
                    each.dirty = set()
                self._last_guard = now
                if campaigns and not await loop.run_in_executor(lane.executor, lane.guard, campaigns):
                    lane.dirty |= campaigns  # evaluated again next time

    async def _write_group(self, loop: asyncio.AbstractEventLoop, lane: _Lane,
                           group: list[tuple[WebhookEvent, asyncio.Future[str | None]]]) -> None:
        events = [e for e, _ in group]
        try:
            results = await loop.run_in_executor(lane.executor, lane.write, events)
        except BaseException as exc:  # noqa: BLE001 - every handler must get an answer, whatever happened
            self.stats["failed_groups"] += 1
            failure = Unavailable(f"group of {len(events)} not stored ({type(exc).__name__})")
            for _, fut in group:
                if not fut.done():
                    fut.set_exception(failure)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        self.stats["groups"] += 1
        self.stats["events"] += len(events)
        self.stats["largest_group"] = max(self.stats["largest_group"], len(events))
        for event, fut in group:
            if fut.done():  # the client went away while waiting; its event is stored all the same
                continue
            outcome = results.get(event.svix_id)
            if isinstance(outcome, Exception):
                fut.set_exception(outcome)
            else:
                fut.set_result(outcome)

    async def aclose(self) -> None:
        """Stop the writer tasks (waiting events get 503) and close the connections."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass
        for _, fut in self._queue:
            if not fut.done():
                fut.set_exception(Unavailable("receiver shutting down"))
        self._queue = []
        loop = asyncio.get_running_loop()
        for lane in self._lanes:
            await loop.run_in_executor(lane.executor, lane.drop_connection)
            lane.executor.shutdown(wait=False)
