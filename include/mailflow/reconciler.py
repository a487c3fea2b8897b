"""The reconciler: repair what a crash or an unknown provider outcome left behind.

Runs every 30 minutes (``reconcile_send_log``). In order, each step a guarded, idempotent change:

1. a stale ``sending`` row (claimed longer ago than ``stale_after`` seconds; younger claims belong
   to a live worker and are never touched) that already has a provider id becomes ``sent``;
2. a stale ``sending`` row without a stored batch was never requested: rolled back;
3. a stale batch older than the provider's idempotency window (Resend keeps keys 24 h; we use
   ``window`` = 23 h for a margin) is never resent under a new key: its rows become ``failed``
   ("unknown outcome") and dead-lettered for a person to decide;
4. a stale batch inside the window is re-claimed (conditional update) and resent with the SAME key,
   the SAME stored bytes and the same validation mode: the provider answers with the original
   result if it had processed it; the answer is applied by index like any send. Its sender is gone
   and may have written the request, so its rows are ambiguous from the claim on: a 5xx, 429, 4xx
   or the reconciler's own budget leaves them ``sending`` with their key (never released); only a
   2xx resolves them. The request slot is reserved before the claim, inside the budget. A strict
   batch refused whole by validation is sent again with the same key and bytes in permissive mode
   (its rows may not be re-keyed; the refusal proves the key holds no accepted request).
   A batch is resent only under the API key it was first sent with (``send_batch.key_identity``:
   the provider scopes idempotency keys per API key, so another key could deliver it twice): the
   current key, or a previous key kept for resends (``previous``); a NULL identity (a batch stored
   before that column existed) goes under the current key, as before. A batch whose key is neither
   is HELD: not claimed, not resent, reported in ``held`` for an alert, and dead-lettered by step 3
   once past the window (docs/operations.md, "Rotating the API key").

While the shared circuit breaker is open (:mod:`mailflow.provider.breaker`), step 4 is the probe:
the reconciler takes the probe lease (one process at a time) and resends the oldest stale batch
under its key; an answer closes the breaker and the other batches follow, a 5xx, a timeout or a
refused connection keeps it open and ends the step. With no stale batch it probes with
``GET /domains``. Without the lease (another process probes) nothing is resent this run.

Whole-request failures never charge users (docs/model.md), so there is no "attempts exhausted"
step. Dead letters found in step 3 are returned so the DAG can alert through a notifier.
Running it twice changes nothing the second time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from mailflow.model.clock import Clock, SystemClock
from mailflow.model.outcome import NotSent, PreparedBatch, Refused, RunContext
from mailflow.provider.breaker import CircuitBreaker, is_answer, key_refused
from mailflow.sendloop.engine import BatchProvider, key_identity_of, reserve_slot, send_prepared
from mailflow.store.send_log import PostgresStore, mask_email
from mailflow.store.sql import query

log = logging.getLogger(__name__)

IDEMPOTENCY_WINDOW = timedelta(hours=23)  # Resend keeps keys 24 h; 1 h of margin


@dataclass
class RepairSummary:
    """Counts of one reconcile run (rows), plus the dead letters created (dicts: id, user_id,
    campaign, masked email, error) and the batches held because their API key is not configured
    (dicts: key, campaign, key_identity, created_at, rows still sending)."""

    promoted_sent: int = 0
    rolled_back_unbatched: int = 0
    unknown_outcome_failed: int = 0
    batches_resent: int = 0
    resent_sent: int = 0
    resent_failed: int = 0
    resent_rolled_back: int = 0
    resent_still_unknown: int = 0
    circuit: str = "closed"
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    held: list[dict[str, Any]] = field(default_factory=list)
    #: batches whose resend under a previous key (``previous_api_keys``) was refused 401/403
    #: (dicts: key, campaign, key_identity, reason): kept ambiguous, the key is needed until they resolve
    key_refused: list[dict[str, Any]] = field(default_factory=list)

    def changed(self) -> int:
        """Rows whose state changed in this run."""
        return (self.promoted_sent + self.rolled_back_unbatched + self.unknown_outcome_failed + self.resent_sent
                + self.resent_failed + self.resent_rolled_back)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("dead_letters", "held", "key_refused")} | {
            "dead_letters": len(self.dead_letters), "held": len(self.held), "key_refused": len(self.key_refused)}


def reconcile(conn: psycopg.Connection, provider: BatchProvider, *, now: datetime,
              stale_after: timedelta = timedelta(minutes=15),
              window: timedelta = IDEMPOTENCY_WINDOW, run: RunContext | None = None,
              deadline: float = float("inf"), batch_limit: int = 500,
              clock: Clock | None = None,
              previous: Mapping[str, Callable[[], BatchProvider]] | None = None) -> RepairSummary:
    """Run the repair steps once; see the module docstring.

    :param conn: psycopg 3 connection to the send log, idle (switched to autocommit; each step is an
        explicit transaction).
    :param now: the database-consistent "now" (aware UTC) the stale threshold and the idempotency
        window are measured from (the reconciler repairs the present, so wall time is right here).
    :param deadline: ``clock.monotonic()`` value (default clock: the system's) after which no new
        batch is resent; the budget covers the wait for each batch's request slot.
    :param provider: sends under the connection's current API key; its ``key_identity`` (None for
        a double without one: every batch is then resent with it, as before identities existed).
    :param previous: key identity -> factory of a provider for a previous API key (same account,
        same pacer; :meth:`mailflow.provider.hook.ResendHook.previous_clients`), called on first use;
        batches first sent under that key are resent with it. A batch under any other key is held.
    """
    clock = clock or SystemClock()
    store = PostgresStore(conn)  # sets autocommit: each step below commits on its own
    run = run or RunContext()
    who = {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}
    stale_before = now - stale_after
    window_start = now - window
    params = who | {"stale_before": stale_before, "window_start": window_start}
    s = RepairSummary()
    current = key_identity_of(provider)
    usable: list[str] | None = None
    if current is not None:
        usable = [current] + [i for i in dict.fromkeys(previous or {}) if i != current]
        with conn.transaction():
            conn.execute(query("repair", "forget_key_identities"), {"identities": usable})
            conn.execute(query("repair", "record_key_identities"), {"identities": usable})
    senders: dict[str, BatchProvider] = {}

    def sender_for(identity: str | None) -> BatchProvider:
        if identity is None or identity == current or previous is None or identity not in previous:
            return provider  # unknown (legacy) identity, or no identities at all: the current key
        if identity not in senders:
            senders[identity] = previous[identity]()
        return senders[identity]

    with conn.transaction():
        s.promoted_sent = len(conn.execute(query("repair", "promote_with_provider_id"), params).fetchall())
        s.rolled_back_unbatched = len(conn.execute(query("repair", "release_unbatched"), params).fetchall())
        for r in conn.execute(query("repair", "fail_past_window"), params).fetchall():
            s.unknown_outcome_failed += 1
            s.dead_letters.append({"id": r[0], "user_id": r[1], "campaign": r[2], "email": mask_email(r[3]), "error": r[4]})

    with conn.transaction():
        batches = conn.execute(query("repair", "stale_batches"),
                               params | {"limit": batch_limit, "identities": usable}).fetchall()
        held = conn.execute(query("repair", "held_batches"), params | {"identities": usable}).fetchall() \
            if usable is not None else []
    for key, campaign, identity, created_at, sending in held:
        # Resending under another API key could deliver it twice (idempotency keys are scoped per
        # key): held, untouched, until its key is configured again or the window closes.
        s.held.append({"key": key, "campaign": campaign, "key_identity": identity, "created_at": created_at,
                       "rows": int(sending)})
        if len(s.held) > 20:
            continue  # the count below and the alert name the rest
        log.error("batch %s (%s, %d emails still sending) was first sent under API key %s, which is neither the "
                  "current key (%s) nor a previous_api_keys entry: held, not resent under another key (it could "
                  "deliver twice); put that key back in previous_api_keys (docs/operations.md, 'Rotating the API "
                  "key') or it becomes a dead letter when its idempotency window closes",
                  key, campaign, int(sending), identity, current)
    if len(s.held) > 20:
        log.error("%d batches (%d emails) held in all, first sent under API keys that are not configured",
                  len(s.held), sum(h["rows"] for h in s.held))
    breaker = CircuitBreaker.for_run(conn, provider, run)
    probing = False
    if breaker.state().open:
        s.circuit = "open"
        if not batches:
            # nothing ambiguous to probe with: a read that mints nothing (one per run at most)
            s.circuit = "closed by probe" if breaker.admit(provider, deadline, clock) is None else "open"
            return s
        probing = breaker.take_probe()
        if not probing:
            log.warning("circuit breaker open and another process holds the probe: no resend this run")
            return s
        log.warning("circuit breaker open: probing with a same-key resend of batch %s", batches[0][0])
    try:
        _resend(conn, store, sender_for, breaker, batches, params, run, deadline, clock, s, probing)
    finally:
        if breaker.state().probe_holder == breaker.holder:
            breaker.release_probe()
    return s


def _resend(conn: psycopg.Connection, store: PostgresStore, sender_for: Callable[[str | None], BatchProvider],
            breaker: CircuitBreaker,
            batches: list[Any], params: dict[str, Any], run: RunContext, deadline: float, clock: Clock,
            s: RepairSummary, probing: bool) -> None:
    """Step 4: resend stale batches under their keys, each with the client of the API key it was
    first sent under (``sender_for(identity)``); the first one is the breaker's probe when
    ``probing`` (its answer closes the breaker, a failure ends the step)."""
    slot: float | None = None
    refused_keys: set[str | None] = set()
    for key, campaign, body, count, validation, identity in batches:
        if identity in refused_keys:
            continue  # its previous key was refused in this run: left ambiguous, untouched
        sender = sender_for(identity)
        previous_key = sender is not sender_for(None)  # a key kept in previous_api_keys for resends
        if slot is None:
            slot = reserve_slot(sender, deadline, clock)
        if slot is None:
            log.info("resend step: the next request slot falls after the budget; the rest waits for the next run")
            break
        with conn.transaction():
            rows = conn.execute(query("repair", "claim_stale_batch"), params | {"key": key}).fetchall()
        claimed = [r for r in rows if r[3]]
        if not claimed:
            continue  # a live worker or another reconciler owns it now (the slot is kept for the next)
        if len(rows) != count or [r[1] for r in rows] != list(range(count)):
            log.error("batch %s: %d rows with indices %s do not match its %d emails; left for a person",
                      key, len(rows), [r[1] for r in rows], count)
            continue
        batch = PreparedBatch(idempotency_key=key, campaign=campaign, row_ids=tuple(r[0] for r in rows),
                              body=bytes(body), validation=validation, key_identity=identity)
        outcome = send_prepared(sender, batch, deadline, slot)
        slot = None
        if isinstance(outcome, Refused):
            # Strict validation refused the stored request as a whole. Its key holds no accepted
            # request (the provider would have replayed that answer for the same key and bytes), but
            # the rows are ambiguous and are never re-keyed: the SAME bytes go again under the SAME
            # key in permissive mode, whose answer names the refused emails by index (docs/model.md).
            log.info("batch %s refused by strict validation (%s); resending it permissive under the same key",
                     key, outcome.reason)
            batch = dataclasses.replace(batch, validation="permissive")
            outcome = send_prepared(sender, batch, deadline, None)
        # Rows of the batch that are no longer 'sending' are skipped by the guarded updates.
        applied = store.apply(batch, outcome, run)
        s.batches_resent += 1
        s.resent_sent += applied.sent
        s.resent_failed += applied.failed
        s.resent_rolled_back += applied.released
        s.resent_still_unknown += applied.unknown
        log.info("resent batch %s (%s, %d emails): %d sent, %d rejected, %d rolled back, %d still unknown",
                 key, campaign, count, applied.sent, applied.failed, applied.released, applied.unknown)
        if previous_key and key_refused(outcome):
            # The previous key was revoked or mistyped: the refusal says nothing about the request
            # first sent under it (the rows stay ambiguous: only a 2xx under that key resolves
            # them) nor about whether the provider processes sends (the breaker stays as it is).
            refused_keys.add(identity)
            s.key_refused.append({"key": key, "campaign": campaign, "key_identity": identity,
                                  "reason": getattr(outcome, "reason", "")})
            log.error("batch %s (%s, %d emails) was resent under previous API key %s and the provider refused that "
                      "key (%s): kept ambiguous, not resent under another key (it could deliver twice). The rotation "
                      "procedure needs that key valid until nothing needs it (docs/operations.md, 'Rotating the API "
                      "key'; `mailflow keys`); past the idempotency window the rows become dead letters",
                      key, campaign, count, identity, getattr(outcome, "reason", ""))
            continue  # no verdict: a probe goes on with the next batch
        failure = breaker.record(outcome, previous_key=previous_key)  # an answer closes it, a whole-request failure opens it
        if probing:
            probing = False
            s.circuit = "closed by probe" if is_answer(outcome) else "open"
            if failure is not None or not is_answer(outcome):
                log.warning("probe resend of batch %s was not answered (%s): the breaker stays open",
                            key, getattr(outcome, "reason", ""))
                break
        if outcome.stop_run or isinstance(outcome, NotSent):
            log.warning("stopping the resend step: %s", outcome.stop_run or getattr(outcome, "reason", ""))
            break
