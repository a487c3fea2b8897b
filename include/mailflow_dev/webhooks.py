"""Webhooks on a laptop: the standalone receiver as a process, the emulator's lifecycle for the demos,
and the emulator's accounting of what it pushed, checked against the send log.

``make demo`` runs :class:`ReceiverProcess` (``mailflow webhooks serve``) and an emulator
that pushes each accepted email's lifecycle (:data:`DEMO_LIFECYCLE`) to it, signed with a secret
generated once into ``.demo/webhook.secret`` (:func:`webhook_secret`); ``make airflow`` points its
emulator at the API server's plugin instead. After a run, :func:`wait_acknowledged` waits until the
emulator has nothing pending and :func:`lost` counts the events it saw acknowledged that the database
does not hold (the product's promise: 0).
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from mailflow.emulator.testing import free_port
from mailflow.store.sql import query

DEMO_LIFECYCLE: dict[str, float] = {
    "hard_bounce_rate": 0.02,  # under the demos' guard line (DEMO_GUARD, 5 %): the demo keeps sending
    "soft_bounce_rate": 0.01,
    "delayed_rate": 0.01,
    "complaint_rate": 0.0005,  # a complaint or two per few thousand, under the demos' 0.3 % line
    "open_rate": 0.35,
    "click_rate": 0.08,
    "event_spread_seconds": 2.0,  # opens and clicks come a little after the delivery, as they do
}
"""The emulator's seeded lifecycle in the demos (fractions of the emails it accepts; see
:class:`mailflow.emulator.config.EmulatorConfig`). The rates are drawn per email id, so the counts
vary a little between runs; the emulator's accounting and the database agree exactly."""

#: The reputation guard's lines in the demos (``MAILFLOW_GUARD_*``, set by ``make demo`` and ``make airflow``
#: unless already set): the demo list bounces at about 2 % and complains at about 0.05 %, above the guard's
#: defaults (2 % and 0.04 % lines: a list that stays near them trips), so the demos judge it against the
#: published account lines (SES: review at 5 % bounces; Gmail: never 0.3 % complaints) and keep sending hour
#: after hour. A real deployment keeps the defaults (docs/operations.md, "Reputation guard").
DEMO_GUARD = {"MAILFLOW_GUARD_HARD_BOUNCE_RATE": "0.05", "MAILFLOW_GUARD_COMPLAINT_RATE": "0.003"}

RECEIVER_PATH = "/resend"


def webhook_secret(path: Path) -> str:
    """The signing secret kept in ``path`` (``whsec_`` + base64 of 24 random bytes, Svix's format),
    generated on first use with mode 0600; never printed or logged."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("whsec_" + base64.b64encode(os.urandom(24)).decode())
        path.chmod(0o600)
    return path.read_text().strip()


def emulator_flags(url: str, secret: str) -> list[str]:
    """The emulator's command-line flags for pushing the demo lifecycle to ``url``, signed with ``secret``."""
    flags = ["--webhook-url", url, "--webhook-secret", secret, "--control"]
    for name, value in DEMO_LIFECYCLE.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


