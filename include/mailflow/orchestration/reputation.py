"""Airflow glue of the reputation guard: the alert for new trips (called by the deliverability feedback
task) and the ``resume_sending`` DAG's task. The guard itself is :mod:`mailflow.store.reputation`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg

from mailflow.orchestration.alerts import notifier
from mailflow.sources.scheduled.control import resume_reputation
from mailflow.store import reputation

log = logging.getLogger(__name__)


def reputation_alerts(conn: psycopg.Connection, context: Any = None) -> list[str]:
    """Alert once for every scope the guard tripped that was not alerted yet; return the lines.

    One alert (the configured notifier, :func:`mailflow.orchestration.alerts.notifier`) names each
    trip's scope, rates, sample and how to resume. The trips are locked (``FOR UPDATE SKIP LOCKED``)
    while the alert is sent and ``alerted_at`` is set in the same transaction after it was sent: an
    alert that raises leaves them unalerted for the next call, and two callers never alert the same
    trip twice. ``context``: the task context the notifier gets (None outside a task).
    """
    with conn.transaction():
        trips = reputation.unalerted_trips(conn)
        if not trips:
            return []
        lines = [reputation.alert_line(t) for t in trips]
        header = (f"reputation guard: {len(trips)} scope(s) tripped; their sending is stopped until a person "
                  "resumes it (docs/operations.md, 'Reputation guard'):")
        notifier("\n".join([header] + [f"  {line}" for line in lines]),
                 subject=f"mailflow: reputation guard tripped ({len(trips)})")(context or {})
        reputation.mark_alerted(conn, [(t["scope"], t["name"]) for t in trips])
    return lines


def triggering_user(context: Mapping[str, Any]) -> str | None:
    """The user who triggered the run (Airflow's ``dag_run.triggering_user_name``), or None."""
    dag_run = context.get("dag_run")
    user = getattr(dag_run, "triggering_user_name", None)
    return str(user) if user else None


def resume_task(context: Mapping[str, Any], conn: psycopg.Connection) -> dict[str, Any]:
    """The ``resume_sending`` DAG's task: Params ``scope`` (campaign / account), ``name``, ``reason``
    (required). The actor is the run's triggering user, else ``<dag_id>/<run_id>``. Returns
    :func:`mailflow.sources.scheduled.control.resume_reputation`'s dict.

    :raises ValueError: for an empty reason or name (the Params forbid them too).
    :raises LookupError: if the guard never evaluated that scope.
    """
    params = context["params"]
    name = str(params.get("name") or "").strip()
    if not name:
        raise ValueError("name the campaign or the account to resume")
    ti = context.get("ti")
    actor = triggering_user(context) or f"{getattr(ti, 'dag_id', 'resume_sending')}/{getattr(ti, 'run_id', '?')}"
    out = resume_reputation(conn, str(params["scope"]), name, actor=actor, reason=str(params.get("reason") or ""))
    log.warning("reputation guard: %s", out)
    return out
