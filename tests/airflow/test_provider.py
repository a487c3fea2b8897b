"""The `resend` connection type is registered through the package's provider info and the hook
follows the Airflow provider shape (lazy connection, test_connection, form metadata)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mailflow.provider.hook import ResendHook

AIRFLOW = str(Path(sys.executable).parent / "airflow")


def run_airflow(*args: str) -> str:
    res = subprocess.run([AIRFLOW, *args], capture_output=True, text=True, env=os.environ.copy(), timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


def test_providers_list_shows_the_package() -> None:
    out = run_airflow("providers", "list", "-o", "json")
    rows = {r["package_name"]: r for r in json.loads(out[out.index("["):])}
    assert rows["mailflow"]["version"] == "0.1.0"


def test_connections_add_with_conn_type_resend(airflow_db: Path) -> None:
    run_airflow("connections", "add", "resend_cli_check", "--conn-type", "resend",
                "--conn-host", "http://127.0.0.1:9", "--conn-password", "re_cli_secret",
                "--conn-extra", '{"requests_per_second": 5}')
    out = run_airflow("connections", "get", "resend_cli_check", "-o", "json")
    conn = json.loads(out[out.index("["):])[0]
    assert (conn["conn_type"], conn["host"]) == ("resend", "http://127.0.0.1:9")
    assert {k: str(v) for k, v in conn["extra_dejson"].items()} == {"requests_per_second": "5"}
    run_airflow("connections", "delete", "resend_cli_check")


def test_hook_meta_labels_the_password_as_api_key() -> None:
    from airflow.api_fastapi.core_api.services.ui.connections import HookMetaService

    meta = {m.connection_type: m for m in HookMetaService.hook_meta_data()}["resend"]
    fields = meta.standard_fields
    assert meta.hook_class_name == "mailflow.provider.hook.ResendHook"
    assert (fields.password.title, fields.password.hidden) == ("API key", False)
    assert (fields.host.title, fields.host.placeholder) == ("API base URL", "https://api.resend.com")
    assert fields.login.hidden is True and fields.port.hidden is True
    assert set(meta.extra_fields) == {"requests_per_second", "target_fraction", "batch_validation",
                                      "timeout_seconds", "connect_timeout_seconds", "pacer_conn_id",
                                      "max_retry_after_seconds"}


def test_hook_shape() -> None:
    assert (ResendHook.conn_name_attr, ResendHook.default_conn_name, ResendHook.conn_type) == (
        "resend_conn_id", "resend_default", "resend")
    hook = ResendHook()  # resolving the connection is lazy: nothing looked up yet
    assert hook._client is None


@pytest.fixture
def resend_conn(monkeypatch: pytest.MonkeyPatch, emulator) -> str:
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_TEST", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": "re_test_emulator",
        "extra": {"requests_per_second": 4, "target_fraction": 0.5, "batch_validation": "strict"}}))
    return "resend_test"


def test_settings_and_test_connection_ok(resend_conn: str, emulator) -> None:
    hook = ResendHook(resend_conn)
    s = hook.settings()
    assert s == {"base_url": emulator.base_url, "requests_per_second": 4.0, "target_fraction": 0.5,
                 "batch_validation": "strict", "timeout_seconds": 30.0, "connect_timeout_seconds": 5.0,
                 "pacer_conn_id": "send_log_db", "max_retry_after_seconds": 60.0}
    ok, message = hook.test_connection()
    assert ok is True
    assert message == (f"API key accepted by {emulator.base_url} with full access: every DAG can use connection "
                       "'resend_test' (domains: mailflow.example)")
    assert "re_test_emulator" not in message
    # the probe is a POST /emails/batch that can never send (an empty batch), then GET /domains
    stats = emulator.stats()
    assert stats["accepted_emails"] == 0 and stats["outbox_lines"] == 0
    assert stats["responses_by_status"] == {"422": 1, "200": 1}


def test_test_connection_bad_key(monkeypatch: pytest.MonkeyPatch, emulator) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_BAD", json.dumps(
        {"conn_type": "resend", "host": emulator.base_url, "password": "re_wrong"}))
    ok, message = ResendHook("resend_bad").test_connection()
    assert ok is False
    assert message.startswith("the provider does not know the API key of connection 'resend_bad' "
                              "(HTTP 403 invalid_api_key: API key is invalid)")
    assert "re_wrong" not in message


def test_test_connection_tells_a_sending_only_key_from_an_invalid_one(monkeypatch: pytest.MonkeyPatch,
                                                                        emulator) -> None:
    """Resend's recommended sending-only key is valid: ok, and the message says what it cannot do."""
    emulator.configure(restricted_keys=["re_sending_only"])
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_SEND", json.dumps(
        {"conn_type": "resend", "host": emulator.base_url, "password": "re_sending_only"}))
    ok, message = ResendHook("resend_send").test_connection()
    assert ok is True
    assert message == (f"API key accepted by {emulator.base_url} for sending only (GET /domains: 401 "
                       "restricted_api_key): lifecycle_emails, dispatch_scheduled_emails and reconcile_send_log "
                       "work; deliverability_feedback reads emails and needs a full-access key (set "
                       "MAILFLOW_FEEDBACK_CONN_ID to a connection that holds one)")
    stats = emulator.stats()
    assert stats["accepted_emails"] == 0 and stats["errors_by_name"] == {"validation_error": 1,
                                                                         "restricted_api_key": 1}
    # the same key once revoked (the emulator no longer knows it): invalid, with the fix
    emulator.configure(restricted_keys=[])
    ok, message = ResendHook("resend_send").test_connection()
    assert ok is False and "does not know the API key of connection 'resend_send'" in message


