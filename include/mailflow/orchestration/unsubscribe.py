"""The unsubscribe endpoint inside the Airflow 3 API server (``plugins/mailflow_unsubscribe.py``):
the signing secret and the send-log DSN from the environment, else from Airflow connections, looked
up on the first request so a missing connection never breaks the API server."""

from __future__ import annotations

import os
import threading
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from mailflow import settings
from mailflow.feedback.unsubscribe_app import (
    DSN_ENV,
    Unavailable,
    connect_factory,
    create_app,
    signer_from_env,
)
from mailflow.feedback.unsubscribe_tokens import UnsubscribeSigner, signer_from_connection


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


class _AirflowDsn:
    """The send-log DSN, resolved on first use and cached: ``MAILFLOW_UNSUBSCRIBE_DSN``, else the
    Airflow connection ``send_log_db`` (host, port, login, password, schema = database, extras
    such as ``sslmode``)."""

    def __init__(self) -> None:
        self._dsn: str | None = None
        self._lock = threading.Lock()

    def dsn(self) -> str:
        if self._dsn is None:
            with self._lock:
                if self._dsn is None:
                    self._dsn = os.environ.get(DSN_ENV) or self._from_airflow()
        return self._dsn

    @staticmethod
    def _from_airflow() -> str:
        try:
            from airflow.sdk import BaseHook

            c = BaseHook.get_connection(settings.SEND_LOG_CONN_ID)
        except Exception:
            raise Unavailable(f"no send-log database: set {DSN_ENV} or the Airflow connection "
                              f"{settings.SEND_LOG_CONN_ID!r}") from None
        params: dict[str, Any] = {k: v for k, v in (c.extra_dejson or {}).items()
                                  if k in ("sslmode", "sslrootcert", "sslcert", "sslkey", "target_session_attrs")}
        parts = {"host": c.host, "port": c.port, "user": c.login, "password": c.password, "dbname": c.schema}
        params.update({k: v for k, v in parts.items() if v})
        return make_conninfo("", **params)

    def connect(self) -> psycopg.Connection:
        return connect_factory(self.dsn())()


def create_airflow_app(brand: str = "Aptitude Practice") -> Any:
    """The endpoint wrapped in a tiny FastAPI app for an Airflow 3 plugin's ``fastapi_apps``.

    Nothing is resolved at import or start-up: the secret and the database are looked up on the
    first request (environment first, then Airflow connections), so the API server starts even if
    they are missing and the endpoint answers 503 until they exist. It is public: recipients are
    not Airflow users, and the token is the only credential.
    """
    from fastapi import FastAPI

    api = FastAPI(title="mailflow unsubscribe", openapi_url=None, docs_url=None, redoc_url=None)
    api.mount("/", create_app(signer_from_airflow, _AirflowDsn().connect, brand=brand))
    return api
