"""Scheduled campaigns: provisioning (one planned ``pending`` row per recipient), dispatch (send
due rows close to their time), and the operator's controls (create, cancel, pause, resume,
complete, status). Plain Python over a psycopg 3 connection; Airflow is imported only inside the
``*_task`` callables the DAGs call.

A campaign (``mail.campaign``) is a plan, :class:`mailflow.sources.scheduled.planning.PlanSpec` (IANA timezone,
emails per day, ISO weekdays, local windows) anchored at a start, plus a recipient list (a SQL file
in ``campaigns/recipients/`` or an uploaded table such as ``mail.campaign_recipient``). Each email
is one ``kind = 'scheduled'`` row of ``mail.send_log`` with ``scheduled_at`` (UTC) and the lifecycle
``pending -> sending -> sent | failed | cancelled``; the send log is shared with the lifecycle
DAG, so its cooldown and the analytics see both kinds.

**The plan.** Recipients are taken in ``user_id`` order; the i-th gets the i-th instant of
``plan_send_times(spec, ., plan_start)`` after ``plan_skip`` instants. ``plan_start`` is
``max(start_at, now)`` at the first provisioning. Provisioning runs in chunks; each chunk's rows and
the checkpoint (``provision_cursor`` = last user_id, ``planned_through`` = last instant used) commit
in one transaction, so a killed run resumes exactly where it stopped. A chunk continues the plan by
re-planning the local day of ``planned_through`` from its start and skipping the instants already
used, which gives exactly the instants of one uninterrupted plan (the planner spreads a day's slots
over the whole day, so "plan from the instant after the last slot" would not). If the continuation
would start in the past (provisioning resumed after its plan ran out), the plan is re-anchored at
``now`` as a resume is (below).

**Pause / resume rule.** Pause stops dispatch (only ``scheduled`` campaigns are dispatched); rows
keep their times. Resume: if no pending row's time passed, nothing moves. Otherwise every pending
row is **re-planned in its original order from the resume instant** with the planner: the overdue
rows take the next slots in the campaign's windows and everyone after them shifts back, so no
burst is sent, every email stays inside the windows and the pace stays ``emails_per_day``. The
first (resume) local day gets only the slots left after the campaign's emails already sent that
day (``plan_skip`` drops that many of its earliest slots), so the daily cap holds on that day too.
Nobody is skipped, nobody is duplicated: rows keep their identity. Every other release of a held
campaign re-plans the same way (:mod:`.replan`): the reputation guard's resume (of the campaigns it
paused and of those it held while ``scheduled``) and a canary release. Behind the plan, the dispatcher's
per-day cap (:meth:`.claiming.Dispatcher.over_cap`): a claim never takes a campaign past
``emails_per_day`` on one plan day; with more rows due than that, it re-plans them from now instead.
Why a campaign is held: :mod:`.holds`.

**Dispatch** claims due rows (``status = 'pending' and scheduled_at <= now()``, campaign
``scheduled``) with ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)``, at most 100
of one campaign per batch, renders them, stores the batch bytes, all in one transaction, then sends
through the same client, pacer and ``PostgresStore.apply`` as the lifecycle DAG.

CLI: ``mailflow campaign create|update|provision|pause|resume|cancel|status|complete ...`` (:mod:`.cli`).
"""

from __future__ import annotations

from mailflow.sources.scheduled.campaign_db import CampaignStateError
from mailflow.sources.scheduled.claiming import DispatchSummary
from mailflow.sources.scheduled.cli import main
from mailflow.sources.scheduled.control import cancel, complete, pause, resume, status
from mailflow.sources.scheduled.dispatcher import (
    BATCH_SIZE,
    COALESCE_SECONDS,
    DISPATCH_BUDGET_SECONDS,
    POLL_SECONDS,
    SEND_GRACE_SECONDS,
    dispatch,
)
from mailflow.sources.scheduled.planning import plan_after, plan_spec
from mailflow.sources.scheduled.provisioning import ProvisionSummary, provision
from mailflow.sources.scheduled.spec import (
    create_campaign,
    load_spec,
    resolve_campaign,
    update_draft,
    upload_recipients,
)

__all__ = [
    "BATCH_SIZE", "COALESCE_SECONDS", "CampaignStateError", "DISPATCH_BUDGET_SECONDS",
    "DispatchSummary", "POLL_SECONDS", "ProvisionSummary", "SEND_GRACE_SECONDS", "cancel",
    "complete", "create_campaign", "dispatch", "load_spec", "main", "pause", "plan_after",
    "plan_spec", "provision", "resolve_campaign", "resume", "status", "update_draft", "upload_recipients",
]
