"""An approval approves a fingerprint, against PostgreSQL: what changed between the approval and the
provisioning (the definition replaced while the approval waits, a template's bytes, the recipients)
is refused with nothing provisioned and the campaign still a draft, naming the change; the CLI
provisions only an approved fingerprint or records the operator's own approval; the record says who
approved which fingerprint, when and how."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from mailflow.campaigns import CAMPAIGNS_DIR, CampaignFolder
from mailflow.cli import main as mailflow
from mailflow.sources.scheduled import provision
from mailflow.sources.scheduled.approval import (
    ApprovalRefused,
    Fingerprint,
    decide,
    open_request,
    usable_approval,
)
from mailflow.sources.scheduled.provisioning import current_fingerprint
from mailflow.sources.scheduled.spec import create_campaign, update_draft
from mailflow.store.migrate import migration_files
from mailflow.store.scheduled import ScheduledStore

NAME = "spring_outreach"
EARLY = datetime(2025, 12, 1, tzinfo=UTC)
SPEC: dict[str, Any] = {"name": NAME, "template": "outreach", "subject": "Hi {{ user.first_name }}",
                        "from": "Outreach <outreach@mail.example.com>", "recipients_table": "app.approval_shown",
                        "start_at": "2026-01-05T00:00:00+01:00", "timezone": "UTC", "emails_per_day": 1000,
                        "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-24:00"]}
PLAN_PATH = "provision_campaign/manual__1/plan"
APPROVE_PATH = "provision_campaign/manual__1/approve"


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> CampaignFolder:
    """A copy of the packaged campaigns (its templates may be edited), also the CLI's folder."""
    root = tmp_path / "campaigns"
    shutil.copytree(CAMPAIGNS_DIR, root)
    monkeypatch.setenv("MAILFLOW_CAMPAIGNS_DIR", str(root))
    return CampaignFolder(root)


@pytest.fixture
def pg(db: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """40 users; app.approval_shown lists users 1-5 (what the approver is shown), app.approval_other all 40."""
    db.execute("truncate mail.campaign_approval, mail.campaign_event, mail.campaign_recipient, mail.campaign"
               " restart identity cascade")
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, 40) as i")
    for table, n in (("approval_shown", 5), ("approval_other", 40)):
        db.execute(f"drop table if exists app.{table}")
        db.execute(f"create table app.{table} as select user_id, email, first_name from app.users where user_id <= {n}")
    yield db


def fingerprint_now(conn: psycopg.Connection, cid: int, folder: CampaignFolder) -> Fingerprint:
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(cid)
        assert c is not None
        return current_fingerprint(conn, c, folder)


def plan_request(conn: psycopg.Connection, cid: int, folder: CampaignFolder) -> tuple[int, Fingerprint]:
    """What provision_campaign's plan task records: the pending request of the fingerprint shown."""
    fp = fingerprint_now(conn, cid, folder)
    return open_request(conn, cid, fp, requested_by=PLAN_PATH, expires_at=None), fp


def approve(conn: psycopg.Connection, approval_id: int, name: str = "Ann") -> str:
    return decide(conn, approval_id, "approved", responded_by={"id": name.lower(), "name": name}, via=APPROVE_PATH)


def send_log_rows(conn: psycopg.Connection) -> int:
    row = conn.execute("select count(*) from mail.send_log").fetchone()
    assert row is not None
    return int(row[0])


def status(conn: psycopg.Connection) -> tuple[str, int]:
    row = conn.execute("select status, provisioned_count from mail.campaign").fetchone()
    assert row is not None
    return str(row[0]), int(row[1])


