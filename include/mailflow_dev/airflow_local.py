"""A real, local Airflow for the end-to-end tier and the scale-out demo: environment, processes
and a small REST API v2 client.

Nothing here is imported by the DAGs or the package. ``tests/e2e`` and ``scripts/scale_demo.py``
use it to run Airflow 3 the way an operator does:

* :func:`airflow_env`: a temporary ``AIRFLOW_HOME``, the metadata DB on a PostgreSQL server (never
  SQLite: the scheduler, API server, DAG processor and workers run in parallel), free ports for the
  API server and the log servers, one JWT secret for every process, SimpleAuthManager with
  ``simple_auth_manager_all_admins`` (a token from ``GET /auth/token``), examples off, the
  connection "Test" button on, and the mailflow connections as ``AIRFLOW_CONN_*`` variables
  (the test tiers) or none (``make airflow`` writes them to the metadata database:
  :func:`sync_connections`).
* :class:`Proc`: one Airflow command (``airflow standalone``, ``airflow scheduler``, ...) in its
  own session (process group), output to a log file. :meth:`Proc.stop` sends SIGINT to the PID it
  started (``airflow standalone`` shuts its components down on SIGINT, not SIGTERM), waits, and
  only then kills what is left of that process group.
* :class:`AirflowApi`: the REST calls the UI makes (``/api/v2/...``) with a bearer token.

Run through ``scripts/airflow_local.py`` it is ``make airflow`` / ``make stop`` (:func:`up`, :func:`down`): the same
environment and the same :class:`Proc`, left running in the background with PID files in
``.demo/airflow-local/`` (see the ``up`` docstring).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

from mailflow.emulator.testing import free_port  # noqa: F401  (re-exported for the e2e tier)
from mailflow_dev.webhooks import DEMO_GUARD

ROOT = Path(__file__).resolve().parents[2]  # the checkout: include/mailflow_dev/<this file>
VENV_BIN = Path(sys.executable).parent
TERMINAL = {"success", "failed"}


def worker_hostname() -> str:
    """``[core] hostname_callable`` for several workers on one host: ``MAILFLOW_WORKER_NAME`` if set
    (the scale-out demo names its Celery workers), else the FQDN as Airflow's default does."""
    return os.environ.get("MAILFLOW_WORKER_NAME") or socket.getfqdn()


def sqlalchemy_url(dsn: str) -> str:
    """SQLAlchemy URL (psycopg 3 driver) for a libpq DSN or URI; a Unix-socket directory as host
    becomes ``?host=/dir`` (``postgresql+psycopg://postgres@/db?host=/run/pg``)."""
    p = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}  # parsed from a string: every value is one
    host = p.get("host") or ""
    socket_dir = host if host.startswith("/") else None
    url = URL.create(
        "postgresql+psycopg",
        username=p.get("user") or "postgres",
        password=p.get("password") or None,
        host=None if socket_dir else (host or "localhost"),
        port=int(p["port"]) if p.get("port") and not socket_dir else None,
        database=p.get("dbname") or "postgres",
        query={"host": socket_dir} if socket_dir else {},
    )
    return url.render_as_string(hide_password=False)


