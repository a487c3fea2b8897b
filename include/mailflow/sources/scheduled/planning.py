"""Send-time planner for scheduled outreach campaigns (pure, deterministic, streaming).

A campaign sends ``emails_per_day`` emails on each allowed local day, spread evenly in real elapsed
time over that day's local business-hour windows in the campaign's IANA timezone.

Rules (the single source of truth; the tests in ``tests/unit/sources/test_planner.py`` pin them down):

* **Eligible instants.** An instant is eligible on plan day ``D`` iff its local wall-clock reading
  (``instant.astimezone(zone)``) is inside one of ``D``'s windows (start inclusive, end exclusive).
  A window belongs to the local date it starts on: ``22:00-24:00`` ends at the next midnight and
  ``23:00-01:00+1`` runs from 23:00 on ``D`` to 01:00 on ``D + 1`` (its weekday and holiday are
  ``D``'s, its emails count towards ``D``'s ``emails_per_day``). Only the last window of a day can cross midnight, and
  its tail may not overlap the next day's first window. A plan day therefore runs from
  ``PlanSpec.day_start`` (the end of a crossing window, else 00:00) on ``D`` to the same wall time on
  ``D + 1`` (:func:`plan_day`). Offsets are never cached: each day is split into constant-UTC-offset pieces found from
  zoneinfo, and every window is intersected with every piece. Consequences at DST changes:

  - spring forward: wall times in the gap do not exist, so a bound in the gap resolves to the instant
    the clocks jumped to (02:00-03:30 on Europe/Berlin 2026-03-29 is 01:00-01:30 UTC);
  - fall back: both passes of the repeated hour are eligible, i.e. a start bound resolves to its first
    occurrence (fold=0) and an end bound to its last occurrence (fold=1); a window lying entirely in the
    repeated hour (02:15-02:45) yields two disjoint stretches and never the time between them.

* **Spreading.** With ``T`` the total eligible time of the day and ``N = emails_per_day``, slot ``k``
  (``0 <= k < N``) is the instant ``floor(k * T / N)`` (microseconds) into the day's eligible
  stretches laid end to end, so the first slot is the first eligible instant (e.g. 09:00).

* **First day / floor.** Day 1 is the plan day of ``start``. Only eligible time at or after a floor
  counts: ``start`` on the first day,
  one microsecond after the previous slot afterwards (this only bites when a local date occurs
  twice, e.g. America/Juneau in October 1867). The ``N`` slots are spread over what remains; a day with less than ``N`` microseconds of
  remaining eligible time (e.g. ``start`` after the last window) is skipped, as are days whose
  weekday is not allowed and days that are public holidays of ``PlanSpec.holidays`` (the pins:
  ``tests/unit/sources/test_holidays.py``). Output is therefore strictly increasing.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from itertools import dropwhile, islice
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import holidays

__all__ = ["PlanSpec", "PlanSummary", "Window", "describe_schedule", "holiday_calendar", "holidays_skipped", "load_zone",
           "plan_after", "plan_day", "plan_send_times", "plan_spec", "summarize"]

_HOUR = timedelta(hours=1)
_SECOND = timedelta(seconds=1)
_MICRO = timedelta(microseconds=1)
_MAX_OFFSET = timedelta(hours=16)  # every UTC offset in tzdata, LMT included, is within +-16h
_MAX_EMPTY_DAYS = 800  # safety valve: no real zone has this many allowed days without window time
_DAY = timedelta(days=1)
_TIME = r"(\d{1,2}):(\d{2})(?::(\d{2}))?"
_WINDOW_RE = re.compile(rf"^\s*{_TIME}\s*-\s*{_TIME}\s*(\+1)?\s*$")


@functools.cache
def holiday_calendar(code: str) -> holidays.HolidayBase:
    """The public holidays of ``code``: a country (ISO 3166-1 alpha-2, ``"DE"``) or a country and
    subdivision (``"DE-BY"``, ``"US-CA"``), from the ``holidays`` library (its data, its
    subdivision codes). The calendar is a local-date set that fills in years as they are asked for.

    :raises ValueError: naming the code, for a country or subdivision the library does not know.
    """
    country, _, subdiv = code.strip().upper().partition("-")
    supported = holidays.list_supported_countries()
    if country not in supported:
        raise ValueError(f"unknown holiday country {country!r} in {code!r} (use an ISO 3166-1 code such as DE, FR, US)")
    if subdiv and subdiv not in supported[country]:
        raise ValueError(f"unknown holiday region {code!r}: {country} has the subdivisions "
                         f"{', '.join(supported[country]) or 'none'}")
    return holidays.country_holidays(country, subdiv=subdiv or None)


def load_zone(key: str) -> ZoneInfo:
    """Return the ``ZoneInfo`` for IANA key ``key``; raise ``ValueError("unknown IANA timezone ...")``."""
    try:
        return ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise ValueError(f"unknown IANA timezone {key!r}") from None


def _fmt(t: time, *, end: bool = False) -> str:
    if end and t == time(0):
        return "24:00"
    return t.strftime("%H:%M") if (t.second, t.microsecond) == (0, 0) else t.isoformat()


def _seconds(t: time) -> timedelta:
    return timedelta(hours=t.hour, minutes=t.minute, seconds=t.second, microseconds=t.microsecond)


@dataclass(frozen=True, order=True)
class Window:
    """A local wall-clock window ``[start, end)`` (naive ``datetime.time`` values) that opens on a day.

    ``end`` is exclusive. ``end <= start`` means the window crosses midnight and ends on the next
    local date: ``Window(time(22), time(0))`` is ``22:00-24:00``, ``Window(time(23), time(1))`` is
    ``23:00-01:00+1`` and ``Window(time(0), time(0))`` is the whole day (``00:00-24:00``). Any other
    ``start == end`` is refused as ambiguous. Raises ``ValueError`` naming the window.

    Text form (``str``, :meth:`parse`): ``HH:MM-HH:MM``, with ``+1`` after a window that ends on the
    next date at a time other than midnight (``23:00-01:00+1``); ``24:00`` ends at midnight.
    """

    start: time
    end: time

    def __post_init__(self) -> None:
        if not isinstance(self.start, time) or not isinstance(self.end, time):
            raise ValueError(f"window bounds must be datetime.time values, got {self.start!r}-{self.end!r}")
        if self.start.tzinfo is not None or self.end.tzinfo is not None:
            raise ValueError(f"window {self} must use naive local times (the zone comes from PlanSpec)")
        if self.start == self.end and self.start != time(0):
            raise ValueError(f"invalid window {_fmt(self.start)}-{_fmt(self.end)}: start equals end "
                             "(for a whole day write 00:00-24:00)")

    def __str__(self) -> str:
        overnight = self.crosses_midnight and self.end != time(0)
        return f"{_fmt(self.start)}-{_fmt(self.end, end=True)}{'+1' if overnight else ''}"

    @property
    def crosses_midnight(self) -> bool:
        """True if the window ends on the next local date (``end <= start``, incl. ``24:00``)."""
        return self.end <= self.start

    @property
    def length(self) -> timedelta:
        """Wall-clock length (``timedelta``, ``0 < length <= 24 h``), ignoring DST shifts."""
        d = _seconds(self.end) - _seconds(self.start)
        return d if d > timedelta() else d + _DAY

    def bounds(self, day: date) -> tuple[datetime, datetime]:
        """Naive local ``(start, end)`` wall-clock datetimes of this window opened on ``day``."""
        start = datetime.combine(day, self.start)
        return start, datetime.combine(day + _DAY if self.crosses_midnight else day, self.end)

    @classmethod
    def parse(cls, text: str) -> Window:
        """Parse ``"HH:MM-HH:MM"`` (seconds optional, e.g. ``"09:00-12:00"``, ``"22:00-24:00"``,
        ``"23:00-01:00+1"``); raise ``ValueError``. A ``+1`` must end on the next date; its absence is
        not checked here (``23:00-01:00`` still crosses midnight): a definition requires it
        (:func:`mailflow.sources.scheduled.definition.parse_window`)."""
        m = _WINDOW_RE.match(text)
        if not m:
            raise ValueError(f"invalid window {text!r}: expected 'HH:MM-HH:MM' (or 'HH:MM-HH:MM+1')")
        *groups, plus = m.groups()
        h1, m1, s1, h2, m2, s2 = (int(g or 0) for g in groups)
        if (h2, m2, s2) == (24, 0, 0):
            h2 = 0
        elif (h1, m1, s1) == (h2, m2, s2):
            raise ValueError(f"invalid window {text!r}: start equals end (for a whole day write 00:00-24:00)")
        try:
            start, end = time(h1, m1, s1), time(h2, m2, s2)
        except ValueError:
            raise ValueError(f"invalid window {text!r}: not a valid time of day") from None
        window = cls(start, end)
        if plus and not window.crosses_midnight:
            raise ValueError(f"invalid window {text!r}: +1 says it ends the next day, but it ends after it starts")
        return window


_DEFAULT_WINDOWS = (Window(time(9), time(12)), Window(time(14), time(17)))


@dataclass(frozen=True)
class PlanSpec:
    """Campaign schedule settings; validated on construction (``ValueError`` with a clear message).

    - ``timezone``: IANA key, e.g. ``"Europe/Berlin"``; windows and days are interpreted in it.
    - ``emails_per_day``: sends per allowed local day, ``>= 1``.
    - ``weekdays``: allowed **ISO** weekdays, ``1 = Monday .. 7 = Sunday`` (``date.isoweekday()``),
      default Monday-Friday; at least one.
    - ``windows``: non-empty, non-overlapping ``Window`` values (``"HH:MM-HH:MM"`` strings accepted);
      stored sorted by start. Touching windows (``09:00-12:00``, ``12:00-13:00``) are allowed. The
      last window may end at ``24:00`` or cross midnight (``23:00-01:00``); its tail on the next date
      must not overlap that date's first window.
    - ``holidays``: a country (``"DE"``) or country-subdivision (``"DE-BY"``, ``"US-CA"``) code of the
      ``holidays`` library, or None. A plan day whose local date is one of its public holidays sends
      nothing, like a weekday not allowed (:func:`holiday_calendar`).
    """

    timezone: str = "Europe/Berlin"
    emails_per_day: int = 20
    weekdays: frozenset[int] = frozenset({1, 2, 3, 4, 5})
    windows: tuple[Window, ...] = field(default=_DEFAULT_WINDOWS)
    holidays: str | None = None

    def __post_init__(self) -> None:
        load_zone(self.timezone)
        if isinstance(self.emails_per_day, bool) or not isinstance(self.emails_per_day, int):
            raise ValueError(f"emails_per_day must be an int, got {self.emails_per_day!r}")
        if self.emails_per_day < 1:
            raise ValueError(f"emails_per_day must be >= 1, got {self.emails_per_day}")
        days = frozenset(self.weekdays)
        if not days:
            raise ValueError("weekdays must contain at least one ISO weekday (1=Monday .. 7=Sunday)")
        if bad := sorted((d for d in days if d not in range(1, 8)), key=repr):
            raise ValueError(f"weekdays must be ISO weekday numbers 1..7 (1=Monday), got {bad}")
        windows = tuple(sorted(Window.parse(w) if isinstance(w, str) else w for w in self.windows))
        if not windows:
            raise ValueError("windows must contain at least one window")
        for a, b in zip(windows, windows[1:], strict=False):
            if _seconds(a.start) + a.length > _seconds(b.start):
                raise ValueError(f"windows {a} and {b} overlap")
        last, first = windows[-1], windows[0]
        if _seconds(last.start) + last.length - _DAY > _seconds(first.start):
            raise ValueError(f"windows {last} and {first} overlap (the first runs past midnight into the "
                             "next day's)")
        object.__setattr__(self, "weekdays", days)
        object.__setattr__(self, "windows", windows)
        if self.holidays is not None:
            holiday_calendar(self.holidays)

    def sends_on(self, day: date) -> bool:
        """True if plan day ``day`` (a local date) may send: an allowed weekday, not a holiday."""
        if day.isoweekday() not in self.weekdays:
            return False
        return self.holidays is None or day not in holiday_calendar(self.holidays)

    @property
    def zone(self) -> ZoneInfo:
        """The ``ZoneInfo`` for ``timezone``."""
        return load_zone(self.timezone)

    @property
    def day_start(self) -> time:
        """Local wall time at which a plan day begins: the end of a window that crosses midnight
        (e.g. ``01:00`` for ``23:00-01:00``), else ``00:00``."""
        last = self.windows[-1]
        return last.end if last.crosses_midnight else time(0)


def plan_day(spec: PlanSpec, instant: datetime) -> date:
    """The plan day (a local date in ``spec.timezone``) that aware ``instant`` belongs to: its local
    date, or the previous one when its wall time is before ``spec.day_start`` (the tail of a window
    that crossed midnight). Raises ``ValueError`` for a naive ``instant``."""
    if instant.tzinfo is None or instant.utcoffset() is None:
        raise ValueError(f"plan_day needs an aware datetime, got naive {instant!r}")
    local = instant.astimezone(spec.zone)
    return local.date() - _DAY if local.time().replace(fold=0) < spec.day_start else local.date()


def _offset(zone: ZoneInfo, instant: datetime) -> timedelta:
    off = instant.astimezone(zone).utcoffset()
    assert off is not None
    return off


def _offset_pieces(
    zone: ZoneInfo, lo: datetime, hi: datetime
) -> Iterator[tuple[datetime, datetime, timedelta]]:
    """Split UTC ``[lo, hi)`` into ``(from, to, utc_offset)`` pieces of constant offset.

    Samples hourly and bisects to the second (tzdata transitions are whole UTC seconds); assumes at
    most one transition per hour, which holds for every zone in tzdata.
    """
    cur, cur_off, t = lo, _offset(zone, lo), lo
    while t < hi:
        nxt = min(t + _HOUR, hi)
        if _offset(zone, nxt) == cur_off:
            t = nxt
            continue
        a, b = t, nxt  # offset(a) == cur_off != offset(b)
        while b - a > _SECOND:
            mid = a + (b - a) // _SECOND // 2 * _SECOND
            a, b = (mid, b) if _offset(zone, mid) == cur_off else (a, mid)
        yield cur, b, cur_off
        cur, cur_off, t = b, _offset(zone, b), b
    yield cur, hi, cur_off


def _day_slots(spec: PlanSpec, zone: ZoneInfo, day: date, floor: datetime) -> list[datetime]:
    """The ``emails_per_day`` UTC slots of local ``day`` at or after ``floor`` (``[]`` if no room)."""
    midnight = datetime.combine(day, time(), tzinfo=UTC)
    lo = midnight - _MAX_OFFSET
    hi = midnight + (2 * _DAY if spec.windows[-1].crosses_midnight else _DAY) + _MAX_OFFSET
    bounds = [tuple(b.replace(tzinfo=UTC) for b in w.bounds(day)) for w in spec.windows]
    segments: list[tuple[datetime, datetime]] = []
    for piece_from, piece_to, off in _offset_pieces(zone, lo, hi):
        for w_start, w_end in bounds:
            s = max(piece_from, floor, w_start - off)
            e = min(piece_to, w_end - off)
            if s < e:
                segments.append((s, e))
    segments.sort()
    n = spec.emails_per_day
    total = sum((e - s for s, e in segments), timedelta())
    if total < n * _MICRO:
        return []
    slots: list[datetime] = []
    seg_iter = iter(segments)
    seg_start, seg_end = next(seg_iter)
    passed = timedelta()  # eligible time in segments before the current one
    for k in range(n):
        target = total * k // n
        while target >= passed + (seg_end - seg_start):
            passed += seg_end - seg_start
            seg_start, seg_end = next(seg_iter)
        slots.append(seg_start + (target - passed))
    return slots


def plan_send_times(spec: PlanSpec, count: int, start: datetime) -> Iterator[datetime]:
    """Yield ``count`` send instants as aware UTC datetimes (``tzinfo=datetime.UTC``), strictly increasing.

    Recipient ``i`` gets the ``i``-th instant. ``start`` must be timezone-aware; nothing is planned
    before it, and day 1 is ``start``'s local date in ``spec.timezone``. See the module docstring for
    the eligibility, spreading, first-day and DST rules. Lazy: holds one day's slots at a time.
    Raises ``ValueError`` (eagerly, at call time) for a naive ``start`` or a negative ``count``.
    """
    if start.tzinfo is None or start.utcoffset() is None:
        raise ValueError("start must be a timezone-aware datetime")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an int >= 0, got {count!r}")
    return _generate(spec, count, start.astimezone(UTC))


def _generate(spec: PlanSpec, count: int, start: datetime) -> Iterator[datetime]:
    zone = spec.zone
    day, floor, remaining, empty_days = plan_day(spec, start), start, count, 0
    while remaining > 0:
        sends = spec.sends_on(day)
        slots = _day_slots(spec, zone, day, floor) if sends else []
        if slots:
            empty_days = 0
            yield from slots[:remaining]
            remaining -= len(slots)
            floor = slots[-1] + _MICRO
        elif sends:
            empty_days += 1
            if empty_days > _MAX_EMPTY_DAYS:
                raise RuntimeError(f"no window time on {_MAX_EMPTY_DAYS} consecutive allowed days")
        day += timedelta(days=1)


@dataclass(frozen=True)
class PlanSummary:
    """Dry-run overview of planned instants.

    ``first``/``last``: earliest/latest instant as given (``None`` if empty); ``emails_per_day``: count
    per **local** date in the summary's zone, in date order; ``days_spanned``: calendar days from the
    first to the last local date inclusive (0 if empty); ``total``: number of instants.
    """

    first: datetime | None
    last: datetime | None
    emails_per_day: dict[date, int]
    days_spanned: int
    total: int


def summarize(times: Iterable[datetime], tz: str, *, day_start: time = time(0)) -> PlanSummary:
    """Summarize aware instants ``times`` (any iterable, consumed once) by local date in IANA zone ``tz``.

    ``day_start``: local wall time a day begins at (``PlanSpec.day_start``), so emails in the tail of
    a window that crossed midnight count towards the day the window opened on.

    Memory is O(number of distinct local days). Raises ``ValueError`` for an unknown zone or a naive
    datetime.
    """
    zone = load_zone(tz)
    first: datetime | None = None
    last: datetime | None = None
    per_day: dict[date, int] = {}
    total = 0
    for t in times:
        if t.tzinfo is None or t.utcoffset() is None:
            raise ValueError(f"summarize needs aware datetimes, got naive {t!r}")
        first = t if first is None or t < first else first
        last = t if last is None or t > last else last
        local = t.astimezone(zone)
        d = local.date() - _DAY if local.time().replace(fold=0) < day_start else local.date()
        per_day[d] = per_day.get(d, 0) + 1
        total += 1
    days = dict(sorted(per_day.items()))
    spanned = (max(days) - min(days)).days + 1 if days else 0
    return PlanSummary(first, last, days, spanned, total)


def plan_spec(campaign: Mapping[str, Any]) -> PlanSpec:
    """The planner settings of a ``mail.campaign`` row (a mapping with timezone, emails_per_day,
    weekdays, windows).

    :raises ValueError: from :class:`PlanSpec` (unknown zone, bad window, ...).
    """
    return PlanSpec(timezone=str(campaign["timezone"]), emails_per_day=int(campaign["emails_per_day"]),
                    weekdays=frozenset(int(d) for d in campaign["weekdays"]),
                    windows=tuple(Window.parse(str(w)) for w in campaign["windows"]),
                    holidays=campaign.get("holidays"))


def local_midnight(day: date, spec: PlanSpec) -> datetime:
    """The first instant (UTC) of plan day ``day``: ``spec.day_start`` (00:00 unless a window crosses
    midnight) on that local date (in a DST gap: the instant after it)."""
    return datetime.combine(day, spec.day_start, tzinfo=spec.zone).astimezone(UTC)


def day_bounds(at: datetime, spec: PlanSpec) -> tuple[datetime, datetime]:
    """``[start, end)`` in UTC of the plan day of ``at`` in the campaign's zone (see
    :func:`mailflow.sources.scheduled.planning.plan_day`: a window crossing midnight counts towards its first date)."""
    day = plan_day(spec, at)
    return local_midnight(day, spec), local_midnight(day + timedelta(days=1), spec)


def plan_after(spec: PlanSpec, plan_start: datetime, plan_skip: int, planned_through: datetime | None,
               count: int) -> Iterator[datetime]:
    """The next ``count`` instants (aware UTC, increasing) of the plan anchored at ``plan_start``.

    The plan is ``plan_send_times(spec, ., plan_start)`` without its first ``plan_skip`` instants.
    ``planned_through`` (the last instant already given to a row, or None) is continued from
    without generating the plan from its start: the local day of ``planned_through`` is re-planned
    from its beginning (or from ``plan_start`` on the plan's first day) and the instants up to
    ``planned_through`` are dropped, so chunked planning equals one uninterrupted plan.
    """
    if count <= 0:
        return iter(())
    if planned_through is None:
        return islice(plan_send_times(spec, count + plan_skip, plan_start), plan_skip, None)
    day = plan_day(spec, planned_through)
    if day <= plan_day(spec, plan_start):
        start = plan_start
    else:
        start = local_midnight(day, spec)
    # the local day of planned_through holds at most emails_per_day instants up to and including it
    times = plan_send_times(spec, count + spec.emails_per_day + plan_skip, start)
    return islice(dropwhile(lambda t: t <= planned_through, times), count)


_DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")


def describe_schedule(spec: PlanSpec) -> str:
    """The local send hours of ``spec`` for a person: windows (a window into the next day with
    ``+1``), the zone, the weekdays as ranges and the holiday calendar skipped, e.g.
    ``"09:00-12:00, 14:00-17:00 Europe/Berlin, Mon-Fri, DE-BY holidays skipped"``."""
    days = sorted(spec.weekdays)
    runs: list[list[int]] = []
    for d in days:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    named = ", ".join(_DAY_NAMES[r[0] - 1] if len(r) == 1 else f"{_DAY_NAMES[r[0] - 1]}-{_DAY_NAMES[r[-1] - 1]}"
                      for r in runs)
    text = f"{', '.join(str(w) for w in spec.windows)} {spec.timezone}, {named}"
    return f"{text}, {spec.holidays} holidays skipped" if spec.holidays else text


def holidays_skipped(spec: PlanSpec, first_day: date, last_day: date) -> int:
    """How many plan days in ``[first_day, last_day]`` (local dates, inclusive) sent nothing because
    they are public holidays of ``spec.holidays``: holidays on an allowed weekday (a holiday on a
    day that never sends is not counted). 0 without a holiday calendar or for an empty span."""
    if spec.holidays is None or last_day < first_day:
        return 0
    calendar = holiday_calendar(spec.holidays)
    n, day = 0, first_day
    while day <= last_day:
        if day.isoweekday() in spec.weekdays and day in calendar:
            n += 1
        day += _DAY
    return n
