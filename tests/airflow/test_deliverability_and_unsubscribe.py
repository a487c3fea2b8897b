"""Airflow tier of issue #8: the ``deliverability_feedback`` DAG (shape, and ``dag.test()`` against
the emulator and a real send log) and the unsubscribe plugin inside the real Airflow API server
(public, and a missing connection is a 503 page, not a broken server)."""

from __future__ import annotations

import json
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT, UNSUBSCRIBE_SECRET

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import DataInterval
from mailflow.provider.client import ResendClient
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import PostgresStore
from mailflow_dev import devenv

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags" / "deliverability_feedback.py"))


def test_deliverability_feedback_dag_shape(dagbag: Any) -> None:
    from airflow.sdk import CronDataIntervalTimetable

    from mailflow.orchestration.assets import SEND_LOG

    assert dagbag.import_errors == {}
    dag = dagbag.dags["deliverability_feedback"]
    assert set(dag.tags) == {"email", "deliverability", "mailflow"}
    assert (dag.max_active_runs, dag.catchup) == (1, False)
    assert isinstance(dag.timetable, CronDataIntervalTimetable)
    assert (dag.timetable.expression, str(dag.timetable.timezone)) == ("10,40 * * * *", "UTC")
    task = dag.get_task("poll_feedback")
    assert (task.pool, task.owner, task.retries, task.retry_delay) == ("email_provider", "data-eng", 2,
                                                                        timedelta(minutes=2))
    assert task.execution_timeout == timedelta(minutes=25)
    assert [o.name for o in task.outlets] == [SEND_LOG.name]
    assert dag.params.dump() == {"lookback_hours": 48, "min_age_minutes": 60, "recheck_after_minutes": 120,
                                 "max_checks_per_email": 4, "max_emails_per_run": 500, "rate_share": 0.01,
                                 "time_budget_seconds": 600, "sweep_limit": 5000, "give_up_hours": 72}
    assert set(dag.task_ids) == {"apply_pending", "alert_webhook_decisions", "poll_feedback"}
    assert dag.get_task("apply_pending").downstream_task_ids == {"alert_webhook_decisions", "poll_feedback"}
    assert task.trigger_rule == "all_done"  # the safety net runs whatever became of the sweep


@pytest.mark.airflow
def test_dag_test_suppresses_the_bounced_and_the_complained_address(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess, dagbag: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
        "extra": {"requests_per_second": 50}}))
    for uid in (1, 2, 3):
        db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                   " values (%s, %s, 'N', now() - interval '9 days', 'UTC', 'free')", (uid, f"dag{uid}@example.com"))
    emulator.configure(bounce=["dag1@example.com"], complain=["dag3@example.com"])
    end = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
    campaign = Campaign(name="dag_feedback", priority=1, audience_sql="select user_id, email, first_name from app.users",
                        template="first_practice", subject="Hi", from_address="P <p@mail.example.com>", reply_to=None,
                        cooldown=timedelta(0), audience_window=timedelta(hours=1))
    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account=emulator.base_url, requests_per_second=50)
    with psycopg.connect(db_dsn) as conn, ResendClient(emulator.base_url, emulator.api_key, pacer=pacer) as client:
        run_lifecycle(PostgresStore(conn), client, Renderer(signer_from_secret(UNSUBSCRIBE_SECRET),
                      "https://mail.example.com", "https://app.example.com", mailto=""), [campaign],
                      DataInterval(end - timedelta(hours=1), end))
    pacer.close()

    dr = dagbag.dags["deliverability_feedback"].test(run_conf={"min_age_minutes": 0})

    assert dr.state == "success"
    summary = dr.get_task_instance("poll_feedback").xcom_pull(task_ids="poll_feedback")
    assert {k: summary[k] for k in ("due", "checked", "bounced", "complained", "suppressed", "errors")} == {
        "due": 3, "checked": 3, "bounced": 1, "complained": 1, "suppressed": 2, "errors": 0}
    assert db.execute("select email, scope, source from mail.suppression order by email").fetchall() == [
        ("dag1@example.com", "all", "bounce"), ("dag3@example.com", "all", "complaint")]
    assert summary["request_budget"] == 900  # 1% of 50 requests/s over the 30-minute interval
    assert dr.get_task_instance("apply_pending").state == "success"
    assert dr.get_task_instance("alert_webhook_decisions").xcom_pull(task_ids="alert_webhook_decisions") == {
        "alerted": 0}


