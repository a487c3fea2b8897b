"""One provider rate limit shared by every process: 4 senders against an emulator capped at
10 requests/s produce no 429 with the PostgreSQL slot schedule, and do with per-process pacers."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from mailflow.emulator.testing import EmulatorProcess
from mailflow.loadgen import max_in_window, run_concurrent

CAP = 10  # requests/s, the emulator's per-key limit (sliding 1 s window)


@pytest.fixture
def capped_emulator(tmp_path: Path):
    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=CAP) as emu:
        yield emu


def test_max_in_window() -> None:
    assert max_in_window([0.0, 0.1, 0.5, 0.99, 1.0, 1.05], 1.0) == 5  # [0.1, 1.1)
    assert max_in_window([0.0, 1.0, 2.0], 1.0) == 1
    assert max_in_window([], 1.0) == 0


def test_four_processes_share_one_cap_through_postgres(capped_emulator, db_dsn: str) -> None:
    result = run_concurrent(4, capped_emulator.base_url, "re_test_emulator", emails_per_sender=800,
                            batch_size=100, requests_per_second=CAP, target_fraction=0.8,
                            dsn=db_dsn, account=f"pacing-test-{uuid.uuid4().hex[:6]}")
    stats = capped_emulator.stats()
    assert result["requests"] == 32  # 4 senders x 8 batches, no retries needed
    assert result["rate_limited"] == 0
    assert stats["responses_by_status"] == {"200": 32}  # the provider's own count: no 429 at all
    assert result["accepted"] == 3200
    assert result["max_requests_in_any_second"] <= CAP
    assert 6.0 <= result["request_rate"] <= CAP  # ~8/s: the target fraction of the cap


def test_per_process_pacers_exceed_the_cap(capped_emulator) -> None:
    # The seed's design: each process paces itself at 0.8 x cap, so 4 of them send ~3.2 x cap.
    result = run_concurrent(4, capped_emulator.base_url, "re_test_emulator", emails_per_sender=800,
                            batch_size=100, requests_per_second=CAP, target_fraction=0.8, dsn=None)
    assert result["rate_limited"] > 0
    assert capped_emulator.stats()["rate_limited"]["rate_limit_exceeded"] == result["rate_limited"]
    assert result["accepted"] == 3200  # retries still deliver everything, once
