"""Address suppressions written with their mailbox key (docs/model.md, "The mailbox key").

Every lookup compares ``mail.suppression.email_key`` as stored, so an address suppression must be
written with its key: through :func:`suppress_address` (the deliverability feedback, operators'
scripts, tests), never by a bare ``INSERT`` of the address text alone (such a row matches nothing).
"""

from __future__ import annotations

import psycopg

from mailflow.store.policy import mailbox_key
from mailflow.store.sql import query


def suppress_address(conn: psycopg.Connection, email: str, *, source: str, reason: str | None = None,
                     scope: str = "all") -> bool:
    """Suppress the mailbox of ``email`` for ``scope`` (``all`` or a campaign name), in the
    caller's transaction (or autocommit).

    :param email: the address as given (any spelling of the mailbox: case, whitespace, IDN or
        punycode domain); the row keeps this text and its :func:`mailbox_key`.
    :param source: e.g. ``bounce``, ``complaint``, ``provider_suppressed``, ``manual``.
    :returns: True if the suppression is new, False if the mailbox was already suppressed for the scope.
    :raises ValueError: if ``email`` is not a valid address (it has no mailbox to suppress).
    :raises psycopg.Error: on a database failure.
    """
    key = mailbox_key(email)
    if key is None:
        raise ValueError(f"not a valid address, nothing to suppress: {email!r}")
    row = conn.execute(query("suppression", "suppress_mailboxes"), {
        "emails": [email.strip()], "keys": [key], "scope": scope, "source": source, "reason": reason}).fetchone()
    return row is not None


def suppress_user(conn: psycopg.Connection, user_id: int, *, source: str, reason: str | None = None,
                  scope: str = "all") -> bool:
    """Suppress the user ``user_id`` for ``scope`` (``all`` or a campaign name), in the caller's
    transaction (or autocommit): the fallback for an address that has no mailbox key (the
    validator rejects it) but belongs to a known user.

    :returns: True if the suppression is new, False if the user was already suppressed for the scope.
    :raises psycopg.Error: on a database failure.
    """
    row = conn.execute(query("suppression", "suppress_user"), {
        "user_id": int(user_id), "scope": scope, "source": source, "reason": reason}).fetchone()
    return row is not None
