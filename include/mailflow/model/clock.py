"""Time sources. The engine and the provider client take a :class:`Clock` so tests inject time."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    """``monotonic()`` in seconds (deadlines), ``sleep(seconds)``, ``now()`` aware UTC (HTTP dates)."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    def now(self) -> datetime: ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock for tests: ``sleep`` advances time instantly and records each wait (seconds)."""

    def __init__(self, start: float = 0.0, wall: datetime | None = None):
        self.t = start
        self.wall = wall or datetime(2026, 1, 1, tzinfo=UTC)
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        if seconds > 0:
            self.t += seconds

    def advance(self, seconds: float) -> None:
        self.t += seconds

    def now(self) -> datetime:
        from datetime import timedelta

        return self.wall + timedelta(seconds=self.t)