def events(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute("select from_status, to_status, detail->>'reason', actor, detail from mail.campaign_event"
                        " order by id").fetchall()


def last_event(conn: psycopg.Connection, reason: str) -> tuple[str | None, dict[str, Any]]:
    rows = [(e[3], e[4]) for e in events(conn) if e[2] == reason]
    assert rows, f"no {reason} event"
    return rows[-1]


# -- the faults --------------------------------------------------------------------------------------


def test_approval_binds_definition_replaced_while_approval_waits(pg: psycopg.Connection,
                                                                 folder: CampaignFolder) -> None:
    """The issue's scenario: while the approval waits, the draft is replaced (another recipients table,
    another subject); Approve then arrives. Nothing is provisioned; the refusal names the changes."""
    cid = create_campaign(pg, SPEC, actor="ed", folder=folder)
    approval_id, shown = plan_request(pg, cid, folder)
    assert shown.recipient_count == 5

    update_draft(pg, NAME, {**SPEC, "recipients_table": "app.approval_other", "subject": "Last chance, {{ "
                            "user.first_name }}"}, actor="mallory", folder=folder)
    assert approve(pg, approval_id) == "voided"  # the answer came too late: the request stays voided

    with pytest.raises(ApprovalRefused) as info:
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)

    assert send_log_rows(pg) == 0
    assert status(pg) == ("draft", 0)
    message = str(info.value)
    assert f"approval #{approval_id} was voided by mallory" in message
    assert info.value.changes == [
        'definition recipients_table: "app.approval_shown" -> "app.approval_other"',
        'definition subject: "Hi {{ user.first_name }}" -> "Last chance, {{ user.first_name }}"',
        "recipients: 35 added, 0 removed (5 approved, 40 now)"]
    reasons = [e[2] for e in events(pg)]
    assert reasons == [None, "approval_requested", "definition replaced", "approval_voided", "approval_approved",
                       "provision_refused"]
    actor, voided = last_event(pg, "approval_voided")
    assert (actor, voided["cause"], voided["approvals"]) == (
        "mallory", "definition replaced", [{"id": approval_id, "state": "pending", "fingerprint": shown.value}])
    _, answered = last_event(pg, "approval_approved")
    assert (answered["request_state"], answered["responded_by"]) == ("voided", {"id": "ann", "name": "Ann"})
    _, refused = last_event(pg, "provision_refused")
    assert (refused["approval_id"], refused["fingerprint_approved"]) == (approval_id, shown.value)
    assert pg.execute("select state, decided_by from mail.campaign_approval").fetchall() == [("voided", "mallory")]


def test_approval_binds_recipients_changed_after_approval(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    """No definition update (nothing voids the approval): the recipients table itself gains and loses
    users after Approve. Provisioning refuses, counting them."""
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, _ = plan_request(pg, cid, folder)
    assert approve(pg, approval_id) == "approved"
    pg.execute("insert into app.approval_shown select user_id, email, first_name from app.users"
               " where user_id between 6 and 8")
    pg.execute("delete from app.approval_shown where user_id = 2")

    with pytest.raises(ApprovalRefused) as info:
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)

    assert info.value.changes == ["recipients: 3 added, 1 removed (5 approved, 7 now)"]
    assert "what it would send differs from what was approved" in str(info.value)
    assert (send_log_rows(pg), status(pg)) == (0, ("draft", 0))


@pytest.mark.parametrize("path", ["templates/outreach.html.j2", "templates/outreach.txt.j2",
                                  "templates/_layout.html.j2"])
def test_approval_binds_template_bytes_changed_after_approval(pg: psycopg.Connection, folder: CampaignFolder,
                                                              path: str) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, _ = plan_request(pg, cid, folder)
    approve(pg, approval_id)
    with open(folder.root / path, "a", encoding="utf-8") as f:
        f.write("{# one more line nobody approved #}\n")

    with pytest.raises(ApprovalRefused) as info:
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)

    assert info.value.changes == [f"file {path} changed"]
    assert (send_log_rows(pg), status(pg)) == (0, ("draft", 0))


@pytest.mark.parametrize("answer", ["rejected", "expired"])
def test_a_rejected_or_expired_approval_provisions_nothing(pg: psycopg.Connection, folder: CampaignFolder,
                                                           answer: str) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, _ = plan_request(pg, cid, folder)
    decide(pg, approval_id, answer, responded_by=None if answer == "expired" else {"id": "bo", "name": "Bo"},
           via=APPROVE_PATH)
    with pytest.raises(ApprovalRefused, match=f"approval #{approval_id} (was rejected by Bo|expired unanswered)"):
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)
    assert (send_log_rows(pg), status(pg)) == (0, ("draft", 0))


