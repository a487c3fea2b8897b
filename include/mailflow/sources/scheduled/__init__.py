"""Scheduled campaigns: provisioning (one planned ``pending`` row per recipient), dispatch (send
due rows close to their time), and the operator's controls (create, cancel, pause, resume,
complete, status). Plain Python over a psycopg 3 connection; Airflow is imported only inside the
``*_task`` callables the DAGs call.

A campaign (``mail.campaign``) is a plan, :class:`mailflow.sources.scheduled.planning.PlanSpec` (IANA timezone,
emails per day, ISO weekdays, local windows) anchored at a start, plus a recipient list (a SQL file
in ``campaigns/recipients/`` or an uploaded table such as ``mail.campaign_recipient``). Each email
is one ``kind = 'scheduled'`` row of ``mail.send_log`` with ``scheduled_at`` (UTC) and the lifecycle
``pending -> sending -> sent | failed | cancelled``; the send log is shared with the lifecycle
DAG, so its cooldown and the analytics see both kinds.

**The plan.** Recipients are taken in ``user_id`` order; the i-th gets the i-th instant of
``plan_send_times(spec, ., plan_start)`` after ``plan_skip`` instants. ``plan_start`` is
``max(start_at, now)`` at the first provisioning. Provisioning runs in chunks; each chunk's rows and
the checkpoint (``provision_cursor`` = last user_id, ``planned_through`` = last instant used) commit
in one transaction, so a killed run resumes exactly where it stopped. A chunk continues the plan by
re-planning the local day of ``planned_through`` from its start and skipping the instants already
used, which gives exactly the instants of one uninterrupted plan (the planner spreads a day's slots
over the whole day, so "plan from the instant after the last slot" would not). If the continuation
would start in the past (provisioning resumed after its plan ran out), the plan is re-anchored at
``now`` as a resume is (below).

**Pause / resume rule.** Pause stops dispatch (only ``scheduled`` campaigns are dispatched); rows
keep their times. Resume: if no pending row's time passed, nothing moves. Otherwise every pending
row is **re-planned in its original order from the resume instant** with the planner: the overdue
rows take the next slots in the campaign's windows and everyone after them shifts back, so no
burst is sent, every email stays inside the windows and the pace stays ``emails_per_day``. The
first (resume) local day gets only the slots left after the campaign's emails already sent that
day (``plan_skip`` drops that many of its earliest slots), so the daily cap holds on that day too.
Nobody is skipped, nobody is duplicated: rows keep their identity.

**Dispatch** claims due rows (``status = 'pending' and scheduled_at <= now()``, campaign
``scheduled``) with ``UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)``, at most 100
of one campaign per batch, renders them, stores the batch bytes, all in one transaction, then sends
through the same client, pacer and ``PostgresStore.apply`` as the lifecycle DAG.

CLI: ``python -m mailflow.sources.scheduled --dsn ... create|provision|cancel|pause|resume|status ...``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os
import re
import sys
import tomllib
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from functools import partial
from itertools import dropwhile, islice
from pathlib import Path
from typing import Any

import jinja2
import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from mailflow import settings
from mailflow.campaigns import CAMPAIGNS_DIR, Campaign
from mailflow.sendloop.clock import Clock, SystemClock
from mailflow.sendloop.engine import (
    MAX_BATCH,
    ChunkPipeline,
    InFlight,
    release_unsent,
    reserve_slot,
    send_chunk,
)
from mailflow.sendloop.outcome import (
    Accepted,
    MintedRow,
    NotSent,
    Outcome,
    PreparedBatch,
    Refused,
    RunContext,
    SendError,
    Unknown,
)
from mailflow.sendloop.render import Renderer, subject_template
from mailflow.sources.scheduled.planning import PlanSpec, Window, plan_day, plan_send_times, summarize
from mailflow.store.policy import ON_POLICY, ContactPolicy, Hold, evaluate, load_policy, normalise_address
from mailflow.store.send_log import (
    PostgresStore,
    duplicate_reason,
    load_contacts,
    lock_contacts,
    reserve_addresses,
)
from mailflow.store.sql import query

log = logging.getLogger(__name__)

__all__ = [
    "BATCH_SIZE", "COALESCE_SECONDS", "DISPATCH_BUDGET_SECONDS", "CampaignStateError", "DispatchSummary",
    "ProvisionSummary", "cancel", "complete", "create_campaign", "dispatch", "dispatch_task", "load_spec",
    "main", "pause", "plan_after", "plan_spec", "provision", "provision_task", "resolve_campaign", "resume", "status",
    "upload_recipients",
]

BATCH_SIZE = MAX_BATCH
DISPATCH_BUDGET_SECONDS = 50.0  # one run of the 1-minute dispatch DAG (leaves ~10 s for start-up)
COALESCE_SECONDS = 5.0  # a due row waits at most this long for others to share its request
POLL_SECONDS = 5.0  # while sleeping towards the next due row, look again this often
SEND_GRACE_SECONDS = 60.0  # a claimed batch may still wait this long past the budget (pacing, 429)
_MIN_BIGINT = -(2**63)
_NAME = re.compile(r"^[a-z0-9_]{1,64}$")
_TABLE = re.compile(r"^(?:([a-z_][a-z0-9_]*)\.)?([a-z_][a-z0-9_]*)$")


class CampaignStateError(ValueError):
    """The operation is not allowed in the campaign's current status (names both)."""


# -- shapes --------------------------------------------------------------------------------------


