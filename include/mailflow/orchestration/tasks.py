"""Task callables for the DAGs: build the store, provider and renderer from Airflow connections
and call the engine. DAG files import this lazily, inside tasks, so parsing stays fast."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import psycopg

from mailflow import settings
from mailflow.feedback.unsubscribe_tokens import UnsubscribeSigner, signer_from_secret
from mailflow.masking import mask_connection
from mailflow.model.outcome import DataInterval, RunContext
from mailflow.orchestration import metrics
from mailflow.orchestration.run_conf import check_run_conf

if TYPE_CHECKING:
    from mailflow.campaigns import CampaignFolder
    from mailflow.feedback.deliverability import FeedbackSummary
    from mailflow.provider.client import ResendClient
    from mailflow.sendloop.render import Renderer

log = logging.getLogger(__name__)


def unsubscribe_signer() -> UnsubscribeSigner:
    """Signer from the ``mail_unsubscribe`` connection: password = current secret, extra
    ``{"kid": "k2", "old_keys": {"k1": "..."}}`` for rotation.

    :raises ValueError: if the connection is missing or has no password.
    """
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(settings.UNSUBSCRIBE_CONN_ID)
    except Exception as exc:
        raise ValueError(f"connection {settings.UNSUBSCRIBE_CONN_ID!r} (unsubscribe signing secret) "
                         f"is not defined: {exc}") from None
    mask_connection(conn)  # the secret and extra.old_keys (which still verify tokens) never reach a log
    if not conn.password:
        raise ValueError(f"connection {settings.UNSUBSCRIBE_CONN_ID!r} has no password (the signing secret)")
    extra = conn.extra_dejson or {}
    return signer_from_secret(conn.password, kid=extra.get("kid", "k1"), old=extra.get("old_keys"))


def campaign_folder(context: Mapping[str, Any] | None) -> CampaignFolder:
    """The campaigns folder of a task: resolved against the folder of the task's DAG file (the DAG
    bundle as this worker sees it, at the version the run uses), so campaign files deploy with the
    DAGs; see :meth:`mailflow.campaigns.CampaignFolder.resolve`. Read anew by every run.

    :raises mailflow.campaigns.CampaignFileError: if ``MAILFLOW_CAMPAIGNS_DIR`` names a missing folder.
    """
    from pathlib import Path

    from mailflow.campaigns import CampaignFolder

    fileloc = getattr((context or {}).get("dag"), "fileloc", None)
    folder = CampaignFolder.resolve(Path(fileloc).parent if fileloc else None)
    log.info("campaigns folder: %s (%s)", folder.root, folder.origin)
    return folder


def renderer_for(folder: CampaignFolder) -> Renderer:
    """The run's renderer: the ``mail_unsubscribe`` signer, the public and app URLs, and the
    templates of ``folder``."""
    from mailflow.sendloop.render import Renderer, template_env

    return Renderer(unsubscribe_signer(), settings.unsubscribe_base_url(), settings.app_url(),
                    env=template_env(folder.templates_dir))


def campaigns_param(params: Any, folder: CampaignFolder | None = None) -> list[Any]:
    """The lifecycle campaigns a run asked for (Param ``campaigns``: a list of declared names;
    empty or missing = all), loaded and validated.

    A mistake in the Param (a name not in ``lifecycle.toml``, a value that is not a list of strings)
    fails the task at once with :class:`airflow.sdk.exceptions.AirflowFailException`, i.e. without
    retries: running the same Params again cannot succeed. The trigger form already refuses
    undeclared names (the Param's enum); this covers runs created around it (API, CLI, a
    ``lifecycle.toml`` changed since the run was triggered). Campaign files are read from
    ``folder`` (default: resolved); a bad file fails the task the same way, naming file and field.
    """
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.campaigns import load_campaigns

    raw = params.get("campaigns") if params is not None else None
    if raw is None or raw == []:
        only = None
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        only = list(raw)
    else:
        raise AirflowFailException(f"Param campaigns must be a list of campaign names, got {raw!r}")
    try:
        return load_campaigns(only=only, folder=folder)
    except ValueError as exc:
        raise AirflowFailException(f"Param campaigns: {exc}") from None


def budget_fits(context: Any, budget_seconds: float, conn_id: str | None = None) -> float:
    """Return ``budget_seconds`` after checking, before anything is sent, that it fits the task's
    ``execution_timeout`` with the longest chunk of the provider connection ``conn_id`` (its
    timeouts; default ``resend_default``); see :mod:`mailflow.orchestration.budgets`.

    :raises airflow.sdk.exceptions.AirflowFailException: naming both numbers (not retried).
    """
    from mailflow.orchestration.budgets import check_budget

    task = context.get("task") if hasattr(context, "get") else None
    if getattr(task, "execution_timeout", None) is None:
        return budget_seconds
    from mailflow.provider.hook import ResendHook

    s = ResendHook(conn_id or settings.RESEND_CONN_ID).settings()
    check_budget(budget_seconds, context, timeout=s["timeout_seconds"], connect_timeout=s["connect_timeout_seconds"])
    return budget_seconds


def send_log_connection() -> Any:
    """A psycopg 3 connection to the send log through the Postgres provider's hook."""
    from airflow.providers.postgres.hooks.postgres import PostgresHook

    hook = PostgresHook(postgres_conn_id=settings.SEND_LOG_CONN_ID)
    mask_connection(hook.get_connection(settings.SEND_LOG_CONN_ID))
    return hook.get_conn()


