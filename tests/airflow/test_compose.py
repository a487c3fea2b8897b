"""docker-compose.yaml against the real code: the unsubscribe link an email from the compose
deployment carries, built by the product from the environment compose gives the workers, reaches
the plugin inside the real Airflow API server (Airflow's FastAPI app with ./plugins loaded; no
Docker engine needed); so does a webhook the compose emulator signs, at the URL and with the secret
compose gives it. Also the other addresses the file wires together."""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from compose_rig import COMPOSE_SECRETS, compose_config, env_of

from mailflow import settings
from mailflow.campaigns import Campaign
from mailflow.feedback.unsubscribe_app import create_app as create_standalone_app
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import MintedRow
from mailflow.sendloop.render import Renderer
from mailflow_dev import devenv

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

CAMPAIGN = Campaign(name="upgrade_offer", priority=1, audience_sql="select 1", template="first_practice",
                    subject="Hi", from_address="P <p@mail.example.com>", reply_to=None, cooldown=timedelta(0),
                    audience_window=timedelta(hours=1), marketing=True)
ONE_CLICK: dict[str, Any] = {"content": b"List-Unsubscribe=One-Click",
                             "headers": {"Content-Type": "application/x-www-form-urlencoded"}}


@pytest.fixture
def fresh_plugin_app() -> Iterator[None]:
    """The plugin's endpoint resolves its secret on the first request and keeps it: give the API
    server's next app a fresh one afterwards, as a restarted API server would have."""
    yield
    from airflow import plugins_manager

    from mailflow.orchestration.unsubscribe import create_airflow_app

    # the entries the API server mounts (plugins_manager keeps them, cached; the plugin module may have
    # been imported again under another name since)
    for entry in plugins_manager.get_fastapi_plugins()[0]:
        if entry.get("url_prefix") == settings.UNSUBSCRIBE_PATH:
            entry["app"] = create_airflow_app()


@pytest.fixture
def fresh_webhook_plugin_app() -> Iterator[None]:
    """The webhook plugin resolves its secrets on the first request and keeps them for minutes: give
    the API server a fresh app before and after, as a started or restarted API server has."""
    from airflow import plugins_manager

    from mailflow.orchestration.webhooks import URL_PREFIX, create_airflow_app

    def renew() -> None:  # the entries the API server mounts (plugins_manager keeps them, cached)
        for entry in plugins_manager.get_fastapi_plugins()[0]:
            if entry.get("url_prefix") == URL_PREFIX:
                entry["app"] = create_airflow_app()

    renew()
    yield
    renew()


def _emulator_args(services: dict[str, Any]) -> Any:
    """The compose emulator's command line, parsed by the emulator's own command (``mailflow emulator``)."""
    from types import SimpleNamespace

    from mailflow.emulator.cli import emulator

    words = " ".join(services["mailflow-emulator"]["command"].split()).split(" ")
    # `mailflow emulator` through the image's entrypoint, which runs `python ...` as given (a bare
    # `mailflow` would become `airflow mailflow`)
    assert words[:4] == ["python", "-m", "mailflow.cli", "emulator"], words
    with emulator.make_context("mailflow emulator", words[4:]) as ctx:
        return SimpleNamespace(**ctx.params)


def _compose(extra: dict[str, str] | None = None) -> dict[str, Any]:
    model, _how = compose_config({**COMPOSE_SECRETS, **(extra or {})})
    return model["services"]


def _link(env: dict[str, str], monkeypatch: pytest.MonkeyPatch, user_id: int) -> str:
    """The List-Unsubscribe link the product renders in a worker holding ``env``."""
    monkeypatch.setenv("MAILFLOW_PUBLIC_URL", env["MAILFLOW_PUBLIC_URL"])
    secret = json.loads(env["AIRFLOW_CONN_MAIL_UNSUBSCRIBE"])["password"]
    renderer = Renderer(signer_from_secret(secret), settings.unsubscribe_base_url(), settings.app_url(), mailto="")
    email = renderer.render_email(CAMPAIGN, MintedRow(id=1, user_id=user_id, email=f"u{user_id}@example.com",
                                                      context={"first_name": "N"}))
    header = email["headers"]["List-Unsubscribe"]
    assert header.startswith("<") and header.endswith(">") and email["text"].count(header[1:-1]) == 1
    return header[1:-1]


