"""Bulk populations for the scale benchmarks, generated inside PostgreSQL (``generate_series``,
``random()`` after ``setseed``), so a million users and five million send-log rows load in minutes.

The shape (all times before :data:`bench.common.ANCHOR`):

* ``app.users``: ``user_id`` 1..N in sign-up order over two years (about N/730 a day); 8% on the pro
  plan; ``last_active_at`` null for 5%, inside the last 7 days for about 10%, else some time between
  sign-up and now; a few null or empty first names.
* ``app.assessments``: ``user_id % 5`` per user (0..4, two on average; a fifth never start one); the
  first one just before the user's last activity, the others between sign-up and then; 75% finished
  8-45 minutes later, 75% free.
* ``mail.send_log``: about five rows per user on average: 10 slots per user (k = 1..10), each an
  instant uniform over the last two years, kept only if after the user's sign-up (old users have
  ~10 emails, new ones ~0; ~9% of old users had one in the last 7 days). Slots 1..4 are the
  lifecycle campaign ``first_practice``/``finish_assessment``/``upgrade_offer``/``practice_tips``
  with probability 0.6, every other slot a scheduled ``newsletter_<k>``. 93% sent, 3% failed, 2%
  failed and released (whole-request failure); scheduled rows: 1% cancelled, 1% still pending in
  the coming week.
* ``mail.suppression``: 1% of users by id (scope all), 0.5% by address (scope all), 0.5% by id for
  one campaign.

Secondary indexes (and the assessments foreign key) are dropped for the load and rebuilt from their
own definitions afterwards, then ``VACUUM ANALYZE`` (the steady state autovacuum keeps).
"""

from __future__ import annotations

import atexit
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from queue import SimpleQueue
from typing import Any

import psycopg
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from bench.common import ANCHOR
from mailflow.store.migrate import migrate
from mailflow_dev import devenv
from mailflow_dev.demo.loader import schema_sql

USERS_SQL = """
insert into app.users (user_id, email, first_name, last_name, signed_up_at, timezone, plan, last_active_at)
select g,
       'user' || g || '@example.' || (array['com', 'org', 'net'])[1 + g %% 3],
       (array['Anna', 'Ben', 'Clara', 'David', 'Emma', 'Felix', 'Jean', 'Lucy', null, ''])[1 + (g * 7) %% 10],
       (array['Miller', 'Schmidt', 'Dubois', 'Smith', 'Jones'])[1 + (g * 13) %% 5],
       s.signed_up_at,
       (array['Europe/Berlin', 'Europe/London', 'America/New_York', 'Europe/Paris'])[1 + g %% 4],
       case when s.r1 < 0.08 then 'pro' else 'free' end,
       case when s.r2 < 0.05 then null
            when s.r2 < 0.15 then %(anchor)s - s.r3 * least(interval '7 days', %(anchor)s - s.signed_up_at)
            else s.signed_up_at + s.r3 * (%(anchor)s - s.signed_up_at) end
from (select g, random() as r1, random() as r2, random() as r3,
             %(anchor)s - interval '730 days' * ((%(n)s - g + 1)::float8 / %(n)s) - random() * interval '1 minute'
               as signed_up_at
      from generate_series(1, %(n)s) as g) as s
"""

ASSESSMENTS_SQL = """
insert into app.assessments (assessment_id, user_id, kind, is_free, started_at, finished_at, score)
select x.user_id * 4 + x.k - 4, x.user_id,
       (array['numerical', 'verbal', 'logical', 'diagrammatic', 'situational_judgement', 'mechanical'])
         [1 + (x.user_id + x.k) %% 6],
       x.free < 0.75,
       x.started_at,
       case when x.fin < 0.75 and x.started_at + x.took < %(anchor)s then x.started_at + x.took end,
       case when x.fin < 0.75 and x.started_at + x.took < %(anchor)s then 30 + (x.score * 70)::int end
from (select u.user_id, k, random() as fin, random() as free, random() as score,
             interval '8 minutes' + random() * interval '37 minutes' as took,
             case when k = 1
                  then greatest(u.signed_up_at, coalesce(u.last_active_at, u.signed_up_at) - random() * interval '1 hour')
                  else u.signed_up_at + random() * (coalesce(u.last_active_at, u.signed_up_at) - u.signed_up_at)
             end as started_at
      from app.users u cross join lateral generate_series(1, (u.user_id %% 5)::int) as k
      where u.user_id between %(lo)s and %(hi)s) as x
"""

