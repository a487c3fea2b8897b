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
from mailflow.emulator.config import RUNTIME_SETTINGS, EmulatorConfig, coerce_update


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
    # each accepted email's lifecycle (webhooks and last_event)
    p.add_argument("--soft-bounce", action="append", default=[], help="address whose email bounces Transient")
    p.add_argument("--delayed", action="append", default=[], help="address delivery_delayed, then delivered")
    for rate in ("hard_bounce_rate", "soft_bounce_rate", "failed_rate", "delayed_rate", "complaint_rate",
                 "open_rate", "click_rate"):
        p.add_argument("--" + rate.replace("_", "-"), type=float, default=0.0, help="fraction in [0, 1]")
    p.add_argument("--event-spread-seconds", type=float, default=0.0,
                   help="an email's events happen within this many seconds of the send")
    # webhooks
    p.add_argument("--webhook-url", default="", help="an endpoint registered without an API call")
    p.add_argument("--webhook-secret", "--webhook-secrets", action="append", default=[], dest="webhook_secrets",
                   help="its signing secret whsec_<base64> (repeatable: all are signed for, rotation)")
    p.add_argument("--webhook-event", "--webhook-events", action="append", default=[], dest="webhook_events",
                   help="an event type it subscribes to (repeatable; default every email event)")
    p.add_argument("--webhook-retry-schedule", action="append", default=[],
                   help="seconds before each attempt, comma-separated or repeated (default Svix's: "
                        "0,5,300,1800,7200,18000,36000,36000)")
    p.add_argument("--webhook-time-scale", type=float, default=1.0, help="multiplies the retry schedule")
    p.add_argument("--webhook-timeout-seconds", type=float, default=15.0, help="per attempt")
    p.add_argument("--webhook-concurrency", type=int, default=64, help="attempts in flight (connections)")
    for rate in ("webhook_duplicate_rate", "webhook_reorder_rate", "webhook_delay_rate", "webhook_drop_rate",
                 "webhook_forged_rate", "webhook_stale_rate", "webhook_future_rate"):
        p.add_argument("--" + rate.replace("_", "-"), type=float, default=0.0, help="fraction in [0, 1]")
    p.add_argument("--webhook-delay-seconds", type=float, default=0.0)
    p.add_argument("--webhook-log", default=None, help="JSON-lines file, one line per final message or copy")
    p.add_argument("--webhook-records-max", type=int, default=0,
                   help="messages kept in memory for the control view (the newest; 0 = all)")
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
        soft_bounce=tuple(args.soft_bounce), delayed=tuple(args.delayed), hard_bounce_rate=args.hard_bounce_rate,
        soft_bounce_rate=args.soft_bounce_rate, failed_rate=args.failed_rate, delayed_rate=args.delayed_rate,
        complaint_rate=args.complaint_rate, open_rate=args.open_rate, click_rate=args.click_rate,
        event_spread_seconds=args.event_spread_seconds, webhook_url=args.webhook_url,
        webhook_secrets=tuple(args.webhook_secrets), webhook_events=tuple(args.webhook_events),
        webhook_time_scale=args.webhook_time_scale, webhook_timeout_seconds=args.webhook_timeout_seconds,
        webhook_concurrency=args.webhook_concurrency, webhook_duplicate_rate=args.webhook_duplicate_rate,
        webhook_reorder_rate=args.webhook_reorder_rate, webhook_delay_rate=args.webhook_delay_rate,
        webhook_delay_seconds=args.webhook_delay_seconds, webhook_drop_rate=args.webhook_drop_rate,
        webhook_forged_rate=args.webhook_forged_rate, webhook_stale_rate=args.webhook_stale_rate,
        webhook_future_rate=args.webhook_future_rate, webhook_log=args.webhook_log,
        webhook_records_max=args.webhook_records_max,
    )
    if args.webhook_retry_schedule:
        config.webhook_retry_schedule = tuple(float(x) for item in args.webhook_retry_schedule
                                              for x in item.split(",") if x.strip())
    try:  # the same checks as a runtime update (secrets, URL, rates)
        coerce_update(config, {k: v for k, v in config.public().items() if k in RUNTIME_SETTINGS
                               and k.startswith(("webhook_", "soft_bounce", "hard_bounce", "failed_rate"))})
    except ValueError as exc:
        build_parser().error(str(exc))
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
        lifespan="on", date_header=False,  # the app sends Date from its own (possibly skewed) clock
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
