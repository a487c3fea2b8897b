"""The campaign DAGs driven from the Airflow UI, through `dag.test()` on a real PostgreSQL send log
(the emulator as the provider): campaign_create from its generated form, provision_campaign by
name with its plan, test email and approval (answered as the UI's Required Actions would, by
writing the response to the metadata DB from another thread while `dag.test()` waits), and
campaign_control; and run conf strictness for every mailflow DAG."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT, UNSUBSCRIBE_SECRET
from hitl_rig import run_with_answer

from mailflow.emulator.testing import EmulatorProcess
from mailflow.sources import scheduled
from mailflow.sources.scheduled.definition import CampaignDefinition
from mailflow_dev import devenv

DAGS = ROOT / "dags"
NAME = "ui_outreach"


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture
def campaign_db(db: psycopg.Connection) -> Iterator[psycopg.Connection]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    yield db


@pytest.fixture
def conns(monkeypatch: pytest.MonkeyPatch, db_dsn: str, emulator: EmulatorProcess) -> EmulatorProcess:
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", json.dumps({"conn_type": "generic",
                                                                    "password": UNSUBSCRIBE_SECRET}))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
        "extra": {"requests_per_second": 50}}))
    return emulator


def _users(db: psycopg.Connection, n: int) -> None:
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'ui' || i || '@example.com', 'N' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, %s) as i", (n,))


def _create(db: psycopg.Connection, n: int = 12, **spec: Any) -> int:
    _users(db, n)
    return scheduled.create_campaign(db, {
        "name": NAME, "template": "outreach", "subject": "Hello {{ user.first_name }}",
        "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
        "start_at": datetime(2031, 3, 3, 9, 0, tzinfo=UTC), "timezone": "Europe/Berlin", "emails_per_day": 5,
        **spec})


def _ti(dr: Any, task_id: str) -> Any:
    return dr.get_task_instance(task_id)


def _events(db: psycopg.Connection) -> list[tuple[Any, ...]]:
    return db.execute("select from_status, to_status, detail->>'reason' from mail.campaign_event order by id").fetchall()


# -- the forms ------------------------------------------------------------------------------------


def test_the_new_dags_import_and_follow_the_house_rules(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    for dag_id in ("campaign_create", "provision_campaign", "campaign_control"):
        dag = dagbag.dags[dag_id]
        assert dag.timetable.can_be_scheduled is False and dag.catchup is False
        assert dag.max_active_runs == (16 if dag_id == "provision_campaign" else 1)
        assert {"email", "scheduled", "mailflow"} <= set(dag.tags) and dag_id in dag.doc_md
        for task in dag.tasks:
            assert task.retries >= 1 and task.owner == "data-eng" and task.execution_timeout is not None, task
    assert [t.task_id for t in dagbag.dags["provision_campaign"].topological_sort()] == [
        "plan", "send_test_email", "approve", "provision"]


def test_campaign_create_params_are_generated_from_the_definition_model(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    params = dagbag.dags["campaign_create"].params
    model = CampaignDefinition.model_json_schema(by_alias=True)["properties"]
    assert list(params.keys()) == [*model, "update"]
    assert "from" in params and "from_address" not in params
    per_day = params.get_param("emails_per_day")
    assert (per_day.value, per_day.schema["type"], per_day.schema["minimum"], per_day.schema["maximum"]) == (
        20, "integer", 1, 1_000_000)
    assert (per_day.description, per_day.schema["title"]) == ("Emails sent on each sending day.", "Emails Per Day")
    assert params.get_param("on_policy").schema["enum"] == ["defer", "skip", "ignore"]
    assert params.get_param("weekdays").value == [1, 2, 3, 4, 5]  # a default_factory's value
    assert params.get_param("windows").value == ["09:00-12:00", "14:00-17:00"]
    assert params.get_param("reply_to").schema["type"] == ["string", "null"]
    assert params.get_param("start_at").schema["format"] == "date-time"
    assert params.get_param("holdout_share").schema["exclusiveMaximum"] == 1
    with pytest.raises(ParamValidationError):
        params.get_param("name").resolve()  # required: no default
    with pytest.raises(ParamValidationError):
        params.get_param("name").resolve("Bad Name")  # the model's pattern
    with pytest.raises(ParamValidationError):
        per_day.resolve(0)
    assert params.get_param("update").value is False


def test_provision_and_control_take_a_campaign_name(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    for dag_id in ("provision_campaign", "campaign_control"):
        param = dagbag.dags[dag_id].params.get_param("campaign")
        assert param.schema["type"] == "string"
        with pytest.raises(ParamValidationError):
            param.resolve()
    prov = dagbag.dags["provision_campaign"].params
    assert "campaign_id" not in prov
    assert prov.dump() | {"campaign": None} == {"campaign": None, "dry_run": False, "chunk_size": 5000,
                                                "test_email_to": None, "approval_timeout_hours": 72.0}
    assert dagbag.dags["campaign_control"].params.get_param("action").schema["enum"] == [
        "pause", "resume", "cancel", "complete", "status"]


# -- campaign_create ------------------------------------------------------------------------------

CREATE_CONF = {"name": NAME, "template": "outreach", "subject": "Hello {{ user.first_name }}",
               "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
               "timezone": "UTC", "emails_per_day": 7, "weekdays": [1, 2, 3, 4, 5, 6, 7],
               "windows": ["00:00-24:00"], "start_at": "2031-03-03T09:00:00+00:00"}


@pytest.mark.airflow
def test_campaign_create_creates_a_draft_from_params(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    dr = dagbag.dags["campaign_create"].test(run_conf=CREATE_CONF)

    assert dr.state == "success"
    row = campaign_db.execute("select name, status, timezone, emails_per_day, weekdays, windows, start_at,"
                              " from_address, recipients_sql from mail.campaign").fetchall()
    assert row == [(NAME, "draft", "UTC", 7, [1, 2, 3, 4, 5, 6, 7], ["00:00-24:00"],
                    datetime(2031, 3, 3, 9, 0, tzinfo=UTC), "Outreach <outreach@mail.example.com>",
                    "free_plan_users")]
    out = _ti(dr, "create").xcom_pull(task_ids="create")
    assert (out["name"], out["status"]) == (NAME, "draft")
    [(actor,)] = campaign_db.execute("select actor from mail.campaign_event").fetchall()
    assert actor.startswith("dag_test via campaign_create/")


@pytest.mark.airflow
def test_campaign_create_with_update_replaces_a_drafts_definition(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    assert dagbag.dags["campaign_create"].test(run_conf=CREATE_CONF).state == "success"
    dr = dagbag.dags["campaign_create"].test(run_conf={**CREATE_CONF, "emails_per_day": 9, "holidays": "DE",
                                                       "update": True})
    assert dr.state == "success"
    assert campaign_db.execute("select status, emails_per_day, holidays from mail.campaign").fetchall() == [
        ("draft", 9, "DE")]
    events = campaign_db.execute("select from_status, to_status, detail->>'reason' from mail.campaign_event"
                                 " order by id").fetchall()
    assert events == [(None, "draft", None), ("draft", "draft", "definition replaced")]


@pytest.mark.airflow
@pytest.mark.parametrize(("bad", "field"), [
    ({"timezone": "Europe/Berln"}, "timezone"),
    ({"from": "not an address"}, "from"),
    ({"windows": ["17:00-09:00"]}, "windows"),
    ({"recipients_table": "mail.campaign_recipient"}, "recipients_table"),  # two recipient sources
])
def test_refused_input_names_the_field_writes_nothing_and_is_not_retried(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
    bad: dict[str, Any], field: str,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.campaign_tasks import create_task

    dag = dagbag.dags["campaign_create"]
    dr = dag.test(run_conf={**CREATE_CONF, **bad})

    assert dr.state == "failed"
    ti = _ti(dr, "create")
    assert (ti.state, ti.try_number, ti.max_tries) == ("failed", 1, 1)  # retries=1 exists, but was not used
    assert campaign_db.execute("select count(*) from mail.campaign").fetchone() == (0,)
    assert campaign_db.execute("select count(*) from mail.campaign_event").fetchone() == (0,)
    # the message names the field
    params = {**dag.params.dump(), **CREATE_CONF, **bad}
    with pytest.raises(AirflowFailException, match=f"{field}"):
        create_task({"params": params, "dag": dag, "dag_run": None, "ti": None})


@pytest.mark.airflow
def test_an_unknown_conf_key_is_refused_before_anything_is_written(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.run_conf import check_run_conf

    dag = dagbag.dags["campaign_create"]
    dr = dag.test(run_conf={**CREATE_CONF, "emails_per_dya": 5})
    assert dr.state == "failed" and _ti(dr, "create").try_number == 1
    assert campaign_db.execute("select count(*) from mail.campaign").fetchone() == (0,)
    with pytest.raises(AirflowFailException, match=r"'emails_per_dya' \(did you mean 'emails_per_day'\?\)"):
        check_run_conf({"dag": dag, "dag_run": type("R", (), {"conf": {"emails_per_dya": 5}})()})


# -- provision_campaign ---------------------------------------------------------------------------


@pytest.mark.airflow
def test_provision_by_name_with_a_test_email_and_approval(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    cid = _create(campaign_db, 12)
    campaign_db.execute("insert into mail.suppression (user_id, scope, source) values (3, 'all', 'test')")

    dr, answered = run_with_answer(dagbag.dags["provision_campaign"],
                                    {"campaign": NAME, "test_email_to": "approver@example.com", "chunk_size": 5},
                                    "Approve")

    assert dr.state == "success"
    assert {t.task_id: t.state for t in dr.get_task_instances()} == {
        "plan": "success", "send_test_email": "success", "approve": "success", "provision": "success"}
    plan = _ti(dr, "plan").xcom_pull(task_ids="plan")
    assert (plan["campaign_id"], plan["status"]) == (cid, "draft")
    p = plan["plan"]
    assert (p["recipients"], p["emails_per_day"], p["days_spanned"], p["windows"], p["weekdays"]) == (
        12, 5, 3, ["09:00-12:00", "14:00-17:00"], [1, 2, 3, 4, 5])
    assert p["first_send_local"].startswith("2031-03-03 10:00 CET")
    hb = plan["holdback"]
    assert (hb["checked"], hb["suppressed"], hb["cooldown"], hb["capped"], hb["held"]) == (12, 1, 0, 0, 1)
    assert plan["sample"]["user_id"] == 1 and plan["sample"]["subject"] == "Hello N1"
    assert plan["sample"]["text"].startswith("Hi N1,")
    assert "/u/<user 1's token>" in plan["sample"]["text"] and "/u/k1." not in plan["sample"]["text"]
    # the approver saw the plan, the hold-back, the sample and the test email
    assert answered.subject == f"Provision campaign {NAME}?"
    assert answered.body is not None
    for text in ("**Recipients to provision:** 12", "1 of 12 recipients would be held back: 1 suppressed",
                 "subject: Hello N1", "**Test email** sent to a***@example.com"):
        assert text in answered.body, text
    # one test email, recorded as an event, not a send-log row
    outbox = conns.read_outbox()
    assert len(outbox) == 1
    assert outbox[0]["to"] == ["approver@example.com"] and outbox[0]["subject"] == "[TEST] Hello N1"
    assert {"name": "test", "value": "true"} in outbox[0]["tags"]
    test = _ti(dr, "send_test_email").xcom_pull(task_ids="send_test_email")
    [(detail,)] = campaign_db.execute("select detail from mail.campaign_event where detail->>'reason' = 'test_email'"
                                      ).fetchall()
    assert detail["provider_id"] == test["provider_id"] == outbox[0]["id"]
    # provisioned: 12 rows, the campaign scheduled
    assert campaign_db.execute("select status, count(*) from mail.send_log group by status").fetchall() == [
        ("pending", 12)]
    assert campaign_db.execute("select status from mail.campaign").fetchone() == ("scheduled",)
    summary = _ti(dr, "provision").xcom_pull(task_ids="provision")
    assert (summary["created"], summary["chunks"], summary["complete"]) == (12, 3, True)
    # the test email is shown with the provisioning, with whatever outcome its webhooks recorded by then
    [shown] = summary["test_emails"]
    assert (shown["provider_id"], shown["status"], shown["to"]) == (test["provider_id"], "sent", "a***@example.com")
    assert shown["campaign_event_id"] is not None and shown["outcome"] is None  # no webhooks in this emulator
    # what was approved: the fingerprint the approver was shown, by whom
    approval = plan["approval"]
    assert f"**Fingerprint of what you approve:** `{approval['fingerprint']}`" in answered.body
    assert (summary["approval_id"], summary["fingerprint"]) == (approval["id"], approval["fingerprint"])
    assert campaign_db.execute("select state, how, fingerprint, recipient_count, decided_by from mail.campaign_approval"
                               ).fetchall() == [("approved", "airflow_hitl", approval["fingerprint"], 12, "approver")]
    [(actor, detail)] = campaign_db.execute("select actor, detail from mail.campaign_event"
                                            " where detail->>'reason' = 'approval_approved'").fetchall()
    assert actor.startswith("approver via provision_campaign/")
    assert (detail["responded_by"], detail["fingerprint"]) == ({"id": "approver", "name": "approver"},
                                                               approval["fingerprint"])


@pytest.mark.airflow
def test_approval_binds_definition_replaced_while_the_approval_waits(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    """While the approval waits in Required Actions, the draft gets another recipients table and
    another subject; then the approver (who saw 5 recipients and the old subject) clicks Approve.
    Nothing is provisioned, the run fails naming the change, and the campaign stays a draft."""
    _users(campaign_db, 40)
    campaign_db.execute("drop table if exists app.ui_shown")
    campaign_db.execute("create table app.ui_shown as select user_id, email, first_name from app.users"
                        " where user_id <= 5")
    shown = {"name": NAME, "template": "outreach", "subject": "Hello {{ user.first_name }}",
             "from": "Outreach <outreach@mail.example.com>", "recipients_table": "app.ui_shown",
             "start_at": datetime(2031, 3, 3, 9, 0, tzinfo=UTC), "timezone": "Europe/Berlin", "emails_per_day": 5}
    scheduled.create_campaign(campaign_db, shown)

    def replace_the_draft() -> None:
        with psycopg.connect(campaign_db.info.dsn, autocommit=True) as conn:
            scheduled.update_draft(conn, NAME, {**shown, "recipients_table": None, "recipients_sql": "free_plan_users",
                                                "subject": "Last chance, {{ user.first_name }}"}, actor="mallory")

    dr, answered = run_with_answer(dagbag.dags["provision_campaign"], {"campaign": NAME}, "Approve",
                                    before_answer=replace_the_draft)

    assert answered.body is not None and "**Recipients to provision:** 5" in answered.body
    assert dr.state == "failed"
    assert {t.task_id: t.state for t in dr.get_task_instances()} == {
        "plan": "success", "send_test_email": "success", "approve": "success", "provision": "failed"}
    assert _ti(dr, "provision").try_number == 1  # refused, not retried
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert campaign_db.execute("select status, provisioned_count from mail.campaign").fetchone() == ("draft", 0)
    assert [m for m in conns.read_outbox() if m["to"][0].startswith("ui")] == []
    [(detail,)] = campaign_db.execute("select detail from mail.campaign_event"
                                      " where detail->>'reason' = 'provision_refused'").fetchall()
    assert detail["changes"] == [
        'definition recipients_sql: null -> "free_plan_users"',
        'definition recipients_table: "app.ui_shown" -> null',
        'definition subject: "Hello {{ user.first_name }}" -> "Last chance, {{ user.first_name }}"',
        "file recipients/free_plan_users.sql added",
        "recipients: 35 added, 0 removed (5 approved, 40 now)"]
    assert "voided by mallory" in detail["message"]


@pytest.mark.airflow
def test_a_rejected_approval_leaves_a_draft_with_nothing_scheduled(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    _create(campaign_db, 6)

    dr, _ = run_with_answer(dagbag.dags["provision_campaign"], {"campaign": NAME}, "Reject")

    assert {t.task_id: t.state for t in dr.get_task_instances()} == {
        "plan": "success", "send_test_email": "success", "approve": "success", "provision": "skipped"}
    assert campaign_db.execute("select status, provisioned_count from mail.campaign").fetchone() == ("draft", 0)
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert [m for m in conns.read_outbox() if m["to"][0].startswith("ui")] == []  # no recipient was emailed
    assert _events(campaign_db)[-1] == ("draft", "draft", "approval_rejected")
    [(actor,)] = campaign_db.execute("select actor from mail.campaign_event where detail->>'reason' = "
                                     "'approval_rejected'").fetchall()
    assert actor.startswith("approver via provision_campaign/")


@pytest.mark.airflow
def test_an_unanswered_approval_expires_like_a_rejection(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    _create(campaign_db, 4)

    dr, _ = run_with_answer(dagbag.dags["provision_campaign"],
                             {"campaign": NAME, "approval_timeout_hours": 0.0005}, None, expire=True)  # 1.8 s

    assert _ti(dr, "provision").state == "skipped"
    assert campaign_db.execute("select status from mail.campaign").fetchone() == ("draft",)
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert _events(campaign_db)[-1] == ("draft", "draft", "approval_expired")


@pytest.mark.airflow
def test_a_dry_run_stops_after_the_plan(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    _create(campaign_db, 10)

    dr = dagbag.dags["provision_campaign"].test(run_conf={"campaign": NAME, "dry_run": True,
                                                          "test_email_to": "approver@example.com"})

    assert {t.task_id: t.state for t in dr.get_task_instances()} == {
        "plan": "success", "send_test_email": "skipped", "approve": "skipped", "provision": "skipped"}
    assert _ti(dr, "plan").xcom_pull(task_ids="plan")["plan"]["recipients"] == 10
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert conns.read_outbox() == []


@pytest.mark.airflow
@pytest.mark.parametrize("case", ["missing", "cancelled"])
def test_an_unknown_or_cancelled_campaign_fails_the_plan_without_retries(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any, case: str,
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.campaign_tasks import plan_task

    cid = _create(campaign_db, 3)
    name = "no_such_campaign" if case == "missing" else NAME
    if case == "cancelled":
        with psycopg.connect(campaign_db.info.dsn) as conn:
            scheduled.cancel(conn, cid)
    dag = dagbag.dags["provision_campaign"]
    assert dag.default_args["retries"] == 3

    dr = dag.test(run_conf={"campaign": name})

    assert dr.state == "failed"
    ti = _ti(dr, "plan")
    assert (ti.state, ti.try_number) == ("failed", 1)
    assert {t.task_id: t.state for t in dr.get_task_instances()}["provision"] == "upstream_failed"
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    expected = "no campaign named 'no_such_campaign'" if case == "missing" else f"campaign '{NAME}' is cancelled"
    with pytest.raises(AirflowFailException, match=expected):
        plan_task({"params": {**dag.params.dump(), "campaign": name}, "dag": dag, "dag_run": None, "ti": None})


# -- campaign_control -----------------------------------------------------------------------------


@pytest.mark.airflow
def test_campaign_control_pauses_resumes_and_cancels_by_name(
    airflow_db: Path, campaign_db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    cid = _create(campaign_db, 5)
    with psycopg.connect(campaign_db.info.dsn) as conn:
        scheduled.provision(conn, cid, now=datetime.now(UTC))
    dag = dagbag.dags["campaign_control"]

    def run(action: str) -> Any:
        dr = dag.test(run_conf={"campaign": NAME, "action": action})
        return dr, _ti(dr, "control").xcom_pull(task_ids="control")

    assert run("pause")[1]["status"] == "paused"
    assert campaign_db.execute("select status from mail.campaign").fetchone() == ("paused",)
    assert run("resume")[1]["status"] == "scheduled"
    status = run("status")[1]
    assert (status["name"], status["status"], status["rows"]["pending"]) == (NAME, "scheduled", 5)
    out = run("cancel")[1]
    assert (out["status"], out["rows_cancelled"]) == ("cancelled", 5)
    dr, _ = run("resume")  # a cancelled campaign does not resume
    assert dr.state == "failed" and _ti(dr, "control").try_number == 1
    dr, _ = run("pause") if False else (dag.test(run_conf={"campaign": "nope", "action": "status"}), None)
    assert dr.state == "failed" and _ti(dr, "control").try_number == 1
    actors = [r[0] for r in campaign_db.execute("select actor from mail.campaign_event order by id").fetchall()]
    assert sum(1 for a in actors if a and a.startswith("dag_test via campaign_control/")) == 3


# -- run conf strictness --------------------------------------------------------------------------


@pytest.mark.airflow
def test_a_dryrun_typo_in_the_conf_fails_lifecycle_emails_before_anything_is_sent(
    airflow_db: Path, db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    _users(db, 5)
    dag = dagbag.dags["lifecycle_emails"]
    assert dag.default_args["retries"] == 2

    dr = dag.test(logical_date=datetime.now(UTC).replace(minute=0, second=0, microsecond=0),
                  run_conf={"dryrun": True})

    assert dr.state == "failed"
    ti = _ti(dr, "send_campaigns")
    assert (ti.state, ti.try_number) == ("failed", 1)
    assert db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert conns.read_outbox() == []


@pytest.mark.airflow
def test_lifecycle_emails_refuses_a_lifecycle_name_a_scheduled_campaign_has_without_retries(
    airflow_db: Path, db: psycopg.Connection, conns: EmulatorProcess, dagbag: Any,
) -> None:
    # a row written before names were checked across kinds (create_campaign refuses it now)
    _users(db, 5)
    db.execute("insert into mail.campaign (name, template, subject, from_address, recipients_sql)"
               " values ('first_practice', 'outreach', 's', 'a@example.com', 'free_plan_users')")
    dr = dagbag.dags["lifecycle_emails"].test(
        logical_date=datetime.now(UTC).replace(minute=0, second=0, microsecond=0))

    assert dr.state == "failed"
    ti = _ti(dr, "send_campaigns")
    assert (ti.state, ti.try_number) == ("failed", 1)
    assert db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert conns.read_outbox() == []


@pytest.mark.parametrize("dag_id", ["lifecycle_emails", "dispatch_scheduled_emails", "reconcile_send_log",
                                    "deliverability_feedback", "resume_sending", "campaign_create",
                                    "provision_campaign", "campaign_control"])
def test_every_mailflow_task_refuses_a_conf_key_that_is_no_param(dagbag: Any, dag_id: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Each task's callable checks the conf first: given a typo, it fails before it reads a
    connection (none is defined here, so any other step would fail differently)."""
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.run_conf import unknown_conf_keys

    dag = dagbag.dags[dag_id]
    declared = list(dag.params)
    key = declared[0] + "x"
    assert unknown_conf_keys({key: 1}, declared) == [(key, declared[0])]
    for task in dag.tasks:
        if not hasattr(task, "python_callable"):
            continue  # the approval: its plan task checked the conf
        context = {"params": {**dag.params.dump(), key: 1}, "dag": dag, "task": task,
                   "dag_run": type("R", (), {"conf": {key: 1}})(), "ti": None}
        with pytest.raises(AirflowFailException, match=f"{key!r} \\(did you mean {declared[0]!r}\\?\\)"):
            task.python_callable(**context)


