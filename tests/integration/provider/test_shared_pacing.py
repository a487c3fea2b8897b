"""One provider rate limit shared by every process: 4 senders against an emulator capped at
10 requests/s produce no 429 with the PostgreSQL slot schedule, and do with per-process pacers."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import psycopg
import pytest

from mailflow.emulator.testing import EmulatorProcess
from mailflow.provider.pacing import PostgresPacer
from mailflow_dev.loadgen import max_in_window, probe_in_new_process, run_concurrent

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


# -- the learned rate (issue 16): stored with the slot schedule, used by every new process ---------

def learned(db_dsn: str, account: str) -> dict:
    pacer = PostgresPacer(lambda: psycopg.connect(db_dsn), account, 10.0)
    try:
        row = pacer.learned()
        assert row is not None
        return row
    finally:
        pacer.close()


def test_a_new_process_starts_from_the_learned_limit_not_the_connection_default(db_dsn: str) -> None:
    account = f"learn-{uuid.uuid4().hex[:6]}"
    teacher = PostgresPacer(lambda: psycopg.connect(db_dsn), account, requests_per_second=10.0)
    teacher.claim()
    teacher.observe({"ratelimit-limit": "2", "ratelimit-remaining": "1", "ratelimit-reset": "1"})
    teacher.close()
    assert learned(db_dsn, account)["limit_per_second"] == 2.0
    # another interpreter, configured with the connection default (10/s), paces at 2 x 0.8 from its first claim
    fresh = probe_in_new_process(dsn=db_dsn, account=account, requests_per_second=10.0, target_fraction=0.8, claims=3)
    assert fresh["learned_limit"] == 2.0
    assert fresh["requests_per_second"] == 2.0
    assert fresh["spacing"] == pytest.approx(1 / (2 * 0.8))
    gaps = [b - a for a, b in zip(fresh["slot_at"], fresh["slot_at"][1:], strict=False)]
    assert gaps == [pytest.approx(0.625, abs=0.05)] * 2  # 1.6 requests/s, not 8
    # a configured ceiling below the learned limit still wins (the operator's choice)
    low = probe_in_new_process(dsn=db_dsn, account=account, requests_per_second=1.0, target_fraction=1.0, claims=1)
    assert low["spacing"] == pytest.approx(1.0)


def test_a_higher_provider_limit_replaces_the_learned_one(db_dsn: str) -> None:
    account = f"learn-{uuid.uuid4().hex[:6]}"
    a = PostgresPacer(lambda: psycopg.connect(db_dsn), account, requests_per_second=20.0, target_fraction=1.0)
    a.observe({"ratelimit-limit": "5"})
    a.observe({"ratelimit-limit": "5"})  # unchanged: not written again
    first_seen = learned(db_dsn, account)["limit_seen_at"]
    assert learned(db_dsn, account)["limit_per_second"] == 5.0
    a.observe({"ratelimit-limit": "10"})  # the plan was upgraded: the header is the truth
    row = learned(db_dsn, account)
    assert row["limit_per_second"] == 10.0 and row["limit_seen_at"] > first_seen
    a.claim()
    assert a.spacing == pytest.approx(0.1) and a.requests_per_second == 10.0
    a.close()


def test_a_429_is_stored_and_slows_every_new_process(db_dsn: str) -> None:
    account = f"learn-{uuid.uuid4().hex[:6]}"
    hit = PostgresPacer(lambda: psycopg.connect(db_dsn), account, requests_per_second=10.0, target_fraction=1.0)
    hit.claim()
    pushed_at = time.time()
    hit.push_back(2.0)  # the client got 429 rate_limit_exceeded with Retry-After: 2
    hit.push_back(2.0)  # a second sender saw the same burst: counted, penalised once
    hit.close()
    row = learned(db_dsn, account)
    assert row["rate_limited_total"] == 2
    assert row["penalty_now"] == pytest.approx(0.1, abs=0.001)
    fresh = probe_in_new_process(dsn=db_dsn, account=account, requests_per_second=10.0, target_fraction=1.0, claims=2)
    # the Retry-After holds every sender, including new ones: measured from the push-back, not
    # from the new interpreter's start (which alone can take over a second on a loaded machine)
    assert fresh["slot_at"][0] - pushed_at >= 2.0 - 0.02
    assert fresh["spacing"] == pytest.approx(1 / (10 * 0.9), rel=0.01)  # 9 requests/s while the penalty lasts
    assert fresh["slot_at"][1] - fresh["slot_at"][0] == pytest.approx(1 / 9, abs=0.03)


def test_four_fresh_processes_start_from_the_rate_the_provider_taught(tmp_path: Path, db_dsn: str) -> None:
    # The provider allows 4 requests/s; the connections say 10. A first wave learns it (and may
    # be answered 429 while it does); a second wave of fresh processes paces at 4 x 0.8 from its
    # first request: no 429 at all.
    account = f"learn-{uuid.uuid4().hex[:6]}"
    with EmulatorProcess(outbox=tmp_path / "outbox.jsonl", rate_limit=4) as emu:
        run_concurrent(4, emu.base_url, "re_test_emulator", emails_per_sender=200, batch_size=100,
                       requests_per_second=10, target_fraction=0.8, dsn=db_dsn, account=account)
        assert learned(db_dsn, account)["limit_per_second"] == 4.0
        emu.reset(keep_config=True)
        second = run_concurrent(4, emu.base_url, "re_test_emulator", emails_per_sender=300, batch_size=100,
                                requests_per_second=10, target_fraction=0.8, dsn=db_dsn, account=account)
        stats = emu.stats()
    assert second["rate_limited"] == 0
    assert stats["responses_by_status"] == {"200": 12}
    assert second["accepted"] == 1200
    assert second["max_requests_in_any_second"] <= 4
    assert 2.5 <= second["request_rate"] <= 3.3  # 4 x 0.8 = 3.2 requests/s, not 8
