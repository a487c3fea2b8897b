"""The progress page's queries before and after the per-campaign counters (migration 0028), and what
the counters cost the write path.

On an existing populated database (``--dsn``; e.g. :func:`bench.population.load`'s shape with
``mail.delivery_status`` rows for the sent emails):

* **page**: median ms (``--repeat`` runs, 5 by default) of each of the page's count queries read the
  old way (``mail.campaign_progress`` and ``mail.campaign_outcomes``, every campaign and the largest
  one) and from the counters (``counters.progress`` / ``counters.outcomes``), the day table
  (``mail.campaign_daily`` vs ``counters.latest_days``), and of the page's whole list / campaign loads
  (``progress_queries.load_list`` / ``load_campaign``), in a session without JIT as the page's;
* **seed**: the first fold after the upgrade (one full count), timed once (the counters are rebuilt);
* **write path**: the engine's mint (``mint.mint_keyed``) and apply (``send_log.mark_sent``) of a chunk of
  100, server-side execution ms (``EXPLAIN ANALYZE``: the client's timing on a shared machine is mostly
  noise), with the counting triggers enabled and disabled alternately (ABBA per chunk, ``--chunks``,
  120 by default, each rolled back), and the trigger functions' own time.

``python -m bench.counters --dsn DSN [--repeat N] [--chunks N]``; not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from mailflow.orchestration.ui import progress_queries as page
from mailflow.store.sql import query

TRIGGERS = ("send_log_count_insert", "send_log_count_update", "send_log_count_delete")


def _ms(conn: psycopg.Connection, fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 1)


def page_queries(conn: psycopg.Connection, repeat: int) -> dict[str, float]:
    """Median ms of each count query of the page, the views' way and the counters' way."""
    big = conn.execute("select campaign from mail.campaign_counts where key = 'sent' order by n desc limit 1"
                       ).fetchone()
    assert big is not None
    one = {"campaign": big[0]}
    q = {
        "view: progress, all": lambda: conn.execute(page.LIST_SQL).fetchall(),
        "view: progress, one": lambda: conn.execute(page.ONE_SQL, one).fetchall(),
        "view: outcomes, all": lambda: conn.execute(page.OUTCOMES_ALL_SQL).fetchall(),
        "view: outcomes, one": lambda: conn.execute(page.OUTCOMES_ONE_SQL, one).fetchall(),
        "counters: progress, all": lambda: conn.execute(query("counters", "progress"), {"campaign": None}).fetchall(),
        "counters: progress, one": lambda: conn.execute(query("counters", "progress"), one).fetchall(),
        "counters: outcomes, all": lambda: conn.execute(query("counters", "outcomes"), {"campaign": None}).fetchall(),
        "counters: outcomes, one": lambda: conn.execute(query("counters", "outcomes"), one).fetchall(),
        "page: load_list": lambda: page.load_list(conn),
        "page: load_campaign (days=False)": lambda: page.load_campaign(conn, big[0], show=False, days=False),
        "page: load_campaign (with days)": lambda: page.load_campaign(conn, big[0], show=False),
        "page: recent": lambda: conn.execute(page.RECENT_SQL, one | {"limit": 20}).fetchall(),
        "page: errors": lambda: conn.execute(page.ERRORS_SQL, one | {"limit": 20}).fetchall(),
        "view: days (campaign_daily, 14 latest)": lambda: conn.execute(page.DAYS_SQL, one | {"days": 14}).fetchall(),
        "counters: latest_days (14)": lambda: conn.execute(query("counters", "latest_days"),
                                                           one | {"days": 14}).fetchall(),
    }
    out = {"campaign": big[0]}
    for name, fn in q.items():
        out[name] = _ms(conn, fn, 1 if name.startswith("view") else repeat)
        print(f"  {name}: {out[name]} ms", flush=True)
    return out  # type: ignore[return-value]


def seed(conn: psycopg.Connection) -> float:
    """Seconds of the first fold (a full count), after emptying the counters as an upgrade finds them."""
    with conn.transaction():
        conn.execute("update mail.campaign_counter_state set seeded_at = null")
        conn.execute("delete from mail.campaign_counter")
    t0 = time.perf_counter()
    with conn.transaction():
        conn.execute(query("counters", "fold")).fetchone()
    return round(time.perf_counter() - t0, 1)


def write_path(conn: psycopg.Connection, chunks: int) -> dict[str, dict[str, float]]:
    """Server-side execution ms (``EXPLAIN ANALYZE``) of the engine's mint (``mint.mint_keyed``) and apply
    (``send_log.mark_sent``) of a chunk of 100, with the counting triggers enabled and disabled alternately
    (ABBA per chunk, each chunk rolled back: the table and the counters stay as they are). Medians, and the
    time of the trigger functions themselves."""
    who = {"dag_id": "bench", "run_id": "bench-counters", "task_id": "send"}
    got: dict[bool, dict[str, list[float]]] = {on: {"mint_ms": [], "apply_ms": [], "mint_trigger_ms": [],
                                                    "apply_trigger_ms": []} for on in (True, False)}
    user = 70_000_000
    for i in range(chunks):
        on = i % 4 in (0, 3)
        with conn.transaction(force_rollback=True):
            for t in TRIGGERS:
                conn.execute(f"alter table mail.send_log {'enable' if on else 'disable'} trigger {t}")
            row = conn.execute(query("mint", "allocate"), {"n": 100}).fetchone()
            assert row is not None
            ids = [int(x) for x in row[0]]
            page_ = [{"id": k, "user_id": user + j, "email": f"new{user + j}@example.com",
                      "email_key": f"new{user + j}@example.com", "context": {}, "idx": j} for j, k in enumerate(ids)]
            for label, sql, params in (
                ("mint", query("mint", "mint_keyed"), who | {"campaign": "first_practice", "page": Jsonb(page_),
                                                            "key": f"cb-{user}", "interval_start": None,
                                                            "interval_end": None}),
                ("apply", query("send_log", "mark_sent"), who | {"ids": ids, "pids": [f"cb-{user}-{k}" for k in ids]}),
            ):
                res = conn.execute(f"explain (analyze, format json) {sql}", params).fetchone()
                assert res is not None
                plan = res[0][0]
                got[on][f"{label}_ms"].append(plan["Execution Time"])
                got[on][f"{label}_trigger_ms"].append(sum(t["Time"] for t in plan.get("Triggers", [])
                                                         if t["Trigger Name"].startswith("send_log_count")))
        user += 100
    return {("with" if on else "without"): {k: round(statistics.median(v), 3) for k, v in d.items()}
            for on, d in got.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("COUNTERS_BENCH_DSN"), required=False)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunks", type=int, default=120)
    p.add_argument("--skip", nargs="*", default=[], choices=("page", "seed", "write"))
    a = p.parse_args(argv)
    if not a.dsn:
        p.error("--dsn (a populated, migrated database) is required")
    with psycopg.connect(a.dsn, autocommit=True) as conn:
        conn.execute("set jit = off")  # as the page's session (progress.send_log_readonly)
        sizes = conn.execute("select (select count(*) from mail.send_log), (select count(*) from mail.delivery_status),"
                             " (select count(distinct campaign) from mail.campaign_counter),"
                             " pg_size_pretty(pg_total_relation_size('mail.send_log'))").fetchone()
        print(f"send_log rows, delivery_status rows, campaigns, send_log size: {sizes}", flush=True)
        print("load average:", os.getloadavg(), flush=True)
        if "seed" not in a.skip:
            print(f"seed (first fold, full count): {seed(conn)} s", flush=True)
        if "page" not in a.skip:
            page_queries(conn, a.repeat)
        if "write" not in a.skip:
            print("write path (median ms per chunk of 100):", write_path(conn, a.chunks), flush=True)
        print("load average:", os.getloadavg(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
