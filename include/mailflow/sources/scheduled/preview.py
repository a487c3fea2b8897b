"""What an approver sees before a scheduled campaign is provisioned: how many of its recipients
the contact policy would hold back now (suppressed, in cooldown, over a frequency cap, invalid
address), and a sample email rendered for its first recipient. Reads only; writes nothing."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from mailflow.campaigns import Campaign, CampaignFolder, load_policy, scheduled_content_hash
from mailflow.model.outcome import MintedRow
from mailflow.sendloop.render import Renderer
from mailflow.sources.scheduled.provisioning import _MIN_BIGINT, _snapshot, recipient_source
from mailflow.store.contact_guard import load_contacts
from mailflow.store.policy import evaluate, normalise_address
from mailflow.store.scheduled import ScheduledStore
from mailflow.store.sql import query

PAGE = 5000
"""Recipients read per query by :func:`policy_holdback`."""


@dataclass
class Holdback:
    """Counts (recipients) of the campaign's recipients still to provision that the contact policy
    would hold back if they were due now: ``invalid`` (the address does not validate: the row would
    fail), ``suppressed`` (by address or user, for all mail or this campaign: cancelled),
    ``cooldown`` and ``capped`` (held: deferred, skipped or sent anyway per ``on_policy``),
    ``no_email`` (no address: gets no row). ``checked`` = recipients looked at; ``examples`` up to
    five reasons, with user ids only. ``on_policy = 'ignore'`` holds nothing for cooldown or caps."""

    checked: int = 0
    no_email: int = 0
    invalid: int = 0
    suppressed: int = 0
    cooldown: int = 0
    capped: int = 0
    on_policy: str = "defer"
    examples: list[str] = field(default_factory=list)

    @property
    def held(self) -> int:
        return self.invalid + self.suppressed + self.cooldown + self.capped

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "held": self.held}


def _recipients(conn: psycopg.Connection, c: dict[str, Any], folder: CampaignFolder) -> Iterator[list[Any]]:
    source = recipient_source(conn, c, folder)
    after = c["provision_cursor"] if c["provision_cursor"] is not None else _MIN_BIGINT
    while True:
        page = ScheduledStore(conn).recipients_page(source, after, PAGE, c["name"], int(c["id"]))
        if not page:
            return
        recs = [_snapshot(r[0]) for r in page]
        yield recs
        after = max(uid for uid, _, _ in recs)


def policy_holdback(conn: psycopg.Connection, campaign_id: int, *, now: datetime,
                    folder: CampaignFolder | None = None) -> Holdback:
    """Count what the contact policy (``lifecycle.toml``'s ``[policy]`` of ``folder``) and the
    suppression list would hold back of the recipients still to provision, were they due at
    ``now`` (aware): the same rules the dispatcher's claim applies (a planned email is held only
    when due, so later sends may fare better). Read-only, one transaction.

    :raises LookupError: if the campaign does not exist.
    :raises ValueError: for a missing recipients file or table.
    """
    folder = folder or CampaignFolder.resolve()
    policy = load_policy(folder=folder)
    out = Holdback()
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(campaign_id)
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        out.on_policy = str(c["on_policy"])
        for recs in _recipients(conn, c, folder):
            out.checked += len(recs)
            keys: dict[int, str] = {}
            for uid, email, _ in recs:
                if not email:
                    out.no_email += 1
                    continue
                a = normalise_address(email)
                if not a.valid:
                    out.invalid += 1
                    _example(out, f"user {uid}: invalid address ({a.error})")
                else:
                    keys[uid] = a.key
            if not keys:
                continue
            barred = {r[0] for r in conn.execute(query("contact", "suppressed_addresses"),
                                                 {"keys": sorted(set(keys.values())), "campaign": c["name"]})}
            barred_users = {int(r[0]) for r in conn.execute(query("contact", "suppressed_users"),
                                                            {"ids": sorted(keys), "campaign": c["name"]})}
            free = {}
            for uid, key in keys.items():
                if key in barred or uid in barred_users:
                    out.suppressed += 1
                    _example(out, f"user {uid}: suppressed")
                else:
                    free[uid] = key
            if not free or out.on_policy == "ignore" or not policy.rules:
                continue
            contacts = load_contacts(conn, sorted(free), policy, ref=now, now=now, include_planned=True,
                                     mailboxes=free)
            for uid in free:
                hold = evaluate(policy, contacts.get(uid, ()), ref=now, now=now)
                if hold is None:
                    continue
                if hold.cooldown:
                    out.cooldown += 1
                else:
                    out.capped += 1
                _example(out, f"user {uid}: {hold.reason()}")
    return out


def _example(out: Holdback, line: str) -> None:
    if len(out.examples) < 5:
        out.examples.append(line)


def campaign_for_render(c: dict[str, Any], folder: CampaignFolder) -> Campaign:
    """The renderer's :class:`Campaign` of a ``mail.campaign`` row with its own subject template
    (not the snapshot the dispatcher renders from: nothing is provisioned yet)."""
    return Campaign(name=str(c["name"]), priority=0, audience_sql="", template=str(c["template"]),
                    subject=str(c["subject"]), from_address=str(c["from_address"]), reply_to=c["reply_to"],
                    cooldown=timedelta(0), audience_window=timedelta(0), marketing=bool(c["marketing"]),
                    content_hash=scheduled_content_hash(c, folder))


def first_recipient(conn: psycopg.Connection, c: dict[str, Any],
                    folder: CampaignFolder) -> tuple[int, str | None, dict[str, Any]] | None:
    """``(user_id, email, context)`` of the campaign's first recipient with an address (user_id
    order, from the start of the list), or None if it has none."""
    source = recipient_source(conn, c, folder)
    after = _MIN_BIGINT
    while True:
        page = ScheduledStore(conn).recipients_page(source, after, 100, c["name"], int(c["id"]))
        if not page:
            return None
        recs = [_snapshot(r[0]) for r in page]
        for rec in recs:
            if rec[1]:
                return rec
        after = max(uid for uid, _, _ in recs)


def sample_email(conn: psycopg.Connection, campaign_id: int, renderer: Renderer,
                 folder: CampaignFolder | None = None) -> dict[str, Any] | None:
    """The email the campaign's first recipient would get, rendered by ``renderer``:
    ``{"user_id", "subject", "text", "email"}`` (``email``: the whole Resend email object; ``text``
    its text body with the recipient's unsubscribe link blanked out, for showing to people), or
    None for a campaign without recipients. Read-only.

    :raises LookupError: if the campaign does not exist.
    :raises mailflow.sendloop.render.RenderError: naming the template and the user, if it cannot render.
    """
    folder = folder or CampaignFolder.resolve()
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(campaign_id)
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        rec = first_recipient(conn, c, folder)
    if rec is None:
        return None
    uid, email, ctx = rec
    campaign = campaign_for_render(c, folder)
    batch = renderer.prepare_batch(campaign, [MintedRow(id=0, user_id=uid, email=str(email), context=ctx)])
    import json

    [mail] = json.loads(batch.body)
    # the sample is shown to people (the approval): its unsubscribe link must not work for the user
    link = f"{renderer.public_url}/u/{renderer.signer.token(uid, campaign.name, issued=renderer.issued_on)}"
    text = str(mail["text"]).replace(link, f"{renderer.public_url}/u/<user {uid}'s token>")
    return {"user_id": uid, "subject": mail["subject"], "text": text, "email": mail}
