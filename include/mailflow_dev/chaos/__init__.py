"""Fault injection (``make chaos``): kill the sender, the scheduled dispatcher and the reconciler at
random points while the emulator produces the real provider's faults, one fault kind at a time; then
recover and audit the provider's outbox against the send log, per fault kind.

Each fault kind runs in its own database (a copy of one template: demo users, the real lifecycle
campaigns, a scheduled campaign whose rows are all due) with its own installation id, against ONE
emulator (one provider team, one outbox, one idempotency memory): the keys of every database meet
there, so "a key with two bodies" across databases would show.

Per fault kind:

1. **fault phase**: the emulator's fault is switched on; sender (``run_lifecycle``), dispatcher
   (``scheduled.dispatch``) and reconciler (``reconciler.reconcile``, stale threshold 0: every earlier
   process is dead or done) runs alternate, each a forked process, most of them SIGKILLed at a random
   point: sender ``before_mint`` / ``after_mint`` (rows and bytes stored, no request) / ``in_flight``
   (a timer fires while the request is out) / ``before_apply`` (the answer arrived, not recorded);
   dispatcher and reconciler the same with ``before_claim`` / ``after_claim``. The reconciler's
   resends meet the same fault.
2. **recovery**: faults off; reconciler, sender and dispatcher rounds until a round changes nothing.
3. **audit** (outbox lines of this installation vs its send log): duplicate deliveries (a user got
   one campaign twice), rows ``sent`` without a delivery, deliveries without a ``sent`` row, keys
   seen with two bodies (two different emails under one key and index, a delivered email that is
   not the stored bytes of its key, or a 409 ``invalid_idempotent_request``), and eligible users not
   sent after recovery (still in an audience, a row left ``sending``, a scheduled row due and
   ``pending``, a dead letter, or a row failed although its email was valid). Each must be 0.

The simulated clock: actors run on :class:`~mailflow.model.clock.FakeClock` (backoff, retry-after and
budget waits take no real time); an advance of the scenario clock by ``s`` seconds moves the
emulator's clock (idempotency TTL, quota day) and ages every stored batch (``created_at``, which the
reconciler's idempotency window reads) by ``s``. The ``outage`` kind holds a 6-hour outage (503s,
then an unreachable provider, then 503s) with runs every 10 simulated minutes; ``quota`` exhausts a
daily quota and keeps hitting it for 4 simulated hours until the provider's next UTC day.
``team_rate_limit`` runs on the real clock: another API key of the same team takes most of a 5
requests/s cap, so our senders meet 429s with retry-after. ``key_rotation_while_ambiguous`` leaves
batches ambiguous under one API key, then rotates it: one reconcile run with only the new key must hold
them (no request, no row changed; ``info.held_run``), and the recovery runs with the old key as a
previous key.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mailflow_dev.chaos.runner import run_chaos
from mailflow_dev.chaos.scenarios import COLUMNS, HEADERS, SCENARIOS


def table(report: dict[str, Any]) -> str:
    """The per-fault-kind table (text)."""
    head = ["fault kind", "kills", *HEADERS, "ids misattributed*"]
    body = []
    for s in report["scenarios"]:
        body.append([s["name"], str(s["kills"]), *(str(s["invariants"][k]) for k in COLUMNS),
                     str(s["info"].get("provider_ids_misattributed", 0))])
    body.append(["TOTAL", str(report["kills"]), *(str(report["totals"][k]) for k in COLUMNS),
                 str(sum(int(s["info"].get("provider_ids_misattributed", 0)) for s in report["scenarios"]))])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *(line(r) for r in body[:-1]), rule, line(body[-1])])


def failed(report: dict[str, Any]) -> list[str]:
    """What makes the run fail: a non-zero invariant, an unexpected error, too few kills."""
    bad = [f"{k} = {v}" for k, v in report["totals"].items() if v]
    if report["unexpected_errors"]:
        bad.append(f"{report['unexpected_errors']} actor run(s) failed unexpectedly")
    if report["kills"] < report["kills_requested"]:
        bad.append(f"only {report['kills']} of {report['kills_requested']} kills happened")
    return bad


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow_dev.chaos [--kills N] [--users N] [--seed N] [--dsn DSN] [--json]``; exit 1
    if any invariant is not 0."""
    p = argparse.ArgumentParser(prog="mailflow_dev.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=200, help="SIGKILLs in all, spread over the fault kinds (default 200)")
    p.add_argument("--users", type=int, default=800, help="demo users per fault kind's database (default 800)")
    p.add_argument("--scheduled-users", type=int, default=300, help="scheduled recipients per database (300)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--chunk-size", type=int, default=10, help="emails per batch request (default 10)")
    p.add_argument("--step-minutes", type=float, default=10.0,
                   help="simulated minutes between the outage's runs (default 10; the quota's: 1.5 times)")
    p.add_argument("--only", action="append", default=[], help="run only this fault kind (repeatable)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON too")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create scratch databases on "
                        "(default: $TEST_DATABASE_URL, else the embedded server)")
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    scenarios = SCENARIOS
    if args.only:
        unknown = set(args.only) - {s.name for s in SCENARIOS}
        if unknown:
            p.error(f"unknown fault kind(s) {sorted(unknown)}; known: {[s.name for s in SCENARIOS]}")
        scenarios = tuple(s for s in SCENARIOS if s.name in args.only)
    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    try:
        report = run_chaos(admin, kills=args.kills, users=args.users, scheduled_users=args.scheduled_users,
                           seed=args.seed, chunk_size=args.chunk_size, step_minutes=args.step_minutes,
                           scenarios=scenarios, out=lambda s: print(s, flush=True))
    finally:
        if started:
            devenv.stop_embedded(pgdata)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    print()
    print(table(report))
    print("* provider ids misattributed: ids answered out of request order land on the wrong rows; delivery is "
          "unaffected and the feedback reader refuses to act on them (recipient check). Information only.")
    print(f"kills: {report['kills']} of {report['kills_requested']} ({report['kills_by_actor']}); "
          f"wall time {report['seconds']} s")
    if report["errors"]:
        print("unexpected errors:\n" + report["errors"])
    bad = failed(report)
    print("invariants: " + ("ALL 0" if not bad else "VIOLATED: " + "; ".join(bad)))
    return 1 if bad else 0

__all__ = [
    "COLUMNS", "SCENARIOS", "run_chaos",
]
