"""The scheduled-campaign test rig (real PostgreSQL, the emulator over HTTP), shared by the
scheduled and contact-policy tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from conftest import UNSUBSCRIBE_SECRET

from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources import scheduled
from mailflow.sources.scheduled import DispatchSummary

FAST_RETRY = RetryPolicy(max_attempts=2, base=0.01, cap=0.02)
RUN = RunContext(dag_id="dispatch_scheduled_emails", run_id="test-run", task_id="dispatch")
PAST = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday, long before any test runs
ALL_DAY = {"timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"], "emails_per_day": 1000}


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


@dataclass
class Rig:
    db: psycopg.Connection
    dsn: str
    emulator: EmulatorProcess
    closers: list[Any] = field(default_factory=list)

    def conn(self) -> psycopg.Connection:
        c = psycopg.connect(self.dsn)
        self.closers.append(c)
        return c

    def client(self, policy: RetryPolicy = FAST_RETRY) -> ResendClient:
        pacer = PostgresPacer(lambda: psycopg.connect(self.dsn), account=self.emulator.base_url,
                              requests_per_second=200)
        client = ResendClient(self.emulator.base_url, self.emulator.api_key, pacer=pacer, policy=policy,
                              timeout=httpx.Timeout(5.0))
        self.closers += [client, pacer]
        return client

    def renderer(self) -> Renderer:
        return Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")

    def dispatch(self, **kw: Any) -> DispatchSummary:
        kw.setdefault("budget_seconds", 20)
        kw.setdefault("coalesce_seconds", 0)
        return scheduled.dispatch(self.conn(), kw.pop("client", None) or self.client(), self.renderer(), run=RUN, **kw)

    def users(self, n: int, *, start: int = 1, plan: str = "free") -> None:
        self.db.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                        " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', %s"
                        " from generate_series(%s::bigint, %s::bigint) as i", (plan, start, start + n - 1))

    def campaign(self, name: str = "outreach_test", **spec: Any) -> int:
        base = {"name": name, "template": "outreach", "subject": "{{ user.first_name }}, the full practice library",
                "from": "Outreach <outreach@mail.example.com>", "recipients_sql": "free_plan_users",
                "start_at": PAST}
        return scheduled.create_campaign(self.db, base | spec, actor="test")

    def provision(self, cid: int, **kw: Any) -> scheduled.ProvisionSummary:
        kw.setdefault("now", PAST)
        return scheduled.provision(self.db, cid, **kw)

    def rows(self, where: str = "true") -> list[dict[str, Any]]:
        cur = self.db.execute(f"select * from mail.send_log where {where} order by user_id, id")
        names = [d.name for d in cur.description or []]
        return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]

    def times(self, campaign: str = "outreach_test") -> list[datetime]:
        return [r[0] for r in self.db.execute(
            "select scheduled_at from mail.send_log where campaign = %s order by user_id", (campaign,)).fetchall()]

    def events(self, send_log_id: int) -> list[tuple[Any, ...]]:
        return self.db.execute("select from_status, to_status from mail.send_event where send_log_id = %s order by id",
                               (send_log_id,)).fetchall()

    def campaign_row(self, cid: int) -> dict[str, Any]:
        cur = self.db.execute("select * from mail.campaign where id = %s", (cid,))
        names = [d.name for d in cur.description or []]
        row = cur.fetchone()
        assert row is not None
        return dict(zip(names, row, strict=True))

    def outbox_ids(self) -> Counter[int]:
        return Counter(int(e["headers"]["X-Mailflow-Send-Id"]) for e in self.emulator.read_outbox())


@pytest.fixture
def rig(db: psycopg.Connection, db_dsn: str, emulator: EmulatorProcess) -> Iterator[Rig]:
    db.execute("truncate mail.campaign_event, mail.campaign_recipient, mail.campaign restart identity cascade")
    r = Rig(db=db, dsn=db_dsn, emulator=emulator)
    yield r
    for c in reversed(r.closers):
        c.close()


def provisioned(rig: Rig, n: int, name: str = "outreach_test", **spec: Any) -> int:
    """A scheduled campaign with ``n`` rows planned on 2026-01-05 (all long due)."""
    rig.users(n)
    cid = rig.campaign(name, **(ALL_DAY | spec))
    assert rig.provision(cid).created == n
    return cid
