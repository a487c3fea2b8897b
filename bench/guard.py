"""The reputation guard's cost per call (docs/operations.md, "Reputation guard"): ``evaluate`` of three
campaigns and the account, and ``admit`` of one chunk, on counters shaped like a busy send log.

The guard reads only the outcome counters (``mail.campaign_counts``: the folded counts plus the deltas not
folded yet), so its cost depends on the number of campaigns and of unfolded delta rows, not on the send
log's size. The population: ``campaigns`` campaigns with folded counts of a 20M-email history, and
``deltas`` unfolded delta rows (what about 30 minutes at 800 emails/s append between two folds of the
reconcile DAG: one row per (campaign, key) per statement). Reported: p50 and p95 ms of each call, measured
on the client (both are what a sender and the webhook receiver wait for).
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta
from typing import Any

import psycopg

from mailflow.store import reputation

ACCOUNT = "https://api.resend.com"


def _populate(conn: psycopg.Connection, campaigns: int, deltas: int) -> list[str]:
    names = [f"bench_guard_{i}" for i in range(campaigns)]
    keys = ("sent", "with_outcome", "delivered", "hard_bounced", "complained")  # deltas: the first three
    per = 20_000_000 // campaigns
    conn.execute("insert into mail.campaign_counter (campaign, key, n)"
                 " select c, k, case k when 'sent' then %(n)s when 'with_outcome' then %(n)s * 0.98"
                 " when 'delivered' then %(n)s * 0.97 when 'hard_bounced' then %(n)s * 0.005 else %(n)s * 0.0001 end"
                 " from unnest(%(names)s::text[]) as c cross join unnest(%(keys)s::text[]) as k"
                 " on conflict (campaign, key) do nothing", {"n": per, "names": names, "keys": list(keys)})
    conn.execute("insert into mail.campaign_counter_delta (campaign, key, n)"
                 " select (%(names)s::text[])[1 + i %% %(c)s], (%(keys)s::text[])[1 + i %% 3], 1"
                 " from generate_series(1, %(d)s) as i", {"names": names, "keys": list(keys), "c": campaigns,
                                                         "d": deltas})
    conn.execute("analyze mail.campaign_counter, mail.campaign_counter_delta")
    return names


def _times(fn: Any, repeat: int) -> tuple[float, float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    out.sort()
    return statistics.median(out), out[int(0.95 * (len(out) - 1))]


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    campaigns, deltas, repeat = (20, 50_000, 200) if not quick else (5, 5_000, 30)
    config = reputation.GuardConfig(account_every=timedelta(0))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("truncate mail.reputation_guard, mail.campaign_counter, mail.campaign_counter_delta")
        names = _populate(conn, campaigns, deltas)
        three = names[:3]
        reputation.evaluate(conn, three, config=config, account=ACCOUNT)  # the scopes' first sight
        ev50, ev95 = _times(lambda: reputation.evaluate(conn, three, config=config, account=ACCOUNT), repeat)
        ad50, ad95 = _times(lambda: reputation.admit(conn, names[0], 100, account=ACCOUNT, config=config), repeat)
        conn.execute("truncate mail.reputation_guard, mail.campaign_counter, mail.campaign_counter_delta")
    params = {"campaigns": campaigns, "unfolded_deltas": deltas, "calls": repeat}
    return [
        {"name": "reputation guard: evaluate 3 campaigns + account, p50", "value": round(ev50, 2), "unit": "ms",
         "target": "<= 50 ms", "met": ev50 <= 50, "params": params},
        {"name": "reputation guard: evaluate 3 campaigns + account, p95", "value": round(ev95, 2), "unit": "ms",
         "target": None, "met": None, "params": params},
        {"name": "reputation guard: admit one chunk, p50", "value": round(ad50, 2), "unit": "ms",
         "target": "<= 5 ms", "met": ad50 <= 5, "params": params},
        {"name": "reputation guard: admit one chunk, p95", "value": round(ad95, 2), "unit": "ms",
         "target": None, "met": None, "params": params},
    ]


if __name__ == "__main__":
    import os

    for m in run(os.environ["TEST_DATABASE_URL"]):
        print(m["name"], m["value"], m["unit"])
