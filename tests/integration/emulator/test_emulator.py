"""The Resend emulator over real HTTP (a uvicorn subprocess per module), plus in-process clock tests.

Contract points: /work/shared/reference/resend-contract.md (batch modes, Idempotency-Key, rate limits,
quotas, error bodies) and resend-openapi.yaml (request/response shapes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import threading
import time
import uuid
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import pytest

from mailflow.emulator import EmulatorConfig, create_app
from mailflow.emulator.testing import EmulatorProcess

AUTH = {"Authorization": "Bearer re_test_emulator"}
ADDR_MSG = ("Invalid `to` field. The email address needs to follow the `email@example.com` or "
            "`Name <email@example.com>` format.")


def email(i: int, to: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"from": "Shop <news@shop.example.com>", "to": [to or f"user{i}@example.com"],
            "subject": f"Hello {i}", "html": f"<p>Hi {i}</p>", "text": f"Hi {i}", **extra}


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory):
    with EmulatorProcess(outbox=tmp_path_factory.mktemp("emu") / "outbox.jsonl", rate_limit=0, seed=7) as e:
        yield e


@pytest.fixture
def client(emu: EmulatorProcess):
    emu.reset()
    with httpx.Client(base_url=emu.base_url, headers=AUTH, timeout=5.0) as c:
        yield c


def post_raw(client: httpx.Client, path: str, body: bytes, timeout: float = 5.0, **headers: str) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json", **headers}, timeout=timeout)


def test_auth_and_health(client: httpx.Client, emu: EmulatorProcess) -> None:
    assert httpx.get(f"{emu.base_url}/health").status_code == 200
    r = httpx.post(f"{emu.base_url}/emails", json=email(0))
    assert r.status_code == 401
    assert r.json()["statusCode"] == 401 and r.json()["name"] == "missing_api_key"
    r = httpx.post(f"{emu.base_url}/emails", json=email(0), headers={"Authorization": "Bearer re_wrong"})
    assert r.status_code == 403
    assert r.json() == {"statusCode": 403, "name": "invalid_api_key", "message": "API key is invalid"}
    assert emu.read_outbox() == []


def test_single_send_and_get(client: httpx.Client, emu: EmulatorProcess) -> None:
    r = client.post("/emails", json=email(1, headers={"List-Unsubscribe": "<https://u.example.com/x>"}))
    assert r.status_code == 200
    (eid,) = r.json().values()
    assert list(r.json()) == ["id"] and uuid.UUID(eid)
    (line,) = emu.read_outbox()
    assert {k: v for k, v in line.items() if k != "received_at"} == {
        "id": eid, "from": "Shop <news@shop.example.com>", "to": ["user1@example.com"], "cc": [], "bcc": [],
        "reply_to": [], "subject": "Hello 1", "headers": {"List-Unsubscribe": "<https://u.example.com/x>"},
        "tags": [], "idempotency_key": None, "batch_index": None,
        "text_sha256": hashlib.sha256(b"Hi 1").hexdigest(), "html_sha256": hashlib.sha256(b"<p>Hi 1</p>").hexdigest(),
    }
    assert line["received_at"].endswith("Z")
    got = client.get(f"/emails/{eid}").json()
    assert (got["object"], got["id"], got["to"], got["from"], got["subject"], got["html"], got["text"],
            got["last_event"]) == ("email", eid, ["user1@example.com"], "Shop <news@shop.example.com>",
                                   "Hello 1", "<p>Hi 1</p>", "Hi 1", "delivered")


@pytest.mark.parametrize("bad, name, message", [
    ({"to": "not-an-address"}, "validation_error", ADDR_MSG),
    ({"to": None}, "missing_required_field", "Missing `to` field."),
    ({"from": "nobody"}, "validation_error", "Invalid `from` field. The email address needs to follow the "
     "`email@example.com` or `Name <email@example.com>` format."),
    ({"subject": ""}, "validation_error", "Invalid `subject` field. It must be a non-empty string."),
    ({"html": None, "text": None}, "validation_error", "Missing `html` or `text` field."),
    ({"to": [f"u{i}@example.com" for i in range(51)]}, "validation_error",
     "Too many recipients in `to`: the maximum is 50."),
])
def test_single_validation(client: httpx.Client, emu: EmulatorProcess, bad: dict, name: str, message: str) -> None:
    body = {k: v for k, v in {**email(0), **bad}.items() if v is not None}
    r = client.post("/emails", json=body)
    assert (r.status_code, r.json()) == (422, {"statusCode": 422, "name": name, "message": message})
    assert emu.read_outbox() == []


def test_batch_strict_rejects_everything(client: httpx.Client, emu: EmulatorProcess) -> None:
    batch = [email(0), email(1, to="broken@"), email(2)]
    r = client.post("/emails/batch", json=batch)
    assert r.status_code == 422
    assert r.json() == {"statusCode": 422, "name": "validation_error", "message": ADDR_MSG}  # no index: Resend documents none
    assert emu.read_outbox() == [] and emu.stats()["accepted_emails"] == 0


def test_batch_permissive_sends_the_valid_ones(client: httpx.Client, emu: EmulatorProcess) -> None:
    batch = [email(i, to="bad address@example.com" if i == 2 else None) for i in range(5)]
    r = client.post("/emails/batch", json=batch, headers={"x-batch-validation": "permissive"})
    assert r.status_code == 200
    ids = [d["id"] for d in r.json()["data"]]
    assert len(ids) == 4 and r.json()["errors"] == [{"index": 2, "message": ADDR_MSG}]
    out = emu.read_outbox()
    assert [o["to"] for o in out] == [["user0@example.com"], ["user1@example.com"], ["user3@example.com"],
                                      ["user4@example.com"]]
    assert [o["batch_index"] for o in out] == [0, 1, 3, 4]
    assert [o["id"] for o in out] == ids  # data lists accepted emails in request order


def test_strict_only_ignores_permissive(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(strict_only=True)
    r = client.post("/emails/batch", json=[email(0), email(1, to="x")], headers={"x-batch-validation": "permissive"})
    assert r.status_code == 422 and "emails[" not in r.json()["message"]
    assert emu.read_outbox() == []


@pytest.mark.parametrize("size", [0, 101])
def test_batch_size_limits(client: httpx.Client, emu: EmulatorProcess, size: int) -> None:
    r = client.post("/emails/batch", json=[email(i) for i in range(size)])
    assert r.status_code == 422
    assert r.json() == {"statusCode": 422, "name": "validation_error",
                        "message": f"The batch must contain between 1 and 100 emails, got {size}."}
    assert emu.read_outbox() == []


def test_batch_rejects_attachments_and_scheduled_at(client: httpx.Client, emu: EmulatorProcess) -> None:
    r = client.post("/emails/batch", json=[email(0, attachments=[{"filename": "a.txt", "content": "eA=="}])])
    assert r.json()["message"] == "`attachments` is not supported in batch emails."
    r = client.post("/emails/batch", json=[email(0), email(1, scheduled_at="2030-01-01T00:00:00Z")])
    assert r.json()["message"] == "`scheduled_at` is not supported in batch emails."
    assert emu.read_outbox() == []


def test_idempotent_replay_returns_the_original(client: httpx.Client, emu: EmulatorProcess) -> None:
    body = json.dumps([email(0), email(1)]).encode()
    first = post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "batch-42"})
    second = post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "batch-42"})
    assert first.status_code == second.status_code == 200
    assert second.content == first.content
    out = emu.read_outbox()
    assert [o["id"] for o in out] == [d["id"] for d in first.json()["data"]]
    assert {o["idempotency_key"] for o in out} == {"batch-42"}
    assert emu.stats()["replays"] == 1 and emu.stats()["accepted_emails"] == 2


def test_same_key_different_payload_conflicts(client: httpx.Client, emu: EmulatorProcess) -> None:
    assert client.post("/emails", json=email(0), headers={"Idempotency-Key": "k"}).status_code == 200
    for path, body in (("/emails", email(1)), ("/emails/batch", [email(0)])):
        r = client.post(path, json=body, headers={"Idempotency-Key": "k"})
        assert r.status_code == 409 and r.json()["name"] == "invalid_idempotent_request"
    assert len(emu.read_outbox()) == 1
    assert emu.stats()["conflicts"] == {"invalid_idempotent_request": 2}


def test_concurrent_same_key(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(latency_ms=400)
    body = json.dumps([email(0)]).encode()
    results: list[httpx.Response] = []

    def send() -> None:
        with httpx.Client(base_url=emu.base_url, headers=AUTH, timeout=5) as c:
            results.append(post_raw(c, "/emails/batch", body, **{"Idempotency-Key": "race"}))

    threads = [threading.Thread(target=send) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert sorted(r.status_code for r in results) == [200, 409]
    (conflict,) = [r for r in results if r.status_code == 409]
    assert conflict.json()["name"] == "concurrent_idempotent_requests"
    (ok,) = [r for r in results if r.status_code == 200]
    assert [o["id"] for o in emu.read_outbox()] == [ok.json()["data"][0]["id"]]
    assert post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "race"}).content == ok.content


@pytest.mark.parametrize("key, status", [("", 400), ("k" * 257, 400), ("k" * 256, 200), ("k", 200)])
def test_idempotency_key_length(client: httpx.Client, emu: EmulatorProcess, key: str, status: int) -> None:
    r = client.post("/emails", json=email(0), headers={"Idempotency-Key": key})
    assert r.status_code == status
    if status == 400:
        assert r.json()["name"] == "invalid_idempotency_key" and emu.read_outbox() == []


def test_rate_limit(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(rate_limit=10)
    responses = [client.post("/emails", json=email(i)) for i in range(15)]
    codes = [r.status_code for r in responses]
    assert codes == [200] * 10 + [429] * 5
    assert [r.headers["ratelimit-remaining"] for r in responses] == [str(9 - i) for i in range(10)] + ["0"] * 5
    for r in responses:
        assert r.headers["ratelimit-limit"] == "10" and int(r.headers["ratelimit-reset"]) in (0, 1)
    for r in responses[10:]:
        assert r.json()["name"] == "rate_limit_exceeded" and r.headers["retry-after"] == "1"
    assert len(emu.read_outbox()) == 10
    assert emu.stats()["rate_limited"] == {"rate_limit_exceeded": 5}
    time.sleep(1.05)
    assert client.get("/domains").status_code == 200


def test_quota(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(quota_emails=5)
    batch3 = [email(i) for i in range(3)]
    assert client.post("/emails/batch", json=batch3).status_code == 200
    r = client.post("/emails/batch", json=batch3)
    assert r.status_code == 429 and r.json()["name"] == "daily_quota_exceeded" and "retry-after" not in r.headers
    assert client.post("/emails", json=email(3)).status_code == 200
    assert client.post("/emails", json=email(4)).status_code == 200
    assert client.post("/emails", json=email(5)).status_code == 429
    assert len(emu.read_outbox()) == 5
    assert emu.stats()["rate_limited"] == {"daily_quota_exceeded": 2}


def test_error_rate_sends_nothing(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(error_rate=1.0)
    r = client.post("/emails/batch", json=[email(0)], headers={"Idempotency-Key": "e1"})
    assert r.status_code == 500 and r.json()["name"] == "internal_server_error"
    assert emu.read_outbox() == [] and emu.stats()["status_5xx"] == 1
    emu.configure(error_rate=0.0)  # nothing was recorded under the key: the retry is a first send
    assert client.post("/emails/batch", json=[email(0)], headers={"Idempotency-Key": "e1"}).status_code == 200
    assert len(emu.read_outbox()) == 1


def test_timeout_sends_nothing(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(timeout_rate=1.0, hang_seconds=1.0)
    with pytest.raises(httpx.TimeoutException):
        client.post("/emails", json=email(0), headers={"Idempotency-Key": "t1"}, timeout=0.3)
    emu.configure(timeout_rate=0.0)
    assert emu.read_outbox() == [] and emu.stats()["timeouts_injected"] == 1
    assert client.post("/emails", json=email(0), headers={"Idempotency-Key": "t1"}).status_code == 200


@pytest.mark.parametrize("mode", ["abort", "hang"])
def test_reset_after_accept(client: httpx.Client, emu: EmulatorProcess, mode: str) -> None:
    emu.configure(reset_after_accept_rate=1.0, reset_mode=mode, hang_seconds=1.5)
    body = json.dumps([email(i) for i in range(3)]).encode()
    with pytest.raises(httpx.TransportError):  # abort: RemoteProtocolError; hang: ReadTimeout
        post_raw(client, "/emails/batch", body, timeout=0.5, **{"Idempotency-Key": "lost-1"})
    out = emu.read_outbox()
    assert [o["batch_index"] for o in out] == [0, 1, 2] and emu.stats()["resets_after_accept"] == 1
    emu.configure(reset_after_accept_rate=0.0)
    retry = post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "lost-1"})
    assert retry.status_code == 200
    assert [d["id"] for d in retry.json()["data"]] == [o["id"] for o in out]
    assert emu.read_outbox() == out and emu.stats()["replays"] == 1


def test_last_event_and_not_found(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(bounce=["Bounce@Example.com"], complain=["spam@example.com"])
    to = ["bounce@example.com", "spam@example.com", "fine@example.com", "bounced@resend.dev"]
    data = client.post("/emails/batch", json=[email(i, to=a) for i, a in enumerate(to)]).json()["data"]
    events = [client.get(f"/emails/{d['id']}").json()["last_event"] for d in data]
    assert events == ["bounced", "complained", "delivered", "bounced"]
    r = client.get(f"/emails/{uuid.uuid4()}")
    assert (r.status_code, r.json()["name"]) == (404, "not_found")


def test_list_newest_first_with_cursor(client: httpx.Client, emu: EmulatorProcess) -> None:
    ids = [client.post("/emails", json=email(i)).json()["id"] for i in range(3)]
    page = client.get("/emails", params={"limit": 2}).json()
    assert (page["object"], page["has_more"], [e["id"] for e in page["data"]]) == ("list", True, ids[:0:-1])
    rest = client.get("/emails", params={"limit": 2, "after": ids[1]}).json()
    assert (rest["has_more"], [e["id"] for e in rest["data"]]) == (False, [ids[0]])
    assert client.get("/emails", params={"limit": 101}).status_code == 422


def test_scramble_order_breaks_request_order(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(scramble_order=True)
    data = client.post("/emails/batch", json=[email(i) for i in range(20)]).json()["data"]
    by_index = [o["id"] for o in emu.read_outbox()]
    assert sorted(d["id"] for d in data) == sorted(by_index) and [d["id"] for d in data] != by_index


def test_domains_and_control_errors(client: httpx.Client, emu: EmulatorProcess) -> None:
    r = client.get("/domains")
    assert r.status_code == 200 and [d["name"] for d in r.json()["data"]] == ["mailflow.example"]
    assert httpx.post(f"{emu.base_url}/_emulator/config", json={"nope": 1}).status_code == 400
    assert httpx.post(f"{emu.base_url}/_emulator/config", json={"error_rate": 2}).status_code == 400
    r = client.delete("/emails")
    assert (r.status_code, r.json()["name"]) == (405, "method_not_allowed")


def test_batch_of_100_is_fast(client: httpx.Client, emu: EmulatorProcess) -> None:
    timings = []
    for k in range(10):
        body = json.dumps([email(i, to=f"r{k}-{i}@example.com") for i in range(100)]).encode()
        t0 = time.perf_counter()
        assert post_raw(client, "/emails/batch", body).status_code == 200
        timings.append(time.perf_counter() - t0)
    assert statistics.median(timings) < 0.05, timings
    assert len(emu.read_outbox()) == 1000


# -- in process, with an injected clock ---------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def run_in_process(config: EmulatorConfig, calls: Any) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=create_app(config))
        async with httpx.AsyncClient(transport=transport, base_url="http://emu", headers=AUTH) as c:
            return await calls(c)
    return asyncio.run(main())


def test_idempotency_expires_after_24h(tmp_path) -> None:
    clock = FakeClock()

    async def calls(c: httpx.AsyncClient) -> list[str]:
        ids = []
        for advance in (0, 86399, 2):  # t0, t0+23:59:59 (replay), t0+24:00:01 (expired: sent again)
            clock.t += advance
            ids.append((await c.post("/emails", json=email(0), headers={"Idempotency-Key": "d"})).json()["id"])
        return ids

    ids = run_in_process(EmulatorConfig(outbox=str(tmp_path / "o.jsonl"), clock=clock), calls)
    assert ids[0] == ids[1] != ids[2]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("style", ["seconds", "fraction", "http-date"])
def test_retry_after_styles(style: str) -> None:
    clock = FakeClock()

    async def calls(c: httpx.AsyncClient) -> list[httpx.Response]:
        out = [await c.get("/domains")]
        clock.t += 0.25
        out.append(await c.get("/domains"))
        clock.t += 0.8  # the first request left the window
        out.append(await c.get("/domains"))
        return out

    ok, limited, later = run_in_process(EmulatorConfig(rate_limit=1, retry_after_style=style, clock=clock), calls)
    assert (ok.status_code, limited.status_code, later.status_code) == (200, 429, 200)
    value = limited.headers["retry-after"]
    if style == "seconds":
        assert value == "1"
    elif style == "fraction":
        assert value == "0.750"
    else:
        assert parsedate_to_datetime(value).timestamp() == 1_800_000_001  # t0 + 0.25 + ceil(0.75), whole s


def test_startup_appends_to_an_existing_outbox(tmp_path) -> None:
    outbox = tmp_path / "o.jsonl"
    outbox.write_text('{"id": "from-an-earlier-run"}\n')

    async def calls(c: httpx.AsyncClient) -> int:
        return (await c.post("/emails", json=email(0))).status_code

    assert run_in_process(EmulatorConfig(outbox=str(outbox)), calls) == 200
    lines = [json.loads(line) for line in outbox.read_text().splitlines()]
    assert len(lines) == 2 and lines[0] == {"id": "from-an-earlier-run"} and lines[1]["to"] == ["user0@example.com"]


def test_absurd_nesting_and_oversized_bodies_are_client_errors(client) -> None:
    deep = client.post("/emails/batch", content=b"[" * 100_000, headers={"Content-Type": "application/json"})
    assert (deep.status_code, deep.json()["name"]) == (422, "validation_error")
    big = client.post("/emails", content=b" " * (40 * 1024 * 1024 + 1), headers={"Content-Type": "application/json"})
    assert big.status_code == 413
    assert big.json()["message"] == f"The request body is {40 * 1024 * 1024 + 1} bytes; the limit is {40 * 1024 * 1024} bytes."


def test_idempotency_memory_survives_a_restart_with_a_store(tmp_path) -> None:
    # Issue 17: a demo interrupted after the provider accepted a batch resends it to a NEW emulator;
    # with the store the resend is recognised (same ids, nothing delivered twice), a different body
    # under the key is still a conflict, and an expired record is not loaded.
    clock = FakeClock()
    store, outbox = tmp_path / "idem.jsonl", tmp_path / "o.jsonl"
    cfg = EmulatorConfig(outbox=str(outbox), idempotency_store=str(store), clock=clock)

    async def first(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/emails/batch", json=[email(0), email(1)], headers={"Idempotency-Key": "b-1"}),
                await c.post("/emails", json=email(2), headers={"Idempotency-Key": "old"})]

    async def after_restart(c: httpx.AsyncClient) -> list[httpx.Response]:
        return [await c.post("/emails/batch", json=[email(0), email(1)], headers={"Idempotency-Key": "b-1"}),
                await c.post("/emails/batch", json=[email(0)], headers={"Idempotency-Key": "b-1"}),
                await c.post("/emails", json=email(2), headers={"Idempotency-Key": "old"})]

    sent, old = run_in_process(cfg, first)
    assert b"re_test_emulator" not in store.read_bytes()  # the API key is kept hashed
    # make "old" older than the 24 h TTL, as if the emulator had been down for a day
    lines = [json.loads(x) for x in store.read_text().splitlines()[:2]]
    lines[1]["at"] -= 86401
    store.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"torn line')
    replay, conflict, resent = run_in_process(cfg, after_restart)
    assert (replay.status_code, replay.content) == (200, sent.content)
    assert (conflict.status_code, conflict.json()["name"]) == (409, "invalid_idempotent_request")
    assert resent.status_code == 200 and resent.json()["id"] != old.json()["id"]
    # outbox: 2 + 1 from the first life, 1 (the expired key sent again) from the second
    assert [json.loads(x)["idempotency_key"] for x in outbox.read_text().splitlines()] == ["b-1", "b-1", "old", "old"]
    # the journal was compacted at start-up (expired and torn lines dropped) and holds b-1 and the new "old"
    assert [json.loads(x)["idem"] for x in store.read_text().splitlines()] == ["b-1", "old"]


# -- the real provider's faults (issue 12) -------------------------------------------------------

@pytest.mark.parametrize("status", [500, 502, 504])
def test_5xx_after_processing_records_the_batch_and_a_retry_replays_it(client: httpx.Client, emu: EmulatorProcess,
                                                                        status: int) -> None:
    emu.configure(error_after_rate=1.0, error_after_status=status)
    body = json.dumps([email(i) for i in range(3)]).encode()
    r = post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "edge-1", "x-batch-validation": "permissive"})
    assert r.status_code == status and r.json()["statusCode"] == status
    out = emu.read_outbox()
    assert [o["batch_index"] for o in out] == [0, 1, 2]  # processed although the answer is a 5xx
    assert emu.stats()["errors_after_accept"] == 1
    emu.configure(error_after_rate=0.0)
    retry = post_raw(client, "/emails/batch", body, **{"Idempotency-Key": "edge-1", "x-batch-validation": "permissive"})
    assert retry.status_code == 200 and [d["id"] for d in retry.json()["data"]] == [o["id"] for o in out]
    assert emu.read_outbox() == out


def test_outage_answers_503_and_processes_nothing(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(outage=True)
    r = client.post("/emails/batch", json=[email(0)], headers={"Idempotency-Key": "o1"})
    assert (r.status_code, r.json()["name"]) == (503, "service_unavailable")
    assert emu.read_outbox() == []
    emu.configure(outage=False)
    assert client.post("/emails/batch", json=[email(0)], headers={"Idempotency-Key": "o1"}).status_code == 200


def test_rate_limit_is_shared_by_every_api_key_of_the_team(tmp_path) -> None:
    clock = FakeClock()

    async def calls(c: httpx.AsyncClient) -> list[int]:
        codes = []
        for key in ("re_a", "re_b", "re_a", "re_b"):
            codes.append((await c.post("/emails", json=email(0), headers={"Authorization": f"Bearer {key}"})).status_code)
        return codes

    codes = run_in_process(EmulatorConfig(outbox=str(tmp_path / "p.jsonl"), api_keys=("re_a", "re_b"), rate_limit=2,
                                          clock=clock), calls)
    assert codes == [200, 200, 429, 429]  # 2 requests/s for the team, whichever key sends


def test_daily_quota_starts_again_at_the_next_utc_day(tmp_path) -> None:
    clock = FakeClock()

    async def calls(c: httpx.AsyncClient) -> list[tuple[int, str]]:
        out = []
        for advance in (0, 0, 86400):
            clock.t += advance
            r = await c.post("/emails/batch", json=[email(0), email(1)])
            out.append((r.status_code, r.json().get("name", "")))
        return out

    got = run_in_process(EmulatorConfig(outbox=str(tmp_path / "q.jsonl"), quota_emails=3, rate_limit=0, clock=clock),
                         calls)
    assert got == [(200, ""), (429, "daily_quota_exceeded"), (200, "")]


def test_last_event_suppressed_and_failed(client: httpx.Client, emu: EmulatorProcess) -> None:
    emu.configure(suppress=["Gone@Example.com"], fail=["broken@example.com"])
    to = ["gone@example.com", "broken@example.com", "fine@example.com"]
    data = client.post("/emails/batch", json=[email(i, to=a) for i, a in enumerate(to)]).json()["data"]
    events = [client.get(f"/emails/{d['id']}").json()["last_event"] for d in data]
    assert events == ["suppressed", "failed", "delivered"]
