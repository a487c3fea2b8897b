"""The ``mailflow`` command: everything a person does outside Airflow (``mailflow --help``).

The send log (``--dsn`` before or after the command, or ``MAILFLOW_DSN``)::

\b
    mailflow migrate --dsn postgresql://...    # apply pending migrations (the deploy's migrate step)
    mailflow migrate --check --dsn ...         # exit 1 and name them if any are pending
    mailflow report  --dsn ...                 # per-campaign counts by state
    mailflow outcomes --dsn ...                # per-campaign outcomes the provider reported (webhooks, poll)
    mailflow audit   --dsn ... --outbox PATH   # invariants: sent rows <-> delivered emails
    mailflow keys    --dsn ...                 # batches still sending, per API key identity (key rotation)
    mailflow dead-letters list [--campaign C]  # dead letters nobody has decided on yet
    mailflow dead-letters resend (--ids 1,2 | --all) --by NAME --reason TEXT --accept-duplicate-risk
    mailflow dead-letters close  (--ids 1,2 | --all) --by NAME --reason TEXT
    mailflow breaker [--close ACCOUNT --by NAME]         # the providers' circuit breakers
    mailflow reopen-refused --campaign NAME [--field from] [--apply]   # un-charge a campaign's mistake
    mailflow reputation status                                         # the reputation guard's scopes
    mailflow reputation resume (--campaign NAME | --account NAME) --reason TEXT [--by NAME]
    mailflow reputation set --account NAME [--hard-bounce-rate F] [--complaint-rate F] [--exposure E]
                            [--complaint-lag-hours H] [--by NAME]   # per-account lines ('default' resets)

Scheduled campaigns (JSON output; NAME is a campaign's name or id)::

\b
    mailflow campaign create SPEC.toml | --name N --template T --subject S --from A --recipients-sql F
    mailflow campaign update SPEC.toml                 # a draft's definition
    mailflow campaign provision NAME [--dry-run] [--chunk N]
    mailflow campaign pause|resume|cancel|status NAME
    mailflow campaign complete [NAME]

Servers (each until SIGINT/SIGTERM)::

\b
    mailflow unsubscribe serve [--port 8090]   # the one-click unsubscribe endpoint, standalone
    mailflow webhooks serve [--port 8091]      # the provider's webhook receiver, standalone
    mailflow emulator [--port 8025]            # the Resend-compatible emulator (test double, demo)
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import Any

import click
import psycopg

from mailflow.feedback.unsubscribe_app import serve_command as unsubscribe_serve
from mailflow.feedback.webhooks import serve_command as webhooks_serve
from mailflow.model.tally import COLUMNS as TALLY_COLUMNS
from mailflow.sources.scheduled.cli import campaign, dsn_of, dsn_option, run
from mailflow.store import counters
from mailflow.store.sql import query

#: The report's columns: the campaign, then every summary's columns (mailflow.model.tally.COLUMNS).
REPORT_HEAD: tuple[str, ...] = ("campaign", *TALLY_COLUMNS)


def report(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Rows ``(campaign, total, pending, sending, sent, failed, cancelled, duplicate, skipped, holdout, invalid,
    dead_lettered, rolled_back)`` by campaign (:data:`REPORT_HEAD`), counted as every summary counts
    (:mod:`mailflow.model.tally`): the first eight states add up to ``total``; ``invalid`` and
    ``dead_lettered`` are part of ``failed``; ``rolled_back`` is outside the total. From the per-campaign
    counters (migration 0028) once they are seeded, else from ``mail.campaign_progress``."""
    if counters.seeded(conn):
        return [tuple(r[c] for c in REPORT_HEAD) for r in counters.progress(conn)
                if r["total"] > 0 or r["rolled_back"] > 0]
    return conn.execute(query("report", "campaign_tally")).fetchall()


#: The outcomes table's columns (mail.campaign_outcomes; the rates are fractions 0..1 of sent).
OUTCOMES_HEAD: tuple[str, ...] = (
    "campaign", "sent", "delivered", "hard_bounced", "soft_bounced", "complained", "failed_after_send", "opened",
    "clicked", "no_outcome_yet", "delivered_rate", "hard_bounce_rate", "complaint_rate", "open_rate", "click_rate")


