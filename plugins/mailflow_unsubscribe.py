"""Airflow plugin: the one-click unsubscribe endpoint inside the Airflow 3 API server.

Mounted at ``<api server>/mailflow-unsubscribe`` (``mailflow.settings.UNSUBSCRIBE_PATH``); links are
built as ``<MAILFLOW_PUBLIC_URL>/mailflow-unsubscribe/u/<token>``, so ``MAILFLOW_PUBLIC_URL`` is the
API server's public address (``https://<airflow host>``; the prefix may be written too). The routes are public: email recipients are not
Airflow users and the signed token is the only credential (see docs/unsubscribe.md). Nothing is
resolved at start-up: the signing secret (``MAILFLOW_UNSUBSCRIBE_SECRET`` or the connection
``mail_unsubscribe``) and the database (``MAILFLOW_UNSUBSCRIBE_DSN`` or the connection
``send_log_db``) are looked up on the first request, so a missing connection never breaks the API
server: the endpoint answers a friendly 503 until it exists.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from mailflow.orchestration.unsubscribe import create_airflow_app
from mailflow.settings import UNSUBSCRIBE_PATH

URL_PREFIX = UNSUBSCRIBE_PATH


class MailflowUnsubscribePlugin(AirflowPlugin):
    """Registers the unsubscribe endpoint as a FastAPI sub-application of the API server."""

    name = "mailflow_unsubscribe"
    fastapi_apps = [
        {"app": create_airflow_app(), "url_prefix": URL_PREFIX, "name": "mailflow one-click unsubscribe"},
    ]
