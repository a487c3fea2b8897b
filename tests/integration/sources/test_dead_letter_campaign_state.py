"""A person's `dead-letters resend` decision on scheduled rows must not leave them `pending` in a
campaign that nothing dispatches (completed or cancelled meanwhile)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from scheduled_rig import Rig, provisioned, rig  # noqa: F401  (fixture)

from mailflow.cli import decide_dead_letters
from mailflow.model.outcome import RunContext, SendError
from mailflow.reconciler import reconcile
from mailflow.sources.scheduled.control import cancel

REPAIR = RunContext(dag_id="reconcile_send_log", run_id="r", task_id="reconcile")


def _dead_letters_in_finished_campaign(rig: Rig) -> tuple[int, list[int]]:
    cid = provisioned(rig, 4)
    rig.emulator.configure(outage=True)
    with pytest.raises(SendError):
        rig.dispatch(batch_size=2)  # one batch of 2 in flight when the outage began: ambiguous
    rig.emulator.configure(outage=False)
    rig.db.execute("update mail.send_batch set created_at = created_at - interval '24 hours'")
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - interval '24 hours' where claimed_at is not null")
    now = rig.db.execute("select now()").fetchone()[0]  # type: ignore[index]
    reconcile(rig.conn(), rig.client(), now=now, stale_after=timedelta(0), run=REPAIR)
    dead = [r["id"] for r in rig.rows("dead_lettered_at is not null")]
    assert len(dead) == 2
    rig.dispatch(batch_size=10)  # the other two are sent; nothing pending or sending: completed
    return cid, dead


def test_resend_decision_in_a_completed_campaign_is_dispatched(rig: Rig) -> None:
    cid, dead = _dead_letters_in_finished_campaign(rig)
    assert rig.campaign_row(cid)["status"] == "completed"
    assert decide_dead_letters(rig.db, "resend", dead, "ops@example.com", "outage processed nothing") == dead
    # the campaign dispatches them again (not pending forever in a campaign nothing picks up)
    assert rig.campaign_row(cid)["status"] == "scheduled"
    summary = rig.dispatch(batch_size=10)
    assert summary.sent == 2
    assert {r["status"] for r in rig.rows()} == {"sent"}


def test_resend_decision_in_a_cancelled_campaign_is_not_left_pending(rig: Rig) -> None:
    cid, dead = _dead_letters_in_finished_campaign(rig)
    rig.db.execute("update mail.campaign set status = 'scheduled' where id = %s", (cid,))
    cancel(rig.db, cid, actor="ops")
    decide_dead_letters(rig.db, "resend", dead, "ops@example.com", "outage processed nothing")
    rows = {r["id"]: r for r in rig.rows()}
    assert [rows[i]["status"] for i in dead] == ["cancelled", "cancelled"]


def test_reopen_refused_in_a_cancelled_campaign_does_not_leave_rows_pending(rig: Rig) -> None:
    from mailflow.store.send_log import reopen_refused

    cid = provisioned(rig, 2, name="cancelled_bad_from")
    ids = [r["id"] for r in rig.rows()]
    rig.db.execute("update mail.send_log set status = 'failed', attempts = 1, claimed_at = now(),"
                   " error = 'Invalid `from` field. The email address needs to follow the `email@example.com`'"
                   " where id = any(%s)", (ids,))
    cancel(rig.db, cid, actor="ops")
    done = reopen_refused(rig.db, "cancelled_bad_from", "from", apply=True)
    assert done.reopened == 2
    assert [r["status"] for r in rig.rows()] == ["cancelled", "cancelled"]
