"""Tests for mailflow.sources.scheduled.planning: literal UTC expectations (incl. DST days) plus hypothesis properties."""

from __future__ import annotations

import functools
import tracemalloc
from collections import Counter
from datetime import UTC, date, datetime, time, timedelta
from itertools import islice
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mailflow.sources.scheduled.planning import (
    PlanSpec,
    PlanSummary,
    Window,
    plan_day,
    plan_send_times,
    summarize,
)

ALL_DAYS = frozenset(range(1, 8))
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


def plan(count: int, start: datetime, **spec_kwargs: object) -> list[datetime]:
    return list(plan_send_times(PlanSpec(**spec_kwargs), count, start))  # type: ignore[arg-type]


def assert_sane(times: list[datetime], zone: ZoneInfo) -> None:
    """Strictly increasing UTC instants whose local wall time round-trips (i.e. exists)."""
    assert all(t.tzinfo is UTC for t in times)
    assert all(a < b for a, b in zip(times, times[1:], strict=False))
    for t in times:
        local = t.astimezone(zone)
        naive = local.replace(tzinfo=None)
        assert naive.replace(tzinfo=zone, fold=local.fold).astimezone(UTC) == t


# --- simple weekday, first-day rule, weekends -------------------------------------------------------


def test_simple_weekday_berlin_summer():
    # Tue 2026-06-02, CEST (UTC+2). 6 h of windows / 4 = 1h30 apart: 09:00 10:30 | 14:00 15:30 local.
    got = plan(8, datetime(2026, 6, 2, 0, 0, tzinfo=BERLIN), emails_per_day=4)
    assert got == [
        utc(2026, 6, 2, 7, 0),
        utc(2026, 6, 2, 8, 30),
        utc(2026, 6, 2, 12, 0),
        utc(2026, 6, 2, 13, 30),
        utc(2026, 6, 3, 7, 0),
        utc(2026, 6, 3, 8, 30),
        utc(2026, 6, 3, 12, 0),
        utc(2026, 6, 3, 13, 30),
    ]


def test_simple_weekday_berlin_winter_and_last_day_short():
    # Mon 2026-01-12, CET (UTC+1); 5 emails at 4/day -> Mon full, Tue one.
    got = plan(5, datetime(2026, 1, 12, 8, 0, tzinfo=BERLIN), emails_per_day=4)
    assert got == [
        utc(2026, 1, 12, 8, 0),
        utc(2026, 1, 12, 9, 30),
        utc(2026, 1, 12, 13, 0),
        utc(2026, 1, 12, 14, 30),
        utc(2026, 1, 13, 8, 0),
    ]


def test_first_day_start_inside_window_uses_remaining_time():
    # 10:00 local: remaining 10-12 (2h) + 14-17 (3h) = 5h, /4 = 1h15: 10:00 11:15 14:30 15:45 CEST.
    got = plan(4, datetime(2026, 6, 2, 10, 0, tzinfo=BERLIN), emails_per_day=4)
    assert got == [
        utc(2026, 6, 2, 8, 0),
        utc(2026, 6, 2, 9, 15),
        utc(2026, 6, 2, 12, 30),
        utc(2026, 6, 2, 13, 45),
    ]


def test_first_day_start_between_windows_and_after_windows():
    between = plan(4, datetime(2026, 6, 2, 13, 0, tzinfo=BERLIN), emails_per_day=4)
    assert between == [
        utc(2026, 6, 2, 12, 0),
        utc(2026, 6, 2, 12, 45),
        utc(2026, 6, 2, 13, 30),
        utc(2026, 6, 2, 14, 15),
    ]
    after = plan(1, datetime(2026, 6, 2, 17, 0, tzinfo=BERLIN), emails_per_day=4)
    assert after == [utc(2026, 6, 3, 7, 0)]


def test_first_day_with_less_than_n_microseconds_left_is_skipped():
    start = datetime(2026, 6, 2, 16, 59, 59, 999_998, tzinfo=BERLIN)  # 2 us left, 4 needed
    assert plan(1, start, emails_per_day=4) == [utc(2026, 6, 3, 7, 0)]
    assert plan(2, start, emails_per_day=2) == [
        utc(2026, 6, 2, 14, 59, 59, 999_998),
        utc(2026, 6, 2, 14, 59, 59, 999_999),
    ]


