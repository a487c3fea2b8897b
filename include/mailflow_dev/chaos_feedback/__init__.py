"""Fault injection for webhook feedback (``make chaos``, after the send-path and contact-policy runs).

The emulator pushes each accepted email's lifecycle as signed webhooks with EVERY webhook fault on
at once (duplicates, reordered emails, delayed first attempts, dropped attempts retried on Svix's
schedule run 500 times faster, forged signatures over tampered bodies, replays with stale and
future timestamps) to a standalone receiver process (``mailflow webhooks serve``, as
deployed). Emails are sent through the emulator's batch API with their send-log rows (``sending``
first, the provider ids stored by index after the answer, as the engine does: a webhook can arrive
before its email's id is known), spread over the kill phase, while the receiver is SIGKILLed at
random moments under load, stays down a moment (the provider meets refused connections and
retries) and restarts on the same port, ``--kills`` times. One of the kills is an outage longer than
the provider retries (4 s during which a message is given up after its third failed attempt): what
it loses, only the safety-net poll can recover. By default (``--outage clean``) it starts when no
message is pending, so it loses whole lifecycles (emails sent during it), which the poll recovers;
``--outage random`` starts it at a random moment, where it can also lose a complaint that follows a
delivery already recorded: the poll asks only about emails without an outcome, so that complaint
stays missed until the provider's failed messages are replayed (docs/feedback.md).

The outcomes come from address rules (8% permanent bounces, 3% complaints, 6% transient bounces, 5%
delayed then delivered, 3% failed; opens and clicks by seeded rates), so the addresses that must be
suppressed are known exactly. After the kills: wait until every message is acknowledged or given
up, run the sweep (``apply_pending``) and the safety-net poll, then audit (each must be 0):

* acknowledged but lost: messages the emulator saw answered 2xx that are not in
  ``mail.webhook_event`` (or are there with another type: a forged body in the genuine one's place);
* wrong suppressions: suppressed addresses that must not be (transient bounces, delays, failures,
  opens, forged or stale copies, other users);
* missed suppressions after the safety-net poll: permanent bounces and complaints not suppressed;
* outcomes on the wrong email: ``mail.delivery_event`` rows whose send-log row is not the email the
  provider sent under that id;
* forged/stale/future copies acknowledged.

``python -m mailflow_dev.chaos_feedback [--kills N] [--emails N] [--seed N] [--dsn DSN] [--json]``;
exit 1 if any is not 0.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from mailflow_dev.chaos_feedback.audit import COLUMNS, HEADERS
from mailflow_dev.chaos_feedback.runner import run_feedback_chaos


def table(report: dict[str, Any]) -> str:
    """The invariants as a two-column text table."""
    rows = [(HEADERS[k], str(report["invariants"][k])) for k in COLUMNS]
    w = max(len(a) for a, _ in rows)
    v = max(len(b) for _, b in rows)
    rule = "-" * w + "-+-" + "-" * v
    return "\n".join([f"{'invariant'.ljust(w)} | {'n'.rjust(v)}", rule,
                      *(f"{a.ljust(w)} | {b.rjust(v)}" for a, b in rows)])


def failed(report: dict[str, Any]) -> list[str]:
    """What makes the run fail: a non-zero invariant, fewer kills than asked for."""
    bad = [f"{HEADERS[k]} = {v}" for k, v in report["invariants"].items() if v]
    if report["kills"] < report["kills_requested"]:
        bad.append(f"only {report['kills']} of {report['kills_requested']} kills happened")
    return bad


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m mailflow_dev.chaos_feedback``."""
    p = argparse.ArgumentParser(prog="mailflow_dev.chaos_feedback", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=30, help="SIGKILLs of the receiver (default 30)")
    p.add_argument("--emails", type=int, default=3000, help="emails sent, one per address (default 3000)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--outage", choices=("clean", "random", "none"), default="clean",
                   help="the outage longer than the provider retries: after every pending message was "
                        "acknowledged (clean, default), at a random moment (random: may lose a complaint "
                        "after a recorded delivery, which only a replay from the provider recovers), or none")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON too")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create a scratch database on "
                        "(default: $TEST_DATABASE_URL, else the embedded server)")
    args = p.parse_args(argv)
    from mailflow_dev import devenv

    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    try:
        report = run_feedback_chaos(admin, kills=args.kills, emails=args.emails, seed=args.seed,
                                    outage=args.outage, out=lambda s: print(s, flush=True))
    finally:
        if started:
            devenv.stop_embedded(pgdata)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    info = report["info"]
    print()
    print(table(report))
    print(f"emails {report['emails']}, kills {report['kills']} of {report['kills_requested']}, receiver down "
          f"{report['down_seconds']:.1f} s in all; webhooks {info.get('messages_by_kind_and_final')}; genuine "
          f"attempts {info.get('genuine_attempt_statuses')}; suppressed {info.get('suppressed')} of "
          f"{info.get('expected_suppressions')} expected; wall time {report['seconds']} s")
    if report["invariants"]["missed_suppressions"]:
        print(f"missed suppressions: {info.get('missed_reasons')}; examples {info['examples']['missed']}")
    bad = failed(report)
    print("invariants: " + ("ALL 0" if not bad else "VIOLATED: " + "; ".join(bad)))
    return 1 if bad else 0


__all__ = ["COLUMNS", "HEADERS", "failed", "main", "run_feedback_chaos", "table"]
