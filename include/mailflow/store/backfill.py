"""Backfill steps of migrations that PostgreSQL cannot compute itself, run by the migrator
(``mailflow.store.migrate``) where a no-transaction migration names them with a line
``-- migrate: python <name>`` (docs/operations.md, "Upgrading").

Each step works on a live send log: small transactions (no long lock, nothing blocks the tasks),
idempotent and resumable (an interrupted run is simply run again from its start), and it never
deletes a recorded row.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from importlib import resources

import psycopg
from psycopg import sql as pgsql

from mailflow.store.policy import mailbox_key

log = logging.getLogger(__name__)

BATCH = 5000
"""Rows per update transaction."""


def backfill_mailbox_keys(conn: psycopg.Connection) -> dict[str, int]:
    """Migration 0018: store the mailbox key (:func:`mailflow.store.policy.mailbox_key`) wherever an
    address is compared.

    * ``mail.suppression.email_key`` for every address suppression without one. Two entries that
      are one mailbox for one scope (``Straße@x`` and ``STRASSE@x``) keep both rows; the earliest
      (lowest id) takes the key, which suppresses the mailbox, the other keeps its text only.
    * ``mail.send_log.email_key`` where it is null (rows from before 0007) or the address is not
      ASCII (0007's key lower-cased it; ASCII keys are unchanged by case folding, so only those
      rows are read: ``octet_length <> char_length``).
    * ``mail.campaign_address``: a non-ASCII key is replaced by the folded key (if the folded key
      already has a holder, that holder stays and the old spelling's entry is dropped: the
      campaign has mailed the mailbox once).

    :param conn: a psycopg 3 connection in autocommit mode (each batch is its own transaction).
    :returns: rows changed per table.
    """
    changed = {"suppression": 0, "send_log": 0, "campaign_address": 0}
    with conn.transaction():
        rows = conn.execute("select id, email, scope, email_key from mail.suppression"
                            " where email is not null order by id").fetchall()
    taken = {(str(r[3]), str(r[2])) for r in rows if r[3] is not None}
    todo: list[tuple[int, str]] = []
    for rid, email, scope, key in rows:
        new = mailbox_key(email) if key is None else None
        if new is not None and (new, scope) not in taken:
            taken.add((new, scope))
            todo.append((int(rid), new))
    for i in range(0, len(todo), BATCH):
        part = todo[i:i + BATCH]
        with conn.transaction():
            cur = conn.execute("update mail.suppression s set email_key = r.key"
                               " from unnest(%(ids)s::bigint[], %(keys)s::text[]) as r(id, key)"
                               " where s.id = r.id and s.email_key is null",
                               {"ids": [p[0] for p in part], "keys": [p[1] for p in part]})
            changed["suppression"] += max(cur.rowcount, 0)

    # the send log in pages of the primary key (one pass over the table, a short transaction per
    # page); each distinct address is validated once
    cache: dict[str, str | None] = {}
    after = 0
    while True:
        with conn.transaction():
            rows = conn.execute("select id, email, email_key from mail.send_log where id > %(after)s"
                                " and email is not null"
                                " and (email_key is null or octet_length(email) <> char_length(email))"
                                " order by id limit %(n)s", {"after": after, "n": BATCH}).fetchall()
        if not rows:
            break
        after = int(rows[-1][0])
        fixes = []
        for rid, email, key in rows:
            if email not in cache:
                cache[email] = mailbox_key(email)
            new = cache[email]
            if new is not None and new != key:
                fixes.append((int(rid), new))
        if len(cache) > 100_000:
            cache.clear()
        if fixes:
            with conn.transaction():
                cur = conn.execute("update mail.send_log l set email_key = r.key"
                                   " from unnest(%(ids)s::bigint[], %(keys)s::text[]) as r(id, key) where l.id = r.id",
                                   {"ids": [f[0] for f in fixes], "keys": [f[1] for f in fixes]})
                changed["send_log"] += max(cur.rowcount, 0)

    with conn.transaction():
        rows = conn.execute("select campaign, email_key, user_id, created_at from mail.campaign_address"
                            " where octet_length(email_key) <> char_length(email_key)"
                            " order by created_at").fetchall()
    for campaign, key, uid, created in rows:
        new = mailbox_key(key)
        if new is None or new == key:
            continue
        with conn.transaction():
            conn.execute("insert into mail.campaign_address (campaign, email_key, user_id, created_at)"
                         " values (%s, %s, %s, %s) on conflict do nothing", (campaign, new, uid, created))
            conn.execute("delete from mail.campaign_address where campaign = %s and email_key = %s", (campaign, key))
            changed["campaign_address"] += 1
    log.info("mailbox keys backfilled: %s", changed)
    return changed


def require_suppression_keys(conn: psycopg.Connection, *, lock_timeout_seconds: float = 1.0, retries: int = 10) -> bool:
    """Migration 0018: from now on an address suppression must carry its mailbox key: the CHECK
    ``suppression_email_has_key`` (``email is null or email_key is not null``), added ``NOT VALID``
    (rows written before are not checked: an invalid address, or the second spelling of a mailbox
    already suppressed, keeps a null key), so a bare ``INSERT`` of an address, which no lookup would
    ever match, fails loudly instead. A brief lock with ``lock_timeout``, retried with a growing
    pause, like the migrator's transactional files.

    :returns: True if the constraint was added, False if it existed.
    :raises psycopg.errors.LockNotAvailable: if the lock was not granted after the retries.
    """
    for attempt in range(retries + 1):
        try:
            with conn.transaction():
                conn.execute("select set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_seconds * 1000)}ms",))
                exists = conn.execute("select 1 from pg_constraint where conrelid = 'mail.suppression'::regclass"
                                      " and conname = 'suppression_email_has_key'").fetchone()
                if exists:
                    return False
                conn.execute("alter table mail.suppression add constraint suppression_email_has_key"
                             " check (email is null or email_key is not null) not valid")
            return True
        except psycopg.errors.LockNotAvailable:
            if attempt == retries:
                raise
            time.sleep(min(30.0, 0.5 * 2**attempt))
    return False


#: every state mail.send_log.status may take once 0025 ran (the union with what the check already allows)
_STATES_0025 = ("pending", "sending", "sent", "failed", "cancelled", "skipped", "duplicate", "holdout")


def allow_holdout_status(conn: psycopg.Connection, *, lock_timeout_seconds: float = 1.0, retries: int = 10) -> bool:
    """Migration 0025: the send log's status check ``send_log_status_check`` allows ``holdout``.

    Keeps every state the current check allows (another migration may have added one; read from
    its definition, as 0007 did) and replaces the check in one ``ALTER TABLE`` (drop and add in the
    same statement: there is no moment without a check), ``NOT VALID`` (no scan under the lock:
    every existing row passed the narrower check). A brief lock with ``lock_timeout``, retried with
    a growing pause, like the migrator's transactional files. Idempotent.

    :returns: True if the check was replaced, False if it already allowed ``holdout``.
    :raises psycopg.errors.LockNotAvailable: if the lock was not granted after the retries.
    """
    for attempt in range(retries + 1):
        try:
            with conn.transaction():
                conn.execute("select set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_seconds * 1000)}ms",))
                row = conn.execute("select pg_get_constraintdef(oid) from pg_constraint"
                                   " where conrelid = 'mail.send_log'::regclass"
                                   " and conname = 'send_log_status_check'").fetchone()
                # the states are quoted literals: 'sent'::text each (0001) or one '{a,b}'::text[] (0007)
                allowed = {state for literal in re.findall(r"'([^']*)'", str(row[0]) if row else "")
                           for state in literal.strip("{}").split(",") if re.fullmatch(r"[a-z_]+", state)}
                if "holdout" in allowed:
                    return False
                states = sorted(allowed | set(_STATES_0025))
                conn.execute(pgsql.SQL(
                    "alter table mail.send_log drop constraint if exists send_log_status_check,"
                    " add constraint send_log_status_check check (status = any ({}::text[])) not valid"
                ).format(pgsql.Literal(states)))
            return True
        except psycopg.errors.LockNotAvailable:
            if attempt == retries:
                raise
            time.sleep(min(30.0, 0.5 * 2**attempt))
    return False


_HOLDOUT_CAMPAIGNS = """
with recursive seen (campaign) as (
    (select h.campaign from mail.send_log h where h.status = 'holdout' order by h.campaign limit 1)
    union all
    select (select h.campaign from mail.send_log h where h.status = 'holdout' and h.campaign > s.campaign
            order by h.campaign limit 1)
    from seen s
    where s.campaign is not null
)
select s.campaign from seen s where s.campaign is not null
"""

# Each held-out row's slot: the planned time of the campaign's next recipient in provisioning order (user_id)
# that has one, else of the previous one, else the row's own minted_at (the provisioning time). Probes of
# send_log_campaign_user_uq (campaign, user_id); scheduled rows are never released, so the key holds them all.
_SET_HOLDOUT_SLOTS = """
update mail.send_log h
set scheduled_at = coalesce(
        (select n.scheduled_at from mail.send_log n
         where n.campaign = h.campaign and n.user_id > h.user_id and n.released_at is null
           and n.status <> 'holdout' and n.scheduled_at is not null
         order by n.user_id limit 1),
        (select n.scheduled_at from mail.send_log n
         where n.campaign = h.campaign and n.user_id < h.user_id and n.released_at is null
           and n.status <> 'holdout' and n.scheduled_at is not null
         order by n.user_id desc limit 1),
        h.minted_at)
