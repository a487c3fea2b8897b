"""
### provision_campaign

Provision a **scheduled campaign** by **name**, after a person approved its plan: one `pending`
send-log row per recipient with its send time (UTC) from the campaign's plan (IANA timezone, emails
per day, weekdays, local windows, start); `dispatch_scheduled_emails` sends the rows as they fall due.

Tasks: `plan` -> `send_test_email` -> `approve` -> `provision`.

1. **plan**: recipients still to provision, first and last send (UTC and local),
   emails per day, days spanned, the local windows; what the contact policy would hold back now
   (suppressed, in cooldown, over a frequency cap, invalid address); the email rendered for the first
   recipient (subject and text); the campaign's **fingerprint** (its whole definition, the bytes of
   its template, layouts and recipients file, its recipients' ids). Its one write: the approval
   request of that fingerprint (`mail.campaign_approval`, pending; none on a dry run).
2. **send_test_email** (only with `test_email_to`): one email through `resend_default` to that
   address, subject `[TEST] ...`, tagged `test`, recorded as the campaign event `test_email` with the
   provider's id, never a send-log row (no count, no contact policy; a suppressed address gets none).
   Its unsubscribe link is signed for no user. Its outcomes (delivered, bounced, opened, ...) are
   recorded on it as the provider's webhooks arrive and listed as `test_emails` in the output of
   `plan` and `provision` (docs/feedback.md, "Test emails"). **`dry_run`** skips it and everything
   after it: a dry run stops after `plan`.
3. **approve**: a Required Action in the UI (Browse -> Required Actions, or the task's page)
   showing the plan, the hold-back, the sample and the fingerprint: Approve or Reject. Unanswered after
   `approval_timeout_hours` (default 72) it takes its default, Reject: it expires. Every answer is
   recorded on the request and as an event naming who answered (`approval_approved` /
   `approval_rejected` / `approval_expired`); on a rejection or an expiry `provision` is skipped and the
   campaign stays as it was (a draft stays a draft; nothing is scheduled).
4. **provision** (approved only): rows in chunks of `chunk_size`; a draft becomes `scheduled`. Only
   the approved fingerprint: if the definition was replaced while the approval waited (which voids
   the request), or a template, the recipients file or the recipients changed, it fails without
   retries naming each change, and nothing is provisioned (docs/operations.md, "The approval
   fingerprint").
   One provisioning at a time (`max_active_tis_per_dag=1`); runs waiting for their approval do not
   block each other (`max_active_runs=16`). Idempotent (rows `ON CONFLICT DO NOTHING`, continues after the checkpoint) and resumable (each
   chunk and the checkpoint commit together).

An unknown name, a cancelled or completed campaign, a stored definition that cannot be provisioned
(a missing template or recipients file, a subject that does not render) or a run conf key that is
no Param fails `plan` at once, without retries. Create campaigns with `campaign_create` (or
`mailflow campaign create`); pause, resume, cancel with `campaign_control`.

Templates and recipients files come from the campaigns folder (`campaigns/` next to this file,
`MAILFLOW_CAMPAIGNS_DIR`, or the packaged examples); its templates are checked when this file is
parsed (a bad one is an import error naming the file). Connections: `send_log_db`, `resend_default`
(the test email), `mail_unsubscribe`.
"""

from datetime import timedelta
from pathlib import Path

import pendulum
from airflow.sdk import DAG, Param, task

from mailflow.campaigns import CampaignFolder, check_templates
from mailflow.orchestration.alerts import default_args
from mailflow.orchestration.approval import CampaignApprovalOperator
from mailflow.orchestration.assets import SEND_LOG
from mailflow.orchestration.campaign_tasks import DEFAULT_APPROVAL_TIMEOUT_HOURS

check_templates(CampaignFolder.resolve(Path(__file__).parent))  # parse time, no database

APPROVAL_BODY = """{{ ti.xcom_pull(task_ids='plan')['approval_text'] }}

{% set t = ti.xcom_pull(task_ids='send_test_email') %}{% if t and t['sent'] -%}
**Test email** sent to {{ t['to'] }} (subject "{{ t['subject'] }}", provider id `{{ t['provider_id'] }}`).
{%- else -%}
No test email was sent (Param `test_email_to` empty).
{%- endif %}

Approve to provision (the campaign becomes scheduled and sends per the plan); Reject to leave it as it is.
"""

with DAG(
    dag_id="provision_campaign",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    # a run waits for its approval for up to approval_timeout_hours: other campaigns' runs must not
    # queue behind it; the provisioning itself runs one at a time (max_active_tis_per_dag)
    max_active_runs=16,
    default_args=default_args(retries=3, retry_delay=timedelta(minutes=1)),
    tags=["email", "scheduled", "mailflow"],
    doc_md=__doc__,
    params={
        "campaign": Param(type="string", minLength=1, description="The campaign's name (see campaign_create)."),
        "dry_run": Param(False, type="boolean",
                         description="Only the plan: no test email, no approval, nothing provisioned."),
        "chunk_size": Param(5000, type="integer", minimum=1, maximum=50000,
                            description="Recipients per transaction (and per checkpoint)."),
        "test_email_to": Param(None, type=["string", "null"],
                               description="Optional: send one test email ([TEST] subject) to this address "
                                           "before the approval."),
        "approval_timeout_hours": Param(DEFAULT_APPROVAL_TIMEOUT_HOURS, type="number", exclusiveMinimum=0,
                                        maximum=720,
                                        description="Hours the approval waits; unanswered, it expires like a "
                                                    "rejection."),
    },
) as dag:

    @task(execution_timeout=timedelta(minutes=15))
    def plan(**context) -> dict:
        """The dry-run plan, the contact policy's hold-back and a sample email (writes nothing)."""
        from mailflow.orchestration.campaign_tasks import plan_task

        return plan_task(context)

    @task(execution_timeout=timedelta(minutes=5))
    def send_test_email(**context) -> dict:
        """One test email to Param test_email_to (none without it; skipped on a dry run)."""
        from mailflow.orchestration.campaign_tasks import test_email_task

        return test_email_task(context)

    approve = CampaignApprovalOperator(
        task_id="approve",
        subject="Provision campaign {{ params.campaign }}?",
        body=APPROVAL_BODY,
        execution_timeout=timedelta(minutes=5),
    )

    @task(execution_timeout=timedelta(minutes=30), outlets=[SEND_LOG], max_active_tis_per_dag=1)
    def provision(**context) -> dict:
        """Provision the approved campaign; returns the provisioning summary."""
        from mailflow.orchestration.campaign_tasks import provision_task

        return provision_task(context)

    plan() >> send_test_email() >> approve >> provision()
