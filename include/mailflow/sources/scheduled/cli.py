"""``python -m mailflow.sources.scheduled [--dsn DSN] COMMAND``: create, provision, cancel, pause,
resume, status, complete; prints JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from mailflow.model.outcome import RunContext
from mailflow.sources.scheduled.campaign_db import CampaignStateError, json_default
from mailflow.sources.scheduled.control import cancel, complete, pause, resume, status
from mailflow.sources.scheduled.provisioning import provision
from mailflow.sources.scheduled.spec import create_campaign, load_spec, resolve_campaign


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
    print(json.dumps(out, indent=2, default=json_default))
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
