"""`make demo`: the whole product path on one laptop, end to end.

0. one demo at a time: a second one refuses with one line (or waits, ``--wait SECONDS``);
1. a PostgreSQL for the send log: ``AIRFLOW_CONN_SEND_LOG_DB`` if set, else the embedded server
   (``.demo/pgdata``, Unix socket only); database ``mailflow_demo``;
2. the webhook receiver (``mailflow webhooks serve``) on a free port against that
   database, with a signing secret generated once into ``.demo/webhook.secret``;
3. the Resend-compatible emulator on a free port, cap 10 requests/s, pushing each accepted email's
   lifecycle to the receiver as signed webhooks (seeded rates: a few % bounces, a complaint or two,
   opens and clicks; :data:`mailflow_dev.webhooks.DEMO_LIFECYCLE`). Its outbox and idempotency memory
   belong to the database, not to the checkout: ``.demo/send-logs/<db identity>/`` (see
   :func:`mailflow_dev.devenv.database_identity`), so a restarted emulator recognises a resend and a
   fresh database starts with a fresh outbox;
4. migrations, demo data (5,000 synthetic users, seed 42, loaded once);
5. ``airflow dags test lifecycle_emails`` for the latest complete hour (Airflow metadata in
   ``.demo/airflow``, SQLite);
6. the reconciler (:func:`mailflow.reconciler.reconcile`): rows an interrupted earlier demo left
   ``sending`` are resent under their key and bytes (the emulator replays what it accepted);
7. a bounded wait until the emulator's accounting says every webhook was acknowledged and the
   receiver applied them, and a check that none it acknowledged is missing from the database;
8. a per-campaign table read back from ``mail.send_log``, an audit of the outbox against it, the
   outcomes per campaign (``mail.campaign_outcomes``) and the addresses the outcomes suppressed.
While ``make airflow`` runs on the same database, its emulator is used, and it pushes to the API
server's plugin (``/mailflow-webhooks/resend``) instead of a receiver of the demo's own.
It stops what it started: the emulator, the receiver, and the embedded server only if this run
started it, no other client uses it and ``--keep-db`` is not given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from mailflow.cli import (
    OUTCOMES_HEAD,
    REPORT_HEAD,
    audit,
    feedback_suppressions,
    outcome_cells,
    outcomes,
    print_table,
    report,
)
from mailflow.emulator.testing import EmulatorProcess
from mailflow.store.migrate import migrate
from mailflow_dev import devenv
from mailflow_dev.demo.loader import load_demo_data
from mailflow_dev.webhooks import (
    DEMO_GUARD,
    DEMO_LIFECYCLE,
    Accounting,
    ReceiverProcess,
    acknowledged_ids,
    lost,
    wait_acknowledged,
    wait_applied,
    webhook_secret,
)

ROOT = Path(__file__).resolve().parents[1]
STATE = devenv.STATE
EXIT_BUSY = 3
WEBHOOK_WAIT_SECONDS = 20.0
"""How long the demo waits after the run for the last webhooks (usually well under a second)."""


def secret_file(name: str) -> str:
    """A random secret kept in ``.demo/`` (generated once; never in code)."""
    path = STATE / name
    if not path.exists():
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()


def airflow_env(dsn: str, emulator_url: str, api_key: str) -> dict[str, str]:
    """Environment for the Airflow CLI: home, DAG folder, and the four connections."""
    home = STATE / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    env = os.environ.copy()
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        # `airflow dags test` of Airflow 3.3.2 fails at the end of a run of a DAG with Deadline Alerts
        "MAILFLOW_DEADLINE_ALERTS": "0",
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW_CONN_SEND_LOG_DB": devenv.airflow_conn_json(dsn),
        "AIRFLOW_CONN_RESEND_DEFAULT": json.dumps({
            "conn_type": "resend", "host": emulator_url, "password": api_key,
            "extra": {"requests_per_second": 10, "target_fraction": 0.8}}),
        "AIRFLOW_CONN_MAIL_UNSUBSCRIBE": json.dumps({"conn_type": "generic",
                                                     "password": secret_file("unsubscribe.secret")}),
        "AIRFLOW_CONN_MAIL_WEBHOOK": json.dumps({"conn_type": "generic",
                                                 "password": webhook_secret(STATE / "webhook.secret")}),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    })
    return env


def airflow(env: dict[str, str], *args: str, quiet: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the ``airflow`` CLI of this venv; raise with its output on failure."""
    cmd = [str(Path(sys.executable).parent / "airflow"), *args]
    res = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if res.returncode != 0:
        sys.stderr.write(res.stdout[-6000:] + res.stderr[-6000:])
        raise SystemExit(f"`airflow {' '.join(args)}` failed with exit code {res.returncode}")
    if not quiet:
        sys.stdout.write(res.stdout)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--keep-db", action="store_true", help="leave the embedded PostgreSQL running")
    p.add_argument("--reset", action="store_true", help="reload the demo users (the send log is kept)")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="if another demo is running, wait up to this long instead of refusing at once")
    args = p.parse_args()
    for var, value in DEMO_GUARD.items():  # the receiver and the lifecycle run judge the demo list alike
        os.environ.setdefault(var, value)
    STATE.mkdir(parents=True, exist_ok=True)
    try:
        with devenv.exclusive("demo", wait=args.wait):
            return run(args)
    except devenv.Busy as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return EXIT_BUSY


