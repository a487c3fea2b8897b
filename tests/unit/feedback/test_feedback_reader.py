"""The feedback poll's paced GET: one pacer slot per attempt, 429 pushes the shared schedule back,
bounded retries of 5xx and transport errors, 404 and 401 handling, the time budget (HTTP mocked
at the transport, LocalPacer on a FakeClock)."""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx
import pytest

from mailflow.feedback.deliverability import FeedbackError, PacedReader
from mailflow.model.clock import FakeClock
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import LocalPacer

PID = "4ef9a417-02e9-4d39-ad75-9611e0fcc33c"


class RecordingPacer(LocalPacer):
    def __init__(self, clock: FakeClock):
        super().__init__(10.0, target_fraction=1.0, clock=clock)
        self.claims = 0
        self.pushed: list[float] = []

    def claim(self) -> float:
        self.claims += 1
        return super().claim()

    def push_back(self, seconds: float) -> None:
        self.pushed.append(seconds)
        super().push_back(seconds)


def reader(*steps: httpx.Response | Exception | Callable[[httpx.Request], httpx.Response],
           max_attempts: int = 3) -> tuple[PacedReader, RecordingPacer, list[httpx.Request], FakeClock]:
    clock = FakeClock()
    pacer = RecordingPacer(clock)
    seen: list[httpx.Request] = []
    queue = list(steps)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        step = queue.pop(0)
        if isinstance(step, Exception):
            raise step
        if callable(step) and not isinstance(step, httpx.Response):
            return step(request)
        return step

    client = ResendClient("https://api.example.test", "re_secret", pacer=pacer, clock=clock,
                          policy=RetryPolicy(max_attempts=max_attempts, base=0.5, cap=2.0),
                          rng=random.Random(7), transport=httpx.MockTransport(handler), conn_id="resend_x")
    return PacedReader(client), pacer, seen, clock


def email(last_event: str, pid: str = PID) -> httpx.Response:
    return httpx.Response(200, json={"object": "email", "id": pid, "last_event": last_event, "to": ["a@example.com"]})


def test_one_slot_per_request_and_the_email_object_comes_back() -> None:
    r, pacer, seen, _ = reader(email("bounced"))
    answer = r.get_email(PID, deadline=100.0)
    assert (answer.kind, answer.body and answer.body["last_event"]) == ("ok", "bounced")
    assert (pacer.claims, r.requests, len(seen)) == (1, 1, 1)
    assert seen[0].method == "GET" and seen[0].url.path == f"/emails/{PID}"
    assert seen[0].headers["authorization"] == "Bearer re_secret"


def test_429_pushes_the_shared_schedule_back_and_retries_in_a_new_slot() -> None:
    limited = httpx.Response(429, headers={"retry-after": "2", "ratelimit-limit": "10"},
                             json={"name": "rate_limit_exceeded", "message": "Too many requests"})
    r, pacer, seen, clock = reader(limited, email("delivered"))
    answer = r.get_email(PID, deadline=100.0)
    assert answer.kind == "ok"
    assert pacer.pushed == [2.0]
    assert pacer.claims == 2 and len(seen) == 2
    assert clock.t >= 2.0  # the second request waited for the pushed-back slot
    assert r.client.stats["429"] == 1


def test_a_long_rate_limit_stops_the_run() -> None:
    limited = httpx.Response(429, headers={"retry-after": "600"}, json={"name": "rate_limit_exceeded"})
    r, pacer, _, _ = reader(limited)
    answer = r.get_email(PID, deadline=1000.0)
    assert answer.kind == "stop" and "rate limited" in answer.reason
    assert pacer.pushed == [600.0]  # every sender still learns about it


def test_5xx_and_transport_errors_are_retried_a_bounded_number_of_times() -> None:
    r, pacer, _, _ = reader(httpx.Response(500), httpx.ConnectError("refused"), email("delivered"))
    assert r.get_email(PID, deadline=100.0).kind == "ok"
    assert pacer.claims == 3
    r, pacer, _, _ = reader(httpx.Response(502), httpx.ReadTimeout("slow"), httpx.Response(503))
    answer = r.get_email(PID, deadline=100.0)
    assert answer.kind == "error" and "gave up after 3 attempts" in answer.reason
    assert pacer.claims == 3


def test_404_is_not_found_and_other_4xx_is_an_error_without_retry() -> None:
    r, pacer, _, _ = reader(httpx.Response(404, json={"name": "not_found"}))
    assert r.get_email(PID, deadline=100.0).kind == "not_found"
    r, pacer, _, _ = reader(httpx.Response(422, json={"name": "validation_error"}))
    assert r.get_email(PID, deadline=100.0).kind == "error"
    assert pacer.claims == 1


def test_401_raises_naming_the_connection_not_the_key() -> None:
    r, _, _, _ = reader(httpx.Response(401, json={"name": "missing_api_key"}))
    with pytest.raises(FeedbackError, match="resend_x") as err:
        r.get_email(PID, deadline=100.0)
    assert "re_secret" not in str(err.value)


def test_an_answer_about_another_email_or_not_json_is_an_error() -> None:
    r, _, _, _ = reader(email("bounced", pid="someone-else"))
    assert r.get_email(PID, deadline=100.0).kind == "error"
    r, _, _, _ = reader(httpx.Response(200, content=b"<html>"))
    assert r.get_email(PID, deadline=100.0).kind == "error"


def test_no_request_starts_at_or_after_the_deadline() -> None:
    r, pacer, seen, clock = reader(email("delivered"))
    clock.advance(50.0)
    answer = r.get_email(PID, deadline=50.0)
    assert (answer.kind, answer.reason, len(seen)) == ("stop", "time budget", 0)


@pytest.mark.parametrize("to,address,same", [
    (["user3@example.com"], "User3@Example.com", True),
    (["  Name <USER3@EXAMPLE.COM> "], "user3@example.com", True),
    ("user3@example.com", "user3@example.com", True),  # a bare string, though the spec says a list
    (["user4@example.com"], "user3@example.com", False),
    (["user3@example.com", "user4@example.com"], "user3@example.com", False),  # we send one recipient
    ([], "user3@example.com", False),
    (None, "user3@example.com", False),
    (["user3@example.co"], "user3@example.com", False),
])
def test_recipient_matches_normalised(to: object, address: str, same: bool) -> None:
    from mailflow.feedback.deliverability import recipient_matches

    assert recipient_matches(to, address) is same


def test_restricted_key_names_the_fix() -> None:
    r, _, _, _ = reader(httpx.Response(401, json={"statusCode": 401, "name": "restricted_api_key",
                                                  "message": "This API key is restricted to only send emails"}))
    with pytest.raises(FeedbackError, match="sending-only .*full-access key") as err:
        r.get_email(PID, 100.0)
    assert "re_secret" not in str(err.value)
