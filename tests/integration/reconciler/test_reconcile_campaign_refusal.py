"""The reconciler's same-key resend of a stale (so ambiguous) batch answered 2xx with every email
refused for a field of the CAMPAIGN (its `from`): nobody is charged (issue 21, item 11), as on the
senders' own path. Before, the rows were failed for good and `reopen-refused` kept them (ambiguous)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from scheduled_rig import Rig, provisioned, rig  # noqa: F401  (fixture)

from mailflow.model.outcome import RunContext
from mailflow.reconciler import reconcile

BAD_FROM = "Outreach <outreach@@mail.example.com>"  # refused by the provider for every email: `from`
REPAIR = RunContext(dag_id="reconcile_send_log", run_id="r", task_id="reconcile")


class KilledAfterClaim:
    """The dispatcher's process dies as its request goes out: the batch is stored, its rows sending."""

    def __init__(self, inner: Any):
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def send_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt("killed after writing the request")


def test_resent_stale_batch_refused_for_the_campaign_charges_nobody(rig: Rig) -> None:
    cid = provisioned(rig, 2, name="bad_from")
    rig.db.execute("update mail.campaign set from_address = %s where id = %s", (BAD_FROM, cid))
    with pytest.raises(KeyboardInterrupt):
        rig.dispatch(batch_size=2, client=KilledAfterClaim(rig.client()))
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - interval '20 minutes'"
                   " where claimed_at is not null")
    now = rig.db.execute("select now()").fetchone()[0]  # type: ignore[index]

    s = reconcile(rig.conn(), rig.client(), now=now, stale_after=timedelta(minutes=15), run=REPAIR)

    assert (s.batches_resent, s.resent_failed, s.resent_rolled_back) == (1, 0, 2)
    rows = rig.rows()
    assert [(r["status"], r["idempotency_key"], r["ambiguous_at"]) for r in rows] == [("pending", None, None)] * 2
    assert all("`from`" in r["error"] for r in rows)
    assert rig.emulator.read_outbox() == []
    # fixed: both are sent once
    rig.db.execute("update mail.campaign set from_address = 'Outreach <outreach@mail.example.com>' where id = %s",
                   (cid,))
    assert rig.dispatch(batch_size=10).sent == 2
