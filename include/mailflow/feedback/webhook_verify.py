"""Verifying the provider's signed webhooks (Resend signs with Svix, the Standard Webhooks scheme).

A request carries ``svix-id`` (the message id: stable across the provider's retries), ``svix-timestamp``
(Unix seconds) and ``svix-signature`` (space-separated ``v1,<base64>`` entries, one per secret the
provider signs with). The signed content is ``id.timestamp.raw_body``, HMAC-SHA256 under the base64
part of a ``whsec_...`` secret. The check itself is the ``standardwebhooks`` library's
(:class:`standardwebhooks.webhooks.Webhook`); this module maps the ``svix-*`` headers to the
``webhook-*`` names it reads, tries every configured secret (rotation: the request is genuine if any
one verifies), refuses timestamps more than :data:`TOLERANCE_SECONDS` off before any HMAC work, and
turns every failure, including the library's ``ValueError`` / ``binascii.Error`` /
``UnicodeDecodeError`` on malformed input, into a :class:`Rejected` with a 4xx status. Never a 500.

Secrets are never logged or put in an error message. Source of the scheme and the tolerance:
../shared/reference/resend-contract.md ("Webhooks"), the Standard Webhooks specification.
"""

from __future__ import annotations

import binascii
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from standardwebhooks.webhooks import EmptyWebhookSecretError, Webhook, WebhookVerificationError

TOLERANCE_SECONDS = 300
"""A timestamp more than this many seconds before or after our clock is refused (replay window)."""
MAX_ID_LENGTH = 256
"""A longer svix-id is not the provider's (Svix ids are ``msg_`` + 27 characters)."""
MAX_SIGNATURE_LENGTH = 4096
"""A longer svix-signature header is refused before any work (a handful of v1 entries is ~50 bytes each)."""
_ID = re.compile(r"[\x21-\x7e]{1,256}")  # MAX_ID_LENGTH
_TIMESTAMP = re.compile(r"[0-9]{1,12}")
_SPLIT = re.compile(r"[\s,]+")


class Rejected(Exception):
    """The request is not a genuine, fresh webhook: ``status`` (400 malformed, 401 not signed by us
    or outside the time window) and a short ``reason`` that holds no secret and no body."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


class NoSecrets(ValueError):
    """No usable signing secret is configured (the message names no secret)."""


@dataclass(frozen=True)
class Verified:
    """A verified request: its ``svix_id`` and ``timestamp`` (Unix seconds) from the headers."""

    svix_id: str
    timestamp: int


def parse_secrets(text: str | None) -> list[str]:
    """``"whsec_new, whsec_old"`` -> ``["whsec_new", "whsec_old"]``: one or more secrets separated by
    whitespace or commas (the ``mail_webhook`` connection's password, ``MAILFLOW_WEBHOOK_SECRETS``).

    :raises NoSecrets: if there is none, or one is not a ``whsec_`` base64 secret (the message says
        which position, never the value).
    """
    items = [s for s in _SPLIT.split(text or "") if s]
    if not items:
        raise NoSecrets("no webhook signing secret configured")
    for i, s in enumerate(items, 1):
        try:
            Webhook(s)
        except (binascii.Error, ValueError, EmptyWebhookSecretError, RuntimeError):
            raise NoSecrets(f"webhook signing secret #{i} is not a whsec_<base64> secret") from None
    return items


class WebhookVerifier:
    """Verifies requests against one or more secrets (the newest first; each is tried in turn).

    :param secrets: ``whsec_...`` secrets (:func:`parse_secrets`).
    :param clock: seconds since the epoch (tests pass their own).
    :param tolerance: seconds a timestamp may be off (default :data:`TOLERANCE_SECONDS`; the
        library enforces 5 minutes too).
    :raises NoSecrets: if ``secrets`` is empty or holds a malformed secret.
    """

    def __init__(self, secrets: Iterable[str], *, clock: Callable[[], float] = time.time,
                 tolerance: int = TOLERANCE_SECONDS):
        items = list(secrets)
        if not items:
            raise NoSecrets("no webhook signing secret configured")
        try:
            self._hooks = [Webhook(s) for s in items]
        except (binascii.Error, ValueError, EmptyWebhookSecretError, RuntimeError):
            raise NoSecrets("a webhook signing secret is not a whsec_<base64> secret") from None
        self._clock = clock
        self._tolerance = tolerance

    @property
    def count(self) -> int:
        """How many secrets are configured."""
        return len(self._hooks)

    def verify(self, body: bytes, headers: Mapping[str, str]) -> Verified:
        """Check ``body`` (the raw bytes, before any parsing) against the ``svix-*`` headers.

        :param headers: request headers (case-insensitive lookups: Starlette's Headers, or a dict
            with lower-case names).
        :returns: the verified id and timestamp.
        :raises Rejected: 400 for missing or malformed headers or a body that is not UTF-8;
            401 for a stale or future timestamp or no matching signature.
        """
        msg_id = headers.get("svix-id") or headers.get("webhook-id")
        stamp = headers.get("svix-timestamp") or headers.get("webhook-timestamp")
        signature = headers.get("svix-signature") or headers.get("webhook-signature")
        if not msg_id or not stamp or not signature:
            raise Rejected(400, "missing svix-id, svix-timestamp or svix-signature header")
        if not _ID.fullmatch(msg_id):
            raise Rejected(400, "malformed svix-id")
        if not _TIMESTAMP.fullmatch(stamp):
            raise Rejected(400, "malformed svix-timestamp")
        if len(signature) > MAX_SIGNATURE_LENGTH:
            raise Rejected(400, "svix-signature too long")
        ts = int(stamp)
        now = self._clock()
        if ts < now - self._tolerance:
            raise Rejected(401, "svix-timestamp too old")
        if ts > now + self._tolerance:
            raise Rejected(401, "svix-timestamp in the future")
        mapped = {"webhook-id": msg_id, "webhook-timestamp": stamp, "webhook-signature": signature}
        for hook in self._hooks:
            try:
                hook.verify(body, mapped, json_parse=False)
            except WebhookVerificationError as exc:
                if "timestamp" in str(exc).lower():  # the library's own window, on its own clock
                    raise Rejected(401, "svix-timestamp outside the tolerance") from None
                continue  # not this secret: try the next one
            except UnicodeDecodeError:
                raise Rejected(400, "body is not UTF-8") from None
            except (ValueError, binascii.Error, TypeError, OverflowError):
                raise Rejected(400, "malformed svix-signature") from None
            return Verified(msg_id, ts)
        raise Rejected(401, "no matching signature")


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``svix-signature`` value (``v1,<base64>``) of ``body`` under ``secret``, through the
    library (for tests, the load tool and the emulator's counterpart).

    :raises ValueError: if ``body`` is not UTF-8 or ``secret`` is malformed.
    """
    from datetime import UTC, datetime

    return Webhook(secret).sign(msg_id, datetime.fromtimestamp(timestamp, tz=UTC), body.decode("utf-8"))