def airflow_env(home: Path, metadata_dsn: str, connections: Mapping[str, str], *, api_port: int,
                executor: str = "LocalExecutor", dags_folder: Path | None = None,
                extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment shared by every Airflow process of one local deployment.

    :param home: AIRFLOW_HOME (created; airflow.cfg is generated there on first use).
    :param metadata_dsn: libpq DSN of the (existing, empty or migrated) metadata database.
    :param connections: ``{"AIRFLOW_CONN_SEND_LOG_DB": "{...json...}", ...}``.
    """
    home.mkdir(parents=True, exist_ok=True)
    # Nothing of the caller's Airflow configuration leaks in (the test session sets its own).
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
    base = f"http://127.0.0.1:{api_port}"
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder or ROOT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(ROOT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": executor,
        "AIRFLOW__CORE__PARALLELISM": "8",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
        # Airflow 3 disables the connection form's "Test" button by default; the docs ask for it
        "AIRFLOW__CORE__TEST_CONNECTION": "Enabled",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base}/execution/",
        "AIRFLOW__CORE__AUTH_MANAGER":
            "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        "AIRFLOW__CORE__FERNET_KEY": "",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": sqlalchemy_url(metadata_dsn),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_POOL_SIZE": "3",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_MAX_OVERFLOW": "5",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__API__BASE_URL": base,
        # one secret for every process: the API server signs task and UI tokens with it
        "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_urlsafe(32),
        "AIRFLOW__API__SECRET_KEY": secrets.token_urlsafe(32),
        "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
        "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
        "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
        "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(connections)
    env.update(extra or {})
    return env


def mailflow_connections(send_log_dsn: str, emulator_url: str, api_key: str, unsubscribe_secret: str, *,
                         requests_per_second: float = 10, target_fraction: float = 0.8,
                         webhook_secret: str | None = None) -> dict[str, str]:
    """The mailflow connections as ``AIRFLOW_CONN_*`` environment variables: the three the sending
    needs, and ``mail_webhook`` (the webhook signing secret, ``whsec_...``) when ``webhook_secret`` is given."""
    from mailflow_dev import devenv

    conns = {
        "AIRFLOW_CONN_SEND_LOG_DB": devenv.airflow_conn_json(send_log_dsn),
        "AIRFLOW_CONN_RESEND_DEFAULT": json.dumps({
            "conn_type": "resend", "host": emulator_url, "password": api_key,
            "extra": {"requests_per_second": requests_per_second, "target_fraction": target_fraction}}),
        "AIRFLOW_CONN_MAIL_UNSUBSCRIBE": json.dumps({"conn_type": "generic", "password": unsubscribe_secret}),
    }
    if webhook_secret is not None:
        conns["AIRFLOW_CONN_MAIL_WEBHOOK"] = json.dumps({"conn_type": "generic", "password": webhook_secret})
    return conns


CONN_FIELDS = ("conn_type", "host", "port", "login", "password", "schema", "extra")


def _normal(conn: Mapping[str, Any]) -> dict[str, Any]:
    """A connection's fields in one comparable shape (``extra`` as a dict, absent fields None)."""
    out = {k: conn.get(k) for k in CONN_FIELDS}
    if isinstance(out["extra"], str):
        out["extra"] = json.loads(out["extra"]) if out["extra"].strip() else None
    out["extra"] = out["extra"] or None
    return out


def sync_connections(env: Mapping[str, str], wanted: Mapping[str, str], record: Path) -> dict[str, str]:
    """Put ``wanted`` (``{"AIRFLOW_CONN_<ID>": json}``, as :func:`mailflow_connections` gives) into
    the metadata database of ``env``, where Admin -> Connections shows them and an edit there takes
    effect (``airflow connections export`` and ``import --overwrite``; the database must be migrated).

    A connection is created when missing; one that still holds exactly what this function wrote last
    time (kept in ``record``) is brought up to date (the emulator's port changes between runs); one
    that differs from that was edited by a person and is kept as it is.

    :returns: ``{conn_id: "created" | "updated" | "unchanged" | "kept (edited in Airflow)"}``.
    :raises RuntimeError: if the Airflow CLI fails (its output in the message).
    """
    desired = {name[len("AIRFLOW_CONN_"):].lower(): _normal(json.loads(value)) for name, value in wanted.items()}
    try:
        written = {k: _normal(v) for k, v in json.loads(record.read_text()).items()}
    except (OSError, ValueError):
        written = {}
    current = {k: _normal(v) for k, v in
               json.loads(airflow_cli(env, "connections", "export", "-", "--file-format", "json") or "{}").items()}
    actions: dict[str, str] = {}
    for conn_id, conn in desired.items():
        if conn_id not in current:
            actions[conn_id] = "created"
        elif current[conn_id] == conn:
            actions[conn_id] = "unchanged"
        elif current[conn_id] == written.get(conn_id):
            actions[conn_id] = "updated"
        else:
            actions[conn_id] = "kept (edited in Airflow)"
    todo = {k: desired[k] for k, a in actions.items() if a in ("created", "updated")}
    if todo:
        record.parent.mkdir(parents=True, exist_ok=True)
        upload = record.with_suffix(".import.json")
        upload.write_text(json.dumps({k: {f: v for f, v in c.items() if v is not None} for k, c in todo.items()}))
        upload.chmod(0o600)
        try:
            airflow_cli(env, "connections", "import", "--overwrite", str(upload))
        finally:
            upload.unlink(missing_ok=True)
    record.write_text(json.dumps({**written, **todo}))
    record.chmod(0o600)
    return actions


def airflow_cli(env: Mapping[str, str], *args: str, timeout: float = 300) -> str:
    """Run ``airflow ARGS`` to completion; return stdout; raise with the output on failure."""
    res = subprocess.run([str(VENV_BIN / "airflow"), *args], env=dict(env), text=True, capture_output=True,
                         timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"airflow {' '.join(args)} exited {res.returncode}:\n{res.stdout[-4000:]}"
                           f"\n{res.stderr[-4000:]}")
    return res.stdout


class Proc:
    """One long-running command in its own process group, output appended to ``log``."""

    def __init__(self, name: str, cmd: list[str], env: Mapping[str, str], log: Path):
        self.name, self.cmd, self.env, self.log = name, cmd, dict(env), log
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(ROOT))
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, timeout: float = 30.0) -> str:
        """SIGINT to the PID started here, wait; then SIGTERM/SIGKILL to its own process group
        (children that outlived it). Returns how it ended."""
        if self.popen is None:
            return "not started"
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        how = "exited before stop"
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=timeout)
                how = "stopped on SIGINT"
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)
                how = "killed after SIGINT timeout"
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            if not group_alive(pgid):
                break
            how += f"; {sig.name} to leftover process group {pgid}"
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
        return how


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # zombies of the group count as gone
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            fields = (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop_all(procs: Iterable[Proc]) -> dict[str, str]:
    """Stop processes in reverse start order; ``{name: how}``."""
    return {p.name: p.stop() for p in reversed(list(procs))}


class AirflowApi:
    """REST API v2 with a JWT from SimpleAuthManager (``GET /auth/token`` when all users are admins)."""

    def __init__(self, base_url: str, timeout: float = 30.0, credentials: tuple[str, str] | None = None):
        """:param credentials: ``(user, password)`` of SimpleAuthManager (``POST /auth/token``); None:
        every visitor is admin (``GET /auth/token``)."""
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout)
        self.credentials = credentials

    def _token(self) -> httpx.Response:
        if self.credentials:
            user, password = self.credentials
            return self.http.post("/auth/token", json={"username": user, "password": password})
        return self.http.get("/auth/token")

    def close(self) -> None:
        self.http.close()

    def wait_ready(self, timeout: float, procs: Iterable[Proc] = ()) -> float:
        """Wait until the API answers and a token is issued; return seconds waited."""
        t0 = time.monotonic()
        last: object = None
        while time.monotonic() - t0 < timeout:
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited ({p.popen and p.popen.returncode}):\n{p.tail()}")
            try:
                resp = self._token()
                if resp.status_code in (200, 201):
                    self.http.headers["Authorization"] = f"Bearer {resp.json()['access_token']}"
                    if self.http.get("/api/v2/monitor/health").status_code == 200:
                        return time.monotonic() - t0
                last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.TransportError as exc:
                last = exc
            time.sleep(0.5)
        raise TimeoutError(f"Airflow API at {self.base_url} not ready in {timeout}s (last: {last})")

    def request(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.http.request(method, f"/api/v2/{path.lstrip('/')}", **kw)
        if resp.status_code >= 400:
            raise RuntimeError(f"{method} /api/v2/{path} -> HTTP {resp.status_code}: {resp.text[:1000]}")
        return resp.json() if resp.content else None

    def get(self, path: str, **params: Any) -> Any:
        return self.request("GET", path, params=params)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, json=body)

    def patch(self, path: str, body: Any) -> Any:
        return self.request("PATCH", path, json=body)

    # -- the operations of the UI ------------------------------------------------------------------
    def ensure_pool(self, name: str, slots: int, description: str) -> dict[str, Any]:
        try:
            return dict(self.patch(f"pools/{name}", {"name": name, "slots": slots, "description": description,
                                                     "include_deferred": False}))
        except RuntimeError as exc:
            if "404" not in str(exc):
                raise
        return dict(self.post("pools", {"name": name, "slots": slots, "description": description,
                                        "include_deferred": False}))

    def wait_dag(self, dag_id: str, timeout: float = 120) -> dict[str, Any]:
        """Wait until the DAG processor has parsed ``dag_id``; return the DAG."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            resp = self.http.get(f"/api/v2/dags/{dag_id}")
            if resp.status_code == 200:
                return dict(resp.json())
            time.sleep(0.5)
        errors = self.get("importErrors")
        raise TimeoutError(f"DAG {dag_id} not parsed in {timeout}s; import errors: {errors}")

    def set_paused(self, dag_id: str, paused: bool) -> dict[str, Any]:
        return dict(self.patch(f"dags/{dag_id}", {"is_paused": paused}))

    def trigger(self, dag_id: str, *, conf: dict[str, Any], logical_date: str | None = None,
                data_interval: tuple[str, str] | None = None, dag_run_id: str | None = None,
                note: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"logical_date": logical_date, "conf": conf}
        if data_interval:
            body["data_interval_start"], body["data_interval_end"] = data_interval
        if dag_run_id:
            body["dag_run_id"] = dag_run_id
        if note:
            body["note"] = note
        return dict(self.post(f"dags/{dag_id}/dagRuns", body))

    def create_backfill(self, dag_id: str, from_date: str, to_date: str, *, conf: dict[str, Any] | None = None,
                        max_active_runs: int = 1, reprocess_behavior: str = "none") -> dict[str, Any]:
        return dict(self.post("backfills", {
            "dag_id": dag_id, "from_date": from_date, "to_date": to_date, "run_backwards": False,
            "dag_run_conf": conf or {}, "reprocess_behavior": reprocess_behavior,
            "max_active_runs": max_active_runs}))

    def dag_runs(self, dag_id: str, **params: Any) -> list[dict[str, Any]]:
        params.setdefault("limit", 100)
        params.setdefault("order_by", "logical_date")
        return list(self.get(f"dags/{dag_id}/dagRuns", **params)["dag_runs"])

    def wait_runs(self, dag_id: str, run_ids: Iterable[str], timeout: float = 180) -> list[dict[str, Any]]:
        """Wait until every run is success or failed; return them in the given order."""
        ids = list(run_ids)
        deadline = time.monotonic() + timeout
        while True:
            runs = [dict(self.get(f"dags/{dag_id}/dagRuns/{r}")) for r in ids]
            if all(r["state"] in TERMINAL for r in runs):
                return runs
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs not finished in {timeout}s: {[(r['dag_run_id'], r['state']) for r in runs]}")
            time.sleep(1.0)

    def runs_between(self, dag_id: str, first: str, last: str, run_type: str | None = None) -> list[dict[str, Any]]:
        """Runs whose logical date is in [first, last] (ISO strings), in logical-date order."""
        params: dict[str, Any] = {"logical_date_gte": first, "logical_date_lte": last}
        if run_type:
            params["run_type"] = run_type
        return self.dag_runs(dag_id, **params)

    def wait_backfill(self, backfill_id: int, timeout: float = 180) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            b = dict(self.get(f"backfills/{backfill_id}"))
            if b.get("completed_at"):
                return b
            if time.monotonic() > deadline:
                raise TimeoutError(f"backfill {backfill_id} not completed in {timeout}s: {b}")
            time.sleep(1.0)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        return list(self.get(f"dags/{dag_id}/dagRuns/{run_id}/taskInstances")["task_instances"])

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value",
             map_index: int = -1) -> Any:
        entry = self.get(f"dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}",
                         map_index=map_index, deserialize=True)
        value = entry["value"]
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError:
                return value
        return value


# -- make airflow / make stop ----------------------------------------------------------------------

ADMIN = "admin"
WEBHOOK_PATH = "/mailflow-webhooks/resend"
"""The webhook receiver's path in the API server (plugins/mailflow_webhooks.py)."""
POOL = ("email_provider", 4, "Bounds concurrent send tasks; the pacer enforces the rate")
DEMO_CAMPAIGN = "demo_outreach"


