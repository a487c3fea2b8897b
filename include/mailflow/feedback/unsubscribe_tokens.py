"""Signed, per-user, per-list unsubscribe tokens (HMAC-SHA256) and the links built from them.

Two token shapes, both only ``[a-z0-9._-]`` (they survive case-folding and URL re-encoding by mail
clients) and both verified by the same :meth:`UnsubscribeSigner.verify`:

* **v1** (no expiry, the default): ``<kid>.<user_id>.<list>.<sig>`` where ``sig`` is the first 16
  bytes of HMAC-SHA256(secret[kid], ``"<kid>.<user_id>.<list>"``) in lowercase base32 without
  padding (26 characters).
* **v2** (with an issue day, for an optional maximum age): ``<kid>.<user_id>.<list>.<day>.<sig>``
  where ``day`` is the UTC issue date as days since 1970-01-01 and ``sig`` is HMAC-SHA256 over
  ``"mailflow-unsubscribe-v2|<kid>.<user_id>.<list>.<day>"`` (domain-separated from v1, so a v1
  signature is never a v2 signature and the day cannot be dropped or changed). Issued only when the
  caller passes the day (``token(..., issued=date)``; :class:`mailflow.sendloop.render.Renderer` does so when
  built with ``issued_on``), which keeps rendering deterministic: the day is an input, never the
  clock. A signer with ``max_age_days`` refuses v2 tokens older than that (:class:`ExpiredToken`);
  v1 tokens carry no date and do not expire (retire their key to end them).

The key id inside the token lets keys rotate: the current key signs, old keys stay in the key ring
for verification only, and removing a key from the ring invalidates every token it signed.

**Canonical re-spellings.** :func:`canonical_token` is the one normalisation applied before
parsing: surrounding whitespace, trailing punctuation that mail clients and scanners append
(``. , ; : ! ? ) > ] } ' "``), and letter case (some clients upper-case links) are removed; every
other difference is a different token. Numbers must be written canonically (no leading zeros, ASCII
digits only), so a token verifies only if its canonical form is byte-for-byte the token that was
issued. Signatures are compared in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime

_KID = re.compile(r"^[a-z0-9]{1,16}$")
_LIST = re.compile(r"^[a-z0-9_]{1,64}$")
_UID = re.compile(r"^(?:0|[1-9][0-9]{0,17})$")  # canonical: no leading zeros, < 10**18
_DAY = re.compile(r"^(?:0|[1-9][0-9]{0,5})$")  # days since 1970-01-01 (UTC), canonical
_TRAILING = ".,;:!?)>]}'\""
_V2_DOMAIN = b"mailflow-unsubscribe-v2|"
_EPOCH = date(1970, 1, 1)
ALL_MARKETING = "all"
MIN_MAX_AGE_DAYS = 30  # CAN-SPAM: an opt-out mechanism must work for at least 30 days after sending


class InvalidToken(ValueError):
    """The token is malformed, truncated, signed by an unknown key or tampered with."""


class ExpiredToken(InvalidToken):
    """A genuine v2 token older than the signer's ``max_age_days`` (a subclass of InvalidToken)."""


@functools.lru_cache(maxsize=64)
def _keyed(secret: bytes) -> hmac.HMAC:
    """An HMAC-SHA256 of ``secret`` over no message yet, to be ``copy()``-ed per token (keys are few)."""
    return hmac.new(secret, digestmod=hashlib.sha256)


@functools.lru_cache(maxsize=1024)
def _list_ok(list_id: str) -> bool:
    """``list_id`` is 1-64 of ``[a-z0-9_]`` (checked once per list: a run signs thousands per campaign)."""
    return _LIST.match(list_id) is not None


def canonical_token(text: str) -> str:
    """The canonical spelling of a token as received: whitespace and trailing punctuation stripped,
    lower-cased. Two texts are the same token iff their canonical spellings are equal."""
    return text.strip().rstrip(_TRAILING).lower()


def day_number(day: date) -> int:
    """Days since 1970-01-01 of a calendar date (the ``day`` field of v2 tokens)."""
    return (day - _EPOCH).days


