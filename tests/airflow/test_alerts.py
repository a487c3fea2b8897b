"""The alert setting: checked when a DAG file is parsed, and an alert that cannot go where it is
configured still reaches the task log (never lost to an ImportError inside a callback)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from mailflow.orchestration import alerts

SLACK = "slack:slack_alerts:#email-ops"
SLACK_MISSING = importlib.util.find_spec("airflow.providers.slack") is None


class _TI:
    dag_id, run_id, task_id = "lifecycle_emails", "scheduled__2026-12-01T09:00:00+00:00", "send_campaigns"


def _failure(caplog: pytest.LogCaptureFixture) -> list[str]:
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        alerts.task_failure_alert({"ti": _TI(), "exception": RuntimeError("provider answered 500")})
    return [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"]


@pytest.mark.skipif(not SLACK_MISSING, reason="the Slack provider is installed here")
def test_slack_without_its_provider_fails_dag_parsing_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("MAILFLOW_ALERT", SLACK)
    with pytest.raises(alerts.AlertSettingError, match=r"needs apache-airflow-providers-slack \(pip install "
                                                       r"'mailflow\[slack\]'\)"):
        alerts.default_args()
    bag = DagBag(dag_folder=str(ROOT / "dags" / "lifecycle_emails.py"))
    [(path, error)] = bag.import_errors.items()
    assert Path(path).name == "lifecycle_emails.py" and "MAILFLOW_ALERT='slack:slack_alerts:#email-ops' needs " \
        "apache-airflow-providers-slack" in error
    assert bag.dags == {}


@pytest.mark.skipif(not SLACK_MISSING, reason="the Slack provider is installed here")
def test_the_first_alert_is_logged_when_the_slack_provider_is_missing_where_the_callback_runs(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MAILFLOW_ALERT", SLACK)
    reason, alert = _failure(caplog)
    assert reason.startswith("the configured alert channel cannot be used (MAILFLOW_ALERT='slack:slack_alerts:"
                             "#email-ops' needs apache-airflow-providers-slack")
    assert alert == ("ALERT: task failed: lifecycle_emails/scheduled__2026-12-01T09:00:00+00:00/send_campaigns:"
                     " provider answered 500")


@pytest.mark.parametrize("spec", ["slack:only_a_conn", "pager:ops:me", "smtp::ops@example.com", "log:extra"])
def test_a_malformed_setting_fails_parsing_and_the_callback_still_logs(
        spec: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("MAILFLOW_ALERT", spec)
    with pytest.raises(alerts.AlertSettingError, match="expected log, smtp:<conn_id>:<to> or slack:<conn_id>"):
        alerts.default_args()
    assert [m for m in _failure(caplog) if m.startswith("ALERT: task failed: lifecycle_emails/")] != []


@pytest.mark.parametrize(("spec", "expected"), [
    (None, ("log", "", "", None)), ("", ("log", "", "", None)), (" log ", ("log", "", "", None)),
])
def test_log_is_the_default(spec: str | None, expected: tuple[Any, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MAILFLOW_ALERT", raising=False)
    assert alerts.alert_setting(spec) == expected
    assert isinstance(alerts.notifier("x"), alerts.LogNotifier)


def test_smtp_builds_the_smtp_notifier(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    monkeypatch.setenv("MAILFLOW_ALERT", "smtp:smtp_ops:ops@example.com")
    assert alerts.default_args()["on_failure_callback"] is alerts.task_failure_alert
    n = alerts.notifier("3 dead letters", subject="mailflow: 3 dead letter(s)")
    assert isinstance(n, SmtpNotifier)
    assert (n.to, n.smtp_conn_id, n.subject, n.html_content) == (
        "ops@example.com", "smtp_ops", "mailflow: 3 dead letter(s)", "<pre>3 dead letters</pre>")


def test_an_alert_quoting_a_template_is_not_lost_to_its_rendering(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A failure message that quotes a campaign's subject (Jinja) reaches the log as written; the
    notifier renders its fields, and ``{{ user.first_name }}`` used to fail that rendering."""
    monkeypatch.delenv("MAILFLOW_ALERT", raising=False)
    error = "definition subject: \"Hi {{ user.first_name }}\" -> \"{% if x %}{# y #}\""
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        alerts.task_failure_alert({"ti": _TI(), "exception": ValueError(error)})
    assert [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"] == [
        f"ALERT: task failed: lifecycle_emails/scheduled__2026-12-01T09:00:00+00:00/send_campaigns: {error}"]
