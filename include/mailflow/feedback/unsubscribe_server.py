"""Serving the standalone unsubscribe endpoint so that slow or idle clients cannot hold it down.

The endpoint is public: anyone can open connections to it. uvicorn times out idle keep-alive
connections, but not a request that is half sent: a client that opens a connection and sends
part of the headers (or the headers and then part of the body) holds a socket and a file
descriptor for as long as it likes. With enough of them the process reaches its file-descriptor
limit and every new connection, including a mail provider's one-click POST, is refused
("slowloris"). uvicorn has no header or body read timeout, and its ``limit_concurrency`` counts
those stalled connections too, so it would answer the one-click POST 503.

:func:`guarded_protocol` wraps uvicorn's HTTP protocol (httptools or h11) with what it lacks:

* a **header timeout**: the request line and headers must arrive within ``header_timeout``
  seconds of the connection opening (or, on a kept-alive connection, of the next request's first
  byte); else the server answers ``408`` and closes;
* a **body timeout**: the body must be complete within ``body_timeout`` seconds of the headers;
  else the connection is closed (the app sees a disconnect and changes nothing);
* a **header size** bound: more than ``max_header_bytes`` before the headers end: ``431`` and close;
* a **connection cap** below the file-descriptor limit: when ``max_connections`` are open, a new
  connection makes room by closing the oldest one that is not being answered (one still sending
  its request, or idle between requests); if every connection is being answered, the new one gets
  ``503`` with ``Retry-After``. A request the app is answering is never cut.

The hooks used (``cycle``, ``cycle.more_body``, ``cycle.response_complete``,
``server_state.connections``) are uvicorn's protocol internals; the tests drive a real server.
What a reverse proxy in front must add is in docs/unsubscribe.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click

log = logging.getLogger(__name__)

FD_RESERVE = 128
"""File descriptors kept free for everything but client sockets: the listening socket, database
connections of the worker threads (one per request in flight), logs, the interpreter's own."""


@dataclass(frozen=True)
class ServerLimits:
    """Limits of the standalone server (seconds, bytes, connections).

    :ivar header_timeout: seconds from a connection's first byte to the end of its headers.
    :ivar body_timeout: seconds from the end of the headers to the end of the body.
    :ivar keep_alive: seconds an idle kept-alive connection stays open (uvicorn's ``timeout_keep_alive``).
    :ivar max_header_bytes: bytes a request may send before its headers end.
    :ivar max_connections: open client connections at most; ``None``: 1000. Always capped at the
        process's soft ``RLIMIT_NOFILE`` minus :data:`FD_RESERVE` (see :meth:`connection_cap`).
    """

    header_timeout: float = 10.0
    body_timeout: float = 10.0
    keep_alive: int = 5
    max_header_bytes: int = 16 * 1024
    max_connections: int | None = None

    def connection_cap(self) -> int:
        """The connection cap in force: ``max_connections`` (default 1000), but at most the soft
        file-descriptor limit minus :data:`FD_RESERVE` (and at least 16)."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = self.max_connections or 1000
        if soft == resource.RLIM_INFINITY:
            return wanted
        return max(16, min(wanted, soft - FD_RESERVE))


_408 = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
_503 = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 120\r\nConnection: close\r\n"
        b"Content-Length: 0\r\n\r\n")


def guarded_protocol(base: type[asyncio.Protocol], limits: ServerLimits) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's HTTP protocol class ``base`` (``HttpToolsProtocol`` or
    ``H11Protocol``) that enforces ``limits`` (see the module docstring); pass it as uvicorn's
    ``http=``.

    :param base: a uvicorn HTTP/1.1 protocol class.
    :param limits: timeouts and bounds; the connection cap is computed once, here.
    """
    cap = limits.connection_cap()

    class Guarded(base):  # type: ignore[valid-type,misc]
        _opened: float
        _phase: str | None  # "head": reading headers; "body": reading the body; None: not reading
        _timer: asyncio.TimerHandle | None
        _cycle_at_arm: Any
        _head_bytes: int

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self._timer, self._phase, self._head_bytes = None, None, 0
            self._opened = asyncio.get_running_loop().time()
            super().connection_made(transport)
            if len(self.connections) > cap and not self._make_room():
                log.warning("unsubscribe server: %d connections open, all being answered: refusing one", cap)
                self._refuse(_503)
                return
            self._arm("head", limits.header_timeout)

        def _make_room(self) -> bool:
            """Close the oldest connection that is not being answered; False if there is none."""
            idle = [c for c in self.connections
                    if c is not self and isinstance(c, Guarded) and not c._answering()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._opened)
            oldest._refuse(_408 if oldest._phase == "head" else b"")
            return True

        def _answering(self) -> bool:
            c = self.cycle
            return c is not None and not c.more_body and not c.response_complete

        def _arm(self, phase: str, seconds: float) -> None:
            self._disarm()
            self._phase, self._cycle_at_arm = phase, self.cycle
            self._timer = asyncio.get_running_loop().call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._phase = None, None

        def _expired(self) -> None:
            self._timer = None
            self._refuse(_408 if self._phase == "head" else b"")

        def _refuse(self, answer: bytes) -> None:
            self._disarm()
            if self.transport is not None and not self.transport.is_closing():
                if answer:
                    self.transport.write(answer)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._phase is None and (self.cycle is None or self.cycle.response_complete):
                self._arm("head", limits.header_timeout)  # the next request on a kept-alive connection
                self._head_bytes = 0
            if self._phase == "head":
                self._head_bytes += len(data)
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
                return
            cycle = self.cycle
            if self._phase == "head":
                if cycle is not self._cycle_at_arm and cycle is not None:  # the headers are in
                    if cycle.more_body and not cycle.response_complete:
                        self._arm("body", limits.body_timeout)
                    else:
                        self._disarm()
                elif self._head_bytes > limits.max_header_bytes:
                    self._refuse(_431)
            elif self._phase == "body" and cycle is not None and not cycle.more_body:
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = f"Guarded{base.__name__}"
    return Guarded


def serve(app: Any, *, host: str, port: int, limits: ServerLimits, proxy_headers: bool = True) -> None:
    """Run ``app`` with uvicorn under ``limits`` until interrupted (access log off: paths carry tokens).

    :param proxy_headers: trust ``X-Forwarded-*`` from the addresses uvicorn trusts (127.0.0.1 by default).
    """
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    protocol = guarded_protocol(AutoHTTPProtocol, limits)
    log.info("unsubscribe server limits: headers %.0f s, body %.0f s, keep-alive %d s, %d header bytes, "
             "%d connections", limits.header_timeout, limits.body_timeout, limits.keep_alive,
             limits.max_header_bytes, limits.connection_cap())
    uvicorn.run(app, host=host, port=port, http=protocol, access_log=False, proxy_headers=proxy_headers,
                log_level="info", timeout_keep_alive=limits.keep_alive)


def dsn_option(env: str) -> Callable[[click.Context, click.Parameter, str | None], str]:
    """A click callback for a server's ``--dsn``: the option, else ``mailflow --dsn`` (the group's,
    kept in ``ctx.meta``), else the server's own variable ``env``, else ``MAILFLOW_DSN``.

    :raises click.UsageError: (exit 2) when none is set.
    """
    def callback(ctx: click.Context, _param: click.Parameter, value: str | None) -> str:
        dsn = value or ctx.meta.get("mailflow.dsn") or os.environ.get(env) or os.environ.get("MAILFLOW_DSN")
        if not dsn:
            raise click.UsageError(f"--dsn, {env} or MAILFLOW_DSN is required")
        return str(dsn)
    return callback
