"""Webhook pushing like Resend (Svix): registered endpoints, signed messages, the retry schedule,
switchable faults and the accounting tests and the chaos run read.

Each accepted email's lifecycle (:mod:`.lifecycle`) becomes one message per event and subscribed
endpoint. A message has an ``svix-id`` unique to it and stable across its retries, a JSON body fixed
at its first emission, and is signed at every attempt with the attempt's time (``svix-timestamp``,
Unix seconds, wall clock) by ``standardwebhooks`` for every active secret of the endpoint
(``svix-signature``: space-separated ``v1,<base64>``). A 2xx acknowledges it; anything else (a
status, a timeout, a refused connection, a dropped attempt) is a failed attempt, retried after the
next delay of ``webhook_retry_schedule`` times ``webhook_time_scale``; after the last one it is
given up (Svix marks it failed).

Copies a receiver must refuse (forged signature, stale or future timestamp) are sent once each,
before the genuine message, and recorded with their kind: they are attacks, not deliveries.
A duplicate (the same message once more after it was acknowledged, as when an acknowledgement is
lost) is recorded as kind ``duplicate``.

Due attempts are put on an asyncio queue by the event loop's own timers (``call_later``) and
taken by a fixed pool of worker tasks (``webhook_concurrency``) sharing one keep-alive client
(:class:`.http_client.PostClient`): bounded concurrency, no client per event.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import random
import time
import uuid
from collections import OrderedDict, deque
from datetime import UTC, datetime
from typing import Any, TextIO

import h11
from standardwebhooks.webhooks import Webhook

from mailflow.emulator.config import EmulatorConfig
from mailflow.emulator.http_client import PostClient
from mailflow.emulator.lifecycle import plan_lifecycle

log = logging.getLogger("mailflow.emulator")

REPLAY_SKEW_SECONDS = 600.0
"""How far a stale or future copy's timestamp is off: beyond the 5-minute tolerance of Svix and
standardwebhooks, so a receiver that checks timestamps refuses it."""
CHAIN_GAP_SECONDS = 0.0
"""A reordered email's next message goes out this long after the previous one's first attempt ended."""
ATTACK_KINDS = ("forged", "stale", "future")
COPY_KINDS = ("duplicate", *ATTACK_KINDS)
USER_AGENT = "Svix-Webhooks/1.0 (mailflow-emulator; https://www.svix.com/)"


def new_secret() -> str:
    """A fresh signing secret in Svix's format: ``whsec_`` + base64 of 24 random bytes."""
    return "whsec_" + base64.b64encode(os.urandom(24)).decode()


def iso_utc(epoch: float) -> str:
    """Epoch seconds as Resend's event time: ``2023-10-06T23:47:56.678Z`` (UTC, milliseconds)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Endpoint:
    """A registered webhook endpoint: URL, subscribed event types (empty: all), active secrets
    (every one is signed for: rotation), ``enabled`` / ``disabled``."""

    __slots__ = ("id", "url", "events", "secrets", "signers", "created_at", "status", "from_config")

    def __init__(self, endpoint_id: str, url: str, events: tuple[str, ...], secrets: tuple[str, ...],
                 created_at: float, from_config: bool = False):
        self.id, self.url, self.events = endpoint_id, url, events
        self.secrets = secrets
        self.signers = [Webhook(s) for s in secrets]
        self.created_at, self.status, self.from_config = created_at, "enabled", from_config

    def subscribed(self, event_type: str) -> bool:
        return not self.events or event_type in self.events

    def set_secrets(self, secrets: tuple[str, ...]) -> None:
        self.secrets = secrets
        self.signers = [Webhook(s) for s in secrets]

    def sign(self, msg_id: str, timestamp: int, body: str) -> str:
        """``svix-signature``: one ``v1,<base64>`` per active secret, space-separated."""
        at = datetime.fromtimestamp(timestamp, UTC)
        return " ".join(w.sign(msg_id, at, body) for w in self.signers)

    def public(self, with_secret: bool) -> dict[str, Any]:
        """Resend's webhook object (GetWebhookResponse; the list omits the secret)."""
        out: dict[str, Any] = {"object": "webhook", "id": self.id, "endpoint": self.url,
                               "events": list(self.events) or None, "status": self.status,
                               "created_at": datetime.fromtimestamp(self.created_at, UTC)
                               .strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "+00"}
        if with_secret:
            out["signing_secret"] = self.secrets[0]
        return out


