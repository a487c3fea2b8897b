"""Contact-policy stress (`make chaos` runs the long version): several processes claim emails for
the same users at once, lifecycle and scheduled mixed, and nobody may get two emails inside the
cooldown.

Processes (``multiprocessing``, spawn), all started together on one barrier:

* two scheduled campaigns, due at once: ``cc_sched_defer`` (every 2nd user) is provisioned before
  the race; ``cc_sched_skip`` (every 3rd user) is provisioned by the ``provision`` process in
  small chunks, paced (``pace`` seconds between chunks) so that its planned, at once due, emails
  appear while the lifecycle runs mint the same users: the paths meet at the contact guard;
* ``lifecycle-N``: lifecycle runs over two campaigns whose audience is every user (each process its
  own run id; the first runs both, the others one each, so runs of different campaigns overlap);
* ``dispatch-N``: scheduled dispatchers, looping until the provisioner is done and nothing is due.

The provider is an in-process double that accepts every email (the claim side is under test, not
the provider); a ``sent`` row is an accepted email. Every email goes out within seconds, so any two
contacts of one user fall inside the 7-day cooldown. Invariants (all must be 0): users with two or
more contacts (``sent`` or ``sending``), users never decided (no email and nothing pending or held),
due ``pending`` rows left undecided. The counts also say where the paths met under the guard:
``lifecycle_held_under_guard`` (users a lifecycle run held back after the lock, summed over the
runs' summaries) and ``scheduled_held_by_lifecycle`` (scheduled emails deferred or skipped because
of a lifecycle email).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from mailflow.campaigns import Campaign
from mailflow.model.outcome import Accepted, DataInterval, Outcome, PreparedBatch, RunContext

LIFECYCLE = ("cc_life_a", "cc_life_b")
SCHEDULED = (("cc_sched_defer", "defer", 2), ("cc_sched_skip", "skip", 3))
PAST = datetime(2026, 1, 5, tzinfo=UTC)
SECRET = "contact-chaos-secret-0123456789"


class AcceptAll:
    """Provider double: accepts every email of a batch (ids unique per key and index)."""

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Outcome:
        return Accepted(ids={i: f"cc-{batch.idempotency_key}-{i}" for i in range(len(batch.row_ids))}, rejected={})


def _campaign(name: str, priority: int) -> Campaign:
    return Campaign(name=name, priority=priority,
                    audience_sql="select user_id, email, first_name from app.users",
                    template="first_practice", subject="Hello {{ user.first_name or 'there' }}",
                    from_address="Practice Team <practice@mail.example.com>", reply_to=None,
                    cooldown=timedelta(days=7), audience_window=timedelta(hours=1))


def _renderer() -> Any:
    from mailflow.feedback.unsubscribe_tokens import signer_from_secret
    from mailflow.sendloop.render import Renderer

    return Renderer(signer_from_secret(SECRET), "https://mail.example.com", "https://app.example.com", mailto="")


def _lifecycle_worker(dsn: str, n: int, names: Sequence[str], barrier: Any, rounds: int, held: Any) -> None:
    from mailflow.sources.lifecycle import run_lifecycle
    from mailflow.store.send_log import PostgresStore

    with psycopg.connect(dsn, autocommit=True) as conn:
        store = PostgresStore(conn)
        campaigns = [_campaign(name, LIFECYCLE.index(name) + 1) for name in names]
        barrier.wait()
        total = 0
        for r in range(rounds):
            end = conn.execute("select now()").fetchone()[0]  # type: ignore[index]
            summaries = run_lifecycle(
                store, AcceptAll(), _renderer(), campaigns, DataInterval(end - timedelta(hours=1), end),
                run=RunContext(dag_id="contact_chaos", run_id=f"lifecycle-{n}-{r}", task_id="send"),
                chunk_size=(50, 75, 100, 33)[n % 4])
            total += sum(s.held for s in summaries)
        held.put(total)


def _dispatch_worker(dsn: str, n: int, barrier: Any, done: Any, seconds: float) -> None:
    from mailflow.sources import scheduled

    with psycopg.connect(dsn, autocommit=True) as conn:
        barrier.wait()
        stop = time.monotonic() + seconds
        while time.monotonic() < stop:
            provisioned = done.is_set()
            s = scheduled.dispatch(conn, AcceptAll(), _renderer(), budget_seconds=2.0, coalesce_seconds=0,
                                   poll_seconds=0.1, batch_size=(40, 60, 100, 25)[n % 4],
                                   run=RunContext(dag_id="contact_chaos", run_id=f"dispatch-{n}", task_id="dispatch"))
            if provisioned and s.claimed == 0 and s.deferred == 0 and s.skipped == 0:
                return
            if s.claimed == 0:
                time.sleep(0.05)


def _provision_worker(dsn: str, ids: Sequence[int], barrier: Any, done: Any, pace: float) -> None:
    from mailflow.sources import scheduled

    with psycopg.connect(dsn, autocommit=True) as conn:
        barrier.wait()
        for cid in ids[1:]:
            # small chunks at a pace near the lifecycle runs' own, so that a recipient's planned (and
            # at once due) email often appears while a lifecycle run is minting the same user: the
            # two paths then meet at the contact guard, not only at the audience pre-filter
            scheduled.provision(conn, cid, now=PAST, chunk=23, after_chunk=lambda _s: time.sleep(pace))
        done.set()


NEVER_DECIDED = ("select count(*) from app.users u where not exists (select 1 from mail.send_log l"
                 " where l.user_id = u.user_id and l.status in ('sent', 'sending', 'pending', 'skipped', 'duplicate', 'holdout'))")
NEVER_DECIDED_SHARED = (
    "select count(*) from app.users u where not exists (select 1 from mail.send_log l"
    " where l.user_id = u.user_id and l.status in ('sent', 'sending', 'pending', 'skipped', 'duplicate', 'holdout'))"
    " and not exists (select 1 from mail.send_log m where m.status in ('sent', 'sending')"
    " and ((u.user_id % 10 = 0 and m.user_id = u.user_id - 1) or (u.user_id % 10 = 9 and m.user_id = u.user_id + 1)))")
"""Users with no decision; with shared mailboxes, a user is also decided when the other user id at
its mailbox (user ids 10k - 1 and 10k) was emailed."""


def setup(dsn: str, users: int, shared_mailboxes: bool = False) -> list[int]:
    """Fresh users ``1..users`` and the two scheduled campaigns (drafts with their recipient lists);
    returns the campaign ids. Expects a migrated database with the demo app schema.

    ``shared_mailboxes``: every 10th user id has the mailbox of the user before it, spelled
    differently (case and surrounding whitespace), so the claimers also meet at mailbox locks."""
    from mailflow.sources import scheduled

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("truncate mail.send_event, mail.send_log, mail.send_batch, mail.contact, mail.mailbox,"
                     " mail.campaign_address,"
                     " mail.campaign_event,"
                     " mail.campaign_recipient, mail.campaign, app.assessments, app.users restart identity cascade")
        conn.execute("insert into app.users (user_id, email, first_name, signed_up_at, timezone, plan)"
                     " select i, 'user' || i || '@example.com', 'First' || i, '2025-01-01', 'UTC', 'free'"
                     " from generate_series(1, %s::bigint) as i", (users,))
        if shared_mailboxes:
            conn.execute("update app.users set email = ' USER' || (user_id - 1) || '@Example.COM' || chr(9)"
                         " where user_id % 10 = 0")
        ids = []
        for name, on_policy, every in SCHEDULED:
            cid = scheduled.create_campaign(conn, {
                "name": name, "template": "outreach", "subject": "{{ user.first_name }}, the practice library",
                "from": "Outreach <outreach@mail.example.com>", "recipients_table": "mail.campaign_recipient",
                "start_at": PAST, "timezone": "UTC", "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-23:59"],
                "emails_per_day": 5000, "on_policy": on_policy}, actor="contact_chaos")
            conn.execute("insert into mail.campaign_recipient (campaign_id, user_id, email, first_name)"
                         " select %s, u.user_id, u.email, u.first_name from app.users u where u.user_id %% %s = 0",
                         (cid, every))
            ids.append(cid)
        # the first campaign is provisioned before the race (due at once: it holds lifecycle mail
        # back from its users); the others while the claimers run
        scheduled.provision(conn, ids[0], now=PAST, chunk=1000)
    return ids


def run(dsn: str, *, users: int = 2000, lifecycle: int = 3, dispatchers: int = 2, rounds: int = 1,
        seconds: float = 60.0, pace: float = 0.05, shared_mailboxes: bool = False) -> dict[str, Any]:
    """Run the mixed claimers against ``dsn`` (migrated, demo app schema) and return the counts.

    ``shared_mailboxes`` (see :func:`setup`) adds the invariant ``mailboxes_with_two_contacts_in_cooldown``
    (by the stored mailbox key); a user held back because the other user id at its mailbox was
    emailed counts as decided.

    :returns: ``{"users", "processes", "seconds", "counts": {...}, "invariants": {...}}``.
    """
    ids = setup(dsn, users, shared_mailboxes)
    ctx = multiprocessing.get_context("spawn")
    parties = 1 + lifecycle + dispatchers
    barrier, done, held = ctx.Barrier(parties), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_provision_worker, args=(dsn, ids, barrier, done, pace), name="provision")]
    for n in range(lifecycle):
        names = LIFECYCLE if n == 0 else (LIFECYCLE[n % 2],)
        procs.append(ctx.Process(target=_lifecycle_worker, args=(dsn, n, names, barrier, rounds, held),
                                 name=f"lifecycle-{n}"))
    for n in range(dispatchers):
        procs.append(ctx.Process(target=_dispatch_worker, args=(dsn, n, barrier, done, seconds), name=f"dispatch-{n}"))
    t0 = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 60)
    failed = [f"{p.name}: exit {p.exitcode}" for p in procs if p.exitcode != 0]
    lifecycle_held = 0
    for p in procs:
        if p.name.startswith("lifecycle-") and p.exitcode == 0:
            lifecycle_held += int(held.get(timeout=10))
    for p in procs:
        if p.is_alive():
            p.kill()
    elapsed = time.monotonic() - t0
    with psycopg.connect(dsn, autocommit=True) as conn:
        def one(sql: str) -> int:
            row = conn.execute(sql).fetchone()
            return int(row[0]) if row and row[0] is not None else 0

        counts = {
            "emails_sent": one("select count(*) from mail.send_log where status = 'sent'"),
            "users_emailed": one("select count(distinct user_id) from mail.send_log where status in ('sent', 'sending')"),
            "lifecycle_sent": one("select count(*) from mail.send_log where status = 'sent' and kind = 'lifecycle'"),
            "scheduled_sent": one("select count(*) from mail.send_log where status = 'sent' and kind = 'scheduled'"),
            "scheduled_deferred": one("select count(*) from mail.send_log where kind = 'scheduled' and status = 'pending'"
                                      " and scheduled_at > now()"),
            "scheduled_skipped": one("select count(*) from mail.send_log where status = 'skipped'"),
            "deferral_events": one("select count(*) from mail.send_event where from_status = 'pending'"
                                   " and to_status = 'pending' and error like 'contact policy:%'"),
            "skip_events": one("select count(*) from mail.send_event where to_status = 'skipped'"
                               " and error like 'contact policy:%'"),
            # where the two paths met at the contact guard (not only at the audience pre-filter):
            # lifecycle users held back under the lock (by a planned or claimed scheduled email, or
            # another lifecycle run), and scheduled emails held back by a lifecycle email
            "lifecycle_held_under_guard": lifecycle_held,
            "scheduled_held_by_lifecycle": one(
                "select count(*) from mail.send_log where kind = 'scheduled' and status in ('pending', 'skipped')"
                " and error like 'contact policy:%(cc_life_%'"),
        }
        invariants = {
            "users_with_two_contacts_in_cooldown": one(
                "select count(*) from (select user_id from mail.send_log where status in ('sent', 'sending')"
                " group by user_id having count(*) > 1 and max(coalesce(sent_at, now()))"
                " - min(coalesce(sent_at, now())) < interval '7 days') as x"),
            "users_never_decided": one(NEVER_DECIDED_SHARED if shared_mailboxes else NEVER_DECIDED),
            "due_rows_left_pending": one("select count(*) from mail.send_log where status = 'pending'"
                                         " and scheduled_at <= now()"),
            "processes_failed": len(failed),
        }
        if shared_mailboxes:
            invariants["mailboxes_with_two_contacts_in_cooldown"] = one(
                "select count(*) from (select email_key from mail.send_log where status in ('sent', 'sending')"
                " group by email_key having count(*) > 1 and max(coalesce(sent_at, now()))"
                " - min(coalesce(sent_at, now())) < interval '7 days') as x")
    return {"users": users, "processes": len(procs), "seconds": round(elapsed, 1), "failed": failed,
            "counts": counts, "invariants": invariants}


def main(argv: list[str] | None = None) -> int:
    """``python -m mailflow_dev.contact_chaos [--users N] [--lifecycle N] [--dispatchers N] [--rounds N]
    [--dsn DSN]``: prints the counts as JSON; exit 1 if an invariant is not 0."""
    p = argparse.ArgumentParser(prog="mailflow_dev.contact_chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=20000)
    p.add_argument("--lifecycle", type=int, default=4)
    p.add_argument("--dispatchers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--shared-mailboxes", action="store_true",
                   help="every 10th user id shares the mailbox of the one before (spelled differently)")
    p.add_argument("--dsn", default=os.environ.get("TEST_DATABASE_URL"),
                   help="maintenance DSN of a server to create a scratch database on (default: embedded)")
    args = p.parse_args(argv)
    from mailflow.store.migrate import migrate
    from mailflow_dev import devenv
    from mailflow_dev.demo.loader import schema_sql

    pgdata = devenv.STATE / "pgdata-test"
    started = not args.dsn and not devenv.embedded_running(pgdata)
    admin = args.dsn or devenv.embedded_dsn(pgdata)
    name = f"mailflow_contact_chaos_{os.getpid()}"
    dsn = devenv.create_database(admin, name, exist_ok=False)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn)
            conn.execute(schema_sql())
        report = run(dsn, users=args.users, lifecycle=args.lifecycle, dispatchers=args.dispatchers,
                     rounds=args.rounds, seconds=600.0, shared_mailboxes=args.shared_mailboxes)
    finally:
        devenv.drop_database(admin, name)
        if started:
            devenv.stop_embedded(pgdata)
    print(json.dumps(report, indent=2))
    bad = {k: v for k, v in report["invariants"].items() if v}
    print("contact policy invariants: " + ("ALL 0" if not bad else f"VIOLATED {bad}"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