class ReceiverProcess:
    """``mailflow webhooks serve`` on a free loopback port against ``dsn``, the secret
    in its environment (``MAILFLOW_WEBHOOK_SECRETS``, never on the command line), output to ``log``.

    ``url`` is the endpoint to register (``http://127.0.0.1:<port>/resend``). On exit: SIGINT
    (uvicorn drains, the group writer commits what it holds), SIGKILL after ``stop_timeout`` seconds.
    """

    def __init__(self, dsn: str, secret: str, log: Path, *, sweep_every: float = 1.0,
                 startup_timeout: float = 20.0, stop_timeout: float = 15.0):
        self.dsn, self.secret, self.log = dsn, secret, log
        self.sweep_every, self.startup_timeout, self.stop_timeout = sweep_every, startup_timeout, stop_timeout
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.how_stopped = "not started"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.base_url + RECEIVER_PATH

    def start(self) -> ReceiverProcess:
        """Start it and wait for ``GET /healthz``. :raises RuntimeError: with the log's tail if it
        exits or does not answer within ``startup_timeout`` seconds."""
        self.port = free_port()
        env = {**os.environ, "MAILFLOW_WEBHOOK_SECRETS": self.secret, "PYTHONUNBUFFERED": "1"}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mailflow.cli", "webhooks", "serve", "--port", str(self.port), "--dsn", self.dsn,
                 "--sweep-every", str(self.sweep_every)],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"webhook receiver exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.base_url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"webhook receiver did not answer in {self.startup_timeout:.0f} s:\n{self.tail()}")

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> str:
        """SIGINT, wait; kill if it is still running. Returns how it ended."""
        if self.proc is None:
            return self.how_stopped
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=self.stop_timeout)
                self.how_stopped = "stopped on SIGINT"
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
                self.how_stopped = f"killed {self.stop_timeout:.0f} s after SIGINT"
        else:
            self.how_stopped = f"exited early with {self.proc.returncode}"
        self.proc = None
        return self.how_stopped

    def __enter__(self) -> ReceiverProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Accounting:
    """The emulator's count of what it pushed (``GET /_emulator/webhooks`` totals).

    :param messages: genuine messages created (one per event and endpoint).
    :param acknowledged: of those, answered 2xx by the receiver.
    :param pending: not final yet (waiting for an attempt or a retry, or in flight).
    :param given_up: the retry schedule ran out (the provider marks them failed): lost to the product.
    :param by_type: messages per event type (``{"email.delivered": n, ...}``).
    :param waited: seconds :func:`wait_acknowledged` waited.
    """

    messages: int
    acknowledged: int
    pending: int
    given_up: int
    by_type: dict[str, int]
    waited: float


def _totals(emulator_url: str) -> dict[str, Any]:
    resp = httpx.get(f"{emulator_url}/_emulator/webhooks", params={"limit": 0}, timeout=10.0)
    resp.raise_for_status()
    return dict(resp.json()["totals"])


def wait_acknowledged(emulator_url: str, timeout: float) -> Accounting:
    """Wait (at most ``timeout`` seconds) until the emulator at ``emulator_url`` (control API on) has
    no webhook pending or in flight; return its accounting either way (``pending`` > 0: not settled)."""
    t0 = time.monotonic()
    while True:
        totals = _totals(emulator_url)
        pending = int(totals["pending"])
        if (pending == 0 and totals["in_flight"] == 0) or time.monotonic() - t0 > timeout:
            return Accounting(int(totals["messages"]), int(totals["acknowledged"]), pending,
                              int(totals["given_up"]) + int(totals["endpoint_gone"]),
                              dict(totals["events_by_type"]), time.monotonic() - t0)
        time.sleep(0.1)


def acknowledged_ids(emulator_url: str) -> list[str]:
    """The svix ids of every genuine message the emulator saw acknowledged (all of its records)."""
    ids: list[str] = []
    with httpx.Client(base_url=emulator_url, timeout=30.0) as http:
        while True:
            resp = http.get("/_emulator/webhooks", params={"limit": 10000, "offset": len(ids), "kind": "genuine",
                                                          "final": "acknowledged"})
            resp.raise_for_status()
            page = resp.json()
            ids += [m["svix_id"] for m in page["messages"]]
            if not page["has_more"]:
                return ids


def lost(conn: psycopg.Connection, svix_ids: list[str]) -> int:
    """How many of ``svix_ids`` (acknowledged by the receiver, as the provider saw it) are not in
    ``mail.webhook_event``: acknowledged events the product lost. 0 is the promise."""
    stored = conn.execute(query("report", "webhooks_stored"), {"svix_ids": svix_ids}).fetchone()
    return len(set(svix_ids)) - int(stored[0] if stored else 0)


def wait_applied(conn: psycopg.Connection, timeout: float) -> tuple[int, float]:
    """Wait (at most ``timeout`` seconds) until every stored webhook event is applied to the send log
    (an event that arrived before the sender recorded its email's id waits for the receiver's sweep).
    Returns ``(still unapplied, seconds waited)``."""
    t0 = time.monotonic()
    while True:
        row = conn.execute(query("report", "webhook_backlog")).fetchone()
        backlog = int(row[0]) if row else 0
        if backlog == 0 or time.monotonic() - t0 > timeout:
            return backlog, time.monotonic() - t0
        time.sleep(0.2)
