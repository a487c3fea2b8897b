"""Idempotency keys (docs/model.md, "Idempotency keys").

The key the provider sees is assigned by the store when it saves a batch (``save_batch`` in
``store/sql/queries/send_log.sql``): ``mf-<installation id>-<campaign tag>-<batch serial>-<16 hex of
sha256(body)>``, so a key is never sent with two bodies, even across databases sharing one provider
account. :func:`key_tag` makes the campaign tag; :func:`idempotency_key` is the renderer's
provisional key, replaced when the batch is stored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence


def idempotency_key(campaign: str, row_ids: Sequence[int]) -> str:
    """Key for a batch: unique by construction (a send-log id belongs to one batch at a time) and
    derived from exactly the rows it carries, so a resend of a subset gets a new key.

    Shape: ``mf-<first row id>-<16 hex of sha256(ids)>`` (<= 256 chars, Resend's limit)."""
    digest = hashlib.sha256(",".join(str(i) for i in row_ids).encode()).hexdigest()[:16]
    return f"mf-{row_ids[0]}-{digest}"


def key_tag(campaign: str) -> str:
    """The campaign part of an idempotency key: ``[A-Za-z0-9_]`` only, at most 64 characters
    (a key is 1-256 characters, Resend's idempotency page)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", campaign)[:64] or "_"


def batch_key(installation: str, campaign: str, serial: int, body: bytes) -> str:
    """The stored key of a batch: ``mf-<installation id>-<campaign tag>-<batch serial>-<16 hex of
    sha256(body)>`` (docs/model.md, "Idempotency keys"; the same format ``send_log.save_batch``
    builds in SQL). ``installation`` is ``mail.installation.id`` (unique per database), ``serial``
    a value of ``mail.send_batch_serial`` (unique per batch in it)."""
    return f"mf-{installation}-{key_tag(campaign)}-{int(serial)}-{hashlib.sha256(body).hexdigest()[:16]}"
