"""Test helpers: run the emulator as a real subprocess (uvicorn, real sockets) and drive it.

    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=0) as emu:
        httpx.post(f"{emu.base_url}/emails", ...)
        emu.configure(error_rate=1.0); emu.stats(); emu.read_outbox(); emu.reset()

Webhooks: :meth:`EmulatorProcess.with_webhooks` points the emulator's pre-registered endpoint at a
URL; :class:`WebhookSink` is a small real receiver that verifies and records what arrives:

    with WebhookSink([SECRET]) as sink, EmulatorProcess.with_webhooks(sink.url, [SECRET]) as emu:
        ...send...; totals = emu.wait_webhooks(); sink.requests
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from standardwebhooks.webhooks import Webhook, WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

DEFAULT_API_KEY = "re_test_emulator"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (prefer ``port=0``, which has no race)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _flag_args(flags: dict[str, Any]) -> list[str]:
    """``rate_limit=5`` -> ``--rate-limit 5``; True -> ``--flag``; False -> ``--no-flag``; lists repeat."""
    out: list[str] = []
    for key, value in flags.items():
        opt = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            out.append(opt if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list | tuple):
            for item in value:
                out += [opt, str(item)]
        else:
            out += [opt, str(value)]
    return out


class EmulatorProcess:
    """``mailflow emulator`` in a subprocess, with the control API on by default.

    ``flags`` are CLI options by field name (``rate_limit=10``, ``bounce=["a@x.org"]``,
    ``store_bodies=False``). Output goes to ``<outbox>.log``. On exit: SIGINT, then kill after 5 s.
    """

    def __init__(self, port: int = 0, outbox: str | Path | None = None, host: str = "127.0.0.1",
                 api_key: str = DEFAULT_API_KEY, startup_timeout: float = 15.0, **flags: Any):
        if outbox is None:
            outbox = Path(tempfile.mkdtemp(prefix="mailflow-emulator-")) / "outbox.jsonl"
        self.outbox_path = Path(outbox)
        self.log_path = self.outbox_path.with_suffix(".log")
        self.host, self.port, self.api_key = host, port, api_key
        self.startup_timeout = startup_timeout
        flags.setdefault("control", True)
        self.flags = flags
        self.base_url = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self._client: httpx.Client | None = None

    def start(self) -> EmulatorProcess:
        self.outbox_path.parent.mkdir(parents=True, exist_ok=True)
        # the emulator's own command (what `mailflow emulator` runs) without loading the product's CLI
        cmd = [sys.executable, "-c", "from mailflow.emulator.cli import emulator; emulator.main(prog_name='mailflow emulator')",
               "--host", self.host, "--port", str(self.port),
               "--outbox", str(self.outbox_path), "--api-key", self.api_key, *_flag_args(self.flags)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"emulator exited with {self.proc.returncode}: {self.log_text()}")
            for line in self.log_text().splitlines():
                if "listening on " in line:
                    self.base_url = line.split("listening on ", 1)[1].strip()
            if self.base_url:
                try:
                    if httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200:
                        self._client = httpx.Client(base_url=self.base_url, timeout=10.0)
                        return self
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"emulator did not start in {self.startup_timeout}s: {self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None

    @classmethod
    def with_webhooks(cls, url: str, secrets: list[str] | None = None, **flags: Any) -> EmulatorProcess:
        """An emulator (rate limit off unless given) whose pre-registered webhook endpoint is ``url``,
        signed with ``secrets`` (``whsec_...``; none: one is generated, see :meth:`webhook_secret`).
        Any other config field can be given as a flag (``webhook_time_scale=0.0001``)."""
        flags.setdefault("rate_limit", 0)
        return cls(webhook_url=url, webhook_secrets=list(secrets or []), **flags)

    def __enter__(self) -> EmulatorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- control API ---------------------------------------------------------------------------
    def _control(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        assert self._client is not None, "emulator not started"
        resp = self._client.request(method, f"/_emulator/{path}", json=body)
        resp.raise_for_status()
        return dict(resp.json())

    def configure(self, **settings: Any) -> dict[str, Any]:
        """Partial runtime update (``POST /_emulator/config``); returns the full settings."""
        return self._control("POST", "config", settings)

    def stats(self) -> dict[str, Any]:
        return self._control("GET", "stats")

    def reset(self, keep_config: bool = False) -> None:
        """Clear state and stats, truncate the outbox, restore the startup settings."""
        self._control("POST", "reset", {"keep_config": keep_config})

    def read_outbox(self) -> list[dict[str, Any]]:
        """The outbox lines, parsed, in write order."""
        if not self.outbox_path.exists():
            return []
        return [json.loads(line) for line in self.outbox_path.read_text().splitlines() if line.strip()]

    def webhooks(self, limit: int = 1000, offset: int = 0, **filters: str) -> dict[str, Any]:
        """``GET /_emulator/webhooks``: ``{"totals", "messages", "has_more"}`` (filters: kind, final,
        email_id, svix_id, type)."""
        assert self._client is not None, "emulator not started"
        resp = self._client.get("/_emulator/webhooks", params={"limit": limit, "offset": offset, **filters})
        resp.raise_for_status()
        return dict(resp.json())

    def webhook_messages(self, **filters: str) -> list[dict[str, Any]]:
        """Every recorded message and copy matching ``filters``, in creation order."""
        out: list[dict[str, Any]] = []
        while True:
            page = self.webhooks(limit=10000, offset=len(out), **filters)
            out += page["messages"]
            if not page["has_more"]:
                return out

    def wait_webhooks(self, timeout: float = 30.0) -> dict[str, Any]:
        """Wait until no message is pending or in flight; return the totals. TimeoutError if not."""
        deadline = time.monotonic() + timeout
        while True:
            totals = dict(self.webhooks(limit=0)["totals"])
            if totals["pending"] == 0 and totals["in_flight"] == 0:
                return totals
            if time.monotonic() > deadline:
                raise TimeoutError(f"webhooks still pending after {timeout}s: {totals}")
            time.sleep(0.05)

    def webhook_secret(self, endpoint_id: str | None = None) -> str:
        """The newest signing secret of an endpoint (default: the first, the pre-registered one)."""
        assert self._client is not None, "emulator not started"
        headers = self.auth_headers
        if endpoint_id is None:
            listed = self._client.get("/webhooks", headers=headers)
            listed.raise_for_status()
            endpoint_id = listed.json()["data"][0]["id"]
        resp = self._client.get(f"/webhooks/{endpoint_id}", headers=headers)
        resp.raise_for_status()
        return str(resp.json()["signing_secret"])

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


@dataclass
class SinkRequest:
    """One request a :class:`WebhookSink` received: the Svix headers, the raw body, whether a secret
    verified it (``error``: why not), the status answered and when (epoch seconds, on arrival)."""

    svix_id: str
    timestamp: str
    signature: str
    body: bytes
    verified: bool
    error: str | None
    status: int
    at: float

    @property
    def envelope(self) -> dict[str, Any]:
        """The parsed body (``{"type", "created_at", "data"}``)."""
        return dict(json.loads(self.body))


class WebhookSink:
    """A small real webhook receiver for tests: uvicorn on a background thread, every request verified
    with ``standardwebhooks`` against ``secrets`` (svix-* headers read as webhook-*; any secret
    may match) and recorded in :attr:`requests`.

    The answer is ``answer(request)`` if given, else 200 when verified and 401 when not;
    ``delay_seconds`` (a number or ``f(request)``) is slept before answering. :meth:`stop` then
    :meth:`start` again keeps the port: in between, connections are refused (a receiver that is down).
    """

    def __init__(self, secrets: list[str] | tuple[str, ...] = (), host: str = "127.0.0.1", port: int = 0,
                 answer: Callable[[SinkRequest], int] | None = None,
                 delay_seconds: float | Callable[[SinkRequest], float] = 0.0):
        self.secrets = list(secrets)
        self.host, self.port = host, port
        self.answer, self.delay_seconds = answer, delay_seconds
        self.requests: list[SinkRequest] = []
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/webhooks/resend"

    def verify(self, body: bytes, svix_id: str, timestamp: str, signature: str) -> str | None:
        """None when a secret verifies the request, else the last verification error."""
        error = "no secret configured"
        headers = {"webhook-id": svix_id, "webhook-timestamp": timestamp, "webhook-signature": signature}
        for secret in self.secrets:
            try:
                Webhook(secret).verify(body, headers, json_parse=False)
                return None
            except (WebhookVerificationError, ValueError) as exc:
                error = str(exc) or type(exc).__name__
        return error

    async def _handle(self, request: Request) -> Response:
        body = await request.body()
        h = request.headers
        svix_id, ts, sig = h.get("svix-id", ""), h.get("svix-timestamp", ""), h.get("svix-signature", "")
        error = self.verify(body, svix_id, ts, sig)
        rec = SinkRequest(svix_id, ts, sig, body, error is None, error, 0, time.time())
        rec.status = self.answer(rec) if self.answer is not None else (200 if error is None else 401)
        delay = self.delay_seconds(rec) if callable(self.delay_seconds) else self.delay_seconds
        with self._lock:
            self.requests.append(rec)
        if delay > 0:
            await asyncio.sleep(delay)
        return Response(status_code=rec.status)

    def start(self) -> WebhookSink:
        """Listen (on the same port as before after a :meth:`stop`) and serve on a thread."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(1024)
        self.port = int(sock.getsockname()[1])
        self._sock = sock
        app = Starlette(routes=[Route("/{path:path}", self._handle, methods=["POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                                     timeout_graceful_shutdown=1))
        server = self._server
        self._thread = threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True,
                                        name="webhook-sink")
        self._thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("webhook sink did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stop serving and close the socket: further connections are refused until :meth:`start`."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._sock is not None:
            self._sock.close()
        self._server = self._thread = self._sock = None

    def received(self, verified: bool | None = True) -> list[SinkRequest]:
        """A snapshot of the requests (default: the verified ones only; None: all)."""
        with self._lock:
            return [r for r in self.requests if verified is None or r.verified is verified]

    def __enter__(self) -> WebhookSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
