"""Shared fixtures: a real PostgreSQL (``TEST_DATABASE_URL`` or the embedded default), the
Resend emulator as a real HTTP server, and an isolated Airflow home for DAG tests.

Airflow reads its configuration at import, so the environment is set here, before any test
module imports it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_AIRFLOW_HOME = Path(tempfile.mkdtemp(prefix="mailflow-airflow-home-"))
os.environ["AIRFLOW_HOME"] = str(_AIRFLOW_HOME)
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(ROOT / "plugins")
os.environ["AIRFLOW__CORE__UNIT_TEST_MODE"] = "False"
# dag.test() of Airflow 3.3.2 fails when a run of a DAG with Deadline Alerts ends (it looks the
# alerts up by id, which only a serialized DAG has); the tests that need them turn them on
os.environ["MAILFLOW_DEADLINE_ALERTS"] = "0"

import psycopg  # noqa: E402
import pytest  # noqa: E402

from mailflow.emulator.testing import EmulatorProcess  # noqa: E402
from mailflow.store.migrate import migrate  # noqa: E402
from mailflow_dev import devenv  # noqa: E402

UNSUBSCRIBE_SECRET = "test-secret-0123456789abcdef"
MAIL_TABLES = ("mail.send_event, mail.send_log, mail.send_batch, mail.rate_slot, mail.circuit_breaker, mail.suppression,"
               " mail.contact, mail.campaign_address, mail.mailbox, mail.webhook_event, mail.delivery_event,"
               " mail.reputation_guard, mail.reputation_setting, mail.test_email, mail.test_email_event,"
               " mail.campaign_approval, mail.campaign_lift_day, mail.campaign_lift_fold")
"""Emptied before every test that takes ``db``; a table without a foreign key to the send log must be named
(``cascade`` does not reach it), or one test's rows leak into the next one's views."""


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """DSN of a maintenance database on the test server (TEST_DATABASE_URL or embedded)."""
    explicit = os.environ.get("TEST_DATABASE_URL")
    if explicit:
        yield explicit
        return
    pgdata = devenv.TEST_PGDATA
    with devenv.server_in_use(pgdata):  # `make stop` (run by an e2e test, or a person) leaves it alone
        already_running = devenv.embedded_running(pgdata)
        dsn = devenv.embedded_dsn(pgdata)
        yield dsn
    if not already_running:  # another session may be using a server it started
        devenv.stop_if_unused(pgdata)


@pytest.fixture(scope="session")
def db_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh, migrated database for this test session (dropped at the end)."""
    name = f"mailflow_test_{uuid.uuid4().hex[:8]}"
    dsn = devenv.create_database(pg_admin_dsn, name, exist_ok=False)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn)
        from mailflow_dev.demo.loader import schema_sql

        conn.execute(schema_sql())
    yield dsn
    devenv.drop_database(pg_admin_dsn, name)


@pytest.fixture
def db(db_dsn: str) -> Iterator[psycopg.Connection]:
    """A connection to the session database with every mail and app table emptied first."""
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute(f"truncate {MAIL_TABLES}, app.assessments, app.users restart identity cascade")
        yield conn


@pytest.fixture(scope="session")
def emulator_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmulatorProcess]:
    """One emulator subprocess for the session (rate limit off unless a test sets it)."""
    with EmulatorProcess(outbox=tmp_path_factory.mktemp("emulator") / "outbox.jsonl", rate_limit=0, seed=1) as emu:
        yield emu


@pytest.fixture
def emulator(emulator_process: EmulatorProcess) -> EmulatorProcess:
    """The session emulator, reset (state, stats, outbox, startup settings) for this test."""
    emulator_process.reset()
    return emulator_process


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """Migrate the Airflow metadata database (SQLite in a temporary AIRFLOW_HOME) once."""
    subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], check=True,
                   capture_output=True, env=os.environ.copy())
    return _AIRFLOW_HOME


@pytest.fixture(autouse=True)
def _mailflow_loggers_enabled() -> None:
    """The product's loggers as a deployment has them, for every test: enabled and at the level they
    inherit (an earlier test's logging setup, Airflow's or a tool run in-process, may have disabled
    or quietened them), so a test can read what the product logs (caplog)."""
    for name, logger in logging.root.manager.loggerDict.items():
        if name.split(".")[0] in ("mailflow", "mailflow_dev") and isinstance(logger, logging.Logger):
            logger.disabled = False
            logger.setLevel(logging.NOTSET)
