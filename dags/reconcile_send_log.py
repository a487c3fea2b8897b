"""
### reconcile_send_log

Every 30 minutes, repair what crashes and unknown provider outcomes left in `mail.send_log`:

* stale `sending` rows (claimed more than `stale_after_seconds` ago; younger claims belong to a
  live worker and are left alone): a row with a provider id becomes `sent`; a batch still inside the
  provider's 24 h idempotency window is resent with the **same key and the same stored bytes**; a
  batch past the window becomes `failed` ("unknown outcome") and is dead-lettered, never resent
  under a new key;
* rows of a stale batch are ambiguous (their sender may have written the request): only a 2xx
  answer to their key resolves them; a 5xx, 429 or the budget leaves them for the next run;
* dead letters alert through the configured notifier (`MAILFLOW_ALERT`: log, smtp or slack).

Running it twice changes nothing the second time: every change is guarded on the current state.

* Run conf: a key that is not one of the Params below (a typo: `dryrun`) fails the run at once, without
  retries, naming the nearest Param, before anything is read or sent.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task

from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.assets import SEND_LOG
from mailflow.orchestration.budgets import budget_description, max_budget_seconds

RECONCILE_TIMEOUT = timedelta(minutes=25)  # execution_timeout of reconcile; the budget Param fits inside it

with DAG(
    dag_id="reconcile_send_log",
    schedule=CronDataIntervalTimetable("*/30 * * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=2, retry_delay=timedelta(minutes=2)),
    tags=["email", "reconcile", "mailflow"],
    doc_md=__doc__,
    params={
        "stale_after_seconds": Param(900, type="integer", minimum=60,
                                     description="A sending claim older than this (s) is stale."),
        "time_budget_seconds": Param(600, type="integer", minimum=10, maximum=max_budget_seconds(RECONCILE_TIMEOUT),
                                     description=budget_description("Stop resending batches after this many seconds.",
                                                                    RECONCILE_TIMEOUT)),
    },
) as dag:

    @task(pool="email_provider", execution_timeout=RECONCILE_TIMEOUT, outlets=[SEND_LOG])
    def reconcile(**context) -> dict:
        """Repair stale claims, resend inside the idempotency window, dead-letter and alert."""
        from mailflow.orchestration.tasks import reconcile_send_log

        return reconcile_send_log(context)

    reconcile()
