"""The API key identity stored with every batch: stable, per account, and never the key."""

from __future__ import annotations

import hashlib

import pytest

from mailflow.model.outcome import MintedRow, PreparedBatch
from mailflow.provider.client import ResendClient, key_identity
from mailflow.sendloop.engine import key_identity_of, send_prepared, stamp_identity


class _Pacer:
    def close(self) -> None: ...


def test_key_identity_is_a_salted_hash_prefix_of_the_key_alone_and_never_the_key() -> None:
    key = "re_live_0123456789abcdef"
    ident = key_identity(key)
    digest = hashlib.sha256(b"mailflow-key-id:re_live_0123456789abcdef").hexdigest()
    assert ident == f"key#{digest[:16]}"
    assert key not in ident and hashlib.sha256(key.encode()).hexdigest()[:16] not in ident  # salted
    assert key_identity(key) == ident  # the same key: the same identity
    assert key_identity(key + "x") != ident
    # whatever URL reaches the account (a proxy, an emulator restarted on another port)
    with ResendClient("http://127.0.0.1:8025", key, pacer=_Pacer()) as other:  # type: ignore[arg-type]
        assert other.key_identity == ident
    with ResendClient("https://api.resend.com", key, pacer=_Pacer()) as client:  # type: ignore[arg-type]
        assert client.key_identity == ident and key_identity_of(client) == ident


def test_batches_carry_the_sending_key_identity_and_doubles_carry_none() -> None:
    def prepare(rows: object) -> PreparedBatch:
        return PreparedBatch(idempotency_key="p", campaign="c", row_ids=(1,), body=b"[]")

    rows = [MintedRow(id=1, user_id=1, email="a@example.com", context={})]
    with ResendClient("https://api.resend.com", "re_a", pacer=_Pacer()) as client:  # type: ignore[arg-type]
        assert stamp_identity(prepare, client)(rows).key_identity == client.key_identity
    assert stamp_identity(prepare, object())(rows).key_identity is None  # a double without an identity


def test_a_batch_is_never_sent_under_another_key_than_the_one_it_was_stored_for() -> None:
    with ResendClient("https://api.resend.com", "re_new", pacer=_Pacer()) as client:  # type: ignore[arg-type]
        batch = PreparedBatch(idempotency_key="mf-x-c-1-00", campaign="c", row_ids=(1,), body=b"[]",
                              key_identity=key_identity("re_old"))
        with pytest.raises(ValueError, match="never sent under another key"):
            send_prepared(client, batch, deadline=float("inf"), slot=None)
        assert client.stats["requests"] == 0
