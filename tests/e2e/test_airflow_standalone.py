"""Real Airflow, end to end: ``airflow standalone`` (scheduler, API server, DAG processor,
triggerer; LocalExecutor) with a temporary AIRFLOW_HOME and its metadata database on the test
PostgreSQL server, driven only through the REST API v2 that the UI uses.

The story (H = the current hour, UTC; every user below is a ``first_practice`` candidate, i.e.
signed up at the given time and never started an assessment, unless said otherwise):

1. Pool ``email_provider`` (4 slots) is created through the API; the DAG was created paused
   and has been "paused" since its start_date (2026-01-01).
2. Unpause: ``catchup=False`` creates exactly ONE scheduled run, for [H-1h, H): it sends the
   current interval's audience (d1 signed up H-30h, d2 H-90min, d3 an unfinished assessment
   started H-40min -> finish_assessment), not a flood of catch-up runs.
   At the same time a backfill over 3 intervals 3.5 days old with ``allow_old_interval=true``
   (b1, b2, b3 signed up inside [H-85h, H-84h), [H-84h, H-83h), [H-83h, H-82h)): each run
   sends exactly its own interval's user. The send task has ``max_active_tis_per_dag=1``, so
   the scheduled run and the backfill never overlap (checked from the task instances' times).
3. A backfill with default Params over 2 intervals 2.5 days old (a1, a2): 0 sent; every
   campaign's summary says why (interval older than max_interval_age).
4. A manual run with Params (campaign subset, chunk size 1, allow_old_interval) for
   [H-59h, H-58h): sends a1 and a2 in 2 batches; an invalid Param is refused with HTTP 400.
5. Late data for recent hours (c1 in [H-4h, H-3h), c2 in [H-3h, H-2h)), then a backfill with
   default Params over those 2 recent intervals: each sends its interval's user.

Finally: every user was emailed exactly once (send log, emulator outbox and the audit agree),
no 429s, and everything started here is stopped by PID.

Timing: ~25 s for Airflow to come up (the first run also migrates its metadata DB), then ~10 runs.
If the hour would roll over during the test, it first waits for the new hour (the scheduler
would otherwise create a second scheduled run whose 2-day window takes the late-data users).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from compose_rig import AIRFLOW_SERVICES, COMPOSE_SECRETS, compose_config, env_of
from conftest import ROOT, UNSUBSCRIBE_SECRET

from mailflow import cli
from mailflow.emulator.testing import EmulatorProcess
from mailflow.store.migrate import migrate
from mailflow_dev import devenv
from mailflow_dev.airflow_local import (
    VENV_BIN,
    AirflowApi,
    Proc,
    airflow_env,
    free_port,
    group_alive,
    mailflow_connections,
)

DAG = "lifecycle_emails"
TASK = "send_campaigns"
H_ = timedelta(hours=1)
MIN = timedelta(minutes=1)
TEST_BUDGET = timedelta(minutes=4)  # if fewer remain in the hour, start after the hour turns


def iso(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def wait_for_a_quiet_hour() -> datetime:
    """The current hour H; first sleeps past the next hour boundary if it is closer than the budget."""
    now = datetime.now(UTC)
    nxt = now.replace(minute=0, second=0, microsecond=0) + H_
    if nxt - now < TEST_BUDGET:
        time.sleep((nxt - now).total_seconds() + 2)
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


@dataclass
class Deployment:
    api: AirflowApi
    standalone: Proc
    send_log_dsn: str
    emulator: EmulatorProcess
    hour: datetime
    started_in: float


@pytest.fixture  # one test uses it; stopped before the next test starts its own cluster
def airflow(pg_admin_dsn: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    hour = wait_for_a_quiet_hour()
    tmp = tmp_path_factory.mktemp("airflow-e2e")
    suffix = uuid.uuid4().hex[:8]
    meta_db, log_db = f"airflow_e2e_{suffix}", f"mailflow_e2e_{suffix}"
    meta_dsn = devenv.create_database(pg_admin_dsn, meta_db, exist_ok=False)
    send_log_dsn = devenv.create_database(pg_admin_dsn, log_db, exist_ok=False)
    with psycopg.connect(send_log_dsn, autocommit=True) as conn:
        migrate(conn)
        from mailflow_dev.demo.loader import schema_sql

        conn.execute(schema_sql())
    emulator = EmulatorProcess(outbox=tmp / "outbox.jsonl", rate_limit=10, seed=1).start()
    port = free_port()
    env = airflow_env(tmp / "home", meta_dsn, api_port=port, connections=mailflow_connections(
        send_log_dsn, emulator.base_url, emulator.api_key, UNSUBSCRIBE_SECRET))
    standalone = Proc("airflow standalone", [str(VENV_BIN / "airflow"), "standalone"], env,
                      tmp / "standalone.log")
    api = AirflowApi(f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    standalone.start()
    try:
        api.wait_ready(240, [standalone])
        api.wait_dag(DAG, timeout=120)
        yield Deployment(api, standalone, send_log_dsn, emulator, hour, time.monotonic() - t0)
    finally:
        api.close()
        t1 = time.monotonic()
        how = standalone.stop(timeout=45)
        print(f"\nairflow standalone (pid {standalone.pid}): {how} in {time.monotonic() - t1:.1f} s;"
              f" log {standalone.log}")
        emulator.stop()
        devenv.drop_database(pg_admin_dsn, meta_db)
        devenv.drop_database(pg_admin_dsn, log_db)
        assert not group_alive(standalone.pid), "processes of airflow standalone outlived stop()"


# -- the population -----------------------------------------------------------------------------

def add_user(conn: psycopg.Connection, uid: int, name: str, signed_up_at: datetime) -> None:
    conn.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                 " values (%s, %s, %s, %s, 'UTC', 'free')", (uid, f"{name}@example.com", name, signed_up_at))


def add_open_assessment(conn: psycopg.Connection, aid: int, uid: int, started_at: datetime) -> None:
    conn.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at)"
                 " values (%s, %s, 'numerical', true, %s)", (aid, uid, started_at))


def seed(conn: psycopg.Connection, h: datetime) -> dict[str, datetime]:
    """Users placed inside specific hours; returns name -> the start of the hour they belong to."""
    placed = {"b1": h - 85 * H_, "b2": h - 84 * H_, "b3": h - 83 * H_,  # backfill, allow_old_interval
              "a1": h - 61 * H_, "a2": h - 60 * H_}  # backfill (default: nothing) then a manual run
    for uid, (name, start) in enumerate(placed.items(), start=1):
        add_user(conn, uid, name, start + 20 * MIN)
    add_user(conn, 10, "d1", h - 30 * H_)  # all three: the audience of the scheduled run [H-1h, H)
    add_user(conn, 11, "d2", h - 90 * MIN)
    add_user(conn, 12, "d3", h - 10 * 24 * H_)
    add_open_assessment(conn, 1201, 12, h - 40 * MIN)  # -> finish_assessment
    return placed


def add_late_data(conn: psycopg.Connection, h: datetime) -> dict[str, datetime]:
    placed = {"c1": h - 4 * H_, "c2": h - 3 * H_}
    # user ids outside first_practice's holdout group (lifecycle.toml holds out 10%; 21 is a member)
    for uid, (name, start) in enumerate(placed.items(), start=22):
        add_user(conn, uid, name, start + 15 * MIN)
    return placed


def sent_by_run(conn: psycopg.Connection) -> dict[str, list[tuple[str, str]]]:
    """run_id -> [(first_name, campaign)] of its sent rows."""
    out: dict[str, list[tuple[str, str]]] = {}
    for run_id, name, campaign in conn.execute(
            "select l.run_id, u.first_name, l.campaign from mail.send_log l join app.users u using (user_id)"
            " where l.status = 'sent' order by l.run_id, u.first_name").fetchall():
        out.setdefault(run_id, []).append((name, campaign))
    return out


def summary_of(api: AirflowApi, run_id: str) -> list[dict[str, Any]]:
    return list(api.xcom(DAG, run_id, TASK))


def totals(summary: list[dict[str, Any]]) -> tuple[int, int]:
    return sum(s["eligible"] for s in summary), sum(s["sent"] for s in summary)


# -- the test -----------------------------------------------------------------------------------

def test_backfills_params_pool_and_unpause_through_the_rest_api(airflow: Deployment) -> None:
    api, h = airflow.api, airflow.hour
    results: list[tuple[str, str, str, int, int, str]] = []  # for the printed per-interval table
    t_start = time.monotonic()
    with psycopg.connect(airflow.send_log_dsn, autocommit=True) as conn:
        placed = seed(conn, h)

        # 1. the pool the send tasks use, and the DAG as the UI sees it: paused, Params described
        pool = api.ensure_pool("email_provider", 4, "Bounds concurrent send tasks; the pacer enforces the rate")
        assert pool["slots"] == 4
        details = api.get(f"dags/{DAG}/details")
        assert details["is_paused"] is True
        assert details["catchup"] is False and details["max_active_runs"] == 1
        params = details["params"]
        assert set(params) == {"time_budget_seconds", "chunk_size", "campaigns", "dry_run", "allow_old_interval"}
        assert all(p["description"] for p in params.values())
        assert params["chunk_size"]["schema"] == {"type": "integer", "minimum": 1, "maximum": 100}
        assert api.dag_runs(DAG) == []

        # 2. unpause (no catch-up flood) and, at once, a backfill of old intervals with the Param set
        api.set_paused(DAG, False)
        old2 = [h - 85 * H_, h - 84 * H_, h - 83 * H_]
        backfill = api.create_backfill(DAG, iso(old2[0]), iso(old2[-1]), conf={"allow_old_interval": True})
        assert (backfill["max_active_runs"], backfill["dag_run_conf"]) == (1, {"allow_old_interval": True})
        deadline = time.monotonic() + 60
        while not (scheduled := api.dag_runs(DAG, run_type="scheduled")) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(scheduled) == 1, scheduled
        [sched] = scheduled
        assert (sched["data_interval_start"], sched["data_interval_end"]) == (iso(h - H_), iso(h))
        api.wait_backfill(backfill["id"], timeout=180)
        old2_runs = api.runs_between(DAG, iso(old2[0]), iso(old2[-1]), run_type="backfill")
        assert [r["logical_date"] for r in old2_runs] == [iso(t) for t in old2]
        [sched] = api.wait_runs(DAG, [sched["dag_run_id"]], timeout=120)
        assert sched["state"] == "success"
        assert all(r["state"] == "success" for r in old2_runs), old2_runs
        by_run = sent_by_run(conn)
        assert sorted(by_run[sched["dag_run_id"]]) == [("d1", "first_practice"), ("d2", "first_practice"),
                                                      ("d3", "finish_assessment")]
        results.append(("scheduled (unpause)", iso(h - H_), "defaults", *totals(summary_of(api, sched["dag_run_id"])),
                        ", ".join(n for n, _ in by_run[sched["dag_run_id"]])))
        for run, name in zip(old2_runs, ("b1", "b2", "b3"), strict=True):
            assert run["data_interval_start"] == iso(placed[name])
            assert run["conf"] == {"allow_old_interval": True}
            assert by_run[run["dag_run_id"]] == [(name, "first_practice")]
            summary = summary_of(api, run["dag_run_id"])
            assert {s["campaign"]: s["sent"] for s in summary}["first_practice"] == 1
            assert all(s["stopped"] is None for s in summary)
            results.append(("backfill", run["data_interval_start"], "allow_old_interval", *totals(summary), name))

        # the scheduled run and the backfill's runs never ran their send task at the same time
        tis = sorted((api.task_instances(DAG, r["dag_run_id"])[0] for r in [sched, *old2_runs]),
                     key=lambda t: t["start_date"])
        for earlier, later in zip(tis, tis[1:], strict=False):
            assert when(later["start_date"]) >= when(earlier["end_date"]), (earlier, later)
        assert all(t["pool"] == "email_provider" for t in tis)

        # 3. a backfill of old intervals with default Params: the moment has passed, nothing is sent
        old = [h - 61 * H_, h - 60 * H_]
        backfill = api.create_backfill(DAG, iso(old[0]), iso(old[-1]))
        api.wait_backfill(backfill["id"], timeout=120)
        old_runs = api.runs_between(DAG, iso(old[0]), iso(old[-1]), run_type="backfill")
        assert [r["state"] for r in old_runs] == ["success", "success"]
        for i, run in enumerate(old_runs):
            summary = summary_of(api, run["dag_run_id"])
            fp = next(s for s in summary if s["campaign"] == "first_practice")
            assert (fp["eligible"], fp["minted"], fp["sent"]) == (i + 1, 0, 0)  # a1, then a1 and a2
            for s in summary:
                assert s["sent"] == 0 and s["minted"] == 0
                assert "over max_interval_age 6:00:00" in s["stopped"], s
            assert run["dag_run_id"] not in sent_by_run(conn)
            results.append(("backfill", run["data_interval_start"], "defaults", *totals(summary),
                            f"none: {fp['stopped']}"))

        # 4. a manual run with Params (what the trigger form sends); an invalid Param is refused
        with pytest.raises(RuntimeError, match="HTTP 400"):
            api.trigger(DAG, conf={"chunk_size": 101}, logical_date=iso(h - 58 * H_ + 5 * MIN))
        conf = {"campaigns": ["first_practice"], "chunk_size": 1, "allow_old_interval": True}
        manual = api.trigger(DAG, conf=conf, logical_date=iso(h - 58 * H_ + 5 * MIN),
                             data_interval=(iso(h - 59 * H_), iso(h - 58 * H_)), note="e2e: Params")
        [manual] = api.wait_runs(DAG, [manual["dag_run_id"]], timeout=120)
        assert manual["state"] == "success" and manual["run_type"] == "manual"
        [summary] = summary_of(api, manual["dag_run_id"])
        assert (summary["campaign"], summary["sent"], summary["chunks"]) == ("first_practice", 2, 2)
        assert sent_by_run(conn)[manual["dag_run_id"]] == [("a1", "first_practice"), ("a2", "first_practice")]
        results.append(("manual", manual["data_interval_start"], "campaigns, chunk 1, allow_old", summary["eligible"],
                        summary["sent"], "a1, a2"))

        # 5. late data for recent hours, then a backfill of those hours with default Params
        late = add_late_data(conn, h)
        recent = [h - 4 * H_, h - 3 * H_]
        backfill = api.create_backfill(DAG, iso(recent[0]), iso(recent[-1]))
        api.wait_backfill(backfill["id"], timeout=120)
        recent_runs = api.runs_between(DAG, iso(recent[0]), iso(recent[-1]), run_type="backfill")
        by_run = sent_by_run(conn)
        for run, name in zip(recent_runs, ("c1", "c2"), strict=True):
            assert run["state"] == "success"
            assert run["data_interval_start"] == iso(late[name])
            assert by_run[run["dag_run_id"]] == [(name, "first_practice")]
            summary = summary_of(api, run["dag_run_id"])
            assert totals(summary) == (1, 1)  # d1 (sent by the scheduled run) is in cooldown
            results.append(("backfill", run["data_interval_start"], "defaults (recent)", *totals(summary), name))

        # finally: one email per user, outbox == send log, no 429, still one scheduled run
        rows = conn.execute("select u.first_name, count(*) from mail.send_log l join app.users u using (user_id)"
                            " where l.status = 'sent' group by 1 order by 1").fetchall()
        assert rows == [(n, 1) for n in ["a1", "a2", "b1", "b2", "b3", "c1", "c2", "d1", "d2", "d3"]]
        assert conn.execute("select count(*) from mail.send_log where status <> 'sent'").fetchone() == (0,)
        audit = cli.audit(conn, airflow.emulator.outbox_path)
        assert audit == {"delivered": 10, "sent_rows": 10, "duplicate_deliveries": 0, "sent_without_delivery": 0,
                         "delivered_without_sent": 0, "provider_id_mismatch": 0}
        stats = airflow.emulator.stats()
        assert stats["responses_by_status"].get("429", 0) == 0
        assert len(api.dag_runs(DAG, run_type="scheduled")) == 1

    print(f"\nAirflow ready in {airflow.started_in:.1f} s; scenario {time.monotonic() - t_start:.1f} s;"
          f" H = {iso(h)}; provider requests {stats['requests']}, 429s 0")
    print(f"{'run':<22}{'data interval start':<23}{'Params':<32}{'eligible':>9}{'sent':>6}  who")
    for kind, start, conf_text, eligible, sent, who in results:
        print(f"{kind:<22}{start:<23}{conf_text:<32}{eligible:>9}{sent:>6}  {who}")


# -- docker-compose.yaml (no Docker engine here: `docker compose config` only) ------------------


def test_docker_compose_config_has_what_the_package_needs() -> None:
    import json

    model, how = compose_config(COMPOSE_SECRETS)
    print(f"\ncompose model from: {how}")
    services = model["services"]
    assert {"postgres", "redis", "mailflow-emulator", *AIRFLOW_SERVICES} <= set(services)
    commands = {name: services[name].get("command") for name in AIRFLOW_SERVICES}
    norm = {k: " ".join(v) if isinstance(v, list) else v for k, v in commands.items()}
    assert norm["airflow-apiserver"] == "api-server" and norm["airflow-scheduler"] == "scheduler"
    assert norm["airflow-dag-processor"] == "dag-processor" and norm["airflow-triggerer"] == "triggerer"
    assert norm["airflow-worker-1"] == norm["airflow-worker-2"] == "celery worker"
    # the init job migrates Airflow's DB and the send log, and creates the pool
    assert "_AIRFLOW_DB_MIGRATE" in env_of(services["airflow-init"])
    assert "airflow pools set email_provider 4" in norm["airflow-init"]
    assert "migrate" in norm["airflow-init"] and "dbname=mailflow" in norm["airflow-init"]
    # two databases on one server: Airflow's metadata and the send log (own role, created at init)
    assert "CREATE DATABASE mailflow OWNER mailflow" in " ".join(services["postgres"]["entrypoint"])
    jwt = set()
    for name in (*AIRFLOW_SERVICES, "mailflow-emulator"):
        svc, env = services[name], env_of(services[name])
        assert Path(str(svc["build"]["context"] if isinstance(svc["build"], dict) else svc["build"])).resolve() in (
            ROOT, Path(".").resolve()), name
        assert "_PIP_ADDITIONAL_REQUIREMENTS" not in env, name
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert env["AIRFLOW__CORE__LOAD_EXAMPLES"].lower() == "false"
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:") or \
            env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://:@redis:")
        assert "@postgres/airflow" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        jwt.add(env["AIRFLOW__API_AUTH__JWT_SECRET"])
        send_log = json.loads(env["AIRFLOW_CONN_SEND_LOG_DB"])
        assert (send_log["conn_type"], send_log["host"], send_log["schema"], send_log["password"]) == (
            "postgres", "postgres", "mailflow", "db-pw")
        resend = json.loads(env["AIRFLOW_CONN_RESEND_DEFAULT"])
        assert (resend["conn_type"], resend["host"], resend["extra"]["requests_per_second"]) == (
            "resend", "http://mailflow-emulator:8025", 10)
        assert json.loads(env["AIRFLOW_CONN_MAIL_UNSUBSCRIBE"])["password"] == COMPOSE_SECRETS["MAILFLOW_UNSUBSCRIBE_SECRET"]
        mounts = {str(v).split(":")[1] if isinstance(v, str) else v["target"]: v for v in svc["volumes"]}
        assert {"/opt/airflow/dags", "/opt/airflow/plugins", "/opt/mailflow/include"} <= set(mounts), name
    assert jwt == {"jwt-secret"}  # one JWT secret for every process
    assert str(services["mailflow-emulator"]["command"]).startswith("python -m mailflow.cli emulator ")
    # the image: built from requirements.txt, the package installed (include/ importable)
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM apache/airflow:3.3.2-python3.11" in dockerfile
    assert "-r /opt/mailflow/requirements.txt" in dockerfile and "pip install --no-cache-dir --no-deps -e /opt/mailflow" \
        in dockerfile


def test_docker_compose_refuses_to_run_without_its_secrets() -> None:
    for missing in COMPOSE_SECRETS:
        with pytest.raises(ValueError, match=missing):
            compose_config({k: v for k, v in COMPOSE_SECRETS.items() if k != missing})


# -- scale-out: CeleryExecutor, two workers on the local Redis (~1.5 min; MAILFLOW_SCALE_TEST=0 skips) --

@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MAILFLOW_SCALE_TEST") == "0",
                    reason="MAILFLOW_SCALE_TEST=0: the two-worker Celery run is skipped (`make scale-demo` runs it)")
def test_scale_out_on_two_celery_workers(pg_admin_dsn: str, tmp_path: Path) -> None:
    import argparse

    sys.path.insert(0, str(ROOT / "scripts"))  # scale_demo is a script of the repository, not a module
    import scale_demo

    args = argparse.Namespace(
        admin_dsn=pg_admin_dsn, redis=os.environ.get("MAILFLOW_SCALE_REDIS", "redis://127.0.0.1:6379/0"),
        senders=8, batches=20, emails_per_batch=10, concurrency=2, users=1000, timeout=300,
        workdir=str(tmp_path), keep=False, json=False)
    result = scale_demo.run(args)
    scale_demo.print_report(result)
    assert result["problems"] == []
    assert set(result["tasks_per_worker"]) == {"worker1", "worker2"}
    assert result["rate_limited_429"] == 0
    assert result["max_requests_in_any_second"] <= scale_demo.CAP
    assert all(how.startswith("stopped on SIGINT") for how in result["stopped"].values()), result["stopped"]
