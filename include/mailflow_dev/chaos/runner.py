"""One scenario from fault phase to recovery and audit (:func:`run_scenario`), and the whole run
over every fault kind (:func:`run_chaos`)."""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import psycopg

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.emulator.testing import EmulatorProcess, free_port
from mailflow.provider.client import ResendClient
from mailflow.provider.pacing import PostgresPacer
from mailflow_dev.chaos.actors import fork_actor
from mailflow_dev.chaos.audit import Team, advance, audit, build_template, scenario_db, work_left
from mailflow_dev.chaos.scenarios import (
    ACTORS,
    API_KEY,
    COLUMNS,
    FAULTS_OFF,
    HANG_SECONDS,
    KILL_POINTS,
    ROTATED_KEY,
    SCENARIOS,
    SCHEDULED,
    SENDING_ONLY_KEY,
    ActorSpec,
    Plan,
    Scenario,
    scenario_faults,
    share_kills,
)


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
        self.key = scn.key  # the actors' API key (a rotation changes it)
        self.previous_keys: tuple[str, ...] = ()

    def spec(self, actor: str) -> ActorSpec:
        self.n += 1
        return ActorSpec(actor=actor, dsn=self.dsn, base_url=self.base_url, api_key=self.key,
                         previous_keys=self.previous_keys,
                         strict=self.scn.strict, campaigns=self.campaigns,
                         sim_seconds=None if self.scn.real_clock else self.sim, chunk_size=self.chunk_size,
                         run_id=f"{self.scn.name}-{self.n}", error_log=str(self.error_log),
                         slow_pacer=self.scn.slow_pacer)

    def plan(self, actor: str, first_chunk: bool) -> Plan:
        """A random kill point; ``first_chunk``: at the first batch (runs that stop after one)."""
        return Plan(point=self.rng.choice(KILL_POINTS[actor]), chunk=0 if first_chunk else self.rng.choice((0, 0, 1, 2)),
                    delay=self.rng.uniform(0.0, 0.03))

    def run(self, actor: str, kill: bool, first_chunk: bool = False) -> int:
        if self.scn.status_cycle:
            self.emu.configure(error_after_status=self.rng.choice(self.scn.status_cycle))
        if self.scn.per_run:
            self.emu.configure(**self.rng.choice(self.scn.per_run))
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


def _long_outage_phase(r: Runner, kills: int, step_minutes: float, hours: float = 30.0) -> None:
    """An outage longer than the idempotency window (23 h here, 24 h at Resend): ``hours`` simulated
    hours of 503s to everything, reads included, with the provider unreachable (connection refused)
    from hour 10 to 14. The dispatcher runs every step (at least 30 simulated minutes apart), the
    reconciler every step and the sender every other; kills land on random runs, and those that found
    nothing to kill on runs after the outage. With the circuit
    breaker only the batches in flight when the outage began may become dead letters; everyone else
    is still eligible and is mailed once in the recovery."""
    step = max(step_minutes, 30.0) * 60
    steps = max(2, round(hours * 3600 / step))
    dead = f"http://127.0.0.1:{free_port()}"
    schedule = [["dispatcher", "reconciler"] + (["sender"] if i % 2 == 0 else []) for i in range(steps)]

    def before(i: int) -> None:
        r.base_url = dead if 10 * 3600 <= i * step < 14 * 3600 else r.emu.base_url

    r.emu.configure(outage=True)
    _stepped(r, kills, schedule, step, before)
    r.base_url = r.emu.base_url
    _decide_dead_letters(r)
    # with the breaker open almost no run of the outage reaches a batch to be killed at: the kills
    # still due land on the way back (the breaker's probe, the resends, the re-opened dead letters)
    r.emu.configure(outage=False)
    _kill_phase(r, kills)


def _decide_dead_letters(r: Runner) -> None:
    """The runbook's decision (docs/operations.md, "Dead letters"), taken as a person would: a dead
    letter whose key the provider never delivered (not in the outbox: the outage answered 503 before
    processing) is re-opened for a resend under a new key; one it did deliver is closed. The audit
    then proves nobody was mailed twice."""
    from mailflow.cli import dead_letters, decide_dead_letters

    delivered = {str(d.get("idempotency_key")) for d in r.emu.emu.read_outbox()}
    with psycopg.connect(r.dsn, autocommit=True) as conn:
        rows = dead_letters(conn)
        for decision, ids in (("resend", [int(x[0]) for x in rows if x[4] not in delivered]),
                              ("close", [int(x[0]) for x in rows if x[4] in delivered])):
            if ids:
                decide_dead_letters(conn, decision, ids, "chaos runner",
                                    "the provider's outbox shows whether the key was delivered")
    r.report.info["dead_letters_decided"] = len(rows)


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


def _rotation_phase(r: Runner, kills: int) -> None:
    """Batches made ambiguous (and senders killed) under the scenario's key; then the key is rotated:
    faults off, one reconcile run with only the new key (the old batches must be held: nothing sent,
    nothing claimed), and from then on every actor uses the new key and the reconciler keeps the old
    one as a previous key (docs/operations.md, "Rotating the API key") for the recovery."""
    _kill_phase(r, kills)
    r.emu.configure(**FAULTS_OFF)

    def ambiguous() -> int:
        with psycopg.connect(r.dsn, autocommit=True) as conn:
            row = conn.execute("select count(*) from mail.send_log where status = 'sending'").fetchone()
        return int(row[0]) if row else 0

    before, requests = ambiguous(), int(r.emu.emu.stats()["requests"])
    r.key, r.previous_keys = ROTATED_KEY, ()
    r.run("reconciler", kill=False)
    r.report.info["held_run"] = {"sending_before": before, "sending_after": ambiguous(),
                                 "requests": int(r.emu.emu.stats()["requests"]) - requests}
    r.previous_keys = (r.scn.key,)