def local_dir() -> Path:
    """``.demo/airflow-local`` (or under ``MAILFLOW_DEMO_STATE``): home, PID files, logs, password."""
    from mailflow_dev import devenv

    return devenv.STATE / "airflow-local"


def _secret(path: Path) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_urlsafe(12))
        path.chmod(0o600)
    return path.read_text().strip()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stop_group(pid: int, timeout: float = 45.0, first: signal.Signals = signal.SIGINT) -> str:
    """Stop a process started (by an earlier command) in its own session: ``first`` to ``pid``, wait;
    then SIGTERM/SIGKILL to what is left of its process group. Returns how it ended."""
    from mailflow_dev.devenv import pid_alive

    how = "was not running"
    if pid_alive(pid):
        os.kill(pid, first)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        how = f"stopped on {first.name}" if not pid_alive(pid) else f"still running {timeout:.0f} s after {first.name}"
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        if not group_alive(pid):
            break
        how += f"; {sig.name} to process group {pid}"
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return how


#: The demo campaign's pace: 3 emails a minute (a whole day's window, 1,440 minutes).
DEMO_EMAILS_PER_DAY = 3 * 1440


def demo_zone(now: datetime) -> str:
    """The fixed-offset IANA zone whose local day starts at ``now``'s UTC hour (``UTC`` at 00:xx,
    ``Etc/GMT+5`` at 05:xx = UTC-5, ``Etc/GMT-11`` at 13:xx = UTC+11): the planner spreads a day's
    emails over what is left of its first local day, so in this zone nearly the whole day is left
    and the pace is ``emails_per_day`` / 1,440 a minute from now on, whatever the hour."""
    h = now.astimezone(UTC).hour
    if h == 0:
        return "UTC"
    return f"Etc/GMT+{h}" if h <= 12 else f"Etc/GMT-{24 - h}"