def test_weekend_skipped_friday_start_lands_fri_mon_tue():
    got = plan(6, datetime(2026, 6, 5, 8, 0, tzinfo=BERLIN), emails_per_day=2)  # Fri 2026-06-05
    assert got == [
        utc(2026, 6, 5, 7, 0),
        utc(2026, 6, 5, 12, 0),
        utc(2026, 6, 8, 7, 0),
        utc(2026, 6, 8, 12, 0),
        utc(2026, 6, 9, 7, 0),
        utc(2026, 6, 9, 12, 0),
    ]
    assert [t.astimezone(BERLIN).isoweekday() for t in got] == [5, 5, 1, 1, 2, 2]


def test_zero_count_and_start_is_inclusive():
    assert plan(0, utc(2026, 6, 2)) == []
    assert plan(1, utc(2026, 6, 2, 7, 0), emails_per_day=4) == [utc(2026, 6, 2, 7, 0)]


# --- DST: literal expectations ----------------------------------------------------------------------

DST_WINDOWS = (Window(time(1), time(4)), Window(time(9), time(17)))


@pytest.mark.parametrize(
    ("zone", "day", "per_day", "expected"),
    [
        # Berlin spring forward Sun 2026-03-29 01:00 UTC (02:00 CET -> 03:00 CEST). 01-04 local is
        # 00:00-02:00 UTC (2h), 09-17 CEST is 07:00-15:00 UTC (8h); 10 slots 1h apart. 01:00 UTC is the
        # jump instant (03:00 CEST); no 02:xx local is produced.
        (BERLIN, date(2026, 3, 29), 10, [utc(2026, 3, 29, h) for h in (0, 1, 7, 8, 9, 10, 11, 12, 13, 14)]),
        # Berlin fall back Sun 2026-10-25 01:00 UTC (03:00 CEST -> 02:00 CET). 01-04 local is
        # 23:00(24th)-03:00 UTC (4h, both passes of 02:xx), 09-17 CET is 08:00-16:00 UTC; 12 slots 1h apart.
        (
            BERLIN,
            date(2026, 10, 25),
            12,
            [utc(2026, 10, 24, 23)] + [utc(2026, 10, 25, h) for h in (0, 1, 2, 8, 9, 10, 11, 12, 13, 14, 15)],
        ),
        # New York spring forward Sun 2026-03-08 07:00 UTC (02:00 EST -> 03:00 EDT). 01-04 local is
        # 06:00-08:00 UTC, 09-17 EDT is 13:00-21:00 UTC.
        (
            NEW_YORK,
            date(2026, 3, 8),
            10,
            [utc(2026, 3, 8, h) for h in (6, 7, 13, 14, 15, 16, 17, 18, 19, 20)],
        ),
        # New York fall back Sun 2026-11-01 06:00 UTC (02:00 EDT -> 01:00 EST). 01-04 local is
        # 05:00-09:00 UTC, 09-17 EST is 14:00-22:00 UTC.
        (
            NEW_YORK,
            date(2026, 11, 1),
            12,
            [utc(2026, 11, 1, h) for h in (5, 6, 7, 8, 14, 15, 16, 17, 18, 19, 20, 21)],
        ),
    ],
    ids=["berlin-spring", "berlin-fall", "newyork-spring", "newyork-fall"],
)
def test_dst_days_exact(zone: ZoneInfo, day: date, per_day: int, expected: list[datetime]):
    spec = PlanSpec(timezone=zone.key, emails_per_day=per_day, weekdays=ALL_DAYS, windows=DST_WINDOWS)
    start = datetime.combine(day, time(0), tzinfo=zone)
    got = list(plan_send_times(spec, per_day, start))
    assert got == expected
    assert_sane(got, zone)
    assert Counter(t.astimezone(zone).date() for t in got) == {day: per_day}
    assert len(set(got)) == per_day


