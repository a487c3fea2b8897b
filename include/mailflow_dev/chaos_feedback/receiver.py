"""The standalone webhook receiver as deployed (``mailflow webhooks serve --port P --dsn
DSN``, secrets in ``MAILFLOW_WEBHOOK_SECRETS``) in a subprocess that can be SIGKILLed and restarted
on the same port, so the provider's endpoint URL stays valid across restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mailflow.emulator.testing import free_port


class ReceiverProcess:
    """One receiver process at a time on ``port`` (a free one by default).

    ``url`` is the endpoint the provider posts to (``http://127.0.0.1:<port>/resend``). Output goes
    to ``log_path`` (appended across restarts). ``starts`` counts the processes started.
    """

    def __init__(self, dsn: str, secrets: list[str], log_path: Path, port: int | None = None,
                 extra_args: list[str] | None = None, startup_timeout: float = 30.0):
        self.dsn, self.secrets, self.log_path = dsn, secrets, log_path
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/resend"

    def start(self, wait: bool = True) -> ReceiverProcess:
        """Start a process (the previous one must be gone); with ``wait``, return once it answers
        HTTP. RuntimeError if it exits or does not answer within ``startup_timeout`` seconds."""
        assert self.proc is None or self.proc.poll() is not None, "receiver still running"
        env = os.environ.copy()
        env["MAILFLOW_WEBHOOK_SECRETS"] = " ".join(self.secrets)
        cmd = [sys.executable, "-m", "mailflow.cli", "webhooks", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--dsn", self.dsn, *self.extra_args]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self) -> float:
        """Block until the receiver answers ``GET /healthz`` (any status: a 503 there still proves
        the server is up); returns the seconds waited."""
        assert self.proc is not None
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.startup_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"receiver exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    pass
                httpx.get(f"{self.base_url}/healthz", timeout=2.0)
                return time.monotonic() - t0
            except (OSError, httpx.HTTPError):
                time.sleep(0.05)
        raise RuntimeError(f"receiver did not answer within {self.startup_timeout} s: {self.log_tail()}")

    def kill(self) -> bool:
        """SIGKILL the running process (no cleanup, no graceful shutdown); True if one was running."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        return True

    def stop(self) -> None:
        """SIGTERM (graceful), then SIGKILL after 10 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def __enter__(self) -> ReceiverProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
