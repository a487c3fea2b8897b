"""CLI: ``python -m mailflow.emulator --port 8025 --outbox PATH [--control] [fault flags]``.

Binds the socket first (``--port 0`` picks a free port), prints exactly one line
``mailflow-emulator listening on http://HOST:PORT`` to stdout, then serves with uvicorn
(single process, async). Stop it with SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

import uvicorn

from mailflow.emulator.app import create_app
from mailflow.emulator.config import EmulatorConfig


def build_parser() -> argparse.ArgumentParser:
    """The CLI flags; each fault flag mirrors an :class:`EmulatorConfig` field of the same name."""
    p = argparse.ArgumentParser(prog="python -m mailflow.emulator", description="Resend-compatible emulator")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8025, help="0 = any free port (the printed URL tells)")
    p.add_argument("--outbox", default=None, help="JSON-lines file of accepted emails (appended)")
    p.add_argument("--idempotency-store", default=None, help="JSON-lines journal of idempotency keys "
                   "(loaded at start, appended to): a restarted emulator still recognises a resend")
    p.add_argument("--api-key", action="append", dest="api_keys", help="accepted key (repeatable); "
                   "default re_test_emulator")
    p.add_argument("--rate-limit", type=float, default=10.0, help="requests/s per key, 0 = off")
    p.add_argument("--quota-emails", type=int, default=None)
    p.add_argument("--error-rate", type=float, default=0.0, help="5xx before processing")
    p.add_argument("--error-after-rate", type=float, default=0.0, help="processed, then answered 5xx")
    p.add_argument("--error-after-status", type=int, choices=(500, 502, 503, 504), default=502)
    p.add_argument("--outage", action="store_true", help="every API request answered 503")
    p.add_argument("--latency-ms", type=float, default=0.0)
    p.add_argument("--latency-jitter-ms", type=float, default=0.0)
    p.add_argument("--timeout-rate", type=float, default=0.0)
    p.add_argument("--hang-seconds", type=float, default=30.0)
    p.add_argument("--reset-after-accept-rate", type=float, default=0.0)
    p.add_argument("--reset-mode", choices=("abort", "hang"), default="abort")
    p.add_argument("--strict-only", action="store_true")
    p.add_argument("--scramble-order", action="store_true")
    p.add_argument("--bounce", action="append", default=[], help="address whose last_event is bounced")
    p.add_argument("--complain", action="append", default=[], help="address whose last_event is complained")
    p.add_argument("--suppress", action="append", default=[], help="address whose last_event is suppressed")
    p.add_argument("--fail", action="append", default=[], help="address whose last_event is failed")
    p.add_argument("--retry-after-style", choices=("seconds", "fraction", "http-date"), default="seconds")
    p.add_argument("--date-skew-seconds", type=float, default=0.0, help="the Date header runs N s ahead")
    p.add_argument("--retry-after-value", default="", help="literal Retry-After of every 429 rate limit")
    p.add_argument("--rate-limited-rate", type=float, default=0.0, help="429 rate_limit_exceeded before processing")
    p.add_argument("--no-store-bodies", dest="store_bodies", action="store_false")
    p.add_argument("--domain", default="mailflow.example", help="the verified sending domain")
    p.add_argument("--restricted-keys", action="append", default=[], dest="restricted_keys",
                   help="a sending-only API key (repeatable): 401 restricted_api_key on anything but sending")
    p.add_argument("--check-from-domain", action=argparse.BooleanOptionalAction, default=False,
                   help="403 validation_error for a `from` outside --domain")
    p.add_argument("--test-only", action=argparse.BooleanOptionalAction, default=False,
                   help="403 validation_error for any recipient but --owner-email")
    p.add_argument("--owner-email", default="owner@mailflow.example")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control", action=argparse.BooleanOptionalAction, default=False,
                   help="register the unauthenticated /_emulator/* control API")
    p.add_argument("--access-log", action="store_true")
    p.add_argument("--log-level", default="warning")
    return p


class _DropAbortNoise(logging.Filter):
    """uvicorn logs an error when a response is left incomplete; that is our reset_after_accept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in str(record.msg)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    config = EmulatorConfig(
        outbox=args.outbox, api_keys=tuple(args.api_keys or ("re_test_emulator",)), control=args.control,
        rate_limit=args.rate_limit, quota_emails=args.quota_emails, error_rate=args.error_rate,
        latency_ms=args.latency_ms, latency_jitter_ms=args.latency_jitter_ms, timeout_rate=args.timeout_rate,
        hang_seconds=args.hang_seconds, reset_after_accept_rate=args.reset_after_accept_rate,
        reset_mode=args.reset_mode, strict_only=args.strict_only, scramble_order=args.scramble_order,
        bounce=tuple(args.bounce), complain=tuple(args.complain), suppress=tuple(args.suppress),
        fail=tuple(args.fail),
        error_after_rate=args.error_after_rate, error_after_status=args.error_after_status, outage=args.outage,
        retry_after_style=args.retry_after_style, date_skew_seconds=args.date_skew_seconds,
        retry_after_value=args.retry_after_value, rate_limited_rate=args.rate_limited_rate, store_bodies=args.store_bodies, domain=args.domain,
        seed=args.seed, idempotency_store=args.idempotency_store,
        restricted_keys=tuple(args.restricted_keys), check_from_domain=args.check_from_domain,
        test_only=args.test_only, owner_email=args.owner_email,
    )
    app = create_app(config)
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted sockets only then (else +40 ms/response)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(2048)
    sock.set_inheritable(True)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=args.log_level, access_log=args.access_log, timeout_graceful_shutdown=2,
        lifespan="off", date_header=False,  # the app sends Date from its own (possibly skewed) clock
    ))
    logging.getLogger("uvicorn.error").addFilter(_DropAbortNoise())
    shown = f"[{host}]" if ":" in host else host
    print(f"mailflow-emulator listening on http://{shown}:{port}", flush=True)
    try:
        server.run(sockets=[sock])  # sets up uvloop/httptools when available
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