class Message:
    """One webhook message (kind ``genuine``) or one copy of it (``duplicate``, ``forged``,
    ``stale``, ``future``), with its attempts: ``(epoch seconds, status)`` where status is the HTTP
    status or ``timeout`` / ``refused`` / ``error`` / ``dropped``. ``final``: ``pending``,
    ``acknowledged`` (a 2xx), ``given_up`` (schedule exhausted), ``endpoint_gone`` (deleted or
    disabled before it was acknowledged) or, for a copy sent once, ``rejected``."""

    __slots__ = ("svix_id", "email_id", "type", "endpoint_id", "kind", "body", "event_at", "first_at",
                 "attempts", "final", "acked_at", "gen", "copies", "duplicate", "chain_next", "delay_first",
                 "latency")

    def __init__(self, svix_id: str, email_id: str, event_type: str, endpoint_id: str, kind: str, body: str,
                 event_at: float, gen: int):
        self.svix_id, self.email_id, self.type, self.endpoint_id = svix_id, email_id, event_type, endpoint_id
        self.kind, self.body, self.event_at, self.gen = kind, body, event_at, gen
        self.first_at: float | None = None
        self.attempts: list[tuple[float, int | str]] = []
        self.final = "pending"
        self.acked_at: float | None = None
        self.copies: tuple[str, ...] = ()  # attack copies sent before the first attempt
        self.duplicate = False  # delivered once more after it is acknowledged
        self.chain_next: Message | None = None  # reordered emails: the next message, after this one's try
        self.delay_first = False  # the first attempt waits webhook_delay_seconds more
        self.latency = 0.0  # the first attempt waits this much more (webhook_latency_*_seconds)

    def public(self) -> dict[str, Any]:
        return {"svix_id": self.svix_id, "email_id": self.email_id, "type": self.type,
                "endpoint_id": self.endpoint_id, "kind": self.kind, "event_created_at": self.event_at,
                "first_emitted_at": self.first_at, "attempts": [{"at": at, "status": st} for at, st in self.attempts],
                "final": self.final, "acknowledged_at": self.acked_at}