def _cancel_phase(r: Runner, kills: int) -> None:
    """An operator cancels the scheduled campaign while one of its batches is in flight, and the
    provider then refuses that batch whole (429 ``daily_quota_exceeded``: proven not processed).
    A new provider day starts with a daily quota of a third of the campaign; a first dispatcher run
    sends that third and stops at the quota; the next one cancels the campaign (another session,
    committed) at the moment its first batch goes out, so the refusal is applied to rows of a
    cancelled campaign: they must become ``cancelled``, never ``pending`` again (a pending row there
    is never picked up and would count as a contact; the audit's due-pending count sees it). Then
    random actors are killed while the quota stays exhausted; the recovery lifts it."""
    from mailflow.provider.client import ResendClient
    from mailflow.sources import scheduled

    with psycopg.connect(r.dsn, autocommit=True) as conn:
        cid, due = conn.execute("select c.id, count(l.id) from mail.campaign c join mail.send_log l"
                                " on l.campaign = c.name and l.status = 'pending' where c.name = %s group by c.id",
                                (SCHEDULED,)).fetchone()  # type: ignore[misc]
    r.emu.advance_clock((86400 - r.emu.now() % 86400) % 86400 + 1)  # the quota counts from a new provider day
    r.emu.configure(quota_emails=max(1, int(due) // 3))
    r.run("dispatcher", kill=False)
    original = ResendClient.send_batch

    def cancel_then_send(self: Any, *a: Any, **k: Any) -> Any:
        with psycopg.connect(r.dsn, autocommit=True) as other:
            scheduled.cancel(other, int(cid), actor="chaos operator")
        ResendClient.send_batch = original  # type: ignore[method-assign]  # (in this child) once
        return original(self, *a, **k)

    ResendClient.send_batch = cancel_then_send  # type: ignore[method-assign]  # inherited by the next fork only
    try:
        r.run("dispatcher", kill=False)
    finally:
        ResendClient.send_batch = original  # type: ignore[method-assign]
    with psycopg.connect(r.dsn, autocommit=True) as conn:
        r.report.info["cancelled_in_flight"] = conn.execute(
            "select count(*) from mail.send_event e join mail.send_log l on l.id = e.send_log_id"
            " where l.campaign = %s and e.from_status = 'sending' and e.to_status = 'cancelled'",
            (SCHEDULED,)).fetchone()[0]  # type: ignore[index]
    _kill_phase(r, kills, first_chunk=True)
    with psycopg.connect(r.dsn, autocommit=True) as conn:
        r.report.info["pending_in_cancelled"] = conn.execute(
            "select count(*) from mail.send_log l join mail.campaign c on c.name = l.campaign"
            " where c.status = 'cancelled' and l.status = 'pending'").fetchone()[0]  # type: ignore[index]


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


def _feedback(dsn: str, team: Team) -> dict[str, int]:
    """One run of the deliverability feedback reader (full-access key) over the scenario's sends:
    ``last_event`` suppressed suppresses the address, failed is recorded, an id on the wrong row is
    a recipient mismatch (nothing suppressed)."""
    import logging

    from mailflow.feedback.deliverability import poll_feedback

    product_log = logging.getLogger("mailflow")
    level = product_log.level
    product_log.setLevel(logging.CRITICAL)  # its per-email alerts are the point here, not in the log
    try:
        with psycopg.connect(dsn) as conn, ResendClient(team.base_url, API_KEY, pacer=PostgresPacer(
                lambda: psycopg.connect(dsn), "chaos-feedback", requests_per_second=500, target_fraction=1.0),
                timeout=httpx.Timeout(5.0)) as client:
            s = poll_feedback(conn, client, min_age=timedelta(0), limit=200, budget_seconds=120)  # every email of a small run, a sample of a large one
            client.pacer.close()  # type: ignore[attr-defined]
    finally:
        product_log.setLevel(level)  # the caller's process logs as before (a test session runs this in-process)
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

    faults = scenario_faults(scn, emails, rng)
    emu.configure(**(FAULTS_OFF | faults))
    if scn.driver == "outage":
        _outage_phase(r, kills, step_minutes)
    elif scn.driver == "long_outage":
        _long_outage_phase(r, kills, step_minutes)
    elif scn.driver == "quota":
        _quota_phase(r, kills, 1.5 * step_minutes)
    elif scn.driver == "rotation":
        _rotation_phase(r, kills)
    elif scn.driver == "cancel":
        _cancel_phase(r, kills)
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
        + (f"; wrongly failed {report.info['wrongly_failed']}" if report.info["wrongly_failed"] else "")
        + (f"; {report.info['cancelled_in_flight']} rows cancelled in flight, {report.info['pending_in_cancelled']}"
           " pending in a cancelled campaign" if "cancelled_in_flight" in report.info else ""))
    return report


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