def _demo_campaign(dsn: str) -> None:
    """A scheduled campaign (``demo_outreach``) so the progress page has a planned-versus-sent curve
    that moves as soon as ``dispatch_scheduled_emails`` is unpaused; created once.

    Audience: ``recipients/free_plan_not_recently_mailed.sql``, the free-plan users no other campaign
    had mailed within the contact policy's cooldown when it was created (right after ``make demo``
    about 82% of all free-plan users were, and the policy would defer their emails by a week: a
    flat line). Plan: from now, every day, the whole day, 3 emails a minute
    (:data:`DEMO_EMAILS_PER_DAY`), in the zone of :func:`demo_zone` so the first day is a whole day
    whatever the hour (in UTC a campaign created at 23:00 would squeeze a day's emails into an hour)."""
    import psycopg

    from mailflow.sources import scheduled

    with psycopg.connect(dsn) as conn:
        if conn.execute("select 1 from mail.campaign where name = %s", (DEMO_CAMPAIGN,)).fetchone():
            return
        conn.rollback()
        now = datetime.now(UTC)
        cid = scheduled.create_campaign(conn, {
            "name": DEMO_CAMPAIGN, "template": "outreach", "subject": "{{ user.first_name or 'Hi' }}, new practice packs",
            "from": "Practice Team <practice@mail.example.com>", "recipients_sql": "free_plan_not_recently_mailed",
            "timezone": demo_zone(now), "weekdays": [1, 2, 3, 4, 5, 6, 7], "windows": ["00:00-24:00"],
            "emails_per_day": DEMO_EMAILS_PER_DAY, "start_at": now,
        }, actor="make airflow")
        scheduled.provision(conn, cid, now=now, chunk=5000)


