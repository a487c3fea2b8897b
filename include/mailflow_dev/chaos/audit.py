"""Scenario databases (a template copied per fault kind) and the audit of the provider's outbox
against the send log: the five invariants, each must be 0."""

from __future__ import annotations

import csv
import hashlib
import json
import time
import uuid
from collections import Counter, defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from mailflow.campaigns import Campaign
from mailflow.emulator.testing import EmulatorProcess
from mailflow_dev.chaos.scenarios import ANCHOR, INTERVAL, SCHEDULED, SCHEDULED_USER_BASE


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
    without_sent = mismatch = holdout_delivered = 0
    for d in lines:
        headers = {str(k).lower(): v for k, v in (d.get("headers") or {}).items()}
        sid = int(headers.get("x-mailflow-send-id", -1))
        by_row[sid] += 1
        row = rows.get(sid)
        per_user[(row[1], row[2]) if row else ("unknown", sid)] += 1
        if row is None or row[3] != "sent":
            without_sent += 1  # a holdout row's delivery among them: holdout rows are never sent
            holdout_delivered += int(row is not None and row[3] == "holdout")
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
    holdout = [r for r in rows.values() if r[3] == "holdout"]
    # a holdout row is terminal from its mint: never given a provider id, a batch key or an error
    holdout_touched = sum(1 for r in holdout if r[4] is not None or r[5] is not None or r[7] is not None)
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
        "holdout_rows": len(holdout),
        "holdout_delivered": holdout_delivered,
        "holdout_touched": holdout_touched,
        "wrongly_failed": [f"row {r[0]} user {r[1]} {r[2]}: {r[6]}" for r in wrongly[:5]],
    }
