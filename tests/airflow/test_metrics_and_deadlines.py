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
    metrics.campaign_outcomes([{"campaign": "upgrade_offer", "sent": 98, "failed": 1, "sending": 1, "held": 0},
                               {"campaign": "first_practice", "sent": 0, "failed": 0, "sending": 0, "held": 7}],
                              "lifecycle_emails")
    metrics.provider_requests({"requests": 12, "429": 2, "5xx": 1, "timeouts": 0, "replays": 4, "late_slots": 3},
                              "lifecycle_emails")
    metrics.dead_letters([{"campaign": "upgrade_offer"}, {"campaign": "upgrade_offer"}, {"campaign": "win_back"}],
                         "reconcile_send_log")
    metrics.dispatch_outcomes({"sent_by_campaign": {"demo_outreach": 40}, "failed": 2, "unknown": 0},
                              "dispatch_scheduled_emails")
    expected = ["airflow.mailflow.campaign.upgrade_offer.sent:98|c", "airflow.mailflow.campaign.upgrade_offer.failed:1|c",
                "airflow.mailflow.campaign.upgrade_offer.sending:1|c", "airflow.mailflow.campaign.first_practice.held:7|c",
                "airflow.mailflow.provider.requests:12|c", "airflow.mailflow.provider.429:2|c",
                "airflow.mailflow.provider.5xx:1|c", "airflow.mailflow.provider.late_slots:3|c",
                "airflow.mailflow.campaign.upgrade_offer.dead_lettered:2|c",
                "airflow.mailflow.campaign.win_back.dead_lettered:1|c",
                "airflow.mailflow.campaign.demo_outreach.sent:40|c", "airflow.mailflow.dispatch.failed:2|c"]
    assert _received(statsd, len(expected)) == expected  # zero counts are not sent


def test_held_campaigns_reach_statsd_as_gauges_per_kind(statsd: socket.socket) -> None:
    """A dispatch run's ``held`` (every scheduled or paused campaign: its hold, or None): one gauge per
    campaign and kind (1 for the reason it is held, 0 for the others, all 0 when it sends as planned), and
    how many campaigns are held for each reason."""
    metrics.campaign_holds({"spring": {"kind": "guard_account", "reason": "reputation guard tripped (account a)"},
                            "autumn": None}, "dispatch_scheduled_emails")
    kinds = ("paused", "guard_account", "guard_campaign", "guard_waiting", "canary")
    expected = [f"airflow.mailflow.campaign.spring.hold.{k}:{int(k == 'guard_account')}|g" for k in kinds]
    expected += [f"airflow.mailflow.campaign.autumn.hold.{k}:0|g" for k in kinds]
    expected += [f"airflow.mailflow.campaigns.held.{k}:{int(k == 'guard_account')}|g" for k in kinds]
    assert _received(statsd, len(expected)) == expected


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


def test_campaign_outcome_metrics_name_keys_the_run_summary_has():
    """A metric counts a key of the lifecycle summary; a renamed key would silently count 0."""
    from mailflow.model.outcome import CampaignSummary

    keys = set(CampaignSummary(campaign="c").as_dict())
    assert set(metrics.CAMPAIGN_OUTCOMES) <= keys, set(metrics.CAMPAIGN_OUTCOMES) - keys


class _Pacer:
    account = "api.resend.com"


class _Client:
    """What the run's signals read of a client: its ``stats`` and its pacer's account."""

    pacer = _Pacer()

    def __init__(self, **stats: int) -> None:
        self.stats = {"requests": 0, "429": 0, "5xx": 0, "timeouts": 0, "replays": 0, "late_slots": 0,
                      "pacing_wait_ms": 0} | stats


class _TI:
    dag_id, run_id, task_id = "lifecycle_emails", "scheduled__2026-12-01T09:00:00+00:00", "send"


def test_a_runs_pacing_wait_and_the_breaker_it_leaves_reach_statsd(statsd: socket.socket, db) -> None:
    from mailflow.orchestration.tasks import _provider_signals
    from mailflow.provider.breaker import CircuitBreaker

    context = {"ti": _TI()}
    breaker = CircuitBreaker(db, "api.resend.com", "test")
    breaker.trip("provider unavailable: HTTP 503 service_unavailable")
    _provider_signals(db, _Client(requests=3, pacing_wait_ms=1250), context)
    assert breaker.reset("a probe was answered")
    _provider_signals(db, _Client(requests=1, pacing_wait_ms=0), context)
    _provider_signals(db, _Client(), context)  # no request made: no pacing timing, the gauge still set
    assert _received(statsd, 5) == [
        "airflow.mailflow.provider.pacing_wait:1250.000000|ms", "airflow.mailflow.breaker.api_resend_com.open:1|g",
        "airflow.mailflow.provider.pacing_wait:0.000000|ms", "airflow.mailflow.breaker.api_resend_com.open:0|g",
        "airflow.mailflow.breaker.api_resend_com.open:0|g"]