@dataclass(frozen=True)
class UnsubscribeSigner:
    """Sign and verify unsubscribe tokens.

    :param keys: key ring ``{kid: secret}``; ``kid`` is 1-16 of ``[a-z0-9]``; secrets are bytes of
        at least 16 bytes (from an Airflow connection's password or an env var, never code).
    :param current_kid: the key that signs new tokens.
    :param max_age_days: if set, v2 tokens issued more than this many days before the verification
        day (UTC) are refused with :class:`ExpiredToken`; at least 30 (CAN-SPAM). ``None``: no expiry.
    :raises ValueError: on a bad kid, a short secret, a current key missing from the ring or a
        maximum age under 30 days.
    """

    keys: dict[str, bytes]
    current_kid: str
    max_age_days: int | None = None

    def __post_init__(self) -> None:
        if self.current_kid not in self.keys:
            raise ValueError(f"current key id {self.current_kid!r} is not in the key ring")
        for kid, secret in self.keys.items():
            if not _KID.match(kid):
                raise ValueError(f"unsubscribe key id {kid!r} must be 1-16 of [a-z0-9]")
            if len(secret) < 16:
                raise ValueError(f"unsubscribe secret for key {kid!r} is shorter than 16 bytes")
        if self.max_age_days is not None and self.max_age_days < MIN_MAX_AGE_DAYS:
            raise ValueError(f"max_age_days must be at least {MIN_MAX_AGE_DAYS} (links must work for 30 days "
                             f"after sending), got {self.max_age_days}")

    def _sig(self, kid: str, user_id: int, list_id: str, day: int | None = None) -> str:
        if day is None:
            msg = f"{kid}.{user_id}.{list_id}".encode()
        else:
            msg = _V2_DOMAIN + f"{kid}.{user_id}.{list_id}.{day}".encode()
        # the key's padded inner and outer hash states are derived once per key (_keyed), then
        # copied per token: HMAC(key, msg) as hmac.new(key, msg, sha256) computes it
        mac = _keyed(self.keys[kid]).copy()
        mac.update(msg)
        return base64.b32encode(mac.digest()[:16]).decode().rstrip("=").lower()

    def token(self, user_id: int, list_id: str, issued: date | None = None) -> str:
        """Return the token for ``user_id`` on ``list_id`` (a campaign name or ``all``).

        :param issued: the UTC issue date: given -> a v2 token that can expire; None -> v1 (no date).
        :raises ValueError: for a list id outside ``[a-z0-9_]{1,64}`` or a user id outside
            ``0 <= id < 10**18``.
        """
        if not _list_ok(list_id):
            raise ValueError(f"list id {list_id!r} must be 1-64 of [a-z0-9_]")
        uid = int(user_id)
        if not 0 <= uid < 10**18:
            raise ValueError(f"user id {user_id!r} must be between 0 and 10**18 - 1")
        kid = self.current_kid
        if issued is None:
            return f"{kid}.{uid}.{list_id}.{self._sig(kid, uid, list_id)}"
        day = day_number(issued)
        if not _DAY.match(str(day)):
            raise ValueError(f"issue date {issued} is outside 1970-01-01 .. year 4707")
        return f"{kid}.{uid}.{list_id}.{day}.{self._sig(kid, uid, list_id, day)}"

    def verify(self, token: str, *, today: date | None = None) -> tuple[int, str]:
        """Return ``(user_id, list_id)`` of a valid token (any key in the ring, v1 or v2).

        :param today: the verification day (UTC) for the maximum age; default: the current UTC date.
        :raises ExpiredToken: for a genuine v2 token older than ``max_age_days``.
        :raises InvalidToken: for anything else (never another exception type).
        """
        text = canonical_token(token)
        if not text.isascii():
            raise InvalidToken("malformed token")  # tokens are [a-z0-9._-]; no second spelling
        parts = text.split(".")
        if len(parts) == 4:
            kid, uid, list_id, sig = parts
            day = None
        elif len(parts) == 5:
            kid, uid, list_id, day_text, sig = parts
            if not _DAY.match(day_text):
                raise InvalidToken("malformed token")
            day = int(day_text)
        else:
            raise InvalidToken("malformed token")
        if kid not in self.keys or not _UID.match(uid) or not _LIST.match(list_id):
            raise InvalidToken("malformed token or unknown key")
        expected = self._sig(kid, int(uid), list_id, day)
        if not hmac.compare_digest(expected.encode(), sig.encode()):
            raise InvalidToken("bad signature")
        if day is not None:
            now_day = day_number(today or datetime.now(UTC).date())
            if day > now_day + 1:  # one day of clock skew between issuer and verifier
                raise InvalidToken("token issued in the future")
            if self.max_age_days is not None and now_day - day > self.max_age_days:
                raise ExpiredToken(f"token issued {now_day - day} days ago, over the maximum age of "
                                   f"{self.max_age_days} days")
        return int(uid), list_id


def signer_from_secret(secret: str, kid: str = "k1", old: dict[str, str] | None = None,
                       max_age_days: int | None = None) -> UnsubscribeSigner:
    """Build a signer from text secrets (e.g. a connection password); ``old`` keys verify only."""
    ring = {k: v.encode() for k, v in (old or {}).items()}
    ring[kid] = secret.encode()
    return UnsubscribeSigner(keys=ring, current_kid=kid, max_age_days=max_age_days)


def signer_from_connection(password: str | None, extra: dict | None) -> UnsubscribeSigner:
    """Build a signer from the ``mail_unsubscribe`` connection's fields: password = current secret;
    extra ``kid`` (default ``k1``), ``old_keys`` (``{kid: secret}``, verify only) and
    ``max_age_days`` (optional expiry of v2 tokens).

    :raises ValueError: if the password is empty or a field is invalid (the message never contains
        a secret).
    """
    if not password:
        raise ValueError("the unsubscribe connection has no password (the signing secret)")
    extra = extra or {}
    old = extra.get("old_keys") or {}
    from mailflow.masking import mask

    mask(password)  # in the API server's logs too: the current and the old keys forge tokens
    mask(old)
    if not isinstance(old, dict) or not all(isinstance(v, str) for v in old.values()):
        raise ValueError("extra 'old_keys' must be an object {kid: secret}")
    max_age = extra.get("max_age_days")
    return signer_from_secret(password, kid=str(extra.get("kid") or "k1"), old={str(k): v for k, v in old.items()},
                              max_age_days=int(max_age) if max_age not in (None, "") else None)
