"""`python -m bench.analytics [--quick] [--dsn DSN] [--reuse]`: the analytics views (migrations 0004,
0011), the progress page's queries and the example queries of docs/send_log.md stay index-backed at
scale.

The population is :mod:`bench.population` (1,000,000 users, five send-log rows each; ``--quick``: a
tenth) plus the events the send log would have (``mail.send_event``: a creation event per row and
one per later state change, about 10 million). Each query runs under ``EXPLAIN (ANALYZE, FORMAT
JSON)``; a query is index-backed when its plan has no sequential scan of ``mail.send_log``,
``mail.send_event``, ``app.users`` or ``app.assessments``. One metric per query: its time (ms), met =
index-backed. The progress page's list (``mail.campaign_progress`` unfiltered) counts every
campaign, by index-only scans: index-backed, but its time grows with the whole send log.

``run(dsn, quick)`` has the shape of the other suites (``bench/__main__.py``'s ``SUITES``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from bench.common import ANCHOR, metric, scratch_database

BIG_TABLES = {"send_log", "send_event", "users", "assessments"}

EVENTS_SQL = """
insert into mail.send_event (send_log_id, from_status, to_status, at, attempt, error, provider_message_id,
                             dag_id, run_id, task_id)
select l.id, null, case when l.kind = 'scheduled' then 'pending' else 'sending' end, l.minted_at,
       case when l.kind = 'scheduled' then 0 else 1 end, null, null, l.dag_id, l.run_id, l.task_id
from mail.send_log l
union all
select l.id, case when l.kind = 'scheduled' then 'pending' else 'sending' end, l.status,
       coalesce(l.sent_at, l.released_at, l.claimed_at, l.minted_at), l.attempts, l.error, l.provider_message_id,
       l.dag_id, l.run_id, l.task_id
from mail.send_log l
where l.status in ('sent', 'failed', 'cancelled')
"""


def add_events(dsn: str, log: Any = print) -> float:
    """Fill mail.send_event from the send log (index dropped for the load, rebuilt); seconds."""
    t0 = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("set maintenance_work_mem = '256MB'")
        conn.execute("set synchronous_commit = off")
        ddl = conn.execute("select pg_get_indexdef('mail.send_event_send_log_idx'::regclass)").fetchone()
        assert ddl is not None
        conn.execute("drop index mail.send_event_send_log_idx")
        conn.execute(EVENTS_SQL)
        conn.execute(ddl[0])
        conn.execute("vacuum (analyze) mail.send_event")
    log(f"    loaded send_event in {time.perf_counter() - t0:.1f} s")
    return time.perf_counter() - t0


def doc_queries() -> dict[int, tuple[dict[str, str], str]]:
    """The example queries of docs/send_log.md: ``{n: (psql defaults, SQL with %(name)s)}``."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "send_log.md").read_text(encoding="utf-8")
    out: dict[int, tuple[dict[str, str], str]] = {}
    for m in re.finditer(r"^### Q(\d+)\. .+?\n.*?```sql\n(.*?)```", text, re.S | re.M):
        defaults, lines = {}, []
        for line in m.group(2).splitlines():
            s = re.match(r"^\\set (\w+) '(.*)'$", line.strip())
            if s:
                defaults[s.group(1)] = s.group(2)
            else:
                lines.append(line)
        sql = re.sub(r":'(\w+)'", lambda v: f"%({v.group(1)})s", "\n".join(lines).strip().rstrip(";"))
        out[int(m.group(1))] = (defaults, sql)
    return out


