"""Each accepted email's lifecycle: which provider events happen to it and when, decided once, so the
pushed webhooks and ``GET /emails/{id}``'s ``last_event`` tell the same story.

The decision is a pure function of the email (id and recipients) and the configuration: address
rules first (the ``bounce`` / ``complain`` / ``suppress`` / ``fail`` / ``soft_bounce`` / ``delayed``
lists and Resend's ``*@resend.dev`` test addresses), then seeded rates. The random draws come from a
generator seeded with ``"<seed>:<email_id>"``, so the same seed and id always give the same events.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mailflow.emulator.config import EmulatorConfig
from mailflow.emulator.validation import check_address

EMAIL_EVENTS = ("email.sent", "email.delivered", "email.delivery_delayed", "email.bounced", "email.complained",
                "email.opened", "email.clicked", "email.failed", "email.suppressed")
"""The email event types the emulator emits (resend-openapi.yaml, top-level ``webhooks:``)."""

_TEST_DOMAIN_RULES = {"bounced": "bounced", "complained": "complained", "delivered": "delivered"}
# Precedence when an email's recipients match several rules (the worst outcome wins).
_RULE_ORDER = ("bounced", "complained", "suppressed", "failed", "soft_bounced", "delayed", "delivered")


@dataclass(frozen=True, slots=True)
class PlannedEvent:
    """One event of an email's lifecycle.

    ``type`` is the webhook type (``email.bounced``), ``offset_seconds`` its time after the send
    (>= 0; events are listed in the order they happen), ``detail`` the type's extra ``data`` keys
    (``bounce``, ``click``, ``failed``, ``suppressed``) and ``last_event`` the name ``GET
    /emails/{id}`` reports once it has happened. A transient bounce reports ``delivery_delayed``:
    Resend's ``bounced`` last_event means a permanent rejection, which a poll suppresses.
    """

    type: str
    offset_seconds: float
    detail: dict[str, Any] | None
    last_event: str


def address_rule(recipients: list[str], cfg: EmulatorConfig) -> str | None:
    """The outcome the address rules force on an email, or None (then the seeded rates decide).

    Returns one of ``bounced``, ``complained``, ``suppressed``, ``failed``, ``soft_bounced``,
    ``delayed``, ``delivered``; with several matching recipients the first in that order wins.
    """
    found = set()
    for addr in recipients:
        norm = check_address(addr) or addr.lower()
        norm = norm.rpartition("<")[2].rstrip(">")
        local, _, domain = norm.partition("@")
        if norm in cfg.bounce:
            found.add("bounced")
        elif norm in cfg.complain:
            found.add("complained")
        elif norm in cfg.suppress:
            found.add("suppressed")
        elif norm in cfg.fail:
            found.add("failed")
        elif norm in cfg.soft_bounce:
            found.add("soft_bounced")
        elif norm in cfg.delayed:
            found.add("delayed")
        elif domain == "resend.dev" and local.split("+")[0] in _TEST_DOMAIN_RULES:
            found.add(_TEST_DOMAIN_RULES[local.split("+")[0]])
    return next((rule for rule in _RULE_ORDER if rule in found), None)


def plan_lifecycle(email_id: str, recipients: list[str], cfg: EmulatorConfig) -> list[PlannedEvent]:
    """The email's events in the order they happen, with offsets within ``cfg.event_spread_seconds``.

    Shapes: ``sent`` first; then one of ``delivered`` (possibly after ``delivery_delayed``, then
    possibly ``opened``, ``clicked`` and, last, ``complained``), ``bounced`` (Permanent or
    Transient), ``failed`` or ``suppressed``. Rates are drawn only when no address rule applies
    (hard_bounce_rate, soft_bounce_rate, failed_rate share one draw, so they add up to at most 1);
    open_rate, click_rate, complaint_rate and delayed_rate are independent draws.
    """
    rng = random.Random(f"{cfg.seed}:{email_id}")
    u = [rng.random() for _ in range(9)]  # a fixed number of draws: each knob keeps its own draw
    spread = cfg.event_spread_seconds
    rule = address_rule(recipients, cfg)
    if rule is None or rule == "delayed":
        x, hard, soft, failed = u[0], cfg.hard_bounce_rate, cfg.soft_bounce_rate, cfg.failed_rate
        outcome = ("bounced" if x < hard else "soft_bounced" if x < hard + soft
                   else "failed" if x < hard + soft + failed else "delivered")
        if rule == "delayed":
            outcome = "delivered"
        delayed = rule == "delayed" or (outcome == "delivered" and u[1] < cfg.delayed_rate)
        complained = outcome == "delivered" and u[2] < cfg.complaint_rate
    else:
        outcome = {"complained": "delivered", "delivered": "delivered"}.get(rule, rule)
        delayed = False
        complained = rule == "complained"
    clicked = outcome == "delivered" and u[3] < cfg.click_rate
    opened = outcome == "delivered" and (clicked or u[4] < cfg.open_rate)

    events = [PlannedEvent("email.sent", 0.0, None, "sent")]
    t_delay = spread * 0.2 * u[5]
    t_final = spread * (0.3 + 0.2 * u[6])
    if delayed:
        events.append(PlannedEvent("email.delivery_delayed", t_delay, None, "delivery_delayed"))
    if outcome == "delivered":
        events.append(PlannedEvent("email.delivered", t_final, None, "delivered"))
        t_open = t_final + (spread - t_final) * 0.5 * u[7]
        if opened:
            events.append(PlannedEvent("email.opened", t_open, None, "opened"))
        if clicked:
            t_click = t_open + (spread - t_open) * 0.5 * u[8]
            events.append(PlannedEvent("email.clicked", t_click, {"click": {
                "ipAddress": "192.0.2.10", "link": "https://mailflow.example/landing",
                "timestamp": "", "userAgent": "Mozilla/5.0 (emulated)"}}, "clicked"))
        if complained:
            events.append(PlannedEvent("email.complained", spread, None, "complained"))
    elif outcome == "bounced":
        events.append(PlannedEvent("email.bounced", t_final, {"bounce": {
            "diagnosticCode": ["smtp; 550 5.1.1 user unknown"], "message": "The recipient's mail server "
            "permanently rejected the email: the mailbox does not exist.", "subType": "NoEmail",
            "type": "Permanent"}}, "bounced"))
    elif outcome == "soft_bounced":
        events.append(PlannedEvent("email.bounced", t_final, {"bounce": {
            "diagnosticCode": ["smtp; 452 4.2.2 mailbox full"], "message": "The recipient's mailbox is full; "
            "the message could not be delivered for now.", "subType": "MailboxFull", "type": "Transient"}},
            "delivery_delayed"))
    elif outcome == "failed":
        events.append(PlannedEvent("email.failed", t_final, {"failed": {"reason": "emulated_send_failure"}},
                                   "failed"))
    elif outcome == "suppressed":
        events.append(PlannedEvent("email.suppressed", t_final, {"suppressed": {
            "diagnosticCode": [], "message": "The recipient is on the account's suppression list.",
            "reason": "previous_bounce", "type": "OnAccountSuppressionList"}}, "suppressed"))
    return events


def last_event(plan: list[PlannedEvent], elapsed_seconds: float) -> str:
    """``last_event`` after ``elapsed_seconds`` since the send: the latest event that has happened
    (ties: the later in the plan). ``sent`` at least, since ``sent`` happens at offset 0."""
    current = plan[0].last_event
    for event in plan:
        if event.offset_seconds <= elapsed_seconds:
            current = event.last_event
    return current
