"""One feedback chaos run (:func:`run_feedback_chaos`): the emulator pushes signed webhooks with every
fault on to a standalone receiver process, emails are sent while the receiver is SIGKILLed at random
points and restarted, then the sweep and the safety-net poll run and :mod:`.audit` counts what went
wrong."""

from __future__ import annotations

import base64
import logging
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import httpx
import psycopg

from mailflow.emulator.config import SVIX_RETRY_SCHEDULE
from mailflow.emulator.testing import EmulatorProcess
from mailflow.store.migrate import migrate
from mailflow.store.policy import mailbox_key
from mailflow_dev.chaos_feedback.audit import COLUMNS, audit
from mailflow_dev.chaos_feedback.receiver import ReceiverProcess

API_KEY = "re_test_emulator"
CAMPAIGN = "chaos_feedback"
BATCH = 50
#: The share of addresses per outcome rule (the rest are delivered; opens and clicks by seeded rates).
RULES = {"bounce": 0.08, "complain": 0.03, "soft_bounce": 0.06, "delayed": 0.05, "fail": 0.03}
#: Every webhook fault of the emulator, on at once. Stale and future copies carry a genuine signature
#: over a timestamp 10 minutes off; forged copies a wrong signature over a tampered body
#: (``email.complained``): each must be refused and change nothing.
FAULTS = {"webhook_duplicate_rate": 0.10, "webhook_reorder_rate": 0.20, "webhook_delay_rate": 0.10,
          "webhook_delay_seconds": 1.5, "webhook_drop_rate": 0.10, "webhook_forged_rate": 0.05,
          "webhook_stale_rate": 0.05, "webhook_future_rate": 0.05}
#: Svix's retry schedule (immediately, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h) run 500 times faster:
#: a day of retries in 200 s. The receiver's restart (1-3 s) is not compressed, so each kill is a
#: longer outage relative to the schedule than it would be for real.
TIME_SCALE = 0.002


@dataclass
class Report:
    """What one run did and found (``invariants``: each must be 0)."""

    emails: int = 0
    kills: int = 0
    kills_requested: int = 0
    restarts: int = 0
    down_seconds: float = 0.0
    seconds: float = 0.0
    invariants: dict[str, int] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


def new_secret() -> str:
    """A signing secret in Svix's format (``whsec_`` + base64 of 24 random bytes)."""
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def assign_rules(n: int, rng: random.Random) -> tuple[list[str], dict[str, list[str]]]:
    """``n`` addresses and the emulator's address rules over them (:data:`RULES` shares, drawn)."""
    addrs = [f"chaos{i}@example.com" for i in range(1, n + 1)]
    shuffled = addrs[:]
    rng.shuffle(shuffled)
    rules: dict[str, list[str]] = {}
    at = 0
    for name, share in RULES.items():
        k = max(1, round(n * share))
        rules[name] = shuffled[at:at + k]
        at += k
    return addrs, rules


class Sender(threading.Thread):
    """Sends every address one email, ``BATCH`` at a time, spread over ``seconds``: each batch's rows
    are inserted ``sending`` first, then ``POST /emails/batch`` (with an idempotency key), then the
    answer's ids are stored by index, as the engine does, so a webhook can arrive before its email's
    id is in the send log."""

    def __init__(self, dsn: str, base_url: str, addrs: list[str], seconds: float):
        super().__init__(daemon=True, name="chaos-feedback-sender")
        self.dsn, self.base_url, self.addrs, self.seconds = dsn, base_url, addrs, seconds
        self.sent = 0
        self.error: BaseException | None = None
        self.running = threading.Event()  # cleared: the sender waits before its next batch
        self.running.set()

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - reported by the runner
            self.error = exc

    def _run(self) -> None:
        batches = [self.addrs[i:i + BATCH] for i in range(0, len(self.addrs), BATCH)]
        gap = self.seconds / max(1, len(batches))
        with psycopg.connect(self.dsn, autocommit=True) as conn, \
                httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                             timeout=30.0) as http:
            t0 = time.monotonic()
            for n, batch in enumerate(batches):
                if not self.running.is_set():  # paused: the schedule resumes where it stopped, no burst
                    paused = time.monotonic()
                    self.running.wait()
                    t0 += time.monotonic() - paused
                key = f"chaos-feedback-{uuid.uuid4().hex}"
                with conn.transaction():
                    ids = [r[0] for r in conn.execute(
                        "insert into mail.send_log (user_id, campaign, kind, email, email_key, status, claimed_at,"
                        " idempotency_key, batch_index, attempts, run_id)"
                        " select u, %s, 'lifecycle', e, k, 'sending', now(), %s, i - 1, 1, 'chaos-feedback'"
                        " from unnest(%s::bigint[], %s::text[], %s::text[]) with ordinality as t(u, e, k, i)"
                        " order by i returning id",
                        (CAMPAIGN, key, [int(a[5:].split("@")[0]) for a in batch], batch,
                         [mailbox_key(a) for a in batch])).fetchall()]
                body = [{"from": "Chaos <chaos@mailflow.example>", "to": [a], "subject": "Feedback chaos",
                         "text": f"Hello {a}"} for a in batch]
                resp = http.post("/emails/batch", json=body, headers={"Idempotency-Key": key})
                resp.raise_for_status()
                pids = [d["id"] for d in resp.json()["data"]]
                with conn.transaction():
                    conn.execute("update mail.send_log set status = 'sent', sent_at = now(), provider_message_id = p"
                                 " from unnest(%s::bigint[], %s::text[]) as t(i, p) where id = t.i", (ids, pids))
                self.sent += len(batch)
                time.sleep(max(0.0, t0 + (n + 1) * gap - time.monotonic()))


