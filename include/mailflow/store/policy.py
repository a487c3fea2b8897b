"""The contact policy (cooldown, frequency caps) and address hygiene, shared by every sending path.

**The policy** (docs/model.md, "The contact policy") is configured once, in the ``[policy]`` section
of ``campaigns/lifecycle.toml``: a cooldown across all campaigns and frequency caps ("at most N
emails per rolling window W"). The cooldown is the cap ``(1, cooldown)``. A cap ``(N, W)`` holds a
new email back when N contacts of the user already lie within W of it:

* a **contact** is an email of any campaign and kind that was sent (``sent``, at ``sent_at``), is in
  flight (``sending``: claimed, or of unknown outcome; counted as "now", inside every window) or,
  for lifecycle mail only, is planned (``pending``, at ``scheduled_at``, or now if that passed: a
  planned scheduled email keeps lifecycle mail away from its actual send time; not while its
  campaign is paused, cancelled or completed: such a campaign sends nothing). Rejected, rolled-back, cancelled, skipped
  and duplicate rows are not contacts.
* **window bounds** are instants (UTC, elapsed time: P1D is 24 hours across a DST change): for a
  new email decided with reference time ``ref`` (the data interval end of a lifecycle run, or now)
  and actual send time ``now``, the contacts counted are those with ``ref - W <= at < now + W``
  (lower bound inclusive, upper bound exclusive).

The database enforces it: each claim locks the users' ``mail.contact`` rows (user_id order) and
re-evaluates :func:`evaluate` over the user's contacts read after the lock.

**Address hygiene** (:func:`normalise_address`) runs before any request on both paths, with
``email-validator`` (no DNS: ``check_deliverability=False``).

**The mailbox key** (:func:`mailbox_key`, docs/model.md "The mailbox key") is the one definition of
"the same mailbox": computed here, in Python, once per address, stored with every send-log row
(``send_log.email_key``) and every address suppression (``suppression.email_key``), and compared as
stored by SQL (never re-derived there: PostgreSQL's ``lower()`` depends on the database's locale).
The contact guard locks and counts mailboxes as well as users (``mail.mailbox``).
"""

from __future__ import annotations

import functools
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import email_validator

from mailflow.model.policy import Cap, ContactPolicy, human_duration

#: Statuses whose rows are contacts (see the module docstring); ``pending`` only for lifecycle mail.
CONTACT_STATES = ("sent", "sending")
ON_POLICY = ("defer", "skip", "ignore")


# -- evaluation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contact:
    """One contact of a user: send-log ``row_id``, its ``campaign``, ``status`` and instant ``at``
    (aware; ``None`` = in flight, i.e. now and inside every window)."""

    row_id: int
    campaign: str
    status: str
    at: datetime | None


@dataclass(frozen=True)
class Hold:
    """Why an email is held back: the rule, the contacts that fill it, and ``free_at`` (aware UTC),
    the first instant at which the rule would let the email go (for a deferral)."""

    rule: Cap
    contacts: tuple[Contact, ...]
    free_at: datetime
    cooldown: bool = False

    def reason(self) -> str:
        """One line for ``send_log.error`` and the event: the rule and the contact(s) behind it."""
        what = f"cooldown {human_duration(self.rule.window)}" if self.cooldown else f"frequency cap {self.rule}"
        seen = ", ".join(
            f"row {c.row_id} ({c.campaign}, {c.status}{'' if c.at is None else ' ' + c.at.isoformat()})"
            for c in self.contacts[:3])
        more = f" and {len(self.contacts) - 3} more" if len(self.contacts) > 3 else ""
        return f"contact policy: {what}: {seen}{more}; free from {self.free_at.isoformat()}"


def evaluate(policy: ContactPolicy, contacts: Iterable[Contact], *, ref: datetime, now: datetime) -> Hold | None:
    """Decide one new email for a user whose contacts are ``contacts``.

    :param ref: the reference instant (lifecycle: the data interval end; scheduled: now), aware.
    :param now: the actual send time (the database clock), aware; in-flight contacts are at ``now``.
    :returns: ``None`` if the email may go, else the first rule it breaks (cooldown first).
    """
    items = list(contacts)
    lo_ref = min(ref, now)
    for i, rule in enumerate(policy.rules):
        lo, hi = lo_ref - rule.window, now + rule.window
        inside = [c for c in items if c.at is None or lo <= c.at < hi]
        if len(inside) >= rule.emails:
            times = sorted((now if c.at is None else c.at) for c in inside)
            # free once all but emails-1 of them are more than `window` in the past
            free_at = times[len(times) - rule.emails] + rule.window
            # the reason lists the email(s) behind the hold: in flight first, then the most recent
            inside.sort(key=lambda c: (c.at is None, c.at or now), reverse=True)
            return Hold(rule=rule, contacts=tuple(inside), free_at=max(free_at, now),
                        cooldown=(i == 0 and policy.cooldown > timedelta(0) and rule.emails == 1
                                  and rule.window == policy.cooldown))
    return None