def checks(conn: psycopg.Connection) -> list[tuple[str, str, dict[str, Any], bool]]:
    """``(name, sql, params, must be index-backed)`` for the views, the page's queries and the doc's."""
    from mailflow.orchestration.ui import progress_queries as progress
    from mailflow.store.sql import query

    run_id = "scheduled__" + (ANCHOR - timedelta(days=1, hours=1)).strftime("%Y-%m-%dT%H:%M:%S") + "+00:00"
    user = conn.execute("select user_id from mail.send_log where run_id = %s limit 1", (run_id,)).fetchone()
    user_id = str(user[0]) if user else "4242"
    days_back = (datetime.now(UTC) - ANCHOR).days + 30  # Q10: the 30 days before the population's "now"
    params = {"day": (ANCHOR - timedelta(days=1)).date().isoformat(),
              "since": (ANCHOR - timedelta(days=7)).date().isoformat(),
              "run_id": run_id, "campaign": "practice_tips", "user_id": user_id, "days": str(days_back),
              "cooldown": "7 days", "stale": "15 minutes"}
    out: list[tuple[str, str, dict[str, Any], bool]] = [
        ("view_campaign_daily_by_campaign", "select * from mail.campaign_daily where campaign = %(c)s",
         {"c": "newsletter_3"}, True),
        ("view_campaign_progress_by_campaign", "select * from mail.campaign_progress where campaign = %(c)s",
         {"c": "newsletter_3"}, True),
        ("view_user_email_history_by_user",
         "select * from mail.user_email_history where user_id = %(u)s order by event_at, event_id",
         {"u": int(user_id)}, True),
        ("view_email_status_by_run", "select * from mail.email_status where run_id = %(r)s", {"r": run_id}, True),
        ("page_recent_emails", progress.RECENT_SQL, {"campaign": "practice_tips", "limit": 20}, True),
        ("page_errors", progress.ERRORS_SQL, {"campaign": "newsletter_3", "limit": 20}, True),
        # what the page runs once the counters are seeded (bench.history folds them first)
        ("page_campaign_list", query("counters", "progress"), {"campaign": None}, True),
        ("page_campaign_outcomes_list", query("counters", "outcomes"), {"campaign": None}, True),
        ("page_days", query("counters", "latest_days"), {"campaign": "practice_tips", "days": progress.DAYS}, True),
        # the send charts: per minute while a campaign is active (all / one), per day otherwise
        ("page_sends_per_minute_all", progress.PER_MINUTE_SQL,
         {"since": ANCHOR - timedelta(minutes=progress.LIVE_MINUTES), "campaign": None}, True),
        ("page_sends_per_minute_one", progress.PER_MINUTE_SQL,
         {"since": ANCHOR - timedelta(minutes=progress.LIVE_MINUTES), "campaign": "practice_tips"}, True),
        ("page_sends_per_day_all", progress.PER_DAY_ALL_SQL,
         {"since": ANCHOR - timedelta(days=progress.HISTORY_DAYS)}, True),
        ("page_sends_per_day_one", progress.PER_DAY_ONE_SQL, {"campaign": "practice_tips", "tz": "UTC"}, True),
        ("view_sent_email_by_day", "select * from mail.sent_email where sent_at >= %(a)s and sent_at < %(b)s",
         {"a": ANCHOR - timedelta(days=1), "b": ANCHOR}, True),
    ]
    for n, (defaults, sql) in sorted(doc_queries().items()):
        out.append((f"doc_q{n}", sql, defaults | {k: v for k, v in params.items() if k in defaults}, True))
    return out


def seq_scans(plan: dict[str, Any]) -> list[str]:
    """Relations of BIG_TABLES read by a sequential scan anywhere in a JSON plan."""
    found = []
    if plan.get("Node Type") == "Seq Scan" and plan.get("Relation Name") in BIG_TABLES:
        found.append(str(plan["Relation Name"]))
    for child in plan.get("Plans", []):
        found += seq_scans(child)
    return found


def run(dsn: str, quick: bool = False, *, reuse: bool = False, log: Any = print) -> list[dict[str, Any]]:
    """Load (unless ``reuse``: ``dsn`` already holds the population and events) and check every query."""
    if reuse:
        return _check(dsn, quick, log)
    from bench import population

    users = 100_000 if quick else 1_000_000
    with scratch_database(dsn, "analytics") as sdsn:
        population.load(sdsn, users, log=log)  # five send-log rows per user
        add_events(sdsn, log=log)
        return _check(sdsn, quick, log)


def _check(dsn: str, quick: bool, log: Any) -> list[dict[str, Any]]:
    metrics = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        sizes = conn.execute("select (select count(*) from app.users), (select count(*) from mail.send_log),"
                             " (select count(*) from mail.send_event)").fetchone()
        assert sizes is not None
        for name, sql, params, required in checks(conn):
            conn.execute(sql, params).fetchall()  # warm the cache once
            t0 = time.perf_counter()
            [[doc]] = conn.execute(f"explain (analyze, format json) {sql}", params).fetchall()  # type: ignore[arg-type]
            ms = (time.perf_counter() - t0) * 1000
            scans = seq_scans(doc[0]["Plan"])
            met = not scans if required else None
            log(f"  {name}: {ms:.1f} ms, {'index-backed' if not scans else 'seq scan of ' + ', '.join(scans)}")
            metrics.append(metric(f"analytics_{name}", round(ms, 1), "ms",
                                  "no seq scan of send_log/send_event/users/assessments" if required else None,
                                  met, users=sizes[0], send_log_rows=sizes[1], send_event_rows=sizes[2],
                                  seq_scans=scans, quick=quick))
    return metrics


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tenth of the population")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="server (a scratch database is created there) or, with --reuse, the loaded database")
    p.add_argument("--reuse", action="store_true", help="--dsn already holds the population and its events")
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    dsn = args.dsn or devenv.embedded_dsn(devenv.STATE / "pgdata-bench")
    metrics = run(dsn, args.quick, reuse=args.reuse)
    print(json.dumps([{k: m[k] for k in ("name", "value", "met")} for m in metrics], indent=1))
    return 0 if all(m["met"] is not False for m in metrics) else 1


if __name__ == "__main__":
    sys.exit(main())
