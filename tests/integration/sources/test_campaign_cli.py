"""``mailflow campaign ...`` against the test database: campaigns by name (or id), JSON on stdout,
``error: ...`` and exit 2 on stderr for a campaign that does not exist."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mailflow.cli import main as mailflow
from mailflow.sources import scheduled

SPEC = """
name = "NAME"
template = "outreach"
subject = "{{ user.first_name }}, new practice packs"
from = "Practice Team <practice@mail.example.com>"
timezone = "UTC"
emails_per_day = 1000
weekdays = [1, 2, 3, 4, 5, 6, 7]
windows = ["00:00-23:59"]
start_at = "2026-01-05T00:00:00+00:00"
recipients_sql = "free_plan_users"
"""


def _users(db: psycopg.Connection, n: int) -> None:
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, %s::bigint) as i", (n,))


def _json(capsys: pytest.CaptureFixture[str], argv: list[str], rc: int = 0) -> Any:
    assert mailflow(argv) == rc, capsys.readouterr()
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def name() -> str:
    """A campaign name of this test's own (the db fixture keeps mail.campaign between tests)."""
    return f"cli_{uuid.uuid4().hex[:10]}"


@pytest.fixture
def spec_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(SPEC.replace("NAME", name))
    return path


def test_a_campaign_by_name_from_create_to_cancel(db: psycopg.Connection, db_dsn: str, spec_file: Path, name: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _users(db, 3)
    dsn = ["--dsn", db_dsn]
    created = _json(capsys, ["campaign", "create", str(spec_file), "--actor", "ops", *dsn])
    assert (created["name"], created["status"], created["subject"]) == (
        name, "draft", "{{ user.first_name }}, new practice packs")
    plan = _json(capsys, ["campaign", "provision", name, "--dry-run", *dsn])
    assert (plan["dry_run"], plan["recipients"], plan["created"]) == (True, 3, 0)
    assert db.execute("select count(*) from mail.send_log where campaign = %s", (name,)).fetchone() == (0,)
    done = _json(capsys, ["--dsn", db_dsn, "campaign", "provision", name, "--chunk", "2", "--approve-as", "Ops Lead",
                          "--reason", "the spring plan"])
    assert (done["created"], done["chunks"], done["complete"]) == (3, 2, True)
    rows = _json(capsys, ["campaign", "status", name, *dsn])["rows"]
    assert (rows["pending"], rows["sent"], rows["cancelled"]) == (3, 0, 0)
    assert _json(capsys, ["campaign", "pause", name, *dsn])["status"] == "paused"
    assert _json(capsys, ["campaign", "status", str(created["id"]), *dsn])["status"] == "paused"  # an id works too
    assert _json(capsys, ["campaign", "resume", name, *dsn])["status"] == "scheduled"
    _json(capsys, ["campaign", "cancel", name, *dsn])
    status = _json(capsys, ["campaign", "status", name, *dsn])
    assert (status["status"], status["rows"]["cancelled"], status["rows"]["pending"]) == ("cancelled", 3, 0)
    actors = db.execute("select distinct actor from mail.campaign_event e join mail.campaign c on c.id = e.campaign_id"
                        " where c.name = %s and e.from_status is null", (name,)).fetchall()
    assert actors == [("ops",)]


def test_create_from_options_and_an_option_overrides_the_spec(db: psycopg.Connection, db_dsn: str, name: str,
                                                              spec_file: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MAILFLOW_DSN", db_dsn)
    made = _json(capsys, ["campaign", "create", "--name", f"{name}_f", "--template", "outreach", "--subject", "Hi",
                          "--from", "news@mail.example.com", "--recipients-sql", "free_plan_users",
                          "--emails-per-day", "7", "--weekdays", "1,3", "--window", "10:00-11:00",
                          "--window", "15:00-16:00", "--transactional", "--on-policy", "skip"])
    assert {k: made[k] for k in ("name", "status", "emails_per_day", "weekdays", "windows", "marketing",
                                 "on_policy", "from_address")} == {
        "name": f"{name}_f", "status": "draft", "emails_per_day": 7, "weekdays": [1, 3],
        "windows": ["10:00-11:00", "15:00-16:00"], "marketing": False, "on_policy": "skip",
        "from_address": "news@mail.example.com"}
    other = _json(capsys, ["campaign", "create", str(spec_file), "--name", f"{name}_o", "--emails-per-day", "5"])
    assert (other["name"], other["emails_per_day"], other["timezone"]) == (f"{name}_o", 5, "UTC")


def test_create_without_a_spec_or_a_name_is_refused(db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert mailflow(["campaign", "create", "--dsn", db_dsn]) == 2
    assert "error: ValueError: create needs a SPEC file or --name" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["status", "x"], ["pause", "x"], ["resume", "x"], ["cancel", "x"],
                                  ["provision", "x"], ["provision", "x", "--dry-run"], ["complete", "x"]])
def test_a_name_that_does_not_exist_exits_2_naming_it(db: psycopg.Connection, db_dsn: str, argv: list[str],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    before = db.execute("select count(*), max(updated_at) from mail.campaign").fetchone()
    assert mailflow(["campaign", *argv, "--dsn", db_dsn]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err == "error: LookupError: no campaign named 'x'\n"
    assert db.execute("select count(*), max(updated_at) from mail.campaign").fetchone() == before


def test_all_is_not_a_name_and_complete_all_means_every_campaign(db: psycopg.Connection, db_dsn: str,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert mailflow(["campaign", "pause", "all", "--dsn", db_dsn]) == 2
    assert "'all' is not a campaign name (it means every campaign)" in capsys.readouterr().err
    everything = _json(capsys, ["campaign", "complete", "all", "--dsn", db_dsn])
    assert isinstance(everything["completed"], list)
    assert _json(capsys, ["campaign", "complete", "--dsn", db_dsn]) == {"completed": []}  # all: none left


def test_without_a_dsn_the_command_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("MAILFLOW_DSN", raising=False)
    with pytest.raises(SystemExit) as exc:
        mailflow(["campaign", "status", "x"])
    assert exc.value.code == 2
    assert "--dsn or MAILFLOW_DSN is required" in capsys.readouterr().err


def test_the_deprecated_module_runs_the_same_commands(db: psycopg.Connection, db_dsn: str, spec_file: Path, name: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert scheduled.main(["--dsn", db_dsn, "--actor", "old", "create", str(spec_file)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "draft"
    assert scheduled.main(["--dsn", db_dsn, "status", name]) == 0
    assert json.loads(capsys.readouterr().out)["name"] == name
    assert scheduled.main(["--dsn", db_dsn, "status", "x"]) == 2
    assert capsys.readouterr().err == "error: LookupError: no campaign named 'x'\n"


def test_update_replaces_a_drafts_definition_and_refuses_a_provisioned_one(
        db: psycopg.Connection, db_dsn: str, spec_file: Path, name: str, capsys: pytest.CaptureFixture[str]) -> None:
    _users(db, 2)
    dsn = ["--dsn", db_dsn]
    _json(capsys, ["campaign", "create", str(spec_file), *dsn])
    spec_file.write_text(SPEC.replace("NAME", name).replace("emails_per_day = 1000", "emails_per_day = 40"))
    updated = _json(capsys, ["campaign", "update", str(spec_file), "--actor", "ed", *dsn])
    assert (updated["name"], updated["status"], updated["emails_per_day"]) == (name, "draft", 40)
    _json(capsys, ["campaign", "provision", name, "--approve-as", "ed", "--reason", "test", *dsn])
    assert mailflow(["campaign", "update", str(spec_file), *dsn]) == 2
    assert "only a draft's definition can be replaced" in capsys.readouterr().err
