"""The standalone receiver (``mailflow webhooks serve``, uvicorn) under slow bodies and
concurrent deliveries: a half-sent body stores nothing, and concurrent events share transactions."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
from webhook_rig import SECRET, envelope, inbox, seed_sent, signed

from mailflow.emulator.testing import free_port


@contextmanager
def receiver(db_dsn: str, tmp_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MAILFLOW_WEBHOOK_SECRETS": f"{SECRET}, whsec_c2Vjb25kLXNlY3JldC0wMTIzNDU2Nzg5YWJjZA=="}
    with open(tmp_path / "receiver.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mailflow.cli", "webhooks", "serve", "--port", str(port),
                                 "--dsn", db_dsn, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log = (tmp_path / "receiver.log").read_text()
    assert "whsec_" not in log and "user1@example.com" not in log  # no secret, no unmasked address


def test_a_slow_body_is_cut_off_and_stores_nothing(db: psycopg.Connection, db_dsn: str, tmp_path: Path) -> None:
    db.execute("truncate mail.webhook_event")
    seed_sent(db, {"em_1": "user1@example.com"})
    body, headers = signed(envelope("bounced", "em_1", "user1@example.com"), svix_id="msg_slow")
    with receiver(db_dsn, tmp_path, "--body-timeout", "1", "--sweep-every", "0") as base:
        port = int(base.rsplit(":", 1)[1])
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(f"POST /resend HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{head}\r\n".encode()
                  + body[:40])
        started = time.monotonic()
        got = s.recv(4096)  # the server gives up on the body: closes (maybe after a 408)
        waited = time.monotonic() - started
        s.close()
        assert got in (b"",) or got.startswith(b"HTTP/1.1 408"), got
        assert 0.5 < waited < 5
        assert inbox(db) == []
        r = httpx.post(f"{base}/resend", content=body, headers=headers)  # the provider's retry
        assert r.status_code == 200
    assert [x[0] for x in inbox(db)] == ["msg_slow"]


def test_concurrent_events_are_committed_in_shared_groups(db: psycopg.Connection, db_dsn: str,
                                                          tmp_path: Path) -> None:
    db.execute("truncate mail.webhook_event")
    n = 300
    seed_sent(db, {f"em_{i}": f"user{i}@example.com" for i in range(n)})
    requests = [signed(envelope("delivered", f"em_{i}", f"user{i}@example.com"), svix_id=f"msg_{i:04d}")
                for i in range(n)]

    async def deliver(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=30,
                                     limits=httpx.Limits(max_connections=100)) as client:
            answers = await asyncio.gather(*(client.post("/resend", content=b, headers=h) for b, h in requests))
        return [a.status_code for a in answers]

    with receiver(db_dsn, tmp_path, "--sweep-every", "0") as base:
        statuses = asyncio.run(deliver(base))
        stats = httpx.get(f"{base}/healthz").json()
    assert statuses == [200] * n
    assert len(inbox(db)) == n and {x[3] for x in inbox(db)} == {"applied"}
    assert db.execute("select count(*) from mail.delivery_status where outcome = 'delivered'").fetchone() == (n,)
    assert stats["events"] == n and stats["failed_groups"] == 0
    assert stats["groups"] < n and stats["largest_group"] > 1  # several events per transaction
