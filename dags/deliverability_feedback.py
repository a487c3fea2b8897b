"""
### deliverability_feedback

Outcomes (delivered, bounced, complained, opened, ...) arrive as signed webhooks at the receiver
(`/mailflow-webhooks/resend` in the API server, or `mailflow webhooks serve`; docs/feedback.md),
which stores and applies them at once: hard bounces and complaints are suppressed within seconds. Every
30 minutes this DAG does what the receiver cannot do alone:

* `apply_pending`: webhook events whose email id was not in the send log yet when they arrived are
  applied now (the receiver also sweeps every few seconds); after `give_up_hours` an event whose email is
  never found is decided `unknown_email`. The reputation guard evaluates the campaigns that got outcomes.
* `alert_webhook_decisions`: one alert for new recipient mismatches (applied to nobody's row; the
  provider's own recipient is suppressed for a hard bounce or complaint), provider failures (`failed`:
  never suppressed) and unknown emails (`mail.webhook_event.alerted_at`); and one alert for each
  campaign or account the reputation guard tripped (its rates and sample; `resume_sending` resumes it).
* `poll_feedback`, the **safety net**: `GET /emails/{id}` for `sent` emails of the last `lookback_hours`
  that still have **no outcome** `min_age_minutes` after sending (the receiver was down longer than the
  provider retries, or no endpoint is registered). Bounded by `max_emails_per_run`, `time_budget_seconds`
  and, off the critical rate path, `rate_share` of the account's rate limit between two runs (default 1%:
  180 requests per run at 10 requests/s). Answers go through the same code as the webhooks (the same
  outcome, suppression, recipient check and `mail.send_event` decision records).
* **The poll needs a full-access API key** (`GET /emails/{id}`; a sending-only key gets 401
  `restricted_api_key`: the task fails saying so). Set `MAILFLOW_FEEDBACK_CONN_ID` to a `resend`
  connection with a full-access key; default `resend_default`.
* Connections: `send_log_db`, `MAILFLOW_FEEDBACK_CONN_ID` (default `resend_default`). Pool `email_provider`
  (the poll only).
* Run conf: a key that is not one of the Params below (a typo: `dryrun`) fails the run at once, without
  retries, naming the nearest Param, before anything is read or sent.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task

from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.assets import SEND_LOG
from mailflow.orchestration.budgets import budget_description, max_budget_seconds

POLL_TIMEOUT = timedelta(minutes=25)  # execution_timeout of poll_feedback; the budget Param fits inside it

with DAG(
    dag_id="deliverability_feedback",
    schedule=CronDataIntervalTimetable("10,40 * * * *", timezone="UTC"),  # off the :00/:30 of the others
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=2, retry_delay=timedelta(minutes=2)),
    tags=["email", "deliverability", "mailflow"],
    doc_md=__doc__,
    params={
        "lookback_hours": Param(48, type="integer", minimum=1, maximum=24 * 14,
                                description="Poll emails sent within this many hours."),
        "min_age_minutes": Param(60, type="integer", minimum=0, maximum=24 * 60,
                                 description="Poll an email without an outcome this long after it was sent "
                                             "(webhooks come first)."),
        "recheck_after_minutes": Param(120, type="integer", minimum=1, maximum=7 * 24 * 60,
                                       description="Ask again after this long, doubling per check."),
        "max_checks_per_email": Param(4, type="integer", minimum=1, maximum=20,
                                      description="Polls per email at most."),
        "max_emails_per_run": Param(500, type="integer", minimum=1, maximum=20000,
                                    description="Emails polled per run at most."),
        "rate_share": Param(0.01, type="number", minimum=0, maximum=0.2,
                            description="Share of the account's rate limit one poll run may spend (requests per "
                                        "run <= share x requests/s x seconds between runs)."),
        "time_budget_seconds": Param(600, type="integer", minimum=10, maximum=max_budget_seconds(POLL_TIMEOUT),
                                     description=budget_description("No request starts after this many seconds.",
                                                                    POLL_TIMEOUT)),
        "sweep_limit": Param(5000, type="integer", minimum=1, maximum=1_000_000,
                             description="Pending webhook events applied per run at most."),
        "give_up_hours": Param(72, type="number", minimum=1, maximum=24 * 30,
                               description="A webhook event whose email is never found in the send log is "
                                           "decided unknown_email (and alerted) after this long."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=10), outlets=[SEND_LOG])
    def apply_pending(**context) -> dict:
        """Apply webhook events that arrived before their email id was stored; returns counts."""
        from mailflow.orchestration.tasks import webhook_sweep_task

        return webhook_sweep_task(context)

    @task(execution_timeout=timedelta(minutes=5), trigger_rule="all_done")
    def alert_webhook_decisions(**context) -> dict:
        """Alert once for new webhook mismatches, failures, unknown emails and reputation-guard trips."""
        from mailflow.orchestration.tasks import webhook_alert_task

        return webhook_alert_task(context)

    # the safety net runs whatever became of the sweep
    @task(pool="email_provider", execution_timeout=POLL_TIMEOUT, outlets=[SEND_LOG], trigger_rule="all_done")
    def poll_feedback(**context) -> dict:
        """Safety net: poll sent emails without an outcome; suppress hard bounces and complaints; returns counts."""
        from mailflow.orchestration.tasks import feedback_task

        return feedback_task(context)

    swept = apply_pending()
    swept >> alert_webhook_decisions()
    swept >> poll_feedback()
