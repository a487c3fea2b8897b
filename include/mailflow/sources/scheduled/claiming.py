"""Claiming due rows: one transaction picks one campaign's due rows (``FOR UPDATE SKIP LOCKED``),
gives them the recipients' current addresses (:meth:`Dispatcher.refresh_addresses`), passes them
through the contact guard (invalid, suppressed, duplicate; held rows deferred to the
next planned slot, skipped, or sent anyway per ``on_policy``), renders and stores the batch; the
dispatch call's state and counts (:class:`DispatchSummary`)."""

from __future__ import annotations

import dataclasses
import logging
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from functools import partial
from typing import Any

import jinja2
import psycopg
from psycopg import sql as pgsql

from mailflow.campaigns import Campaign, CampaignFolder, load_policy, scheduled_content_hash
from mailflow.model.outcome import Accepted, MintedRow, Outcome, PreparedBatch, RunContext
from mailflow.model.policy import ContactPolicy
from mailflow.sendloop.engine import send_chunk
from mailflow.sendloop.render import Renderer
from mailflow.sources.scheduled.planning import (
    day_bounds,
    local_midnight,
    plan_day,
    plan_send_times,
    plan_spec,
)

# the one definition of a campaign's recipient source (the file or the checked table), shared with
# provisioning so the address at send time comes from exactly the query that chose the recipient
from mailflow.sources.scheduled.provisioning import recipient_source
from mailflow.store import reputation
from mailflow.store.contact_guard import duplicate_reason, load_contacts, lock_contacts, reserve_addresses
from mailflow.store.policy import Hold, evaluate, mailbox_key, normalise_address
from mailflow.store.scheduled import ScheduledStore
from mailflow.store.send_log import PostgresStore
from mailflow.store.sql import query

log = logging.getLogger(__name__)


@dataclass
class DispatchSummary:
    """Counts of one dispatch call (rows). ``idle_seconds`` = time slept waiting for due rows,
    ``seconds`` = wall time of the call, ``completed`` = campaigns completed at the end,
    ``sent_by_campaign`` = rows sent per campaign name."""

    claimed: int = 0
    sent: int = 0
    failed: int = 0
    released: int = 0
    unknown: int = 0
    suppressed: int = 0
    render_failed: int = 0
    deferred: int = 0
    skipped: int = 0
    invalid: int = 0
    duplicates: int = 0
    #: rows given the recipient's new address at claim time (mail.address_change)
    readdressed: int = 0
    #: of ``skipped``: rows whose user the campaign's recipients no longer return (or return without an address)
    gone: int = 0
    batches: int = 0
    idle_seconds: float = 0.0
    seconds: float = 0.0
    stopped: str | None = None
    completed: list[str] = field(default_factory=list)
    sent_by_campaign: dict[str, int] = field(default_factory=dict)
    #: campaigns paused by this call because the campaign itself was at fault: name -> reason
    paused: dict[str, str] = field(default_factory=dict)
    #: campaigns whose canary was in: the rest of their rows was released by this call
    canaries_released: list[str] = field(default_factory=list)
    #: campaigns that had more rows due than their per-day cap allowed: pending rows re-planned from now
    replanned: dict[str, int] = field(default_factory=dict)
    #: every scheduled or paused campaign at the end of the call: name -> why it is held
    #: (``holds.Hold.as_dict``: kind, reason, ...), or None when it sends as planned
    held: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["idle_seconds"] = round(self.idle_seconds, 3)
        out["seconds"] = round(self.seconds, 3)
        return out


#: The uploaded recipient list (``recipients_csv``): its rows are the snapshot itself, there is no
#: newer source to read an address from, so its rows keep the address they were provisioned with.
UPLOADED_LIST = "mail.campaign_recipient"


