"""Dispatch scans at 1,000,000 pending rows (a claim must not cost more as the backlog grows):
``scheduled.cancel_suppressed_due``
(run before every claim), the statement before and after the change, timed with
``EXPLAIN (ANALYZE, BUFFERS)`` inside a transaction that is rolled back (it writes), median of 3.
(The reconciler's dead-letter sweep is gone: a whole-request failure no longer dead-letters anyone,
so there is no second scan to measure.)

Population (generated in PostgreSQL, about a minute): one active scheduled campaign with 1,000,000
pending rows, all due (a backlog: a paused campaign resumed, or a provider outage), over users
1..1,000,000; 20,000 users suppressed by id and 2,000 by address (2.2%); 1,000,000 sent rows of
history. ``VACUUM ANALYZE`` after the load.

``python -m bench.dispatch_scans [--dsn DSN]`` prints the table; ``--quick`` uses 100,000 pending rows.
Not part of ``make bench`` (it is a before/after measurement for one change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import psycopg

from bench.common import metric, scratch_database
from mailflow.store.sql import query

#: The statements as they were before the due queue was read head first (for the before/after).
CANCEL_BEFORE = """
with hit as materialized (
    select d.id
    from mail.send_log d
    join mail.campaign c on c.name = d.campaign and c.status = 'scheduled'
    where d.status = 'pending' and d.kind = 'scheduled' and d.scheduled_at <= now()
      and (exists (select 1 from mail.suppression s
                   where s.user_id = d.user_id and s.scope in ('all', d.campaign))
           or exists (select 1 from mail.suppression s
                      where lower(s.email) = lower(d.email) and s.scope in ('all', d.campaign)))
    for update of d skip locked
), gone as (
    update mail.send_log l
    set status = 'cancelled', error = 'suppressed before sending'
    where l.id in (select id from hit) and l.status = 'pending'
    returning l.id, l.attempts
)
insert into mail.send_event (send_log_id, from_status, to_status, attempt, error, dag_id, run_id, task_id)
select id, 'pending', 'cancelled', attempts, 'suppressed before sending', %(dag_id)s, %(run_id)s, %(task_id)s
from gone
returning send_log_id
"""

LOAD = [
    # an uploaded list: the sweep judges its rows' addresses (a campaign with a recipients query has its
    # addresses refreshed and judged by the claim's guard instead)
    """insert into mail.campaign (name, status, template, subject, from_address, recipients_table)
       values ('backlog', 'scheduled', 'outreach', 'Hi', 'a@mail.example.com', 'mail.campaign_recipient')""",
    # the backlog: every row due, oldest first
    """insert into mail.send_log (user_id, campaign, kind, email, status, scheduled_at, minted_at)
       select g, 'backlog', 'scheduled', 'user' || g || '@example.com', 'pending',
              now() - interval '10 days' * (1 - g::float8 / %(n)s), now() - interval '11 days'
       from generate_series(1, %(n)s) g""",
    # history: sent lifecycle rows
    """insert into mail.send_log (user_id, campaign, kind, email, status, minted_at, sent_at, provider_message_id)
       select g, 'first_practice', 'lifecycle', 'user' || g || '@example.com', 'sent',
              now() - interval '300 days' * random(), now() - interval '300 days' * random(), 'pm-' || g
       from generate_series(1, %(n)s) g""",
    """insert into mail.suppression (user_id, scope, source)
       select (g::bigint * 104729) %% %(n)s + 1, 'all', 'unsubscribe' from generate_series(1, %(n)s / 50) g
       on conflict do nothing""",
    # email_key: the mailbox key of these ASCII addresses is the address itself
    """insert into mail.suppression (email, email_key, scope, source)
       select a, a, 'all', 'bounce' from (
           select 'user' || ((g::bigint * 15485863) %% %(n)s + 1) || '@example.com' as a
           from generate_series(1, %(n)s / 500) g) as x
       on conflict do nothing""",
]


def _nodes(plan: dict, out: list[str] | None = None) -> list[str]:
    """The plan's node types with their relation or index, depth first."""
    out = [] if out is None else out
    out.append(" ".join(x for x in (plan.get("Node Type"), plan.get("Index Name") or plan.get("Relation Name")) if x))
    for child in plan.get("Plans", []):
        _nodes(child, out)
    return out


def _explain(conn: psycopg.Connection, sql: str, params: dict[str, Any]) -> tuple[float, int, dict]:
    """(execution ms, rows returned, plan JSON) of one run, rolled back."""
    with conn.transaction(force_rollback=True):
        row = conn.execute("explain (analyze, buffers, format json) " + sql, params).fetchone()
    assert row is not None
    plan = row[0][0]
    return float(plan["Execution Time"]), int(plan["Plan"].get("Actual Rows", 0)), plan


def _buffers(plan: dict) -> int:
    p = plan["Plan"]
    return int(p.get("Shared Hit Blocks", 0)) + int(p.get("Shared Read Blocks", 0))


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    n = 100_000 if quick else 1_000_000
    out: list[dict[str, Any]] = []
    with scratch_database(dsn, "scans", app_schema=False) as sdsn, psycopg.connect(sdsn, autocommit=True) as conn:
        t0 = time.monotonic()
        for sql in LOAD:
            conn.execute(sql, {"n": n})
        conn.execute("vacuum analyze mail.send_log")
        conn.execute("vacuum analyze mail.suppression")
        conn.execute("analyze mail.campaign")
        load = time.monotonic() - t0
        out.append(metric("scans_population_load_seconds", load, "s", pending=n))
        who = {"dag_id": "bench", "run_id": "bench", "task_id": "bench"}
        cases = [
            ("cancel_suppressed_due", CANCEL_BEFORE, query("scheduled", "cancel_suppressed_due")),
        ]
        for name, before, after in cases:
            for label, sql in (("before", before), ("after", after)):
                runs = [_explain(conn, sql, who) for _ in range(3)]
                ms = statistics.median(r[0] for r in runs)
                plan = runs[-1][2]
                out.append(metric(f"{name}_{label}_ms", ms, f"ms at {n:,} pending rows (EXPLAIN ANALYZE, median of 3)",
                                  None, None, rows=runs[-1][1], buffers=_buffers(plan), nodes=_nodes(plan["Plan"]),
                                  plan=json.dumps(plan["Plan"])[:4000]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"))
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    for m in run(args.dsn, quick=args.quick):
        extra = {k: v for k, v in m["params"].items() if k != "plan"}
        print(f"{m['name']}: {m['value']:.4g} {m['unit']} {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
