"""PostgreSQL adapter for the send log: the engine's *store* of rows.

Every write is a named statement from ``store/sql/queries``; every state change is guarded on the
current state and appends a ``mail.send_event`` row in the same statement.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import psycopg
from psycopg import sql as pgsql
from psycopg.types.json import Jsonb

from mailflow.campaigns import Campaign
from mailflow.model.apply_by_index import CAMPAIGN_FIELDS, RENDERED_FIELDS, campaign_field
from mailflow.model.holdout import in_holdout
from mailflow.model.keys import batch_key, key_tag
from mailflow.model.outcome import (
    Accepted,
    MintedRow,
    NotSent,
    Outcome,
    PreparedBatch,
    Refused,
    RunContext,
    Unknown,
)
from mailflow.store.contact_guard import (
    caps_sql,
    contact_params,
    duplicate_reason,
    with_mailbox_contacts,
)
from mailflow.store.policy import contacts_from_rows, evaluate, normalise_address
from mailflow.store.sql import query


@dataclass(frozen=True)
class MintResult:
    """One page of the audience and what became of it.

    ``page_size`` = candidates read (0 = audience exhausted), ``cursor`` = the last user_id read
    (keyset), ``batch`` = the prepared request for the rows actually minted (None if every candidate
    lost the ON CONFLICT race to another run)."""

    page_size: int
    cursor: int
    batch: PreparedBatch | None
    rows: tuple[MintedRow, ...] = ()
    invalid: int = 0
    duplicates: int = 0
    held: int = 0
    holdout: int = 0


@dataclass(frozen=True)
class Applied:
    """Rows changed by applying an outcome: sent, failed (rejected), released, left unknown."""

    sent: int = 0
    failed: int = 0
    released: int = 0
    unknown: int = 0

    def __add__(self, other: Applied) -> Applied:
        return Applied(self.sent + other.sent, self.failed + other.failed, self.released + other.released,
                       self.unknown + other.unknown)


class _LostRows(Exception):
    """The mint's ON CONFLICT backstop claimed only ``claimed`` (user ids) of a batch's rows."""

    def __init__(self, claimed: set[int]):
        super().__init__(f"{len(claimed)} rows claimed")
        self.claimed = claimed


class RunMemory:
    """What a store (and its :meth:`PostgresStore.companion` on the sender thread) remembers across
    chunks of a run, thread-safe: the normalised addresses the provider rejected in each run
    (read once per run from the send log, then kept up to date by every apply: a lower-priority
    campaign does not try them again in the same run), and the address of each row in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rejected: dict[str | None, set[str]] = {}
        self._row_keys: dict[int, str] = {}

    def rejected_in_run(self, conn: psycopg.Connection, run_id: str | None) -> frozenset[str]:
        """The addresses rejected in run ``run_id`` so far (none without a run id)."""
        if run_id is None:
            return frozenset()
        with self._lock:
            known = self._rejected.get(run_id)
        if known is None:
            rows = conn.execute(query("mint", "rejected_of_run"), {"run_id": run_id}).fetchall()
            with self._lock:
                known = self._rejected.setdefault(run_id, {str(r[0]) for r in rows})
        with self._lock:
            return frozenset(known)

    def minted(self, rows: Sequence[MintedRow], keys: dict[int, str]) -> None:
        """Remember the normalised address of each minted row (``keys``: user_id -> address)."""
        with self._lock:
            for r in rows:
                self._row_keys[r.id] = keys[r.user_id]

    def applied(self, run_id: str | None, row_ids: Sequence[int], rejected: Sequence[int]) -> None:
        """A batch's answer was applied: ``rejected`` rows' addresses join the run's rejections."""
        with self._lock:
            keys = [self._row_keys.pop(i, None) for i in row_ids]
            if run_id is not None and run_id in self._rejected:
                bad = set(rejected)
                self._rejected[run_id].update(k for i, k in zip(row_ids, keys, strict=True)
                                              if k is not None and i in bad)