# -- address hygiene --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Address:
    """A checked address: ``send`` is what goes in the request (trimmed, NFC, domain IDNA-encoded
    and lower-cased; local part as given); ``key`` is its :func:`mailbox_key` (deduplication,
    suppression, the contact guard's mailbox lock); ``keys`` = ``(key,)`` (kept for callers that
    match a set of spellings). ``error`` is the validator's reason when the address is invalid
    (then the others are empty)."""

    raw: str
    send: str = ""
    key: str = ""
    keys: tuple[str, ...] = field(default=())
    error: str | None = None

    @property
    def valid(self) -> bool:
        return self.error is None


def fold_local_part(local: str) -> str:
    """The case-folding rule of the mailbox key for a local part: Unicode full case folding
    (``str.casefold``, the "caseless matching" of the Unicode Standard, section 3.13; the data is
    the running Python's Unicode database, 14.0 on Python 3.11), then NFC again (folding can
    decompose: ``İ`` folds to ``i`` + U+0307).

    Why casefold and not ``lower``: ``lower`` is not a matching rule. Python's ``lower`` applies the
    final-sigma context (``ΟΔΟΣ`` -> ``οδος`` but ``οδοσ`` stays), so one mailbox typed two ways got
    two keys; casefold maps ``Σ``, ``σ`` and ``ς`` to ``σ``, ``İ`` and ``i̇`` to ``i̇``, ``Ä`` to ``ä``,
    and ``ß``, ``ẞ`` and ``SS`` to ``ss``. The last one merges ``straße`` with ``strasse``: we accept
    that (the upper case of ``ß`` is ``SS``, so a person typing the address in capitals reaches the
    same mailbox; the cost of a false merge is one email held back or one bounce suppressing a
    near-identical spelling, never a second email to one person). ASCII folds exactly as ``lower``,
    so every key of an ASCII address is what it was before."""
    return unicodedata.normalize("NFC", unicodedata.normalize("NFC", local).casefold())


def mailbox_key(raw: str | None) -> str | None:
    """The mailbox key of an address, or None if it is not a valid address: the one normalisation
    of the package (trim, NFC, ``email-validator`` syntax check without DNS, the domain IDNA-encoded
    by UTS #46 and lower-cased, the local part folded by :func:`fold_local_part`).

    Computed in Python when a row or a suppression is written and stored; SQL compares stored
    keys only. Idempotent: ``mailbox_key(mailbox_key(x)) == mailbox_key(x)``. Never raises.
    """
    a = normalise_address(raw)
    return a.key if a.valid else None


def normalise_address(raw: str | None) -> Address:
    """Check and normalise one recipient address (RFC 5321/6531 via ``email-validator``, no DNS).

    Trim, Unicode-normalise (NFC), IDNA-encode the domain for sending (UTS #46 via the validator),
    lower-case the domain; the local part keeps its case for sending and is folded
    (:func:`fold_local_part`) for the mailbox key only. Never raises: an invalid address comes
    back with ``error`` = the validator's message.

    A pure function of ``raw`` (no DNS, no clock), so each text is validated once per process
    (:func:`_normalised`, an LRU of the last 8,192 texts, a few MB): the validator costs ~25 us an
    address, and the same address comes back in every campaign whose audience holds its user and
    in every path (mint, scheduled claim, preview, outcome lookups). The :class:`Address` returned
    is immutable and may be shared.
    """
    return _normalised(raw)


@functools.lru_cache(maxsize=8_192)
def _normalised(raw: str | None) -> Address:
    """:func:`normalise_address`, computed."""
    text = unicodedata.normalize("NFC", (raw or "").strip())
    if not text:
        return Address(raw=raw or "", error="the address is empty")
    try:
        v = email_validator.validate_email(text, check_deliverability=False)
    except email_validator.EmailNotValidError as exc:
        return Address(raw=raw or "", error=str(exc))
    domain = (v.ascii_domain or v.domain).lower()
    send = f"{v.local_part}@{domain}"
    key = f"{fold_local_part(v.local_part)}@{domain}"
    return Address(raw=raw or "", send=send, key=key, keys=(key,))


def contacts_from_rows(rows: Sequence[Sequence[Any]]) -> dict[int, list[Contact]]:
    """Group ``(user_id, row_id, campaign, status, at)`` rows (the ``contact.contacts_of`` query) by user."""
    out: dict[int, list[Contact]] = {}
    for uid, rid, campaign, status, at in rows:
        out.setdefault(int(uid), []).append(Contact(int(rid), str(campaign), str(status), at))
    return out
