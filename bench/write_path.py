"""Write-path cost of the analytics indexes of migration 0004 (issue 16, item 5): what each costs per
mint and per apply of a chunk of 100 emails.

The statements are the engine's own (``lifecycle.mint`` with its event, ``send_log.save_batch`` +
``assign_batch``, and ``send_log.mark_sent`` with its event), each chunk in the two transactions the
store uses (mint + batch bytes; apply), timed from the client including the commit, over a send log
of ``HISTORY`` rows (93% sent, 3% failed, 2% released, 1% cancelled, 1% pending; ~10 campaigns;
two years; ``VACUUM ANALYZE``). Configurations:

* ``all``: the schema as migrated (0001 + 0004's indexes);
* ``none``: without 0004's six new indexes and with 0001's plain ``(campaign, minted_at)`` index in
  place of 0004's covering one;
* ``none + <index>``: each 0004 index alone on top of ``none`` (its marginal cost).

Median ms per chunk over ``CHUNKS`` chunks; configurations run in rounds (all, none, all, none) so
drift of a shared machine shows. ``python -m bench.write_path [--quick] [--dsn DSN]``. Not part of
``make bench``.
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

from bench.common import metric, scratch_database
from mailflow.store.sql import query

#: 0004's indexes on mail.send_log: name -> definition (as 0004 builds them).
ANALYTICS_INDEXES = {
    "send_log_campaign_minted_idx": "create index send_log_campaign_minted_idx on mail.send_log (campaign, minted_at)"
                                    " include (user_id, kind)",
    "send_log_campaign_sent_idx": "create index send_log_campaign_sent_idx on mail.send_log (campaign, sent_at)"
                                  " include (user_id, kind) where status = 'sent'",
    "send_log_sent_idx": "create index send_log_sent_idx on mail.send_log (sent_at) include (user_id, campaign)"
                         " where status = 'sent'",
    "send_log_failed_idx": "create index send_log_failed_idx on mail.send_log (campaign, minted_at)"
                           " include (user_id, kind, claimed_at, released_at, dead_lettered_at) where status = 'failed'",
    "send_log_cancelled_idx": "create index send_log_cancelled_idx on mail.send_log (campaign, minted_at)"
                              " include (user_id, kind) where status = 'cancelled'",
    "send_log_user_idx": "create index send_log_user_idx on mail.send_log (user_id)",
    "send_log_run_idx": "create index send_log_run_idx on mail.send_log (run_id, campaign) where run_id is not null",
}
PLAIN_MINTED = "create index send_log_campaign_minted_idx on mail.send_log (campaign, minted_at)"

HISTORY_SQL = """
insert into mail.send_log (user_id, campaign, kind, email, status, minted_at, claimed_at, sent_at, released_at,
                           provider_message_id, attempts, run_id)
select u, c, case when c like 'newsletter%%' then 'scheduled' else 'lifecycle' end, 'user' || u || '@example.com',
       case when r < 0.93 then 'sent' when r < 0.98 then 'failed' when r < 0.99 then 'cancelled' else 'pending' end,
       t, t, case when r < 0.93 then t + interval '2 seconds' end,
       case when r >= 0.96 and r < 0.98 then t + interval '1 second' end,
       case when r < 0.93 then 'hist-' || g end, 1, 'scheduled__' || to_char(t, 'YYYY-MM-DD"T"HH24')
from (select g, (g / 5) + 1 as u,
             (array['first_practice', 'finish_assessment', 'upgrade_offer', 'practice_tips', 'newsletter_1',
                    'newsletter_2', 'newsletter_3', 'newsletter_4', 'newsletter_5', 'newsletter_6'])[1 + g %% 10] as c,
             random() as r, now() - interval '730 days' * random() as t
      from generate_series(0, %(n)s - 1) g) x
