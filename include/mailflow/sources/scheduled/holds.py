"""Why a scheduled campaign does not send as planned: one reading shared by ``mailflow campaign status``,
the progress page and the dispatcher's metrics, so a held campaign never shows just ``scheduled``.

A campaign is held when the claim statements will not claim its rows (``pick_due``), for one of these
reasons, the first that applies (:data:`HOLD_KINDS`):

* ``paused``: a person (or the dispatcher, for the campaign's own fault) paused it; the event's actor
  and reason;
* ``guard_account``: the reputation guard tripped the provider account: every campaign is held, paused
  by the trip or ``scheduled`` (provisioned, or resumed by a person, while it was tripped);
* ``guard_campaign``: the guard tripped the campaign itself;
* ``guard_waiting``: the guard's exposure bound: the campaign (or the account) is not proven yet and its
  round of E emails is spent; sending goes on when the round's outcomes arrive (or the outcome wait ends);
* ``canary``: its canary is not released yet: how many canary emails were sent, how many have an
  outcome against how many the release needs, rows in flight or still planned, rows the contact policy
  deferred (not waited for) and when ``canary_max_wait`` releases it at the latest.

A campaign the guard paused shows the guard's kind (the trip's scope), not ``paused``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from mailflow.store.sql import query

#: The kinds of hold, in the order they are reported when several apply.
HOLD_KINDS = ("paused", "guard_account", "guard_campaign", "guard_waiting", "canary")
#: The actor of the reputation guard's pauses (:data:`mailflow.store.reputation.GUARD_ACTOR`).
_GUARD = "reputation_guard"


@dataclass(frozen=True)
class Hold:
    """Why campaign ``campaign`` is held: ``kind`` (one of :data:`HOLD_KINDS`), ``reason`` (text for a
    person: the cause and what lifts it), ``since`` (aware UTC: the pause or the trip; None for a canary)
    and ``detail`` (the numbers behind it: the canary's counts, the tripped scope)."""

    campaign: str
    kind: str
    reason: str
    since: datetime | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``kind``, ``reason``, ``since`` (ISO text or None) and the ``detail`` keys."""
        return {"kind": self.kind, "reason": self.reason, "since": self.since.isoformat() if self.since else None,
                **self.detail}


def _when(t: datetime | None) -> str:
    return t.isoformat(timespec="seconds") if t else "-"


def _guard(kind: str, scope: str, name: str, reason: str | None, at: datetime | None, status: str) -> Hold:
    held = "paused by the trip" if status == "paused" else "scheduled, but nothing is claimed while it is tripped"
    return Hold("", kind, f"reputation guard tripped ({scope} {name}) at {_when(at)}: {reason or 'no reason recorded'}; "
                          f"{held}; a person resumes it: mailflow reputation resume --{scope} {name} --reason ...",
                at, {"scope": scope, "name": name})


def _canary(r: Mapping[str, Any]) -> Hold:
    if r["canary_last_id"] is None:
        return Hold("", "canary", "canary waiting: provisioning has not fixed the canary rows yet (nothing is sent "
                                  "before it completes)", None, {"canary_rows": 0})
    sent, with_outcome = int(r["canary_sent"] or 0), int(r["canary_with_outcome"] or 0)
    share = float(r["canary_min_outcome_share"])
    needed = math.ceil(share * sent) if sent else 0
    open_, deferred = int(r["canary_open"] or 0), int(r["canary_deferred"] or 0)
    by = (r["canary_last_sent"] or r["canary_started"])
    release_by = by + r["canary_max_wait"] if by is not None else None
    parts = [f"canary waiting: {sent} of {int(r['canary_rows'] or 0)} canary emails sent, {with_outcome} with an "
             f"outcome (the release needs {needed}, {share:.0%} of those sent)"]
    if open_:
        parts.append(f"{open_} still in flight or planned")
    if deferred:
        parts.append(f"{deferred} deferred by the contact policy (not waited for)")
    parts.append(f"released by canary_max_wait at {_when(release_by)} at the latest" if not open_ else
                 "canary_max_wait counts from its last send")
    return Hold("", "canary", "; ".join(parts), None, {
        "canary_rows": int(r["canary_rows"] or 0), "canary_sent": sent, "canary_with_outcome": with_outcome,
        "canary_outcomes_needed": needed, "canary_open": open_, "canary_deferred": deferred,
        "canary_release_by": release_by.isoformat() if release_by else None})


def _hold_of(r: Mapping[str, Any]) -> Hold | None:
    status = str(r["status"])
    if status == "paused" and r["paused_by"] != _GUARD:
        who = r["paused_by"] or "an operator"
        return Hold("", "paused", f"paused by {who} at {_when(r['paused_at'])}: {r['paused_reason'] or 'no reason given'}"
                                  f"; mailflow campaign resume {r['name']} sends it again (overdue rows re-planned "
                                  f"from then)", r["paused_at"], {"paused_by": r["paused_by"]})
    if r["account"] is not None:
        return _guard("guard_account", "account", str(r["account"]), r["account_reason"], r["account_tripped_at"],
                      status)
    if r["campaign_reason"] is not None:
        return _guard("guard_campaign", "campaign", str(r["name"]), r["campaign_reason"], r["campaign_tripped_at"],
                      status)
    if status == "paused":  # the guard paused it and its scope is ok again, but it was not unpaused yet
        return Hold("", "paused", f"paused by the reputation guard at {_when(r['paused_at'])}: "
                                  f"{r['paused_reason'] or '-'}; mailflow campaign resume {r['name']} sends it again",
                    r["paused_at"], {"paused_by": _GUARD})
    if r["waiting_name"] is not None:
        scope, name = str(r["waiting_scope"]), str(r["waiting_name"])
        return Hold("", "guard_waiting", f"reputation guard: {scope} {name} is not proven yet and its round of "
                                         f"{r['waiting_round_sent']} emails awaits their outcomes (exposure E, since "
                                         f"{_when(r['waiting_since'])}); sending goes on as they arrive",
                    r["waiting_since"], {"scope": scope, "name": name, "round_sent": r["waiting_round_sent"]})
    if r["canary_share"] is not None:
        return _canary(r)
    return None


def campaign_holds(conn: psycopg.Connection, name: str | None = None) -> dict[str, Hold]:
    """The held campaigns among the scheduled and paused ones (only ``name`` if given): name -> its
    :class:`Hold`. A campaign that sends as planned is absent. One statement (``campaign_holds``), in
    the caller's transaction (JIT off for the rest of it) or autocommit; read-only."""
    if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
        conn.execute(query("scheduled", "no_jit"))  # (a read-only page sets jit off for its session)
    with conn.cursor(row_factory=dict_row) as cur:
        rows = cur.execute(query("scheduled", "campaign_holds"), {"name": name}).fetchall()
    out: dict[str, Hold] = {}
    for r in rows:
        hold = _hold_of(r)
        if hold is not None:
            out[str(r["name"])] = Hold(str(r["name"]), hold.kind, hold.reason, hold.since, hold.detail)
    return out


def hold_states(conn: psycopg.Connection) -> dict[str, dict[str, Any] | None]:
    """Every scheduled or paused campaign: name -> its hold as a dict (:meth:`Hold.as_dict`), or None
    when it sends as planned (the metrics set each campaign's gauges from this). Two statements."""
    held = campaign_holds(conn)
    names = [str(r[0]) for r in conn.execute(query("scheduled", "campaigns_sending")).fetchall()]
    return {n: (held[n].as_dict() if n in held else None) for n in names}
