"""Fault injection (``make chaos``): kill the sender, the scheduled dispatcher and the reconciler at
random points while the emulator produces the real provider's faults, one fault kind at a time; then
recover and audit the provider's outbox against the send log, per fault kind.

Each fault kind runs in its own database (a copy of one template: demo users, the real lifecycle
campaigns, a scheduled campaign whose rows are all due) with its own installation id, against ONE
emulator (one provider team, one outbox, one idempotency memory): the keys of every database meet
there, so "a key with two bodies" across databases would show.

Per fault kind:

1. **fault phase**: the emulator's fault is switched on; sender (``run_lifecycle``), dispatcher
   (``scheduled.dispatch``) and reconciler (``repair.reconcile``, stale threshold 0: every earlier
   process is dead or done) runs alternate, each a forked process, most of them SIGKILLed at a random
   point: sender ``before_mint`` / ``after_mint`` (rows and bytes stored, no request) / ``in_flight``
   (a timer fires while the request is out) / ``before_apply`` (the answer arrived, not recorded);
   dispatcher and reconciler the same with ``before_claim`` / ``after_claim``. The reconciler's
   resends meet the same fault.
2. **recovery**: faults off; reconciler, sender and dispatcher rounds until a round changes nothing.
3. **audit** (outbox lines of this installation vs its send log): duplicate deliveries (a user got
   one campaign twice), rows ``sent`` without a delivery, deliveries without a ``sent`` row, keys
   seen with two bodies (two different emails under one key and index, a delivered email that is
   not the stored bytes of its key, or a 409 ``invalid_idempotent_request``), and eligible users not
   sent after recovery (still in an audience, a row left ``sending``, a scheduled row due and
   ``pending``, a dead letter, or a row failed although its email was valid). Each must be 0.

The simulated clock: actors run on :class:`~mailflow.sendloop.clock.FakeClock` (backoff, retry-after and
budget waits take no real time); an advance of the scenario clock by ``s`` seconds moves the
emulator's clock (idempotency TTL, quota day) and ages every stored batch (``created_at``, which the
reconciler's idempotency window reads) by ``s``. The ``outage`` kind holds a 6-hour outage (503s,
then an unreachable provider, then 503s) with runs every 10 simulated minutes; ``quota`` exhausts a
daily quota and keeps hitting it for 4 simulated hours until the provider's next UTC day.
``team_rate_limit`` runs on the real clock: another API key of the same team takes most of a 5
requests/s cap, so our senders meet 429s with retry-after.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import psycopg

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.emulator.testing import EmulatorProcess, free_port
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.clock import Clock, FakeClock, SystemClock
from mailflow.sendloop.outcome import DataInterval, RunContext, SendError
from mailflow.sendloop.render import Renderer

ANCHOR = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
INTERVAL = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
API_KEY = "re_test_emulator"
SENDING_ONLY_KEY = "re_chaos_sending_only"  # a restricted key of the same team (401 on reads)
SCHEDULED = "chaos_outreach"
SCHEDULED_USER_BASE = 50_000_000  # scheduled recipients are users of their own (no lifecycle audience)
ACTORS = ("sender", "dispatcher", "reconciler")
KILL_POINTS = {
    "sender": ("before_mint", "after_mint", "in_flight", "before_apply"),
    "dispatcher": ("before_claim", "after_claim", "in_flight", "before_apply"),
    "reconciler": ("before_claim", "after_claim", "in_flight", "before_apply"),
}
COLUMNS = ("duplicate_deliveries", "sent_without_delivery", "delivered_without_sent", "keys_with_two_bodies",
           "eligible_not_sent")
HEADERS = ("duplicate deliveries", "sent w/o delivery", "delivered w/o sent", "keys w/ two bodies",
           "eligible not sent")
CLIENT_READ_TIMEOUT = 0.4  # seconds; the emulator's slow answers hang longer (HANG_SECONDS)
HANG_SECONDS = 0.6
UNEXPECTED = 4  # exit code of a child that raised something other than SendError


@dataclass(frozen=True)
class Scenario:
    """One fault kind: ``faults`` = emulator settings of the fault phase; ``key`` = the API key the
    actors use; ``strict`` = strict batch validation (some users' emails are refused by the
    provider); ``driver`` = ``kills`` (runs until the kill share is reached), ``outage`` or ``quota``
    (simulated hours); ``real_clock`` = actors on the system clock (rate limits need real time)."""

    name: str
    about: str
    faults: dict[str, Any] = field(default_factory=dict)
    key: str = API_KEY
    strict: bool = False
    driver: str = "kills"
    real_clock: bool = False
    weight: float = 1.0
    status_cycle: tuple[int, ...] = ()  # error_after_status drawn per run from these


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("5xx_before_processing", "HTTP 500 before the batch is processed", {"error_rate": 0.35}),
    Scenario("5xx_after_processing", "500/502/503/504 after the batch was processed (edge or origin)",
             {"error_after_rate": 0.35}, status_cycle=(500, 502, 503, 504)),
    Scenario("reset_after_accept", "connection closed after the batch was accepted",
             {"reset_after_accept_rate": 0.35, "reset_mode": "abort"}),
    Scenario("slow_but_processed", "processed, answered after the client's read timeout",
             {"reset_after_accept_rate": 0.35, "reset_mode": "hang", "hang_seconds": HANG_SECONDS}),
    Scenario("timeout_not_processed", "hangs past the client's timeout, nothing processed",
             {"timeout_rate": 0.3, "hang_seconds": HANG_SECONDS}),
    Scenario("team_rate_limit", "5 requests/s per team, another key of the team takes ~4 of them",
             {"rate_limit": 5}, real_clock=True, weight=0.5),
    Scenario("unverified_domain", "403 validation_error: the `from` domain is not verified",
             {"check_from_domain": True}, weight=0.7),
    Scenario("restricted_key", "a sending-only key (401 restricted_api_key on reads) sends everything",
             {}, key=SENDING_ONLY_KEY, weight=0.7),
    Scenario("strict_refusal", "strict validation refuses a batch in Resend's wording, no index",
             {}, strict=True),
    Scenario("last_event_suppressed_failed", "provider reports last_event suppressed / failed",
             {"suppress": ["__SUPPRESS__"], "fail": ["__FAIL__"]}, weight=0.5),
    Scenario("ids_out_of_order", "batch ids answered out of request order", {"scramble_order": True}, weight=0.7),
    Scenario("outage_6h", "6 simulated hours: 503s, then unreachable, then 503s", {}, driver="outage", weight=1.5),
    Scenario("quota_exhausted", "daily quota exhausted, hit for 4 simulated hours until the next UTC day",
             {}, driver="quota", weight=1.5),
    Scenario("mixed", "every fault above at a low rate at once",
             {"error_rate": 0.05, "error_after_rate": 0.05, "reset_after_accept_rate": 0.05, "timeout_rate": 0.05,
              "hang_seconds": HANG_SECONDS, "scramble_order": True}, status_cycle=(500, 502, 503, 504), weight=1.5),
)

FAULTS_OFF: dict[str, Any] = {
    "error_rate": 0.0, "error_after_rate": 0.0, "reset_after_accept_rate": 0.0, "timeout_rate": 0.0,
    "outage": False, "quota_emails": None, "rate_limit": 0, "scramble_order": False, "check_from_domain": False,
    "suppress": [], "fail": [], "reset_mode": "abort", "hang_seconds": HANG_SECONDS,
}


# -- kill plans and the forked actors -----------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """Where a child dies: ``point`` at its ``chunk``-th batch (0-based); ``delay`` seconds after the
    request starts for ``in_flight``."""

    point: str
    chunk: int
    delay: float


@dataclass(frozen=True)
class ActorSpec:
    """What a forked actor needs (picklable by fork)."""

    actor: str
    dsn: str
    base_url: str
    api_key: str
    strict: bool
    campaigns: tuple[Campaign, ...]
    sim_seconds: float | None  # FakeClock start; None: the system clock
    chunk_size: int
    run_id: str
    error_log: str


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_kill(plan: Plan) -> None:
    """Patch the actor's seams in THIS (forked) process so it dies at ``plan``."""
    from mailflow import reconciler as repair
    from mailflow.sources import scheduled
    from mailflow.store.send_log import PostgresStore

    state = {"entries": 0, "sends": 0, "armed": False}

    def before(orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            if state["entries"] == plan.chunk:
                _die()
            state["entries"] += 1
            return orig(*a, **k)
        return wrapper

    if plan.point == "before_mint":
        PostgresStore.mint_chunk = before(PostgresStore.mint_chunk)  # type: ignore[method-assign]
    elif plan.point == "before_claim":
        scheduled._Dispatcher.claim = before(scheduled._Dispatcher.claim)  # type: ignore[method-assign]
        repair.reserve_slot = before(repair.reserve_slot)  # the reconciler reserves, then claims
    elif plan.point == "before_apply":
        orig_apply = PostgresStore.apply

        def apply(self: Any, *a: Any, **k: Any) -> Any:
            if state["armed"]:
                _die()
            return orig_apply(self, *a, **k)
        PostgresStore.apply = apply  # type: ignore[method-assign]
    orig_send = ResendClient.send_batch

    def send_batch(self: Any, batch: Any, deadline: float, slot: float | None = None) -> Any:
        n = state["sends"]
        state["sends"] += 1
        if n == plan.chunk:
            if plan.point in ("after_mint", "after_claim"):
                _die()
            if plan.point == "in_flight":
                threading.Timer(plan.delay, _die).start()
            if plan.point == "before_apply":
                state["armed"] = True
        return orig_send(self, batch, deadline, slot)
    ResendClient.send_batch = send_batch  # type: ignore[method-assign]


def _renderer() -> Renderer:
    return Renderer(signer_from_secret("chaos-secret-0123456789"), "https://mail.example.com", "https://app.example.com")


def _client(spec: ActorSpec, clock: Clock) -> ResendClient:
    # Each actor paces on its own account name (as three misconfigured deployments would): only the
    # provider's team-wide limit holds them together.
    pacer = PostgresPacer(lambda: psycopg.connect(spec.dsn), f"chaos-{spec.actor}",
                          requests_per_second=10 if spec.sim_seconds is None else 500, target_fraction=1.0)
    return ResendClient(spec.base_url, spec.api_key, pacer=pacer, clock=clock,
                        validation="strict" if spec.strict else "permissive",
                        policy=RetryPolicy(max_attempts=3, base=0.05, cap=0.5, max_retry_after=30),
                        timeout=httpx.Timeout(CLIENT_READ_TIMEOUT, connect=1.0, write=1.0, pool=1.0))


def run_actor(spec: ActorSpec) -> None:
    """One run of one actor (sender, dispatcher or reconciler) against ``spec.dsn``."""
    from mailflow.reconciler import reconcile
    from mailflow.sendloop.engine import run_lifecycle
    from mailflow.sources import scheduled
    from mailflow.store.send_log import PostgresStore

    clock: Clock = SystemClock() if spec.sim_seconds is None else FakeClock(start=spec.sim_seconds)
    run = RunContext(dag_id=f"chaos_{spec.actor}", run_id=spec.run_id, task_id=spec.actor)
    budget = 20.0 if spec.sim_seconds is None else 240.0
    with psycopg.connect(spec.dsn) as conn, _client(spec, clock) as client:
        if spec.actor == "sender":
            run_lifecycle(PostgresStore(conn), client, _renderer(), spec.campaigns, INTERVAL, run=run,
                          chunk_size=spec.chunk_size, budget_seconds=budget, clock=clock)
        elif spec.actor == "dispatcher":
            scheduled.dispatch(conn, client, _renderer(), budget_seconds=budget, coalesce_seconds=0,
                               poll_seconds=30, batch_size=spec.chunk_size, clock=clock, run=run)
        else:
            conn.autocommit = True
            row = conn.execute("select now()").fetchone()
            assert row is not None
            reconcile(conn, client, now=row[0], stale_after=timedelta(0), run=run, clock=clock,
                      deadline=clock.monotonic() + budget)
        client.pacer.close()  # type: ignore[attr-defined]


def _child(spec: ActorSpec, plan: Plan | None) -> None:
    import logging

    logging.disable(logging.CRITICAL)
    if plan is not None:
        _install_kill(plan)
    try:
        run_actor(spec)
    except SendError:
        os._exit(3)  # a run that stopped with an alert (auth, quota, refused body): recorded, expected
    except BaseException:
        with open(spec.error_log, "a", encoding="utf-8") as fh:
            fh.write(f"--- {spec.actor} {spec.run_id} plan={plan}\n{traceback.format_exc()}\n")
        os._exit(UNEXPECTED)
    os._exit(0)


def fork_actor(spec: ActorSpec, plan: Plan | None, timeout: float = 120.0) -> int:
    """Run ``spec`` in a forked process; return its exit code (``-SIGKILL`` when killed)."""
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(spec, plan))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        with open(spec.error_log, "a", encoding="utf-8") as fh:
            fh.write(f"--- {spec.actor} {spec.run_id} plan={plan}: hung for {timeout} s, killed\n")
        return UNEXPECTED
    return int(proc.exitcode or 0)


