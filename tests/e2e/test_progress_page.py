"""The live campaign progress page (``plugins/mailflow_progress.py``) in a real Airflow API server.

A real ``airflow api-server`` runs as a subprocess on a free port with a temporary AIRFLOW_HOME
(metadata: the session's migrated SQLite), SimpleAuthManager with two known users (``admin`` and
``viewer``), ``AIRFLOW__CORE__PLUGINS_FOLDER=plugins`` and the ``send_log_db`` connection in its
environment; it is stopped by its PID at the end. The send log is a database of its own with demo
data (800 users), one real lifecycle run and a scheduled campaign (to the free users that run did not
email: the contact guard would defer those) whose rows are all due.

* Without a token every route of the plugin answers 401 (a bad token: 403); the UI navigation lists
  the page.
* In headless Chromium (Debian's package, driven by Playwright; no ``playwright install``): the
  counts on the list and the campaign page equal ``mail.campaign_progress``; then a real dispatch
  sends the campaign through the emulator, slowly, and the pages (one on server-sent events, one
  forced to the polling fallback) show the counts moving, end with the SQL's final counts and stop
  refreshing once the campaign is done. Screenshots: ``artifacts/test_progress_page/``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from conftest import ROOT
from send_log_demo import current_hour, lifecycle_run_context, make_client, renderer, run_lifecycle_once

from mailflow.emulator.testing import EmulatorProcess, free_port
from mailflow.model.outcome import RunContext
from mailflow.sources import scheduled
from mailflow.store.migrate import migrate
from mailflow_dev import devenv
from mailflow_dev.demo.loader import load_demo_data

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts" / "test_progress_page"
CAMPAIGN = "spring_outreach"
PASSWORDS = {"admin": secrets.token_urlsafe(12), "viewer": secrets.token_urlsafe(12)}
COUNT_FIELDS = ("total", "pending", "sending", "sent", "failed", "cancelled", "rolled_back", "dead_lettered")
PAST = datetime(2026, 1, 5, tzinfo=UTC)


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict[str, Any]) -> dict[str, Any]:
    """pytest-playwright's launch options (``--headed``, ``--slowmo``) with Debian's Chromium: the
    browser-channel options do not find it, and there is no ``playwright install``."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (see .ci/run)")
    return {**browser_type_launch_args, "executable_path": str(CHROMIUM)}


