"""The lifecycle source: for one data interval, every campaign's audience page by page, highest
priority first: count, mint (:meth:`~mailflow.store.send_log.PostgresStore.mint_chunk`: the contact
guard and ``INSERT ... ON CONFLICT DO NOTHING`` in one transaction, SQL in
``store/sql/queries/lifecycle.sql``), send with the shared loop
(:func:`mailflow.sendloop.engine.send_chunk`), stop at the time budget.

Campaign declarations: ``campaigns/lifecycle.toml`` (:func:`mailflow.campaigns.load_campaigns`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from mailflow.campaigns import Campaign
from mailflow.model.clock import Clock, SystemClock
from mailflow.model.outcome import (
    Accepted,
    CampaignSummary,
    DataInterval,
    NotSent,
    Refused,
    RunContext,
    SendError,
    Unknown,
)
from mailflow.provider.breaker import CIRCUIT_OPEN, CircuitBreaker, breaker_account
from mailflow.sendloop.engine import (
    CLAIM_AT_SEND,
    MAX_BATCH,
    BatchProvider,
    ChunkPipeline,
    InFlight,
    chunk_size_ok,
    peek_slot,
    release_unsent,
    reserve_slot,
    stamp_identity,
)
from mailflow.sendloop.render import Renderer
from mailflow.store import reputation
from mailflow.store.send_log import Store

log = logging.getLogger(__name__)


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
    apply_store: Store | None = None,
    breaker: CircuitBreaker | None = None,
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
    whole-request failure stops the run (see the outcome model in docs/model.md); a refusal of a
    field of one campaign (its ``from``, headers, a template that renders invalid) stops only that
    campaign (its summary's ``stopped`` names the field; a chunk of it already minted is released
    uncharged) and the next campaigns go on, the task failing at the end.

    The reputation guard (:func:`mailflow.store.reputation.blocked`, asked with the store's connection
    at each campaign's turn and before each of its chunks is minted): a campaign whose own scope or
    the provider account is tripped is skipped, its summary's ``stopped`` naming the rates and the
    sample; the run goes on with the others and does not fail for it (the trip alerted once; a person
    resumes it).

    ``pipelined`` (the Airflow task turns it on, :func:`mailflow.settings.pipelined`): chunk N+1 is
    paged, minted, rendered and stored while chunk N is in flight (:class:`ChunkPipeline`; the
    budget is still checked before each mint); at most two chunks are exposed to a crash, both
    stored with their bytes. With ``apply_store`` (a store on a second connection sharing the
    first's run memory, :meth:`~mailflow.store.send_log.PostgresStore.companion`) the sender thread
    also applies each answer, so apply is off the critical path too. Off (the library default): one chunk after the other, so a provider
    double that advances a fake clock sees the budget checked strictly between chunks.

    Backfills: when ``now`` (aware, the wall clock of the run) is given and the interval ended more
    than ``campaign.max_interval_age`` before it, the campaign sends nothing (its moment has passed)
    unless ``allow_old_interval``; the summary says so. ``now`` only gates; it never selects.

    The circuit breaker (``breaker``; default: the provider account's shared one in the store's
    database, :class:`~mailflow.provider.breaker.CircuitBreaker`) is asked before each chunk is
    minted: while it is open nothing is minted and the run stops with ``circuit open``; a chunk
    whose whole request failed (5xx, timeout, reset, refused connection) opens it.

    :returns: one :class:`CampaignSummary` per campaign, in priority order.
    :raises SendError: after recording everything, if the provider refused the key or an idempotency
        conflict needs a person, or a whole campaign's emails were rejected, or the provider failed
        whole requests or the breaker was open (the run could not send: it must not look green).
    """
    clock = clock or SystemClock()
    run = run or RunContext()
    chunk_size = chunk_size_ok(chunk_size)
    deadline = clock.monotonic() + budget_seconds
    summaries: list[CampaignSummary] = []
    state = _RunState()
    conn = getattr(store, "conn", None)
    state.breaker = breaker or (CircuitBreaker.for_run(conn, provider, run) if conn is not None else None)
    if conn is not None:
        state.guard = partial(reputation.blocked, conn)
        state.account = reputation.guard_account(conn, breaker_account(provider))
        # the account's settings once per run (a change applies from the next run)
        state.admit = partial(reputation.admit, conn, account=state.account,
                              config=reputation.config_for(conn, state.account))
        state.evaluate = partial(reputation.evaluate, conn, account=state.account)
    open_audience = getattr(store, "open_audience", None)
    close_audience = getattr(store, "close_audience", None)
    pipe = ChunkPipeline(store, provider, run, enabled=pipelined, apply_store=apply_store)
    try:
        for campaign in sorted(campaigns, key=lambda c: c.priority):
            summary = CampaignSummary(campaign=campaign.name)
            summaries.append(summary)
            window = campaign.window(interval)
            cooldown_since = interval.end - campaign.cooldown
            try:
                if state.guard is not None and (held := state.guard(campaign.name)) is not None:
                    # the reputation guard stopped this campaign (or the account): a person resumes it;
                    # its audience is not evaluated, nobody is charged, the other campaigns go on
                    summary.stopped = held
                    log.warning("%s: skipped: %s", campaign.name, held)
                    continue
                if state.stop in (None, "time budget") and not _can_start(provider, clock, deadline):
                    # the budget will not start it: no snapshot (at 1M users one costs up to
                    # seconds past a budget already spent), so its audience is not counted
                    summary.stopped = state.stop = "time budget"
                    log.info("%s: not started (time budget); audience not evaluated", campaign.name)
                    continue
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
                 "duplicate address %d, held back by the contact guard %d, holdout %d, skipped %d%s",
                 summary.campaign, summary.eligible, summary.minted, summary.sent, summary.failed,
                 summary.released, summary.unknown, summary.invalid, summary.duplicates, summary.held,
                 summary.holdout, summary.skipped,
                 f" (stopped: {summary.stopped})" if summary.stopped else "")
    if state.breaker is not None and state.breaker.opened_by_run is not None:
        # the provider failed whole requests or the breaker was open: the run could not send
        state.fatal.append(f"provider down ({state.stop or CIRCUIT_OPEN}): {state.breaker.opened_by_run}; "
                           f"nothing new is minted until a probe is answered (docs/operations.md, 'Circuit breaker')")
        log.error("lifecycle run could not send: %s", state.fatal[-1])
    if state.fatal:
        raise SendError("; ".join(state.fatal), summaries)
    return summaries


