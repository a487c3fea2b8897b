"""Scheduled dispatch lateness: ``sent_at - scheduled_at`` (seconds) for 10,000 emails due within
10 minutes (quick: 1,000 within 1 minute), against the emulator at a cap of 10 requests/s (50 ms
latency per request), through the production path:

* a campaign is created and provisioned with ``mailflow.sources.scheduled`` (an uploaded recipient list,
  one local window of exactly the measured span, ``emails_per_day`` = the email count, so the
  planner spreads the sends evenly over the span);
* the dispatcher runs as the ``dispatch_scheduled_emails`` DAG runs it: one call of
  :func:`mailflow.sources.scheduled.dispatch` with the DAG's defaults (50 s budget, 5 s coalescing) at every
  UTC minute boundary plus ``START_DELAY`` seconds (the scheduler's and worker's start-up latency,
  assumed), never two at once (``max_active_runs=1``), with the shared PostgreSQL pacer and the
  real Resend client.

Target: p99 <= 60 s. Also reported: p50, max, emails left unsent, duplicate deliveries, HTTP 429s,
requests, and the fraction of run time the dispatcher slept waiting for due rows.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import psycopg

from bench.provider import API_KEY, CAP, FRACTION, metric
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import RunContext
from mailflow.provider.client import ResendClient
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources import scheduled

START_DELAY = 3.0  # seconds from a minute boundary to the task's first statement (assumed)
LEAD = 20.0  # seconds from setup to the first due email
LATENCY_MS = 50.0


def _zone_for(at: datetime) -> str:
    """An IANA fixed-offset zone (``Etc/GMT±h``) in which ``at`` is between 08:00 and 16:00 local, so
    a window of up to 10 minutes starting there never crosses local midnight."""
    for h in range(-12, 15):
        key = f"Etc/GMT{'-' if h >= 0 else '+'}{abs(h)}"  # POSIX sign: Etc/GMT-2 is UTC+2
        local = at + timedelta(hours=h)
        if 8 <= local.hour < 16:
            return key
    raise RuntimeError("no fixed-offset zone puts this instant in business hours")  # unreachable


def _setup(conn: psycopg.Connection, n: int, span: float, start: datetime) -> int:
    """Create, upload and provision the campaign; return its id."""
    zone = _zone_for(start)
    local = start.astimezone(ZoneInfo(zone))
    end = local + timedelta(seconds=span)
    window = f"{local:%H:%M:%S}-{end:%H:%M:%S}"
    cid = scheduled.create_campaign(conn, {
        "name": f"bench_{int(time.time())}", "template": "outreach", "subject": "Hello {{ user.first_name }}",
        "from": "Outreach <outreach@mail.example.com>", "recipients_table": "mail.campaign_recipient",
        "timezone": zone, "emails_per_day": n, "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": [window],
        "start_at": start}, actor="bench")
    with conn.transaction():
        conn.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                     " select %s, i, 'bench' || i || '@example.com', 'B' || i from generate_series(1, %s) as i",
                     (cid, n))
    summary = scheduled.provision(conn, cid, now=start - timedelta(seconds=1), chunk=5000)
    assert summary.created == n, summary
    assert summary.first_send == start and summary.last_send is not None
    assert summary.last_send < start + timedelta(seconds=span), summary
    return cid


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    """Run the lateness benchmark; return metric dicts (see ``bench.provider.metric``)."""
    n, span = (1_000, 60.0) if quick else (10_000, 600.0)
    outbox = Path(mkdtemp(prefix="mailflow-bench-dispatch-")) / "outbox.jsonl"
    renderer = Renderer(signer_from_secret("bench-secret-0123456789abcdef"), "https://mail.example.com",
                        "https://app.example.com")
    with EmulatorProcess(outbox=outbox, rate_limit=CAP, store_bodies=False, latency_ms=LATENCY_MS) as emu, \
            psycopg.connect(dsn) as conn:
        start = (datetime.now(UTC) + timedelta(seconds=LEAD)).replace(microsecond=0)
        cid = _setup(conn, n, span, start)
        name = scheduled.status(conn, cid)["name"]
        pacer = PostgresPacer(lambda: psycopg.connect(dsn), account=emu.base_url, requests_per_second=CAP,
                              target_fraction=FRACTION)
        client = ResendClient(emu.base_url, API_KEY, pacer=pacer, timeout=httpx.Timeout(30.0))
        runs = 0
        busy = idle = 0.0
        give_up = time.time() + span + LEAD + 180
        try:
            while time.time() < give_up:
                # the next scheduled run: a UTC minute boundary, plus the start-up delay
                now = time.time()
                nxt = math.floor(now / 60) * 60 + START_DELAY
                if nxt < now:
                    nxt += 60
                time.sleep(max(0.0, nxt - time.time()))
                runs += 1
                s = scheduled.dispatch(conn, client, renderer, run=RunContext("dispatch_scheduled_emails",
                                                                             f"bench-{runs}", "dispatch"))
                busy += s.seconds
                idle += s.idle_seconds
                print(f"    run {runs}: sent {s.sent} in {s.batches} batches, {s.seconds:.1f} s "
                      f"({s.idle_seconds:.1f} s asleep){' -> ' + str(s.completed) if s.completed else ''}",
                      flush=True)
                if name in s.completed:
                    break
        finally:
            client.close()
            pacer.close()
        row = conn.execute(
            "select percentile_cont(0.5) within group (order by extract(epoch from sent_at - scheduled_at)),"
            "       percentile_cont(0.99) within group (order by extract(epoch from sent_at - scheduled_at)),"
            "       max(extract(epoch from sent_at - scheduled_at)),"
            "       min(extract(epoch from sent_at - scheduled_at)),"
            "       count(*) filter (where status = 'sent'), count(*) filter (where status <> 'sent')"
            " from mail.send_log where campaign = %s", (name,)).fetchone()
        assert row is not None
        p50, p99, worst, earliest, sent, unsent = (float(row[0] or 0), float(row[1] or 0), float(row[2] or 0),
                                                   float(row[3] or 0), int(row[4]), int(row[5]))
        stats = emu.stats()
        outbox_lines = stats["outbox_lines"]
        distinct = len({e["headers"]["X-Mailflow-Send-Id"] for e in emu.read_outbox()})
    params = dict(emails=n, due_within_seconds=span, cap_requests_per_second=CAP, target_fraction=FRACTION,
                  latency_ms=LATENCY_MS, budget_seconds=scheduled.DISPATCH_BUDGET_SECONDS,
                  coalesce_seconds=scheduled.COALESCE_SECONDS, start_delay_seconds=START_DELAY, runs=runs,
                  requests=stats["requests"], sent=sent)
    out = [
        metric("dispatch_lateness_p50", p50, "s (sent_at - scheduled_at)", None, None, **params),
        metric("dispatch_lateness_p99", p99, "s (sent_at - scheduled_at)", "<= 60", p99 <= 60, **params),
        metric("dispatch_lateness_max", worst, "s", None, None, earliest_seconds=round(earliest, 3)),
        metric("dispatch_sent_early", int(earliest < 0), "emails sent before their time (any)", "0", earliest >= 0),
        metric("dispatch_unsent", unsent, "emails", "0", unsent == 0, emails=n),
        metric("dispatch_duplicates", outbox_lines - distinct, "emails", "0", outbox_lines == distinct == sent,
               outbox_lines=outbox_lines, distinct_send_ids=distinct),
        metric("dispatch_http_429", stats["responses_by_status"].get("429", 0), "responses", "0",
               stats["responses_by_status"].get("429", 0) == 0),
        metric("dispatch_requests_per_email", stats["requests"] / max(sent, 1), "requests/email", None, None,
               requests=stats["requests"]),
        metric("dispatch_asleep_fraction", idle / busy if busy else 0.0, "of run time asleep waiting for due rows",
               None, None, run_seconds=round(busy, 1), asleep_seconds=round(idle, 1)),
    ]
    return out
