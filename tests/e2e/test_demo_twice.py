"""`make demo` cannot be broken by running it twice (issue 17): real ``scripts/demo.py`` processes in
a state directory of their own (``MAILFLOW_DEMO_STATE``: embedded PostgreSQL, Airflow home, outboxes).

1. Two demos started at the same moment: one succeeds with a clean audit, the other refuses with
   one clear line (exit 3) and touches nothing; the server the winner started is stopped by it.
2. A demo interrupted after the provider accepted a batch (its rows left ``sending`` without a
   provider id, the emulator gone) heals on the next run: the reconciler resends the same key and
   bytes, the restarted emulator recognises the key from its per-database idempotency memory, so
   nothing is delivered twice and the audit is clean. That run did not start the server, so it
   leaves it running.
3. The same checkout pointed at a fresh database (``AIRFLOW_CONN_SEND_LOG_DB``) gets a fresh outbox
   of that database's own: a clean audit, not the earlier database's deliveries.

Every run pushes its emails' outcomes as signed webhooks to the demo's own receiver: none is lost
(the emulator's acknowledged svix ids are all in mail.webhook_event), and the winner's outcomes table
holds exactly what the emulator says it pushed and what mail.delivery_event holds, per campaign.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from conftest import ROOT

from mailflow_dev import devenv

pytestmark = pytest.mark.slow
USERS = "300"


def demo_env(state: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    env.update({"MAILFLOW_DEMO_STATE": str(state), "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": str(ROOT / "include"), **extra})
    return env


def start_demo(state: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "demo.py"), "--users", USERS, *args],
                            env=demo_env(state, **extra), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=str(ROOT))


def finish(p: subprocess.Popen[str], timeout: float = 400) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def audit_line(out: str) -> dict[str, int]:
    line = next(x for x in out.splitlines() if x.startswith("audit (send log vs outbox): "))
    return {k: int(v) for k, v in (kv.split("=") for kv in line.split(": ", 1)[1].split(", "))}


def clean(audit: dict[str, int]) -> bool:
    return audit["delivered"] == audit["sent_rows"] > 0 and all(
        v == 0 for k, v in audit.items() if k not in ("delivered", "sent_rows"))


OUTCOME_COUNTS = ("sent", "delivered", "hard_bounced", "soft_bounced", "complained", "failed_after_send", "opened",
                  "clicked", "no_outcome_yet")


def outcomes_table(out: str) -> dict[str, dict[str, int]]:
    """The demo's outcomes table: ``{campaign: {column: count}}`` (the rate columns left out)."""
    lines = out.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("outcomes per campaign (mail.campaign_outcomes"))
    head = lines[start + 1].split()
    assert head[:len(OUTCOME_COUNTS) + 1] == ["campaign", *OUTCOME_COUNTS], head
    table = {}
    for line in lines[start + 3:]:
        if not line.strip() or line.startswith("suppressed by"):
            break
        cells = line.split()
        table[cells[0]] = {k: int(v) for k, v in zip(OUTCOME_COUNTS, cells[1:], strict=False)}
    return table


def webhook_line(out: str) -> dict[str, int]:
    """``webhooks: N signed events pushed, N acknowledged, ...`` as numbers."""
    line = next(x for x in out.splitlines() if x.startswith("webhooks: "))
    m = re.fullmatch(r"webhooks: (\d+) signed events pushed, (\d+) acknowledged, (\d+) pending, (\d+) given up; "
                     r"lost \(acknowledged, not in mail.webhook_event\): (\d+); not yet applied to the send log: "
                     r"(\d+); settled [\d.]+ s after the run", line)
    assert m, line
    return dict(zip(("pushed", "acknowledged", "pending", "given_up", "lost", "unapplied"), map(int, m.groups()),
                    strict=True))


def webhook_events(out: str) -> Counter[str]:
    line = next(x for x in out.splitlines() if x.startswith("webhook events: "))
    return Counter({k: int(v) for k, v in (kv.split("=") for kv in line.split(": ", 1)[1].split(", "))})


def settled(out: str) -> bool:
    w = webhook_line(out)
    return w["pushed"] == w["acknowledged"] and w["pending"] == w["given_up"] == w["lost"] == w["unapplied"] == 0


