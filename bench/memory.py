"""Metric 5: peak RSS of a lifecycle run whose audience is 1,000,000 users versus one of 10,000.

Each run is a fresh subprocess (``python -m bench.memory --child ...``) that imports the engine,
connects, and calls ``run_lifecycle`` for the real ``first_practice`` campaign with the real store and
renderer and the instant in-process provider, for the same fixed number of chunks (100 chunks of
100: the small audience exactly, the large one stopped by the chunk budget; 50 with ``--quick``). Peak RSS is the
child's ``ru_maxrss``. The engine streams: one keyset page of at most 100 rows is in memory at a
time and the audience size is a ``count(*)`` on the server, so the ratio should be ~1.

The naive way in the same run: a child that fetches the whole eligible audience into a list (what a
loop over ``cursor.fetchall()`` does), for both sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from bench.common import ANCHOR, metric, scratch_database

SMALL = 10_000
CHUNKS = 100  # 100 chunks of 100 = the whole small audience
RATIO_TARGET = 1.2
BIG_END = ANCHOR
SMALL_END = ANCHOR - timedelta(days=10)

USERS_SQL = """
insert into app.users (user_id, email, first_name, last_name, signed_up_at, timezone, plan, last_active_at)
select g, 'user' || g || '@example.com', (array['Anna', 'Ben', 'Clara', null, ''])[1 + g %% 5], 'Bench',
       %(end)s - interval '2 days' * ((%(last)s - g + 1)::float8 / (%(last)s - %(first)s + 1)),
       'Europe/Berlin', 'free', null
from generate_series(%(first)s::bigint, %(last)s::bigint) as g
"""


def _rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux


def child(mode: str, dsn: str, end: datetime, chunks: int) -> dict[str, Any]:
    """Run inside the subprocess: ``streaming`` (the engine) or ``naive`` (fetch all)."""
    from bench.common import ChunkClock, InstantProvider, renderer
    from mailflow.campaigns import load_campaigns
    from mailflow.model.outcome import DataInterval, RunContext
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.send_log import PostgresStore

    campaigns = load_campaigns(only=["first_practice"])
    interval = DataInterval(end - timedelta(hours=1), end)
    r = renderer()
    with psycopg.connect(dsn, autocommit=True) as conn:
        store = PostgresStore(conn)
        baseline = _rss_kb()
        t0 = time.perf_counter()
        if mode == "streaming":
            provider = InstantProvider()
            summaries = run_lifecycle(store, provider, r, campaigns, interval, budget_seconds=chunks,
                                      clock=ChunkClock(provider), run=RunContext(run_id=f"bench-memory-{end:%d}"))
            out = {"eligible": summaries[0].eligible, "emails": provider.emails, "chunks": provider.calls}
        else:
            c = campaigns[0]
            window, since = c.window(interval), interval.end - c.cooldown
            sql = store._audience_sql("audience_count", c).as_string(conn).replace("select count(*) from", "select * from", 1)
            rows = conn.execute(sql, store._params(c, window, since)).fetchall()
            out = {"eligible": len(rows), "emails": 0, "chunks": 0}
        out |= {"seconds": round(time.perf_counter() - t0, 2), "baseline_kb": baseline, "maxrss_kb": _rss_kb()}
    return out


def _spawn(mode: str, dsn: str, end: datetime, chunks: int) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-m", "bench.memory", "--child", mode, "--dsn", dsn, "--end", end.isoformat(),
                        "--chunks", str(chunks)], capture_output=True, text=True, env=env, cwd=root, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"memory child {mode} failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    big = 100_000 if quick else 1_000_000
    chunks = 50 if quick else CHUNKS
    with scratch_database(dsn, "memory") as sdsn:
        t0 = time.perf_counter()
        with psycopg.connect(sdsn, autocommit=True) as conn:
            conn.execute(USERS_SQL, {"first": 1, "last": SMALL, "end": SMALL_END})
            conn.execute(USERS_SQL, {"first": SMALL + 1, "last": SMALL + big, "end": BIG_END})
            conn.execute("vacuum analyze app.users")
        load_s = time.perf_counter() - t0
        # The naive children first: they write nothing, so both see the whole audience.
        small_n = _spawn("naive", sdsn, SMALL_END, chunks)
        big_n = _spawn("naive", sdsn, BIG_END, chunks)
        small_s = _spawn("streaming", sdsn, SMALL_END, chunks)
        big_s = _spawn("streaming", sdsn, BIG_END, chunks)
    ratio = big_s["maxrss_kb"] / small_s["maxrss_kb"]
    naive_ratio = big_n["maxrss_kb"] / small_n["maxrss_kb"]
    mib = 1024
    return [
        metric("memory_peak_rss_ratio_big_vs_small", ratio, "x (peak RSS)", f"<= {RATIO_TARGET}", ratio <= RATIO_TARGET,
               audience_big=big_s["eligible"], audience_small=small_s["eligible"], chunks=chunks,
               emails_each=[small_s["emails"], big_s["emails"]],
               peak_rss_mib_small=round(small_s["maxrss_kb"] / mib, 1), peak_rss_mib_big=round(big_s["maxrss_kb"] / mib, 1),
               rss_after_imports_mib=round(big_s["baseline_kb"] / mib, 1),
               run_seconds=[small_s["seconds"], big_s["seconds"]], load_seconds=round(load_s, 1),
               campaign="first_practice", provider="in-process, accepts at once"),
        metric("memory_naive_fetchall_rss_ratio", naive_ratio, "x (peak RSS)", None, None,
               method="the eligible audience fetched into one list (cursor.fetchall)",
               peak_rss_mib_small=round(small_n["maxrss_kb"] / mib, 1), peak_rss_mib_big=round(big_n["maxrss_kb"] / mib, 1),
               rows=[small_n["eligible"], big_n["eligible"]], seconds=[small_n["seconds"], big_n["seconds"]]),
    ]


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["streaming", "naive"], required=True)
    p.add_argument("--dsn", required=True)
    p.add_argument("--end", required=True)
    p.add_argument("--chunks", type=int, default=CHUNKS)
    a = p.parse_args()
    print(json.dumps(child(a.child, a.dsn, datetime.fromisoformat(a.end), a.chunks)))
