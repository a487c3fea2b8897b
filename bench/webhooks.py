"""Webhook feedback: ingestion throughput and outcome coverage.

**Ingestion** (``webhook_ingest_*``): one standalone receiver process, as deployed (``mailflow
webhooks serve --port P --dsn DSN``, the signing secret in ``MAILFLOW_WEBHOOK_SECRETS``),
on a scratch database of the bench's PostgreSQL whose send log holds the emails the events refer to
(``sent`` rows with provider ids). A load generator in another process (:mod:`bench.webhook_load`:
asyncio over ``CONNECTIONS`` keep-alive connections, requests built and signed with
``standardwebhooks`` before the clock starts) pushes a realistic mix (sent, delivered, bounced
Permanent and Transient, complained, opened, clicked; 3% duplicates) for ``SECONDS`` seconds
(``--quick``: 5). Reported: events acknowledged (2xx) per second over the run (target >= 2,000), the
slowest and median second, p50 and p99 acknowledgement latency (request written to status read, at
``CONNECTIONS`` requests in flight). Then, with the receiver still running, up to ``DRAIN_S``
seconds for it to finish applying, and the audit: every acknowledged svix-id is a row of
``mail.webhook_event`` (count), applied (``applied_at`` set), and the suppressions are exactly the
addresses with an acknowledged permanent bounce or complaint.

**Coverage** (``webhook_coverage_*``, ``webhook_poll_share_of_rate_limit``): see :func:`coverage`.

``python -m bench --only webhooks [--quick]`` or ``python -m bench.webhooks [--quick] [--dsn DSN]
[--only ingestion|coverage]``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import psycopg

from bench.common import metric, scratch_database
from mailflow_dev.chaos_feedback.receiver import ReceiverProcess

SECONDS = 30.0
CONNECTIONS = 64
DUPLICATE_RATE = 0.03
TARGET_EPS = 2000.0
POOL_RATE = 6000  # events generated per second of the run: more than the receiver can take here
DRAIN_S = 60.0
ROOT = Path(__file__).resolve().parent.parent


def new_secret() -> str:
    """A signing secret in Svix's format (``whsec_`` + base64 of 24 random bytes)."""
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def _env() -> dict[str, str]:
    env = os.environ.copy()
    paths = [str(ROOT), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def seed_send_log(conn: psycopg.Connection, n: int, prefix: str) -> list[tuple[str, str]]:
    """``n`` sent emails of one lifecycle campaign (provider ids ``<prefix>-<i>``, one address each);
    returns ``[(provider id, address)]``."""
    with conn.transaction():
        conn.execute(
            "insert into mail.send_log (user_id, campaign, kind, email, email_key, status, claimed_at, sent_at,"
            " provider_message_id, attempts, run_id)"
            " select i, 'bench_webhooks', 'lifecycle', 'user' || i || '@example.com', 'user' || i || '@example.com',"
            " 'sent', now() - interval '2 minutes', now() - interval '2 minutes', %s || '-' || i, 1, 'bench-webhooks'"
            " from generate_series(1, %s) as i", (prefix, n))
    return [(f"{prefix}-{i}", f"user{i}@example.com") for i in range(1, n + 1)]


def _wait_applied(conn: psycopg.Connection, seconds: float) -> float:
    """Seconds until no webhook_event row waits to be applied (at most ``seconds``)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        left = conn.execute("select count(*) from mail.webhook_event where applied_at is null").fetchone()[0]  # type: ignore[index]
        if not left:
            break
        time.sleep(0.5)
    return time.monotonic() - t0


def ingestion(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    """The ingestion benchmark (module doc); returns metric dicts."""
    seconds = 5.0 if quick else SECONDS
    max_events = int(POOL_RATE * seconds)
    work = Path(mkdtemp(prefix="mailflow-bench-webhooks-"))
    secret = new_secret()
    with scratch_database(dsn, "webhooks", app_schema=False) as sdsn, \
            psycopg.connect(sdsn, autocommit=True) as conn:
        emails = seed_send_log(conn, int(max_events / 2.2), "bench-wh")
        conn.execute("vacuum analyze mail.send_log")
        spec = {"secret": secret, "emails": emails, "seed": 1, "seconds": seconds, "connections": CONNECTIONS,
                "max_events": max_events, "duplicate_rate": DUPLICATE_RATE}
        rx = ReceiverProcess(sdsn, [secret], work / "receiver.log")
        with rx:
            spec["url"] = rx.url
            (work / "spec.json").write_text(json.dumps(spec))
            print(f"    receiver on {rx.url}; pushing for {seconds:.0f} s over {CONNECTIONS} connections "
                  f"({len(emails)} emails in the send log)", flush=True)
            gen = subprocess.run([sys.executable, "-m", "bench.webhook_load", str(work / "spec.json"),
                                  str(work / "out.json")], env=_env(), cwd=ROOT, capture_output=True, text=True,
                                 timeout=seconds + 600)
            if gen.returncode:
                raise RuntimeError(f"load generator failed: {gen.stderr[-3000:]}")
            out = json.loads((work / "out.json").read_text())
            drained = _wait_applied(conn, DRAIN_S)
            rx_log = rx.log_tail(2000)
        acked = sorted(set(out["acked"]))
        found, applied, bad_type = conn.execute(
            "select count(*), count(*) filter (where applied_at is not null), 0"
            " from mail.webhook_event where svix_id = any(%s)", (acked,)).fetchone()  # type: ignore[misc]
        decisions = dict(conn.execute("select coalesce(decision, '(none)'), count(*) from mail.webhook_event"
                                      " group by 1 order by 1").fetchall())
        delivery_events = conn.execute("select count(*) from mail.delivery_event where svix_id = any(%s)",
                                       (acked,)).fetchone()[0]  # type: ignore[index]
        outcomes = dict(conn.execute("select coalesce(outcome, '(none)'), count(*) from mail.delivery_status"
                                     " group by 1 order by 1").fetchall())
        suppressed = {r[0] for r in conn.execute("select email_key from mail.suppression").fetchall()}
        expected = set(out.get("suppress_expected", []))
    n_acked = len(acked)
    rate = len(out["acked"]) / out["seconds"] if out["seconds"] else 0.0
    per_second = out["per_second"][:-1] if len(out["per_second"]) > 1 else out["per_second"]  # the last is partial
    lat = out["latency_ms"]
    params = {"seconds": out["seconds"], "connections": CONNECTIONS, "acknowledged": len(out["acked"]),
              "unique_acknowledged": n_acked, "requests": out["requests"], "statuses": out["statuses"],
              "pool": out["pool"], "pool_used_up": out["pool_used_up"], "by_type": out["by_type"],
              "duplicate_rate": DUPLICATE_RATE, "send_log_emails": len(emails),
              "slowest_second": min(per_second, default=0), "median_second": statistics.median(per_second or [0]),
              "latency_ms": lat, "prepare_seconds": out["prepared_seconds"]}
    print(f"    {len(out['acked'])} acknowledged in {out['seconds']} s = {rate:.0f}/s; statuses {out['statuses']}; "
          f"latency {lat}; per second {per_second}; applied after {drained:.1f} s; decisions {decisions}; "
          f"outcomes {outcomes}", flush=True)
    if out["statuses"].keys() - {"200", "201", "202", "204"}:
        print(f"    receiver log tail: {rx_log}", flush=True)
    lost = n_acked - int(found)
    unapplied = n_acked - int(applied)
    return [
        metric("webhook_ingest_events_per_second", rate, "events acknowledged/s (1 receiver process)",
               f">= {TARGET_EPS:.0f}", rate >= TARGET_EPS, **params),
        metric("webhook_ingest_ack_latency_p50", lat["p50"], "ms", None, None, connections=CONNECTIONS),
        metric("webhook_ingest_ack_latency_p99", lat["p99"], "ms", None, None, connections=CONNECTIONS,
               p90=lat["p90"], max=lat["max"]),
        metric("webhook_ingest_acknowledged_not_stored", lost, "events", "0", lost == 0, found=int(found),
               unique_acknowledged=n_acked),
        metric("webhook_ingest_not_applied", unapplied, "events", "0", unapplied == 0,
               applied=int(applied), drained_seconds=round(drained, 1), decisions=decisions,
               delivery_events=int(delivery_events), outcomes=outcomes, wrong_type=int(bad_type)),
        metric("webhook_ingest_suppressions_off", len(suppressed ^ expected), "addresses", "0",
               suppressed == expected, suppressed=len(suppressed), expected=len(expected),
               missed=len(expected - suppressed), extra=len(suppressed - expected)),
    ]


OUTCOME_TYPES = ("email.delivered", "email.bounced", "email.failed", "email.suppressed")
"""The event that settles an email's outcome; the emulator emits exactly one of them per email."""
COVERAGE_RATES = {"hard_bounce_rate": 0.005, "soft_bounce_rate": 0.01, "failed_rate": 0.001, "delayed_rate": 0.02,
                  "complaint_rate": 0.0001, "open_rate": 0.30, "click_rate": 0.05}
"""The emulator's seeded lifecycle rates in the coverage run (about 2.4 events per email)."""
EVENT_SPREAD_S = 60.0
WITHIN_S = 300.0
POLL_RUNS_PER_HOUR = 2  # the deliverability_feedback DAG runs at :10 and :40


def _journal_messages(path: Path, types: tuple[str, ...]) -> list[dict[str, Any]]:
    """The emulator's accounting (its ``webhook_log`` journal: one JSON line per message when it is
    final) of the genuine messages of ``types``."""
    out: list[dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            m = json.loads(line)
            if m["kind"] == "genuine" and m["type"] in types:
                out.append(m)
    return out


def _drain(emu: Any, seconds: float) -> tuple[dict[str, Any], float]:
    """Wait until the emulator has pushed everything it planned (no message pending, nothing queued
    or in flight), at most ``seconds``; its totals and the seconds waited."""
    t0 = time.monotonic()
    while True:
        totals = emu._control("GET", "webhooks?limit=0")["totals"]
        if (totals["pending"] == 0 and not totals["queued"] and not totals["in_flight"]) \
                or time.monotonic() - t0 > seconds:
            return totals, time.monotonic() - t0
        time.sleep(1.0)


def _history_has_outcomes(conn: psycopg.Connection) -> int:
    """Give the population's sent emails of the poll's lookback (49 h) the outcome ``delivered`` at
    their send time, as webhooks that had been on for days would have (the population has no
    outcomes: without this the poll would spend its budget on fake history, not on the run);
    returns how many."""
    return conn.execute(
        "insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome,"
        " delivered_at, outcome_at) select id, provider_message_id, 'delivered', 0, 'delivered', sent_at, sent_at"
        " from mail.send_log where status = 'sent' and sent_at > now() - interval '49 hours'"
        " on conflict (send_log_id) do nothing").rowcount


def coverage(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    """Outcome coverage after a bounded lifecycle run with webhooks on, and the safety-net poll's
    share of the rate limit.

    What runs: the population of :mod:`bench.population` (1,000,000 users; ``--quick`` 100,000);
    the emulator at a cap of 10 requests/s (50 ms latency) with lifecycle rates
    :data:`COVERAGE_RATES`, each email's events spread over :data:`EVENT_SPREAD_S` seconds after its
    send, and the receiver registered as its webhook endpoint (every email event type, Svix's retry
    schedule in real time); the real engine (``run_lifecycle``, pipelined, shared pacer at 0.95 of
    the cap, as :mod:`bench.lifecycle_e2e` runs it) for ``budget`` seconds (120; quick 15) of the
    hourly run: not a whole hour, the same full rate. The population's own sent emails of the last
    49 hours are given the outcome ``delivered`` first (webhooks on for days before the run). Then
    the emulator pushes what is still planned (up to 15 minutes), and:

    * coverage = sent emails (send log, this run) whose outcome event (delivered, bounced, failed or
      suppressed: exactly one per email) is in ``mail.delivery_event`` with ``recorded_at`` at most
      :data:`WITHIN_S` seconds after the emulator created it (``event_created_at`` of its accounting:
      the moment the provider emits it; the first attempt's time is reported too). Target 100%.
    * poll share = the safety-net poll's requests in one run (the DAG's limit of 500 emails and a
      request budget of :data:`POLL_SHARE` of the slots between two runs; no minimum age, so every
      email of the run without an outcome is due: the worst case) times :data:`POLL_RUNS_PER_HOUR` /
      the cap's slots in an hour (36,000). Target < 1%.
    """
    from datetime import timedelta

    import httpx

    from bench import population
    from bench.common import ANCHOR, renderer
    from bench.lifecycle_e2e import API_KEY, CAP, LATENCY_MS
    from mailflow.campaigns import load_campaigns
    from mailflow.emulator.testing import EmulatorProcess
    from mailflow.model.outcome import DataInterval, RunContext
    from mailflow.provider.client import ResendClient
    from mailflow.provider.pacing import PostgresPacer
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.send_log import PostgresStore

    users = 100_000 if quick else 1_000_000
    budget = 15.0 if quick else 120.0
    fraction = 0.95
    interval = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
    work = Path(mkdtemp(prefix="mailflow-bench-coverage-"))
    secret = new_secret()
    with population.shared_copy(dsn, users, "webhooks", log=print) as (sdsn, pop):
        with psycopg.connect(sdsn, autocommit=True) as conn:
            history = _history_has_outcomes(conn)
        rx = ReceiverProcess(sdsn, [secret], work / "receiver.log")
        with rx, EmulatorProcess(outbox=work / "outbox.jsonl", rate_limit=CAP, store_bodies=False,
                                 latency_ms=LATENCY_MS, webhook_url=rx.url, webhook_secrets=[secret],
                                 event_spread_seconds=EVENT_SPREAD_S, webhook_log=str(work / "webhooks.jsonl"),
                                 webhook_records_max=1000, **COVERAGE_RATES) as emu:
            pacer = PostgresPacer(lambda: psycopg.connect(sdsn), account="coverage", requests_per_second=CAP,
                                  target_fraction=fraction)
            client = ResendClient(emu.base_url, API_KEY, pacer=pacer, timeout=httpx.Timeout(30.0))
            run = RunContext(dag_id="bench", run_id="bench-coverage", task_id="send_campaigns")
            with psycopg.connect(sdsn, autocommit=True) as conn, psycopg.connect(sdsn, autocommit=True) as aconn:
                store = PostgresStore(conn)
                t0 = time.perf_counter()
                summaries = run_lifecycle(store, client, renderer(), load_campaigns(), interval, run=run,
                                          budget_seconds=budget, pipelined=True, apply_store=store.companion(aconn))
                wall = time.perf_counter() - t0
            client.close()
            sent = sum(s.sent for s in summaries)
            print(f"    engine: {sent} emails accepted in {wall:.1f} s ({sent / wall:.0f}/s); "
                  f"draining webhooks", flush=True)
            totals, drained = _drain(emu, 900.0)
            messages = _journal_messages(work / "webhooks.jsonl", OUTCOME_TYPES)
            with psycopg.connect(sdsn, autocommit=True) as conn:
                _wait_applied(conn, 60.0)
                stats_before = emu.stats()["requests"]
                poll = _safety_net_poll(sdsn, emu.base_url, pacer, CAP)
                poll_requests = emu.stats()["requests"] - stats_before
                recorded = dict(conn.execute(
                    "select d.svix_id, extract(epoch from d.recorded_at) from mail.delivery_event d"
                    " join mail.send_log l on l.id = d.send_log_id where l.run_id = %s and d.svix_id is not null",
                    (run.run_id,)).fetchall())
                sent_ids = {r[0] for r in conn.execute(
                    "select provider_message_id from mail.send_log where run_id = %s and status = 'sent'",
                    (run.run_id,)).fetchall()}
                ingest = dict(conn.execute("select coalesce(decision, '(pending)'), count(*) from mail.webhook_event"
                                           " group by 1").fetchall())
            pacer.close()
            rx_log = rx.log_tail(1500)
    by_email = {m["email_id"]: m for m in messages if m["email_id"] in sent_ids}
    lags, lags_first, covered = [], [], 0
    for pid in sent_ids:
        m = by_email.get(pid)
        at = recorded.get(m["svix_id"]) if m else None
        if m is None or at is None:
            continue
        lag = float(at) - m["event_created_at"]
        lags.append(lag)
        if m["first_emitted_at"] is not None:
            lags_first.append(float(at) - m["first_emitted_at"])
        covered += lag <= WITHIN_S
    share = covered / len(sent_ids) if sent_ids else 0.0
    lags.sort()

    def q(values: list[float], p: float) -> float:
        return round(values[min(len(values) - 1, int(p * (len(values) - 1)))], 2) if values else float("nan")

    slots = CAP * 3600
    poll_share = poll_requests * POLL_RUNS_PER_HOUR / slots
    params = {"users": users, "budget_seconds": budget, "wall_seconds": round(wall, 1), "fraction": fraction,
              "sent": len(sent_ids), "accepted": sent, "emails_per_second": round(sent / wall, 1),
              "outcome_recorded": len(lags), "within_seconds": WITHIN_S,
              "lag_seconds": {"p50": q(lags, 0.5), "p99": q(lags, 0.99), "max": q(lags, 1.0)},
              "lag_from_first_attempt_seconds": {"p50": q(sorted(lags_first), 0.5),
                                                 "p99": q(sorted(lags_first), 0.99)},
              "drain_seconds": round(drained, 1), "webhooks": {k: totals.get(k) for k in (
                  "emails", "messages", "acknowledged", "given_up", "pending", "attempts", "attempt_statuses",
                  "events_by_type")}, "ingest_decisions": ingest, "rates": COVERAGE_RATES,
              "event_spread_seconds": EVENT_SPREAD_S, "population_seconds": pop["built_seconds"] + pop["copy_seconds"],
              "history_marked_delivered": history}
    print(f"    coverage {share:.4f} ({covered} of {len(sent_ids)}); lag {params['lag_seconds']}; "
          f"drained in {drained:.0f} s; webhooks {params['webhooks']}; poll {poll}", flush=True)
    if share < 1.0:
        print(f"    receiver log tail: {rx_log}", flush=True)
    return [
        metric("webhook_coverage_within_5_min", share, "of sent emails with a recorded outcome", "100%",
               share >= 1.0, **params),
        metric("webhook_coverage_lag_p99", q(lags, 0.99), "s (recorded_at - emitted)", None, None,
               p50=q(lags, 0.5), max=q(lags, 1.0)),
        metric("webhook_poll_share_of_rate_limit", poll_share, "of the cap's slots per hour", "< 1%",
               poll_share < 0.01, requests_per_run=poll_requests, runs_per_hour=POLL_RUNS_PER_HOUR,
               slots_per_hour=slots, poll=poll),
    ]


POLL_SHARE = 0.01
"""The safety-net poll's request budget per run: this share of the cap's slots between two runs
(:func:`mailflow.feedback.deliverability.request_budget`)."""


def _safety_net_poll(dsn: str, base_url: str, pacer: Any, cap: float) -> dict[str, Any]:
    """One run of the safety-net poll with the DAG's defaults (500 emails, a request budget of
    :data:`POLL_SHARE` of the slots in 30 minutes) but no minimum age (every email of the run is old
    enough: the worst case), through the real client and the shared pacer."""
    from datetime import timedelta

    import httpx

    from bench.lifecycle_e2e import API_KEY
    from mailflow.feedback.deliverability import poll_feedback, request_budget
    from mailflow.provider.client import ResendClient

    budget = request_budget(cap, POLL_SHARE, 3600 / POLL_RUNS_PER_HOUR)
    with psycopg.connect(dsn) as conn, ResendClient(base_url, API_KEY, pacer=pacer,
                                                    timeout=httpx.Timeout(30.0)) as client:
        s = poll_feedback(conn, client, min_age=timedelta(0), limit=500, budget_seconds=600, max_requests=budget)
    out = s.as_dict() if hasattr(s, "as_dict") else dict(vars(s))
    return {k: v for k, v in out.items() if k not in ("alerts",)} | {"alerts": len(out.get("alerts", []))}


def run(dsn: str, quick: bool = False, only: tuple[str, ...] = ("ingestion", "coverage")) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if "ingestion" in only:
        out += ingestion(dsn, quick)
    if "coverage" in only:
        out += coverage(dsn, quick)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", action="append", choices=("ingestion", "coverage"))
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    admin = args.dsn or devenv.embedded_dsn(devenv.STATE / "pgdata-bench")
    for m in run(admin, quick=args.quick, only=tuple(args.only or ("ingestion", "coverage"))):
        print(f"{m['name']}: {m['value']:.4g} {m['unit']} (target {m['target'] or '-'}, met {m['met']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