def outcomes_in_db(dsn: str) -> tuple[dict[str, dict[str, int]], int]:
    """Per campaign, the outcomes as mail.delivery_event records them (not through the views), and the
    distinct addresses that hard-bounced or complained."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("""
            select l.campaign, count(*),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'delivered')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'bounced' and e.bounce_type = 'Permanent')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'bounced' and e.bounce_type <> 'Permanent')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'complained')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'failed')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'opened')),
                   count(*) filter (where exists (select 1 from mail.delivery_event e where e.send_log_id = l.id
                                                  and e.event = 'clicked'))
            from mail.send_log l where l.status = 'sent' group by l.campaign""").fetchall()
        suppressible = conn.execute("""
            select count(distinct lower(l.email)) from mail.send_log l
            join mail.delivery_event e on e.send_log_id = l.id
            where (e.event = 'bounced' and e.bounce_type = 'Permanent') or e.event = 'complained'""").fetchone()[0]
    return {r[0]: dict(zip(OUTCOME_COUNTS[:-1], r[1:], strict=True)) for r in rows}, suppressible


def outbox_of(out: str) -> Path:
    line = next(x for x in out.splitlines() if x.startswith("outbox: "))
    return Path(line.split()[1])


@pytest.fixture
def state() -> Iterator[Path]:
    # A short path outside pytest's 0700 tmp tree: as root the embedded server runs as its own user,
    # which must reach the data directory, and a Unix socket path is limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="mf-demo-"))
    path.chmod(0o755)
    yield path
    devenv.stop_embedded(path / "pgdata")
    shutil.rmtree(path, ignore_errors=True)


def test_two_demos_at_once_then_an_interrupted_one_heals(state: Path, pg_admin_dsn: str) -> None:
    # 1. two at once
    t0 = time.monotonic()
    a, b = start_demo(state), start_demo(state)
    results = [finish(a), finish(b)]
    print(f"\ntwo concurrent demos: {time.monotonic() - t0:.1f} s")
    codes = sorted(r[0] for r in results)
    assert codes == [0, 3], results
    (_, won, _), (_, _, refused_err) = sorted(results, key=lambda r: r[0])
    refusal = [x for x in refused_err.splitlines() if x.strip()]
    assert len(refusal) == 1, refused_err
    assert refusal[0].startswith("demo: another `make demo` is running (pid ")
    assert "wait for it to finish" in refusal[0]
    assert clean(audit_line(won)), won
    assert "started;" in won  # the winner started the embedded server ...
    assert not devenv.embedded_running(state / "pgdata")  # ... and stopped it
    # the outcomes arrived: every webhook acknowledged, none lost, all applied, and the table says exactly
    # what the emulator pushed and what the delivery events hold
    assert settled(won), won
    table, pushed = outcomes_table(won), webhook_events(won)
    total = {k: sum(row[k] for row in table.values()) for k in OUTCOME_COUNTS}
    assert total["sent"] == pushed["email.sent"] == audit_line(won)["sent_rows"] > 0
    assert (total["delivered"], total["hard_bounced"] + total["soft_bounced"], total["complained"], total["opened"],
            total["clicked"], total["failed_after_send"], total["no_outcome_yet"]) == (
        pushed["email.delivered"], pushed["email.bounced"], pushed["email.complained"], pushed["email.opened"],
        pushed["email.clicked"], pushed["email.failed"], 0)
    assert total["hard_bounced"] > 0 and total["soft_bounced"] > 0 and total["opened"] > total["clicked"] > 0
    by_event, suppressible = outcomes_in_db(  # starts the server again: part 2 needs it running anyway
        devenv.with_dbname(devenv.embedded_dsn(state / "pgdata"), "mailflow_demo"))
    assert {c: {k: v for k, v in row.items() if k != "no_outcome_yet"} for c, row in table.items()} == by_event
    assert f"suppressed by these outcomes: {suppressible} addresses (bounce " in won
    assert total["hard_bounced"] + total["complained"] >= suppressible > 0

    # 2. an interrupted demo: the provider accepted a batch, the rows stayed 'sending', the emulator died
    pgdata = state / "pgdata"
    dsn = devenv.with_dbname(devenv.embedded_dsn(pgdata), "mailflow_demo")
    with psycopg.connect(dsn, autocommit=True) as conn:
        key = conn.execute("select idempotency_key from mail.send_log where status = 'sent'"
                           " order by id limit 1").fetchone()[0]
        orphaned = len(conn.execute("update mail.send_log set status = 'sending', provider_message_id = null,"
                                    " sent_at = null, claimed_at = now() - interval '1 minute'"
                                    " where idempotency_key = %s and status = 'sent' returning id",
                                    (key,)).fetchall())
    assert orphaned >= 1
    outbox = outbox_of(won)
    before = Counter(json.loads(x)["idempotency_key"] for x in outbox.read_text().splitlines())

    code, out, err = finish(start_demo(state))
    assert code == 0, out + err
    assert "already running" in out
    assert "reconciler: " in out and "nothing left over" not in out, out
    assert clean(audit_line(out)), out
    assert webhook_line(out)["lost"] == 0 and settled(out), out
    after = Counter(json.loads(x)["idempotency_key"] for x in outbox.read_text().splitlines())
    assert after[key] == before[key]  # replayed by the emulator, not delivered again
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute("select count(*) from mail.send_log where status = 'sending'").fetchone()[0] == 0
        assert conn.execute("select count(*) from mail.send_log where idempotency_key = %s and status = 'sent'",
                            (key,)).fetchone()[0] == orphaned
    assert devenv.embedded_running(pgdata)  # this run did not start it: left running
    assert "this demo did not start it" in out

    # 3. a fresh database: its own outbox, a clean audit
    fresh = f"mailflow_demo_fresh_{uuid.uuid4().hex[:8]}"
    fresh_dsn = devenv.create_database(pg_admin_dsn, fresh, exist_ok=False)
    try:
        code, out, err = finish(start_demo(state, AIRFLOW_CONN_SEND_LOG_DB=fresh_dsn))
        assert code == 0, out + err
        assert clean(audit_line(out)), out
        assert settled(out) and webhook_events(out)["email.sent"] == audit_line(out)["sent_rows"], out
        assert outbox_of(out).parent != outbox.parent
        assert outbox_of(out).parent.name.startswith(f"{fresh}-")
    finally:
        devenv.drop_database(pg_admin_dsn, fresh)
