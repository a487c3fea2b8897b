"""
### example_scale_out (scale-out demo only: `make scale-demo`, never in dags/)

N mapped send tasks, each pushing synthetic batches through the **production send path**: the
`resend_default` connection -> `ResendHook` -> `ResendClient` with the shared `PostgresPacer`
(`mail.rate_slot` in the `send_log_db` database). On CeleryExecutor the tasks spread over the
workers; the pool `email_provider` bounds how many send at once and the pacer keeps the
aggregate request rate under the provider's cap, whichever worker a task lands on.

Synthetic emails only (to `userN@example.com`, reserved domain); nothing is written to the send
log. Each task returns what it sent and where it ran. `scripts/scale_demo.py` puts this file in
a temporary DAG folder next to `lifecycle_emails.py`; it is not part of the deployed DAGs.
"""

from datetime import timedelta

import pendulum
from airflow.sdk import DAG, Param, task

with DAG(
    dag_id="example_scale_out",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    default_args={"owner": "data-eng", "retries": 0},
    tags=["example", "mailflow"],
    doc_md=__doc__,
    params={
        "senders": Param(8, type="integer", minimum=1, maximum=64, description="Mapped send tasks."),
        "batches": Param(30, type="integer", minimum=1, maximum=100, description="Batch requests per task."),
        "emails_per_batch": Param(10, type="integer", minimum=1, maximum=100, description="Emails per batch."),
    },
) as dag:

    @task
    def plan(**context) -> list[dict]:
        """One spec per sender: disjoint synthetic row ids, so every email is unique in the run."""
        p = context["params"]
        span = p["batches"] * p["emails_per_batch"]
        return [{"sender": i, "first_id": 1 + i * span, "emails": span, "batch_size": p["emails_per_batch"]}
                for i in range(p["senders"])]

    @task(pool="email_provider", execution_timeout=timedelta(minutes=10))
    def send(spec: dict, **context) -> dict:
        """Send this sender's batches through the hook's client (shared pacer); return counts."""
        import os
        import socket
        import time

        from mailflow import settings
        from mailflow.model.outcome import Accepted
        from mailflow.provider.hook import ResendHook
        from mailflow_dev.loadgen import synthetic_batches

        ti = context["ti"]
        campaign = f"scale-{ti.run_id}-{spec['sender']}".replace(":", "-").replace("+", "-")[:120]
        client = ResendHook(settings.RESEND_CONN_ID).get_conn()
        accepted = not_accepted = 0
        t0 = time.time()
        try:
            for batch in synthetic_batches(spec["emails"], first_id=spec["first_id"], batch_size=spec["batch_size"],
                                           campaign=campaign):
                outcome = client.send_batch(batch, deadline=time.monotonic() + 300)
                if isinstance(outcome, Accepted):
                    accepted += len(outcome.ids)
                    not_accepted += len(outcome.rejected)
                else:
                    not_accepted += len(batch.row_ids)
        finally:
            client.close()
        return {"sender": spec["sender"], "worker": os.environ.get("MAILFLOW_WORKER_NAME") or socket.gethostname(),
                "requests": client.stats["requests"], "rate_limited": client.stats["429"], "accepted": accepted,
                "not_accepted": not_accepted, "started": t0, "finished": time.time()}

    send.expand(spec=plan())
