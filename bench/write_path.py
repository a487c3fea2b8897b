"""Write-path cost of the send log's indexes (every index costs WAL on every apply): what the analytics indexes of
migration 0004 (built by 0009) cost per mint and per apply of a chunk of 100 emails, and the schema
before and after 0011, which dropped the ones that did not earn it.

The statements are the engine's own: the lifecycle mint (``mint.allocate`` + ``mint.mint_keyed`` with
its event + ``mint.save_batch_keyed``: one INSERT per row that already carries its batch key; on a
tree without ``mint.sql``, or with ``--mint assign``, the older ``lifecycle.mint`` +
``send_log.save_batch`` + ``assign_batch``: an INSERT and an UPDATE per row),
and the apply (``send_log.mark_sent`` with its event), each chunk in the two transactions the store
uses (mint + batch bytes; apply), timed from the client including the commit. The contact guard's
reads and locks of the mint are left out: they touch no index of ``mail.send_log``. The send log has
2,000,000 rows of history (``--quick``: 500,000; 93% sent, 3% failed, 2% released, 1% cancelled, 1% pending; ~10 campaigns; two
years; ``VACUUM ANALYZE``). Schemas:

* ``before``: ``mail.send_log``'s indexes as migrated up to 0010 (read from a database migrated to
  that version, so the definitions are the migrations' own);
* ``after``: as migrated to the newest version (0011 dropped ``before - after``);
* ``none``: ``after`` without any of 0004's analytics indexes (0001's plain ``(campaign,
  minted_at)`` in place of the covering one): what the engine alone needs;
* leave-one-out: ``before`` without one analytics index (the covering index: with 0001's plain one
  instead), against ``before`` (paired, ABBA: with, without, without, with), i.e. what dropping that
  index alone saves.

Median ms per chunk over 200 chunks (``--quick``: 60), and WAL bytes per chunk (every index entry written is
WAL; deterministic where times are noisy, but the WAL of other sessions of the server is included:
run it alone). Schemas run in rounds (before, after, none, before, after, none) so drift of a shared
machine shows in the rounds; a ``CHECKPOINT`` after each change of indexes keeps the full-page
images of a checkpoint that an index build started out of the measures.
``python -m bench.write_path [--quick] [--mint auto|keyed|assign] [--dsn DSN]``; not part of
``make bench``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from bench.common import metric
from mailflow.model.keys import key_tag
from mailflow.store.migrate import migrate
from mailflow.store.sql import query
from mailflow_dev import devenv

#: The schema "before": migrated up to this version (0011 dropped indexes).
BEFORE_VERSION = 10
#: 0004's analytics indexes on mail.send_log (as 0009 builds them), measured one by one.
ANALYTICS_INDEXES = ("send_log_campaign_minted_cover_idx", "send_log_campaign_sent_idx", "send_log_sent_idx",
                     "send_log_failed_idx", "send_log_cancelled_idx", "send_log_user_idx", "send_log_run_idx")
COVER = "send_log_campaign_minted_cover_idx"
PLAIN_MINTED = "CREATE INDEX send_log_campaign_minted_idx ON mail.send_log USING btree (campaign, minted_at)"

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


def _keyed_mint() -> bool:
    """Whether this tree mints with ``mint.mint_keyed`` (one INSERT per row, key included)."""
    try:
        query("mint", "mint_keyed")
    except (FileNotFoundError, KeyError):
        return False
    return True


def _lsn(conn: psycopg.Connection) -> int:
    row = conn.execute("select pg_current_wal_insert_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _mint_keyed(conn: psycopg.Connection, who: dict[str, Any], users: range, tag: str) -> list[int]:
    row = conn.execute(query("mint", "allocate"), {"n": len(users)}).fetchone()
    assert row is not None
    ids = [int(i) for i in row[0]]
    key = f"wp-{tag}-{row[1]}"
    page = [{"id": i, "user_id": u, "email": f"new{u}@example.com", "email_key": f"new{u}@example.com",
             "context": {}, "idx": n} for n, (i, u) in enumerate(zip(ids, users, strict=True))]
    got = conn.execute(query("mint", "mint_keyed"), who | {
        "campaign": "first_practice", "page": Jsonb(page), "key": key,
        "interval_start": None, "interval_end": None}).fetchall()
    conn.execute(query("mint", "save_batch_keyed"), {"key": key, "campaign": "first_practice",
                                                     "count": len(ids), "body": b"[]", "validation": "strict",
                                                     "key_identity": None, "content_hash": None})
    assert len(got) == len(ids)
    return ids


def _mint_then_assign(conn: psycopg.Connection, who: dict[str, Any], users: range, tag: str) -> list[int]:
    page = [{"user_id": u, "email": f"new{u}@example.com", "email_key": f"new{u}@example.com", "context": {}}
            for u in users]
    rows = conn.execute(query("lifecycle", "mint"), who | {
        "campaign": "first_practice", "page": Jsonb(page), "interval_start": None, "interval_end": None}).fetchall()
    ids = [int(r[0]) for r in rows]
    saved = conn.execute(query("send_log", "save_batch"), {
        "tag": key_tag("first_practice"), "campaign": "first_practice", "count": len(ids), "body": b"[]",
        "validation": "strict"}).fetchone()
    assert saved is not None
    conn.execute(query("send_log", "assign_batch"), {"key": saved[0], "ids": ids, "idx": list(range(len(ids)))})
    return ids


def _chunk(conn: psycopg.Connection, first_user: int, tag: str,
           mint: Callable[[psycopg.Connection, dict[str, Any], range, str], list[int]]) -> tuple[float, ...]:
    """Mint (+ batch bytes) then apply one chunk of 100 new users; (mint ms, apply ms, mint WAL
    bytes, apply WAL bytes)."""
    who = {"dag_id": "bench", "run_id": f"bench-{tag}", "task_id": "send"}
    w0 = _lsn(conn)
    t0 = time.perf_counter()
    with conn.transaction():
        ids = mint(conn, who, range(first_user, first_user + 100), tag)
    t1 = time.perf_counter()
    w1 = _lsn(conn)
    with conn.transaction():
        conn.execute(query("send_log", "mark_sent"), who | {
            "ids": ids, "pids": [f"wp-{tag}-{i}" for i in ids]}).fetchall()
    t2 = time.perf_counter()
    w2 = _lsn(conn)
    assert len(ids) == 100
    return (t1 - t0) * 1000, (t2 - t1) * 1000, w1 - w0, w2 - w1


KEYS = ("mint_ms", "apply_ms", "mint_wal", "apply_wal")


class Bench:
    def __init__(self, conn: psycopg.Connection, chunks: int, mint: str = "auto") -> None:
        self.conn = conn
        self.chunks = chunks
        self.next_user = 10_000_000
        keyed = _keyed_mint() if mint == "auto" else mint == "keyed"
        self.mint = _mint_keyed if keyed else _mint_then_assign

    def measure(self) -> dict[str, float]:
        """Median per chunk of ``chunks`` chunks after 5 warm-up chunks."""
        tag = uuid.uuid4().hex[:6]
        samples: list[tuple[float, ...]] = []
        for i in range(5 + self.chunks):
            s = _chunk(self.conn, self.next_user, tag, self.mint)
            self.next_user += 100
            if i >= 5:
                samples.append(s)
        return {k: statistics.median(s[j] for s in samples) for j, k in enumerate(KEYS)}

    def indexes(self) -> dict[str, str]:
        """mail.send_log's indexes now: name -> definition (pg_get_indexdef)."""
        return {r[0]: r[1] for r in self.conn.execute(
            "select c.relname, pg_get_indexdef(i.indexrelid) from pg_index i join pg_class c on c.oid = i.indexrelid"
            " where i.indrelid = 'mail.send_log'::regclass").fetchall()}

    def set_indexes(self, wanted: dict[str, str]) -> None:
        """Drop the indexes not in ``wanted``, build the missing ones (plain builds: the table is ours)."""
        now = self.indexes()
        for name in set(now) - set(wanted):
            self.conn.execute(f"drop index mail.{name}")
        for name in set(wanted) - set(now):
            self.conn.execute(wanted[name])
        self.conn.execute("analyze mail.send_log")
        self.checkpoint()

    def checkpoint(self) -> None:
        """A checkpoint now, so the next measure does not pay the full-page images of one that the
        index builds' WAL would otherwise start in the middle of it (needs superuser or pg_checkpoint)."""
        try:
            self.conn.execute("checkpoint")
        except psycopg.errors.InsufficientPrivilege:
            pass