where h.id = any(%(ids)s::bigint[]) and h.status = 'holdout' and h.kind = 'scheduled' and h.scheduled_at is null
"""


def backfill_holdout_slots(conn: psycopg.Connection) -> int:
    """Migration 0031: give each scheduled ``holdout`` row without a planned time the slot of the plan it
    would have had, so the lift can start its window where its treated neighbours' start
    (docs/send_log.md, Q15).

    Provisioning before 0031 planned the treated recipients only, in ``user_id`` order, and left the held-out
    ones without a slot. The slot a held-out user would have taken is the one its next recipient in that
    order got: the row's ``scheduled_at`` becomes the planned time of the campaign's next non-holdout row by
    ``user_id`` (its latest planned time: a deferral or a resume moved it with the plan), else the previous
    one's (it was the last), else its own ``minted_at`` (the provisioning time; a campaign without a planned
    row). Lifecycle holdout rows are left alone: their window starts at ``minted_at``, the moment they were
    decided, next to the emails minted and sent with them.

    Per campaign (a skip scan of the holdout index), the rows to fill are read once and updated in
    transactions of :data:`BATCH` rows; only rows still without ``scheduled_at`` change, so a rerun (an
    interrupted migration, ``mailflow migrate --backfill`` after a rolling deploy whose old workers
    provisioned meanwhile) fills what is left and nothing else.

    :param conn: a psycopg 3 connection in autocommit mode (each batch is its own transaction).
    :returns: the rows given a slot.
    """
    changed = 0
    with conn.transaction():
        campaigns = [str(r[0]) for r in conn.execute(_HOLDOUT_CAMPAIGNS).fetchall()]
    for campaign in campaigns:
        with conn.transaction():
            ids = [int(r[0]) for r in conn.execute(
                "select id from mail.send_log where status = 'holdout' and campaign = %s and kind = 'scheduled'"
                " and scheduled_at is null order by id", (campaign,)).fetchall()]
        for i in range(0, len(ids), BATCH):
            with conn.transaction():
                cur = conn.execute(_SET_HOLDOUT_SLOTS, {"ids": ids[i:i + BATCH]})
                changed += max(cur.rowcount, 0)
    log.info("holdout slots backfilled: %d rows", changed)
    return changed


_DAY_COUNT_TRIGGERS = tuple(f"{t}_day_count_{op}" for t, ops in (("send_log", ("insert", "update", "delete", "truncate")),
                                                                ("delivery_status", ("insert", "update", "delete")))
                            for op in ops)


def install_outcome_day_counters(conn: psycopg.Connection, *, lock_timeout_seconds: float = 1.0,
                                 retries: int = 10) -> bool:
    """Migration 0031: the per-campaign, per-day outcome counters (``store/sql/steps/
    0031_outcome_day_counters.sql``: tables, statement-level triggers on ``mail.send_log`` and
    ``mail.delivery_status``, the fold, the seed of an empty send log), in one transaction: PL/pgSQL bodies
    cannot run in a no-transaction migration. CREATE TRIGGER takes a brief SHARE ROW EXCLUSIVE lock on
    both tables, with ``lock_timeout`` and retries with a growing pause, like the migrator's transactional
    files.

    Once installed (the fold function and the seven triggers exist) a rerun (``mailflow migrate
    --backfill``) changes nothing and takes no lock.

    :returns: True if it was installed now, False if it already was.
    :raises psycopg.errors.LockNotAvailable: if the locks were not granted after the retries.
    """
    with conn.transaction():
        row = conn.execute(
            "select to_regprocedure('mail.fold_campaign_day_counters()') is not null"
            " and (select count(*) from pg_trigger where tgname = any(%s::text[])) = %s",
            (list(_DAY_COUNT_TRIGGERS), len(_DAY_COUNT_TRIGGERS))).fetchone()
    if row is not None and row[0]:
        return False
    text = resources.files("mailflow.store.sql").joinpath("steps", "0031_outcome_day_counters.sql").read_text(
        encoding="utf-8")
    for attempt in range(retries + 1):
        try:
            with conn.transaction():
                conn.execute("select set_config('lock_timeout', %s, true)", (f"{int(lock_timeout_seconds * 1000)}ms",))
                conn.execute(text.encode())  # trusted file from the package
            return True
        except psycopg.errors.LockNotAvailable:
            if attempt == retries:
                raise
            time.sleep(min(30.0, 0.5 * 2**attempt))
    return False


STEPS: dict[str, Callable[[psycopg.Connection], object]] = {
    "backfill_mailbox_keys": backfill_mailbox_keys,
    "require_suppression_keys": require_suppression_keys,
    "allow_holdout_status": allow_holdout_status,
    "backfill_holdout_slots": backfill_holdout_slots,
    "install_outcome_day_counters": install_outcome_day_counters,
}
"""The named steps a migration may call (``-- migrate: python <name>``)."""
