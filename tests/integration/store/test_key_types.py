"""Key types and domain checks over HTTP (issue 13): the emulator models Resend's sending-only keys
(401 restricted_api_key on anything but sending) and its 403 validation_error for an unverified
``from`` domain or a test-only account; the client maps each 401/403 to its own message with the fix.
All three faults are off by default."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx
import pytest

from mailflow.emulator.testing import EmulatorProcess
from mailflow.model.outcome import Accepted, NotSent
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import LocalPacer
from mailflow_dev.loadgen import synthetic_batches

FULL = "re_test_emulator"
SENDING = "re_sending_only"


def api(emu: EmulatorProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=emu.base_url, headers={"Authorization": f"Bearer {key}"}, timeout=5.0)


def mail(frm: str = "Team <team@mailflow.example>", to: str = "user1@example.com") -> dict[str, Any]:
    return {"from": frm, "to": [to], "subject": "Hi", "text": "Hello"}


def client(emu: EmulatorProcess, key: str = FULL) -> ResendClient:
    return ResendClient(emu.base_url, key, pacer=LocalPacer(1000, 1.0), policy=RetryPolicy(max_attempts=3, base=0.01,
                        cap=0.02), rng=random.Random(1), timeout=httpx.Timeout(5.0), conn_id="resend_prod")


def test_faults_are_off_by_default(emulator: EmulatorProcess) -> None:
    cfg = emulator.configure()
    assert (cfg["restricted_keys"], cfg["check_from_domain"], cfg["test_only"]) == ([], False, False)
    with api(emulator, FULL) as http:
        assert http.post("/emails", json=mail(frm="x@elsewhere.org", to="anyone@example.org")).status_code == 200
        assert http.get("/domains").status_code == 200
    with api(emulator, SENDING) as http:  # not a key of the account unless configured
        assert http.post("/emails", json=mail()).json()["name"] == "invalid_api_key"


def test_a_sending_only_key_sends_but_reads_nothing(emulator: EmulatorProcess) -> None:
    emulator.configure(restricted_keys=[SENDING])
    with api(emulator, SENDING) as http:
        sent = http.post("/emails/batch", json=[mail(), mail(to="user2@example.com")])
        assert sent.status_code == 200 and len(sent.json()["data"]) == 2
        one = http.post("/emails", json=mail(to="user3@example.com"))
        assert one.status_code == 200
        for path in ("/emails", f"/emails/{one.json()['id']}", "/domains"):
            r = http.get(path)
            assert (r.status_code, r.json()) == (401, {"statusCode": 401, "name": "restricted_api_key",
                                                       "message": "This API key is restricted to only send emails"})
    with api(emulator, FULL) as http:  # the full-access key of the same account reads them
        assert http.get(f"/emails/{one.json()['id']}").json()["to"] == ["user3@example.com"]
    assert len(emulator.read_outbox()) == 3


def test_an_unverified_from_domain_is_403_validation_error_and_sends_nothing(emulator: EmulatorProcess) -> None:
    emulator.configure(check_from_domain=True)
    with api(emulator, FULL) as http:
        r = http.post("/emails/batch", json=[mail(), mail(frm="Team <team@gmail.com>")],
                      headers={"x-batch-validation": "permissive"})
        assert (r.status_code, r.json()) == (403, {
            "statusCode": 403, "name": "validation_error",
            "message": "The gmail.com domain is not verified. Please, add and verify your domain on "
                       "https://resend.com/domains"})
        assert http.post("/emails", json=mail(frm="news@send.mailflow.example")).status_code == 200  # a subdomain
        assert http.post("/emails", json=mail()).status_code == 200
    assert len(emulator.read_outbox()) == 2


def test_a_test_only_account_writes_to_its_owner_only(emulator: EmulatorProcess) -> None:
    emulator.configure(test_only=True, owner_email="owner@mailflow.example")
    with api(emulator, FULL) as http:
        r = http.post("/emails", json=mail(to="user1@example.com"))
        assert r.status_code == 403 and r.json()["name"] == "validation_error"
        assert r.json()["message"].startswith("You can only send testing emails to your own email address "
                                              "(owner@mailflow.example).")
        assert http.post("/emails", json=mail(to="Owner <OWNER@mailflow.example>")).status_code == 200
    assert len(emulator.read_outbox()) == 1


@pytest.mark.parametrize("setup,key,kind,fix", [
    ({"check_from_domain": True}, FULL, "domain not verified",
     "Verify the domain (resend.com/domains), or change the campaign's from address to a verified domain"),
    ({"test_only": True}, FULL, "test-only account", "Verify a sending domain (resend.com/domains)"),
    ({}, "re_revoked", "invalid API key", "Put a current key in the connection's password"),
])
def test_the_client_names_each_refusal_and_its_fix(emulator: EmulatorProcess, setup: dict[str, Any], key: str,
                                                   kind: str, fix: str) -> None:
    emulator.configure(**setup)
    batch = next(synthetic_batches(3, first_id=1, batch_size=3))  # from bench@mail.example.com
    with client(emulator, key) as c:
        out = c.send_batch(batch, time.monotonic() + 30)
    assert isinstance(out, NotSent) and out.fatal and out.stop_run == kind
    assert "connection 'resend_prod'" in out.reason and fix in out.reason
    assert "provider refused the API key" not in out.reason
    assert c.stats["requests"] == 1 and emulator.read_outbox() == []


def test_a_sending_only_key_is_enough_for_the_send_path(emulator: EmulatorProcess) -> None:
    emulator.configure(restricted_keys=[SENDING])
    with client(emulator, SENDING) as c:
        out = c.send_batch(next(synthetic_batches(3, first_id=1, batch_size=3)), time.monotonic() + 30)
    assert isinstance(out, Accepted) and len(emulator.read_outbox()) == 3