def test_missing_api_key_names_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_NOKEY", json.dumps({"conn_type": "resend", "host": "http://x"}))
    with pytest.raises(ValueError, match="connection 'resend_nokey' has no API key"):
        ResendHook("resend_nokey").settings()


def test_previous_api_keys_give_one_client_per_key_identity(monkeypatch: pytest.MonkeyPatch, emulator) -> None:
    """Key rotation: the connection's previous_api_keys are usable for resends (one client per key
    identity, sharing the current client's pacer); identities never reveal a key."""
    from mailflow.provider.client import key_identity

    monkeypatch.setenv("AIRFLOW_CONN_RESEND_ROT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": "re_new_key",
        "extra": {"previous_api_keys": ["re_test_emulator", "re_new_key", "re_older"]}}))
    hook = ResendHook("resend_rot")
    current, previous = hook.key_identities()
    assert current == key_identity("re_new_key")
    assert previous == [key_identity("re_test_emulator"), key_identity("re_older")]  # current dropped
    assert current.startswith("key#") and len(current.rsplit("#", 1)[1]) == 16
    assert all("re_" not in i.rsplit("#", 1)[1] for i in [current, *previous])
    client = hook.get_conn(pacer=object())  # type: ignore[arg-type]
    factories = hook.previous_clients()
    assert list(factories) == previous
    old = factories[key_identity("re_test_emulator")]()
    assert old is factories[key_identity("re_test_emulator")]()  # built once
    assert old.key_identity == key_identity("re_test_emulator") and old.pacer is client.pacer
    assert old.http.headers["Authorization"] == "Bearer re_test_emulator"
    hook.close()
    assert old.http.is_closed and client.http.is_closed
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_ROT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": "re_new_key",
        "extra": {"previous_api_keys": "re_a, re_b"}}))
    assert ResendHook("resend_rot").previous_api_keys() == ["re_a", "re_b"]


@pytest.mark.parametrize(("name", "value", "allowed"), [
    ("max_retry_after_seconds", 0, "(0, 120]"),
    ("max_retry_after_seconds", "abc", "(0, 120]"),
    ("max_retry_after_seconds", 500, "(0, 120]"),
    ("requests_per_second", 0, "(0, inf)"),
    ("requests_per_second", "ten", "(0, inf)"),
    ("target_fraction", 1.5, "(0, 1]"),
    ("target_fraction", 0, "(0, 1]"),
    ("timeout_seconds", -1, "(0, inf)"),
    ("connect_timeout_seconds", "nan", "(0, inf)"),
])
def test_invalid_numeric_extra_is_refused_naming_connection_extra_and_range(
        monkeypatch: pytest.MonkeyPatch, name: str, value: object, allowed: str) -> None:
    """An explicit 0 is not "the default", a word is not a number, and an out-of-range value names
    where it came from: each raises before any sender starts."""
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_EXTRA", json.dumps(
        {"conn_type": "resend", "host": "http://x", "password": "re_k", "extra": {name: value}}))
    with pytest.raises(ValueError) as exc:
        ResendHook("resend_extra").settings()
    assert str(exc.value) == (f"connection 'resend_extra': extra {name!r} must be a number in {allowed}, "
                              f"got {value!r}")


def test_valid_numeric_extras_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_OK", json.dumps(
        {"conn_type": "resend", "host": "http://x", "password": "re_k",
         "extra": {"max_retry_after_seconds": "120", "requests_per_second": 2.5, "target_fraction": 1,
                   "timeout_seconds": "", "connect_timeout_seconds": None}}))
    s = ResendHook("resend_ok").settings()
    assert (s["max_retry_after_seconds"], s["requests_per_second"], s["target_fraction"], s["timeout_seconds"],
            s["connect_timeout_seconds"]) == (120.0, 2.5, 1.0, 30.0, 5.0)
