"""Resend's request validation as the emulator applies it: addresses (``email@example.com`` or
``Name <email@example.com>``), recipients, tags, the email payload; :class:`ApiError` carries the
provider's error name and status."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

from email_validator import EmailNotValidError, validate_email

ADDRESS_FORMAT = "needs to follow the `email@example.com` or `Name <email@example.com>` format."

MAX_RECIPIENTS = 50  # spec SendEmailRequest.to: max 50


_TAG_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")  # spec Tag.name / Tag.value


class ApiError(Exception):
    """An error answered with Resend's body ``{"statusCode", "name", "message"}`` (contract "Errors")."""

    def __init__(self, status: int, name: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.name, self.message, self.headers = status, name, message, headers or {}


# A conservative dot-atom subset that email_validator always accepts when the domain is valid:
# lets a batch of 100 unique recipients skip 100 full validations (the domain is checked once).
_SIMPLE_ADDR = re.compile(r"^[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)$")


@lru_cache(maxsize=65536)
def _full_check(value: str) -> str | None:
    try:
        info = validate_email(value, check_deliverability=False, allow_display_name=True)
    except EmailNotValidError:
        return None
    return str(info.normalized).lower()


def check_address(value: str) -> str | None:
    """The normalised lower-case address of ``addr`` or ``Name <addr>``, or None if invalid.

    The verdict is email_validator's (check_deliverability=False); simple addresses reuse its
    cached verdict on their domain.
    """
    value = value.strip()
    m = _SIMPLE_ADDR.match(value)
    if m and len(value) <= 254 and value.index("@") <= 64:
        return value.lower() if _full_check("x@" + m.group(1)) is not None else None
    return _full_check(value)


def _addresses(email: dict[str, Any], field: str, required: bool) -> list[str]:
    """Validate an address field (string or list); returns it as a list of the given strings."""
    value = email.get(field)
    if value is None:
        if required:
            raise ApiError(422, "missing_required_field", f"Missing `{field}` field.")
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(a, str) for a in items):
        raise ApiError(422, "validation_error", f"Invalid `{field}` field. The email address {ADDRESS_FORMAT}")
    if len(items) > MAX_RECIPIENTS:
        raise ApiError(422, "validation_error", f"Too many recipients in `{field}`: the maximum is {MAX_RECIPIENTS}.")
    for addr in items:
        if check_address(addr) is None:
            raise ApiError(422, "validation_error", f"Invalid `{field}` field. The email address {ADDRESS_FORMAT}")
    return [a.strip() for a in items]


def validate_email_payload(email: Any, in_batch: bool) -> dict[str, Any]:
    """Check one email object like Resend does; return its normalised fields or raise ApiError(422)."""
    if not isinstance(email, dict):
        raise ApiError(422, "validation_error", "Each email must be a JSON object.")
    frm = email.get("from")
    if frm is None:
        raise ApiError(422, "missing_required_field", "Missing `from` field.")
    if not isinstance(frm, str) or check_address(frm) is None:
        raise ApiError(422, "validation_error", f"Invalid `from` field. The email address {ADDRESS_FORMAT}")
    to = _addresses(email, "to", required=True)
    subject = email.get("subject")
    if subject is None:
        raise ApiError(422, "missing_required_field", "Missing `subject` field.")
    if not isinstance(subject, str) or not subject.strip():
        raise ApiError(422, "validation_error", "Invalid `subject` field. It must be a non-empty string.")
    html, text = email.get("html"), email.get("text")
    for name, val in (("html", html), ("text", text)):
        if val is not None and not isinstance(val, str):
            raise ApiError(422, "validation_error", f"Invalid `{name}` field. It must be a string.")
    if not html and not text:
        raise ApiError(422, "validation_error", "Missing `html` or `text` field.")
    headers = email.get("headers") or {}
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise ApiError(422, "validation_error", "Invalid `headers` field. It must be an object of string values.")
    tags = email.get("tags") or []
    if not isinstance(tags, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and _TAG_RE.match(t["name"])
        and isinstance(t.get("value", ""), str) and (t.get("value", "") == "" or _TAG_RE.match(t["value"]))
        for t in tags
    ):
        raise ApiError(422, "validation_error", "Invalid `tags` field. Tag names and values can only contain "
                       "ASCII letters, numbers, underscores or dashes, at most 256 characters.")
    for name in ("attachments", "scheduled_at"):
        if in_batch and email.get(name) is not None:
            raise ApiError(422, "validation_error", f"`{name}` is not supported in batch emails.")
    return {
        "from": frm.strip(), "to": to, "subject": subject, "html": html, "text": text,
        "cc": _addresses(email, "cc", False), "bcc": _addresses(email, "bcc", False),
        "reply_to": _addresses(email, "reply_to", False), "headers": headers, "tags": tags,
        "scheduled_at": email.get("scheduled_at"), "attachments": len(email.get("attachments") or []),
    }
