"""
### lifecycle_emails

Hourly lifecycle campaigns (declared in `lifecycle.toml` of the campaigns folder: `campaigns/` next
to this file when it exists, `MAILFLOW_CAMPAIGNS_DIR` if set, else the packaged examples), highest
priority first. Each run selects audiences from **its own data interval** (an interval timetable,
so `[data_interval_start, data_interval_end)` is one real hour), excludes anyone emailed by any
campaign within the cooldown or suppressed, mints send-log rows one chunk (<= 100) at a time,
sends each chunk as one `POST /emails/batch` and reconciles rejections by index.

* Time budget: checked between chunks, never inside one; what is left waits for the next run.
* Retries of this task are safe: the send log's unique key and the cooldown skip what was minted.
* Backfills re-select each interval's own audience; an interval that ended more than a campaign's
  `max_interval_age` (6 h) ago sends nothing unless the run sets `allow_old_interval`.
* Unpausing after days off: `catchup=False` creates one run, for the latest interval only.
* Scheduled, manual and backfill runs never overlap: `max_active_tis_per_dag=1` on the send task
  (backfill runs do not count against `max_active_runs`, so that alone would not serialize them);
  create backfills with `max_active_runs=1` so their intervals run oldest first.
* Campaign files are validated when this file is parsed (a bad one is an import error naming the
  file and the field) and read again by every run; each batch records the campaign's content hash.
* Connections: `send_log_db` (Postgres), `resend_default` (API key = password), `mail_unsubscribe`.
* Pool `email_provider` bounds concurrent send tasks; the shared pacer in Postgres enforces the rate.
* Run conf: a key that is not one of the Params below (a typo: `dryrun`) fails the run at once, without
  retries, naming the nearest Param, before anything is read or sent.
"""

from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG, CronDataIntervalTimetable, Param, task

from mailflow.campaigns import CampaignFolder, check_templates, declared_names, load_campaigns
from mailflow.orchestration.alerts import LIFECYCLE_DEADLINE, deadline, default_args
from mailflow.orchestration.assets import SEND_LOG
from mailflow.orchestration.budgets import budget_description, max_budget_seconds

SEND_TIMEOUT = timedelta(minutes=15)  # execution_timeout of send_campaigns; the budget Param fits inside it

# Parse time, no database: a bad campaign file fails this import, naming the file and the field
# (strict keys, audience and template files present, every template in the sandbox). The tasks
# read the folder again at run time, so an edit needs no reinstall.
CAMPAIGNS = CampaignFolder.resolve(Path(__file__).parent)
load_campaigns(folder=CAMPAIGNS)
check_templates(CAMPAIGNS)
CAMPAIGN_NAMES = declared_names(folder=CAMPAIGNS)  # the trigger form's choices, in file order

with DAG(
    dag_id="lifecycle_emails",
    schedule=CronDataIntervalTimetable("0 * * * *", timezone="UTC"),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=2, retry_delay=timedelta(minutes=2)),
    deadline=deadline(LIFECYCLE_DEADLINE, "the hourly lifecycle run is not finished 45 min after it was queued; "
                      "the next hour's run waits behind it"),
    tags=["email", "lifecycle", "mailflow"],
    doc_md=__doc__,
    params={
        "time_budget_seconds": Param(240, type="integer", minimum=10, maximum=max_budget_seconds(SEND_TIMEOUT),
                                     description=budget_description("Stop minting new chunks after this many "
                                                                    "seconds (checked between chunks).", SEND_TIMEOUT)),
        "chunk_size": Param(100, type="integer", minimum=1, maximum=100,
                            description="Emails per batch request (provider limit: 100)."),
        "campaigns": Param([], type="array", items={"type": "string", "enum": CAMPAIGN_NAMES},
                           uniqueItems=True, examples=CAMPAIGN_NAMES,
                           description="Run only these campaigns (names from lifecycle.toml); empty = all."),
        "dry_run": Param(False, type="boolean",
                         description="Only count audiences and render a sample; mint and send nothing."),
        "allow_old_interval": Param(False, type="boolean",
                                    description="Backfills: send for intervals older than a campaign's "
                                    "max_interval_age (default 6 h). Off: an old interval sends nothing."),
    },
) as dag:

    @task(pool="email_provider", execution_timeout=SEND_TIMEOUT, outlets=[SEND_LOG],
          max_active_tis_per_dag=1)
    def send_campaigns(**context) -> list[dict]:
        """Send every campaign for this run's data interval; returns per-campaign counts."""
        from mailflow.orchestration.tasks import lifecycle

        return lifecycle(context)

    send_campaigns()