def _same_address(old: str, new: str) -> bool:
    """Whether two addresses are the same recipient address as sent: compared in the normalised
    form the claim sends to (:func:`normalise_address`), or as trimmed text if either is invalid."""
    a, b = normalise_address(old), normalise_address(new)
    if a.valid and b.valid:
        return a.send == b.send
    return old.strip() == new.strip()


#: How the reason of a row skipped because its recipient is gone starts.
GONE = "recipient gone"

#: How far ahead a deferral looks for a planned slot (days); the planner's own bound on days
#: without window time.
PLAN_HORIZON_DAYS = 800


def _deferred_times(conn: psycopg.Connection, c: Mapping[str, Any],
                    held: Sequence[tuple[int, datetime]]) -> dict[int, datetime]:
    """New planned times for rows the contact policy holds back: ``held`` = ``(row id, free_at)``.

    Each row gets the first instant after its ``free_at`` that the campaign's plan allows: an
    allowed weekday, inside the local windows, on a local day whose emails (planned, in flight or
    sent) are still fewer than ``emails_per_day``; within that day the planner's slots spread from
    ``free_at`` are used in order. Aware UTC datetimes, strictly after ``free_at``.

    A row with no such instant within :data:`PLAN_HORIZON_DAYS` days (every day up to there is full
    or has no window time) is left out of the result: the caller skips it with a reason. One row
    that cannot be planned never fails the claim (it would stay at the head of the due queue and
    fail every later dispatch).
    """
    spec = plan_spec(c)
    first = min(f for _, f in held)
    since = local_midnight(plan_day(spec, first), spec)
    day_start = timedelta(hours=spec.day_start.hour, minutes=spec.day_start.minute, seconds=spec.day_start.second)
    counts: dict[date, int] = {d: int(n) for d, n in ScheduledStore(conn).day_counts(
        c["name"], spec.timezone, since, day_start)}
    days: dict[date, list[datetime]] = {}  # the day's free slots (computed once per day and call)
    out: dict[int, datetime] = {}
    for rid, free_at in sorted(held, key=lambda h: (h[1], h[0])):
        start = free_at + timedelta(microseconds=1)
        day = plan_day(spec, start)
        for _ in range(PLAN_HORIZON_DAYS):  # the planner's own bound on days without window time
            if day.isoweekday() in spec.weekdays and counts.get(day, 0) < spec.emails_per_day:
                if day not in days:
                    floor = max(start, local_midnight(day, spec))
                    days[day] = [t for t in plan_send_times(spec, spec.emails_per_day, floor)
                                 if plan_day(spec, t) == day]
                free = days[day]
                i = bisect_left(free, start)
                if i < len(free):
                    out[rid] = free.pop(i)
                    counts[day] = counts.get(day, 0) + 1
                    break
            day += timedelta(days=1)
            start = max(start, local_midnight(day, spec))
        else:
            log.warning("campaign %s: row %d has no planned slot within %d days after %s: skipped",
                        c["name"], rid, PLAN_HORIZON_DAYS, free_at.isoformat())
    return out


def _render_campaign(c: Mapping[str, Any], folder: CampaignFolder) -> Campaign:
    """The renderer's :class:`Campaign` for a ``mail.campaign`` row: the subject is the snapshot
    rendered at provisioning (``user.subject``); audience fields are unused. Its content hash is
    the row's and the folder's templates' (:func:`mailflow.campaigns.scheduled_content_hash`)."""
    return Campaign(name=str(c["name"]), priority=0, audience_sql="", template=str(c["template"]),
                    subject="{{ user.subject }}", from_address=str(c["from_address"]), reply_to=c["reply_to"],
                    cooldown=timedelta(0), audience_window=timedelta(0), marketing=bool(c["marketing"]),
                    content_hash=scheduled_content_hash(c, folder))


