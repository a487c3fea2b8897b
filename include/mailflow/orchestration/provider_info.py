"""Airflow provider info for the ``resend`` connection type (``apache_airflow_provider`` entry point).

Airflow 3.2+ builds the connection form from this metadata, not from hook methods: hidden fields,
labels and placeholders come from ``ui-field-behaviour``; the extra fields from ``conn-fields``.
``package-name`` must equal the distribution name (``mailflow`` in pyproject.toml).
"""

from __future__ import annotations

from typing import Any


def get_provider_info() -> dict[str, Any]:
    """Return the provider metadata dict read by Airflow's ProvidersManager."""
    return {
        "package-name": "mailflow",
        "name": "mailflow",
        "description": "Lifecycle and scheduled email campaigns with a PostgreSQL send log; "
        "a Resend-compatible email API connection.",
        "versions": ["0.1.0"],
        "connection-types": [
            {
                "connection-type": "resend",
                "hook-class-name": "mailflow.provider.hook.ResendHook",
                "hook-name": "Resend (email API)",
                "conn-fields": {
                    "requests_per_second": {
                        "label": "Rate limit (requests/s)",
                        "description": "The provider's cap for the whole team/account (Resend: 2, 5 or 10).",
                        "schema": {"type": ["number", "null"], "default": 10},
                    },
                    "target_fraction": {
                        "label": "Target fraction of the cap",
                        "description": "Pace requests at this fraction of the cap (0-1], default 0.8.",
                        "schema": {"type": ["number", "null"], "default": 0.8},
                    },
                    "batch_validation": {
                        "label": "Batch validation",
                        "schema": {"type": ["string", "null"], "default": "permissive",
                                   "enum": ["permissive", "strict"]},
                    },
                    "timeout_seconds": {
                        "label": "Read timeout (s)",
                        "schema": {"type": ["number", "null"], "default": 30},
                    },
                    "connect_timeout_seconds": {
                        "label": "Connect timeout (s)",
                        "schema": {"type": ["number", "null"], "default": 5},
                    },
                    "max_retry_after_seconds": {
                        "label": "Longest rate-limit wait (s)",
                        "description": "A Retry-After above this stops the run with an alert; every sender "
                                       "is held at most this long (default 60, at most 120).",
                        "schema": {"type": ["number", "null"], "default": 60},
                    },
                    "pacer_conn_id": {
                        "label": "Shared pacing database connection",
                        "description": "Postgres connection holding mail.rate_slot (default send_log_db).",
                        "schema": {"type": ["string", "null"], "default": "send_log_db"},
                    },
                },
                "ui-field-behaviour": {
                    "hidden-fields": ["schema", "login", "port"],
                    "relabeling": {"host": "API base URL", "password": "API key"},
                    "placeholders": {"host": "https://api.resend.com", "password": "re_..."},
                },
            }
        ],
    }
