"""``mailflow emulator``: serve the Resend-compatible emulator (``--port 8025 --outbox PATH [--control]
[fault flags]``).

Binds the socket first (``--port 0`` picks a free port), prints exactly one line
``mailflow-emulator listening on http://HOST:PORT`` to stdout, then serves with uvicorn
(single process, async). Stop it with SIGINT/SIGTERM. The command lives here, with the emulator,
because the emulator stands alone (it imports nothing of the product); ``mailflow.cli`` mounts it
as ``mailflow emulator`` and ``python -m mailflow.emulator`` (deprecated) runs it too.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import click

RATES = ("hard_bounce_rate", "soft_bounce_rate", "failed_rate", "delayed_rate", "complaint_rate", "open_rate",
         "click_rate")
WEBHOOK_RATES = ("webhook_duplicate_rate", "webhook_reorder_rate", "webhook_delay_rate", "webhook_drop_rate",
                 "webhook_forged_rate", "webhook_stale_rate", "webhook_future_rate")


def _fractions(names: tuple[str, ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One ``--name-with-dashes FLOAT`` option (a fraction in [0, 1], default 0) per field name."""
    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for name in reversed(names):
            f = click.option("--" + name.replace("_", "-"), name, type=float, default=0.0,
                             help="fraction in [0, 1]")(f)
        return f
    return decorate


