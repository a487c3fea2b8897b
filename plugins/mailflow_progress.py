"""Airflow plugin: the live mail campaign progress page (``mailflow.orchestration.ui.progress``).

* ``fastapi_apps``: the page and its JSON / server-sent-events API, mounted in the API server at
  ``/mailflow`` and protected by Airflow's own auth dependencies (401 without a token).
* ``external_views``: "Mail campaigns" in the navigation's Browse menu; the UI shows the page in a
  frame at ``/plugin/mailflow``.

The app is built lazily (only the API server reads ``fastapi_apps``): every Airflow process imports
plugins, and task processes should not pay for the API server's imports.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.plugins_manager import AirflowPlugin

URL_PREFIX = "/mailflow"


class MailflowProgressPlugin(AirflowPlugin):
    """Campaign progress (counts by state, send rate, ETA) from the send log, live while sending."""

    name = "mailflow_progress"
    external_views = [
        {
            "name": "Mail campaigns",
            "href": "mailflow/",  # relative to the UI's base URL
            "url_route": "mailflow",
            "destination": "nav",
            "category": "browse",
        }
    ]

    @cached_property
    def fastapi_apps(self) -> list[dict[str, Any]]:  # type: ignore[override]
        from mailflow.orchestration.ui.progress import create_app

        return [{"app": create_app(), "url_prefix": URL_PREFIX, "name": "mailflow campaign progress"}]
