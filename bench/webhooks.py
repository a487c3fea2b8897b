"""Webhook feedback: ingestion throughput and outcome coverage.

**Ingestion** (``webhook_ingest_*``): one standalone receiver process, as deployed (``python -m
mailflow.feedback.webhooks --port P --dsn DSN``, the signing secret in ``MAILFLOW_WEBHOOK_SECRETS``),
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

**Coverage** (``webhook_coverage_*``): see :func:`coverage`.

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


def coverage(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    """The coverage benchmark (see the module doc)."""
    raise NotImplementedError


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