SEND_LOG_SQL = """
insert into mail.send_log (user_id, campaign, kind, email, context, status, scheduled_at, minted_at, claimed_at,
                           sent_at, released_at, provider_message_id, idempotency_key, batch_index, attempts,
                           error, dag_id, run_id, task_id, data_interval_start, data_interval_end)
select y.user_id, y.campaign, y.kind, y.email, y.context, y.status,
       case when y.kind = 'scheduled' then y.at end,
       y.at - interval '1 minute',
       case when y.status <> 'pending' then y.at end,
       case when y.status = 'sent' then y.at end,
       case when y.released then y.at end,
       case when y.status = 'sent' then 'pm-' || y.user_id || '-' || y.k end,
       case when y.status <> 'pending' then 'mf-' || y.user_id / 100 || '-' || y.k end,
       case when y.status <> 'pending' then (y.user_id %% 100)::smallint end,
       case when y.status = 'pending' then 0 else 1 end,
       case when y.status = 'failed' then 'provider rejected the address' end,
       case when y.kind = 'scheduled' then 'dispatch_scheduled_emails' else 'lifecycle_emails' end,
       'scheduled__' || to_char(date_trunc('hour', y.at), 'YYYY-MM-DD"T"HH24:MI:SS') || '+00:00',
       'send_campaigns', date_trunc('hour', y.at) - interval '1 hour', date_trunc('hour', y.at)
from (select x.user_id, x.k, x.email, x.at,
             case when x.lc then (array['first_practice', 'finish_assessment', 'upgrade_offer', 'practice_tips'])[x.k]
                  else 'newsletter_' || x.k end as campaign,
             case when x.lc then 'lifecycle' else 'scheduled' end as kind,
             case when x.lc then jsonb_build_object('first_name', x.first_name) else '{}'::jsonb end as context,
             case when not x.lc and x.r >= 0.98 then 'pending'
                  when not x.lc and x.r >= 0.97 then 'cancelled'
                  when x.r >= 0.92 and x.r < 0.97 then 'failed'
                  else 'sent' end as status,
             x.lc and x.r >= 0.95 and x.r < 0.97 as released
      from (select b.*, b.k <= 4 and b.pick < 0.6 as lc,
                   case when not (b.k <= 4 and b.pick < 0.6) and b.r >= 0.98
                        then %(anchor)s + b.when_ * interval '7 days'
                        else %(anchor)s - b.when_ * interval '730 days' end as at
            from (select u.user_id, u.email, u.first_name, u.signed_up_at, k,
                         random() as pick, random() as r, random() as when_
                  from app.users u cross join generate_series(1, %(slots)s) as k
                  where u.user_id between %(lo)s and %(hi)s) as b) as x
      where x.at >= x.signed_up_at) as y
"""

SUPPRESSION_SQL = """
insert into mail.suppression (user_id, email, email_key, scope, source, reason, created_at)
select case when user_id %% 200 = 2 then null else user_id end,
       case when user_id %% 200 = 2 then lower(email) end,
       case when user_id %% 200 = 2 then lower(email) end, -- the mailbox key of these ASCII addresses
       case when user_id %% 200 = 3 then 'practice_tips' else 'all' end,
       'unsubscribe', 'bench', %(anchor)s - (user_id %% 300) * interval '1 day'
from app.users where user_id %% 200 < 4
"""


def _secondary_indexes(conn: psycopg.Connection, tables: list[str]) -> list[tuple[str, str]]:
    """``(qualified name, CREATE INDEX ...)`` of every index of ``tables`` not backing a constraint."""
    return [(r[0], r[1]) for r in conn.execute(
        "select format('%%I.%%I', n.nspname, c.relname), pg_get_indexdef(i.indexrelid)"
        " from pg_index i join pg_class c on c.oid = i.indexrelid join pg_namespace n on n.oid = c.relnamespace"
        " where i.indrelid = any(%s::regclass[])"
        "   and not exists (select 1 from pg_constraint k where k.conindid = i.indexrelid)",
        (tables,)).fetchall()]


def _session(dsn: str, seed: float) -> psycopg.Connection:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("set maintenance_work_mem = '256MB'")
    conn.execute("set synchronous_commit = off")
    conn.execute("select setseed(%s)", (seed,))
    return conn


