"""Operators' metrics through Airflow's ``Stats``: StatsD, Datadog or OpenTelemetry, whichever the
deployment configured in ``[metrics]`` (nothing at all when metrics are off). Names (after
Airflow's ``statsd_prefix``, default ``airflow``), all counters unless said otherwise:

* ``mailflow.campaign.<campaign>.<outcome>``: emails per campaign and outcome, ``outcome`` one of
  ``sent``, ``failed``, ``unknown``, ``held`` (lifecycle) and ``dead_lettered`` (reconcile);
* ``mailflow.provider.<kind>``: provider requests, with ``kind`` one of ``requests``, ``429``,
  ``5xx``, ``timeouts``, ``late_slots`` (the pacer's slot came late);
* ``mailflow.dispatch.lateness``: a timing (ms): how long after its scheduled minute a dispatch
  run started.

Every call carries the tag ``dag_id`` (StatsD without tags ignores it). Campaign names are already
safe (``[a-z0-9_]``); a name Airflow's validator would refuse is normalised by Airflow. Emitting
never fails a task: a metrics backend's error is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

log = logging.getLogger("mailflow.metrics")

PROVIDER_KINDS = ("requests", "429", "5xx", "timeouts", "late_slots")
CAMPAIGN_OUTCOMES = ("sent", "failed", "unknown", "held")


def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


def _incr(name: str, count: int, dag_id: str) -> None:
    if count:
        try:
            _stats().incr(name, count, tags={"dag_id": dag_id})
        except Exception as exc:  # a metric is never worth a failed send
            log.warning("metric %s not emitted: %s", name, exc)


def provider_requests(stats: Mapping[str, int], dag_id: str) -> None:
    """Count one run's provider requests (``ResendClient.stats``)."""
    for kind in PROVIDER_KINDS:
        _incr(f"mailflow.provider.{kind}", int(stats.get(kind, 0)), dag_id)


def campaign_outcomes(summaries: Iterable[Mapping[str, Any]], dag_id: str) -> None:
    """Count emails per campaign and outcome from lifecycle summaries (``CampaignSummary.as_dict``)."""
    for s in summaries:
        for outcome in CAMPAIGN_OUTCOMES:
            _incr(f"mailflow.campaign.{s['campaign']}.{outcome}", int(s.get(outcome, 0)), dag_id)


def dispatch_outcomes(summary: Mapping[str, Any], dag_id: str) -> None:
    """Count a dispatch run's emails: sent per campaign, and its failed/unknown totals."""
    for campaign, sent in (summary.get("sent_by_campaign") or {}).items():
        _incr(f"mailflow.campaign.{campaign}.sent", int(sent), dag_id)
    for outcome in ("failed", "unknown"):
        _incr(f"mailflow.dispatch.{outcome}", int(summary.get(outcome, 0)), dag_id)


def dead_letters(rows: Iterable[Mapping[str, Any]], dag_id: str) -> None:
    """Count dead letters per campaign (the reconciler's ``dead_letters`` rows)."""
    per: dict[str, int] = {}
    for row in rows:
        per[str(row["campaign"])] = per.get(str(row["campaign"]), 0) + 1
    for campaign, n in per.items():
        _incr(f"mailflow.campaign.{campaign}.dead_lettered", n, dag_id)


def dispatch_lateness(scheduled: datetime | None, started: datetime, dag_id: str) -> None:
    """Time from a dispatch run's scheduled minute (its data interval's end, aware) to its start."""
    if scheduled is None:
        return
    try:
        _stats().timing("mailflow.dispatch.lateness", max(started - scheduled, timedelta(0)),
                        tags={"dag_id": dag_id})
    except Exception as exc:
        log.warning("metric mailflow.dispatch.lateness not emitted: %s", exc)
