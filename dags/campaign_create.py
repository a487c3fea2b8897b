"""
### campaign_create

Create a **scheduled campaign** as a `draft` from this form: one field per key of the campaign
definition (the pydantic model `mailflow.sources.scheduled.definition.CampaignDefinition`; the form
is generated from its JSON schema, so types, choices, bounds, descriptions and defaults are the
model's). With **`update`** on, the existing draft of that name gets this definition instead
(only a draft: a provisioned campaign keeps its plan). An update voids the draft's pending and
approved approval requests (event `approval_voided`): plan and approve it again.

The task validates the whole definition again with the model (strict: a number is not text, an
unknown conf key is refused), checks the template and recipients files, and writes the campaign in
one transaction. Refused input fails the task at once, without retries, with a message naming
each refused field; nothing is written.

Next: `provision_campaign` with the campaign's name (plan, test email, approval, provision).
Connection: `send_log_db`. Templates and recipients files: the campaigns folder (`campaigns/` next
to this file, `MAILFLOW_CAMPAIGNS_DIR`, or the packaged examples).
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.campaign_params import definition_params

with DAG(
    dag_id="campaign_create",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args=default_args(retries=1, retry_delay=timedelta(minutes=1)),
    tags=["email", "scheduled", "mailflow"],
    doc_md=__doc__,
    params={
        **definition_params(),
        "update": Param(False, type="boolean",
                        description="Replace the definition of the existing draft of this name."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=5))
    def create(**context) -> dict:
        """Validate the definition and create (or update) the draft; returns the campaign's status."""
        from mailflow.orchestration.campaign_tasks import create_task

        return create_task(context)

    create()
