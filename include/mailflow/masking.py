"""Register the secrets read from Airflow connections with Airflow's secrets masker.

Airflow masks a connection's password and the extra fields whose *names* look sensitive
(``password``, ``secret``, ``api_key``, ...) only in some code paths, and never a field such as
``old_keys`` (the unsubscribe signing keys kept for rotation, which still verify tokens) or
``previous_api_keys`` (earlier provider keys kept for the reconciler's resends). Every
function that reads a secret from a connection calls :func:`mask_connection` first, so the values
are replaced by ``***`` in task logs (and in the supervisor's output) whatever logs them later.

Uses ``airflow.sdk.log.mask_secret`` (Airflow 3: masks in the task process and tells the
supervisor process; the older ``airflow.sdk.execution_time.secrets_masker`` import is deprecated).
Outside Airflow (CLI, tests without Airflow) masking is a no-op.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

SECRET_EXTRA_KEYS = ("old_keys", "previous_api_keys")
"""Extra fields of our connections whose values are secrets although their names do not say so."""


def mask(value: Any) -> None:
    """Register ``value`` (a string, or every string inside a dict or list) with the masker; the
    URL-quoted form too (connection URIs). Empty values are skipped."""
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:  # not running under Airflow
        return
    if isinstance(value, dict):
        for item in value.values():
            mask(item)
    elif isinstance(value, list | tuple):
        for item in value:
            mask(item)
    elif isinstance(value, str) and value:
        mask_secret(value)
        if quote(value, safe="") != value:
            mask_secret(quote(value, safe=""))


def mask_connection(conn: Any) -> None:
    """Mask a connection's password and the secret extras (:data:`SECRET_EXTRA_KEYS`, plus any
    extra whose name Airflow deems sensitive)."""
    mask(getattr(conn, "password", None))
    extra = getattr(conn, "extra_dejson", None) or {}
    for key in SECRET_EXTRA_KEYS:
        mask(extra.get(key))
    try:
        from airflow.sdk.log import mask_secret
    except ImportError:
        return
    if extra:
        mask_secret(extra)  # keys with sensitive names (password, secret, token, api_key, ...)
