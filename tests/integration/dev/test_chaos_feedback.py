"""The short feedback chaos run (``make chaos`` runs the long one): a real emulator pushing signed
webhooks with every fault on, a real standalone receiver process SIGKILLed three times under load
(once for an outage longer than the provider retries, taken after every pending message was
acknowledged: it loses whole lifecycles, which the safety-net poll must recover), the sweep and the
safety-net poll, and the audit's invariants, each exactly 0."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_chaos_feedback_short(pg_admin_dsn: str) -> None:
    from mailflow_dev.chaos_feedback import COLUMNS, failed, run_feedback_chaos, table

    report = run_feedback_chaos(pg_admin_dsn, kills=3, emails=400, seed=11, send_seconds=8.0, time_scale=0.0005,
                                outage_seconds=2.0, outage="clean", out=lambda *_: None)
    print(table(report))
    info = report["info"]
    assert (report["kills"], report["kills_requested"], report["restarts"]) == (3, 3, 3)
    assert report["invariants"] == dict.fromkeys(COLUMNS, 0), info["examples"]
    assert failed(report) == []
    # every fault happened: copies of each kind were sent and refused, duplicates acknowledged,
    # attempts dropped, refused while the receiver was down, and retried to an acknowledgement
    kinds = info["messages_by_kind_and_final"]
    for kind in ("forged", "stale", "future"):
        assert kinds[kind].get("rejected", 0) > 0 and kinds[kind].get("acknowledged", 0) == 0, kind
    assert kinds["duplicate"].get("acknowledged", 0) > 0
    statuses = info["genuine_attempt_statuses"]
    assert statuses.get("dropped", 0) > 0 and statuses.get("refused", 0) > 0
    assert info["webhooks"]["reordered_emails"] > 0 and info["webhooks"]["delayed_messages"] > 0
    assert info["webhooks"]["pending"] == 0
    # the outage lost some events to the webhooks (given up), and the poll found what they said
    assert kinds["genuine"]["acknowledged"] > 0 and kinds["genuine"].get("given_up", 0) > 0
    assert info["poll"]["checked"] > 0 and info["delivery_events_by_source"]["poll"] > 0
    # 8% of 400 bounce permanently, 3% complain: 32 + 12 addresses suppressed, no other
    assert (info["expected_suppressions"], info["suppressed"]) == (44, 44)
    assert info["stored"] >= kinds["genuine"]["acknowledged"]  # + any committed just before a kill, never answered