class Store(Protocol):
    """What the engine needs from a send log. A store may also offer the run's audience snapshot
    (``open_audience(campaign, window, cooldown_since) -> int`` and ``close_audience(campaign)``,
    see :class:`PostgresStore`); the engine then pages from it instead of counting separately."""

    def count_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int: ...

    def mint_chunk(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime,
                   after: int, limit: int, run: RunContext, interval: tuple[datetime, datetime],
                   prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> MintResult: ...

    def apply(self, batch: PreparedBatch, outcome: Outcome, run: RunContext) -> Applied: ...

    def rebatch(self, batch: PreparedBatch) -> PreparedBatch: ...


class PostgresStore:
    """The send log in PostgreSQL (schema ``mail``, see ``store/sql/migrations``).

    :param conn: a psycopg 3 connection, idle; the store switches it to autocommit so that nothing
        can hold a transaction open by accident: every unit of work is an explicit
        ``conn.transaction()`` that commits when it ends (a send is never recorded inside a
        transaction that a later crash could roll back).
    :raises ValueError: if the connection is inside a transaction.
    """

    def __init__(self, conn: psycopg.Connection):
        if not conn.autocommit:
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                raise ValueError("PostgresStore needs an idle connection (commit or roll back first)")
            conn.autocommit = True
        self.conn = conn
        self._sql_cache: dict[tuple[Any, ...], pgsql.Composed] = {}
        self._snapshots: dict[str, pgsql.Identifier] = {}
        self._snapshot_seq = 0
        self._memory = RunMemory()

    def companion(self, conn: psycopg.Connection) -> PostgresStore:
        """A store on another connection that shares this one's :class:`RunMemory`: the pipelined
        sender applies answers with it on its own thread (a connection is never used by two
        threads), while this store mints the next chunk."""
        other = PostgresStore(conn)
        other._memory = self._memory
        return other

    def _audience_sql(self, name: str, campaign: Campaign) -> pgsql.Composed:
        key = (name, campaign.name, campaign.audience_sql, campaign.exempt, len(campaign.contact_policy.extra_caps()))
        if key not in self._sql_cache:
            self._sql_cache[key] = pgsql.SQL(query("lifecycle", name)).format(eligible=eligible_sql(campaign))
        return self._sql_cache[key]

    @staticmethod
    def _params(campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> dict[str, Any]:
        ref = cooldown_since + campaign.cooldown  # the interval end
        out = {"campaign": campaign.name, "window_start": window[0], "window_end": window[1],
               "cooldown_since": cooldown_since, "cooldown_until": cooldown_since + 2 * campaign.cooldown,
               "cooldown": campaign.cooldown, "exempt": campaign.exempt}
        for i, cap in enumerate(campaign.contact_policy.extra_caps()):
            out |= {f"cap_since_{i}": ref - cap.window, f"cap_until_{i}": ref + cap.window,
                    f"cap_window_{i}": cap.window, f"cap_emails_{i}": cap.emails}
        return out

    def count_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int:
        """Audience size after exclusions (emails), read in its own short transaction. The contact
        policy is the same pre-filter the mint starts from (cooldown, caps, suppression); the mint
        re-checks each user under the contact guard, so this is an upper bound of what is minted."""
        with self.conn.transaction():
            row = self.conn.execute(self._audience_sql("audience_count", campaign),
                                    self._params(campaign, window, cooldown_since)).fetchone()
        return int(row[0]) if row else 0

    def open_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int:
        """Evaluate the campaign's eligible audience ONCE (``lifecycle.eligible``: the anti-joins, then
        one contact-policy probe per remaining candidate) into a temporary table of this session
        keyed by user_id, in one statement (one audience snapshot per campaign per run, because
        evaluating the audience page by page cost seconds per campaign at 1M users;
        ``lifecycle.snapshot_create``), then keys it (``snapshot_key``). Until :meth:`close_audience`,
        :meth:`mint_chunk` pages from it (~1 ms a page) and re-checks each user at mint (suppression
        by user and address, the contact policy under the contact guard, the (user, campaign) key),
        so a snapshot that aged during the run never sends what the live state forbids.

        Call it at the campaign's turn, after every earlier campaign of the run has minted (the
        priority rule: their claims are contacts the snapshot excludes).

        :returns: the audience size after exclusions (emails), the run summary's ``eligible``.
        """
        self.close_audience(campaign)
        self._snapshot_seq += 1
        ident = pgsql.Identifier("pg_temp", f"mailflow_audience_{self._snapshot_seq}")
        with self.conn.transaction():
            # JIT compiles these plans (cost above jit_above_cost at 1M users) for ~0.1-0.3 s and
            # gains nothing on index-driven joins: off for this transaction only; and room for the
            # hash of the campaign's live rows (dedupe) and in-memory sorts at 1M users
            self.conn.execute("set local jit = off")
            self.conn.execute("set local work_mem = '64MB'")
            # and, while the send log's statistics are stale (lifecycle.send_log_stats_stale), no
            # Materialize: on statistics that think the send log is (nearly) empty, e.g. before
            # autovacuum's first ANALYZE, the planner materialised the campaign's live rows and
            # filtered them per candidate (a nested loop with a join filter: 1M candidates x 10k
            # rows took 240 s); without Materialize that nested loop probes the live key per
            # candidate (~1 us each). Fresh statistics keep the planner's own choice (turning it off
            # always cost ~25% on an analysed 1M population).
            stale = self.conn.execute(query("lifecycle", "send_log_stats_stale")).fetchone()
            if stale is not None and stale[0]:
                self.conn.execute("set local enable_material = off")
            cur = self.conn.execute(pgsql.SQL(query("lifecycle", "snapshot_create")).format(
                snapshot=ident, eligible=eligible_sql(campaign, snapshot=True)),
                self._params(campaign, window, cooldown_since))
            size = max(cur.rowcount, 0)
            key = pgsql.SQL(query("lifecycle", "snapshot_key")).format(snapshot=ident)
            try:
                with self.conn.transaction():
                    self.conn.execute(key)
            except psycopg.errors.UniqueViolation:  # the audience file lists a user twice
                cur = self.conn.execute(pgsql.SQL(query("lifecycle", "snapshot_dedupe")).format(snapshot=ident))
                size -= max(cur.rowcount, 0)
                self.conn.execute(key)
        self._snapshots[campaign.name] = ident
        return size

    def close_audience(self, campaign: Campaign) -> None:
        """Drop the campaign's audience snapshot, if any (also dropped with the session)."""
        ident = self._snapshots.pop(campaign.name, None)
        if ident is not None and not self.conn.closed:
            with self.conn.transaction():
                self.conn.execute(pgsql.SQL(query("lifecycle", "snapshot_drop")).format(snapshot=ident))

    def mint_chunk(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime,
                   after: int, limit: int, run: RunContext, interval: tuple[datetime, datetime],
                   prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> MintResult:
        """Read the next audience page (from the run's snapshot after :meth:`open_audience`, else
        from the live ``lifecycle.eligible``), pass it through the contact guard, mint it, render it and
        store the batch, in ONE transaction.

        The guard (docs/model.md, "The contact policy"): addresses are normalised and checked
        (invalid: a ``failed`` row with the validator's reason, no request); suppression is matched
        on the normalised address; addresses the provider rejected earlier in this run are left
        out; the users' ``mail.contact`` rows are locked (user_id order), then their mailboxes'
        ``mail.mailbox`` rows (key order), and the policy is re-evaluated on what is committed now,
        counting the user's contacts and every other user's at the same mailbox, so a concurrent
        claim of another path or run for the same user or mailbox is seen; a second user at an
        address the campaign already mails gets a ``duplicate`` row naming the first. A user who passed
        every check and is in the campaign's holdout group (:func:`mailflow.model.holdout.in_holdout`)
        gets a ``holdout`` row instead of an email: no address reservation, no request, not a contact,
        and it holds the (user, campaign) key like any row. Either all of it commits (rows ``sending`` with their
        batch bytes, re-sendable by the reconciler) or none of it does.
        """
        params = self._params(campaign, window, cooldown_since) | {"after": after, "limit": limit}
        who = {"campaign": campaign.name, "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id,
               "interval_start": interval[0], "interval_end": interval[1]}
        snapshot = self._snapshots.get(campaign.name)
        policy = campaign.contact_policy
        checks_policy = not campaign.exempt and bool(policy.rules)
        ref = cooldown_since + campaign.cooldown
        conn = self.conn
        with conn.transaction():
            # round trip 1: the page
            if snapshot is not None:
                page = conn.execute(pgsql.SQL(query("lifecycle", "snapshot_page")).format(snapshot=snapshot),
                                    params).fetchall()
            else:
                page = conn.execute(self._audience_sql("audience_page", campaign), params).fetchall()
            if not page:
                return MintResult(page_size=0, cursor=after, batch=None)
            cursor, read = max(r[0] for r in page), len(page)
            addresses = {int(r[0]): normalise_address(r[1]) for r in page}
            decided = [{"user_id": r[0], "email": (r[1] or "").strip(), "email_key": None, "context": r[2],
                        "status": "failed",
                        "error": f"invalid address: {addresses[r[0]].error}"} for r in page if not addresses[r[0]].valid]
            valid = [r for r in page if addresses[r[0]].valid]
            keys = sorted({k for r in valid for k in addresses[r[0]].keys})
            uids = sorted({int(r[0]) for r in valid})
            rejected = self._memory.rejected_in_run(conn, run.run_id)
            # round trip 2 (one pipeline; the server runs the statements in this order, each seeing
            # the ones before): suppression re-checks, the contact guard's locks (users, then
            # mailboxes), then what the locks make authoritative: the users' and the mailboxes'
            # contacts and the users' live rows of this campaign.
            gone_cur = barred_cur = now_cur = contacts_cur = box_cur = taken_cur = None
            with conn.pipeline():
                if snapshot is not None:
                    # the snapshot may have aged: a user who unsubscribed since is left out
                    gone_cur = conn.execute(query("contact", "suppressed_users"),
                                            {"ids": sorted({int(r[0]) for r in page}), "campaign": campaign.name})
                if uids:
                    barred_cur = conn.execute(query("contact", "suppressed_addresses"),
                                              {"keys": keys, "campaign": campaign.name})
                    conn.execute(query("contact", "ensure_contacts"), {"ids": uids})
                    conn.execute(query("contact", "lock_contact_rows"), {"ids": uids})
                    conn.execute(query("contact", "ensure_mailboxes"), {"keys": keys})
                    conn.execute(query("contact", "lock_mailbox_rows"), {"keys": keys})
                    now_cur = conn.execute(query("contact", "db_now"))
                    taken_cur = conn.execute(query("mint", "taken"), {"ids": uids, "campaign": campaign.name})
                    if checks_policy:
                        cparams = contact_params(uids, policy, ref=ref, include_planned=True)
                        contacts_cur = conn.execute(query("contact", "contact_times"), cparams)
                        box_cur = conn.execute(query("contact", "mailbox_contact_times"), cparams | {"keys": keys})
            gone = {int(x[0]) for x in gone_cur} if gone_cur is not None else set()
            barred = {str(x[0]) for x in barred_cur} if barred_cur is not None else set()
            barred |= rejected
            # left out of this run, no row (a later run decides again), counted as held: the summary
            # accounts for every eligible user
            held = len(valid) + sum(1 for d in decided if int(d["user_id"]) in gone)
            decided = [d for d in decided if int(d["user_id"]) not in gone]
            valid = [r for r in valid if int(r[0]) not in gone and not barred.intersection(addresses[r[0]].keys)]
            if valid and contacts_cur is not None and now_cur is not None:
                now_row = now_cur.fetchone()
                assert now_row is not None
                now = now_row[0]
                contacts = contacts_from_rows(contacts_cur.fetchall())
                if box_cur is not None:
                    contacts = with_mailbox_contacts(contacts, box_cur.fetchall(),
                                                     {int(r[0]): addresses[r[0]].key for r in valid})
                valid = [r for r in valid if evaluate(policy, contacts.get(int(r[0]), ()), ref=ref, now=now) is None]
            held -= len(valid)
            if valid and taken_cur is not None:
                # another run of this campaign minted the user after the snapshot (an exempt
                # campaign's race; under the policy the guard holds them above): not ours, not held
                taken = {int(x[0]) for x in taken_cur}
                valid = [r for r in valid if int(r[0]) not in taken]
            if valid and campaign.holdout_share > 0:
                # the control group: decided here, after every check a treated user passes, so the two
                # groups are drawn from the same users (docs/model.md, "Holdout groups")
                out = {int(r[0]) for r in valid if in_holdout(campaign.name, int(r[0]), campaign.holdout_share)}
                decided += [{"user_id": r[0], "email": addresses[r[0]].send, "email_key": addresses[r[0]].key,
                             "context": r[2], "status": "holdout", "error": None} for r in valid if int(r[0]) in out]
                valid = [r for r in valid if int(r[0]) not in out]
            alloc: Any = None
            if valid:
                # round trip 3: reserve the addresses (one email per address and campaign) and
                # allocate the ids and the batch serial
                claims = [(int(r[0]), addresses[r[0]].key) for r in valid]
                with conn.pipeline():
                    conn.execute(query("lifecycle", "reserve_addresses"), {
                        "campaign": campaign.name, "keys": [k for _, k in claims], "uids": [u for u, _ in claims]})
                    holders_cur = conn.execute(query("lifecycle", "address_holders"), {
                        "campaign": campaign.name, "keys": sorted({k for _, k in claims})})
                    alloc_cur = conn.execute(query("mint", "allocate"), {"n": len(valid)})
                holders = {str(k): int(u) for k, u in holders_cur}
                alloc = alloc_cur.fetchone()
                for r in valid:
                    holder = holders[addresses[r[0]].key]
                    if holder != int(r[0]):
                        decided.append({"user_id": r[0], "email": addresses[r[0]].send,
                                        "email_key": addresses[r[0]].key, "context": r[2], "status": "duplicate",
                                        "error": duplicate_reason(addresses[r[0]].key, holder)})
                valid = [r for r in valid if holders[addresses[r[0]].key] == int(r[0])]
            duplicates = sum(1 for d in decided if d["status"] == "duplicate")
            holdout = sum(1 for d in decided if d["status"] == "holdout")
            invalid = len(decided) - duplicates - holdout
            if decided:
                conn.execute(query("lifecycle", "mint_decided"), who | {"page": Jsonb(decided)})
            if not valid:
                return MintResult(page_size=read, cursor=cursor, batch=None, invalid=invalid,
                                  duplicates=duplicates, held=held, holdout=holdout)
            assert alloc is not None
            ids, serial, installation = list(alloc[0]), int(alloc[1]), str(alloc[2])
            rows = tuple(MintedRow(id=int(ids[i]), user_id=int(r[0]), email=addresses[r[0]].send, context=r[2] or {})
                         for i, r in enumerate(valid))
            batch, rows = self._mint_keyed(campaign, rows, {int(r[0]): addresses[r[0]].key for r in valid},
                                           who, serial, installation, prepare)
        if batch is not None:
            self._memory.minted(rows, {int(r[0]): addresses[r[0]].key for r in valid})
        return MintResult(page_size=read, cursor=cursor, batch=batch, rows=rows,
                          invalid=invalid, duplicates=duplicates, held=held, holdout=holdout)

    def _mint_keyed(self, campaign: Campaign, rows: tuple[MintedRow, ...], email_keys: dict[int, str],
                    who: dict[str, Any], serial: int, installation: str,
                    prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> tuple[PreparedBatch | None,
                                                                                      tuple[MintedRow, ...]]:
        """Render ``rows`` (ids allocated), derive the key from the bytes, and insert rows, events and
        batch in one pipeline inside a savepoint. If the ON CONFLICT backstop claimed fewer rows than
        the batch names (a live row appeared without passing the contact lock), roll back to the
        savepoint and do it again for the rows that were claimable: a batch never names a row it
        does not hold."""
        while rows:
            batch = prepare(rows)
            key = batch_key(installation, campaign.name, serial, batch.body)
            batch = dataclasses.replace(batch, idempotency_key=key)
            try:
                with self.conn.transaction():  # a savepoint
                    with self.conn.pipeline():
                        minted_cur = self.conn.execute(query("mint", "mint_keyed"), who | {"key": key, "page": Jsonb([
                            {"id": r.id, "user_id": r.user_id, "email": r.email, "email_key": email_keys[r.user_id],
                             "context": r.context, "idx": i} for i, r in enumerate(rows)])})
                        self.conn.execute(query("mint", "save_batch_keyed"), {
                            "key": key, "campaign": batch.campaign, "count": len(batch.row_ids),
                            "body": batch.body, "validation": batch.validation,
                            "key_identity": batch.key_identity, "content_hash": batch.content_hash})
                    claimed = {int(x[0]) for x in minted_cur}
                    if len(claimed) != len(rows):
                        raise _LostRows(claimed)
            except _LostRows as lost:
                rows = tuple(r for r in rows if r.user_id in lost.claimed)
                continue
            return batch, rows
        return None, ()

    def _save_batch(self, batch: PreparedBatch) -> PreparedBatch:
        row = self.conn.execute(query("send_log", "save_batch"), {
            "tag": key_tag(batch.campaign), "campaign": batch.campaign, "count": len(batch.row_ids),
            "body": batch.body, "validation": batch.validation, "key_identity": batch.key_identity,
            "content_hash": batch.content_hash}).fetchone()
        assert row is not None
        batch = dataclasses.replace(batch, idempotency_key=str(row[0]))
        assigned = self.conn.execute(query("send_log", "assign_batch"), {
            "key": batch.idempotency_key, "ids": list(batch.row_ids),
            "idx": list(range(len(batch.row_ids)))}).fetchall()
        if len(assigned) != len(batch.row_ids):
            raise RuntimeError(f"batch {batch.idempotency_key}: only {len(assigned)} of {len(batch.row_ids)} rows "
                               "are claimable (not sending, or part of an ambiguous request)")
        return batch

    def save_batch(self, batch: PreparedBatch) -> PreparedBatch:
        """Store a batch's exact request bytes, assign its idempotency key (docs/model.md) and give
        its rows (``sending``) that key and their request indices, inside the CALLER's transaction
        (the scheduled dispatcher claims, renders and stores in one transaction, so a ``sending``
        row always has bytes to resend).

        :returns: ``batch`` with the assigned key (the renderer's key is provisional).
        :raises RuntimeError: if a row is not ``sending`` or was part of an ambiguous request.
        """
        return self._save_batch(batch)

    def rebatch(self, batch: PreparedBatch) -> PreparedBatch:
        """Store a new batch for rows already ``sending`` (after a strict-mode refusal, which proves
        nothing was processed): the rows take its new key and indices, and its bytes become what any
        retry resends. Rows that were part of an ambiguous request are never re-keyed.

        :returns: ``batch`` with its assigned key.
        :raises RuntimeError: (transaction rolled back) if a row cannot take the new key.
        """
        with self.conn.transaction():
            return self._save_batch(batch)

    def apply(self, batch: PreparedBatch, outcome: Outcome, run: RunContext) -> Applied:
        """Apply a provider outcome to the batch's rows, by request index, in one transaction."""
        who = {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}
        ids = list(batch.row_ids)
        with self.conn.transaction():
            if isinstance(outcome, Accepted):
                sent = failed = 0
                if outcome.ids:
                    idx = sorted(outcome.ids)
                    sent = len(self.conn.execute(query("send_log", "mark_sent"), who | {
                        "ids": [ids[i] for i in idx], "pids": [outcome.ids[i] for i in idx]}).fetchall())
                rejected = dict(outcome.rejected)
                returned = 0
                if outcome.withheld:
                    # refused for a field of the campaign (its sender, headers, rendered subject):
                    # not the recipient's fault, so released uncharged like a NotSent; this 2xx
                    # answers the key, so a row of an ambiguous request (the reconciler's resend)
                    # is resolved and released too, never failed for the campaign's mistake
                    reason = f"campaign refused by the provider: {outcome.stop_run or ''}"[:1000]
                    done = {r[0] for r in self.conn.execute(query("send_log", "release_withheld"), who | {
                        "ids": [ids[i] for i in sorted(outcome.withheld)], "reason": reason}).fetchall()}
                    returned = len(done)
                    rejected |= {i: m for i, m in outcome.withheld.items() if ids[i] not in done}
                if rejected:
                    idx = sorted(rejected)
                    failed = len(self.conn.execute(query("send_log", "mark_failed"), who | {
                        "ids": [ids[i] for i in idx],
                        "msgs": [rejected[i][:1000] for i in idx]}).fetchall())
                self._memory.applied(run.run_id, ids, [ids[i] for i in outcome.rejected])
                return Applied(sent=sent, failed=failed, released=returned)
            if isinstance(outcome, Refused):
                # Strict validation refused the whole request: nothing was processed and nothing
                # changes here; the caller re-sends the chunk permissive under a new key.
                return Applied()
            self._memory.applied(run.run_id, ids, ())  # no rejection: the rows' addresses are forgotten
            if isinstance(outcome, NotSent):
                # Proven not processed: released without charging anyone, except rows that were
                # ever part of an ambiguous request (they keep their key: only a 2xx resolves them).
                released = {r[0] for r in self.conn.execute(query("send_log", "release"), who | {
                    "ids": ids, "reason": outcome.reason[:1000]}).fetchall()}
                kept = [i for i in ids if i not in released]
                n = len(self.conn.execute(query("send_log", "note_unknown"), who | {
                    "ids": kept, "reason": outcome.reason[:1000], "ambiguous": False}).fetchall()) if kept else 0
                return Applied(released=len(released), unknown=n)
            assert isinstance(outcome, Unknown)
            n = len(self.conn.execute(query("send_log", "note_unknown"), who | {
                "ids": ids, "reason": outcome.reason[:1000], "ambiguous": True}).fetchall())
            return Applied(unknown=n)

    def preview(self, campaigns: Sequence[Campaign], interval: Any, renderer: Any, sample: int = 3) -> list[dict[str, Any]]:
        """Dry run: per campaign, in priority order, the audience size after exclusions and
        ``sample`` rendered emails (subject and masked recipient). Writes nothing.

        The same policy as a real run of ``interval``: the audience query's exclusions (dedupe,
        cooldown, caps, planned emails, suppression), and priority: a user an earlier campaign of
        the run would claim is a contact for every later one, so a later campaign does not count
        them unless it is exempt (transactional) or there is no cooldown. ``eligible`` is what the
        real run reports as its campaign's ``eligible`` (the mint's re-check under the contact guard
        may still hold some back: a claim committed after the dry run); ``holdout`` is how many of
        them the campaign's holdout group would take (no email, no contact for a later campaign, not
        in the sample)."""
        out: list[dict[str, Any]] = []
        taken: set[int] = set()  # users an earlier campaign of this run would claim
        for c in sorted(campaigns, key=lambda c: c.priority):
            window = c.window(interval)
            since = interval.end - c.cooldown
            params = self._params(c, window, since)
            with self.conn.transaction():
                ids = {int(r[0]) for r in self.conn.execute(self._audience_sql("audience_ids", c), params)}
            blocked = set() if c.exempt or c.cooldown <= timedelta(0) else taken
            eligible = ids - blocked
            held_out = {u for u in eligible if in_holdout(c.name, u, c.holdout_share)}
            taken |= eligible - held_out
            emails: list[dict[str, Any]] = []
            after = 0
            while len(emails) < sample:
                with self.conn.transaction():
                    rows = self.conn.execute(self._audience_sql("audience_page", c),
                                             params | {"after": after, "limit": max(sample, 100)}).fetchall()
                if not rows:
                    break
                after = max(int(r[0]) for r in rows)
                emails += [renderer.render_email(c, MintedRow(id=0, user_id=r[0], email=a.send, context=r[2] or {}))
                           for r in rows if int(r[0]) in eligible and int(r[0]) not in held_out
                           and (a := normalise_address(r[1])).valid]
            out.append({
                "campaign": c.name,
                "eligible": len(eligible),
                "holdout": len(held_out),
                "window": [window[0].isoformat(), window[1].isoformat()],
                "sample": [{"to": mask_email(e["to"][0]), "subject": e["subject"]} for e in emails[:sample]],
            })
        return out


@dataclass(frozen=True)
class Reopened:
    """What :func:`reopen_refused` found and did: ``found`` failed rows whose error names the field,
    ``reopened`` (lifecycle rows released, scheduled rows back to pending), ``kept_ambiguous``
    (part of an ambiguous request: left as they are), ``campaign_paused`` (a completed scheduled
    campaign became paused)."""

    found: int
    reopened: int
    kept_ambiguous: int
    campaign_paused: bool


def reopen_refused(conn: psycopg.Connection, campaign: str, field: str | None = None, *,
                   apply: bool = False) -> Reopened:
    """Re-open the rows of ``campaign`` that the provider rejected for a field of the CAMPAIGN, not
    of the recipient (the rule of :func:`mailflow.model.apply_by_index.campaign_field`, applied to
    each row's stored error; ``field`` restricts it to one field, e.g. ``"from"``; without it, the
    fields that are the same in every email: a rendered subject or body refused for one row may be
    about that recipient's data, so those are re-opened only when named): users charged for
    the campaign's mistake before such refusals were recognised (docs/operations.md, "A campaign
    the provider refused"). Lifecycle rows are released (the next run decides again), scheduled
    rows go back to ``pending`` and a completed scheduled campaign becomes ``paused``: fix the field,
    then resume it. Each change appends an event; the old error is kept in the new one.

    :param apply: False (default): count only, change nothing.
    :raises ValueError: if ``field`` is not a campaign field.
    """
    if field is not None and field not in CAMPAIGN_FIELDS:
        raise ValueError(f"{field!r} is not a field of the campaign (one of {', '.join(sorted(CAMPAIGN_FIELDS))})")
    with conn.transaction():
        rows = conn.execute(query("send_log", "refused_candidates"), {"campaign": campaign}).fetchall()
        hits = [r for r in rows if (f := campaign_field(str(r[2]))) is not None
                and (f == field if field is not None else f not in RENDERED_FIELDS)]
        ambiguous = sum(1 for r in hits if r[3])
        ids = [int(r[0]) for r in hits if not r[3]]
        if not apply or not ids:
            return Reopened(found=len(hits), reopened=0, kept_ambiguous=ambiguous, campaign_paused=False)
        done = conn.execute(query("send_log", "reopen_refused"), {
            "ids": ids, "reason": "re-opened: the provider refused a field of the campaign, not this recipient"
        }).fetchall()
        scheduled = any(r[1] == "scheduled" for r in hits)
        paused = bool(scheduled and conn.execute(query("send_log", "reopen_campaign"), {
            "campaign": campaign, "detail": Jsonb({"reason": "rows re-opened by reopen-refused", "rows": len(done)})
        }).fetchall())
    return Reopened(found=len(hits), reopened=len(done), kept_ambiguous=ambiguous, campaign_paused=paused)


def eligible_sql(campaign: Campaign, *, policy: bool = True, snapshot: bool = False) -> pgsql.Composed:
    """``lifecycle.eligible`` for ``campaign``: its audience file (trusted, version-controlled SQL,
    composed in as SQL) wrapped in the engine's exclusions; the contact-policy pre-filter
    (``lifecycle.eligible_policy`` with :func:`caps_sql`) only when the campaign is not exempt, so
    every exclusion stays a top-level anti-join the planner can hash (a constant ``exempt OR (...)``
    would hide them in correlated per-candidate subplans). ``policy=False`` leaves the policy part
    out.

    ``snapshot=True``: the form of the run's snapshot (``lifecycle.snapshot_create``): the audience's
    own columns (the context is built per page, ``lifecycle.snapshot_page``) and the same policy as
    one probe of each candidate's contacts after the anti-joins (``lifecycle.snapshot_policy``), not
    the set-based anti-joins over every recent contact of every user."""
    columns = pgsql.SQL("a.user_id, a.email, to_jsonb(a) - 'user_id' - 'email' as context")
    join: pgsql.Composable = pgsql.SQL("")
    part: pgsql.Composable = pgsql.SQL("")
    if snapshot:
        columns = pgsql.SQL("a.*")
        if policy and not campaign.exempt:
            since = [pgsql.Placeholder("cooldown_since")] + [
                pgsql.Placeholder(f"cap_since_{i}") for i in range(len(campaign.contact_policy.extra_caps()))]
            join = pgsql.SQL(query("lifecycle", "snapshot_policy")).format(
                contact_since=pgsql.SQL("least({})").format(pgsql.SQL(", ").join(since)),
                caps=caps_sql(campaign.contact_policy, "snapshot_cap"))
            part = pgsql.SQL("and p.held is null")
    elif policy and not campaign.exempt:
        part = pgsql.SQL(query("lifecycle", "eligible_policy")).format(caps=caps_sql(campaign.contact_policy))
    return pgsql.SQL(query("lifecycle", "eligible")).format(
        columns=columns, audience=pgsql.SQL(campaign.audience_sql), policy_join=join, policy=part)


def mask_email(address: str) -> str:
    """``jane.doe@example.com`` -> ``j***@example.com`` (for logs, XCom and UI pages)."""
    local, _, domain = address.partition("@")
    return f"{local[:1]}***@{domain}" if domain else "***"