class _DropAbortNoise(logging.Filter):
    """uvicorn logs an error when a response is left incomplete; that is our reset_after_accept."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "returned without completing response" not in str(record.msg)


@click.command("emulator", context_settings={"help_option_names": ["-h", "--help"]},
               help="Serve the Resend-compatible emulator (a test double and the demo's email API).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8025, show_default=True, help="0 = any free port (the printed URL tells)")
@click.option("--outbox", default=None, help="JSON-lines file of accepted emails (appended)")
@click.option("--idempotency-store", default=None, help="JSON-lines journal of idempotency keys (loaded at start, "
              "appended to): a restarted emulator still recognises a resend")
@click.option("--api-key", "api_keys", multiple=True, help="accepted key (repeatable); default re_test_emulator")
@click.option("--rate-limit", type=float, default=10.0, show_default=True, help="requests/s per key, 0 = off")
@click.option("--quota-emails", type=int, default=None)
@click.option("--error-rate", type=float, default=0.0, help="5xx before processing")
@click.option("--error-after-rate", type=float, default=0.0, help="processed, then answered 5xx")
@click.option("--error-after-status", type=click.Choice(["500", "502", "503", "504"]), default="502",
              show_default=True)
@click.option("--outage", is_flag=True, help="every API request answered 503")
@click.option("--latency-ms", type=float, default=0.0)
@click.option("--latency-jitter-ms", type=float, default=0.0)
@click.option("--timeout-rate", type=float, default=0.0)
@click.option("--hang-seconds", type=float, default=30.0, show_default=True)
@click.option("--reset-after-accept-rate", type=float, default=0.0)
@click.option("--reset-mode", type=click.Choice(["abort", "hang"]), default="abort", show_default=True)
@click.option("--strict-only", is_flag=True)
@click.option("--scramble-order", is_flag=True)
@click.option("--bounce", multiple=True, help="address whose last_event is bounced")
@click.option("--complain", multiple=True, help="address whose last_event is complained")
@click.option("--suppress", multiple=True, help="address whose last_event is suppressed")
@click.option("--fail", multiple=True, help="address whose last_event is failed")
@click.option("--retry-after-style", type=click.Choice(["seconds", "fraction", "http-date"]), default="seconds",
              show_default=True)
@click.option("--date-skew-seconds", type=float, default=0.0, help="the Date header runs N s ahead")
@click.option("--retry-after-value", default="", help="literal Retry-After of every 429 rate limit")
@click.option("--rate-limited-rate", type=float, default=0.0, help="429 rate_limit_exceeded before processing")
@click.option("--store-bodies/--no-store-bodies", default=True, show_default=True)
@click.option("--domain", default="mailflow.example", show_default=True, help="the verified sending domain")
@click.option("--restricted-keys", "restricted_keys", multiple=True,
              help="a sending-only API key (repeatable): 401 restricted_api_key on anything but sending")
@click.option("--check-from-domain/--no-check-from-domain", default=False,
              help="403 validation_error for a `from` outside --domain")
@click.option("--test-only/--no-test-only", default=False,
              help="403 validation_error for any recipient but --owner-email")
@click.option("--owner-email", default="owner@mailflow.example", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
# each accepted email's lifecycle (webhooks and last_event)
@click.option("--soft-bounce", multiple=True, help="address whose email bounces Transient")
@click.option("--delayed", multiple=True, help="address delivery_delayed, then delivered")
@_fractions(RATES)
@click.option("--event-spread-seconds", type=float, default=0.0,
              help="an email's events happen within this many seconds of the send")
# webhooks
@click.option("--webhook-url", default="", help="an endpoint registered without an API call")
@click.option("--webhook-secret", "--webhook-secrets", "webhook_secrets", multiple=True,
              help="its signing secret whsec_<base64> (repeatable: all are signed for, rotation)")
@click.option("--webhook-event", "--webhook-events", "webhook_events", multiple=True,
              help="an event type it subscribes to (repeatable; default every email event)")
@click.option("--webhook-retry-schedule", multiple=True,
              help="seconds before each attempt, comma-separated or repeated (default Svix's: "
                   "0,5,300,1800,7200,18000,36000,36000)")
@click.option("--webhook-time-scale", type=float, default=1.0, show_default=True,
              help="multiplies the retry schedule")
@click.option("--webhook-timeout-seconds", type=float, default=15.0, show_default=True, help="per attempt")
@click.option("--webhook-concurrency", type=int, default=64, show_default=True, help="attempts in flight")
@_fractions(WEBHOOK_RATES)
@click.option("--webhook-delay-seconds", type=float, default=0.0)
@click.option("--webhook-latency-min-seconds", type=float, default=0.0)
@click.option("--webhook-latency-max-seconds", type=float, default=0.0,
              help="every webhook's first attempt waits a random time in [min, max] s: outcomes arrive late")
@click.option("--webhook-log", default=None, help="JSON-lines file, one line per final message or copy")
@click.option("--webhook-records-max", type=int, default=0,
              help="messages kept in memory for the control view (the newest; 0 = all)")
@click.option("--control/--no-control", default=False, help="register the unauthenticated /_emulator/* control API")
@click.option("--access-log", is_flag=True)
@click.option("--log-level", default="warning", show_default=True)
def emulator(**options: Any) -> int:
    """Serve the emulator until SIGINT/SIGTERM; returns 0.

    :raises click.UsageError: (exit 2) for a setting a runtime update would refuse too (a secret,
        the webhook URL, a rate outside [0, 1]).
    """
    import uvicorn

    from mailflow.emulator.app import create_app
    from mailflow.emulator.config import RUNTIME_SETTINGS, EmulatorConfig, coerce_update

    args = SimpleNamespace(**options)
    config = EmulatorConfig(
        outbox=args.outbox, api_keys=tuple(args.api_keys or ("re_test_emulator",)), control=args.control,
        rate_limit=args.rate_limit, quota_emails=args.quota_emails, error_rate=args.error_rate,
        latency_ms=args.latency_ms, latency_jitter_ms=args.latency_jitter_ms, timeout_rate=args.timeout_rate,
        hang_seconds=args.hang_seconds, reset_after_accept_rate=args.reset_after_accept_rate,
        reset_mode=args.reset_mode, strict_only=args.strict_only, scramble_order=args.scramble_order,
        bounce=tuple(args.bounce), complain=tuple(args.complain), suppress=tuple(args.suppress),
        fail=tuple(args.fail),
        error_after_rate=args.error_after_rate, error_after_status=int(args.error_after_status), outage=args.outage,
        retry_after_style=args.retry_after_style, date_skew_seconds=args.date_skew_seconds,
        retry_after_value=args.retry_after_value, rate_limited_rate=args.rate_limited_rate,
        store_bodies=args.store_bodies, domain=args.domain,
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
        webhook_latency_min_seconds=args.webhook_latency_min_seconds,
        webhook_latency_max_seconds=args.webhook_latency_max_seconds,
        webhook_forged_rate=args.webhook_forged_rate, webhook_stale_rate=args.webhook_stale_rate,
        webhook_future_rate=args.webhook_future_rate, webhook_log=args.webhook_log,
        webhook_records_max=args.webhook_records_max,
    )
    try:
        if args.webhook_retry_schedule:
            config.webhook_retry_schedule = tuple(float(x) for item in args.webhook_retry_schedule
                                                  for x in item.split(",") if x.strip())
        # the same checks as a runtime update (secrets, URL, rates)
        coerce_update(config, {k: v for k, v in config.public().items() if k in RUNTIME_SETTINGS
                               and k.startswith(("webhook_", "soft_bounce", "hard_bounce", "failed_rate"))})
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
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
