"""The send loop: page -> mint -> render -> send one batch -> apply by index -> check the budget.

The engine sees three narrow things: a :class:`~mailflow.store.send_log.Store` (the send log), a provider
with ``send_batch(batch, deadline) -> Outcome`` and a :class:`~mailflow.sendloop.clock.Clock`. It is tested
without Airflow; the DAG only builds these from connections and calls :func:`run_lifecycle`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from functools import partial
from typing import Protocol

from mailflow.campaigns import Campaign
from mailflow.sendloop.clock import Clock, SystemClock
from mailflow.sendloop.outcome import (
    Accepted,
    CampaignSummary,
    DataInterval,
    MintedRow,
    NotSent,
    Outcome,
    PreparedBatch,
    Refused,
    RunContext,
    SendError,
    Unknown,
)
from mailflow.sendloop.render import Renderer
from mailflow.store.send_log import Applied, Store

log = logging.getLogger(__name__)

MAX_BATCH = 100  # Resend: POST /emails/batch takes 1 to 100 emails


class BatchProvider(Protocol):
    """Sends one prepared batch; see :meth:`mailflow.provider.client.ResendClient.send_batch`.

    ``send_batch(batch, deadline, slot)``: ``slot`` is a start time from ``reserve_slot`` (optional:
    a provider without it is treated as having a free slot now)."""

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Outcome: ...


def reserve_slot(provider: object, deadline: float, clock: Clock) -> float | None:
    """The start time (``clock.monotonic()``) of the provider's next request slot, claimed now, or
    None if it starts after ``deadline``. Called BEFORE a chunk is minted or claimed, so the budget
    covers the wait for the slot and a minted chunk is always sent (issue 12)."""
    reserve = getattr(provider, "reserve_slot", None)
    if reserve is None:
        now = clock.monotonic()
        return now if now <= deadline else None
    start: float | None = reserve(deadline)
    return start


def chunk_size_ok(chunk_size: int) -> int:
    """Validate a chunk size (emails per batch request).

    :raises ValueError: unless 1 <= chunk_size <= 100 (Resend's batch limit).
    """
    if not 1 <= int(chunk_size) <= MAX_BATCH:
        raise ValueError(f"chunk_size must be between 1 and {MAX_BATCH} emails (provider batch limit), got {chunk_size}")
    return int(chunk_size)


def send_chunk(store: Store, provider: BatchProvider, prepare: Callable[[Sequence[MintedRow]], PreparedBatch],
               batch: PreparedBatch, rows: Sequence[MintedRow], deadline: float,
               run: RunContext, slot: float | None = None) -> tuple[Outcome, Applied, PreparedBatch]:
    """Send one stored batch and apply the provider's answer by index (every path uses this).

    On a strict-mode refusal (:class:`Refused`: the whole request was refused by validation and
    nothing was processed) the refused email is never guessed from the message: the whole chunk
    is re-rendered with ``prepare``, stored as a new batch in permissive mode (a new key, so no key
    is ever sent with two requests) and sent again; the permissive answer names the refused emails
    by index. This happens at most once per chunk.

    :param rows: the batch's rows in request order (``rows[i]`` is request index ``i``).
    :param slot: the reserved start of the first request (see :func:`reserve_slot`).
    :returns: the last outcome, the row changes summed over all attempts, and the last batch sent.
    """
    return finish_chunk(store, provider, prepare, batch, rows, _send(provider, batch, deadline, slot), deadline, run)


def finish_chunk(store: Store, provider: BatchProvider, prepare: Callable[[Sequence[MintedRow]], PreparedBatch],
                 batch: PreparedBatch, rows: Sequence[MintedRow], outcome: Outcome, deadline: float,
                 run: RunContext) -> tuple[Outcome, Applied, PreparedBatch]:
    """The second half of :func:`send_chunk`: apply ``outcome`` (the answer to ``batch``) and, on a
    strict-mode refusal, re-send the chunk permissive under a new key (synchronously)."""
    total = store.apply(batch, outcome, run)
    if isinstance(outcome, Refused):
        log.info("%s: batch %s refused by strict validation (%s); resending the chunk permissive under a new key",
                 batch.campaign, batch.idempotency_key, outcome.reason)
        batch = store.rebatch(dataclasses.replace(prepare(rows), validation="permissive"))
        outcome = _send(provider, batch, deadline, None)
        total = total + store.apply(batch, outcome, run)
    return outcome, total, batch


def _send(provider: BatchProvider, batch: PreparedBatch, deadline: float, slot: float | None) -> Outcome:
    if slot is None or not hasattr(provider, "reserve_slot"):  # a double without slots: no slot to pass
        return provider.send_batch(batch, deadline)
    return provider.send_batch(batch, deadline, slot)


@dataclasses.dataclass
class InFlight:
    """One chunk handed to :class:`ChunkPipeline`: its stored batch, rows (request order), renderer
    for a permissive resend, and ``tag`` (the caller's bookkeeping, e.g. its campaign summary)."""

    batch: PreparedBatch
    rows: Sequence[MintedRow]
    prepare: Callable[[Sequence[MintedRow]], PreparedBatch]
    deadline: float
    tag: object = None
    future: Future[Outcome] | None = None
    outcome: Outcome | None = None


class ChunkPipeline:
    """Pipelined sending (issue 16): at most ONE chunk in flight while the caller prepares the next.

    ``submit`` starts the provider call of a stored chunk (its rows ``sending`` with their batch
    bytes: recoverable by the reconciler) on a single background thread that does the HTTP call
    only (the provider is thread-safe: httpx and a locked pacer); the caller's thread meanwhile
    pages, mints, renders and stores chunk N+1 on its own connection. ``collect`` waits for the
    chunk in flight and applies its answer by index on the caller's connection (the store is
    never used by two threads). So a crash leaves at most two chunks exposed, both stored with
    their bytes: the one in flight and the one just minted. With ``enabled=False`` ``submit`` sends
    synchronously (the unpipelined engine, for comparison and for providers that are not
    thread-safe).
    """

    def __init__(self, store: Store, provider: BatchProvider, run: RunContext, *, enabled: bool = True):
        self.store, self.provider, self.run = store, provider, run
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mailflow-send") if enabled else None
        self._inflight: InFlight | None = None

    @property
    def pipelined(self) -> bool:
        """False when ``submit`` sends synchronously (collect right after it)."""
        return self._pool is not None

    @property
    def busy(self) -> bool:
        """True while a chunk is submitted and not yet collected."""
        return self._inflight is not None

    def submit(self, chunk: InFlight, slot: float | None) -> None:
        """Start sending ``chunk`` (first attempt at ``slot``). Collect the previous chunk first.

        :raises RuntimeError: if a chunk is still in flight (never two at once).
        """
        if self._inflight is not None:
            raise RuntimeError("a chunk is already in flight: collect() it first")
        if self._pool is None:
            chunk.outcome = _send(self.provider, chunk.batch, chunk.deadline, slot)
        else:
            chunk.future = self._pool.submit(_send, self.provider, chunk.batch, chunk.deadline, slot)
        self._inflight = chunk

    def collect(self) -> tuple[InFlight, Outcome, Applied, PreparedBatch] | None:
        """Wait for the chunk in flight (if any) and apply its answer (:func:`finish_chunk`).

        :returns: ``(chunk, last outcome, row changes, last batch sent)``, or None if nothing was in
            flight. An exception of the provider call propagates (the rows keep key and bytes).
        """
        chunk, self._inflight = self._inflight, None
        if chunk is None:
            return None
        outcome = chunk.outcome if chunk.future is None else chunk.future.result()
        assert outcome is not None
        done = finish_chunk(self.store, self.provider, chunk.prepare, chunk.batch, chunk.rows, outcome,
                            chunk.deadline, self.run)
        return (chunk, *done)

    def close(self) -> None:
        """Stop the background thread (after waiting for a chunk still in flight; not applied)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def release_unsent(store: Store, chunk: InFlight, reason: str, run: RunContext) -> Applied:
    """A minted chunk that will never be sent (the chunk before it stopped the run): proven not
    processed, so its rows are rolled back without charging anyone (docs/model.md)."""
    return store.apply(chunk.batch, NotSent(reason=f"not sent: {reason}"), run)


def run_lifecycle(
    store: Store,
    provider: BatchProvider,
    renderer: Renderer,
    campaigns: Sequence[Campaign],
    interval: DataInterval,
    *,
    run: RunContext | None = None,
    budget_seconds: float = 240.0,
    chunk_size: int = MAX_BATCH,
    clock: Clock | None = None,
    now: datetime | None = None,
    allow_old_interval: bool = False,
    pipelined: bool = False,
) -> list[CampaignSummary]:
    """Send every campaign's audience for one data interval, highest priority first.

    Audiences use ``campaign.window(interval)`` and a cooldown since ``interval.end - cooldown``:
    nothing here reads the wall clock for selection, so a backfill re-selects the audience of its
    own interval. Each campaign's audience is evaluated once, at its turn (after every earlier
    campaign has minted), into the store's snapshot when it has one (``open_audience``; its size is
    the summary's ``eligible``), else counted (``count_audience``) and paged live. The time budget
    (seconds, monotonic) is checked before each chunk is minted and covers the wait for its
    request slot; a minted chunk is always sent, unless the chunk before it stopped the run (then
    it is rolled back uncharged); what is not minted when it runs out is left for the next run. A
    whole-request failure stops the run (see the outcome model in docs/model.md).

    ``pipelined`` (the Airflow task turns it on, :func:`mailflow.settings.pipelined`): chunk N+1 is
    paged, minted, rendered and stored while chunk N is in flight (:class:`ChunkPipeline`; the
    budget is still checked before each mint); at most two chunks are exposed to a crash, both
    stored with their bytes. Off (the library default): one chunk after the other, so a provider
    double that advances a fake clock sees the budget checked strictly between chunks.

    Backfills: when ``now`` (aware, the wall clock of the run) is given and the interval ended more
    than ``campaign.max_interval_age`` before it, the campaign sends nothing (its moment has passed)
    unless ``allow_old_interval``; the summary says so. ``now`` only gates; it never selects.

    :returns: one :class:`CampaignSummary` per campaign, in priority order.
    :raises SendError: after recording everything, if the provider refused the key or an idempotency
        conflict needs a person, or a whole campaign's emails were rejected.
    """
    clock = clock or SystemClock()
    run = run or RunContext()
    chunk_size = chunk_size_ok(chunk_size)
    deadline = clock.monotonic() + budget_seconds
    summaries: list[CampaignSummary] = []
    state = _RunState()
    open_audience = getattr(store, "open_audience", None)
    close_audience = getattr(store, "close_audience", None)
    pipe = ChunkPipeline(store, provider, run, enabled=pipelined)
    try:
        for campaign in sorted(campaigns, key=lambda c: c.priority):
            summary = CampaignSummary(campaign=campaign.name)
            summaries.append(summary)
            window = campaign.window(interval)
            cooldown_since = interval.end - campaign.cooldown
            try:
                if open_audience is not None:
                    summary.eligible = open_audience(campaign, window, cooldown_since)
                else:
                    summary.eligible = store.count_audience(campaign, window, cooldown_since)
                _run_campaign(store, provider, renderer, campaign, interval, window, cooldown_since, summary,
                              run, deadline, chunk_size, clock, now, allow_old_interval, pipe, state)
            finally:
                if close_audience is not None:
                    close_audience(campaign)
        _drain(store, pipe, run, state)
    finally:
        try:
            if pipe.busy:  # an exception while a chunk was in flight: record its answer if it has one
                _drain(store, pipe, run, state)
        finally:
            pipe.close()
    for summary in summaries:
        if summary.minted and summary.failed == summary.minted:
            state.fatal.append(f"{summary.campaign}: every one of {summary.minted} emails was rejected by the provider")
        log.info("%s: eligible %d, minted %d, sent %d, failed %d, rolled back %d, unknown %d, invalid address %d, "
                 "duplicate address %d, held back by the contact guard %d, skipped %d%s",
                 summary.campaign, summary.eligible, summary.minted, summary.sent, summary.failed,
                 summary.released, summary.unknown, summary.invalid, summary.duplicates, summary.held,
                 summary.skipped,
                 f" (stopped: {summary.stopped})" if summary.stopped else "")
    if state.fatal:
        raise SendError("; ".join(state.fatal), summaries)
    return summaries


@dataclasses.dataclass
class _RunState:
    stop: str | None = None
    fatal: list[str] = dataclasses.field(default_factory=list)


def _run_campaign(store: Store, provider: BatchProvider, renderer: Renderer, campaign: Campaign,
                  interval: DataInterval, window: tuple[datetime, datetime], cooldown_since: datetime,
                  summary: CampaignSummary, run: RunContext, deadline: float, chunk_size: int, clock: Clock,
                  now: datetime | None, allow_old_interval: bool, pipe: ChunkPipeline, state: _RunState) -> None:
    """Mint and send one campaign's chunks (the chunk before may still be in flight)."""
    age = timedelta(seconds=(now - interval.end).total_seconds()) if now is not None else None
    if age is not None and not allow_old_interval and age > campaign.max_interval_age:
        # (a plain timedelta: Airflow's pendulum bounds would otherwise format as an Interval)
        summary.stopped = f"interval ended {age} ago, over max_interval_age {campaign.max_interval_age}"
        log.info("%s: %d eligible, not sent: %s (allow_old_interval to send)", campaign.name, summary.eligible,
                 summary.stopped)
        return
    if state.stop is None and clock.monotonic() >= deadline:
        state.stop = "time budget"
    if state.stop is not None:
        summary.stopped = state.stop
        log.info("%s: %d eligible, not started (%s)", campaign.name, summary.eligible, state.stop)
        return
    prepare = partial(renderer.prepare_batch, campaign)
    cursor = 0
    slot: float | None = None
    while True:
        # The budget covers the wait for the next request slot, checked BEFORE minting: a
        # minted chunk is always sent (its first attempt starts at the reserved slot).
        if slot is None:
            slot = reserve_slot(provider, deadline, clock)
        elif clock.monotonic() > deadline:
            slot = None  # reserved for a page that minted nothing; the budget has run out since
        if slot is None:
            summary.stopped = state.stop = "time budget"
            return
        minted = store.mint_chunk(
            campaign, window, cooldown_since, after=cursor, limit=chunk_size, run=run,
            interval=(interval.start, interval.end), prepare=prepare,
        )
        if minted.page_size == 0:
            return
        cursor = minted.cursor
        summary.invalid += minted.invalid
        summary.duplicates += minted.duplicates
        summary.held += minted.held
        if minted.batch is None:
            continue
        summary.chunks += 1
        summary.minted += len(minted.batch.row_ids)
        chunk = InFlight(minted.batch, minted.rows, prepare, deadline, tag=summary)
        # one chunk in flight at a time: the previous one's answer first (it may stop the run)
        _drain(store, pipe, run, state)
        if state.stop is not None:
            applied = release_unsent(store, chunk, f"the run stopped ({state.stop})", run)
            summary.released += applied.released
            summary.unknown += applied.unknown
            summary.stopped = state.stop
            return
        pipe.submit(chunk, slot)
        slot = None
        if not pipe.pipelined:  # unpipelined: the answer is applied before the next mint
            _drain(store, pipe, run, state)
            if state.stop is not None:
                return


def _drain(store: Store, pipe: ChunkPipeline, run: RunContext, state: _RunState) -> None:
    """Collect the chunk in flight (if any), count it in its campaign's summary, note a stop."""
    done = pipe.collect()
    if done is None:
        return
    chunk, outcome, applied, batch = done
    summary = chunk.tag
    assert isinstance(summary, CampaignSummary)
    summary.sent += applied.sent
    summary.failed += applied.failed
    summary.released += applied.released
    summary.unknown += applied.unknown
    log.info("%s chunk (%s): %d emails -> %d sent, %d rejected, %d rolled back, %d unknown%s",
             summary.campaign, batch.idempotency_key, len(batch.row_ids), applied.sent,
             applied.failed, applied.released, applied.unknown,
             "" if isinstance(outcome, Accepted) else f" ({outcome.reason})")
    if isinstance(outcome, NotSent | Unknown | Refused):
        if outcome.fatal:
            state.fatal.append(f"{summary.campaign}: {outcome.reason}")
        if outcome.stop_run or isinstance(outcome, NotSent):
            # A whole-request failure that will repeat (auth, domain, quota, a refused body,
            # an outage, the budget) stops the run at once: it does not march through the
            # audience. Released rows charged nobody; the next healthy run sends them.
            summary.stopped = state.stop = outcome.stop_run or outcome.reason
        # An ambiguous chunk (rows kept with their key for the reconciler): go on.
