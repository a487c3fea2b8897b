"""
### provision_campaign

Create the planned send-log rows of one **scheduled campaign** (`mail.campaign`): one `pending`
row per recipient with its send time (UTC) from the campaign's plan (IANA timezone, emails per day,
weekdays, local business-hour windows, start). Triggered by hand with the campaign's id.

* Idempotent: rows are inserted `ON CONFLICT DO NOTHING` and a run continues after the campaign's
  checkpoint, so triggering it twice creates nothing twice.
* Resumable: recipients are provisioned `chunk_size` at a time; each chunk and the checkpoint commit
  in one transaction, so a killed, timed-out or retried run resumes where it stopped, with the send
  times an uninterrupted run would have given.
* `dry_run`: nothing is written; the task logs and returns the plan summary (first and last send,
  emails per day, days spanned).
* A draft campaign becomes `scheduled` with its first chunk; `dispatch_scheduled_emails` sends rows
  as they fall due. Create campaigns with `mailflow campaign create SPEC.toml`.
* Templates and recipients files come from the campaigns folder (`campaigns/` next to this file,
  `MAILFLOW_CAMPAIGNS_DIR`, or the packaged examples); its templates are checked when this file is
  parsed (a bad one is an import error naming the file).
* Connection: `send_log_db` (Postgres).
"""

from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Param, task

from mailflow.campaigns import CampaignFolder, check_templates
from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.assets import SEND_LOG

check_templates(CampaignFolder.resolve(Path(__file__).parent))  # parse time, no database

with DAG(
    dag_id="provision_campaign",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=3, retry_delay=timedelta(minutes=1)),
    tags=["email", "scheduled", "mailflow"],
    doc_md=__doc__,
    params={
        "campaign_id": Param(type="integer", minimum=1, description="Id of the campaign in mail.campaign (required)."),
        "dry_run": Param(False, type="boolean",
                         description="Only print the plan summary (first/last send, emails per day, days spanned)."),
        "chunk_size": Param(5000, type="integer", minimum=1, maximum=50000,
                            description="Recipients per transaction (and per checkpoint)."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=30), outlets=[SEND_LOG])
    def provision(**context) -> dict:
        """Provision (or dry-run) the campaign; returns the provisioning summary."""
        from mailflow.orchestration.tasks import provision_task

        return provision_task(context)

    provision()