def outcomes(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Rows of :data:`OUTCOMES_HEAD` by campaign, from ``mail.campaign_outcomes`` (whole history): the
    sent emails and what the provider reported about them (webhooks and the poll, as
    ``mail.delivery_status`` holds it). Counts are emails (an email delivered and then complained
    about is in both); ``opened``/``clicked`` are unique per email; rates are ``Decimal`` fractions
    0..1 of sent (None when nothing was sent). Campaigns without a sent email are left out. From the
    per-campaign counters (migration 0028) once they are seeded, else from the view."""
    if counters.seeded(conn):
        names = {"opened": "unique_opens", "clicked": "unique_clicks"}
        return [tuple(r[names.get(c, c)] for c in OUTCOMES_HEAD) for r in counters.outcomes(conn) if r["sent"] > 0]
    return conn.execute(query("report", "campaign_outcomes")).fetchall()


def outcome_cells(row: tuple[Any, ...]) -> tuple[Any, ...]:
    """An :func:`outcomes` row for printing: the rates as percentages with two decimals (``2.07%``)."""
    counts = len(OUTCOMES_HEAD) - 5
    return (*row[:counts], *("-" if r is None else f"{100 * r:.2f}%" for r in row[counts:]))


def feedback_suppressions(conn: psycopg.Connection, since: datetime) -> dict[str, int]:
    """Mailboxes suppressed because of the provider's reports since ``since`` (aware datetime), by
    source: ``{"bounce": n, "complaint": n, "provider_suppressed": n}`` (sources with none are left
    out). A mailbox counts once, under the strongest report it got."""
    return dict(conn.execute(query("report", "feedback_suppressions_since"), {"since": since}).fetchall())


def keys(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Per API key identity, the batches that still need that key for a resend (docs/operations.md,
    "Rotating the API key"): rows ``(key_identity, role, batches, sending_rows, oldest_batch,
    needed_until)``, one per identity that has a batch with rows still ``sending`` or that the
    reconciler last found configured (``mail.api_key_identity``).

    ``role``: ``current`` / ``previous`` (as configured at the reconciler's latest run),
    ``NOT CONFIGURED`` (such batches are held, never resent under another key), or ``unknown`` for
    batches stored before identities were recorded (resent under the current key). ``oldest_batch``
    and ``needed_until`` (the newest batch's creation + 23 h, the idempotency window after which the
    reconciler dead-letters what is left) are aware UTC datetimes, or None without batches.
    """
    return conn.execute(
        """
        with need as (
            select b.key_identity, count(*) as batches, sum(s.n) as sending,
                   min(b.created_at) as oldest, max(b.created_at) + interval '23 hours' as until
            from mail.send_batch b
            join (select idempotency_key, count(*) as n from mail.send_log
                  where status = 'sending' and idempotency_key is not null group by idempotency_key) s
              on s.idempotency_key = b.idempotency_key
            group by b.key_identity
        )
        select coalesce(n.key_identity, k.identity, '(none recorded)'),
               case when k.role is not null then k.role
                    when n.key_identity is null then 'unknown'
                    else 'NOT CONFIGURED' end,
               coalesce(n.batches, 0), coalesce(n.sending, 0), n.oldest, n.until
        from need n full join mail.api_key_identity k on k.identity = n.key_identity
        order by k.role nulls last, n.oldest
        """
    ).fetchall()


def audit(conn: psycopg.Connection, outbox: Path) -> dict[str, int]:
    """Compare the send log with the provider's outbox (the witness of what was delivered).

    Each outbox line carries the ``X-Mailflow-Send-Id`` header of the row it came from.
    :raises FileNotFoundError: if ``outbox`` does not exist.
    :returns: counts that must all be 0 except ``delivered`` and ``sent_rows``:
        ``duplicate_deliveries`` (same user+campaign delivered more than once),
        ``sent_without_delivery`` (sent rows with no outbox email), ``delivered_without_sent``
        (outbox emails whose row is not sent), ``provider_id_mismatch`` (row's provider id differs).
    """
    delivered: list[dict[str, Any]] = []
    with outbox.open(encoding="utf-8") as fh:  # a missing outbox is an error, not an empty one
        delivered = [json.loads(line) for line in fh if line.strip()]
    rows = {r[0]: r for r in conn.execute(
        "select id, user_id, campaign, status, provider_message_id from mail.send_log").fetchall()}
    by_row: Counter[int] = Counter()
    per_user_campaign: Counter[tuple[Any, ...]] = Counter()
    mismatch = without_sent = 0
    for d in delivered:
        headers = {str(k).lower(): v for k, v in (d.get("headers") or {}).items()}
        sid = int(headers.get("x-mailflow-send-id", -1))
        by_row[sid] += 1
        row = rows.get(sid)
        per_user_campaign[(row[1], row[2]) if row else ("unknown row", sid)] += 1
        if row is None or row[3] != "sent":
            without_sent += 1
        elif row[4] != d.get("id"):
            mismatch += 1
    sent_rows = [r for r in rows.values() if r[3] == "sent"]
    return {
        "delivered": len(delivered),
        "sent_rows": len(sent_rows),
        "duplicate_deliveries": sum(n - 1 for n in per_user_campaign.values() if n > 1),
        "sent_without_delivery": sum(1 for r in sent_rows if by_row[r[0]] == 0),
        "delivered_without_sent": without_sent,
        "provider_id_mismatch": mismatch,
    }


def dead_letters(conn: psycopg.Connection, ids: list[int] | None = None,
                 campaign: str | None = None) -> list[tuple[Any, ...]]:
    """Undecided dead letters ``(id, kind, campaign, user_id, idempotency_key, dead_lettered_at,
    error)``, oldest first; ``ids`` / ``campaign`` narrow them (None: all)."""
    from mailflow.store.sql import query

    return conn.execute(query("breaker", "dead_letters"), {"ids": ids, "campaign": campaign}).fetchall()


def decide_dead_letters(conn: psycopg.Connection, decision: str, ids: list[int], who: str, why: str) -> list[int]:
    """Record a person's decision on undecided dead letters, in one transaction (docs/operations.md,
    "Dead letters"). ``decision`` is ``resend`` (re-open under a new key, accepting that the provider
    may already have delivered the old one: lifecycle rows released so the next run decides again,
    scheduled rows back to ``pending``) or ``close`` (failed for good). Nothing is deleted: the
    decision, ``who`` and ``why`` are stored on the row and appended as an event.

    :returns: the ids changed (rows already decided, or not dead letters, are left as they are).
    :raises ValueError: for another decision or an empty ``who`` / ``why``.
    """
    from mailflow.store.sql import query

    if decision not in ("resend", "close"):
        raise ValueError(f"decision must be 'resend' or 'close', got {decision!r}")
    if not who.strip() or not why.strip():
        raise ValueError("a decision on a dead letter names who took it (--by) and why (--reason)")
    with conn.transaction():
        rows = conn.execute(query("breaker", f"dead_letter_{decision}"),
                            {"ids": ids, "who": who.strip(), "why": why.strip()}).fetchall()
    return sorted(int(r[0]) for r in rows)


class _IdList(click.ParamType):
    """``--ids``: comma-separated positive send-log ids."""

    name = "ID,ID,..."

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        """:raises click.BadParameter: (exit 2) naming the first entry that is not a positive integer."""
        if isinstance(value, list):
            return value
        ids = []
        for part in (x.strip() for x in str(value).split(",")):
            if not part:
                continue
            if not part.isascii() or not part.isdigit() or int(part) == 0:
                self.fail(f"{part!r} is not a send-log id (a positive integer)", param, ctx)
            ids.append(int(part))
        if not ids:
            self.fail("no send-log id given", param, ctx)
        return ids


def _db_command(body: Callable[..., int]) -> Callable[..., int]:
    """Wrap ``body(conn, **params) -> exit code``: connect to the send log (autocommit) and run it.
    An unreachable database, or a schema without the tables the command reads, prints
    ``error: ...`` to stderr and returns 2."""

    @wraps(body)
    def command(**params: Any) -> int:
        dsn = dsn_of(click.get_current_context())
        try:
            conn = psycopg.connect(dsn, autocommit=True)
        except psycopg.Error as exc:
            print(f"error: cannot connect to the send-log database: {exc}".strip(), file=sys.stderr)
            return 2
        try:
            with conn:
                return body(conn, **params)
        except psycopg.errors.UndefinedTable as exc:
            print(f"error: {str(exc).splitlines()[0]}: run `mailflow migrate` first", file=sys.stderr)
            return 2

    return command


class _Mailflow(click.Group):
    """The ``mailflow`` group; ``emulator`` is resolved when asked for (:func:`_emulator_command`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), "emulator"])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name == "emulator":
            return _emulator_command()
        return super().get_command(ctx, cmd_name)


def _emulator_command() -> click.Command:
    """The emulator's own command (:mod:`mailflow.emulator.cli`), imported here and only here: the
    product launches the test double for a person, it shares no code with it (the import contract's
    one exception, pyproject.toml)."""
    from mailflow.emulator.cli import emulator

    return emulator


@click.group("mailflow", cls=_Mailflow, help=(__doc__ or "").replace("``", "`").replace("::", ":"),
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
@dsn_option
def cli() -> None:
    """The ``mailflow`` group (help: the module's docstring)."""


@cli.command("migrate")
@click.option("--check", is_flag=True, help="apply nothing; exit 1 if migrations are pending")
@click.option("--backfill", is_flag=True,
              help="after applying what is pending, run the backfill steps of the applied migrations again "
                   "(idempotent: keys what workers of the previous release wrote during a rolling deploy)")
@click.option("--lock-timeout", type=float, default=1.0, show_default=True,
              help="seconds a transactional migration waits for a table lock before retrying")
@dsn_option
@_db_command
def migrate_command(conn: psycopg.Connection, check: bool, backfill: bool, lock_timeout: float) -> int:
    """Apply pending migrations under the migration lock (docs/operations.md, 'Upgrading')."""
    import logging

    from mailflow.store.migrate import SchemaNotCurrent, migrate, require_current, rerun_backfills

    if check:
        try:
            require_current(conn)
        except SchemaNotCurrent as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print("schema up to date")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    applied = migrate(conn, lock_timeout_seconds=lock_timeout)
    print("applied: " + ", ".join(applied) if applied else "schema up to date")
    if backfill:
        print("backfill steps run again: " + (", ".join(rerun_backfills(conn)) or "none"))
    return 0


@cli.command("report")
@dsn_option
@_db_command
def report_command(conn: psycopg.Connection) -> int:
    """Per-campaign counts by state."""
    print_table(REPORT_HEAD, report(conn))
    return 0


@cli.command("outcomes")
@dsn_option
@_db_command
def outcomes_command(conn: psycopg.Connection) -> int:
    """Per-campaign outcomes the provider reported: delivered, bounces, complaints, opens, clicks and
    their rates (mail.campaign_outcomes; docs/send_log.md)."""
    print_table(OUTCOMES_HEAD, [outcome_cells(r) for r in outcomes(conn)])
    return 0


@cli.command("audit")
@click.option("--outbox", type=click.Path(path_type=Path), required=True, help="the emulator's outbox (JSON lines)")
@dsn_option
@_db_command
def audit_command(conn: psycopg.Connection, outbox: Path) -> int:
    """Compare the send log with an outbox file; exit 1 on any violation."""
    if not outbox.is_file():
        print(f"error: outbox file {outbox} not found", file=sys.stderr)
        return 2
    result = audit(conn, outbox)
    print(json.dumps(result, indent=2))
    bad = {k: v for k, v in result.items() if k not in ("delivered", "sent_rows") and v}
    return 1 if bad else 0


@cli.command("keys")
@dsn_option
@_db_command
def keys_command(conn: psycopg.Connection) -> int:
    """Batches with rows still sending, per API key identity: which keys a resend still needs
    (docs/operations.md, 'Rotating the API key')."""
    rows = keys(conn)
    print_table(("key_identity", "role", "batches", "sending", "oldest_batch", "needed_until"),
                [(i, r, b, n, o.isoformat(timespec="seconds") if o else "-",
                  u.isoformat(timespec="seconds") if u else "-") for i, r, b, n, o, u in rows])
    waiting = [r for r in rows if r[1] in ("previous", "NOT CONFIGURED") and r[2]]
    print(f"{sum(r[2] for r in waiting)} batch(es) still need a key other than the current one"
          + ("" if any(r[1] in ("current", "previous") for r in rows) else
             " (the reconciler has not recorded the configured keys yet)"))
    return 0


@cli.command("reopen-refused")
@click.option("--campaign", required=True, help="the campaign whose rows the provider refused")
@click.option("--field", default=None, callback=lambda _c, _p, v: v.lower() if v else v,
              help="only rows whose error names this campaign field (any case)")
@click.option("--apply", is_flag=True, help="change the rows (default: count only)")
@dsn_option
@_db_command
def reopen_refused_command(conn: psycopg.Connection, campaign: str, field: str | None, apply: bool) -> int:
    """Re-open rows the provider rejected for a field of the campaign (e.g. `from`), not of the
    recipient (docs/operations.md); counts only without --apply."""
    from mailflow.store.send_log import reopen_refused

    if (unknown := unknown_campaign(conn, campaign)) is not None:
        print(f"error: {unknown}", file=sys.stderr)
        return 2
    try:
        done = reopen_refused(conn, campaign, field, apply=apply)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(dataclasses.asdict(done) | {"applied": apply}, indent=2))
    return 0

def unknown_campaign(conn: psycopg.Connection, campaign: str | None) -> str | None:
    """None when ``campaign`` is None or has a row in the send log; otherwise the message saying no
    such campaign exists there, with the closest names (:func:`difflib.get_close_matches`)."""
    if campaign is None:
        return None
    names = [r[0] for r in conn.execute("select distinct campaign from mail.send_log").fetchall()]
    if campaign in names:
        return None
    close = difflib.get_close_matches(campaign, names, n=3)
    return (f"no campaign {campaign!r} in the send log"
            + (f"; did you mean {', '.join(map(repr, close))}?" if close else ""))


def undecidable(conn: psycopg.Connection, ids: list[int], campaign: str | None) -> dict[int, str]:
    """Of ``ids``, the ones a decision cannot apply to, each with why: not in the send log, outside
    ``campaign``, never dead-lettered, or already decided (when, by whom, which decision; times are
    the database's, shown in UTC). Ids absent from the result are undecided dead letters."""
    rows = conn.execute(
        """
        select id, campaign, dead_lettered_at, status, dead_letter_decision,
               dead_letter_decided_at, dead_letter_decided_by
        from mail.send_log where id = any(%(ids)s::bigint[])
        """, {"ids": ids}).fetchall()
    found = {int(r[0]): r for r in rows}
    why: dict[int, str] = {}
    for i in ids:
        r = found.get(i)
        if r is None:
            why[i] = "no such row in the send log"
        elif campaign is not None and r[1] != campaign:
            why[i] = f"belongs to campaign {r[1]!r}, not {campaign!r}"
        elif r[5] is not None and (r[2] is None or r[5] >= r[2]):
            why[i] = f"already decided ({r[4]}) at {r[5].astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC by {r[6]}"
        elif r[2] is None or r[3] != "failed":
            why[i] = f"not a dead letter (status {r[3]})"
    return why


@cli.command("dead-letters")
@click.argument("action", type=click.Choice(["list", "resend", "close"]))
@click.option("--ids", type=_IdList(), help="comma-separated send-log ids (each must be an undecided dead letter, "
              "of --campaign if given: exit 1 naming any that is not)")
@click.option("--all", "all_", is_flag=True, help="every undecided dead letter (of --campaign, if given)")
@click.option("--campaign", help="only this campaign")
@click.option("--by", default="", help="who decides (recorded on the rows and events)")
@click.option("--reason", default="", help="why (recorded on the rows and events)")
@click.option("--accept-duplicate-risk", is_flag=True,
              help="resend: the provider may have delivered the old key; a user may get the email twice")
@dsn_option
def dead_letters_command(action: str, ids: list[int] | None, all_: bool, campaign: str | None, by: str,
                         reason: str, accept_duplicate_risk: bool) -> int:
    """List dead letters, or record a person's decision on them (docs/operations.md, 'Dead letters')."""
    if ids is not None and all_:
        raise click.UsageError("--ids and --all exclude each other: name the rows or take them all")
    return _dead_letters(action=action, ids=ids, all_=all_, campaign=campaign, by=by, reason=reason,
                         accept_duplicate_risk=accept_duplicate_risk)


@_db_command
def _dead_letters(conn: psycopg.Connection, action: str, ids: list[int] | None, all_: bool, campaign: str | None,
                  by: str, reason: str, accept_duplicate_risk: bool) -> int:
    if (unknown := unknown_campaign(conn, campaign)) is not None:
        print(f"error: {unknown}", file=sys.stderr)
        return 2
    if action == "list":
        rows = dead_letters(conn, ids, campaign)
        print_table(("id", "kind", "campaign", "user_id", "key", "dead_lettered_at", "error"),
                    [(*r[:6], (r[6] or "")[:80]) for r in rows])
        print(f"{len(rows)} undecided dead letter(s)")
        return 0
    if ids is None and not all_:
        print("error: name the rows (--ids) or pass --all", file=sys.stderr)
        return 2
    if action == "resend" and not accept_duplicate_risk:
        print("error: a resend under a new key may deliver an email the provider already accepted under the old "
              "one; pass --accept-duplicate-risk to take that decision", file=sys.stderr)
        return 2
    if not by.strip() or not reason.strip():  # checked before any row is looked at
        print("error: a decision on a dead letter names who took it (--by) and why (--reason)", file=sys.stderr)
        return 2
    refused = undecidable(conn, ids, campaign) if ids is not None else {}
    targets = [int(r[0]) for r in dead_letters(conn, ids, campaign) if int(r[0]) not in refused]
    try:
        changed = decide_dead_letters(conn, action, targets, by, reason) if targets else []
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for i in sorted(set(targets) - set(changed)):  # decided by someone else between the read and the write
        refused[i] = "decided by someone else meanwhile"
    print(f"{action}: {len(changed)} dead letter(s) decided" + (f" ({', '.join(map(str, changed))})"
                                                              if changed else ""))
    if refused:
        print(f"error: {len(refused)} id(s) left unchanged:", file=sys.stderr)
        for i, why in sorted(refused.items()):
            print(f"  {i}: {why}", file=sys.stderr)
        return 1
    return 0


@cli.command("breaker")
@click.option("--close", metavar="ACCOUNT", help="close this account's breaker by hand (the provider is back)")
@click.option("--by", default="", help="who closes it")
@dsn_option
def breaker_command(close: str | None, by: str) -> int:
    """The providers' circuit breakers (docs/operations.md, 'Circuit breaker')."""
    if by and not close:
        raise click.UsageError("breaker: --by names who closes a breaker; it needs --close ACCOUNT")
    return _breaker(close=close, by=by)


@_db_command
def _breaker(conn: psycopg.Connection, close: str | None, by: str) -> int:
    if close:
        if not by.strip():
            print("error: --by names who closes the breaker", file=sys.stderr)
            return 2
        known = [r[0] for r in conn.execute("select account from mail.circuit_breaker order by account")]
        if close not in known:
            print(f"error: no breaker for account {close!r}; known accounts: "
                  + (", ".join(known) or "none (no breaker has opened yet)"), file=sys.stderr)
            return 1
        with conn.transaction():
            row = conn.execute(query("breaker", "close"), {"account": close,
                                                          "holder": f"by hand: {by.strip()}"}).fetchone()
        print(f"closed the breaker of {close}" if row else f"the breaker of {close} was not open")
        return 0
    print_table(("account", "state", "opened_at", "reason", "failures", "opened_total", "probe_holder",
                 "probe_until", "closed_at", "closed_by"), conn.execute(query("breaker", "breakers")).fetchall())
    return 0


def _setting(kind: type) -> Callable[[str | None], float | int | None | str]:
    """A ``mailflow reputation set`` value: a number, ``default`` (back to the default) or absent."""
    def parse(raw: str | None) -> float | int | None | str:
        if raw is None:
            return None
        if raw.strip().lower() == "default":
            return "default"
        try:
            return kind(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r} is not a number (or 'default')") from None
    return parse


@cli.command("reputation")
@click.argument("action", type=click.Choice(["status", "resume", "set"]))
@click.option("--campaign", help="resume this campaign")
@click.option("--account", help="resume the provider account (every campaign), or the account whose settings to set")
@click.option("--reason", default="", help="why it is safe to send again (required to resume)")
@click.option("--by", default=lambda: os.environ.get("USER", ""), show_default="$USER", help="who resumes or sets")
@click.option("--hard-bounce-rate", callback=lambda _c, _p, v: _setting(float)(v),
              help="set: the hard-bounce line (fraction, e.g. 0.02), or 'default'")
@click.option("--complaint-rate", callback=lambda _c, _p, v: _setting(float)(v),
              help="set: the complaint line (fraction, e.g. 0.0004), or 'default'")
@click.option("--exposure", callback=lambda _c, _p, v: _setting(int)(v),
              help="set: E, emails a scope may send per round before its rates are known, or 'default'")
@click.option("--complaint-lag-hours", callback=lambda _c, _p, v: _setting(float)(v),
              help="set: over how many hours after delivery complaints arrive, or 'default'")
@dsn_option
def reputation_command(action: str, campaign: str | None, account: str | None, reason: str, by: str,
                       **settings: Any) -> int:
    """The reputation guard: status, resume a tripped campaign or account (a person's decision), or set
    an account's lines, E and complaint lag (docs/operations.md, 'Reputation guard')."""
    if campaign and account and action == "resume":
        raise click.UsageError("--campaign and --account exclude each other: resume one scope at a time")
    return _reputation(action=action, campaign=campaign, account=account, reason=reason, by=by, settings=settings)


@_db_command
def _reputation(conn: psycopg.Connection, action: str, campaign: str | None, account: str | None, reason: str,
                by: str, settings: dict[str, Any]) -> int:
    from mailflow.sources.scheduled.control import resume_reputation
    from mailflow.store import reputation

    if action == "status":
        rows = reputation.status(conn)
        keys = ("scope", "name", "state", "hard_bounce_rate", "complaint_rate", "sample", "proven", "round_sent",
                "waiting", "awaiting", "evaluated_at", "tripped_at", "resumed_at", "resumed_by")
        print_table(keys, [tuple("-" if r[k] is None else r[k] for k in keys) for r in rows])
        for r in rows:
            if r["state"] == "tripped":
                print(f"{r['scope']} {r['name']} tripped: {r['reason']}")
        for acct in sorted({r["name"] for r in rows if r["scope"] == "account"}):
            c = reputation.config_for(conn, acct)
            print(f"account {acct}: lines {c.hard_bounce_rate:g} hard bounces, {c.complaint_rate:g} complaints; "
                  f"E {c.exposure}; complaint lag {c.complaint_lag}")
        return 0
    if action == "set":
        if not account:
            print("error: set names the provider account: --account NAME", file=sys.stderr)
            return 2
        if not by.strip():
            print("error: a setting is a person's decision: give --by (or set $USER)", file=sys.stderr)
            return 2
        current = conn.execute(query("reputation", "setting"), {"account": account}).fetchone()
        names = ("hard_bounce_rate", "complaint_rate", "exposure", "complaint_lag_hours")
        values = dict(zip(names, current or (None,) * 4, strict=True))
        for k in names:
            v = settings.get(k)
            if v is not None:
                values[k] = None if v == "default" else v
        try:
            with conn.transaction():
                reputation.set_config(conn, account, by, **values)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        c = reputation.config_for(conn, account)
        print(f"account {account}: lines {c.hard_bounce_rate:g} hard bounces, {c.complaint_rate:g} complaints; "
              f"E {c.exposure}; complaint lag {c.complaint_lag} (set by {by.strip()})")
        return 0
    if not (campaign or account):
        print("error: resume names what: --campaign NAME or --account NAME", file=sys.stderr)
        return 2
    if not by.strip() or not reason.strip():
        print("error: resuming is a person's decision: give --reason (and --by if $USER is not set)", file=sys.stderr)
        return 2
    scope, name = ("campaign", campaign) if campaign else ("account", str(account))
    try:
        done = resume_reputation(conn, scope, name, actor=by, reason=reason)
    except (LookupError, ValueError) as exc:
        print(f"error: {str(exc).strip(chr(39) + chr(34))}", file=sys.stderr)
        return 1
    if not done["changed"]:
        print(f"{scope} {name} is not tripped: nothing to resume")
        return 0
    print(f"resumed {scope} {name} at {done['resumed_at']} by {by.strip()}; scheduled campaigns set back to "
          f"scheduled: {', '.join(done['unpaused']) or 'none'}; held scheduled campaigns re-planned from now: "
          f"{', '.join(done['released']) or 'none'}")
    return 0


cli.add_command(campaign)


@cli.group("unsubscribe")
def unsubscribe_group() -> None:
    """The one-click unsubscribe endpoint, standalone (docs/unsubscribe.md)."""


unsubscribe_group.add_command(unsubscribe_serve)


@cli.group("webhooks")
def webhooks_group() -> None:
    """The provider's webhook receiver, standalone (docs/feedback.md)."""


webhooks_group.add_command(webhooks_serve)

def print_table(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """Print an aligned text table."""
    cells = [tuple(str(c) for c in head)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mailflow`` command (``[project.scripts]``): runs ``argv`` (default
    ``sys.argv[1:]``) and returns the exit code: 0 done, 1 a check found something (audit
    violations, pending migrations, ids left unchanged), 2 bad input or no database. ``--help``
    and usage errors raise ``SystemExit`` (0 / 2) with the text printed."""
    return run(cli, argv, "mailflow")


if __name__ == "__main__":
    sys.exit(main())
