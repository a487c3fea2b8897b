"""Plain data shapes shared by the engine, the store and the provider (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from mailflow.model.tally import Tally


@dataclass(frozen=True)
class DataInterval:
    """A run's half-open data interval ``[start, end)``; both aware datetimes (stored as UTC).

    :raises ValueError: if a bound is naive or ``end < start``.
    """

    start: datetime
    end: datetime

    def __post_init__(self) -> None:
        if self.start.tzinfo is None or self.end.tzinfo is None:
            raise ValueError(f"data interval bounds must be timezone-aware: {self.start!r}, {self.end!r}")
        if self.end < self.start:
            raise ValueError(f"data interval end {self.end} is before its start {self.start}")


@dataclass(frozen=True)
class RunContext:
    """Who is writing: copied onto every send-log row and event (Airflow ids, or a tool's name)."""

    dag_id: str | None = None
    run_id: str | None = None
    task_id: str | None = None


@dataclass(frozen=True)
class MintedRow:
    """One claimed send-log row: ``id`` (send_log.id), ``user_id``, recipient snapshot ``email``,
    and ``context`` (the audience's extra columns, a JSON object used by the templates)."""

    id: int
    user_id: int
    email: str
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PreparedBatch:
    """The exact request for one chunk: ``row_ids[i]`` is the send-log row of request index ``i``.

    ``body`` is the JSON array sent to ``POST /emails/batch``, byte-for-byte; every retry of this
    batch sends these bytes under ``idempotency_key`` (Resend keeps keys 24 h) with the same
    ``validation`` mode (``x-batch-validation``; None: the client's configured mode). The key the
    renderer gives is provisional: the store assigns the final one when it stores the batch (see
    docs/model.md, "Idempotency keys").

    ``key_identity`` is the non-secret identity of the API key that will send it
    (``ResendClient.key_identity``; None: unknown, e.g. a test double). The store records it with
    the bytes: the provider scopes idempotency keys per API key, so a resend must use that key.

    ``content_hash`` is the hash of the campaign content the body was rendered from (16 hex,
    ``Campaign.content_hash``; None: unknown), stored with the bytes so analysts can tell which
    version of a campaign an email came from.
    """

    idempotency_key: str
    campaign: str
    row_ids: tuple[int, ...]
    body: bytes
    validation: str | None = None
    key_identity: str | None = None
    content_hash: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.row_ids) <= 100:
            raise ValueError(f"a batch holds 1 to 100 emails (provider docs), got {len(self.row_ids)}")
        if self.validation not in (None, "strict", "permissive"):
            raise ValueError(f"batch validation must be 'strict' or 'permissive', got {self.validation!r}")


# The outcome model (docs/model.md): every answer to a batch request is exactly one of these.
# Sources: Resend's error-code page (which statuses and names mean the request was refused as a
# whole), its idempotency-key page (same key + same body replays the original answer for 24 h), and
# its batch-validation page (strict: any invalid email fails the whole request, nothing is sent).


@dataclass(frozen=True)
class Accepted:
    """The provider answered 2xx and the answer adds up: ``ids`` maps request index -> provider email
    id, ``rejected`` maps request index -> the provider's message (a per-recipient error: that exact
    email is refused, the only thing that fails a row), ``withheld`` maps request index -> the
    message of a refusal that names a campaign field (charges nobody, see below). Every index is in
    exactly one of them."""

    ids: dict[int, str]
    rejected: dict[int, str]
    kind: Literal["accepted"] = "accepted"
    stop_run: str | None = None
    #: request index -> the provider's message, for emails refused for a field that belongs to the
    #: CAMPAIGN (``from``, ``reply_to``, ``headers``; a rendered subject or body refused in every
    #: email of the batch), not to the recipient: nobody is charged (the rows are released like
    #: a :class:`NotSent`), the run stops (``stop_run``) and the task fails (``fatal``).
    withheld: dict[int, str] = field(default_factory=dict)
    fatal: bool = False
    #: the campaign field the provider refused (``withheld`` is not empty), e.g. ``"from"``
    campaign_field: str | None = None


@dataclass(frozen=True)
class NotSent:
    """Proven not processed: the provider's own answer says the whole request was refused (400/422
    validation of the whole body, 401/403, 429 of any kind, 409 ``concurrent_idempotent_requests``
    with no earlier ambiguous attempt) or nothing was ever written to the connection. The chunk is
    rolled back without charging any user. Such a failure repeats (auth, domain, quota, a refused
    body, an outage), so ``stop_run`` always names why the run stops; ``fatal`` makes the task fail
    after everything is recorded, so a person is alerted."""

    reason: str
    stop_run: str | None = None
    fatal: bool = False
    kind: Literal["not_sent"] = "not_sent"


