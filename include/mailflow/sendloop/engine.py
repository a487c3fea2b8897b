"""The shared send loop: send one stored chunk, apply the provider's answer by index, and re-send
a strict-mode refusal once in permissive mode under a new key (:func:`send_chunk`); keep one chunk
in flight while the next is prepared (:class:`ChunkPipeline`, when present); reserve the request
slot before a chunk is minted or claimed (:func:`reserve_slot`).

Both sources call it (:mod:`mailflow.sources.lifecycle`, :mod:`mailflow.sources.scheduled`), and
so does the reconciler. It sees three narrow things: a store (:class:`~mailflow.store.send_log.Store`),
a provider with ``send_batch(batch, deadline) -> Outcome`` and a
:class:`~mailflow.model.clock.Clock`; it is tested without Airflow.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from mailflow.model.clock import Clock
from mailflow.model.outcome import MintedRow, NotSent, Outcome, PreparedBatch, Refused, RunContext
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
    covers the wait for the slot and a minted chunk is always sent (a run that ran out of time
    after minting would otherwise leave claimed rows for the reconciler instead of sending them)."""
    reserve = getattr(provider, "reserve_slot", None)
    if reserve is None:
        now = clock.monotonic()
        return now if now <= deadline else None
    start: float | None = reserve(deadline)
    return start


def peek_slot(provider: object, deadline: float) -> float | None:
    """The predicted start (``clock.monotonic()``) of the provider's next request slot, NOT claimed,
    or None if it starts after ``deadline`` (then nothing should be minted). For providers with
    ``peek_slot`` (:meth:`mailflow.provider.client.ResendClient.peek_slot`); the pipelined lifecycle
    engine checks the budget with it before a mint and claims the slot right before the send.
    Another sender may claim the predicted slot meanwhile: the chunk then starts a slot or a few
    later, past the budget by at most that; a slot more than ``SLOT_GRACE_SECONDS`` past the budget
    (a hold after someone's 429) is not waited for: the chunk is released uncharged (``time budget``,
    :meth:`mailflow.provider.client.ResendClient.send_batch`)."""
    start: float | None = provider.peek_slot(deadline)  # type: ignore[attr-defined]
    return start


def key_identity_of(provider: object) -> str | None:
    """The non-secret identity of the API key ``provider`` sends with (``ResendClient.key_identity``),
    or None for a provider that has none (a test double): the store records it with every batch."""
    identity = getattr(provider, "key_identity", None)
    return identity if isinstance(identity, str) else None


def stamp_identity(prepare: Callable[[Sequence[MintedRow]], PreparedBatch],
                   provider: object) -> Callable[[Sequence[MintedRow]], PreparedBatch]:
    """``prepare`` whose batches carry ``provider``'s key identity (:func:`key_identity_of`), so the
    store records, in the statement that stores the bytes, which API key the batch is sent under."""
    identity = key_identity_of(provider)

    def stamped(rows: Sequence[MintedRow]) -> PreparedBatch:
        return dataclasses.replace(prepare(rows), key_identity=identity)

    return stamped


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
    return finish_chunk(store, provider, prepare, batch, rows, send_prepared(provider, batch, deadline, slot), deadline, run)


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
        outcome = send_prepared(provider, batch, deadline, None)
        total = total + store.apply(batch, outcome, run)
    return outcome, total, batch


#: ``slot`` value for :meth:`ChunkPipeline.submit`: claim the request slot on the sender thread
#: right before the request (``send_batch(..., claim_at_send=True)``), whatever the budget.
CLAIM_AT_SEND = float("-inf")