def test_a_recipient_appearing_while_provisioning_gets_no_row(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    """The approval is checked in the first chunk; a user the approver was not shown who appears before
    a later chunk is refused there (the rows approved before it stay, nobody unapproved gets one)."""
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, _ = plan_request(pg, cid, folder)
    approve(pg, approval_id)

    def sneak_in(_summary: Any) -> None:
        pg.execute("insert into app.approval_shown select user_id, email, first_name from app.users where user_id = 39")

    with pytest.raises(ApprovalRefused, match="1 recipients appeared that approval #.* does not cover \\(users 39\\)"):
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id, chunk=2, after_chunk=sneak_in)

    # chunks of 2: users 1-2 and 3-4 were provisioned before user 39 appeared; the page of 5 and 39 was refused
    assert pg.execute("select user_id from mail.send_log order by user_id").fetchall() == [(1,), (2,), (3,), (4,)]
    assert status(pg) == ("scheduled", 4)


def test_an_approval_of_another_campaign_is_refused(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    other = create_campaign(pg, SPEC | {"name": "other_outreach"}, folder=folder)
    approval_id, _ = plan_request(pg, other, folder)
    approve(pg, approval_id)
    with pytest.raises(ApprovalRefused, match="is not an approval of this campaign"):
        provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)
    assert send_log_rows(pg) == 0


# -- the happy path and the record -------------------------------------------------------------------


def test_an_approved_fingerprint_provisions_and_the_record_says_who_approved_what(
        pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, fp = plan_request(pg, cid, folder)
    assert approve(pg, approval_id) == "approved"

    done = provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id, chunk=2)

    assert (done.created, done.chunks, done.complete, done.approval_id, done.fingerprint) == (
        5, 3, True, approval_id, fp.value)
    assert status(pg) == ("scheduled", 5)
    row = pg.execute("select state, how, fingerprint, recipient_count, recipient_ids, requested_by, decided_by,"
                     " decided_at is not null from mail.campaign_approval").fetchone()
    assert row == ("approved", "airflow_hitl", fp.value, 5, [1, 2, 3, 4, 5], PLAN_PATH, "Ann", True)
    actor, started = last_event(pg, "provisioning started")
    assert (started["approval_id"], started["fingerprint"]) == (approval_id, fp.value)
    actor, approved = last_event(pg, "approval_approved")
    assert actor == f"Ann via {APPROVE_PATH}"
    assert (approved["fingerprint"], approved["responded_by"], approved["how"]) == (
        fp.value, {"id": "ann", "name": "Ann"}, "airflow_hitl")
    # a retry of the same provisioning (the task's retries) passes the same check and adds nothing
    again = provision(pg, cid, now=EARLY, folder=folder, approval_id=approval_id)
    assert (again.created, again.complete) == (0, True)


def test_the_fingerprint_is_what_the_plan_computes_and_stable(pg: psycopg.Connection, folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    a, b = fingerprint_now(pg, cid, folder), fingerprint_now(pg, cid, folder)
    assert a.value == b.value and len(a.value) == 64
    assert sorted(a.files) == ["templates/_layout.html.j2", "templates/_layout.txt.j2", "templates/outreach.html.j2",
                               "templates/outreach.txt.j2"]
    assert (a.recipient_count, a.recipient_ids) == (5, (1, 2, 3, 4, 5))
    sql = create_campaign(pg, SPEC | {"name": "sql_outreach", "recipients_table": None,
                                      "recipients_sql": "free_plan_users"}, folder=folder)
    assert "recipients/free_plan_users.sql" in fingerprint_now(pg, sql, folder).files


# -- the CLI ---------------------------------------------------------------------------------------


def cli(db_dsn: str, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any, str]:
    rc = mailflow(["campaign", *argv, "--dsn", db_dsn])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if out.out else None), out.err