@dataclass(frozen=True)
class SharedEmulator:
    """The emulator `make airflow` runs (only its URL is needed)."""

    base_url: str


def shared_emulator(state: Path) -> SharedEmulator | None:
    """The running `make airflow` emulator if it serves this database (same outbox directory):
    then the demo uses it, so one process owns the outbox and the idempotency memory."""
    here = STATE / "airflow-local"
    if devenv.local_airflow_pid() is None:
        return None
    try:
        url, served = (here / "emulator.url").read_text().split("\n")[:2]
    except (OSError, ValueError):
        return None
    return SharedEmulator(url.strip()) if Path(served.strip()) == state else None


def reconcile_after(dsn: str, emulator_url: str, api_key: str, *, external: bool) -> dict[str, int]:
    """The reconciler on the demo's database (its public entry point, :func:`mailflow.reconciler.reconcile`).

    Claims are live only while a sender runs. The demo holds the lock and its own run has ended, so
    on the embedded server (reachable from this checkout only) every ``sending`` row is an orphan of
    an interrupted demo, unless ``make airflow`` is up (its scheduler may be sending): then, and on
    an external database, only claims older than the usual stale threshold are touched.
    """
    from mailflow import settings
    from mailflow.provider.client import ResendClient
    from mailflow.provider.pacing import PostgresPacer
    from mailflow.reconciler import reconcile

    live_senders_possible = external or devenv.local_airflow_pid() is not None
    stale_after = timedelta(seconds=settings.stale_after_seconds() if live_senders_possible else 0)
    pacer = PostgresPacer(lambda: psycopg.connect(dsn), account=emulator_url, requests_per_second=10,
                          target_fraction=0.8)
    client = ResendClient(emulator_url, api_key, pacer=pacer)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            now = conn.execute("select now()").fetchone()[0]
            summary = reconcile(conn, client, now=now, stale_after=stale_after)
    finally:
        client.close()
        close = getattr(pacer, "close", None)
        if close:
            close()
    return {k: v for k, v in summary.as_dict().items() if isinstance(v, int)}