def test_unknown_conf_keys_names_the_nearest_declared_param() -> None:
    from mailflow.orchestration.run_conf import unknown_conf_keys

    assert unknown_conf_keys({"dryrun": True, "chunk_size": 5, "zzz": 1}, ["dry_run", "chunk_size"]) == [
        ("dryrun", "dry_run"), ("zzz", None)]
    assert unknown_conf_keys({}, ["dry_run"]) == []
    assert unknown_conf_keys(None, ["dry_run"]) == []




def test_a_bad_test_address_is_refused_before_anything_is_read_or_sent() -> None:
    from mailflow.sources.scheduled.test_email import send_test_email

    with pytest.raises(ValueError, match=r"test_email_to 'approver\(at\)example.com' is not a valid address"):
        send_test_email(None, None, 1, "approver(at)example.com", None, renderer=None)  # type: ignore[arg-type]


def test_the_plan_counts_what_the_contact_policy_would_hold_back_now(campaign_db: psycopg.Connection) -> None:
    """lifecycle.toml's policy: a 7-day cooldown and at most 3 emails in 28 days."""
    from mailflow.sources.scheduled.preview import policy_holdback

    cid = _create(campaign_db, 8)
    campaign_db.execute("insert into mail.send_log (user_id, campaign, email, status, sent_at, provider_message_id)"
                        " values (2, 'welcome', 'ui2@example.com', 'sent', now() - interval '1 day', 'p1'),"
                        " (4, 'welcome', 'ui4@example.com', 'sent', now() - interval '8 days', 'p2'),"
                        " (4, 'first_practice', 'ui4@example.com', 'sent', now() - interval '15 days', 'p3'),"
                        " (4, 'upgrade_offer', 'ui4@example.com', 'sent', now() - interval '22 days', 'p4'),"
                        " (5, 'welcome', 'ui5@example.com', 'sent', now() - interval '30 days', 'p5')")
    campaign_db.execute("insert into mail.suppression (user_id, scope, source) values (6, %s, 'test')", (NAME,))
    campaign_db.execute("insert into mail.suppression (user_id, scope, source) values (7, 'other_campaign', 'test')")
    campaign_db.execute("update app.users set email = 'not an address' where user_id = 8")

    with psycopg.connect(campaign_db.info.dsn) as conn:
        hb = policy_holdback(conn, cid, now=datetime.now(UTC))

    assert (hb.checked, hb.suppressed, hb.cooldown, hb.capped, hb.invalid, hb.held) == (8, 1, 1, 1, 1, 4)
    assert [e.split(":")[0] for e in hb.examples] == ["user 8", "user 6", "user 2", "user 4"]
    assert hb.examples[1] == "user 6: suppressed"
    assert "cooldown" in hb.examples[2] and "row 1 (welcome, sent" in hb.examples[2]
    assert "frequency cap" in hb.examples[3]
    with psycopg.connect(campaign_db.info.dsn) as conn:
        conn.execute("update mail.campaign set on_policy = 'ignore'")
        conn.commit()
        ignored = policy_holdback(conn, cid, now=datetime.now(UTC))
    assert (ignored.suppressed, ignored.cooldown, ignored.capped, ignored.held) == (1, 0, 0, 2)
