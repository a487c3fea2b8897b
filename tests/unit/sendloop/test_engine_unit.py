"""The send loop (mailflow.sources.lifecycle.run_lifecycle) with in-memory fakes: no database, no HTTP.

The fake store keeps rows in a dict and applies the same exclusion rules as the SQL (one live row
per user and campaign, cooldown across campaigns); the fake provider records every batch it gets
and answers from a script. Time is a FakeClock.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from mailflow.campaigns import Campaign
from mailflow.model.clock import FakeClock
from mailflow.model.keys import idempotency_key
from mailflow.model.outcome import (
    Accepted,
    CampaignSummary,
    DataInterval,
    MintedRow,
    NotSent,
    Outcome,
    PreparedBatch,
    Refused,
    RunContext,
    SendError,
    Unknown,
)
from mailflow.sendloop.engine import MAX_BATCH, chunk_size_ok
from mailflow.sources.lifecycle import run_lifecycle
from mailflow.store.send_log import Applied, MintResult

END = datetime(2026, 3, 10, 12, 0, tzinfo=UTC)
INTERVAL = DataInterval(END - timedelta(hours=1), END)
RUN = RunContext(dag_id="d", run_id="r", task_id="t")


def campaign(name: str, priority: int, window: timedelta = timedelta(hours=1),
             cooldown: timedelta = timedelta(days=7)) -> Campaign:
    return Campaign(name=name, priority=priority, audience_sql="select 1", template=name, subject=name,
                    from_address="Team <team@example.com>", reply_to=None, cooldown=cooldown,
                    audience_window=window)


class FakeStore:
    """The Store protocol over a dict of rows: ``audiences`` maps campaign name -> user ids."""

    def __init__(self, audiences: dict[str, Sequence[int]]):
        self.audiences = {k: sorted(v) for k, v in audiences.items()}
        self.rows: dict[int, dict[str, Any]] = {}
        self.next_id = 1
        self.counts: list[tuple[str, tuple[datetime, datetime], datetime]] = []
        self.mints: list[dict[str, Any]] = []
        self.applied: list[tuple[PreparedBatch, Outcome]] = []
        self.rebatched: list[PreparedBatch] = []

    def _eligible(self, campaign: str, user_id: int) -> bool:
        for r in self.rows.values():
            if r["user_id"] != user_id:
                continue
            if r["campaign"] == campaign and not r["released"]:
                return False
            if r["status"] in ("sending", "sent"):
                return False  # cooldown: every sent row of this fake is "recent"
        return True

    def _audience(self, campaign: Campaign) -> list[int]:
        return [u for u in self.audiences.get(campaign.name, []) if self._eligible(campaign.name, u)]

    def count_audience(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime) -> int:
        self.counts.append((campaign.name, window, cooldown_since))
        return len(self._audience(campaign))

    def mint_chunk(self, campaign: Campaign, window: tuple[datetime, datetime], cooldown_since: datetime,
                   after: int, limit: int, run: RunContext, interval: tuple[datetime, datetime],
                   prepare: Callable[[Sequence[MintedRow]], PreparedBatch]) -> MintResult:
        self.mints.append({"campaign": campaign.name, "after": after, "limit": limit, "window": window,
                           "cooldown_since": cooldown_since, "interval": interval, "run": run})
        page = [u for u in self._audience(campaign) if u > after][:limit]
        if not page:
            return MintResult(page_size=0, cursor=after, batch=None)
        rows = []
        for u in page:
            rid = self.next_id
            self.next_id += 1
            self.rows[rid] = {"user_id": u, "campaign": campaign.name, "status": "sending", "released": False,
                              "pid": None, "error": None}
            rows.append(MintedRow(id=rid, user_id=u, email=f"user{u}@example.com"))
        return MintResult(page_size=len(page), cursor=max(page), batch=prepare(rows), rows=tuple(rows))

    def rebatch(self, batch: PreparedBatch) -> PreparedBatch:
        batch = dataclasses.replace(batch, idempotency_key=f"{batch.idempotency_key}-re{len(self.rebatched) + 1}")
        self.rebatched.append(batch)
        return batch

    def apply(self, batch: PreparedBatch, outcome: Outcome, run: RunContext) -> Applied:
        self.applied.append((batch, outcome))
        ids = list(batch.row_ids)
        if isinstance(outcome, Accepted):
            for i, pid in outcome.ids.items():
                self.rows[ids[i]].update(status="sent", pid=pid)
            for i, msg in outcome.rejected.items():
                self.rows[ids[i]].update(status="failed", error=msg)
            return Applied(sent=len(outcome.ids), failed=len(outcome.rejected))
        if isinstance(outcome, Refused):
            return Applied()
        if isinstance(outcome, NotSent):
            for rid in ids:
                self.rows[rid].update(status="failed", released=True, error=outcome.reason)
            return Applied(released=len(ids))
        for rid in ids:
            self.rows[rid]["error"] = outcome.reason
        return Applied(unknown=len(ids))

    def status_counts(self, campaign: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.rows.values():
            if r["campaign"] == campaign:
                key = "released" if r["released"] else r["status"]
                out[key] = out.get(key, 0) + 1
        return out


class FakeRenderer:
    """Only what the engine uses of Renderer: ``prepare_batch(campaign, rows)``."""

    def prepare_batch(self, campaign: Campaign, rows: Sequence[MintedRow]) -> PreparedBatch:
        ids = tuple(r.id for r in rows)
        body = json.dumps([{"to": [r.email], "send_id": r.id} for r in rows]).encode()
        return PreparedBatch(idempotency_key=idempotency_key(campaign.name, ids), campaign=campaign.name,
                             row_ids=ids, body=body)


def accept_all(batch: PreparedBatch) -> Outcome:
    return Accepted(ids={i: f"p-{rid}" for i, rid in enumerate(batch.row_ids)}, rejected={})


class FakeProvider:
    """``send_batch`` answers from ``script`` (a callable or a list of callables, one per batch; the
    last one repeats) and advances ``clock`` by ``seconds_per_batch``."""

    def __init__(self, clock: FakeClock, script: Any = accept_all, seconds_per_batch: float = 0.0,
                 slot_waits: Sequence[float] = (0.0,)):
        self.clock = clock
        self.script = script if isinstance(script, list) else [script]
        self.seconds_per_batch = seconds_per_batch
        self.slot_waits = list(slot_waits)  # wait of each reserved slot (the last one repeats)
        self.reservations: list[float | None] = []
        self.batches: list[PreparedBatch] = []
        self.deadlines: list[float] = []
        self.slots: list[float | None] = []

    def reserve_slot(self, deadline: float) -> float | None:
        wait = self.slot_waits[min(len(self.reservations), len(self.slot_waits) - 1)]
        start = self.clock.monotonic() + wait
        self.reservations.append(None if start > deadline else start)
        return self.reservations[-1]

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Outcome:
        n = len(self.batches)
        self.batches.append(batch)
        self.deadlines.append(deadline)
        self.slots.append(slot)
        self.clock.advance(self.seconds_per_batch)
        answer = self.script[min(n, len(self.script) - 1)]
        return answer(batch)

    def sizes(self) -> list[int]:
        return [len(b.row_ids) for b in self.batches]

    def campaigns(self) -> list[str]:
        return [b.campaign for b in self.batches]


def run(store: FakeStore, provider: FakeProvider, campaigns: list[Campaign], clock: FakeClock,
        **kw: Any) -> list[CampaignSummary]:
    return run_lifecycle(store, provider, FakeRenderer(), campaigns, INTERVAL, run=RUN, clock=clock, **kw)


# -- chunking ------------------------------------------------------------------------------------

def test_250_candidates_in_chunks_of_100_are_three_batches_100_100_50() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 251)})
    provider = FakeProvider(clock)
    [s] = run(store, provider, [campaign("a", 1)], clock, chunk_size=100)
    assert provider.sizes() == [100, 100, 50]
    assert [m["after"] for m in store.mints] == [0, 100, 200, 250]  # keyset cursor, last page empty
    assert [m["limit"] for m in store.mints] == [100, 100, 100, 100]
    # every user in exactly one batch, in user order
    users = [store.rows[rid]["user_id"] for b in provider.batches for rid in b.row_ids]
    assert users == list(range(1, 251))
    assert s.as_dict() == {"campaign": "a", "eligible": 250, "minted": 250, "held": 0, "not_reached": 0, "chunks": 3, "stopped": None, "total": 250, "pending": 0, "sending": 0, "sent": 250, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    assert store.status_counts("a") == {"sent": 250}
    # the run context and interval reach the store; window and cooldown come from the interval end
    assert store.mints[0]["run"] == RUN
    assert store.mints[0]["interval"] == (INTERVAL.start, INTERVAL.end)
    assert store.mints[0]["window"] == (END - timedelta(hours=1), END)
    assert store.mints[0]["cooldown_since"] == END - timedelta(days=7)


def test_window_is_widened_to_the_campaign_audience_window() -> None:
    clock = FakeClock()
    store = FakeStore({"wide": [1]})
    run(store, FakeProvider(clock), [campaign("wide", 1, window=timedelta(days=2), cooldown=timedelta(days=3))],
        clock)
    assert store.counts == [("wide", (END - timedelta(days=2), END), END - timedelta(days=3))]


@pytest.mark.parametrize("size", [0, 101, -5])
def test_chunk_size_outside_1_to_100_raises_naming_the_limit(size: int) -> None:
    clock = FakeClock()
    store = FakeStore({"a": [1, 2]})
    provider = FakeProvider(clock)
    with pytest.raises(ValueError, match=rf"between 1 and {MAX_BATCH} emails .*got {size}$"):
        run(store, provider, [campaign("a", 1)], clock, chunk_size=size)
    assert store.mints == [] and provider.batches == [] and store.counts == []


@pytest.mark.parametrize("size", [1, 100])
def test_chunk_size_bounds_are_accepted(size: int) -> None:
    assert chunk_size_ok(size) == size


def test_chunk_size_1_sends_one_email_per_batch() -> None:
    clock = FakeClock()
    store = FakeStore({"a": [5, 7, 9]})
    provider = FakeProvider(clock)
    [s] = run(store, provider, [campaign("a", 1)], clock, chunk_size=1)
    assert provider.sizes() == [1, 1, 1]
    assert (s.chunks, s.sent, s.minted) == (3, 3, 3)


# -- time budget ---------------------------------------------------------------------------------

def test_time_budget_is_checked_between_chunks_only() -> None:
    clock = FakeClock()
    store = FakeStore({"first": range(1, 501), "second": range(1001, 1011)})
    provider = FakeProvider(clock, seconds_per_batch=30.0)
    s1, s2 = run(store, provider, [campaign("first", 1), campaign("second", 2)], clock,
                 budget_seconds=70.0, chunk_size=100)
    # starts at t=0, 30 and 60 are within the budget; at t=90 no new chunk is minted
    assert provider.sizes() == [100, 100, 100]
    assert provider.deadlines == [70.0, 70.0, 70.0]
    assert clock.monotonic() == 90.0
    assert s1.as_dict() == {"campaign": "first", "eligible": 500, "minted": 300, "held": 0, "not_reached": 200, "chunks": 3, "stopped": "time budget", "total": 300, "pending": 0, "sending": 0, "sent": 300, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    assert len(store.rows) == 300  # the rest was not minted
    # the later campaign is marked stopped without minting, and without evaluating its audience
    # (issue 16: its snapshot would cost up to seconds at 1M users past a budget already spent)
    assert s2.as_dict() == {"campaign": "second", "eligible": 0, "minted": 0, "held": 0, "not_reached": 0, "chunks": 0, "stopped": "time budget", "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    assert [c[0] for c in store.counts] == ["first"]
    assert [m["campaign"] for m in store.mints] == ["first"] * 3
    assert store.status_counts("second") == {}


def test_a_chunk_started_before_the_deadline_is_finished_after_it() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 201)})
    provider = FakeProvider(clock, seconds_per_batch=100.0)  # one batch overruns the whole budget
    [s] = run(store, provider, [campaign("a", 1)], clock, budget_seconds=10.0, chunk_size=100)
    assert provider.sizes() == [100]
    assert (s.minted, s.sent, s.skipped, s.stopped) == (100, 100, 100, "time budget")


def test_exhausted_budget_before_the_first_campaign_mints_nothing() -> None:
    clock = FakeClock()
    store = FakeStore({"a": [1, 2, 3]})
    provider = FakeProvider(clock)
    [s] = run(store, provider, [campaign("a", 1)], clock, budget_seconds=0.0)
    assert provider.batches == [] and store.mints == [] and store.counts == []  # not even evaluated
    assert (s.eligible, s.minted, s.skipped, s.stopped) == (0, 0, 0, "time budget")


# -- priority ------------------------------------------------------------------------------------

def test_campaigns_passed_unsorted_run_by_priority_and_exclude_later_ones() -> None:
    clock = FakeClock()
    # user 2 qualifies for all three, user 3 for "low" and "mid", user 4 only for "low"
    store = FakeStore({"low": [2, 3, 4], "high": [1, 2], "mid": [2, 3]})
    provider = FakeProvider(clock)
    summaries = run(store, provider, [campaign("low", 30), campaign("high", 1), campaign("mid", 7)], clock)
    assert [s.campaign for s in summaries] == ["high", "mid", "low"]
    assert [c[0] for c in store.counts] == ["high", "mid", "low"]
    assert provider.campaigns() == ["high", "mid", "low"]
    by_user: dict[int, list[str]] = {}
    for r in store.rows.values():
        by_user.setdefault(r["user_id"], []).append(r["campaign"])
    assert by_user == {1: ["high"], 2: ["high"], 3: ["mid"], 4: ["low"]}
    assert [(s.eligible, s.sent) for s in summaries] == [(2, 2), (1, 1), (1, 1)]


# -- outcomes ------------------------------------------------------------------------------------

def test_not_sent_rolls_back_the_chunk_and_stops_the_run_without_marching_on() -> None:
    # A request proven not processed (here a refused body) will be refused again: the run stops at
    # once instead of releasing chunk after chunk; the released users are eligible next run.
    clock = FakeClock()
    store = FakeStore({"a": range(1, 251)})
    not_sent = lambda b: NotSent(reason="provider refused the whole request: HTTP 422")  # noqa: E731
    provider = FakeProvider(clock, script=[accept_all, not_sent, accept_all])
    [s] = run(store, provider, [campaign("a", 1)], clock, chunk_size=100)
    assert provider.sizes() == [100, 100]
    assert s.as_dict() == {"campaign": "a", "eligible": 250, "minted": 200, "held": 0, "not_reached": 50, "chunks": 2, "stopped": "provider refused the whole request: HTTP 422", "total": 100, "pending": 0, "sending": 0, "sent": 100, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 100}
    assert store.status_counts("a") == {"sent": 100, "released": 100}
    released_users = sorted(r["user_id"] for r in store.rows.values() if r["released"])
    assert released_users == list(range(101, 201))
    # the next healthy run sends every still-eligible user exactly once
    provider2 = FakeProvider(clock)
    [s2] = run(store, provider2, [campaign("a", 1)], clock, chunk_size=100)
    assert (s2.eligible, s2.sent) == (150, 150)
    sent_users = sorted(r["user_id"] for r in store.rows.values() if r["status"] == "sent")
    assert sent_users == list(range(1, 251))


def test_budget_is_checked_before_minting_including_the_wait_for_the_slot() -> None:
    # The second chunk's slot starts at t=100, after the 70 s budget: it is never minted (before,
    # the chunk was minted and then abandoned by the client, released or left behind).
    clock = FakeClock()
    store = FakeStore({"a": range(1, 251)})
    provider = FakeProvider(clock, slot_waits=[0.0, 100.0])
    [s] = run(store, provider, [campaign("a", 1)], clock, chunk_size=100, budget_seconds=70.0)
    assert provider.reservations == [0.0, None]
    assert provider.sizes() == [100]
    assert len(store.mints) == 1 and len(store.rows) == 100
    assert (s.minted, s.sent, s.released, s.skipped, s.stopped) == (100, 100, 0, 150, "time budget")


def test_a_minted_chunk_is_sent_at_the_slot_reserved_before_minting() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 31)})
    provider = FakeProvider(clock, slot_waits=[5.0])
    run(store, provider, [campaign("a", 1)], clock, chunk_size=10, budget_seconds=100.0)
    assert provider.sizes() == [10, 10, 10]
    assert provider.slots == provider.reservations[:3] == [5.0, 5.0, 5.0]  # the FakeClock never moves


def test_unknown_outcome_without_stop_continues_and_counts_unknown() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 151)})
    provider = FakeProvider(clock, script=[lambda b: Unknown(reason="ReadTimeout"), accept_all])
    [s] = run(store, provider, [campaign("a", 1)], clock, chunk_size=100)
    assert provider.sizes() == [100, 50]
    assert (s.minted, s.sent, s.unknown, s.released, s.stopped) == (150, 50, 100, 0, None)
    assert store.status_counts("a") == {"sending": 100, "sent": 50}


@pytest.mark.parametrize("outcome", [
    NotSent(reason="provider quota exhausted", stop_run="daily_quota_exceeded"),
    Unknown(reason="time budget reached while retrying", stop_run="daily_quota_exceeded"),
])
def test_an_outcome_with_stop_run_stops_the_whole_run(outcome: Outcome) -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 301), "b": [900, 901]})
    provider = FakeProvider(clock, script=[accept_all, lambda b: outcome])
    s1, s2 = run(store, provider, [campaign("a", 1), campaign("b", 2)], clock, chunk_size=100)
    assert provider.sizes() == [100, 100]
    released = 100 if isinstance(outcome, NotSent) else 0
    unknown = 100 - released
    assert s1.as_dict() == {"campaign": "a", "eligible": 300, "minted": 200, "held": 0, "not_reached": 100, "chunks": 2, "stopped": "daily_quota_exceeded", "total": unknown + 100, "pending": 0, "sending": unknown, "sent": 100, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": released}
    assert s2.as_dict() == {"campaign": "b", "eligible": 2, "minted": 0, "held": 0, "not_reached": 2, "chunks": 0, "stopped": "daily_quota_exceeded", "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    assert [m["campaign"] for m in store.mints] == ["a", "a"]


def test_fatal_outcome_raises_send_error_with_the_summaries_after_recording() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 151), "b": [7]})
    fatal = NotSent(reason="provider refused the API key of connection 'resend_default': HTTP 401",
                    stop_run="authentication failed", fatal=True)
    provider = FakeProvider(clock, script=[lambda b: fatal])
    with pytest.raises(SendError) as err:
        run(store, provider, [campaign("a", 1), campaign("b", 2)], clock, chunk_size=100)
    assert str(err.value) == "a: provider refused the API key of connection 'resend_default': HTTP 401"
    assert [s.as_dict() for s in err.value.summaries] == [
        {"campaign": "a", "eligible": 150, "minted": 100, "held": 0, "not_reached": 50, "chunks": 1, "stopped": "authentication failed", "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 100},
        {"campaign": "b", "eligible": 1, "minted": 0, "held": 0, "not_reached": 1, "chunks": 0, "stopped": "authentication failed", "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0},
    ]
    assert len(provider.batches) == 1
    assert store.status_counts("a") == {"released": 100}  # recorded before raising


def test_fatal_without_stop_finishes_the_run_then_raises() -> None:
    clock = FakeClock()
    store = FakeStore({"a": [1, 2, 3], "b": [4]})
    conflict = Unknown(reason="idempotency conflict, not resent under a new key: HTTP 409", fatal=True)
    provider = FakeProvider(clock, script=[lambda b: conflict, accept_all])
    with pytest.raises(SendError) as err:
        run(store, provider, [campaign("a", 1), campaign("b", 2)], clock, chunk_size=2)
    assert str(err.value) == "a: idempotency conflict, not resent under a new key: HTTP 409"
    assert provider.sizes() == [2, 1, 1]
    assert [(s.campaign, s.minted, s.sent, s.unknown, s.stopped) for s in err.value.summaries] == [
        ("a", 3, 1, 2, None), ("b", 1, 1, 0, None)]


def test_a_campaign_whose_every_email_is_rejected_raises_after_recording() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 6), "b": [10, 11]})

    def reject_a(batch: PreparedBatch) -> Outcome:
        if batch.campaign == "a":
            return Accepted(ids={}, rejected={i: f"bad address {i}" for i in range(len(batch.row_ids))})
        return accept_all(batch)

    provider = FakeProvider(clock, script=reject_a)
    with pytest.raises(SendError) as err:
        run(store, provider, [campaign("a", 1), campaign("b", 2)], clock, chunk_size=3)
    assert str(err.value) == "a: every one of 5 emails was rejected by the provider"
    assert [s.as_dict() for s in err.value.summaries] == [
        {"campaign": "a", "eligible": 5, "minted": 5, "held": 0, "not_reached": 0, "chunks": 2, "stopped": None, "total": 5, "pending": 0, "sending": 0, "sent": 0, "failed": 5, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0},
        {"campaign": "b", "eligible": 2, "minted": 2, "held": 0, "not_reached": 0, "chunks": 1, "stopped": None, "total": 2, "pending": 0, "sending": 0, "sent": 2, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0},
    ]
    assert store.status_counts("a") == {"failed": 5}
    assert sorted(r["error"] for r in store.rows.values() if r["campaign"] == "a") == [
        "bad address 0", "bad address 0", "bad address 1", "bad address 1", "bad address 2"]


def test_partial_rejection_is_not_an_error() -> None:
    clock = FakeClock()
    store = FakeStore({"a": range(1, 6)})
    provider = FakeProvider(clock, script=lambda b: Accepted(
        ids={0: "x0", 1: "x1", 3: "x3", 4: "x4"}, rejected={2: "Invalid `to` field"}))
    [s] = run(store, provider, [campaign("a", 1)], clock)
    assert (s.minted, s.sent, s.failed) == (5, 4, 1)
    assert {r["user_id"]: (r["status"], r["pid"]) for r in store.rows.values()} == {
        1: ("sent", "x0"), 2: ("sent", "x1"), 3: ("failed", None), 4: ("sent", "x3"), 5: ("sent", "x4")}


def test_an_empty_audience_sends_nothing() -> None:
    clock = FakeClock()
    store = FakeStore({})
    provider = FakeProvider(clock)
    [s] = run(store, provider, [campaign("a", 1)], clock)
    assert provider.batches == []
    assert s.as_dict() == {"campaign": "a", "eligible": 0, "minted": 0, "held": 0, "not_reached": 0, "chunks": 0, "stopped": None, "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}


# -- strict-mode refusal -------------------------------------------------------------------------

def test_strict_refusal_without_index_resends_the_whole_chunk_permissive_under_a_new_key() -> None:
    # Resend's strict error names no index: nothing is parsed from the prose. The whole chunk goes
    # again in permissive mode under a new key; the permissive answer names the refused email.
    clock = FakeClock()
    store = FakeStore({"a": range(1, 6)})
    refused = lambda b: Refused(reason="HTTP 422 validation_error: Invalid `to` field.")  # noqa: E731
    reject_2 = lambda b: Accepted(ids={i: f"p-{b.row_ids[i]}" for i in (0, 1, 3, 4)},  # noqa: E731
                                  rejected={2: "Invalid `to` field."})
    provider = FakeProvider(clock, script=[refused, reject_2])
    [s] = run(store, provider, [campaign("a", 1)], clock)
    first, second = provider.batches
    assert first.row_ids == second.row_ids == (1, 2, 3, 4, 5)  # the whole chunk, the order kept
    assert (first.validation, second.validation) == (None, "permissive")
    assert second.idempotency_key != first.idempotency_key
    assert store.rebatched == [second]
    assert s.as_dict() == {"campaign": "a", "eligible": 5, "minted": 5, "held": 0, "not_reached": 0, "chunks": 1, "stopped": None, "total": 5, "pending": 0, "sending": 0, "sent": 4, "failed": 1, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    assert {r["user_id"]: (r["status"], r["pid"], r["error"]) for r in store.rows.values()} == {
        1: ("sent", "p-1", None), 2: ("sent", "p-2", None), 3: ("failed", None, "Invalid `to` field."),
        4: ("sent", "p-4", None), 5: ("sent", "p-5", None)}


def test_a_strict_refusal_whose_permissive_resend_rejects_every_email_raises_after_recording() -> None:
    clock = FakeClock()
    store = FakeStore({"a": [1, 2]})
    refused = lambda b: Refused(reason="HTTP 422")  # noqa: E731
    reject_all = lambda b: Accepted(ids={}, rejected={0: "bad", 1: "bad"})  # noqa: E731
    provider = FakeProvider(clock, script=[refused, reject_all])
    with pytest.raises(SendError, match=r"^a: every one of 2 emails was rejected by the provider$") as err:
        run(store, provider, [campaign("a", 1)], clock)
    assert [b.row_ids for b in provider.batches] == [(1, 2), (1, 2)]
    assert [(x.minted, x.failed, x.chunks) for x in err.value.summaries] == [(2, 2, 1)]


# -- backfill gate (max_interval_age) ------------------------------------------------------------

def test_an_interval_older_than_max_interval_age_sends_nothing() -> None:
    clock = FakeClock()
    store = FakeStore({"a": [1, 2], "b": [3]})
    provider = FakeProvider(clock)
    young = dataclasses.replace(campaign("b", 2), max_interval_age=timedelta(days=3))
    sa, sb = run(store, provider, [campaign("a", 1), young], clock, now=END + timedelta(days=2))
    assert sa.as_dict() == {"campaign": "a", "eligible": 2, "minted": 0, "held": 0, "not_reached": 2, "chunks": 0, "stopped": "interval ended 2 days, 0:00:00 ago, over max_interval_age 6:00:00", "total": 0, "pending": 0, "sending": 0, "sent": 0, "failed": 0, "cancelled": 0, "duplicate": 0, "skipped": 0, "holdout": 0, "invalid": 0, "dead_lettered": 0, "rolled_back": 0}
    # the gate is per campaign: b accepts intervals up to 3 days old
    assert (sb.minted, sb.sent, sb.stopped) == (1, 1, None)
    assert provider.campaigns() == ["b"]


def test_the_gate_boundary_and_its_overrides() -> None:
    for kw, sent in [({"now": END + timedelta(hours=6)}, 1),  # exactly max_interval_age: still sends
                     ({"now": END + timedelta(hours=6, seconds=1)}, 0),
                     ({"now": END + timedelta(days=30), "allow_old_interval": True}, 1),
                     ({}, 1)]:  # no wall clock given: no gate
        clock = FakeClock()
        store = FakeStore({"a": [1]})
        [s] = run(store, FakeProvider(clock), [campaign("a", 1)], clock, **kw)
        assert s.sent == sent, kw


def test_the_gate_message_is_a_duration_with_airflow_context_datetimes() -> None:
    import pendulum

    clock = FakeClock()
    store = FakeStore({"a": [1]})
    interval = DataInterval(pendulum.datetime(2026, 3, 10, 11, tz="UTC"), pendulum.datetime(2026, 3, 10, 12, tz="UTC"))
    [s] = run_lifecycle(store, FakeProvider(clock), FakeRenderer(), [campaign("a", 1)], interval, run=RUN,
                        clock=clock, now=datetime(2026, 3, 12, 12, 0, tzinfo=UTC))  # psycopg's select now()
    assert s.stopped == "interval ended 2 days, 0:00:00 ago, over max_interval_age 6:00:00"
