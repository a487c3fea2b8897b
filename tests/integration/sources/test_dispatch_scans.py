"""Issue 16 item 6: the dispatcher's suppression sweep looks at a bounded part of the send log and
stays complete (bench/dispatch_scans.py measures it at 1M; issue 12 removed the dead-letter sweep)."""

from __future__ import annotations

import psycopg

from mailflow.store.sql import query
from mailflow.store.suppression import suppress_address

WHO = {"dag_id": "test", "run_id": "test", "task_id": "test"}


def _backlog(db: psycopg.Connection, n: int) -> list[int]:
    # an uploaded list: its rows keep their address, so the sweep judges it (a campaign with a recipients
    # query gets each user's current address at claim time, and the claim's guard judges that one)
    db.execute("insert into mail.campaign (name, status, template, subject, from_address, recipients_table)"
               " values ('backlog', 'scheduled', 'outreach', 'Hi', 'a@mail.example.com', 'mail.campaign_recipient')")
    return [r[0] for r in db.execute(
        "insert into mail.send_log (user_id, campaign, kind, email, email_key, status, scheduled_at)"
        " select g, 'backlog', 'scheduled', 'u' || g || '@example.com', 'u' || g || '@example.com', 'pending',"
        "        now() - interval '1 day' + g * interval '1 second'"
        " from generate_series(1, %s) g order by g returning id", (n,)).fetchall()]


def test_suppressed_rows_beyond_the_head_are_never_claimed_and_cancelled_when_they_reach_it(db) -> None:
    ids = _backlog(db, 1500)
    db.execute("insert into mail.suppression (user_id, scope, source) values (10, 'all', 'test'), (1200, 'all', 'test')")
    suppress_address(db, "U1400@example.com", scope="backlog", source="test")
    with db.transaction():
        cancelled = [r[0] for r in db.execute(query("scheduled", "cancel_suppressed_due"), WHO).fetchall()]
    assert cancelled == [ids[9]]  # only the head (the first 1,000 due rows) is checked per claim
    with db.transaction():
        picked = [r[0] for r in db.execute(query("scheduled", "pick_due"), WHO | {"limit": 1500}).fetchall()]
    assert len(picked) == 1497 and ids[1199] not in picked and ids[1399] not in picked  # never picked
    db.execute("update mail.send_log set status = 'sent', sent_at = now(), provider_message_id = 'p' || id"
               " where id = any(%s)", (picked,))  # the dispatcher sent the rows before them
    with db.transaction():
        cancelled = sorted(r[0] for r in db.execute(query("scheduled", "cancel_suppressed_due"), WHO).fetchall())
    assert cancelled == [ids[1199], ids[1399]]  # now at the head of the due queue
    assert db.execute("select status, count(*) from mail.send_log group by 1 order by 1").fetchall() == [
        ("cancelled", 3), ("sent", 1497)]
    assert db.execute("select count(*) from mail.send_event where to_status = 'cancelled'").fetchone() == (3,)