@dataclass(frozen=True)
class Unknown:
    """Ambiguous: the provider may have processed the batch (any 5xx, a timeout or a connection
    lost after the request was written, a 2xx that does not add up, a 409 with the same key in
    flight). The rows keep their key and bytes forever and are retried with that key only; only a
    2xx resolves them; past the idempotency window they become dead letters "unknown outcome".
    Never guessed."""

    reason: str
    stop_run: str | None = None
    fatal: bool = False
    kind: Literal["unknown"] = "unknown"


@dataclass(frozen=True)
class Refused:
    """Strict batch validation refused the whole request (a 400/422 ``validation_error`` answer to
    ``x-batch-validation: strict``): nothing was processed. Resend's strict error names no index,
    so the refused email is not guessed: the caller re-sends the whole chunk in permissive mode
    under a new key, and the permissive answer names the refused emails by index."""

    reason: str
    kind: Literal["refused"] = "refused"
    stop_run: str | None = None
    fatal: bool = False


Outcome = Accepted | NotSent | Unknown | Refused


@dataclass
class CampaignSummary:
    """Counts for one campaign in one run (emails). ``eligible`` is the audience after exclusions at
    the start of the campaign; ``minted`` = rows requested from the provider; ``sent`` = accepted;
    ``failed`` = rejected by the provider, by index; ``invalid`` = rows failed locally (address
    rejected by the validator, no request); ``duplicates`` = rows recorded as ``duplicate`` (another
    user got the campaign at the same normalised address); ``released`` = rows rolled back (the whole
    request certainly failed); ``unknown`` = rows left ``sending`` after an ambiguous answer;
    ``held`` = users the contact guard left out at mint, without a row (a claim that committed after
    the audience was read, an address suppressed in a spelling the audience query cannot match, or an
    address the provider rejected earlier in this run; a later run decides again); ``holdout`` = users
    recorded in the campaign's holdout group (a ``holdout`` row, no email; docs/model.md, "Holdout
    groups"); ``not_reached``
    (also ``skipped``) = eligible users not decided (time budget or stop), without a row; ``waited``
    = seconds the campaign waited for outcomes (the reputation guard's exposure bound).

    :meth:`emails` counts the rows the run wrote the way every other summary counts the send log
    (:mod:`mailflow.model.tally`): an invalid address is a ``failed`` row there, of which ``invalid``."""

    campaign: str
    eligible: int = 0
    minted: int = 0
    sent: int = 0
    failed: int = 0
    released: int = 0
    unknown: int = 0
    chunks: int = 0
    stopped: str | None = None
    invalid: int = 0
    duplicates: int = 0
    held: int = 0
    holdout: int = 0
    waited: float = 0.0

    @property
    def not_reached(self) -> int:
        """Eligible users the run did not decide (no row): time budget or a stop."""
        return max(self.eligible - self.minted - self.invalid - self.duplicates - self.held - self.holdout, 0)

    @property
    def skipped(self) -> int:
        """The same as :attr:`not_reached` (users, not the send log's ``skipped`` status)."""
        return self.not_reached

    def emails(self) -> Tally:
        """The rows this run wrote, by the send log's columns (:class:`~mailflow.model.tally.Tally`)."""
        return Tally.of_run(self)

    def as_dict(self) -> dict[str, Any]:
        """The task's return value: the run's own counts (``eligible``, ``minted``, ``held``,
        ``not_reached``, ``chunks``, ``stopped``) and its rows by the send log's columns
        (``total``, ``pending`` ... ``rolled_back``: :data:`mailflow.model.tally.COLUMNS`)."""
        return {
            "campaign": self.campaign,
            "eligible": self.eligible,
            "minted": self.minted,
            "held": self.held,
            "not_reached": self.not_reached,
            "chunks": self.chunks,
            "stopped": self.stopped,
            **self.emails().as_dict(),
        }


class SendError(RuntimeError):
    """Raised after a run has recorded everything it could, when a person must act (bad API key,
    idempotency conflict, a whole campaign rejected, a provider that could not be reached).
    ``summaries`` holds a lifecycle run's counts, ``summary`` a scheduled dispatch run's."""

    def __init__(self, message: str, summaries: list[CampaignSummary] | None = None, summary: Any = None):
        super().__init__(message)
        self.summaries = summaries or []
        self.summary = summary


def iso(dt: datetime) -> str:
    """ISO-8601 text of an aware datetime (for logs and JSON)."""
    return dt.isoformat()


def as_timedelta(text: str) -> timedelta:
    """Parse a small ISO-8601 duration: ``P7D``, ``PT1H``, ``P1DT12H``, ``PT30M``, ``PT45S``.

    :raises ValueError: naming the text if it is not such a duration (months/years are refused:
        they have no fixed length).
    """
    import re

    m = re.fullmatch(r"P(?:(\d+)W)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?", text.strip())
    if not m or text.strip() in ("P", "PT"):
        raise ValueError(f"not an ISO-8601 duration in weeks/days/hours/minutes/seconds: {text!r}")
    w, d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return timedelta(weeks=w, days=d, hours=h, minutes=mi, seconds=s)
