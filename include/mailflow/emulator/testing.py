"""Test helpers: run the emulator as a real subprocess (uvicorn, real sockets) and drive it.

    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=0) as emu:
        httpx.post(f"{emu.base_url}/emails", ...)
        emu.configure(error_rate=1.0); emu.stats(); emu.read_outbox(); emu.reset()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

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
    """``python -m mailflow.emulator`` in a subprocess, with the control API on by default.

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
        cmd = [sys.executable, "-m", "mailflow.emulator", "--host", self.host, "--port", str(self.port),
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

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}
