"""`make psql`: open the demo's send log in psql (AIRFLOW_CONN_SEND_LOG_DB, or the embedded server,
started again if it is not running). Leave with \\q; `make stop` stops the embedded server."""

from __future__ import annotations

import os
import sys

from mailflow_dev import devenv

if __name__ == "__main__":
    external = os.environ.get("AIRFLOW_CONN_SEND_LOG_DB")
    dsn = devenv.dsn_from_airflow_conn(external) if external else devenv.with_dbname(devenv.embedded_dsn(), "mailflow_demo")
    print(f"psql {dsn}\n(the server keeps running after \\q; MAILFLOW_DSN='{dsn}' for the scheduled CLI; "
          "make stop stops it)", file=sys.stderr)
    sys.exit(devenv.run_psql(dsn))
