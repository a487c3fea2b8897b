"""The unsubscribe endpoint inside the Airflow 3 API server (``plugins/mailflow_unsubscribe.py``):
the signing secret and the send-log DSN from the environment, else from Airflow connections, looked
up on the first request so a missing connection never breaks the API server."""

from __future__ import annotations

from typing import Any

from mailflow import settings
from mailflow.feedback.unsubscribe_app import (
    DSN_ENV,
    Unavailable,
    connect_factory,
    create_app,
    signer_from_env,
)
from mailflow.feedback.unsubscribe_tokens import UnsubscribeSigner, signer_from_connection
from mailflow.orchestration.send_log_dsn import AirflowDsn


def signer_from_airflow() -> UnsubscribeSigner:
    """The signer from the environment, else the Airflow connection ``mail_unsubscribe`` (through
    the configured secrets backends; in the API server also the metadata database).

    :raises Unavailable: if there is no secret anywhere.
    """
    try:
        return signer_from_env()
    except Unavailable as env_error:
        try:
            from airflow.sdk import BaseHook

            conn = BaseHook.get_connection(settings.UNSUBSCRIBE_CONN_ID)
        except Exception:
            raise Unavailable(f"{env_error}; and the Airflow connection {settings.UNSUBSCRIBE_CONN_ID!r} "
                              f"is not defined") from None
        try:
            return signer_from_connection(conn.password, conn.extra_dejson or {})
        except ValueError as exc:
            raise Unavailable(f"connection {settings.UNSUBSCRIBE_CONN_ID!r}: {exc}") from None


def create_airflow_app(brand: str = "Aptitude Practice") -> Any:
    """The endpoint wrapped in a tiny FastAPI app for an Airflow 3 plugin's ``fastapi_apps``.

    Nothing is resolved at import or start-up: the secret and the database are looked up on the
    first request (environment first, then Airflow connections), so the API server starts even if
    they are missing and the endpoint answers 503 until they exist. It is public: recipients are
    not Airflow users, and the token is the only credential.
    """
    from fastapi import FastAPI

    api = FastAPI(title="mailflow unsubscribe", openapi_url=None, docs_url=None, redoc_url=None)
    send_log = AirflowDsn(DSN_ENV, Unavailable, lambda dsn: connect_factory(dsn)())
    api.mount("/", create_app(signer_from_airflow, send_log.connect, brand=brand))
    return api
