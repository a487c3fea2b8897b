"""
### deliverability_feedback

Every 30 minutes, ask the email API what became of recent sends (`GET /emails/{id}` ->
`last_event`) and stop all further mail to addresses that **hard-bounced** (`bounced`),
**complained** (marked as spam) or are on the provider's suppression list (`suppressed`): each
becomes a row of `mail.suppression` (scope `all`, source `bounce` / `complaint` /
`provider_suppressed`), which the lifecycle audiences and the scheduled dispatcher honour.

* Which emails: `sent` rows of the last `lookback_hours`, first checked `min_age_minutes` after
  sending, re-checked after `recheck_after_minutes` (doubling each time) at most
  `max_checks_per_email` times, never again after a final event. What was seen is recorded in
  `mail.delivery_status`, so nothing is polled forever.
* Bounded: at most `max_emails_per_run` requests (plus retries) and `time_budget_seconds`; the GETs
  claim slots of the same shared pacer as the sends, so feedback never pushes senders over the
  provider's rate limit (it just takes its share of it).
* Safe to retry or re-run: suppressions are `ON CONFLICT DO NOTHING`, each email's record is one
  transaction.
* Webhooks (`email.bounced`, `email.complained`) are the push alternative: see docs/unsubscribe.md.
* Recipient check: the provider's `to` must be the send log's address (normalised); on a mismatch
  nobody is suppressed and the run alerts. `suppressed` (Resend's own suppression list) suppresses
  the address too; `failed` alerts. Every decision is an event of the email (`mail.send_event`).
* **Needs a full-access API key.** It reads emails (`GET /emails/{id}`), which a sending-only key
  may not (401 `restricted_api_key`: the task fails saying so). Keep the senders on a sending-only
  key and give this DAG its own connection: set `MAILFLOW_FEEDBACK_CONN_ID` (e.g.
  `resend_full_access`, a `resend` connection with a full-access key); default `resend_default`.
* Connections: `send_log_db`, `MAILFLOW_FEEDBACK_CONN_ID` (default `resend_default`). Pool `email_provider`.
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
                                description="Check emails sent within this many hours."),
        "min_age_minutes": Param(5, type="integer", minimum=0, maximum=24 * 60,
                                 description="First check an email this long after it was sent."),
        "recheck_after_minutes": Param(120, type="integer", minimum=1, maximum=7 * 24 * 60,
                                       description="Ask again after this long, doubling per check."),
        "max_checks_per_email": Param(4, type="integer", minimum=1, maximum=20,
                                      description="Polls per email at most."),
        "max_emails_per_run": Param(500, type="integer", minimum=1, maximum=20000,
                                    description="Emails checked per run at most (about one request each)."),
        "time_budget_seconds": Param(600, type="integer", minimum=10, maximum=max_budget_seconds(POLL_TIMEOUT),
                                     description=budget_description("No request starts after this many seconds.",
                                                                    POLL_TIMEOUT)),
    },
) as dag:

    @task(pool="email_provider", execution_timeout=POLL_TIMEOUT, outlets=[SEND_LOG])
    def poll_feedback(**context) -> dict:
        """Check recent sends' status; suppress hard bounces and complaints; returns counts."""
        from mailflow.orchestration.tasks import feedback_task

        return feedback_task(context)

    poll_feedback()
