"""CLI: ``python -m mailflow_dev.demo --dsn DSN [--users N] [--seed N] [--anchor ISO] [--reset]``.

Creates schema ``app`` if needed, loads the demo population (unless
``app.users`` already has rows and ``--reset`` is not given) and prints the
:class:`~mailflow_dev.demo.loader.LoadSummary` line.  Exit status 0 on success
(including "nothing loaded"), 2 on bad arguments, 1 on database errors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

import psycopg

from mailflow_dev.demo.loader import load_demo_data


def _parse_anchor(text: str) -> datetime:
    """ISO 8601 -> aware UTC datetime; a value without offset is taken as UTC."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 datetime: {text!r}") from exc
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def _default_anchor() -> datetime:
    return datetime.now(UTC).replace(minute=0, second=0, microsecond=0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m mailflow_dev.demo",
        description="Load deterministic demo users and assessments into schema 'app'.",
    )
    parser.add_argument("--dsn", required=True, help="libpq DSN or URL of the target database")
    parser.add_argument("--users", type=int, default=5000, help="number of users (default 5000)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default 42)")
    parser.add_argument(
        "--anchor",
        type=_parse_anchor,
        default=None,
        help="the data's 'now', ISO 8601 (no offset = UTC); default: the current hour, UTC",
    )
    parser.add_argument("--reset", action="store_true", help="truncate app.users/app.assessments first")
    args = parser.parse_args(argv)
    if args.users < 1:
        parser.error("--users must be >= 1")
    anchor = args.anchor or _default_anchor()
    try:
        with psycopg.connect(args.dsn) as conn:
            summary = load_demo_data(conn, users=args.users, seed=args.seed, anchor=anchor, reset=args.reset)
    except psycopg.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
