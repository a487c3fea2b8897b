"""`make airflow` then `make stop`, as a newcomer runs them (issue 17).

``scripts/airflow_local.py up`` (the recipe of ``make airflow``) in a state directory of its own
(``MAILFLOW_DEMO_STATE``): embedded PostgreSQL, demo data, the emulator and ``airflow standalone``
in the background. Then, through the REST API and in Chromium (Debian's package, Playwright):

* it printed the URL and the login, and that login works;
* the DAG list holds exactly the package's DAGs, without import errors, and it said they are paused;
  the pool exists;
* the three connections are in the metadata database (Admin -> Connections lists them) and the
  connection "Test" button works (Airflow 3 disables it unless configured);
* unpausing ``lifecycle_emails`` runs it against the embedded send log and the emulator (the
  connections work) and it succeeds;
* screenshots: the DAG list, the progress page list and a scheduled campaign with both charts
  (``artifacts/test_make_airflow/``);
* ``make demo`` meanwhile uses the same emulator and audits clean;
* ``make stop`` stops it (SIGINT to the standalone) and no process of it is left: nothing whose
  command line or environment names the state directory, no member of their process groups, and
  the embedded server is down.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import ROOT

from mailflow_dev import devenv
from mailflow_dev.airflow_local import AirflowApi, free_port, group_alive

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "artifacts" / "test_make_airflow"
DAGS = sorted(p.stem for p in (ROOT / "dags").glob("*.py"))


def processes_of(state: Path) -> list[tuple[int, int, str]]:
    """Live (not zombie) processes whose command line or environment names ``state``:
    ``(pid, pgid, command)``."""
    needle = str(state).encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if stat[0] != "Z" and (needle in cmd or needle + b"\0" in env or needle + b"/" in env):
            found.append((int(d.name), int(stat[2]), cmd.replace(b"\0", b" ").decode(errors="replace")[:200]))
    return found


@pytest.fixture
def state() -> Iterator[Path]:
    # short and world-readable: as root the embedded server runs as its own user (see test_demo_twice)
    path = Path(tempfile.mkdtemp(prefix="mf-airflow-"))
    path.chmod(0o755)
    env = {**os.environ, "MAILFLOW_DEMO_STATE": str(path)}
    yield path
    # whatever happened: stop what the test started, by its PID files and its data directory
    subprocess.run([sys.executable, str(ROOT / "scripts" / "airflow_local.py"), "down"], env=env,
                   capture_output=True, timeout=120)
    devenv.stop_embedded(path / "pgdata")
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def chromium() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (see .ci/run)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            browser.close()


def test_make_airflow_shows_the_dags_and_the_charts_and_make_stop_leaves_nothing(state: Path, chromium: Any) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({"MAILFLOW_DEMO_STATE": str(state), "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(ROOT / "include")})
    port = free_port()
    t0 = time.monotonic()
    up = subprocess.run([sys.executable, str(ROOT / "scripts" / "airflow_local.py"), "up", "--port", str(port)],
                        env=env, text=True, capture_output=True, timeout=600, cwd=str(ROOT))
    print(f"\nmake airflow: {time.monotonic() - t0:.1f} s\n{up.stdout}")
    assert up.returncode == 0, up.stdout + up.stderr
    m = re.search(r"Airflow UI: +(http://127\.0\.0\.1:\d+)/ +login: (\w+) / (\S+)", up.stdout)
    assert m, up.stdout
    base, user, password = m.groups()
    assert base == f"http://127.0.0.1:{port}" and user == "admin"
    assert "make stop" in up.stdout
    assert "connections (Admin -> Connections): send_log_db created, resend_default created, mail_unsubscribe " \
        "created" in up.stdout
    assert f"DAGs paused: {', '.join(DAGS)} (unpause one to send)" in up.stdout and "unpaused" not in up.stdout
    pid = int((state / "airflow-local" / "standalone.pid").read_text())
    emulator_pid = int((state / "airflow-local" / "emulator.pid").read_text())

    api = AirflowApi(base, credentials=(user, password))
    try:
        api.wait_ready(30)
        dags = api.get("dags", limit=100)["dags"]
        assert sorted(d["dag_id"] for d in dags) == DAGS
        assert api.get("importErrors")["total_entries"] == 0
        assert api.get("pools/email_provider")["slots"] == 4
        conns = {c["connection_id"]: c for c in api.get("connections", limit=100)["connections"]}
        assert {"send_log_db", "resend_default", "mail_unsubscribe"} <= set(conns)
        assert (conns["send_log_db"]["conn_type"], conns["send_log_db"]["schema"]) == ("postgres", "mailflow_demo")
        tested = api.post("connections/test", {k: v for k, v in conns["send_log_db"].items()
                                               if k in ("connection_id", "conn_type", "host", "port", "login",
                                                        "schema")})
        assert tested["status"] is True, tested
        # the connections work: the lifecycle DAG's one scheduled run (catchup=False) sends the demo data
        api.set_paused("lifecycle_emails", False)
        deadline = time.monotonic() + 240
        while not (runs := api.dag_runs("lifecycle_emails")) and time.monotonic() < deadline:
            time.sleep(1)
        assert len(runs) == 1, runs
        (run,) = api.wait_runs("lifecycle_emails", [runs[0]["dag_run_id"]], timeout=300)
        assert run["state"] == "success", api.task_instances("lifecycle_emails", run["dag_run_id"])
        api.set_paused("lifecycle_emails", True)
        token = api.http.headers["Authorization"].split(" ", 1)[1]
    finally:
        api.close()
    send_log = devenv.with_dbname(devenv.embedded_dsn(state / "pgdata"), "mailflow_demo")
    with psycopg.connect(send_log) as conn:
        sent = conn.execute("select count(*) from mail.send_log where status = 'sent' and run_id = %s",
                            (run["dag_run_id"],)).fetchone()[0]
    assert sent > 0

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    context = chromium.new_context(viewport={"width": 1400, "height": 900})
    context.add_cookies([{"name": "_token", "value": token, "url": base}])
    try:
        page = context.new_page()
        page.goto(f"{base}/dags")
        for dag_id in DAGS:
            page.get_by_text(dag_id, exact=True).first.wait_for(timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "dag_list.png"), full_page=True)

        page.goto(f"{base}/mailflow/campaigns/demo_outreach")
        page.locator('#charts[data-ready="true"]').wait_for(timeout=30_000)
        assert page.locator("#chart-sends canvas").count() == 1
        assert page.locator("#plan-box").is_visible() and page.locator("#chart-plan canvas").count() == 1
        with psycopg.connect(send_log) as conn:
            planned = conn.execute("select count(*) from mail.send_log where campaign = 'demo_outreach'"
                                   " and status <> 'cancelled'").fetchone()[0]
        assert int(page.locator("#chart-plan").get_attribute("data-planned") or -1) == planned > 0
        page.screenshot(path=str(ARTIFACTS / "progress_scheduled_campaign.png"), full_page=True)

        page.goto(f"{base}/mailflow/campaigns/upgrade_offer")
        page.locator('#charts[data-ready="true"]').wait_for(timeout=30_000)
        assert page.locator("#chart-sends canvas").count() == 1 and not page.locator("#plan-box").is_visible()
        page.screenshot(path=str(ARTIFACTS / "progress_lifecycle_campaign.png"), full_page=True)

        page.goto(f"{base}/mailflow/")
        page.locator('#charts[data-ready="true"]').wait_for(timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "progress_list.png"), full_page=True)
        page.goto(f"{base}/plugin/mailflow")  # inside the Airflow UI (Browse > Mail campaigns)
        page.frame_locator("iframe").first.locator('#charts[data-ready="true"]').wait_for(timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "airflow_ui_progress.png"))
    finally:
        context.close()

    # make demo while make airflow runs on the same database: it shares the emulator (one process owns
    # the outbox and the idempotency memory), leaves the server it did not start, and audits clean
    demo = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--users", "300"], env=env, text=True,
                          capture_output=True, timeout=600, cwd=str(ROOT))
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "the one of `make airflow`" in demo.stdout and "this demo did not start it" in demo.stdout
    audit = next(x for x in demo.stdout.splitlines() if x.startswith("audit (send log vs outbox): "))
    assert "duplicate_deliveries=0, sent_without_delivery=0, delivered_without_sent=0, provider_id_mismatch=0" in audit
    assert devenv.pid_alive(pid) and devenv.pid_alive(emulator_pid)

    # make stop, as the Makefile runs it (-o: never rebuild the shared venv from here)
    t1 = time.monotonic()
    stop = subprocess.run(["make", "-s", "-o", ".venv/.installed", "stop"], env=env, text=True,
                          capture_output=True, timeout=300, cwd=str(ROOT))
    print(f"make stop: {time.monotonic() - t1:.1f} s\n{stop.stdout}{stop.stderr}")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    # SIGINT stops it cleanly (standalone stops its components one by one); on a machine loaded by
    # other work that can take longer than make stop's 120 s, and then the escalation is the contract
    assert (f"airflow standalone: pid {pid}: stopped on SIGINT" in stop.stdout
            or f"airflow standalone: pid {pid}: still running 120 s after SIGINT; SIGTERM to process group {pid}"
            in stop.stdout), stop.stdout
    assert f"emulator: pid {emulator_pid}: stopped on SIGINT" in stop.stdout
    time.sleep(1)
    assert not group_alive(pid) and not group_alive(emulator_pid)
    assert processes_of(state) == []
    assert not devenv.embedded_running(state / "pgdata")
    if not os.environ.get("TEST_DATABASE_URL"):  # the suite's own embedded server is in use: left alone
        assert devenv.embedded_running(devenv.TEST_PGDATA)
        assert f"embedded PostgreSQL {devenv.TEST_PGDATA}: left running: in use by pid {os.getpid()}" in stop.stdout
