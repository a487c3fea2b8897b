"""``mailflow campaign COMMAND``: the scheduled-campaign commands (click); each prints JSON.

``create SPEC|--name ...``, ``update SPEC`` (a draft),
``provision NAME [--dry-run] [--chunk N] [--approve-as NAME --reason TEXT]``,
``pause|resume|cancel|status NAME``, ``complete [NAME]``. NAME is a campaign's name or its id;
``all`` is no campaign's name (it is reserved: it means every campaign, and only ``complete``
takes it). The send-log database comes from ``--dsn`` (on ``mailflow``, on ``campaign`` or on the
command) or ``MAILFLOW_DSN``; the actor recorded on the campaign's events from ``--actor`` or
``$USER``. Errors print ``error: <kind>: <message>`` to stderr and exit 2.

``python -m mailflow.sources.scheduled`` (:func:`main`) runs the same group, as a deprecated alias.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from functools import wraps
from pathlib import Path
from typing import Any

import click
import psycopg

from mailflow.campaigns import CampaignFolder
from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.approval import ApprovalRefused, approve_now, record_refusal, usable_approval
from mailflow.sources.scheduled.campaign_db import CampaignStateError, json_default
from mailflow.sources.scheduled.control import cancel, complete, pause, resume, status
from mailflow.sources.scheduled.provisioning import current_fingerprint, provision
from mailflow.sources.scheduled.spec import create_campaign, load_spec, resolve_campaign, update_draft
from mailflow.store import test_emails
from mailflow.store.scheduled import ScheduledStore

#: ``ctx.meta`` keys (click shares ``meta`` with every nested context): the innermost ``--dsn`` /
#: ``--actor`` given wins, so ``mailflow --dsn X campaign status N`` and ``... status N --dsn X`` agree
DSN_KEY = "mailflow.dsn"
ACTOR_KEY = "mailflow.actor"
#: the word that means every campaign; no campaign may take it as its name
ALL = "all"
DEPRECATED_PROG = "python -m mailflow.sources.scheduled"


def _remember(key: str) -> Callable[[click.Context, click.Parameter, str | None], None]:
    def callback(ctx: click.Context, _param: click.Parameter, value: str | None) -> None:
        if value:
            ctx.meta[key] = value
    return callback


def dsn_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--dsn DSN`` on a group or command: remembered for the commands below it (:func:`dsn_of`)."""
    return click.option("--dsn", metavar="DSN", expose_value=False, callback=_remember(DSN_KEY),
                        help="send-log database (or MAILFLOW_DSN)")(f)


def actor_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--actor NAME``: who is recorded on the campaign's events (default ``$USER``)."""
    return click.option("--actor", metavar="NAME", expose_value=False, callback=_remember(ACTOR_KEY),
                        help="recorded on campaign events (default: $USER)")(f)


def dsn_of(ctx: click.Context) -> str:
    """The DSN: the innermost ``--dsn`` given, else ``MAILFLOW_DSN``.

    :raises click.UsageError: (exit 2) when there is neither.
    """
    dsn = ctx.meta.get(DSN_KEY) or os.environ.get("MAILFLOW_DSN")
    if not dsn:
        raise click.UsageError("--dsn or MAILFLOW_DSN is required", ctx)
    return str(dsn)


def _campaign_id(conn: psycopg.Connection, ref: str) -> int:
    """The id of the campaign named (or numbered) ``ref``.

    :raises LookupError: for ``all`` (not a name) or a name no campaign has.
    """
    if ref.strip().lower() == ALL:
        raise LookupError(f"{ref!r} is not a campaign name (it means every campaign); name one campaign or its id")
    return resolve_campaign(conn, ref)


def _json_command(run: Callable[..., Any]) -> Callable[..., int]:
    """Wrap a command body ``run(conn, actor, **params) -> JSON-able`` : connect, check the schema
    (:func:`mailflow.store.migrate.require_current`; this command never migrates), print the result
    as JSON and return 0; an input, state or database error prints ``error: <kind>: <message>`` (and
    for an unreachable database a hint) to stderr and returns 2, nothing partial written."""

    @wraps(run)
    def command(**params: Any) -> int:
        from mailflow.store.migrate import SchemaNotCurrent, require_current

        ctx = click.get_current_context()
        dsn = dsn_of(ctx)
        actor = ctx.meta.get(ACTOR_KEY) or os.environ.get("USER")
        try:
            with psycopg.connect(dsn) as conn:
                require_current(conn)  # the schema comes from `mailflow migrate`, never from this command
                out = run(conn, actor, **params)
        except (FileNotFoundError, ValueError, LookupError, CampaignStateError, SchemaNotCurrent,
                psycopg.Error) as exc:
            print(f"error: {type(exc).__name__}: {str(exc).strip()}", file=sys.stderr)
            if isinstance(exc, psycopg.OperationalError):
                print("hint: is the database running? The demo's embedded server stops when `make demo` ends; "
                      "start it with `make psql` (it prints the DSN and keeps running after \\q), `make airflow`, "
                      "or `make demo DEMO_ARGS=--keep-db`; `make stop` stops it", file=sys.stderr)
            return 2
        print(json.dumps(out, indent=2, default=json_default))
        return 0

    return command


