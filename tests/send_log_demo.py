"""Test helpers shared by tests/integration/store/test_analytics.py and tests/e2e/test_progress_page.py:
a Resend client on the emulator, the real renderer, one real lifecycle run through the engine, and
the example queries of docs/send_log.md extracted from the markdown.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
from conftest import UNSUBSCRIBE_SECRET

from mailflow.campaigns import Campaign, load_campaigns
from mailflow.emulator.testing import EmulatorProcess
from mailflow.feedback.unsubscribe_tokens import signer_from_secret
from mailflow.model.outcome import CampaignSummary, DataInterval, RunContext
from mailflow.provider.client import ResendClient, RetryPolicy
from mailflow.provider.pacing import PostgresPacer
from mailflow.sendloop.render import Renderer
from mailflow.sources.lifecycle import run_lifecycle

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "send_log.md"
FAST_RETRY = RetryPolicy(max_attempts=2, base=0.01, cap=0.02)


def current_hour() -> datetime:
    """The start of the current UTC hour: the end of the latest complete data interval."""
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def lifecycle_run_context(end: datetime) -> RunContext:
    """The RunContext of the hourly lifecycle run whose data interval ends at ``end``."""
    return RunContext(dag_id="lifecycle_emails", run_id=f"scheduled__{(end - timedelta(hours=1)).isoformat()}",
                      task_id="send_campaigns")


def renderer() -> Renderer:
    return Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), "https://mail.example.com", "https://app.example.com")


def make_client(dsn: str, emulator: EmulatorProcess, closers: list[Any], *,
                requests_per_second: float = 200.0) -> ResendClient:
    """A real ResendClient on the emulator, paced by the shared PostgreSQL pacer of ``dsn``."""
    pacer = PostgresPacer(lambda: psycopg.connect(dsn), account=emulator.base_url,
                          requests_per_second=requests_per_second)
    client = ResendClient(emulator.base_url, emulator.api_key, pacer=pacer, policy=FAST_RETRY,
                          timeout=httpx.Timeout(5.0))
    closers += [client, pacer]
    return client


def run_lifecycle_once(dsn: str, emulator: EmulatorProcess, end: datetime, run: RunContext,
                       campaigns: list[Campaign] | None = None) -> list[CampaignSummary]:
    """One real lifecycle run for the interval ``[end - 1 h, end)``: engine, PostgresStore, the
    shared pacer and the emulator over HTTP."""
    from mailflow.store.send_log import PostgresStore

    closers: list[Any] = []
    try:
        conn = psycopg.connect(dsn)
        closers.append(conn)
        client = make_client(dsn, emulator, closers)
        return run_lifecycle(PostgresStore(conn), client, renderer(), campaigns or load_campaigns(),
                             DataInterval(end - timedelta(hours=1), end), run=run)
    finally:
        for c in reversed(closers):
            c.close()


def raw_audience(conn: psycopg.Connection, campaign: Campaign, end: datetime) -> list[tuple[int, str]]:
    """``(user_id, email)`` of the campaign's own audience SQL over its window for the interval
    ending at ``end``, before any exclusion, in user_id order."""
    start, stop = campaign.window(DataInterval(end - timedelta(hours=1), end))
    rows = conn.execute(f"select a.user_id, a.email from ({campaign.audience_sql}) as a order by a.user_id",
                        {"window_start": start, "window_end": stop}).fetchall()
    return [(int(r[0]), str(r[1])) for r in rows]


# -- the example queries of docs/send_log.md -------------------------------------------------------

_QUESTION = re.compile(r"^### Q(\d+)\. (.+?)\n(.*?)```sql\n(.*?)```", re.S | re.M)
_SET = re.compile(r"^\\set (\w+) '(.*)'$")
_VAR = re.compile(r":'(\w+)'")


def doc_questions() -> dict[int, tuple[str, dict[str, str], str]]:
    """``{n: (question, psql variable defaults, SQL)}`` of every "### Qn." section of the doc."""
    out: dict[int, tuple[str, dict[str, str], str]] = {}
    for m in _QUESTION.finditer(DOC.read_text(encoding="utf-8")):
        defaults: dict[str, str] = {}
        lines = []
        for line in m.group(4).splitlines():
            s = _SET.match(line.strip())
            if s:
                defaults[s.group(1)] = s.group(2)
            else:
                lines.append(line)
        out[int(m.group(1))] = (m.group(2).strip(), defaults, "\n".join(lines).strip().rstrip(";"))
    return out


def doc_query(n: int) -> tuple[dict[str, str], str]:
    """Question ``n``'s psql variables and its SQL with ``:'name'`` turned into psycopg placeholders."""
    _, defaults, sql = doc_questions()[n]
    return defaults, _VAR.sub(lambda m: f"%({m.group(1)})s", sql)


def run_doc_query(conn: psycopg.Connection, n: int, *, role: str | None = None,
                  **params: Any) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run question ``n`` with its defaults overridden by ``params`` (as text, like psql variables);
    as ``role`` if given. Returns ``(column names, rows)``."""
    defaults, sql = doc_query(n)
    values = defaults | {k: str(v) for k, v in params.items()}
    missing = set(_VAR.findall(doc_questions()[n][2])) - set(values)
    assert not missing, f"Q{n} uses undefined psql variables {missing}"
    with conn.transaction():
        if role:
            conn.execute(f"set local role {role}")
        cur = conn.execute(sql, values)  # type: ignore[arg-type]
        return [d.name for d in cur.description or []], cur.fetchall()

