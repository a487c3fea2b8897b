"""Reconcile a provider batch response with the request, by index (pure functions).

Resend's permissive batch answers ``{"data": [{"id"}...], "errors": [{"index", "message"}...]}``
(provider docs, batch validation modes). It does not state that ``data`` lists the accepted emails
in request order; we rely on it (guarded by a contract test against the emulator and the official
SDK) and refuse to guess whenever the response does not add up: then the outcome is
:class:`~mailflow.model.outcome.Unknown` and the rows stay ``sending`` for the reconciler.
"""

from __future__ import annotations

import re
from typing import Any

from mailflow.model.outcome import Accepted, Outcome, Unknown

#: Fields of an email object that are the same for every email of a campaign (the sender, the
#: reply address, the headers, and what the campaign's templates render: subject, html, text, tags):
#: a refusal naming one of them is the campaign's mistake, never the recipient's. The recipient's
#: own fields (``to``, ``cc``, ``bcc``) are not listed: a refusal naming them, or naming no field,
#: stays a per-recipient rejection. Field names from Resend's send-batch request schema
#: (/work/shared/reference/resend-openapi.yaml, ``CreateEmailOptions``).
CAMPAIGN_FIELDS = frozenset({"from", "reply_to", "subject", "html", "text", "headers", "tags", "attachments",
                             "scheduled_at", "react", "template"})
RECIPIENT_FIELDS = frozenset({"to", "cc", "bcc"})
#: Campaign fields rendered from each recipient's data (``{{ user.first_name }}`` in a subject): a
#: refusal of SOME emails of a batch for one of them is about those recipients' data and fails
#: those rows as before; only when EVERY email of a batch of two or more is refused for the same
#: rendered field is the template itself at fault (campaign-level). The other campaign fields are the same bytes in
#: every email (or built by this package, the headers): one refusal is enough.
RENDERED_FIELDS = frozenset({"subject", "html", "text", "react", "template"})

# A field named in an error message: in backticks or quotes (Resend writes "Invalid `from` field",
# "Missing `from` field"), or as a bare word before "field" / "address" ("invalid from address").
_QUOTED = re.compile(r"[`'\"]([A-Za-z_]+)[`'\"]")
_BARE = re.compile(r"\b([A-Za-z_]+)\s+(?:field|address|header)s?\b", re.IGNORECASE)


def campaign_field(message: str) -> str | None:
    """The campaign field a provider error message names, or None if it names a recipient field
    (``to``, ``cc``, ``bcc``), or no known field at all (then the rejection is per-recipient).

    The first known field name wins, looked for in backticks or quotes first and then as a bare word
    before "field" / "address" (so ``Invalid `from` field. The email address needs to follow the
    `email@example.com` format`` names ``from``; the error name ``invalid_from_address`` also
    names ``from``). Case-insensitive; never raises.

    :returns: the field name in lower case (one of :data:`CAMPAIGN_FIELDS`) or None.
    """
    text = str(message or "")
    lowered = text.lower()
    for pattern in (_QUOTED, _BARE):
        for m in pattern.finditer(text):
            name = m.group(1).lower()
            if name in RECIPIENT_FIELDS:
                return None
            if name in CAMPAIGN_FIELDS:
                return name
    if "invalid_from_address" in lowered:
        return "from"
    return None


def reconcile_by_index(request_size: int, payload: Any) -> Outcome:
    """Map a 2xx batch response onto request indices ``0..request_size-1``.

    Accepted emails take the ``data`` ids in order over the indices not named in ``errors``.

    An error whose message names a field of the campaign (:func:`campaign_field`: ``from``,
    ``reply_to``, ``headers``; a rendered subject or body only when every email of the batch is
    refused for that same field, see :data:`RENDERED_FIELDS`) is not the recipient's fault: its index
    goes to ``withheld`` (released, nobody charged) and the outcome stops the run with an alert
    (``stop_run`` "campaign refused: `<field>`", ``fatal``, ``campaign_field``). Accepted indices of
    the same answer stay accepted.

    :returns: :class:`Accepted` when ``len(data) + len(errors) == request_size``, every error index
        is an int in range and unique, and every id is a non-empty string; otherwise
        :class:`Unknown` with the reason (never raises on a malformed payload).
    """
    if not isinstance(payload, dict) or not isinstance(payload.get("data"), list):
        return Unknown(reason=f"ambiguous response: no data array ({str(payload)[:200]})")
    data = payload["data"]
    errors = payload.get("errors") or []
    if not isinstance(errors, list):
        return Unknown(reason="ambiguous response: errors is not an array")
    rejected: dict[int, str] = {}
    for err in errors:
        idx = err.get("index") if isinstance(err, dict) else None
        if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < request_size or idx in rejected:
            return Unknown(reason=f"ambiguous response: bad error index {err!r}")
        rejected[idx] = str(err.get("message") or "rejected by provider")
    if len(data) + len(rejected) != request_size:
        return Unknown(
            reason=f"ambiguous response: {len(data)} ids + {len(rejected)} errors != {request_size} emails sent"
        )
    ids: dict[int, str] = {}
    accepted_indices = [i for i in range(request_size) if i not in rejected]
    for idx, item in zip(accepted_indices, data, strict=True):
        pid = item.get("id") if isinstance(item, dict) else None
        if not isinstance(pid, str) or not pid:
            return Unknown(reason=f"ambiguous response: data item without id {item!r}")
        ids[idx] = pid
    if len(set(ids.values())) != len(ids):
        return Unknown(reason="ambiguous response: duplicate provider ids")
    fields = {i: f for i, m in rejected.items() if (f := campaign_field(m)) is not None}
    if request_size < 2 or len(fields) < request_size or len(set(fields.values())) > 1:
        # a rendered field is the template's fault only if every email of a batch (two or more:
        # one email cannot tell the template from its recipient's data) is refused for it
        fields = {i: f for i, f in fields.items() if f not in RENDERED_FIELDS}
    if not fields:
        return Accepted(ids=ids, rejected=rejected)
    withheld = {i: rejected.pop(i) for i in sorted(fields)}
    name = fields[min(fields)]
    return Accepted(ids=ids, rejected=rejected, withheld=withheld, fatal=True, campaign_field=name,
                    stop_run=f"campaign refused: `{name}` ({withheld[min(withheld)][:200]})")
