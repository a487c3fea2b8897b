"""The official ``resend`` SDK (PyPI) against the emulator: the emulator must speak what the SDK speaks.

The SDK reads ``RESEND_API_URL`` and ``RESEND_API_KEY`` once, at import (``resend/__init__.py``:
``api_url = os.environ.get("RESEND_API_URL", ...)``), and builds each URL from ``resend.api_url`` at
call time. So the SDK runs in a fresh subprocess whose environment points it at the emulator, which
also proves the variable is honoured. Batch options are ``{"idempotency_key", "batch_validation"}``
(``resend.Batch.SendOptions``), sent as ``Idempotency-Key`` and ``x-batch-validation``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from mailflow.emulator.testing import EmulatorProcess

SDK_SCRIPT = r'''
import json, os, resend
from resend.exceptions import ResendError

assert resend.api_url == os.environ["RESEND_API_URL"], resend.api_url
out = {}
single = resend.Emails.send({"from": "Shop <news@shop.example.com>", "to": "ann@example.com",
                             "subject": "Welcome", "html": "<p>Hi Ann</p>", "text": "Hi Ann",
                             "headers": {"X-Campaign": "welcome"}, "tags": [{"name": "campaign", "value": "welcome"}]})
out["single"] = {"id": single["id"], "ratelimit_limit": single["http_headers"].get("ratelimit-limit")}
batch = [{"from": "news@shop.example.com", "to": [addr], "subject": f"Batch {i}", "text": f"T{i}"}
         for i, addr in enumerate(["b0@example.com", "b1@example.com", "not an address", "b3@example.com"])]
options = {"idempotency_key": "sdk-batch-1", "batch_validation": "permissive"}
first = resend.Batch.send(batch, options)
again = resend.Batch.send(batch, options)
out["batch"] = {"data": first["data"], "errors": first["errors"]}
out["replay"] = {"data": again["data"], "errors": again["errors"]}
got = resend.Emails.get(single["id"])
out["get"] = {k: got.get(k) for k in ("object", "id", "to", "from", "subject", "html", "text", "last_event")}
listed = resend.Emails.list({"limit": 10})
out["list"] = {"object": listed["object"], "has_more": listed["has_more"],
               "ids": [e["id"] for e in listed["data"]]}
for name, call in [
    ("conflict", lambda: resend.Batch.send(batch[:1], options)),
    ("strict", lambda: resend.Batch.send(batch)),
    ("bad_key", lambda: (setattr(resend, "api_key", "re_wrong"), resend.Emails.get(single["id"]))),
]:
    try:
        call()
        out[name] = None
    except ResendError as exc:
        out[name] = {"code": int(exc.code), "type": exc.error_type, "class": type(exc).__name__,
                     "message": exc.message}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def sdk_run(tmp_path_factory: pytest.TempPathFactory):
    outbox = tmp_path_factory.mktemp("sdk") / "outbox.jsonl"
    with EmulatorProcess(outbox=outbox, rate_limit=100) as emu:
        env = {**os.environ, "RESEND_API_URL": emu.base_url, "RESEND_API_KEY": emu.api_key}
        proc = subprocess.run([sys.executable, "-c", SDK_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        yield json.loads(proc.stdout), emu.read_outbox(), emu.stats()


def test_single_send_and_get(sdk_run) -> None:
    out, outbox, _ = sdk_run
    sid = out["single"]["id"]
    assert out["single"]["ratelimit_limit"] == "100"
    assert outbox[0]["id"] == sid
    assert {k: outbox[0][k] for k in ("from", "to", "subject", "headers", "tags", "batch_index",
                                      "idempotency_key", "text_sha256", "html_sha256")} == {
        "from": "Shop <news@shop.example.com>", "to": ["ann@example.com"], "subject": "Welcome",
        "headers": {"X-Campaign": "welcome"}, "tags": [{"name": "campaign", "value": "welcome"}],
        "batch_index": None, "idempotency_key": None, "text_sha256": hashlib.sha256(b"Hi Ann").hexdigest(),
        "html_sha256": hashlib.sha256(b"<p>Hi Ann</p>").hexdigest()}
    assert out["get"] == {"object": "email", "id": sid, "to": ["ann@example.com"],
                          "from": "Shop <news@shop.example.com>", "subject": "Welcome", "html": "<p>Hi Ann</p>",
                          "text": "Hi Ann", "last_event": "delivered"}


def test_permissive_batch_with_idempotency_key(sdk_run) -> None:
    out, outbox, stats = sdk_run
    ids = [d["id"] for d in out["batch"]["data"]]
    assert out["batch"]["errors"] == [{"index": 2, "message": "Invalid `to` field. The email address needs to "
                                       "follow the `email@example.com` or `Name <email@example.com>` format."}]
    assert out["replay"] == out["batch"]  # same key, same bytes: the original response
    assert [(o["id"], o["to"], o["subject"], o["batch_index"], o["idempotency_key"]) for o in outbox[1:]] == [
        (ids[0], ["b0@example.com"], "Batch 0", 0, "sdk-batch-1"),
        (ids[1], ["b1@example.com"], "Batch 1", 1, "sdk-batch-1"),
        (ids[2], ["b3@example.com"], "Batch 3", 3, "sdk-batch-1"),
    ]
    assert len(outbox) == 4 and stats["accepted_emails"] == 4 and stats["replays"] == 1


def test_list_newest_first(sdk_run) -> None:
    out, outbox, _ = sdk_run
    assert out["list"] == {"object": "list", "has_more": False, "ids": [o["id"] for o in reversed(outbox)]}


def test_errors_as_the_sdk_sees_them(sdk_run) -> None:
    out, _, _ = sdk_run
    assert {k: out["conflict"][k] for k in ("code", "type")} == {"code": 409, "type": "invalid_idempotent_request"}
    assert out["strict"] == {"code": 422, "type": "validation_error", "class": "ValidationError",
                             "message": "Invalid `to` field. The email address needs to follow the "
                             "`email@example.com` or `Name <email@example.com>` format."}
    assert out["bad_key"] == {"code": 403, "type": "invalid_api_key", "class": "InvalidApiKeyError",
                              "message": "API key is invalid"}
