"""The approval step of ``provision_campaign``: Airflow's ``ApprovalOperator`` (a Required Action
in the UI, answered there or through the REST API's ``hitlDetails``), with

* the wait bounded per run by Param ``approval_timeout_hours`` (the operator's ``response_timeout``;
  Airflow's scheduler applies the default answer, Reject, when it passes: an unanswered approval
  expires like a rejection);
* every answer recorded on the plan's approval request (``mail.campaign_approval``: approved,
  rejected or expired, by whom) and as a campaign event (``approval_approved`` /
  ``approval_rejected`` / ``approval_expired``, ``detail.responded_by`` naming the responder); on a
  rejection or an expiry the campaign stays as it was (a draft stays a draft, nothing scheduled).
  What an Approve approves is the fingerprint the plan showed: ``provision`` checks it
  (:mod:`mailflow.sources.scheduled.approval`).
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
        if "error" not in event and chosen:
            # recorded first: on a rejection the base class skips the downstream tasks by raising
            planned = context["ti"].xcom_pull(task_ids="plan") or {}
            record_decision(str(context["params"]["campaign"]).strip(), (planned.get("approval") or {}).get("id"),
                            chosen[0] == self.APPROVE, bool(event.get("timedout")), event.get("responded_by_user"),
                            task_path(context))
        return super().execute_complete(context=context, event=event)