def test_dst_local_wall_times_berlin():
    spec = PlanSpec(
        timezone="Europe/Berlin", emails_per_day=4, weekdays=ALL_DAYS, windows=(Window.parse("01:00-04:00"),)
    )
    spring = [t.astimezone(BERLIN) for t in plan_send_times(spec, 4, datetime(2026, 3, 29, tzinfo=BERLIN))]
    # 2h real over 01:00 CET .. 04:00 CEST: 30 min apart; 02:30 local never appears (it does not exist).
    assert [(t.strftime("%H:%M"), t.tzname()) for t in spring] == [
        ("01:00", "CET"),
        ("01:30", "CET"),
        ("03:00", "CEST"),
        ("03:30", "CEST"),
    ]
    fall = [t.astimezone(BERLIN) for t in plan_send_times(spec, 4, datetime(2026, 10, 25, tzinfo=BERLIN))]
    assert [(t.strftime("%H:%M"), t.tzname()) for t in fall] == [
        ("01:00", "CEST"),
        ("02:00", "CEST"),
        ("02:00", "CET"),
        ("03:00", "CET"),
    ]


def test_nonexistent_bound_resolves_to_jump_instant():
    # 02:00-03:30 Berlin: Sat 2026-03-28 (CET) is 01:00-02:30 UTC; Sun 29th only 03:00-03:30 CEST exists.
    spec = PlanSpec(
        timezone="Europe/Berlin", emails_per_day=3, weekdays=ALL_DAYS, windows=(Window.parse("02:00-03:30"),)
    )
    got = list(plan_send_times(spec, 6, datetime(2026, 3, 28, tzinfo=BERLIN)))
    assert got == [
        utc(2026, 3, 28, 1, 0),
        utc(2026, 3, 28, 1, 30),
        utc(2026, 3, 28, 2, 0),
        utc(2026, 3, 29, 1, 0),
        utc(2026, 3, 29, 1, 10),
        utc(2026, 3, 29, 1, 20),
    ]


def test_window_inside_gap_skips_that_day():
    spec = PlanSpec(
        timezone="Europe/Berlin", emails_per_day=1, weekdays=ALL_DAYS, windows=(Window.parse("02:00-02:30"),)
    )
    got = list(plan_send_times(spec, 2, datetime(2026, 3, 28, 12, 0, tzinfo=BERLIN)))
    assert got == [utc(2026, 3, 30, 0, 0), utc(2026, 3, 31, 0, 0)]  # 29th has no 02:xx; 30th is CEST


def test_window_inside_repeated_hour_uses_both_passes_only():
    # 02:15-02:45 on Berlin 2026-10-25: 00:15-00:45 UTC (CEST pass) and 01:15-01:45 UTC (CET pass), 1h total.
    spec = PlanSpec(
        timezone="Europe/Berlin", emails_per_day=4, weekdays=ALL_DAYS, windows=(Window.parse("02:15-02:45"),)
    )
    got = list(plan_send_times(spec, 4, datetime(2026, 10, 25, tzinfo=BERLIN)))
    assert got == [
        utc(2026, 10, 25, 0, 15),
        utc(2026, 10, 25, 0, 30),
        utc(2026, 10, 25, 1, 15),
        utc(2026, 10, 25, 1, 30),
    ]


def test_adjacent_windows_split_inside_repeated_hour_do_not_overlap():
    # Bounds inside the repeated hour: each window gets its own wall-time preimage, never an instant twice.
    windows = (Window.parse("01:00-02:30"), Window.parse("02:30-04:00"))
    spec = PlanSpec(timezone="Europe/Berlin", emails_per_day=8, weekdays=ALL_DAYS, windows=windows)
    got = list(plan_send_times(spec, 8, datetime(2026, 10, 25, tzinfo=BERLIN)))
    assert len(got) == 8 and len(set(got)) == 8
    assert_sane(got, BERLIN)
    local = [(t.astimezone(BERLIN).strftime("%H:%M"), t.astimezone(BERLIN).tzname()) for t in got]
    assert local == [
        ("01:00", "CEST"),
        ("01:30", "CEST"),
        ("02:00", "CEST"),
        ("02:30", "CEST"),
        ("02:00", "CET"),
        ("02:30", "CET"),
        ("03:00", "CET"),
        ("03:30", "CET"),
    ]
    # 4h real time in total -> 30 min apart from 01:00 CEST.
    assert got == [utc(2026, 10, 24, 23, 0) + timedelta(minutes=30 * k) for k in range(8)]


