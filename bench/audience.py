"""Metric 4: audience selection at scale, and the send-log read paths analysts use.

A dedicated database gets 1,000,000 ``app.users``, ~2,000,000 assessments and ~5,000,000
``mail.send_log`` rows (see :mod:`bench.population`; quick: a tenth), ``VACUUM ANALYZE``. Then, for
each lifecycle campaign, with the parameters of the hourly run that ends at :data:`ANCHOR`
(the campaign's own window, cooldown since ``end - cooldown``, ``MAILFLOW_MAX_ATTEMPTS``), the real
composed SQL of :class:`~mailflow.store.PostgresStore` is timed from the client:

* ``audience_count`` (what the engine runs once per campaign per run), median of ``REPS``;
* ``audience_page``: the first page of 100 (median of ``REPS``) and the next ``NEXT_PAGES`` keyset
  pages on the same connection (psycopg prepares a statement after 5 executions, as in a run);
* ``EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON)`` of both: the plan must not read
  ``mail.send_log`` with a Seq Scan (every exclusion probe is an index probe); seq scans of the
  small ``mail.suppression`` are reported, not failed. JIT compile time is reported.

Then the example queries of ``docs/send_log.md`` (```sql blocks) and the ``mail`` views (each filtered
the way its comment says is index-backed) are run and checked the same way, if they exist.
Last, ``run_lifecycle`` with the instant provider for ``SCALE_CHUNKS`` chunks per campaign at this
scale: metric 3 with production-size tables.
"""

from __future__ import annotations

import dataclasses
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench import population
from bench.common import ANCHOR, ChunkClock, InstantProvider, median, metric, renderer, scratch_database
from mailflow.campaigns import Campaign, load_campaigns
from mailflow.engine import run_lifecycle
from mailflow.model import DataInterval, RunContext
from mailflow.sql import query as named_query
from mailflow.store import PostgresStore, caps_sql

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
NEXT_PAGES = 11
SCALE_CHUNKS = 10
EXPLAIN = pgsql.SQL("explain (analyze, buffers, timing off, format json) ")

#: A candidate rewrite of practice_tips (same rows: the OR of two windows as a UNION of two index
#: range scans), measured next to the shipped SQL; not used by the product.
PRACTICE_TIPS_UNION = """
select u.user_id, u.email, u.first_name, r.kind as recent_kind
from app.users u
left join lateral (
        select a.kind from app.assessments a
        where a.user_id = u.user_id and a.started_at >= %(window_start)s and a.started_at < %(window_end)s
        order by a.started_at desc, a.assessment_id desc
        limit 1) r on true
where u.user_id in (select x.user_id from app.users x
                    where x.last_active_at >= %(window_start)s and x.last_active_at < %(window_end)s
                    union
                    select a.user_id from app.assessments a
                    where a.started_at >= %(window_start)s and a.started_at < %(window_end)s)
"""


#: The cooldown exclusion of lifecycle.eligible as shipped, and a candidate split into two anti-joins
#: (same rows): "sent since cooldown_since" alone can use the sent_at index and be hashed once,
#: instead of one probe per candidate. Measured next to the shipped SQL; not used by the product.
COOLDOWN_SHIPPED = """  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id
                    and c.status in ('pending', 'sending', 'sent')
                    and case c.status
                          when 'sent' then c.sent_at >= %(cooldown_since)s
                          when 'pending' then coalesce(c.scheduled_at, c.minted_at) < %(cooldown_until)s
                          else true end)"""
COOLDOWN_SPLIT = """  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status = 'sent' and c.sent_at >= %(cooldown_since)s)
  and not exists (select 1 from mail.send_log c
                  where c.user_id = a.user_id and c.status in ('pending', 'sending')
                    and (c.status = 'sending' or coalesce(c.scheduled_at, c.minted_at) < %(cooldown_until)s))"""


def _nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    out = [node]
    for child in node.get("Plans", []):
        out += _nodes(child)
    return out


