"""The reputation guard: rolling hard-bounce and complaint rates per campaign and per provider account,
and the stop they impose when a rate passes its threshold (``mail.reputation_guard``, migration 0020).

Email providers suspend accounts whose bounce or complaint rates stay high, which stops every campaign
of the user. The guard stops the one at fault first. The defaults come from the published guidance in
``resend-contract.md`` "Deliverability thresholds" (docs/operations.md, "Reputation guard"):

* hard bounces: 5 %. Amazon SES puts an account under review at about 5 % and may pause it at about
  10 %; other providers publish 2-10 %. Only permanent bounces count (a transient bounce says nothing
  about the list).
* complaints: 0.3 %. Gmail and Yahoo's bulk-sender rules (2024): keep the spam rate under 0.1 % and
  never reach 0.3 %; SES reviews at about 0.1 % and may pause at about 0.5 %.
* minimum sample: 500 emails with an outcome (below it one unlucky email is a large rate); window:
  emails sent in the last 24 hours, at most the latest 2,000 of them with an outcome.

A scope is evaluated over its recent outcomes: sent emails (``mail.send_log``, ``status = 'sent'``)
whose ``mail.delivery_status.outcome`` is set, sent within the window and after the scope's last
``resumed_at`` (so outcomes from before a person's resume never re-trip it). The account scope counts
every campaign's emails: the send log sends through one provider account (the pacer's account, the
key of ``mail.rate_slot`` and ``mail.circuit_breaker``).

A trip pauses the scheduled campaign (``mail.campaign.status = 'paused'``, a campaign event by
``reputation_guard`` with the rates) in the trip's own transaction; an account trip pauses every
scheduled campaign. The lifecycle source skips a blocked campaign (:func:`blocked`), and the
dispatcher's claim statements never pick a blocked campaign's rows. Only a person resumes
(:func:`resume`, ``mailflow reputation resume``, the ``resume_sending`` DAG).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow.store.sql import query

log = logging.getLogger(__name__)

#: The actor of the campaign events the guard writes (a pause), and how a resume recognises its pauses.
GUARD_ACTOR = "reputation_guard"
SCOPES = ("campaign", "account")


@dataclass(frozen=True)
class GuardConfig:
    """Thresholds, sample and window of the guard.

    :param hard_bounce_rate: trip at or above this share of hard bounces (fraction 0..1; default 0.05,
        Amazon SES's review level).
    :param complaint_rate: trip at or above this share of complaints (fraction 0..1; default 0.003,
        Gmail/Yahoo's "never reach 0.3 %").
    :param min_sample: no trip before this many emails with an outcome (default 500).
    :param window: only emails sent this recently count (default 24 hours).
    :param max_sample: at most this many of the latest emails with an outcome count (default 2,000),
        found among the newest ``2 * max_sample`` sent emails (:attr:`walk`): the rate follows the
        recent sends and one evaluation reads a bounded number of rows (a few ms per scope).
    :param account_every: the account scope (every campaign's emails: the costlier read) is read at
        most this often (default 1 s); a call within it evaluates the campaigns only. An outcome is
        counted for the account by the next evaluation after that, at the latest the feedback DAG's.

    Environment overrides (per deployment): ``MAILFLOW_GUARD_HARD_BOUNCE_RATE``,
    ``MAILFLOW_GUARD_COMPLAINT_RATE``, ``MAILFLOW_GUARD_MIN_SAMPLE``, ``MAILFLOW_GUARD_WINDOW_HOURS``,
    ``MAILFLOW_GUARD_MAX_SAMPLE`` (:meth:`from_env`).
    """

    hard_bounce_rate: float = 0.05
    complaint_rate: float = 0.003
    min_sample: int = 500
    window: timedelta = timedelta(hours=24)
    max_sample: int = 2_000
    account_every: timedelta = timedelta(seconds=1)

    @property
    def walk(self) -> int:
        """How many of the newest sent emails one evaluation reads at most to find ``max_sample``
        outcomes (twice as many: the newest sends often have no outcome yet)."""
        return 2 * self.max_sample

    def __post_init__(self) -> None:
        for name in ("hard_bounce_rate", "complaint_rate"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"reputation guard: {name} must be a fraction in (0, 1], got {value!r}")
        if self.min_sample < 1 or self.max_sample < self.min_sample:
            raise ValueError(f"reputation guard: need 1 <= min_sample <= max_sample, got {self.min_sample} and "
                             f"{self.max_sample}")
        if self.window <= timedelta(0):
            raise ValueError(f"reputation guard: window must be positive, got {self.window}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> GuardConfig:
        """The defaults, overridden by the ``MAILFLOW_GUARD_*`` variables that are set.

        :raises ValueError: naming the variable, for a value that is not a number or out of range.
        """
        env = dict(os.environ if env is None else env)
        kw: dict[str, Any] = {}
        for var, field, kind in (("MAILFLOW_GUARD_HARD_BOUNCE_RATE", "hard_bounce_rate", float),
                                 ("MAILFLOW_GUARD_COMPLAINT_RATE", "complaint_rate", float),
                                 ("MAILFLOW_GUARD_MIN_SAMPLE", "min_sample", int),
                                 ("MAILFLOW_GUARD_MAX_SAMPLE", "max_sample", int),
                                 ("MAILFLOW_GUARD_WINDOW_HOURS", "window", float)):
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a number") from None
            kw[field] = timedelta(hours=value) if field == "window" else value
        try:
            return cls(**kw)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the MAILFLOW_GUARD_* environment)") from None


@dataclass(frozen=True)
class Trip:
    """A scope this evaluation tripped: ``scope`` ('campaign' / 'account'), ``name``, the rates
    (fractions 0..1) and ``sample`` (emails with an outcome) that tripped it, ``reason`` (text naming
    them), ``tripped_at`` (aware, database clock) and ``paused`` (scheduled campaigns paused by it)."""

    scope: str
    name: str
    hard_bounce_rate: Decimal
    complaint_rate: Decimal
    sample: int
    hard_bounces: int
    complaints: int
    reason: str
    tripped_at: datetime
    paused: tuple[str, ...] = ()


def guard_account(conn: psycopg.Connection) -> str:
    """The provider account the account scope is named after: ``MAILFLOW_GUARD_ACCOUNT`` if set, else
    the pacer's account that claimed a slot last (``mail.rate_slot``), else ``"default"`` (the
    breaker's name for an account without a pacer)."""
    configured = os.environ.get("MAILFLOW_GUARD_ACCOUNT", "").strip()
    if configured:
        return configured
    row = conn.execute(query("reputation", "account")).fetchone()
    return str(row[0]) if row else "default"


def _rate(part: int, sample: int) -> Decimal:
    return (Decimal(part) / Decimal(sample)).quantize(Decimal("0.000001")) if sample else Decimal(0)


def _pct(fraction: float | Decimal) -> str:
    return f"{float(fraction) * 100:.2f}%".replace(".00%", "%")


def decide(sample: int, hard: int, complaints: int, config: GuardConfig) -> str | None:
    """The reason to trip a scope with ``sample`` emails with an outcome, ``hard`` hard bounces and
    ``complaints`` complaints, or None. Trips at or above a threshold (compared exactly, not in
    floating point), never below ``config.min_sample``."""
    if sample < config.min_sample:
        return None
    over = []
    if Fraction(hard, sample) >= Fraction(str(config.hard_bounce_rate)):
        over.append(f"hard-bounce rate {_pct(_rate(hard, sample))} ({hard} of {sample}) >= "
                    f"{_pct(config.hard_bounce_rate)}")
    if Fraction(complaints, sample) >= Fraction(str(config.complaint_rate)):
        over.append(f"complaint rate {_pct(_rate(complaints, sample))} ({complaints} of {sample}) >= "
                    f"{_pct(config.complaint_rate)}")
    if not over:
        return None
    return (f"{' and '.join(over)} over the last {sample} emails with an outcome "
            f"(hard bounces {_pct(_rate(hard, sample))}, complaints {_pct(_rate(complaints, sample))})")


def evaluate(conn: psycopg.Connection, campaigns: Iterable[str], *, config: GuardConfig | None = None,
             account: str | None = None, include_account: bool = True) -> list[Trip]:
    """Evaluate the campaigns ``campaigns`` and the provider account; trip the scopes over a threshold.

    Per scope still ``ok``: the rates over its recent outcomes (module docstring; ``config``, default
    :meth:`GuardConfig.from_env`) are stored on its row (``hard_bounce_rate``, ``complaint_rate``,
    ``sample``, ``evaluated_at``); a scope with at least ``min_sample`` emails and a rate at or above
    its threshold trips (``state = 'tripped'``, ``tripped_at``, ``reason`` naming the rates and the
    sample). In the same transaction a tripped campaign, or for an account trip every campaign, that
    is ``scheduled`` is paused (campaign event by ``reputation_guard`` with the rates in ``detail``).
    A tripped scope is not evaluated again until :func:`resume`.

    Idempotent and safe under concurrent evaluators: the rates are read without locks and stored by
    one guarded UPDATE (only a scope still ``ok`` and not resumed since the read changes), so two
    evaluators at once trip a scope once and pause its campaign once. Cost: one statement for the
    campaigns and one for the account, each reading at most ``max_sample`` emails through the send
    log's sent-at indexes. Call it after the outcomes it should see are committed (its own
    transaction, or a savepoint of the caller's; the guard rows stay locked until that commits).

    :param campaigns: send-log campaign names (lifecycle or scheduled); duplicates are ignored.
    :param account: the account scope's name (default :func:`guard_account`).
    :param include_account: also evaluate the account scope (default True).
    :returns: the scopes this call tripped (none if another evaluator tripped them first).
    """
    config = config or GuardConfig.from_env()
    names = sorted({str(c) for c in campaigns})
    trips: list[Trip] = []
    with conn.transaction():
        conn.execute(query("reputation", "no_jit"))
        acct = (account or guard_account(conn)) if include_account else None
        scopes = [("campaign", n) for n in names] + ([("account", acct)] if acct is not None else [])
        if not scopes:
            return []
        with conn.cursor(row_factory=dict_row) as cur:
            rows = {(r["scope"], r["name"]): r for r in cur.execute(
                query("reputation", "scopes"), {"campaigns": names, "account": acct,
                                                "every": config.account_every.total_seconds()}).fetchall()}
        missing = [s for s in scopes if s not in rows]
        if missing:
            conn.execute(query("reputation", "ensure_scopes"), {"scopes": [s for s, _ in missing],
                                                               "names": [n for _, n in missing]})
            for s in missing:
                rows[s] = {"scope": s[0], "name": s[1], "state": "ok", "resumed_at": None, "fresh": False}
        window = config.window.total_seconds()
        counts: dict[tuple[str, str], tuple[int, int, int]] = {}
        live = [n for n in names if rows[("campaign", n)]["state"] == "ok"]
        if live:
            for name, sample, hard, complaints in conn.execute(query("reputation", "campaign_rates"), {
                    "names": live, "resumed": [rows[("campaign", n)]["resumed_at"] for n in live],
                    "window": window, "max_sample": config.max_sample, "walk": config.walk}).fetchall():
                counts[("campaign", str(name))] = (int(sample), int(hard), int(complaints))
        if acct is not None and rows[("account", acct)]["state"] == "ok" and not rows[("account", acct)]["fresh"]:
            got = conn.execute(query("reputation", "account_rates"), {
                "resumed": rows[("account", acct)]["resumed_at"], "window": window,
                "max_sample": config.max_sample, "walk": config.walk}).fetchone()
            assert got is not None
            counts[("account", acct)] = (int(got[0]), int(got[1]), int(got[2]))
        if not counts:
            return []
        keys = list(counts)
        reasons = {k: decide(*counts[k], config) for k in keys}
        tripped = conn.execute(query("reputation", "record"), {
            "scopes": [s for s, _ in keys], "names": [n for _, n in keys],
            "samples": [counts[k][0] for k in keys],
            "hard_rates": [_rate(counts[k][1], counts[k][0]) for k in keys],
            "complaint_rates": [_rate(counts[k][2], counts[k][0]) for k in keys],
            "trips": [reasons[k] is not None for k in keys], "reasons": [reasons[k] for k in keys],
            "resumed": [rows[k]["resumed_at"] for k in keys]}).fetchall()
        for scope, name, now_tripped, tripped_at in sorted(tripped, key=lambda r: (r[0] != "account", r[1])):
            if not now_tripped:
                continue
            sample, hard, complaints = counts[(scope, name)]
            trip = Trip(scope, name, _rate(hard, sample), _rate(complaints, sample), sample, hard, complaints,
                        str(reasons[(scope, name)]), tripped_at)
            detail = {"reason": f"reputation guard tripped ({scope} {name}): {trip.reason}", "scope": scope,
                      "name": name, "hard_bounce_rate": str(trip.hard_bounce_rate),
                      "complaint_rate": str(trip.complaint_rate), "sample": sample, "hard_bounces": hard,
                      "complaints": complaints}
            paused = [r[0] for r in conn.execute(query("reputation", "pause_campaigns"), {
                "all": scope == "account", "name": name, "detail": Jsonb(detail)}).fetchall()]
            trips.append(dataclasses.replace(trip, paused=tuple(paused)))
    for t in trips:
        log.error("reputation guard tripped (%s %s): %s; paused: %s", t.scope, t.name, t.reason,
                  ", ".join(t.paused) or "no scheduled campaign")
    return trips


def blocked(conn: psycopg.Connection, campaign: str) -> str | None:
    """Why ``campaign`` may not send now: its own scope or the provider account is tripped (the
    account's reason first); None when it may send. One indexed read of the tripped rows."""
    with conn.transaction():
        row = conn.execute(query("reputation", "blocked"), {"campaign": campaign}).fetchone()
    if row is None:
        return None
    scope, name, reason, tripped_at = row
    return (f"reputation guard tripped ({scope} {name}) at {tripped_at:%Y-%m-%d %H:%M:%S %Z}: {reason}; "
            f"a person resumes it (mailflow reputation resume --{scope} {name})")


#: ``unpause(conn, campaign_id, actor)``: sets a guard-paused scheduled campaign back to ``scheduled``
#: (in the caller's transaction); the scheduled source's resume re-plans overdue rows.
Unpause = Callable[[psycopg.Connection, int, str], Any]
#: ``release(conn, campaign_id, actor)``: re-plans the overdue rows of a ``scheduled`` campaign the
#: resumed scope held without pausing it (in the caller's transaction; the scheduled source's
#: ``replan_overdue``).
Release = Callable[[psycopg.Connection, int, str], Any]


@dataclass(frozen=True)
class Resumed:
    """What :func:`resume` did: ``changed`` (the scope was tripped and is ok now), ``resumed_at``
    (aware, database clock; None if unchanged), ``unpaused`` (scheduled campaigns set back to
    ``scheduled`` because the guard had paused them and nothing trips them any more) and ``released``
    (campaigns that were ``scheduled`` but held by the scope, handed to the ``release`` hook)."""

    scope: str
    name: str
    changed: bool
    resumed_at: datetime | None
    unpaused: tuple[str, ...]
    released: tuple[str, ...] = ()


def resume(conn: psycopg.Connection, scope: str, name: str, actor: str, reason: str = "", *,
           unpause: Unpause | None = None, release: Release | None = None) -> Resumed:
    """A person resumes a tripped scope (a campaign or the provider account), in one transaction.

    The scope becomes ``ok`` with ``resumed_at`` (database clock), ``resumed_by`` = ``actor`` and
    ``resume_reason``; outcomes of emails sent before it no longer count, so it does not trip again
    at once on the same bounces. Every scheduled campaign the guard paused (its last pause event is
    by ``reputation_guard``) that no scope trips any more is set back to ``scheduled`` with ``unpause``
    (default: the status alone, with a campaign event by ``actor``); a campaign paused by someone else
    stays paused. Every campaign the scope held while it was already ``scheduled`` (provisioned, or
    resumed by a person, while the scope was tripped: the claim statements hold it all the same) that
    nothing trips any more is handed to ``release`` (the scheduled source re-plans its overdue rows, so
    the backlog of the hold is not sent at once; default: nothing). Resuming an ``ok`` scope changes
    nothing.

    :raises ValueError: for an unknown scope, or an empty ``actor`` (resuming is a person's decision).
    :raises LookupError: if the guard has no row for the scope (never evaluated: nothing to resume).
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    if not actor or not actor.strip():
        raise ValueError("resuming is a person's decision: name who resumes (actor)")
    actor = actor.strip()
    with conn.transaction():
        row = conn.execute(query("reputation", "resume"), {"scope": scope, "name": name, "actor": actor,
                                                          "reason": reason.strip() or None}).fetchone()
        if row is None and conn.execute(query("reputation", "scope_exists"),
                                        {"scope": scope, "name": name}).fetchone() is None:
            raise LookupError(f"the reputation guard has no {scope} {name!r} (known: "
                              + (", ".join(f"{s} {n}" for s, n, *_ in status_rows(conn)) or "none") + ")")
        unpaused: list[str] = []
        released: list[str] = []
        if row is not None:
            # the campaigns held while scheduled, read before any unpause makes a paused one scheduled
            held = conn.execute(query("reputation", "guard_held"),
                                {"name": name if scope == "campaign" else None}).fetchall()
            for cid, cname in held:
                if release is not None:
                    release(conn, int(cid), actor)
                    released.append(str(cname))
            for cid, cname in conn.execute(query("reputation", "guard_paused"),
                                           {"name": name if scope == "campaign" else None}).fetchall():
                if unpause is not None:
                    unpause(conn, int(cid), actor)
                else:
                    conn.execute(query("reputation", "unpause"), {"id": cid, "actor": actor, "detail": Jsonb(
                        {"reason": f"reputation guard resumed ({scope} {name}) by {actor}: {reason}"})})
                unpaused.append(str(cname))
    if row is not None:
        log.warning("reputation guard resumed (%s %s) by %s: %s; campaigns set back to scheduled: %s; held "
                    "campaigns released: %s", scope, name, actor, reason, ", ".join(unpaused) or "none",
                    ", ".join(released) or "none")
    return Resumed(scope, name, row is not None, row[0] if row else None, tuple(unpaused), tuple(released))


def status_rows(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Every guard row as a tuple ``(scope, name, state, ...)`` in :func:`status` order."""
    return conn.execute(query("reputation", "status")).fetchall()


def status(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Every guard row, tripped first: ``scope``, ``name``, ``state``, ``hard_bounce_rate``,
    ``complaint_rate`` (Decimal fractions 0..1 or None), ``sample``, ``evaluated_at``, ``tripped_at``,
    ``reason``, ``resumed_at``, ``resumed_by``, ``resume_reason``, ``alerted_at`` (aware UTC or None)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("reputation", "status")).fetchall()


def unalerted_trips(conn: psycopg.Connection) -> list[dict[str, Any]]:
    """Trips not alerted yet, oldest first, locked ``FOR UPDATE SKIP LOCKED`` until the caller's
    transaction ends (call inside one; :func:`mark_alerted` in the same transaction after alerting)."""
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query("reputation", "unalerted")).fetchall()


def mark_alerted(conn: psycopg.Connection, scopes: Iterable[tuple[str, str]]) -> None:
    """Record that the trips ``(scope, name)`` were put in an alert (``alerted_at``)."""
    pairs = list(scopes)
    conn.execute(query("reputation", "mark_alerted"), {"scopes": [s for s, _ in pairs], "names": [n for _, n in pairs]})


def alert_line(trip: dict[str, Any]) -> str:
    """One alert line for an :func:`unalerted_trips` row: the scope, the rates, the sample and what to do."""
    return (f"{trip['scope']} {trip['name']}: hard bounces {_pct(trip['hard_bounce_rate'] or 0)}, complaints "
            f"{_pct(trip['complaint_rate'] or 0)} over {trip['sample']} emails with an outcome; {trip['reason']}; "
            f"resume: mailflow reputation resume --{trip['scope']} {trip['name']} --reason ...")
