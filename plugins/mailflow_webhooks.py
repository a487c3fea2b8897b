"""Airflow plugin: the provider's webhook receiver inside the Airflow 3 API server.

Mounted at ``<api server>/mailflow-webhooks``: register ``https://<airflow host>/mailflow-webhooks/resend``
with the provider (docs/feedback.md). The route is public: the provider is not an Airflow user and the
signature (Svix scheme) is its credential. Nothing is resolved at start-up: the signing secrets
(``MAILFLOW_WEBHOOK_SECRETS`` or the connection ``mail_webhook``) and the database
(``MAILFLOW_WEBHOOK_DSN`` or the connection ``send_log_db``) are looked up on the first request, so a
missing connection never breaks the API server: the endpoint answers 503 (the provider retries) until it exists.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from mailflow.orchestration.webhooks import URL_PREFIX, create_airflow_app


class MailflowWebhooksPlugin(AirflowPlugin):
    """Registers the webhook receiver as a FastAPI sub-application of the API server."""

    name = "mailflow_webhooks"
    fastapi_apps = [
        {"app": create_airflow_app(), "url_prefix": URL_PREFIX, "name": "mailflow provider webhooks"},
    ]
