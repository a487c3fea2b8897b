"""Airflow hook for a Resend-compatible email API (connection type ``resend``).

Connection: host = API base URL (default ``https://api.resend.com``), password = API key; extras
``requests_per_second``, ``target_fraction``, ``batch_validation``, ``timeout_seconds``,
``connect_timeout_seconds``, ``pacer_conn_id``, ``max_retry_after_seconds`` (the cap on a shared
rate-limit hold, default 60, at most 120), ``previous_api_keys`` (a list of earlier keys of the same
account, kept only so the reconciler can resend ambiguous batches under the key they were first sent with:
docs/operations.md, "Rotating the API key"; masked like the password). The connection is resolved lazily in
:meth:`ResendHook.get_conn`; the API keys never leave the clients' Authorization headers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import httpx
import psycopg
from airflow.sdk import BaseHook

from mailflow.model.clock import Clock
from mailflow.provider.client import ResendClient, RetryPolicy, key_identity
from mailflow.provider.pacing import (
    DEFAULT_MAX_HOLD_SECONDS,
    MAX_HOLD_SECONDS,
    Pacer,
    PostgresPacer,
    check_max_hold,
)

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
        self._previous: dict[str, ResendClient] = {}

    def _connection(self) -> Any:
        """The connection, with its API key (and any secret extra) registered with Airflow's
        secrets masker before anything can log it (:mod:`mailflow.masking`)."""
        from mailflow.masking import mask_connection

        conn = self.get_connection(self.resend_conn_id)
        mask_connection(conn)
        return conn

    def settings(self) -> dict[str, Any]:
        """Connection settings with defaults applied (no secret): base_url, requests_per_second
        (float, requests/s), target_fraction (0-1], batch_validation, timeouts (s), pacer_conn_id,
        max_retry_after_seconds (s: a longer Retry-After stops the run with an alert; every sender is
        held at most this long).

        :raises ValueError: if the connection has no API key, naming the connection, or a numeric extra
            is not a number in its range (naming the connection, the extra and the range): every one
            ``> 0``, target_fraction at most 1, max_retry_after_seconds at most ``pacing.MAX_HOLD_SECONDS``.
            An absent or empty extra takes its default; an explicit 0 is refused.
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
            "requests_per_second": self._number(extra, "requests_per_second", 10.0),
            "target_fraction": self._number(extra, "target_fraction", 0.8, upper=1.0),
            "batch_validation": str(extra.get("batch_validation") or "permissive"),
            "timeout_seconds": self._number(extra, "timeout_seconds", 30.0),
            "connect_timeout_seconds": self._number(extra, "connect_timeout_seconds", 5.0),
            "pacer_conn_id": str(extra.get("pacer_conn_id") or "send_log_db"),
            "max_retry_after_seconds": check_max_hold(self._number(
                extra, "max_retry_after_seconds", DEFAULT_MAX_HOLD_SECONDS, upper=MAX_HOLD_SECONDS)),
        }

    def _number(self, extra: dict[str, Any], name: str, default: float, upper: float | None = None) -> float:
        """The numeric extra ``name`` in ``(0, upper]`` (no upper bound when None); ``default`` only
        when the extra is absent, null or empty (an explicit 0 is a mistake, not "use the default").

        :raises ValueError: naming the connection, the extra and the allowed range, for a value that
            is not a finite number in that range.
        """
        raw = extra.get(name)
        if raw is None or (isinstance(raw, str) and not raw.strip()):
            return default
        try:
            value = float(raw) if not isinstance(raw, bool) else math.nan
        except (TypeError, ValueError):
            value = math.nan
        if not (math.isfinite(value) and value > 0 and (upper is None or value <= upper)):
            allowed = f"(0, {upper:g}]" if upper is not None else "(0, inf)"
            raise ValueError(f"connection {self.resend_conn_id!r}: extra {name!r} must be a number in {allowed}, "
                             f"got {raw!r}")
        return value

    def previous_api_keys(self) -> list[str]:
        """The connection's ``previous_api_keys`` extra: a JSON list of keys (or one key, or several
        separated by commas or whitespace), empty entries dropped, in the order given. Secrets:
        registered with the masker before they are returned (:mod:`mailflow.masking`)."""
        raw = (self._connection().extra_dejson or {}).get("previous_api_keys") or []
        items = raw.replace(",", " ").split() if isinstance(raw, str) else [str(k) for k in raw]
        from mailflow.masking import mask

        keys = [k.strip() for k in items if k and k.strip()]
        mask(keys)  # each key on its own (a separated string was masked whole)
        return keys

    def key_identities(self) -> tuple[str, list[str]]:
        """``(current, previous)``: the non-secret identities (:func:`~mailflow.provider.client.key_identity`)
        of the connection's key and of its ``previous_api_keys``, as stored with each batch.

        :raises ValueError: if the connection has no API key.
        """
        self.settings()  # raises if the connection has no API key
        current = key_identity(str(self._connection().password))
        previous = [key_identity(k) for k in self.previous_api_keys()]
        return current, [i for i in dict.fromkeys(previous) if i != current]

    def previous_clients(self) -> dict[str, Callable[[], ResendClient]]:
        """Identity -> factory of a client for each previous API key other than the connection's own
        (for the reconciler's resends of batches first sent under that key). A client is built on first call and kept; it shares the
        base URL, timeouts, retry policy, clock and pacer of :meth:`get_conn`'s client (one rate limit per
        account), so call :meth:`get_conn` first. :meth:`close` closes them."""
        s = self.settings()
        base = s["base_url"]
        current = key_identity(str(self._connection().password))
        keys = {i: k for k in self.previous_api_keys() if (i := key_identity(k)) != current}

        def factory(identity: str) -> Callable[[], ResendClient]:
            def build() -> ResendClient:
                if identity not in self._previous:
                    own = self.get_conn()
                    self._previous[identity] = ResendClient(
                        base, keys[identity], pacer=own.pacer, clock=own.clock, validation=own.validation,
                        policy=own.policy, conn_id=self.resend_conn_id,
                        timeout=httpx.Timeout(s["timeout_seconds"], connect=s["connect_timeout_seconds"]))
                return self._previous[identity]
            return build

        return {identity: factory(identity) for identity in keys}

    def close(self) -> None:
        """Close every client this hook built (the current key's and the previous keys')."""
        for client in [self._client, *self._previous.values()]:
            if client is not None:
                client.close()
        self._client = None
        self._previous = {}

    def shared_pacer(self) -> PostgresPacer:
        """The account's slot schedule in the pacing database (shared by every sender)."""
        from airflow.providers.postgres.hooks.postgres import PostgresHook

        s = self.settings()
        pg = PostgresHook(postgres_conn_id=s["pacer_conn_id"])
        from mailflow.masking import mask_connection

        mask_connection(pg.get_connection(s["pacer_conn_id"]))  # its password never reaches a log
        connect = cast("Callable[[], psycopg.Connection]", pg.get_conn)
        return PostgresPacer(connect, account=s["base_url"],
                             requests_per_second=s["requests_per_second"], target_fraction=s["target_fraction"],
                             max_hold=s["max_retry_after_seconds"])

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
                validation=s["batch_validation"], conn_id=self.resend_conn_id,
                policy=policy or RetryPolicy(max_retry_after=s["max_retry_after_seconds"]),
                timeout=httpx.Timeout(s["timeout_seconds"], connect=s["connect_timeout_seconds"]),
            )
        return self._client

    def test_connection(self) -> tuple[bool, str]:
        """Check the key without sending mail; return ``(ok, message)``, never the key.

        Resend's sending-only keys (the kind Resend recommends for sending) get 401
        ``restricted_api_key`` on everything but sending, so ``GET /domains`` alone would call a good
        sending key bad. So, first a request a sending key may make: ``POST /emails/batch`` with an
        empty array. The contract allows 1 to 100 emails, so the body is always refused by validation
        (400/422) and nothing can be sent; an unknown key is refused before that (401/403). Then
        ``GET /domains`` tells full access (200) from sending-only (401 ``restricted_api_key``), and
        confirms an unknown key (403 ``invalid_api_key`` on every endpoint), should a provider ever
        validate the body before the key. ok is True for a valid key of either type; the message says
        which DAGs it serves.
        """
        from mailflow.provider.client import error_fields
        from mailflow.provider.errors import describe_refusal

        try:
            s = self.settings()
            conn = self._connection()
            with httpx.Client(base_url=s["base_url"], timeout=httpx.Timeout(10.0),
                              headers={"Authorization": f"Bearer {conn.password}"}) as http:
                probe = http.post("/emails/batch", content=b"[]", headers={
                    "Content-Type": "application/json", "x-batch-validation": "strict"})
                domains = http.get("/domains") if probe.status_code not in (401, 403) else None
        except Exception as exc:  # a connection test reports, it does not raise
            return False, f"{type(exc).__name__}: {exc}"
        base, cid = s["base_url"], self.resend_conn_id
        if probe.status_code in (401, 403):
            return False, describe_refusal(probe.status_code, *error_fields(probe), cid).message
        if probe.status_code not in (200, 400, 422):
            name, message = error_fields(probe)
            return False, (f"{base} answered the sending probe (POST /emails/batch []) with HTTP {probe.status_code} "
                           f"{name}: {message}; the key could not be checked, try again")
        assert domains is not None
        if domains.status_code == 200:
            names = [str(d.get("name")) for d in (domains.json().get("data") or []) if isinstance(d, dict)]
            return True, (f"API key accepted by {base} with full access: every DAG can use connection {cid!r} "
                          f"(domains: {', '.join(names) or 'none verified'})")
        name, message = error_fields(domains)
        if domains.status_code == 401 and name == "restricted_api_key":
            return True, (f"API key accepted by {base} for sending only (GET /domains: 401 restricted_api_key): "
                          "lifecycle_emails, dispatch_scheduled_emails and reconcile_send_log work; "
                          "deliverability_feedback reads emails and needs a full-access key (set "
                          "MAILFLOW_FEEDBACK_CONN_ID to a connection that holds one)")
        if domains.status_code == 403:
            return False, describe_refusal(403, name, message, cid).message
        return True, (f"API key accepted by {base} for sending; GET /domains answered HTTP {domains.status_code} "
                      f"{name}: {message}")
