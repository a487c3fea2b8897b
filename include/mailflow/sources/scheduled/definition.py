"""The one model of a scheduled campaign's definition (pydantic): the spec files (TOML/JSON), the
``mailflow campaign`` CLI and the Airflow forms (``campaign_create``'s Params are generated from
its JSON schema) all validate through :func:`parse_definition`.

Strict: an unknown key is an error (``emails_per_dya``), types are not coerced from text
(``"20"`` is not a number, ``"true"`` is not a boolean), and every error names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, time
from typing import Annotated, Any, Literal

import email_validator
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from mailflow.campaigns import RESERVED_NAMES
from mailflow.sources.scheduled.planning import PlanSpec, Window, holiday_calendar, load_zone

__all__ = ["RESERVED_NAMES", "CampaignDefinition", "CampaignDefinitionError", "check_address", "check_stored",
           "parse_definition", "parse_window"]

NAME_PATTERN = r"^[a-z0-9_]{1,64}$"
#: the latest year a campaign may start in: later is a typo, and the planner's calendar ends at 9999
LAST_START_YEAR = 2200
RECIPIENT_SOURCES = ("recipients_sql", "recipients_table", "recipients_csv")


class _FieldsError(ValueError):
    """A rule over several fields, raised in the model's whole-definition check: names the fields
    (pydantic would report the definition as a whole)."""

    def __init__(self, fields: tuple[str, ...], message: str) -> None:
        self.fields = fields
        super().__init__(message)


class CampaignDefinitionError(ValueError):
    """A campaign definition was refused. ``errors`` holds ``(field, reason)`` pairs; the message
    names the campaign and every field."""

    def __init__(self, label: str, errors: list[tuple[str, str]], source: str | None = None) -> None:
        self.label = label
        self.errors = errors
        self.source = source
        lines = "; ".join(f"{f}: {r}" for f, r in errors)
        super().__init__(f"{source + ': ' if source else ''}campaign {label!r} refused: {lines}")

    @property
    def fields(self) -> list[str]:
        """The refused fields, in the order reported (``from``, ``windows``, ``weekdays.0`` for an
        item of the wrong type, ``recipients_sql``)."""
        return [f for f, _ in self.errors]


#: one mailbox, bare or as ``Display Name <addr>`` (the name plain or double-quoted), nothing else: no
#: second address, no stray brackets, no group syntax (RFC 5322 3.4 "mailbox")
_MAILBOX = re.compile(r'^(?:(?:"(?:[^"\\]|\\.)*"|[^"<>,;:@]*?)\s*<(?P<angle>[^<>\s,;]+)>|(?P<bare>[^<>\s,;"]+))$')


def check_address(value: str, field: str) -> str:
    """Validate a sender-side address: one mailbox, bare (``news@example.com``) or with a display name
    (``Mailflow <news@example.com>``, ``"Doe, Jane" <jane@example.com>``), per RFC 5322's ``mailbox``;
    the address itself by email-validator (no DNS lookup). A control character (a CR/LF would inject a
    header), a second address, a stray bracket or trailing text is refused. Returns ``value`` stripped.

    :raises ValueError: naming ``field`` and the reason.
    """
    text = value.strip()
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError(f"{field} {value!r} contains a control character (a line break would inject a header)")
    m = _MAILBOX.match(text)
    if not m:
        raise ValueError(f"{field} {value!r} is not one email address (write a@example.com or Name <a@example.com>)")
    addr = m.group("angle") or m.group("bare")
    try:
        email_validator.validate_email(addr, check_deliverability=False)
    except email_validator.EmailNotValidError as exc:
        raise ValueError(f"{field} {value!r} is not a valid address: {exc}") from None
    return text


def parse_window(text: str) -> Window:
    """A window as written in a definition: ``HH:MM-HH:MM``, or ``HH:MM-HH:MM+1`` for one that ends
    on the next local date (``22:00-02:00+1``). ``24:00`` ends at midnight without a ``+1``. A window
    whose end is not after its start must say ``+1``: ``17:00-09:00`` is refused instead of being read
    as overnight.

    :raises ValueError: naming the window and the reason.
    """
    raw = text.strip()
    window = Window.parse(raw)  # checks a +1 that does not end the next day
    if window.crosses_midnight and window.end != time(0) and not raw.endswith("+1"):
        raise ValueError(f"window {raw!r} ends before it starts: if it runs overnight into the next day, "
                         f"write {raw + '+1'!r}")
    return window


StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
Share = Annotated[float, Strict()]


class CampaignDefinition(BaseModel):
    """A scheduled campaign as a person defines it (keys of a spec file, fields of the form).

    Shapes and units: ``timezone`` an IANA key; ``windows`` local wall-clock ``HH:MM-HH:MM`` in that
    zone (``+1``: ends the next day); ``weekdays`` ISO numbers (1 = Monday); ``start_at`` an aware
    datetime or ISO-8601 text with an offset (None: when provisioned); ``holidays`` a country or
    country-subdivision code of the ``holidays`` library (``DE``, ``DE-BY``, ``US-CA``): those
    public holidays are skipped like a weekday not allowed; shares are fractions in [0, 1).
    Exactly one recipient source: ``recipients_sql`` (a file in ``campaigns/recipients/``),
    ``recipients_table`` (``schema.table``) or ``recipients_csv`` (a CSV path).
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True, str_strip_whitespace=True)

    name: str = Field(pattern=NAME_PATTERN, description="Unique across scheduled and lifecycle campaigns; "
                      "lower-case letters, digits and _. 'all' is reserved.")
    template: str = Field(min_length=1, description="Template name in campaigns/templates (NAME.html.j2 + NAME.txt.j2).")
    subject: str = Field(min_length=1, description="Subject line (Jinja over user, e.g. 'Hi {{ user.first_name }}').")
    from_address: str = Field(alias="from", description="Sender: a@example.com or Name <a@example.com>.")
    reply_to: str | None = Field(None, description="Optional Reply-To address.")
    timezone: str = Field("Europe/Berlin", description="IANA timezone of the windows and weekdays.")
    emails_per_day: StrictInt = Field(20, ge=1, le=1_000_000, description="Emails sent on each sending day.")
    weekdays: list[StrictInt] = Field(default_factory=lambda: [1, 2, 3, 4, 5], min_length=1, max_length=7,
                                      description="ISO weekdays that send (1 = Monday .. 7 = Sunday).")
    windows: list[str] = Field(default_factory=lambda: ["09:00-12:00", "14:00-17:00"], min_length=1,
                               description="Local send windows HH:MM-HH:MM; a window into the next day ends in +1.")
    holidays: str | None = Field(None, description="Skip the public holidays of this country or region "
                                 "(holidays library code: DE, DE-BY, US-CA); empty: none skipped.")
    start_at: datetime | None = Field(None, description="First possible send (ISO 8601 with offset); empty: now.")
    marketing: StrictBool = Field(True, description="Marketing mail (unsubscribe link, List-Unsubscribe).")
    on_policy: Literal["defer", "skip", "ignore"] = Field(
        "defer", description="A due email the contact policy holds back: defer to a later slot, skip it, "
        "or ignore the policy (transactional mail only).")
    holdout_share: Share = Field(0.0, ge=0, lt=1, description="Share of recipients held out as a control "
                                 "group (recorded, never sent), e.g. 0.1.")
    canary_share: Share | None = Field(None, gt=0, lt=1, description="Send this share first and hold the rest "
                                       "until its outcomes are in.")
    canary_min_outcome_share: Share | None = Field(None, gt=0, le=1)
    canary_max_wait_minutes: Share | None = Field(None, gt=0)
    recipients_sql: str | None = Field(None, description="Recipients query file in campaigns/recipients.")
    recipients_table: str | None = Field(None, pattern=r"^(?:[a-z_][a-z0-9_]*\.)?[a-z_][a-z0-9_]*$",
                                         description="Recipients table schema.table (user_id, email, first_name).")
    recipients_csv: str | None = Field(None, description="CSV file of recipients (user_id, email, first_name, ...).")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if v in RESERVED_NAMES:
            raise ValueError(f"{v!r} is reserved (it means every campaign)")
        return v

    @field_validator("from_address")
    @classmethod
    def _from(cls, v: str) -> str:
        return check_address(v, "from")

    @field_validator("reply_to")
    @classmethod
    def _reply_to(cls, v: str | None) -> str | None:
        return check_address(v, "reply_to") if v else None

    @field_validator("timezone")
    @classmethod
    def _zone(cls, v: str) -> str:
        load_zone(v)
        return v

    @field_validator("weekdays")
    @classmethod
    def _weekdays(cls, v: list[int]) -> list[int]:
        bad = [d for d in v if d not in range(1, 8)]
        if bad:
            raise ValueError(f"ISO weekday numbers are 1..7 (1 = Monday), got {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"a weekday is listed twice: {v}")
        return sorted(v)

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        return [str(parse_window(w)) for w in v]  # one spelling: 23:00-01:00+1, 22:00-24:00

    @field_validator("holidays")
    @classmethod
    def _holidays(cls, v: str | None) -> str | None:
        if not v:
            return None
        holiday_calendar(v)  # raises ValueError naming the code
        return v.upper()

    @field_validator("start_at")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        if v is not None and v.tzinfo is None:
            raise ValueError("must carry a UTC offset (e.g. 2026-12-07T09:00:00+01:00)")
        if v is not None and v.year > LAST_START_YEAR:
            raise ValueError(f"{v.isoformat()} is after {LAST_START_YEAR}: a typo? (a plan must fit in the calendar)")
        return v

    @model_validator(mode="after")
    def _whole(self) -> CampaignDefinition:
        sources = [k for k in RECIPIENT_SOURCES if getattr(self, k)]
        if len(sources) != 1:
            raise _FieldsError(tuple(sources) or RECIPIENT_SOURCES[:1], f"give exactly one of "
                               f"{', '.join(RECIPIENT_SOURCES)} (got {', '.join(sources) or 'none'})")
        if self.canary_share is None and (self.canary_min_outcome_share is not None
                                          or self.canary_max_wait_minutes is not None):
            given = tuple(k for k in ("canary_min_outcome_share", "canary_max_wait_minutes") if getattr(self, k) is not None)
            raise _FieldsError(given, "needs a canary_share")
        try:  # the windows together: overlaps, a night window running into the next morning's
            self.plan_spec()
        except ValueError as exc:
            raise _FieldsError(("windows",), str(exc)) from None
        return self

    def plan_spec(self) -> PlanSpec:
        """The planner settings of this definition (:class:`PlanSpec`)."""
        return PlanSpec(timezone=self.timezone, emails_per_day=self.emails_per_day,
                        weekdays=frozenset(self.weekdays), windows=tuple(parse_window(w) for w in self.windows),
                        holidays=self.holidays)

    @property
    def recipient_source(self) -> tuple[str, str]:
        """``(key, value)`` of the one recipient source given."""
        for k in RECIPIENT_SOURCES:
            if v := getattr(self, k):
                return k, str(v)
        raise AssertionError("validated: exactly one recipient source")

    def as_spec(self) -> dict[str, Any]:
        """The definition as spec keys (``from``, not ``from_address``), None values dropped."""
        return {k: v for k, v in self.model_dump(by_alias=True).items() if v is not None}


def parse_definition(data: Any, label: str | None = None, *, source: str | None = None) -> CampaignDefinition:
    """Validate a definition mapping (a spec file's table, a form's Params, a CLI's options).

    :param source: where the definition came from (a spec file's path), put before the message.
    :raises CampaignDefinitionError: (a ValueError) naming the campaign and every refused field:
        an unknown key, a missing or mistyped one, an invalid address, timezone, window, holiday
        code or share, a reserved name, no or several recipient sources.
    """
    name = label or (str(data.get("name")) if isinstance(data, Mapping) and data.get("name") else "?")
    if not isinstance(data, Mapping):
        raise CampaignDefinitionError(name, [("(definition)", f"expected a table of keys, got {type(data).__name__}")],
                                      source)
    try:
        return CampaignDefinition.model_validate(dict(data))
    except ValidationError as exc:
        errors = []
        for e in exc.errors(include_url=False):
            cause = e.get("ctx", {}).get("error")
            msg = "unknown key (a typo?)" if e["type"] == "extra_forbidden" else str(e["msg"])
            msg = msg.removeprefix("Value error, ")
            if isinstance(cause, _FieldsError):  # a rule over several fields names each
                errors += [(f, msg) for f in cause.fields]
                continue
            loc = ".".join(str(p) for p in e["loc"]) or "(definition)"
            errors.append(("from" if loc == "from_address" else loc, msg))
        raise CampaignDefinitionError(name, errors, source) from None


def check_stored(row: Mapping[str, Any]) -> None:
    """Re-check a stored campaign (a ``mail.campaign`` row as a dict) by the definition's rules
    before anything is written for it: a row created before a rule existed (or edited by hand) is
    refused here, not sent. Checks ``name`` (reserved), ``from_address`` (reported as ``from``),
    ``reply_to``, ``timezone``, ``weekdays``, ``windows`` (each, with ``+1`` for one into the next
    day, and together) and ``holidays``.

    :raises CampaignDefinitionError: naming the campaign (source ``mail.campaign``) and every
        refused field.
    """
    errors: list[tuple[str, str]] = []

    def check(field: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except ValueError as exc:
            errors.append((field, str(exc)))

    name = str(row.get("name"))
    if name in RESERVED_NAMES:
        errors.append(("name", f"{name!r} is reserved (it means every campaign)"))
    check("from", check_address, str(row.get("from_address") or ""), "from")
    if row.get("reply_to"):
        check("reply_to", check_address, str(row["reply_to"]), "reply_to")
    check("timezone", load_zone, str(row.get("timezone")))
    weekdays = list(row.get("weekdays") or [])
    if not weekdays or any(d not in range(1, 8) for d in weekdays):
        errors.append(("weekdays", f"ISO weekday numbers are 1..7 (1 = Monday), got {weekdays}"))
    windows = [str(w) for w in row.get("windows") or []]
    n = len(errors)
    for w in windows:
        check("windows", parse_window, w)
    if not windows:
        errors.append(("windows", "no window"))
    elif len(errors) == n:
        check("windows", PlanSpec, "UTC", 1, frozenset({1}), tuple(windows))
    if row.get("holidays"):
        check("holidays", holiday_calendar, str(row["holidays"]))
    if errors:
        raise CampaignDefinitionError(name, errors, "mail.campaign")