def _can_start(provider: BatchProvider, clock: Clock, deadline: float) -> bool:
    """Whether a campaign could still send a chunk within the budget: the clock is before the
    deadline and, for a provider that predicts its slots, the next slot starts before it."""
    if clock.monotonic() >= deadline:
        return False
    return not callable(getattr(provider, "peek_slot", None)) or peek_slot(provider, deadline) is not None


@dataclasses.dataclass
class _RunState:
    stop: str | None = None
    fatal: list[str] = dataclasses.field(default_factory=list)
    breaker: CircuitBreaker | None = None
    #: campaigns stopped on their own (the provider refused one of their fields): the run goes on
    refused: set[str] = dataclasses.field(default_factory=set)
    #: why a campaign may not send now (the reputation guard, :func:`mailflow.store.reputation.blocked`)
    guard: Callable[[str], str | None] | None = None
    #: how many of a chunk's emails the guard's exposure bound lets go (:func:`mailflow.store.reputation.admit`)
    admit: Callable[[str, int], reputation.Admission] | None = None
    #: the provider account the run sends through (the guard's account scope)
    account: str | None = None
    #: the guard's evaluation of a campaign (starts a spent exposure round again once its outcomes are in)
    evaluate: Callable[[list[str]], Any] | None = None

    def halted(self, campaign: str) -> bool:
        """Whether ``campaign`` must mint or send nothing more: the run stopped, or that campaign did."""
        return self.stop is not None or campaign in self.refused


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
    prepare = stamp_identity(partial(renderer.prepare_batch, campaign), provider)
    cursor = 0
    slot: float | None = None
    # Pipelined with a provider that can predict its next slot: the budget check before the mint
    # uses the prediction, and the sender thread claims the slot right before the request, after
    # the chunk before was answered (docs/operations.md "The shared rate"). A slot claimed before
    # the mint is claimed while the previous chunk is still in flight; if that chunk is late (its
    # slot forfeited and claimed again behind ours), ours is late too, and so on: a cascade of
    # forfeited slots that halved the rate at 1M users. Claimed on the caller's thread after the
    # drain, the hand-over to the sender thread could still miss the slot's tolerance on a
    # loaded machine (76 of 80 late at load 2.5).
    claim_late = pipe.pipelined and callable(getattr(provider, "peek_slot", None))
    while True:
        # The budget covers the wait for the next request slot, checked BEFORE minting: a
        # minted chunk is always sent (its first attempt starts at the reserved slot).
        if claim_late:
            slot = peek_slot(provider, deadline)
        elif slot is None:
            slot = reserve_slot(provider, deadline, clock)
        elif clock.monotonic() > deadline:
            slot = None  # reserved for a page that minted nothing; the budget has run out since
        if slot is None:
            summary.stopped = state.stop = "time budget"
            return
        if state.breaker is not None and state.breaker.admit(provider, deadline, clock) is not None:
            summary.stopped = state.stop = CIRCUIT_OPEN  # nothing minted: nobody is charged
            return
        limit = chunk_size
        if state.admit is not None:
            granted = _admitted(campaign.name, chunk_size, summary, deadline, clock, state,
                                settle=partial(_drain, store, pipe, run, state))
            if granted is None:
                return
            limit = granted
        minted = store.mint_chunk(
            campaign, window, cooldown_since, after=cursor, limit=limit, run=run,
            interval=(interval.start, interval.end), prepare=prepare,
        )
        _give_back(store, state, campaign.name, limit - (len(minted.batch.row_ids) if minted.batch else 0))
        if minted.page_size == 0:
            return
        cursor = minted.cursor
        summary.invalid += minted.invalid
        summary.duplicates += minted.duplicates
        summary.held += minted.held
        summary.holdout += minted.holdout
        if minted.batch is None:
            continue
        summary.chunks += 1
        summary.minted += len(minted.batch.row_ids)
        chunk = InFlight(minted.batch, minted.rows, prepare, deadline, tag=summary)
        # one chunk in flight at a time: the previous one's answer first (it may stop the run)
        _drain(store, pipe, run, state)
        if state.halted(campaign.name):
            # the chunk before stopped the run, or this campaign (its refusal is in summary.stopped)
            why = f"the run stopped ({state.stop})" if state.stop is not None else \
                f"the campaign stopped ({summary.stopped})"
            applied = release_unsent(store, chunk, why, run)
            summary.released += applied.released
            summary.unknown += applied.unknown
            _give_back(store, state, campaign.name, applied.released)
            if state.stop is not None:
                summary.stopped = state.stop
            return
        if claim_late:  # claimed by the sender right before its request; sent whatever the budget
            slot = CLAIM_AT_SEND
        pipe.submit(chunk, slot)
        slot = None
        if not pipe.pipelined:  # unpipelined: the answer is applied before the next mint
            _drain(store, pipe, run, state)
            if state.halted(campaign.name):
                return


