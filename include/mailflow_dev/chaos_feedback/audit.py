"""The feedback chaos audit: the emulator's accounting (every message, its attempts and whether it was
acknowledged) and the provider's outbox (which address each email id went to) against what the
receiver stored and applied."""

from __future__ import annotations

from typing import Any

import psycopg

COLUMNS = ("acknowledged_lost", "wrong_suppressions", "missed_suppressions", "wrong_email", "attacks_acknowledged")
HEADERS = {
    "acknowledged_lost": "acknowledged but lost",
    "wrong_suppressions": "wrong suppressions",
    "missed_suppressions": "missed suppressions (after poll)",
    "wrong_email": "outcomes on the wrong email",
    "attacks_acknowledged": "forged/stale/future acknowledged",
}


def audit(conn: psycopg.Connection, messages: list[dict[str, Any]], truth: dict[str, str],
          expected: set[str | None]) -> dict[str, Any]:
    """Count the invariants (:data:`COLUMNS`, each must be 0) plus information.

    :param messages: the emulator's per-message accounting (``GET /_emulator/webhooks``): genuine
        messages and their copies (duplicate, forged, stale, future) with ``final``.
    :param truth: provider email id -> the address the provider sent it to (the outbox).
    :param expected: mailbox keys that must be suppressed: addresses of sent emails whose lifecycle
        has a permanent bounce or a complaint.

    * acknowledged_lost: svix-ids the emulator saw answered 2xx (the genuine message or its
      duplicate) that are not in ``mail.webhook_event``, or are there with another event type (a
      forged body stored in the genuine message's place).
    * wrong_suppressions: suppressed mailboxes (or users) that are not in ``expected``: a transient
      bounce, a delay, a failure, an open, a forged or stale copy, or another user's address.
    * missed_suppressions: mailboxes in ``expected`` with no suppression (after the sweep and the
      safety-net poll).
    * wrong_email: ``mail.delivery_event`` rows whose email (send-log row) is not the one the event
      is about: its provider id differs from the row's, or the provider sent that id to another
      address than the row's.
    * attacks_acknowledged: forged, stale or future copies answered 2xx.
    """
    genuine = {m["svix_id"]: m for m in messages if m["kind"] == "genuine"}
    acked = {m["svix_id"] for m in messages if m["kind"] in ("genuine", "duplicate") and m["final"] == "acknowledged"}
    stored: dict[str, str] = dict(conn.execute("select svix_id, event_type from mail.webhook_event").fetchall())
    lost = sorted(s for s in acked if s not in stored or stored[s] != genuine[s]["type"])
    suppressed_keys = {r[0] for r in conn.execute(
        "select coalesce(email_key, lower(email)) from mail.suppression where email is not null").fetchall()}
    suppressed_users = [r[0] for r in conn.execute(
        "select user_id from mail.suppression where email is null").fetchall()]
    wrong_supp = sorted(str(k) for k in suppressed_keys - expected) + [f"user {u}" for u in suppressed_users]
    missed = sorted(k for k in expected - suppressed_keys if k is not None)
    rows = conn.execute(
        "select d.id, d.provider_message_id, l.provider_message_id, l.email, d.event, d.source"
        " from mail.delivery_event d join mail.send_log l on l.id = d.send_log_id").fetchall()
    wrong_email = [r for r in rows if r[1] != r[2] or (truth.get(r[1]) or "").lower() != r[3].lower()]
    by_key: dict[str, list[str]] = {}
    for m in genuine.values():
        key = (truth.get(m["email_id"]) or "").lower()
        by_key.setdefault(key, []).append(f"{m['type'].removeprefix('email.')}:{m['final']}")
    attacks = [m for m in messages if m["kind"] in ("forged", "stale", "future") and m["final"] == "acknowledged"]
    kinds: dict[str, dict[str, int]] = {}
    for m in messages:
        k = kinds.setdefault(m["kind"], {})
        k[m["final"]] = k.get(m["final"], 0) + 1
    attempt_statuses: dict[str, int] = {}
    for m in genuine.values():
        for a in m["attempts"]:
            attempt_statuses[str(a["status"])] = attempt_statuses.get(str(a["status"]), 0) + 1
    return {
        "acknowledged_lost": len(lost), "wrong_suppressions": len(wrong_supp), "missed_suppressions": len(missed),
        "wrong_email": len(wrong_email), "attacks_acknowledged": len(attacks),
        "examples": {"lost": lost[:5], "wrong_suppressions": wrong_supp[:5],
                     "missed": {k: sorted(by_key.get(k, [])) for k in missed[:10]},
                     "wrong_email": [list(map(str, r)) for r in wrong_email[:5]],
                     "attacks": [(m["kind"], m["svix_id"]) for m in attacks[:5]]},
        "messages_by_kind_and_final": kinds,
        "genuine_attempt_statuses": attempt_statuses,
        "missed_reasons": _count(_why_missed(by_key.get(k, [])) for k in missed),
        "given_up_by_type": _count(m["type"] for m in genuine.values() if m["final"] == "given_up"),
        "acknowledged": len(acked), "stored": len(stored), "expected_suppressions": len(expected),
        "suppressed": len(suppressed_keys) + len(suppressed_users),
        "decisions": dict(conn.execute("select coalesce(decision, '(pending)'), count(*) from mail.webhook_event"
                                       " group by 1 order by 1").fetchall()),
        "outcomes": dict(conn.execute("select coalesce(outcome, '(none)'), count(*) from mail.delivery_status"
                                      " group by 1 order by 1").fetchall()),
        "delivery_events_by_source": dict(conn.execute(
            "select source, count(*) from mail.delivery_event group by 1 order by 1").fetchall()),
    }


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _why_missed(history: list[str]) -> str:
    """Why a suppression was missed, from the email's messages (``type:final``)."""
    lost = [h for h in history if h in ("complained:given_up", "bounced:given_up")]
    outcome = [h for h in history if h.endswith(":acknowledged") and not h.startswith("sent:")]
    if lost and outcome:
        return ("its complaint or bounce was given up by the provider after the email already had an outcome "
                "(the safety-net poll asks only about emails without one)")
    if lost:
        return "its complaint or bounce was given up by the provider and the poll did not recover it"
    return "its complaint or bounce was acknowledged or pending (a receiver or apply fault)"