def _schemas(dsn: str) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(indexes before, indexes after, migrations after BEFORE_VERSION) from a throw-away database."""
    name = f"wp_schema_{uuid.uuid4().hex[:6]}"
    sdsn = devenv.create_database(dsn, name, exist_ok=False)
    try:
        with psycopg.connect(sdsn, autocommit=True) as conn:
            migrate(conn, target=BEFORE_VERSION)
            b = Bench(conn, 0)
            before = b.indexes()
            applied = migrate(conn)
            return before, b.indexes(), applied
    finally:
        devenv.drop_database(dsn, name)


def run(dsn: str, quick: bool = False, mint: str = "auto") -> list[dict[str, Any]]:
    n = 500_000 if quick else 2_000_000
    chunks = 60 if quick else 200
    before, after, applied = _schemas(dsn)
    none = {k: v for k, v in after.items() if k not in ANALYTICS_INDEXES}
    none["send_log_campaign_minted_idx"] = PLAIN_MINTED
    out: list[dict[str, Any]] = []
    name = f"wp_{uuid.uuid4().hex[:6]}"
    sdsn = devenv.create_database(dsn, name, exist_ok=False)
    try:
        with psycopg.connect(sdsn, autocommit=True) as conn:
            migrate(conn)
            b = Bench(conn, chunks, mint)
            t0 = time.monotonic()
            conn.execute(HISTORY_SQL, {"n": n})
            conn.execute("vacuum analyze mail.send_log")
            b.checkpoint()
            common: dict[str, Any] = {"history_rows": n, "chunks": chunks, "mint": b.mint.__name__.lstrip("_")}
            out.append(metric("write_path_history_load_seconds", time.monotonic() - t0, "s", **common,
                              migrations_after_before=applied, dropped=sorted(set(before) - set(after)),
                              added=sorted(set(after) - set(before)), indexes_after=sorted(after)))
            schemas = {"before": before, "after": after, "none": none}
            rounds: dict[str, list[dict[str, float]]] = {k: [] for k in schemas}
            for label in ("before", "after", "none", "before", "after", "none"):
                b.set_indexes(schemas[label])
                rounds[label].append(b.measure())
            for label in schemas:
                for k in KEYS:
                    unit = "ms per chunk of 100 (median)" if k.endswith("ms") else "WAL bytes per chunk of 100 (median)"
                    out.append(metric(f"write_path_{k}_{label}", statistics.mean(r[k] for r in rounds[label]), unit,
                                      rounds=[round(r[k], 2) for r in rounds[label]], indexes=len(schemas[label]),
                                      **common))
            b.set_indexes(before)
            for index in ANALYTICS_INDEXES:
                if index not in before:
                    continue
                without = {k: v for k, v in before.items() if k != index}
                if index == COVER:
                    without["send_log_campaign_minted_idx"] = PLAIN_MINTED
                size = conn.execute("select pg_relation_size(%s::regclass)", (f"mail.{index}",)).fetchone()
                w1 = b.measure()
                b.set_indexes(without)
                o1, o2 = b.measure(), b.measure()
                b.set_indexes(before)
                w2 = b.measure()
                for k in KEYS:
                    with_, without_ = (w1[k] + w2[k]) / 2, (o1[k] + o2[k]) / 2
                    unit = "ms" if k.endswith("ms") else "WAL bytes"
                    out.append(metric(f"write_path_{k}_marginal {index}", with_ - without_,
                                      f"{unit} per chunk of 100 it adds to 'before' (paired, ABBA)",
                                      with_index=round(with_, 2), without=round(without_, 2),
                                      runs=[round(x[k], 2) for x in (w1, o1, o2, w2)],
                                      index_bytes=size[0] if size else None, dropped_by_0011=index not in after,
                                      **common))
    finally:
        devenv.drop_database(dsn, name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="the server (scratch databases are created and dropped there)")
    p.add_argument("--quick", action="store_true", help="500,000 rows of history, 60 chunks per measure")
    p.add_argument("--mint", choices=("auto", "keyed", "assign"), default="auto",
                   help="keyed: mint.mint_keyed (one INSERT per row); assign: lifecycle.mint + assign_batch "
                        "(an INSERT and an UPDATE per row); auto: keyed when this tree has mint.sql")
    args = p.parse_args(argv)
    dsn = args.dsn or devenv.embedded_dsn(devenv.STATE / "pgdata-bench")
    for m in run(dsn, quick=args.quick, mint=args.mint):
        print(f"{m['name']}: {m['value']:.4g} {m['unit']} {m['params']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
