"""The webhook receiver inside the Airflow 3 API server (``plugins/mailflow_webhooks.py``) and the
``deliverability_feedback`` DAG's webhook tasks (the sweep of pending events and their alerts).

In the API server the signing secrets come from ``MAILFLOW_WEBHOOK_SECRETS`` or the Airflow connection
``mail_webhook`` (password: one or more ``whsec_...``; masked), the database from ``MAILFLOW_WEBHOOK_DSN`` or
the connection ``send_log_db``. Both are looked up on the first request (and the secrets again every few
minutes, so a rotation is picked up), so a missing connection answers 503 and never breaks the API server.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import psycopg

from mailflow import settings
from mailflow.feedback.webhooks import (
    DSN_ENV,
    NoSecrets,
    Unavailable,
    alert_lines,
    apply_pending,
    create_app,
    guard_reputation,
    mark_alerted,
    parse_secrets,
    secrets_from_env,
)
from mailflow.masking import mask_connection
from mailflow.orchestration import metrics
from mailflow.orchestration.send_log_dsn import AirflowDsn

URL_PREFIX = "/mailflow-webhooks"


def secrets_from_airflow() -> list[str]:
    """The signing secrets from the environment, else the Airflow connection ``mail_webhook`` (its
    password, registered with the secrets masker).

    :raises Unavailable: if there is no usable secret anywhere (the message names no secret).
    """
    try:
        return secrets_from_env()
    except NoSecrets as env_error:
        try:
            from airflow.sdk import BaseHook

            conn = BaseHook.get_connection(settings.WEBHOOK_CONN_ID)
        except Exception:
            raise Unavailable(f"{env_error}; and the Airflow connection {settings.WEBHOOK_CONN_ID!r} is not "
                              "defined") from None
        mask_connection(conn)
        try:
            return parse_secrets(conn.password)
        except NoSecrets as exc:
            raise Unavailable(f"connection {settings.WEBHOOK_CONN_ID!r}: {exc}") from None


def _connect(dsn: str) -> psycopg.Connection:
    return psycopg.connect(dsn, connect_timeout=3, autocommit=True, options="-c statement_timeout=10000")


def create_airflow_app() -> Any:
    """The receiver wrapped in a tiny FastAPI app for an Airflow 3 plugin's ``fastapi_apps``.

    Nothing is resolved at import or start-up (see the module docstring). The route is public: the
    provider is not an Airflow user; the signature is its credential.
    """
    from fastapi import FastAPI

    api = FastAPI(title="mailflow webhooks", openapi_url=None, docs_url=None, redoc_url=None)
    api.mount("/", create_app(secrets_from_airflow, AirflowDsn(DSN_ENV, Unavailable, _connect).connect,
                              on_answer=metrics.webhook_event))
    return api


# -- the deliverability_feedback DAG's webhook tasks --------------------------------------------------


def sweep_task(conn: psycopg.Connection, params: Mapping[str, Any]) -> dict[str, Any]:
    """Apply webhook events still waiting for their email (Params ``sweep_limit``: events per run at
    most, ``give_up_hours``: decided ``unknown_email`` after this), in chunks of 500, then let the
    reputation guard evaluate the campaigns that got outcomes. Returns the summed counts.
    """
    from datetime import timedelta

    limit = int(params.get("sweep_limit", 5000))
    give_up = timedelta(hours=float(params.get("give_up_hours", 72)))
    total: dict[str, Any] = {"taken": 0, "applied": 0, "mismatched": 0, "failed": 0, "test_emails": 0,
                             "ignored": 0, "still_pending": 0, "unknown_email": 0, "suppressed": 0}
    campaigns: set[str] = set()
    started = time.monotonic()
    while total["taken"] < limit:
        s = apply_pending(conn, min(500, limit - total["taken"]), give_up_after=give_up)
        for k in total:
            total[k] += getattr(s, k)
        campaigns |= s.campaigns
        if s.taken < 500 or s.applied + s.unknown_email + s.ignored + s.mismatched == 0 \
                or time.monotonic() - started > 300:
            break  # nothing more, or only events still waiting (they are tried again next run)
    if campaigns:
        with conn.transaction():
            total["trips"] = [str(t) for t in guard_reputation(conn, campaigns)]
    total["campaigns"] = sorted(campaigns)
    return total


def alert_task(conn: psycopg.Connection, context: Any) -> dict[str, Any]:
    """One alert for the webhook decisions a person must see (recipient mismatches, provider failures,
    emails never found) that no alert named yet; they are marked alerted in the same transaction,
    after the alert went out. Returns ``{"alerted": n}``."""
    from mailflow.orchestration.alerts import notifier

    with conn.transaction():
        lines, ids = alert_lines(conn)
        if lines:
            shown = [f"  {line}" for line in lines[:50]]
            if len(lines) > 50:
                shown.append(f"  ... and {len(lines) - 50} more")
            header = (f"webhook feedback: {len(lines)} event(s) need a look (recipient mismatches are applied to "
                      "nobody's row; failures suppress nobody; unknown emails were never found in the send log):")
            notifier("\n".join([header, *shown]), subject=f"mailflow: {len(lines)} webhook decision(s) to check")(
                context)
            mark_alerted(conn, ids)
    return {"alerted": len(ids)}
