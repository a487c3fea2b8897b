"""The scheduled-campaign DAG files: import cleanly through a DagBag, follow the house rules, and
`dag.test()` runs provisioning (real PostgreSQL) and one dispatch run (the emulator as the API)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT, UNSUBSCRIBE_SECRET
from hitl_rig import run_with_answer

from mailflow.emulator.testing import EmulatorProcess
from mailflow.sources import scheduled
from mailflow.sources.scheduled.planning import PlanSpec, plan_send_times
from mailflow_dev import devenv

DAGS = ROOT / "dags"
IDS = ("provision_campaign", "dispatch_scheduled_emails")


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(DAGS))


@pytest.fixture
def campaign_db(db: psycopg.Connection) -> Iterator[psycopg.Connection]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    yield db


def test_both_dags_import_without_errors(dagbag: Any) -> None:
    assert dagbag.import_errors == {}
    assert set(IDS) <= set(dagbag.dag_ids)


@pytest.mark.parametrize("dag_id", IDS)
def test_house_rules(dagbag: Any, dag_id: str) -> None:
    dag = dagbag.dags[dag_id]
    assert {"email", "scheduled", "mailflow"} <= set(dag.tags)
    assert dag.catchup is False
    if dag_id == "provision_campaign":  # runs wait for their approval side by side; provisioning is serial
        assert dag.max_active_runs > 1 and dag.get_task("provision").max_active_tis_per_dag == 1
    else:
        assert dag.max_active_runs == 1
    assert dag.doc_md and dag_id in dag.doc_md
    for task in dag.tasks:
        assert task.retries >= 1, task.task_id
        assert task.owner == "data-eng"
        assert task.execution_timeout is not None


def test_dispatch_dag_shape_matches_the_documented_loop(dagbag: Any) -> None:
    from airflow.sdk import CronDataIntervalTimetable

    dag = dagbag.dags["dispatch_scheduled_emails"]
    assert isinstance(dag.timetable, CronDataIntervalTimetable)
    assert (dag.timetable.expression, str(dag.timetable.timezone)) == ("* * * * *", "UTC")
    [task] = dag.tasks
    assert task.pool == "email_provider"
    # the DAG's defaults are the ones the benchmark measures
    assert dag.params.dump() == {"time_budget_seconds": scheduled.DISPATCH_BUDGET_SECONDS,
                                 "coalesce_seconds": scheduled.COALESCE_SECONDS}
    assert scheduled.DISPATCH_BUDGET_SECONDS < 60  # a run ends before the next one is due
    assert task.execution_timeout > timedelta(seconds=scheduled.DISPATCH_BUDGET_SECONDS + scheduled.SEND_GRACE_SECONDS)
    assert "1-minute" in dag.doc_md and "deferrable" in dag.doc_md  # the choice is justified


def test_provision_dag_requires_a_campaign_name(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    dag = dagbag.dags["provision_campaign"]
    assert dag.timetable.can_be_scheduled is False  # manual only
    param = dag.params.get_param("campaign")
    assert param.schema["type"] == "string"
    with pytest.raises(ParamValidationError):
        param.resolve()
    assert param.resolve("spring_outreach") == "spring_outreach"
    assert dag.params.get_param("dry_run").resolve() is False


def _connections(monkeypatch: pytest.MonkeyPatch, dsn: str, emulator: EmulatorProcess | None = None) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(dsn))
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", json.dumps({"conn_type": "generic",
                                                                    "password": UNSUBSCRIBE_SECRET}))
    if emulator is not None:
        monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
            "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
            "extra": {"requests_per_second": 50}}))


def _campaign(db: psycopg.Connection, n: int, start: datetime, **spec: Any) -> int:
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " select i, 'dag' || i || '@example.com', 'N' || i, '2025-01-01', 'UTC', 'free'"
               " from generate_series(1, %s) as i", (n,))
    return scheduled.create_campaign(db, {
        "name": "dag_outreach", "template": "outreach", "subject": "Hello {{ user.first_name }}",
        "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users", "start_at": start,
        **spec})


@pytest.mark.airflow
def test_dag_test_provisions_a_campaign_from_params(
    airflow_db: Path, campaign_db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess, dagbag: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _connections(monkeypatch, db_dsn, emulator)
    start = datetime(2031, 3, 3, 9, 0, tzinfo=UTC)  # a Monday, in the future
    _campaign(campaign_db, 30, start, timezone="Europe/Berlin", emails_per_day=8)
    dag = dagbag.dags["provision_campaign"]

    dry = dag.test(run_conf={"campaign": "dag_outreach", "dry_run": True})
    assert dry.state == "success"
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    summary = dry.get_task_instance("plan").xcom_pull(task_ids="plan")["plan"]
    assert (summary["dry_run"], summary["recipients"], summary["emails_per_day"], summary["days_spanned"]) == (
        True, 30, 8, 4)

    # an approval step marked done without anybody's answer approves nothing: provision refuses
    skipped = dag.test(run_conf={"campaign": "dag_outreach", "dry_run": False, "chunk_size": 7},
                       mark_success_pattern="approve")
    assert skipped.state == "failed" and skipped.get_task_instance("provision").try_number == 1
    assert campaign_db.execute("select count(*) from mail.send_log").fetchone() == (0,)
    assert campaign_db.execute("select state from mail.campaign_approval").fetchall() == [("pending",)]

    dr, _ = run_with_answer(dag, {"campaign": "dag_outreach", "dry_run": False, "chunk_size": 7}, "Approve")
    assert dr.state == "success"
    got = [r[0] for r in campaign_db.execute(
        "select scheduled_at from mail.send_log where campaign = 'dag_outreach' order by user_id").fetchall()]
    assert got == list(plan_send_times(PlanSpec(timezone="Europe/Berlin", emails_per_day=8), 30, start))
    rows = campaign_db.execute("select distinct dag_id, task_id, status, kind from mail.send_log").fetchall()
    assert rows == [("provision_campaign", "provision", "pending", "scheduled")]
    summary = dr.get_task_instance("provision").xcom_pull(task_ids="provision")
    assert (summary["created"], summary["chunks"], summary["complete"]) == (30, 5, True)


@pytest.mark.airflow
def test_dag_test_dispatches_due_rows(
    airflow_db: Path, campaign_db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess, dagbag: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _connections(monkeypatch, db_dsn, emulator)
    past = datetime(2026, 1, 5, tzinfo=UTC)
    cid = _campaign(campaign_db, 12, past, timezone="UTC", weekdays=[1, 2, 3, 4, 5, 6, 7], windows=["00:00-23:59"],
                    emails_per_day=100)
    with psycopg.connect(db_dsn) as conn:
        assert scheduled.provision(conn, cid, now=past).created == 12

    dr = dagbag.dags["dispatch_scheduled_emails"].test(logical_date=datetime(2026, 6, 1, 10, 0, tzinfo=UTC))

    assert dr.state == "success"
    summary = dr.get_task_instance("dispatch").xcom_pull(task_ids="dispatch")
    assert (summary["sent"], summary["completed"]) == (12, ["dag_outreach"])
    assert campaign_db.execute("select status, count(*) from mail.send_log group by status").fetchall() == [("sent", 12)]
    assert len(emulator.read_outbox()) == 12
