"""Synthetic load for the pacing proof and the benchmarks: senders that push prepared batches of
fake emails through the real client and pacer, optionally in several processes at once.

Nothing here touches the send log; only the shared slot schedule (``mail.rate_slot``) when a DSN
is given. Times are ``time.time()`` seconds so several processes can be merged on one axis.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psycopg

from mailflow.model.keys import idempotency_key
from mailflow.model.outcome import Accepted, PreparedBatch
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import LocalPacer, Pacer, PostgresPacer


def synthetic_batches(n_emails: int, *, first_id: int, batch_size: int = 100,
                      campaign: str = "bench") -> Iterator[PreparedBatch]:
    """Batches of ``batch_size`` small valid emails, row ids ``first_id..first_id+n_emails-1``."""
    for start in range(first_id, first_id + n_emails, batch_size):
        ids = tuple(range(start, min(start + batch_size, first_id + n_emails)))
        emails = [{"from": "Bench <bench@mail.example.com>", "to": [f"user{i}@example.com"],
                   "subject": f"bench {i}", "text": f"hello {i}",
                   "headers": {"X-Mailflow-Send-Id": str(i)}} for i in ids]
        body = json.dumps(emails, separators=(",", ":"), sort_keys=True).encode()
        yield PreparedBatch(idempotency_key(campaign, ids), campaign, ids, body)


@dataclass
class SenderResult:
    """What one sender saw: requests made, 429s, emails accepted, request start times (epoch s)."""

    requests: int = 0
    rate_limited: int = 0
    accepted: int = 0
    not_accepted: int = 0
    started: list[float] = field(default_factory=list)
    elapsed: float = 0.0


class _TimedTransport(httpx.HTTPTransport):
    def __init__(self, sink: list[float]):
        super().__init__()
        self.sink = sink

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sink.append(time.time())
        return super().handle_request(request)


def run_sender(base_url: str, api_key: str, *, n_emails: int, first_id: int, requests_per_second: float,
               target_fraction: float = 0.8, dsn: str | None = None, account: str = "bench",
               batch_size: int = 100) -> dict[str, Any]:
    """Send ``n_emails`` synthetic emails in batches; return :class:`SenderResult` as a dict.

    With ``dsn`` the pacer is the shared :class:`PostgresPacer` (account ``account``); without, a
    per-process :class:`LocalPacer` (what the seed did: N processes send N times the cap).
    """
    result = SenderResult()
    pacer: Pacer
    if dsn:
        pacer = PostgresPacer(lambda: psycopg.connect(dsn), account, requests_per_second, target_fraction)
    else:
        pacer = LocalPacer(requests_per_second, target_fraction)
    client = ResendClient(base_url, api_key, pacer=pacer, transport=_TimedTransport(result.started),
                          policy=RetryPolicy(max_attempts=8))
    t0 = time.monotonic()
    with client:
        for batch in synthetic_batches(n_emails, first_id=first_id, batch_size=batch_size):
            outcome = client.send_batch(batch, deadline=time.monotonic() + 600)
            if isinstance(outcome, Accepted):
                result.accepted += len(outcome.ids)
                result.not_accepted += len(outcome.rejected)
            else:
                result.not_accepted += len(batch.row_ids)
    result.elapsed = time.monotonic() - t0
    result.requests = client.stats["requests"]
    result.rate_limited = client.stats["429"]
    return asdict(result)


def _worker(kwargs: dict[str, Any]) -> dict[str, Any]:
    return run_sender(**kwargs)


def probe_pacer(dsn: str, account: str, requests_per_second: float, target_fraction: float = 0.8,
                claims: int = 3) -> dict[str, Any]:
    """A fresh :class:`PostgresPacer` (as a new process or worker builds it from its connection)
    claims ``claims`` slots without sending or sleeping; returns ``{"waits": [s...], "slot_at":
    [Unix seconds of each claimed slot: when the claim returned plus its wait...], "spacing": s,
    "requests_per_second": effective requests/s, "learned_limit": requests/s or None}``."""
    pacer = PostgresPacer(lambda: psycopg.connect(dsn), account, requests_per_second, target_fraction)
    try:
        waits: list[float] = []
        slot_at: list[float] = []
        for _ in range(claims):
            waits.append(pacer.claim())
            slot_at.append(time.time() + waits[-1])
        return {"waits": waits, "slot_at": slot_at, "spacing": pacer.spacing,
                "requests_per_second": pacer.requests_per_second, "learned_limit": pacer.learned_limit}
    finally:
        pacer.close()


def probe_in_new_process(**kwargs: Any) -> dict[str, Any]:
    """:func:`probe_pacer` in a freshly spawned interpreter (nothing shared but the database)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(probe_pacer, kwds=kwargs)


def run_concurrent(senders: int, base_url: str, api_key: str, *, emails_per_sender: int, **kw: Any) -> dict[str, Any]:
    """Run ``senders`` processes at once (spawned, so each has its own interpreter and pool).

    :returns: ``{"senders": [...per-sender dicts...], "requests", "rate_limited", "accepted",
        "wall_seconds", "request_rate" (requests/s over first..last request start),
        "max_requests_in_any_second"}``.
    """
    jobs = [dict(base_url=base_url, api_key=api_key, n_emails=emails_per_sender,
                 first_id=1 + i * emails_per_sender * 10, **kw) for i in range(senders)]
    t0 = time.monotonic()
    with multiprocessing.get_context("spawn").Pool(senders) as pool:
        results = pool.map(_worker, jobs)
    wall = time.monotonic() - t0
    starts = sorted(t for r in results for t in r["started"])
    span = (starts[-1] - starts[0]) if len(starts) > 1 else 0.0
    return {
        "senders": results,
        "requests": sum(r["requests"] for r in results),
        "rate_limited": sum(r["rate_limited"] for r in results),
        "accepted": sum(r["accepted"] for r in results),
        "wall_seconds": wall,
        "busy_seconds": max(r["elapsed"] for r in results),
        "request_rate": (len(starts) - 1) / span if span else 0.0,
        "max_requests_in_any_second": max_in_window(starts, 1.0),
    }


def max_in_window(times: list[float], width: float) -> int:
    """Largest number of (sorted) instants inside any half-open window of ``width`` seconds."""
    best = lo = 0
    for hi, t in enumerate(times):
        while t - times[lo] >= width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best
