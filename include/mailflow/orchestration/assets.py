"""Airflow Assets produced by mailflow DAGs, so analyst DAGs can be scheduled on them.

``SEND_LOG`` is updated by every task that changes ``mail.send_log`` (lifecycle sends, scheduled
dispatch, reconcile). An analyst DAG: ``DAG(..., schedule=[SEND_LOG])``.
"""

from __future__ import annotations

from airflow.sdk import Asset

SEND_LOG = Asset(name="mail.send_log", uri="mailflow://send_log_db/mail/send_log", group="mailflow")
