"""`make scale-demo`: mailflow on CeleryExecutor with two Celery workers on this host.

Starts, each as its own process (group), all sharing one environment (one metadata database,
one JWT secret, one broker): the Airflow scheduler, API server and DAG processor, and two
``airflow celery worker`` processes with distinct ``--celery-hostname`` and log-server ports,
using the local Redis as the Celery broker and a queue of their own. Then:

1. creates the pool ``email_provider`` (4 slots) through the REST API;
2. unpauses ``lifecycle_emails`` (demo data anchored at the current hour: its one scheduled run
   sends the last hour's audiences into the real send log) and triggers ``example_scale_out``
   (``scripts/example_scale_out_dag.py``: N mapped send tasks through the production hook and the
   shared PostgreSQL pacer), all against one emulator enforcing the provider cap (10 requests/s);
3. reports per-worker task counts (task instances' ``hostname`` from the API), the aggregate
   request rate seen by the provider, the most requests in any 1 s window, the 429 count, and
   checks the invariants: every synthetic email delivered once, the send log audited against the
   outbox, nobody emailed twice, no second above the cap;
4. stops everything it started, by PID (SIGINT, then the process group), and drops its databases.

Databases: ``--admin-dsn``, else ``TEST_DATABASE_URL``, else the demo's embedded PostgreSQL.
Exit code 1 if an invariant fails. ``--json`` prints the result as JSON (used by the e2e test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from mailflow import cli
from mailflow.emulator.testing import EmulatorProcess  # noqa: E402
from mailflow.store.migrate import migrate  # noqa: E402
from mailflow_dev import devenv  # noqa: E402
from mailflow_dev.airflow_local import (
    ROOT,
    VENV_BIN,
    AirflowApi,
    Proc,
    airflow_cli,
    airflow_env,
    free_port,
    mailflow_connections,
    stop_all,
)
from mailflow_dev.demo.loader import load_demo_data  # noqa: E402
from mailflow_dev.loadgen import max_in_window  # noqa: E402

CAP = 10  # provider requests per second (the emulator enforces it, the connection declares it)


def check_redis(url: str) -> None:
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
    except Exception as exc:
        raise SystemExit(f"Redis broker {url} is not reachable ({exc}); start Redis or pass --redis") from None


def wait_workers_ready(workers: list[Proc], timeout: float) -> None:
    """Wait until every Celery worker logged ``<name>@<host> ready.`` (so both can take tasks)."""
    deadline = time.monotonic() + timeout
    while not all(f"{w.name}@" in w.tail(200_000) and " ready." in w.tail(200_000) for w in workers):
        for w in workers:
            if not w.alive():
                raise RuntimeError(f"{w.name} exited:\n{w.tail()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Celery workers not ready in {timeout}s")
        time.sleep(0.5)


def request_times(outbox: list[dict[str, Any]]) -> list[float]:
    """One instant per accepted request (its emails share an idempotency key), epoch seconds."""
    first: dict[str, float] = {}
    for line in outbox:
        t = datetime.fromisoformat(line["received_at"].replace("Z", "+00:00")).timestamp()
        key = line["idempotency_key"] or line["id"]
        first[key] = min(first.get(key, t), t)
    return sorted(first.values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    check_redis(args.redis)
    admin = args.admin_dsn or os.environ.get("TEST_DATABASE_URL") or devenv.embedded_dsn()
    tag = uuid.uuid4().hex[:8]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="mailflow-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    meta_db, log_db = f"airflow_scale_{tag}", f"mailflow_scale_{tag}"
    meta_dsn = devenv.create_database(admin, meta_db, exist_ok=False)
    send_log_dsn = devenv.create_database(admin, log_db, exist_ok=False)
    procs: list[Proc] = []
    emulator: EmulatorProcess | None = None
    result: dict[str, Any] = {"workdir": str(work)}
    t0 = time.monotonic()
    try:
        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        with psycopg.connect(send_log_dsn, autocommit=True) as conn:
            migrate(conn)
            load_demo_data(conn, users=args.users, seed=42, anchor=hour)
        emulator = EmulatorProcess(outbox=work / "outbox.jsonl", rate_limit=CAP, seed=1).start()

        dags = work / "dags"  # the deployed lifecycle DAG plus the example, nothing else
        dags.mkdir(exist_ok=True)
        for src in (ROOT / "dags" / "lifecycle_emails.py", ROOT / "scripts" / "example_scale_out_dag.py"):
            shutil.copy(src, dags / src.name)
        port = free_port()
        queue = f"mailflow-scale-{tag}"
        env = airflow_env(work / "home", meta_dsn, api_port=port, executor="CeleryExecutor", dags_folder=dags,
                          connections=mailflow_connections(send_log_dsn, emulator.base_url, emulator.api_key,
                                                           "scale-demo-unsubscribe-secret-0123456789",
                                                           requests_per_second=CAP),
                          extra={"AIRFLOW__CELERY__BROKER_URL": args.redis,
                                 "AIRFLOW__OPERATORS__DEFAULT_QUEUE": queue,
                                 "AIRFLOW__CORE__HOSTNAME_CALLABLE": "mailflow_dev.airflow_local.worker_hostname",
                                 "PYTHONPATH": str(ROOT / "include")})
        airflow = str(VENV_BIN / "airflow")
        airflow_cli(env, "db", "migrate")
        for name, cmd in (("scheduler", ["scheduler"]), ("dag-processor", ["dag-processor"]),
                          ("api-server", ["api-server"])):
            procs.append(Proc(name, [airflow, *cmd], env, work / f"{name}.log").start())
        for i in (1, 2):
            wenv = dict(env, MAILFLOW_WORKER_NAME=f"worker{i}",
                        AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(free_port()))
            procs.append(Proc(f"worker{i}", [airflow, "celery", "worker", "--celery-hostname", f"worker{i}@%h",
                                             "--concurrency", str(args.concurrency), "--queues", queue],
                              wenv, work / f"worker{i}.log").start())
        api = AirflowApi(f"http://127.0.0.1:{port}")
        try:
            api.wait_ready(240, procs)
            for dag_id in ("lifecycle_emails", "example_scale_out"):
                api.wait_dag(dag_id, timeout=120)
            wait_workers_ready([p for p in procs if p.name.startswith("worker")], timeout=120)
            result["started_in_seconds"] = round(time.monotonic() - t0, 1)
            api.ensure_pool("email_provider", 4, "Bounds concurrent send tasks; the pacer enforces the rate")
            api.set_paused("example_scale_out", False)
            conf = {"senders": args.senders, "batches": args.batches, "emails_per_batch": args.emails_per_batch}
            example = api.trigger("example_scale_out", conf=conf, logical_date=None)
            api.set_paused("lifecycle_emails", False)
            deadline = time.monotonic() + 60
            while not (sched := api.dag_runs("lifecycle_emails", run_type="scheduled")):
                if time.monotonic() > deadline:
                    raise TimeoutError("no scheduled lifecycle run after unpausing")
                time.sleep(0.5)
            runs = api.wait_runs("example_scale_out", [example["dag_run_id"]], timeout=args.timeout)
            runs += api.wait_runs("lifecycle_emails", [sched[0]["dag_run_id"]], timeout=args.timeout)
            result["runs"] = {r["dag_id"]: r["state"] for r in runs}
            tis = api.task_instances("example_scale_out", example["dag_run_id"])
            tis += api.task_instances("lifecycle_emails", sched[0]["dag_run_id"])
            sends = [t for t in tis if t["task_id"] in ("send", "send_campaigns")]
            result["tasks_per_worker"] = dict(Counter(t["hostname"] for t in sends))
            result["task_states"] = dict(Counter(t["state"] for t in sends))
            result["senders"] = [api.xcom("example_scale_out", example["dag_run_id"], "send", map_index=t["map_index"])
                                 for t in sends if t["task_id"] == "send" and t["state"] == "success"]
            result["lifecycle_summary"] = (api.xcom("lifecycle_emails", sched[0]["dag_run_id"], "send_campaigns")
                                           if result["runs"]["lifecycle_emails"] == "success" else None)
        finally:
            api.close()

        stats = emulator.stats()
        outbox = emulator.read_outbox()
        times = request_times(outbox)
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        synthetic = [line for line in outbox if not line.get("tags")]
        lifecycle = [line for line in outbox if line.get("tags")]
        expected_synthetic = args.senders * args.batches * args.emails_per_batch
        lifecycle_outbox = work / "outbox-lifecycle.jsonl"
        lifecycle_outbox.write_text("".join(json.dumps(line) + "\n" for line in lifecycle))
        with psycopg.connect(send_log_dsn, autocommit=True) as conn:
            audit = cli.audit(conn, lifecycle_outbox)
            twice = conn.execute("select count(*) from (select user_id from mail.send_log where status = 'sent'"
                                 " group by user_id having count(*) > 1) d").fetchone()[0]
        result.update({
            "provider_requests": stats["requests"],
            "accepted_requests": len(times),
            "rate_limited_429": stats["responses_by_status"].get("429", 0),
            "aggregate_request_rate": round((len(times) - 1) / span, 2) if span else 0.0,
            "max_requests_in_any_second": max_in_window(times, 1.0),
            "cap_requests_per_second": CAP,
            "synthetic_emails": {"expected": expected_synthetic, "delivered": len(synthetic),
                                 "distinct_recipients": len({tuple(line["to"]) for line in synthetic})},
            "lifecycle_audit": audit,
            "users_emailed_twice": twice,
        })
        problems = []
        if result["runs"] != {"example_scale_out": "success", "lifecycle_emails": "success"}:
            problems.append(f"runs: {result['runs']}")
        if len(result["tasks_per_worker"]) < 2:
            problems.append(f"send tasks ran on {len(result['tasks_per_worker'])} worker(s) only")
        if result["rate_limited_429"]:
            problems.append(f"{result['rate_limited_429']} responses were 429")
        if result["max_requests_in_any_second"] > CAP:
            problems.append(f"{result['max_requests_in_any_second']} requests in one second (cap {CAP})")
        if not (expected_synthetic == len(synthetic) == result["synthetic_emails"]["distinct_recipients"]):
            problems.append(f"synthetic emails: {result['synthetic_emails']}")
        if any(v for k, v in audit.items() if k not in ("delivered", "sent_rows")) or twice:
            problems.append(f"send log audit: {audit}, users emailed twice: {twice}")
        result["problems"] = problems
    finally:
        result["stopped"] = stop_all(procs)
        if emulator is not None:
            emulator.stop()
        if not args.keep:
            devenv.drop_database(admin, meta_db)
            devenv.drop_database(admin, log_db)
        result["total_seconds"] = round(time.monotonic() - t0, 1)
    return result


def print_report(r: dict[str, Any]) -> None:
    print(f"Airflow (CeleryExecutor, 2 workers, Redis broker) ready in {r.get('started_in_seconds')} s;"
          f" total {r['total_seconds']} s; logs in {r['workdir']}")
    print(f"runs: {r.get('runs')}")
    print(f"send tasks per worker (task instance hostname): {r.get('tasks_per_worker')}")
    for s in sorted(r.get("senders", []), key=lambda s: s["sender"]):
        print(f"  sender {s['sender']:>2} on {s['worker']}: {s['requests']} requests, {s['accepted']} emails accepted,"
              f" {s['rate_limited']} x 429, {s['finished'] - s['started']:.1f} s")
    if r.get("lifecycle_summary"):
        sent = {s["campaign"]: s["sent"] for s in r["lifecycle_summary"]}
        print(f"lifecycle_emails (scheduled run, last hour): sent {sent}")
    print(f"provider: {r.get('provider_requests')} requests ({r.get('accepted_requests')} accepted batches),"
          f" aggregate {r.get('aggregate_request_rate')} requests/s, at most {r.get('max_requests_in_any_second')}"
          f" in any 1 s (cap {CAP}), {r.get('rate_limited_429')} x 429")
    print(f"synthetic emails: {r.get('synthetic_emails')}; send-log audit: {r.get('lifecycle_audit')};"
          f" users emailed twice: {r.get('users_emailed_twice')}")
    print(f"stopped: {r['stopped']}")
    print("invariants: " + ("OK" if not r.get("problems") else "FAILED: " + "; ".join(r["problems"])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--admin-dsn", help="maintenance DSN of the PostgreSQL server for both databases")
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Celery broker URL")
    p.add_argument("--senders", type=int, default=8, help="mapped send tasks")
    p.add_argument("--batches", type=int, default=30, help="batch requests per send task")
    p.add_argument("--emails-per-batch", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=2, help="task slots per Celery worker")
    p.add_argument("--users", type=int, default=2000, help="demo users for the lifecycle run")
    p.add_argument("--timeout", type=float, default=300, help="seconds to wait for the runs")
    p.add_argument("--workdir", help="logs and outbox (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the two databases")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print_report(result)
    return 1 if result.get("problems") or "problems" not in result else 0


if __name__ == "__main__":
    sys.exit(main())
