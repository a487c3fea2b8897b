"""`make psql`: open the demo's send log in psql (AIRFLOW_CONN_SEND_LOG_DB, or the embedded server,
started again if it is not running). Leave with \\q; `make stop` stops the embedded server.

Before `make demo` (or `make airflow`) there is no send log yet: it says so, names the command that
creates it, and stops the embedded server again if it started it here (exit 1)."""

from __future__ import annotations

import os
import sys

import psycopg

from mailflow_dev import devenv

DEMO_DB = "mailflow_demo"

if __name__ == "__main__":
    external = os.environ.get("AIRFLOW_CONN_SEND_LOG_DB")
    if external:
        dsn = devenv.dsn_from_airflow_conn(external)
    else:
        pgdata = devenv.STATE / "pgdata"
        was_running = devenv.embedded_running(pgdata)
        admin = devenv.embedded_dsn(pgdata)
        with psycopg.connect(admin, autocommit=True) as conn:
            exists = conn.execute("select 1 from pg_database where datname = %s", (DEMO_DB,)).fetchone()
        if not exists:
            stopped = "" if was_running else " (the embedded server it started for this is stopped again)"
            print(f"make psql: there is no send log yet (database {DEMO_DB!r} does not exist in {pgdata}).\n"
                  f"Run `make demo` (or `make airflow`) first, then `make psql`{stopped}.", file=sys.stderr)
            if not was_running:
                devenv.stop_embedded(pgdata)
            sys.exit(1)
        dsn = devenv.with_dbname(admin, DEMO_DB)
    print(f"psql {dsn}\n(the server keeps running after \\q; MAILFLOW_DSN='{dsn}' for the scheduled CLI; "
          "make stop stops it)", file=sys.stderr)
    sys.exit(devenv.run_psql(dsn))
