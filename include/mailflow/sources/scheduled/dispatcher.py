"""Dispatch: until nothing is due within the budget, claim a campaign's due rows
(:mod:`~mailflow.sources.scheduled.claiming`), send them with the shared send loop, apply the
answer by index, stop on a whole-request failure; complete finished campaigns."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import psycopg

from mailflow.campaigns import CampaignFolder
from mailflow.model.apply_by_index import campaign_field
from mailflow.model.clock import Clock, SystemClock
from mailflow.model.outcome import Accepted, NotSent, Outcome, Refused, RunContext, SendError, Unknown
from mailflow.model.policy import ContactPolicy
from mailflow.provider.breaker import CIRCUIT_OPEN, CircuitBreaker, breaker_account
from mailflow.sendloop.engine import (
    MAX_BATCH,
    ChunkPipeline,
    InFlight,
    key_identity_of,
    release_unsent,
    reserve_slot,
)
from mailflow.sendloop.render import Renderer
from mailflow.sources.scheduled.campaign_db import actor_name
from mailflow.sources.scheduled.claiming import Claim, Dispatcher, DispatchSummary
from mailflow.sources.scheduled.control import complete, hold
from mailflow.sources.scheduled.holds import hold_states
from mailflow.sources.scheduled.replan import replan_overdue
from mailflow.store import reputation
from mailflow.store.scheduled import ScheduledStore

log = logging.getLogger(__name__)


BATCH_SIZE = MAX_BATCH
DISPATCH_BUDGET_SECONDS = 50.0  # one run of the 1-minute dispatch DAG (leaves ~10 s for start-up)
COALESCE_SECONDS = 5.0  # a due row waits at most this long for others to share its request
POLL_SECONDS = 5.0  # while sleeping towards the next due row, look again this often
SEND_GRACE_SECONDS = 60.0  # a claimed batch may still wait this long past the budget (pacing, 429)


def release_canaries(conn: psycopg.Connection, actor: str | None) -> list[str]:
    """Release the rest of the campaigns whose canary is in (docs/operations.md, "Reputation guard"):
    first the reputation guard evaluates the waiting campaigns (so a canary that bounced trips and
    pauses its campaign instead of being released), then ``ScheduledStore.release_canaries`` releases
    those whose canary is judged (the outcome share of the canary emails sent, or ``canary_max_wait``
    since its last send; a canary row the contact policy deferred is not waited for) and that nothing
    trips. In the same transaction each released campaign's overdue rows are re-planned from now
    (:func:`~mailflow.sources.scheduled.replan.replan_overdue`): the rest waited behind the canary, and
    a release must not send that backlog at once. Its own transactions; returns the names released."""
    with conn.transaction():
        waiting = ScheduledStore(conn).canaries_waiting()
    if not waiting:
        return []
    reputation.evaluate(conn, waiting)
    with conn.transaction():
        released = ScheduledStore(conn).release_canaries(actor)
        replanned = {r.name: replan_overdue(conn, r.campaign_id, actor=actor, reason="canary released")
                     for r in released}
    for r in released:
        log.info("campaign %s: canary released by its %s (%d sent, %d with an outcome, %d deferred by the contact "
                 "policy); %d overdue rows re-planned from now", r.name, r.rule, r.sent, r.with_outcome, r.deferred,
                 replanned[r.name].replanned)
    return [r.name for r in released]


def dispatch(conn: psycopg.Connection, provider: Any, renderer: Renderer, *,
             budget_seconds: float = DISPATCH_BUDGET_SECONDS, coalesce_seconds: float = COALESCE_SECONDS,
             poll_seconds: float = POLL_SECONDS, batch_size: int = BATCH_SIZE,
             send_grace_seconds: float = SEND_GRACE_SECONDS, clock: Clock | None = None,
             run: RunContext | None = None, policy: ContactPolicy | None = None,
             pipelined: bool = False, breaker: CircuitBreaker | None = None,
             folder: CampaignFolder | None = None) -> DispatchSummary:
    """Send due scheduled rows until nothing is due within the budget, or the budget is spent.

    Loop: ask the database how long until a claim is worth it (the earliest due row has waited
    ``coalesce_seconds`` s, or ``batch_size`` rows are due); if that is beyond the remaining budget,
    return (the next run takes it: the worker slot is not held idle); if it is ahead, sleep (at
    most ``poll_seconds`` s at a time); otherwise cancel suppressed due rows, claim up to
    ``batch_size`` due rows of one campaign (``FOR UPDATE SKIP LOCKED``: concurrent dispatchers
    never share a row and never wait on each other), give them the recipients' current addresses
    from the campaign's recipient source (:meth:`Dispatcher.refresh_addresses`: a user it no longer
    returns is ``skipped``; the contact policy and the address checks then judge the new address), render them, store the batch, send it with
    ``provider.send_batch(batch, deadline)`` and apply the outcome by index with
    ``PostgresStore.apply`` (docs/model.md: a request proven not processed returns its rows to
    ``pending`` without charging them and stops the run; rows of an ambiguous request keep their
    key and bytes for the reconciler). Campaigns left with nothing to send are completed at the end.

    Holds enforced by the claim statements: a campaign the reputation guard tripped (or every one
    while the account is tripped) is never claimed, and a campaign with a canary gives only its canary
    rows until :func:`release_canaries` (run at the start of each call) releases the rest (re-planning
    what waited behind it). The per-day cap (:meth:`Dispatcher.over_cap`): a campaign with more rows due
    than ``emails_per_day`` still allows on its plan day is not claimed; its pending rows are re-planned
    from now instead (``summary.replanned``). At the end, ``summary.held`` says why each scheduled or
    paused campaign does not send (:func:`~mailflow.sources.scheduled.holds.hold_states`).

    One campaign never stops the others: a claim that raises for one campaign (e.g. its template
    is missing) is rolled back, and a batch the provider refuses for a field of the campaign
    (``from``, ``reply_to``, headers, the rendered subject or body: :func:`campaign_field`) charges
    nobody (its rows go back to ``pending``); either way that campaign is paused with the reason
    (``summary.paused``, a campaign event), the run goes on with the other campaigns, and the task
    fails at the end (``SendError``), which alerts.

    :param conn: psycopg 3 connection to the send log (each step is its own transaction).
    :param provider: ``send_batch(batch, deadline) -> Outcome`` (a ResendClient), on ``clock``'s
        monotonic timeline; a claimed batch may run ``send_grace_seconds`` past the budget.
    :param budget_seconds: no new claim or wait starts after this many seconds (monotonic).
    :param batch_size: emails per request, 1-100.
    :param policy: the contact policy (default: ``[policy]`` of the campaigns folder's ``lifecycle.toml``).
    :param folder: the campaigns folder (default: :meth:`CampaignFolder.resolve`): the policy and
        the templates' content hash recorded on each batch (the renderer's templates should be its own).
    :param pipelined: claim, render and store batch N+1 while batch N is in flight
        (:class:`mailflow.sendloop.engine.ChunkPipeline`: one batch in flight, its answer applied on ``conn``;
        a crash leaves at most two claimed batches, both with their bytes, for the reconciler).
    :param breaker: the shared circuit breaker (default: the provider account's, in ``conn``'s
        database): asked before each claim; while it is open nothing is claimed and the run stops
        with ``circuit open``; a batch whose whole request failed opens it.
    :raises SendError: after recording everything, if the provider refused the key, an
        idempotency conflict needs a person, or an email could not be rendered (a recipient's
        snapshot lacks a template variable: that row is marked ``failed``, the others are sent),
        the provider failed whole requests or the breaker was open (the run could not send), or a
        campaign was paused for its own fault (see above).
    :raises ValueError: for a batch size outside 1-100.
    """
    if not 1 <= batch_size <= MAX_BATCH:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH} emails (provider batch limit), got {batch_size}")
    clock = clock or SystemClock()
    run = run or RunContext()
    d = Dispatcher(conn, renderer, run, batch_size, policy, folder)
    d.key_identity = key_identity_of(provider)
    d.account = reputation.guard_account(conn, breaker_account(provider))
    d.guard_config = reputation.config_for(conn, d.account)
    summary = DispatchSummary()
    t0 = clock.monotonic()
    deadline = t0 + budget_seconds
    fatal: list[str] = []
    slot: float | None = None
    pipe = ChunkPipeline(d.store, provider, run, enabled=pipelined)
    breaker = breaker or CircuitBreaker.for_run(conn, provider, run)
    actor = actor_name(run, "dispatcher")
    summary.canaries_released = release_canaries(conn, actor)
    waiting = reputation.waiting_scopes(conn)
    if waiting:  # a round whose outcomes stopped coming starts again after the guard's outcome wait
        reputation.evaluate(conn, [name for scope, name in waiting if scope == "campaign"], account=d.account,
                            config=d.guard_config)
        # an account scope another process names otherwise holds the claim statements too: evaluated here
        for other in sorted({name for scope, name in waiting if scope == "account"} - {d.account}):
            reputation.evaluate(conn, [], account=other)

    def pause_campaign(name: str, reason: str) -> None:
        """The campaign itself is at fault: pause it (the others go on) and fail the task at the end."""
        fatal.append(f"{name}: {reason}")
        summary.paused.setdefault(name, reason)
        hold(conn, name, reason, actor=actor)

    def campaign_fault(outcome: Outcome) -> str | None:
        """The reason to pause the batch's campaign, if the provider refused a field of the campaign."""
        if isinstance(outcome, Accepted) and outcome.campaign_field:
            return f"provider refused the campaign's `{outcome.campaign_field}`: {outcome.stop_run}"
        if isinstance(outcome, NotSent) and outcome.stop_run == "request refused":
            name = campaign_field(outcome.reason)
            if name is not None:
                return f"provider refused the campaign's `{name}`: {outcome.reason}"
        return None

    def drain() -> str | None:
        """Collect the batch in flight (if any); the reason the run stops, if its answer says so."""
        done = pipe.collect()
        if done is None:
            return None
        chunk, outcome, applied, batch = done
        claim = chunk.tag
        assert isinstance(claim, Claim)
        d.count(claim, outcome, applied, batch, summary)
        d.give_back(claim.campaign.name, applied.released + applied.failed)
        breaker.record(outcome)  # a whole-request failure opens it for every sender
        fault = campaign_fault(outcome)
        if fault is not None:
            # nobody was charged (the rows went back to pending); this campaign stops, not the run
            pause_campaign(claim.campaign.name, fault)
            return None
        if isinstance(outcome, NotSent | Unknown | Refused):
            if outcome.fatal:
                fatal.append(f"{claim.campaign.name}: {outcome.reason}")
            if outcome.stop_run or isinstance(outcome, NotSent):
                # a whole-request failure that will repeat stops the run at once (docs/model.md)
                return outcome.stop_run or outcome.reason
        return None

    try:
        while True:
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                summary.stopped = "time budget"
                break
            wait = d.due_wait(coalesce_seconds)
            if wait is None:
                break  # nothing pending in any active campaign
            if wait > 0:
                if pipe.busy:  # nothing to prepare meanwhile: take the answer of the batch in flight
                    stop = drain()
                    if stop:
                        summary.stopped = stop
                        break
                    continue
                if wait >= remaining:
                    break  # the next claim falls after this run's budget: free the worker slot
                nap = min(wait, poll_seconds)
                clock.sleep(nap)
                summary.idle_seconds += nap
                continue
            # The budget covers the wait for the request slot, checked BEFORE claiming: a claimed batch
            # is always sent (its first attempt starts at the reserved slot).
            if slot is None:
                slot = reserve_slot(provider, deadline + send_grace_seconds, clock)
            if slot is None:
                summary.stopped = "time budget"
                break
            if breaker.admit(provider, deadline, clock) is not None:
                summary.stopped = CIRCUIT_OPEN  # nothing claimed: nobody is charged
                break
            try:
                suppressed, claim = d.claim()
            except psycopg.OperationalError:
                raise  # the database itself: not one campaign's fault
            except Exception as exc:  # rolled back: the campaign's rows stay pending
                if d.claiming is None or d.claiming in summary.paused:
                    raise  # not one campaign's, or pausing it did not take it out of the queue
                log.exception("dispatch of campaign %s failed; pausing it, the others go on", d.claiming)
                pause_campaign(d.claiming, f"dispatch failed: {type(exc).__name__}: {exc}")
                continue
            summary.suppressed += suppressed
            if claim is None:
                if pipe.busy:
                    stop = drain()
                    if stop:
                        summary.stopped = stop
                        break
                elif not suppressed:
                    # every due row is held by another dispatcher: look again shortly
                    nap = min(0.2, remaining)
                    clock.sleep(nap)
                    summary.idle_seconds += nap
                continue
            if claim.capped is not None:
                # more rows are due than the campaign may still send today: re-plan them from now, never burst
                done = replan_overdue(conn, d.campaign_id(claim.campaign.name), actor=actor, reason=claim.capped)
                summary.replanned[claim.campaign.name] = summary.replanned.get(claim.campaign.name, 0) + done.replanned
                continue
            summary.deferred += claim.decided.get("deferred", 0)
            summary.skipped += claim.decided.get("skipped", 0)
            summary.invalid += claim.decided.get("failed", 0)
            summary.duplicates += claim.decided.get("duplicate", 0)
            summary.readdressed += claim.readdressed
            summary.gone += claim.gone
            summary.render_failed += claim.render_failed
            if claim.render_failed:
                fatal.append(f"{claim.campaign.name}: {claim.render_failed} email(s) could not be rendered and "
                             f"were marked failed ({claim.render_errors[0]})")
            summary.claimed += len(claim.rows) + claim.render_failed
            if claim.batch is None:
                continue
            summary.batches += 1
            chunk = InFlight(claim.batch, claim.rows, partial(d.prepare, claim.campaign),
                             deadline + send_grace_seconds, tag=claim)
            stop = drain()  # one batch in flight at a time: the previous one's answer first
            if stop:
                released = release_unsent(d.store, chunk, f"the run stopped ({stop})", run).released
                summary.released += released
                d.give_back(claim.campaign.name, released)
                summary.stopped = stop
                break
            if claim.campaign.name in summary.paused:  # the batch before paused its campaign
                released = release_unsent(
                    d.store, chunk, f"campaign paused ({summary.paused[claim.campaign.name]})", run).released
                summary.released += released
                d.give_back(claim.campaign.name, released)
                continue
            pipe.submit(chunk, slot)
            slot = None
            if not pipe.pipelined:  # unpipelined: the answer is applied before the next claim
                stop = drain()
                if stop:
                    summary.stopped = stop
                    break
        stop = drain()
        if stop and not summary.stopped:
            summary.stopped = stop
    finally:
        try:
            if pipe.busy:
                drain()
        finally:
            pipe.close()
            d.close()
    summary.completed = complete(conn, actor=actor_name(run, "dispatcher"))
    with conn.transaction():  # why each campaign that does not send is held (the metrics' gauges)
        summary.held = hold_states(conn)
    for name, why in summary.held.items():
        if why is not None:
            log.info("campaign %s held (%s): %s", name, why["kind"], why["reason"])
    summary.seconds = clock.monotonic() - t0
    log.info("dispatch: %s", summary.as_dict())
    if breaker.opened_by_run is not None:
        # the provider failed whole requests or the breaker was open: a run that could not send
        # must not look green (the breaker keeps a retry from claiming anything new)
        fatal.append(f"provider down ({summary.stopped or CIRCUIT_OPEN}): {breaker.opened_by_run}; nothing new is "
                     f"claimed until a probe is answered (docs/operations.md, 'Circuit breaker')")
        log.error("dispatch could not send: %s", fatal[-1])
    if fatal:
        raise SendError("; ".join(fatal), summary=summary)
    return summary
