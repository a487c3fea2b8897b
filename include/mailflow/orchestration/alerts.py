"""Alerts through Airflow notifiers: task failures and dead letters.

Which notifier is chosen by ``MAILFLOW_ALERT`` (an environment setting, never a secret):

* ``log`` (default): :class:`LogNotifier`, an ERROR line in the task log;
* ``smtp:<conn_id>:<to>``: the SMTP provider's ``SmtpNotifier`` through that connection;
* ``slack:<conn_id>:<channel>``: the Slack provider's ``SlackNotifier``; the provider is an optional
  extra (``pip install 'mailflow[slack]'``, i.e. ``apache-airflow-providers-slack``).

The setting is checked when a DAG file builds its ``default_args`` (:func:`alert_setting`): a
malformed value or a notifier whose provider is not installed is a DAG import error naming both,
seen in the UI before any task runs. Should the check pass where the DAGs are parsed but the
notifier still cannot be built where a callback runs (another image, another worker), the alert
is written to the task log at ERROR level with the reason: an alert is never lost to an
ImportError inside a callback.

Messages carry counts, campaign names and masked addresses only.
"""

from __future__ import annotations

import importlib
import logging
import os
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseNotifier

log = logging.getLogger("mailflow.alerts")


class LogNotifier(BaseNotifier):
    """Write the (templated) message to the task log at ERROR level."""

    template_fields = ("message",)

    def __init__(self, message: str, **kwargs: Any):
        super().__init__(**kwargs)
        self.message = message

    def notify(self, context: Any) -> None:
        log.error("ALERT: %s", self.message)


class AlertSettingError(ValueError):
    """``MAILFLOW_ALERT`` is malformed, or names a notifier whose provider is not installed."""


# kind -> (module, class, what to install); the SMTP provider ships with apache-airflow
_NOTIFIERS = {
    "smtp": ("airflow.providers.smtp.notifications.smtp", "SmtpNotifier", "apache-airflow-providers-smtp"),
    "slack": ("airflow.providers.slack.notifications.slack", "SlackNotifier",
              "apache-airflow-providers-slack (pip install 'mailflow[slack]')"),
}


def alert_setting(spec: str | None = None) -> tuple[str, str, str, Any]:
    """Parse and check ``spec`` (default: ``MAILFLOW_ALERT``, else ``log``).

    :returns: ``(kind, conn_id, target, notifier class)`` (a ``BaseNotifier`` subclass); ``("log", "", "", None)`` for ``log``.
    :raises AlertSettingError: naming the value: not one of the three forms, or the notifier's
        provider package cannot be imported here (naming the package to install).
    """
    spec = (os.environ.get("MAILFLOW_ALERT", "log") if spec is None else spec).strip() or "log"
    kind, _, rest = spec.partition(":")
    if kind == "log" and not rest:
        return "log", "", "", None
    conn_id, _, target = rest.partition(":")
    if kind not in _NOTIFIERS or not conn_id or not target:
        raise AlertSettingError(f"MAILFLOW_ALERT={spec!r}: expected log, smtp:<conn_id>:<to> or "
                                "slack:<conn_id>:<channel>")
    module, name, package = _NOTIFIERS[kind]
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise AlertSettingError(f"MAILFLOW_ALERT={spec!r} needs {package}, which is not installed in this "
                                f"environment ({exc})") from exc
    return kind, conn_id, target, cls


def _verbatim(text: str) -> str:
    """``text`` as a Jinja template that renders to ``text`` itself: every ``{`` becomes the
    expression ``{{ '{' }}``, so a message quoting a template (a campaign's subject
    ``Hi {{ user.first_name }}``) is shown as written instead of failing the notifier's rendering."""
    return text.replace("{", "{{ '{' }}")


def notifier(message: str, subject: str = "mailflow alert") -> BaseNotifier:
    """The configured notifier for ``message`` (see the module docstring). Never raises: when the
    configured notifier cannot be built here, a :class:`LogNotifier` carries the message and says why.
    Notifiers render their fields as templates: the message and subject are passed so that they
    render to themselves (an error quoting ``{{ ... }}`` would otherwise fail the callback and the
    alert would be lost)."""
    message, subject = _verbatim(message), _verbatim(subject)
    try:
        kind, conn_id, target, cls = alert_setting()
        if cls is None:
            return LogNotifier(message)
        if kind == "smtp":
            return cls(to=target, smtp_conn_id=conn_id, subject=subject, html_content=f"<pre>{message}</pre>")
        return cls(slack_conn_id=conn_id, channel=target, text=message)
    except Exception as exc:  # the alert matters more than the channel: keep it in the task log
        log.error("the configured alert channel cannot be used (%s); logging the alert instead", exc)
        return LogNotifier(message)


def default_args(retries: int = 2, retry_delay: timedelta = timedelta(minutes=2)) -> dict[str, Any]:
    """``default_args`` shared by every mailflow DAG: owner, bounded retries, and the failure alert.

    :raises AlertSettingError: when ``MAILFLOW_ALERT`` cannot work here (see :func:`alert_setting`),
        so the DAG file fails to import with that message instead of a callback failing later.
    """
    alert_setting()
    return {"owner": "data-eng", "retries": retries, "retry_delay": retry_delay,
            "on_failure_callback": task_failure_alert}


def task_failure_alert(context: Any) -> None:
    """``on_failure_callback`` for every mailflow task: one alert naming the DAG, run and task."""
    ti = context.get("ti") or context.get("task_instance")
    where = f"{getattr(ti, 'dag_id', '?')}/{getattr(ti, 'run_id', '?')}/{getattr(ti, 'task_id', '?')}"
    notifier(f"task failed: {where}: {context.get('exception')}", subject=f"mailflow task failed: {where}")(context)


