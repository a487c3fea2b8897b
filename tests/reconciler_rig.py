"""Helpers of the reconciler tests shared with the pipelined-sending tests: the reconciler's run
context, the database clock, ageing claims past the stale threshold."""

from __future__ import annotations

from lifecycle_rig import (
    Rig,
    rig,  # noqa: F401  (fixture)
)

from mailflow.model.outcome import RunContext

REPAIR = RunContext(dag_id="reconcile_send_log", run_id="r1", task_id="reconcile")


def db_now(rig: Rig):
    return rig.db.execute("select now()").fetchone()[0]


def age_claims(rig: Rig, minutes: int, where: str = "true") -> None:
    rig.db.execute(f"update mail.send_log set claimed_at = claimed_at - make_interval(mins => %s) where {where}",
                   (minutes,))
