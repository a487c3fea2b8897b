"""One test email of a scheduled campaign, before it is approved: the campaign's email rendered
with its first recipient's data (the recipient's address replaced by the test address), sent
through the real provider connection, subject prefixed ``[TEST] ``, tagged ``test`` and
``mailflow_test = <its id>``. It is recorded in ``mail.test_email`` (written before the request,
so a webhook that beats the answer is matched by the tag) and as a campaign event (``test_email``,
with the provider's id), never as a send-log row, so it is in no count, no contact policy, no
report and no campaign address reservation. Its outcomes (delivered, bounced, opened, ...) are
recorded on it by the webhook receiver (:mod:`mailflow.store.test_emails`); a hard bounce or a
complaint suppresses the address like any email's, and no test email goes to a suppressed address.

The unsubscribe link in it is signed for user 0 (no user): clicking it in the test inbox
unsubscribes no real recipient."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

from mailflow.campaigns import CampaignFolder
from mailflow.model.outcome import Accepted, MintedRow, PreparedBatch
from mailflow.sendloop.render import Renderer
from mailflow.sources.scheduled.preview import campaign_for_render, first_recipient
from mailflow.store import test_emails
from mailflow.store.policy import normalise_address
from mailflow.store.scheduled import ScheduledStore

TEST_PREFIX = "[TEST] "
SEND_BUDGET_SECONDS = 60.0
"""Seconds the request may take, retries and pacing included."""


class TestEmailError(RuntimeError):
    """The test email was not accepted; the message says why. ``retry_safe``: the request was
    proven not processed (a new request cannot deliver twice); otherwise it was refused (the same
    request fails again) or its outcome is unknown (a new request might deliver a second one)."""

    __test__ = False  # not a pytest class

    def __init__(self, message: str, *, retry_safe: bool) -> None:
        super().__init__(message)
        self.retry_safe = retry_safe


def masked(address: str) -> str:
    """``a***@example.com``: an address as events and logs show it."""
    local, _, domain = address.partition("@")
    return f"{local[:1]}***@{domain}"


def send_test_email(conn: psycopg.Connection, client: Any, campaign_id: int, to: str, actor: str | None, *,
                    renderer: Renderer, folder: CampaignFolder | None = None) -> dict[str, Any]:
    """Send one test email of campaign ``campaign_id`` to ``to`` through ``client`` (a
    :class:`~mailflow.provider.client.ResendClient`: the shared pacer, retries and outcome model of
    every send). Before the request, its ``mail.test_email`` row is written and committed (status
    ``sending``, a new tag id ``uuid4().hex`` sent as the tag ``mailflow_test``); after it, the
    row gets the provider's id (status ``sent``) together with the campaign event ``test_email``
    (``detail``: ``reason = "test_email"``, ``provider_id``, ``to`` masked, ``idempotency_key``,
    ``subject``, ``test_email_id``), or the status of a request not accepted (``not_sent``,
    ``refused``, ``unknown``). Each call is a new request under a new idempotency key
    (``test-email/<campaign>/<tag id>``), so asking twice sends twice; its own retries reuse that
    key and bytes. Run it on an autocommit connection (each step commits on its own).

    :returns: ``{"campaign", "to" (masked), "subject", "provider_id", "idempotency_key",
        "test_email_id"}``.
    :raises ValueError: if ``to`` is not a valid address (naming it), is suppressed for all mail or
        for this campaign (naming the source: a hard bounce, a complaint, ...), or the campaign has
        no status a test makes sense in (cancelled or completed).
    :raises LookupError: if the campaign does not exist.
    :raises TestEmailError: if the provider did not accept it.
    :raises mailflow.sendloop.render.RenderError: if the email cannot be rendered.
    """
    address = normalise_address(to)
    if not address.valid:
        raise ValueError(f"test_email_to {to!r} is not a valid address: {address.error}")
    folder = folder or CampaignFolder.resolve()
    with conn.transaction():
        c = ScheduledStore(conn).campaign_by_id(campaign_id)
        if c is None:
            raise LookupError(f"no campaign with id {campaign_id} in mail.campaign")
        if c["status"] in ("cancelled", "completed"):
            raise ValueError(f"campaign {c['name']!r} is {c['status']}: no test email")
        suppressed = test_emails.suppressed_as(conn, address.key, str(c["name"]))
        if suppressed is not None:
            raise ValueError(f"test_email_to {masked(address.send)} is suppressed (source {suppressed}): "
                             "no test email is sent to a suppressed address")
        rec = first_recipient(conn, c, folder)
    context = dict(rec[2]) if rec is not None else {}
    campaign = campaign_for_render(c, folder)
    rendered = renderer.prepare_batch(campaign, [MintedRow(id=0, user_id=0, email=address.send, context=context)])
    [mail] = json.loads(rendered.body)
    tag = uuid.uuid4().hex
    mail["subject"] = TEST_PREFIX + mail["subject"]
    mail["tags"] = [*mail.get("tags", []), {"name": "test", "value": "true"},
                    {"name": test_emails.TAG_NAME, "value": tag}]
    headers = {k: v for k, v in mail.get("headers", {}).items() if k != "X-Mailflow-Send-Id"}  # no row has it
    mail["headers"] = {**headers, "X-Mailflow-Test": "true"}
    key = f"test-email/{c['name']}/{tag}"
    batch = PreparedBatch(idempotency_key=key, campaign=str(c["name"]), row_ids=(0,),
                          body=json.dumps([mail], ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode(),
                          key_identity=getattr(client, "key_identity", None), content_hash=rendered.content_hash)
    with conn.transaction():
        test_id = test_emails.record_request(conn, campaign_id, tag, address.send, mail["subject"])
    outcome = client.send_batch(batch, client.clock.monotonic() + SEND_BUDGET_SECONDS)
    if not isinstance(outcome, Accepted):
        kind = getattr(outcome, "kind", type(outcome).__name__)
        with conn.transaction():
            test_emails.record_not_accepted(conn, test_id, kind if kind in test_emails.NOT_ACCEPTED else "unknown")
        raise TestEmailError(f"test email of campaign {c['name']!r} to {masked(address.send)} not sent "
                             f"({kind}): {getattr(outcome, 'reason', outcome)}", retry_safe=kind == "not_sent")
    if 0 not in outcome.ids:
        why = outcome.rejected.get(0) or outcome.withheld.get(0) or "no id in the answer"
        with conn.transaction():
            test_emails.record_not_accepted(conn, test_id, "refused")
        raise TestEmailError(f"test email of campaign {c['name']!r} to {masked(address.send)} refused: {why}",
                             retry_safe=False)
    provider_id = outcome.ids[0]
    with conn.transaction():
        current = ScheduledStore(conn).campaign_by_id(campaign_id) or c
        test_emails.record_accepted(conn, test_id, provider_id, current["status"], actor, {
            "reason": "test_email", "provider_id": provider_id, "to": masked(address.send),
            "idempotency_key": key, "subject": mail["subject"], "test_email_id": test_id})
    return {"campaign": c["name"], "to": masked(address.send), "subject": mail["subject"],
            "provider_id": provider_id, "idempotency_key": key, "test_email_id": test_id}
