"""Task callables of the scheduled-campaign DAGs driven from the Airflow UI: ``campaign_create``
(create or update a draft from the generated form), ``provision_campaign`` (plan, optional test
email, human approval, provision) and ``campaign_control`` (pause, resume, cancel, complete,
status). Campaigns are named, never numbered, in every form.

Input errors (a refused field, an unknown campaign name, a campaign in the wrong status, a conf
key that is no Param) fail the task with :class:`airflow.sdk.exceptions.AirflowFailException`:
no retries, since the same input fails again; nothing partial is written (each write is one
transaction)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from mailflow import settings
from mailflow.orchestration.run_conf import check_run_conf

log = logging.getLogger(__name__)

ACTIONS = ("pause", "resume", "cancel", "complete", "status")
"""The ``campaign_control`` actions (:mod:`mailflow.sources.scheduled.control`)."""

DEFAULT_APPROVAL_TIMEOUT_HOURS = 72.0
"""Hours an approval request waits for an answer before it expires like a rejection."""


def _fail(message: str) -> Exception:
    from airflow.sdk.exceptions import AirflowFailException

    return AirflowFailException(message)


def task_path(context: Mapping[str, Any]) -> str:
    """``<dag_id>/<run_id>/<task_id>`` of the task."""
    ti = context.get("ti")
    return f"{getattr(ti, 'dag_id', '?')}/{getattr(ti, 'run_id', '?')}/{getattr(ti, 'task_id', '?')}"


def actor(context: Mapping[str, Any]) -> str:
    """Who acts, for campaign events: ``<user> via <dag_id>/<run_id>/<task_id>`` (the user who
    triggered the run, when Airflow knows it) or the task path alone."""
    user = getattr(context.get("dag_run"), "triggering_user_name", None)
    return f"{user} via {task_path(context)}" if user else task_path(context)


def campaign_by_name(conn: psycopg.Connection, name: Any) -> dict[str, Any]:
    """The ``mail.campaign`` row named ``name``.

    :raises AirflowFailException: if the name is empty or no campaign has it (not retried).
    """
    from mailflow.store.scheduled import ScheduledStore

    if not isinstance(name, str) or not name.strip():
        raise _fail(f"Param campaign: give the campaign's name, got {name!r}")
    with conn.transaction():
        row = ScheduledStore(conn).campaign_by_name(name.strip())
    if row is None:
        raise _fail(f"Param campaign: no campaign named {name.strip()!r} in mail.campaign "
                    f"(create it with the campaign_create DAG or `mailflow campaign create`)")
    return row


# -- campaign_create ------------------------------------------------------------------------------


def create_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """``campaign_create``: validate the run's Params as a
    :class:`~mailflow.sources.scheduled.definition.CampaignDefinition` and create the ``draft``
    campaign, or with Param ``update`` replace the definition of the existing draft of that name.
    Returns the campaign's status (:func:`mailflow.sources.scheduled.control.status`).

    :raises AirflowFailException: naming the field for refused input (an unknown conf key, a field
        the model refuses, a missing template or recipients file, a name in use), without retries;
        nothing is written.
    """
    from mailflow.orchestration.campaign_params import definition_from_params
    from mailflow.orchestration.tasks import campaign_folder, send_log_connection
    from mailflow.sources.scheduled.control import status
    from mailflow.sources.scheduled.definition import CampaignDefinitionError, parse_definition
    from mailflow.sources.scheduled.spec import create_campaign, update_draft
    from mailflow.store.migrate import require_current

    check_run_conf(context)
    params = context["params"]
    try:
        definition = parse_definition(definition_from_params(params))
    except CampaignDefinitionError as exc:
        raise _fail(str(exc)) from None
    spec = definition.as_spec()
    folder = campaign_folder(context)
    who = actor(context)
    with send_log_connection() as conn:
        conn.autocommit = True  # the create (or update) is one explicit transaction
        require_current(conn)
        try:
            if params.get("update"):
                campaign_id = update_draft(conn, definition.name, spec, actor=who, folder=folder)
            else:
                campaign_id = create_campaign(conn, spec, actor=who, folder=folder)
        except psycopg.errors.UniqueViolation:
            raise _fail(f"name: a campaign named {definition.name!r} exists already (set update to replace a "
                        f"draft's definition, or choose another name)") from None
        except (ValueError, LookupError) as exc:
            raise _fail(str(exc)) from None
        out = status(conn, int(campaign_id))
    log.info("campaign %s %s: %s", definition.name, "updated" if params.get("update") else "created",
             json.dumps(out, default=str))
    return out


# -- provision_campaign ---------------------------------------------------------------------------


def _provisionable(conn: psycopg.Connection, context: Mapping[str, Any]) -> dict[str, Any]:
    c = campaign_by_name(conn, context["params"].get("campaign"))
    if c["status"] in ("cancelled", "completed"):
        raise _fail(f"Param campaign: campaign {c['name']!r} is {c['status']}: nothing to provision")
    return c


def _local(at: str | None, zone: Any) -> str | None:
    if not at:
        return None
    return datetime.fromisoformat(at).astimezone(zone).strftime("%Y-%m-%d %H:%M %Z (%a)")


def plan_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """``provision_campaign``'s first task: the plan of the recipients still to provision (a dry
    run: recipients, first and last send in UTC and local time, emails per day, days spanned, the
    local windows and weekdays), what the contact policy would hold back now
    (:func:`mailflow.sources.scheduled.preview.policy_holdback`), a sample email for the first
    recipient (subject and text) and the campaign's fingerprint
    (:mod:`mailflow.sources.scheduled.approval`: definition, template bytes, recipient snapshot).
    Unless ``dry_run``, it records the approval request of that fingerprint (pending, expiring after
    ``approval_timeout_hours``; the only write). Returns ``{"campaign_id", "campaign", "status",
    "plan", "holdback", "sample", "approval", "test_emails", "approval_text"}`` (``approval``: ``{"id"``
    (None on a dry run), ``"fingerprint", "recipient_count", "recipients_sha256", "files"}``;
    ``test_emails``: the test emails sent so far with their outcomes,
    :func:`mailflow.store.test_emails.of_campaign`; ``approval_text``: the Markdown the approval shows).

    :raises AirflowFailException: for an unknown conf key, an unknown name, a cancelled or completed
        campaign, or a stored definition that cannot be provisioned (a missing template or
        recipients file, a subject that does not render), naming it; not retried.
    """
    from mailflow.campaigns.templating import check_campaign_templates
    from mailflow.orchestration.tasks import campaign_folder, renderer_for, send_log_connection
    from mailflow.sources.scheduled.approval import open_request
    from mailflow.sources.scheduled.planning import plan_spec
    from mailflow.sources.scheduled.preview import policy_holdback, sample_email
    from mailflow.sources.scheduled.provisioning import current_fingerprint, provision
    from mailflow.store import test_emails
    from mailflow.store.migrate import require_current

    check_run_conf(context)
    params = context["params"]
    folder = campaign_folder(context)
    now = datetime.now(UTC)
    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        c = _provisionable(conn, context)
        try:
            spec = plan_spec(c)
            check_campaign_templates(c["name"], c["subject"], c["template"], folder.templates_dir)
            plan = provision(conn, int(c["id"]), now=now, dry_run=True, folder=folder).as_dict()
            holdback = policy_holdback(conn, int(c["id"]), now=now, folder=folder).as_dict()
            sample = sample_email(conn, int(c["id"]), renderer_for(folder), folder)
            tests = test_emails.of_campaign(conn, int(c["id"]))
            with conn.transaction():
                fp = current_fingerprint(conn, c, folder)
        except (ValueError, LookupError) as exc:
            raise _fail(f"campaign {c['name']!r}: its stored definition cannot be provisioned: {exc}") from None
        approval_id = None
        if not params.get("dry_run"):
            hours = float(params.get("approval_timeout_hours") or DEFAULT_APPROVAL_TIMEOUT_HOURS)
            approval_id = open_request(conn, int(c["id"]), fp, requested_by=actor(context),
                                       expires_at=now + timedelta(hours=hours))
    plan["first_send_local"] = _local(plan["first_send"], spec.zone)
    plan["last_send_local"] = _local(plan["last_send"], spec.zone)
    plan["windows"] = [str(w) for w in spec.windows]
    plan["weekdays"] = sorted(spec.weekdays)
    out = {"campaign_id": int(c["id"]), "campaign": c["name"], "status": c["status"], "plan": plan,
           "holdback": holdback,
           "sample": None if sample is None else {k: sample[k] for k in ("user_id", "subject", "text")},
           "approval": {"id": approval_id, "fingerprint": fp.value, "recipient_count": fp.recipient_count,
                        "recipients_sha256": fp.recipients_sha256, "files": fp.files},
           "test_emails": tests}
    out["approval_text"] = approval_text(out)
    log.info("plan of %s: %s", c["name"], json.dumps({k: v for k, v in out.items() if k != "approval_text"},
                                                      default=str))
    return out


_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def approval_text(p: Mapping[str, Any]) -> str:
    """The approval's Markdown body of a :func:`plan_task` result: the plan, the contact policy's
    hold-back, the sample email and the fingerprint being approved."""
    plan, hb, sample = p["plan"], p["holdback"], p["sample"]
    days = ", ".join(_DAYS[d - 1] for d in plan["weekdays"])
    lines = [
        f"### Provision campaign `{p['campaign']}` (now {p['status']})",
        "",
        f"* **Recipients to provision:** {plan['recipients']} ({plan['provisioned_total']} provisioned before)",
        f"* **First send:** {plan['first_send_local'] or '-'} (UTC {plan['first_send'] or '-'})",
        f"* **Last send:** {plan['last_send_local'] or '-'} (UTC {plan['last_send'] or '-'})",
        f"* **Emails per day:** {plan['emails_per_day']} (most on one day: {plan['per_day_max']}), "
        f"over {plan['days_spanned']} days ({plan['sending_days']} sending days)",
        f"* **Local windows ({plan['timezone']}):** {', '.join(plan['windows'])} on {days}",
        "",
        f"**Contact policy now:** {hb['held']} of {hb['checked']} recipients would be held back: "
        f"{hb['suppressed']} suppressed, {hb['cooldown']} in cooldown, {hb['capped']} over a frequency cap, "
        f"{hb['invalid']} invalid address; {hb['no_email']} without an address "
        f"(on_policy = {hb['on_policy']}).",
    ]
    if hb["examples"]:
        lines += [""] + [f"* {e}" for e in hb["examples"]]
    lines.append("")
    if sample is None:
        lines.append("**Sample:** the campaign has no recipients.")
    else:
        text = sample["text"] if len(sample["text"]) <= 3000 else sample["text"][:3000] + "\n[...]"
        lines += [f"**Sample email** (user {sample['user_id']}), subject: {sample['subject']}", "", "```text",
                  text.replace("```", "'''"), "```"]
    a = p.get("approval")
    if a:
        lines += ["", f"**Fingerprint of what you approve:** `{a['fingerprint']}` (approval request "
                      f"#{a['id']}): the definition, the files {', '.join(f'`{f}`' for f in sorted(a['files']))} "
                      f"and {a['recipient_count']} recipients (user ids sha256 `{a['recipients_sha256'][:16]}`). "
                      f"Provisioning refuses anything else: a change of the definition, a file or the recipients "
                      f"before it runs fails it, naming the change, and the campaign stays as it is."]
    return "\n".join(lines)


def test_email_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """``provision_campaign``'s optional test email (Param ``test_email_to``): see
    :func:`mailflow.sources.scheduled.test_email.send_test_email`. Without an address it sends
    nothing (``{"sent": False}``). On a dry run it is skipped, and with it everything after it:
    a dry run stops after the plan.

    :raises AirflowSkipException: on a dry run.
    :raises AirflowFailException: for a bad address, an unknown or finished campaign, or a test
        email the provider refused or may have processed (not retried: a retry could deliver a
        second one); a request proven not processed is retried.
    """
    from airflow.sdk.exceptions import AirflowSkipException

    from mailflow.orchestration.tasks import campaign_folder, renderer_for, send_log_connection
    from mailflow.provider.hook import ResendHook
    from mailflow.sources.scheduled.test_email import TestEmailError, send_test_email
    from mailflow.store.migrate import require_current

    check_run_conf(context)
    params = context["params"]
    if params.get("dry_run"):
        raise AirflowSkipException("dry run: the plan only; no test email, approval or provisioning")
    to = (params.get("test_email_to") or "").strip()
    if not to:
        return {"sent": False}
    folder = campaign_folder(context)
    renderer = renderer_for(folder)
    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        c = _provisionable(conn, context)
        client = ResendHook(settings.RESEND_CONN_ID).get_conn()
        try:
            out = send_test_email(conn, client, int(c["id"]), to, actor(context), renderer=renderer, folder=folder)
        except TestEmailError as exc:
            if exc.retry_safe:
                raise
            raise _fail(str(exc)) from None
        except (ValueError, LookupError) as exc:
            raise _fail(str(exc)) from None
        finally:
            client.close()
    log.info("test email: %s", json.dumps(out))
    return {"sent": True, **out}


def record_decision(campaign: str, approval_id: int | None, approved: bool, timed_out: bool, responder: Any,
                    who: str) -> str | None:
    """Record the answer to the approval request ``approval_id`` of ``campaign`` (the plan's request):
    the request becomes ``approved``, ``rejected`` or ``expired`` (an answer to a request voided
    meanwhile leaves it voided) and the campaign event ``approval_approved`` / ``approval_rejected`` /
    ``approval_expired`` names who acted (``detail.responded_by``: Airflow's ``{"id", "name"}`` of the
    responder, None for an expiry) and the fingerprint; the actor is ``<responder> via <who>``
    (``who``: the approval task's path). The status is unchanged: a draft stays a draft until
    provisioned. Returns the request's state after the answer, or None for a run whose plan recorded
    no request (planned before approvals were recorded: the answer is logged, nothing else).
    """
    from mailflow.orchestration.tasks import send_log_connection
    from mailflow.sources.scheduled.approval import decide

    decision = "approved" if approved else "expired" if timed_out else "rejected"
    if approval_id is None:
        log.warning("campaign %s: the approval was %s, but this run's plan recorded no approval request; "
                    "provision refuses to run without one", campaign, decision)
        return None
    by = dict(responder) if isinstance(responder, Mapping) else None
    with send_log_connection() as conn:
        conn.autocommit = True
        state = decide(conn, int(approval_id), decision, responded_by=by, via=who)
    log.info("campaign %s: approval #%s %s; the request is %s", campaign, approval_id, decision, state)
    return state


def provision_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """``provision_campaign``'s last task, run only when the approval said Approve: provision the
    campaign named by Param ``campaign`` under the approval request its plan recorded
    (``chunk_size`` recipients per transaction; a draft becomes ``scheduled``), only if the
    campaign's fingerprint now equals the approved one. Returns the :class:`ProvisionSummary` as a
    dict, with ``test_emails``: the campaign's test emails and the outcomes recorded for them by then
    (:func:`mailflow.store.test_emails.of_campaign`).

    :raises AirflowFailException: for an unknown name, a stored definition that cannot be
        provisioned, a run whose plan recorded no approval request, or a refused approval (not
        approved any more, or the definition, a file or the recipients changed since the plan:
        the message names each change; nothing is provisioned and a draft stays a draft). Not retried.
    """
    from mailflow.orchestration.tasks import campaign_folder, run_context, send_log_connection
    from mailflow.sources.scheduled.approval import ApprovalRefused
    from mailflow.sources.scheduled.provisioning import provision
    from mailflow.store import test_emails
    from mailflow.store.migrate import require_current

    check_run_conf(context)
    params = context["params"]
    with send_log_connection() as conn:
        require_current(conn)
        c = _provisionable(conn, context)
        planned = context["ti"].xcom_pull(task_ids="plan") or {}
        approval_id = (planned.get("approval") or {}).get("id")
        if approval_id is None:
            raise _fail(f"campaign {c['name']!r}: this run's plan recorded no approval request (planned before "
                        f"approvals had fingerprints?): nothing provisioned; trigger provision_campaign again")
        try:
            summary = provision(conn, int(c["id"]), now=datetime.now(UTC), chunk=int(params.get("chunk_size") or 5000),
                                run=run_context(context), folder=campaign_folder(context),
                                approval_id=int(approval_id))
        except ApprovalRefused as exc:
            raise _fail(str(exc)) from None
        except ValueError as exc:
            raise _fail(f"campaign {c['name']!r}: {exc}") from None
        # what became of the test emails the approver saw (their webhooks arrive while the approval waits)
        tests = test_emails.of_campaign(conn, int(c["id"]))
    out = {**summary.as_dict(), "test_emails": tests}
    log.info("provisioning summary: %s", json.dumps(out))
    return out


# -- campaign_control -----------------------------------------------------------------------------


def control_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """``campaign_control``: Param ``action`` (:data:`ACTIONS`) on the campaign named by Param
    ``campaign`` (:mod:`mailflow.sources.scheduled.control`). Returns what the control returns
    (``complete``: ``{"completed": [names]}``).

    :raises AirflowFailException: for an unknown conf key, an unknown name or action, or an action
        the campaign's status does not allow (naming both); not retried.
    """
    from mailflow.orchestration.tasks import run_context, send_log_connection
    from mailflow.sources.scheduled import control
    from mailflow.sources.scheduled.campaign_db import CampaignStateError
    from mailflow.store.migrate import require_current

    check_run_conf(context)
    action = context["params"].get("action")
    if action not in ACTIONS:
        raise _fail(f"Param action: {action!r} is not one of {', '.join(ACTIONS)}")
    who = actor(context)
    with send_log_connection() as conn:
        conn.autocommit = True
        require_current(conn)
        c = campaign_by_name(conn, context["params"].get("campaign"))
        cid = int(c["id"])
        try:
            out: dict[str, Any]
            if action == "pause":
                out = control.pause(conn, cid, actor=who)
            elif action == "resume":
                out = control.resume(conn, cid, actor=who)
            elif action == "cancel":
                out = control.cancel(conn, cid, actor=who, run=run_context(context))
            elif action == "complete":
                done = control.complete(conn, cid, actor=who)
                if not done:
                    raise CampaignStateError(f"campaign {c['name']!r} is {c['status']}: it completes only when "
                                             f"scheduled, fully provisioned and no row is pending or sending")
                out = {"campaign": c["name"], "completed": done}
            else:
                out = control.status(conn, cid)
        except CampaignStateError as exc:
            raise _fail(str(exc)) from None
    log.info("%s %s: %s", action, c["name"], json.dumps(out, default=str))
    return out
