"""The chaos run's fault kinds (one scenario each), the actors and kill points, and the fixed
instants and keys every scenario shares."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from mailflow.campaigns import Campaign
from mailflow.model.outcome import DataInterval

ANCHOR = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
INTERVAL = DataInterval(ANCHOR - timedelta(hours=1), ANCHOR)
API_KEY = "re_test_emulator"
SENDING_ONLY_KEY = "re_chaos_sending_only"  # a restricted key of the same team (401 on reads)
SCHEDULED = "chaos_outreach"
SCHEDULED_USER_BASE = 50_000_000  # scheduled recipients are users of their own (no lifecycle audience)
ACTORS = ("sender", "dispatcher", "reconciler")
KILL_POINTS = {
    "sender": ("before_mint", "after_mint", "in_flight", "before_apply"),
    "dispatcher": ("before_claim", "after_claim", "in_flight", "before_apply"),
    "reconciler": ("before_claim", "after_claim", "in_flight", "before_apply"),
}
COLUMNS = ("duplicate_deliveries", "sent_without_delivery", "delivered_without_sent", "keys_with_two_bodies",
           "eligible_not_sent")
HEADERS = ("duplicate deliveries", "sent w/o delivery", "delivered w/o sent", "keys w/ two bodies",
           "eligible not sent")
CLIENT_READ_TIMEOUT = 0.4  # seconds; the emulator's slow answers hang longer (HANG_SECONDS)
HANG_SECONDS = 0.6
UNEXPECTED = 4  # exit code of a child that raised something other than SendError


@dataclass(frozen=True)
class Scenario:
    """One fault kind: ``faults`` = emulator settings of the fault phase; ``key`` = the API key the
    actors use; ``strict`` = strict batch validation (some users' emails are refused by the
    provider); ``driver`` = ``kills`` (runs until the kill share is reached), ``cancel`` (an operator
    cancels the scheduled campaign while a batch is in flight), ``rotation`` (the API key rotated while
    batches are ambiguous), ``outage``, ``long_outage`` or ``quota`` (simulated hours); ``real_clock`` =
    actors on the system clock (rate limits need real time)."""

    name: str
    about: str
    faults: dict[str, Any] = field(default_factory=dict)
    key: str = API_KEY
    strict: bool = False
    driver: str = "kills"
    real_clock: bool = False
    weight: float = 1.0
    status_cycle: tuple[int, ...] = ()  # error_after_status drawn per run from these
    per_run: tuple[dict[str, Any], ...] = ()  # emulator settings drawn per run from these
    slow_pacer: bool = False  # the actors' pacer database answers every statement 0-0.5 s late


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("5xx_before_processing", "HTTP 500 before the batch is processed", {"error_rate": 0.35}),
    Scenario("5xx_after_processing", "500/502/503/504 after the batch was processed (edge or origin)",
             {"error_after_rate": 0.35}, status_cycle=(500, 502, 503, 504)),
    Scenario("reset_after_accept", "connection closed after the batch was accepted",
             {"reset_after_accept_rate": 0.35, "reset_mode": "abort"}),
    Scenario("slow_but_processed", "processed, answered after the client's read timeout",
             {"reset_after_accept_rate": 0.35, "reset_mode": "hang", "hang_seconds": HANG_SECONDS}),
    Scenario("timeout_not_processed", "hangs past the client's timeout, nothing processed",
             {"timeout_rate": 0.3, "hang_seconds": HANG_SECONDS}),
    Scenario("team_rate_limit", "5 requests/s per team, another key of the team takes ~4 of them",
             {"rate_limit": 5}, real_clock=True, weight=0.5),
    Scenario("unverified_domain", "403 validation_error: the `from` domain is not verified",
             {"check_from_domain": True}, weight=0.7),
    Scenario("restricted_key", "a sending-only key (401 restricted_api_key on reads) sends everything",
             {}, key=SENDING_ONLY_KEY, weight=0.7),
    Scenario("strict_refusal", "strict validation refuses a batch in Resend's wording, no index",
             {}, strict=True),
    Scenario("last_event_suppressed_failed", "provider reports last_event suppressed / failed",
             {"suppress": ["__SUPPRESS__"], "fail": ["__FAIL__"]}, weight=0.5),
    Scenario("ids_out_of_order", "batch ids answered out of request order", {"scramble_order": True}, weight=0.7),
    Scenario("outage_6h", "6 simulated hours: 503s, then unreachable, then 503s", {}, driver="outage", weight=1.5),
    Scenario("quota_exhausted", "daily quota exhausted, hit for 4 simulated hours until the next UTC day",
             {}, driver="quota", weight=1.5),
    Scenario("mixed", "every fault above at a low rate at once",
             {"error_rate": 0.05, "error_after_rate": 0.05, "reset_after_accept_rate": 0.05, "timeout_rate": 0.05,
              "hang_seconds": HANG_SECONDS, "scramble_order": True}, status_cycle=(500, 502, 503, 504), weight=1.5),
    Scenario("key_rotation_while_ambiguous", "batches left ambiguous under one API key, then the key is rotated: "
             "a reconcile run with only the new key, then recovery with the old key in previous_api_keys",
             {"reset_after_accept_rate": 0.3, "error_after_rate": 0.2, "reset_mode": "abort"}, driver="rotation"),
    Scenario("outage_longer_than_window", "30 simulated hours of 503s (4 h unreachable): past the idempotency window",
             {}, driver="long_outage", weight=1.5),
    Scenario("cancel_while_in_flight", "the scheduled campaign cancelled while a batch is in flight, answered "
             "429 daily_quota_exceeded", {}, driver="cancel", weight=0.7),
    Scenario("skewed_retry_after_date", "429s whose Retry-After is an HTTP-date 1 s ahead by a clock 10 min fast",
             {"rate_limited_rate": 0.3, "retry_after_style": "http-date", "date_skew_seconds": 600}, weight=0.7),
    Scenario("absurd_retry_after", "429s asking for years (100000000, an overflowing number, year 9999) or 1e300",
             {"rate_limited_rate": 0.2}, weight=0.7,
             per_run=({"retry_after_value": "100000000"}, {"retry_after_value": "1e300"},
                      {"retry_after_value": "9" * 150}, {"retry_after_value": "Fri, 31 Dec 9999 23:59:59 GMT"})),
    Scenario("slow_pacer_db", "the actors' pacer database answers 0-0.5 s late; 10 requests/s per team",
             {"rate_limit": 10}, real_clock=True, slow_pacer=True, weight=0.5),
)
ROTATED_KEY = SENDING_ONLY_KEY  # the new key after a rotation: a sending-only key of the same team

FAULTS_OFF: dict[str, Any] = {
    "error_rate": 0.0, "error_after_rate": 0.0, "reset_after_accept_rate": 0.0, "timeout_rate": 0.0,
    "outage": False, "quota_emails": None, "rate_limit": 0, "scramble_order": False, "check_from_domain": False,
    "suppress": [], "fail": [], "reset_mode": "abort", "hang_seconds": HANG_SECONDS,
    "rate_limited_rate": 0.0, "retry_after_value": "", "date_skew_seconds": 0.0, "retry_after_style": "seconds",
}


@dataclass(frozen=True)
class Plan:
    """Where a child dies: ``point`` at its ``chunk``-th batch (0-based); ``delay`` seconds after the
    request starts for ``in_flight``."""

    point: str
    chunk: int
    delay: float


@dataclass(frozen=True)
class ActorSpec:
    """What a forked actor needs (picklable by fork)."""

    actor: str
    dsn: str
    base_url: str
    api_key: str
    strict: bool
    campaigns: tuple[Campaign, ...]
    sim_seconds: float | None  # FakeClock start; None: the system clock
    chunk_size: int
    run_id: str
    error_log: str
    previous_keys: tuple[str, ...] = ()  # the reconciler's previous_api_keys (key rotation)
    slow_pacer: bool = False


def scenario_faults(scn: Scenario, emails: list[str], rng: random.Random) -> dict[str, Any]:
    faults = dict(scn.faults)
    if "suppress" in faults:  # a few real recipients of the scenario
        pick = rng.sample(emails, min(len(emails), 20))
        faults["suppress"], faults["fail"] = pick[:10], pick[10:]
    return faults


def share_kills(kills: int, scenarios: tuple[Scenario, ...]) -> list[int]:
    """Split ``kills`` over the scenarios by weight, at least one each (largest remainder)."""
    n = len(scenarios)
    if kills < n:
        raise ValueError(f"at least {n} kills are needed (one per fault kind), got {kills}")
    total = sum(s.weight for s in scenarios)
    raw = [1 + (kills - n) * s.weight / total for s in scenarios]
    out = [int(x) for x in raw]
    for i in sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)[: kills - sum(out)]:
        out[i] += 1
    return out