def plan_summary(doc: list[dict[str, Any]]) -> dict[str, Any]:
    """Scans and costs of an ``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` result."""
    root = doc[0]
    nodes = _nodes(root["Plan"])
    seq = sorted({n["Relation Name"] for n in nodes if n["Node Type"] == "Seq Scan"})
    send_log = sorted({f"{n['Node Type']}" + (f" ({n['Index Name']})" if "Index Name" in n else "")
                       for n in nodes if n.get("Relation Name") == "send_log"}
                      | {f"{n['Node Type']} ({n['Index Name']})" for n in nodes
                         if n["Node Type"] == "Bitmap Index Scan" and n.get("Index Name", "").startswith("send_log")})
    jit = root.get("JIT", {}).get("Timing", {})
    return {
        "seq_scans": seq,
        "send_log_access": send_log,
        "indexes": sorted({n["Index Name"] for n in nodes if "Index Name" in n}),
        "explain_exec_ms": round(root.get("Execution Time", 0.0), 1),
        "planning_ms": round(root.get("Planning Time", 0.0), 1),
        "jit_ms": round(jit.get("Total", 0.0), 1) if isinstance(jit, dict) else None,
        "buffers_hit": root["Plan"].get("Shared Hit Blocks"),
        "buffers_read": root["Plan"].get("Shared Read Blocks"),
    }


def _timed(fn: Any) -> tuple[float, Any]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def measure_campaign(conn: psycopg.Connection, store: PostgresStore, c: Campaign, interval: DataInterval,
                     reps: int) -> dict[str, Any]:
    window, since = c.window(interval), interval.end - c.cooldown
    params = store._params(c, window, since)
    count_sql = store._audience_sql("audience_count", c)
    page_sql = store._audience_sql("audience_page", c)
    counts = [_timed(lambda: store.count_audience(c, window, since)) for _ in range(reps)]

    def page(after: int) -> list[tuple]:
        with conn.transaction():
            return conn.execute(page_sql, params | {"after": after, "limit": 100}).fetchall()

    firsts = [_timed(lambda: page(0)) for _ in range(reps)]
    rows = firsts[-1][1]
    nexts: list[float] = []
    while rows and len(nexts) < NEXT_PAGES:
        dt, rows = _timed(lambda after=rows[-1][0]: page(after))
        nexts.append(dt)
    with conn.transaction():
        count_plan = plan_summary(conn.execute(EXPLAIN + count_sql, params).fetchone()[0])
        page_plan = plan_summary(conn.execute(EXPLAIN + page_sql, params | {"after": 0, "limit": 100}).fetchone()[0])
    return {
        "eligible": counts[0][1], "count_s": median([t for t, _ in counts]), "count_runs_s": [round(t, 3) for t, _ in counts],
        "page_s": median([t for t, _ in firsts]), "page_runs_s": [round(t, 3) for t, _ in firsts],
        "next_pages": len(nexts), "next_page_p50_s": round(median(nexts), 4) if nexts else None,
        "next_page_max_s": round(max(nexts), 4) if nexts else None,
        "count_plan": count_plan, "page_plan": page_plan,
        "window": [window[0].isoformat(), window[1].isoformat()], "cooldown_since": since.isoformat(),
    }


# -- docs/send_log.md examples and the mail views --------------------------------------------------------

_TOKEN = re.compile(r"(?P<str>'(?:[^']|'')*')|:'(?P<q>[A-Za-z_]\w*)'|(?<![:\w]):(?P<r>[A-Za-z_]\w*)|%\((?P<p>\w+)\)s")
_SET = re.compile(r"^\\set\s+(\w+)\s+(.*?)\s*$")


def _sample_values(conn: psycopg.Connection) -> dict[str, str]:
    """Realistic psql variables for the doc examples (strings, as psql has them)."""
    row = conn.execute("select user_id from mail.send_log where campaign = 'practice_tips'"
                       " and status = 'sent' order by sent_at desc limit 1").fetchone()
    run = conn.execute("select run_id from mail.send_log where kind = 'lifecycle' and run_id is not null"
                       " order by minted_at desc limit 1").fetchone()
    return {"campaign": "practice_tips", "user_id": str(row[0] if row else 1), "run_id": run[0] if run else "",
            "day": str((ANCHOR - timedelta(days=1)).date()), "since": str((ANCHOR - timedelta(days=7)).date())}


def doc_queries(path: Path) -> list[tuple[str, str, dict[str, str]]]:
    """``(label, sql, psql variables set in the block)`` for each read-only statement in the ```sql
    blocks of ``path``; ``\\set`` lines give the block's default parameters."""
    text = path.read_text(encoding="utf-8")
    out: list[tuple[str, str, dict[str, str]]] = []
    for i, block in enumerate(re.findall(r"```sql\n(.*?)```", text, flags=re.S), start=1):
        defaults: dict[str, str] = {}
        lines = []
        for ln in block.splitlines():
            m = _SET.match(ln.strip())
            if m:
                v = m.group(2)
                defaults[m.group(1)] = v[1:-1].replace("''", "'") if len(v) > 1 and v[0] == v[-1] == "'" else v
            elif not ln.strip().startswith("--"):
                lines.append(ln)
        for j, stmt in enumerate(s.strip() for s in re.split(r";\s*(?:\n|$)", "\n".join(lines))):
            if stmt and re.match(r"(?is)^(select|with)\b", stmt):
                out.append((f"docs/{path.name} query {i}.{j + 1}", stmt, defaults))
    return out