def up(port: int = 8080, timeout: float = 300.0) -> int:
    """``make airflow``: a local Airflow 3 (``airflow standalone``, LocalExecutor) on this checkout.

    * metadata database ``airflow_local`` and the send log ``mailflow_demo`` on the embedded
      PostgreSQL (the send log: ``AIRFLOW_CONN_SEND_LOG_DB`` instead when set), migrated, with the
      demo data (loaded once, as ``make demo`` does, under the demo's lock) and a small scheduled
      campaign;
    * the emulator as the email API (outbox and idempotency memory of that database, as in
      ``make demo``), API key in ``.demo/emulator.key``; it pushes each email's lifecycle (the demo's
      seeded rates, :data:`mailflow_dev.webhooks.DEMO_LIFECYCLE`) as signed webhooks to the API
      server's plugin, ``/mailflow-webhooks/resend``, with the secret in ``.demo/webhook.secret``
      (its control API is on, loopback only: ``make demo`` reads its webhook accounting);
    * the package's DAGs and plugins, the ``email_provider`` pool, and the four connections in the
      metadata database (Admin -> Connections shows them, an edit there is kept across restarts,
      the "Test" button is on: :func:`sync_connections`); DAGs are created paused (unpause one in
      the UI to send), and on a restart it says which ones are not;
    * SimpleAuthManager with one user, ``admin``, password generated once into
      ``.demo/airflow-local/admin.password``.

    Both long-running processes run in sessions of their own with PID files next to the home, so
    :func:`down` (``make stop``) stops exactly them. Prints the URL and the login. Returns the exit code.
    """
    import psycopg

    from mailflow.store.migrate import migrate
    from mailflow_dev import devenv
    from mailflow_dev.demo.loader import load_demo_data
    from mailflow_dev.webhooks import emulator_flags, webhook_secret

    here = local_dir()
    if (pid := devenv.local_airflow_pid()) is not None:
        print(f"airflow standalone already running (pid {pid}):")
        print((here / "banner.txt").read_text() if (here / "banner.txt").exists() else "")
        return 0
    with devenv.exclusive("airflow", what="make airflow"):
        here.mkdir(parents=True, exist_ok=True)
        if not _port_free(port):
            print(f"make airflow: port {port} is in use; choose another with AIRFLOW_PORT=NNNN", file=sys.stderr)
            return 2
        embedded = devenv.embedded_dsn()
        print(f"embedded PostgreSQL: {devenv.STATE / 'pgdata'}")
        meta_dsn = devenv.create_database(embedded, "airflow_local")
        external = os.environ.get("AIRFLOW_CONN_SEND_LOG_DB")
        send_log_dsn = (devenv.dsn_from_airflow_conn(external) if external
                        else devenv.create_database(embedded, "mailflow_demo"))
        with devenv.exclusive("demo", wait=900), psycopg.connect(send_log_dsn, autocommit=True) as conn:
            migrate(conn)
            anchor = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
            print(f"send log: {send_log_dsn}; demo data: {load_demo_data(conn, anchor=anchor)}")
            state = devenv.database_state(conn)
        _demo_campaign(send_log_dsn)

        api_key = "re_demo_" + _secret(devenv.STATE / "emulator.key")[:16]
        hook_secret = webhook_secret(devenv.STATE / "webhook.secret")
        webhook_url = f"http://127.0.0.1:{port}{WEBHOOK_PATH}"
        emu_port = _stable_port(here / "emulator.port")
        emulator = Proc("emulator", [sys.executable, "-m", "mailflow.cli", "emulator", "--port", str(emu_port),
                                     "--outbox", str(state / "outbox.jsonl"), "--idempotency-store",
                                     str(state / "idempotency.jsonl"), "--api-key", api_key, "--rate-limit", "10",
                                     *emulator_flags(webhook_url, hook_secret)],
                        {**os.environ, "PYTHONUNBUFFERED": "1"}, here / "emulator.log").start()
        (here / "emulator.pid").write_text(str(emulator.pid))
        emulator_url = f"http://127.0.0.1:{emu_port}"
        (here / "emulator.url").write_text(f"{emulator_url}\n{state}\n")  # make demo on this database uses it
        password = _secret(here / "admin.password")
        (here / "passwords.json").write_text(json.dumps({ADMIN: password}))
        # no AIRFLOW_CONN_* here: the connections live in the metadata database, where people look
        env = airflow_env(here / "home", meta_dsn, {}, api_port=port, extra={
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "False",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(here / "passwords.json"),
            "MAILFLOW_DEMO_STATE": str(devenv.STATE),
            **{var: os.environ.get(var, value) for var, value in DEMO_GUARD.items()},
        })
        try:
            airflow_cli(env, "db", "migrate", timeout=600)
            synced = sync_connections(env, mailflow_connections(
                send_log_dsn, emulator_url, api_key, _secret(devenv.STATE / "unsubscribe.secret"),
                webhook_secret=hook_secret),
                here / "connections.json")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"make airflow: {exc}", file=sys.stderr)
            down()
            return 1
        print("connections (Admin -> Connections): " + ", ".join(f"{k} {v}" for k, v in synced.items()))
        standalone = Proc("airflow standalone", [str(VENV_BIN / "airflow"), "standalone"], env,
                          here / "standalone.log").start()
        devenv.airflow_pidfile().write_text(str(standalone.pid))
        print(f"airflow standalone starting (pid {standalone.pid}, log {standalone.log}) ...")
        api = AirflowApi(f"http://127.0.0.1:{port}", credentials=(ADMIN, password))
        try:
            took = api.wait_ready(timeout, [standalone, emulator])
            api.ensure_pool(*POOL)
            dags = [api.wait_dag(p.stem, timeout=120) for p in sorted((ROOT / "dags").glob("*.py"))]
        except (RuntimeError, TimeoutError) as exc:
            print(f"make airflow: {exc}", file=sys.stderr)
            down()
            return 1
        finally:
            api.close()
        banner = (f"Airflow UI:        http://127.0.0.1:{port}/   login: {ADMIN} / {password}\n"
                  f"campaign progress: http://127.0.0.1:{port}/plugin/mailflow (Browse > Mail campaigns)\n"
                  f"email API:         {emulator_url} (emulator, API key in {devenv.STATE / 'emulator.key'})\n"
                  f"webhooks:          {webhook_url} (the emulator pushes each email's outcomes there, "
                  f"signed; connection mail_webhook)\n"
                  f"send log:          {send_log_dsn}\n"
                  f"stop everything:   make stop")
        (here / "banner.txt").write_text(banner + "\n")
        print(f"ready in {took:.0f} s; {paused_summary(dags)}")
        print(banner)
    return 0