def send_prepared(provider: BatchProvider, batch: PreparedBatch, deadline: float, slot: float | None) -> Outcome:
    sender = key_identity_of(provider)
    if batch.key_identity is not None and sender is not None and batch.key_identity != sender:
        # the provider may scope idempotency keys per API key: under another key the same key and
        # bytes could be processed twice. Callers pick the client by the batch's identity.
        raise ValueError(f"batch {batch.idempotency_key} was stored for API key {batch.key_identity}, "
                         f"not for this client's key {sender}: never sent under another key")
    if slot == CLAIM_AT_SEND:
        return provider.send_batch(batch, deadline, claim_at_send=True)  # type: ignore[call-arg]
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
    """Pipelined sending (the provider's wait is spent preparing the next chunk instead of idling):
    at most ONE chunk in flight while the caller prepares the next.

    ``submit`` starts the provider call of a stored chunk (its rows ``sending`` with their batch
    bytes: recoverable by the reconciler) on a single background thread (the provider is
    thread-safe: httpx and a locked pacer); the caller's thread meanwhile pages, mints, renders and
    stores chunk N+1 on its own connection. The answer is applied by index either on the sender
    thread, with ``apply_store`` (a store on a SECOND connection, e.g.
    :meth:`~mailflow.store.send_log.PostgresStore.companion`: apply leaves the critical path), or,
    without one, by ``collect`` on the caller's thread and connection. No connection is ever used
    by two threads. ``collect`` waits for the chunk in flight (sent and applied). So a crash leaves
    at most two chunks exposed, both stored with their bytes: the one in flight (or being applied)
    and the one just minted. With ``enabled=False`` ``submit`` sends synchronously (the unpipelined
    engine, for comparison and for providers that are not thread-safe).
    """

    def __init__(self, store: Store, provider: BatchProvider, run: RunContext, *, enabled: bool = True,
                 apply_store: Store | None = None):
        self.store, self.provider, self.run = store, provider, run
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mailflow-send") if enabled else None
        self._apply_store = apply_store if enabled else None
        self._inflight: InFlight | None = None
        self._done: Future[tuple[Outcome, Applied, PreparedBatch]] | None = None

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
            chunk.outcome = send_prepared(self.provider, chunk.batch, chunk.deadline, slot)
        elif self._apply_store is not None:
            self._done = self._pool.submit(self._send_and_apply, self._apply_store, chunk, slot)
        else:
            chunk.future = self._pool.submit(send_prepared, self.provider, chunk.batch, chunk.deadline, slot)
        self._inflight = chunk

    def _send_and_apply(self, store: Store, chunk: InFlight, slot: float | None) -> tuple[Outcome, Applied, PreparedBatch]:
        """The sender thread's whole job for one chunk when it has its own store."""
        outcome = send_prepared(self.provider, chunk.batch, chunk.deadline, slot)
        return finish_chunk(store, self.provider, chunk.prepare, chunk.batch, chunk.rows, outcome, chunk.deadline,
                            self.run)

    def collect(self) -> tuple[InFlight, Outcome, Applied, PreparedBatch] | None:
        """Wait for the chunk in flight (if any) and apply its answer (:func:`finish_chunk`).

        :returns: ``(chunk, last outcome, row changes, last batch sent)``, or None if nothing was in
            flight. An exception of the provider call propagates (the rows keep key and bytes).
        """
        chunk, self._inflight = self._inflight, None
        if chunk is None:
            return None
        if self._done is not None:
            pending, self._done = self._done, None
            result = pending.result()
            return (chunk, *result)
        outcome = chunk.outcome if chunk.future is None else chunk.future.result()
        assert outcome is not None
        done = finish_chunk(self.store, self.provider, chunk.prepare, chunk.batch, chunk.rows, outcome,
                            chunk.deadline, self.run)
        return (chunk, *done)

    def close(self) -> None:
        """Stop the background thread, after waiting for a chunk still in flight (applied only if the
        sender thread has its own ``apply_store``; otherwise ``collect`` it first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def release_unsent(store: Store, chunk: InFlight, reason: str, run: RunContext) -> Applied:
    """A minted chunk that will never be sent (the chunk before it stopped the run): proven not
    processed, so its rows are rolled back without charging anyone (docs/model.md)."""
    return store.apply(chunk.batch, NotSent(reason=f"not sent: {reason}"), run)
