"""One contact policy for every path, enforced by the database (issue 14): the contact guard under
concurrency, scheduled dispatch under the policy (defer / skip / ignore), backfills and planned
emails, frequency caps, and address hygiene on both paths."""

from __future__ import annotations

from datetime import timedelta

import psycopg

from mailflow import contact_chaos


def test_concurrent_lifecycle_and_scheduled_claimers_never_mail_a_user_twice(db: psycopg.Connection,
                                                                            db_dsn: str) -> None:
    # several processes at once: a provisioner, 3 lifecycle runs (overlapping campaigns) and 2
    # dispatchers, over 2,000 users who are in every audience
    report = contact_chaos.run(db_dsn, users=2000, lifecycle=3, dispatchers=2, rounds=1, seconds=60)
    assert report["failed"] == []
    assert report["invariants"] == {"users_with_two_contacts_in_cooldown": 0, "users_never_decided": 0,
                                    "due_rows_left_pending": 0, "processes_failed": 0}
    c = report["counts"]
    # every user got exactly one email, whichever path won
    assert c["users_emailed"] == 2000 and c["emails_sent"] == 2000
    assert c["lifecycle_sent"] + c["scheduled_sent"] == 2000
    # every scheduled row the policy held back is visible: deferred (with an event) or skipped
    sched = db.execute("select count(*) from mail.send_log where kind = 'scheduled'").fetchone()
    assert sched is not None and sched[0] == 1000 + 666
    assert c["scheduled_sent"] + c["scheduled_deferred"] + c["scheduled_skipped"] == 1000 + 666
    assert c["skip_events"] == c["scheduled_skipped"]
    assert c["deferral_events"] >= c["scheduled_deferred"]
    held = db.execute("select count(*) from mail.send_log where kind = 'scheduled' and status in ('pending', 'skipped')"
                      " and error like 'contact policy: cooldown 7 days: row %'").fetchone()
    assert held is not None and held[0] == c["scheduled_deferred"] + c["scheduled_skipped"]
    assert timedelta(0) <= timedelta(seconds=report["seconds"]) < timedelta(seconds=45)
