"""
### dispatch_scheduled_emails

Sends the **due** rows of scheduled campaigns (`status = 'pending'`, `scheduled_at <= now()`, campaign
`scheduled`) close to their time, through the same client, shared pacer and reconciliation by
index as `lifecycle_emails`, in batches of up to 100 emails of one campaign.

**Scheduling choice: a 1-minute interval schedule, each run a loop of at most 50 s.** A run claims
what is due, then sleeps until the next claim is worth it (the earliest due row has waited
`coalesce_seconds`, or 100 rows are due) **only if that falls inside its budget**; otherwise it
returns at once and frees its worker slot. So a slot is never held idle for more than one budget
(50 s), and a run with nothing due in the coming minute lasts about a second. Lateness
(`sent_at - scheduled_at`) is bounded by `coalesce_seconds` (5 s) plus pacing inside a run, and by
the gap between runs (60 - 50 s) plus the scheduler's start delay between runs: well under the
60 s p99 target (measured: `python -m bench --only dispatch`). Rejected alternatives: a 5-minute
interval whose run sleeps towards rows up to ~4.5 min away holds the slot idle for minutes; a
deferrable wait (DateTimeTrigger) frees the slot but every wake-up pays the triggerer -> scheduler ->
worker hand-off (seconds, more under load) and needs a triggerer, for no gain over a short schedule.

* Concurrency-safe: claims use `FOR UPDATE SKIP LOCKED`; two dispatchers never share a row or wait.
* Terminal states are protected: `sent`/`cancelled` rows are never claimed; suppressed users' due
  rows are cancelled before sending; a request proven not processed returns its rows to `pending`
  without charging them and stops the run; rows of an ambiguous request keep their key and bytes
  and are resent with that key only (by `reconcile_send_log`) until a 2xx answers it.
* Paused campaigns are skipped (their plan is kept); campaigns with nothing left become `completed`.
* Connections: `send_log_db`, `resend_default`, `mail_unsubscribe`. Pool `email_provider`.
* Run conf: a key that is not one of the Params below (a typo: `dryrun`) fails the run at once, without
  retries, naming the nearest Param, before anything is read or sent.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task

from mailflow.orchestration.alerts import DISPATCH_DEADLINE, deadline, default_args
from mailflow.orchestration.assets import SEND_LOG
from mailflow.orchestration.budgets import budget_description, max_budget_seconds

# execution_timeout of dispatch: a 50 s budget needs far less, but the chunk in flight at the budget may
# retry for up to the longest chunk (333 s with the default connection, mailflow.orchestration.budgets).
DISPATCH_TIMEOUT = timedelta(minutes=10)

with DAG(
    dag_id="dispatch_scheduled_emails",
    schedule=CronDataIntervalTimetable("* * * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=1, retry_delay=timedelta(seconds=30)),
    deadline=deadline(DISPATCH_DEADLINE, "a dispatch run is not finished 5 min after it was queued; scheduled "
                      "emails are going out late"),
    tags=["email", "scheduled", "mailflow"],
    doc_md=__doc__,
    params={
        "time_budget_seconds": Param(50, type="integer", minimum=5, maximum=max_budget_seconds(DISPATCH_TIMEOUT),
                                     description=budget_description("No new claim or wait starts after this many "
                                                                    "seconds.", DISPATCH_TIMEOUT)),
        "coalesce_seconds": Param(5, type="number", minimum=0, maximum=50,
                                  description="A due email waits at most this long for others to share its request."),
    },
) as dag:

    @task(pool="email_provider", execution_timeout=DISPATCH_TIMEOUT, outlets=[SEND_LOG])
    def dispatch(**context) -> dict:
        """Send due scheduled emails until nothing is due within the budget; returns counts."""
        from mailflow.orchestration.tasks import dispatch_task

        return dispatch_task(context)

    dispatch()
