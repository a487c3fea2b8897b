"""Time budgets that fit inside their task's ``execution_timeout``.

A run stops starting new chunks at its time budget (checked between chunks, never inside one), so
the chunk in flight at the budget must still finish before Airflow kills the task at its
``execution_timeout``. Each sending task therefore needs::

    time budget + longest chunk + SETUP_SECONDS  <=  execution_timeout

**Longest chunk** (seconds): one batch (or, for feedback, one email's GET) with every retry of
the provider client (``RetryPolicy``: ``max_attempts`` requests, full-jitter backoff capped at
``min(cap, base * 2**(n-1))`` between them), each request bounded by the connection's httpx timeouts
(``connect_timeout_seconds`` to connect, then ``timeout_seconds`` to write the body and
``timeout_seconds`` to read the answer)::

    max_attempts * (connect + 2 * timeout) + sum(min(cap, base * 2**(n-1)) for n in 1..max_attempts-1)

With the defaults (5 attempts, connect 5 s, timeout 30 s, backoff 0.5/1/2/4 s): 5 * 65 + 7.5 =
332.5 s, rounded up to 333 s. This does not rely on the client's own deadline checks (which keep
waits, but not a request in flight, inside the deadline), so it holds for any chunk that starts
just before the budget ends. ``SETUP_SECONDS`` (60 s) covers what a task does outside chunks:
connections, the schema check, the audience query of a chunk and applying its outcome, and the
first request's wait for its slot past the budget (at most ``SLOT_GRACE_SECONDS`` = 5 s,
``mailflow.provider.client``: a later slot, a hold of the shared schedule, is not waited for).

Params: each DAG's ``time_budget_seconds`` has a ``maximum`` computed here from the task's
``execution_timeout`` and the default connection settings, so the trigger form and the REST API
refuse a budget that cannot fit; :func:`check_budget` repeats the check in the task before anything
is sent, with the connection's real timeouts, and fails without retries (``AirflowFailException``)
naming both numbers.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

SETUP_SECONDS = 60
"""Seconds a sending task spends outside its chunks (connect, schema check, queries, apply)."""
DEFAULT_TIMEOUT_SECONDS = 30.0  # ResendHook: extra timeout_seconds (httpx read/write/pool)
DEFAULT_CONNECT_TIMEOUT_SECONDS = 5.0  # ResendHook: extra connect_timeout_seconds
# RetryPolicy()'s defaults, repeated here so DAG files need not import the client at parse time
# (tests/unit/test_budgets.py holds them equal).
MAX_ATTEMPTS = 5
BACKOFF_BASE_SECONDS = 0.5
BACKOFF_CAP_SECONDS = 20.0


def longest_chunk_seconds(*, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                          connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_SECONDS,
                          max_attempts: int | None = None, base: float | None = None,
                          cap: float | None = None) -> int:
    """Upper bound (whole seconds, rounded up) of one chunk with all its retries; see the module doc.

    Retry parameters default to :class:`mailflow.provider.client.RetryPolicy`'s (the constants above).
    """
    attempts = MAX_ATTEMPTS if max_attempts is None else max_attempts
    b = BACKOFF_BASE_SECONDS if base is None else base
    c = BACKOFF_CAP_SECONDS if cap is None else cap
    requests = attempts * (connect_timeout + 2 * timeout)
    backoff = sum(min(c, b * 2 ** (n - 1)) for n in range(1, attempts))
    return math.ceil(requests + backoff)


def max_budget_seconds(execution_timeout: timedelta, *, longest_chunk: int | None = None) -> int:
    """The largest time budget (s) that fits ``execution_timeout`` with the longest chunk and setup,
    rounded down to a multiple of 10 s (a readable Param maximum)."""
    chunk = longest_chunk_seconds() if longest_chunk is None else longest_chunk
    room = int(execution_timeout.total_seconds()) - chunk - SETUP_SECONDS
    return max(0, room // 10 * 10)


def budget_description(text: str, execution_timeout: timedelta) -> str:
    """A Param description that states the arithmetic behind its maximum."""
    return (f"{text} At most {max_budget_seconds(execution_timeout)} s: the task's execution_timeout "
            f"({int(execution_timeout.total_seconds())} s) minus the longest chunk ({longest_chunk_seconds()} s: "
            f"provider timeouts x retries + backoff) and {SETUP_SECONDS} s of setup.")


def check_budget(budget_seconds: float, context: Any, *, timeout: float = DEFAULT_TIMEOUT_SECONDS,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_SECONDS) -> None:
    """Fail the task before anything is sent if ``budget_seconds`` cannot fit its ``execution_timeout``.

    :param context: the Airflow task context (``context["task"].execution_timeout``; no timeout = no check).
    :param timeout: the provider connection's ``timeout_seconds``; ``connect_timeout`` likewise.
    :raises airflow.sdk.exceptions.AirflowFailException: naming the budget, the longest chunk and the
        execution_timeout (not retried: the same Params cannot fit on a retry).
    """
    task = context.get("task") if hasattr(context, "get") else None
    limit = getattr(task, "execution_timeout", None)
    if limit is None:
        return
    chunk = longest_chunk_seconds(timeout=timeout, connect_timeout=connect_timeout)
    need = budget_seconds + chunk + SETUP_SECONDS
    if need > limit.total_seconds():
        from airflow.sdk.exceptions import AirflowFailException

        fits = max(0, int(limit.total_seconds() - chunk - SETUP_SECONDS))
        raise AirflowFailException(
            f"time_budget_seconds {budget_seconds:g} s does not fit the task's execution_timeout of "
            f"{limit.total_seconds():g} s: the budget + the longest chunk ({chunk} s: provider timeouts x retries "
            f"+ backoff) + {SETUP_SECONDS} s setup = {need:g} s. Lower time_budget_seconds to at most {fits} s, or lower the connection's "
            "timeout_seconds.")
