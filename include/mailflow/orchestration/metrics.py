"""Operators' metrics through Airflow's ``Stats``: StatsD, Datadog or OpenTelemetry, whichever the
deployment configured in ``[metrics]`` (nothing at all when metrics are off). Names (after
Airflow's ``statsd_prefix``, default ``airflow``), all counters unless said otherwise:

* ``mailflow.campaign.<campaign>.<outcome>``: emails per campaign and outcome, ``outcome`` one of
  ``sent``, ``failed``, ``sending`` (claimed and not answered: ambiguous until a 2xx to its key),
  ``held`` (lifecycle; the columns of :mod:`mailflow.model.tally`) and ``dead_lettered`` (reconcile);
* ``mailflow.provider.<kind>``: provider requests, with ``kind`` one of ``requests``, ``429``,
  ``5xx``, ``timeouts``, ``late_slots`` (the pacer's slot came late);
* ``mailflow.provider.pacing_wait``: a timing (ms), one per run that made requests: how long the
  run's client slept for its request slots of the shared schedule (the pacer's spacing and every
  429's push-back; ``ResendClient.stats["pacing_wait_ms"]``);
* ``mailflow.breaker.<account>.open``: a gauge, 1 when the circuit breaker of the provider account
  (its API host, e.g. ``api_resend_com``) was open at the end of a run, 0 when closed; set by every
  send, dispatch and reconcile run, so it is as fresh as the last run;
* ``mailflow.dispatch.lateness``: a timing (ms): how long after its scheduled minute a dispatch
  run started;
* ``mailflow.campaign.<campaign>.hold.<kind>``: gauges, 1 while the scheduled campaign is held for that
  reason, 0 otherwise, ``kind`` one of ``paused``, ``guard_account``, ``guard_campaign``, ``guard_waiting``, ``canary``
  (:mod:`mailflow.sources.scheduled.holds`); ``mailflow.campaigns.held.<kind>``: gauges, how many
  campaigns are held for it. Set by every dispatch run for every scheduled or paused campaign, so a
  campaign that only shows ``scheduled`` still says why it does not send;
* ``mailflow.webhook.<event_type>.<decision>``: webhook events the receiver acknowledged (in the
  API server), ``event_type`` with ``.`` as ``_`` (``email_bounced``), ``decision`` one of
  ``applied``, ``failed``, ``recipient_mismatch``, ``ignored``, ``pending`` (its email not in the
  send log yet), ``duplicate`` (a svix-id stored before); ``mailflow.webhook.refused.<status>``:
  requests answered 4xx/5xx (400, 401, 408, 413, 503), nothing stored.

Every call carries the tag ``dag_id`` (StatsD without tags ignores it), the breaker gauge also
``account``. Campaign names are already
safe (``[a-z0-9_]``); a name Airflow's validator would refuse is normalised by Airflow. Emitting
never fails a task: a metrics backend's error is logged and dropped.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

log = logging.getLogger("mailflow.metrics")

PROVIDER_KINDS = ("requests", "429", "5xx", "timeouts", "late_slots")
CAMPAIGN_OUTCOMES = ("sent", "failed", "sending", "held")


def _stats() -> Any:
    from airflow.sdk.observability.stats import Stats

    return Stats


def _api_server_stats() -> Any:
    # The API server initialises Airflow core's own Stats (from ``[metrics]``, at its start), not
    # the task SDK's, which stays a no-op there; a process without that module (a standalone
    # receiver without Airflow core) gets the SDK's.
    try:
        from airflow._shared.observability.metrics import stats
    except ImportError:
        return _stats()
    return stats


def _segment(text: str) -> str:
    """``text`` as one segment of a metric name: every character outside ``[A-Za-z0-9_-]`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", text) or "_"


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


def pacing_wait(stats: Mapping[str, int], dag_id: str) -> None:
    """Time one run's waits for request slots (``ResendClient.stats["pacing_wait_ms"]``); nothing for
    a run that made no request."""
    if not stats.get("requests"):
        return
    try:
        _stats().timing("mailflow.provider.pacing_wait", timedelta(milliseconds=int(stats.get("pacing_wait_ms", 0))),
                        tags={"dag_id": dag_id})
    except Exception as exc:
        log.warning("metric mailflow.provider.pacing_wait not emitted: %s", exc)


def breaker_state(account: str, is_open: bool, dag_id: str) -> None:
    """Set the gauge ``mailflow.breaker.<account>.open`` to 1 (open) or 0 (closed) as a run saw it."""
    name = f"mailflow.breaker.{_segment(account)}.open"
    try:
        _stats().gauge(name, 1 if is_open else 0, tags={"dag_id": dag_id, "account": account})
    except Exception as exc:
        log.warning("metric %s not emitted: %s", name, exc)


def webhook_event(kind: str, outcome: str) -> None:
    """Count one webhook request the receiver answered: ``kind`` the event type (``email.bounced``)
    and ``outcome`` its decision, or ``kind="refused"`` and the HTTP status. Emitted through the API
    server's Stats; never raises (the receiver's answer must not depend on a metric)."""
    name = f"mailflow.webhook.{_segment(kind)}.{_segment(outcome)}"
    try:
        _api_server_stats().incr(name, 1)
    except Exception as exc:
        log.warning("metric %s not emitted: %s", name, exc)


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


HOLD_KINDS = ("paused", "guard_account", "guard_campaign", "guard_waiting", "canary")  # mailflow.sources.scheduled.holds


def campaign_holds(held: Mapping[str, Mapping[str, Any] | None], dag_id: str) -> None:
    """Set the hold gauges from a dispatch run's ``held`` (every scheduled or paused campaign: name ->
    its hold with a ``kind``, or None when it sends as planned)."""
    totals = dict.fromkeys(HOLD_KINDS, 0)
    for campaign, hold in held.items():
        kind = hold.get("kind") if hold else None
        if kind in totals:
            totals[str(kind)] += 1
        for k in HOLD_KINDS:
            _gauge(f"mailflow.campaign.{_segment(campaign)}.hold.{k}", 1 if k == kind else 0, dag_id)
    for k, n in totals.items():
        _gauge(f"mailflow.campaigns.held.{k}", n, dag_id)


def _gauge(name: str, value: int, dag_id: str) -> None:
    try:
        _stats().gauge(name, value, tags={"dag_id": dag_id})
    except Exception as exc:  # a metric is never worth a failed run
        log.warning("metric %s not emitted: %s", name, exc)


def dispatch_lateness(scheduled: datetime | None, started: datetime, dag_id: str) -> None:
    """Time from a dispatch run's scheduled minute (its data interval's end, aware) to its start."""
    if scheduled is None:
        return
    try:
        _stats().timing("mailflow.dispatch.lateness", max(started - scheduled, timedelta(0)),
                        tags={"dag_id": dag_id})
    except Exception as exc:
        log.warning("metric mailflow.dispatch.lateness not emitted: %s", exc)