@dataclass
class Claim:
    campaign: Campaign
    rows: tuple[MintedRow, ...]
    attempts: dict[int, int]
    batch: PreparedBatch | None
    render_failed: int
    render_errors: list[str] = field(default_factory=list)
    decided: dict[str, int] = field(default_factory=dict)  # rows decided without a request, by status
    readdressed: int = 0  # rows given the recipient's current address
    gone: int = 0  # rows skipped because the recipient source no longer returns their user
    #: why nothing was claimed although rows were due: more are due than the campaign may still send
    #: on this plan day (:meth:`Dispatcher.over_cap`); the dispatcher re-plans the campaign's rows
    capped: str | None = None


class Dispatcher:
    """One dispatch call's state: the connection, the lifecycle store (apply, rebatch, batches)."""

    def __init__(self, conn: psycopg.Connection, renderer: Renderer, run: RunContext, batch_size: int,
                 policy: ContactPolicy | None = None, folder: CampaignFolder | None = None):
        self.conn = conn
        self.store = PostgresStore(conn)
        self.renderer = renderer
        self.run = run
        self.who = {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}
        self.batch_size = batch_size
        self.campaigns: dict[str, Campaign] = {}
        self.campaign_rows: dict[str, dict[str, Any]] = {}
        # read once per dispatch call (a run): the next run sees an edited folder
        self.folder = folder or CampaignFolder.resolve()
        self.policy: ContactPolicy = policy if policy is not None else load_policy(folder=self.folder)
        self.key_identity: str | None = None  # the sending client's (dispatch sets it); stored with each batch
        self.account: str | None = None  # the sending client's provider account (the reputation guard's scope)
        self.guard_config: reputation.GuardConfig | None = None  # its guard settings (dispatch reads them once)
        self.claiming: str | None = None  # the campaign of the claim in progress (see claim)
        self._guard_conn: psycopg.Connection | None = None
        # each campaign's recipient source, composed once per dispatch call (None: keep the snapshot)
        self.sources: dict[str, pgsql.Composable | None] = {}

    @property
    def guard_conn(self) -> psycopg.Connection:
        """The reputation guard's own connection (autocommit, opened on first use with the claim connection's
        parameters): its grants commit at once, outside the claim's transaction."""
        if self._guard_conn is None or self._guard_conn.closed:
            info = self.conn.info
            self._guard_conn = psycopg.connect(info.dsn, password=info.password or None, autocommit=True)
        return self._guard_conn

    def close(self) -> None:
        """Close the guard's connection (the claim connection is the caller's)."""
        if self._guard_conn is not None:
            self._guard_conn.close()
            self._guard_conn = None

    def due_wait(self, coalesce: float) -> float | None:
        with self.conn.transaction():
            return ScheduledStore(self.conn).due_wait(coalesce, self.batch_size)

    def prepare(self, campaign: Campaign, rows: Sequence[MintedRow]) -> PreparedBatch:
        """Render a claimed chunk; its key is assigned by the store when the batch is saved
        (docs/model.md, "Idempotency keys": never the same key for two bodies). The batch carries the
        sending key's identity, stored with its bytes (a resend must use the same API key)."""
        return dataclasses.replace(self.renderer.prepare_batch(campaign, rows), key_identity=self.key_identity)

    def _campaign(self, name: str) -> Campaign:
        if name not in self.campaigns:
            c = ScheduledStore(self.conn).campaign_by_name(name)
            if c is None:
                raise LookupError(f"campaign {name!r} vanished from mail.campaign")
            self.campaigns[name] = _render_campaign(c, self.folder)
        return self.campaigns[name]

    def claim(self) -> tuple[int, Claim | None]:
        """Cancel suppressed due rows, pick one campaign's due rows, give them the recipients'
        current addresses (:meth:`refresh_addresses`: a user the campaign's recipients no longer
        return is ``skipped``), pass them through the contact guard, claim the rest, render and
        store the batch: one transaction (a crash leaves either pending rows or sending rows with
        their bytes).

        The guard (docs/model.md, "The contact policy"): each address is normalised (invalid: the
        row fails with the validator's reason, no request; suppressed as normalised: cancelled; a
        second user at an address the campaign already mails: ``duplicate`` naming the first); the
        users' ``mail.contact`` rows are locked in user_id order, then their mailboxes'
        ``mail.mailbox`` rows in key order, and the policy is re-evaluated on what is committed now
        (the user's contacts and every other user's at the same mailbox); a held row is deferred to
        the first planned slot after the window (``on_policy = 'defer'``), or ``skipped`` with the
        reason, or sent anyway (``ignore``).
        Returns ``(rows cancelled as suppressed, the claim or None if nothing was due)``. If it
        raises after picking, the transaction is rolled back and ``self.claiming`` names the
        campaign whose rows were picked (the dispatcher pauses it and goes on)."""
        self.claiming = None
        with self.conn.transaction():
            suppressed = ScheduledStore(self.conn).cancel_suppressed_due(self.who)
            picked = ScheduledStore(self.conn).pick_due(self.who, self.batch_size)
            if not picked:
                return suppressed, None
            self.claiming = str(picked[0][4])  # the campaign at fault if what follows raises
            crow = self._campaign_row(str(picked[0][4]))
            capped = self.over_cap(crow)
            if capped is not None:  # nothing claimed: the rows stay pending and the dispatcher re-plans them
                return suppressed, Claim(self._campaign(str(crow["name"])), (), {}, None, 0, capped=capped)
            # the address first: hygiene, suppression, mailbox cooldown and caps judge the one sent to
            picked, decided, readdressed = self.refresh_addresses(crow, picked)
            gone = len(decided)  # so far only the rows whose recipient is gone
            decided.update(self._guard(crow, [r for r in picked if int(r[0]) not in decided]))
            if decided:
                ScheduledStore(self.conn).decide_rows(
                    self.who, list(decided), [d[0] for d in decided.values()],
                    [d[1] for d in decided.values()], [d[2] for d in decided.values()])
            go = [r for r in picked if int(r[0]) not in decided]
            granted = 0
            if go:
                # the reputation guard's exposure bound: a scope whose rates are not known yet sends at most
                # E emails a round; the rest stay pending, in plan order. Granted on the guard's own
                # connection, committed at once, so a claim in progress never holds the guard's rows (two
                # dispatchers never wait on each other); given back below if this claim does not send them
                granted = reputation.admit(self.guard_conn, str(crow["name"]), len(go), account=self.account,
                                           config=self.guard_config).granted
                go = go[:granted]
            found: list[Any] = []
            try:
                if go:
                    addrs = [normalise_address(r[2]) for r in go]
                    found = ScheduledStore(self.conn).claim_rows(
                        self.who, [int(r[0]) for r in go], [a.send for a in addrs], [a.key for a in addrs])
            finally:
                self.give_back(str(crow["name"]), granted - len(found))  # granted, not claimed
            counts: dict[str, int] = {}
            for st, _, _at in decided.values():
                k = "deferred" if st == "pending" else st
                counts[k] = counts.get(k, 0) + 1
            if not found:
                return suppressed + counts.pop("cancelled", 0), Claim(
                    self._campaign(str(picked[0][4])), (), {}, None, 0, [], counts, readdressed, gone)
            suppressed += counts.pop("cancelled", 0)
            campaign = self._campaign(str(found[0][4]))
            rows = tuple(MintedRow(id=r[0], user_id=r[1], email=r[2], context=r[3] or {}) for r in found)
            attempts = {int(r[0]): int(r[5]) for r in found}
            bad: dict[int, str] = {}
            try:
                batch: PreparedBatch | None = self.prepare(campaign, rows)
            except (jinja2.TemplateError, ValueError, TypeError):  # the renderer's RenderError is a ValueError
                # Find the rows at fault: a recipient whose snapshot lacks a template variable fails
                # (its snapshot will not change), the others go. Any other error (a missing or broken
                # template) propagates: the claim rolls back and the rows stay pending.
                good = []
                for r in rows:
                    try:
                        self.renderer.render_email(campaign, r)
                        good.append(r)
                    except jinja2.UndefinedError as exc:
                        bad[r.id] = f"render failed (template {campaign.template!r}): {exc}"
                rows = tuple(good)
                batch = self.prepare(campaign, rows) if rows else None
            if bad:
                self.conn.execute(query("send_log", "mark_failed"), self.who | {
                    "ids": list(bad), "msgs": list(bad.values())})
                self.give_back(campaign.name, len(bad))  # granted, never sent
            if batch is not None:
                batch = self.store.save_batch(batch)
        if bad:
            log.error("%s: %d email(s) failed to render, marked failed: %s", campaign.name, len(bad),
                      "; ".join(f"row {i}: {m}" for i, m in bad.items()))
        return suppressed, Claim(campaign, rows, attempts, batch, len(bad), list(bad.values()), counts,
                                 readdressed, gone)

    def over_cap(self, c: Mapping[str, Any]) -> str | None:
        """The per-day cap at claim time, for campaign row ``c`` whose row pick_due locked (so no other
        claim of it is uncommitted, whatever the number of dispatchers): the campaign may send at most
        ``emails_per_day`` emails on one plan day (its local day in its timezone,
        :func:`~mailflow.sources.scheduled.planning.day_bounds`), counted from its emails sent or in
        flight that day (``ScheduledStore.day_sends``). If more of its rows are due now than it may
        still send today (held rows released at once, a dispatcher that did not run for a day), nothing
        is claimed and the reason is returned: the caller re-plans the campaign's pending rows from now
        (:func:`~mailflow.sources.scheduled.replan.replan_overdue`) instead of sending the backlog.
        None: the due rows fit."""
        spec = plan_spec(c)
        store = ScheduledStore(self.conn)
        start, end = day_bounds(store.db_now(), spec)
        left = max(spec.emails_per_day - store.day_sends(str(c["name"]), start, end), 0)
        due = store.due_count(str(c["name"]), left + 1)
        if due <= left:
            return None
        return (f"per-day cap: more than {left} rows due but only {left} of emails_per_day {spec.emails_per_day} "
                f"left on the plan day from {start.isoformat()}")

    def campaign_id(self, name: str) -> int:
        """The id of campaign ``name`` (read once per dispatch call)."""
        return int(self._campaign_row(name)["id"])

    def give_back(self, campaign: str, n: int) -> None:
        """Give the reputation guard back ``n`` emails of ``campaign`` it granted that were not sent and will
        never have an outcome (not claimed, failed to render, rolled back, rejected by the provider): an
        exposure round waits for as many outcomes as it counts (:func:`mailflow.store.reputation.refund`)."""
        if n > 0:
            reputation.refund(self.guard_conn, campaign, n, account=self.account)

    def _campaign_row(self, name: str) -> dict[str, Any]:
        if name not in self.campaign_rows:
            c = ScheduledStore(self.conn).campaign_by_name(name)
            if c is None:
                raise LookupError(f"campaign {name!r} vanished from mail.campaign")
            self.campaign_rows[name] = c
        return self.campaign_rows[name]

    def _address_source(self, c: Mapping[str, Any]) -> pgsql.Composable | None:
        """The campaign's recipient source to read current addresses from (composed once per call),
        or None for the uploaded list (:data:`UPLOADED_LIST`: no newer source; keep the snapshot)."""
        name = str(c["name"])
        if name not in self.sources:
            uploaded = not c["recipients_sql"] and str(c["recipients_table"] or "") == UPLOADED_LIST
            self.sources[name] = None if uploaded else recipient_source(self.conn, c, self.folder)
        return self.sources[name]

    def refresh_addresses(self, c: Mapping[str, Any], picked: Sequence[Any]) -> tuple[
            list[Any], dict[int, tuple[str, str, datetime | None]], int]:
        """Give picked rows ``(id, user_id, email, context, campaign, attempts, scheduled_at)`` of
        campaign row ``c`` their users' addresses now, in the claim transaction, before the contact
        guard and before any bytes or key exist for them (docs/model.md, "The address at send time").

        One statement reads the claimed users' addresses from the campaign's recipient source (its
        recipients SQL file or table, restricted to these user_ids). A row whose address changed
        gets the new one and its mailbox key, and the change (old and new) is recorded in
        ``mail.address_change`` (``ScheduledStore.readdress_rows``: only rows never attempted, so a
        row with an idempotency key keeps its address and bytes). A user the source no longer returns
        (deleted, or no longer matching the campaign's query), or returns without an address, is
        not sent to: the row is decided ``skipped`` with the reason (starting with :data:`GONE`);
        the source decides who is a recipient, and mailing someone it no longer selects (e.g. a
        user who left the free plan) is the mistake that cannot be taken back. Rows of the uploaded
        list (:data:`UPLOADED_LIST`) keep their address.

        Returns ``(picked rows with the addresses to use, {id: ("skipped", reason, None)} for rows
        whose user is gone, rows re-addressed)``.
        """
        source = self._address_source(c)
        if source is None:
            return list(picked), {}, 0
        current = ScheduledStore(self.conn).current_addresses(
            source, sorted({int(r[1]) for r in picked}), str(c["name"]), int(c["id"]))
        label = c["recipients_sql"] or c["recipients_table"]
        gone: dict[int, tuple[str, str, datetime | None]] = {}
        new: dict[int, str] = {}
        for r in picked:
            rid, uid = int(r[0]), int(r[1])
            if uid not in current:
                gone[rid] = ("skipped", f"{GONE}: user {uid} is no longer returned by the campaign's recipients "
                                        f"({label}) at send time: skipped, not sent", None)
            elif current[uid] is None:
                gone[rid] = ("skipped", f"{GONE}: the campaign's recipients ({label}) return user {uid} without "
                                        "an address at send time: skipped, not sent", None)
            elif not _same_address(str(r[2]), str(current[uid])):
                new[rid] = str(current[uid])
        changed: set[int] = set()
        if new:
            changed = set(ScheduledStore(self.conn).readdress_rows(
                self.who, list(new), list(new.values()), [mailbox_key(e) for e in new.values()]))
            if changed:
                log.info("campaign %s: %d row(s) re-addressed to the recipient's current address "
                         "(mail.address_change): %s", c["name"], len(changed), sorted(changed))
        rows = [(r[0], r[1], new[int(r[0])], *r[3:]) if int(r[0]) in changed else r for r in picked]
        return rows, gone, len(changed)

    def _guard(self, c: Mapping[str, Any], picked: Sequence[Any]) -> dict[int, tuple[str, str, datetime | None]]:
        """The contact guard for picked rows ``(id, user_id, email, context, campaign, attempts,
        scheduled_at)`` of campaign row ``c``, in the claim transaction. Returns the rows decided
        without a request: ``{id: (status, reason, new scheduled_at or None)}``."""
        out: dict[int, tuple[str, str, datetime | None]] = {}
        addrs = {int(r[0]): normalise_address(r[2]) for r in picked}
        for r in picked:
            a = addrs[int(r[0])]
            if not a.valid:
                out[int(r[0])] = ("failed", f"invalid address: {a.error}", None)
        valid = [r for r in picked if int(r[0]) not in out]
        keys = sorted({k for r in valid for k in addrs[int(r[0])].keys})
        if keys:
            barred = {x[0] for x in self.conn.execute(query("contact", "suppressed_addresses"),
                                                      {"keys": keys, "campaign": c["name"]})}
            for r in valid:
                if barred.intersection(addrs[int(r[0])].keys):
                    out[int(r[0])] = ("cancelled", "suppressed before sending (address)", None)
        valid = [r for r in picked if int(r[0]) not in out]
        if not valid:
            return out
        now = lock_contacts(self.conn, [int(r[1]) for r in valid], [addrs[int(r[0])].key for r in valid])
        out.update(self._hold(c, valid, picked, now, {int(r[1]): addrs[int(r[0])].key for r in valid}))
        valid = [r for r in valid if int(r[0]) not in out]
        holders = reserve_addresses(self.conn, c["name"], [(int(r[1]), addrs[int(r[0])].key) for r in valid])
        for r in valid:
            holder = holders[addrs[int(r[0])].key]
            if holder != int(r[1]):
                out[int(r[0])] = ("duplicate", duplicate_reason(addrs[int(r[0])].key, holder), None)
        return out

    def _hold(self, c: Mapping[str, Any], valid: Sequence[Any], picked: Sequence[Any],
              now: datetime, mailboxes: Mapping[int, str]) -> dict[int, tuple[str, str, datetime | None]]:
        """The policy decision for rows ``valid`` under the contact guard (``mailboxes``: user_id ->
        mailbox key, whose other users' contacts count too): held rows deferred or skipped (per
        ``c['on_policy']``); ``ignore`` holds nothing."""
        out: dict[int, tuple[str, str, datetime | None]] = {}
        if c["on_policy"] == "ignore" or not self.policy.rules:
            return out
        contacts = load_contacts(self.conn, [int(r[1]) for r in valid], self.policy, ref=now, now=now,
                                 include_planned=False, except_ids=[int(r[0]) for r in picked], mailboxes=mailboxes)
        held: list[tuple[int, Hold]] = []
        for r in valid:
            hold = evaluate(self.policy, contacts.get(int(r[1]), ()), ref=now, now=now)
            if hold is None:
                continue
            if c["on_policy"] == "skip":
                out[int(r[0])] = ("skipped", hold.reason(), None)
            else:
                held.append((int(r[0]), hold))
        if held:
            times = _deferred_times(self.conn, c, [(rid, h.free_at) for rid, h in held])
            for rid, hold in held:
                if rid in times:
                    out[rid] = ("pending", f"{hold.reason()}; deferred to {times[rid].isoformat()}", times[rid])
                else:  # the plan has no slot for it: skipped with the reason, the queue goes on
                    out[rid] = ("skipped", f"{hold.reason()}; no planned slot within {PLAN_HORIZON_DAYS} days "
                                           "after that (every plan day full or without window time): skipped", None)
        return out

    def send(self, claim: Claim, provider: Any, deadline: float, summary: DispatchSummary,
             slot: float | None = None) -> Outcome:
        assert claim.batch is not None
        campaign = claim.campaign
        outcome, applied, batch = send_chunk(self.store, provider, partial(self.prepare, campaign),
                                             claim.batch, claim.rows, deadline, self.run, slot)
        self.count(claim, outcome, applied, batch, summary)
        return outcome

    def count(self, claim: Claim, outcome: Outcome, applied: Any, batch: PreparedBatch,
              summary: DispatchSummary) -> None:
        """Add one sent chunk's row changes to ``summary`` and log them."""
        campaign = claim.campaign
        summary.sent += applied.sent
        summary.failed += applied.failed
        summary.released += applied.released
        summary.unknown += applied.unknown
        if applied.sent:
            summary.sent_by_campaign[campaign.name] = summary.sent_by_campaign.get(campaign.name, 0) + applied.sent
        log.info("%s batch %s: %d emails -> %d sent, %d rejected, %d released, %d unknown%s", campaign.name,
                 batch.idempotency_key, len(batch.row_ids), applied.sent, applied.failed, applied.released,
                 applied.unknown, "" if isinstance(outcome, Accepted) else f" ({outcome.reason})")