@click.group("campaign", context_settings={"help_option_names": ["-h", "--help"]})
@dsn_option
@actor_option
def campaign() -> None:
    """Scheduled campaigns: create, update a draft, provision, pause, resume, cancel, status, complete
    (prints JSON; NAME is a campaign's name or id; docs/operations.md, "Scheduled campaigns")."""


def _weekdays(_ctx: click.Context, _param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(d) for d in value.split(",") if d.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of ISO weekdays (1 = Monday)") from None


@campaign.command("create")
@click.argument("spec", required=False, type=click.Path(path_type=Path))
@click.option("--name", help="the campaign's name ([a-z0-9_], the send log's campaign)")
@click.option("--template", help="template in campaigns/templates (NAME.html.j2 + NAME.txt.j2)")
@click.option("--subject", help="subject line (Jinja over user)")
@click.option("--from", "from_", metavar="ADDRESS", help="sender: a@example.com or 'Name <a@example.com>'")
@click.option("--reply-to", metavar="ADDRESS")
@click.option("--timezone", help="IANA timezone of the windows and weekdays (default Europe/Berlin)")
@click.option("--emails-per-day", type=int)
@click.option("--weekdays", callback=_weekdays, metavar="1,2,3,4,5", help="ISO weekdays that send")
@click.option("--window", "windows", multiple=True, metavar="HH:MM-HH:MM", help="a local send window (repeatable)")
@click.option("--start-at", metavar="ISO", help="first possible send, ISO 8601 with an offset (default: now)")
@click.option("--marketing/--transactional", default=None, help="marketing mail (default) or transactional")
@click.option("--on-policy", type=click.Choice(["defer", "skip", "ignore"]))
@click.option("--holidays", metavar="CODE", help="skip the public holidays of this country or region (DE, DE-BY)")
@click.option("--holdout-share", type=float, help="share of recipients held out as a control group (0.1)")
@click.option("--canary-share", type=float)
@click.option("--canary-min-outcome-share", type=float)
@click.option("--canary-max-wait-minutes", type=float)
@click.option("--recipients-sql", metavar="FILE", help="recipients query file in campaigns/recipients")
@click.option("--recipients-table", metavar="SCHEMA.TABLE")
@click.option("--recipients-csv", metavar="FILE", type=click.Path(path_type=Path))
@dsn_option
@actor_option
@_json_command
def create_command(conn: psycopg.Connection, actor: str | None, spec: Path | None, **fields: Any) -> Any:
    """Create a draft campaign from SPEC (a .toml or .json file, keys in docs/operations.md) and/or
    the options (an option overrides the file's key); prints its status."""
    data: dict[str, Any] = load_spec(spec) if spec is not None else {}
    given = {("from" if k == "from_" else k): v for k, v in fields.items() if v is not None and v != ()}
    if "windows" in given:
        given["windows"] = list(given["windows"])
    if "recipients_csv" in given:
        given["recipients_csv"] = str(given["recipients_csv"])
    if spec is None and not given.get("name"):
        raise ValueError("create needs a SPEC file or --name (with --template, --subject, --from and a recipients "
                         "option)")
    data.update(given)
    cid = create_campaign(conn, data, actor=actor, base_dir=spec.parent if spec is not None else None)
    return status(conn, cid)


@campaign.command("update")
@click.argument("spec", type=click.Path(path_type=Path))
@click.option("--name", help="the draft to update (default: the spec's name; a draft keeps its name)")
@dsn_option
@actor_option
@_json_command
def update_command(conn: psycopg.Connection, actor: str | None, spec: Path, name: str | None) -> Any:
    """Replace a draft campaign's whole definition with SPEC; a campaign that left ``draft`` is
    refused (pause or cancel it instead). Prints its status."""
    data = load_spec(spec)
    name = name or str(data.get("name") or "")
    if not name:
        raise ValueError(f"{spec}: no name: give the spec a name or pass --name")
    cid = _campaign_id(conn, name)
    update_draft(conn, name, data, actor=actor, base_dir=spec.parent)
    return status(conn, cid)


@campaign.command("provision")
@click.argument("name")
@click.option("--dry-run", is_flag=True, help="plan only: first/last send, per day, days spanned, the fingerprint; "
                                              "writes nothing")
@click.option("--chunk", type=click.IntRange(min=1), default=5000, show_default=True, help="rows per transaction")
@click.option("--approve-as", metavar="NAME", help="record your approval of the campaign as it is now (who "
                                                   "approves; needs --reason), then provision it")
@click.option("--reason", metavar="TEXT", help="why you approve (recorded with --approve-as)")
@dsn_option
@actor_option
@_json_command
def provision_command(conn: psycopg.Connection, actor: str | None, name: str, dry_run: bool, chunk: int,
                      approve_as: str | None, reason: str | None) -> Any:
    """Create the campaign's planned rows (one pending row per recipient) under an approval of what
    it sends now, or plan them (--dry-run). Without --approve-as it provisions only if the
    campaign's latest approval (Airflow's provision_campaign, or an earlier --approve-as) approved
    its current fingerprint; otherwise it refuses and changes nothing. --approve-as NAME --reason TEXT
    records NAME's approval of the current fingerprint (a campaign event) and provisions. The output
    carries the campaign's test emails and their outcomes (``test_emails``)."""
    if (approve_as is None) != (reason is None):
        raise ValueError("--approve-as NAME and --reason TEXT go together: who approves, and why")
    if dry_run and approve_as is not None:
        raise ValueError("--dry-run writes nothing: it cannot record an approval (drop --approve-as)")
    cid = _campaign_id(conn, name)
    folder = CampaignFolder.resolve()
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(cid)
        if c is None:
            raise LookupError(f"no campaign with id {cid} in mail.campaign")
        fp = current_fingerprint(conn, c, folder)
    if dry_run:
        out = provision(conn, cid, now=datetime.now(UTC), chunk=chunk, dry_run=True, folder=folder).as_dict()
        return {**out, "fingerprint": fp.value, "recipient_count": fp.recipient_count,
                "test_emails": test_emails.of_campaign(conn, cid)}
    try:
        if approve_as is not None:
            approval_id = approve_now(conn, cid, fp, approved_by=approve_as, reason=str(reason), actor=actor)
        else:
            with conn.transaction():
                approval_id = usable_approval(conn, c)
    except ApprovalRefused as exc:
        record_refusal(conn, cid, exc, actor)
        raise
    out = provision(conn, cid, now=datetime.now(UTC), chunk=chunk, run=RunContext(task_id="cli"), folder=folder,
                    approval_id=approval_id, actor=actor).as_dict()
    return {**out, "test_emails": test_emails.of_campaign(conn, cid)}


def _control(verb: str, action: Callable[..., Any], doc: str) -> None:
    @campaign.command(verb, help=doc)
    @click.argument("name")
    @dsn_option
    @actor_option
    @_json_command
    def command(conn: psycopg.Connection, actor: str | None, name: str) -> Any:
        return action(conn, _campaign_id(conn, name), actor=actor)


_control("pause", pause, "Pause a campaign: due rows wait, every planned time is kept.")
_control("resume", resume, "Resume a paused campaign (overdue rows are re-planned from now, in order).")
_control("cancel", cancel, "Cancel a campaign: its pending rows become cancelled (rows in flight finish).")


@campaign.command("status")
@click.argument("name")
@dsn_option
@actor_option
@_json_command
def status_command(conn: psycopg.Connection, actor: str | None, name: str) -> Any:
    """A campaign's settings, rows by state, next due time and send lateness."""
    return status(conn, _campaign_id(conn, name))


@campaign.command("complete")
@click.argument("name", required=False)
@dsn_option
@actor_option
@_json_command
def complete_command(conn: psycopg.Connection, actor: str | None, name: str | None) -> Any:
    """Mark finished campaigns completed (fully provisioned, nothing pending or sending): NAME only,
    or every one (no NAME, or ``all``). Prints the names completed."""
    cid = None if name is None or name.strip().lower() == ALL else resolve_campaign(conn, name)
    return {"completed": complete(conn, cid, actor=actor)}


def run(command: click.Command, argv: list[str] | None, prog_name: str) -> int:
    """Run a click command as a program that returns its exit code (for ``main`` functions tests call).

    The command's return value (an int) is the exit code. ``--help`` and usage errors end as
    argparse did: ``SystemExit`` with 0 (help printed) or 2 (the usage error printed to stderr).
    """
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with command.make_context(prog_name, args) as ctx:
            rv = command.invoke(ctx)
    except click.exceptions.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    except click.ClickException as exc:
        exc.show()
        raise SystemExit(exc.exit_code) from None
    except click.Abort:
        print("Aborted!", file=sys.stderr)
        raise SystemExit(1) from None
    return rv if isinstance(rv, int) else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow.sources.scheduled [--dsn DSN] [--actor NAME] COMMAND``: the ``campaign``
    group under its deprecated name (the module's ``__main__`` prints the deprecation notice)."""
    return run(campaign, argv, DEPRECATED_PROG)
