"""Signed, per-user, per-list unsubscribe tokens (HMAC-SHA256) and the links built from them.

Token text: ``<kid>.<user_id>.<list>.<sig>`` where ``sig`` is the first 16 bytes of
HMAC-SHA256(secret[kid], "<kid>.<user_id>.<list>") in lowercase base32 without padding. Only
``[a-z0-9._-]`` appears, so links survive case-folding and URL re-encoding by mail clients;
verification strips surrounding whitespace and trailing punctuation that scanners append, and
compares signatures in constant time (``hmac.compare_digest``). The key id inside the token lets
keys rotate: old keys stay in the key ring for verification only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from dataclasses import dataclass

_KID = re.compile(r"^[a-z0-9]{1,16}$")
_LIST = re.compile(r"^[a-z0-9_]{1,64}$")
_UID = re.compile(r"^[0-9]{1,18}$")
ALL_MARKETING = "all"


class InvalidToken(ValueError):
    """The token is malformed, truncated, signed by an unknown key or tampered with."""


@dataclass(frozen=True)
class UnsubscribeSigner:
    """Sign and verify unsubscribe tokens.

    :param keys: key ring ``{kid: secret}``; ``kid`` is 1-16 of ``[a-z0-9]``; secrets are bytes of
        at least 16 bytes (from an Airflow connection's password or an env var, never code).
    :param current_kid: the key that signs new tokens.
    :raises ValueError: on a bad kid, a short secret or a current key missing from the ring.
    """

    keys: dict[str, bytes]
    current_kid: str

    def __post_init__(self) -> None:
        if self.current_kid not in self.keys:
            raise ValueError(f"current key id {self.current_kid!r} is not in the key ring")
        for kid, secret in self.keys.items():
            if not _KID.match(kid):
                raise ValueError(f"unsubscribe key id {kid!r} must be 1-16 of [a-z0-9]")
            if len(secret) < 16:
                raise ValueError(f"unsubscribe secret for key {kid!r} is shorter than 16 bytes")

    def _sig(self, kid: str, user_id: int, list_id: str) -> str:
        mac = hmac.new(self.keys[kid], f"{kid}.{user_id}.{list_id}".encode(), hashlib.sha256).digest()[:16]
        return base64.b32encode(mac).decode().rstrip("=").lower()

    def token(self, user_id: int, list_id: str) -> str:
        """Return the token for ``user_id`` on ``list_id`` (a campaign name or ``all``)."""
        if not _LIST.match(list_id):
            raise ValueError(f"list id {list_id!r} must be 1-64 of [a-z0-9_]")
        return f"{self.current_kid}.{int(user_id)}.{list_id}.{self._sig(self.current_kid, user_id, list_id)}"

    def verify(self, token: str) -> tuple[int, str]:
        """Return ``(user_id, list_id)`` of a valid token.

        :raises InvalidToken: for anything else (never another exception type).
        """
        text = token.strip().rstrip(".,;:!?)>]}'\"").lower()
        if not text.isascii():
            raise InvalidToken("malformed token")  # tokens are [a-z0-9._-]; no second spelling
        parts = text.split(".")
        if len(parts) != 4:
            raise InvalidToken("malformed token")
        kid, uid, list_id, sig = parts
        if kid not in self.keys or not _UID.match(uid) or not _LIST.match(list_id):
            raise InvalidToken("malformed token or unknown key")
        expected = self._sig(kid, int(uid), list_id)
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise InvalidToken("bad signature")
        return int(uid), list_id


def signer_from_secret(secret: str, kid: str = "k1", old: dict[str, str] | None = None) -> UnsubscribeSigner:
    """Build a signer from text secrets (e.g. a connection password); ``old`` keys verify only."""
    ring = {k: v.encode() for k, v in (old or {}).items()}
    ring[kid] = secret.encode()
    return UnsubscribeSigner(keys=ring, current_kid=kid)