def _bind(query: str, values: dict[str, str]) -> tuple[str | None, str | None]:
    """Substitute psql ``:'name'`` (quoted) / ``:name`` (raw) and ``%(name)s`` (quoted) variables;
    returns ``(sql, None)`` or ``(None, reason)`` when one is unknown."""
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        if m.group("str"):
            return m.group(0)
        name = m.group("q") or m.group("r") or m.group("p")
        if name not in values:
            missing.append(name)
            return m.group(0)
        v = str(values[name])
        return v if m.group("r") else "'" + v.replace("'", "''") + "'"

    bound = _TOKEN.sub(sub, query)
    if missing:
        return None, f"unbound variable(s) {sorted(set(missing))}"
    return bound, None


def view_queries(conn: psycopg.Connection, values: dict[str, str]) -> list[tuple[str, str, dict[str, str]]]:
    """One query per view of schema ``mail``, filtered the way its comment says is index-backed."""
    out: list[tuple[str, str, dict[str, str]]] = []
    for (name,) in conn.execute("select viewname from pg_views where schemaname = 'mail' order by 1").fetchall():
        cols = {r[0] for r in conn.execute("select column_name from information_schema.columns"
                                           " where table_schema = 'mail' and table_name = %s", (name,)).fetchall()}
        ident = pgsql.Identifier("mail", name)
        if "user_id" in cols:
            q = pgsql.SQL("select * from {} where user_id = {}").format(ident, pgsql.Literal(int(values["user_id"])))
            out.append((f"view mail.{name} (one user)", q.as_string(conn), {}))
        elif "campaign" in cols:
            q = pgsql.SQL("select * from {} where campaign = {}").format(ident, pgsql.Literal(values["campaign"]))
            out.append((f"view mail.{name} (one campaign)", q.as_string(conn), {}))
        else:
            q = pgsql.SQL("select * from {} limit 100").format(ident)
            out.append((f"view mail.{name} (first 100 rows)", q.as_string(conn), {}))
    return out


def measure_reads(conn: psycopg.Connection) -> list[dict[str, Any]]:
    values = _sample_values(conn)
    doc = ROOT / "docs" / "send_log.md"
    found = doc_queries(doc) if doc.is_file() else []
    views = view_queries(conn, values)
    out: list[dict[str, Any]] = []
    if not doc.is_file():
        out.append(metric("send_log_doc_queries_found", 0, "queries", None, None,
                          note="docs/send_log.md does not exist (yet): no example queries run"))
    for label, query, defaults in found + views:
        bound, reason = _bind(query, defaults | values)
        if bound is None:
            out.append(metric(f"read: {label}", float("nan"), "s", "index-backed (no Seq Scan on mail.send_log)",
                              None, skipped=reason, sql=query[:400]))
            continue
        try:
            with conn.transaction():
                conn.execute("set transaction read only")
                conn.execute("set local statement_timeout = '30s'")
                dt, doc = _timed(lambda q=bound: conn.execute(EXPLAIN + pgsql.SQL(q)).fetchone()[0])  # type: ignore[arg-type]
                plan = plan_summary(doc)
        except psycopg.Error as exc:
            out.append(metric(f"read: {label}", float("nan"), "s", "index-backed (no Seq Scan on mail.send_log)", None,
                              error=str(exc).splitlines()[0][:300], sql=bound[:400]))
            continue
        backed = "send_log" not in plan["seq_scans"]
        out.append(metric(f"read: {label}", dt, "s", "index-backed (no Seq Scan on mail.send_log)", backed,
                          sql=bound[:400], **plan))
    return out