# -- databases --------------------------------------------------------------------------------------

def build_template(dsn: str, *, users: int, scheduled_users: int, seed: int, workdir: Path) -> None:
    """Migrate ``dsn``, load demo users and create a scheduled campaign whose rows are all due."""
    from mailflow.sources import scheduled
    from mailflow.store.migrate import migrate
    from mailflow_dev.demo.loader import load_demo_data

    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        load_demo_data(conn, users=users, seed=seed, anchor=ANCHOR)
        path = workdir / "scheduled_recipients.csv"
        with open(path, "w", newline="", encoding="utf-8") as fh:
            w = csv.writer(fh)
            w.writerow(["user_id", "email", "first_name"])
            for i in range(1, scheduled_users + 1):
                w.writerow([SCHEDULED_USER_BASE + i, f"outreach{i}@example.org", f"Reader{i}"])
        past = datetime(2026, 1, 5, tzinfo=UTC)
        cid = scheduled.create_campaign(conn, {
            "name": SCHEDULED, "template": "outreach", "subject": "{{ user.first_name }}, the full practice library",
            "from": "Outreach <outreach@mail.example.com>", "recipients_csv": str(path), "start_at": past,
            "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"],
            "emails_per_day": 100_000}, actor="chaos")
        scheduled.provision(conn, cid, now=past)


