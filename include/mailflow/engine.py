"""The send loop: page -> mint -> render -> send one batch -> apply by index -> check the budget.

The engine sees three narrow things: a :class:`~mailflow.store.Store` (the send log), a provider
with ``send_batch(batch, deadline) -> Outcome`` and a :class:`~mailflow.clock.Clock`. It is tested
without Airflow; the DAG only builds these from connections and calls :func:`run_lifecycle`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Protocol

from mailflow.campaigns import Campaign
from mailflow.clock import Clock, SystemClock
from mailflow.model import (
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
from mailflow.render import Renderer
from mailflow.store import Applied, Store

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
    total = Applied()
    outcome = _send(provider, batch, deadline, slot)
    total = total + store.apply(batch, outcome, run)
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
) -> list[CampaignSummary]:
    """Send every campaign's audience for one data interval, highest priority first.

    Audiences use ``campaign.window(interval)`` and a cooldown since ``interval.end - cooldown``:
    nothing here reads the wall clock for selection, so a backfill re-selects the audience of its
    own interval. The time budget (seconds, monotonic) is checked before each chunk is minted and
    covers the wait for its request slot; a minted chunk is always sent; what is not minted when it
    runs out is left for the next run. A whole-request failure stops the run (see the outcome model
    in docs/model.md).

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
    stop: str | None = None
    fatal: list[str] = []
    for campaign in sorted(campaigns, key=lambda c: c.priority):
        summary = CampaignSummary(campaign=campaign.name)
        summaries.append(summary)
        window = campaign.window(interval)
        cooldown_since = interval.end - campaign.cooldown
        summary.eligible = store.count_audience(campaign, window, cooldown_since)
        age = timedelta(seconds=(now - interval.end).total_seconds()) if now is not None else None
        if age is not None and not allow_old_interval and age > campaign.max_interval_age:
            # (a plain timedelta: Airflow's pendulum bounds would otherwise format as an Interval)
            summary.stopped = f"interval ended {age} ago, over max_interval_age {campaign.max_interval_age}"
            log.info("%s: %d eligible, not sent: %s (allow_old_interval to send)", campaign.name, summary.eligible,
                     summary.stopped)
            continue
        if stop is None and clock.monotonic() >= deadline:
            stop = "time budget"
        if stop is not None:
            summary.stopped = stop
            log.info("%s: %d eligible, not started (%s)", campaign.name, summary.eligible, stop)
            continue
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
                summary.stopped = stop = "time budget"
                break
            minted = store.mint_chunk(
                campaign, window, cooldown_since, after=cursor, limit=chunk_size, run=run,
                interval=(interval.start, interval.end),
                prepare=partial(renderer.prepare_batch, campaign),
            )
            if minted.page_size == 0:
                break
            cursor = minted.cursor
            summary.invalid += minted.invalid
            summary.duplicates += minted.duplicates
            summary.held += minted.held
            if minted.batch is None:
                continue
            summary.chunks += 1
            summary.minted += len(minted.batch.row_ids)
            outcome, applied, batch = send_chunk(store, provider, partial(renderer.prepare_batch, campaign),
                                                 minted.batch, minted.rows, deadline, run, slot)
            slot = None
            summary.sent += applied.sent
            summary.failed += applied.failed
            summary.released += applied.released
            summary.unknown += applied.unknown
            log.info("%s chunk %d (%s): %d emails -> %d sent, %d rejected, %d rolled back, %d unknown%s",
                     campaign.name, summary.chunks, batch.idempotency_key, len(batch.row_ids), applied.sent,
                     applied.failed, applied.released, applied.unknown,
                     "" if isinstance(outcome, Accepted) else f" ({outcome.reason})")
            if isinstance(outcome, NotSent | Unknown | Refused):
                if outcome.fatal:
                    fatal.append(f"{campaign.name}: {outcome.reason}")
                if outcome.stop_run or isinstance(outcome, NotSent):
                    # A whole-request failure that will repeat (auth, domain, quota, a refused body,
                    # an outage, the budget) stops the run at once: it does not march through the
                    # audience. Released rows charged nobody; the next healthy run sends them.
                    summary.stopped = stop = outcome.stop_run or outcome.reason
                    break
                # An ambiguous chunk (rows kept with their key for the reconciler): go on.
        if summary.minted and summary.failed == summary.minted:
            fatal.append(f"{campaign.name}: every one of {summary.minted} emails was rejected by the provider")
        log.info("%s: eligible %d, minted %d, sent %d, failed %d, rolled back %d, unknown %d, invalid address %d, "
                 "duplicate address %d, held back by the contact guard %d, skipped %d%s",
                 campaign.name, summary.eligible, summary.minted, summary.sent, summary.failed,
                 summary.released, summary.unknown, summary.invalid, summary.duplicates, summary.held,
                 summary.skipped,
                 f" (stopped: {summary.stopped})" if summary.stopped else "")
    if fatal:
        raise SendError("; ".join(fatal), summaries)
    return summaries