def load(dsn: str, users: int, rows_per_user: int = 5, log: Any = print, workers: int = 2) -> dict[str, Any]:
    """Fill an empty, migrated database (with the ``app`` schema) and return timings (s) and counts.

    ``workers`` sessions share the work (the two halves of the user range; the index builds; the
    vacuums), each seeded on its own, so the population is the same from run to run."""
    timings: dict[str, float] = {}
    tables = ["app.users", "app.assessments", "mail.send_log", "mail.suppression"]
    conns = [_session(dsn, 0.42 + 0.1 * i) for i in range(workers)]
    pool = ThreadPoolExecutor(workers)

    def on_all(jobs: list[tuple[str, dict[str, Any]]]) -> None:
        """Run (sql, params) jobs, each session taking the next one when free."""
        queue: SimpleQueue[tuple[str, dict[str, Any]]] = SimpleQueue()
        for j in jobs:
            queue.put(j)

        def drain(conn: psycopg.Connection) -> None:
            while not queue.empty():
                q, p = queue.get()
                conn.execute(q, p or None)

        for f in [pool.submit(drain, c) for c in conns]:
            f.result()

    def step(label: str, jobs: list[tuple[str, dict[str, Any]]]) -> None:
        t0 = time.perf_counter()
        on_all(jobs)
        timings[label] = round(time.perf_counter() - t0, 1)
        log(f"    {label}: {timings[label]} s")

    try:
        conn = conns[0]
        indexes = _secondary_indexes(conn, tables)
        fks = conn.execute("select conname, pg_get_constraintdef(oid) from pg_constraint"
                           " where conrelid = 'app.assessments'::regclass and contype = 'f'").fetchall()
        for name, _ in fks:
            conn.execute(f'alter table app.assessments drop constraint "{name}"')
        for name, _ in indexes:
            conn.execute(f"drop index {name}")
        base = {"anchor": ANCHOR, "n": users, "slots": 2 * rows_per_user}
        halves = [dict(base, lo=1 + i * users // workers, hi=(i + 1) * users // workers) for i in range(workers)]
        step("users", [(USERS_SQL, base)])
        step("assessments + send_log", [(sql, h) for sql in (SEND_LOG_SQL, ASSESSMENTS_SQL) for h in halves])
        step("suppression", [(SUPPRESSION_SQL, base)])
        step("indexes", [(ddl, {}) for _, ddl in indexes])
        for name, ddl in fks:
            conn.execute(f'alter table app.assessments add constraint "{name}" {ddl}')
        step("vacuum_analyze", [(f"vacuum (analyze) {t}", {}) for t in ("mail.send_log", *tables[:2], tables[3])])
        counts = dict(zip(("users", "assessments", "send_log", "suppression"), conn.execute(
            "select (select count(*) from app.users), (select count(*) from app.assessments),"
            " (select count(*) from mail.send_log), (select count(*) from mail.suppression)").fetchone(),
            strict=True))
    finally:
        pool.shutdown()
        for c in conns:
            c.close()
    return {"seconds": timings, "rows": counts, "indexes_rebuilt": len(indexes)}


# -- one population per `make bench` run, shared by the suites that need the same shape ------------------

#: ``(server, users, rows_per_user)`` -> ``(template database name, admin DSN, load() result)``: the
#: populations built in this process, kept as templates until :func:`drop_shared`.
_SHARED: dict[tuple[str, int, int], tuple[str, str, dict[str, Any]]] = {}


def _server(dsn: str) -> str:
    d = conninfo_to_dict(dsn)
    return f"{d.get('host')}:{d.get('port')}"


@contextmanager
def shared_copy(dsn: str, users: int, suffix: str, rows_per_user: int = 5,
                log: Any = print) -> Iterator[tuple[str, dict[str, Any]]]:
    """A private, writable copy of the one population of ``users`` x ``rows_per_user`` built in this
    process on the server of ``dsn``; yields ``(copy DSN, info)`` and drops the copy on exit.

    The first call builds the population with :func:`load` into a template database (migrated, with
    the ``app`` schema, loaded, ``VACUUM ANALYZE``d: the state every suite measured when it built its
    own); every call then takes ``CREATE DATABASE ... TEMPLATE ... STRATEGY FILE_COPY``, a copy of
    the template's files: the same pages, rows, ids, visibility map and planner statistics, so a suite
    sees exactly the population it would have built (same ANCHOR, same seeds), and what one suite
    writes (the audience suite's scale runs, the e2e runs) never reaches another. ``info``:
    ``built_seconds`` (this call's build, 0 when reused), ``copy_seconds``, ``build`` (the
    :func:`load` result of the shared build: step seconds and row counts), ``reused`` (bool).

    The templates live until :func:`drop_shared` (``python -m bench`` calls it at the end; an
    ``atexit`` hook covers a suite run on its own)."""
    key = (_server(dsn), users, rows_per_user)
    built_s = 0.0
    if key not in _SHARED:
        t0 = time.perf_counter()
        base = conninfo_to_dict(dsn).get("dbname") or "mailflow_bench"
        template = f"{base}_pop{users}_{uuid.uuid4().hex[:4]}"[:50]
        tdsn = devenv.create_database(dsn, template, exist_ok=False)
        try:
            with psycopg.connect(tdsn, autocommit=True) as conn:
                migrate(conn)
                conn.execute(schema_sql())
            loaded = load(tdsn, users, rows_per_user, log=log)
        except BaseException:
            devenv.drop_database(dsn, template)
            raise
        if not _SHARED:
            atexit.register(drop_shared)
        _SHARED[key] = (template, dsn, loaded)
        built_s = time.perf_counter() - t0
    template, _, loaded = _SHARED[key]
    t0 = time.perf_counter()
    name = f"{template}_{suffix}"[:63]
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(pgsql.SQL("create database {} template {} strategy file_copy").format(
            pgsql.Identifier(name), pgsql.Identifier(template)))
    copy_s = time.perf_counter() - t0
    log(f"    population of {users} users: {f'built in {built_s:.1f} s' if built_s else 'reused'},"
        f" copied in {copy_s:.1f} s")
    try:
        yield make_conninfo(dsn, dbname=name), {"built_seconds": round(built_s, 1), "copy_seconds": round(copy_s, 1),
                                                "build": loaded, "reused": not built_s}
    finally:
        devenv.drop_database(dsn, name)


def drop_shared() -> None:
    """Drop the shared population templates built in this process (idempotent)."""
    while _SHARED:
        _, (name, admin, _) = _SHARED.popitem()
        devenv.drop_database(admin, name)