def _drain(emu: EmulatorProcess, seconds: float) -> dict[str, Any]:
    """Wait until the emulator has no webhook message pending (acknowledged or given up), at most
    ``seconds``; its totals."""
    t0 = time.monotonic()
    while True:
        totals = emu._control("GET", "webhooks?limit=0")["totals"]
        if (totals["pending"] == 0 and not totals["queued"] and not totals["in_flight"]) \
                or time.monotonic() - t0 > seconds:
            return dict(totals)
        time.sleep(0.5)


def _messages(emu: EmulatorProcess) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    offset = 0
    while True:
        page = emu._control("GET", f"webhooks?limit=5000&offset={offset}")
        out += page["messages"]
        offset += len(page["messages"])
        if not page["has_more"]:
            return out


def sweep(dsn: str) -> dict[str, Any]:
    """The deliverability DAG's sweep: ``apply_pending`` until it applies nothing more."""
    from mailflow.feedback.webhooks import apply_pending

    rounds: list[dict[str, Any]] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(100):
            s = apply_pending(conn, 5000).as_dict()
            rounds.append(s)
            if not (s["applied"] or s["mismatched"] or s["ignored"] or s["unknown_email"]):
                break
    return {"rounds": len(rounds), "summaries": rounds[:5]}


def safety_net(dsn: str, base_url: str) -> dict[str, Any]:
    """The safety-net poll over every email without a final outcome (no minimum age here: the run
    is over), through the real client and pacer against the emulator."""
    from datetime import timedelta

    from mailflow.feedback.deliverability import poll_feedback
    from mailflow.provider.client import ResendClient
    from mailflow.provider.pacing import PostgresPacer

    product_log = logging.getLogger("mailflow")
    level = product_log.level
    product_log.setLevel(logging.CRITICAL)  # its per-email alerts are expected here
    try:
        pacer = PostgresPacer(lambda: psycopg.connect(dsn), "chaos-feedback-poll", requests_per_second=500,
                              target_fraction=1.0)
        with psycopg.connect(dsn) as conn, ResendClient(base_url, API_KEY, pacer=pacer,
                                                        timeout=httpx.Timeout(10.0)) as client:
            s = poll_feedback(conn, client, min_age=timedelta(0), limit=100_000, budget_seconds=300)
        pacer.close()
    finally:
        product_log.setLevel(level)
    return asdict(s) if hasattr(s, "__dataclass_fields__") else {"summary": repr(s)}