def test_a_connection_the_run_broke_loses_only_the_breaker_gauge(statsd: socket.socket, db_dsn: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    import psycopg

    from mailflow.orchestration.tasks import _provider_signals

    conn = psycopg.connect(db_dsn)
    conn.close()
    with caplog.at_level(logging.WARNING, logger="mailflow.orchestration.tasks"):
        _provider_signals(conn, _Client(requests=2, pacing_wait_ms=40), {"ti": _TI()})  # does not raise
    assert _received(statsd, 1) == ["airflow.mailflow.provider.pacing_wait:40.000000|ms"]
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["circuit breaker state not read for its metric"]


@pytest.fixture
def api_server_statsd(statsd: socket.socket) -> Iterator[socket.socket]:
    """The same listener behind Airflow core's Stats, initialised as the API server does at start."""
    from airflow._shared.observability.metrics import stats
    from airflow._shared.observability.metrics.base_stats_logger import NoStatsLogger
    from airflow.observability.metrics import stats_utils

    stats.initialize(factory=stats_utils.get_stats_factory(), export_legacy_names=False)
    try:
        yield statsd
    finally:
        stats.initialize(factory=NoStatsLogger, export_legacy_names=False)


def test_webhook_answers_of_the_api_servers_receiver_are_counted_per_type_and_decision(
        api_server_statsd: socket.socket, db, db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    import time

    from starlette.testclient import TestClient

    from mailflow.feedback.webhook_verify import sign
    from mailflow.orchestration.webhooks import create_airflow_app

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    db.execute("truncate mail.webhook_event")
    monkeypatch.setenv("MAILFLOW_WEBHOOK_SECRETS", secret)
    monkeypatch.setenv("MAILFLOW_WEBHOOK_DSN", db_dsn)

    def post(c: TestClient, svix_id: str, event_type: str, key: str = secret) -> tuple[int, dict]:
        body = json.dumps({"type": event_type, "created_at": "2026-12-01T09:00:00Z",
                           "data": {"email_id": "em_unknown_1", "to": ["a@example.com"]}}).encode()
        ts = int(time.time())
        r = c.post("/resend", content=body, headers={"svix-id": svix_id, "svix-timestamp": str(ts),
                                                    "svix-signature": sign(key, svix_id, ts, body),
                                                    "content-type": "application/json"})
        return r.status_code, r.json()

    api = create_airflow_app()
    with TestClient(api, raise_server_exceptions=False) as c:
        answers = [post(c, "msg_1", "email.delivered"), post(c, "msg_1", "email.delivered"),
                   post(c, "msg_2", "email.delivered", key="whsec_c2Vjb25kLXNlY3JldC0wMTIzNDU2Nzg5YWJjZA=="),
                   post(c, "msg_3", "contact.created")]
        c.portal.call(api.routes[-1].app.state.writer.aclose)
    assert [a[0] for a in answers] == [200, 200, 401, 200]
    assert _received(api_server_statsd, 4) == [
        "airflow.mailflow.webhook.email_delivered.pending:1|c", "airflow.mailflow.webhook.email_delivered.duplicate:1|c",
        "airflow.mailflow.webhook.refused.401:1|c", "airflow.mailflow.webhook.contact_created.ignored:1|c"]


def test_a_failing_metric_never_changes_a_webhook_answer(db, db_dsn: str) -> None:
    import json
    import time

    from starlette.testclient import TestClient

    from mailflow.feedback.webhook_verify import sign
    from mailflow.feedback.webhooks import connect_factory, create_app

    def broken(kind: str, outcome: str) -> None:
        raise OSError("statsd host unreachable")

    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    db.execute("truncate mail.webhook_event")
    app = create_app([secret], connect_factory(db_dsn), on_answer=broken)
    body = json.dumps({"type": "email.opened", "created_at": "2026-12-01T09:00:00Z",
                       "data": {"email_id": "em_unknown_2"}}).encode()
    ts = int(time.time())
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/resend", content=body, headers={"svix-id": "msg_9", "svix-timestamp": str(ts),
                                                    "svix-signature": sign(secret, "msg_9", ts, body)})
    assert (r.status_code, r.json()) == (200, {"received": True, "decision": "pending"})
    assert db.execute("select svix_id from mail.webhook_event").fetchall() == [("msg_9",)]
