"""The reputation guard at full speed (`make chaos` runs it last): bad audiences sent as fast as the
senders can, with every outcome arriving late, must be stopped within the exposure bound E; a healthy
audience must lose less than 5 % of its throughput to the ramp.

Each scenario gets a fresh database, a fresh emulator and the standalone webhook receiver
(``mailflow webhooks serve``, which evaluates the guard as outcomes arrive). The emulator accepts every
email and pushes its outcomes as signed webhooks, each delayed by its own random 1-120 s
(``--webhook-latency-min-seconds`` / ``--webhook-latency-max-seconds``), so an email's bounce or complaint
arrives long after the senders have moved on, and out of order.

* ``bounce``: every address hard-bounces; ``complaint``: 0.5 % of the delivered emails are complained about
  (the SES pause line).
* ``lifecycle``: ``N`` processes run the lifecycle source over one campaign whose audience is every user;
  ``scheduled``: ``N`` dispatchers send one provisioned campaign whose rows are all due.
* Reported per scenario: the emails sent (accepted by the provider) when the guard tripped and in all, E,
  and whether the total stayed within E. The healthy pair runs the lifecycle source twice for the same
  budget over a healthy audience (0.5 % hard bounces, no complaints): once with the ramp (fresh scopes)
  and once without (E above the audience); the ramp's cost is the share of the run the sender spent
  waiting for outcomes (the two totals are printed too; on a shared machine they differ by more).

Exit status 1 if a bad audience sent more than E or was never stopped, or the ramp cost 5 % or more.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

from mailflow.campaigns import Campaign
from mailflow.model.outcome import DataInterval, RunContext

PAST = datetime(2026, 1, 5, tzinfo=UTC)
SECRET_BYTES = b"guard-chaos-webhook-secret-0123"
UNSUBSCRIBE_SECRET = "guard-chaos-secret-0123456789"
LIFECYCLE_NAME = "gc_lifecycle"
SCHEDULED_NAME = "gc_scheduled"
AUDIENCES: dict[str, dict[str, float]] = {
    "bounce": {"hard_bounce_rate": 1.0},
    "complaint": {"complaint_rate": 0.005},
    "healthy": {"hard_bounce_rate": 0.005},
}


def _secret() -> str:
    import base64

    return "whsec_" + base64.b64encode(SECRET_BYTES).decode()


def _campaign() -> Campaign:
    return Campaign(name=LIFECYCLE_NAME, priority=1, audience_sql="select user_id, email, first_name from app.users",
                    template="first_practice", subject="Hello {{ user.first_name or 'there' }}",
                    from_address="Practice Team <practice@mail.example.com>", reply_to=None,
                    cooldown=timedelta(days=7), audience_window=timedelta(hours=1))


def _client(dsn: str, base_url: str) -> Any:
    import httpx

    from mailflow.provider.client import ResendClient, RetryPolicy
    from mailflow.provider.pacing import PostgresPacer

    pacer = PostgresPacer(lambda: psycopg.connect(dsn), account=base_url, requests_per_second=50)
    return ResendClient(base_url, "re_test_emulator", pacer=pacer, policy=RetryPolicy(max_attempts=3, base=0.05, cap=0.2),
                        timeout=httpx.Timeout(10.0))


def _renderer() -> Any:
    from mailflow.feedback.unsubscribe_tokens import signer_from_secret
    from mailflow.sendloop.render import Renderer

    return Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")


def _lifecycle_sender(dsn: str, base_url: str, n: int, budget: float, env: dict[str, str], barrier: Any,
                      waited: Any) -> None:
    os.environ.update(env)
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.send_log import PostgresStore

    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    run = RunContext(dag_id="lifecycle_emails", run_id=f"guard-chaos-{n}", task_id="send_campaigns")
    barrier.wait()
    with psycopg.connect(dsn, autocommit=True) as conn:
        [summary] = run_lifecycle(PostgresStore(conn), _client(dsn, base_url), _renderer(), [_campaign()],
                                  DataInterval(end - timedelta(hours=1), end), run=run, chunk_size=100,
                                  budget_seconds=budget, pipelined=True)
    waited.put(summary.waited)


def _dispatcher(dsn: str, base_url: str, n: int, budget: float, env: dict[str, str], barrier: Any,
                waited: Any) -> None:
    os.environ.update(env)
    from mailflow.sources import scheduled

    run = RunContext(dag_id="dispatch_scheduled_emails", run_id=f"guard-chaos-{n}", task_id="dispatch")
    barrier.wait()
    deadline = time.monotonic() + budget
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            s = scheduled.dispatch(conn, _client(dsn, base_url), _renderer(), run=run, coalesce_seconds=0,
                                   budget_seconds=min(50.0, max(1.0, deadline - time.monotonic())), pipelined=True)
            if not s.claimed:
                time.sleep(1.0)  # waiting for outcomes, tripped, or done: look again as the next run would
            status = conn.execute("select status from mail.campaign where name = %s", (SCHEDULED_NAME,)).fetchone()
            left = conn.execute("select count(*) from mail.send_log where status = 'pending'").fetchone()
            if (status and status[0] != "scheduled") or (left and left[0] == 0):
                return


def _setup(dsn: str, users: int, kind: str) -> None:
    from mailflow.sources import scheduled

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                     " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', 'free'"
                     " from generate_series(1, %s::bigint) as i", (users,))
        if kind == "scheduled":
            cid = scheduled.create_campaign(conn, {
                "name": SCHEDULED_NAME, "template": "outreach", "subject": "{{ user.first_name }}, hello",
                "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
                "start_at": PAST, "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"],
                "emails_per_day": users}, actor="guard-chaos")
            scheduled.provision(conn, cid, now=PAST)
        conn.execute("analyze")


def run_scenario(admin: str, *, kind: str, audience: str, senders: int, users: int, budget: float,
                 exposure: int, latency: tuple[float, float], ramp: bool = True) -> dict[str, Any]:
    """One scenario on a scratch database: returns its counts (see the module docstring)."""
    from mailflow.emulator.testing import EmulatorProcess
    from mailflow.store.migrate import migrate
    from mailflow_dev import devenv
    from mailflow_dev.demo.loader import schema_sql
    from mailflow_dev.webhooks import ReceiverProcess

    name = f"mailflow_guard_chaos_{os.getpid()}"
    dsn = devenv.create_database(admin, name, exist_ok=True)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("drop schema if exists mail cascade; drop schema if exists app cascade")
            migrate(conn)
            conn.execute(schema_sql())
        _setup(dsn, users, kind)
        env = {"MAILFLOW_GUARD_EXPOSURE": str(exposure if ramp else 10 * users)}
        os.environ.update(env)  # the receiver evaluates with the same settings
        logdir = Path(tempfile.mkdtemp(prefix="mailflow-guard-chaos-"))
        with ReceiverProcess(dsn, _secret(), logdir / "receiver.log") as receiver, \
                EmulatorProcess.with_webhooks(receiver.url, [_secret()], event_spread_seconds=0.0,
                                              webhook_latency_min_seconds=latency[0],
                                              webhook_latency_max_seconds=latency[1],
                                              **AUDIENCES[audience]) as emu:
            ctx = multiprocessing.get_context("spawn")
            barrier = ctx.Barrier(senders + 1)
            waited = ctx.Queue()
            target = _lifecycle_sender if kind == "lifecycle" else _dispatcher
            procs = [ctx.Process(target=target, args=(dsn, emu.base_url, i, budget, env, barrier, waited),
                                 daemon=True) for i in range(senders)]
            for p in procs:
                p.start()
            barrier.wait()
            t0 = time.monotonic()
            for p in procs:
                p.join(budget + 120)
            seconds = time.monotonic() - t0
            waits: list[float] = []
            for _ in range(senders if kind == "lifecycle" else 0):
                try:
                    waits.append(float(waited.get(timeout=5)))
                except queue.Empty:  # a sender that failed reports nothing (failed_processes says so)
                    break
        with psycopg.connect(dsn, autocommit=True) as conn:
            campaign = LIFECYCLE_NAME if kind == "lifecycle" else SCHEDULED_NAME
            sent = int(conn.execute("select count(*) from mail.send_log where campaign = %s and provider_message_id"
                                    " is not null", (campaign,)).fetchone()[0])  # type: ignore[index]
            trip = conn.execute("select min(tripped_at) from mail.reputation_guard where state = 'tripped'").fetchone()
            tripped_at = trip[0] if trip else None
            before = int(conn.execute(
                "select count(*) from mail.send_log where campaign = %s and provider_message_id is not null"
                " and sent_at <= %s", (campaign, tripped_at)).fetchone()[0]) if tripped_at else None  # type: ignore[index]
            reason = conn.execute("select reason from mail.reputation_guard where state = 'tripped'"
                                  " order by tripped_at limit 1").fetchone()
        return {"kind": kind, "audience": audience, "senders": senders, "exposure": exposure if ramp else None,
                "sent_before_trip": before, "sent": sent, "tripped": tripped_at is not None,
                "reason": reason[0] if reason else None, "seconds": round(seconds, 1),
                "waited_for_outcomes_seconds": round(sum(waits), 1),
                "failed_processes": sum(1 for p in procs if p.exitcode != 0)}
    finally:
        devenv.drop_database(admin, name)


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow_dev.chaos_guard [--users N] [--exposure E] [--budget S] [--healthy-budget S]
    [--senders 1,4] [--dsn DSN]``: prints the table and the JSON; exit 1 if a bound is broken."""
    p = argparse.ArgumentParser(prog="mailflow_dev.chaos_guard", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=30_000, help="audience of the bad scenarios")
    p.add_argument("--exposure", type=int, default=10_000, help="E (the guard's default)")
    p.add_argument("--budget", type=float, default=90.0, help="seconds each bad scenario may send")
    p.add_argument("--healthy-users", type=int, default=60_000)
    p.add_argument("--healthy-budget", type=float, default=120.0, help="seconds of each healthy run")
    p.add_argument("--senders", default="1,4")
    p.add_argument("--latency", default="1,120", help="min,max seconds each outcome arrives late")
    p.add_argument("--only", default="", help="comma-separated scenario names to run (kind-audience-senders)")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create a scratch database on (default: embedded)")
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    latency = tuple(float(x) for x in args.latency.split(","))
    assert len(latency) == 2
    only = {x for x in args.only.split(",") if x}
    results: list[dict[str, Any]] = []
    try:
        for kind in ("lifecycle", "scheduled"):
            for audience in ("bounce", "complaint"):
                for senders in (int(x) for x in args.senders.split(",")):
                    label = f"{kind}-{audience}-{senders}"
                    if only and label not in only:
                        continue
                    r = run_scenario(admin, kind=kind, audience=audience, senders=senders, users=args.users,
                                     budget=args.budget, exposure=args.exposure,
                                     latency=(latency[0], latency[1]))
                    r["ok"] = r["tripped"] and r["sent"] <= args.exposure and not r["failed_processes"]
                    results.append(r)
                    print(json.dumps(r), flush=True)
        healthy: dict[str, Any] = {}
        if not only or "healthy" in only:
            for ramp in (True, False):
                r = run_scenario(admin, kind="lifecycle", audience="healthy", senders=1, users=args.healthy_users,
                                 budget=args.healthy_budget, exposure=args.exposure, latency=(latency[0], latency[1]),
                                 ramp=ramp)
                print(json.dumps(r), flush=True)
                healthy["with_ramp" if ramp else "without_ramp"] = r
            # the ramp's cost: the share of the run the sender waited for outcomes (the two runs' totals
            # are reported too, but on a shared machine they differ by more than the ramp)
            cost = healthy["with_ramp"]["waited_for_outcomes_seconds"] / args.healthy_budget
            healthy["ramp_cost"] = round(cost, 4)
            healthy["ok"] = cost < 0.05 and not healthy["with_ramp"]["tripped"]
    finally:
        if started:
            devenv.stop_embedded(pgdata)
    print()
    print(f"{'scenario':<26} {'E':>7} {'sent at trip':>13} {'sent in all':>12} {'tripped':>8}  result")
    for r in results:
        print(f"{r['kind'] + ' ' + r['audience'] + ' x' + str(r['senders']):<26} {r['exposure']:>7} "
              f"{r['sent_before_trip'] if r['sent_before_trip'] is not None else '-':>13} {r['sent']:>12} "
              f"{'yes' if r['tripped'] else 'no':>8}  {'ok' if r['ok'] else 'VIOLATED'}")
    if healthy:
        w, wo = healthy["with_ramp"], healthy["without_ramp"]
        print(f"healthy lifecycle x1, {args.healthy_budget:.0f} s: {w['sent']} sent with the ramp (waited "
              f"{w['waited_for_outcomes_seconds']} s for outcomes), {wo['sent']} without: the ramp cost "
              f"{healthy['ramp_cost'] * 100:.1f}% of the run ({'ok' if healthy['ok'] else 'VIOLATED'})")
    bad = [r for r in results if not r["ok"]] + ([healthy] if healthy and not healthy["ok"] else [])
    print("reputation guard at full speed: " + ("ALL OK" if not bad else f"{len(bad)} VIOLATED"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
