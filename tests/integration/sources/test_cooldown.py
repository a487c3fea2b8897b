"""The cooldown across campaigns and kinds: sent, in flight and planned emails of any campaign."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from lifecycle_rig import END, Rig, add_user, rig, simple_campaign  # noqa: F401

D = timedelta(days=1)


def plant(rig: Rig, uid: int, status: str, **cols) -> None:
    names = ["user_id", "campaign", "kind", "email", "status", *cols]
    values = [uid, "outreach", "scheduled", f"user{uid}@example.com", status, *cols.values()]
    if status == "sent":
        names.append("provider_message_id")
        values.append(f"p{uid}")
    rig.db.execute(f"insert into mail.send_log ({', '.join(names)}) values ({', '.join(['%s'] * len(values))})",
                   values)


@pytest.mark.parametrize(("status", "cols", "eligible"), [
    ("sent", {"sent_at": END - 3 * D}, False),       # sent 3 days before the interval end
    ("sent", {"sent_at": END - 8 * D}, True),        # 8 days: outside a 7-day cooldown
    ("sent", {"sent_at": END + 2 * D}, False),       # a backfill sees what was sent after its interval
    ("sending", {"claimed_at": END}, False),         # in flight
    ("pending", {"scheduled_at": "now+2d"}, False),      # planned in 2 days: would be too close
    ("pending", {"scheduled_at": "now+21d"}, True),      # planned in 3 weeks: does not block today
    ("pending", {"scheduled_at": "now-1h"}, False),      # planned an hour ago, not sent yet: goes out now
    ("failed", {}, True),                            # nothing was delivered
    ("cancelled", {}, True),
])
def test_cooldown_counts_sent_in_flight_and_planned_emails(rig: Rig, status: str, cols: dict, eligible: bool) -> None:
    # a planned email's cooldown is measured from its actual send time against the real clock (the
    # email being decided goes out now), so planned times are relative to now
    now = datetime.now(UTC)
    cols = {k: now + {"now+2d": 2 * D, "now+21d": 21 * D, "now-1h": -timedelta(hours=1)}[v] if isinstance(v, str) else v
            for k, v in cols.items()}
    add_user(rig.db, 1)
    plant(rig, 1, status, **cols)
    [s] = rig.run([simple_campaign("lc", 1)])
    assert (s.eligible, s.sent) == ((1, 1) if eligible else (0, 0))