@pytest.fixture(scope="module")
def browser(browser_type_launch_args: dict[str, Any]) -> Iterator[Any]:
    """Chromium for this module only. (pytest-playwright's own ``browser`` lives for the whole session
    and keeps its event loop running in the main thread, which breaks later tests that call
    ``asyncio.run``.)"""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(**browser_type_launch_args)
        try:
            yield chromium
        finally:
            chromium.close()


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log: Path
    send_log_dsn: str
    emulator: EmulatorProcess

    def token(self, user: str) -> str:
        resp = httpx.post(f"{self.base_url}/auth/token", json={"username": user, "password": PASSWORDS[user]},
                          timeout=10)
        assert resp.status_code == 201, resp.text
        return str(resp.json()["access_token"])

    def get(self, path: str, user: str | None = None, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.token(user)}"} if user else {}
        return httpx.get(f"{self.base_url}{path}", headers=headers | kw.pop("headers", {}), timeout=10, **kw)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def stop_by_pid(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process started here, then SIGKILL to what is left of its own process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: the group is this PID's own
    except (ProcessLookupError, PermissionError):
        pass


def prepare_send_log(dsn: str, emulator: EmulatorProcess) -> int:
    """Demo data, one real lifecycle run, and a scheduled campaign provisioned in the past (every row
    due now). Returns the campaign's id."""
    end = current_hour()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        load_demo_data(conn, users=800, seed=7, anchor=end)
    run_lifecycle_once(dsn, emulator, end, lifecycle_run_context(end))
    with psycopg.connect(dsn) as conn:
        # the outreach list leaves out whoever the lifecycle run just emailed: the contact guard would
        # defer them past the cooldown (days), and this test watches a campaign finish
        conn.execute("create table app.outreach_list as select u.user_id, u.email, u.first_name from app.users u"
                     " where u.plan = 'free' and not exists (select 1 from mail.send_log l where l.user_id = u.user_id)")
        cid = scheduled.create_campaign(conn, {
            "name": CAMPAIGN, "template": "outreach", "subject": "{{ user.first_name or 'Hi' }}, spring is here",
            "from": "Outreach <outreach@mail.example.com>", "recipients_table": "app.outreach_list", "start_at": PAST,
            "timezone": "Europe/Berlin", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"],
            "emails_per_day": 100000}, actor="test")
        scheduled.provision(conn, cid, now=PAST)
    return cid


@pytest.fixture(scope="module")
def server(pg_admin_dsn: str, airflow_db: Path, emulator_process: EmulatorProcess,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("progress-page")
    name = f"mailflow_progress_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    emulator_process.reset()
    prepare_send_log(dsn, emulator_process)
    (tmp / "passwords.json").write_text(json.dumps(PASSWORDS))
    (tmp / "dags").mkdir()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({
        "AIRFLOW_HOME": str(tmp / "home"),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{airflow_db / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(tmp / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(tmp / "passwords.json"),
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__BASE_URL": f"http://127.0.0.1:{port}",
        "AIRFLOW_CONN_SEND_LOG_DB": devenv.airflow_conn_json(dsn),
        "MAILFLOW_UI_REFRESH_SECONDS": "1",
        "MAILFLOW_UI_SHOW_ADDRESSES": "true",  # full addresses only for users who may read send_log_db
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    })
    log = tmp / "api-server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "airflow"), "api-server", "--port", str(port),
                                 "--host", "127.0.0.1"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(tmp))
    srv = Server(f"http://127.0.0.1:{port}", proc, log, dsn, emulator_process)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"airflow api-server exited with {proc.returncode}:\n{srv.tail()}")
            try:
                if httpx.get(f"{srv.base_url}/api/v2/monitor/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"airflow api-server did not come up in 120 s:\n{srv.tail()}")
            time.sleep(0.5)
        yield srv
    finally:
        stop_by_pid(proc)
        devenv.drop_database(pg_admin_dsn, name)


def progress_sql(dsn: str) -> dict[str, dict[str, Any]]:
    with psycopg.connect(dsn) as conn:
        cur = conn.execute("select * from mail.campaign_progress")
        names = [d.name for d in cur.description or []]
        return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


# -- authentication -----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/mailflow/", f"/mailflow/campaigns/{CAMPAIGN}", "/mailflow/api/campaigns",
                                  f"/mailflow/api/campaigns/{CAMPAIGN}", "/mailflow/api/stream",
                                  f"/mailflow/api/campaigns/{CAMPAIGN}/stream", "/mailflow/static/progress.js"])
def test_every_route_is_401_without_a_token(server: Server, path: str) -> None:
    resp = server.get(path)
    assert (resp.status_code, resp.json()) == (401, {"detail": "Not authenticated"})
    bad = server.get(path, headers={"Authorization": "Bearer not-a-jwt"})
    assert (bad.status_code, bad.json()) == (403, {"detail": "Invalid JWT token"})
    assert server.get(path, cookies={"_token": "not-a-jwt"}).status_code == 403


def test_with_a_token_the_api_answers_and_the_navigation_links_the_page(server: Server) -> None:
    resp = server.get("/mailflow/api/campaigns", "viewer")
    assert resp.status_code == 200
    assert {c["campaign"] for c in resp.json()["campaigns"]} >= {CAMPAIGN, "first_practice"}
    assert server.get("/mailflow/api/campaigns/nope", "viewer").status_code == 404
    plugins = server.get("/api/v2/plugins", "admin").json()["plugins"]
    [mine] = [p for p in plugins if p["name"] == "mailflow_progress"]
    assert [(v["name"], v["href"], v["url_route"], v["destination"]) for v in mine["external_views"]] == [
        ("Mail campaigns", "mailflow/", "mailflow", "nav")]
    assert [a["url_prefix"] for a in mine["fastapi_apps"]] == ["/mailflow"]


def test_addresses_are_masked_unless_the_setting_and_the_user_allow_them(server: Server) -> None:
    viewer = server.get("/mailflow/api/campaigns/first_practice", "viewer").json()
    admin = server.get("/mailflow/api/campaigns/first_practice", "admin").json()
    assert viewer["show_addresses"] is False and admin["show_addresses"] is True
    assert viewer["recent"] and all("***@" in r["email"] for r in viewer["recent"])
    assert all("***" not in r["email"] for r in admin["recent"])
    # no template context, batch keys or bodies, ever
    assert not {"context", "idempotency_key", "body"} & set(admin["recent"][0])


def test_by_default_addresses_are_masked_for_everyone(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data layer with the setting unset (in-process app; no auth, so no user to authorise)."""
    from fastapi.testclient import TestClient

    from mailflow.orchestration.ui.progress import create_app

    monkeypatch.delenv("MAILFLOW_UI_SHOW_ADDRESSES", raising=False)
    with TestClient(create_app(lambda: psycopg.connect(server.send_log_dsn), auth=False)) as client:
        body = client.get("/api/campaigns/first_practice").json()
        assert body["show_addresses"] is False
        assert body["recent"] and all("***@" in r["email"] for r in body["recent"])
        monkeypatch.setenv("MAILFLOW_UI_SHOW_ADDRESSES", "true")
        assert all("***" not in r["email"] for r in client.get("/api/campaigns/first_practice").json()["recent"])


def assert_charts(server: Server, page: Any, campaign: str | None, final: dict[str, Any]) -> None:
    """Both charts of a page drawn (a uPlot canvas each) with the send log's numbers."""
    page.locator('#charts[data-ready="true"]').wait_for(timeout=15_000)
    sends = page.locator("#chart-sends")
    assert sends.locator("canvas").count() == 1
    assert sends.get_attribute("data-unit") == "day"  # finished: history per day
    with psycopg.connect(server.send_log_dsn) as conn:
        sent_total = conn.execute("select count(*) from mail.send_log where status = 'sent'"
                                  + (" and campaign = %s" if campaign else ""),
                                  (campaign,) if campaign else ()).fetchone()[0]
    assert int(sends.get_attribute("data-total") or -1) == sent_total
    plan = page.locator("#plan-box")
    if campaign:  # scheduled: planned vs sent, cumulative, both ending at the campaign's totals
        assert plan.is_visible() and plan.locator("canvas").count() == 1
        chart = page.locator("#chart-plan")
        assert int(chart.get_attribute("data-planned") or -1) == final["total"] - final["cancelled"]
        assert int(chart.get_attribute("data-sent") or -1) == final["sent"]
    else:
        assert not plan.is_visible()
    assert page.evaluate("typeof uPlot") == "function"
    assert all(src.startswith(server.base_url) for src in page.evaluate(
        "Array.from(document.querySelectorAll('script[src], link[href]')).map(e => e.src || e.href)"))


# -- the page in a real browser -------------------------------------------------------------------------

def dom_counts(root: Any) -> dict[str, int]:
    return {f: int(root.locator(f'[data-field="{f}"]').first.text_content()) for f in COUNT_FIELDS}


def test_the_page_shows_the_send_log_and_follows_a_dispatch(server: Server, browser: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    context.add_cookies([{"name": "_token", "value": server.token("viewer"), "url": server.base_url}])
    try:
        _page_story(server, context)
    finally:
        context.close()


def _page_story(server: Server, context: Any) -> None:
    before = progress_sql(server.send_log_dsn)
    total = before[CAMPAIGN]["total"]
    assert before[CAMPAIGN]["pending"] == total > 100 and before[CAMPAIGN]["active"] is True

    # the list: one row per campaign, counts = SQL; live (server-sent events) because one is active
    listing = context.new_page()
    listing.goto(f"{server.base_url}/mailflow/?live=poll")  # this page uses the polling fallback
    listing.locator(f'tr[data-campaign="{CAMPAIGN}"]').wait_for()
    rows = listing.locator("#campaigns tbody tr")
    assert sorted(rows.nth(i).get_attribute("data-campaign") for i in range(rows.count())) == sorted(before)
    for name, want in before.items():
        assert dom_counts(listing.locator(f'tr[data-campaign="{name}"]')) == {f: want[f] for f in COUNT_FIELDS}
    listing.locator('#live[data-state="polling"]').wait_for(timeout=10_000)

    # the campaign page, live over server-sent events
    page = context.new_page()
    page.goto(f"{server.base_url}/mailflow/campaigns/{CAMPAIGN}")
    page.locator('#live[data-state="streaming"]').wait_for(timeout=10_000)
    assert dom_counts(page.locator("#progress")) == {f: before[CAMPAIGN][f] for f in COUNT_FIELDS}
    page.screenshot(path=str(ARTIFACTS / "campaign_before.png"), full_page=True)

    # a real dispatch through the emulator, paced at 2 requests/s, 40 emails per request
    result: dict[str, Any] = {}

    def dispatch() -> None:
        closers: list[Any] = []
        try:
            conn = psycopg.connect(server.send_log_dsn)
            closers.append(conn)
            client = make_client(server.send_log_dsn, server.emulator, closers, requests_per_second=2)
            result["summary"] = scheduled.dispatch(
                conn, client, renderer(), batch_size=40, coalesce_seconds=0, budget_seconds=60,
                run=RunContext(dag_id="dispatch_scheduled_emails", run_id="e2e-progress", task_id="dispatch"))
        except BaseException as exc:  # reported by the main thread
            result["error"] = exc
        finally:
            for c in reversed(closers):
                c.close()

    seen: list[int] = []
    worker = threading.Thread(target=dispatch, name="dispatch")
    worker.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and page.locator("#live").get_attribute("data-state") != "done":
        sent = int(page.locator('#progress [data-field="sent"]').text_content() or 0)
        if not seen or seen[-1] != sent:
            seen.append(sent)
            if 0 < sent < total and len(seen) == 2:
                page.screenshot(path=str(ARTIFACTS / "campaign_during.png"), full_page=True)
        time.sleep(0.1)
    worker.join(timeout=30)
    assert "error" not in result, result.get("error")
    assert page.locator("#live").get_attribute("data-state") == "done", f"still live; sent values seen: {seen}"

    after = progress_sql(server.send_log_dsn)
    final = after[CAMPAIGN]
    summary = result["summary"]
    assert final["sent"] == summary.sent > 0 and final["pending"] == final["sending"] == 0
    assert final["campaign_status"] == "completed" and final["active"] is False
    # the page moved while the dispatch ran, and ends on the SQL's counts
    assert any(0 < v < final["sent"] for v in seen), f"no intermediate count seen: {seen}"
    assert seen == sorted(seen)
    assert dom_counts(page.locator("#progress")) == {f: final[f] for f in COUNT_FIELDS}
    assert page.locator('#progress [data-field="percent_done"]').text_content() == "100.0"
    recent = page.locator('#recent [data-field="email"]')
    assert recent.count() == 20 and all("***@" in (recent.nth(i).text_content() or "") for i in range(20))

    # the polling page followed too, and stopped
    listing.locator('#live[data-state="done"]').wait_for(timeout=15_000)
    assert dom_counts(listing.locator(f'tr[data-campaign="{CAMPAIGN}"]')) == {f: final[f] for f in COUNT_FIELDS}
    generated = listing.locator("#updated").get_attribute("data-generated-at")
    time.sleep(2.5)  # two refresh periods: nothing is fetched any more
    assert listing.locator("#updated").get_attribute("data-generated-at") == generated
    # the charts (uPlot, served by the plugin: no CDN): drawn on canvases from the series API, whose
    # totals equal the send log's
    assert_charts(server, page, CAMPAIGN, final)
    assert_charts(server, listing, None, final)
    page.screenshot(path=str(ARTIFACTS / "campaign.png"), full_page=True)
    listing.screenshot(path=str(ARTIFACTS / "list.png"), full_page=True)

    # inside the Airflow UI: the navigation entry's page frames the same view
    ui = context.new_page()
    ui.goto(f"{server.base_url}/plugin/mailflow")
    framed = ui.frame_locator("iframe").first
    framed.locator(f'tr[data-campaign="{CAMPAIGN}"]').wait_for(timeout=30_000)
    assert dom_counts(framed.locator(f'tr[data-campaign="{CAMPAIGN}"]')) == {f: final[f] for f in COUNT_FIELDS}
    ui.screenshot(path=str(ARTIFACTS / "airflow_ui.png"))


# -- the page's faults: chart ranges, a 1280 px window, outcomes and the reputation guard ---------------

def open_page(server: Server, browser: Any, path: str, width: int = 1400) -> tuple[Any, Any]:
    context = browser.new_context(viewport={"width": width, "height": 900})
    context.add_cookies([{"name": "_token", "value": server.token("viewer"), "url": server.base_url}])
    page = context.new_page()
    page.goto(f"{server.base_url}/mailflow/{path}")
    return context, page


def test_one_day_of_sends_is_a_chart_of_one_day(server: Server, browser: Any) -> None:
    """A lifecycle campaign sent on one day: the x range is that day, half a day on each side (uPlot
    alone widens a single time point to 1,000 days)."""
    with psycopg.connect(server.send_log_dsn) as conn:
        days = conn.execute("select distinct (sent_at at time zone 'UTC')::date from mail.send_log"
                            " where campaign = 'first_practice' and status = 'sent'").fetchall()
    assert len(days) == 1
    day = datetime(days[0][0].year, days[0][0].month, days[0][0].day, tzinfo=UTC).timestamp()
    context, page = open_page(server, browser, "campaigns/first_practice")
    try:
        page.locator('#charts[data-ready="true"]').wait_for(timeout=15_000)
        sends = page.locator("#chart-sends")
        assert sends.get_attribute("data-unit") == "day" and sends.get_attribute("data-points") == "1"
        assert (float(sends.get_attribute("data-scale-min") or 0), float(sends.get_attribute("data-scale-max") or 0)) == (
            day - 43200, day + 43200)
        page.screenshot(path=str(ARTIFACTS / "one_day.png"), full_page=True)
    finally:
        context.close()


def test_the_campaign_list_fits_a_1280_px_window(server: Server, browser: Any) -> None:
    context, page = open_page(server, browser, "", width=1280)
    try:
        page.locator(f'tr[data-campaign="{CAMPAIGN}"]').wait_for()
        widths = page.evaluate("({doc: document.documentElement.scrollWidth, view: document.documentElement.clientWidth,"
                               " table: document.querySelector('#campaigns').getBoundingClientRect().right,"
                               " eta: document.querySelector('#campaigns th:last-child').getBoundingClientRect().right})")
        page.screenshot(path=str(ARTIFACTS / "list_1280.png"), full_page=True)
        assert widths["doc"] <= widths["view"] <= 1280, widths
        assert widths["eta"] <= widths["table"] <= widths["view"], widths
        assert page.locator("#campaigns th:last-child").text_content() == "ETA"
        assert page.locator("#campaigns th:last-child").is_visible()
        page.screenshot(path=str(ARTIFACTS / "list_1280.png"), full_page=True)
    finally:
        context.close()


def shown_rate(value: Any) -> str:
    """progress.js's rate(): percent with one decimal, two below 1% (toFixed rounds a tie up here)."""
    from decimal import ROUND_HALF_UP, Decimal

    v = Decimal(str(value)) * 100
    return f"{v.quantize(Decimal('0.01' if v < 1 else '0.1'), rounding=ROUND_HALF_UP)}%"


def test_the_page_shows_outcome_rates_and_the_guard(server: Server, browser: Any) -> None:
    """Outcomes of first_practice's emails (as the webhook receiver records them) and a tripped guard:
    the list and the campaign page show the rates of mail.campaign_outcomes and the guard's reason."""
    reason = "hard-bounce rate 0.25 over 0.04 (sample 4)"
    with psycopg.connect(server.send_log_dsn) as conn:
        ids = [r[0] for r in conn.execute("select id, provider_message_id from mail.send_log where campaign ="
                                          " 'first_practice' and status = 'sent' order by id limit 4").fetchall()]
        conn.execute(
            "insert into mail.delivery_status (send_log_id, provider_message_id, last_event, delivered_at,"
            " hard_bounced_at, complained_at, outcome)"
            " select l.id, l.provider_message_id, 'delivered', case when l.id <> %(hb)s then now() end,"
            " case when l.id = %(hb)s then now() end, case when l.id = %(c)s then now() end,"
            " case when l.id = %(hb)s then 'hard_bounced' when l.id = %(c)s then 'complained' else 'delivered' end"
            " from mail.send_log l where l.id = any(%(ids)s)", {"ids": ids, "hb": ids[0], "c": ids[1]})
        conn.execute("insert into mail.reputation_guard (scope, name, state, tripped_at, reason)"
                     " values ('campaign', 'first_practice', 'tripped', now(), %s)"
                     " on conflict (scope, name) do update set state = excluded.state,"
                     " tripped_at = excluded.tripped_at, reason = excluded.reason", (reason,))
        conn.commit()
        cur = conn.execute("select delivered_rate, hard_bounce_rate, complaint_rate, sent, delivered, hard_bounced,"
                           " complained from mail.campaign_outcomes where campaign = 'first_practice'")
        want = cur.fetchone()
    assert want is not None and want[4:] == (3, 1, 1) and want[3] > 4
    expected = {"delivered_rate": shown_rate(want[0]), "hard_bounce_rate": shown_rate(want[1]),
                "complaint_rate": shown_rate(want[2])}
    try:
        context, page = open_page(server, browser, "campaigns/first_practice")
        try:
            page.locator('#outcomes [data-field="guard_state"]').wait_for()
            assert {k: page.locator(f'#outcomes [data-field="{k}"]').text_content() for k in expected} == expected
            assert page.locator('#outcomes [data-field="guard_state"]').text_content() == "tripped"
            assert page.locator('#outcomes [data-field="guard_reason"]').text_content() == reason
            page.screenshot(path=str(ARTIFACTS / "outcomes.png"), full_page=True)
            listing = context.new_page()
            listing.goto(f"{server.base_url}/mailflow/")
            row = listing.locator('tr[data-campaign="first_practice"]')
            row.wait_for()
            assert {k: row.locator(f'[data-field="{k}"]').text_content() for k in expected} == expected
            guard = row.locator('[data-field="guard_state"]')
            assert (guard.text_content(), guard.get_attribute("title")) == ("tripped", reason)
            other = listing.locator(f'tr[data-campaign="{CAMPAIGN}"] [data-field="guard_state"]')
            assert other.text_content() == "ok"
        finally:
            context.close()
    finally:
        with psycopg.connect(server.send_log_dsn) as conn:
            conn.execute("delete from mail.reputation_guard")
            conn.execute("delete from mail.delivery_status where send_log_id = any(%s)", (ids,))