def _admitted(name: str, asked: int, summary: CampaignSummary, deadline: float, clock: Clock,
              state: _RunState, settle: Callable[[], None]) -> int | None:
    """How many emails of the next chunk the reputation guard lets go (1..asked), or None when the campaign
    stops: tripped (``summary.stopped`` names the trip), or its exposure round stays spent until the budget
    runs out (``summary.stopped`` says it waited for outcomes), or the chunk in flight stopped it. While the
    round is spent the run waits, asking the guard again every second (its evaluation starts a new round
    once the outcomes are in): sending ramps with the feedback instead of outrunning it. Before the first
    wait ``settle`` applies the chunk in flight: until its rows are ``sent`` their outcomes cannot be
    matched, and the round would wait for its own last chunk."""
    assert state.admit is not None
    settled = False
    while True:
        admission = state.admit(name, asked)
        if admission.reason is not None:
            summary.stopped = admission.reason  # tripped while the campaign was sending: nothing more is minted
            log.warning("%s: stopped: %s", name, admission.reason)
            return None
        if admission.granted > 0:
            return admission.granted
        if not settled:
            settled = True
            settle()
            if state.halted(name):  # the chunk in flight stopped the run, or this campaign
                if state.stop is not None:
                    summary.stopped = state.stop
                return None
            continue
        if clock.monotonic() + 1.0 >= deadline:
            summary.stopped = f"time budget while waiting for outcomes: {admission.waiting}"
            log.warning("%s: stopped: %s", name, summary.stopped)
            return None
        summary.waited += 1.0
        clock.sleep(1.0)
        if state.evaluate is not None:
            state.evaluate([name])


def _give_back(store: Store, state: _RunState, campaign: str, n: int) -> None:
    """Give the reputation guard back ``n`` emails it granted that were not sent and will never have an
    outcome (not minted, rolled back, rejected by the provider): an exposure round counts the emails that
    await outcomes, and waits for as many outcomes as it counts."""
    if state.admit is not None and n > 0:
        reputation.refund(store.conn, campaign, n, account=state.account)  # type: ignore[attr-defined]


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
    _give_back(store, state, summary.campaign, applied.released + applied.failed)
    log.info("%s chunk (%s): %d emails -> %d sent, %d rejected, %d rolled back, %d unknown%s",
             summary.campaign, batch.idempotency_key, len(batch.row_ids), applied.sent,
             applied.failed, applied.released, applied.unknown,
             "" if isinstance(outcome, Accepted) else f" ({outcome.reason})")
    if state.breaker is not None:
        state.breaker.record(outcome)  # a whole-request failure opens it for every sender
    if isinstance(outcome, Accepted) and outcome.stop_run:
        # the provider refused a field of the campaign (its sender, headers, rendered subject):
        # nobody was charged (those rows were released); it would repeat for THIS campaign, so
        # this campaign stops (a chunk of it already minted is released, unsent) while the others
        # go on in priority order; the task still fails at the end, alerted
        if outcome.fatal:
            state.fatal.append(f"{summary.campaign}: {outcome.stop_run}")
        summary.stopped = outcome.stop_run
        state.refused.add(summary.campaign)
        log.error("%s stopped, the other campaigns go on: %s", summary.campaign, outcome.stop_run)
    if isinstance(outcome, NotSent | Unknown | Refused):
        if outcome.fatal:
            state.fatal.append(f"{summary.campaign}: {outcome.reason}")
        if outcome.stop_run or isinstance(outcome, NotSent):
            # A whole-request failure that will repeat (auth, domain, quota, a refused body,
            # an outage, the budget) stops the run at once: it does not march through the
            # audience. Released rows charged nobody; the next healthy run sends them.
            summary.stopped = state.stop = outcome.stop_run or outcome.reason
        # An ambiguous chunk (rows kept with their key for the reconciler): go on.
