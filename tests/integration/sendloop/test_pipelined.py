"""Pipelined sending (issue 16 item 1) and the per-run audience snapshot (item 2): chunk N+1 is
paged, minted, rendered and stored while chunk N is in flight, on both the lifecycle engine and
scheduled dispatch; a crash leaves at most two chunks exposed, both recoverable by the reconciler.
Real PostgreSQL, the real store, renderer and client against the emulator over HTTP."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
import scheduled_rig as ts
from lifecycle_rig import END, INTERVAL, RUN, Rig, add_user, rig, simple_campaign  # noqa: F401
from reconciler_rig import REPAIR, age_claims, db_now

from mailflow.model.outcome import PreparedBatch
from mailflow.reconciler import reconcile
from mailflow.store.send_log import PostgresStore


class Crash(BaseException):
    """The process dies here (nothing after it runs in this process)."""


class CrashOnSecondBatch:
    """The real client, but the process "dies" while batch 2 is in flight: its request reached the
    provider (accepted), and the engine has minted and stored batch 3 meanwhile."""

    def __init__(self, inner: Any, dsn: str):
        self.inner, self.dsn = inner, dsn
        self.calls = 0

    def reserve_slot(self, deadline: float) -> float | None:
        return self.inner.reserve_slot(deadline)

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Any:
        self.calls += 1
        outcome = self.inner.send_batch(batch, deadline, slot)
        if self.calls == 2:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                t0 = time.monotonic()
                while time.monotonic() - t0 < 10:  # until the next chunk is minted and stored
                    n = conn.execute("select count(distinct idempotency_key) from mail.send_log"
                                     " where status = 'sending'").fetchone()[0]  # type: ignore[index]
                    if n >= 2:
                        break
                    time.sleep(0.02)
            raise Crash("killed with batch 2 in flight and batch 3 stored")
        return outcome


def test_a_crash_with_two_chunks_exposed_is_recovered_by_the_reconciler_without_duplicates(rig: Rig) -> None:
    for uid in range(1, 251):
        add_user(rig.db, uid)
    client = CrashOnSecondBatch(rig.client(), rig.dsn)
    with pytest.raises(Crash):
        rig.run([simple_campaign("c1", 1)], client=client, chunk_size=100, pipelined=True)  # type: ignore[arg-type]
    rows = rig.rows()
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    # chunk 1 applied; chunk 2 in flight (delivered, answer lost); chunk 3 minted with its bytes
    assert by_status == {"sent": 100, "sending": 150}
    exposed = {r["idempotency_key"] for r in rows if r["status"] == "sending"}
    assert len(exposed) == 2
    stored = rig.db.execute("select count(*) from mail.send_batch where idempotency_key = any(%s)",
                            (list(exposed),)).fetchone()[0]  # type: ignore[index]
    assert stored == 2  # both exposed chunks have their exact bytes
    assert len(rig.outbox()) == 200

    age_claims(rig, 20)
    s = reconcile(rig.store().conn, rig.client(), now=db_now(rig), run=REPAIR)
    assert (s.batches_resent, s.resent_sent) == (2, 150)
    box = [e["to"][0] for e in rig.outbox()]
    assert len(box) == len(set(box)) == 250  # every user exactly once: the in-flight chunk replayed
    assert rig.emulator.stats()["replays"] == 1
    assert {r["status"] for r in rig.rows()} == {"sent"}


class SlotBudget:
    """The real client with a budget of ``slots`` request slots: ``reserve_slot`` (the engine's
    budget check) answers None after that. Records the order of budget checks, mints and sends."""

    def __init__(self, inner: Any, slots: int, log: list[str]):
        self.inner, self.slots, self.log = inner, slots, log

    def reserve_slot(self, deadline: float) -> float | None:
        if self.slots <= 0:
            self.log.append("budget: out")
            return None
        self.slots -= 1
        self.log.append("budget: slot")
        return self.inner.reserve_slot(deadline)

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Any:
        return self.inner.send_batch(batch, deadline, slot)


class RecordingStore(PostgresStore):
    def __init__(self, conn: psycopg.Connection, log: list[str]):
        super().__init__(conn)
        self.log = log

    def open_audience(self, campaign: Any, *a: Any, **k: Any) -> int:
        self.log.append(f"snapshot: {campaign.name}")
        return super().open_audience(campaign, *a, **k)

    def mint_chunk(self, campaign: Any, *a: Any, **k: Any) -> Any:
        result = super().mint_chunk(campaign, *a, **k)
        if result.batch is not None:
            self.log.append(f"mint: {campaign.name}")
        return result


def test_pipelined_the_budget_is_checked_before_each_mint_and_every_minted_chunk_is_sent(rig: Rig) -> None:
    for uid in range(1, 1001):
        add_user(rig.db, uid)
    log: list[str] = []
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    [s] = rig.run([simple_campaign("c1", 1)], client=SlotBudget(rig.client(), 4, log),  # type: ignore[arg-type]
                  store=RecordingStore(conn, log), chunk_size=100, pipelined=True)
    assert (s.eligible, s.chunks, s.minted, s.sent, s.stopped) == (1000, 4, 400, 400, "time budget")
    checks = [e for e in log if not e.startswith("snapshot")]
    # every mint comes right after a granted slot; nothing is minted once the budget is out
    assert checks == ["budget: slot", "mint: c1"] * 4 + ["budget: out"]
    assert len(rig.outbox()) == 400
    assert rig.db.execute("select count(*) from mail.send_log where status = 'sending'").fetchone()[0] == 0  # type: ignore[index]


def test_pipelined_priority_a_later_campaigns_audience_is_taken_after_the_earlier_minted(rig: Rig) -> None:
    # users 1-150 are in both audiences, 151-300 only in b's: a (priority 1) gets 1-150, b the rest
    for uid in range(1, 301):
        add_user(rig.db, uid)
    log: list[str] = []
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    a = simple_campaign("a", 1, "user_id <= 150")
    b = simple_campaign("b", 2)
    sa, sb = rig.run([b, a], store=RecordingStore(conn, log), chunk_size=100, pipelined=True)
    assert log == ["snapshot: a", "mint: a", "mint: a", "snapshot: b", "mint: b", "mint: b"]
    assert (sa.eligible, sa.sent, sb.eligible, sb.sent) == (150, 150, 150, 150)
    got = {r["user_id"]: r["campaign"] for r in rig.rows()}
    assert got == {u: ("a" if u <= 150 else "b") for u in range(1, 301)}
    to = [e["to"][0] for e in rig.outbox()]
    assert len(to) == len(set(to)) == 300


def test_the_snapshot_is_rechecked_at_mint_for_a_user_who_unsubscribed_during_the_run(rig: Rig) -> None:
    for uid in range(1, 4):
        add_user(rig.db, uid)
    conn = psycopg.connect(rig.dsn)
    rig.conns.append(conn)
    db = rig.db

    class Unsubscribing(PostgresStore):
        def open_audience(self, *a: Any, **k: Any) -> int:
            n = super().open_audience(*a, **k)
            db.execute("insert into mail.suppression (user_id, source) values (2, 'unsubscribe')")
            return n

    [s] = rig.run([simple_campaign("a", 1)], store=Unsubscribing(conn), pipelined=True)
    assert (s.eligible, s.minted, s.sent, s.held, s.skipped) == (3, 2, 2, 1, 0)
    assert sorted(e["to"][0] for e in rig.outbox()) == ["user1@example.com", "user3@example.com"]


def test_unpipelined_and_pipelined_runs_send_the_same_emails(rig: Rig) -> None:
    for uid in [*range(1, 351), *range(1001, 1351)]:
        add_user(rig.db, uid)
    [s1] = rig.run([simple_campaign("a", 1, "user_id < 1000")], chunk_size=100, pipelined=False)
    [s2] = rig.run([simple_campaign("b", 1, "user_id > 1000")], chunk_size=100, pipelined=True)
    assert (s1.eligible, s1.chunks, s1.sent) == (s2.eligible, s2.chunks, s2.sent) == (350, 4, 350)
    got = {r["user_id"]: (r["campaign"], r["status"]) for r in rig.rows()}
    assert got == {u: ("a" if u < 1000 else "b", "sent") for u in [*range(1, 351), *range(1001, 1351)]}
    to = [e["to"][0] for e in rig.outbox()]
    assert len(to) == len(set(to)) == 700


# -- scheduled dispatch ------------------------------------------------------------------------------

@pytest.fixture
def srig(db: psycopg.Connection, db_dsn: str, emulator: Any) -> Any:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    r = ts.Rig(db=db, dsn=db_dsn, emulator=emulator)
    yield r
    for c in reversed(r.closers):
        c.close()


def test_pipelined_dispatch_sends_every_due_row_once(srig: Any) -> None:
    ts.provisioned(srig, 250)
    srig.emulator.configure(latency_ms=50)
    overlap = threading.Event()
    inner = srig.client()
    conn = srig.conn()

    class Watching:
        """Notes whether a claim committed while a batch was in flight (the pipeline at work)."""

        def __init__(self) -> None:
            self.in_flight = 0

        def reserve_slot(self, deadline: float) -> float | None:
            if self.in_flight:
                overlap.set()
            return inner.reserve_slot(deadline)

        def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Any:
            self.in_flight += 1
            try:
                return inner.send_batch(batch, deadline, slot)
            finally:
                self.in_flight -= 1

    from mailflow.sources import scheduled

    d = scheduled.dispatch(conn, Watching(), srig.renderer(), run=ts.RUN, budget_seconds=30, coalesce_seconds=0,
                           batch_size=100, pipelined=True)
    assert (d.claimed, d.sent, d.batches) == (250, 250, 3)
    assert overlap.is_set()  # batch N+1 was prepared while batch N was in flight
    to = [e["to"][0] for e in srig.emulator.read_outbox()]
    assert len(to) == len(set(to)) == 250
    assert {r["status"] for r in srig.rows()} == {"sent"}
