"""The send-log database of an endpoint served inside the Airflow API server (the unsubscribe endpoint,
the webhook receiver): an environment variable, else the Airflow connection ``send_log_db``, resolved on
the first request so a missing connection answers 503 and never breaks the API server."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from mailflow import settings

TLS_EXTRAS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "target_session_attrs")
"""Connection extras passed on to libpq (the rest of ``extra`` is Airflow's business)."""


class AirflowDsn:
    """The send-log DSN, resolved on first use and cached: ``env_var``, else the Airflow connection
    ``send_log_db`` (host, port, login, password, schema = database, the :data:`TLS_EXTRAS`).

    :param env_var: the endpoint's own DSN variable (``MAILFLOW_UNSUBSCRIBE_DSN``, ``MAILFLOW_WEBHOOK_DSN``).
    :param unavailable: the endpoint's exception for "answer 503" (raised when neither is set; the
        message names the variable and the connection, never a password).
    :param connect: opens a connection from a DSN (the endpoint's timeouts).
    """

    def __init__(self, env_var: str, unavailable: type[Exception],
                 connect: Callable[[str], psycopg.Connection]):
        self._env_var = env_var
        self._unavailable = unavailable
        self._connect = connect
        self._dsn: str | None = None
        self._lock = threading.Lock()

    def dsn(self) -> str:
        """The DSN (libpq conninfo string). :raises: ``unavailable`` if there is none."""
        if self._dsn is None:
            with self._lock:
                if self._dsn is None:
                    self._dsn = os.environ.get(self._env_var) or self._from_airflow()
        return self._dsn

    def _from_airflow(self) -> str:
        try:
            from airflow.sdk import BaseHook

            c = BaseHook.get_connection(settings.SEND_LOG_CONN_ID)
        except Exception:
            raise self._unavailable(f"no send-log database: set {self._env_var} or the Airflow connection "
                                    f"{settings.SEND_LOG_CONN_ID!r}") from None
        params: dict[str, Any] = {k: v for k, v in (c.extra_dejson or {}).items() if k in TLS_EXTRAS}
        parts = {"host": c.host, "port": c.port, "user": c.login, "password": c.password, "dbname": c.schema}
        params.update({k: v for k, v in parts.items() if v})
        return make_conninfo("", **params)

    def connect(self) -> psycopg.Connection:
        """A new connection to the send log. :raises: ``unavailable`` if there is no DSN."""
        return self._connect(self.dsn())