def scenario_db(admin: str, template: str, name: str) -> str:
    """A copy of ``template`` with an installation id of its own; returns its DSN."""
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'drop database if exists "{name}" with (force)')
        conn.execute(f'create database "{name}" template "{template}"')
    dsn = _dsn_for(admin, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("update mail.installation set id = %s", (uuid.uuid4().hex,))
    return dsn


def _dsn_for(admin: str, name: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(admin)
    params["dbname"] = name
    return make_conninfo("", **params)


class Team:
    """The emulator (one provider team) and the offset of its clock from the system's (seconds)."""

    def __init__(self, emu: EmulatorProcess):
        self.emu = emu
        self.offset = 0.0

    @property
    def base_url(self) -> str:
        return self.emu.base_url

    def configure(self, **settings: Any) -> None:
        self.emu.configure(**settings)

    def advance_clock(self, seconds: float) -> None:
        self.emu.configure(advance_clock_seconds=seconds)
        self.offset += seconds

    def now(self) -> float:
        """The emulator's clock (epoch seconds)."""
        return time.time() + self.offset


def advance(dsn: str, team: Team, seconds: float) -> None:
    """Move the scenario's simulated clock on by ``seconds``: the emulator's clock, and every stored
    batch gets that much older (the reconciler's idempotency window reads ``send_batch.created_at``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("update mail.send_batch set created_at = created_at - make_interval(secs => %s)", (seconds,))
    team.advance_clock(seconds)


# -- the audit --------------------------------------------------------------------------------------

def eligible_left(conn: psycopg.Connection, campaigns: tuple[Campaign, ...]) -> int:
    """Users still selectable by some lifecycle campaign for the interval."""
    from mailflow.store.send_log import PostgresStore

    store = PostgresStore(conn)
    return sum(store.count_audience(c, c.window(INTERVAL), INTERVAL.end - c.cooldown) for c in campaigns)


def work_left(conn: psycopg.Connection, campaigns: tuple[Campaign, ...]) -> int:
    """Eligible users + rows ``sending`` + scheduled rows due and ``pending``."""
    row = conn.execute("select count(*) filter (where status = 'sending'),"
                       " count(*) filter (where status = 'pending' and scheduled_at <= now())"
                       " from mail.send_log").fetchone()
    assert row is not None
    return eligible_left(conn, campaigns) + int(row[0]) + int(row[1])


def _email_fingerprint(email: dict[str, Any]) -> tuple[Any, ...]:
    def sha(v: Any) -> str | None:
        return hashlib.sha256(v.encode()).hexdigest() if isinstance(v, str) else None

    to = email.get("to")
    to = [to] if isinstance(to, str) else list(to or [])
    headers = {str(k).lower(): v for k, v in (email.get("headers") or {}).items()}
    return (tuple(a.strip() for a in to), email.get("subject"), sha(email.get("text")) if "text" in email
            else email.get("text_sha256"), sha(email.get("html")) if "html" in email else email.get("html_sha256"),
            headers.get("x-mailflow-send-id"))


def audit(conn: psycopg.Connection, lines: list[dict[str, Any]], campaigns: tuple[Campaign, ...],
          bad_users: set[int], conflicts: int) -> dict[str, Any]:
    """The five invariants for one installation (``lines``: its outbox lines) plus information."""
    rows = {r[0]: r for r in conn.execute(
        "select id, user_id, campaign, status, provider_message_id, idempotency_key, error, dead_lettered_at,"
        " released_at from mail.send_log").fetchall()}
    bodies = {r[0]: bytes(r[1]) for r in conn.execute("select idempotency_key, body from mail.send_batch").fetchall()}
    by_row: Counter[int] = Counter()
    per_user: Counter[tuple[Any, ...]] = Counter()
    seen: dict[tuple[str, int], set[tuple[Any, ...]]] = defaultdict(set)
    bad_keys: set[str] = set()
    without_sent = mismatch = 0
    for d in lines:
        headers = {str(k).lower(): v for k, v in (d.get("headers") or {}).items()}
        sid = int(headers.get("x-mailflow-send-id", -1))
        by_row[sid] += 1
        row = rows.get(sid)
        per_user[(row[1], row[2]) if row else ("unknown", sid)] += 1
        if row is None or row[3] != "sent":
            without_sent += 1
        elif row[4] != d.get("id"):
            mismatch += 1
        key, index = str(d.get("idempotency_key")), int(d.get("batch_index") or 0)
        fp = _email_fingerprint(d)
        seen[(key, index)].add(fp)
        stored = bodies.get(key)
        if stored is None:
            bad_keys.add(key)  # delivered under a key this installation never stored
        else:
            items = json.loads(stored)
            if not 0 <= index < len(items) or _email_fingerprint(items[index]) != fp:
                bad_keys.add(key)  # delivered bytes are not the stored bytes of the key
    bad_keys |= {k for (k, _), fps in seen.items() if len(fps) > 1}
    sent = [r for r in rows.values() if r[3] == "sent"]
    row = conn.execute("select count(*) filter (where status = 'sending'),"
                       " count(*) filter (where status = 'pending' and scheduled_at <= now())"
                       " from mail.send_log").fetchone()
    assert row is not None
    dead = sum(1 for r in rows.values() if r[7] is not None)
    wrongly = [r for r in rows.values() if r[3] == "failed" and r[7] is None and r[8] is None
               and r[1] not in bad_users and not str(r[6] or "").startswith("invalid address")]
    wrongly_failed = len(wrongly)
    return {
        "duplicate_deliveries": sum(n - 1 for n in per_user.values() if n > 1),
        "sent_without_delivery": sum(1 for r in sent if by_row[r[0]] == 0),
        "delivered_without_sent": without_sent,
        "keys_with_two_bodies": len(bad_keys) + conflicts,
        "eligible_not_sent": eligible_left(conn, campaigns) + int(row[0]) + int(row[1]) + dead + wrongly_failed,
        "delivered": len(lines),
        "sent_rows": len(sent),
        "provider_ids_misattributed": mismatch,
        "dead_letters": dead,
        "wrongly_failed": [f"row {r[0]} user {r[1]} {r[2]}: {r[6]}" for r in wrongly[:5]],
    }


# -- one scenario -----------------------------------------------------------------------------------

@dataclass
class ScenarioReport:
    name: str
    about: str
    kills: int = 0
    kills_by_actor: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ACTORS, 0))
    kills_by_point: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    completed_runs: int = 0
    stopped_runs: int = 0
    unexpected: int = 0
    recovery_rounds: int = 0
    simulated_hours: float = 0.0
    invariants: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


class Runner:
    """Drives one scenario's runs: picks actors and kill plans, forks, counts."""

    def __init__(self, scn: Scenario, dsn: str, emu: Team, rng: random.Random, chunk_size: int,
                 campaigns: tuple[Campaign, ...], error_log: Path, report: ScenarioReport):
        self.scn, self.dsn, self.emu, self.rng = scn, dsn, emu, rng
        self.chunk_size, self.campaigns, self.error_log, self.report = chunk_size, campaigns, error_log, report
        self.sim = 0.0
        self.base_url = emu.base_url
        self.n = 0

    def spec(self, actor: str) -> ActorSpec:
        self.n += 1
        return ActorSpec(actor=actor, dsn=self.dsn, base_url=self.base_url, api_key=self.scn.key,
                         strict=self.scn.strict, campaigns=self.campaigns,
                         sim_seconds=None if self.scn.real_clock else self.sim, chunk_size=self.chunk_size,
                         run_id=f"{self.scn.name}-{self.n}", error_log=str(self.error_log))

    def plan(self, actor: str, first_chunk: bool) -> Plan:
        """A random kill point; ``first_chunk``: at the first batch (runs that stop after one)."""
        return Plan(point=self.rng.choice(KILL_POINTS[actor]), chunk=0 if first_chunk else self.rng.choice((0, 0, 1, 2)),
                    delay=self.rng.uniform(0.0, 0.03))

    def run(self, actor: str, kill: bool, first_chunk: bool = False) -> int:
        if self.scn.status_cycle:
            self.emu.configure(error_after_status=self.rng.choice(self.scn.status_cycle))
        plan = self.plan(actor, first_chunk) if kill else None
        code = fork_actor(self.spec(actor), plan)
        r = self.report
        r.runs += 1
        if code == -signal.SIGKILL and plan is not None:
            r.kills += 1
            r.kills_by_actor[actor] += 1
            key = f"{actor}:{plan.point}"
            r.kills_by_point[key] = r.kills_by_point.get(key, 0) + 1
        elif code == 0:
            r.completed_runs += 1
        elif code == 3:
            r.stopped_runs += 1
        else:
            r.unexpected += 1
        return code

    def advance(self, seconds: float) -> None:
        advance(self.dsn, self.emu, seconds)
        self.sim += seconds
        self.report.simulated_hours = round(self.sim / 3600, 2)

    def work_left(self) -> int:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return work_left(conn, self.campaigns)


def _kill_phase(r: Runner, kills: int, first_chunk: bool = False) -> None:
    """Random actors, each killed at a random point, until ``kills`` kills or no work is left."""
    attempts = 0
    while r.report.kills < kills and attempts < 8 * kills + 10:
        attempts += 1
        actor = r.rng.choices(ACTORS, weights=(0.45, 0.35, 0.2))[0]
        r.run(actor, kill=True, first_chunk=first_chunk)
        if attempts % 5 == 0 and r.work_left() == 0:
            break


def _stepped(r: Runner, kills: int, schedule: list[list[str]], step_seconds: float,
             before_step: Callable[[int], None]) -> None:
    """Run ``schedule[i]`` (actors) at simulated step ``i``, ``step_seconds`` apart; ``kills`` of the
    runs, drawn at random, get a kill plan at their first batch (these runs stop after one)."""
    runs = [(i, j) for i, actors in enumerate(schedule) for j in range(len(actors))]
    doomed = set(r.rng.sample(runs, min(kills, len(runs))))
    for i, actors in enumerate(schedule):
        before_step(i)
        for j, actor in enumerate(actors):
            r.run(actor, kill=(i, j) in doomed, first_chunk=True)
        r.advance(step_seconds)


def _outage_phase(r: Runner, kills: int, step_minutes: float) -> None:
    """Six simulated hours: hours 0-2 and 3-6 answer 503 to everything, hour 2-3 the provider is
    unreachable (connection refused: nothing written). The dispatcher runs every step, the
    reconciler every 30 and the sender every 60 simulated minutes; kills land on random runs, and
    kill plans that found nothing to kill are made up by more runs at the end of the outage."""
    steps = max(6, round(6 * 60 / step_minutes))
    dead = f"http://127.0.0.1:{free_port()}"
    every = max(1, steps // 12)
    schedule = [["dispatcher"] + (["reconciler"] if i % every == 0 else []) + (["sender"] if i % (2 * every) == 0
                else []) for i in range(steps)]

    def before(i: int) -> None:
        r.base_url = dead if steps // 3 <= i < steps // 2 else r.emu.base_url

    r.emu.configure(outage=True)
    _stepped(r, kills, schedule, 6 * 3600 / steps, before)
    r.base_url = r.emu.base_url
    _kill_phase(r, kills, first_chunk=True)


def _quota_phase(r: Runner, kills: int, step_minutes: float) -> None:
    """The emulator's day is set to end 4 simulated hours from now; a daily quota of a third of the
    work runs out within the first steps, and every run after it meets 429 daily_quota_exceeded
    (the reconciler's resends too) for the rest of the day. At the provider's next UTC day the
    quota is lifted (a plan upgrade) for the recovery."""
    to_day_end = 4 * 3600
    # a new provider day that ends in 4 h (a jump of the emulator's clock only: not elapsed time)
    r.emu.advance_clock((86400 - r.emu.now() % 86400) % 86400 + 86400 - to_day_end)
    with psycopg.connect(r.dsn, autocommit=True) as conn:
        work = work_left(conn, r.campaigns)
    r.emu.configure(quota_emails=max(1, work // 3))
    steps = max(4, round(4 * 60 / step_minutes))
    schedule = [["dispatcher", "sender"] + (["reconciler"] if i % 2 == 0 else []) for i in range(steps)]
    _stepped(r, kills, schedule, to_day_end / steps, lambda i: None)
    _kill_phase(r, kills, first_chunk=True)
    r.emu.configure(quota_emails=None)


def recover(r: Runner, max_rounds: int = 25) -> int:
    """Faults off: reconciler, sender, dispatcher rounds (no kills) until no work is left or a
    round changes nothing. Returns the rounds run."""
    r.base_url = r.emu.base_url

    def state() -> tuple[list[Any], int]:
        with psycopg.connect(r.dsn, autocommit=True) as conn:
            return (conn.execute("select status, released_at is null, count(*) from mail.send_log"
                                 " group by 1, 2 order by 1, 2").fetchall(), work_left(conn, r.campaigns))

    before = state()
    for rounds in range(1, max_rounds + 1):
        for actor in ("reconciler", "sender", "dispatcher"):
            r.run(actor, kill=False)
        after = state()
        if after[1] == 0 or after == before:
            return rounds
        before = after
    return max_rounds


def _scenario_faults(scn: Scenario, emails: list[str], rng: random.Random) -> dict[str, Any]:
    faults = dict(scn.faults)
    if "suppress" in faults:  # a few real recipients of the scenario
        pick = rng.sample(emails, min(len(emails), 20))
        faults["suppress"], faults["fail"] = pick[:10], pick[10:]
    return faults


def _feedback(dsn: str, team: Team) -> dict[str, int]:
    """One run of the deliverability feedback reader (full-access key) over the scenario's sends:
    ``last_event`` suppressed suppresses the address, failed is recorded, an id on the wrong row is
    a recipient mismatch (nothing suppressed)."""
    import logging

    from mailflow.feedback.deliverability import poll_feedback

    logging.getLogger("mailflow").setLevel(logging.CRITICAL)  # its per-email alerts are the point here
    with psycopg.connect(dsn) as conn, ResendClient(team.base_url, API_KEY, pacer=PostgresPacer(
            lambda: psycopg.connect(dsn), "chaos-feedback", requests_per_second=500, target_fraction=1.0),
            timeout=httpx.Timeout(5.0)) as client:
        s = poll_feedback(conn, client, min_age=timedelta(0), limit=200, budget_seconds=120)  # every email of a small run, a sample of a large one
        client.pacer.close()  # type: ignore[attr-defined]
    return {"checked": s.checked, "provider_suppressed": s.provider_suppressed, "failed": s.failed,
            "recipient_mismatch": s.mismatched, "suppressed": s.suppressed}


@contextmanager
def _noise(base_url: str, rate: float) -> Iterator[None]:
    """Another API key of the same team using ``rate`` requests/s (GET /domains) in the background."""
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {SENDING_ONLY_KEY}"},
                          timeout=2.0) as c:
            while not stop.is_set():
                try:
                    c.get("/domains")
                except httpx.HTTPError:
                    pass
                stop.wait(1.0 / rate)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(5)


def run_scenario(scn: Scenario, dsn: str, emu: Team, *, kills: int, seed: int, chunk_size: int,
                 error_log: Path, out: Callable[[str], None], step_minutes: float = 10.0,
                 settle: bool = True) -> ScenarioReport:
    """Fault phase with ``kills`` kills, recovery, audit; returns the scenario's report."""
    t0 = time.monotonic()
    rng = random.Random(f"{seed}-{scn.name}")
    report = ScenarioReport(scn.name, scn.about)
    campaigns = tuple(load_campaigns())
    bad_users: set[int] = set()
    with psycopg.connect(dsn, autocommit=True) as conn:
        inst = str(conn.execute("select id from mail.installation").fetchone()[0])  # type: ignore[index]
        emails = [r[0] for r in conn.execute("select email from app.users order by user_id").fetchall()]
        if scn.strict:
            # The provider refuses an email with an empty subject; our renderer sends it as given. Every
            # 15th user of the first campaign's audience gets one: strict mode refuses those batches whole.
            conn.execute("update app.users set first_name = '' where user_id % 15 = 0")
            bad_users = {int(r[0]) for r in conn.execute(  # the demo data has some of its own
                "select user_id from app.users where coalesce(first_name, '') = ''").fetchall()}
            first = campaigns[0]
            campaigns = (dataclasses.replace(first, subject="{{ user.first_name }}"), *campaigns[1:])
        conflicts0 = int(emu.emu.stats()["conflicts"].get("invalid_idempotent_request", 0))
    r = Runner(scn, dsn, emu, rng, chunk_size, campaigns, error_log, report)
    phases: dict[str, float] = {"setup": time.monotonic() - t0}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()

    faults = _scenario_faults(scn, emails, rng)
    emu.configure(**(FAULTS_OFF | faults))
    if scn.driver == "outage":
        _outage_phase(r, kills, step_minutes)
    elif scn.driver == "quota":
        _quota_phase(r, kills, 1.5 * step_minutes)
    elif scn.name == "team_rate_limit":
        with _noise(emu.base_url, 4.0):
            _kill_phase(r, kills)
    else:
        _kill_phase(r, kills)
    phase("faults")
    keep = {k: v for k, v in faults.items() if k in ("suppress", "fail", "scramble_order")}
    emu.configure(**(FAULTS_OFF | keep))
    report.recovery_rounds = recover(r)
    if settle and not scn.real_clock:
        r.advance(3600)  # an hour later, one more round: nothing may change
        recover(r, max_rounds=1)
    phase("recovery")
    if keep:
        report.info["feedback"] = _feedback(dsn, emu)
        phase("feedback")
    conflicts = int(emu.emu.stats()["conflicts"].get("invalid_idempotent_request", 0)) - conflicts0
    lines = [d for d in emu.emu.read_outbox() if str(d.get("idempotency_key") or "").startswith(f"mf-{inst}-")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        result = audit(conn, lines, campaigns, bad_users, conflicts)
        report.info["states"] = dict(conn.execute(
            "select status || case when dead_lettered_at is not null then '+dead_letter'"
            " when released_at is not null then '+released' else '' end, count(*)"
            " from mail.send_log group by 1 order by 1").fetchall())
    phase("audit")
    report.info["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    report.invariants = {k: result[k] for k in COLUMNS}
    report.info |= {k: result[k] for k in result if k not in COLUMNS}
    report.seconds = round(time.monotonic() - t0, 1)
    out(f"  {scn.name}: {report.kills} kills, {report.runs} runs ({report.recovery_rounds} recovery rounds), "
        f"{report.info['delivered']} delivered, {report.seconds} s {report.info['phase_seconds']}; "
        f"states {report.info['states']}"
        + (f"; feedback {report.info['feedback']}" if "feedback" in report.info else "")
        + (f"; VIOLATED {bad}" if (bad := {k: v for k, v in report.invariants.items() if v}) else "")
        + (f"; wrongly failed {report.info['wrongly_failed']}" if report.info["wrongly_failed"] else ""))
    return report


# -- the whole run ----------------------------------------------------------------------------------

def share_kills(kills: int, scenarios: tuple[Scenario, ...]) -> list[int]:
    """Split ``kills`` over the scenarios by weight, at least one each (largest remainder)."""
    n = len(scenarios)
    if kills < n:
        raise ValueError(f"at least {n} kills are needed (one per fault kind), got {kills}")
    total = sum(s.weight for s in scenarios)
    raw = [1 + (kills - n) * s.weight / total for s in scenarios]
    out = [int(x) for x in raw]
    for i in sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)[: kills - sum(out)]:
        out[i] += 1
    return out


def run_chaos(admin_dsn: str, *, kills: int = 200, users: int = 800, scheduled_users: int = 300, seed: int = 7,
              chunk_size: int = 10, step_minutes: float = 10.0, settle: bool = True,
              scenarios: tuple[Scenario, ...] = SCENARIOS, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every scenario on scratch databases of the server ``admin_dsn`` (created and dropped
    here); return the report: ``scenarios`` (one dict per fault kind), ``totals``, ``kills``.

    :param users: demo users per scenario database (their lifecycle audiences are the sender's work).
    :param scheduled_users: due scheduled rows per scenario database (the dispatcher's work).
    :param chunk_size: emails per batch request.
    :param step_minutes: simulated minutes between the outage's runs (the quota's: 1.5 times this).
    :param settle: after recovery, one more round an hour (simulated) later that must change nothing.
    """
    from mailflow_dev import devenv

    t0 = time.monotonic()
    prefix = f"mailflow_chaos_{os.getpid()}"
    workdir = Path(mkdtemp(prefix="mailflow-chaos-"))
    error_log = workdir / "errors.log"
    template = f"{prefix}_template"
    names: list[str] = [template]
    reports: list[ScenarioReport] = []
    droppers: list[threading.Thread] = []
    try:
        tdsn = devenv.create_database(admin_dsn, template, exist_ok=False)
        build_template(tdsn, users=users, scheduled_users=scheduled_users, seed=seed, workdir=workdir)
        out(f"template database ready ({users} demo users, {scheduled_users} scheduled recipients, "
            f"{time.monotonic() - t0:.0f} s)")
        with EmulatorProcess(outbox=workdir / "outbox.jsonl", rate_limit=0, seed=seed, latency_ms=3,
                             latency_jitter_ms=10, hang_seconds=HANG_SECONDS,
                             restricted_keys=[SENDING_ONLY_KEY]) as process:
            emu = Team(process)
            carry = 0
            for scn, share in zip(scenarios, share_kills(kills, scenarios), strict=True):
                name = f"{prefix}_{len(names)}"
                names.append(name)
                dsn = scenario_db(admin_dsn, template, name)
                rep = run_scenario(scn, dsn, emu, kills=share + carry, seed=seed, chunk_size=chunk_size,
                                   error_log=error_log, out=out, step_minutes=step_minutes, settle=settle)
                carry = share + carry - rep.kills
                reports.append(rep)
                dropper = threading.Thread(target=devenv.drop_database, args=(admin_dsn, name))
                dropper.start()  # while the next scenario runs
                droppers.append(dropper)
            emulator_stats = process.stats()
        errors = error_log.read_text(encoding="utf-8") if error_log.exists() else ""
    finally:
        for dropper in droppers:
            dropper.join()
        for name in names:
            try:
                devenv.drop_database(admin_dsn, name)
            except psycopg.Error:
                pass
        shutil.rmtree(workdir, ignore_errors=True)
    totals = {k: sum(r.invariants.get(k, 0) for r in reports) for k in COLUMNS}
    return {
        "kills_requested": kills,
        "kills": sum(r.kills for r in reports),
        "kills_by_actor": {a: sum(r.kills_by_actor[a] for r in reports) for a in ACTORS},
        "unexpected_errors": sum(r.unexpected for r in reports),
        "errors": errors[-4000:],
        "totals": totals,
        "scenarios": [dataclasses.asdict(r) for r in reports],
        "emulator": {k: emulator_stats.get(k) for k in ("requests", "accepted_emails", "replays", "status_5xx",
                                                          "errors_after_accept", "resets_after_accept",
                                                          "timeouts_injected", "rate_limited", "conflicts")},
        "seconds": round(time.monotonic() - t0, 1),
    }


def table(report: dict[str, Any]) -> str:
    """The per-fault-kind table (text)."""
    head = ["fault kind", "kills", *HEADERS, "ids misattributed*"]
    body = []
    for s in report["scenarios"]:
        body.append([s["name"], str(s["kills"]), *(str(s["invariants"][k]) for k in COLUMNS),
                     str(s["info"].get("provider_ids_misattributed", 0))])
    body.append(["TOTAL", str(report["kills"]), *(str(report["totals"][k]) for k in COLUMNS),
                 str(sum(int(s["info"].get("provider_ids_misattributed", 0)) for s in report["scenarios"]))])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *(line(r) for r in body[:-1]), rule, line(body[-1])])


def failed(report: dict[str, Any]) -> list[str]:
    """What makes the run fail: a non-zero invariant, an unexpected error, too few kills."""
    bad = [f"{k} = {v}" for k, v in report["totals"].items() if v]
    if report["unexpected_errors"]:
        bad.append(f"{report['unexpected_errors']} actor run(s) failed unexpectedly")
    if report["kills"] < report["kills_requested"]:
        bad.append(f"only {report['kills']} of {report['kills_requested']} kills happened")
    return bad


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow_dev.chaos [--kills N] [--users N] [--seed N] [--dsn DSN] [--json]``; exit 1
    if any invariant is not 0."""
    p = argparse.ArgumentParser(prog="mailflow_dev.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200, help="SIGKILLs in all, spread over the fault kinds (default 200)")
    p.add_argument("--users", type=int, default=800, help="demo users per fault kind's database (default 800)")
    p.add_argument("--scheduled-users", type=int, default=300, help="scheduled recipients per database (300)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--chunk-size", type=int, default=10, help="emails per batch request (default 10)")
    p.add_argument("--step-minutes", type=float, default=10.0,
                   help="simulated minutes between the outage's runs (default 10; the quota's: 1.5 times)")
    p.add_argument("--only", action="append", default=[], help="run only this fault kind (repeatable)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON too")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create scratch databases on "
                        "(default: $TEST_DATABASE_URL, else the embedded server)")
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    scenarios = SCENARIOS
    if args.only:
        unknown = set(args.only) - {s.name for s in SCENARIOS}
        if unknown:
            p.error(f"unknown fault kind(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
        scenarios = tuple(s for s in SCENARIOS if s.name in args.only)
    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    try:
        report = run_chaos(admin, kills=args.kills, users=args.users, scheduled_users=args.scheduled_users,
                           seed=args.seed, chunk_size=args.chunk_size, step_minutes=args.step_minutes,
                           scenarios=scenarios, out=lambda s: print(s, flush=True))
    finally:
        if started:
            devenv.stop_embedded(pgdata)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    print()
    print(table(report))
    print("* provider ids misattributed: ids answered out of request order land on the wrong rows; delivery is "
          "unaffected and the feedback reader refuses to act on them (recipient check). Information only.")
    print(f"kills: {report['kills']} of {report['kills_requested']} ({report['kills_by_actor']}); "
          f"wall time {report['seconds']} s")
    if report["errors"]:
        print("unexpected errors:\n" + report["errors"])
    bad = failed(report)
    print("invariants: " + ("ALL 0" if not bad else "VIOLATED: " + "; ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
