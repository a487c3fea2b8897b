"""ResendClient.send_batch against httpx.MockTransport (HTTP mocked at the transport), with a
LocalPacer on a FakeClock and a seeded random.Random: retries, waits, idempotency, outcomes."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable
from datetime import timedelta
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from mailflow.model.clock import FakeClock
from mailflow.model.outcome import Accepted, NotSent, PreparedBatch, Refused, Unknown
from mailflow.provider.client import SLOT_GRACE_SECONDS, ResendClient, RetryPolicy, parse_retry_after
from mailflow.provider.pacing import LocalPacer

SEED = 20260101
BASE = "https://api.resend.test"
EMAILS = [{"from": "a@example.com", "to": [f"u{i}@example.com"], "subject": "Hi", "text": "é"} for i in range(3)]
BATCH = PreparedBatch(idempotency_key="mf-11-0123456789abcdef", campaign="c", row_ids=(11, 12, 13),
                      body=json.dumps(EMAILS, ensure_ascii=False).encode())
OK = {"data": [{"id": "id-0"}, {"id": "id-1"}, {"id": "id-2"}], "errors": []}


def err(status: int, name: str, message: str = "msg", **headers: str) -> httpx.Response:
    return httpx.Response(status, json={"statusCode": status, "name": name, "message": message}, headers=headers)


Step = httpx.Response | Exception | Callable[[httpx.Request], httpx.Response]


class Script:
    """A MockTransport handler answering each request with the next step (responses or exceptions)."""

    def __init__(self, *steps: Step):
        self.steps = list(steps)
        self.requests: list[httpx.Request] = []
        self.bodies: list[bytes] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        self.bodies.append(request.read())
        assert self.steps, f"unexpected request #{len(self.requests)}"
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        if callable(step) and not isinstance(step, httpx.Response):
            return step(request)
        return step


class Rig:
    def __init__(self, *steps: Step, max_attempts: int = 5, rps: float = 10.0, conn_id: str = "resend_default",
                 policy: RetryPolicy | None = None):
        self.clock = FakeClock()
        self.pacer = LocalPacer(rps, clock=self.clock)
        self.script = Script(*steps)
        self.policy = policy or RetryPolicy(max_attempts=max_attempts)
        self.client = ResendClient(BASE, "re_secret_key", pacer=self.pacer, clock=self.clock, policy=self.policy,
                                   rng=random.Random(SEED), transport=httpx.MockTransport(self.script),
                                   conn_id=conn_id)

    def send(self, deadline: float = 1000.0, batch: PreparedBatch = BATCH) -> Any:
        return self.client.send_batch(batch, deadline)

    @property
    def requests(self) -> list[httpx.Request]:
        return self.script.requests


def backoffs(*attempts: int) -> list[float]:
    """What RetryPolicy() draws from a fresh Random(SEED) for these attempts, in order."""
    rng, p = random.Random(SEED), RetryPolicy()
    return [rng.uniform(0, min(p.cap, p.base * 2 ** (a - 1))) for a in attempts]


def assert_same_request(requests: list[httpx.Request], bodies: list[bytes]) -> None:
    assert len({r.headers["idempotency-key"] for r in requests}) == 1
    assert requests[0].headers["idempotency-key"] == BATCH.idempotency_key
    assert all(b == BATCH.body for b in bodies)


# -- Retry-After parsing -------------------------------------------------------------------------

def test_retry_after_delta_seconds_and_fraction() -> None:
    clock = FakeClock()
    assert parse_retry_after("2", clock) == 2.0
    assert parse_retry_after(" 7 ", clock) == 7.0
    assert parse_retry_after("0.25", clock) == 0.25
    assert parse_retry_after("0", clock) == 0.0


def test_retry_after_http_date_is_measured_against_the_clock_now() -> None:
    clock = FakeClock(start=0.0)
    header = format_datetime(clock.now() + timedelta(seconds=5), usegmt=True)
    assert parse_retry_after(header, clock) == 5.0
    clock.advance(2.0)
    assert parse_retry_after(header, clock) == 3.0
    clock.advance(10.0)
    assert parse_retry_after(header, clock) == 0.0  # a date in the past means "now"


@pytest.mark.parametrize("value", [None, "", "soon", "-1", "-0.5", "nan", "inf", "-inf", "Mon, 99 Foo 2026"])
def test_retry_after_unusable_values_are_none(value: str | None) -> None:
    assert parse_retry_after(value, FakeClock()) is None


def test_garbage_retry_after_falls_back_to_the_jittered_backoff() -> None:
    # a fast pacer (spacing 1.25 ms) so the wait is the backoff, not the pacer's next slot
    rig = Rig(err(429, "rate_limit_exceeded", **{"retry-after": "soon"}), httpx.Response(200, json=OK), rps=1000)
    out = rig.send()
    assert out == Accepted(ids={0: "id-0", 1: "id-1", 2: "id-2"}, rejected={})
    [b1] = backoffs(1)
    assert 1 / (1000 * 0.8) < b1 <= 0.5
    assert rig.clock.sleeps == [0.0, b1]
    assert rig.client.stats["429"] == 1


# -- 429 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("retry_after,wait", [("2", 2.0), ("0.25", 0.25)])
def test_429_then_200_waits_exactly_retry_after_and_resends_the_same_bytes(retry_after: str, wait: float) -> None:
    rig = Rig(err(429, "rate_limit_exceeded", "Too many requests", **{"retry-after": retry_after}),
              httpx.Response(200, json=OK))
    out = rig.send()
    assert out == Accepted(ids={0: "id-0", 1: "id-1", 2: "id-2"}, rejected={})
    assert rig.clock.sleeps == [0.0, wait]
    assert rig.clock.monotonic() == wait
    assert len(rig.requests) == 2
    assert_same_request(rig.requests, rig.script.bodies)
    for r in rig.requests:
        assert r.method == "POST" and str(r.url) == f"{BASE}/emails/batch"
        assert r.headers["authorization"] == "Bearer re_secret_key"
        assert r.headers["x-batch-validation"] == "permissive"
        assert r.headers["content-type"] == "application/json"
    # the second attempt waited for its slot of the pushed-back schedule: that wait is pacing
    assert rig.client.stats == {"requests": 2, "429": 1, "5xx": 0, "timeouts": 0, "replays": 0, "late_slots": 0,
                                "pacing_wait_ms": round(wait * 1000)}


def test_429_with_http_date_retry_after() -> None:
    clock_now = FakeClock().now()
    header = format_datetime(clock_now + timedelta(seconds=3), usegmt=True)
    rig = Rig(err(429, "rate_limit_exceeded", **{"retry-after": header}), httpx.Response(200, json=OK))
    assert isinstance(rig.send(), Accepted)
    assert rig.clock.sleeps == [0.0, 3.0]


def test_retry_after_beyond_the_deadline_stops_the_run_without_sleeping_past_it() -> None:
    rig = Rig(err(429, "rate_limit_exceeded", "Too many requests", **{"retry-after": "10"}))
    out = rig.send(deadline=5.0)
    assert out == NotSent(reason="time budget reached while rate limited "
                                 "(HTTP 429 rate_limit_exceeded: Too many requests)", stop_run="time budget")
    assert rig.clock.sleeps == [0.0]
    assert rig.clock.monotonic() == 0.0
    assert len(rig.requests) == 1
    # the shared schedule is still pushed back for every other sender
    assert rig.pacer.claim() == 10.0


def test_retry_after_above_max_retry_after_stops_the_run_as_rate_limited() -> None:
    rig = Rig(err(429, "rate_limit_exceeded", "slow down", **{"retry-after": "61"}))
    out = rig.send()
    assert out == NotSent(reason="rate limited: the provider asked for a wait of 61 s (Retry-After '61'), above "
                                 "the 60 s cap (HTTP 429 rate_limit_exceeded: slow down)",
                          stop_run="rate limited", fatal=True)
    assert rig.clock.sleeps == [0.0]
    assert len(rig.requests) == 1
    assert rig.pacer.claim() == 60.0  # every other sender is held the cap, not the 61 s asked


def test_pacer_wait_past_the_deadline_makes_no_request() -> None:
    rig = Rig()
    rig.pacer.push_back(30.0)
    out = rig.send(deadline=20.0)
    assert out == NotSent(reason="time budget reached before attempt 1: the next request slot starts 10.0 s after "
                                 "the deadline (no attempt made)", stop_run="time budget")
    assert rig.requests == [] and rig.clock.sleeps == []


def test_daily_quota_exceeded_stops_the_run_after_one_request() -> None:
    rig = Rig(err(429, "daily_quota_exceeded", "You have reached your daily email sending quota"))
    out = rig.send()
    assert out == NotSent(reason="provider quota exhausted: HTTP 429 daily_quota_exceeded: "
                                 "You have reached your daily email sending quota",
                          stop_run="daily_quota_exceeded", fatal=True)
    assert len(rig.requests) == 1
    assert rig.clock.sleeps == [0.0]


def test_monthly_quota_exceeded_stops_the_run_too() -> None:
    rig = Rig(err(429, "monthly_quota_exceeded", "quota"))
    out = rig.send()
    assert isinstance(out, NotSent) and out.stop_run == "monthly_quota_exceeded" and out.fatal
    assert len(rig.requests) == 1


# -- 5xx, timeouts, transport errors: ambiguous ----------------------------------------------------

@pytest.mark.parametrize("status,name", [(500, "internal_server_error"), (502, "bad_gateway"),
                                         (503, "service_unavailable"), (504, "gateway_timeout")])
def test_5xx_after_processing_is_unknown_never_not_sent(status: int, name: str) -> None:
    # Resend: a 5xx says nothing about whether the batch was processed (an edge 502/504 can follow
    # processing). Before issue 12 this was NotSent, and the rows were released and sent again.
    rig = Rig(*[err(status, name, "boom") for _ in range(3)], max_attempts=3)
    out = rig.send()
    assert out == Unknown(reason=f"gave up after 3 attempts: HTTP {status} {name}: boom; "
                                 "an earlier attempt may have been processed", stop_run="provider unavailable")
    assert len(rig.requests) == 3
    assert_same_request(rig.requests, rig.script.bodies)
    b1, b2 = backoffs(1, 2)
    # pacer waits at even positions, the jittered backoffs in between (none after the last attempt)
    assert rig.clock.sleeps[1::2] == [b1, b2]
    assert len(rig.clock.sleeps) == 5
    assert rig.client.stats["5xx"] == 3 and rig.client.stats["requests"] == 3


def test_a_5xx_then_a_429_is_still_unknown() -> None:
    rig = Rig(err(500, "internal_server_error", "boom"), err(429, "daily_quota_exceeded", "quota"))
    out = rig.send()
    assert isinstance(out, Unknown) and out.stop_run == "daily_quota_exceeded" and out.fatal


def test_read_timeout_then_500s_is_unknown() -> None:
    rig = Rig(httpx.ReadTimeout("timed out"), err(500, "internal_server_error", "boom"),
              err(502, "bad_gateway", "upstream"), max_attempts=3)
    out = rig.send()
    assert out == Unknown(reason="gave up after 3 attempts: HTTP 502 bad_gateway: upstream; "
                                 "an earlier attempt may have been processed", stop_run="provider unavailable")
    assert len(rig.requests) == 3
    assert_same_request(rig.requests, rig.script.bodies)
    assert rig.client.stats["timeouts"] == 1 and rig.client.stats["5xx"] == 2


def test_read_timeout_then_200_is_accepted() -> None:
    rig = Rig(httpx.ReadTimeout("timed out"),
              httpx.Response(200, json={"data": [{"id": "a"}, {"id": "c"}],
                                        "errors": [{"index": 1, "message": "Invalid `to` field."}]}))
    out = rig.send()
    assert out == Accepted(ids={0: "a", 2: "c"}, rejected={1: "Invalid `to` field."})
    assert len(rig.requests) == 2
    assert_same_request(rig.requests, rig.script.bodies)


def test_remote_protocol_error_after_writing_is_ambiguous() -> None:
    rig = Rig(httpx.RemoteProtocolError("peer closed connection"), httpx.ConnectError("refused"), max_attempts=2)
    out = rig.send()
    assert out == Unknown(reason="gave up after 2 attempts: connection failed: refused; "
                                 "an earlier attempt may have been processed", stop_run="provider unavailable")


def test_connect_errors_only_are_not_sent_and_stop_the_run() -> None:
    rig = Rig(*[httpx.ConnectError("connection refused") for _ in range(4)], max_attempts=4)
    out = rig.send()
    assert out == NotSent(reason="gave up after 4 attempts: connection failed: connection refused",
                          stop_run="provider unreachable")
    assert len(rig.requests) == 4
    assert rig.client.stats["timeouts"] == 0


@pytest.mark.parametrize("exc", [httpx.ConnectTimeout("connect timed out"), httpx.PoolTimeout("pool timed out")])
def test_connect_and_pool_timeouts_are_not_ambiguous(exc: Exception) -> None:
    rig = Rig(exc, exc, max_attempts=2)
    out = rig.send()
    assert isinstance(out, NotSent)
    assert out.reason == f"gave up after 2 attempts: {type(exc).__name__}: {exc}"
    assert rig.client.stats["timeouts"] == 2


def test_backoff_past_the_deadline_after_a_5xx_is_unknown_with_time_budget() -> None:
    rig = Rig(err(503, "service_unavailable", "down"), max_attempts=5)
    [b1] = backoffs(1)
    out = rig.send(deadline=b1 / 2)
    assert out == Unknown(reason="time budget reached while retrying (HTTP 503 service_unavailable: down); "
                                 "an earlier attempt may have been processed", stop_run="time budget")
    assert rig.clock.sleeps == [0.0]


def test_a_reserved_slot_is_used_for_the_first_attempt_even_past_the_deadline() -> None:
    rig = Rig(httpx.Response(200, json=OK))
    slot = rig.client.reserve_slot(deadline=10.0)
    assert slot == 0.0
    rig.clock.advance(20.0)  # minting took longer than the budget: the minted chunk is still sent
    out = rig.client.send_batch(BATCH, 10.0, slot)
    assert isinstance(out, Accepted) and len(rig.requests) == 1


def test_reserve_slot_past_the_deadline_is_none() -> None:
    rig = Rig(rps=0.1)  # slots 12.5 s apart
    assert rig.client.reserve_slot(deadline=5.0) == 0.0
    assert rig.client.reserve_slot(deadline=5.0) is None
    assert rig.requests == []


def test_peek_slot_predicts_the_next_slot_without_claiming_it() -> None:
    rig = Rig(rps=0.1)  # slots 12.5 s apart
    assert rig.client.peek_slot(deadline=5.0) == 0.0
    assert rig.client.peek_slot(deadline=5.0) == 0.0  # nothing was claimed
    assert rig.client.reserve_slot(deadline=5.0) == 0.0
    assert rig.client.peek_slot(deadline=20.0) == pytest.approx(12.5)
    assert rig.client.peek_slot(deadline=5.0) is None  # the next slot starts after the budget
    assert rig.requests == []


def test_claim_at_send_claims_the_slot_then_and_allows_the_first_attempt_a_grace_past_the_budget() -> None:
    # the pipelined engine checked the budget with peek_slot before minting; the sender claims the
    # slot right before the request and does not abandon a minted chunk whose slot is a few slots late
    rig = Rig(httpx.Response(200, json=OK), httpx.Response(200, json=OK), rps=0.1)
    rig.client.reserve_slot(deadline=100.0)  # another sender took the slot at 0; the next is at 12.5
    out = rig.client.send_batch(BATCH, 12.5 - SLOT_GRACE_SECONDS, claim_at_send=True)
    assert isinstance(out, Accepted) and len(rig.requests) == 1
    assert rig.clock.sleeps == [pytest.approx(12.5)]
    assert rig.client.stats["late_slots"] == 0
    assert rig.client.peek_slot(deadline=100.0) == pytest.approx(25.0)  # that slot was claimed by the send


# -- 4xx: proven not processed ---------------------------------------------------------------------

@pytest.mark.parametrize("status,name,message,kind,fix", [
    (401, "missing_api_key", "Missing API key", "missing API key", "set the password of connection 'resend_prod'"),
    (403, "invalid_api_key", "API key is invalid", "invalid API key", "Put a current key in the connection's password"),
    (401, "restricted_api_key", "This API key is restricted to only send emails", "restricted API key",
     "full-access key"),
    (403, "validation_error", "The gmail.com domain is not verified. Please, add and verify your domain on "
     "https://resend.com/domains", "domain not verified", "change the campaign's from address to a verified domain"),
    (403, "validation_error", "You can only send testing emails to your own email address (o@x.org).",
     "test-only account", "Verify a sending domain"),
])
def test_auth_failure_is_fatal_and_names_the_connection_and_the_fix(status: int, name: str, message: str, kind: str,
                                                                    fix: str) -> None:
    rig = Rig(err(status, name, message), conn_id="resend_prod")
    out = rig.send()
    assert isinstance(out, NotSent) and out.fatal and out.stop_run == kind
    assert "connection 'resend_prod'" in out.reason and fix in out.reason
    assert f"HTTP {status} {name}: {message}" in out.reason
    assert len(rig.requests) == 1
    assert "re_secret_key" not in out.reason


def test_invalid_idempotent_request_is_unknown_and_fatal() -> None:
    rig = Rig(err(409, "invalid_idempotent_request", "Same idempotency key used with a different request payload."))
    out = rig.send()
    assert out == Unknown(reason="idempotency conflict, not resent under a new key: HTTP 409 "
                                 "invalid_idempotent_request: Same idempotency key used with a different "
                                 "request payload.", stop_run="idempotency conflict", fatal=True)
    assert len(rig.requests) == 1


def test_concurrent_idempotent_request_then_200_is_accepted() -> None:
    rig = Rig(err(409, "concurrent_idempotent_requests", "in progress"), httpx.Response(200, json=OK))
    out = rig.send()
    assert out == Accepted(ids={0: "id-0", 1: "id-1", 2: "id-2"}, rejected={})
    assert len(rig.requests) == 2
    assert_same_request(rig.requests, rig.script.bodies)
    [b1] = backoffs(1)
    assert rig.clock.sleeps[1] == b1


def test_concurrent_idempotent_request_on_every_attempt_is_unknown() -> None:
    rig = Rig(*[err(409, "concurrent_idempotent_requests", "in progress") for _ in range(2)], max_attempts=2)
    out = rig.send()
    assert out == Unknown(reason="gave up after 2 attempts: HTTP 409 concurrent_idempotent_requests: in progress; "
                                 "an earlier attempt may have been processed", stop_run="provider unavailable")


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_refused_whole_body_is_not_sent_stops_the_run_and_alerts(status: int) -> None:
    rig = Rig(err(status, "validation_error", "The batch must contain between 1 and 100 emails, got 0."))
    out = rig.send()
    assert out == NotSent(reason=f"provider refused the whole request: HTTP {status} validation_error: "
                                 "The batch must contain between 1 and 100 emails, got 0.",
                          stop_run="request refused", fatal=True)
    assert len(rig.requests) == 1


STRICT_MSG = "Invalid `to` field. The email address needs to follow the `email@example.com` format."


def test_strict_refusal_without_index_is_refused_never_parsed() -> None:
    # Resend's strict error is prose naming no email: the client never attributes it to an index.
    rig = Rig(err(422, "validation_error", "emails[1]: " + STRICT_MSG))
    rig.client.validation = "strict"
    out = rig.send()
    assert out == Refused(reason=f"HTTP 422 validation_error: emails[1]: {STRICT_MSG}")
    assert len(rig.requests) == 1 and rig.clock.sleeps == [0.0]
    assert rig.requests[0].headers["x-batch-validation"] == "strict"


def test_a_batch_validation_mode_overrides_the_clients() -> None:
    rig = Rig(httpx.Response(200, json=OK))
    rig.client.validation = "strict"
    rig.send(batch=dataclasses.replace(BATCH, validation="permissive"))
    assert rig.requests[0].headers["x-batch-validation"] == "permissive"


def test_a_422_in_permissive_mode_is_a_refused_body_not_a_strict_refusal() -> None:
    rig = Rig(err(422, "validation_error", STRICT_MSG))
    out = rig.send()
    assert isinstance(out, NotSent) and out.stop_run == "request refused"


def test_a_strict_422_after_an_ambiguous_attempt_is_unknown() -> None:
    rig = Rig(httpx.ReadTimeout("timed out"), err(422, "validation_error", STRICT_MSG))
    rig.client.validation = "strict"
    out = rig.send()
    assert out == Unknown(reason=f"provider refused the whole request: HTTP 422 validation_error: {STRICT_MSG}; "
                                 "an earlier attempt may have been processed", stop_run="request refused", fatal=True)
    assert len(rig.requests) == 2


def test_2xx_with_a_non_json_body_is_unknown() -> None:
    rig = Rig(httpx.Response(200, content=b"<html>oops</html>"))
    out = rig.send()
    assert out == Unknown(reason="2xx with a body that is not JSON: '<html>oops</html>'")


def test_2xx_that_does_not_add_up_is_unknown() -> None:
    rig = Rig(httpx.Response(200, json={"data": [{"id": "a"}]}))
    assert rig.send() == Unknown(reason="ambiguous response: 1 ids + 0 errors != 3 emails sent")


# -- pacing --------------------------------------------------------------------------------------

def test_ratelimit_remaining_zero_hold_counts_from_the_start_of_the_request_that_saw_it() -> None:
    # the window was counted when the request arrived: a response 0.4 s later holds the next start
    # until 1 s after that request started (1 / limit), not 1 s after the response (issue 16: at
    # 0.95 every window is full, and the latency was added to every one of them)
    headers = {"ratelimit-limit": "1", "ratelimit-remaining": "0", "ratelimit-reset": "3"}
    rig = Rig(httpx.Response(200, json=OK, headers=headers), httpx.Response(200, json=OK), rps=1.0)

    def slow(request: httpx.Request) -> httpx.Response:
        rig.clock.advance(0.4)
        return httpx.Response(200, json=OK, headers=headers)
    rig.script.steps[0] = slow
    assert isinstance(rig.send(), Accepted)
    assert isinstance(rig.send(), Accepted)
    # the next slot at the configured spacing (1 / (1 x 0.8) = 1.25 s) is later than the hold anyway;
    # at the full cap the hold alone decides: the start at 1.0 s, i.e. 0.6 s after the response
    assert rig.clock.sleeps == [0.0, pytest.approx(0.85)]
    pacer = LocalPacer(10, 1.0, clock=rig.clock)
    pacer.claim()
    t = rig.clock.monotonic()
    pacer.observe({"ratelimit-limit": "10", "ratelimit-remaining": "0", "ratelimit-reset": "1"}, since_start=0.06)
    assert pacer.claim() == pytest.approx(0.1)  # the spacing (100 ms) is later than the 40 ms left of the hold
    assert rig.clock.monotonic() == t


def test_ratelimit_remaining_zero_holds_the_local_pacer_one_slot_at_the_full_cap() -> None:
    # remaining 0 at a learned limit of 1/s: hold min(ratelimit-reset 3 s, 1 / limit) = 1 s
    headers = {"ratelimit-limit": "1", "ratelimit-remaining": "0", "ratelimit-reset": "3"}
    rig = Rig(httpx.Response(200, json=OK, headers=headers), httpx.Response(200, json=OK))
    assert isinstance(rig.send(), Accepted)
    assert isinstance(rig.send(), Accepted)
    assert rig.clock.sleeps == [0.0, 1.0]


def test_ratelimit_remaining_zero_does_not_wait_the_whole_reset_at_a_high_fraction() -> None:
    # At 0.95 of 10/s the window is full after every 10th request; a whole-second reset would halve the rate.
    clock = FakeClock()
    pacer = LocalPacer(10.0, 0.95, clock=clock)
    pacer.claim()
    pacer.observe({"ratelimit-limit": "10", "ratelimit-remaining": "0", "ratelimit-reset": "1"})
    assert pacer.claim() == pytest.approx(1 / 9.5)  # the spacing (105 ms) covers the 100 ms hold
    pacer.observe({"ratelimit-limit": "10", "ratelimit-remaining": "0", "ratelimit-reset": "garbage"})
    pacer.observe({"ratelimit-limit": "10", "ratelimit-remaining": "0", "ratelimit-reset": "120"})
    assert pacer.claim() == pytest.approx(2 / 9.5)  # unusable resets hold nothing


def test_a_429_lowers_the_local_rate_and_it_recovers() -> None:
    clock = FakeClock()
    pacer = LocalPacer(10.0, 1.0, clock=clock)
    assert pacer.claim() == 0.0
    pacer.push_back(1.0)
    pacer.push_back(1.0)  # the same burst (within 1 s): counted, not penalised twice
    assert pacer.rate_limited_total == 2
    assert pacer.penalty_now() == pytest.approx(0.1)
    assert pacer.claim() == 1.0
    assert pacer.spacing == pytest.approx(1 / 9.0)
    clock.t = 300.0  # half the recovery period later
    assert pacer.penalty_now() == pytest.approx(0.05)
    clock.t = 600.0
    assert pacer.penalty_now() == 0.0
    pacer.claim()
    assert pacer.spacing == pytest.approx(0.1)


def test_ratelimit_remaining_nonzero_keeps_the_normal_spacing() -> None:
    headers = {"ratelimit-limit": "10", "ratelimit-remaining": "4", "ratelimit-reset": "1"}
    rig = Rig(httpx.Response(200, json=OK, headers=headers), httpx.Response(200, json=OK), rps=10.0)
    rig.send()
    rig.send()
    assert rig.clock.sleeps == [0.0, 1 / (10.0 * 0.8)]


def test_a_lower_provider_limit_lowers_the_pacer_rate() -> None:
    rig = Rig(httpx.Response(200, json=OK, headers={"ratelimit-limit": "2", "ratelimit-remaining": "1"}),
              httpx.Response(200, json=OK), rps=10.0)
    rig.send()
    assert rig.pacer.requests_per_second == 2.0
    assert rig.pacer.spacing == 1 / (2.0 * 0.8)
    rig.send()
    # the slot after the first request was claimed with the old spacing
    assert rig.clock.sleeps == [0.0, 1 / (10.0 * 0.8)]
    assert rig.pacer.claim() == 1 / (2.0 * 0.8)  # the next slot uses the adopted spacing


def test_strict_validation_is_sent_as_the_header() -> None:
    clock = FakeClock()
    script = Script(httpx.Response(200, json=OK))
    client = ResendClient(BASE, "k", pacer=LocalPacer(10, clock=clock), clock=clock, validation="strict",
                          transport=httpx.MockTransport(script))
    assert isinstance(client.send_batch(BATCH, 100.0), Accepted)
    assert script.requests[0].headers["x-batch-validation"] == "strict"
    with pytest.raises(ValueError, match="'permissive' or 'strict'"):
        ResendClient(BASE, "k", pacer=LocalPacer(10, clock=clock), validation="lenient")


def test_a_reserved_slot_missed_by_more_than_the_tolerance_is_forfeited_for_the_next() -> None:
    # At 0.8 of 10/s the slack per 1 s window is 1/0.8 - 1 = 0.25 s; half of it (0.125 s) may be lost
    # between a slot and its request. A chunk prepared for longer than that takes a fresh slot.
    rig = Rig(httpx.Response(200, json=OK), httpx.Response(200, json=OK))
    assert rig.client.late_tolerance() == pytest.approx(0.125)
    slot = rig.client.reserve_slot(deadline=100.0)
    assert slot == 0.0
    rig.clock.advance(0.1)  # preparing the chunk took 100 ms: within the tolerance, sent at once
    assert isinstance(rig.client.send_batch(BATCH, 100.0, slot=slot), Accepted)
    assert rig.clock.sleeps == [0.0] and rig.client.stats["late_slots"] == 0
    slot = rig.client.reserve_slot(deadline=100.0)  # the next slot: 0.125
    assert slot == pytest.approx(0.125)
    rig.clock.advance(0.3)  # now 0.4: the slot passed 275 ms ago
    assert isinstance(rig.client.send_batch(BATCH, 100.0, slot=slot), Accepted)
    assert rig.client.stats["late_slots"] == 1
    assert rig.clock.sleeps == [0.0, 0.0]  # a fresh slot: the schedule's next one (0.25) is already past
    assert rig.pacer.claim() == pytest.approx(0.125)  # and the schedule moved on from it (0.4 + 0.125)


# -- provider headers are bounded -----------------------------------------------------------------

def test_skewed_http_date_retry_after_is_measured_against_the_response_date_header() -> None:
    # the provider's clock runs 10 min ahead of ours: "retry in 1 s" by its own Date, not 601 s by ours
    clock = FakeClock(start=0.0)
    theirs = clock.now() + timedelta(seconds=600)
    date, header = format_datetime(theirs, usegmt=True), format_datetime(theirs + timedelta(seconds=1), usegmt=True)
    assert parse_retry_after(header, clock, date) == 1.0
    assert parse_retry_after(header, clock, "not a date") == 601.0  # Date unusable: our clock is all there is
    assert parse_retry_after(header, clock) == 601.0

    rig = Rig(err(429, "rate_limit_exceeded", "slow down", **{"retry-after": header, "date": date}),
              httpx.Response(200, json=OK))
    out = rig.send(deadline=30.0)
    assert isinstance(out, Accepted)
    assert rig.clock.sleeps == [0.0, 1.0]  # one second, as the provider meant


@pytest.mark.parametrize("value,seconds", [
    ("1e300", None),                                  # not delta-seconds: garbage, backoff
    ("100000000", 366 * 86400.0),                     # valid and absurd (3 years): the ceiling; the cap decides
    ("9" * 400, 366 * 86400.0),                       # overflows a float: the ceiling, never inf
    ("Fri, 31 Dec 9999 23:59:59 GMT", 366 * 86400.0),  # an HTTP-date far away: the ceiling
    ("Sat, 01 Jan 10000 00:00:00 GMT", None),         # beyond datetime: garbage
    ("Thu, 01 Jan 1970 00:00:00 GMT", 0.0),           # in the past: now
    ("+5", None), ("5e1", None), ("0x10", None), ("1_0", None), ("infinity", None),
])
def test_retry_after_overflow_and_garbage_never_raise_and_stay_in_range(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, FakeClock(), "Thu, 01 Jan 2026 00:00:00 GMT") == seconds


@pytest.mark.parametrize("value", ["100000000", "9" * 400, "Fri, 31 Dec 9999 23:59:59 GMT"])
def test_absurd_retry_after_stops_the_run_with_an_alert_and_holds_others_only_the_cap(value: str) -> None:
    rig = Rig(err(429, "rate_limit_exceeded", "slow down", **{"retry-after": value}))
    out = rig.send()
    assert isinstance(out, NotSent) and out.stop_run == "rate limited" and out.fatal is True
    assert "above the 60 s cap" in out.reason
    assert rig.clock.sleeps == [0.0] and len(rig.requests) == 1
    assert rig.pacer.claim() == 60.0  # every other sender: frozen for the cap, not for years


def test_unparseable_retry_after_1e300_never_raises_and_backs_off() -> None:
    rig = Rig(err(429, "rate_limit_exceeded", "slow down", **{"retry-after": "1e300"}), httpx.Response(200, json=OK),
              rps=1000)
    out = rig.send()
    assert isinstance(out, Accepted)
    [b1] = backoffs(1)
    assert rig.clock.sleeps == [0.0, b1]


def test_shared_hold_is_never_pushed_back_past_the_cap() -> None:
    pacer = LocalPacer(10.0, clock=FakeClock())
    for seconds in (1e300, float("inf"), float("nan"), 100000000.0):
        pacer.push_back(seconds)
    assert pacer.claim() == 60.0
    assert LocalPacer(10.0, clock=FakeClock(), max_hold=5.0).max_hold == 5.0
    for cap in (0.0, -1.0, 121.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="cap on a shared rate-limit hold"):
            RetryPolicy(max_retry_after=cap)


def test_a_shared_hold_past_the_budget_is_never_slept_by_the_pipelined_sender() -> None:
    # another sender's 429 pushed the shared schedule back 60 s (the cap); this run has 30 s of budget
    rig = Rig(httpx.Response(200, json=OK))
    rig.pacer.push_back(60.0)
    out = rig.client.send_batch(BATCH, 30.0, claim_at_send=True)
    assert out == NotSent(reason="time budget reached before attempt 1: the next request slot starts 30.0 s after "
                                 "the deadline (no attempt made)", stop_run="time budget")
    assert rig.clock.sleeps == [] and rig.requests == []
    # a reserved slot that passed is claimed again under the same rule
    rig2 = Rig(httpx.Response(200, json=OK))
    slot = rig2.client.reserve_slot(deadline=30.0)
    rig2.clock.advance(1.0)
    rig2.pacer.push_back(60.0)
    out2 = rig2.client.send_batch(BATCH, 30.0, slot)
    assert isinstance(out2, NotSent) and out2.stop_run == "time budget"
    assert rig2.clock.sleeps == [] and rig2.requests == [] and rig2.client.stats["late_slots"] == 1


def test_rate_limit_retries_exhausted_stop_as_rate_limited() -> None:
    rig = Rig(*(err(429, "rate_limit_exceeded", "slow down", **{"retry-after": "1"}) for _ in range(3)),
              max_attempts=3)
    out = rig.send()
    assert out == NotSent(reason="gave up after 3 attempts: HTTP 429 rate_limit_exceeded: slow down",
                          stop_run="rate limited")
    assert len(rig.requests) == 3