def run(args: argparse.Namespace) -> int:
    """The demo itself, under the lock."""
    started = time.monotonic()
    bad: dict[str, int] = {}

    external = os.environ.get("AIRFLOW_CONN_SEND_LOG_DB")
    if external:
        try:
            dsn = devenv.dsn_from_airflow_conn(external)
            dbname = psycopg.conninfo.conninfo_to_dict(dsn).get("dbname")
            psycopg.connect(dsn, connect_timeout=10).close()
        except (psycopg.Error, ValueError) as exc:
            raise SystemExit(f"AIRFLOW_CONN_SEND_LOG_DB is set but unusable ({type(exc).__name__}: "
                             f"{str(exc).strip()}). Expected a postgresql:// URI or Airflow connection JSON "
                             "of a reachable database; unset it to use the embedded PostgreSQL.") from None
        print(f"send log: the database of AIRFLOW_CONN_SEND_LOG_DB ({dbname})")
        started_server = False
    else:
        started_server = not devenv.embedded_running()
        dsn = devenv.create_database(devenv.embedded_dsn(), "mailflow_demo")
        print(f"send log: embedded PostgreSQL in {STATE / 'pgdata'}, database mailflow_demo "
              f"({'started' if started_server else 'already running'}; DSN {dsn})")

    end = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    start = end - timedelta(hours=1)
    api_key = "re_demo_" + secret_file("emulator.key")[:16]
    hooks: dict[str, int] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            run_started = conn.execute("select now()").fetchone()[0]
            state = devenv.database_state(conn)
            outbox, idem_store = state / "outbox.jsonl", state / "idempotency.jsonl"
            legacy = STATE / "outbox.jsonl"  # before per-database state: the embedded database's outbox
            if not external and legacy.exists() and not outbox.exists():
                legacy.rename(outbox)
            applied = migrate(conn)
            print("migrations: " + (", ".join(applied) if applied else "up to date"))
            loaded = load_demo_data(conn, users=args.users, seed=args.seed, anchor=end, reset=args.reset)
            print(f"demo data: {loaded}")
            before = conn.execute("select count(*) from mail.send_log where status = 'sent'").fetchone()[0]

        shared = shared_emulator(state)
        secret = webhook_secret(STATE / "webhook.secret")
        receiver = None if shared else ReceiverProcess(dsn, secret, STATE / "webhook-receiver.log")
        with contextlib.ExitStack() as stack:
            if receiver is not None:
                stack.enter_context(receiver)
                print(f"webhook receiver: {receiver.url} (standalone, signing secret in {STATE / 'webhook.secret'})")
            emu = stack.enter_context(contextlib.nullcontext(shared) if shared else EmulatorProcess(
                outbox=outbox, api_key=api_key, rate_limit=10, idempotency_store=idem_store, seed=args.seed,
                webhook_url=receiver.url if receiver else "", webhook_secrets=[secret], **DEMO_LIFECYCLE))
            print(f"email API emulator: {emu.base_url} (outbox {outbox})"
                  + (" - the one of `make airflow`, which uses this database too and pushes its webhooks to the "
                     "API server's plugin" if shared else ", pushing signed webhooks to the receiver"))
            env = airflow_env(dsn, emu.base_url, api_key)
            if not (STATE / "airflow" / "airflow.db").exists():
                print("airflow: migrating its metadata database (first run only)")
            airflow(env, "db", "migrate")
            airflow(env, "pools", "set", "email_provider", "4", "Bounds concurrent send tasks; the pacer enforces the rate")
            print(f"airflow dags test lifecycle_emails: data interval [{start:%Y-%m-%d %H:%M}, {end:%H:%M}) UTC")
            t0 = time.monotonic()
            # Interval timetables in Airflow 3: the logical date of a run is its data interval's end.
            airflow(env, "dags", "test", "lifecycle_emails", end.isoformat())
            took = time.monotonic() - t0
            repaired = reconcile_after(dsn, emu.base_url, api_key, external=bool(external))
            print("reconciler: " + (", ".join(f"{k}={v}" for k, v in repaired.items() if v)
                                    or "nothing left over from an earlier run"))
            hooks = settle_webhooks(dsn, emu.base_url)
            if hooks.get("lost"):
                bad["webhooks_lost"] = hooks["lost"]

        if receiver is not None:
            print(f"webhook receiver: {receiver.how_stopped}")
        with psycopg.connect(dsn, autocommit=True) as conn:
            after = conn.execute("select count(*) from mail.send_log where status = 'sent'").fetchone()[0]
            minted_here = conn.execute("select count(*) from mail.send_log where data_interval_end = %s",
                                       (end,)).fetchone()[0]
            print()
            # every summary's columns (mailflow.model.tally): the states add up to total
            print_table(REPORT_HEAD, report(conn))
            print()
            new = after - before
            print(f"rows minted for this interval (all runs): {minted_here}")
            print(f"this run sent {new} new emails in {took:.1f} s"
                  + ("" if new else " (nothing new: everyone in this interval was already emailed or is in cooldown)"))
            result = audit(conn, outbox)
            print("audit (send log vs outbox): " + ", ".join(f"{k}={v}" for k, v in result.items()))
            print()
            print(f"outcomes per campaign (mail.campaign_outcomes; rates of sent; {since_text(hooks)}):")
            print_table(OUTCOMES_HEAD, [outcome_cells(r) for r in outcomes(conn)])
            suppressed = feedback_suppressions(conn, run_started)
            print(f"suppressed by these outcomes: {sum(suppressed.values())} addresses"
                  + (" (" + ", ".join(f"{k} {v}" for k, v in suppressed.items()) + ")" if suppressed else ""))
            print(f"outbox: {outbox}   query the send log: make psql   the Airflow UI: make airflow")
            failed = {k: v for k, v in result.items() if k not in ("delivered", "sent_rows") and v}
            if failed:
                print(f"AUDIT FAILED: {failed}: the outbox {outbox} holds emails the send log does not explain "
                      "(was another emulator writing to it?)", file=sys.stderr)
            bad.update(failed)
    finally:
        if started_server and not args.keep_db:
            others = devenv.other_clients(dsn)
            if others:
                print(f"embedded PostgreSQL left running: {others} other client(s) connected (make stop stops it)")
            else:
                devenv.stop_embedded()
        elif not external:
            print("embedded PostgreSQL left running (" + ("--keep-db" if started_server else
                  "this demo did not start it") + "); make stop stops it")
    print(f"demo took {time.monotonic() - started:.1f} s")
    if bad:
        print(f"DEMO FAILED: {bad}", file=sys.stderr)
    return 1 if bad else 0


