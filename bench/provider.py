"""Provider utilisation at a 10 requests/s cap, 1 and 4 senders sharing the cap, at target fractions
0.8 (the default) and 0.95, against the seed's naive loops (one email per request, sequential; and one email per request, paced).

Ceiling = cap x 100 emails/s (every request a full batch). Utilisation = accepted emails per second
over the whole send (first request to last response) / ceiling.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx

from mailflow.emulator.testing import EmulatorProcess
from mailflow.model.clock import SystemClock
from mailflow.provider.client import parse_retry_after
from mailflow_dev.loadgen import run_concurrent

CAP = 10.0
FRACTION = 0.8  # the default target fraction: the naive baselines and the speedups use it
#: Every fraction measured with 1 and 4 senders (0.95: how close to the cap we run with 0 x 429).
FRACTIONS = (0.8, 0.95)
API_KEY = "re_test_emulator"


def metric(name: str, value: float, unit: str, target: str | None = None, met: bool | None = None,
           **params: Any) -> dict[str, Any]:
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met, "params": params}


def naive_sequential(base_url: str, n: int) -> dict[str, float]:
    """The seed's loop: POST /emails once per email, sequentially; on 429 sleep Retry-After."""
    sent = rate_limited = 0
    t0 = time.monotonic()
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        i = 0
        while i < n:
            r = http.post("/emails", json={"from": "a@mail.example.com", "to": [f"naive{i}@example.com"],
                                           "subject": "naive", "text": "hi"})
            if r.status_code == 429:
                rate_limited += 1
                time.sleep(parse_retry_after(r.headers.get("retry-after"), SystemClock()) or 1.0)
                continue
            sent += r.status_code == 200
            i += 1
    return {"emails_per_second": sent / (time.monotonic() - t0), "rate_limited": rate_limited}


def paced_per_email(base_url: str, n: int) -> dict[str, float]:
    """One email per request, paced at the target fraction of the cap (no 429s, no batching)."""
    spacing = 1 / (CAP * FRACTION)
    t0 = time.monotonic()
    nxt = t0
    sent = 0
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as http:
        for i in range(n):
            time.sleep(max(0.0, nxt - time.monotonic()))
            nxt += spacing
            r = http.post("/emails", json={"from": "a@mail.example.com", "to": [f"paced{i}@example.com"],
                                           "subject": "paced", "text": "hi"})
            sent += r.status_code == 200
    return {"emails_per_second": sent / (time.monotonic() - t0)}


def run(dsn: str, quick: bool = False) -> list[dict[str, Any]]:
    total = 2_000 if quick else 20_000
    naive_n = 60 if quick else 300
    ceiling = CAP * 100
    out: list[dict[str, Any]] = []
    outbox = Path(mkdtemp(prefix="mailflow-bench-")) / "outbox.jsonl"
    with EmulatorProcess(outbox=outbox, rate_limit=CAP, store_bodies=False) as emu:
        results = {}
        for fraction in FRACTIONS:
            for senders in (1, 4):
                emu.reset(keep_config=True)
                r = run_concurrent(senders, emu.base_url, API_KEY, emails_per_sender=total // senders, batch_size=100,
                                   requests_per_second=CAP, target_fraction=fraction, dsn=dsn,
                                   account=f"bench-{uuid.uuid4().hex[:6]}")
                stats = emu.stats()
                eps = r["accepted"] / r["busy_seconds"]
                if fraction == FRACTION:
                    results[senders] = eps
                who = f"{senders}_sender{'s' if senders > 1 else ''}" + ("" if fraction == FRACTION else f"_at_{fraction}")
                params = dict(cap_requests_per_second=CAP, target_fraction=fraction, emails=total, senders=senders,
                              requests=r["requests"], busy_seconds=round(r["busy_seconds"], 2),
                              max_requests_in_any_second=r["max_requests_in_any_second"])
                out.append(metric(f"utilisation_{who}", eps / ceiling, "of ceiling (cap x 100 emails/s)",
                                  f">= 0.95 x target fraction ({0.95 * fraction:.2f})",
                                  eps / ceiling >= 0.95 * fraction, emails_per_second=round(eps, 1), **params))
                out.append(metric(f"utilisation_{who}_vs_target", eps / (ceiling * fraction),
                                  f"of target (cap x {fraction} x 100)", ">= 0.95",
                                  eps / (ceiling * fraction) >= 0.95, **params))
                n429 = stats["responses_by_status"].get("429", 0)
                out.append(metric(f"http_429_{who}", n429, "responses", "0", n429 == 0, **params))
                dup = stats["outbox_lines"] - r["accepted"]
                out.append(metric(f"duplicates_{who}", dup, "emails", "0", dup == 0,
                                  outbox_lines=stats["outbox_lines"], accepted=r["accepted"]))
        emu.reset(keep_config=True)
        naive = naive_sequential(emu.base_url, naive_n)
        emu.reset(keep_config=True)
        paced = paced_per_email(emu.base_url, naive_n)
    out.append(metric("naive_sequential_emails_per_second", naive["emails_per_second"], "emails/s", None, None,
                      emails=naive_n, rate_limited=naive["rate_limited"]))
    out.append(metric("paced_per_email_emails_per_second", paced["emails_per_second"], "emails/s", None, None,
                      emails=naive_n))
    out.append(metric("speedup_vs_naive_sequential", results[1] / naive["emails_per_second"], "x", None, None))
    out.append(metric("speedup_vs_paced_per_email", results[1] / paced["emails_per_second"], "x", None, None))
    return out
