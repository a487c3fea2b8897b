"""Operators' signals the Airflow way: metrics through Airflow's ``Stats`` reach a StatsD listener
with the documented names and values (configured as a deployment configures ``[metrics]``, set up
as Airflow's task runner sets it up), and the two send DAGs carry Deadline Alerts."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from conftest import ROOT

from mailflow.orchestration import alerts, metrics


@pytest.fixture
def statsd(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    from airflow.sdk._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.sdk.observability import stats
    from airflow.sdk.observability.metrics import stats_utils

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2)
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_ON", "True")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_HOST", "127.0.0.1")
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PORT", str(sock.getsockname()[1]))
    monkeypatch.setenv("AIRFLOW__METRICS__STATSD_PREFIX", "airflow")
    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
    try:
        yield sock
    finally:
        stats.initialize(factory=NoStatsLogger, export_legacy_names=False)
        sock.close()


def _received(sock: socket.socket, n: int) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        out.extend(sock.recv(65535).decode().split("\n"))
    sock.settimeout(0.3)
    try:
        extra = sock.recv(65535).decode()
    except TimeoutError:
        extra = ""
    assert extra == "", f"more metrics than expected: {extra!r}"
    return out


def test_send_provider_and_dead_letter_counts_reach_statsd(statsd: socket.socket) -> None:
    metrics.campaign_outcomes([{"campaign": "upgrade_offer", "sent": 98, "failed": 1, "unknown": 1, "held": 0},
                               {"campaign": "first_practice", "sent": 0, "failed": 0, "unknown": 0, "held": 7}],
                              "lifecycle_emails")
    metrics.provider_requests({"requests": 12, "429": 2, "5xx": 1, "timeouts": 0, "replays": 4, "late_slots": 3},
                              "lifecycle_emails")
    metrics.dead_letters([{"campaign": "upgrade_offer"}, {"campaign": "upgrade_offer"}, {"campaign": "win_back"}],
                         "reconcile_send_log")
    metrics.dispatch_outcomes({"sent_by_campaign": {"demo_outreach": 40}, "failed": 2, "unknown": 0},
                              "dispatch_scheduled_emails")
    expected = ["airflow.mailflow.campaign.upgrade_offer.sent:98|c", "airflow.mailflow.campaign.upgrade_offer.failed:1|c",
                "airflow.mailflow.campaign.upgrade_offer.unknown:1|c", "airflow.mailflow.campaign.first_practice.held:7|c",
                "airflow.mailflow.provider.requests:12|c", "airflow.mailflow.provider.429:2|c",
                "airflow.mailflow.provider.5xx:1|c", "airflow.mailflow.provider.late_slots:3|c",
                "airflow.mailflow.campaign.upgrade_offer.dead_lettered:2|c",
                "airflow.mailflow.campaign.win_back.dead_lettered:1|c",
                "airflow.mailflow.campaign.demo_outreach.sent:40|c", "airflow.mailflow.dispatch.failed:2|c"]
    assert _received(statsd, len(expected)) == expected  # zero counts are not sent


def test_dispatch_lateness_is_a_timing_in_ms(statsd: socket.socket) -> None:
    scheduled = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
    metrics.dispatch_lateness(scheduled, scheduled + timedelta(seconds=7, milliseconds=250), "dispatch_scheduled_emails")
    metrics.dispatch_lateness(scheduled, scheduled - timedelta(seconds=1), "dispatch_scheduled_emails")  # early: 0
    metrics.dispatch_lateness(None, scheduled, "dispatch_scheduled_emails")  # a manual run: nothing
    assert _received(statsd, 2) == ["airflow.mailflow.dispatch.lateness:7250.000000|ms",
                                    "airflow.mailflow.dispatch.lateness:0.000000|ms"]


@pytest.mark.parametrize(("dag_file", "interval", "what"), [
    ("lifecycle_emails", timedelta(minutes=45), "the hourly lifecycle run is not finished 45 min after"),
    ("dispatch_scheduled_emails", timedelta(minutes=5), "a dispatch run is not finished 5 min after"),
])
def test_the_send_dags_carry_a_deadline_alert_that_serializes(dag_file: str, interval: timedelta, what: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.dag_processing.dagbag import DagBag

    monkeypatch.setenv("MAILFLOW_DEADLINE_ALERTS", "0")
    assert DagBag(dag_folder=str(ROOT / "dags" / f"{dag_file}.py")).dags[dag_file].deadline in (None, [])
    monkeypatch.setenv("MAILFLOW_DEADLINE_ALERTS", "1")
    from airflow.sdk.definitions.deadline import DeadlineReference
    from airflow.serialization.serialized_objects import DagSerialization

    bag = DagBag(dag_folder=str(ROOT / "dags" / f"{dag_file}.py"))
    assert bag.import_errors == {}
    [alert] = bag.dags[dag_file].deadline
    assert type(alert.reference) is type(DeadlineReference.DAGRUN_QUEUED_AT) and alert.interval == interval
    assert alert.callback.path == "mailflow.orchestration.alerts.deadline_missed"
    assert alert.callback.kwargs["what"].startswith(what)
    assert DagSerialization.to_dict(bag.dags[dag_file])["dag"]["deadline"]  # the scheduler can store it


def test_a_missed_deadline_alerts_through_the_configured_notifier(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class Run:
        dag_id, run_id = "dispatch_scheduled_emails", "scheduled__2026-12-01T09:00:00+00:00"

    monkeypatch.delenv("MAILFLOW_ALERT", raising=False)
    with caplog.at_level(logging.ERROR, logger="mailflow.alerts"):
        asyncio.run(alerts.deadline_missed(what="scheduled emails are going out late", context={"dag_run": Run()}))
    assert [r.getMessage() for r in caplog.records if r.name == "mailflow.alerts"] == [
        "ALERT: deadline missed: dispatch_scheduled_emails/scheduled__2026-12-01T09:00:00+00:00: scheduled emails "
        "are going out late"]
