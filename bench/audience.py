"""Metric 4: audience selection at scale, and the send-log read paths analysts use.

A private copy of the run's shared population (:func:`bench.population.shared_copy`: built once per
``python -m bench``, also used by ``lifecycle_e2e``) has 1,000,000 ``app.users``, ~2,000,000
assessments and ~5,000,000 ``mail.send_log`` rows (see :mod:`bench.population`; quick: a tenth), ``VACUUM ANALYZE``. Then, for
each lifecycle campaign, with the parameters of the hourly run that ends at :data:`ANCHOR`
(the campaign's own window, cooldown since ``end - cooldown``, ``MAILFLOW_MAX_ATTEMPTS``), the real
composed SQL of :class:`~mailflow.store.send_log.PostgresStore` is timed from the client:

* ``audience_snapshot``: ``PostgresStore.open_audience``, the run's one evaluation of the eligible
  audience into a temporary table (one statement: the audience minus dedupe and suppression, then
  one contact-policy probe per remaining candidate; then its key), median of ``REPS``; its size is
  the run's ``eligible`` (there is no separate ``count(*)`` in a run any more);
* ``audience_page``: the first page of 100 from the snapshot (median of ``REPS``) and the next
  ``NEXT_PAGES`` keyset pages;
* ``EXPLAIN (ANALYZE, BUFFERS, TIMING OFF, FORMAT JSON)`` of the snapshot's statement: the plan must
  not read ``mail.send_log`` with a Seq Scan; seq scans of the small ``mail.suppression`` (and of
  ``app.users`` where an audience file reads most users, e.g. ``upgrade_offer``'s free plan) are
  reported, not failed;
* ``audience_dry_run_count``: ``audience_count`` (dry runs and ``preview`` only), once.

Then the example queries of ``docs/send_log.md`` (```sql blocks) and the ``mail`` views (each filtered
the way its comment says is index-backed) are run and checked the same way, if they exist.
Last, ``run_lifecycle`` with the instant provider for ``SCALE_CHUNKS`` chunks per campaign at this
scale: metric 3 with production-size tables, with its breakdown per chunk (page, mint, render,
store, apply).
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql as pgsql

from bench import population
from bench.common import ANCHOR, ChunkClock, InstantProvider, median, metric, record_durations, renderer
from mailflow.campaigns import Campaign, load_campaigns
from mailflow.model.outcome import DataInterval, RunContext
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import PostgresStore, eligible_sql
from mailflow.store.sql import query as named_query

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 1.0
NEXT_PAGES = 11
SCALE_CHUNKS = 10
EXPLAIN = pgsql.SQL("explain (analyze, buffers, timing off, format json) ")

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


def snapshot_plans(conn: psycopg.Connection, c: Campaign, params: dict[str, Any]) -> dict[str, Any]:
    """EXPLAIN ANALYZE of the snapshot's statement (``lifecycle.snapshot_create``: the audience, its
    exclusions and the contact-policy probe in one ``CREATE TEMP TABLE ... AS``) in a transaction
    that is rolled back (the temp table goes with it)."""
    ident = pgsql.Identifier("pg_temp", "bench_snapshot_plan")
    out: dict[str, Any] = {}
    try:
        with conn.transaction(force_rollback=True):
            conn.execute("set local jit = off")  # as PostgresStore.open_audience
            conn.execute("set local work_mem = '64MB'")
            out["snapshot"] = plan_summary(conn.execute(EXPLAIN + pgsql.SQL(named_query("lifecycle", "snapshot_create")).format(
                snapshot=ident, eligible=eligible_sql(c, snapshot=True)), params).fetchone()[0])
    except psycopg.Error:
        pass
    return out


def measure_campaign(conn: psycopg.Connection, store: PostgresStore, c: Campaign, interval: DataInterval,
                     reps: int) -> dict[str, Any]:
    """The audience snapshot of one campaign (``open_audience``: evaluated once per run), median of
    ``reps``; its pages; EXPLAIN of its statements; the dry-run ``audience_count`` once."""
    window, since = c.window(interval), interval.end - c.cooldown
    params = store._params(c, window, since)
    snaps = []
    for _ in range(reps):
        snaps.append(_timed(lambda: store.open_audience(c, window, since)))
        if len(snaps) < reps:
            store.close_audience(c)
    page_sql = pgsql.SQL(named_query("lifecycle", "snapshot_page")).format(snapshot=store._snapshots[c.name])

    def page(after: int) -> list[tuple]:
        with conn.transaction():
            return conn.execute(page_sql, {"after": after, "limit": 100}).fetchall()

    firsts = [_timed(lambda: page(0)) for _ in range(reps)]
    rows = firsts[-1][1]
    nexts: list[float] = []
    while rows and len(nexts) < NEXT_PAGES:
        dt, rows = _timed(lambda after=rows[-1][0]: page(after))
        nexts.append(dt)
    store.close_audience(c)
    plans = snapshot_plans(conn, c, params)
    count_s, counted = _timed(lambda: store.count_audience(c, window, since))
    return {
        "eligible": snaps[0][1], "snapshot_s": median([t for t, _ in snaps]),
        "snapshot_runs_s": [round(t, 3) for t, _ in snaps],
        "page_s": median([t for t, _ in firsts]), "page_runs_s": [round(t, 3) for t, _ in firsts],
        "next_pages": len(nexts), "next_page_p50_s": round(median(nexts), 5) if nexts else None,
        "next_page_max_s": round(max(nexts), 5) if nexts else None,
        "plans": plans, "dry_run_count_s": round(count_s, 3), "dry_run_count": counted,
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


def scale_pipeline(dsn: str, interval: DataInterval, page_s: dict[str, float], pipelined: bool = True) -> dict[str, Any]:
    """``run_lifecycle`` per campaign for ``SCALE_CHUNKS`` chunks on the big tables, provider excluded.
    ``pipelined`` (the headline): as the Airflow task runs it, the sender thread applying each answer
    on a second connection while the caller prepares the next chunk; else one step after the other.
    Breakdown per chunk from timers around ``mint_chunk`` (page + guard + mint + render + store, one
    transaction), the renderer's ``prepare_batch``, the keyed insert of rows, events and batch bytes
    (``_mint_keyed`` without its render) and ``apply``; the page is the snapshot's measured next-page
    p50 (``page_s``); guard = the rest of ``mint_chunk`` (suppression, contact lock and policy,
    addresses, ids)."""
    per: dict[str, Any] = {}
    gaps: list[float] = []
    total_wall = total_chunks = 0.0
    spans: dict[str, list[float]] = {"mint_chunk": [], "render": [], "store": [], "apply": [], "snapshot": []}
    pages: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as conn2:
        store = PostgresStore(conn)
        apply_store = store.companion(conn2)
        r = renderer()
        record_durations(store, "open_audience", spans["snapshot"])
        record_durations(store, "mint_chunk", spans["mint_chunk"])
        record_durations(store, "_mint_keyed", spans["store"])
        record_durations(apply_store if pipelined else store, "apply", spans["apply"])
        record_durations(r, "prepare_batch", spans["render"])
        for c in load_campaigns():
            provider = InstantProvider()
            t0 = time.perf_counter()
            run_lifecycle(store, provider, r, [c], interval, budget_seconds=SCALE_CHUNKS, clock=ChunkClock(provider),
                          run=RunContext(dag_id="bench", run_id=f"bench-scale-{pipelined}", task_id="send_campaigns"),
                          pipelined=pipelined, apply_store=apply_store if pipelined else None)
            wall = time.perf_counter() - t0
            g = [b - a for a, b in zip(provider.stamps, provider.stamps[1:], strict=False)]
            gaps += g
            pages += [page_s.get(c.name, 0.0)] * provider.calls
            total_wall += wall
            total_chunks += provider.calls
            per[c.name] = {"chunks": provider.calls, "wall_s": round(wall, 2),
                           "p50_ms": round(median(g) * 1000, 1) if g else None}
    n = max(total_chunks, 1)
    page_ms = sum(pages) / n * 1000
    ms = {k: sum(v) / n * 1000 for k, v in spans.items()}
    breakdown = {"page (snapshot keyset)": round(page_ms, 2),
                 "guard (suppression, contact lock + policy, addresses, ids)": round(
                     ms["mint_chunk"] - ms["store"] - page_ms, 2),
                 "render (jinja2 + json)": round(ms["render"], 2),
                 "store (rows with key + events + batch bytes)": round(ms["store"] - ms["render"], 2),
                 "apply (reconcile by index + events)" + (" [sender thread]" if pipelined else ""): round(ms["apply"], 2)}
    return {"p50_ms": median(gaps) * 1000 if gaps else float("nan"),
            "mean_ms": (total_wall - sum(spans["snapshot"])) / n * 1000,
            "snapshots_s": round(sum(spans["snapshot"]), 2), "pipelined": pipelined,
            "chunks": int(total_chunks), "per_campaign": per, "breakdown_ms_per_chunk": breakdown}



def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    users = 100_000 if quick else 1_000_000
    reps = 2 if quick else 3
    interval = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
    out: list[dict[str, Any]] = []
    with population.shared_copy(dsn, users, "audience", log=print) as (sdsn, pop):
        load_s = pop["built_seconds"] + pop["copy_seconds"]
        loaded = pop["build"]
        scale = {"users": loaded["rows"]["users"], "assessments": loaded["rows"]["assessments"],
                 "send_log_rows": loaded["rows"]["send_log"], "suppressions": loaded["rows"]["suppression"],
                 "load_seconds": round(load_s, 1), "send_event": "empty (not generated)"}
        out.append(metric("audience_population_load_seconds", load_s, "s", None, None,
                          step_seconds=loaded["seconds"], built_seconds=pop["built_seconds"],
                          copy_seconds=pop["copy_seconds"], reused_shared_population=pop["reused"], **scale))
        with psycopg.connect(sdsn, autocommit=True) as conn:
            conn.execute("set statement_timeout = '300s'")
            store = PostgresStore(conn)
            next_pages: dict[str, float] = {}
            for c in load_campaigns():
                m = measure_campaign(conn, store, c, interval, reps)
                next_pages[c.name] = m["next_page_p50_s"] or m["page_s"]
                seq = sorted({t for p in m["plans"].values() for t in p["seq_scans"]})
                backed = "send_log" not in seq and bool(m["plans"])
                params = {k: v for k, v in m.items() if k not in ("snapshot_s", "page_s")}
                out.append(metric(f"audience_snapshot_{c.name}", m["snapshot_s"], "s (once per campaign per run)",
                                  f"<= {TARGET_S:g} s, no Seq Scan on mail.send_log",
                                  m["snapshot_s"] <= TARGET_S and backed, seq_scans=seq, **params, **scale))
                out.append(metric(f"audience_page_{c.name}", m["page_s"], "s (a page of 100 from the snapshot)",
                                  f"<= {TARGET_S:g} s", m["page_s"] <= TARGET_S,
                                  next_page_p50_s=m["next_page_p50_s"], next_page_max_s=m["next_page_max_s"]))
                out.append(metric(f"audience_dry_run_count_{c.name}", m["dry_run_count_s"], "s", None, None,
                                  note="dry runs and preview only (the run reports the snapshot's size)",
                                  eligible=m["dry_run_count"]))
                print(f"    {c.name}: eligible {m['eligible']}, snapshot {m['snapshot_s']:.3f} s, page {m['page_s']:.4f} s,"
                      f" next pages p50 {m['next_page_p50_s']} s, dry-run count {m['dry_run_count_s']} s; send_log seq"
                      f" scans: {'send_log' in seq}", flush=True)
            out += measure_reads(conn)
        # headline: the serial work per chunk (see bench/pipeline.py for why not the pipelined gap)
        sp = scale_pipeline(sdsn, interval, next_pages, pipelined=False)
        out.append(metric("pipeline_ms_per_chunk_p50_at_scale", sp["p50_ms"], "ms per chunk of 100", "<= 20",
                          sp["p50_ms"] <= 20, mean_ms_excl_snapshots=round(sp["mean_ms"], 1), chunks=sp["chunks"],
                          snapshots_s=sp["snapshots_s"], breakdown_ms_per_chunk=sp["breakdown_ms_per_chunk"],
                          per_campaign=sp["per_campaign"], engine="one step after the other", **scale))
        su = scale_pipeline(sdsn, interval, next_pages, pipelined=True)
        out.append(metric("pipeline_ms_per_chunk_p50_at_scale_pipelined_instant_provider", su["p50_ms"],
                          "ms between provider calls (pipelined, apply on the sender thread, instant provider)",
                          None, None, mean_ms_excl_snapshots=round(su["mean_ms"], 1), chunks=su["chunks"],
                          breakdown_ms_per_chunk=su["breakdown_ms_per_chunk"], per_campaign=su["per_campaign"]))
    return out
