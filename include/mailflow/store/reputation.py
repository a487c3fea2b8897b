"""The reputation guard: sequential tests of the hard-bounce and complaint rates per campaign and per
provider account, the stop they impose when a rate crosses its line, and the bound on what a scope may
send before its rates are known (``mail.reputation_guard``, migrations 0020 and 0033; docs/operations.md,
"Reputation guard").

Email providers suspend accounts whose bounce or complaint rates stay high, which stops every campaign of
the user. The strictest published lines (``resend-contract.md``, "Deliverability thresholds"): Resend's
acceptable-use policy, complaints under 0.08 % and bounces under 4 %; Amazon SES, review at 5 % bounces or
0.1 % complaints, pause at 10 % or 0.5 %; Gmail and Yahoo (2024), spam rate under 0.1 %, never 0.3 %. The
guard's default lines are half the strictest: **2 % hard bounces, 0.04 % complaints** (:class:`GuardConfig`;
per account in ``mail.reputation_setting``).

What is counted. Every outcome once, when it arrives: each evaluation adds to a scope's statistics what the
outcome counters (``mail.campaign_counts``, migration 0028) gained since the previous evaluation. An email
without an outcome is never evidence; the newest sends are never the sample.

The rule: three one-sided sequential probability ratio tests (Wald), each run as a CUSUM (its log-likelihood
ratio floored at the lower boundary, so a long good history never hides a bad turn):

* hard bounces: H1 rate = the line, H0 = a quarter of it; every email with a final outcome is a trial.
* gross complaints: H1 = 10x the complaint line, H0 = the line; every delivered email is a trial (complaints
  of a grossly bad list arrive as fast as its deliveries: this test is what the exposure bound waits for).
* complaints: H1 = the line, H0 = a quarter of it; a delivered email counts as a trial only in proportion to
  the part of the complaint lag (default 24 h) it has lived (:func:`lagged_evidence`), because complaints
  arrive hours or days after delivery: a fresh email without a complaint is not yet evidence of none.

A test trips its scope when its ratio reaches ``log((1 - miss) / false_trip)`` (6.9 with the defaults
``false_trip`` 0.001 and ``miss`` 0.01). Under H0 or better the ratio is a non-negative supermartingale, so by
Ville's inequality an excursion from the floor reaches the trip line with probability at most
``exp(-(upper - lower))`` (1e-5): the false-trip probability; at the line or worse the ratio drifts up and
trips with probability 1 (the miss probability of the test's first pass is ``miss``). Expected evidence to
trip: 5 hard bounces at a 100 % bounce rate, about 540 outcomes at exactly 2 %, about 870 delivered emails at
0.5 % complaints (:func:`operating_characteristics`, docs/operations.md has the table).

Bounded exposure. A scope is *proven* once the bounce and gross-complaint tests have reached their lower
boundary (their rates are known to be healthy), and stays proven until either ratio rises above 0. While a
scope is not proven, at most ``exposure`` (E, default 10,000) of its emails are granted per round
(:func:`admit`, called by the lifecycle source before each chunk and by the dispatcher's claim); a new round
starts once as many outcomes have arrived as the round sent, or, after ``outcome_wait`` (default 15 minutes)
without a grant, once 90 % of them have (time alone never opens a round: a dead feedback channel holds it). A bad audience is therefore stopped within its first E emails whenever its test needs fewer
than E outcomes (a 100 % bounce list needs 5; 0.5 % complaints about 870); a healthy one is proven after
about 300 bounce outcomes and 1,300 deliveries, and then sends at full speed.

A trip pauses the scheduled campaign (``mail.campaign.status = 'paused'``, a campaign event by
``reputation_guard`` with the rates) in the trip's own transaction; an account trip pauses every scheduled
campaign. The lifecycle source skips a blocked campaign, and the dispatcher's claim statements never pick a
blocked or waiting campaign's rows. Only a person resumes (:func:`resume`, ``mailflow reputation resume``,
the ``resume_sending`` DAG).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow.store.sql import query

log = logging.getLogger(__name__)

#: The actor of the campaign events the guard writes (a pause), and how a resume recognises its pauses.
GUARD_ACTOR = "reputation_guard"
SCOPES = ("campaign", "account")
#: H0 of the bounce and complaint tests is the line divided by this (a healthy list sits well under the line).
HEALTHY_FRACTION = 4.0
#: H1 of the gross-complaint test is the complaint line times this.
GROSS_FACTOR = 10.0
#: The smallest E an account's setting may hold (mail.reputation_setting's check: one full batch).
MIN_SETTING_EXPOSURE = 100
#: After the outcome wait, a round ends once this share of its emails has an outcome (the rest may be lost
#: for good); with less, it keeps waiting for feedback: time alone never opens a round.
ROUND_EVIDENCE = 0.9
_WARNED: dict[str, float] = {}


def _warn_once(key: str, message: str, every: float = 60.0) -> None:
    """Log ``message`` as a warning at most once per ``every`` seconds per ``key`` in this process (a
    waiting lifecycle run evaluates every second)."""
    now = time.monotonic()
    if now - _WARNED.get(key, -every) >= every:
        _WARNED[key] = now
        log.warning("%s", message)


#: Obsolete settings of the windowed guard: ignored, with a warning.
_OBSOLETE = ("MAILFLOW_GUARD_MIN_SAMPLE", "MAILFLOW_GUARD_MAX_SAMPLE", "MAILFLOW_GUARD_WINDOW_HOURS")


@dataclass(frozen=True)
class GuardConfig:
    """The lines, the tests' error probabilities and the exposure bound of the guard.

    :param hard_bounce_rate: the hard-bounce line to stay under (fraction 0..1; default 0.02, half of
        Resend's 4 %).
    :param complaint_rate: the complaint line to stay under (fraction; default 0.0004, half of Resend's
        0.08 %). At most 0.099: the gross test's H1 is ten times it.
    :param exposure: E, the emails a scope that is not proven may send per round (default 10,000: about what
        800 emails/s put in flight while the first outcomes come back, so a healthy audience is proven before its
        first round is spent).
    :param complaint_lag: complaints are expected over this long after delivery (default 24 h); a
        delivered email weighs ``age / complaint_lag`` (at most 1) in the complaint test.
    :param outcome_wait: a round that has 90 % of its outcomes (:data:`ROUND_EVIDENCE`) is over after this
        long without a grant (default 15 minutes: a webhook lost for good must not hold a campaign forever);
        with fewer it keeps waiting for feedback.
    :param false_trip: alpha of each test (default 0.001).
    :param miss: beta of each test (default 0.01).
    :param account_every: the account scope is evaluated at most this often (default 1 s).

    Environment overrides (per deployment): ``MAILFLOW_GUARD_HARD_BOUNCE_RATE``,
    ``MAILFLOW_GUARD_COMPLAINT_RATE``, ``MAILFLOW_GUARD_EXPOSURE``, ``MAILFLOW_GUARD_COMPLAINT_LAG_HOURS``,
    ``MAILFLOW_GUARD_OUTCOME_WAIT_MINUTES`` (:meth:`from_env`); per provider account: a row of
    ``mail.reputation_setting`` (:func:`config_for`, ``mailflow reputation set``).
    """

    hard_bounce_rate: float = 0.02
    complaint_rate: float = 0.0004
    exposure: int = 10_000
    complaint_lag: timedelta = timedelta(hours=24)
    outcome_wait: timedelta = timedelta(minutes=15)
    false_trip: float = 0.001
    miss: float = 0.01
    account_every: timedelta = timedelta(seconds=1)

    def __post_init__(self) -> None:
        if not 0 < self.hard_bounce_rate < 1:
            raise ValueError(f"reputation guard: hard_bounce_rate must be a fraction in (0, 1), got "
                             f"{self.hard_bounce_rate!r}")
        if not 0 < self.complaint_rate * GROSS_FACTOR < 1:
            raise ValueError(f"reputation guard: complaint_rate must be a fraction in (0, {1 / GROSS_FACTOR}), got "
                             f"{self.complaint_rate!r}")
        if self.exposure < 1:
            raise ValueError(f"reputation guard: exposure must be at least 1 email, got {self.exposure!r}")
        if self.complaint_lag <= timedelta(0) or self.outcome_wait <= timedelta(0):
            raise ValueError("reputation guard: complaint_lag and outcome_wait must be positive")
        if not (0 < self.false_trip < 0.5 and 0 < self.miss < 0.5):
            raise ValueError("reputation guard: false_trip and miss must be probabilities in (0, 0.5)")

    @property
    def upper(self) -> float:
        """The trip line of every test's log-likelihood ratio: ``log((1 - miss) / false_trip)``."""
        return math.log((1 - self.miss) / self.false_trip)

    @property
    def lower(self) -> float:
        """The floor (lower boundary) of every test's ratio: ``log(miss / (1 - false_trip))``."""
        return math.log(self.miss / (1 - self.false_trip))

    def weights(self, test: str) -> tuple[float, float]:
        """``(per bad event, per good trial)`` log-likelihood increments of ``test`` ('bounce', 'gross',
        'complaint'): ``log(p1 / p0)`` and ``log((1 - p1) / (1 - p0))``."""
        p1, p0 = {"bounce": (self.hard_bounce_rate, self.hard_bounce_rate / HEALTHY_FRACTION),
                  "gross": (self.complaint_rate * GROSS_FACTOR, self.complaint_rate),
                  "complaint": (self.complaint_rate, self.complaint_rate / HEALTHY_FRACTION)}[test]
        return math.log(p1 / p0), math.log((1 - p1) / (1 - p0))

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> GuardConfig:
        """The defaults, overridden by the ``MAILFLOW_GUARD_*`` variables that are set.

        :raises ValueError: naming the variable, for a value that is not a number or out of range.
        """
        env = dict(os.environ if env is None else env)
        for var in _OBSOLETE:
            if env.get(var, "").strip():
                log.warning("%s is no longer read: the guard's tests need no minimum sample or window "
                            "(docs/operations.md, 'Reputation guard')", var)
        kw: dict[str, Any] = {}
        for var, field, kind in (("MAILFLOW_GUARD_HARD_BOUNCE_RATE", "hard_bounce_rate", float),
                                 ("MAILFLOW_GUARD_COMPLAINT_RATE", "complaint_rate", float),
                                 ("MAILFLOW_GUARD_EXPOSURE", "exposure", int),
                                 ("MAILFLOW_GUARD_COMPLAINT_LAG_HOURS", "complaint_lag", float),
                                 ("MAILFLOW_GUARD_OUTCOME_WAIT_MINUTES", "outcome_wait", float)):
            raw = env.get(var, "").strip()
            if not raw:
                continue
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a number") from None
            if field == "complaint_lag":
                kw[field] = timedelta(hours=value)
            elif field == "outcome_wait":
                kw[field] = timedelta(minutes=value)
            else:
                kw[field] = value
        try:
            return cls(**kw)
        except ValueError as exc:
            raise ValueError(f"{exc} (from the MAILFLOW_GUARD_* environment)") from None


def config_for(conn: psycopg.Connection, account: str, base: GuardConfig | None = None) -> GuardConfig:
    """The guard's settings for provider account ``account``: ``base`` (default :meth:`GuardConfig.from_env`)
    with the non-null columns of its ``mail.reputation_setting`` row."""
    base = base or GuardConfig.from_env()
    row = conn.execute(query("reputation", "setting"), {"account": account}).fetchone()
    if row is None:
        return base
    hb, cr, exposure, lag_hours = row
    kw: dict[str, Any] = {}
    if hb is not None:
        kw["hard_bounce_rate"] = float(hb)
    if cr is not None:
        kw["complaint_rate"] = float(cr)
    if exposure is not None:
        kw["exposure"] = int(exposure)
    if lag_hours is not None:
        kw["complaint_lag"] = timedelta(hours=float(lag_hours))
    return dataclasses.replace(base, **kw)


def set_config(conn: psycopg.Connection, account: str, actor: str, **values: float | int | None) -> None:
    """Store the settings of ``account`` (``hard_bounce_rate``, ``complaint_rate``, ``exposure``,
    ``complaint_lag_hours``; None keeps the default) after checking them with :class:`GuardConfig`.

    :raises ValueError: for an unknown setting, or a value :class:`GuardConfig` refuses (naming it).
    """
    known = {"hard_bounce_rate", "complaint_rate", "exposure", "complaint_lag_hours"}
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown reputation setting(s): {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
    if not actor.strip():
        raise ValueError("a setting is a person's decision: name who sets it")
    exposure = values.get("exposure")
    if exposure is not None and exposure < MIN_SETTING_EXPOSURE:
        raise ValueError(f"reputation setting of account {account}: exposure must be at least {MIN_SETTING_EXPOSURE} "
                         f"emails (one full batch), got {exposure!r}")
    probe: dict[str, Any] = {k: v for k, v in values.items() if v is not None and k != "complaint_lag_hours"}
    if values.get("complaint_lag_hours") is not None:
        probe["complaint_lag"] = timedelta(hours=float(values["complaint_lag_hours"] or 0))
    GuardConfig(**probe)  # raises naming the bad value
    conn.execute(query("reputation", "set_setting"), {"account": account, "actor": actor.strip(),
                                                      **{k: values.get(k) for k in known}})


@dataclass(frozen=True)
class Trip:
    """A scope this evaluation tripped: ``scope`` ('campaign' / 'account'), ``name``, the rates since the
    scope's baseline (fractions 0..1), ``sample`` (emails with an outcome), the counts, ``reason`` (text
    naming the test, the rates and the line), ``tripped_at`` (aware, database clock) and ``paused``
    (scheduled campaigns paused by it)."""

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


def guard_account(conn: psycopg.Connection, sender: str | None = None) -> str:
    """The provider account the account scope is named after: ``MAILFLOW_GUARD_ACCOUNT`` if set, else
    ``sender`` (a sender's own account, :func:`mailflow.provider.breaker.breaker_account`). A caller without
    a provider (the webhook receiver, the feedback task) takes the account scope the senders were granted
    emails on last (``mail.reputation_guard.last_grant_at``: the name the senders use, whatever their
    pacer or environment), else the pacer's account that claimed a slot last (``mail.rate_slot``), else
    ``"default"`` (the breaker's name for an account without a pacer)."""
    configured = os.environ.get("MAILFLOW_GUARD_ACCOUNT", "").strip()
    if configured:
        return configured
    if sender:
        return sender
    row = conn.execute(query("reputation", "account")).fetchone()
    return str(row[0]) if row else "default"


def _rate(part: int, sample: int) -> Decimal:
    return (Decimal(part) / Decimal(sample)).quantize(Decimal("0.000001")) if sample else Decimal(0)


def _pct(fraction: float | Decimal) -> str:
    return f"{float(fraction) * 100:.3f}".rstrip("0").rstrip(".") + "%"


#: The outcome counters one evaluation reads (mail.campaign_counts keys), and their names in ``seen``.
COUNTER_KEYS = {"sent": "sent", "with_outcome": "with_outcome", "hard_bounced": "hard",
                "complained": "complaints", "delivered": "delivered"}


def lagged_evidence(marks: list[list[float]], now: float, delivered: float, lag: float) -> float:
    """The complaint test's trials: ``(1 / lag) * integral of D(s) ds over [now - lag, now]``, where D is the
    scope's delivered count since its baseline, piecewise linear through ``marks`` (``[epoch seconds,
    D]``, ascending, the first at the baseline with D = 0) and ``(now, delivered)``, and 0 before the first
    mark. Equals the sum over delivered emails of ``min(1, age / lag)``: each email weighs the share of the
    complaint lag it has lived (complaints assumed to arrive uniformly over the lag)."""
    pts = [(float(t), float(d)) for t, d in marks if float(t) < now] + [(now, float(delivered))]
    start = now - lag
    total = 0.0
    for (t0, d0), (t1, d1) in zip(pts, pts[1:], strict=False):
        if t1 <= start or t1 <= t0:
            continue
        a = max(t0, start)
        da = d0 + (d1 - d0) * (a - t0) / (t1 - t0)
        total += (da + d1) / 2 * (t1 - a)
    return total / lag


def _step(llr: float, bad: float, good: float, weights: tuple[float, float], floor: float) -> float:
    return max(floor, llr + bad * weights[0] + max(good, 0.0) * weights[1])


def _counts(conn: psycopg.Connection, names: list[str], account: str | None) -> tuple[dict[tuple[str, str], dict[str, int]], bool]:
    """The outcome counters now: per campaign of ``names`` and, with ``account``, summed over every
    campaign (the send log sends through one provider account); and whether the counters are seeded.
    One read of the counters (every campaign's when the account is asked for, else only ``names``)."""
    zero = {v: 0 for v in COUNTER_KEYS.values()}
    out: dict[tuple[str, str], dict[str, int]] = {}
    seeded = bool(conn.execute(query("counters", "seeded")).fetchone()[0])  # type: ignore[index]
    keys = list(COUNTER_KEYS)
    if not names and account is None:
        return out, seeded
    total = dict(zero)
    for row in conn.execute(query("reputation", "campaign_counts"), {
            "names": None if account is not None else names, "keys": keys}).fetchall():
        got = {COUNTER_KEYS[k]: int(v) for k, v in zip(keys, row[1:], strict=True)}
        if str(row[0]) in names:
            out[("campaign", str(row[0]))] = got
        for k, v in got.items():
            total[k] += v
    for n in names:
        out.setdefault(("campaign", n), dict(zero))
    if account is not None:
        out[("account", account)] = total
    return out, seeded


def _ensure(conn: psycopg.Connection, scopes: list[tuple[str, str]], *, sending: timedelta | None = None) -> None:
    """Create the guard rows not seen before, their baseline at zero: a scope first seen counts its
    campaign's (or the account's) whole history in its first evaluation, so a campaign sent before the
    guard knew it is judged on everything it has, its deliveries as old ones (they lived the complaint lag:
    an upgrade must not trip a campaign on its old complaints). A row created by a sender (``sending``, the
    complaint lag: :func:`admit`, before the scope's first email) gets complaint-lag marks now: what was
    delivered before counts as having lived the lag (an account scope under a new name has the whole send
    log's history), and what it sends from here on counts as fresh."""
    have = {(r[0], r[1]) for r in conn.execute(query("reputation", "existing"), {
        "scopes": [s for s, _ in scopes], "names": [n for _, n in scopes]}).fetchall()}
    # created in lock_scopes' order (account first, then campaigns by name), like every locker's
    missing = sorted((s for s in scopes if s not in have), key=lambda k: (k[0] != "account", k[1]))
    if not missing:
        return
    seeded = bool(conn.execute(query("counters", "seeded")).fetchone()[0])  # type: ignore[index]
    zero = {**{k: 0 for k in COUNTER_KEYS.values()}, "seeded": seeded}
    marks: dict[tuple[str, str], list[list[float]]] = {k: [] for k in missing}
    if sending is not None:
        now = float(conn.execute(query("reputation", "now")).fetchone()[0])  # type: ignore[index]
        acct = next((n for s, n in missing if s == "account"), None)
        counts, _ = _counts(conn, [n for s, n in missing if s == "campaign"], acct)
        for k in missing:
            history = float(counts[k]["delivered"])
            marks[k] = [[now - sending.total_seconds(), history], [now, history]]
    conn.execute(query("reputation", "ensure_scopes"), {
        "scopes": [s for s, _ in missing], "names": [n for _, n in missing], "seen": [Jsonb(zero) for _ in missing],
        "marks": [Jsonb(marks[k]) for k in missing]})


def evaluate(conn: psycopg.Connection, campaigns: Iterable[str], *, config: GuardConfig | None = None,
             account: str | None = None, include_account: bool = True) -> list[Trip]:
    """Evaluate the campaigns ``campaigns`` and the provider account; trip the scopes whose tests cross.

    Per scope still ``ok``: the outcome counters' gains since its last evaluation feed its three tests
    (module docstring); the rates and the sample since its baseline are stored for display; its proof and
    its exposure round are updated (a spent round whose outcomes arrived, or that waited ``outcome_wait``,
    starts again). A test at or over its trip line trips the scope (``state = 'tripped'``, ``tripped_at``,
    ``reason`` naming the test, the rates and the line). In the same transaction a tripped campaign, or for
    an account trip every campaign, that is ``scheduled`` is paused (campaign event by ``reputation_guard``
    with the rates in ``detail``). A tripped scope is not evaluated again until :func:`resume`.

    Safe under concurrent evaluators and senders: the scopes' rows are locked (account first, then the
    campaigns by name) for the read-modify-write, so every counter gain is counted once and a scope trips
    once. Cost: one read of the counters per call (a few rows per campaign plus the unfolded deltas), whatever
    the send log's size. Call it after the outcomes it should see are committed (its own transaction, or a
    savepoint of the caller's; the guard rows stay locked until that commits).

    :param campaigns: send-log campaign names (lifecycle or scheduled); duplicates are ignored.
    :param config: the settings (default: :func:`config_for` the account).
    :param account: the account scope's name (default :func:`guard_account`).
    :param include_account: also evaluate the account scope (default True; at most every ``account_every``).
    :returns: the scopes this call tripped (none if another evaluator tripped them first).
    """
    names = sorted({str(c) for c in campaigns})
    trips: list[Trip] = []
    with conn.transaction():
        acct_name = account or guard_account(conn)
        config = config or config_for(conn, acct_name)
        acct = acct_name if include_account else None
        scopes = [("campaign", n) for n in names] + ([("account", acct)] if acct is not None else [])
        if not scopes:
            return []
        _ensure(conn, scopes)
        with conn.cursor(row_factory=dict_row) as cur:
            rows = {(r["scope"], r["name"]): r for r in cur.execute(query("reputation", "lock_scopes"), {
                "scopes": [s for s, _ in scopes], "names": [n for _, n in scopes],
                "every": config.account_every.total_seconds()}).fetchall()}
        live = [k for k in scopes if k in rows and rows[k]["state"] == "ok"
                and not (k[0] == "account" and rows[k]["fresh"])]
        if not live:
            return []
        counts, seeded = _counts(conn, [n for s, n in live if s == "campaign"],
                                 acct if ("account", acct) in live else None)
        now = float(conn.execute(query("reputation", "now")).fetchone()[0])  # type: ignore[index]
        for key in live:
            reason = _update(conn, rows[key], counts[key], seeded, now, config)
            if reason is None:
                continue
            scope, name = key
            r = rows[key]
            trip = Trip(scope, name, _rate(r["cum_hard"], r["cum_outcomes"]),
                        _rate(r["cum_complaints"], r["cum_delivered"]), int(r["cum_outcomes"]), int(r["cum_hard"]),
                        int(r["cum_complaints"]), reason, r["tripped_at"])
            detail = {"reason": f"reputation guard tripped ({scope} {name}): {reason}", "scope": scope,
                      "name": name, "hard_bounce_rate": str(trip.hard_bounce_rate),
                      "complaint_rate": str(trip.complaint_rate), "sample": trip.sample,
                      "hard_bounces": trip.hard_bounces, "complaints": trip.complaints}
            paused = [p[0] for p in conn.execute(query("reputation", "pause_campaigns"), {
                "all": scope == "account", "name": name, "detail": Jsonb(detail)}).fetchall()]
            trips.append(dataclasses.replace(trip, paused=tuple(paused)))
    for t in sorted(trips, key=lambda t: (t.scope != "account", t.name)):
        log.error("reputation guard tripped (%s %s): %s; paused: %s", t.scope, t.name, t.reason,
                  ", ".join(t.paused) or "no scheduled campaign")
    return trips


def _update(conn: psycopg.Connection, row: dict[str, Any], now_counts: dict[str, int], seeded: bool, now: float,
            config: GuardConfig) -> str | None:
    """Feed one locked scope's tests with the counters' gains, store its state; the trip reason or None.
    ``row`` is updated in place with what was stored."""
    seen = row["seen"] or {}
    if not seen or bool(seen.get("seeded")) != seeded:
        # first sight, or the counters were seeded (a full recount): a new baseline, nothing counted
        gain = {k: 0 for k in COUNTER_KEYS.values()}
        if seen and row["round_outcomes"] is not None:
            # the round's outcomes so far, carried into the recount's units (the history the seed adds is
            # not the round's)
            row["round_outcomes"] = now_counts["with_outcome"] - (int(seen.get("with_outcome", 0))
                                                                   - int(row["round_outcomes"]))
    else:
        gain = {k: max(0, now_counts[k] - int(seen.get(k, 0))) for k in COUNTER_KEYS.values()}
    outcomes, hard = gain["with_outcome"], gain["hard"]
    complaints, delivered = gain["complaints"], gain["delivered"]
    cum_delivered = int(row["cum_delivered"]) + delivered
    lag = config.complaint_lag.total_seconds()
    marks: list[list[float]] = list(row["delivered_marks"] or [])
    if not marks:
        # first sight: what was delivered before the guard knew the scope counts as having lived the lag
        marks = [[now - lag, float(cum_delivered)]]
    evidence = lagged_evidence(marks, now, cum_delivered, lag)
    if now - marks[-1][0] >= lag / 60:
        marks.append([now, float(cum_delivered)])
    while len(marks) > 1 and marks[1][0] <= now - lag:
        marks.pop(0)  # the mark at or before the lag's start is enough to interpolate from
    floor = config.lower
    llr_b = _step(row["llr_bounce"], hard, outcomes - hard, config.weights("bounce"), floor)
    llr_g = _step(row["llr_gross"], complaints, delivered - complaints, config.weights("gross"), floor)
    llr_c = _step(row["llr_complaint"], complaints, evidence - float(row["evidence"]) - complaints,
                  config.weights("complaint"), floor)
    cum_outcomes = int(row["cum_outcomes"]) + outcomes
    cum_hard = int(row["cum_hard"]) + hard
    cum_complaints = int(row["cum_complaints"]) + complaints
    eps = 1e-9
    was_proven = bool(row["proven"])
    proven = (llr_b <= floor + eps and llr_g <= floor + eps) or (was_proven and llr_b <= 0 and llr_g <= 0)
    round_sent, round_outcomes, waiting = int(row["round_sent"]), row["round_outcomes"], bool(row["waiting"])
    last_grant = row["last_grant_epoch"]
    if proven or was_proven:
        # proven: no bound; just lost the proof: a fresh round counts from here
        round_sent, round_outcomes, waiting = 0, now_counts["with_outcome"], False
    elif round_sent > 0:
        came = now_counts["with_outcome"] - int(round_outcomes or 0)
        timed_out = last_grant is not None and now - float(last_grant) >= config.outcome_wait.total_seconds()
        # time alone never opens a round: after the outcome wait the few outcomes that never came (a webhook
        # lost for good) no longer hold it, but most of the round's evidence must be in
        enough = came >= math.ceil(ROUND_EVIDENCE * round_sent)
        if came < round_sent and timed_out:
            _warn_once(f"{row['scope']} {row['name']} {last_grant}", (
                f"reputation guard ({row['scope']} {row['name']}): {round_sent - max(came, 0)} of its round's "
                f"{round_sent} emails still have no outcome after the outcome wait ({config.outcome_wait}); "
                + ("a new round starts" if enough else
                   f"the round waits for them (it needs {ROUND_EVIDENCE:.0%} of them)")
                + (": no outcome arrived at all; are the webhooks and the deliverability poll running?"
                   if came <= 0 else "")))
        if came >= round_sent or (timed_out and enough):
            round_sent, round_outcomes, waiting = 0, now_counts["with_outcome"], False
    reason = None
    over = []
    line_b, line_c = _pct(config.hard_bounce_rate), _pct(config.complaint_rate)
    if llr_b >= config.upper:
        over.append(f"hard bounces {_pct(_rate(cum_hard, cum_outcomes))} ({cum_hard} of {cum_outcomes} emails with "
                    f"an outcome) against the {line_b} line")
    if llr_g >= config.upper:
        over.append(f"complaints {_pct(_rate(cum_complaints, cum_delivered))} ({cum_complaints} of {cum_delivered} "
                    f"delivered) against {_pct(config.complaint_rate * GROSS_FACTOR)} (10x the {line_c} line)")
    elif llr_c >= config.upper:
        over.append(f"complaints {_pct(_rate(cum_complaints, cum_delivered))} ({cum_complaints} of {cum_delivered} "
                    f"delivered, {evidence:.0f} weighed by the {config.complaint_lag} complaint lag) against the "
                    f"{line_c} line")
    if over:
        reason = (f"{' and '.join(over)}: the sequential test crossed its trip line "
                  f"(log-likelihood ratio >= {config.upper:.2f}; false-trip probability <= {config.false_trip:g})")
    stored = conn.execute(query("reputation", "store"), {
        "scope": row["scope"], "name": row["name"], "llr_bounce": llr_b, "llr_gross": llr_g, "llr_complaint": llr_c,
        "proven": proven, "seen": Jsonb({**now_counts, "seeded": seeded}), "marks": Jsonb(marks),
        "evidence": evidence, "cum_outcomes": cum_outcomes, "cum_hard": cum_hard, "cum_complaints": cum_complaints,
        "cum_delivered": cum_delivered, "awaiting": max(0, now_counts["sent"] - now_counts["with_outcome"]),
        "round_sent": round_sent, "round_outcomes": round_outcomes, "waiting": waiting,
        "hard_rate": _rate(cum_hard, cum_outcomes), "complaint_rate": _rate(cum_complaints, cum_delivered),
        "trip": reason is not None, "reason": reason}).fetchone()
    row.update(cum_outcomes=cum_outcomes, cum_hard=cum_hard, cum_complaints=cum_complaints,
               cum_delivered=cum_delivered, tripped_at=stored[0] if stored else None)
    return reason


@dataclass(frozen=True)
class Admission:
    """What :func:`admit` granted: ``granted`` emails (0..asked), ``reason`` why none may go (a trip, named
    as :func:`blocked` does) or None, and ``waiting`` (a scope's exposure round is spent: sending resumes when
    its outcomes arrive)."""

    granted: int
    reason: str | None = None
    waiting: str | None = None


def admit(conn: psycopg.Connection, campaign: str, asked: int, *, account: str | None = None,
          config: GuardConfig | None = None) -> Admission:
    """Ask the guard for ``asked`` emails of ``campaign`` about to be minted or claimed.

    Refused (0 granted, ``reason``) while the campaign's scope or the account is tripped. Otherwise each scope
    that is not proven grants at most what is left of its round's exposure (``config.exposure`` minus
    ``round_sent``) and counts the grant; a proven scope grants everything. A scope whose round is spent is
    marked ``waiting`` (the dispatcher's claim statements skip its campaigns) until :func:`evaluate` starts a
    new round. The scopes' rows are locked (account first) until the caller's transaction ends: call it in
    the transaction that mints or claims the rows, or give back what was not used with :func:`refund`.
    While both scopes are proven the locks are shared (nothing is counted): concurrent senders never wait
    on each other, and an evaluation that trips a scope waits for the caller's transaction (so a claim
    never sends past a trip it could have seen). A scope that is not proven counts every grant under an
    exclusive lock: its senders take turns for the length of a claim.

    :param account: the sender's provider account (:func:`guard_account`).
    :returns: an :class:`Admission`; ``granted <= asked``.
    """
    if asked <= 0:
        return Admission(0)
    with conn.transaction():
        acct = guard_account(conn, account)
        config = config or config_for(conn, acct)
        keys = [("account", acct), ("campaign", campaign)]
        params = {"scopes": [s for s, _ in keys], "names": [n for _, n in keys], "every": 0}
        with conn.cursor(row_factory=dict_row) as cur:
            looked = cur.execute(query("reputation", "read_scopes"), params).fetchall()
            if len(looked) == len(keys) and all(r["proven"] for r in looked):
                # both proven: nothing to count. Shared locks (senders never wait on each other; an
                # evaluation that trips or unproves a scope waits for this transaction, and it for one).
                with conn.transaction() as shared:
                    held = cur.execute(query("reputation", "share_scopes"), params).fetchall()
                    if len(held) == len(keys) and all(r["proven"] for r in held):
                        other = _blocked_reason(conn, campaign)
                        return Admission(0, reason=other) if other is not None else Admission(asked)
                    raise psycopg.Rollback(shared)  # unproven meanwhile: count under the exclusive lock below
            rows = {(r["scope"], r["name"]): r for r in cur.execute(query("reputation", "lock_scopes"), params)}
            if len(rows) < len(keys):  # a scope's first email
                _ensure(conn, keys, sending=config.complaint_lag)
                rows = {(r["scope"], r["name"]): r for r in cur.execute(query("reputation", "lock_scopes"), params)}
        for key in keys:
            r = rows[key]
            if r["state"] == "tripped":
                return Admission(0, reason=(
                    f"reputation guard tripped ({key[0]} {key[1]}) at {r['tripped_at']:%Y-%m-%d %H:%M:%S %Z}: "
                    f"{r['reason']}; a person resumes it (mailflow reputation resume --{key[0]} {key[1]})"))
        # an account scope under another name (a process that names the account otherwise) stops this
        # campaign as it stops the claim statements and blocked(): every account scope sums the same counters
        other = _blocked_reason(conn, campaign)
        if other is not None:
            return Admission(0, reason=other)
        granted = asked
        for key in keys:
            if not rows[key]["proven"]:
                granted = min(granted, max(0, config.exposure - int(rows[key]["round_sent"])))
        starting = [k for k in keys if not rows[k]["proven"] and int(rows[k]["round_sent"]) == 0]
        base: dict[tuple[str, str], int] = {}
        if starting and granted > 0:
            counts, _ = _counts(conn, [n for s, n in starting if s == "campaign"],
                                acct if ("account", acct) in starting else None)
            base = {k: counts[k]["with_outcome"] for k in starting}
        waiting = None
        for key in keys:
            r = rows[key]
            if r["proven"]:
                continue
            spent = int(r["round_sent"]) + granted >= config.exposure
            if spent and waiting is None:
                waiting = (f"{key[0]} {key[1]} is not proven yet: {config.exposure} of its emails await their "
                           f"outcomes (exposure E); sending resumes as they arrive")
            conn.execute(query("reputation", "grant"), {
                "scope": key[0], "name": key[1], "n": granted, "waiting": spent, "base": base.get(key)})
    return Admission(granted, waiting=waiting)


def refund(conn: psycopg.Connection, campaign: str, n: int, *, account: str | None = None) -> None:
    """Give back ``n`` emails granted by :func:`admit` that were not sent and will never have an outcome
    (held, duplicates, an empty page, rolled back, rejected by the provider): the rounds of the campaign's
    scope and the account's shrink by them (never below 0), so a round waits only for outcomes that can
    come."""
    if n <= 0:
        return
    with conn.transaction():
        acct = guard_account(conn, account)
        conn.execute(query("reputation", "refund"), {"campaign": campaign, "account": acct, "n": n})


def waiting_scopes(conn: psycopg.Connection) -> list[tuple[str, str]]:
    """``(scope, name)`` of the scopes (campaigns and accounts) whose exposure round is spent: what the
    dispatcher evaluates at each run so a round whose outcomes stopped coming starts again after
    ``outcome_wait`` (the claim statements skip every campaign while an account waits)."""
    return [(str(r[0]), str(r[1])) for r in conn.execute(query("reputation", "waiting")).fetchall()]


def waiting_campaigns(conn: psycopg.Connection) -> list[str]:
    """The campaigns of :func:`waiting_scopes`, by name."""
    return [name for scope, name in waiting_scopes(conn) if scope == "campaign"]


def operating_characteristics(rate: float, test: str = "bounce", config: GuardConfig | None = None) -> float:
    """Wald's approximation of the expected number of trials for ``test`` to reach its trip line from 0
    when the true rate is ``rate`` (fraction), or ``inf`` when the ratio drifts down (a rate at or under the
    test's indifference point). Trials: outcomes (bounce), delivered emails (gross, complaint)."""
    config = config or GuardConfig()
    bad, good = config.weights(test)
    drift = rate * bad + (1 - rate) * good
    return math.inf if drift <= 0 else config.upper / drift


def blocked(conn: psycopg.Connection, campaign: str) -> str | None:
    """Why ``campaign`` may not send now: its own scope or the provider account is tripped (the
    account's reason first); None when it may send. One indexed read of the tripped rows."""
    with conn.transaction():
        return _blocked_reason(conn, campaign)


def _blocked_reason(conn: psycopg.Connection, campaign: str) -> str | None:
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
    ``resume_reason``; its tests start again from 0 with a new baseline (the outcome counters now: what
    arrived before no longer counts, so it does not trip again at once on the same bounces) and it is not
    proven (the exposure bound applies again until its rates are known). Outcomes that arrive after the
    resume count, also for emails sent before it: resume once the stopped send's bounces are in
    (``mailflow reputation status`` shows what is still awaited). Every scheduled campaign the guard paused (its last pause event is
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
        counts, seeded = _counts(conn, [name] if scope == "campaign" else [], name if scope == "account" else None)
        row = conn.execute(query("reputation", "resume"), {
            "scope": scope, "name": name, "actor": actor, "reason": reason.strip() or None,
            "seen": Jsonb({**counts[(scope, name)], "seeded": seeded})}).fetchone()
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
    """One alert line for an :func:`unalerted_trips` row: the scope, the rates, the evidence and what to do."""
    return (f"{trip['scope']} {trip['name']}: hard bounces {_pct(trip['hard_bounce_rate'] or 0)} of {trip['sample']} "
            f"emails with an outcome, complaints {_pct(trip['complaint_rate'] or 0)} of {trip['cum_delivered']} "
            f"delivered; {trip['reason']}; resume: mailflow reputation resume --{trip['scope']} {trip['name']} "
            f"--reason ...")
