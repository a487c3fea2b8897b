"""``make airflow`` writes its three connections into the metadata database (Admin -> Connections),
brings its own up to date on a restart and keeps what a person edited there; it reports the DAGs'
real paused state. Runs the real ``airflow connections`` CLI on this session's Airflow home."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from mailflow_dev.airflow_local import airflow_cli, mailflow_connections, paused_summary, sync_connections

DSN = "host=127.0.0.1 port=5432 user=postgres dbname=mailflow_demo"
SECRET = "unsubscribe-secret-0123456789"


def _exported() -> dict[str, dict[str, Any]]:
    return json.loads(airflow_cli(os.environ, "connections", "export", "-", "--file-format", "json"))


@pytest.fixture
def clean_connections(airflow_db: Path) -> None:
    for conn_id in ("send_log_db", "resend_default", "mail_unsubscribe"):
        os.environ.pop(f"AIRFLOW_CONN_{conn_id.upper()}", None)
    if current := _exported():
        for conn_id in current:
            airflow_cli(os.environ, "connections", "delete", conn_id)


@pytest.mark.airflow
def test_connections_are_created_then_updated_unless_a_person_edited_them(
        clean_connections: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for conn_id in ("SEND_LOG_DB", "RESEND_DEFAULT", "MAIL_UNSUBSCRIBE"):
        monkeypatch.delenv(f"AIRFLOW_CONN_{conn_id}", raising=False)
    record = tmp_path / "connections.json"
    first = mailflow_connections(DSN, "http://127.0.0.1:18025", "re_demo_key_1", SECRET)
    assert sync_connections(os.environ, first, record) == {
        "send_log_db": "created", "resend_default": "created", "mail_unsubscribe": "created"}
    conns = _exported()
    assert (conns["send_log_db"]["conn_type"], conns["send_log_db"]["host"], conns["send_log_db"]["schema"]) == (
        "postgres", "127.0.0.1", "mailflow_demo")
    assert (conns["resend_default"]["host"], conns["resend_default"]["password"]) == (
        "http://127.0.0.1:18025", "re_demo_key_1")
    assert json.loads(conns["resend_default"]["extra"]) == {"requests_per_second": 10, "target_fraction": 0.8}
    assert conns["mail_unsubscribe"]["password"] == SECRET

    # a person fixes the send log's login in Admin -> Connections (same as the UI's save)
    edited = tmp_path / "edit.json"
    edited.write_text(json.dumps({"send_log_db": {**json.loads(first["AIRFLOW_CONN_SEND_LOG_DB"]),
                                                  "login": "mailflow_app"}}))
    airflow_cli(os.environ, "connections", "import", "--overwrite", str(edited))

    # the restart: the emulator came back on another port
    second = mailflow_connections(DSN, "http://127.0.0.1:28025", "re_demo_key_1", SECRET)
    assert sync_connections(os.environ, second, record) == {
        "send_log_db": "kept (edited in Airflow)", "resend_default": "updated", "mail_unsubscribe": "unchanged"}
    conns = _exported()
    assert conns["send_log_db"]["login"] == "mailflow_app"
    assert conns["resend_default"]["host"] == "http://127.0.0.1:28025"
    assert sync_connections(os.environ, second, record) == {
        "send_log_db": "kept (edited in Airflow)", "resend_default": "unchanged", "mail_unsubscribe": "unchanged"}
    assert oct(record.stat().st_mode & 0o777) == "0o600" and not list(tmp_path.glob("*.import.json"))


@pytest.mark.parametrize(("flags", "expected"), [
    ({"a": True, "b": True}, "DAGs paused: a, b (unpause one to send)"),
    ({"a": True, "c": False, "b": False},
     "DAGs paused: a (unpause one to send); unpaused (they run on their schedules): b, c"),
    ({"c": False}, "unpaused (they run on their schedules): c"),
])
def test_the_paused_state_is_reported_as_the_api_has_it(flags: dict[str, bool], expected: str) -> None:
    assert paused_summary([{"dag_id": k, "is_paused": v} for k, v in flags.items()]) == expected