class WebhookDispatcher:
    """Endpoints, messages, the delivery loop and its accounting for one emulator.

    ``cfg`` is read at every use, so runtime changes (faults, schedule, time scale) apply to the
    next attempt. Times in the accounting are wall-clock epoch seconds.
    """

    def __init__(self, get_config: Any):
        self._cfg = get_config  # () -> EmulatorConfig (the emulator's current settings)
        self.endpoints: OrderedDict[str, Endpoint] = OrderedDict()
        self.gen = 0
        self.client: PostClient | None = None
        self.queue: asyncio.Queue[Message] | None = None
        self.workers: list[asyncio.Task[None]] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self._log: TextIO | None = open(self.cfg.webhook_log, "a", encoding="utf-8") if self.cfg.webhook_log else None
        self.clear()

    @property
    def cfg(self) -> EmulatorConfig:
        return self._cfg()

    def _journal(self, msg: Message) -> None:
        """One JSON line per final message or copy (``msg.public()``), flushed at once."""
        if self._log is not None and msg.gen == self.gen:
            self._log.write(json.dumps(msg.public(), separators=(",", ":")) + "\n")
            self._log.flush()

    # -- state -------------------------------------------------------------------------------------
    def clear(self, truncate: bool = False) -> None:
        """Forget messages and counters and the API-registered endpoints (``truncate``: empty the
        ``webhook_log`` too); attempts already in flight finish but schedule nothing more."""
        self.gen += 1
        if truncate and self._log is not None:
            self._log.seek(0)
            self._log.truncate()
            self._log.flush()
        keep = int(self.cfg.webhook_records_max)
        self.records: deque[Message] = deque(maxlen=keep if keep > 0 else None)
        self.in_flight = 0
        self.totals: dict[str, Any] = {
            "emails": 0, "messages": 0, "acknowledged": 0, "given_up": 0, "endpoint_gone": 0,
            "attempts": 0, "attempt_statuses": {}, "events_by_type": {}, "reordered_emails": 0,
            "delayed_messages": 0, **{k: {"sent": 0, "acknowledged": 0} for k in COPY_KINDS},
        }
        self.endpoints = OrderedDict((k, v) for k, v in self.endpoints.items() if v.from_config)
        self.sync_config()

    def sync_config(self) -> None:
        """Make the configured endpoint (``webhook_url``, ``webhook_secrets``, ``webhook_events``) match
        the settings: registered, replaced or removed. A generated secret survives while the URL stays."""
        cfg = self.cfg
        old = next((e for e in self.endpoints.values() if e.from_config), None)
        if not cfg.webhook_url:
            if old is not None:
                del self.endpoints[old.id]
            return
        endpoint_id = str(uuid.uuid5(uuid.NAMESPACE_URL, "mailflow-emulator-webhook:" + cfg.webhook_url))
        secrets = cfg.webhook_secrets or (old.secrets if old is not None and old.id == endpoint_id
                                          else (new_secret(),))
        if old is not None:
            del self.endpoints[old.id]
        ep = Endpoint(endpoint_id, cfg.webhook_url, cfg.webhook_events, secrets, time.time(), from_config=True)
        self.endpoints[endpoint_id] = ep
        self.endpoints.move_to_end(endpoint_id, last=False)

    def register(self, url: str, events: tuple[str, ...]) -> Endpoint:
        """``POST /webhooks``: a new endpoint with a fresh secret."""
        ep = Endpoint(str(uuid.uuid4()), url, events, (new_secret(),), time.time())
        self.endpoints[ep.id] = ep
        return ep

    def rotate(self, endpoint_id: str, secret: str | None) -> Endpoint:
        """Add a secret in front (the new one first; the old ones stay signed for). KeyError if unknown."""
        ep = self.endpoints[endpoint_id]
        ep.set_secrets((secret or new_secret(), *ep.secrets))
        return ep

    # -- the loop ----------------------------------------------------------------------------------
    def ensure_started(self) -> None:
        """Start the worker pool and the shared client on the running loop (idempotent; a pool left on
        another loop, as an in-process test client makes one per request, is replaced)."""
        loop = asyncio.get_running_loop()
        if self.workers and self.loop is loop:
            return
        n = max(1, int(self.cfg.webhook_concurrency))
        self.loop = loop
        self.client = PostClient()
        self.queue = asyncio.Queue()
        self.workers = [asyncio.create_task(self._worker(), name=f"webhook-worker-{i}") for i in range(n)]

    async def stop(self) -> None:
        """Cancel the workers and close the client (pending retries are abandoned with the process)."""
        for task in self.workers:
            task.cancel()
        for task in self.workers:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: S110 - shutting down
                pass
        self.workers = []
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def email_accepted(self, rec: dict[str, Any], accepted_at: float) -> None:
        """Plan the email's lifecycle and schedule one message per event and subscribed enabled
        endpoint. Called in the event loop, inside the request that accepted the email."""
        targets = [ep for ep in self.endpoints.values() if ep.status == "enabled"]
        if not targets or rec.get("scheduled_at"):
            return
        self.ensure_started()
        assert self.loop is not None
        cfg = self.cfg
        email_id = rec["id"]
        plan = plan_lifecycle(email_id, rec["to"] + rec["cc"] + rec["bcc"], cfg)
        self.totals["emails"] += 1
        reorder = cfg.webhook_reorder_rate > 0 and \
            random.Random(f"{cfg.seed}:{email_id}:reorder").random() < cfg.webhook_reorder_rate
        base: dict[str, Any] = {"email_id": email_id, "created_at": rec["received_at"], "from": rec["from"],
                                "to": list(rec["to"]), "subject": rec["subject"]}
        if rec.get("tags"):
            base["tags"] = {t["name"]: t["value"] for t in rec["tags"]}
        by_type = self.totals["events_by_type"]
        for ep in targets:
            chain: list[tuple[float, Message]] = []
            for ev in plan:
                if not ep.subscribed(ev.type):
                    continue
                event_at = accepted_at + ev.offset_seconds
                data = dict(base)
                if ev.detail:
                    data.update(ev.detail)
                    if "click" in data:
                        data["click"] = {**data["click"], "timestamp": iso_utc(event_at)}
                body = json.dumps({"type": ev.type, "created_at": iso_utc(event_at), "data": data},
                                  separators=(",", ":"), ensure_ascii=False)
                svix_id = "msg_" + hashlib.sha256(f"{ep.id}:{email_id}:{ev.type}".encode()).hexdigest()[:27]
                msg = Message(svix_id, email_id, ev.type, ep.id, "genuine", body, event_at, self.gen)
                self._draw_message_faults(msg, cfg)
                self.records.append(msg)
                self.totals["messages"] += 1
                by_type[ev.type] = by_type.get(ev.type, 0) + 1
                chain.append((ev.offset_seconds, msg))
            if not chain:
                continue
            first_delay = cfg.webhook_retry_schedule[0] * cfg.webhook_time_scale
            if reorder and len(chain) > 1:
                self.totals["reordered_emails"] += 1
                last_offset = chain[-1][0]
                ordered = [m for _, m in reversed(chain)]
                for a, b in zip(ordered, ordered[1:], strict=False):
                    a.chain_next = b
                self._schedule(ordered[0], last_offset + first_delay)
            else:
                for offset, msg in chain:
                    self._schedule(msg, offset + first_delay)

    def _draw_message_faults(self, msg: Message, cfg: EmulatorConfig) -> None:
        if cfg.webhook_latency_max_seconds > 0:
            low = min(cfg.webhook_latency_min_seconds, cfg.webhook_latency_max_seconds)
            u = random.Random(f"{cfg.seed}:latency:{msg.svix_id}").random()
            msg.latency = low + (cfg.webhook_latency_max_seconds - low) * u
        rates = (cfg.webhook_forged_rate, cfg.webhook_stale_rate, cfg.webhook_future_rate,
                 cfg.webhook_duplicate_rate, cfg.webhook_delay_rate)
        if not any(rates):
            return
        rng = random.Random(f"{cfg.seed}:{msg.svix_id}")
        draws = [rng.random() for _ in rates]  # fixed order and count: each knob keeps its own draw
        msg.copies = tuple(kind for kind, u, r in zip(ATTACK_KINDS, draws, rates, strict=False) if u < r)
        msg.duplicate = draws[3] < rates[3]
        if draws[4] < rates[4]:
            self.totals["delayed_messages"] += 1
            msg.delay_first = True

    def _schedule(self, msg: Message, delay: float) -> None:
        if msg.delay_first:
            msg.delay_first = False
            delay += self.cfg.webhook_delay_seconds
        if msg.latency:
            delay, msg.latency = delay + msg.latency, 0.0
        assert self.loop is not None and self.queue is not None
        if delay <= 0:
            self.queue.put_nowait(msg)
        else:
            self.loop.call_later(delay, self.queue.put_nowait, msg)

    async def _worker(self) -> None:
        assert self.queue is not None
        while True:
            msg = await self.queue.get()
            if msg.gen != self.gen:
                continue
            self.in_flight += 1
            try:
                await self._deliver(msg)
            except Exception:  # a bug must not stop the pool; the message stays pending
                log.exception("webhook delivery failed unexpectedly: %s", msg.svix_id)
            finally:
                self.in_flight -= 1

    async def _deliver(self, msg: Message) -> None:
        """One attempt of a genuine message (preceded, the first time, by its attack copies), then
        its acknowledgement, duplicate, retry or give-up."""
        cfg = self.cfg
        ep = self.endpoints.get(msg.endpoint_id)
        if ep is None or ep.status != "enabled":
            self._finish(msg, "endpoint_gone")
            return
        if not msg.attempts:
            for kind in msg.copies:
                await self._send_copy(msg, ep, kind)
        n = len(msg.attempts)
        if cfg.webhook_drop_rate > 0 and \
                random.Random(f"{cfg.seed}:{msg.svix_id}:{n}").random() < cfg.webhook_drop_rate:
            status: int | str = "dropped"
            now = time.time()
        else:
            now = time.time()
            status = await self._post(ep, msg.svix_id, msg.body, int(now), ep.sign(msg.svix_id, int(now), msg.body))
        self._record_attempt(msg, now, status)
        if msg.chain_next is not None and n == 0:
            nxt, msg.chain_next = msg.chain_next, None
            self._schedule(nxt, CHAIN_GAP_SECONDS)
        if msg.gen != self.gen:
            return
        if isinstance(status, int) and 200 <= status < 300:
            msg.acked_at = time.time()
            self._finish(msg, "acknowledged")
            if msg.duplicate:
                await self._send_copy(msg, ep, "duplicate")
            return
        schedule = cfg.webhook_retry_schedule
        if n + 1 >= len(schedule):
            self._finish(msg, "given_up")
            return
        self._schedule(msg, schedule[n + 1] * cfg.webhook_time_scale)

    def _record_attempt(self, msg: Message, at: float, status: int | str) -> None:
        if msg.first_at is None:
            msg.first_at = at
        msg.attempts.append((at, status))
        if msg.kind == "genuine" and msg.gen == self.gen:
            self.totals["attempts"] += 1
            key = str(status)
            statuses = self.totals["attempt_statuses"]
            statuses[key] = statuses.get(key, 0) + 1

    def _finish(self, msg: Message, final: str) -> None:
        msg.final = final
        if msg.gen == self.gen and msg.kind == "genuine":
            self.totals[final] += 1
        self._journal(msg)
        if not msg.duplicate:
            msg.body = ""  # the accounting keeps the facts, not the bytes

    async def _send_copy(self, msg: Message, ep: Endpoint, kind: str) -> None:
        """One attempt of a copy: a duplicate (genuine bytes and signature, same svix-id) or an attack."""
        now = time.time()
        body = msg.body
        if kind == "forged":
            env = json.loads(body)
            env["type"] = "email.complained" if env["type"] != "email.complained" else "email.delivered"
            body = json.dumps(env, separators=(",", ":"), ensure_ascii=False)
            signature = Endpoint("forger", ep.url, (), (new_secret(),), now).sign(msg.svix_id, int(now), body)
            ts = int(now)
        else:
            ts = int(now + {"stale": -REPLAY_SKEW_SECONDS, "future": REPLAY_SKEW_SECONDS}.get(kind, 0.0))
            signature = ep.sign(msg.svix_id, ts, body)
        copy = Message(msg.svix_id, msg.email_id, msg.type, msg.endpoint_id, kind, "", msg.event_at, msg.gen)
        self.records.append(copy)
        status = await self._post(ep, msg.svix_id, body, ts, signature)
        copy.first_at = now
        copy.attempts.append((now, status))
        acked = isinstance(status, int) and 200 <= status < 300
        copy.final = "acknowledged" if acked else "rejected"
        if copy.final == "acknowledged":
            copy.acked_at = time.time()
        self._journal(copy)
        if msg.gen == self.gen:
            self.totals[kind]["sent"] += 1
            self.totals[kind]["acknowledged"] += int(acked)
        if kind == "duplicate":
            msg.body = ""

    async def _post(self, ep: Endpoint, msg_id: str, body: str, timestamp: int, signature: str) -> int | str:
        """POST with the Svix headers; the status, or ``timeout`` / ``refused`` / ``error``."""
        assert self.client is not None
        headers = [("content-type", "application/json"), ("user-agent", USER_AGENT), ("svix-id", msg_id),
                   ("svix-timestamp", str(timestamp)), ("svix-signature", signature)]
        try:
            return await self.client.post(ep.url, body.encode(), headers, self.cfg.webhook_timeout_seconds)
        except TimeoutError:
            return "timeout"
        except ConnectionRefusedError:
            return "refused"
        except (OSError, h11.ProtocolError, asyncio.IncompleteReadError, ValueError):
            return "error"

    # -- accounting --------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Totals: genuine messages by final state, attempts by status, copies sent and
        acknowledged per kind, emails planned, events by type, queued and in-flight attempts."""
        t = self.totals
        pending = t["messages"] - t["acknowledged"] - t["given_up"] - t["endpoint_gone"]
        return {**{k: (dict(v) if isinstance(v, dict) else v) for k, v in t.items()}, "pending": pending,
                "queued": self.queue.qsize() if self.queue is not None else 0, "in_flight": self.in_flight}