def scale_pipeline(dsn: str, interval: DataInterval) -> dict[str, Any]:
    """``run_lifecycle`` per campaign for ``SCALE_CHUNKS`` chunks on the big tables."""
    per: dict[str, Any] = {}
    gaps: list[float] = []
    total_wall = total_chunks = 0.0
    with psycopg.connect(dsn, autocommit=True) as conn:
        store = PostgresStore(conn)
        r = renderer()
        for c in load_campaigns():
            provider = InstantProvider()
            t0 = time.perf_counter()
            run_lifecycle(store, provider, r, [c], interval, budget_seconds=SCALE_CHUNKS, clock=ChunkClock(provider),
                          run=RunContext(dag_id="bench", run_id="bench-scale", task_id="send_campaigns"))
            wall = time.perf_counter() - t0
            g = [b - a for a, b in zip(provider.stamps, provider.stamps[1:], strict=False)]
            gaps += g
            total_wall += wall
            total_chunks += provider.calls
            per[c.name] = {"chunks": provider.calls, "wall_s": round(wall, 2),
                           "p50_ms": round(median(g) * 1000, 1) if g else None}
    return {"p50_ms": median(gaps) * 1000 if gaps else float("nan"),
            "mean_ms": total_wall / total_chunks * 1000 if total_chunks else float("nan"),
            "chunks": int(total_chunks), "per_campaign": per}


