"""One way of counting a campaign's emails: the columns every summary shows, from send-log states.

A run's summary (the task's return value), the demo's table, the progress page and the views of
migration 0021 (``mail.campaign_progress``, ``mail.campaign_daily``) all count with this mapping, and
tests hold them against one another:

================  ===============================================================================
column            send-log rows (``mail.send_log``)
================  ===============================================================================
``pending``       status ``pending`` (scheduled, waiting for its time)
``sending``       status ``sending`` (claimed: in flight, or ambiguous until a 2xx to its key)
``sent``          status ``sent`` (the provider accepted this exact email)
``failed``        status ``failed``, not rolled back: rejected by the provider, an invalid address
                  (decided without a request) or given up (a dead letter)
``cancelled``     status ``cancelled`` (campaign cancelled, user or address suppressed)
``duplicate``     status ``duplicate`` (another user of the campaign got it at the same address)
``skipped``       status ``skipped`` (held back by the contact policy; the campaign skips)
``holdout``       status ``holdout`` (in the campaign's holdout group: recorded, never sent)
================  ===============================================================================

Those eight are disjoint and add up to ``total``. Three more columns break some of them down or sit
outside the total: ``invalid`` (of ``failed``: never claimed, ``claimed_at`` null: decided without a
request because the address is invalid; the row's error starts ``invalid address:``),
``dead_lettered`` (``failed`` rows given up for a person to decide, a
rolled-back attempt included) and ``rolled_back`` (status
``failed`` with ``released_at``: an attempt whose whole request certainly failed; history that
charges nobody, not in ``total``). Source of the states: docs/send_log.md, "The model".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, Protocol

#: The disjoint columns, in display order; they add up to the total.
STATE_COLUMNS: tuple[str, ...] = ("pending", "sending", "sent", "failed", "cancelled", "duplicate", "skipped",
                                  "holdout")
#: Breakdowns: ``invalid`` is part of ``failed``; ``dead_lettered`` of ``failed`` and ``rolled_back``;
#: ``rolled_back`` is outside the total.
DETAIL_COLUMNS: tuple[str, ...] = ("invalid", "dead_lettered", "rolled_back")
#: Every column, in display order (``total`` first).
COLUMNS: tuple[str, ...] = ("total", *STATE_COLUMNS, *DETAIL_COLUMNS)


def column_of(status: str, *, rolled_back: bool = False) -> str:
    """The column a send-log row is counted in: its status, or ``rolled_back`` for a released attempt.

    :param status: ``mail.send_log.status``.
    :param rolled_back: ``released_at is not null`` (only a ``failed`` row can be released).
    :raises ValueError: for a status the send log does not have.
    """
    if status == "failed" and rolled_back:
        return "rolled_back"
    if status not in STATE_COLUMNS:
        raise ValueError(f"unknown send-log status {status!r}; known: {', '.join(STATE_COLUMNS)}")
    return status


class RunCounts(Protocol):
    """What a sending run counts (``CampaignSummary`` of a lifecycle run, ``DispatchSummary`` of a
    scheduled dispatch): rows it decided, by outcome."""

    sent: int
    failed: int
    invalid: int
    duplicates: int
    holdout: int
    released: int
    unknown: int


@dataclass
class Tally:
    """A campaign's (or a run's) emails by column (counts of send-log rows; see the module docstring)."""

    pending: int = 0
    sending: int = 0
    sent: int = 0
    failed: int = 0
    cancelled: int = 0
    duplicate: int = 0
    skipped: int = 0
    holdout: int = 0
    invalid: int = 0
    dead_lettered: int = 0
    rolled_back: int = 0

    @property
    def total(self) -> int:
        """Emails (rows not rolled back): the sum of :data:`STATE_COLUMNS`."""
        return sum(getattr(self, c) for c in STATE_COLUMNS)

    def add_row(self, status: str, *, rolled_back: bool = False, dead_lettered: bool = False,
                claimed: bool = True) -> None:
        """Count one send-log row: ``rolled_back`` = ``released_at is not null``, ``dead_lettered`` =
        ``dead_lettered_at is not null``, ``claimed`` = ``claimed_at is not null``."""
        column = column_of(status, rolled_back=rolled_back)
        setattr(self, column, getattr(self, column) + 1)
        if status == "failed":
            self.dead_lettered += int(dead_lettered)
        if column == "failed":
            self.invalid += int(not claimed)

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[str, bool, bool, bool]]) -> Tally:
        """Count rows ``(status, rolled_back, dead_lettered, claimed)`` (see :meth:`add_row`)."""
        t = cls()
        for status, rolled_back, dead_lettered, claimed in rows:
            t.add_row(status, rolled_back=rolled_back, dead_lettered=dead_lettered, claimed=claimed)
        return t

    @classmethod
    def of_run(cls, run: RunCounts, *, cancelled: int = 0, skipped: int = 0) -> Tally:
        """The rows a sending run decided, counted like the send log counts them.

        A run counts its provider rejections (``failed``) apart from the rows it failed itself for an
        invalid address (``invalid``); both are ``failed`` rows in the send log. Rows left ``sending``
        (``unknown``: an ambiguous answer) stay ``sending``; released attempts are ``rolled_back``.
        A scheduled dispatch also cancels (suppressed addresses) and skips (contact policy) rows:
        ``cancelled`` and ``skipped`` (a lifecycle run does neither: 0). A run's ``holdout`` rows are the
        users it recorded in the campaign's holdout group.
        """
        return cls(sending=run.unknown, sent=run.sent, failed=run.failed + run.invalid, cancelled=cancelled,
                   duplicate=run.duplicates, skipped=skipped, holdout=run.holdout, invalid=run.invalid,
                   rolled_back=run.released)

    @classmethod
    def of_mapping(cls, values: dict[str, Any]) -> Tally:
        """From a dict holding at least the columns (a view's row, the progress JSON); ``total`` is checked.

        :raises ValueError: if ``values["total"]`` is given and differs from the sum of the columns.
        """
        t = cls(**{f.name: int(values.get(f.name) or 0) for f in fields(cls)})
        if values.get("total") is not None and int(values["total"]) != t.total:
            raise ValueError(f"total {values['total']} is not the sum of the columns ({t.total}): {values}")
        return t

    def as_dict(self) -> dict[str, int]:
        """``{column: count}`` in :data:`COLUMNS` order, ``total`` first."""
        return {c: (self.total if c == "total" else getattr(self, c)) for c in COLUMNS}

    def __add__(self, other: Tally) -> Tally:
        return Tally(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})
