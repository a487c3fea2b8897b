"""Webhook load generator (a process of its own): pushes signed Resend webhooks at one receiver over
keep-alive HTTP/1.1 connections and records every acknowledgement.

``python -m bench.webhook_load SPEC.json OUT.json``. SPEC: ``url`` (the receiver's endpoint),
``secret`` (whsec_...), ``emails`` ([[provider id, address], ...]: rows of the send log), ``seed``,
``seconds`` (how long to push), ``connections`` (requests in flight at once, one per connection),
``max_events`` (the pool: events are generated and signed before the clock starts, so signing
never slows the pushing), ``duplicate_rate`` (messages posted once more, same svix-id).

The mix per email (seeded): ``email.sent``; then ``email.delivered`` (91%), ``email.bounced``
Permanent (4%) or Transient (5%); a delivered email is ``email.opened`` (35%), ``email.clicked``
(10%, and then also opened) and ``email.complained`` (0.5%). The pool is shuffled in windows of
2,000 events: the provider promises no order.

The client is asyncio (uvloop when installed) writing pre-built request bytes and parsing only the
status line and the body's length: one connection costs a few tens of microseconds per request, so
the receiver, not the client, sets the pace. A request that is not answered with a 2xx is not
retried (it is counted by status). OUT: ``acked`` (svix-ids answered 2xx, in answer order), ``suppress_expected`` (addresses with an
acknowledged permanent bounce or complaint), ``statuses``,
``latency_ms`` (p50, p90, p99, max over every answered request), ``per_second`` (2xx per second
of the run), ``seconds`` (first request to last answer), ``requests``, ``errors``, ``by_type``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

from standardwebhooks.webhooks import Webhook

MIX = {"hard_bounce": 0.04, "soft_bounce": 0.05, "open": 0.35, "click": 0.10, "complaint": 0.005}


Event = tuple[str, str, str, str, bool]
"""``(svix_id, type, body, address, suppresses)``: ``suppresses`` for a permanent bounce or a complaint."""


def plan_events(emails: list[tuple[str, str]], seed: int, max_events: int) -> list[Event]:
    """The events (:data:`Event`) of the emails in order until ``max_events``, shuffled in windows
    of 2,000. Event times are spread over the minute before now (UTC, milliseconds)."""
    rng = random.Random(seed)
    base = datetime.now(UTC) - timedelta(minutes=1)
    out: list[Event] = []
    n = 0
    for pid, addr in emails:
        if len(out) >= max_events:
            break
        u = rng.random()
        events: list[tuple[str, dict[str, Any]]] = [("email.sent", {})]
        if u < MIX["hard_bounce"]:
            events.append(("email.bounced", {"bounce": {"type": "Permanent", "subType": "General",
                                                         "message": "mailbox does not exist",
                                                         "diagnosticCode": ["smtp; 550 5.1.1 user unknown"]}}))
        elif u < MIX["hard_bounce"] + MIX["soft_bounce"]:
            events.append(("email.bounced", {"bounce": {"type": "Transient", "subType": "MailboxFull",
                                                         "message": "mailbox full",
                                                         "diagnosticCode": ["smtp; 452 4.2.2 mailbox full"]}}))
        else:
            events.append(("email.delivered", {}))
            clicked = rng.random() < MIX["click"]
            if clicked or rng.random() < MIX["open"]:
                events.append(("email.opened", {}))
            if clicked:
                events.append(("email.clicked", {"click": {"ipAddress": "192.0.2.1", "link": "https://example.com/",
                                                           "timestamp": base.isoformat(), "userAgent": "bench"}}))
            if rng.random() < MIX["complaint"]:
                events.append(("email.complained", {}))
        for i, (etype, extra) in enumerate(events):
            at = base + timedelta(seconds=rng.uniform(0, 30) + 5 * i)
            data = {"email_id": pid, "created_at": base.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                    "from": "Mailflow <news@mail.example.com>", "to": [addr], "subject": "Hello", **extra}
            body = json.dumps({"type": etype, "created_at": at.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                               "data": data}, separators=(",", ":"))
            n += 1
            suppresses = etype == "email.complained" or extra.get("bounce", {}).get("type") == "Permanent"
            out.append((f"msg_bench{seed}_{n}", etype, body, addr, suppresses))
    for start in range(0, len(out), 2000):
        window = out[start:start + 2000]
        rng.shuffle(window)
        out[start:start + 2000] = window
    return out[:max_events]


def build_requests(url: str, secret: str, events: list[Event], duplicate_rate: float,
                   seed: int) -> tuple[list[bytes], list[str]]:
    """Signed HTTP/1.1 request bytes and their svix-ids, duplicates (the same bytes again, later)
    inserted at random later positions."""
    parts = urlsplit(url)
    host = parts.netloc
    path = parts.path or "/"
    signer = Webhook(secret)
    now = datetime.now(UTC)
    ts = str(int(now.timestamp()))
    reqs: list[bytes] = []
    ids: list[str] = []
    for svix_id, _etype, body, _addr, _sup in events:
        raw = body.encode()
        sig = signer.sign(svix_id, now, body)
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\nsvix-id: {svix_id}\r\nsvix-timestamp: {ts}\r\n"
                f"svix-signature: {sig}\r\nUser-Agent: Svix-Webhooks/1.0 (mailflow-bench)\r\n\r\n")
        reqs.append(head.encode() + raw)
        ids.append(svix_id)
    rng = random.Random(seed + 1)
    for i in [i for i in range(len(reqs)) if rng.random() < duplicate_rate]:
        j = rng.randint(i + 1, len(reqs))
        reqs.insert(j, reqs[i])
        ids.insert(j, ids[i])
    return reqs, ids


async def _read_response(reader: asyncio.StreamReader) -> int:
    """The status of one HTTP/1.1 response; its body is read and dropped (Content-Length or chunked)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = 0
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value.strip())
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def push(url: str, reqs: list[bytes], ids: list[str], seconds: float, connections: int) -> dict[str, Any]:
    """Push ``reqs`` in order over ``connections`` keep-alive connections for ``seconds`` (or until
    the pool is used up); see the module doc for the result."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    nxt = 0
    acked: list[str] = []
    statuses: dict[str, int] = {}
    lat: list[float] = []
    ack_times: list[float] = []
    errors = 0
    t0 = time.perf_counter()
    end = t0 + seconds
    last = t0

    async def worker() -> None:
        nonlocal nxt, errors, last
        reader = writer = None
        while time.perf_counter() < end and nxt < len(reqs):
            i = nxt
            nxt += 1
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(host, port)
                assert reader is not None
                ts = time.perf_counter()
                writer.write(reqs[i])
                status = await _read_response(reader)
                te = time.perf_counter()
            except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
                errors += 1
                statuses["error"] = statuses.get("error", 0) + 1
                if writer is not None:
                    writer.close()
                reader = writer = None
                await asyncio.sleep(0.01)
                continue
            last = te
            lat.append(te - ts)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if 200 <= status < 300:
                acked.append(ids[i])
                ack_times.append(te - t0)
        if writer is not None:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    lat.sort()

    def q(p: float) -> float:
        return round(lat[min(len(lat) - 1, int(p * (len(lat) - 1) + 0.5))] * 1000, 2) if lat else float("nan")

    per_second = [0] * (int(max(ack_times, default=0)) + 1)
    for t in ack_times:
        per_second[int(t)] += 1
    return {"acked": acked, "statuses": statuses, "requests": nxt, "errors": errors,
            "pool_used_up": nxt >= len(reqs), "seconds": round(last - t0, 3),
            "latency_ms": {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": q(1.0)},
            "per_second": per_second}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(args[0]).read())
    t = time.perf_counter()
    events = plan_events([tuple(e) for e in spec["emails"]], spec.get("seed", 1), spec["max_events"])
    reqs, ids = build_requests(spec["url"], spec["secret"], events, spec.get("duplicate_rate", 0.0),
                               spec.get("seed", 1))
    prepared = time.perf_counter() - t
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - the plain loop is only slower
        pass
    out = asyncio.run(push(spec["url"], reqs, ids, spec["seconds"], spec["connections"]))
    by_type: dict[str, int] = {}
    for _, etype, _, _, _ in events:
        by_type[etype] = by_type.get(etype, 0) + 1
    acked = set(out["acked"])
    out["suppress_expected"] = sorted({addr for sid, _, _, addr, sup in events if sup and sid in acked})
    out |= {"prepared_seconds": round(prepared, 2), "pool": len(reqs), "unique_events": len(events),
            "by_type": by_type}
    with open(args[1], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
