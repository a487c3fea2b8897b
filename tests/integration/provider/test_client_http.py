"""Every retry and error branch of the Resend client against the emulator over real HTTP.

The emulator's outbox is the witness: whatever the faults, each email of a batch is delivered
at most once, and only Accepted outcomes claim delivery.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from mailflow.model.outcome import Accepted, NotSent, Refused, Unknown
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import LocalPacer
from mailflow_dev.loadgen import synthetic_batches

KEY = "re_test_emulator"


class BlindPacer(LocalPacer):
    """A pacer that ignores ratelimit-* headers, so the provider's 429 path is exercised."""

    def observe(self, headers, since_start: float = 0.0) -> None:
        return None


def client(emu, *, read_timeout: float = 5.0, attempts: int = 4, api_key: str = KEY, validation: str = "permissive",
           pacer: LocalPacer | None = None) -> ResendClient:
    return ResendClient(emu.base_url, api_key, pacer=pacer or LocalPacer(1000, 1.0), validation=validation,
                        policy=RetryPolicy(max_attempts=attempts, base=0.05, cap=0.2),
                        rng=random.Random(3), timeout=httpx.Timeout(read_timeout, connect=2.0))


def one_batch(n: int = 5, first_id: int = 1):
    return next(synthetic_batches(n, first_id=first_id, batch_size=n))


def far() -> float:
    return time.monotonic() + 60


def test_accepted_ids_match_outbox_by_index(emulator) -> None:
    batch = one_batch(5)
    with client(emulator) as c:
        out = c.send_batch(batch, far())
    assert isinstance(out, Accepted)
    box = emulator.read_outbox()
    assert [d["batch_index"] for d in box] == [0, 1, 2, 3, 4]
    assert out.ids == {d["batch_index"]: d["id"] for d in box}
    assert {d["idempotency_key"] for d in box} == {batch.idempotency_key}


def test_ratelimit_headers_adapt_the_pacer_so_no_429(emulator) -> None:
    emulator.configure(rate_limit=1)
    # 0.9 of the cap: at 1.0 the second start lands exactly on the provider's window edge, and any
    # jitter in the first request's arrival makes it a 429 (docs/performance.md: the slack is 1/f - 1)
    pacer = LocalPacer(1000, 0.9)
    with client(emulator, pacer=pacer) as c:
        c.send_batch(one_batch(3, first_id=1), far())
        t0 = time.monotonic()
        assert isinstance(c.send_batch(one_batch(3, first_id=100), far()), Accepted)
        waited = time.monotonic() - t0
    assert pacer.requests_per_second == 1.0  # adopted from ratelimit-limit
    assert c.stats["429"] == 0 and c.stats["requests"] == 2
    assert waited >= 0.9  # ratelimit-remaining: 0 pushed the schedule back to ratelimit-reset


def test_429_rate_limit_waits_retry_after_and_delivers_once(emulator) -> None:
    emulator.configure(rate_limit=1)
    with client(emulator, pacer=BlindPacer(1000, 1.0)) as c:
        first = c.send_batch(one_batch(3, first_id=1), far())
        t0 = time.monotonic()
        second = c.send_batch(one_batch(3, first_id=100), far())  # inside the same second: 429 first
        waited = time.monotonic() - t0
    assert isinstance(first, Accepted) and isinstance(second, Accepted)
    assert c.stats["429"] == 1 and c.stats["requests"] == 3
    assert 0.9 <= waited <= 2.5  # retry-after: 1
    assert len(emulator.read_outbox()) == 6
    assert emulator.stats()["rate_limited"] == {"rate_limit_exceeded": 1}


@pytest.mark.parametrize("style", ["fraction", "http-date"])
def test_retry_after_styles(emulator, style: str) -> None:
    emulator.configure(rate_limit=1, retry_after_style=style)
    with client(emulator, pacer=BlindPacer(1000, 1.0)) as c:
        c.send_batch(one_batch(2, first_id=1), far())
        assert isinstance(c.send_batch(one_batch(2, first_id=10), far()), Accepted)
    assert c.stats["429"] >= 1
    assert len(emulator.read_outbox()) == 4


def test_quota_exceeded_is_not_retried_and_stops(emulator) -> None:
    emulator.configure(quota_emails=3)
    with client(emulator) as c:
        out = c.send_batch(one_batch(5), far())
    assert isinstance(out, NotSent)
    assert out.stop_run == "daily_quota_exceeded"
    assert c.stats["requests"] == 1
    assert emulator.read_outbox() == []


def test_5xx_on_every_retry_with_same_key_is_unknown_never_not_sent(emulator) -> None:
    emulator.configure(error_rate=1.0)
    with client(emulator, attempts=3) as c:
        out = c.send_batch(one_batch(4), far())
    assert isinstance(out, Unknown) and out.stop_run == "provider unavailable"
    assert out.reason.startswith("gave up after 3 attempts: HTTP 500 internal_server_error")
    assert emulator.stats()["status_5xx"] == 3
    assert emulator.read_outbox() == []


