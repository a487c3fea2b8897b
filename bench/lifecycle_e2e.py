"""End-to-end lifecycle utilisation (the headline number of the pipelined engine): accepted emails per second of a real
lifecycle run over the configured target rate.

The real engine (:func:`mailflow.sources.lifecycle.run_lifecycle`), :class:`~mailflow.store.send_log.PostgresStore`,
:class:`~mailflow.sendloop.render.Renderer` with the campaigns' templates, :class:`ResendClient` and the
shared :class:`PostgresPacer`, against the emulator over HTTP at a cap of 10 requests/s (50 ms
latency per request), over the population of :mod:`bench.population`: 1,000,000 users and ~5,000,000
send-log rows (``--quick``: 100,000 users, 10 s runs). One hourly run (the interval ending at
:data:`~bench.common.ANCHOR`) per target fraction, 0.8 and 0.95, each with a time budget of
``BUDGET_S`` seconds and a fresh pacer account; the runs follow each other on one population, so
what each run wrote is deleted after it, so every configuration meets the same audience.

* **Utilisation** = emails the provider accepted / the run's wall time (the whole
  ``run_lifecycle`` call: audience snapshots, pages, mint, render, store, send, apply) / the target,
  ``cap x fraction x 100`` emails/s. Target >= 0.95, 0 x 429, 0 duplicates (outbox lines versus
  rows marked sent).
* **Pipelining** (``--pipelined``/``--no-pipelined``, default on): ``run_lifecycle(pipelined=True)``
  (chunk N+1 is paged, minted, rendered and stored while chunk N is in flight,
  as the Airflow task runs it). With it on, the unpipelined engine also runs at 0.95 in the same
  population, for comparison (``..._unpipelined``); ``params.pipelined`` says which engine ran.
* **Naive per-email loop**: the same audience pages, per email: INSERT its row (own transaction),
  render it, ``POST /emails`` (one email per request, 429 -> sleep Retry-After), UPDATE it to sent,
  for ``NAIVE_S`` seconds.

``python -m bench --only lifecycle_e2e [--quick]`` or ``python -m bench.lifecycle_e2e [--quick]
[--no-pipelined] [--dsn DSN]``. The population is the one the ``audience`` suite uses, built once per
process (:func:`bench.population.shared_copy`); this suite runs on its own file copy of it (~6 s), so
the audience suite's scale runs never change its audience. Alone, the full size takes about 5
minutes (2-3 of them building the population); after ``audience`` in ``python -m bench``, about 3.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import time
import uuid
from datetime import timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import psycopg

from bench import population
from bench.common import ANCHOR, metric, renderer
from mailflow.campaigns import load_campaigns
from mailflow.emulator.testing import EmulatorProcess
from mailflow.model.clock import SystemClock
from mailflow.model.outcome import DataInterval, MintedRow, RunContext
from mailflow.provider.client import ResendClient, parse_retry_after
from mailflow.provider.pacing import PostgresPacer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import PostgresStore

CAP = 10.0  # requests/s, the emulator's limit (sliding 1 s window)
LATENCY_MS = 50.0
FRACTIONS = (0.8, 0.95)
API_KEY = "re_test_emulator"
TARGET = 0.95


def engine_supports_pipelining() -> bool:
    """True once ``run_lifecycle`` takes a ``pipelined`` keyword (pipelined sending)."""
    return "pipelined" in inspect.signature(run_lifecycle).parameters


def engine_run(dsn: str, emu: EmulatorProcess, interval: DataInterval, fraction: float, budget: float,
               pipelined: bool, tag: str) -> dict[str, Any]:
    """One ``run_lifecycle`` at ``fraction`` of the cap for ``budget`` seconds; what it achieved."""
    emu.reset(keep_config=True)
    kw: dict[str, Any] = {}
    ran_pipelined = False
    if engine_supports_pipelining():
        kw["pipelined"] = pipelined
        ran_pipelined = pipelined
    pacer = PostgresPacer(lambda: psycopg.connect(dsn), account=f"e2e-{uuid.uuid4().hex[:6]}",
                          requests_per_second=CAP, target_fraction=fraction)
    client = ResendClient(emu.base_url, API_KEY, pacer=pacer, timeout=httpx.Timeout(30.0))
    run = RunContext(dag_id="bench", run_id=f"bench-e2e-{tag}", task_id="send_campaigns")
    with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(dsn, autocommit=True) as apply_conn:
        store = PostgresStore(conn)
        if ran_pipelined and "apply_store" in inspect.signature(run_lifecycle).parameters:
            kw["apply_store"] = store.companion(apply_conn)  # as the Airflow task runs it
        t0 = time.perf_counter()
        summaries = run_lifecycle(store, client, renderer(), load_campaigns(), interval, run=run,
                                  budget_seconds=budget, **kw)
        wall = time.perf_counter() - t0
        sent_rows = conn.execute("select count(*) from mail.send_log where run_id = %s and status = 'sent'",
                                 (run.run_id,)).fetchone()[0]  # type: ignore[index]
        forget_run(conn, run.run_id)
    client.close()
    pacer.close()
    stats = emu.stats()
    sent = sum(s.sent for s in summaries)
    target_eps = CAP * fraction * 100
    return {
        "fraction": fraction, "budget_s": budget, "wall_s": round(wall, 2), "accepted": sent,
        "emails_per_second": sent / wall, "utilisation": sent / wall / target_eps, "target_emails_per_second": target_eps,
        "requests": client.stats["requests"], "late_slots": client.stats["late_slots"], "http_429": stats["responses_by_status"].get("429", 0),
        "duplicates": stats["outbox_lines"] - sent_rows, "outbox_lines": stats["outbox_lines"], "rows_sent": sent_rows,
        "pipelined": ran_pipelined,
        "campaigns": {s.campaign: {"eligible": s.eligible, "sent": s.sent, "stopped": s.stopped} for s in summaries},
    }


def forget_run(conn: psycopg.Connection, run_id: str) -> None:
    """Delete what one measured run wrote (rows, events, batches), so every configuration meets the
    same audience (otherwise the cooldown would hand each run what the previous ones left)."""
    with conn.transaction():
        conn.execute("delete from mail.send_event where send_log_id in"
                     " (select id from mail.send_log where run_id = %s)", (run_id,))
        conn.execute("delete from mail.send_batch where idempotency_key in"
                     " (select idempotency_key from mail.send_log where run_id = %s)", (run_id,))
        conn.execute("delete from mail.send_log where run_id = %s", (run_id,))


def naive_per_email(dsn: str, emu: EmulatorProcess, interval: DataInterval, seconds: float) -> dict[str, Any]:
    """The naive loop over the same audience pages, one email per request (see the module doc)."""
    emu.reset(keep_config=True)
    r = renderer()
    sent = rate_limited = 0
    deadline = time.monotonic() + seconds
    with psycopg.connect(dsn, autocommit=True) as conn, \
            httpx.Client(base_url=emu.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        store = PostgresStore(conn)
        t0 = time.perf_counter()
        for c in load_campaigns():
            window, since = c.window(interval), interval.end - c.cooldown
            after = 0
            while time.monotonic() < deadline:
                page = conn.execute(store._audience_sql("audience_page", c),
                                    store._params(c, window, since) | {"after": after, "limit": 100}).fetchall()
                if not page:
                    break
                after = page[-1][0]
                for user_id, email, ctx in page:
                    if time.monotonic() >= deadline:
                        break
                    row = conn.execute(
                        "insert into mail.send_log (user_id, campaign, kind, email, context, status, claimed_at,"
                        " attempts, run_id) values (%s, %s, 'lifecycle', %s, %s, 'sending', now(), 1, 'naive')"
                        " on conflict (user_id, campaign) where released_at is null do nothing returning id",
                        (user_id, c.name, email, psycopg.types.json.Jsonb(ctx or {}))).fetchone()
                    if row is None:
                        continue
                    msg = r.render_email(c, MintedRow(id=row[0], user_id=user_id, email=email, context=ctx or {}))
                    while True:
                        resp = http.post("/emails", content=json.dumps(msg).encode(),
                                         headers={"Content-Type": "application/json"})
                        if resp.status_code != 429:
                            break
                        rate_limited += 1
                        time.sleep(parse_retry_after(resp.headers.get("retry-after"), SystemClock()) or 1.0)
                    if resp.status_code == 200:
                        conn.execute("update mail.send_log set status = 'sent', provider_message_id = %s,"
                                     " sent_at = now() where id = %s", (resp.json()["id"], row[0]))
                        sent += 1
            if time.monotonic() >= deadline:
                break
        wall = time.perf_counter() - t0
    return {"accepted": sent, "wall_s": round(wall, 2), "emails_per_second": sent / wall, "http_429": rate_limited}


def run(dsn: str, quick: bool = False, pipelined: bool = True) -> list[dict[str, Any]]:
    users = 100_000 if quick else 1_000_000
    budget = 10.0 if quick else 45.0
    naive_s = 5.0 if quick else 20.0
    interval = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
    out: list[dict[str, Any]] = []
    note = ("engine pipelining on" if engine_supports_pipelining() and pipelined else
            "off by the flag" if engine_supports_pipelining() else "not in the engine yet (pipelined sending): "
            "the current, unpipelined engine ran")
    outbox = Path(mkdtemp(prefix="mailflow-bench-e2e-")) / "outbox.jsonl"
    with population.shared_copy(dsn, users, "e2e", log=print) as (sdsn, pop), \
            EmulatorProcess(outbox=outbox, rate_limit=CAP, store_bodies=False, latency_ms=LATENCY_MS) as emu:
        loaded = pop["build"]
        out.append(metric("e2e_population_load_seconds", pop["built_seconds"] + pop["copy_seconds"], "s", None, None,
                          built_seconds=pop["built_seconds"], copy_seconds=pop["copy_seconds"],
                          reused_shared_population=pop["reused"], **loaded["rows"]))
        runs = [(f, pipelined, f"{f}") for f in FRACTIONS]
        if engine_supports_pipelining() and pipelined:
            runs.append((0.95, False, "0.95-unpipelined"))
        for fraction, pipe, tag in runs:
            r = engine_run(sdsn, emu, interval, fraction, budget, pipe, tag)
            name = f"e2e_lifecycle_utilisation_at_{fraction}" + ("_unpipelined" if tag.endswith("unpipelined") else "")
            params = {k: v for k, v in r.items() if k not in ("utilisation",)} | {
                "pipelining": note if not tag.endswith("unpipelined") else "off (comparison run)",
                "cap_requests_per_second": CAP, "latency_ms": LATENCY_MS, "users": loaded["rows"]["users"],
                "send_log_rows": loaded["rows"]["send_log"]}
            ok = r["utilisation"] >= TARGET and r["http_429"] == 0 and r["duplicates"] == 0
            out.append(metric(name, r["utilisation"], f"of target (cap x {fraction} x 100 emails/s)",
                              f">= {TARGET}, 0 x 429, 0 duplicates", ok, **params))
            print(f"    {name}: {r['emails_per_second']:.1f} emails/s = {r['utilisation']:.3f} of target; "
                  f"429s {r['http_429']}, duplicates {r['duplicates']}, wall {r['wall_s']} s ({params['pipelining']}); "
                  f"{r['campaigns']}", flush=True)
        naive = naive_per_email(sdsn, emu, interval, naive_s)
        out.append(metric("e2e_naive_per_email_emails_per_second", naive["emails_per_second"], "emails/s", None, None,
                          **naive))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pipelined", action=argparse.BooleanOptionalAction, default=True,
                   help="pipelined engine (the next chunk prepared while one is in flight); --no-pipelined runs only the unpipelined engine")
    args = p.parse_args(argv)
    for m in run(args.dsn, quick=args.quick, pipelined=args.pipelined):
        print(f"{m['name']}: {m['value']:.4g} {m['unit']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
