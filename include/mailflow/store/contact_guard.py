"""The contact guard in the database (docs/model.md, "The contact policy"): lock the users'
``mail.contact`` rows in user_id order, then their mailboxes' ``mail.mailbox`` rows in key order,
inside the claim transaction, read their contacts (the user's own and every other user's at the
same mailbox) after the locks, reserve one address per campaign; and the policy's caps as SQL.
Used by the lifecycle mint and the scheduled claim alike.

Lock order (deadlock-free): every claimer takes all of its users' locks (user_id order) before any
mailbox lock (key order, bytewise), so no claimer holding a mailbox waits for a user, and within
each kind the order is one total order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql as pgsql

from mailflow.model.policy import ContactPolicy
from mailflow.store.policy import Contact, Hold, contacts_from_rows, evaluate
from mailflow.store.sql import query


def caps_sql(policy: ContactPolicy, name: str = "eligible_cap") -> pgsql.Composable:
    """One clause per frequency cap the cooldown does not imply (users with fewer than ``emails``
    contacts within the cap's window of the email): ``lifecycle.eligible_cap`` (a set-based
    anti-join) or ``lifecycle.snapshot_cap`` (a HAVING term of ``snapshot_policy``)."""
    parts = []
    for i in range(len(policy.extra_caps())):
        parts.append(pgsql.SQL(query("lifecycle", name)).format(
            since=pgsql.Placeholder(f"cap_since_{i}"), until=pgsql.Placeholder(f"cap_until_{i}"),
            window=pgsql.Placeholder(f"cap_window_{i}"), emails=pgsql.Placeholder(f"cap_emails_{i}")))
    return pgsql.SQL("\n  ").join(parts)


def lock_contacts(conn: psycopg.Connection, user_ids: Sequence[int], mailboxes: Sequence[str] = ()) -> datetime:
    """The contact guard, inside the caller's transaction: create the users' ``mail.contact`` rows
    if needed and lock them FOR UPDATE in user_id order, then the same for the ``mailboxes``' keys
    in ``mail.mailbox`` (waits for any other claimer of these users or mailboxes to commit).
    Returns the database clock (the claim's "now", aware UTC).

    Every later statement of the transaction sees each claim committed before the lock: re-check
    the policy with :func:`load_contacts` after this call, never before.
    """
    ids = sorted(set(int(u) for u in user_ids))
    conn.execute(query("contact", "ensure_contacts"), {"ids": ids})
    conn.execute(query("contact", "lock_contact_rows"), {"ids": ids})
    keys = sorted(set(mailboxes))
    if keys:
        conn.execute(query("contact", "ensure_mailboxes"), {"keys": keys})
        conn.execute(query("contact", "lock_mailbox_rows"), {"keys": keys})
    row = conn.execute(query("contact", "db_now")).fetchone()
    assert row is not None
    return row[0]


def reserve_addresses(conn: psycopg.Connection, campaign: str, claims: Sequence[tuple[int, str]]) -> dict[str, int]:
    """One email per (campaign, normalised address), in the caller's transaction: reserve each
    ``(user_id, email_key)`` of ``claims`` in ``mail.campaign_address`` unless another user holds
    the key (the lowest user_id wins within ``claims``). Returns ``{email_key: holder user_id}``
    for every key of ``claims``; a claim whose holder is another user is a duplicate."""
    if not claims:
        return {}
    conn.execute(query("lifecycle", "reserve_addresses"), {
        "campaign": campaign, "keys": [k for _, k in claims], "uids": [u for u, _ in claims]})
    rows = conn.execute(query("lifecycle", "address_holders"), {
        "campaign": campaign, "keys": sorted({k for _, k in claims})}).fetchall()
    return {str(k): int(u) for k, u in rows}


def duplicate_reason(key: str, holder: int) -> str:
    """The ``error`` of a ``duplicate`` row: the address and the user who got the campaign there."""
    return f"duplicate address: {key} gets this campaign as user {holder}"


def load_contacts(conn: psycopg.Connection, user_ids: Sequence[int], policy: ContactPolicy, *, ref: datetime,
                  now: datetime, include_planned: bool, except_ids: Sequence[int] = (),
                  mailboxes: Mapping[int, str] | None = None) -> dict[int, list[Contact]]:
    """The users' contacts that any rule of ``policy`` can see (sent since ``min(ref, now) - widest
    window``, in flight, and with ``include_planned`` planned before ``now + widest window``),
    grouped by user; rows ``except_ids`` (the ones being claimed) are left out. With ``mailboxes``
    (user_id -> mailbox key), each user's list also holds the contacts of OTHER users at that
    mailbox (:func:`with_mailbox_contacts`)."""
    widest = policy.widest()
    params = {"ids": sorted(set(int(u) for u in user_ids)), "except_ids": list(except_ids),
              "since": min(ref, now) - widest, "until": now + widest, "include_planned": include_planned}
    contacts = contacts_from_rows(conn.execute(query("contact", "contacts_of"), params).fetchall())
    if mailboxes:
        rows = conn.execute(query("contact", "mailbox_contacts"),
                            params | {"keys": sorted(set(mailboxes.values()))}).fetchall()
        contacts = with_mailbox_contacts(contacts, rows, mailboxes)
    return contacts


def with_mailbox_contacts(contacts: dict[int, list[Contact]], rows: Sequence[Sequence[Any]],
                          mailboxes: Mapping[int, str]) -> dict[int, list[Contact]]:
    """Add to each user's ``contacts`` the contacts at the user's mailbox (``mailboxes``: user_id ->
    key) that belong to other users. ``rows`` are ``(email_key, user_id, row_id, campaign, status,
    at)`` (``contact.mailbox_contacts`` / ``mailbox_contact_times``); a row of the user itself is
    already among its own contacts and is not counted twice. Returns a new mapping."""
    at_box: dict[str, list[tuple[int, Contact]]] = {}
    for key, uid, rid, campaign, status, at in rows:
        at_box.setdefault(str(key), []).append((int(uid), Contact(int(rid), str(campaign), str(status), at)))
    out = {u: list(cs) for u, cs in contacts.items()}
    for uid, key in mailboxes.items():
        others = [c for owner, c in at_box.get(key, ()) if owner != int(uid)]
        if others:
            out.setdefault(int(uid), []).extend(others)
    return out


def contact_params(user_ids: Sequence[int], policy: ContactPolicy, *, ref: datetime,
                   include_planned: bool) -> dict[str, object]:
    """Parameters of ``contact.contact_times`` (the lifecycle mint's index-only form of
    :func:`load_contacts`, run in the same pipeline as the lock, after it): the users, ``ref``
    (aware) and the policy's widest window; the claim's "now" is the transaction's ``now()``."""
    return {"ids": sorted(set(int(u) for u in user_ids)), "ref": ref, "widest": policy.widest(),
            "include_planned": include_planned}


def policy_hold(policy: ContactPolicy, contacts: dict[int, list[Contact]], user_id: int, *, ref: datetime,
                now: datetime) -> Hold | None:
    """:func:`mailflow.store.policy.evaluate` for one user of a :func:`load_contacts` result."""
    return evaluate(policy, contacts.get(int(user_id), ()), ref=ref, now=now)