def test_cli_provision_without_an_approval_is_refused(pg: psycopg.Connection, folder: CampaignFolder, db_dsn: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    create_campaign(pg, SPEC, folder=folder)

    rc, out, err = cli(db_dsn, capsys, "provision", NAME, "--actor", "ops")

    assert (rc, out) == (2, None)
    assert err == (f"error: ApprovalRefused: campaign {NAME!r} has no approval on record: nothing provisioned; approve "
                   f"it in Airflow (provision_campaign) or record your approval with --approve-as NAME --reason TEXT\n")
    assert (send_log_rows(pg), status(pg)) == (0, ("draft", 0))
    actor, refused = last_event(pg, "provision_refused")
    assert actor == "ops" and refused["approval_id"] is None
    # half an approval is no approval
    rc, _, err = cli(db_dsn, capsys, "provision", NAME, "--approve-as", "ops")
    assert rc == 2 and "--approve-as NAME and --reason TEXT go together" in err
    assert send_log_rows(pg) == 0


def test_cli_provision_with_approve_as_records_the_operator_and_the_fingerprint(
        pg: psycopg.Connection, folder: CampaignFolder, db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    dry_rc, dry, _ = cli(db_dsn, capsys, "provision", NAME, "--dry-run")
    fp = fingerprint_now(pg, cid, folder)
    assert (dry_rc, dry["fingerprint"], dry["recipients"], send_log_rows(pg)) == (0, fp.value, 5, 0)

    rc, out, err = cli(db_dsn, capsys, "provision", NAME, "--approve-as", "Dana Ops", "--reason",
                       "spring plan signed off in the weekly review", "--actor", "dana")

    assert rc == 0, err
    assert (out["created"], out["fingerprint"], status(pg)) == (5, fp.value, ("scheduled", 5))
    actor, approved = last_event(pg, "approval_approved")
    assert actor == "dana"
    assert {k: approved[k] for k in ("approved_by", "approval_reason", "fingerprint", "how", "recipients")} == {
        "approved_by": "Dana Ops", "approval_reason": "spring plan signed off in the weekly review",
        "fingerprint": fp.value, "how": "cli", "recipients": 5}
    assert pg.execute("select state, how, decided_by, reason, fingerprint from mail.campaign_approval").fetchall() == [
        ("approved", "cli", "Dana Ops", "spring plan signed off in the weekly review", fp.value)]
    _, started = last_event(pg, "provisioning started")
    assert started["approval_id"] == approved["approval_id"]


def test_cli_provisions_an_approved_fingerprint_and_refuses_a_changed_one(
        pg: psycopg.Connection, folder: CampaignFolder, db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    approval_id, _ = plan_request(pg, cid, folder)
    approve(pg, approval_id)
    (folder.root / "templates" / "outreach.txt.j2").write_text("Hello, a text nobody approved\n")

    rc, _, err = cli(db_dsn, capsys, "provision", NAME)
    assert rc == 2 and "file templates/outreach.txt.j2 changed" in err
    assert (send_log_rows(pg), status(pg)) == (0, ("draft", 0))

    shutil.copy(CAMPAIGNS_DIR / "templates" / "outreach.txt.j2", folder.root / "templates" / "outreach.txt.j2")
    rc, out, err = cli(db_dsn, capsys, "provision", NAME)
    assert rc == 0, err
    assert (out["created"], out["approval_id"]) == (5, approval_id)


def test_cli_refuses_when_the_latest_answer_is_a_rejection(
        pg: psycopg.Connection, folder: CampaignFolder, db_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    first, _ = plan_request(pg, cid, folder)
    approve(pg, first)
    second, _ = plan_request(pg, cid, folder)
    decide(pg, second, "rejected", responded_by={"id": "bo", "name": "Bo"}, via=APPROVE_PATH)

    rc, _, err = cli(db_dsn, capsys, "provision", NAME)

    assert rc == 2 and f"its latest approval request #{second} was rejected by Bo" in err
    assert send_log_rows(pg) == 0


# -- the migration --------------------------------------------------------------------------------


def test_the_migration_backfills_earlier_answers_from_the_campaign_events(pg: psycopg.Connection,
                                                                            folder: CampaignFolder) -> None:
    cid = create_campaign(pg, SPEC, folder=folder)
    for reason, actor in (("approval_rejected", "bo via provision_campaign/r1/approve"),
                          ("provisioning started", "provision_campaign/r2/provision"),
                          ("provisioning started", None)):  # the CLI before approvals: no approval on record
        pg.execute("insert into mail.campaign_event (campaign_id, from_status, to_status, detail, actor)"
                   " values (%s, 'draft', 'draft', jsonb_build_object('reason', %s::text), %s)", (cid, reason, actor))
    [m0029] = [m for m in migration_files() if m.version == 29]
    pg.execute(m0029.sql)
    pg.execute(m0029.sql)  # idempotent
    rows = pg.execute("select state, how, fingerprint, decided_by from mail.campaign_approval order by id").fetchall()
    assert rows == [("rejected", "history", None, "bo via provision_campaign/r1/approve"),
                    ("approved", "history", None, "provision_campaign/r2/provision")]
    with pytest.raises(ApprovalRefused, match="recorded before approvals had fingerprints, so it approves nothing"):
        with pg.transaction():
            c = ScheduledStore(pg).campaign_by_id(cid)
            assert c is not None
            usable_approval(pg, c)