NO_DATA_INTERVAL = (
    "this run has no data interval: it was triggered without a logical date (Airflow 3 gives such a run none). "
    "Trigger it with a logical date in the UI or the REST API: the run covers the last complete hour before its "
    "logical date (10:20 or 10:00 -> [09:00, 10:00)), or give data_interval_start/data_interval_end in the REST API; "
    "for a past hour a backfill is clearer (a backfill's and a scheduled run's logical date is the interval's START). "
    "docs/operations.md, 'Data intervals'")
"""Why the lifecycle task refuses a run without a data interval, and how to trigger one (Airflow 3.3.2:
``CronDataIntervalTimetable.infer_manual_data_interval``; the table in docs/operations.md)."""


def lifecycle(context: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the lifecycle campaigns for the task's data interval; return per-campaign summaries.

    Params used: ``time_budget_seconds`` (s), ``chunk_size`` (emails, 1-100), ``campaigns`` (subset
    of names; empty = all), ``dry_run`` (audience counts and a rendered sample, nothing minted),
    ``allow_old_interval`` (a backfill of an interval older than a campaign's max_interval_age sends).
    """
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.model.outcome import SendError
    from mailflow.provider.hook import ResendHook
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.migrate import require_current
    from mailflow.store.scheduled import check_name_collisions
    from mailflow.store.send_log import PostgresStore

    params = context["params"]
    if context.get("data_interval_start") is None or context.get("data_interval_end") is None:
        raise AirflowFailException(NO_DATA_INTERVAL)
    interval = DataInterval(context["data_interval_start"], context["data_interval_end"])
    run = run_context(context)
    folder = campaign_folder(context)
    campaigns = campaigns_param(params, folder)
    renderer = renderer_for(folder)
    log.info("data interval [%s, %s): campaigns %s", interval.start, interval.end, [c.name for c in campaigns])
    budget = float(params.get("time_budget_seconds", 240))
    if not params.get("dry_run"):
        budget_fits(context, budget)
    with send_log_connection() as conn:
        conn.autocommit = True  # every unit of work below is an explicit, committed transaction
        require_current(conn)
        try:
            check_name_collisions(conn, [c.name for c in campaigns])
        except ValueError as exc:
            raise AirflowFailException(str(exc)) from None  # a definition to fix: a retry would fail the same way
        store = PostgresStore(conn)
        if params.get("dry_run"):
            return store.preview(campaigns, interval, renderer, sample=3)
        hook = ResendHook(settings.RESEND_CONN_ID)
        client = hook.get_conn()
        pipelined = settings.pipelined()
        # pipelined: the sender thread applies each answer on a second connection of its own
        apply_conn = send_log_connection() if pipelined else None
        try:
            if apply_conn is not None:
                apply_conn.autocommit = True
            summaries = run_lifecycle(store, client, renderer, campaigns, interval, run=run,
                                      budget_seconds=budget,
                                      chunk_size=int(params.get("chunk_size", 100)),
                                      now=conn.execute("select now()").fetchone()[0],
                                      allow_old_interval=bool(params.get("allow_old_interval", False)),
                                      pipelined=pipelined,
                                      apply_store=store.companion(apply_conn) if apply_conn is not None else None)
        except SendError as exc:
            for s in exc.summaries:
                log.error("summary: %s", s.as_dict())
            metrics.campaign_outcomes([s.as_dict() for s in exc.summaries], _dag_id(context))
            raise
        finally:
            client.close()
            if apply_conn is not None:
                apply_conn.close()
            log.info("provider requests: %s", client.stats)
            metrics.provider_requests(client.stats, _dag_id(context))
            _provider_signals(conn, client, context)
    out = [s.as_dict() for s in summaries]
    metrics.campaign_outcomes(out, _dag_id(context))
    return out


def reconcile_send_log(context: dict[str, Any]) -> dict[str, Any]:
    """Repair stale claims, resend within the idempotency window, dead-letter and alert.

    Params: ``stale_after_seconds`` (default MAILFLOW_STALE_AFTER_SECONDS or 900),
    ``time_budget_seconds``. (Whole-request failures never charge users, so there is no attempts cap.)
    """
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done

    from mailflow.orchestration.alerts import dead_letter_alert, held_batch_alert, key_refused_alert
    from mailflow.provider.hook import ResendHook
    from mailflow.reconciler import reconcile
    from mailflow.store import counters, lift
    from mailflow.store.migrate import require_current

    params = context["params"]
    run = run_context(context)
    stale = float(params.get("stale_after_seconds") or settings.stale_after_seconds())
    budget = budget_fits(context, float(params.get("time_budget_seconds", 600)))
    with send_log_connection() as conn:
        conn.autocommit = True  # every unit of work below is an explicit, committed transaction
        require_current(conn)
        now = conn.execute("select now()").fetchone()[0]
        hook = ResendHook(settings.RESEND_CONN_ID)
        client = hook.get_conn()
        try:
            # previous_api_keys: ambiguous batches are resent under the key they were first sent with
            summary = reconcile(conn, client, now=now, stale_after=timedelta(seconds=stale),
                                run=run, deadline=time.monotonic() + budget, previous=hook.previous_clients())
            _provider_signals(conn, client, context)
            # the progress page's counters: keeps their table of unfolded changes short (the first run
            # after migration 0028 seeds them with one full count of the send log)
            folded = counters.fold(conn)
            # the lift's closed conversion windows, where its fold is installed (it reads the product's
            # schema; docs/send_log.md Q15): the first run after installing reads every holdout campaign once.
            # An analytics rollup: its failure is logged, never the reconcile run's (the lift query still
            # answers, reading the rows the fold has not counted)
            try:
                lifted = lift.fold(conn)
            except psycopg.Error as exc:
                log.warning("the lift's fold failed (mail.fold_campaign_lift): %s", exc)
                lifted = None
        finally:
            hook.close()
    log.info("reconcile: %s; campaign counters: %s; lift: %s", summary.as_dict(),
             "another fold was running" if folded is None else f"{folded} changes folded",
             "not folded (not installed, or another fold was running)" if lifted is None
             else f"{lifted} rollup rows written")
    if summary.circuit == "open":
        log.warning("the provider's circuit breaker is open: its probe was not answered; senders mint and claim "
                    "nothing new (docs/operations.md, 'Circuit breaker')")
    dead_letter_alert(summary.dead_letters, context)
    metrics.dead_letters(summary.dead_letters, _dag_id(context))
    held_batch_alert(summary.held, context)
    key_refused_alert(summary.key_refused, context)
    return summary.as_dict()


def _provider_signals(conn: psycopg.Connection, client: Any, context: Mapping[str, Any]) -> None:
    """Emit a run's pacing wait and the circuit breaker's state as the run leaves it (metrics). The
    breaker is read on the run's own connection; a connection the run left unusable (its error is
    being raised) only loses the gauge, logged."""
    from mailflow.provider.breaker import CircuitBreaker, breaker_account

    metrics.pacing_wait(client.stats, _dag_id(context))
    account = breaker_account(client)
    try:
        is_open = CircuitBreaker(conn, account, holder="metrics").state().open
    except Exception as exc:  # a metric is never worth a changed outcome
        log.warning("circuit breaker state not read for its metric: %s", exc)
        return
    metrics.breaker_state(account, is_open, _dag_id(context))


def _dag_id(context: Mapping[str, Any]) -> str:
    ti = context.get("ti") or context.get("task_instance")
    return str(getattr(ti, "dag_id", None) or getattr(context.get("dag"), "dag_id", None) or "unknown")


def run_context(context: Mapping[str, Any]) -> RunContext:
    """The task's ``(dag_id, run_id, task_id)``, recorded on the rows and events it writes."""
    ti = context["ti"]
    return RunContext(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id)


def dispatch_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """The ``dispatch_scheduled_emails`` DAG's task: Params ``time_budget_seconds``,
    ``coalesce_seconds``. Builds the renderer and the paced Resend client from the connections and
    calls :func:`dispatch`. Returns the :class:`DispatchSummary` as a dict."""
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done
    from mailflow.provider.hook import ResendHook
    from mailflow.sources.scheduled.dispatcher import COALESCE_SECONDS, DISPATCH_BUDGET_SECONDS, dispatch
    from mailflow.store.migrate import require_current

    params = context["params"]
    metrics.dispatch_lateness(context.get("data_interval_end"), datetime.now(UTC), _dag_id(context))
    budget = budget_fits(context, float(params.get("time_budget_seconds", DISPATCH_BUDGET_SECONDS)))
    folder = campaign_folder(context)
    renderer = renderer_for(folder)
    with send_log_connection() as conn:
        require_current(conn)
        client = ResendHook(settings.RESEND_CONN_ID).get_conn()
        try:
            summary = dispatch(conn, client, renderer, run=run_context(context),
                               budget_seconds=budget,
                               coalesce_seconds=float(params.get("coalesce_seconds", COALESCE_SECONDS)),
                               pipelined=settings.pipelined(), folder=folder)
        finally:
            client.close()
            log.info("provider requests: %s", client.stats)
            metrics.provider_requests(client.stats, _dag_id(context))
            _provider_signals(conn, client, context)
    out = summary.as_dict()
    metrics.dispatch_outcomes(out, _dag_id(context))
    metrics.campaign_holds(out["held"], _dag_id(context))
    return out


def _poll_or_fail(conn: psycopg.Connection, client: ResendClient, **kw: Any) -> FeedbackSummary:
    """:func:`poll_feedback`, with a refused key turned into a failure without retries (the same key
    is refused again: a person must change the connection)."""
    from mailflow.feedback.deliverability import FeedbackError, poll_feedback

    try:
        return poll_feedback(conn, client, **kw)
    except FeedbackError as exc:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(str(exc)) from None


POLL_INTERVAL_SECONDS = 1800.0
"""Seconds between two safety-net polls when the run has no data interval to say (the DAG runs every 30 min)."""


def feedback_task(context: dict[str, Any]) -> dict[str, Any]:
    """The ``deliverability_feedback`` DAG's safety-net poll: Params ``lookback_hours``,
    ``min_age_minutes``, ``recheck_after_minutes``, ``max_checks_per_email``, ``max_emails_per_run``,
    ``time_budget_seconds`` and ``rate_share`` (the share of the account's rate limit a run may spend:
    requests per run at most ``rate_share * requests_per_second * seconds between runs``, the seconds
    being the run's data interval). Connections ``send_log_db`` and ``settings.FEEDBACK_CONN_ID``.
    Returns the :class:`FeedbackSummary` as a dict.

    :raises airflow.sdk.exceptions.AirflowFailException: if the provider refuses the API key (not
        retried; a sending-only key: use a full-access key, ``MAILFLOW_FEEDBACK_CONN_ID`` may name
        its own connection).
    """
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done
    from mailflow.feedback.deliverability import request_budget
    from mailflow.provider.hook import ResendHook
    from mailflow.store.migrate import require_current

    params = context["params"]
    ti = context.get("ti")
    budget = budget_fits(context, float(params.get("time_budget_seconds", 600)), settings.FEEDBACK_CONN_ID)
    start, end = context.get("data_interval_start"), context.get("data_interval_end")
    interval = (end - start).total_seconds() if start is not None and end is not None and end > start \
        else POLL_INTERVAL_SECONDS
    started = time.monotonic()
    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        hook = ResendHook(settings.FEEDBACK_CONN_ID)
        max_requests = request_budget(float(hook.settings()["requests_per_second"]),
                                      float(params.get("rate_share", 0.01)), interval)
        client = hook.get_conn()
        try:
            summary = _poll_or_fail(
                conn, client,
                lookback=timedelta(hours=float(params.get("lookback_hours", 48))),
                min_age=timedelta(minutes=float(params.get("min_age_minutes", 60))),
                recheck_after=timedelta(minutes=float(params.get("recheck_after_minutes", 120))),
                max_checks=int(params.get("max_checks_per_email", 4)),
                limit=int(params.get("max_emails_per_run", 500)),
                budget_seconds=budget,
                max_requests=max_requests,
                run=RunContext(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id) if ti is not None else None,
            )
        finally:
            client.close()
            log.info("provider requests: %s (%.1f s)", client.stats, time.monotonic() - started)
            metrics.provider_requests(client.stats, _dag_id(context))
    if summary.alerts:
        from mailflow.orchestration.alerts import feedback_alert

        feedback_alert(summary.alerts, context)
    return summary.as_dict()


def webhook_sweep_task(context: dict[str, Any]) -> dict[str, Any]:
    """The ``deliverability_feedback`` DAG's sweep: apply webhook events still waiting for their email
    (:func:`mailflow.orchestration.webhooks.sweep_task`; Params ``sweep_limit``, ``give_up_hours``)."""
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done
    from mailflow.orchestration.webhooks import sweep_task
    from mailflow.store.migrate import require_current

    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        return sweep_task(conn, context["params"])


def webhook_alert_task(context: dict[str, Any]) -> dict[str, Any]:
    """The ``deliverability_feedback`` DAG's alerts: new webhook mismatches, failures and unknown emails,
    and the reputation guard's new trips (:func:`mailflow.orchestration.reputation.reputation_alerts`:
    one alert naming each tripped scope's rates and sample). Returns the counts and the trip lines."""
    check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done
    from mailflow.orchestration.reputation import reputation_alerts
    from mailflow.orchestration.webhooks import alert_task

    with send_log_connection() as conn:
        conn.autocommit = True
        out = dict(alert_task(conn, context))
        out["reputation_trips"] = reputation_alerts(conn, context)
        return out