@pytest.mark.parametrize(
    ("zone_key", "day", "window", "expected_local"),
    [
        # Lord Howe falls back 30 min: 02:00 +11 -> 01:30 +10:30 at 15:00 UTC. 01-03 local = 14:00-16:30 UTC.
        (
            "Australia/Lord_Howe",
            date(2026, 4, 5),
            "01:00-03:00",
            ["01:00+11:00", "01:30+11:00", "01:30+10:30", "02:00+10:30", "02:30+10:30"],
        ),
        # Lord Howe springs forward 30 min at 15:30 UTC (02:00 +10:30 -> 02:30 +11), off the hourly grid.
        # 01:00-02:15: the end bound does not exist and resolves to the jump instant -> 14:30-15:30 UTC.
        (
            "Australia/Lord_Howe",
            date(2026, 10, 4),
            "01:00-02:15",
            ["01:00+10:30", "01:15+10:30", "01:30+10:30", "01:45+10:30"],
        ),
        # St. John's (-3:30/-2:30) springs forward at 05:30 UTC: 01-04 local = 04:30-06:30 UTC.
        (
            "America/St_Johns",
            date(2026, 3, 8),
            "01:00-04:00",
            ["01:00-03:30", "01:30-03:30", "03:00-02:30", "03:30-02:30"],
        ),
        # ... and falls back at 04:30 UTC (02:00 NDT -> 01:00 NST): 01-04 local = 03:30-07:30 UTC.
        (
            "America/St_Johns",
            date(2026, 11, 1),
            "01:00-04:00",
            ["01:00-02:30", "01:00-03:30", "02:00-03:30", "03:00-03:30"],
        ),
    ],
    ids=["lord-howe-fall", "lord-howe-spring", "st-johns-spring", "st-johns-fall"],
)
def test_dst_half_hour_zones(zone_key: str, day: date, window: str, expected_local: list[str]):
    zone = ZoneInfo(zone_key)
    n = len(expected_local)
    spec = PlanSpec(timezone=zone_key, emails_per_day=n, weekdays=ALL_DAYS, windows=(Window.parse(window),))
    got = list(plan_send_times(spec, n, datetime.combine(day, time(0), tzinfo=zone)))
    assert [t.astimezone(zone).isoformat(timespec="minutes")[11:] for t in got] == expected_local
    assert {t.astimezone(zone).date() for t in got} == {day}
    assert_sane(got, zone)


def test_date_line_jumps():
    # Samoa skipped Fri 2011-12-30 entirely (-10 -> +14): that local day has no window time and is skipped.
    apia = ZoneInfo("Pacific/Apia")
    spec = PlanSpec(
        timezone="Pacific/Apia", emails_per_day=1, weekdays=ALL_DAYS, windows=(Window.parse("09:00-17:00"),)
    )
    got = list(plan_send_times(spec, 2, datetime(2011, 12, 29, tzinfo=apia)))
    assert got == [utc(2011, 12, 29, 19, 0), utc(2011, 12, 30, 19, 0)]  # 29th 09:00 -10, 31st 09:00 +14
    # Alaska moved back a whole day in 1867 (+15:02:19 -> -08:57:41 at 00:31:13 UTC on 10-19): local
    # 10-18 and 10-19 both occur twice. The floor rule keeps the output strictly increasing; 10-19 slots
    # all come from the second occurrence, after 10-18's last slot (which is in 10-18's second pass).
    juneau = ZoneInfo("America/Juneau")
    spec = PlanSpec(
        timezone="America/Juneau", emails_per_day=7, weekdays=ALL_DAYS, windows=(Window.parse("09:00-17:00"),)
    )
    got = list(plan_send_times(spec, 14, datetime(1867, 10, 18, tzinfo=juneau)))
    assert_sane(got, juneau)
    assert Counter(t.astimezone(juneau).date() for t in got) == {date(1867, 10, 18): 7, date(1867, 10, 19): 7}
    assert got[6] > utc(1867, 10, 19, 0, 31, 13)  # 10-18's last slot is in its second pass
    assert got[7] == utc(1867, 10, 19, 17, 57, 41)  # 10-19 09:00 -08:57:41


# --- streaming, determinism, summary ----------------------------------------------------------------