@pytest.mark.airflow
@pytest.mark.parametrize(("public_url", "user_id"), [
    (None, 41),  # the file's default
    ("http://localhost:8080/mailflow-unsubscribe", 42),  # the prefix written out
    ("http://localhost:8080/", 43),
])
def test_a_link_from_the_compose_environment_unsubscribes_through_the_plugin_in_the_api_server(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, monkeypatch: pytest.MonkeyPatch,
        public_url: str | None, user_id: int, fresh_plugin_app: None) -> None:
    services = _compose({"MAILFLOW_PUBLIC_URL": public_url} if public_url else None)
    worker, apiserver = env_of(services["airflow-worker-1"]), env_of(services["airflow-apiserver"])
    link = _link(worker, monkeypatch, user_id)
    # the link names the API server as the host publishes it ...
    published = {p.split(":")[0] for p in services["airflow-apiserver"]["ports"]}
    parts = urlsplit(link)
    assert (parts.scheme, parts.hostname, str(parts.port)) == ("http", "localhost", "8080") and "8080" in published
    assert parts.path.startswith("/mailflow-unsubscribe/u/") and parts.path.count("/mailflow-unsubscribe") == 1

    # ... and the API server, with the connections compose gives it (the database is this test's:
    # compose's host `postgres` is a service name), answers it with the plugin
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", apiserver["AIRFLOW_CONN_MAIL_UNSUBSCRIBE"])
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))
    for name in ("MAILFLOW_UNSUBSCRIBE_SECRET", "MAILFLOW_UNSUBSCRIBE_DSN"):
        monkeypatch.delenv(name, raising=False)
    from airflow.api_fastapi.app import create_app

    with TestClient(create_app(apps="core"), raise_server_exceptions=False, follow_redirects=False) as c:
        page = c.get(parts.path)
        assert page.status_code == 200 and "Unsubscribe" in page.text
        r = c.post(parts.path, **ONE_CLICK)
        assert r.status_code == 200 and "You are unsubscribed" in r.text
    assert db.execute("select user_id, scope, source from mail.suppression").fetchall() == [
        (user_id, "upgrade_offer", "one_click")]


def test_the_standalone_app_answers_the_same_link_path_and_the_old_one(db: psycopg.Connection, db_dsn: str) -> None:
    signer = signer_from_secret(COMPOSE_SECRETS["MAILFLOW_UNSUBSCRIBE_SECRET"])
    app = create_standalone_app(lambda: signer, lambda: psycopg.connect(db_dsn, autocommit=True))
    new = urlsplit(Renderer(signer, settings.unsubscribe_base_url("https://mail.example.com"), "https://a.example",
                            mailto="").render_email(CAMPAIGN, MintedRow(1, 7, "u7@example.com", {"first_name": "N"}))
                   ["headers"]["List-Unsubscribe"][1:-1]).path
    assert new == f"/mailflow-unsubscribe/u/{signer.token(7, 'upgrade_offer')}"
    with TestClient(app) as c:
        assert c.post(new, **ONE_CLICK).status_code == 200
        assert c.post(f"/u/{signer.token(8, 'all')}", **ONE_CLICK).status_code == 200  # links already sent
        assert c.post("/elsewhere/u/" + signer.token(9, "all"), **ONE_CLICK).status_code == 404
    assert db.execute("select user_id, scope from mail.suppression order by user_id").fetchall() == [
        (7, "upgrade_offer"), (8, "all")]


@pytest.mark.parametrize(("public", "base"), [
    ("http://localhost:8080", "http://localhost:8080/mailflow-unsubscribe"),
    ("http://localhost:8080/", "http://localhost:8080/mailflow-unsubscribe"),
    ("https://a.example.com/mailflow-unsubscribe/", "https://a.example.com/mailflow-unsubscribe"),
    ("https://proxy.example.com/airflow", "https://proxy.example.com/airflow/mailflow-unsubscribe"),
])
def test_the_link_base_adds_the_endpoint_path_once(public: str, base: str) -> None:
    assert settings.unsubscribe_base_url(public) == base