def snapshot_alternative(conn: psycopg.Connection, store: PostgresStore, c: Campaign, interval: DataInterval,
                         shipped_next_page_s: float) -> dict[str, Any]:
    """Materialise the eligible audience once (a temp table keyed by user_id), then page it: the
    cost of a per-run snapshot and of its pages, next to the shipped per-page recomputation."""
    window, since = c.window(interval), interval.end - c.cooldown
    params = store._params(c, window, since)
    eligible = pgsql.SQL(named_query("lifecycle", "eligible")).format(audience=pgsql.SQL(c.audience_sql),
                                                                      caps=caps_sql(c.contact_policy))
    table = pgsql.Identifier(f"bench_snapshot_{c.name}")
    t0 = time.perf_counter()
    with conn.transaction():
        conn.execute(pgsql.SQL("create temp table {} as select e.user_id, e.email, e.context from (").format(table)
                     + eligible + pgsql.SQL(") as e"), params)
        conn.execute(pgsql.SQL("alter table {} add primary key (user_id)").format(table))
        conn.execute(pgsql.SQL("analyze {}").format(table))
    snap_s = time.perf_counter() - t0
    page = pgsql.SQL("select user_id, email, context from {} where user_id > %s order by user_id limit 100").format(table)
    after, times = 0, []
    for _ in range(NEXT_PAGES):
        dt, rows = _timed(lambda a=after: conn.execute(page, (a,)).fetchall())
        if not rows:
            break
        times.append(dt)
        after = rows[-1][0]
    conn.execute(pgsql.SQL("drop table {}").format(table))
    return metric(f"alt: audience page of {c.name} from a per-run snapshot", median(times), "s per page", None, None,
                  snapshot_seconds=round(snap_s, 3), pages=len(times), shipped_next_page_p50_s=shipped_next_page_s,
                  note="snapshot once per run (about one audience_count), then keyset pages of the temp table")


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    users = 100_000 if quick else 1_000_000
    reps = 2 if quick else 3
    interval = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
    out: list[dict[str, Any]] = []
    with scratch_database(dsn, "audience") as sdsn:
        t0 = time.perf_counter()
        loaded = population.load(sdsn, users, log=print)
        load_s = time.perf_counter() - t0
        scale = {"users": loaded["rows"]["users"], "assessments": loaded["rows"]["assessments"],
                 "send_log_rows": loaded["rows"]["send_log"], "suppressions": loaded["rows"]["suppression"],
                 "load_seconds": round(load_s, 1), "send_event": "empty (not generated)"}
        out.append(metric("audience_population_load_seconds", load_s, "s", None, None,
                          step_seconds=loaded["seconds"], **scale))
        with psycopg.connect(sdsn, autocommit=True) as conn:
            conn.execute("set statement_timeout = '300s'")
            store = PostgresStore(conn)
            jitted: dict[str, float] = {}
            shipped: dict[str, float] = {}
            shipped_page: dict[str, float] = {}
            next_pages: dict[str, float | None] = {}
            for c in load_campaigns():
                m = measure_campaign(conn, store, c, interval, reps)
                jitted[c.name] = m["count_plan"]["jit_ms"] or 0.0
                shipped[c.name], shipped_page[c.name] = m["count_s"], m["page_s"]
                next_pages[c.name] = m["next_page_p50_s"]
                for kind in ("count", "page"):
                    plan = m[f"{kind}_plan"]
                    backed = "send_log" not in plan["seq_scans"]
                    value = m[f"{kind}_s"]
                    params = {k: v for k, v in m.items() if not k.endswith("_plan") and k not in ("count_s", "page_s")}
                    out.append(metric(f"audience_{kind}_{c.name}", value, "s",
                                      f"<= {TARGET_S:g} s, no Seq Scan on mail.send_log",
                                      value <= TARGET_S and backed, **params, **plan, **scale))
                print(f"    {c.name}: eligible {m['eligible']}, count {m['count_s']:.3f} s, page {m['page_s']:.3f} s,"
                      f" next pages p50 {m['next_page_p50_s']} s", flush=True)
            # Measured alternatives (not shipped): JIT off for the counts that JIT-compiled; practice_tips
            # as a UNION of its two windows. One run each (the shipped SQL got REPS).
            conn.execute("set jit = off")
            for c in load_campaigns():
                if not jitted.get(c.name):
                    continue
                window, since = c.window(interval), interval.end - c.cooldown
                dt, _ = _timed(lambda c=c, w=window, s=since: store.count_audience(c, w, s))
                out.append(metric(f"alt: audience_count_{c.name} with jit=off", dt, "s", None, None,
                                  shipped_median_s=round(shipped[c.name], 3), jit_ms_shipped=jitted[c.name]))
            conn.execute("reset jit")
            tips = load_campaigns(only=["practice_tips"])[0]
            alt = dataclasses.replace(tips, audience_sql=PRACTICE_TIPS_UNION.strip())
            alt_store = PostgresStore(conn)
            window, since = alt.window(interval), interval.end - alt.cooldown
            dt, n = _timed(lambda: alt_store.count_audience(alt, window, since))
            with conn.transaction():
                plan = plan_summary(conn.execute(EXPLAIN + alt_store._audience_sql("audience_count", alt),
                                                 alt_store._params(alt, window, since)).fetchone()[0])
            out.append(metric("alt: audience_count_practice_tips as UNION", dt, "s", None, None, eligible=n,
                              shipped_median_s=round(shipped["practice_tips"], 3), **plan))
            with conn.transaction():
                dt, _ = _timed(lambda: conn.execute(alt_store._audience_sql("audience_page", alt),
                                                    alt_store._params(alt, window, since) | {"after": 0, "limit": 100}).fetchall())
            out.append(metric("alt: audience_page_practice_tips as UNION", dt, "s", None, None,
                              shipped_median_s=round(shipped_page["practice_tips"], 3)))
            # Measured alternative (not shipped): the cooldown exclusion as two anti-joins, for the
            # counts over the target. One EXPLAIN ANALYZE each (timing off): its wall time is the value.
            eligible_sql = named_query("lifecycle", "eligible")
            for c in load_campaigns():
                if shipped[c.name] <= TARGET_S:
                    continue
                if COOLDOWN_SHIPPED not in eligible_sql:
                    out.append(metric(f"alt: audience_count_{c.name} with the cooldown split", float("nan"), "s",
                                      None, None, skipped="lifecycle.eligible changed: the variant no longer applies"))
                    continue
                split = pgsql.SQL(eligible_sql.replace(COOLDOWN_SHIPPED, COOLDOWN_SPLIT)).format(
                    audience=pgsql.SQL(c.audience_sql), caps=caps_sql(c.contact_policy))
                q = pgsql.SQL(named_query("lifecycle", "audience_count")).format(eligible=split)
                window, since = c.window(interval), interval.end - c.cooldown
                params = store._params(c, window, since)
                with conn.transaction():
                    dt, doc = _timed(lambda q=q, p=params: conn.execute(EXPLAIN + q, p).fetchone()[0])
                out.append(metric(f"alt: audience_count_{c.name} with the cooldown split", dt, "s", None, None,
                                  shipped_median_s=round(shipped[c.name], 3), **plan_summary(doc)))
            # Measured alternative (not shipped): a per-run snapshot of the eligible audience, paged
            # from a temp table, for the campaigns whose every page recomputes the whole audience.
            for c in load_campaigns():
                if (next_pages.get(c.name) or 0) < 0.05:
                    continue
                out.append(snapshot_alternative(conn, store, c, interval, next_pages[c.name]))
            out += measure_reads(conn)
        sp = scale_pipeline(sdsn, interval)
        out.append(metric("pipeline_ms_per_chunk_p50_at_scale", sp["p50_ms"], "ms per chunk of 100", "<= 20",
                          sp["p50_ms"] <= 20, mean_ms_incl_counts=round(sp["mean_ms"], 1), chunks=sp["chunks"],
                          per_campaign=sp["per_campaign"], **scale))
    return out
