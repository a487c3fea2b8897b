"""The circuit breaker's probe with a sending-only API key (the key docs/operations.md recommends):
GET /domains answers 401 restricted_api_key whatever the state of the sending path, so that answer
must not close the breaker during an outage; else every run claims a fresh batch into the outage
and leaves it ambiguous (issue 21, item 3, again)."""

from __future__ import annotations

import httpx
import psycopg
import pytest
from scheduled_rig import FAST_RETRY, Rig, provisioned, rig  # noqa: F401  (fixture)

from mailflow.model.outcome import SendError
from mailflow.provider.client import ResendClient
from mailflow.provider.pacing import PostgresPacer

SENDING_ONLY = "re_sending_only_probe"


def _sending_only_client(rig: Rig) -> ResendClient:
    pacer = PostgresPacer(lambda: psycopg.connect(rig.dsn), account=rig.emulator.base_url, requests_per_second=200)
    client = ResendClient(rig.emulator.base_url, SENDING_ONLY, pacer=pacer, policy=FAST_RETRY,
                          timeout=httpx.Timeout(5.0))
    rig.closers += [client, pacer]
    return client


def test_outage_with_a_sending_only_key_claims_only_the_batch_in_flight(rig: Rig) -> None:
    provisioned(rig, 50)
    rig.emulator.configure(restricted_keys=[SENDING_ONLY], outage=True)
    client = _sending_only_client(rig)
    for _ in range(5):  # five dispatch runs during the outage (one a minute in production)
        with pytest.raises(SendError, match="provider down"):
            rig.dispatch(client=client, batch_size=10)
    sending = [r for r in rig.rows() if r["status"] == "sending"]
    # only the batch in flight when the outage began is ambiguous; nobody else was claimed
    assert len(sending) == 10
    # the outage ends: the sending path answers the probe, the breaker closes and the rest is sent
    rig.emulator.configure(outage=False)
    summary = rig.dispatch(client=client, batch_size=10)
    assert summary.sent == 40
