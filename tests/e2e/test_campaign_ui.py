"""A scheduled campaign from the Airflow UI, end to end: real ``airflow standalone`` (scheduler,
API server, DAG processor; LocalExecutor) driven only through the REST API v2 the UI uses, the
send log on the test PostgreSQL server and the emulator as the provider.

1. ``campaign_create`` with the form's fields as the run conf: a draft (start now, a window covering
   the whole day on every weekday, emails spread ~20 s apart).
2. ``provision_campaign`` by name with a test email: the approval waits as a Required Action (state
   ``awaiting_input``), its body shows the plan and the test email; it is answered Approve through
   ``PATCH .../taskInstances/approve/-1/hitlDetails``, and the campaign becomes scheduled.
3. ``dispatch_scheduled_emails`` (unpaused, every minute) sends; ``campaign_control`` pauses (no
   more sends), resumes (more sends) and cancels (every pending row cancelled).
4. A second campaign whose approval is answered Reject stays a draft with no send-log row; an
   unknown campaign name fails ``plan`` once, without retries.

Timing: ~30 s for Airflow to come up, then ~4 min of runs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET

from mailflow.emulator.testing import EmulatorProcess
from mailflow.store.migrate import migrate
from mailflow_dev import devenv
from mailflow_dev.airflow_local import (
    POOL,
    VENV_BIN,
    AirflowApi,
    Proc,
    airflow_env,
    free_port,
    group_alive,
    mailflow_connections,
)

DAGS = ("campaign_create", "provision_campaign", "campaign_control", "dispatch_scheduled_emails")
USERS = 10
SPACING = 20.0  # seconds between two planned sends


@dataclass
class Rig:
    api: AirflowApi
    standalone: Proc
    dsn: str
    emulator: EmulatorProcess


@pytest.fixture
def rig(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("campaign-ui")
    suffix = uuid.uuid4().hex[:8]
    meta_db, log_db = f"airflow_ui_{suffix}", f"mailflow_ui_{suffix}"
    meta_dsn = devenv.create_database(pg_admin_dsn, meta_db, exist_ok=False)
    dsn = devenv.create_database(pg_admin_dsn, log_db, exist_ok=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        from mailflow_dev.demo.loader import schema_sql

        conn.execute(schema_sql())
        conn.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                     " select i, 'ui' || i || '@example.com', 'N' || i, '2025-01-01', 'UTC', 'free'"
                     " from generate_series(1, %s) as i", (USERS,))
    emulator = EmulatorProcess(outbox=tmp / "outbox.jsonl", rate_limit=10, seed=1).start()
    port = free_port()
    env = airflow_env(tmp / "home", meta_dsn, api_port=port, connections=mailflow_connections(
        dsn, emulator.base_url, emulator.api_key, UNSUBSCRIBE_SECRET))
    standalone = Proc("airflow standalone", [str(VENV_BIN / "airflow"), "standalone"], env, tmp / "standalone.log")
    api = AirflowApi(f"http://127.0.0.1:{port}")
    standalone.start()
    try:
        api.wait_ready(240, [standalone])
        for dag_id in DAGS:
            api.wait_dag(dag_id, timeout=180)
        yield Rig(api, standalone, dsn, emulator)
    finally:
        api.close()
        how = standalone.stop(timeout=45)
        print(f"\nairflow standalone (pid {standalone.pid}): {how}; log {standalone.log}")
        emulator.stop()
        devenv.drop_database(pg_admin_dsn, meta_db)
        devenv.drop_database(pg_admin_dsn, log_db)
        assert not group_alive(standalone.pid), "processes of airflow standalone outlived stop()"


#: seconds between seeing the approval wait and answering it (see answer_approval)
AWAIT_SETTLE_SECONDS = 5.0


def wait_for(what: str, check: Any, timeout: float, every: float = 1.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def run_to_end(api: AirflowApi, dag_id: str, conf: dict[str, Any]) -> tuple[str, str]:
    run = api.trigger(dag_id, conf=conf)
    [done] = api.wait_runs(dag_id, [run["dag_run_id"]], timeout=180)
    return run["dag_run_id"], done["state"]


def states(api: AirflowApi, dag_id: str, run_id: str) -> dict[str, str | None]:
    return {t["task_id"]: t["state"] for t in api.task_instances(dag_id, run_id)}


def answer_approval(api: AirflowApi, run_id: str, option: str) -> dict[str, Any]:
    """Wait for the Required Action of ``approve`` and answer it as the UI does; return its detail."""
    path = f"dags/provision_campaign/dagRuns/{run_id}/taskInstances/approve/-1/hitlDetails"
    wait_for("approval awaiting input",
             lambda: states(api, "provision_campaign", run_id).get("approve") == "awaiting_input", 180)
    # A person answers seconds later, not milliseconds: an answer that lands before the executor has
    # reported the paused task's process as ended makes Airflow 3.3.2's scheduler see a queued task that
    # "finished with state success" and run it again, which asks again (seen in a CI run). Wait for the
    # process to be reaped, then check the task still waits.
    time.sleep(AWAIT_SETTLE_SECONDS)
    assert states(api, "provision_campaign", run_id).get("approve") == "awaiting_input"
    detail = dict(api.get(path))
    api.patch(path, {"chosen_options": [option], "params_input": {}})
    return detail


def rows(dsn: str, campaign: str) -> dict[str, int]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute("select status, count(*) from mail.send_log where campaign = %s group by status",
                                 (campaign,)).fetchall())


def campaign_status(dsn: str, name: str) -> str | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("select status from mail.campaign where name = %s", (name,)).fetchone()
    return row[0] if row else None


def definition(name: str) -> dict[str, Any]:
    now = datetime.now(UTC)
    left = (now.replace(hour=0, minute=0, second=0, microsecond=0) + timedelta(days=1) - now).total_seconds()
    return {"name": name, "template": "outreach", "subject": "Hello {{ user.first_name }}",
            "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
            "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-24:00"],
            # the day's emails are spread over what is left of it: one every SPACING seconds
            "emails_per_day": max(USERS, int(left / SPACING))}


@pytest.mark.xfail(strict=False, reason=(
    "flaky on a loaded 2-core machine: a provision_campaign run whose approval was rejected through the REST "
    "API stayed 'running' past 120 s in one CI run of three (cause not found yet; the same path passes "
    "under dag.test in tests/airflow/test_campaign_dags.py). Investigate, then remove this mark."))
def test_a_campaign_from_the_ui(rig: Rig) -> None:
    api, dsn = rig.api, rig.dsn
    api.ensure_pool(*POOL)
    for dag_id in ("campaign_create", "provision_campaign", "campaign_control"):
        api.set_paused(dag_id, False)

    # 1. the create form
    run_id, state = run_to_end(api, "campaign_create", definition("ui_spring"))
    assert state == "success", states(api, "campaign_create", run_id)
    assert campaign_status(dsn, "ui_spring") == "draft"

    # 2. provision by name: plan, test email, approval in Required Actions
    run = api.trigger("provision_campaign", conf={"campaign": "ui_spring", "test_email_to": "approver@example.com"})
    detail = answer_approval(api, run["dag_run_id"], "Approve")
    assert detail["subject"] == "Provision campaign ui_spring?"
    assert f"**Recipients to provision:** {USERS}" in detail["body"]
    assert "**Test email** sent to a***@example.com" in detail["body"]
    assert detail["options"] == ["Approve", "Reject"] and detail["defaults"] == ["Reject"]
    [done] = api.wait_runs("provision_campaign", [run["dag_run_id"]], timeout=120)
    assert done["state"] == "success"
    assert states(api, "provision_campaign", run["dag_run_id"])["provision"] == "success"
    assert campaign_status(dsn, "ui_spring") == "scheduled"
    assert rows(dsn, "ui_spring") == {"pending": USERS}
    test_mails = [m for m in rig.emulator.read_outbox() if m["to"] == ["approver@example.com"]]
    assert [m["subject"] for m in test_mails] == ["[TEST] Hello N1"]

    # 3. the dispatcher sends; pause, resume, cancel from campaign_control
    api.set_paused("dispatch_scheduled_emails", False)
    wait_for("two emails sent", lambda: rows(dsn, "ui_spring").get("sent", 0) >= 2, 240)
    run_id, state = run_to_end(api, "campaign_control", {"campaign": "ui_spring", "action": "pause"})
    assert state == "success" and campaign_status(dsn, "ui_spring") == "paused"
    time.sleep(5)  # a batch claimed before the pause finishes
    sent_paused = rows(dsn, "ui_spring").get("sent", 0)
    time.sleep(3 * SPACING)
    assert rows(dsn, "ui_spring").get("sent", 0) == sent_paused  # nothing sent while paused
    run_id, state = run_to_end(api, "campaign_control", {"campaign": "ui_spring", "action": "resume"})
    assert state == "success" and campaign_status(dsn, "ui_spring") == "scheduled"
    wait_for("more emails sent after the resume",
             lambda: rows(dsn, "ui_spring").get("sent", 0) > sent_paused, 180)
    run_id, state = run_to_end(api, "campaign_control", {"campaign": "ui_spring", "action": "cancel"})
    assert state == "success" and campaign_status(dsn, "ui_spring") == "cancelled"
    time.sleep(5)
    final = rows(dsn, "ui_spring")
    assert set(final) <= {"sent", "cancelled"} and sum(final.values()) == USERS, final
    assert 0 < final.get("cancelled", 0) < USERS
    sent_mails = [m for m in rig.emulator.read_outbox() if m["to"] != ["approver@example.com"]]
    assert len(sent_mails) == final["sent"]

    # 4. a rejected approval leaves a draft and nothing scheduled
    run_id, state = run_to_end(api, "campaign_create", definition("ui_rejected"))
    assert state == "success"
    run = api.trigger("provision_campaign", conf={"campaign": "ui_rejected"})
    answer_approval(api, run["dag_run_id"], "Reject")
    [done] = api.wait_runs("provision_campaign", [run["dag_run_id"]], timeout=120)
    assert states(api, "provision_campaign", run["dag_run_id"])["provision"] == "skipped"
    assert campaign_status(dsn, "ui_rejected") == "draft"
    assert rows(dsn, "ui_rejected") == {}

    # an unknown name fails the first task once (no retries)
    run_id, state = run_to_end(api, "provision_campaign", {"campaign": "no_such_campaign"})
    assert state == "failed"
    [plan] = [t for t in api.task_instances("provision_campaign", run_id) if t["task_id"] == "plan"]
    assert (plan["state"], plan["try_number"]) == ("failed", 1)


