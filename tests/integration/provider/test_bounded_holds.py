"""Provider headers are bounded and the shared schedule keeps its rate whatever the pacer database
does: a skewed or absurd Retry-After never freezes the other senders past the cap nor raises in
SQL, and a pacer database that answers up to 0.5 s late never lets more than the cap's requests
start in one second (4 senders against an emulator capped at 10 requests/s)."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import httpx
import psycopg
import pytest

from mailflow.emulator.testing import DEFAULT_API_KEY, EmulatorProcess
from mailflow.model.outcome import Accepted, NotSent, PreparedBatch
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow_dev.chaos.actors import SlowConnection
from mailflow_dev.loadgen import max_in_window

CAP = 10  # requests/s: the emulator's team limit (sliding 1 s window)


def _batch(sender: int, n: int) -> PreparedBatch:
    emails = [{"from": "Pacing <pacing@mailflow.example>", "to": [f"s{sender}-{n}@example.com"],
               "subject": "pacing", "text": "hello"}]
    return PreparedBatch(f"mf-bounded-{uuid.uuid4().hex}", "pacing", (sender * 1000 + n,),
                         json.dumps(emails).encode())


def _next_slot(db_dsn: str, account: str) -> datetime:
    with psycopg.connect(db_dsn) as conn:
        row = conn.execute("select next_slot from mail.rate_slot where account = %s", (account,)).fetchone()
    assert row is not None
    return row[0]


# -- item: one Retry-After freezes every sender ---------------------------------------------------

@pytest.mark.parametrize("seconds", [1e300, float("inf"), float("nan"), 100000000.0, 601.0])
def test_absurd_push_back_is_clamped_to_the_cap_in_sql_and_never_raises(db_dsn: str, seconds: float) -> None:
    account = f"hold-{uuid.uuid4().hex[:6]}"
    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0)
    try:
        pacer.push_back(seconds)  # on main: "interval out of range" for 1e300, a schedule in 2030 for 1e8
        pacer.observe({"ratelimit-limit": "10", "ratelimit-remaining": "0", "ratelimit-reset": "60"})
        assert (_next_slot(db_dsn, account) - datetime.now(UTC)).total_seconds() <= 60.0
        assert pacer.claim() <= 60.0
    finally:
        pacer.close()


def test_a_schedule_pushed_back_by_an_older_version_is_pulled_in_by_the_next_claim(db_dsn: str) -> None:
    account = f"hold-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(db_dsn, autocommit=True) as conn:  # what Retry-After: 100000000 left behind on main
        conn.execute("insert into mail.rate_slot (account, next_slot) values (%s, '2030-03-03T00:00:00Z')",
                     (account,))
    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0)
    try:
        assert pacer.peek() <= 70.0
        assert pacer.claim() <= 70.0  # at most the cap plus a queue, not 3 years
    finally:
        pacer.close()


def test_skewed_http_date_retry_after_holds_the_shared_schedule_one_second_not_ten_minutes(
        tmp_path: Path, db_dsn: str) -> None:
    # the provider's clock runs 10 min ahead; its 429s say "retry at my now + 1 s" as an HTTP-date
    account = f"skew-{uuid.uuid4().hex[:6]}"
    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=0, rate_limited_rate=1.0,
                         retry_after_style="http-date", date_skew_seconds=600) as emu:
        pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0)
        client = ResendClient(emu.base_url, DEFAULT_API_KEY, pacer=pacer, policy=RetryPolicy(max_attempts=2))
        try:
            out = client.send_batch(_batch(1, 1), deadline=time.monotonic() + 30)
            hold = (_next_slot(db_dsn, account) - datetime.now(UTC)).total_seconds()
        finally:
            client.close()
            pacer.close()
    # both attempts were 429s: the run stops as rate limited (on main: "provider unreachable", and
    # the first 429 held every sender 601 s)
    assert out == NotSent(reason="gave up after 2 attempts: HTTP 429 rate_limit_exceeded: Too many requests. "
                                 "Emulated rate limit.", stop_run="rate limited")
    assert client.stats["429"] == 2
    assert hold <= 2.5


def test_absurd_retry_after_stops_the_run_with_an_alert_and_other_senders_wait_only_the_cap(
        tmp_path: Path, db_dsn: str) -> None:
    account = f"absurd-{uuid.uuid4().hex[:6]}"
    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=0, rate_limited_rate=1.0,
                         retry_after_value="100000000") as emu:
        pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0, max_hold=20.0)
        client = ResendClient(emu.base_url, DEFAULT_API_KEY, pacer=pacer, policy=RetryPolicy(max_retry_after=20.0))
        other = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0)
        try:
            out = client.send_batch(_batch(1, 1), deadline=time.monotonic() + 30)
            wait = other.claim()
        finally:
            client.close()
            pacer.close()
            other.close()
    assert isinstance(out, NotSent) and out.stop_run == "rate limited" and out.fatal is True
    assert "wait of over a year (Retry-After '100000000'), above the 20 s cap" in out.reason
    assert 15.0 <= wait <= 20.5  # held the cap, not 3 years


# -- item: a slow pacer database lets 11 requests start in one second -----------------------------

class _Timed(httpx.HTTPTransport):
    def __init__(self, sink: list[float]):
        super().__init__()
        self.sink = sink

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sink.append(time.monotonic())
        return super().handle_request(request)


def test_slow_pacer_database_never_lets_more_than_the_cap_start_in_one_second(tmp_path: Path, db_dsn: str) -> None:
    account = f"slowdb-{uuid.uuid4().hex[:6]}"
    starts: list[float] = []
    outcomes: list[object] = []
    clients: list[ResendClient] = []
    per_sender = 18

    def sender(i: int, base_url: str) -> None:
        rng = random.Random(1000 + i)
        pacer = PostgresPacer(lambda: SlowConnection(psycopg.connect(db_dsn), rng), account,  # type: ignore[arg-type, return-value]
                              float(CAP), 0.8)
        client = ResendClient(base_url, DEFAULT_API_KEY, pacer=pacer, transport=_Timed(starts),
                              policy=RetryPolicy(max_attempts=1))
        clients.append(client)
        try:
            for n in range(per_sender):
                deadline = time.monotonic() + 600
                if i % 2:  # the pipelined path: the slot is claimed right before the request
                    outcomes.append(client.send_batch(_batch(i, n), deadline, claim_at_send=True))
                else:  # the reserved path: the slot is claimed before the chunk is prepared
                    slot = client.reserve_slot(deadline)
                    outcomes.append(client.send_batch(_batch(i, n), deadline, slot))
        finally:
            client.close()
            pacer.close()

    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=CAP) as emu:
        threads = [threading.Thread(target=sender, args=(i, emu.base_url)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = emu.stats()
    assert stats["responses_by_status"] == {"200": 4 * per_sender}  # 0 x 429
    assert all(isinstance(o, Accepted) for o in outcomes) and len(outcomes) == 4 * per_sender
    assert max_in_window(sorted(starts), 1.0) <= CAP
    assert sum(c.stats["429"] for c in clients) == 0
