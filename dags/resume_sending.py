"""
### resume_sending

Resume sending after the **reputation guard** stopped a campaign or the whole provider account
(a hard-bounce or complaint rate over its threshold: docs/operations.md, "Reputation guard").
Triggered by hand; resuming is a person's decision, recorded with who (the run's triggering user)
and why (the required `reason`).

* `scope`: `campaign` (one campaign, lifecycle or scheduled) or `account` (every campaign).
* The scope's rates start again from now: outcomes of emails sent before the resume no longer
  count, so it does not trip again at once on the same bounces.
* A scheduled campaign the guard paused is set back to `scheduled` (overdue rows re-planned from now,
  as a resume does); a campaign someone else paused stays paused.
* Same as `mailflow reputation resume --campaign NAME --reason TEXT`. Idempotent: resuming a scope
  that is not tripped changes nothing.
* Connection: `send_log_db` (Postgres).
* Run conf: a key that is not one of the Params below (a typo: `dryrun`) fails the run at once, without
  retries, naming the nearest Param, before anything is read or sent.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from mailflow.orchestration.alerts import default_args

with DAG(
    dag_id="resume_sending",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=1, retry_delay=timedelta(minutes=1)),
    tags=["email", "deliverability", "mailflow"],
    doc_md=__doc__,
    params={
        "scope": Param("campaign", type="string", enum=["campaign", "account"],
                       description="What to resume: one campaign, or the provider account (every campaign)."),
        "name": Param(type="string", minLength=1,
                      description="The campaign's name, or the account (see `mailflow reputation status`)."),
        "reason": Param(type="string", minLength=3,
                        description="Why it is safe to send again (required; recorded with who resumed)."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=5))
    def resume(**context) -> dict:
        """Resume the scope; returns what changed (the scope, resumed_at, campaigns set back to scheduled)."""
        from mailflow.orchestration.reputation import resume_task
        from mailflow.orchestration.run_conf import check_run_conf
        from mailflow.orchestration.tasks import send_log_connection
        from mailflow.store.migrate import require_current

        check_run_conf(context)  # a conf key that is no Param (a typo) fails before anything is done

        with send_log_connection() as conn:
            require_current(conn)
            return resume_task(context, conn)

    resume()