def test_5xx_after_processing_then_retry_replays_the_original(emulator) -> None:
    emulator.configure(error_after_rate=1.0, error_after_status=504)
    batch = one_batch(3)
    with client(emulator, attempts=1) as c:
        assert isinstance(c.send_batch(batch, far()), Unknown)
    emulator.configure(error_after_rate=0.0)
    with client(emulator) as c:
        again = c.send_batch(batch, far())
    box = emulator.read_outbox()
    assert isinstance(again, Accepted) and len(box) == 3
    assert again.ids == {d["batch_index"]: d["id"] for d in box}


def test_reset_after_accept_then_retry_replays_original(emulator) -> None:
    emulator.configure(reset_after_accept_rate=1.0, reset_mode="abort")
    batch = one_batch(4)
    with client(emulator, attempts=1) as c:
        out = c.send_batch(batch, far())
    assert isinstance(out, Unknown)  # accepted by the provider, but we cannot know: never guessed
    emulator.configure(reset_after_accept_rate=0.0)
    with client(emulator) as c:
        again = c.send_batch(batch, far())  # same key, same bytes
    box = emulator.read_outbox()
    assert isinstance(again, Accepted)
    assert len(box) == 4  # delivered once
    assert again.ids == {d["batch_index"]: d["id"] for d in box}
    assert emulator.stats()["replays"] == 1


def test_read_timeout_after_accept_then_retry_gets_the_original(emulator) -> None:
    # The provider accepts and records the batch, then its answer is late (hang mode): the client
    # times out (maybe delivered) and retries with the same key and bytes; the provider answers
    # with the original result (or 409 concurrent while the first is still in flight, retried).
    emulator.configure(reset_after_accept_rate=1.0, reset_mode="hang", hang_seconds=1.0)
    batch = one_batch(3)
    with client(emulator, read_timeout=0.4, attempts=6) as c:
        out = c.send_batch(batch, far())
    box = emulator.read_outbox()
    assert isinstance(out, Accepted)
    assert len(box) == 3  # delivered once, whatever the retries
    assert out.ids == {d["batch_index"]: d["id"] for d in box}
    assert c.stats["timeouts"] >= 1


def test_409_invalid_idempotent_request_is_fatal_unknown(emulator) -> None:
    a = one_batch(2, first_id=1)
    b = one_batch(3, first_id=50)
    forged = type(b)(a.idempotency_key, b.campaign, b.row_ids, b.body)  # same key, other bytes
    with client(emulator) as c:
        assert isinstance(c.send_batch(a, far()), Accepted)
        out = c.send_batch(forged, far())
    assert isinstance(out, Unknown) and out.fatal
    assert "invalid_idempotent_request" in out.reason
    assert len(emulator.read_outbox()) == 2


def test_401_and_403_stop_naming_the_connection(emulator) -> None:
    with client(emulator, api_key="re_wrong") as c:
        out = c.send_batch(one_batch(2), far())
    assert isinstance(out, NotSent) and out.fatal and out.stop_run == "invalid API key"
    assert "connection 'resend_default'" in out.reason and "403 invalid_api_key" in out.reason
    assert c.stats["requests"] == 1


def test_strict_mode_refusal_names_no_index_and_is_refused(emulator) -> None:
    import json

    batch = one_batch(4)
    emails = json.loads(batch.body)
    emails[2]["to"] = ["not an address"]
    bad = type(batch)(batch.idempotency_key, batch.campaign, batch.row_ids, json.dumps(emails).encode())
    with client(emulator, validation="strict") as c:
        out = c.send_batch(bad, far())
    assert out == Refused(reason="HTTP 422 validation_error: Invalid `to` field. The email address needs to follow "
                                 "the `email@example.com` or `Name <email@example.com>` format.")
    assert emulator.read_outbox() == []


def test_all_rejected_in_permissive_mode(emulator) -> None:
    import json

    batch = one_batch(3)
    emails = json.loads(batch.body)
    for e in emails:
        e["to"] = ["broken@@example.com"]
    bad = type(batch)(batch.idempotency_key, batch.campaign, batch.row_ids, json.dumps(emails).encode())
    with client(emulator) as c:
        out = c.send_batch(bad, far())
    assert isinstance(out, Accepted)
    assert out.ids == {} and sorted(out.rejected) == [0, 1, 2]
    assert emulator.read_outbox() == []


def test_scrambled_order_is_detected_only_by_contract(emulator) -> None:
    # A provider that reorders `data` cannot be detected from counts alone; the contract test of the
    # emulator and SDK pins request order. Here: the ids we map are the ids the outbox holds.
    with client(emulator) as c:
        out = c.send_batch(one_batch(5), far())
    assert isinstance(out, Accepted)
    assert sorted(out.ids.values()) == sorted(d["id"] for d in emulator.read_outbox())


def test_budget_stops_waiting_on_rate_limit(emulator) -> None:
    emulator.configure(rate_limit=1)
    with client(emulator, pacer=BlindPacer(1000, 1.0)) as c:
        c.send_batch(one_batch(1, first_id=1), far())
        t0 = time.monotonic()
        out = c.send_batch(one_batch(1, first_id=5), time.monotonic() + 0.3)  # retry-after 1 > budget
    assert isinstance(out, NotSent) and out.stop_run == "time budget"
    assert time.monotonic() - t0 < 0.6
    assert len(emulator.read_outbox()) == 1