"""


def _lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("select pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _chunk(conn: psycopg.Connection, first_user: int, tag: str) -> tuple[float, float, int, int]:
    """Mint (+ batch bytes) then apply one chunk of 100 new users; (mint ms, apply ms, mint WAL
    bytes, apply WAL bytes). WAL bytes are deterministic where times are noisy: every index entry
    written is WAL; the WAL of other sessions of the server is included, so run it alone."""
    who = {"dag_id": "bench", "run_id": f"bench-{tag}", "task_id": "send"}
    page = [{"user_id": u, "email": f"new{u}@example.com", "context": {}} for u in range(first_user, first_user + 100)]
    w0 = _lsn(conn)
    t0 = time.perf_counter()
    with conn.transaction():
        rows = conn.execute(query("lifecycle", "mint"), who | {
            "campaign": "first_practice", "page": Jsonb(page), "interval_start": None, "interval_end": None}).fetchall()
        ids = [r[0] for r in rows]
        key = f"wp-{tag}-{first_user}"
        conn.execute(query("send_log", "save_batch"), {"key": key, "campaign": "first_practice",
                                                       "count": len(ids), "body": b"[]"})
        conn.execute(query("send_log", "assign_batch"), {"key": key, "ids": ids, "idx": list(range(len(ids)))})
    t1 = time.perf_counter()
    w1 = _lsn(conn)
    with conn.transaction():
        conn.execute(query("send_log", "mark_sent"), who | {
            "ids": ids, "pids": [f"wp-{tag}-{i}" for i in ids]}).fetchall()
    t2 = time.perf_counter()
    w2 = _lsn(conn)
    assert len(ids) == 100
    return (t1 - t0) * 1000, (t2 - t1) * 1000, w1 - w0, w2 - w1


def _measure(conn: psycopg.Connection, chunks: int, state: dict[str, int]) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    for _ in range(5):  # warm-up (caches, prepared statements)
        _chunk(conn, state["next"], tag)
        state["next"] += 100
    mint, apply, mint_wal, apply_wal = [], [], [], []
    for _ in range(chunks):
        m, a, mw, aw = _chunk(conn, state["next"], tag)
        state["next"] += 100
        mint.append(m)
        apply.append(a)
        mint_wal.append(mw)
        apply_wal.append(aw)
    return {"mint_ms": statistics.median(mint), "apply_ms": statistics.median(apply),
            "mint_wal": statistics.median(mint_wal), "apply_wal": statistics.median(apply_wal)}


def _drop_all(conn: psycopg.Connection) -> None:
    for name in ANALYTICS_INDEXES:
        conn.execute(f"drop index if exists mail.{name}")
    conn.execute(PLAIN_MINTED)


def _create_all(conn: psycopg.Connection) -> None:
    conn.execute("drop index if exists mail.send_log_campaign_minted_idx")
    for ddl in ANALYTICS_INDEXES.values():
        conn.execute(ddl.replace("create index", "create index if not exists"))


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    n = 500_000 if quick else 2_000_000
    chunks = 60 if quick else 200
    out: list[dict[str, Any]] = []
    with scratch_database(dsn, "writes", app_schema=False) as sdsn, psycopg.connect(sdsn, autocommit=True) as conn:
        t0 = time.monotonic()
        conn.execute(HISTORY_SQL, {"n": n})
        conn.execute("vacuum analyze mail.send_log")
        present = {r[0] for r in conn.execute("select indexname from pg_indexes where schemaname = 'mail'"
                                              " and tablename = 'send_log'").fetchall()}
        _create_all(conn)  # the schema as migrated, whichever migration built them
        out.append(metric("write_path_history_load_seconds", time.monotonic() - t0, "s", history_rows=n,
                          indexes_before=sorted(present)))
        state = {"next": 10_000_000}
        rounds: dict[str, list[dict[str, float]]] = {"all": [], "none": []}
        for label in ("all", "none", "all", "none"):
            if label == "all":
                _create_all(conn)
            else:
                _drop_all(conn)
            rounds[label].append(_measure(conn, chunks, state))
        keys = ("mint_ms", "apply_ms", "mint_wal", "apply_wal")
        base = {k: statistics.mean(r[k] for r in rounds["none"]) for k in keys}
        full = {k: statistics.mean(r[k] for r in rounds["all"]) for k in keys}
        for k in keys:
            what, unit = k.split("_")
            unit = "ms per chunk of 100 (median)" if unit == "ms" else "WAL bytes per chunk of 100 (median)"
            out.append(metric(f"write_path_{k}_all_indexes", full[k], unit,
                              rounds=[round(r[k], 2) for r in rounds["all"]], history_rows=n, chunks=chunks))
            out.append(metric(f"write_path_{k}_without_0004", base[k], unit,
                              rounds=[round(r[k], 2) for r in rounds["none"]], history_rows=n, chunks=chunks))
        _drop_all(conn)
        for name, ddl in ANALYTICS_INDEXES.items():
            before = _measure(conn, chunks, state)  # paired: 'none' right before, so drift cancels
            if name == "send_log_campaign_minted_idx":
                conn.execute("drop index mail.send_log_campaign_minted_idx")
            conn.execute(ddl)
            r = _measure(conn, chunks, state)
            size = conn.execute("select pg_relation_size(%s::regclass)", (f"mail.{name}",)).fetchone()[0]  # type: ignore[index]
            conn.execute(f"drop index mail.{name}")
            if name == "send_log_campaign_minted_idx":
                conn.execute(PLAIN_MINTED)
            for k in ("mint_ms", "apply_ms", "mint_wal", "apply_wal"):
                unit = "ms" if k.endswith("ms") else "WAL bytes"
                out.append(metric(f"write_path_{k}_marginal {name}", r[k] - before[k],
                                  f"{unit} per chunk of 100 over 'none' (paired)", measured=round(r[k], 2),
                                  none=round(before[k], 2), index_bytes=size))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"))
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    for m in run(args.dsn, quick=args.quick):
        print(f"{m['name']}: {m['value']:.4g} {m['unit']} {m['params']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
