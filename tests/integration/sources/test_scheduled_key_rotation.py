"""The scheduled path under an API key rotation: the dispatcher stores its key's identity with each
batch, and an ambiguous scheduled batch is resent only under that key (held while it is not
configured), never delivered twice."""

from __future__ import annotations

from collections import Counter

import httpx
import psycopg
import pytest
from scheduled_rig import (
    RUN,
    Rig,
    provisioned,
    rig,  # noqa: F401  (fixture)
)

from mailflow.model.outcome import SendError
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.reconciler import reconcile

NEW_KEY = "re_sending_only_new"


def test_key_rotation_never_duplicates_an_ambiguous_scheduled_batch(rig: Rig) -> None:
    provisioned(rig, 4)
    rig.emulator.configure(error_after_rate=1.0, error_after_status=502, restricted_keys=[NEW_KEY])
    old = rig.client(policy=RetryPolicy(max_attempts=1))
    with pytest.raises(SendError, match="provider down") as failed:  # the 502 opened the breaker
        rig.dispatch(client=old)
    summary = failed.value.summary
    assert (summary.claimed, summary.sent, summary.unknown) == (4, 0, 4)
    [(key, identity)] = rig.db.execute("select idempotency_key, key_identity from mail.send_batch").fetchall()
    assert identity == old.key_identity
    assert len(rig.emulator.read_outbox()) == 4  # processed, the answer was a 502
    rig.emulator.configure(error_after_rate=0.0)
    rig.db.execute("update mail.send_log set claimed_at = claimed_at - interval '1 hour'")

    pacer = PostgresPacer(lambda: psycopg.connect(rig.dsn), account=rig.emulator.base_url, requests_per_second=200)
    new = ResendClient(rig.emulator.base_url, NEW_KEY, pacer=pacer, timeout=httpx.Timeout(5.0))
    rig.closers += [new, pacer]
    now = rig.db.execute("select now()").fetchone()[0]  # type: ignore[index]
    held = reconcile(rig.conn(), new, now=now, run=RUN)
    assert (held.batches_resent, held.changed(), [h["key"] for h in held.held]) == (0, 0, [key])
    assert len(rig.emulator.read_outbox()) == 4
    assert {r["status"] for r in rig.rows()} == {"sending"}

    done = reconcile(rig.conn(), new, now=now, run=RUN, previous={old.key_identity: lambda: old})
    assert (done.batches_resent, done.resent_sent, done.held) == (1, 4, [])
    rows = rig.rows()
    assert {(r["status"], r["idempotency_key"]) for r in rows} == {("sent", key)}
    assert rig.outbox_ids() == Counter({r["id"]: 1 for r in rows})  # each delivered exactly once