def _list_alert(header: str, items: list[str], subject: str, context: Any, shown: int = 50) -> None:
    """One alert: ``header``, then one indented line per item (the first ``shown``, then how many more)."""
    lines = [header] + [f"  {item}" for item in items[:shown]]
    if len(items) > shown:
        lines.append(f"  ... and {len(items) - shown} more")
    notifier("\n".join(lines), subject=subject)(context)


def feedback_alert(lines: list[str], context: Any) -> None:
    """Alert once for the feedback decisions a person must look at (recipient mismatches, provider
    failures); each line names the send-log row, the masked address and the provider id."""
    if not lines:
        return
    _list_alert(f"deliverability feedback: {len(lines)} email(s) need a look (nothing was suppressed for them):",
                lines, f"mailflow: {len(lines)} feedback decision(s) to check", context)


def dead_letter_alert(dead_letters: list[dict[str, Any]], context: Any) -> None:
    """Alert once for the dead letters a reconcile run created (no-op for an empty list)."""
    if not dead_letters:
        return
    _list_alert(f"{len(dead_letters)} email(s) dead-lettered; a person must decide (mail.send_log.dead_lettered_at):",
                [f"send_log.id={d['id']} campaign={d['campaign']} to={d['email']}: {d['error']}" for d in dead_letters],
                f"mailflow: {len(dead_letters)} dead letter(s)", context)


def held_batch_alert(held: list[dict[str, Any]], context: Any) -> None:
    """Alert once for the ambiguous batches a reconcile run held because the API key they were first
    sent with is configured neither as the connection's key nor in ``previous_api_keys`` (no-op for
    an empty list). Each line names the batch, its campaign, rows and key identity (never a key)."""
    if not held:
        return
    rows = sum(int(h["rows"]) for h in held)
    _list_alert(f"{len(held)} ambiguous batch(es), {rows} email(s), held: first sent under an API key that is no "
                "longer configured; resending them under another key could deliver twice. Put the old key in the "
                "connection's previous_api_keys (docs/operations.md, 'Rotating the API key'); past their "
                "idempotency window they become dead letters. `mailflow keys` lists them.",
                [f"batch {h['key']} campaign={h['campaign']} rows={h['rows']} key={h['key_identity']}" for h in held],
                f"mailflow: {len(held)} batch(es) held for a missing API key", context)


def key_refused_alert(refused: list[dict[str, Any]], context: Any) -> None:
    """Alert once for the ambiguous batches whose resend under a previous API key
    (``previous_api_keys``) was refused 401/403 by the provider: they stay ambiguous (only a 2xx
    under that key resolves them), so the key must stay valid until nothing needs it (no-op for an
    empty list). Each line names the batch, its campaign and key identity (never a key)."""
    if not refused:
        return
    _list_alert(f"{len(refused)} ambiguous batch(es) could not be resent: the provider refused the previous API key "
                "they were first sent under. They are kept ambiguous (resending under another key could deliver "
                "twice). Keep (or restore) that key until `mailflow keys` shows nothing needs it (docs/operations.md, "
                "'Rotating the API key'); past their idempotency window they become dead letters.",
                [f"batch {r['key']} campaign={r['campaign']} key={r['key_identity']}" for r in refused],
                f"mailflow: a previous API key was refused ({len(refused)} batch(es))", context)


# -- Deadline Alerts (Airflow 3.1+, experimental there): a run that has not finished in time -----------------

LIFECYCLE_DEADLINE = timedelta(minutes=45)
"""An hourly lifecycle run still unfinished 45 min after it was queued leaves the next hour's run
no room (``max_active_runs=1``): someone should look before the hours pile up."""
DISPATCH_DEADLINE = timedelta(minutes=5)
"""A minutely dispatch run (a 50 s budget) still unfinished 5 min after it was queued means
scheduled emails go out late: the next runs wait behind it."""


def deadline(interval: timedelta, what: str) -> Any:
    """A ``DeadlineAlert`` for a DAG: ``interval`` after the run was queued, :func:`deadline_missed`
    runs in the triggerer with ``what`` (a sentence naming the consequence).

    ``None`` (no deadline) when ``MAILFLOW_DEADLINE_ALERTS`` is ``0``/``false``/``no``/``off``:
    ``airflow dags test`` (``dag.test()``) of Airflow 3.3.2 fails when a run of a DAG with Deadline
    Alerts ends, so the demo and the test suite turn them off; the scheduler handles them."""
    if os.environ.get("MAILFLOW_DEADLINE_ALERTS", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from airflow.sdk.definitions.callback import AsyncCallback
    from airflow.sdk.definitions.deadline import DeadlineAlert, DeadlineReference

    return DeadlineAlert(reference=DeadlineReference.DAGRUN_QUEUED_AT, interval=interval,
                         callback=AsyncCallback(f"{__name__}.deadline_missed", kwargs={"what": what}))


async def deadline_missed(what: str, context: Any = None, **_: Any) -> None:
    """Deadline Alert callback (in the triggerer): one alert through the configured notifier naming
    the DAG and run (from ``context`` when Airflow passes it) and ``what``; never raises."""
    import asyncio

    ctx = context or {}
    dag_run = ctx.get("dag_run")
    where = f"{getattr(dag_run, 'dag_id', None) or ctx.get('dag_id', '?')}/{getattr(dag_run, 'run_id', None) or '?'}"
    message = f"deadline missed: {where}: {what}"
    # notifiers are synchronous (SMTP, Slack's web client): off the triggerer's event loop
    await asyncio.to_thread(lambda: notifier(message, subject=f"mailflow: deadline missed ({where})")(ctx))