def run_feedback_chaos(admin_dsn: str, *, kills: int = 30, emails: int = 3000, seed: int = 7,
                       send_seconds: float | None = None, drain_seconds: float = 240.0,
                       time_scale: float = TIME_SCALE, outage_seconds: float = 4.0, outage: str = "clean",
                       out: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the feedback chaos on a scratch database of the server ``admin_dsn`` (created and
    dropped here); return the report (``invariants``: acknowledged_lost, wrong_suppressions,
    missed_suppressions, wrong_email, attacks_acknowledged; each must be 0).

    :param kills: SIGKILLs of the receiver, at random moments (0.5-3 s after it answered) while emails
        are sent and webhooks pushed; after each the receiver stays down a random 0-1 s (the provider
        meets refused connections and retries), then restarts on the same port (``down_seconds``
        includes the restarts until it answered).
    :param emails: emails sent (one per address) through the emulator's batch API, spread over the
        kill phase (``send_seconds``, default about 2.5 s per kill).
    :param drain_seconds: how long to wait after the kills for every webhook to be acknowledged or
        given up.
    :param time_scale: the retry schedule runs this many times Svix's (:data:`TIME_SCALE`).
    :param outage_seconds: one of the kills is an outage longer than the provider retries: while
        the receiver is down (this long; 0: no such outage) the provider gives a message up after its
        third failed attempt (the schedule cut to ``0, 5 s, 5 min`` scaled), so the events of that
        window are lost to the webhooks and only the safety-net poll can recover them.
    :param outage: ``clean`` (default): sending pauses and every pending message is acknowledged
        first; emails are sent in the outage's first part only, and the receiver comes back once every
        one of their messages was given up: the outage loses whole lifecycles only, which the poll
        must recover entirely; ``random``: that outage starts at a random moment like the other kills, so
        an email whose ``delivered`` was acknowledged just before may lose its later complaint to it:
        the safety-net poll asks only about emails without an outcome, so such a complaint is a
        missed suppression until the provider's failed messages are replayed (docs/feedback.md, "What
        is lost if the receiver is down longer than the provider retries"); ``none``: no such outage.
    """
    from mailflow_dev import devenv

    t0 = time.monotonic()
    rng = random.Random(seed)
    report = Report(emails=emails, kills_requested=kills)
    workdir = Path(mkdtemp(prefix="mailflow-chaos-feedback-"))
    name = f"mailflow_chaos_feedback_{os.getpid()}_{uuid.uuid4().hex[:4]}"
    dsn = devenv.create_database(admin_dsn, name, exist_ok=False)
    rx: ReceiverProcess | None = None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
        secret = new_secret()
        addrs, rules = assign_rules(emails, rng)
        rx = ReceiverProcess(dsn, [secret], workdir / "receiver.log")
        with EmulatorProcess(outbox=workdir / "outbox.jsonl", rate_limit=0, seed=seed) as emu:
            emu.configure(**rules, open_rate=0.4, click_rate=0.1, event_spread_seconds=2.0,
                          webhook_url=rx.url, webhook_secrets=[secret], webhook_time_scale=time_scale, **FAULTS)
            rx.start()
            phases = {"setup": round(time.monotonic() - t0, 1)}
            mark = time.monotonic()
            seconds = send_seconds if send_seconds is not None else max(5.0, 3.5 * kills)
            sender = Sender(dsn, emu.base_url, addrs, seconds)
            sender.start()
            long_down = rng.randrange(kills) if kills else -1
            for k in range(kills):
                time.sleep(rng.uniform(0.5, 3.0))  # under load: webhooks arrive all the time
                long_outage = k == long_down and outage_seconds > 0 and outage != "none"
                if long_outage and outage == "clean":
                    sender.running.clear()
                    time.sleep(1.0)  # the batch in flight is answered
                    _drain(emu, drain_seconds)
                if long_outage:  # from now on the provider gives up after 3 failed attempts
                    emu.configure(webhook_retry_schedule=list(SVIX_RETRY_SCHEDULE[:3]))
                if rx.kill():
                    report.kills += 1
                sender.running.set()
                started = time.monotonic()
                down = outage_seconds if long_outage else rng.uniform(0.0, 1.0)
                if long_outage and outage == "clean":
                    # emails are sent in the outage's first part only; every event of theirs (spread,
                    # delayed, reordered) is emitted and given up before the receiver is back
                    time.sleep(min(1.5, down / 3))
                    sender.running.clear()
                    time.sleep(0.5)
                    _drain(emu, 60.0)
                    time.sleep(max(0.0, down - (time.monotonic() - started)))
                    down = time.monotonic() - started
                else:
                    time.sleep(down)
                if long_outage:
                    emu.configure(webhook_retry_schedule=list(SVIX_RETRY_SCHEDULE))
                    sender.running.set()
                report.down_seconds += down
                rx.start(wait=False)
                report.down_seconds += rx.wait_ready()
                report.restarts += 1
            sender.join()
            if sender.error is not None:
                raise RuntimeError(f"the sender failed: {sender.error!r}")
            out(f"  kills done: {report.kills} kills, {sender.sent} emails sent, "
                f"{time.monotonic() - t0:.0f} s; draining webhooks")
            phases["kills"] = round(time.monotonic() - mark, 1)
            mark = time.monotonic()
            totals = _drain(emu, drain_seconds)
            report.info["webhooks"] = totals
            phases["drain"] = round(time.monotonic() - mark, 1)
            mark = time.monotonic()
            messages = _messages(emu)
            truth = {line["id"]: line["to"][0] for line in emu.read_outbox()}
            report.info["sweep"] = sweep(dsn)
            report.info["poll"] = safety_net(dsn, emu.base_url)
            phases["sweep_and_poll"] = round(time.monotonic() - mark, 1)
            sent = set(truth.values())
            expected = {mailbox_key(a) for a in rules["bounce"] + rules["complain"] if a in sent}
            with psycopg.connect(dsn, autocommit=True) as conn:
                result = audit(conn, messages, truth, expected)
            report.info["phase_seconds"] = phases
        report.invariants = {k: result.pop(k) for k in COLUMNS}
        report.info |= result
        report.info["rules"] = {k: len(v) for k, v in rules.items()}
    finally:
        if rx is not None:
            rx.stop()
            report.info["receiver_log_tail"] = rx.log_tail(1500)
        devenv.drop_database(admin_dsn, name)
        shutil.rmtree(workdir, ignore_errors=True)
    report.seconds = round(time.monotonic() - t0, 1)
    return asdict(report)