@dataclass
class ProvisionSummary:
    """What one provisioning call did (or, with ``dry_run``, would do).

    Counts are rows (emails). ``first_send``/``last_send`` are aware UTC datetimes of the rows
    planned by this call (dry run: of the recipients still to provision); ``emails_per_day`` is the
    campaign's setting, ``per_day_max`` the largest count on one local day of those rows,
    ``days_spanned`` calendar days from the first to the last local date (inclusive) and
    ``sending_days`` the local dates that have sends. ``complete`` = the recipient list is exhausted.
    """

    campaign_id: int
    campaign: str = ""
    dry_run: bool = False
    chunks: int = 0
    recipients: int = 0
    created: int = 0
    skipped_existing: int = 0
    skipped_no_email: int = 0
    provisioned_total: int = 0
    complete: bool = False
    stopped: str | None = None
    reanchored: bool = False
    timezone: str = ""
    emails_per_day: int = 0
    first_send: datetime | None = None
    last_send: datetime | None = None
    per_day_max: int = 0
    days_spanned: int = 0
    sending_days: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict (datetimes as ISO-8601 UTC text)."""
        out = dataclasses.asdict(self)
        for k in ("first_send", "last_send"):
            out[k] = out[k].isoformat() if out[k] else None
        return out


@dataclass
class DispatchSummary:
    """Counts of one dispatch call (rows). ``idle_seconds`` = time slept waiting for due rows,
    ``seconds`` = wall time of the call, ``completed`` = campaigns completed at the end,
    ``sent_by_campaign`` = rows sent per campaign name."""

    claimed: int = 0
    sent: int = 0
    failed: int = 0
    released: int = 0
    unknown: int = 0
    suppressed: int = 0
    render_failed: int = 0
    deferred: int = 0
    skipped: int = 0
    invalid: int = 0
    duplicates: int = 0
    batches: int = 0
    idle_seconds: float = 0.0
    seconds: float = 0.0
    stopped: str | None = None
    completed: list[str] = field(default_factory=list)
    sent_by_campaign: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        out = dataclasses.asdict(self)
        out["idle_seconds"] = round(self.idle_seconds, 3)
        out["seconds"] = round(self.seconds, 3)
        return out


# -- the plan --------------------------------------------------------------------------------------


def plan_spec(campaign: Mapping[str, Any]) -> PlanSpec:
    """The planner settings of a ``mail.campaign`` row (a mapping with timezone, emails_per_day,
    weekdays, windows).

    :raises ValueError: from :class:`PlanSpec` (unknown zone, bad window, ...).
    """
    return PlanSpec(timezone=str(campaign["timezone"]), emails_per_day=int(campaign["emails_per_day"]),
                    weekdays=frozenset(int(d) for d in campaign["weekdays"]),
                    windows=tuple(Window.parse(str(w)) for w in campaign["windows"]))


def _local_midnight(day: date, spec: PlanSpec) -> datetime:
    """The first instant (UTC) of plan day ``day``: ``spec.day_start`` (00:00 unless a window crosses
    midnight) on that local date (in a DST gap: the instant after it)."""
    return datetime.combine(day, spec.day_start, tzinfo=spec.zone).astimezone(UTC)


def _day_bounds(at: datetime, spec: PlanSpec) -> tuple[datetime, datetime]:
    """``[start, end)`` in UTC of the plan day of ``at`` in the campaign's zone (see
    :func:`mailflow.sources.scheduled.planning.plan_day`: a window crossing midnight counts towards its first date)."""
    day = plan_day(spec, at)
    return _local_midnight(day, spec), _local_midnight(day + timedelta(days=1), spec)


def plan_after(spec: PlanSpec, plan_start: datetime, plan_skip: int, planned_through: datetime | None,
               count: int) -> Iterator[datetime]:
    """The next ``count`` instants (aware UTC, increasing) of the plan anchored at ``plan_start``.

    The plan is ``plan_send_times(spec, ., plan_start)`` without its first ``plan_skip`` instants.
    ``planned_through`` (the last instant already given to a row, or None) is continued from
    without generating the plan from its start: the local day of ``planned_through`` is re-planned
    from its beginning (or from ``plan_start`` on the plan's first day) and the instants up to
    ``planned_through`` are dropped, so chunked planning equals one uninterrupted plan.
    """
    if count <= 0:
        return iter(())
    if planned_through is None:
        return islice(plan_send_times(spec, count + plan_skip, plan_start), plan_skip, None)
    day = plan_day(spec, planned_through)
    if day <= plan_day(spec, plan_start):
        start = plan_start
    else:
        start = _local_midnight(day, spec)
    # the local day of planned_through holds at most emails_per_day instants up to and including it
    times = plan_send_times(spec, count + spec.emails_per_day + plan_skip, start)
    return islice(dropwhile(lambda t: t <= planned_through, times), count)


# -- campaigns: create, read -----------------------------------------------------------------------


def _one(conn: psycopg.Connection, sql: str | pgsql.Composable, params: Mapping[str, Any]) -> dict[str, Any] | None:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(sql, params)  # type: ignore[arg-type]  # named statements from store/sql/queries
        return cur.fetchone()


def _lock(conn: psycopg.Connection, campaign_id: int) -> dict[str, Any]:
    row = _one(conn, query("scheduled", "campaign_lock"), {"id": campaign_id})
    if row is None:
        raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
    return row


def _event(conn: psycopg.Connection, campaign_id: int, from_status: str | None, to_status: str,
           actor: str | None, **detail: Any) -> None:
    conn.execute(query("scheduled", "campaign_event"), {
        "id": campaign_id, "from_status": from_status, "to_status": to_status,
        "detail": Jsonb(detail), "actor": actor})


def _actor(run: RunContext | None, actor: str | None) -> str | None:
    if actor:
        return actor
    if run and run.dag_id:
        return f"{run.dag_id}/{run.run_id}/{run.task_id}"
    return None


def resolve_campaign(conn: psycopg.Connection, ref: str | int) -> int:
    """A campaign id from an id or a name (CLI arguments).

    :raises LookupError: if no campaign has that name.
    """
    if isinstance(ref, int) or str(ref).isdigit():
        return int(ref)
    with conn.transaction():
        row = conn.execute(query("scheduled", "campaign_id_by_name"), {"name": str(ref)}).fetchone()
    if row is None:
        raise LookupError(f"no campaign named {ref!r}")
    return int(row[0])


def _check_templates(template: str, label: str) -> None:
    for suffix in (".html.j2", ".txt.j2"):
        t = CAMPAIGNS_DIR / "templates" / f"{template}{suffix}"
        if not _NAME.match(template) or not t.is_file():
            raise ValueError(f"campaign {label!r}: template {t} not found")


def _recipients_file(name: str, label: str) -> Path:
    stem = name[:-4] if name.endswith(".sql") else name
    path = CAMPAIGNS_DIR / "recipients" / f"{stem}.sql"
    if not _NAME.match(stem) or not path.is_file():
        raise ValueError(f"campaign {label!r}: recipients file {path} not found")
    return path


def load_spec(path: Path) -> dict[str, Any]:
    """Read a campaign spec from a ``.toml`` or ``.json`` file (keys: see :func:`create_campaign`).

    :raises ValueError: for another file type.
    """
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".toml"):
        return dict(tomllib.loads(text))
    if str(path).endswith(".json"):
        return dict(json.loads(text))
    raise ValueError(f"campaign spec must be a .toml or .json file, got {path}")


def create_campaign(conn: psycopg.Connection, spec: Mapping[str, Any], *, actor: str | None = None,
                    base_dir: Path | None = None) -> int:
    """Create a ``draft`` campaign from a spec mapping; return its id.

    Keys: ``name`` (``[a-z0-9_]``, = the send log's campaign), ``template``, ``subject`` (Jinja over
    ``user``), ``from``, optional ``reply_to``, ``timezone`` (IANA, default Europe/Berlin),
    ``emails_per_day`` (20), ``weekdays`` (ISO, [1..5]), ``windows`` (["09:00-12:00",
    "14:00-17:00"], local), ``start_at`` (aware datetime or ISO text; default now), ``marketing``
    (true), ``on_policy`` (``defer``: a due email the contact policy holds back moves to the first
    planned slot after the window; ``skip``: it becomes ``skipped`` with the reason; ``ignore``: it
    is sent anyway, for transactional mail; default defer), and exactly one recipient source: ``recipients_sql`` (a file name in
    ``campaigns/recipients/``), ``recipients_table`` (``schema.table`` with user_id, email,
    first_name columns) or ``recipients_csv`` (a CSV file with user_id, email, first_name and any
    extra columns, uploaded into ``mail.campaign_recipient``; relative to ``base_dir``).

    :raises ValueError: naming the campaign and the field for anything invalid.
    """
    label = str(spec.get("name", "?"))
    if not _NAME.match(label):
        raise ValueError(f"campaign name {label!r} must be 1-64 of [a-z0-9_]")
    missing = [k for k in ("template", "subject", "from") if not spec.get(k)]
    if missing:
        raise ValueError(f"campaign {label!r} lacks {', '.join(missing)}")
    sources = [k for k in ("recipients_sql", "recipients_table", "recipients_csv") if spec.get(k)]
    if len(sources) != 1:
        raise ValueError(f"campaign {label!r}: give exactly one of recipients_sql, recipients_table, "
                         f"recipients_csv (got {sources or 'none'})")
    plan = PlanSpec(timezone=str(spec.get("timezone", "Europe/Berlin")),
                    emails_per_day=int(spec.get("emails_per_day", 20)),
                    weekdays=frozenset(int(d) for d in spec.get("weekdays", (1, 2, 3, 4, 5))),
                    windows=tuple(spec.get("windows", ("09:00-12:00", "14:00-17:00"))))
    _check_templates(str(spec["template"]), label)
    try:
        subject_template(str(spec["subject"]))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"campaign {label!r}: subject is not a valid Jinja template: {exc}") from None
    start_at = spec.get("start_at")
    if isinstance(start_at, str):
        start_at = datetime.fromisoformat(start_at)
    if start_at is not None and (not isinstance(start_at, datetime) or start_at.tzinfo is None):
        raise ValueError(f"campaign {label!r}: start_at must be an aware datetime (with an offset), got {start_at!r}")
    on_policy = str(spec.get("on_policy", "defer"))
    if on_policy not in ON_POLICY:
        raise ValueError(f"campaign {label!r}: on_policy must be one of {', '.join(ON_POLICY)}, got {on_policy!r}")
    recipients_sql = recipients_table = None
    if spec.get("recipients_sql"):
        recipients_sql = _recipients_file(str(spec["recipients_sql"]), label).stem
    elif spec.get("recipients_table"):
        recipients_table = str(spec["recipients_table"])
        if not _TABLE.match(recipients_table):
            raise ValueError(f"campaign {label!r}: recipients_table {recipients_table!r} is not a table name")
    else:
        recipients_table = "mail.campaign_recipient"
    with conn.transaction():
        row = conn.execute(query("scheduled", "campaign_insert"), {
            "name": label, "timezone": plan.timezone, "emails_per_day": plan.emails_per_day,
            "weekdays": sorted(plan.weekdays), "windows": [str(w) for w in plan.windows], "start_at": start_at,
            "template": str(spec["template"]), "subject": str(spec["subject"]), "from_address": str(spec["from"]),
            "reply_to": spec.get("reply_to"), "recipients_sql": recipients_sql,
            "recipients_table": recipients_table, "marketing": bool(spec.get("marketing", True)),
            "on_policy": on_policy,
        }).fetchone()
        assert row is not None
        campaign_id = int(row[0])
        _event(conn, campaign_id, None, "draft", actor, spec={k: str(v) for k, v in spec.items()})
        if spec.get("recipients_csv"):
            path = Path(str(spec["recipients_csv"]))
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            upload_recipients(conn, campaign_id, path)
    return campaign_id


def upload_recipients(conn: psycopg.Connection, campaign_id: int, path: Path) -> int:
    """Load a CSV recipient list (header: user_id, email, first_name, extra columns -> ``context``)
    into ``mail.campaign_recipient`` with COPY; return the rows loaded.

    :raises ValueError: if a required column is missing or a user_id is not an integer.
    """
    with open(path, newline="", encoding="utf-8") as fh, conn.transaction():
        reader = csv.DictReader(fh)
        cols = set(reader.fieldnames or ())
        if not {"user_id", "email"} <= cols:
            raise ValueError(f"{path}: the header needs user_id and email columns, got {sorted(cols)}")
        n = 0
        with conn.cursor().copy("copy mail.campaign_recipient (campaign_id, user_id, email, first_name, context)"
                                " from stdin") as copy:
            for i, rec in enumerate(reader, start=2):
                try:
                    uid = int(rec.pop("user_id"))
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{i}: user_id is not an integer") from None
                email = rec.pop("email")
                first = rec.pop("first_name", None)
                copy.write_row((campaign_id, uid, email, first, json.dumps(rec)))
                n += 1
    return n


# -- provisioning ----------------------------------------------------------------------------------


def _recipient_source(conn: psycopg.Connection, c: Mapping[str, Any]) -> pgsql.Composable:
    """The campaign's recipient query (trusted: a version-controlled file, or a checked table name)."""
    if c["recipients_sql"]:
        text = _recipients_file(str(c["recipients_sql"]), c["name"]).read_text(encoding="utf-8")
        return pgsql.SQL(text.strip().rstrip(";"))  # trusted file from the package
    m = _TABLE.match(str(c["recipients_table"] or ""))
    if not m:
        raise ValueError(f"campaign {c['name']!r}: recipients_table {c['recipients_table']!r} is not a table name")
    schema, table = m.group(1) or "public", m.group(2)
    cols = {r[0] for r in conn.execute(
        "select column_name from information_schema.columns where table_schema = %s and table_name = %s",
        (schema, table)).fetchall()}
    if not {"user_id", "email"} <= cols:
        raise ValueError(f"campaign {c['name']!r}: table {schema}.{table} needs user_id and email columns "
                         f"(has {sorted(cols) or 'no columns: does it exist?'})")
    source: pgsql.Composable = pgsql.SQL("select * from {}").format(pgsql.Identifier(schema, table))
    if "campaign_id" in cols:
        source = pgsql.SQL("{} where campaign_id = %(campaign_id)s").format(source)
    return source


def _snapshot(rec: dict[str, Any]) -> tuple[int, str | None, dict[str, Any]]:
    """``(user_id, email, context)`` of one recipient row (a JSON object)."""
    rec = dict(rec)
    uid = int(rec.pop("user_id"))
    email = rec.pop("email", None)
    rec.pop("campaign_id", None)
    extra = rec.pop("context", None)
    ctx = {**(extra if isinstance(extra, dict) else {}), **rec}
    return uid, (str(email).strip() if email else None), ctx


def _used_on_day(conn: psycopg.Connection, c: Mapping[str, Any], spec: PlanSpec, at: datetime,
                 include_pending: bool) -> int:
    start, end = _day_bounds(at, spec)
    row = conn.execute(query("scheduled", "sent_between"), {
        "campaign": c["name"], "start": start, "end": end, "include_pending": include_pending}).fetchone()
    return int(row[0]) if row else 0


def provision(conn: psycopg.Connection, campaign_id: int, *, now: datetime, chunk: int = 5000,
              dry_run: bool = False, run: RunContext | None = None,
              after_chunk: Callable[[ProvisionSummary], None] | None = None) -> ProvisionSummary:
    """Create one ``pending`` send-log row (``kind = 'scheduled'``) per recipient, with its planned
    ``scheduled_at`` (UTC) and a snapshot (address; context = the recipient's extra columns plus the
    rendered ``subject``), ``chunk`` recipients per transaction.

    Idempotent and resumable: each chunk's rows and the checkpoint commit together, rows are
    inserted ``ON CONFLICT DO NOTHING``, and a second call continues after the checkpoint (creating
    nothing if the list is exhausted; recipients added later with a higher user_id are appended).
    A draft campaign becomes ``scheduled`` with its first chunk; a paused one stays paused.
    ``cancelled``/``completed`` campaigns are left alone (``stopped`` says so). Recipients
    without an address are skipped and get no slot.

    :param now: aware "now"; anchors a first plan at ``max(start_at, now)``.
    :param dry_run: plan the recipients still to provision and summarise; write nothing.
    :param after_chunk: called after each chunk commits (tests inject a crash here).
    :raises ValueError: for a naive ``now``, a bad chunk size, a missing template or recipients
        file, or a subject that needs a column the recipients lack (naming campaign and user).
    :raises LookupError: if the campaign does not exist.
    """
    if now.tzinfo is None:
        raise ValueError("now must be a timezone-aware datetime")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 recipients, got {chunk}")
    run = run or RunContext()
    summary = ProvisionSummary(campaign_id=campaign_id, dry_run=dry_run)
    if dry_run:
        return _dry_run(conn, campaign_id, now, summary)
    actor = _actor(run, None)
    per_day: dict[date, int] = {}
    subject_t: jinja2.Template | None = None
    while True:
        with conn.transaction():
            c = _lock(conn, campaign_id)
            spec = plan_spec(c)
            summary.campaign, summary.timezone, summary.emails_per_day = c["name"], spec.timezone, spec.emails_per_day
            if c["status"] in ("cancelled", "completed"):
                summary.stopped = f"campaign {c['status']}"
                summary.complete = c["provisioned_at"] is not None
                summary.provisioned_total = int(c["provisioned_count"])
                log.info("campaign %s is %s: nothing to provision", c["name"], c["status"])
                break
            if subject_t is None:
                _check_templates(c["template"], c["name"])
                subject_t = subject_template(c["subject"])
            plan_start = c["plan_start"] or max(c["start_at"], now)
            source = _recipient_source(conn, c)
            after = c["provision_cursor"] if c["provision_cursor"] is not None else _MIN_BIGINT
            page = conn.execute(pgsql.SQL(query("scheduled", "recipients_page")).format(source=source),
                                {"after": after, "limit": chunk, "campaign": c["name"],
                                 "campaign_id": campaign_id}).fetchall()
            current = c["status"]
            if current == "draft":
                conn.execute(query("scheduled", "campaign_set_status"),
                             {"id": campaign_id, "from_status": "draft", "to_status": "scheduled"})
                _event(conn, campaign_id, "draft", "scheduled", actor, reason="provisioning started")
                current = "scheduled"
            if not page:
                conn.execute(query("scheduled", "mark_provisioned"), {"id": campaign_id, "plan_start": plan_start})
                if c["provisioned_at"] is None:
                    _event(conn, campaign_id, current, current, actor, reason="provisioned",
                           provisioned_count=int(c["provisioned_count"]),
                           planned_through=c["planned_through"].isoformat() if c["planned_through"] else None)
                summary.complete = True
                summary.provisioned_total = int(c["provisioned_count"])
                break
            recipients = [_snapshot(r[0]) for r in page]
            cursor = max(uid for uid, _, _ in recipients)
            usable = [r for r in recipients if r[1]]
            summary.skipped_no_email += len(recipients) - len(usable)
            summary.recipients += len(recipients)
            planned_through, plan_skip = c["planned_through"], int(c["plan_skip"])
            times = list(plan_after(spec, plan_start, plan_skip, planned_through, len(usable)))
            if times and times[0] < now:
                # the plan ran out while provisioning was stopped: continue from now, not in the past
                plan_start, planned_through = now, None
                plan_skip = _used_on_day(conn, c, spec, now, include_pending=True)
                conn.execute(query("scheduled", "set_plan"), {
                    "id": campaign_id, "plan_start": plan_start, "plan_skip": plan_skip, "planned_through": None})
                times = list(plan_after(spec, plan_start, plan_skip, None, len(usable)))
                summary.reanchored = True
            rows = []
            for (uid, email, ctx), at in zip(usable, times, strict=True):
                user = {"user_id": uid, "email": email, **ctx}
                try:
                    subject = " ".join(subject_t.render(user=user, campaign=c["name"], app_url=settings.app_url()).split())
                except jinja2.UndefinedError as exc:
                    raise ValueError(f"campaign {c['name']!r}: the subject needs {exc} (user {uid})") from None
                rows.append({"user_id": uid, "email": email, "context": {**ctx, "subject": subject},
                             "scheduled_at": at.isoformat()})
            created = 0
            if rows:
                res = conn.execute(query("scheduled", "provision_rows"), {
                    "campaign": c["name"], "page": Jsonb(rows),
                    "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}).fetchone()
                created = int(res[0]) if res else 0
            conn.execute(query("scheduled", "advance_checkpoint"), {
                "id": campaign_id, "created": created, "cursor": cursor,
                "planned_through": times[-1] if times else planned_through, "plan_start": plan_start})
        summary.chunks += 1
        summary.created += created
        summary.skipped_existing += len(rows) - created
        summary.provisioned_total = int(c["provisioned_count"]) + created
        if times:
            summary.first_send = summary.first_send or times[0]
            summary.last_send = times[-1]
            for t in times:
                d = t.astimezone(spec.zone).date()
                per_day[d] = per_day.get(d, 0) + 1
        log.info("campaign %s chunk %d: %d recipients -> %d rows created (%d existed), through %s",
                 c["name"], summary.chunks, len(recipients), created, len(rows) - created,
                 times[-1].isoformat() if times else "-")
        if after_chunk is not None:
            after_chunk(summary)
    if per_day:
        summary.per_day_max = max(per_day.values())
        summary.sending_days = len(per_day)
        summary.days_spanned = (max(per_day) - min(per_day)).days + 1
    return summary


def _dry_run(conn: psycopg.Connection, campaign_id: int, now: datetime, summary: ProvisionSummary) -> ProvisionSummary:
    with conn.transaction():
        c = _one(conn, query("scheduled", "campaign_by_id"), {"id": campaign_id})
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        spec = plan_spec(c)
        _check_templates(c["template"], c["name"])
        after = c["provision_cursor"] if c["provision_cursor"] is not None else _MIN_BIGINT
        row = conn.execute(pgsql.SQL(query("scheduled", "recipients_count")).format(
            source=_recipient_source(conn, c)), {"after": after, "campaign": c["name"], "campaign_id": campaign_id}
        ).fetchone()
    remaining = int(row[0]) if row else 0
    plan_start = c["plan_start"] or max(c["start_at"], now)
    times = list(plan_after(spec, plan_start, int(c["plan_skip"]), c["planned_through"], remaining))
    if times and times[0] < now:
        times = list(plan_after(spec, now, 0, None, remaining))
        summary.reanchored = True
    ps = summarize(times, spec.timezone, day_start=spec.day_start)
    summary.campaign, summary.timezone, summary.emails_per_day = c["name"], spec.timezone, spec.emails_per_day
    summary.recipients = remaining
    summary.provisioned_total = int(c["provisioned_count"])
    summary.first_send, summary.last_send = ps.first, ps.last
    summary.per_day_max = max(ps.emails_per_day.values(), default=0)
    summary.sending_days = len(ps.emails_per_day)
    summary.days_spanned = ps.days_spanned
    summary.complete = c["provisioned_at"] is not None and remaining == 0
    log.info("dry run %s: %d recipients to provision, first %s, last %s, %d/day over %d days",
             c["name"], remaining, ps.first, ps.last, spec.emails_per_day, ps.days_spanned)
    return summary


# -- operator controls -----------------------------------------------------------------------------


def _transition(conn: psycopg.Connection, campaign_id: int, allowed: Sequence[str], to_status: str,
                actor: str | None, **detail: Any) -> tuple[dict[str, Any], bool]:
    """Lock the campaign and move it to ``to_status`` from one of ``allowed`` (in the caller's
    transaction). Returns ``(row before, changed)``; already in ``to_status`` = not changed."""
    c = _lock(conn, campaign_id)
    if c["status"] == to_status:
        return c, False
    if c["status"] not in allowed:
        raise CampaignStateError(f"campaign {c['name']!r} is {c['status']}: cannot become {to_status} "
                                 f"(only from {', '.join(allowed)})")
    conn.execute(query("scheduled", "campaign_set_status"),
                 {"id": campaign_id, "from_status": c["status"], "to_status": to_status})
    _event(conn, campaign_id, c["status"], to_status, actor, **detail)
    return c, True


def cancel(conn: psycopg.Connection, campaign_id: int, *, actor: str | None = None,
           run: RunContext | None = None) -> dict[str, Any]:
    """Cancel a campaign: status -> ``cancelled`` and every ``pending`` row -> ``cancelled`` (with an
    event each), in one transaction. Rows already ``sending`` finish as they are; terminal rows are
    untouched. Cancelling a cancelled campaign changes nothing.

    :returns: ``{"campaign", "status", "changed", "rows_cancelled"}``.
    :raises CampaignStateError: if the campaign is completed.
    """
    run = run or RunContext()
    with conn.transaction():
        c, changed = _transition(conn, campaign_id, ("draft", "scheduled", "paused"), "cancelled",
                                 _actor(run, actor))
        n = len(conn.execute(query("scheduled", "cancel_pending"), {
            "campaign": c["name"], "reason": "campaign cancelled",
            "dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}).fetchall())
    log.info("campaign %s cancelled: %d pending rows cancelled", c["name"], n)
    return {"campaign": c["name"], "status": "cancelled", "changed": changed, "rows_cancelled": n}


def pause(conn: psycopg.Connection, campaign_id: int, *, actor: str | None = None) -> dict[str, Any]:
    """Pause a draft or scheduled campaign: the dispatcher stops claiming its rows (rows in flight
    finish); the plan is kept. Pausing a paused campaign changes nothing.

    :raises CampaignStateError: if the campaign is cancelled or completed.
    """
    with conn.transaction():
        c, changed = _transition(conn, campaign_id, ("draft", "scheduled"), "paused", actor)
    return {"campaign": c["name"], "status": "paused", "changed": changed}


def resume(conn: psycopg.Connection, campaign_id: int, *, now: datetime | None = None,
           actor: str | None = None) -> dict[str, Any]:
    """Resume a paused campaign (status -> ``scheduled``) under the module's pause/resume rule: if a
    pending row's time passed (``scheduled_at < now``), every pending row is re-planned in its
    order from ``now`` (the resume day keeps its per-day cap); otherwise no time changes. One
    transaction; resuming a scheduled campaign changes nothing.

    :param now: the resume instant (aware; default: the database clock).
    :returns: ``{"campaign", "status", "changed", "overdue", "replanned", "first", "last"}``
        (first/last: ISO text of the re-planned range, or None).
    :raises CampaignStateError: if the campaign is not paused (or scheduled).
    """
    with conn.transaction():
        at = now or _db_now(conn)
        if at.tzinfo is None:
            raise ValueError("now must be a timezone-aware datetime")
        c = _lock(conn, campaign_id)
        if c["status"] == "scheduled":
            return {"campaign": c["name"], "status": "scheduled", "changed": False, "overdue": 0,
                    "replanned": 0, "first": None, "last": None}
        if c["status"] != "paused":
            raise CampaignStateError(f"campaign {c['name']!r} is {c['status']}: only a paused campaign resumes")
        pending = conn.execute(query("scheduled", "pending_in_order"), {"campaign": c["name"]}).fetchall()
        overdue = sum(1 for _, t in pending if t < at)
        times: list[datetime] = []
        if overdue:
            spec = plan_spec(c)
            skip = _used_on_day(conn, c, spec, at, include_pending=False)
            times = list(plan_after(spec, at, skip, None, len(pending)))
            conn.execute(query("scheduled", "replan_rows"), {"ids": [r[0] for r in pending], "times": times})
            conn.execute(query("scheduled", "set_plan"), {
                "id": campaign_id, "plan_start": at, "plan_skip": skip, "planned_through": times[-1]})
        _transition(conn, campaign_id, ("paused",), "scheduled", actor, overdue=overdue, replanned=len(times),
                    resumed_at=at.isoformat(), first=times[0].isoformat() if times else None,
                    last=times[-1].isoformat() if times else None)
    log.info("campaign %s resumed at %s: %d overdue, %d re-planned", c["name"], at, overdue, len(times))
    return {"campaign": c["name"], "status": "scheduled", "changed": True, "overdue": overdue,
            "replanned": len(times), "first": times[0].isoformat() if times else None,
            "last": times[-1].isoformat() if times else None}


def complete(conn: psycopg.Connection, campaign_id: int | None = None, *, actor: str | None = None) -> list[str]:
    """Mark ``scheduled`` campaigns ``completed`` when their list is fully provisioned and no row
    is ``pending`` or ``sending`` (only ``campaign_id`` if given); return the names completed."""
    with conn.transaction():
        rows = conn.execute(query("scheduled", "complete_finished"), {"id": campaign_id, "actor": actor}).fetchall()
    return [str(r[1]) for r in rows]


def status(conn: psycopg.Connection, campaign_id: int) -> dict[str, Any]:
    """A campaign's settings, checkpoint and rows by state, the next due time and the send
    lateness (``sent_at - scheduled_at``) p50/p99 in seconds. Datetimes as ISO text."""
    with conn.transaction():
        c = _one(conn, query("scheduled", "campaign_by_id"), {"id": campaign_id})
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        counts = _one(conn, query("scheduled", "campaign_counts"), {"campaign": c["name"]}) or {}
    out = {**c, "rows": counts}
    return json.loads(json.dumps(out, default=_json_default))


def _json_default(v: Any) -> Any:
    if isinstance(v, datetime | date):
        return v.isoformat()
    return str(v)


def _db_now(conn: psycopg.Connection) -> datetime:
    row = conn.execute("select now()").fetchone()
    assert row is not None
    return row[0]


# -- dispatch --------------------------------------------------------------------------------------


def _deferred_times(conn: psycopg.Connection, c: Mapping[str, Any],
                    held: Sequence[tuple[int, datetime]]) -> dict[int, datetime]:
    """New planned times for rows the contact policy holds back: ``held`` = ``(row id, free_at)``.

    Each row gets the first instant after its ``free_at`` that the campaign's plan allows: an
    allowed weekday, inside the local windows, on a local day whose emails (planned, in flight or
    sent) are still fewer than ``emails_per_day``; within that day the planner's slots spread from
    ``free_at`` are used in order. Aware UTC datetimes, strictly after ``free_at``.
    """
    spec = plan_spec(c)
    first = min(f for _, f in held)
    since = _local_midnight(plan_day(spec, first), spec)
    day_start = timedelta(hours=spec.day_start.hour, minutes=spec.day_start.minute, seconds=spec.day_start.second)
    counts: dict[date, int] = {d: int(n) for d, n in conn.execute(query("scheduled", "day_counts"), {
        "campaign": c["name"], "tz": spec.timezone, "since": since, "day_start": day_start}).fetchall()}
    days: dict[date, list[datetime]] = {}  # the day's free slots (computed once per day and call)
    out: dict[int, datetime] = {}
    for rid, free_at in sorted(held, key=lambda h: (h[1], h[0])):
        start = free_at + timedelta(microseconds=1)
        day = plan_day(spec, start)
        for _ in range(800):  # the planner's own bound on days without window time
            if day.isoweekday() in spec.weekdays and counts.get(day, 0) < spec.emails_per_day:
                if day not in days:
                    floor = max(start, _local_midnight(day, spec))
                    days[day] = [t for t in plan_send_times(spec, spec.emails_per_day, floor)
                                 if plan_day(spec, t) == day]
                free = days[day]
                i = bisect_left(free, start)
                if i < len(free):
                    out[rid] = free.pop(i)
                    counts[day] = counts.get(day, 0) + 1
                    break
            day += timedelta(days=1)
            start = max(start, _local_midnight(day, spec))
        else:
            raise RuntimeError(f"campaign {c['name']!r}: no planned slot within 800 days after {free_at}")
    return out


def _render_campaign(c: Mapping[str, Any]) -> Campaign:
    """The renderer's :class:`Campaign` for a ``mail.campaign`` row: the subject is the snapshot
    rendered at provisioning (``user.subject``); audience fields are unused."""
    return Campaign(name=str(c["name"]), priority=0, audience_sql="", template=str(c["template"]),
                    subject="{{ user.subject }}", from_address=str(c["from_address"]), reply_to=c["reply_to"],
                    cooldown=timedelta(0), audience_window=timedelta(0), marketing=bool(c["marketing"]))


@dataclass
class _Claim:
    campaign: Campaign
    rows: tuple[MintedRow, ...]
    attempts: dict[int, int]
    batch: PreparedBatch | None
    render_failed: int
    render_errors: list[str] = field(default_factory=list)
    decided: dict[str, int] = field(default_factory=dict)  # rows decided without a request, by status


class _Dispatcher:
    """One dispatch call's state: the connection, the lifecycle store (apply, rebatch, batches)."""

    def __init__(self, conn: psycopg.Connection, renderer: Renderer, run: RunContext, batch_size: int,
                 policy: ContactPolicy | None = None):
        self.conn = conn
        self.store = PostgresStore(conn)
        self.renderer = renderer
        self.run = run
        self.who = {"dag_id": run.dag_id, "run_id": run.run_id, "task_id": run.task_id}
        self.batch_size = batch_size
        self.campaigns: dict[str, Campaign] = {}
        self.campaign_rows: dict[str, dict[str, Any]] = {}
        self.policy: ContactPolicy = policy if policy is not None else load_policy()

    def due_wait(self, coalesce: float) -> float | None:
        with self.conn.transaction():
            row = self.conn.execute(query("scheduled", "due_wait"),
                                    {"coalesce": coalesce, "batch": self.batch_size}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def prepare(self, campaign: Campaign, rows: Sequence[MintedRow]) -> PreparedBatch:
        """Render a claimed chunk; its key is assigned by the store when the batch is saved
        (docs/model.md, "Idempotency keys": never the same key for two bodies)."""
        return self.renderer.prepare_batch(campaign, rows)

    def _campaign(self, name: str) -> Campaign:
        if name not in self.campaigns:
            c = _one(self.conn, query("scheduled", "campaigns_by_name"), {"names": [name]})
            if c is None:
                raise LookupError(f"campaign {name!r} vanished from mail.campaign")
            self.campaigns[name] = _render_campaign(c)
        return self.campaigns[name]

    def claim(self) -> tuple[int, _Claim | None]:
        """Cancel suppressed due rows, pick one campaign's due rows, pass them through the contact
        guard, claim the rest, render and store the batch: one transaction (a crash leaves either
        pending rows or sending rows with their bytes).

        The guard (docs/model.md, "The contact policy"): each address is normalised (invalid: the
        row fails with the validator's reason, no request; suppressed as normalised: cancelled; a
        second user at an address the campaign already mails: ``duplicate`` naming the first); the
        users' ``mail.contact`` rows are locked in user_id order and the policy is re-evaluated on
        what is committed now; a held row is deferred to the first planned slot after the window
        (``on_policy = 'defer'``), or ``skipped`` with the reason, or sent anyway (``ignore``).
        Returns ``(rows cancelled as suppressed, the claim or None if nothing was due)``."""
        with self.conn.transaction():
            suppressed = len(self.conn.execute(query("scheduled", "cancel_suppressed_due"), self.who).fetchall())
            picked = self.conn.execute(query("scheduled", "pick_due"), self.who | {"limit": self.batch_size}).fetchall()
            if not picked:
                return suppressed, None
            crow = self._campaign_row(str(picked[0][4]))
            decided = self._guard(crow, picked)
            if decided:
                self.conn.execute(query("scheduled", "decide_rows"), self.who | {
                    "ids": list(decided), "statuses": [d[0] for d in decided.values()],
                    "reasons": [d[1] for d in decided.values()], "ats": [d[2] for d in decided.values()]})
            go = [r for r in picked if int(r[0]) not in decided]
            found: list[Any] = []
            if go:
                addrs = [normalise_address(r[2]) for r in go]
                found = self.conn.execute(query("scheduled", "claim_rows"), self.who | {
                    "ids": [int(r[0]) for r in go], "emails": [a.send for a in addrs],
                    "keys": [a.key for a in addrs]}).fetchall()
            counts: dict[str, int] = {}
            for st, _, _at in decided.values():
                k = "deferred" if st == "pending" else st
                counts[k] = counts.get(k, 0) + 1
            if not found:
                return suppressed + counts.pop("cancelled", 0), _Claim(
                    self._campaign(str(picked[0][4])), (), {}, None, 0, [], counts)
            suppressed += counts.pop("cancelled", 0)
            campaign = self._campaign(str(found[0][4]))
            rows = tuple(MintedRow(id=r[0], user_id=r[1], email=r[2], context=r[3] or {}) for r in found)
            attempts = {int(r[0]): int(r[5]) for r in found}
            bad: dict[int, str] = {}
            try:
                batch: PreparedBatch | None = self.prepare(campaign, rows)
            except (jinja2.TemplateError, ValueError, TypeError):  # the renderer's RenderError is a ValueError
                # Find the rows at fault: a recipient whose snapshot lacks a template variable fails
                # (its snapshot will not change), the others go. Any other error (a missing or broken
                # template) propagates: the claim rolls back and the rows stay pending.
                good = []
                for r in rows:
                    try:
                        self.renderer.render_email(campaign, r)
                        good.append(r)
                    except jinja2.UndefinedError as exc:
                        bad[r.id] = f"render failed (template {campaign.template!r}): {exc}"
                rows = tuple(good)
                batch = self.prepare(campaign, rows) if rows else None
            if bad:
                self.conn.execute(query("send_log", "mark_failed"), self.who | {
                    "ids": list(bad), "msgs": list(bad.values())})
            if batch is not None:
                batch = self.store.save_batch(batch)
        if bad:
            log.error("%s: %d email(s) failed to render, marked failed: %s", campaign.name, len(bad),
                      "; ".join(f"row {i}: {m}" for i, m in bad.items()))
        return suppressed, _Claim(campaign, rows, attempts, batch, len(bad), list(bad.values()), counts)

    def _campaign_row(self, name: str) -> dict[str, Any]:
        if name not in self.campaign_rows:
            c = _one(self.conn, query("scheduled", "campaigns_by_name"), {"names": [name]})
            if c is None:
                raise LookupError(f"campaign {name!r} vanished from mail.campaign")
            self.campaign_rows[name] = c
        return self.campaign_rows[name]

    def _guard(self, c: Mapping[str, Any], picked: Sequence[Any]) -> dict[int, tuple[str, str, datetime | None]]:
        """The contact guard for picked rows ``(id, user_id, email, context, campaign, attempts,
        scheduled_at)`` of campaign row ``c``, in the claim transaction. Returns the rows decided
        without a request: ``{id: (status, reason, new scheduled_at or None)}``."""
        out: dict[int, tuple[str, str, datetime | None]] = {}
        addrs = {int(r[0]): normalise_address(r[2]) for r in picked}
        for r in picked:
            a = addrs[int(r[0])]
            if not a.valid:
                out[int(r[0])] = ("failed", f"invalid address: {a.error}", None)
        valid = [r for r in picked if int(r[0]) not in out]
        keys = sorted({k for r in valid for k in addrs[int(r[0])].keys})
        if keys:
            barred = {x[0] for x in self.conn.execute(query("contact", "suppressed_addresses"),
                                                      {"keys": keys, "campaign": c["name"]})}
            for r in valid:
                if barred.intersection(addrs[int(r[0])].keys):
                    out[int(r[0])] = ("cancelled", "suppressed before sending (address)", None)
        valid = [r for r in picked if int(r[0]) not in out]
        if not valid:
            return out
        now = lock_contacts(self.conn, [int(r[1]) for r in valid])
        out.update(self._hold(c, valid, picked, now))
        valid = [r for r in valid if int(r[0]) not in out]
        holders = reserve_addresses(self.conn, c["name"], [(int(r[1]), addrs[int(r[0])].key) for r in valid])
        for r in valid:
            holder = holders[addrs[int(r[0])].key]
            if holder != int(r[1]):
                out[int(r[0])] = ("duplicate", duplicate_reason(addrs[int(r[0])].key, holder), None)
        return out

    def _hold(self, c: Mapping[str, Any], valid: Sequence[Any], picked: Sequence[Any],
              now: datetime) -> dict[int, tuple[str, str, datetime | None]]:
        """The policy decision for rows ``valid`` under the contact guard: held rows deferred or
        skipped (per ``c['on_policy']``); ``ignore`` holds nothing."""
        out: dict[int, tuple[str, str, datetime | None]] = {}
        if c["on_policy"] == "ignore" or not self.policy.rules:
            return out
        contacts = load_contacts(self.conn, [int(r[1]) for r in valid], self.policy, ref=now, now=now,
                                 include_planned=False, except_ids=[int(r[0]) for r in picked])
        held: list[tuple[int, Hold]] = []
        for r in valid:
            hold = evaluate(self.policy, contacts.get(int(r[1]), ()), ref=now, now=now)
            if hold is None:
                continue
            if c["on_policy"] == "skip":
                out[int(r[0])] = ("skipped", hold.reason(), None)
            else:
                held.append((int(r[0]), hold))
        if held:
            times = _deferred_times(self.conn, c, [(rid, h.free_at) for rid, h in held])
            for rid, hold in held:
                out[rid] = ("pending", f"{hold.reason()}; deferred to {times[rid].isoformat()}", times[rid])
        return out

    def send(self, claim: _Claim, provider: Any, deadline: float, summary: DispatchSummary,
             slot: float | None = None) -> Outcome:
        assert claim.batch is not None
        campaign = claim.campaign
        outcome, applied, batch = send_chunk(self.store, provider, partial(self.prepare, campaign),
                                             claim.batch, claim.rows, deadline, self.run, slot)
        self.count(claim, outcome, applied, batch, summary)
        return outcome

    def count(self, claim: _Claim, outcome: Outcome, applied: Any, batch: PreparedBatch,
              summary: DispatchSummary) -> None:
        """Add one sent chunk's row changes to ``summary`` and log them."""
        campaign = claim.campaign
        summary.sent += applied.sent
        summary.failed += applied.failed
        summary.released += applied.released
        summary.unknown += applied.unknown
        if applied.sent:
            summary.sent_by_campaign[campaign.name] = summary.sent_by_campaign.get(campaign.name, 0) + applied.sent
        log.info("%s batch %s: %d emails -> %d sent, %d rejected, %d released, %d unknown%s", campaign.name,
                 batch.idempotency_key, len(batch.row_ids), applied.sent, applied.failed, applied.released,
                 applied.unknown, "" if isinstance(outcome, Accepted) else f" ({outcome.reason})")


def dispatch(conn: psycopg.Connection, provider: Any, renderer: Renderer, *,
             budget_seconds: float = DISPATCH_BUDGET_SECONDS, coalesce_seconds: float = COALESCE_SECONDS,
             poll_seconds: float = POLL_SECONDS, batch_size: int = BATCH_SIZE,
             send_grace_seconds: float = SEND_GRACE_SECONDS, clock: Clock | None = None,
             run: RunContext | None = None, policy: ContactPolicy | None = None,
             pipelined: bool = False) -> DispatchSummary:
    """Send due scheduled rows until nothing is due within the budget, or the budget is spent.

    Loop: ask the database how long until a claim is worth it (the earliest due row has waited
    ``coalesce_seconds`` s, or ``batch_size`` rows are due); if that is beyond the remaining budget,
    return (the next run takes it: the worker slot is not held idle); if it is ahead, sleep (at
    most ``poll_seconds`` s at a time); otherwise cancel suppressed due rows, claim up to
    ``batch_size`` due rows of one campaign (``FOR UPDATE SKIP LOCKED``: concurrent dispatchers
    never share a row and never wait on each other), render them, store the batch, send it with
    ``provider.send_batch(batch, deadline)`` and apply the outcome by index with
    ``PostgresStore.apply`` (docs/model.md: a request proven not processed returns its rows to
    ``pending`` without charging them and stops the run; rows of an ambiguous request keep their
    key and bytes for the reconciler). Campaigns left with nothing to send are completed at the end.

    :param conn: psycopg 3 connection to the send log (each step is its own transaction).
    :param provider: ``send_batch(batch, deadline) -> Outcome`` (a ResendClient), on ``clock``'s
        monotonic timeline; a claimed batch may run ``send_grace_seconds`` past the budget.
    :param budget_seconds: no new claim or wait starts after this many seconds (monotonic).
    :param batch_size: emails per request, 1-100.
    :param policy: the contact policy (default: ``[policy]`` of ``campaigns/lifecycle.toml``).
    :param pipelined: claim, render and store batch N+1 while batch N is in flight
        (:class:`mailflow.sendloop.engine.ChunkPipeline`: one batch in flight, its answer applied on ``conn``;
        a crash leaves at most two claimed batches, both with their bytes, for the reconciler).
    :raises SendError: after recording everything, if the provider refused the key, an
        idempotency conflict needs a person, or an email could not be rendered (a recipient's
        snapshot lacks a template variable: that row is marked ``failed``, the others are sent).
    :raises ValueError: for a batch size outside 1-100.
    """
    if not 1 <= batch_size <= MAX_BATCH:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH} emails (provider batch limit), got {batch_size}")
    clock = clock or SystemClock()
    run = run or RunContext()
    d = _Dispatcher(conn, renderer, run, batch_size, policy)
    summary = DispatchSummary()
    t0 = clock.monotonic()
    deadline = t0 + budget_seconds
    fatal: list[str] = []
    slot: float | None = None
    pipe = ChunkPipeline(d.store, provider, run, enabled=pipelined)

    def drain() -> str | None:
        """Collect the batch in flight (if any); the reason the run stops, if its answer says so."""
        done = pipe.collect()
        if done is None:
            return None
        chunk, outcome, applied, batch = done
        claim = chunk.tag
        assert isinstance(claim, _Claim)
        d.count(claim, outcome, applied, batch, summary)
        if isinstance(outcome, NotSent | Unknown | Refused):
            if outcome.fatal:
                fatal.append(f"{claim.campaign.name}: {outcome.reason}")
            if outcome.stop_run or isinstance(outcome, NotSent):
                # a whole-request failure that will repeat stops the run at once (docs/model.md)
                return outcome.stop_run or outcome.reason
        return None

    try:
        while True:
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                summary.stopped = "time budget"
                break
            wait = d.due_wait(coalesce_seconds)
            if wait is None:
                break  # nothing pending in any active campaign
            if wait > 0:
                if pipe.busy:  # nothing to prepare meanwhile: take the answer of the batch in flight
                    stop = drain()
                    if stop:
                        summary.stopped = stop
                        break
                    continue
                if wait >= remaining:
                    break  # the next claim falls after this run's budget: free the worker slot
                nap = min(wait, poll_seconds)
                clock.sleep(nap)
                summary.idle_seconds += nap
                continue
            # The budget covers the wait for the request slot, checked BEFORE claiming: a claimed batch
            # is always sent (its first attempt starts at the reserved slot).
            if slot is None:
                slot = reserve_slot(provider, deadline + send_grace_seconds, clock)
            if slot is None:
                summary.stopped = "time budget"
                break
            suppressed, claim = d.claim()
            summary.suppressed += suppressed
            if claim is None:
                if pipe.busy:
                    stop = drain()
                    if stop:
                        summary.stopped = stop
                        break
                elif not suppressed:
                    # every due row is held by another dispatcher: look again shortly
                    nap = min(0.2, remaining)
                    clock.sleep(nap)
                    summary.idle_seconds += nap
                continue
            summary.deferred += claim.decided.get("deferred", 0)
            summary.skipped += claim.decided.get("skipped", 0)
            summary.invalid += claim.decided.get("failed", 0)
            summary.duplicates += claim.decided.get("duplicate", 0)
            summary.render_failed += claim.render_failed
            if claim.render_failed:
                fatal.append(f"{claim.campaign.name}: {claim.render_failed} email(s) could not be rendered and "
                             f"were marked failed ({claim.render_errors[0]})")
            summary.claimed += len(claim.rows) + claim.render_failed
            if claim.batch is None:
                continue
            summary.batches += 1
            chunk = InFlight(claim.batch, claim.rows, partial(d.prepare, claim.campaign),
                             deadline + send_grace_seconds, tag=claim)
            stop = drain()  # one batch in flight at a time: the previous one's answer first
            if stop:
                summary.released += release_unsent(d.store, chunk, f"the run stopped ({stop})", run).released
                summary.stopped = stop
                break
            pipe.submit(chunk, slot)
            slot = None
            if not pipe.pipelined:  # unpipelined: the answer is applied before the next claim
                stop = drain()
                if stop:
                    summary.stopped = stop
                    break
        stop = drain()
        if stop and not summary.stopped:
            summary.stopped = stop
    finally:
        try:
            if pipe.busy:
                drain()
        finally:
            pipe.close()
    summary.completed = complete(conn, actor=_actor(run, "dispatcher"))
    summary.seconds = clock.monotonic() - t0
    log.info("dispatch: %s", summary.as_dict())
    if fatal:
        raise SendError("; ".join(fatal))
    return summary


# -- Airflow task callables (imported lazily by the DAG files) -------------------------------------


def _run_context(context: Mapping[str, Any]) -> RunContext:
    ti = context["ti"]
    return RunContext(dag_id=ti.dag_id, run_id=ti.run_id, task_id=ti.task_id)


def provision_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """The ``provision_campaign`` DAG's task: Params ``campaign_id`` (int), ``dry_run`` (bool),
    ``chunk_size`` (recipients per transaction). Returns the :class:`ProvisionSummary` as a dict."""
    from mailflow.orchestration.tasks import send_log_connection
    from mailflow.store.migrate import require_current

    params = context["params"]
    with send_log_connection() as conn:
        require_current(conn)
        summary = provision(conn, int(params["campaign_id"]), now=datetime.now(UTC),
                            chunk=int(params.get("chunk_size") or 5000), dry_run=bool(params.get("dry_run")),
                            run=_run_context(context))
    out = summary.as_dict()
    log.info("provisioning summary: %s", json.dumps(out))
    return out


def dispatch_task(context: Mapping[str, Any]) -> dict[str, Any]:
    """The ``dispatch_scheduled_emails`` DAG's task: Params ``time_budget_seconds``,
    ``coalesce_seconds``. Builds the renderer and the paced Resend client from the connections and
    calls :func:`dispatch`. Returns the :class:`DispatchSummary` as a dict."""
    from mailflow.orchestration.tasks import budget_fits, send_log_connection, unsubscribe_signer
    from mailflow.provider.hook import ResendHook
    from mailflow.store.migrate import require_current

    params = context["params"]
    budget = budget_fits(context, float(params.get("time_budget_seconds", DISPATCH_BUDGET_SECONDS)))
    renderer = Renderer(unsubscribe_signer(), settings.public_url(), settings.app_url())
    with send_log_connection() as conn:
        require_current(conn)
        client = ResendHook(settings.RESEND_CONN_ID).get_conn()
        try:
            summary = dispatch(conn, client, renderer, run=_run_context(context),
                               budget_seconds=budget,
                               coalesce_seconds=float(params.get("coalesce_seconds", COALESCE_SECONDS)),
                               pipelined=settings.pipelined())
        finally:
            client.close()
            log.info("provider requests: %s", client.stats)
    return summary.as_dict()


# -- CLI -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow.sources.scheduled [--dsn DSN] COMMAND``; prints JSON.

    Commands: ``create SPEC.toml|SPEC.json``, ``provision CAMPAIGN [--dry-run] [--chunk N]``,
    ``cancel|pause|resume|status CAMPAIGN`` (CAMPAIGN = id or name), ``complete``.
    """
    p = argparse.ArgumentParser(prog="python -m mailflow.sources.scheduled", description="Scheduled campaigns.")
    p.add_argument("--dsn", default=os.environ.get("MAILFLOW_DSN"), help="send-log database (or MAILFLOW_DSN)")
    p.add_argument("--actor", default=os.environ.get("USER"), help="recorded on campaign events")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a draft campaign from a TOML/JSON spec (keys: see docs/operations.md)")
    c.add_argument("spec", type=Path)
    pr = sub.add_parser("provision", help="create the campaign's planned rows (or --dry-run)")
    pr.add_argument("campaign")
    pr.add_argument("--dry-run", action="store_true")
    pr.add_argument("--chunk", type=int, default=5000)
    for name in ("cancel", "pause", "resume", "status"):
        sub.add_parser(name, help=f"{'show' if name == 'status' else name} a campaign").add_argument("campaign")
    sub.add_parser("complete", help="complete every finished campaign")
    args = p.parse_args(argv)
    if not args.dsn:
        p.error("--dsn or MAILFLOW_DSN is required")
    from mailflow.store.migrate import SchemaNotCurrent

    try:
        out = _run_command(args)
    except (FileNotFoundError, ValueError, LookupError, CampaignStateError, SchemaNotCurrent, psycopg.Error) as exc:
        print(f"error: {type(exc).__name__}: {str(exc).strip()}", file=sys.stderr)
        if isinstance(exc, psycopg.OperationalError):
            print("hint: is the database running? The demo's embedded server stops when `make demo` ends; "
                  "start it with `make psql` (it prints the DSN and keeps running after \\q), `make airflow`, "
                  "or `make demo DEMO_ARGS=--keep-db`; `make stop` stops it", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, default=_json_default))
    return 0


def _run_command(args: argparse.Namespace) -> Any:
    from mailflow.store.migrate import require_current

    with psycopg.connect(args.dsn) as conn:
        require_current(conn)  # the schema comes from `mailflow migrate`, never from this command
        out: Any
        if args.cmd == "create":
            cid = create_campaign(conn, load_spec(args.spec), actor=args.actor, base_dir=args.spec.parent)
            out = status(conn, cid)
        elif args.cmd == "complete":
            out = {"completed": complete(conn, actor=args.actor)}
        else:
            cid = resolve_campaign(conn, args.campaign)
            if args.cmd == "provision":
                out = provision(conn, cid, now=datetime.now(UTC), chunk=args.chunk, dry_run=args.dry_run,
                                run=RunContext(task_id="cli")).as_dict()
            elif args.cmd == "cancel":
                out = cancel(conn, cid, actor=args.actor)
            elif args.cmd == "pause":
                out = pause(conn, cid, actor=args.actor)
            elif args.cmd == "resume":
                out = resume(conn, cid, actor=args.actor)
            else:
                out = status(conn, cid)
    return out


if __name__ == "__main__":
    sys.exit(main())