def test_the_compose_addresses_point_at_the_services_that_answer_them() -> None:
    services = _compose()
    env = env_of(services["airflow-scheduler"])
    # the execution API is the API server's service name and port
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
    assert "8080:8080" in services["airflow-apiserver"]["ports"]
    # the email API is the emulator's service name and the port its command listens on
    resend = json.loads(env["AIRFLOW_CONN_RESEND_DEFAULT"])
    emulator = " ".join(services["mailflow-emulator"]["command"].split())
    assert resend["host"] == "http://mailflow-emulator:8025" and "--port 8025" in emulator
    assert f"--api-key {resend['password']}" in emulator
    # the send log: the database and role the postgres service's init script creates
    send_log = json.loads(env["AIRFLOW_CONN_SEND_LOG_DB"])
    init = "\n".join(services["postgres"]["entrypoint"])
    assert (send_log["host"], send_log["login"], send_log["schema"]) == ("postgres", "mailflow", "mailflow")
    assert "CREATE ROLE mailflow LOGIN" in init and "CREATE DATABASE mailflow OWNER mailflow" in init
    # the connection "Test" button (off by default in Airflow 3) is on, and examples are off
    assert (env["AIRFLOW__CORE__TEST_CONNECTION"], env["AIRFLOW__CORE__LOAD_EXAMPLES"]) == ("Enabled", "false")
    assert (env["MAILFLOW_PUBLIC_URL"], env["MAILFLOW_APP_URL"], env["MAILFLOW_ALERT"]) == (
        "http://localhost:8080", "https://app.example.com", "log")


@pytest.mark.airflow
def test_a_webhook_the_compose_emulator_signs_is_accepted_by_the_plugin_in_the_api_server(
        airflow_db: Path, db: psycopg.Connection, db_dsn: str, monkeypatch: pytest.MonkeyPatch,
        fresh_webhook_plugin_app: None) -> None:
    from mailflow.emulator.webhooks import Endpoint
    from mailflow.orchestration.webhooks import URL_PREFIX

    services = _compose()
    args, apiserver = _emulator_args(services), env_of(services["airflow-apiserver"])
    # the emulator pushes to the API server's service, on the port it listens on, at the plugin's path
    url = urlsplit(args.webhook_url)
    assert (url.scheme, url.hostname, url.port, url.path) == ("http", "airflow-apiserver", 8080, f"{URL_PREFIX}/resend")
    assert "8080:8080" in services["airflow-apiserver"]["ports"]
    # ... and signs with the secret of the connection the API server verifies with
    secret = json.loads(apiserver["AIRFLOW_CONN_MAIL_WEBHOOK"])["password"]
    assert list(args.webhook_secrets) == [secret] == [COMPOSE_SECRETS["MAILFLOW_WEBHOOK_SECRET"]]
    assert args.hard_bounce_rate > 0 and args.open_rate > 0  # outcomes to show, not only deliveries

    db.execute("truncate mail.webhook_event")
    db.execute("insert into mail.send_log (user_id, campaign, email, email_key, status, sent_at, provider_message_id)"
               " values (5, 'upgrade_offer', 'compose@example.com', 'compose@example.com', 'sent', now(), 'em_compose')")
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_WEBHOOK", apiserver["AIRFLOW_CONN_MAIL_WEBHOOK"])
    monkeypatch.setenv("AIRFLOW_CONN_SEND_LOG_DB", devenv.airflow_conn_json(db_dsn))  # compose's host is a service
    for name in ("MAILFLOW_WEBHOOK_SECRETS", "MAILFLOW_WEBHOOK_DSN"):
        monkeypatch.delenv(name, raising=False)
    endpoint = Endpoint("ep_compose", args.webhook_url, (), tuple(args.webhook_secrets), time.time())
    body = json.dumps({"type": "email.bounced", "created_at": "2026-03-02T09:00:00.000Z", "data": {
        "email_id": "em_compose", "to": ["compose@example.com"], "bounce": {"type": "Permanent"}}})
    ts = int(time.time())
    headers = {"svix-id": "msg_compose", "svix-timestamp": str(ts), "content-type": "application/json",
               "svix-signature": endpoint.sign("msg_compose", ts, body)}
    from airflow.api_fastapi.app import create_app

    with TestClient(create_app(apps="core"), raise_server_exceptions=False, follow_redirects=False) as c:
        r = c.post(url.path, content=body.encode(), headers=headers)
        assert (r.status_code, r.json()) == (200, {"received": True, "decision": "applied"})
        forged = {**headers, "svix-id": "msg_forged", "svix-signature": Endpoint(
            "ep_other", args.webhook_url, (), ("whsec_b3RoZXItc2VjcmV0LTAxMjM0NTY3",), time.time()).sign(
            "msg_forged", ts, body)}
        assert c.post(url.path, content=body.encode(), headers=forged).status_code == 401
    assert db.execute("select svix_id, decision from mail.webhook_event").fetchall() == [("msg_compose", "applied")]
    assert db.execute("select email, source from mail.suppression").fetchall() == [("compose@example.com", "bounce")]
