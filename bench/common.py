"""Shared pieces of the benchmark suites: the metric shape, a throw-away database per suite, the
instant in-process provider, a clock that counts chunks instead of seconds, and small statistics.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import wraps
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from mailflow.model.outcome import Accepted, PreparedBatch
from mailflow.store.migrate import migrate
from mailflow_dev import devenv

#: The "now" of every generated population: the start of the current UTC hour, so queries written
#: against ``now()`` (docs/send_log.md, the mail views) see data at the right age. The data are the
#: same from run to run (seeded), only shifted in time.
ANCHOR = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
UNSUBSCRIBE_SECRET = "bench-secret-0123456789abcdef"


def metric(name: str, value: float, unit: str, target: str | None = None, met: bool | None = None,
           **params: Any) -> dict[str, Any]:
    """One result row of ``bench/results/latest.json``."""
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met, "params": params}


@contextmanager
def scratch_database(dsn: str, suffix: str, *, app_schema: bool = True) -> Iterator[str]:
    """A fresh, migrated database on the server of ``dsn`` (with the demo ``app`` schema unless
    ``app_schema`` is False), dropped on exit. Yields its DSN."""
    base = conninfo_to_dict(dsn).get("dbname") or "mailflow_bench"
    name = f"{base}_{suffix}_{uuid.uuid4().hex[:4]}"[:63]
    sdsn = devenv.create_database(dsn, name, exist_ok=False)
    try:
        with psycopg.connect(sdsn, autocommit=True) as conn:
            migrate(conn)
            if app_schema:
                from mailflow_dev.demo.loader import schema_sql

                conn.execute(schema_sql())
        yield sdsn
    finally:
        devenv.drop_database(dsn, name)


def renderer() -> Any:
    """The real :class:`~mailflow.sendloop.render.Renderer` with the real templates and a bench secret."""
    from mailflow import settings
    from mailflow.feedback.unsubscribe_tokens import signer_from_secret
    from mailflow.sendloop.render import Renderer

    return Renderer(signer_from_secret(UNSUBSCRIBE_SECRET), settings.unsubscribe_base_url(), settings.app_url())


class InstantProvider:
    """A provider that accepts every batch at once and returns fresh ids (no HTTP, no parsing):
    what is left of a run's time is the pipeline's own. ``stamps`` = perf_counter at each call."""

    def __init__(self) -> None:
        self.prefix = uuid.uuid4().hex[:8]
        self.calls = 0
        self.emails = 0
        self.stamps: list[float] = []

    def send_batch(self, batch: PreparedBatch, deadline: float, slot: float | None = None) -> Accepted:
        self.stamps.append(time.perf_counter())
        self.calls += 1
        n = len(batch.row_ids)
        ids = {i: f"bench-{self.prefix}-{self.emails + i}" for i in range(n)}
        self.emails += n
        return Accepted(ids=ids, rejected={})


class ChunkClock:
    """A clock whose ``monotonic()`` is the number of batches the provider has taken: with
    ``budget_seconds=N`` the engine stops after exactly N chunks (checked between chunks, as the
    real time budget is). Selection never reads it."""

    def __init__(self, provider: InstantProvider):
        self.provider = provider

    def monotonic(self) -> float:
        return float(self.provider.calls)

    def sleep(self, seconds: float) -> None:  # pragma: no cover - the engine never sleeps
        pass

    def now(self) -> datetime:
        return datetime.now(UTC)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation; nan for no values."""
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def record_durations(obj: Any, name: str, sink: list[float]) -> None:
    """Replace ``obj.name`` by a wrapper that appends each call's duration (s) to ``sink``."""
    fn = getattr(obj, name)

    @wraps(fn)
    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            sink.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)