@pytest.mark.airflow
def test_the_plugin_is_public_in_the_api_server_and_a_missing_secret_is_a_503(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MAILFLOW_UNSUBSCRIBE_SECRET", "AIRFLOW_CONN_MAIL_UNSUBSCRIBE", "MAILFLOW_UNSUBSCRIBE_DSN",
                 "AIRFLOW_CONN_SEND_LOG_DB"):
        monkeypatch.delenv(name, raising=False)
    from airflow.api_fastapi.app import create_app

    token = signer_from_secret(UNSUBSCRIBE_SECRET).token(42, "all")
    path = f"/mailflow-unsubscribe/u/{token}"
    app = create_app(apps="core")  # starts although neither the secret nor the database is configured
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as c:
        r = c.post(path, content=b"List-Unsubscribe=One-Click",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 503 and "try the link again" in r.text
        assert c.get("/api/v2/dags").status_code == 401  # Airflow's own API still needs a login

        monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", json.dumps({"conn_type": "generic",
                                                                        "password": UNSUBSCRIBE_SECRET}))
        monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
        assert c.get(path).status_code == 200  # no cookie, no token header: public
        r = c.post(path, content=b"List-Unsubscribe=One-Click",
                   headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 200 and "You are unsubscribed" in r.text and not r.is_redirect
    assert db.execute("select user_id, scope, source from mail.suppression").fetchall() == [(42, "all", "one_click")]


@pytest.mark.airflow
def test_dag_test_with_a_sending_only_key_fails_once_then_works_with_its_own_full_access_connection(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess, dagbag: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 13: the senders keep Resend's recommended sending-only key in resend_default; the feedback
    DAG then fails at once (no retry) saying it needs a full-access key, and works once
    MAILFLOW_FEEDBACK_CONN_ID names a connection that holds one."""
    from mailflow import settings

    emulator.configure(restricted_keys=["re_sending_only"], bounce=["dag1@example.com"])
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": "re_sending_only",
        "extra": {"requests_per_second": 50}}))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_FULL_ACCESS", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
        "extra": {"requests_per_second": 50}}))
    db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
               " values (1, 'dag1@example.com', 'N', now() - interval '9 days', 'UTC', 'free')")
    end = datetime.now(UTC).replace(second=0, microsecond=0) + timedelta(minutes=1)
    campaign = Campaign(name="dag_feedback", priority=1, audience_sql="select user_id, email, first_name from app.users",
                        template="first_practice", subject="Hi", from_address="P <p@mail.example.com>", reply_to=None,
                        cooldown=timedelta(0), audience_window=timedelta(hours=1))
    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account=emulator.base_url, requests_per_second=50)
    with psycopg.connect(db_dsn) as conn, ResendClient(emulator.base_url, "re_sending_only", pacer=pacer) as client:
        run_lifecycle(PostgresStore(conn), client, Renderer(signer_from_secret(UNSUBSCRIBE_SECRET),
                      "https://mail.example.com", "https://app.example.com", mailto=""), [campaign],
                      DataInterval(end - timedelta(hours=1), end))  # sending works with the sending-only key
    pacer.close()
    assert db.execute("select status from mail.send_log").fetchall() == [("sent",)]

    dag = dagbag.dags["deliverability_feedback"]
    monkeypatch.setattr(settings, "FEEDBACK_CONN_ID", "resend_default")
    dr = dag.test(run_conf={"min_age_minutes": 0})
    ti = dr.get_task_instance("poll_feedback")
    assert (dr.state, ti.state, ti.try_number) == ("failed", "failed", 1)  # AirflowFailException: no retry
    assert emulator.stats()["errors_by_name"] == {"restricted_api_key": 1}
    assert db.execute("select count(*) from mail.suppression").fetchone() == (0,)

    monkeypatch.setattr(settings, "FEEDBACK_CONN_ID", "resend_full_access")
    dr = dag.test(run_conf={"min_age_minutes": 0}, logical_date=datetime.now(UTC) + timedelta(seconds=1))
    assert dr.state == "success"
    assert db.execute("select email, source from mail.suppression").fetchall() == [("dag1@example.com", "bounce")]


@pytest.mark.airflow
def test_the_webhook_plugin_is_public_and_a_missing_connection_is_a_503(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from mailflow.feedback.webhook_verify import sign

    for name in ("MAILFLOW_WEBHOOK_SECRETS", "AIRFLOW_CONN_MAIL_WEBHOOK", "MAILFLOW_WEBHOOK_DSN",
                 "AIRFLOW_CONN_SEND_LOG_DB"):
        monkeypatch.delenv(name, raising=False)
    db.execute("truncate mail.webhook_event")
    db.execute("insert into mail.send_log (user_id, campaign, email, email_key, status, sent_at, provider_message_id)"
               " values (7, 'welcome', 'hook@example.com', 'hook@example.com', 'sent', now(), 'em_hook')")
    from airflow.api_fastapi.app import create_app

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = json.dumps({"type": "email.complained", "created_at": "2026-03-02T09:00:00Z",
                       "data": {"email_id": "em_hook", "to": ["hook@example.com"]}}).encode()

    def headers() -> dict[str, str]:
        ts = int(time.time())
        return {"svix-id": "msg_plugin", "svix-timestamp": str(ts), "svix-signature": sign(secret, "msg_plugin", ts, body)}

    app = create_app(apps="core")  # starts although neither the secrets nor the database are configured
    with TestClient(app, raise_server_exceptions=False, follow_redirects=False) as c:
        r = c.post("/mailflow-webhooks/resend", content=body, headers=headers())
        assert r.status_code == 503 and r.headers["retry-after"] == "30"
        monkeypatch.setenv("AIRFLOW_CONN_MAIL_WEBHOOK", json.dumps({"conn_type": "generic",
                                                                    "password": f"{secret} whsec_b2xkLXNlY3JldA=="}))
        monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
        r = c.post("/mailflow-webhooks/resend", content=body, headers=headers())  # no login: public
        assert (r.status_code, r.json()) == (200, {"received": True, "decision": "applied"})
        assert c.post("/mailflow-webhooks/resend", content=body, headers={**headers(), "svix-signature": "v1,AAAA"}
                      ).status_code == 401
    assert db.execute("select svix_id, decision from mail.webhook_event").fetchall() == [("msg_plugin", "applied")]
    assert db.execute("select email, source from mail.suppression").fetchall() == [("hook@example.com", "complaint")]
