"""The resume_sending DAG: imports cleanly, follows the house rules, requires a reason, and `dag.test()`
resumes a tripped campaign on a real PostgreSQL with the run's triggering user as the actor."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from conftest import ROOT

from mailflow.store import reputation
from mailflow.store.reputation import GuardConfig
from mailflow_dev import devenv


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(ROOT / "dags"))


def test_the_dag_imports_and_is_manual_with_a_required_reason(dagbag: Any) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    assert dagbag.import_errors == {}
    dag = dagbag.dags["resume_sending"]
    assert dag.timetable.can_be_scheduled is False and dag.catchup is False and dag.max_active_runs == 1
    assert {"email", "deliverability", "mailflow"} <= set(dag.tags) and "resume_sending" in dag.doc_md
    [task] = dag.tasks
    assert (task.retries, task.owner, task.execution_timeout is not None) == (1, "data-eng", True)
    with pytest.raises(ParamValidationError):
        dag.params.get_param("reason").resolve()
    with pytest.raises(ParamValidationError):
        dag.params.get_param("scope").resolve("everything")
    assert dag.params.get_param("scope").resolve() == "campaign"


@pytest.mark.airflow
def test_dag_test_resumes_a_tripped_campaign(airflow_db: Any, db: psycopg.Connection, db_dsn: str, dagbag: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    db.execute("truncate mail.reputation_guard")
    db.execute("insert into mail.send_log (user_id, campaign, email, status, sent_at, provider_message_id)"
               " select u, 'welcome', 'u' || u || '@example.com', 'sent', now(), 'p' || u from generate_series(1, 10) u")
    db.execute("insert into mail.delivery_status (send_log_id, provider_message_id, last_event, checks, outcome,"
               " hard_bounced_at) select id, provider_message_id, 'bounced', 0, 'hard_bounced', now() from mail.send_log")
    [trip] = reputation.evaluate(db, ["welcome"], config=GuardConfig(), include_account=False)
    assert reputation.blocked(db, "welcome") is not None

    dr = dagbag.dags["resume_sending"].test(run_conf={"scope": "campaign", "name": "welcome",
                                                      "reason": "the bounced import was removed"})

    assert dr.state == "success"
    out = dr.get_task_instance("resume").xcom_pull(task_ids="resume")
    assert (out["scope"], out["name"], out["changed"], out["unpaused"]) == ("campaign", "welcome", True, [])
    row = db.execute("select state, resumed_by, resume_reason from mail.reputation_guard where name = 'welcome'"
                     ).fetchone()
    assert row == ("ok", "dag_test", "the bounced import was removed")
    assert reputation.blocked(db, "welcome") is None
    assert json.dumps(out)  # JSON-ready for XCom
