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
* **write path**: the engine's mint (``mint.allocate`` + ``mint.mint_keyed`` + its batch bytes) and
  apply (``send_log.mark_sent``) of a chunk of 100, median ms and WAL bytes per chunk, with the
  counting triggers enabled and disabled in ABBA rounds (``--chunks`` per measure, 60 by default); the
  counters are seeded again afterwards (the rounds without triggers left them behind).

``python -m bench.counters --dsn DSN [--repeat N] [--chunks N]``; not part of ``make bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.write_path import KEYS, _chunk
from mailflow.orchestration.ui import progress_queries as page
from mailflow.store.sql import query

TRIGGERS = ("send_log_count_insert", "send_log_count_update", "send_log_count_delete")


def _mint_keyed(conn: psycopg.Connection, who: dict[str, Any], users: range, tag: str) -> list[int]:
    """The engine's lifecycle mint of one chunk (mint.allocate, mint.mint_keyed with its event, the batch bytes)."""
    row = conn.execute(query("mint", "allocate"), {"n": len(users)}).fetchone()
    assert row is not None
    ids = [int(i) for i in row[0]]
    key = f"cb-{tag}-{row[1]}"
    page = [{"id": i, "user_id": u, "email": f"new{u}@example.com", "email_key": f"new{u}@example.com",
             "context": {}, "idx": n} for n, (i, u) in enumerate(zip(ids, users, strict=True))]
    got = conn.execute(query("mint", "mint_keyed"), who | {
        "campaign": "first_practice", "page": Jsonb(page), "key": key,
        "interval_start": None, "interval_end": None}).fetchall()
    conn.execute(query("mint", "save_batch_keyed"), {
        "key": key, "campaign": "first_practice", "count": len(ids), "body": b"[]", "validation": "strict",
        "key_identity": None, "content_hash": None})
    assert len(got) == len(ids)
    return ids


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
    """Median mint / apply ms and WAL bytes per chunk with and without the counting triggers (ABBA)."""
    rounds: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    user = 50_000_000
    for label in ("with", "without", "without", "with"):
        verb = "enable" if label == "with" else "disable"
        for t in TRIGGERS:
            conn.execute(f"alter table mail.send_log {verb} trigger {t}")
        tag = uuid.uuid4().hex[:6]
        samples = []
        for i in range(5 + chunks):
            s = _chunk(conn, user, tag, _mint_keyed)
            user += 100
            if i >= 5:
                samples.append(s)
        rounds[label].append({k: statistics.median(s[j] for s in samples) for j, k in enumerate(KEYS)})
        print(f"  {label}: {rounds[label][-1]}", flush=True)
    for t in TRIGGERS:
        conn.execute(f"alter table mail.send_log enable trigger {t}")
    return {label: {k: round(statistics.mean(r[k] for r in rs), 2) for k in KEYS} for label, rs in rounds.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("COUNTERS_BENCH_DSN"), required=False)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--chunks", type=int, default=60)
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
            print("write path (ms / WAL bytes per chunk of 100):", write_path(conn, a.chunks), flush=True)
            # the rounds without triggers left the counters behind the send log: count it again
            print(f"re-seed after the write-path rounds: {seed(conn)} s", flush=True)
        print("load average:", os.getloadavg(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
