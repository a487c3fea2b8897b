"""Airflow hook for a Resend-compatible email API (connection type ``resend``).

Connection: host = API base URL (default ``https://api.resend.com``), password = API key; extras
``requests_per_second``, ``target_fraction``, ``batch_validation``, ``timeout_seconds``,
``connect_timeout_seconds``, ``pacer_conn_id``. The connection is resolved lazily in
:meth:`ResendHook.get_conn`; the API key never leaves the client's Authorization header.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import httpx
import psycopg
from airflow.sdk import BaseHook

from mailflow.clock import Clock
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import Pacer, PostgresPacer

DEFAULT_BASE_URL = "https://api.resend.com"


class ResendHook(BaseHook):
    """Build a paced, retrying :class:`ResendClient` from an Airflow connection.

    :param resend_conn_id: connection id (default ``resend_default``).
    """

    conn_name_attr = "resend_conn_id"
    default_conn_name = "resend_default"
    conn_type = "resend"
    hook_name = "Resend (email API)"

    def __init__(self, resend_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resend_conn_id = resend_conn_id
        self._client: ResendClient | None = None

    def _connection(self) -> Any:
        """The connection, with its API key (and any secret extra) registered with Airflow's
        secrets masker before anything can log it (:mod:`mailflow.masking`)."""
        from mailflow.masking import mask_connection

        conn = self.get_connection(self.resend_conn_id)
        mask_connection(conn)
        return conn

    def settings(self) -> dict[str, Any]:
        """Connection settings with defaults applied (no secret): base_url, requests_per_second
        (float, requests/s), target_fraction (0-1], batch_validation, timeouts (s), pacer_conn_id.

        :raises ValueError: if the connection has no API key, naming the connection.
        """
        conn = self._connection()
        if not conn.password:
            raise ValueError(f"connection {self.resend_conn_id!r} has no API key (password field)")
        extra = conn.extra_dejson or {}
        host = (conn.host or DEFAULT_BASE_URL).rstrip("/")
        if "://" not in host:
            host = f"https://{host}" + (f":{conn.port}" if conn.port else "")
        return {
            "base_url": host,
            "requests_per_second": float(extra.get("requests_per_second") or 10),
            "target_fraction": float(extra.get("target_fraction") or 0.8),
            "batch_validation": str(extra.get("batch_validation") or "permissive"),
            "timeout_seconds": float(extra.get("timeout_seconds") or 30),
            "connect_timeout_seconds": float(extra.get("connect_timeout_seconds") or 5),
            "pacer_conn_id": str(extra.get("pacer_conn_id") or "send_log_db"),
        }

    def shared_pacer(self) -> PostgresPacer:
        """The account's slot schedule in the pacing database (shared by every sender)."""
        from airflow.providers.postgres.hooks.postgres import PostgresHook

        s = self.settings()
        pg = PostgresHook(postgres_conn_id=s["pacer_conn_id"])
        connect = cast("Callable[[], psycopg.Connection]", pg.get_conn)
        return PostgresPacer(connect, account=s["base_url"],
                             requests_per_second=s["requests_per_second"], target_fraction=s["target_fraction"])

    def get_conn(self, pacer: Pacer | None = None, clock: Clock | None = None,
                 policy: RetryPolicy | None = None) -> ResendClient:
        """Return the client (built once per hook; its httpx pool is reused across batches).

        :param pacer: defaults to :meth:`shared_pacer` (PostgreSQL-backed, shared by all senders).
        """
        if self._client is None:
            s = self.settings()
            conn = self._connection()
            self._client = ResendClient(
                s["base_url"], str(conn.password), pacer=pacer or self.shared_pacer(), clock=clock,
                validation=s["batch_validation"], policy=policy, conn_id=self.resend_conn_id,
                timeout=httpx.Timeout(s["timeout_seconds"], connect=s["connect_timeout_seconds"]),
            )
        return self._client

    def test_connection(self) -> tuple[bool, str]:
        """Call ``GET /domains`` (cheap, authenticated); return ``(ok, message)`` without the key."""
        try:
            s = self.settings()
            conn = self._connection()
            with httpx.Client(base_url=s["base_url"], timeout=httpx.Timeout(10.0),
                              headers={"Authorization": f"Bearer {conn.password}"}) as http:
                resp = http.get("/domains")
        except Exception as exc:  # a connection test reports, it does not raise
            return False, f"{type(exc).__name__}: {exc}"
        if resp.status_code == 200:
            return True, f"API key accepted by {s['base_url']}"
        return False, f"{s['base_url']} answered HTTP {resp.status_code}: {resp.text[:200]}"
