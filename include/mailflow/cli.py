"""``mailflow`` command line: migrate, report, audit (send log vs. the emulator outbox).

Usage (``--dsn`` before or after the command, or ``MAILFLOW_DSN``)::

    mailflow migrate --dsn postgresql://...    # apply pending migrations (the deploy's migrate step)
    mailflow migrate --check --dsn ...         # exit 1 and name them if any are pending
    mailflow report  --dsn ...                 # per-campaign counts by state
    mailflow audit   --dsn ... --outbox PATH   # invariants: sent rows <-> delivered emails
    mailflow reopen-refused --campaign NAME [--field from] [--apply]   # un-charge a campaign's mistake
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg


def report(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    """Rows ``(campaign, total, sent, failed, sending, pending, cancelled, rolled_back)`` by campaign."""
    return conn.execute(
        """
        select campaign, count(*) filter (where released_at is null),
               count(*) filter (where status = 'sent'),
               count(*) filter (where status = 'failed' and released_at is null),
               count(*) filter (where status = 'sending'),
               count(*) filter (where status = 'pending'),
               count(*) filter (where status = 'cancelled'),
               count(*) filter (where released_at is not null)
        from mail.send_log group by campaign order by campaign
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``mailflow`` command."""
    p = argparse.ArgumentParser(prog="mailflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dsn", default=os.environ.get("MAILFLOW_DSN"), help="send-log database (or MAILFLOW_DSN)")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", default=argparse.SUPPRESS, help="send-log database (or MAILFLOW_DSN)")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("migrate", help="apply pending migrations under the migration lock (docs/operations.md, "
                       "'Upgrading')", parents=[common])
    m.add_argument("--check", action="store_true", help="apply nothing; exit 1 if migrations are pending")
    m.add_argument("--lock-timeout", type=float, default=1.0,
                   help="seconds a transactional migration waits for a table lock before retrying (default 1)")
    sub.add_parser("report", help="per-campaign counts by state", parents=[common])
    a = sub.add_parser("audit", help="compare the send log with an outbox file; exit 1 on any violation",
                       parents=[common])
    a.add_argument("--outbox", type=Path, required=True)
    r = sub.add_parser("reopen-refused", parents=[common],
                       help="re-open rows the provider rejected for a field of the campaign (e.g. `from`), "
                            "not of the recipient (docs/operations.md); counts only without --apply")
    r.add_argument("--campaign", required=True)
    r.add_argument("--field", default=None, help="only rows whose error names this campaign field")
    r.add_argument("--apply", action="store_true", help="change the rows (default: count only)")
    args = p.parse_args(argv)
    if not args.dsn:
        p.error("--dsn or MAILFLOW_DSN is required")
    try:
        conn = psycopg.connect(args.dsn, autocommit=True)
    except psycopg.Error as exc:
        print(f"error: cannot connect to the send-log database: {exc}".strip(), file=sys.stderr)
        return 2
    try:
        with conn:
            return _run(args, conn)
    except psycopg.errors.UndefinedTable as exc:
        print(f"error: {str(exc).splitlines()[0]}: run `mailflow migrate` first", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, conn: psycopg.Connection) -> int:
    if args.cmd == "migrate":
        import logging

        from mailflow.store.migrate import SchemaNotCurrent, migrate, require_current

        if args.check:
            try:
                require_current(conn)
            except SchemaNotCurrent as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            print("schema up to date")
            return 0
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
        applied = migrate(conn, lock_timeout_seconds=args.lock_timeout)
        print("applied: " + ", ".join(applied) if applied else "schema up to date")
    elif args.cmd == "reopen-refused":
        from mailflow.store.send_log import reopen_refused

        try:
            done = reopen_refused(conn, args.campaign, args.field, apply=args.apply)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(dataclasses.asdict(done) | {"applied": args.apply}, indent=2))
    elif args.cmd == "report":
        head = ("campaign", "total", "sent", "failed", "sending", "pending", "cancelled", "rolled_back")
        print_table(head, report(conn))
    else:
        if not args.outbox.is_file():
            print(f"error: outbox file {args.outbox} not found", file=sys.stderr)
            return 2
        result = audit(conn, args.outbox)
        print(json.dumps(result, indent=2))
        bad = {k: v for k, v in result.items() if k not in ("delivered", "sent_rows") and v}
        return 1 if bad else 0
    return 0


def print_table(head: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """Print an aligned text table."""
    cells = [tuple(str(c) for c in head)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for n, r in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            print("  ".join("-" * w for w in widths))


if __name__ == "__main__":
    sys.exit(main())
