"""The approval step of ``provision_campaign``: Airflow's ``ApprovalOperator`` (a Required Action
in the UI, answered there or through the REST API's ``hitlDetails``), with

* the wait bounded per run by Param ``approval_timeout_hours`` (the operator's ``response_timeout``;
  Airflow's scheduler applies the default answer, Reject, when it passes: an unanswered approval
  expires like a rejection);
* a rejection or an expiry recorded as a campaign event (``approval_rejected`` /
  ``approval_expired``); the campaign stays as it was (a draft stays a draft, nothing scheduled).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator

from mailflow.orchestration.campaign_tasks import DEFAULT_APPROVAL_TIMEOUT_HOURS, record_decision, task_path


class CampaignApprovalOperator(ApprovalOperator):
    """Approve provisioning a campaign (options Approve / Reject; default Reject on expiry)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("defaults", [ApprovalOperator.REJECT])
        kwargs.setdefault("response_timeout", timedelta(hours=DEFAULT_APPROVAL_TIMEOUT_HOURS))
        super().__init__(**kwargs)

    def execute(self, context: Any) -> Any:
        hours = context["params"].get("approval_timeout_hours")
        if hours:
            self.response_timeout = timedelta(hours=float(hours))
        return super().execute(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        chosen = event.get("chosen_options") or []
        if "error" not in event and chosen and chosen[0] != self.APPROVE:
            # recorded first: on a rejection the base class skips the downstream tasks by raising
            record_decision(str(context["params"]["campaign"]).strip(), False, bool(event.get("timedout")),
                            event.get("responded_by_user"), task_path(context))
        return super().execute_complete(context=context, event=event)
