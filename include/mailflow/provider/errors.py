"""What a 401/403 from the email API means, and the fix, in one place (client, feedback reader, hook).

Resend's error-code page (shared/reference/resend-contract.md, "Errors") gives, by status:

* 401 ``missing_api_key``: no ``Authorization: Bearer`` header reached the API;
* 401 ``restricted_api_key``: a **sending-only** key was used for anything but sending
  (``GET /emails``, ``GET /emails/{id}``, ``GET /domains``). Resend recommends such keys for
  sending; reading emails (the deliverability_feedback DAG) needs a **full-access** key;
* 403 ``invalid_api_key``: the key is unknown (revoked, mistyped, another account);
* 403 ``validation_error``: the ``from`` domain is not verified, or the account is test-only and
  may write to its owner's address only.

Each gets its own message that names the connection and the fix, so "provider refused the API key"
is never said of a domain problem.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """A 401/403 explained: ``kind`` (short, for ``stop_run`` and summaries) and ``message`` (the
    cause and the fix, naming the connection; never the key)."""

    kind: str
    message: str


def describe_refusal(status: int, name: str, message: str, conn_id: str) -> Refusal:
    """Explain a 401/403 answer ``{"name": name, "message": message}`` for connection ``conn_id``."""
    said = f"HTTP {status} {name}: {message}".strip()
    text = message.lower()
    if status == 401 and name == "restricted_api_key":
        return Refusal("restricted API key", (
            f"the API key of connection {conn_id!r} is sending-only ({said}): it may send email but not read "
            "emails or domains. Give this task a full-access key (Resend: API Keys -> Permission: Full access), "
            "in a connection of its own if the senders keep the sending-only key (MAILFLOW_FEEDBACK_CONN_ID for "
            "deliverability_feedback)."))
    if status == 401 and name == "missing_api_key":
        return Refusal("missing API key", (
            f"no API key reached the provider ({said}): set the password of connection {conn_id!r} to the key."))
    if status == 403 and name == "invalid_api_key":
        return Refusal("invalid API key", (
            f"the provider does not know the API key of connection {conn_id!r} ({said}): it was revoked, "
            "mistyped or belongs to another account. Put a current key in the connection's password."))
    if status == 403 and name == "validation_error" and ("testing emails" in text or "own email" in text):
        return Refusal("test-only account", (
            f"the provider account of connection {conn_id!r} may only send test emails to its owner ({said}). "
            "Verify a sending domain (resend.com/domains) and send from an address of that domain."))
    if status == 403 and name == "validation_error" and "domain" in text:
        return Refusal("domain not verified", (
            f"the provider refused the from address ({said}): its domain is not verified for the account of "
            f"connection {conn_id!r}. Verify the domain (resend.com/domains), or change the campaign's from "
            "address to a verified domain."))
    return Refusal("authentication failed", (
        f"the provider refused the request with connection {conn_id!r} ({said}): check the API key and its "
        "permission, and the from domain."))
