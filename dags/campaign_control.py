"""
### campaign_control

Operate a **scheduled campaign** by name: `pause` (the dispatcher stops claiming its rows; rows in
flight finish; the plan is kept), `resume` (overdue rows are re-planned from now, so no burst),
`cancel` (every pending row is cancelled; irreversible), `complete` (only when fully provisioned
and nothing is pending or sending) or `status` (settings, rows by state, next due, lateness).

An unknown name, an action the campaign's status does not allow (e.g. resuming a cancelled
campaign) or a run conf key that is no Param fails the task at once, without retries, naming it.
Each action is one transaction and recorded as a campaign event with who triggered the run.
Connection: `send_log_db`.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.campaign_tasks import ACTIONS

with DAG(
    dag_id="campaign_control",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=1, retry_delay=timedelta(minutes=1)),
    tags=["email", "scheduled", "mailflow"],
    doc_md=__doc__,
    params={
        "campaign": Param(type="string", minLength=1, description="The campaign's name."),
        "action": Param("status", type="string", enum=list(ACTIONS),
                        description="pause, resume, cancel, complete or status."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=5))
    def control(**context) -> dict:
        """Apply the action; returns its result (status: the campaign's status)."""
        from mailflow.orchestration.campaign_tasks import control_task

        return control_task(context)

    control()
