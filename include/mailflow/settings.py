"""Per-environment settings (environment variables) and secrets (Airflow connections).

Tiers (see docs/operations.md): credentials in Connections (``send_log_db``, ``resend_default``,
``mail_unsubscribe``, ``mail_webhook``); per-environment values in env vars (below); run-time choices in DAG Params;
campaign definitions in the campaigns folder (:mod:`mailflow.campaigns.folder`, ``MAILFLOW_CAMPAIGNS_DIR``).
"""

from __future__ import annotations

import os
from pathlib import Path

SEND_LOG_CONN_ID = os.environ.get("MAILFLOW_SEND_LOG_CONN_ID", "send_log_db")
RESEND_CONN_ID = os.environ.get("MAILFLOW_RESEND_CONN_ID", "resend_default")
UNSUBSCRIBE_CONN_ID = os.environ.get("MAILFLOW_UNSUBSCRIBE_CONN_ID", "mail_unsubscribe")
FEEDBACK_CONN_ID = os.environ.get("MAILFLOW_FEEDBACK_CONN_ID", RESEND_CONN_ID)
"""The deliverability_feedback DAG's provider connection: it reads emails (GET /emails/{id}), which
needs a **full-access** API key. Point it at a connection of its own (e.g. ``resend_full_access``)
to keep the senders on a sending-only key."""
WEBHOOK_CONN_ID = os.environ.get("MAILFLOW_WEBHOOK_CONN_ID", "mail_webhook")
"""The webhook receiver's signing secrets: password = one or more ``whsec_...`` (whitespace or comma
separated; the newest first while rotating). See docs/feedback.md."""


UNSUBSCRIBE_PATH = "/mailflow-unsubscribe"
"""Where the unsubscribe endpoint lives under the public URL, wherever it runs: the Airflow plugin
mounts it there in the API server and the standalone app serves it there too (and at ``/u/`` for
links sent before). mailflow's other public endpoints sit next to it under the same public URL."""


def public_url() -> str:
    """Public base URL of mailflow's endpoints (``MAILFLOW_PUBLIC_URL``): the Airflow API server's
    address as recipients reach it (``https://airflow.example.com``), or the domain in front of the
    standalone app (``https://mail.example.com``), with any path prefix a proxy adds."""
    return os.environ.get("MAILFLOW_PUBLIC_URL", "https://mail.example.com")


def unsubscribe_base_url(public: str | None = None) -> str:
    """Base of every unsubscribe link (``<base>/u/<token>``): ``public`` (default
    :func:`public_url`) followed by :data:`UNSUBSCRIBE_PATH`, which is added once: a public URL
    that already ends with it (``https://airflow.example.com/mailflow-unsubscribe``) is kept as is,
    so both spellings give links the endpoint answers.

    >>> unsubscribe_base_url("http://localhost:8080/")
    'http://localhost:8080/mailflow-unsubscribe'
    >>> unsubscribe_base_url("https://a.example.com/mailflow-unsubscribe")
    'https://a.example.com/mailflow-unsubscribe'
    """
    base = (public_url() if public is None else public).strip().rstrip("/")
    return base if base.endswith(UNSUBSCRIBE_PATH) else base + UNSUBSCRIBE_PATH


def app_url() -> str:
    """Base URL of the product, used by templates (``MAILFLOW_APP_URL``)."""
    return os.environ.get("MAILFLOW_APP_URL", "https://app.example.com")


def stale_after_seconds() -> float:
    """A ``sending`` claim older than this is stale (``MAILFLOW_STALE_AFTER_SECONDS``, 900 = 15 min)."""
    return float(os.environ.get("MAILFLOW_STALE_AFTER_SECONDS", "900"))


def pipelined() -> bool:
    """Pipelined sending in the DAG tasks (``MAILFLOW_PIPELINED``, default on; ``0``/``false``/``no``
    turns it off): chunk N+1 is prepared while chunk N is in flight (docs/performance.md)."""
    return os.environ.get("MAILFLOW_PIPELINED", "1").strip().lower() not in ("0", "false", "no", "off")


def dags_folder() -> Path:
    """Airflow's DAG folder as the environment gives it: ``AIRFLOW__CORE__DAGS_FOLDER``, else
    ``$AIRFLOW_HOME/dags`` (``~/airflow/dags``), Airflow's own default. A value set only in
    ``airflow.cfg`` is not seen here; tasks pass their DAG file's folder instead (the DAG bundle as
    the worker sees it), and the campaigns folder can be named by ``MAILFLOW_CAMPAIGNS_DIR``."""
    configured = os.environ.get("AIRFLOW__CORE__DAGS_FOLDER", "").strip()
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("AIRFLOW_HOME", "~/airflow")).expanduser() / "dags"
