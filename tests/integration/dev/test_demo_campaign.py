"""`make airflow`'s scheduled demo campaign (demo_outreach) on the demo data after `make demo`: its
audience is not held by the contact policy's cooldown (the lifecycle run of `make demo` has just
mailed most free-plan users), and its plan starts at once and sends a few emails a minute.

The demo data (5,000 users, seed 42, anchored at the current hour, as `make airflow` loads it), one
real lifecycle run for the hour that just ended (as `make demo` sends it, through the emulator),
then `airflow_local._demo_campaign` on the same database. "Held" is decided by the product's own
contact policy code (``load_contacts`` + ``evaluate``, as the dispatcher's claim does)."""

from __future__ import annotations

from datetime import datetime, timedelta

import psycopg
from send_log_demo import current_hour, lifecycle_run_context, run_lifecycle_once

from mailflow.campaigns import CampaignFolder, load_policy
from mailflow.emulator.testing import EmulatorProcess
from mailflow.sources.scheduled.provisioning import recipient_source
from mailflow.store.contact_guard import load_contacts
from mailflow.store.policy import evaluate, mailbox_key
from mailflow.store.scheduled import ScheduledStore
from mailflow_dev import airflow_local
from mailflow_dev.demo.loader import load_demo_data

#: Measured on the demo data (5,000 users, seed 42): free-plan users, of them held by the policy right
#: after make demo's lifecycle run (81.7%: the old audience's flat line; first_practice holds out 10%), demo_outreach's recipients,
#: of them held at provisioning (0%).
MEASURED = (4628, 3779, 849, 0)


def held_by_policy(conn: psycopg.Connection, users: list[tuple[int, str]], now: datetime,
                   except_ids: list[int]) -> set[int]:
    """The users (``(user_id, email)``) the contact policy holds back at ``now``."""
    policy = load_policy()
    mailboxes = {uid: key for uid, email in users if (key := mailbox_key(email)) is not None}
    contacts = load_contacts(conn, [u for u, _ in users], policy, ref=now, now=now, include_planned=False,
                             except_ids=except_ids, mailboxes=mailboxes)
    return {uid for uid, _ in users if evaluate(policy, contacts.get(uid, ()), ref=now, now=now) is not None}


def test_the_demo_campaign_is_not_held_by_the_cooldown_and_sends_within_minutes(
        db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> None:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    end = current_hour()
    load_demo_data(db, users=5000, seed=42, anchor=end)
    run_lifecycle_once(db_dsn, emulator, end, lifecycle_run_context(end))  # what `make demo` sends
    now = db.execute("select now()").fetchone()[0]  # type: ignore[index]
    free = [(int(u), str(e)) for u, e in db.execute(
        "select user_id, email from app.users where plan = 'free' order by user_id").fetchall()]
    held_free = held_by_policy(db, free, now, [])
    print(f"\nfree-plan users: {len(free)}, held by the policy after make demo: {len(held_free)}"
          f" ({len(held_free) / len(free):.1%})")

    airflow_local._demo_campaign(db_dsn)

    rows = db.execute("select id, user_id, email, scheduled_at from mail.send_log"
                      " where campaign = %s order by scheduled_at", (airflow_local.DEMO_CAMPAIGN,)).fetchall()
    held = held_by_policy(db, [(int(r[1]), str(r[2])) for r in rows], now, [int(r[0]) for r in rows])
    print(f"demo_outreach recipients: {len(rows)}, held: {len(held)} ({len(held) / len(rows):.1%});"
          f" first at +{(rows[0][3] - now).total_seconds():.0f} s;"
          f" in the first hour: {sum(1 for r in rows if r[3] < now + timedelta(hours=1))}")
    assert (len(free), len(held_free), len(rows), len(held)) == MEASURED
    # every free-plan user make demo left alone is a recipient (the policy held none of them then)
    assert sorted(int(r[1]) for r in rows) == sorted(u for u, _ in free if u not in held_free)
    # it starts at once and sends 3 a minute: a whole local day ahead (23 h 01 min to 24 h), 4,320 slots
    first_hour = sum(1 for r in rows if r[3] < now + timedelta(hours=1))
    assert rows[0][3] < now + timedelta(seconds=30)
    assert 180 <= first_hour <= 188
    gaps = [(b[3] - a[3]).total_seconds() for a, b in zip(rows, rows[1:], strict=False)]
    assert 19.1 <= min(gaps) and max(gaps) <= 20.1

    # an email from another campaign after the campaign was created holds the user back (the policy
    # defers), it does not make the dispatcher's address look-up drop the user as gone
    uid, email = int(rows[0][1]), str(rows[0][2])
    db.execute("insert into mail.send_log (user_id, campaign, kind, email, status, sent_at, provider_message_id)"
               " values (%s, 'practice_tips', 'lifecycle', %s, 'sent', now(), 'p-later')", (uid, email))
    c = ScheduledStore(db).campaign_by_name(airflow_local.DEMO_CAMPAIGN)
    assert c is not None
    source = recipient_source(db, c, CampaignFolder.resolve())
    assert ScheduledStore(db).current_addresses(source, [uid], c["name"], c["id"]) == {uid: email}
    later = db.execute("select now()").fetchone()[0]  # type: ignore[index]
    assert held_by_policy(db, [(uid, email)], later, [int(rows[0][0])]) == {uid}


def test_the_demo_zone_starts_its_local_day_at_the_current_utc_hour() -> None:
    from zoneinfo import ZoneInfo

    for h in range(24):
        now = datetime(2026, 12, 3, h, 37, tzinfo=ZoneInfo("UTC"))
        local = now.astimezone(ZoneInfo(airflow_local.demo_zone(now)))
        assert (local.hour, local.minute) == (0, 37), (h, airflow_local.demo_zone(now))
