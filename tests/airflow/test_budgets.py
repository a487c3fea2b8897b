"""Every DAG's time budget fits inside its task's execution_timeout with room for the longest chunk
(issue 13): the numbers of each DAG, the trigger-time refusal (Param maximum) and the check a task
makes before sending, with the connection's real timeouts."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mailflow.orchestration import budgets

DAGS = Path(__file__).resolve().parents[2] / "dags"

# dag_id: (task, execution_timeout s, time_budget_seconds maximum s, default s)
EXPECTED = {
    "lifecycle_emails": ("send_campaigns", 900, 500, 240),
    "reconcile_send_log": ("reconcile", 1500, 1100, 600),
    "dispatch_scheduled_emails": ("dispatch", 600, 200, 50),
    "deliverability_feedback": ("poll_feedback", 1500, 1100, 600),
}


@pytest.fixture(scope="module")
def dagbag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(DAGS))
    assert bag.import_errors == {}
    return bag


def test_longest_chunk_is_timeouts_times_attempts_plus_backoff() -> None:
    from mailflow.provider.client import RetryPolicy
    policy = RetryPolicy()
    assert (policy.max_attempts, policy.base, policy.cap) == (
        budgets.MAX_ATTEMPTS, budgets.BACKOFF_BASE_SECONDS, budgets.BACKOFF_CAP_SECONDS)
    # 5 attempts x (connect 5 s + write 30 s + read 30 s) + backoff caps 0.5 + 1 + 2 + 4 s = 332.5 s
    assert budgets.longest_chunk_seconds() == 333
    assert budgets.longest_chunk_seconds(timeout=60, connect_timeout=10) == 5 * 130 + 8
    assert budgets.longest_chunk_seconds(max_attempts=1) == 65
    # the hook's defaults are the ones assumed here
    src = Path(__import__("mailflow.provider.hook", fromlist=["x"]).__file__).read_text()
    assert '_number(extra, "timeout_seconds", 30.0)' in src and '_number(extra, "connect_timeout_seconds", 5.0)' in src


def test_every_dag_with_a_budget_is_held_here(dagbag: Any) -> None:
    with_budget = {d.dag_id for d in dagbag.dags.values() if "time_budget_seconds" in d.params}
    assert with_budget == set(EXPECTED)  # provision_campaign has no time budget (chunks of recipients)


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_budget_fits_execution_timeout_with_the_longest_chunk(dagbag: Any, dag_id: str) -> None:
    from airflow.sdk.exceptions import ParamValidationError

    task_id, timeout, maximum, default = EXPECTED[dag_id]
    dag = dagbag.dags[dag_id]
    task = dag.get_task(task_id)
    assert task.execution_timeout == timedelta(seconds=timeout)
    param = dag.params.get_param("time_budget_seconds")
    assert (param.value, param.schema["maximum"]) == (default, maximum)
    assert maximum + budgets.longest_chunk_seconds() + budgets.SETUP_SECONDS <= timeout
    assert maximum + 10 + budgets.longest_chunk_seconds() + budgets.SETUP_SECONDS > timeout  # no slack wasted
    desc = param.description
    assert f"At most {maximum} s" in desc and f"execution_timeout ({timeout} s)" in desc and "(333 s" in desc
    assert param.resolve(maximum) == maximum
    with pytest.raises(ParamValidationError, match=f"{maximum + 1} is greater than the maximum of {maximum}"):
        param.resolve(maximum + 1)


def _context(minutes: int) -> dict[str, Any]:
    return {"task": SimpleNamespace(execution_timeout=timedelta(minutes=minutes)), "params": {}}


def test_check_budget_fails_without_retry_naming_both_numbers() -> None:
    from airflow.sdk.exceptions import AirflowFailException

    budgets.check_budget(500, _context(15))  # 500 + 333 + 60 = 893 <= 900
    with pytest.raises(AirflowFailException,
                       match=r"time_budget_seconds 3000 s does not fit the task's execution_timeout of 900 s: .*"
                             r"\(333 s: .*\) \+ 60 s setup = 3393 s\. Lower time_budget_seconds to at most 507 s"):
        budgets.check_budget(3000, _context(15))
    budgets.check_budget(1e9, {"task": SimpleNamespace(execution_timeout=None)})  # no timeout: nothing to fit


def test_a_task_checks_with_the_connections_real_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection with slower timeouts makes the default lifecycle budget too long: refused before sending."""
    from airflow.sdk.exceptions import AirflowFailException

    from mailflow.orchestration.tasks import budget_fits

    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": "http://127.0.0.1:9", "password": "re_x", "extra": {"timeout_seconds": 30}}))
    assert budget_fits(_context(15), 240.0) == 240.0
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": "http://127.0.0.1:9", "password": "re_x", "extra": {"timeout_seconds": 60}}))
    # 5 x (5 + 120) + 7.5 = 632.5 -> 633 s; 240 + 633 + 60 = 933 > 900
    with pytest.raises(AirflowFailException, match=r"240 s does not fit .* 900 s: .*\(633 s: .* at most 207 s"):
        budget_fits(_context(15), 240.0)


@pytest.mark.airflow
def test_dag_test_refuses_a_budget_that_cannot_fit_and_fails_a_slow_connection_before_sending(
        airflow_db: Path, db_dsn: str, emulator: Any, dagbag: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run: the Param refuses 3000 at trigger time; a connection whose timeouts make the
    default budget too long fails the task once (no retry) before any request reaches the provider."""
    from airflow.sdk.exceptions import ParamValidationError

    from mailflow_dev import devenv

    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", json.dumps({"conn_type": "generic", "password": "s" * 32}))
    monkeypatch.setenv("AIRFLOW_CONN_RESEND_DEFAULT", json.dumps({
        "conn_type": "resend", "host": emulator.base_url, "password": emulator.api_key,
        "extra": {"timeout_seconds": 100}}))
    dag = dagbag.dags["reconcile_send_log"]
    with pytest.raises(ParamValidationError, match="3000 is greater than the maximum of 1100"):
        dag.test(run_conf={"time_budget_seconds": 3000})
    dr = dag.test()  # default budget 600 s + 5 x (5 + 200) + 7.5 = 1033 s + 60 s > 1500 s
    ti = dr.get_task_instance("reconcile")
    assert (dr.state, ti.state, ti.try_number) == ("failed", "failed", 1)
    assert emulator.stats()["requests"] == 0