def paused_summary(dags: Iterable[Mapping[str, Any]]) -> str:
    """What the DAGs will do, from their ``is_paused`` as the API reports it (a restart keeps
    what a person unpaused): ``"DAGs paused: a, b (unpause one to send)"``, plus
    ``"; unpaused (they run on their schedules): c"`` when some are not."""
    paused = sorted(d["dag_id"] for d in dags if d["is_paused"])
    active = sorted(d["dag_id"] for d in dags if not d["is_paused"])
    parts = [f"DAGs paused: {', '.join(paused)} (unpause one to send)"] if paused else []
    if active:
        parts.append(f"unpaused (they run on their schedules): {', '.join(active)}")
    return "; ".join(parts) or "no DAGs"


def _stable_port(path: Path) -> int:
    """The port kept in ``path`` when it is still free, else a new free one (kept there): the
    emulator keeps its address across restarts, so the connection written for it stays right."""
    try:
        port = int(path.read_text().strip())
        if _port_free(port):
            return port
    except (OSError, ValueError):
        pass
    port = free_port()
    path.write_text(f"{port}\n")
    return port


def down() -> dict[str, str]:
    """``make stop`` (the Airflow part): SIGINT to ``airflow standalone`` (it stops its scheduler,
    API server, DAG processor and triggerer on SIGINT, not on SIGTERM), then the emulator; what
    outlives that in their process groups is terminated. Returns ``{name: how}``."""
    here = local_dir()
    out: dict[str, str] = {}
    for name, pidfile, first in (("airflow standalone", here / "standalone.pid", signal.SIGINT),
                                 ("emulator", here / "emulator.pid", signal.SIGINT)):
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            continue
        print(f"stopping {name} (pid {pid}, {first.name}) ...", flush=True)
        # standalone stops its components one by one; on a loaded machine that can take a minute
        out[name] = f"pid {pid}: " + stop_group(pid, timeout=120.0, first=first)
        pidfile.unlink(missing_ok=True)
    (here / "banner.txt").unlink(missing_ok=True)
    (here / "emulator.url").unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="make airflow / make stop: a local Airflow 3 for this checkout")
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start (or show) the local Airflow")
    u.add_argument("--port", type=int, default=int(os.environ.get("AIRFLOW_PORT") or 8080))
    u.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the API server")
    sub.add_parser("down", help="stop the local Airflow and its emulator")
    args = p.parse_args(argv)
    if args.cmd == "up":
        return up(args.port, args.timeout)
    for name, how in down().items():
        print(f"{name}: {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
