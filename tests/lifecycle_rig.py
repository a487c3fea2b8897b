"""The lifecycle test rig (real PostgreSQL, the emulator over HTTP, the real renderer) and its
population helpers, shared by the lifecycle, cooldown, outcome-model, reconciler and contact-policy
tests."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import CampaignSummary, DataInterval, RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import PostgresStore

END = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
INTERVAL = DataInterval(END - timedelta(hours=1), END)
RUN = RunContext(dag_id="lifecycle_emails", run_id="scheduled__2026-03-10T11:00:00+00:00", task_id="send_campaigns")
H, D = timedelta(hours=1), timedelta(days=1)
FAST_RETRY = RetryPolicy(max_attempts=2, base=0.01, cap=0.02)


def add_user(db: psycopg.Connection, uid: int, *, email: str | None = None, first_name: str | None = None,
             signed_up_at: datetime = END - 60 * D, plan: str = "free", last_active_at: datetime | None = None) -> str:
    address = email if email is not None else f"user{uid}@example.com"
    db.execute("insert into app.users (user_id, email, first_name, last_name, signed_up_at, timezone, plan,"
               " last_active_at) values (%s, %s, %s, 'Test', %s, 'Europe/Berlin', %s, %s)",
               (uid, address, first_name if first_name is not None else f"First{uid}", signed_up_at, plan,
                last_active_at))
    return address


def add_assessment(db: psycopg.Connection, aid: int, uid: int, started_at: datetime, *,
                   finished_at: datetime | None = None, kind: str = "numerical", is_free: bool = True,
                   score: int | None = None) -> None:
    db.execute("insert into app.assessments (assessment_id, user_id, kind, is_free, started_at, finished_at, score)"
               " values (%s, %s, %s, %s, %s, %s, %s)", (aid, uid, kind, is_free, started_at, finished_at, score))


def plant_row(db: psycopg.Connection, uid: int, campaign: str, status: str, *, sent_at: datetime | None = None,
              released: bool = False, run_id: str = "other-run") -> int:
    pid = f"planted-{campaign}-{uid}-{status}" if status == "sent" else None
    row = db.execute(
        "insert into mail.send_log (user_id, campaign, email, status, sent_at, released_at, provider_message_id,"
        " run_id) values (%s, %s, %s, %s, %s, %s, %s, %s) returning id",
        (uid, campaign, f"user{uid}@example.com", status, sent_at, END if released else None, pid, run_id),
    ).fetchone()
    assert row is not None
    return int(row[0])


def simple_campaign(name: str, priority: int, where: str = "true", *, cooldown: timedelta = 7 * D) -> Campaign:
    """A campaign whose audience is ``app.users`` filtered by ``where`` (rendered with the
    first_practice templates, which need only first_name)."""
    return Campaign(name=name, priority=priority,
                    audience_sql=f"select user_id, email, first_name from app.users where {where}",
                    template="first_practice", subject="Hello {{ user.first_name or 'there' }}",
                    from_address="Practice Team <practice@mail.example.com>", reply_to=None, cooldown=cooldown,
                    audience_window=H)


@dataclass
class Rig:
    db: psycopg.Connection
    dsn: str
    emulator: EmulatorProcess
    conns: list[Any] = field(default_factory=list)

    def client(self, policy: RetryPolicy = FAST_RETRY, timeout: float = 5.0) -> ResendClient:
        pacer = PostgresPacer(lambda: psycopg.connect(self.dsn), account=self.emulator.base_url,
                              requests_per_second=200)
        client = ResendClient(self.emulator.base_url, self.emulator.api_key, pacer=pacer, policy=policy,
                              timeout=httpx.Timeout(timeout))
        self.conns += [client, pacer]
        return client

    def store(self, conn: Any = None) -> PostgresStore:
        if conn is None:
            conn = psycopg.connect(self.dsn)
            self.conns.append(conn)
        return PostgresStore(conn)

    def run(self, campaigns: list[Campaign], *, interval: DataInterval = INTERVAL, client: ResendClient | None = None,
            store: PostgresStore | None = None, **kw: Any) -> list[CampaignSummary]:
        renderer = Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")
        return run_lifecycle(store or self.store(), client or self.client(), renderer, campaigns, interval,
                             run=RUN, **kw)

    # reads
    def rows(self, where: str = "true") -> list[dict[str, Any]]:
        cur = self.db.execute(f"select * from mail.send_log where {where} order by id")
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def events(self, send_log_id: int) -> list[tuple[Any, ...]]:
        return self.db.execute("select from_status, to_status from mail.send_event where send_log_id = %s order by id",
                               (send_log_id,)).fetchall()

    def outbox(self) -> list[dict[str, Any]]:
        return self.emulator.read_outbox()


@pytest.fixture
def rig(db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> Iterator[Rig]:
    r = Rig(db=db, dsn=db_dsn, emulator=emulator)
    yield r
    for c in reversed(r.conns):
        c.close()


class RacingConnection:
    """Proxy of the store's connection: right after the audience page is read, another session
    commits a row for ``uid`` (a concurrent run) before the mint statement runs. With ``before``,
    the row is committed instead right before the first statement whose text contains ``before``
    (e.g. a writer that skips the contact lock, seen only by the INSERT's ON CONFLICT)."""

    def __init__(self, conn: psycopg.Connection, other: psycopg.Connection, uid: int, campaign: str,
                 before: str | None = None):
        self._conn, self._other, self._uid, self._campaign = conn, other, uid, campaign
        self._before = before
        self.fired = False

    @property
    def autocommit(self) -> bool:
        return self._conn.autocommit

    @autocommit.setter
    def autocommit(self, value: bool) -> None:
        self._conn.autocommit = value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def transaction(self) -> Any:
        return self._conn.transaction()

    def execute(self, query: Any, params: Any = None) -> Any:
        if self._before is not None:
            if not self.fired and isinstance(query, str) and self._before in query:
                self.fired = True
                plant_row(self._other, self._uid, self._campaign, "sending", run_id="concurrent-run")
            return self._conn.execute(query, params)
        cur = self._conn.execute(query, params)
        if not self.fired and isinstance(params, dict) and "after" in params:
            self.fired = True
            plant_row(self._other, self._uid, self._campaign, "sending", run_id="concurrent-run")
        return cur
