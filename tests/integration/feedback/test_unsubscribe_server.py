"""The standalone unsubscribe server under slow and idle clients: a real ``python -m
mailflow.feedback.unsubscribe_app`` subprocess (uvicorn) with a low file-descriptor limit, raw
sockets that send half a request, and a mail provider's one-click POST that must still get 200."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
import uvicorn
from conftest import UNSUBSCRIBE_SECRET
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from mailflow.emulator.testing import free_port
from mailflow.feedback.unsubscribe_server import ServerLimits, guarded_protocol
from mailflow.feedback.unsubscribe_tokens import signer_from_secret

SIGNER = signer_from_secret(UNSUBSCRIBE_SECRET)
HALF_REQUEST = b"POST /u/abc HTTP/1.1\r\nHost: mail.example.com\r\nContent-Type: application/x-www-"


def _nofile(limit: int) -> Callable[[], None]:
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    return set_limit


@contextmanager
def server(db_dsn: str, tmp_path: Path, *args: str, nofile: int | None = None) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "MAILFLOW_UNSUBSCRIBE_SECRET": UNSUBSCRIBE_SECRET}
    env.pop("AIRFLOW_CONN_MAIL_UNSUBSCRIBE", None)
    with open(tmp_path / "unsubscribe.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mailflow.cli", "unsubscribe", "serve", "--port", str(port),
                                 "--dsn", db_dsn, *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=_nofile(nofile) if nofile else None)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        yield base
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stalled(base: str, n: int, data: bytes = HALF_REQUEST) -> list[socket.socket]:
    port = int(base.rsplit(":", 1)[1])
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(data)
        out.append(s)
    return out


def answer_of(s: socket.socket, within: float) -> bytes:
    """What the server sends before it closes ``s`` (b"" if it just closes); fails if it keeps the
    connection open longer than ``within`` seconds."""
    s.settimeout(within)
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(4096)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the server kept a stalled connection open for {within} s (got {got!r})")


def one_click(base: str, user_id: int, timeout: float = 5.0) -> tuple[int, float]:
    started = time.monotonic()
    r = httpx.post(f"{base}/u/{SIGNER.token(user_id, 'upgrade_offer')}", content=b"List-Unsubscribe=One-Click",
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=timeout)
    return r.status_code, time.monotonic() - started


def test_unsubscribe_endpoint_survives_slow_clients(db: psycopg.Connection, db_dsn: str, tmp_path: Path) -> None:
    # 300 connections that each send half a request and then nothing, against a server allowed 256
    # file descriptors (the field case: 1,100 against 1,024): a one-click POST still gets its 200
    with server(db_dsn, tmp_path, nofile=256) as base:
        sockets = stalled(base, 300)
        try:
            time.sleep(0.5)  # the server has accepted what it can
            status, took = one_click(base, 7)
            assert (status, took < 3.0) == (200, True), took
            status, _ = one_click(base, 8)  # and the next one too: nothing is left wedged
            assert status == 200
        finally:
            for s in sockets:
                s.close()
    assert db.execute("select user_id, scope, source from mail.suppression order by user_id").fetchall() == [
        (7, "upgrade_offer", "one_click"), (8, "upgrade_offer", "one_click")]


def test_unsubscribe_endpoint_times_out_half_sent_requests(db: psycopg.Connection, db_dsn: str,
                                                           tmp_path: Path) -> None:
    with server(db_dsn, tmp_path, "--header-timeout", "1", "--body-timeout", "1", "--keep-alive", "5",
                "--max-header-bytes", "2048") as base:
        token = SIGNER.token(9, "upgrade_offer")
        [head] = stalled(base, 1)  # half the headers
        [body] = stalled(base, 1, f"POST /u/{token} HTTP/1.1\r\nHost: a\r\nContent-Type: "
                                  "application/x-www-form-urlencoded\r\nContent-Length: 26\r\n\r\nList-".encode())
        [big] = stalled(base, 1, b"GET /healthz HTTP/1.1\r\nHost: a\r\n" + b"X-Pad: " + b"a" * 4000 + b"\r\n")
        [kept] = stalled(base, 1, b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        kept.settimeout(3)
        first = b""
        while not first.endswith(b'{"status":"ok"}'):  # the whole first answer, however it is split
            first += kept.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        kept.sendall(HALF_REQUEST)  # the next request on a kept-alive connection, half sent
        try:
            assert answer_of(head, 3).startswith(b"HTTP/1.1 408")
            assert answer_of(body, 3) == b""  # closed: the app saw a disconnect and changed nothing
            assert answer_of(big, 3).startswith(b"HTTP/1.1 431")
            assert answer_of(kept, 3).startswith(b"HTTP/1.1 408")
        finally:
            for s in (head, body, big, kept):
                s.close()
        assert [one_click(base, uid)[0] for uid in (10, 11)] == [200, 200]
    assert db.execute("select user_id from mail.suppression order by user_id").fetchall() == [(10,), (11,)]


@contextmanager
def in_process(protocol: type[asyncio.Protocol], limits: ServerLimits, hold: threading.Event | None = None
               ) -> Iterator[str]:
    """A uvicorn server in a thread with ``protocol`` guarded by ``limits``; ``POST /slow`` waits
    for ``hold`` (a request being answered)."""
    async def echo(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"ok {len(await request.body())}")

    async def slow(request: Request) -> PlainTextResponse:
        while hold is not None and not hold.is_set():
            await asyncio.sleep(0.02)
        return PlainTextResponse("slow")

    app = Starlette(routes=[Route("/", echo, methods=["GET", "POST"]), Route("/slow", slow, methods=["POST"])])
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, port=port, http=guarded_protocol(protocol, limits),
                                        log_level="warning", loop="asyncio"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if srv.started:
                break
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        if hold is not None:
            hold.set()
        srv.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("protocol", [H11Protocol, HttpToolsProtocol], ids=["h11", "httptools"])
def test_slow_client_limits_hold_under_either_http_parser(protocol: type[asyncio.Protocol]) -> None:
    # uvicorn picks httptools when it is installed, else h11: the guard must hold with either
    limits = ServerLimits(header_timeout=1, body_timeout=1, max_header_bytes=2048, max_connections=20)
    with in_process(protocol, limits) as base:
        [head] = stalled(base, 1)
        [body] = stalled(base, 1, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc")
        [big] = stalled(base, 1, b"GET / HTTP/1.1\r\nHost: a\r\nX-Pad: " + b"a" * 4000)
        assert answer_of(head, 3).startswith(b"HTTP/1.1 408")
        assert answer_of(body, 3) == b""
        assert answer_of(big, 3).startswith(b"HTTP/1.1 431")
        idle = stalled(base, 40)  # twice the cap: the oldest half-sent ones make room
        try:
            time.sleep(0.3)
            r = httpx.post(f"{base}/", content=b"List-Unsubscribe=One-Click", timeout=3)
            assert (r.status_code, r.text) == (200, "ok 26")
        finally:
            for s in (head, body, big, *idle):
                s.close()


def test_a_full_server_never_cuts_a_request_it_is_answering() -> None:
    # every one of the 16 connections is being answered: a 17th gets 503 + Retry-After, and the 16 finish
    hold = threading.Event()
    limits = ServerLimits(header_timeout=5, body_timeout=5, max_connections=16)
    with in_process(HttpToolsProtocol, limits, hold) as base:
        busy = stalled(base, 16, b"POST /slow HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
        try:
            time.sleep(0.3)
            [extra] = stalled(base, 1, b"")
            refused = answer_of(extra, 3)
            assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 120" in refused
            hold.set()
            answers = []
            for s in busy:
                s.settimeout(3)
                got = b""
                while not got.endswith(b"slow"):
                    got += s.recv(4096)
                answers.append(got.split(b" ", 2)[1])
            assert answers == [b"200"] * 16
        finally:
            for s in busy:
                s.close()