def settle_webhooks(dsn: str, emulator_url: str) -> dict[str, int]:
    """After the run: wait (bounded) until the emulator has every webhook acknowledged and the send log
    has them all applied; print the emulator's accounting and how many acknowledged events the
    database lacks (``lost``). Returns ``{"lost": n, "pending": n, "unapplied": n}`` (empty when the
    emulator has no accounting to read: a `make airflow` emulator started without its control API)."""
    import httpx

    t0 = time.monotonic()
    try:
        acc: Accounting = wait_acknowledged(emulator_url, WEBHOOK_WAIT_SECONDS)
        ids = acknowledged_ids(emulator_url)
    except httpx.HTTPError as exc:
        print(f"webhooks: the emulator's accounting is not readable ({type(exc).__name__}); restart `make airflow`")
        return {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        unapplied, _ = wait_applied(conn, max(1.0, WEBHOOK_WAIT_SECONDS - (time.monotonic() - t0)))
        missing = lost(conn, ids)
    print(f"webhooks: {acc.messages} signed events pushed, {acc.acknowledged} acknowledged, {acc.pending} pending, "
          f"{acc.given_up} given up; lost (acknowledged, not in mail.webhook_event): {missing}; "
          f"not yet applied to the send log: {unapplied}; settled {time.monotonic() - t0:.1f} s after the run")
    print("webhook events: " + ", ".join(f"{k}={v}" for k, v in sorted(acc.by_type.items())))
    if acc.pending or unapplied:
        print(f"webhooks: not settled within {WEBHOOK_WAIT_SECONDS:.0f} s: the outcomes below miss some "
              "(the receiver applies them when they arrive)")
    return {"lost": missing, "pending": acc.pending, "unapplied": unapplied}


def since_text(hooks: dict[str, int]) -> str:
    """How complete the outcomes table is, in words."""
    if not hooks:
        return "as far as they arrived"
    return "every webhook applied" if not hooks["pending"] and not hooks["unapplied"] else "some still on the way"


if __name__ == "__main__":
    sys.exit(main())