def test_streams_lazily_and_handles_100k():
    huge = plan_send_times(PlanSpec(), 10**12, utc(2026, 1, 1))
    assert next(huge) == utc(2026, 1, 1, 8, 0)  # a list of 10**12 items could never be built
    tracemalloc.start()
    try:
        n = sum(1 for _ in plan_send_times(PlanSpec(), 100_000, utc(2026, 1, 1)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 100_000
    assert peak < 200_000  # bytes: one day's slots, not 100k datetimes (~4.8 MB as a list)


def test_errors_are_raised_eagerly():
    with pytest.raises(ValueError, match="start must be a timezone-aware datetime"):
        plan_send_times(PlanSpec(), 1, datetime(2026, 1, 1))
    with pytest.raises(ValueError, match=r"count must be an int >= 0, got -1"):
        plan_send_times(PlanSpec(), -1, utc(2026, 1, 1))


def test_summarize_local_dates():
    times = plan(6, datetime(2026, 6, 5, 8, 0, tzinfo=BERLIN), emails_per_day=2)
    assert summarize(times, "Europe/Berlin") == PlanSummary(
        first=utc(2026, 6, 5, 7, 0),
        last=utc(2026, 6, 9, 12, 0),
        emails_per_day={date(2026, 6, 5): 2, date(2026, 6, 8): 2, date(2026, 6, 9): 2},
        days_spanned=5,
        total=6,
    )
    # Local dates depend on the zone: 23:30 UTC is the next day in Berlin.
    assert summarize(iter([utc(2026, 6, 5, 23, 30)]), "UTC").emails_per_day == {date(2026, 6, 5): 1}
    assert summarize(iter([utc(2026, 6, 5, 23, 30)]), "Europe/Berlin").emails_per_day == {date(2026, 6, 6): 1}
    assert summarize([], "UTC") == PlanSummary(None, None, {}, 0, 0)


# --- validation -------------------------------------------------------------------------------------


def test_validation_errors():
    with pytest.raises(ValueError, match=r"unknown IANA timezone 'Mars/Olympus_Mons'"):
        PlanSpec(timezone="Mars/Olympus_Mons")
    with pytest.raises(ValueError, match=r"unknown IANA timezone"):
        summarize([], "Not/AZone")
    with pytest.raises(ValueError, match=r"windows 09:00-12:00 and 11:00-13:00 overlap"):
        PlanSpec(windows=(Window.parse("11:00-13:00"), Window.parse("09:00-12:00")))
    with pytest.raises(ValueError, match=r"invalid window 09:00-09:00: start equals end"):
        Window(time(9), time(9))
    with pytest.raises(ValueError, match=r"invalid window '09:00-09:00': start equals end"):
        Window.parse("09:00-09:00")
    with pytest.raises(ValueError, match=r"invalid window '24:00-01:00': not a valid time of day"):
        Window.parse("24:00-01:00")
    with pytest.raises(ValueError, match=r"invalid window '22:00-24:30': not a valid time of day"):
        Window.parse("22:00-24:30")
    with pytest.raises(ValueError, match=r"windows 23:00-01:00\+1 and 00:30-09:00 overlap \(the first runs past midnight"):
        PlanSpec(windows=("23:00-01:00", "00:30-09:00"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"windows 20:00-02:00\+1 and 22:00-23:00 overlap"):
        PlanSpec(windows=("22:00-23:00", "20:00-02:00"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"invalid window '9-12': expected 'HH:MM-HH:MM'"):
        Window.parse("9-12")
    with pytest.raises(ValueError, match=r"invalid window '25:00-26:00': not a valid time of day"):
        Window.parse("25:00-26:00")
    with pytest.raises(ValueError, match=r"emails_per_day must be >= 1, got 0"):
        PlanSpec(emails_per_day=0)
    with pytest.raises(ValueError, match=r"weekdays must contain at least one"):
        PlanSpec(weekdays=frozenset())
    with pytest.raises(
        ValueError, match=r"weekdays must be ISO weekday numbers 1\.\.7 \(1=Monday\), got \[0\]"
    ):
        PlanSpec(weekdays=frozenset({0, 1}))
    with pytest.raises(ValueError, match=r"windows must contain at least one window"):
        PlanSpec(windows=())


def test_spec_normalises_and_allows_touching_windows():
    spec = PlanSpec(windows=("12:00-13:00", "09:00-12:00"), weekdays=[1, 2])  # type: ignore[arg-type]
    assert spec.windows == (Window(time(9), time(12)), Window(time(12), time(13)))
    assert spec.weekdays == frozenset({1, 2})
    assert str(Window.parse("9:05-17:30:15")) == "09:05-17:30:15"


# --- properties -------------------------------------------------------------------------------------

ZONES = [
    "UTC",
    "Europe/Berlin",
    "Europe/London",
    "America/New_York",
    "America/Los_Angeles",
    "America/St_Johns",
    "America/Santiago",
    "America/Havana",
    "Africa/Cairo",
    "Asia/Kolkata",
    "Asia/Kathmandu",
    "Asia/Tokyo",
    "Australia/Sydney",
    "Australia/Lord_Howe",
    "Pacific/Chatham",
    "Pacific/Auckland",
]


@functools.cache
def transition_days(zone_key: str) -> list[date]:
    """UTC dates in 2026-2027 on which the zone's UTC offset changes (test-side, by daily sampling)."""
    zone, days = ZoneInfo(zone_key), []
    d = date(2026, 1, 1)
    while d < date(2028, 1, 1):
        if (
            utc(d.year, d.month, d.day).astimezone(zone).utcoffset()
            != (utc(d.year, d.month, d.day) + timedelta(days=1)).astimezone(zone).utcoffset()
        ):
            days.append(d)
        d += timedelta(days=1)
    return days


@st.composite
def windows_strategy(draw: st.DrawFn) -> tuple[Window, ...]:
    n = draw(st.integers(1, 3))
    # Minute marks, biased to quarter hours in 00:00-04:00 and to 22:00-24:00, where DST changes happen.
    marks = draw(
        st.lists(
            st.integers(0, 1439) | st.integers(0, 4 * 4).map(lambda q: 15 * q) | st.integers(1320, 1439),
            min_size=2 * n,
            max_size=2 * n,
            unique=True,
        )
    )
    marks.sort()
    if draw(st.booleans()):  # half the examples: the last window ends at 24:00 or crosses midnight,
        # its tail ending at or before the (new) first window's start
        marks = [*marks[1:], 1440 + draw(st.integers(0, marks[0]))]
    return tuple(
        Window(time(a // 60, a % 60), time(b % 1440 // 60, b % 60))
        for a, b in zip(marks[::2], marks[1::2], strict=True)
    )


@st.composite
def spec_and_start(draw: st.DrawFn) -> tuple[PlanSpec, datetime]:
    zone = draw(st.sampled_from(ZONES))
    spec = PlanSpec(
        timezone=zone,
        emails_per_day=draw(st.integers(1, 50)),
        weekdays=frozenset(draw(st.lists(st.integers(1, 7), min_size=1, max_size=7))),
        windows=draw(windows_strategy()),
    )
    near_dst = transition_days(zone)
    if near_dst and draw(st.booleans()):  # half the examples start 0-2 days before a DST change
        day = draw(st.sampled_from(near_dst)) - timedelta(days=draw(st.integers(0, 2)))
    else:
        day = draw(st.dates(date(2026, 1, 1), date(2027, 12, 31)))
    minute = draw(st.integers(0, 1439))
    start = datetime.combine(day, time(minute // 60, minute % 60), tzinfo=ZoneInfo(zone)).astimezone(UTC)
    return spec, start


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_and_start(), st.integers(0, 500))
def test_properties(spec_start: tuple[PlanSpec, datetime], count: int):
    spec, start = spec_start
    zone = ZoneInfo(spec.timezone)
    times = list(plan_send_times(spec, count, start))
    assert len(times) == count
    assert times == list(plan_send_times(spec, count, start))  # deterministic
    assert_sane(times, zone)  # UTC, strictly increasing, wall times exist
    assert all(t >= start for t in times)
    per_day: Counter[date] = Counter()
    for t in times:
        local = t.astimezone(zone)
        day = plan_day(spec, t)
        assert day.isoweekday() in spec.weekdays, (local, spec)
        naive = local.replace(tzinfo=None, fold=0)
        assert any(a <= naive < b for a, b in (w.bounds(day) for w in spec.windows)), (local, spec)
        per_day[day] += 1
    days = sorted(per_day)
    assert all(per_day[d] == spec.emails_per_day for d in days[:-1])
    if days:
        assert 1 <= per_day[days[-1]] <= spec.emails_per_day
    assert summarize(times, spec.timezone, day_start=spec.day_start).emails_per_day == dict(sorted(per_day.items()))


@settings(max_examples=100, deadline=None)
@given(spec_and_start(), st.integers(0, 60), st.integers(0, 60))
def test_prefix_stable(spec_start: tuple[PlanSpec, datetime], a: int, b: int):
    # Recipient i's time does not depend on how many recipients follow.
    spec, start = spec_start
    short, long = sorted((a, b))
    assert list(plan_send_times(spec, short, start)) == list(
        islice(plan_send_times(spec, long, start), short)
    )


# --- windows that end at 24:00 or cross midnight ----------------------------------------------------


def test_window_to_24_00_and_across_midnight_parse_and_print():
    assert Window.parse("22:00-24:00") == Window(time(22), time(0))
    assert str(Window.parse("22:00-24:00")) == "22:00-24:00"
    # a window into the next day prints with +1 (the definition's spelling) and parses back
    assert str(Window.parse("23:00-01:00")) == "23:00-01:00+1"
    assert Window.parse("23:00-01:00+1") == Window(time(23), time(1))
    with pytest.raises(ValueError, match=r"invalid window '09:00-17:00\+1': \+1 says it ends the next day"):
        Window.parse("09:00-17:00+1")
    assert str(Window.parse("00:00-24:00")) == "00:00-24:00"
    assert Window.parse("23:00-01:00").length == timedelta(hours=2)
    assert Window.parse("00:00-24:00").length == timedelta(hours=24)
    assert Window.parse("23:00-01:00").bounds(date(2026, 6, 2)) == (datetime(2026, 6, 2, 23), datetime(2026, 6, 3, 1))
    # touching across midnight is fine; the plan day starts where the crossing window ends
    spec = PlanSpec(windows=("01:00-09:00", "23:00-01:00"))  # type: ignore[arg-type]
    assert spec.day_start == time(1)
    assert PlanSpec(windows=("22:00-24:00",)).day_start == time(0)  # type: ignore[arg-type]
    assert PlanSpec().day_start == time(0)


def test_22_to_24_has_no_gap_and_whole_second_times():
    # The old workaround 22:00-23:59:59 left a gap and fractional seconds; 22:00-24:00 spreads 2 h evenly.
    got = plan(4, datetime(2026, 6, 2, 12, tzinfo=UTC), timezone="UTC", emails_per_day=4,
               weekdays=ALL_DAYS, windows=("22:00-24:00",))
    assert got == [utc(2026, 6, 2, 22, 0), utc(2026, 6, 2, 22, 30), utc(2026, 6, 2, 23, 0), utc(2026, 6, 2, 23, 30)]


def test_window_crossing_midnight_belongs_to_its_opening_weekday():
    # Fri 2026-06-05 and Sat allowed only: Friday's 23:00-01:00 runs into Saturday, Saturday's into Sunday;
    # nothing opens on Sunday, and the next plan day is the following Friday.
    got = plan(6, datetime(2026, 6, 5, 12, tzinfo=UTC), timezone="UTC", emails_per_day=2,
               weekdays=frozenset({5, 6}), windows=("23:00-01:00",))
    assert got == [
        utc(2026, 6, 5, 23), utc(2026, 6, 6, 0),
        utc(2026, 6, 6, 23), utc(2026, 6, 7, 0),
        utc(2026, 6, 12, 23), utc(2026, 6, 13, 0),
    ]
    spec = PlanSpec(timezone="UTC", weekdays=frozenset({5, 6}), windows=("23:00-01:00",))  # type: ignore[arg-type]
    assert [plan_day(spec, t) for t in got[:2]] == [date(2026, 6, 5), date(2026, 6, 5)]
    assert summarize(got, "UTC", day_start=spec.day_start).emails_per_day == {
        date(2026, 6, 5): 2, date(2026, 6, 6): 2, date(2026, 6, 12): 2}


def test_start_inside_the_tail_of_yesterdays_window_uses_what_remains():
    # 00:30 on Wed is in Tuesday's 23:00-01:00: its 2 slots go into the remaining 30 min; Wednesday has
    # 1 h + 2 h of windows, so its 2 slots are 1 h 30 min apart in eligible time: 09:00 and 23:30.
    got = plan(4, utc(2026, 6, 3, 0, 30), timezone="UTC", emails_per_day=2, weekdays=ALL_DAYS,
               windows=("09:00-10:00", "23:00-01:00"))
    assert got == [utc(2026, 6, 3, 0, 30), utc(2026, 6, 3, 0, 45), utc(2026, 6, 3, 9, 0), utc(2026, 6, 3, 23, 30)]


MIDNIGHT_DST_CASES = {
    # Berlin fall back (Sun 2026-10-25 03:00 CEST -> 02:00 CET): Saturday's 23:00-03:30 is 5.5 h real time.
    "berlin-fall-back": ("Europe/Berlin", "23:00-03:30", 11, date(2026, 10, 24),
                         [utc(2026, 10, 24, 21) + timedelta(minutes=30 * k) for k in range(11)]),
    # Berlin spring forward (Sun 2026-03-29 02:00 CET -> 03:00 CEST): Saturday's 22:00-04:00 is 5 h.
    "berlin-spring-forward": ("Europe/Berlin", "22:00-04:00", 5, date(2026, 3, 28),
                              [utc(2026, 3, 28, 21), utc(2026, 3, 28, 22), utc(2026, 3, 28, 23),
                               utc(2026, 3, 29, 0), utc(2026, 3, 29, 1)]),
    # New York fall back (Sun 2026-11-01 02:00 EDT -> 01:00 EST): 23:00 EDT to 02:30 EST is 4.5 h.
    "new-york-fall-back": ("America/New_York", "23:00-02:30", 9, date(2026, 10, 31),
                           [utc(2026, 11, 1, 3) + timedelta(minutes=30 * k) for k in range(9)]),
    # Santiago ends DST at midnight (Sun 2026-04-05 00:00 -03 -> Sat 23:00 -04): 22:00-24:00 is 3 h,
    # 24:00 being the end of the repeated hour.
    "santiago-midnight-fall-back": ("America/Santiago", "22:00-24:00", 3, date(2026, 4, 4),
                                    [utc(2026, 4, 5, 1), utc(2026, 4, 5, 2), utc(2026, 4, 5, 3)]),
    # Santiago starts DST at midnight (Sun 2026-09-06 00:00 -04 -> 01:00 -03): 24:00 does not exist and
    # resolves to the jump instant, so 22:00-24:00 is 2 h.
    "santiago-midnight-spring-forward": ("America/Santiago", "22:00-24:00", 3, date(2026, 9, 5),
                                         [utc(2026, 9, 6, 2), utc(2026, 9, 6, 2, 40), utc(2026, 9, 6, 3, 20)]),
    # Havana starts DST at midnight (Sun 2026-03-08 00:00 CST -> 01:00 CDT).
    "havana-midnight-spring-forward": ("America/Havana", "22:00-24:00", 2, date(2026, 3, 7),
                                       [utc(2026, 3, 8, 3), utc(2026, 3, 8, 4)]),
}


@pytest.mark.parametrize("case", sorted(MIDNIGHT_DST_CASES))
def test_midnight_windows_on_dst_days_exact(case: str):
    zone_key, window, per_day, day, expected = MIDNIGHT_DST_CASES[case]
    zone = ZoneInfo(zone_key)
    got = plan(per_day, datetime.combine(day, time(12), tzinfo=zone), timezone=zone_key,
               emails_per_day=per_day, weekdays=ALL_DAYS, windows=(window,))
    assert got == expected
    spec = PlanSpec(timezone=zone_key, weekdays=ALL_DAYS, windows=(window,))  # type: ignore[arg-type]
    assert {plan_day(spec, t) for t in got} == {day}
    assert summarize(got, zone_key, day_start=spec.day_start).emails_per_day == {day: per_day}


def test_plan_after_continues_across_midnight_like_one_plan():
    from mailflow.sources.scheduled import plan_after

    spec = PlanSpec(timezone="Europe/Berlin", emails_per_day=7, weekdays=ALL_DAYS,
                    windows=("09:00-10:00", "23:00-03:30"))  # type: ignore[arg-type]
    start = datetime(2026, 10, 23, 8, tzinfo=BERLIN)
    whole = list(plan_send_times(spec, 40, start))
    for cut in (3, 5, 6, 7, 12, 20):  # planned_through inside the tail, at a day's last slot, ...
        assert list(plan_after(spec, start, 0, whole[cut - 1], 40 - cut)) == whole[cut:], cut
