"""Fault injection (`make chaos`): kill the sender at random points, mix provider faults, then let
the reconciler and the next runs recover, and check the invariants against the provider's outbox.

Kill points (SIGKILL of a forked sender process, at a random chunk of its run):
``before_mint``, ``after_mint`` (rows claimed and stored, request not sent), ``in_flight`` (a timer
fires while the HTTP request is out), ``before_apply`` (the response arrived, not yet recorded).
Provider faults during the kill phase (about ``fault_rate`` of requests in all): 5xx, timeouts,
reset after accept, and 429 bursts. Recovery: faults off, the reconciler (stale threshold 0: every
sender is dead, so no claim is live) and lifecycle runs alternate until a round changes nothing.

Invariants, all must be 0: duplicate deliveries (same user and campaign delivered twice), sent rows
without a delivered email, delivered emails without a sent row, eligible users left without a row,
rows still ``sending``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import psycopg

from mailflow.campaigns import load_campaigns
from mailflow.cli import audit
from mailflow.clock import SystemClock
from mailflow.demo.loader import load_demo_data
from mailflow.emulator.testing import EmulatorProcess
from mailflow.engine import run_lifecycle
from mailflow.migrate import migrate
from mailflow.model import DataInterval, RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.render import Renderer
from mailflow.repair import reconcile
from mailflow.store import PostgresStore
from mailflow.unsubscribe import signer_from_secret

KILL_POINTS = ("before_mint", "after_mint", "in_flight", "before_apply")
ANCHOR = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
INTERVAL = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
API_KEY = "re_test_emulator"


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class _Plan:
    point: str
    chunk: int  # 0-based chunk index at which to die
    delay: float  # in_flight: seconds after the request starts


class _KillingStore:
    def __init__(self, inner: PostgresStore, plan: _Plan | None):
        self.inner, self.plan = inner, plan
        self.calls = 0  # mint_chunk calls
        self.batches = 0  # mint_chunk calls that produced a batch to send

    def count_audience(self, *a: Any, **k: Any) -> int:
        return self.inner.count_audience(*a, **k)

    def mint_chunk(self, *a: Any, **k: Any) -> Any:
        if self.plan and self.plan.point == "before_mint" and self.calls == self.plan.chunk:
            _die()
        self.calls += 1
        result = self.inner.mint_chunk(*a, **k)
        self.batches += result.batch is not None
        return result

    def apply(self, *a: Any, **k: Any) -> Any:
        if self.plan and self.plan.point == "before_apply" and self.batches - 1 == self.plan.chunk:
            _die()
        return self.inner.apply(*a, **k)

    def rebatch(self, *a: Any, **k: Any) -> Any:
        return self.inner.rebatch(*a, **k)


class _KillingProvider:
    def __init__(self, inner: ResendClient, store: _KillingStore, plan: _Plan | None):
        self.inner, self.store, self.plan = inner, store, plan

    def reserve_slot(self, deadline: float) -> float | None:
        return self.inner.reserve_slot(deadline)

    def send_batch(self, batch: Any, deadline: float, slot: float | None = None) -> Any:
        p = self.plan
        if p and self.store.batches - 1 == p.chunk:
            if p.point == "after_mint":
                _die()
            if p.point == "in_flight":
                threading.Timer(p.delay, _die).start()
        return self.inner.send_batch(batch, deadline, slot)


def _client(dsn: str, base_url: str) -> ResendClient:
    pacer = PostgresPacer(lambda: psycopg.connect(dsn), "chaos", requests_per_second=200, target_fraction=1.0)
    import httpx

    return ResendClient(base_url, API_KEY, pacer=pacer, policy=RetryPolicy(max_attempts=3, base=0.02, cap=0.1),
                        timeout=httpx.Timeout(0.5, connect=1.0))


def _renderer() -> Renderer:
    return Renderer(signer_from_secret("chaos-secret-0123456789"), "https://mail.example.com", "https://app.example.com")


def sender_run(dsn: str, base_url: str, chunk_size: int, plan: _Plan | None) -> None:
    """One lifecycle run (in a forked process); dies per ``plan``."""
    with psycopg.connect(dsn) as conn:
        store = _KillingStore(PostgresStore(conn), plan)
        with _client(dsn, base_url) as client:
            run_lifecycle(store, _KillingProvider(client, store, plan), _renderer(), load_campaigns(), INTERVAL,
                          run=RunContext(dag_id="chaos", run_id=f"chaos-{os.getpid()}", task_id="send"),
                          chunk_size=chunk_size, budget_seconds=120, clock=SystemClock())


def _fork_run(dsn: str, base_url: str, chunk_size: int, plan: _Plan | None) -> int:
    proc = multiprocessing.get_context("fork").Process(target=_quiet_run, args=(dsn, base_url, chunk_size, plan))
    proc.start()
    proc.join(180)
    if proc.is_alive():
        proc.kill()
        proc.join()
    return int(proc.exitcode or 0)


def _quiet_run(dsn: str, base_url: str, chunk_size: int, plan: _Plan | None) -> None:
    import logging

    logging.disable(logging.WARNING)
    try:
        sender_run(dsn, base_url, chunk_size, plan)
    except Exception:
        os._exit(3)  # a failed run (e.g. a whole campaign rejected): recorded, not a crash


def eligible_left(dsn: str) -> int:
    """Users still selectable by some campaign for the interval (must be 0 when quiet)."""
    with psycopg.connect(dsn) as conn:
        store = PostgresStore(conn)
        return sum(store.count_audience(c, c.window(INTERVAL), INTERVAL.end - c.cooldown) for c in load_campaigns())


def run_chaos(dsn: str, *, kills: int = 200, users: int = 5000, seed: int = 7, chunk_size: int = 10,
              fault_rate: float = 0.1, out: Any = print) -> dict[str, Any]:
    """Run the whole fault-injection scenario on an empty database ``dsn``; return the report."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        load_demo_data(conn, users=users, seed=seed, anchor=ANCHOR)
    workdir = Path(mkdtemp(prefix="mailflow-chaos-"))
    outbox = workdir / "outbox.jsonl"
    report: dict[str, Any] = {"kills_requested": kills, "kills": 0, "kills_by_point": dict.fromkeys(KILL_POINTS, 0),
                              "completed_runs": 0, "failed_runs": 0}
    with EmulatorProcess(outbox=outbox, rate_limit=0, seed=seed, latency_ms=15, latency_jitter_ms=30,
                         hang_seconds=0.8) as emu:
        share = fault_rate / 4
        while report["kills"] < kills:
            burst = rng.random() < 0.1
            emu.configure(error_rate=share, timeout_rate=share, reset_after_accept_rate=share,
                          rate_limit=3 if burst else 0)
            plan = _Plan(point=rng.choice(KILL_POINTS), chunk=rng.randrange(3), delay=rng.uniform(0.0, 0.05))
            code = _fork_run(dsn, emu.base_url, chunk_size, plan)
            if os.environ.get("CHAOS_DEBUG"):
                out(f"  {plan} -> exit {code}")
            if code == -signal.SIGKILL:
                report["kills"] += 1
                report["kills_by_point"][plan.point] += 1
            elif code == 0:
                report["completed_runs"] += 1
                if eligible_left(dsn) == 0:
                    break  # audience exhausted: nothing left to kill
            else:
                report["failed_runs"] += 1
            if report["kills"] % 25 == 0 and code == -signal.SIGKILL:
                out(f"  {report['kills']} kills ({time.monotonic() - t0:.0f} s)")
        emu.configure(error_rate=0.0, timeout_rate=0.0, reset_after_accept_rate=0.0, rate_limit=0)
        rounds = 0
        while True:
            rounds += 1
            with psycopg.connect(dsn) as conn, _client(dsn, emu.base_url) as client:
                conn.autocommit = True
                now = conn.execute("select now()").fetchone()[0]  # type: ignore[index]
                rep = reconcile(conn, client, now=now, stale_after=timedelta(0),
                                run=RunContext(dag_id="chaos", run_id=f"reconcile-{rounds}", task_id="reconcile"))
            _fork_run(dsn, emu.base_url, chunk_size, None)
            if (rep.changed() == 0 and rep.batches_resent == 0 and eligible_left(dsn) == 0) or rounds > 20:
                break
        report["recovery_rounds"] = rounds
        report["emulator"] = {k: v for k, v in emu.stats().items() if k in ("requests", "accepted_emails", "replays",
                                                                          "status_5xx", "resets_after_accept",
                                                                          "timeouts_injected", "rate_limited")}
    with psycopg.connect(dsn, autocommit=True) as conn:
        inv = audit(conn, outbox)
        states: dict[str, int] = dict(conn.execute("select status || case when dead_lettered_at is not null then '+dead_letter'"
                                   " when released_at is not null then '+rolled_back' else '' end, count(*)"
                                   " from mail.send_log group by 1 order by 1").fetchall())
    report["states"] = states
    report["invariants"] = {
        "duplicate_deliveries": inv["duplicate_deliveries"],
        "sent_without_delivery": inv["sent_without_delivery"],
        "delivered_without_sent": inv["delivered_without_sent"],
        "provider_id_mismatch": inv["provider_id_mismatch"],
        "eligible_users_without_row": eligible_left(dsn),
        "rows_still_sending": states.get("sending", 0),
    }
    report["delivered"] = inv["delivered"]
    report["seconds"] = round(time.monotonic() - t0, 1)
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow.chaos [--kills N] [--users N] [--seed N]``; exit 1 if any invariant is not 0."""
    p = argparse.ArgumentParser(prog="mailflow.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200)
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create a scratch database on (default: embedded)")
    args = p.parse_args(argv)
    from mailflow import devenv

    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    name = f"mailflow_chaos_{os.getpid()}"
    dsn = devenv.create_database(admin, name, exist_ok=False)
    try:
        report = run_chaos(dsn, kills=args.kills, users=args.users, seed=args.seed)
    finally:
        devenv.drop_database(admin, name)
        if started:
            devenv.stop_embedded(pgdata)
    print(json.dumps(report, indent=2))
    bad = {k: v for k, v in report["invariants"].items() if v}
    print("invariants: " + ("ALL 0" if not bad else f"VIOLATED {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
